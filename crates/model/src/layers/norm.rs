//! Layer normalisation over the last axis (any leading shape: [N, C],
//! [N, T, C], NHWC): y = (x − mean)·rstd·γ + β per row, rstd = 1/√(var + eps),
//! with the biased variance, as in PyTorch.
//!
//! Saves for backward: the input (a reference-counted handle, no copy) and
//! each row's mean and rstd (two floats per row), so x̂ is recomputed rather
//! than stored. Backward, per row with x̂ = (x − mean)·rstd and d = g·γ:
//! dγ += Σ g·x̂, dβ += Σ g, dx = rstd·(d − mean(d) − x̂·mean(d·x̂)).
//! γ and β get no weight decay.

use std::mem::MaybeUninit;

use super::activation::par_build;
use crate::{Layer, Mode, ModelError, Param, Result, Tensor};

/// Rows per parallel task: enough work to amortise scheduling.
const ROWS_PER_TASK: usize = 64;

pub struct LayerNorm {
    features: usize,
    eps: f32,
    gamma: Param,
    beta: Param,
    /// Input, and [mean, rstd] per row, of the last training forward.
    saved: Option<(Tensor, Tensor)>,
}

impl LayerNorm {
    pub fn new(name: &str, features: usize, eps: f32) -> Self {
        Self {
            features,
            eps,
            gamma: Param::new(
                format!("{name}.gamma"),
                Tensor::from_vec_unbudgeted(&[features], vec![1.0; features]),
                false,
            ),
            beta: Param::new(format!("{name}.beta"), Tensor::zeros(&[features]), false),
            saved: None,
        }
    }

    fn rows(&self, shape: &[usize]) -> Result<usize> {
        match shape.last() {
            Some(&c) if c == self.features && shape.len() >= 2 => {
                Ok(shape[..shape.len() - 1].iter().product())
            }
            _ => Err(ModelError::Shape {
                op: "layer_norm",
                expected: format!("[n, ..., {}]", self.features),
                got: format!("{shape:?}"),
            }),
        }
    }

    fn check_state(&self) -> Result<()> {
        for p in [&self.gamma, &self.beta] {
            if p.value.shape() != [self.features] || !p.grad_fits() {
                return Err(ModelError::State(format!(
                    "{} has shape {:?}, expected [{}]",
                    p.name,
                    p.value.shape(),
                    self.features
                )));
            }
        }
        Ok(())
    }
}

/// Mean and rstd of one row, accumulated in f64 (rows can be long).
fn row_statistics(row: &[f32], eps: f32) -> (f32, f32) {
    let len = row.len().max(1) as f64;
    let mean = row.iter().map(|&v| v as f64).sum::<f64>() / len;
    let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / len;
    (mean as f32, (1.0 / (var + eps as f64).sqrt()) as f32)
}

impl Layer for LayerNorm {
    fn describe(&self) -> String {
        format!("layer_norm {}", self.features)
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        if input.last() != Some(&self.features) {
            return Err(ModelError::Shape {
                op: "layer_norm",
                expected: format!("[..., {}]", self.features),
                got: format!("{input:?}"),
            });
        }
        Ok(input.to_vec())
    }

    fn macs(&self, input: &[usize]) -> Result<u64> {
        Ok(2 * input.iter().product::<usize>() as u64)
    }

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        self.saved = None;
        let rows = self.rows(input.shape())?;
        self.check_state()?;
        let c = self.features;
        let x = input.data();
        // SAFETY: each chunk holds whole rows' pairs; both are written.
        let stats = unsafe {
            par_build(&[rows, 2], ROWS_PER_TASK * 2, |offset, out| {
                for (r, pair) in out.chunks_mut(2).enumerate() {
                    let row = offset / 2 + r;
                    let (mean, rstd) = row_statistics(&x[row * c..(row + 1) * c], self.eps);
                    pair[0].write(mean);
                    pair[1].write(rstd);
                }
            })?
        };
        let (gamma, beta, s) = (
            self.gamma.value.data(),
            self.beta.value.data(),
            stats.data(),
        );
        // SAFETY: each chunk holds whole rows; every element is written.
        let out = unsafe {
            par_build(input.shape(), ROWS_PER_TASK * c, |offset, out| {
                for (r, out_row) in out.chunks_mut(c).enumerate() {
                    let row = offset / c + r;
                    let (mean, rstd) = (s[2 * row], s[2 * row + 1]);
                    let x_row = &x[row * c..(row + 1) * c];
                    for (j, o) in out_row.iter_mut().enumerate() {
                        o.write((x_row[j] - mean) * rstd * gamma[j] + beta[j]);
                    }
                }
            })?
        };
        if mode == Mode::Train {
            self.saved = Some((input.clone(), stats));
        }
        Ok(out)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let (input, stats) = self
            .saved
            .take()
            .ok_or(ModelError::NoSavedActivation { op: "layer_norm" })?;
        grad_output.expect_shape("layer_norm backward", input.shape())?;
        self.check_state()?;
        let c = self.features;
        let (x, g, s) = (input.data(), grad_output.data(), stats.data());
        let x_hat = |row: usize, j: usize| (x[row * c + j] - s[2 * row]) * s[2 * row + 1];

        let rows = s.len() / 2;
        // A frozen scale and shift have empty gradients: these loops then
        // do nothing.
        let dgamma = self.gamma.grad.data_mut();
        for row in 0..rows {
            for (j, d) in dgamma.iter_mut().enumerate() {
                *d += g[row * c + j] * x_hat(row, j);
            }
        }
        let dbeta = self.beta.grad.data_mut();
        for row in g.chunks_exact(c.max(1)) {
            for (d, &v) in dbeta.iter_mut().zip(row) {
                *d += v;
            }
        }

        let gamma = self.gamma.value.data();
        let write_rows = |offset: usize, out: &mut [MaybeUninit<f32>]| {
            for (r, out_row) in out.chunks_mut(c).enumerate() {
                let row = offset / c + r;
                let (mut mean_d, mut mean_dx) = (0.0f64, 0.0f64);
                for j in 0..c {
                    let d = (g[row * c + j] * gamma[j]) as f64;
                    mean_d += d;
                    mean_dx += d * x_hat(row, j) as f64;
                }
                let (mean_d, mean_dx) = ((mean_d / c as f64) as f32, (mean_dx / c as f64) as f32);
                let rstd = s[2 * row + 1];
                for (j, o) in out_row.iter_mut().enumerate() {
                    let d = g[row * c + j] * gamma[j];
                    o.write(rstd * (d - mean_d - x_hat(row, j) * mean_dx));
                }
            }
        };
        // SAFETY: each chunk holds whole rows; every element is written.
        unsafe { par_build(input.shape(), ROWS_PER_TASK * c, write_rows) }
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        vec![&mut self.gamma, &mut self.beta]
    }

    fn clear_saved(&mut self) {
        self.saved = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_layer, random_tensor};

    fn with_random_affine(mut ln: LayerNorm, seed: u64) -> LayerNorm {
        let c = ln.features;
        ln.gamma.value = random_tensor(&[c], seed);
        ln.beta.value = random_tensor(&[c], seed + 1);
        ln
    }

    #[test]
    fn rows_are_normalised() {
        let mut ln = LayerNorm::new("ln", 16, 1e-5);
        let x = random_tensor(&[3, 4, 16], 1);
        let y = ln.forward(&x, Mode::Eval).unwrap();
        for row in y.data().chunks(16) {
            let mean: f32 = row.iter().sum::<f32>() / 16.0;
            let var: f32 = row.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / 16.0;
            assert!(
                mean.abs() < 1e-5 && (var - 1.0).abs() < 1e-3,
                "{mean} {var}"
            );
        }
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let mut ln = with_random_affine(LayerNorm::new("ln", 6, 1e-5), 3);
        let report = check_layer(&mut ln, &random_tensor(&[2, 3, 6], 2), 1e-2, 2e-3);
        assert!(report.is_ok(), "{}", report.unwrap_err());
    }

    #[test]
    fn many_rows_take_the_parallel_path_and_agree() {
        let mut ln = with_random_affine(LayerNorm::new("ln", 8, 1e-5), 5);
        let report = check_layer(&mut ln, &random_tensor(&[300, 8], 4), 1e-2, 2e-3);
        assert!(report.is_ok(), "{}", report.unwrap_err());
    }

    #[test]
    fn wrong_width_is_a_named_error() {
        let mut ln = LayerNorm::new("ln", 6, 1e-5);
        let err = ln
            .forward(&random_tensor(&[2, 5], 1), Mode::Train)
            .unwrap_err();
        assert!(err.to_string().contains("layer_norm"), "{err}");
        assert!(ln.backward(&random_tensor(&[2, 6], 1)).is_err());
    }
}
