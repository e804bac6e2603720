//! Global-norm gradient clipping (`torch.nn.utils.clip_grad_norm_` with
//! `norm_type=2`). The sum of squares is accumulated in f64, so the norm is
//! exact to f32 precision whatever the number of parameters.

use std::borrow::Borrow;

use headroom_model::{lane_sum, wide, Param};
use rayon::prelude::*;

/// Added to the norm in the clip coefficient, as in PyTorch.
const CLIP_EPS: f64 = 1e-6;

/// Global L2 norm over all gradients. Accepts `&[&mut Param]` (a
/// `Vec<&mut Param>` from `params_mut`), `&[&Param]` or `&[Param]`.
/// Non-finite gradients give a non-finite norm (NaN or +inf).
pub fn grad_norm<P: Borrow<Param> + Sync>(params: &[P]) -> f32 {
    global_norm(params) as f32
}

/// Clips the gradients to a global L2 norm of `max_norm` and returns the norm
/// before clipping.
///
/// If the norm is above `max_norm`, every gradient is multiplied by
/// `max_norm / (norm + 1e-6)` (PyTorch's coefficient); otherwise nothing is
/// touched. (PyTorch multiplies by `min(1, max_norm / (norm + 1e-6))`
/// unconditionally, which also shrinks gradients by up to a relative 1e-6
/// when `max_norm - 1e-6 < norm <= max_norm`; we leave those alone.)
///
/// A non-finite norm (a NaN or infinite gradient, or a norm beyond f32's
/// range) leaves the gradients untouched and is returned as is: the caller
/// skips the step. `max_norm = +inf` never clips; `max_norm` should be
/// positive (the caller validates its config).
pub fn clip_grad_norm(params: &mut [&mut Param], max_norm: f32) -> f32 {
    let norm = global_norm(params);
    clip_to_norm(params, norm, max_norm)
}

/// [`clip_grad_norm`] with the norm already known (a sharded optimizer's
/// ranks each hold some gradients: the norm is made from every rank's
/// [`gradient_sums_of_squares`] by [`norm_of_sums`]); only `params` are
/// scaled. Returns the norm as f32.
pub fn clip_to_norm(params: &mut [&mut Param], norm: f64, max_norm: f32) -> f32 {
    let norm32 = norm as f32;
    if !norm32.is_finite() {
        return norm32;
    }
    if norm > max_norm as f64 {
        let coef = (max_norm as f64 / (norm + CLIP_EPS)) as f32;
        params.par_iter_mut().for_each(|p| {
            let g = p.grad.data_mut();
            wide(
                #[inline(always)]
                || g.iter_mut().for_each(|g| *g *= coef),
            );
        });
    }
    norm32
}

/// One sum per parameter, in parallel, added in parameter order: the same
/// bits on any number of threads.
fn global_norm<P: Borrow<Param> + Sync>(params: &[P]) -> f64 {
    norm_of_sums(&gradient_sums_of_squares(params))
}

/// Σg² of each parameter's gradient, in f64, in parameter order: the
/// terms of the global norm.
pub fn gradient_sums_of_squares<P: Borrow<Param> + Sync>(params: &[P]) -> Vec<f64> {
    params
        .par_iter()
        .map(|p| sum_of_squares(p.borrow().grad.data()))
        .collect()
}

/// The global norm from the per-parameter sums, added in parameter order:
/// the same bits whichever rank or thread computed each sum.
pub fn norm_of_sums(sums: &[f64]) -> f64 {
    sums.iter().sum::<f64>().sqrt()
}

/// Σx² in f64 over eight lanes (`lane_sum`: a single f64 accumulator is a
/// serial dependency chain), compiled for the CPU's widest vectors.
fn sum_of_squares(x: &[f32]) -> f64 {
    let mut total = 0.0;
    wide(
        #[inline(always)]
        || {
            total = lane_sum(
                x,
                x,
                #[inline(always)]
                |v, _| (v as f64) * (v as f64),
            )
        },
    );
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sum_of_squares_covers_chunks_and_tail() {
        for n in [0usize, 1, 7, 8, 9, 17, 100] {
            let x: Vec<f32> = (0..n).map(|i| i as f32 - 3.5).collect();
            let expected: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum();
            assert_eq!(sum_of_squares(&x), expected, "n = {n}");
        }
    }
}
