//! Fully connected layer: [N, in] -> [N, out], y = x·W + b.
//!
//! The weight is stored [in, out] so the forward is one row-major GEMM.
//! A training forward saves its input (a reference-counted handle, no copy);
//! backward computes dW += xᵀ·g, db += Σₙ g and dx = g·Wᵀ.

use gemm::Parallelism;

use crate::layers::matmul::{matmul_with, View};

use crate::init::InitRng;
use crate::{Layer, Mode, ModelError, Param, Result, Tensor};

/// A normal truncated at ±2σ keeps 0.7737 of its variance (see `init`).
const TRUNCATION_STD: f64 = 0.879_625_7;

/// LeCun initialisation: truncated normal whose effective standard deviation
/// is sqrt(1 / fan_in) (the draw's σ is corrected for the truncation, as in
/// `init::he_truncated`).
fn lecun_truncated(rng: &mut InitRng, fan_in: usize, len: usize) -> Vec<f32> {
    let std = (1.0 / fan_in.max(1) as f64).sqrt() / TRUNCATION_STD;
    (0..len).map(|_| rng.truncated_normal(std)).collect()
}

/// Small products (the classifier head) are faster on one thread.
fn matmul(dst: &mut [f32], m: usize, n: usize, k: usize, lhs: View, rhs: View, accumulate: bool) {
    let parallelism = if m * n * k >= 1 << 20 {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    };
    matmul_with(dst, m, n, k, lhs, rhs, accumulate, parallelism);
}

pub struct Linear {
    pub(crate) in_features: usize,
    pub(crate) out_features: usize,
    weight: Param,
    pub(crate) bias: Option<Param>,
    saved_input: Option<Tensor>,
}

impl Linear {
    /// dW and db of `grad_output` for the saved input (taken: backward
    /// runs once per forward), added to the gradients; a frozen parameter
    /// gets none.
    fn add_param_grads(&mut self, grad_output: &Tensor) -> Result<()> {
        let x = self
            .saved_input
            .take()
            .ok_or(ModelError::NoSavedActivation { op: "linear" })?;
        let n = x.batch();
        let (k, o) = (self.in_features, self.out_features);
        grad_output.expect_shape("linear backward", &[n, o])?;
        self.check_state()?;
        let g = grad_output.data();
        // dW[k×o] += xᵀ[k×n] · g[n×o]
        let xt = View {
            data: x.data(),
            row_stride: 1,
            col_stride: k,
        };
        let gv = View {
            data: g,
            row_stride: o,
            col_stride: 1,
        };
        if !self.weight.frozen {
            matmul(self.weight.grad.data_mut(), k, o, n, xt, gv, true);
        }
        // db[o] += Σₙ g
        if let Some(b) = self.bias.as_mut().filter(|b| !b.frozen) {
            let db = b.grad.data_mut();
            for row in g.chunks_exact(o.max(1)) {
                for (d, &v) in db.iter_mut().zip(row) {
                    *d += v;
                }
            }
        }
        Ok(())
    }

    pub fn new(
        name: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
        rng: &mut InitRng,
    ) -> Self {
        let w = lecun_truncated(rng, in_features, in_features * out_features);
        let weight = Tensor::from_vec_unbudgeted(&[in_features, out_features], w);
        let weight = Param::new(format!("{name}.weight"), weight, true);
        let bias = bias.then(|| {
            Param::new(
                format!("{name}.bias"),
                Tensor::zeros(&[out_features]),
                false,
            )
        });
        Self {
            in_features,
            out_features,
            weight,
            bias,
            saved_input: None,
        }
    }

    /// Parameters are replaced wholesale by checkpoint loading; a mismatch is
    /// an error here rather than a panic in the GEMM.
    fn check_state(&self) -> Result<()> {
        let (k, o) = (self.in_features, self.out_features);
        let mut tensors = vec![(&self.weight.value, "weight", vec![k, o])];
        if let Some(b) = &self.bias {
            tensors.push((&b.value, "bias", vec![o]));
        }
        for p in std::iter::once(&self.weight).chain(&self.bias) {
            if !p.grad_fits() {
                return Err(ModelError::State(format!(
                    "{} gradient has shape {:?} for a value of {:?}",
                    p.name,
                    p.grad.shape(),
                    p.value.shape()
                )));
            }
        }
        for (t, what, expected) in tensors {
            if t.shape() != expected {
                return Err(ModelError::State(format!(
                    "linear {what} has shape {:?}, expected {expected:?}",
                    t.shape()
                )));
            }
        }
        Ok(())
    }

    fn input_error(&self, got: &[usize]) -> ModelError {
        ModelError::Shape {
            op: "linear",
            expected: format!("features [n, {}]", self.in_features),
            got: format!("{got:?}"),
        }
    }
}

impl Layer for Linear {
    cuda_form!(crate::ops::linear::layer::LinearLayer::from_cpu);

    fn describe(&self) -> String {
        let bias = if self.bias.is_some() {
            ""
        } else {
            " (no bias)"
        };
        format!("linear {}->{}{bias}", self.in_features, self.out_features)
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        match *input {
            [f] if f == self.in_features => Ok(vec![self.out_features]),
            _ => Err(ModelError::Shape {
                op: "linear",
                expected: format!("[{}]", self.in_features),
                got: format!("{input:?}"),
            }),
        }
    }

    fn macs(&self, input: &[usize]) -> Result<u64> {
        self.output_shape(input)?;
        Ok((self.in_features * self.out_features) as u64)
    }

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        self.saved_input = None;
        let n = match *input.shape() {
            [n, f] if f == self.in_features => n,
            _ => return Err(self.input_error(input.shape())),
        };
        self.check_state()?;
        let (k, o) = (self.in_features, self.out_features);
        let mut result = Tensor::try_zeros(&[n, o])?;
        let out = result.try_data_mut()?;
        if let Some(b) = &self.bias {
            for row in out.chunks_exact_mut(o.max(1)) {
                row.copy_from_slice(b.value.data());
            }
        }
        let x = View {
            data: input.data(),
            row_stride: k,
            col_stride: 1,
        };
        let w = View {
            data: self.weight.value.data(),
            row_stride: o,
            col_stride: 1,
        };
        matmul(out, n, o, k, x, w, self.bias.is_some());
        self.saved_input = match mode {
            Mode::Train => Some(input.clone()),
            Mode::Eval => None,
        };
        Ok(result)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        self.add_param_grads(grad_output)?;
        let (n, k, o) = (grad_output.batch(), self.in_features, self.out_features);
        // dx[n×k] = g[n×o] · Wᵀ[o×k]
        let gv = View {
            data: grad_output.data(),
            row_stride: o,
            col_stride: 1,
        };
        let wt = View {
            data: self.weight.value.data(),
            row_stride: 1,
            col_stride: o,
        };
        let mut dx = Tensor::try_zeros(&[n, k])?;
        matmul(dx.try_data_mut()?, n, k, o, gv, wt, false);
        Ok(dx)
    }

    fn backward_params_only(&mut self, grad_output: &Tensor) -> Result<()> {
        self.add_param_grads(grad_output)
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut params = vec![&mut self.weight];
        if let Some(b) = &mut self.bias {
            params.push(b);
        }
        params
    }

    fn clear_saved(&mut self) {
        self.saved_input = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::check_layer;
    use crate::gradcheck::random_tensor as random;

    fn naive_forward(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Vec<f32> {
        let (n, k) = (x.shape()[0], x.shape()[1]);
        let o = w.shape()[1];
        let mut y = vec![0.0f32; n * o];
        for i in 0..n {
            for j in 0..o {
                let mut acc = b.map_or(0.0, |b| b.data()[j] as f64);
                for l in 0..k {
                    acc += x.data()[i * k + l] as f64 * w.data()[l * o + j] as f64;
                }
                y[i * o + j] = acc as f32;
            }
        }
        y
    }

    #[test]
    fn params_are_named_shaped_and_initialised() {
        let mut rng = InitRng::new(3);
        let mut lin = Linear::new("head", 256, 40, true, &mut rng);
        assert_eq!(lin.describe(), "linear 256->40");
        let params = lin.params_mut();
        assert_eq!(params.len(), 2);
        assert_eq!(params[0].name, "head.weight");
        assert_eq!(params[0].value.shape(), &[256, 40]);
        assert!(params[0].decay);
        assert_eq!(params[1].name, "head.bias");
        assert_eq!(params[1].value.shape(), &[40]);
        assert!(!params[1].decay);
        assert!(params[1].value.data().iter().all(|&b| b == 0.0));
        let w = params[0].value.data();
        let var = w.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / w.len() as f64;
        assert!((var - 1.0 / 256.0).abs() < 0.1 / 256.0, "variance {var}");

        let mut no_bias = Linear::new("fc", 4, 3, false, &mut rng);
        assert_eq!(no_bias.params_mut().len(), 1);
        assert!(no_bias.describe().contains("no bias"));
    }

    #[test]
    fn forward_matches_a_naive_product() {
        let mut rng = InitRng::new(5);
        for bias in [true, false] {
            let mut lin = Linear::new("fc", 37, 11, bias, &mut rng);
            if let Some(b) = &mut lin.bias {
                b.value = random(&[11], 9);
            }
            let x = random(&[13, 37], 7);
            let y = lin.forward(&x, Mode::Eval).unwrap();
            assert_eq!(y.shape(), &[13, 11]);
            let expected =
                naive_forward(&x, &lin.weight.value, lin.bias.as_ref().map(|b| &b.value));
            for (a, e) in y.data().iter().zip(&expected) {
                assert!((a - e).abs() < 1e-4, "{a} vs {e}");
            }
        }
    }

    #[test]
    fn large_forward_takes_the_parallel_path_and_agrees() {
        let mut rng = InitRng::new(6);
        let mut lin = Linear::new("fc", 256, 128, true, &mut rng);
        let x = random(&[64, 256], 8);
        let y = lin.forward(&x, Mode::Eval).unwrap();
        let expected = naive_forward(
            &x,
            &lin.weight.value,
            Some(&lin.bias.as_ref().unwrap().value),
        );
        for (a, e) in y.data().iter().zip(&expected) {
            assert!((a - e).abs() < 1e-4, "{a} vs {e}");
        }
    }

    #[test]
    fn gradient_matches_finite_differences_with_bias() {
        let mut rng = InitRng::new(1);
        let mut lin = Linear::new("fc", 6, 5, true, &mut rng);
        let x = random(&[4, 6], 2);
        let report = check_layer(&mut lin, &x, 1e-2, 1e-3);
        assert!(report.is_ok(), "{}", report.unwrap_err());
    }

    #[test]
    fn gradient_matches_finite_differences_without_bias() {
        let mut rng = InitRng::new(1);
        let mut lin = Linear::new("fc", 7, 3, false, &mut rng);
        let x = random(&[5, 7], 4);
        let report = check_layer(&mut lin, &x, 1e-2, 1e-3);
        assert!(report.is_ok(), "{}", report.unwrap_err());
    }

    #[test]
    fn backward_params_only_adds_the_parameter_gradients_of_backward() {
        let mut rng = InitRng::new(1);
        let mut full = Linear::new("fc", 5, 3, true, &mut rng);
        let mut rng = InitRng::new(1);
        let mut params_only = Linear::new("fc", 5, 3, true, &mut rng);
        let (x, g) = (random(&[4, 5], 2), random(&[4, 3], 3));
        full.forward(&x, Mode::Train).unwrap();
        params_only.forward(&x, Mode::Train).unwrap();
        full.backward(&g).unwrap();
        params_only.backward_params_only(&g).unwrap();
        for (a, b) in full.params_mut().into_iter().zip(params_only.params_mut()) {
            assert!(a.grad.data() == b.grad.data(), "{}", a.name);
        }
        assert!(params_only.backward_params_only(&g).is_err());
    }

    #[test]
    fn backward_accumulates_into_param_grads() {
        let mut rng = InitRng::new(1);
        let mut lin = Linear::new("fc", 3, 2, true, &mut rng);
        let x = random(&[4, 3], 2);
        let g = random(&[4, 2], 3);
        lin.forward(&x, Mode::Train).unwrap();
        lin.backward(&g).unwrap();
        let once: Vec<Vec<f32>> = lin
            .params_mut()
            .iter()
            .map(|p| p.grad.data().to_vec())
            .collect();
        lin.forward(&x, Mode::Train).unwrap();
        lin.backward(&g).unwrap();
        for (p, once) in lin.params_mut().iter().zip(&once) {
            for (&twice, &once) in p.grad.data().iter().zip(once) {
                assert!((twice - 2.0 * once).abs() < 1e-5, "{twice} vs 2×{once}");
            }
        }
        // Bias gradient is the column sum of g.
        let db: Vec<f32> = (0..2)
            .map(|j| (0..4).map(|i| g.data()[i * 2 + j]).sum())
            .collect();
        let bias_grad = lin.params_mut()[1].grad.data().to_vec();
        for (a, e) in bias_grad.iter().zip(&db) {
            assert!((a - 2.0 * e).abs() < 1e-5);
        }
    }

    #[test]
    fn shape_errors_name_the_op_and_backward_needs_a_forward() {
        let mut rng = InitRng::new(1);
        let mut lin = Linear::new("fc", 3, 2, true, &mut rng);
        let err = lin.output_shape(&[4]).unwrap_err();
        assert!(err.to_string().contains("linear"), "{err}");
        let err = lin.output_shape(&[2, 2, 3]).unwrap_err();
        assert!(err.to_string().contains("linear"), "{err}");
        let err = lin
            .forward(&Tensor::zeros(&[2, 4]), Mode::Train)
            .unwrap_err();
        assert!(err.to_string().contains("linear"), "{err}");
        let err = lin.backward(&Tensor::zeros(&[2, 2])).unwrap_err();
        assert!(matches!(
            err,
            ModelError::NoSavedActivation { op: "linear" }
        ));
        lin.forward(&Tensor::zeros(&[2, 3]), Mode::Train).unwrap();
        let err = lin.backward(&Tensor::zeros(&[2, 3])).unwrap_err();
        assert!(err.to_string().contains("linear backward"), "{err}");
    }

    #[test]
    fn mismatched_loaded_state_is_an_error_not_a_panic() {
        let mut lin = Linear::new("fc", 3, 2, true, &mut InitRng::new(1));
        lin.params_mut()[0].value = Tensor::zeros(&[2, 3]);
        let err = lin
            .forward(&Tensor::zeros(&[4, 3]), Mode::Train)
            .unwrap_err();
        assert!(matches!(err, ModelError::State(_)), "{err}");
        assert!(err.to_string().contains("weight"), "{err}");
    }

    #[test]
    fn an_empty_batch_is_fine() {
        let mut rng = InitRng::new(1);
        let mut lin = Linear::new("fc", 3, 2, true, &mut rng);
        let y = lin.forward(&Tensor::zeros(&[0, 3]), Mode::Train).unwrap();
        assert_eq!(y.shape(), &[0, 2]);
        let gi = lin.backward(&y).unwrap();
        assert_eq!(gi.shape(), &[0, 3]);
    }
}
