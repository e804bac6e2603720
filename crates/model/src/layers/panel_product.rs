//! Products of a few rows against one weight matrix used many times: the
//! LSTM's h_{t−1}·Wh at each of T steps, and d_pre_t·Whᵀ backward, with a
//! thread's block of samples (tens of rows) against a [H, 4H] matrix.
//!
//! Through the `gemm` crate with AVX2 kernels such a call ran at about 60%
//! of a core's FMA peak: the crate repacks the whole matrix on every call
//! (1 MiB per step for H = 256). Here the matrix is packed once per
//! forward or backward into panels of 16 columns, [N/16][K][16], and a
//! 6-row × 16-column AVX2+FMA tile streams a panel from L1 while the six
//! rows' values are broadcast: each output is one chain of FMAs over k in
//! order, so the bits depend neither on the rows in a call nor on the
//! threads. With AVX-512 the crate's own kernels are faster than these,
//! and `RecurrentWeights` keeps the crate.
//!
//! Memory: the packed copy, K·N rounded up to 16 columns, from the pool.

use super::activation::par_rows;
#[cfg(target_arch = "x86_64")]
use super::conv::{cpu_kernels, CpuKernels};
use super::matmul::{matmul, View};
use crate::{Result, Tensor};

/// Columns of a panel: two AVX2 registers.
const PANEL: usize = 16;
/// Rows of a tile: 6 × 2 accumulators, 2 panel loads and a broadcast fill
/// 15 of AVX2's 16 registers.
const TILE_ROWS: usize = 6;

/// W [K × N] in the form its products read fastest on this CPU.
pub(super) enum RecurrentWeights<'a> {
    /// Packed 16-column panels for the AVX2 tiles.
    Panels { packed: Tensor, k: usize, n: usize },
    /// Row-major as given, for the `gemm` crate.
    RowMajor { w: View<'a>, k: usize, n: usize },
    /// A row-major copy of a matrix given through other strides: the
    /// crate would repack those on every call.
    Copied { w: Tensor, k: usize, n: usize },
}

impl<'a> RecurrentWeights<'a> {
    /// `w` viewed as K × N (any strides): packed when the AVX2 tiles are
    /// the fastest kernels here, else row-major for the `gemm` crate.
    pub fn new(w: View<'a>, k: usize, n: usize) -> Result<Self> {
        if panels_pay() {
            return Self::packed(w, k, n);
        }
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

    /// N, the columns of every product.
    pub fn cols(&self) -> usize {
        match self {
            Self::Panels { n, .. } | Self::RowMajor { n, .. } | Self::Copied { n, .. } => *n,
        }
    }

    /// Packed panels wherever the CPU has AVX2 and FMA, else the matrix
    /// as it is.
    fn packed(w: View<'a>, k: usize, n: usize) -> Result<Self> {
        if !avx2_fma() {
            return Ok(Self::RowMajor { w, k, n });
        }
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

    /// dst [rows × N] (row-major, contiguous) = lhs [rows × K] · W, where
    /// row r of lhs is `lhs[r·lhs_stride..][..K]`.
    pub fn product(&self, dst: &mut [f32], rows: usize, lhs: &[f32], lhs_stride: usize) {
        match self {
            Self::RowMajor { w, k, n } => gemm(dst, rows, *n, *k, lhs, lhs_stride, *w),
            Self::Copied { w, k, n } => {
                gemm(dst, rows, *n, *k, lhs, lhs_stride, View::rm(w.data(), *n));
            }
            Self::Panels { packed, k, n } => {
                let (k, n) = (*k, *n);
                assert!(dst.len() >= rows * n, "panel product: dst too small");
                assert!(
                    rows == 0 || (rows - 1) * lhs_stride + k <= lhs.len(),
                    "panel product: lhs too small"
                );
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `packed` found AVX2 and FMA before packing; the
                // asserts bound every row read and written.
                unsafe {
                    avx2::product(dst, rows, n, k, lhs, lhs_stride, packed.data());
                }
                #[cfg(not(target_arch = "x86_64"))]
                unreachable!("panels ({} floats) are packed only on x86_64", packed.len());
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

/// Whether the AVX2 panel tiles beat the `gemm` crate here: AVX2 and FMA,
/// and AVX2 the widest kernels in force (no AVX-512F, or
/// `HEADROOM_CPU_KERNELS=avx2`).
fn panels_pay() -> bool {
    #[cfg(target_arch = "x86_64")]
    let avx512 = cpu_kernels() == CpuKernels::Auto && is_x86_feature_detected!("avx512f");
    #[cfg(not(target_arch = "x86_64"))]
    let avx512 = false;
    avx2_fma() && !avx512
}

fn avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    return is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{PANEL, TILE_ROWS};

    /// Panel by panel (16·K floats, in L1 for K up to about 1000), the
    /// rows six at a time.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn product(
        dst: &mut [f32],
        rows: usize,
        n: usize,
        k: usize,
        lhs: &[f32],
        lhs_stride: usize,
        packed: &[f32],
    ) {
        for (panel, weights) in packed.chunks_exact(k * PANEL).enumerate() {
            let cols = (n - panel * PANEL).min(PANEL);
            let mut first = 0;
            while first < rows {
                let tile = Tile {
                    first,
                    col: panel * PANEL,
                    cols,
                    n,
                    k,
                    lhs_stride,
                };
                first += match rows - first {
                    1 => tile.run::<1>(dst, lhs, weights),
                    2 => tile.run::<2>(dst, lhs, weights),
                    3 => tile.run::<3>(dst, lhs, weights),
                    4 => tile.run::<4>(dst, lhs, weights),
                    5 => tile.run::<5>(dst, lhs, weights),
                    _ => tile.run::<TILE_ROWS>(dst, lhs, weights),
                };
            }
        }
    }

    /// Rows first.. and columns col..col + cols of the product.
    struct Tile {
        first: usize,
        col: usize,
        cols: usize,
        n: usize,
        k: usize,
        lhs_stride: usize,
    }

    impl Tile {
        /// R rows; returns R.
        #[target_feature(enable = "avx2,fma")]
        unsafe fn run<const R: usize>(
            &self,
            dst: &mut [f32],
            lhs: &[f32],
            weights: &[f32],
        ) -> usize {
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            let w = weights.as_ptr();
            let x = lhs.as_ptr().add(self.first * self.lhs_stride);
            for kk in 0..self.k {
                // SAFETY (all loads): kk < K, the panel holds K·16 floats,
                // and rows first..first + R of lhs hold K values each.
                let w0 = _mm256_loadu_ps(w.add(kk * PANEL));
                let w1 = _mm256_loadu_ps(w.add(kk * PANEL + 8));
                for (r, acc) in acc.iter_mut().enumerate() {
                    let v = _mm256_broadcast_ss(&*x.add(r * self.lhs_stride + kk));
                    acc[0] = _mm256_fmadd_ps(v, w0, acc[0]);
                    acc[1] = _mm256_fmadd_ps(v, w1, acc[1]);
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                let at = (self.first + r) * self.n + self.col;
                if self.cols == PANEL {
                    let out = dst[at..at + PANEL].as_mut_ptr();
                    _mm256_storeu_ps(out, acc[0]);
                    _mm256_storeu_ps(out.add(8), acc[1]);
                } else {
                    let mut whole = [0.0f32; PANEL];
                    _mm256_storeu_ps(whole.as_mut_ptr(), acc[0]);
                    _mm256_storeu_ps(whole.as_mut_ptr().add(8), acc[1]);
                    dst[at..at + self.cols].copy_from_slice(&whole[..self.cols]);
                }
            }
            R
        }
    }
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
                    acc = lhs[r * stride + kk]
                        .mul_add(w.data[kk * w.row_stride + j * w.col_stride], acc);
                }
                out[r * n + j] = acc;
            }
        }
        out
    }

    /// Row counts around the 6-row tile and widths around the 16-column
    /// panel (a part-filled last panel), against a transposed view too:
    /// the reference's bits wherever the CPU has AVX2 and FMA (packed
    /// even where `new` would keep the gemm crate).
    #[test]
    fn products_match_one_fma_chain_per_output() {
        for (rows, k, n) in [
            (1, 3, 5),
            (6, 16, 16),
            (7, 33, 40),
            (13, 64, 48),
            (16, 20, 12),
        ] {
            for transposed in [false, true] {
                let wdata = values(k * n, n);
                let w = match transposed {
                    false => View::rm(&wdata, n),
                    true => View::cm(&wdata, k),
                };
                let stride = k + 3;
                let lhs = values(rows * stride, rows);
                let weights = RecurrentWeights::packed(w, k, n).unwrap();
                let mut got = vec![f32::NAN; rows * n];
                weights.product(&mut got, rows, &lhs, stride);
                let want = reference(&lhs, stride, rows, w, k, n);
                let packed = matches!(weights, RecurrentWeights::Panels { .. });
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    let close = (a - b).abs() <= 1e-4 * (1.0 + b.abs());
                    assert!(
                        close,
                        "{rows}x{k}x{n} transposed {transposed}: [{i}] {a} against {b}"
                    );
                    if packed {
                        assert_eq!(a.to_bits(), b.to_bits(), "{rows}x{k}x{n}: [{i}]");
                    }
                }
            }
        }
    }
}
