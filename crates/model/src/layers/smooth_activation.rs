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

use super::activation::{par_map, par_zip_map};
use crate::{Layer, Mode, ModelError, Result, Tensor};

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_CUBIC: f32 = 0.044_715;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

fn silu_derivative(x: f32) -> f32 {
    let s = sigmoid(x);
    s * (1.0 + x * (1.0 - s))
}

fn gelu(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x);
    0.5 * x * (1.0 + u.tanh())
}

fn gelu_derivative(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x);
    let t = u.tanh();
    let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * x * x);
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du
}

/// An elementwise activation given by its function and derivative; saves its
/// input for backward.
struct Elementwise {
    name: &'static str,
    f: fn(f32) -> f32,
    derivative: fn(f32) -> f32,
    saved_input: Option<Tensor>,
}

impl Elementwise {
    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        self.saved_input = None;
        let out = par_map(input.shape(), input.data(), self.f)?;
        self.saved_input = (mode == Mode::Train).then(|| input.clone());
        Ok(out)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let x = self
            .saved_input
            .take()
            .ok_or(ModelError::NoSavedActivation { op: self.name })?;
        grad_output.expect_shape(self.name, x.shape())?;
        let derivative = self.derivative;
        par_zip_map(x.shape(), grad_output.data(), x.data(), |g, x| {
            g * derivative(x)
        })
    }
}

macro_rules! elementwise_layer {
    ($ty:ident, $name:literal, $f:expr, $d:expr) => {
        pub struct $ty(Elementwise);

        impl $ty {
            pub fn new() -> Self {
                Self(Elementwise {
                    name: $name,
                    f: $f,
                    derivative: $d,
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
                self.0.forward(input, mode)
            }

            fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
                self.0.backward(grad_output)
            }

            fn clear_saved(&mut self) {
                self.0.saved_input = None;
            }
        }
    };
}

elementwise_layer!(Silu, "silu", silu, silu_derivative);
elementwise_layer!(Gelu, "gelu", gelu, gelu_derivative);

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
