//! Smooth activations, any shape: SiLU and GELU.
//!
//! SiLU(x) = x·σ(x). GELU uses the tanh approximation (as GPT-2 and llm.c
//! do): GELU(x) ≈ ½·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))); the exact
//! erf form differs by less than 1e-3.
//!
//! Unlike ReLU, the derivative is not a function of the output alone, so a
//! training forward saves its INPUT (a reference-counted handle to the
//! previous layer's output, no copy); backward recomputes the derivative
//! from it elementwise.

use super::relu::{par_build, PAR_CHUNK};
use crate::layers::vector_math::{self, map_into, zip_into};
use crate::{Layer, Mode, ModelError, Result, Tensor};

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_CUBIC: f32 = 0.044_715;

/// σ(x) and 1 − σ(x), each without cancellation: with e = e^{−x},
/// σ = 1/(1 + e) and 1 − σ = e·σ.
#[inline(always)]
fn sigmoid_pair(x: f32) -> (f32, f32) {
    let e = vector_math::exp(-x);
    let s = 1.0 / (1.0 + e);
    (s, e * s)
}

#[inline(always)]
fn silu(x: f32) -> f32 {
    x * vector_math::sigmoid(x)
}

#[inline(always)]
fn silu_derivative(x: f32) -> f32 {
    let (s, one_minus_s) = sigmoid_pair(x);
    s * (1.0 + x * one_minus_s)
}

/// √(2/π)·(x + 0.044715·x³) and its derivative in x.
#[inline(always)]
fn gelu_inner(x: f32) -> (f32, f32) {
    let u = SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x);
    let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * x * x);
    (u, du)
}

// ½(1 + tanh u) = σ(2u), so GELU(x) = x·σ(2u) and, with 1 − tanh² u =
// 4σ(2u)(1 − σ(2u)), GELU'(x) = σ(2u) + 2x·σ(2u)(1 − σ(2u))·u'. Written
// with σ, both tails keep their precision (1 ± tanh would cancel).
#[inline(always)]
fn gelu(x: f32) -> f32 {
    let (u, _) = gelu_inner(x);
    x * vector_math::sigmoid(2.0 * u)
}

#[inline(always)]
fn gelu_derivative(x: f32) -> f32 {
    let (u, du) = gelu_inner(x);
    let (s, one_minus_s) = sigmoid_pair(2.0 * u);
    s + 2.0 * x * s * one_minus_s * du
}

/// An elementwise activation given by its function and derivative
/// (monomorphised into vectorised loops by `elementwise_layer!`); saves its
/// input for backward.
struct Elementwise {
    name: &'static str,
    saved_input: Option<Tensor>,
}

impl Elementwise {
    fn forward(
        &mut self,
        input: &Tensor,
        mode: Mode,
        f: impl Fn(f32) -> f32 + Copy + Sync,
    ) -> Result<Tensor> {
        self.saved_input = None;
        let x = input.data();
        // SAFETY: map_into writes every element of each chunk.
        let out = unsafe {
            par_build(input.shape(), PAR_CHUNK, |offset, out| {
                map_into(&x[offset..offset + out.len()], out, f)
            })?
        };
        self.saved_input = (mode == Mode::Train).then(|| input.clone());
        Ok(out)
    }

    fn backward(
        &mut self,
        grad_output: &Tensor,
        derivative: impl Fn(f32) -> f32 + Copy + Sync,
    ) -> Result<Tensor> {
        let x = self
            .saved_input
            .take()
            .ok_or(ModelError::NoSavedActivation { op: self.name })?;
        grad_output.expect_shape(self.name, x.shape())?;
        let (g, x) = (grad_output.data(), x.data());
        // SAFETY: zip_into writes every element of each chunk.
        unsafe {
            par_build(grad_output.shape(), PAR_CHUNK, |offset, out| {
                let range = offset..offset + out.len();
                zip_into(&g[range.clone()], &x[range], out, |g, x| g * derivative(x))
            })
        }
    }
}

macro_rules! elementwise_layer {
    ($ty:ident, $name:literal, $f:expr, $d:expr, $cuda:expr) => {
        pub struct $ty(Elementwise);

        impl $ty {
            pub fn new() -> Self {
                Self(Elementwise {
                    name: $name,
                    saved_input: None,
                })
            }
        }

        impl Default for $ty {
            fn default() -> Self {
                Self::new()
            }
        }

        impl Layer for $ty {
            cuda_form!(value $cuda);

            fn describe(&self) -> String {
                $name.into()
            }

            fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
                Ok(input.to_vec())
            }

            fn macs(&self, _input: &[usize]) -> Result<u64> {
                Ok(0)
            }

            fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
                self.0.forward(input, mode, $f)
            }

            fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
                self.0.backward(grad_output, $d)
            }

            fn clear_saved(&mut self) {
                self.0.saved_input = None;
            }
        }
    };
}

elementwise_layer!(
    Silu,
    "silu",
    silu,
    silu_derivative,
    crate::ops::activation::layer::SmoothLayer(crate::cuda::ops::Smooth::Silu)
);
elementwise_layer!(
    Gelu,
    "gelu",
    gelu,
    gelu_derivative,
    crate::ops::activation::layer::SmoothLayer(crate::cuda::ops::Smooth::Gelu)
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_layer, random_tensor};

    #[test]
    fn silu_and_gelu_match_their_formulas() {
        let x = Tensor::from_vec(&[1, 4], vec![-2.0, -0.5, 0.0, 1.5]).unwrap();
        let y = Silu::new().forward(&x, Mode::Eval).unwrap();
        for (&x, &y) in x.data().iter().zip(y.data()) {
            let expected = x as f64 / (1.0 + (-x as f64).exp());
            assert!((y as f64 - expected).abs() < 1e-6, "silu({x}) = {y}");
        }
        // Reference values of the tanh approximation.
        let y = Gelu::new().forward(&x, Mode::Eval).unwrap();
        let expected = [-0.045_402_3, -0.154_285_8, 0.0, 1.399_571_6];
        for (&y, &e) in y.data().iter().zip(&expected) {
            assert!((y - e).abs() < 1e-5, "gelu: {y} vs {e}");
        }
    }

    /// Against the formulas in f64 over both tails, where 1 ± tanh would
    /// cancel: within 3e-7 absolute plus 1e-6 relative.
    #[test]
    fn values_and_derivatives_match_f64_in_both_tails() {
        let sigmoid = |x: f64| 1.0 / (1.0 + (-x).exp());
        let silu_64 = |x: f64| (x * sigmoid(x), sigmoid(x) * (1.0 + x * (1.0 - sigmoid(x))));
        let gelu_64 = |x: f64| {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            let u = c * (x + 0.044715 * x * x * x);
            let du = c * (1.0 + 3.0 * 0.044715 * x * x);
            let t = u.tanh();
            (
                0.5 * x * (1.0 + t),
                0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du,
            )
        };
        let close = |got: f32, want: f64| (got as f64 - want).abs() <= 3e-7 + 1e-6 * want.abs();
        for i in -12_000..=12_000 {
            let x = i as f32 * 1e-3;
            let (s, ds) = silu_64(x as f64);
            let (g, dg) = gelu_64(x as f64);
            assert!(
                close(silu(x), s) && close(silu_derivative(x), ds),
                "silu at {x}"
            );
            assert!(
                close(gelu(x), g) && close(gelu_derivative(x), dg),
                "gelu at {x}"
            );
        }
    }

    #[test]
    fn silu_gradient_matches_finite_differences() {
        let report = check_layer(
            &mut Silu::new(),
            &random_tensor(&[3, 2, 2, 5], 1),
            1e-2,
            1e-3,
        );
        assert!(report.is_ok(), "{}", report.unwrap_err());
    }

    #[test]
    fn gelu_gradient_matches_finite_differences() {
        let report = check_layer(&mut Gelu::new(), &random_tensor(&[4, 3, 7], 2), 1e-2, 1e-3);
        assert!(report.is_ok(), "{}", report.unwrap_err());
    }

    #[test]
    fn saves_the_input_without_copying_and_only_in_training() {
        let x = random_tensor(&[2, 8], 3);
        let mut silu = Silu::new();
        silu.forward(&x, Mode::Train).unwrap();
        let saved = silu.0.saved_input.as_ref().unwrap();
        assert_eq!(saved.data().as_ptr(), x.data().as_ptr());
        silu.forward(&x, Mode::Eval).unwrap();
        assert!(matches!(
            silu.backward(&x),
            Err(ModelError::NoSavedActivation { op: "silu" })
        ));
    }
}
