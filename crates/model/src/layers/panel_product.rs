//! Products of a few rows against one weight matrix used many times: the
//! LSTM's h_{t−1}·Wh at each of T steps, and d_pre_t·Whᵀ backward, with a
//! thread's block of samples (tens of rows) against a [H, 4H] matrix.
//!
//! Through the `gemm` crate such a call ran at about 60% of a core's FMA
//! peak with its AVX2 kernels and 80% with its AVX-512 ones: the crate
//! repacks the whole matrix on every call (1 MiB per step for H = 256).
//! Here the matrix is packed once per forward or backward into panels of
//! 32 columns, [⌈N/32⌉][K][32] (read in place, Wh's rows 4H floats apart
//! would fall into the same few L1 sets), and the convolution's direct
//! tiles (`conv::direct::tiles`) stream a panel from L1 while broadcasting
//! the rows' values: 12 rows × 32 columns in zmm registers with AVX-512,
//! 6 × 16 in ymm with AVX2. Each output is one chain of FMAs over k in
//! order either way, so the bits depend neither on the vector width nor on
//! the rows in a call (the threads' blocks of samples).
//!
//! Memory: the packed copy, K·N rounded up to 32 columns, from the pool.

use super::matmul::{matmul, View};
use crate::ops::activation::relu::par_rows;
use crate::ops::conv::cpu::direct_tiles::{self as direct, Init, Steps};
use crate::{Result, Tensor};

/// Columns of a panel: the widest tile's.
const PANEL: usize = direct::WIDE;

/// W [K × N] in the form its products read fastest on this CPU.
pub(crate) enum RecurrentWeights<'a> {
    /// Packed 32-column panels for the direct tiles (AVX2+FMA).
    Panels { packed: Tensor, k: usize, n: usize },
    /// Row-major as given, for the `gemm` crate (a CPU without AVX2+FMA).
    RowMajor { w: View<'a>, k: usize, n: usize },
    /// A row-major copy of a matrix given through other strides: the
    /// crate would repack those on every call.
    Copied { w: Tensor, k: usize, n: usize },
}

impl<'a> RecurrentWeights<'a> {
    /// `w` viewed as K × N (any strides): panels where the direct tiles
    /// run, else row-major for the `gemm` crate.
    pub fn new(w: View<'a>, k: usize, n: usize) -> Result<Self> {
        match direct::supports(PANEL) {
            true => Self::packed(w, k, n),
            false => Self::for_gemm(w, k, n),
        }
    }

    /// N, the columns of every product.
    pub fn cols(&self) -> usize {
        match self {
            Self::Panels { n, .. } | Self::RowMajor { n, .. } | Self::Copied { n, .. } => *n,
        }
    }

    fn packed(w: View<'a>, k: usize, n: usize) -> Result<Self> {
        let panels = n.div_ceil(PANEL);
        // SAFETY: every panel row is written whole, columns past N as 0.
        let packed = unsafe {
            par_rows(&[panels * k, PANEL], PANEL, |row, out| {
                let (panel, kk) = (row / k, row % k);
                for (j, o) in out.iter_mut().enumerate() {
                    let col = panel * PANEL + j;
                    o.write(match col < n {
                        true => w.data[kk * w.row_stride + col * w.col_stride],
                        false => 0.0,
                    });
                }
            })?
        };
        Ok(Self::Panels { packed, k, n })
    }

    fn for_gemm(w: View<'a>, k: usize, n: usize) -> Result<Self> {
        if w.col_stride == 1 {
            return Ok(Self::RowMajor { w, k, n });
        }
        // SAFETY: row kk gets all n values of W's row kk.
        let copy = unsafe {
            par_rows(&[k, n], n, |kk, out| {
                for (j, o) in out.iter_mut().enumerate() {
                    o.write(w.data[kk * w.row_stride + j * w.col_stride]);
                }
            })?
        };
        Ok(Self::Copied { w: copy, k, n })
    }

    /// dst [rows × N] (row-major, contiguous) = lhs [rows × K] · W, where
    /// row r of lhs is `lhs[r·lhs_stride..][..K]`.
    pub fn product(&self, dst: &mut [f32], rows: usize, lhs: &[f32], lhs_stride: usize) {
        match self {
            Self::RowMajor { w, k, n } => gemm(dst, rows, *n, *k, lhs, lhs_stride, *w),
            Self::Copied { w, k, n } => {
                gemm(dst, rows, *n, *k, lhs, lhs_stride, View::rm(w.data(), *n));
            }
            Self::Panels { packed, k, n } => {
                let shape = Product {
                    rows,
                    k: *k,
                    n: *n,
                    lhs_stride,
                };
                panel_product(dst, lhs, packed.data(), shape);
            }
        }
    }
}

/// The shape of one call: [rows × K]·[K × N], lhs rows `lhs_stride` apart.
#[derive(Clone, Copy)]
struct Product {
    rows: usize,
    k: usize,
    n: usize,
    lhs_stride: usize,
}

/// Tile column by tile column (16 or 32 of a panel), all rows at once; a
/// part-filled last tile goes through a scratch row block.
fn panel_product(dst: &mut [f32], lhs: &[f32], packed: &[f32], p: Product) {
    assert!(dst.len() >= p.rows * p.n, "panel product: dst too small");
    assert!(
        p.rows == 0 || (p.rows - 1) * p.lhs_stride + p.k <= lhs.len(),
        "panel product: lhs too small"
    );
    assert_eq!(
        packed.len(),
        p.n.div_ceil(PANEL) * p.k * PANEL,
        "panel product: panels"
    );
    let width = direct::tile_width(PANEL);
    let mut rows: Vec<(usize, usize)> = (0..p.rows).map(|r| (r * p.lhs_stride, 0)).collect();
    let mut partial = Vec::new();
    for col in (0..p.n).step_by(width) {
        let panel = &packed[(col / PANEL) * p.k * PANEL..][..p.k * PANEL];
        let steps = Steps {
            segs: &[(0, (col % PANEL) as isize)],
            len: p.k,
            a_step: 1,
            b_step: PANEL as isize,
        };
        let cols = (p.n - col).min(width);
        let (out, stride, at) = match cols == width {
            true => (&mut *dst, p.n, col),
            false => {
                partial.resize(p.rows * width, 0.0);
                (&mut partial[..], width, 0)
            }
        };
        for (r, row) in rows.iter_mut().enumerate() {
            row.1 = r * stride + at;
        }
        // SAFETY: `new` packed only where `direct::supports` holds; row r
        // reads lhs[r·stride..][..K] and panel values (col % 32) + kk·32
        // ..+width for kk < K, inside the panel (the asserts above); each
        // row writes `width` floats of its own inside `out`, which nothing
        // read aliases.
        unsafe {
            direct::tiles(
                &rows,
                lhs,
                panel,
                &steps,
                width,
                out.as_mut_ptr(),
                out.len(),
                Init::Zero,
            );
        }
        if cols < width {
            for (r, tile) in partial.chunks_exact(width).enumerate() {
                dst[r * p.n + col..][..cols].copy_from_slice(&tile[..cols]);
            }
        }
    }
}

fn gemm(dst: &mut [f32], rows: usize, n: usize, k: usize, lhs: &[f32], stride: usize, w: View) {
    let lhs = View {
        data: lhs,
        row_stride: stride,
        col_stride: 1,
    };
    matmul(dst, rows, n, k, lhs, w, false);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i * 7919 + seed * 104_729) % 1999) as f32 - 999.0) / 517.0)
            .collect()
    }

    /// Each output as one FMA chain over k, in order: the tiles' bits.
    fn reference(lhs: &[f32], stride: usize, rows: usize, w: View, k: usize, n: usize) -> Vec<f32> {
        let mut out = vec![0.0; rows * n];
        for r in 0..rows {
            for j in 0..n {
                let mut acc = 0.0f32;
                for kk in 0..k {
                    let wv = w.data[kk * w.row_stride + j * w.col_stride];
                    acc = lhs[r * stride + kk].mul_add(wv, acc);
                }
                out[r * n + j] = acc;
            }
        }
        out
    }

    /// Row counts around the tiles' heights and widths around the 16- and
    /// 32-column tiles (part-filled last panels), against a transposed
    /// view too, and a depth past a tile pass (768 steps): the reference's
    /// bits where the direct tiles run (`tests/lstm_kernels.rs` holds the
    /// two widths to each other), within rounding through the `gemm` crate.
    #[test]
    fn panels_give_one_fma_chain_per_output() {
        let shapes = [
            (1, 3, 5),
            (6, 16, 16),
            (7, 33, 40),
            (13, 64, 48),
            (17, 20, 70),
            (5, 800, 32),
        ];
        for (rows, k, n) in shapes {
            for transposed in [false, true] {
                let wdata = values(k * n, n);
                let w = match transposed {
                    false => View::rm(&wdata, n),
                    true => View::cm(&wdata, k),
                };
                let stride = k + 3;
                let lhs = values(rows * stride, rows);
                let want = reference(&lhs, stride, rows, w, k, n);
                let weights = RecurrentWeights::new(w, k, n).unwrap();
                let mut got = vec![f32::NAN; rows * n];
                weights.product(&mut got, rows, &lhs, stride);
                let packed = matches!(weights, RecurrentWeights::Panels { .. });
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    let close = (a - b).abs() <= 1e-4 * (1.0 + b.abs());
                    assert!(close, "{rows}x{k}x{n}: [{i}] {a} against {b}");
                    if packed {
                        assert_eq!(a.to_bits(), b.to_bits(), "{rows}x{k}x{n}: [{i}]");
                    }
                }
            }
        }
    }
}
