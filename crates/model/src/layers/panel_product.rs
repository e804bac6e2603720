//! Products of a few rows against one weight matrix used many times: the
//! LSTM's h_{t−1}·Wh at each of T steps, and d_pre_t·Whᵀ backward, with a
//! thread's block of samples (tens of rows) against a [H, 4H] matrix.
//!
//! Through the `gemm` crate such a call ran at about 60% of a core's FMA
//! peak with its AVX2 kernels and 80% with its AVX-512 ones: the crate
//! repacks the whole matrix on every call (1 MiB per step for H = 256).
//! Here the matrix is packed once per forward or backward into panels of
//! 32 columns, [⌈N/32⌉][K][32], and a tile streams a panel from L1 while
//! its rows' values are broadcast: 8 rows × 32 columns in two zmm
//! registers with AVX-512, 6 rows × 16 columns (half a panel) in two ymm
//! registers with AVX2. Each output is one chain of FMAs over k in order
//! in both, so the bits depend neither on the vector width nor on the rows
//! in a call (the threads' blocks of samples).
//!
//! Memory: the packed copy, K·N rounded up to 32 columns, from the pool.

use super::activation::par_rows;
#[cfg(target_arch = "x86_64")]
use super::conv::{cpu_kernels, CpuKernels};
use super::matmul::{matmul, View};
use crate::{Result, Tensor};

/// Columns of a panel: two AVX-512 registers, or two tiles of two AVX2 ones.
const PANEL: usize = 32;

/// The tiles that read a packed matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Tiles {
    Avx2,
    Avx512,
}

/// W [K × N] in the form its products read fastest on this CPU.
pub(super) enum RecurrentWeights<'a> {
    /// Packed 32-column panels for our tiles.
    Panels {
        packed: Tensor,
        k: usize,
        n: usize,
        tiles: Tiles,
    },
    /// Row-major as given, for the `gemm` crate (a CPU without AVX2+FMA).
    RowMajor { w: View<'a>, k: usize, n: usize },
    /// A row-major copy of a matrix given through other strides: the
    /// crate would repack those on every call.
    Copied { w: Tensor, k: usize, n: usize },
}

impl<'a> RecurrentWeights<'a> {
    /// `w` viewed as K × N (any strides), for the widest tiles in force:
    /// AVX-512 unless `HEADROOM_CPU_KERNELS=avx2` or the CPU lacks it, then
    /// AVX2+FMA, else row-major for the `gemm` crate.
    pub fn new(w: View<'a>, k: usize, n: usize) -> Result<Self> {
        match widest_tiles() {
            Some(tiles) => Self::packed(w, k, n, tiles),
            None => Self::for_gemm(w, k, n),
        }
    }

    /// N, the columns of every product.
    pub fn cols(&self) -> usize {
        match self {
            Self::Panels { n, .. } | Self::RowMajor { n, .. } | Self::Copied { n, .. } => *n,
        }
    }

    fn packed(w: View<'a>, k: usize, n: usize, tiles: Tiles) -> Result<Self> {
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
        Ok(Self::Panels {
            packed,
            k,
            n,
            tiles,
        })
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
            Self::Panels {
                packed,
                k,
                n,
                tiles,
            } => {
                let product = Product {
                    rows,
                    k: *k,
                    n: *n,
                    lhs_stride,
                };
                assert!(dst.len() >= rows * n, "panel product: dst too small");
                assert!(
                    rows == 0 || (rows - 1) * lhs_stride + k <= lhs.len(),
                    "panel product: lhs too small"
                );
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `widest_tiles` found the tiles' instructions on
                // this CPU; the asserts bound every row read and written,
                // and the panels hold ⌈N/32⌉·K·32 values.
                unsafe {
                    match tiles {
                        Tiles::Avx2 => avx2::product(dst, lhs, packed.data(), product),
                        Tiles::Avx512 => avx512::product(dst, lhs, packed.data(), product),
                    }
                }
                #[cfg(not(target_arch = "x86_64"))]
                unreachable!(
                    "{tiles:?} panels ({} values, {product:?}) are packed only on x86_64",
                    packed.len()
                );
            }
        }
    }
}

/// The shape of one call: [rows × K]·[K × N], lhs rows `lhs_stride` apart.
#[derive(Clone, Copy, Debug)]
struct Product {
    rows: usize,
    k: usize,
    n: usize,
    lhs_stride: usize,
}

fn gemm(dst: &mut [f32], rows: usize, n: usize, k: usize, lhs: &[f32], stride: usize, w: View) {
    let lhs = View {
        data: lhs,
        row_stride: stride,
        col_stride: 1,
    };
    matmul(dst, rows, n, k, lhs, w, false);
}

/// AVX-512 tiles unless held to AVX2 (`HEADROOM_CPU_KERNELS=avx2`) or
/// the CPU lacks AVX-512F; AVX2 tiles on a CPU with AVX2 and FMA; else
/// none (the `gemm` crate).
fn widest_tiles() -> Option<Tiles> {
    #[cfg(target_arch = "x86_64")]
    {
        if cpu_kernels() == CpuKernels::Auto && is_x86_feature_detected!("avx512f") {
            return Some(Tiles::Avx512);
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return Some(Tiles::Avx2);
        }
    }
    None
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Product, PANEL};

    /// Columns of a tile: half a panel.
    const COLS: usize = 16;
    /// Rows of a tile: 6 × 2 accumulators, 2 panel loads and a broadcast
    /// fill 15 of AVX2's 16 registers.
    const ROWS: usize = 6;

    /// Half-panel by half-panel (16·K values, read 64 bytes of each
    /// 128-byte panel row), the rows six at a time.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn product(dst: &mut [f32], lhs: &[f32], packed: &[f32], p: Product) {
        for col in (0..p.n).step_by(COLS) {
            let weights = &packed[(col / PANEL) * p.k * PANEL + col % PANEL..];
            let cols = (p.n - col).min(COLS);
            let mut first = 0;
            while first < p.rows {
                let at = Tile { first, col, cols };
                first += match p.rows - first {
                    1 => at.run::<1>(dst, lhs, weights, p),
                    2 => at.run::<2>(dst, lhs, weights, p),
                    3 => at.run::<3>(dst, lhs, weights, p),
                    4 => at.run::<4>(dst, lhs, weights, p),
                    5 => at.run::<5>(dst, lhs, weights, p),
                    _ => at.run::<ROWS>(dst, lhs, weights, p),
                };
            }
        }
    }

    /// Rows first.. and columns col..col + cols of the product.
    struct Tile {
        first: usize,
        col: usize,
        cols: usize,
    }

    impl Tile {
        /// R rows from `weights`, the tile's first column in panel row 0;
        /// returns R.
        #[target_feature(enable = "avx2,fma")]
        unsafe fn run<const R: usize>(
            &self,
            dst: &mut [f32],
            lhs: &[f32],
            weights: &[f32],
            p: Product,
        ) -> usize {
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            let w = weights.as_ptr();
            let x = lhs.as_ptr().add(self.first * p.lhs_stride);
            for kk in 0..p.k {
                // SAFETY (all loads): kk < K; panel row kk holds the 16
                // columns from here, and rows first..first + R of lhs hold
                // K values each (the caller's asserts).
                let w0 = _mm256_loadu_ps(w.add(kk * PANEL));
                let w1 = _mm256_loadu_ps(w.add(kk * PANEL + 8));
                for (r, acc) in acc.iter_mut().enumerate() {
                    let v = _mm256_broadcast_ss(&*x.add(r * p.lhs_stride + kk));
                    acc[0] = _mm256_fmadd_ps(v, w0, acc[0]);
                    acc[1] = _mm256_fmadd_ps(v, w1, acc[1]);
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                let mut whole = [0.0f32; COLS];
                _mm256_storeu_ps(whole.as_mut_ptr(), acc[0]);
                _mm256_storeu_ps(whole.as_mut_ptr().add(8), acc[1]);
                let at = (self.first + r) * p.n + self.col;
                dst[at..at + self.cols].copy_from_slice(&whole[..self.cols]);
            }
            R
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{Product, PANEL};

    /// Rows of a tile: 8 × 2 accumulators; 16 rows (a 2-thread block of
    /// batch 32) are two whole tiles.
    const ROWS: usize = 8;

    /// Panel by panel (32·K values, in L1 for K up to about 300), the rows
    /// eight at a time.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn product(dst: &mut [f32], lhs: &[f32], packed: &[f32], p: Product) {
        for (panel, weights) in packed.chunks_exact(p.k * PANEL).enumerate() {
            let col = panel * PANEL;
            let cols = (p.n - col).min(PANEL);
            let mut first = 0;
            while first < p.rows {
                let at = Tile { first, col, cols };
                first += match p.rows - first {
                    1 => at.run::<1>(dst, lhs, weights, p),
                    2 => at.run::<2>(dst, lhs, weights, p),
                    3 => at.run::<3>(dst, lhs, weights, p),
                    4 => at.run::<4>(dst, lhs, weights, p),
                    5 => at.run::<5>(dst, lhs, weights, p),
                    6 => at.run::<6>(dst, lhs, weights, p),
                    7 => at.run::<7>(dst, lhs, weights, p),
                    _ => at.run::<ROWS>(dst, lhs, weights, p),
                };
            }
        }
    }

    /// Rows first.. and columns col..col + cols of the product.
    struct Tile {
        first: usize,
        col: usize,
        cols: usize,
    }

    impl Tile {
        /// R rows from the panel `weights`; returns R.
        #[target_feature(enable = "avx512f")]
        unsafe fn run<const R: usize>(
            &self,
            dst: &mut [f32],
            lhs: &[f32],
            weights: &[f32],
            p: Product,
        ) -> usize {
            let mut acc = [[_mm512_setzero_ps(); 2]; R];
            let w = weights.as_ptr();
            let x = lhs.as_ptr().add(self.first * p.lhs_stride);
            for kk in 0..p.k {
                // SAFETY (all loads): kk < K, the panel holds K·32 values,
                // and rows first..first + R of lhs hold K values each.
                let w0 = _mm512_loadu_ps(w.add(kk * PANEL));
                let w1 = _mm512_loadu_ps(w.add(kk * PANEL + 16));
                for (r, acc) in acc.iter_mut().enumerate() {
                    let v = _mm512_set1_ps(*x.add(r * p.lhs_stride + kk));
                    acc[0] = _mm512_fmadd_ps(v, w0, acc[0]);
                    acc[1] = _mm512_fmadd_ps(v, w1, acc[1]);
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                let mut whole = [0.0f32; PANEL];
                _mm512_storeu_ps(whole.as_mut_ptr(), acc[0]);
                _mm512_storeu_ps(whole.as_mut_ptr().add(16), acc[1]);
                let at = (self.first + r) * p.n + self.col;
                dst[at..at + self.cols].copy_from_slice(&whole[..self.cols]);
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
                    let wv = w.data[kk * w.row_stride + j * w.col_stride];
                    acc = lhs[r * stride + kk].mul_add(wv, acc);
                }
                out[r * n + j] = acc;
            }
        }
        out
    }

    /// The tiles this CPU can run.
    fn tiles_here() -> Vec<Tiles> {
        let mut tiles = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                tiles.push(Tiles::Avx2);
            }
            if is_x86_feature_detected!("avx512f") {
                tiles.push(Tiles::Avx512);
            }
        }
        tiles
    }

    /// Row counts around both tiles' heights (6 and 8) and widths around
    /// the 16- and 32-column tiles (part-filled last panels), against a
    /// transposed view too: each kind of tile this CPU has gives the
    /// reference's bits, and `new`'s choice agrees with it.
    #[test]
    fn every_tile_gives_one_fma_chain_per_output() {
        let shapes = [
            (1, 3, 5),
            (6, 16, 16),
            (7, 33, 40),
            (9, 64, 48),
            (17, 20, 70),
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
                let mut weights: Vec<_> = tiles_here()
                    .into_iter()
                    .map(|tiles| RecurrentWeights::packed(w, k, n, tiles).unwrap())
                    .collect();
                weights.push(RecurrentWeights::new(w, k, n).unwrap());
                for weights in weights {
                    let mut got = vec![f32::NAN; rows * n];
                    weights.product(&mut got, rows, &lhs, stride);
                    let what = match &weights {
                        RecurrentWeights::Panels { tiles, .. } => format!("{tiles:?}"),
                        _ => "gemm".to_string(),
                    };
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        let close = (a - b).abs() <= 1e-4 * (1.0 + b.abs());
                        assert!(close, "{what} {rows}x{k}x{n}: [{i}] {a} against {b}");
                        if what != "gemm" {
                            assert_eq!(a.to_bits(), b.to_bits(), "{what} {rows}x{k}x{n}: [{i}]");
                        }
                    }
                }
            }
        }
    }
}
