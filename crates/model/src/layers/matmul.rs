//! The one strided matrix product of the CPU layers (the linear layer, and
//! the convolution's im2col fallback), through the `gemm` crate. A transpose
//! is a change of strides, never a copy.

use gemm::{gemm, Parallelism};

/// A strided matrix view: element (i, j) is data[i·row_stride + j·col_stride].
#[derive(Clone, Copy)]
pub(crate) struct View<'a> {
    pub data: &'a [f32],
    pub row_stride: usize,
    pub col_stride: usize,
}

impl<'a> View<'a> {
    /// Row-major with `cols` columns.
    pub fn rm(data: &'a [f32], cols: usize) -> Self {
        Self {
            data,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The transpose of a row-major matrix with `cols` columns.
    pub fn cm(data: &'a [f32], cols: usize) -> Self {
        Self {
            data,
            row_stride: 1,
            col_stride: cols,
        }
    }
}

/// dst[m×n] (row-major, contiguous) = (accumulate ? dst : 0) + lhs[m×k]·rhs[k×n],
/// single-threaded (callers parallelise over blocks).
pub(crate) fn matmul(
    dst: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    lhs: View,
    rhs: View,
    accumulate: bool,
) {
    matmul_with(dst, m, n, k, lhs, rhs, accumulate, Parallelism::None);
}

/// `matmul` with the `gemm` crate's own threads.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_with(
    dst: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    lhs: View,
    rhs: View,
    accumulate: bool,
    parallelism: Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst.fill(0.0);
        }
        return;
    }
    let last =
        |v: &View, rows: usize, cols: usize| (rows - 1) * v.row_stride + (cols - 1) * v.col_stride;
    // Internal invariants (every caller derives the extents from validated
    // shapes), checked because the call below is unsafe.
    assert!(dst.len() >= m * n, "matmul: dst too small");
    assert!(
        last(&lhs, m, k) < lhs.data.len(),
        "matmul: lhs view out of bounds"
    );
    assert!(
        last(&rhs, k, n) < rhs.data.len(),
        "matmul: rhs view out of bounds"
    );
    // SAFETY: the asserts keep every element gemm reads inside `lhs` and `rhs`
    // and every element it writes inside `dst`, which we hold mutably and
    // which aliases neither input.
    unsafe {
        gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.col_stride as isize,
            lhs.row_stride as isize,
            rhs.data.as_ptr(),
            rhs.col_stride as isize,
            rhs.row_stride as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}
