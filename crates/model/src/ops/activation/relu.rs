//! ReLU. A training forward saves its OUTPUT (a reference-counted handle to
//! the tensor it returns, no copy): the mask `out > 0` is all backward needs,
//! and the next layer usually keeps the same buffer for its own backward.
//!
//! NaN propagates through the forward (`max(x, 0)` would hide it), so the
//! loss-scaling inf/NaN check downstream still sees it.
//!
//! This file also holds the parallel elementwise helpers the other layers in
//! this module share.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::{Layer, Mode, ModelError, Result, Tensor};

/// Elements per parallel task of an elementwise pass: large enough to amortise
/// scheduling, small enough to spread a 3M-element activation over many cores.
pub(crate) const PAR_CHUNK: usize = 1 << 14;

/// Builds a tensor of `shape` in a pool block without zeroing it first
/// (zeroing a reused block is a whole extra pass over memory, ~30% of an
/// elementwise op). `fill(offset, out)` is called, in parallel when the
/// tensor is large, on consecutive chunks of `chunk` elements (the last may be
/// shorter); `offset` is the index of `out[0]` in the tensor. Fails with
/// `ModelError::OutOfMemory` past the pool's budget.
///
/// # Safety
/// `fill` must initialise every element of every slice it is given.
pub(crate) unsafe fn par_build(
    shape: &[usize],
    chunk: usize,
    fill: impl Fn(usize, &mut [MaybeUninit<f32>]) + Sync,
) -> Result<Tensor> {
    let chunk = chunk.max(1);
    // SAFETY: every chunk is handed to `fill`, which initialises it (our
    // caller's contract).
    unsafe {
        Tensor::try_init_with(shape, |out| {
            if out.len() <= chunk {
                fill(0, out);
            } else {
                out.par_chunks_mut(chunk)
                    .enumerate()
                    .for_each(|(i, out)| fill(i * chunk, out));
            }
        })
    }
}

/// A tensor of `shape` built row by row (`row` values each), in parallel
/// for large tensors: `fill(k, out)` writes row k.
///
/// # Safety
/// `fill` must initialise every element of the row it is given.
///
/// # Panics
/// If `row` does not divide the shape's length.
pub(crate) unsafe fn par_rows(
    shape: &[usize],
    row: usize,
    fill: impl Fn(usize, &mut [MaybeUninit<f32>]) + Sync,
) -> Result<Tensor> {
    let row = row.max(1);
    assert_eq!(shape.iter().product::<usize>() % row, 0, "par_rows: shape");
    let chunk = PAR_CHUNK.div_ceil(row) * row;
    // SAFETY: chunks are whole rows, each handed to `fill` (our caller's
    // contract).
    unsafe {
        par_build(shape, chunk, |offset, out| {
            for (r, out_row) in out.chunks_mut(row).enumerate() {
                fill(offset / row + r, out_row);
            }
        })
    }
}

/// A tensor of `shape` made of rows of `row` values, row k copied from
/// `from(k)` (a slice of `row` values): layout changes (attention's heads,
/// a frame out of a sequence), one copy per row.
///
/// # Panics
/// If `row` does not divide the shape's length, or `from` returns a slice
/// of another length.
pub(crate) fn gather_rows<'a>(
    shape: &[usize],
    row: usize,
    from: impl Fn(usize) -> &'a [f32] + Sync,
) -> Result<Tensor> {
    // SAFETY: every row is written by the zip with a source slice of the
    // same length (asserted).
    unsafe {
        par_rows(shape, row, |k, out| {
            let src = from(k);
            assert_eq!(src.len(), out.len(), "gather_rows: source row");
            for (o, &v) in out.iter_mut().zip(src) {
                o.write(v);
            }
        })
    }
}

/// `out[i] = f(a[i])` into a new tensor of `shape`, in parallel for large
/// inputs.
///
/// # Panics
/// If `shape` does not hold `a.len()` elements (callers pass `a`'s shape).
pub(crate) fn par_map(shape: &[usize], a: &[f32], f: impl Fn(f32) -> f32 + Sync) -> Result<Tensor> {
    assert_eq!(shape.iter().product::<usize>(), a.len(), "par_map: shape");
    // SAFETY: each chunk `out` is zipped with the equally long `a[offset..]`
    // slice, so every element is written.
    unsafe {
        par_build(shape, PAR_CHUNK, |offset, out| {
            let a = &a[offset..offset + out.len()];
            for (o, &x) in out.iter_mut().zip(a) {
                o.write(f(x));
            }
        })
    }
}

/// `out[i] = f(a[i], b[i])` into a new tensor of `shape`, in parallel for
/// large inputs.
///
/// # Panics
/// If `a`, `b` and `shape` differ in length (callers check shapes first).
pub(crate) fn par_zip_map(
    shape: &[usize],
    a: &[f32],
    b: &[f32],
    f: impl Fn(f32, f32) -> f32 + Sync,
) -> Result<Tensor> {
    assert_eq!(a.len(), b.len(), "par_zip_map: operands differ in length");
    assert_eq!(
        shape.iter().product::<usize>(),
        a.len(),
        "par_zip_map: shape"
    );
    // SAFETY: `out`, `a[offset..]` and `b[offset..]` have the same length, so
    // the zip writes every element.
    unsafe {
        par_build(shape, PAR_CHUNK, |offset, out| {
            let a = &a[offset..offset + out.len()];
            let b = &b[offset..offset + out.len()];
            for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                o.write(f(x, y));
            }
        })
    }
}

/// `acc[i] += b[i]`, in parallel for large inputs.
pub(crate) fn par_add_assign(acc: &mut [f32], b: &[f32]) {
    debug_assert_eq!(acc.len(), b.len());
    if acc.len() < 2 * PAR_CHUNK {
        for (a, &y) in acc.iter_mut().zip(b) {
            *a += y;
        }
    } else {
        acc.par_chunks_mut(PAR_CHUNK)
            .zip(b.par_chunks(PAR_CHUNK))
            .for_each(|(a, b)| {
                for (a, &y) in a.iter_mut().zip(b) {
                    *a += y;
                }
            });
    }
}

/// max(x, 0) written `x < 0 ? 0 : x`, which keeps NaN (and vectorises to a
/// compare + blend). The fused batch norm uses it too, so fused and unfused
/// networks agree bit for bit.
#[inline(always)]
pub(crate) fn relu(x: f32) -> f32 {
    if x < 0.0 {
        0.0
    } else {
        x
    }
}

/// The gradient through a ReLU whose training forward returned `out`: g
/// where out > 0, else 0.
pub(crate) fn relu_backward(grad_output: &Tensor, out: &Tensor) -> Result<Tensor> {
    grad_output.expect_shape("relu backward", out.shape())?;
    par_zip_map(out.shape(), grad_output.data(), out.data(), |g, y| {
        if y > 0.0 {
            g
        } else {
            0.0
        }
    })
}

/// Rectified linear unit, any shape.
#[derive(Default)]
pub struct Relu {
    /// The output of the last training forward.
    saved_output: Option<Tensor>,
}

impl Relu {
    pub fn new() -> Self {
        Self { saved_output: None }
    }
}

impl Layer for Relu {
    cuda_form!(value crate::ops::activation::layer::ReluLayer);

    fn describe(&self) -> String {
        "relu".into()
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        Ok(input.to_vec())
    }

    fn macs(&self, _input: &[usize]) -> Result<u64> {
        Ok(0)
    }

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        self.saved_output = None;
        let out = par_map(input.shape(), input.data(), relu)?;
        self.saved_output = match mode {
            Mode::Train => Some(out.clone()),
            Mode::Eval => None,
        };
        Ok(out)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let out = self
            .saved_output
            .take()
            .ok_or(ModelError::NoSavedActivation { op: "relu" })?;
        relu_backward(grad_output, &out)
    }

    fn clear_saved(&mut self) {
        self.saved_output = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::check_layer;
    use crate::init::InitRng;

    /// Values in ±[0.1, 1.1]: far enough from the kink that a finite
    /// difference with eps 1e-3 never straddles it.
    fn away_from_zero(shape: &[usize], seed: u64) -> Tensor {
        let mut rng = InitRng::new(seed);
        let len = shape.iter().product();
        let data = (0..len)
            .map(|_| {
                let m = 0.1 + rng.uniform() as f32;
                if rng.uniform() < 0.5 {
                    -m
                } else {
                    m
                }
            })
            .collect();
        Tensor::from_vec(shape, data).unwrap()
    }

    #[test]
    fn forward_clamps_negatives_and_keeps_nan() {
        let x = Tensor::from_vec(&[1, 5], vec![-2.0, -0.0, 0.5, 3.0, f32::NAN]).unwrap();
        let y = Relu::new().forward(&x, Mode::Eval).unwrap();
        assert_eq!(&y.data()[..4], &[0.0, 0.0, 0.5, 3.0]);
        assert!(y.data()[4].is_nan());
    }

    #[test]
    fn backward_masks_by_output() {
        let mut relu = Relu::new();
        let x = Tensor::from_vec(&[2, 2], vec![-1.0, 2.0, 0.0, 4.0]).unwrap();
        relu.forward(&x, Mode::Train).unwrap();
        let g = Tensor::from_vec(&[2, 2], vec![10.0, 20.0, 30.0, 40.0]).unwrap();
        let gi = relu.backward(&g).unwrap();
        assert_eq!(gi.data(), &[0.0, 20.0, 0.0, 40.0]);
        // The saved output was consumed.
        let err = relu.backward(&g).unwrap_err();
        assert!(matches!(err, ModelError::NoSavedActivation { op: "relu" }));
    }

    #[test]
    fn saves_the_output_without_copying() {
        let mut relu = Relu::new();
        let x = away_from_zero(&[2, 3, 3, 4], 1);
        let y = relu.forward(&x, Mode::Train).unwrap();
        let saved = relu.saved_output.as_ref().unwrap();
        assert_eq!(saved.data().as_ptr(), y.data().as_ptr());
    }

    #[test]
    fn eval_saves_nothing_and_backward_then_fails() {
        let mut relu = Relu::new();
        let x = away_from_zero(&[2, 4], 2);
        relu.forward(&x, Mode::Train).unwrap();
        relu.forward(&x, Mode::Eval).unwrap();
        let err = relu.backward(&x).unwrap_err();
        assert!(matches!(err, ModelError::NoSavedActivation { .. }), "{err}");
    }

    #[test]
    fn backward_rejects_a_wrong_gradient_shape() {
        let mut relu = Relu::new();
        relu.forward(&away_from_zero(&[2, 4], 3), Mode::Train)
            .unwrap();
        let err = relu.backward(&Tensor::zeros(&[2, 5])).unwrap_err();
        assert!(err.to_string().contains("relu"), "{err}");
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let mut relu = Relu::new();
        let x = away_from_zero(&[3, 4, 4, 5], 4);
        let report = check_layer(&mut relu, &x, 1e-3, 1e-3);
        assert!(report.is_ok(), "{}", report.unwrap_err());
    }

    #[test]
    fn large_inputs_take_the_parallel_path_and_agree() {
        let x = away_from_zero(&[4, 32, 32, 16], 5);
        let mut relu = Relu::new();
        let y = relu.forward(&x, Mode::Train).unwrap();
        for (&a, &b) in x.data().iter().zip(y.data()) {
            assert_eq!(b, a.max(0.0));
        }
        let g = away_from_zero(x.shape(), 6);
        let gi = relu.backward(&g).unwrap();
        for ((&a, &gg), &r) in x.data().iter().zip(g.data()).zip(gi.data()) {
            assert_eq!(r, if a > 0.0 { gg } else { 0.0 });
        }
    }
}
