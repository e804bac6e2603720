//! Layer normalisation over the last axis (any leading shape: [N, C],
//! [N, T, C], NHWC): y = (x − mean)·rstd·γ + β per row, rstd = 1/√(var + eps),
//! with the biased variance, as in PyTorch.
//!
//! Saves for backward: the input (a reference-counted handle, no copy) and
//! each row's mean and rstd (two floats per row), so x̂ is recomputed rather
//! than stored. Backward, per row with x̂ = (x − mean)·rstd and d = g·γ:
//! dγ += Σ g·x̂, dβ += Σ g, dx = rstd·(d − mean(d) − x̂·mean(d·x̂)).
//! γ and β get no weight decay.
//!
//! Speed: a row's sums run in f64 as eight independent lanes (one zmm or
//! two ymm registers of chains, added in a fixed order at the end), so
//! they vectorise and give the same bits at any vector width; a single
//! f64 chain per row was most of this layer's time. Backward makes dx and
//! each task's partial dγ and dβ in one parallel pass; the partials of the
//! fixed 64-row tasks are added in task order, so the gradients do not
//! depend on the thread count.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::layers::vector_math::{lane_sum, wide};
use crate::ops::activation::relu::par_build;
use crate::{Layer, Mode, ModelError, Param, Result, Tensor};

/// Rows per parallel task: enough work to amortise scheduling. Fixed (not
/// the thread count): the tasks' partial dγ and dβ are summed in order.
const ROWS_PER_TASK: usize = 64;

pub struct LayerNorm {
    pub(crate) features: usize,
    pub(crate) eps: f32,
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
#[inline(always)]
fn row_statistics(row: &[f32], eps: f32) -> (f32, f32) {
    let len = row.len().max(1) as f64;
    let mean = lane_sum(row, row, |v, _| v as f64) / len;
    let var = lane_sum(row, row, |v, _| (v as f64 - mean).powi(2)) / len;
    (mean as f32, (1.0 / (var + eps as f64).sqrt()) as f32)
}

/// One row's dx from its input, gradient and statistics, leaving x̂ in
/// `x_hat` (for the caller's dγ) and g·γ in `d`.
#[inline(always)]
fn backward_row(
    (x, g, gamma): (&[f32], &[f32], &[f32]),
    (mean, rstd): (f32, f32),
    (x_hat, d): (&mut [f32], &mut [f32]),
    out: &mut [MaybeUninit<f32>],
) {
    for (h, &v) in x_hat.iter_mut().zip(x) {
        *h = (v - mean) * rstd;
    }
    for ((d, &g), &w) in d.iter_mut().zip(g).zip(gamma) {
        *d = g * w;
    }
    let c = x.len().max(1) as f64;
    let mean_d = (lane_sum(d, d, |d, _| d as f64) / c) as f32;
    let mean_dx = (lane_sum(d, x_hat, |d, h| d as f64 * h as f64) / c) as f32;
    for ((o, &d), &h) in out.iter_mut().zip(&*d).zip(&*x_hat) {
        o.write(rstd * (d - mean_d - h * mean_dx));
    }
}

/// Rows `first`.. of dx (as many as `out` holds), and their Σ g·x̂ and
/// Σ g added into `partial` = [dγ | dβ], from x, g and [mean, rstd]
/// per row of the whole batch.
#[inline(always)]
fn backward_rows(
    first: usize,
    (x, g, stats): (&[f32], &[f32], &[f32]),
    gamma: &[f32],
    out: &mut [MaybeUninit<f32>],
    partial: &mut [f32],
) {
    let c = gamma.len();
    let (dgamma, dbeta) = partial.split_at_mut(c);
    let (mut x_hat, mut d) = (vec![0.0f32; c], vec![0.0f32; c]);
    for (r, out_row) in out.chunks_mut(c.max(1)).enumerate() {
        let row = first + r;
        let span = row * c..(row + 1) * c;
        let row_stats = (stats[2 * row], stats[2 * row + 1]);
        let g_row = &g[span.clone()];
        let scratch = (&mut x_hat[..], &mut d[..]);
        backward_row((&x[span], g_row, gamma), row_stats, scratch, out_row);
        let terms = g_row.iter().zip(&x_hat);
        for ((dg, db), (&gv, &h)) in dgamma.iter_mut().zip(&mut *dbeta).zip(terms) {
            *dg += gv * h;
            *db += gv;
        }
    }
}

impl Layer for LayerNorm {
    cuda_form!(crate::ops::layer_norm::layer::LayerNormLayer::from_cpu);

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
                wide(
                    #[inline(always)]
                    || {
                        for (r, pair) in out.chunks_mut(2).enumerate() {
                            let row = offset / 2 + r;
                            let x_row = &x[row * c..(row + 1) * c];
                            let (mean, rstd) = row_statistics(x_row, self.eps);
                            pair[0].write(mean);
                            pair[1].write(rstd);
                        }
                    },
                )
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
                wide(
                    #[inline(always)]
                    || {
                        for (r, out_row) in out.chunks_mut(c).enumerate() {
                            let row = offset / c + r;
                            let (mean, rstd) = (s[2 * row], s[2 * row + 1]);
                            let x_row = &x[row * c..(row + 1) * c];
                            for (j, o) in out_row.iter_mut().enumerate() {
                                o.write((x_row[j] - mean) * rstd * gamma[j] + beta[j]);
                            }
                        }
                    },
                )
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
        let rows = stats.len() / 2;
        let tasks = rows.div_ceil(ROWS_PER_TASK);
        let mut partials = vec![0.0f32; tasks * 2 * c];
        let (x, g, s) = (input.data(), grad_output.data(), stats.data());
        let gamma = self.gamma.value.data();
        // SAFETY: each task writes every element of its whole rows.
        let dx = unsafe {
            Tensor::try_init_with(input.shape(), |out| {
                out.par_chunks_mut((ROWS_PER_TASK * c).max(1))
                    .zip(partials.par_chunks_mut((2 * c).max(1)))
                    .enumerate()
                    .for_each(|(t, (out, partial))| {
                        let first = t * ROWS_PER_TASK;
                        wide(
                            #[inline(always)]
                            || backward_rows(first, (x, g, s), gamma, out, partial),
                        )
                    });
            })?
        };
        // A frozen scale or shift has an empty gradient: nothing is added.
        for partial in partials.chunks_exact((2 * c).max(1)) {
            let (dgamma, dbeta) = partial.split_at(c);
            for (grad, part) in [(&mut self.gamma.grad, dgamma), (&mut self.beta.grad, dbeta)] {
                for (d, &v) in grad.data_mut().iter_mut().zip(part) {
                    *d += v;
                }
            }
        }
        Ok(dx)
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

    /// dγ and dβ are summed in fixed 64-row tasks, then in task order.
    #[test]
    fn gradients_have_the_same_bits_on_any_number_of_threads() {
        let bits_on = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let mut ln = with_random_affine(LayerNorm::new("ln", 40, 1e-5), 7);
                ln.forward(&random_tensor(&[300, 40], 8), Mode::Train)
                    .unwrap();
                let dx = ln.backward(&random_tensor(&[300, 40], 9)).unwrap();
                let mut bits: Vec<u32> = dx.data().iter().map(|v| v.to_bits()).collect();
                for p in ln.params_mut() {
                    bits.extend(p.grad.data().iter().map(|v| v.to_bits()));
                }
                bits
            })
        };
        let one = bits_on(1);
        assert_eq!(one.len(), 300 * 40 + 2 * 40);
        assert_eq!(one, bits_on(3));
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
