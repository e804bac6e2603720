//! Convolutions with fewer than 16 output channels (a frame predictor's
//! last layer to one channel, an RGB head), which the direct tiles do not
//! take. Through im2col + `gemm` each pass was a product with one to
//! fifteen columns behind an im2col copy of k·k·Cin floats per pixel
//! (`conv_lstm`'s 17 -> 1 head at batch 16: 400 MB written and read back
//! per pass), and dX ended in a col2im scatter into a zeroed dX. Here
//! nothing the size of im2col is made, and every pass vectorises along
//! a kernel row's run of input, the channels, or the image's columns:
//! - forward, where a kernel row reads 16 or more inputs: that row of a
//!   receptive field is a contiguous run of k·Cin floats in NHWC, so each
//!   output is a dot product along its k runs, lanes apart, the lanes
//!   summed in a fixed tree at the end (explicit AVX-512/AVX2 loops, the
//!   same operations as the portable one). Shorter kernel rows (Cin of 5
//!   or less at 3×3): the input channel-planar (split by column phase for
//!   a stride), 16 neighbouring outputs reading 16 consecutive floats per
//!   (ky, c, kx) term against one broadcast weight;
//! - dW: dW[ky][run] += dY·run, the run's 16-float blocks held in
//!   registers while ox walks the row;
//! - dX at stride 1: each input pixel's whole blocks of 16 channels sum
//!   dY·Wᵀ over the (ky, kx, output channel) terms, dY read from a
//!   zero-padded copy and broadcast, four pixels at a time, stored straight
//!   into the pixel; the channels after the last whole block along 16
//!   input columns instead. At a larger stride each input pixel gathers
//!   dY·Wᵀ over the (tap, output channel) pairs that reach it (tabled once
//!   per call in `Reach`), 16 input channels at a time.
//!
//! `conv_lstm`'s head (17 -> 1, batch 160 frames, 2 threads), forward +
//! backward: 46 ms through im2col, 18.4 ms with channel-planar forward
//! and dX along the columns, 12.5 ms now (`conv_bench`, see docs/measurements/cpu-epyc-avx512.md).
//!
//! Loops are compiled for the CPU's widest vectors (`vector_math::wide`)
//! with plain multiplies and adds in a fixed order per output, lanes
//! apart, so the bits depend on neither the vector width nor the thread
//! count.

use std::mem::MaybeUninit;

use super::{with_scratch, Geom};
use crate::layers::vector_math::wide;
use crate::memory::try_zeroed;
use crate::Result;

/// Lanes of a dot product, and input channels a pixel's dX accumulates at
/// once (one zmm or two ymm).
const LANES: usize = 16;

/// Whether the narrow kernels take this geometry: fewer than 16 outputs.
pub(super) fn takes(g: &Geom) -> bool {
    #[cfg(test)]
    if super::tests::FORCE_GEMM.get() {
        return false;
    }
    g.cout < 16
}

/// Whether the narrow dX takes it: at most MAX_TERMS (tap, output channel)
/// pairs reach a pixel.
pub(super) fn takes_grad_input(g: &Geom) -> bool {
    takes(g) && g.k * g.k * g.cout <= MAX_TERMS
}

/// Terms of one input pixel's gradient: (dY value, start of its Cin
/// weights in `wt`, Wᵀ per tap [k·k, cout, cin]), at most MAX_TERMS.
const MAX_TERMS: usize = 64;

// ---------------------------------------------------------------------------
// Forward and dW: input rows channel-planar, 16 output columns at a time.

/// W as [cout, k·k·cin] (stored [k·k·cin, cout]): one output channel's
/// weights in (ky, kx, c) order.
pub(super) fn by_output(g: &Geom, w: &[f32]) -> Result<Vec<f32>> {
    let mut by_out = try_zeroed(w.len())?;
    for (j, row) in w.chunks_exact(g.cout).enumerate() {
        for (co, &v) in row.iter().enumerate() {
            by_out[co * g.kk + j] = v;
        }
    }
    Ok(by_out)
}

/// Output columns rounded up to whole blocks of LANES.
fn blocks(g: &Geom) -> usize {
    g.ow.div_ceil(LANES)
}

/// One image's input rows, channel-planar, split by column phase (so that
/// a stride reads consecutive floats) and zero-padded: for input row iy,
/// channel c and phase ph, `row(iy, c, ph)[m]` is x[iy][m·stride + ph − pad][c]
/// (0 outside the image), for m in 0..span. Tap kx of output column ox
/// reads `row(iy, c, kx % stride)[ox + kx / stride]`: 16 consecutive
/// outputs read 16 consecutive floats.
struct Planes<'a> {
    data: &'a mut [f32],
    span: usize,
    stride: usize,
    cin: usize,
}

/// Columns and channels `Planes::build` transposes at once.
const TILE: usize = 16;

impl<'a> Planes<'a> {
    fn span(g: &Geom) -> usize {
        blocks(g) * LANES + (g.k - 1) / g.stride
    }

    fn len(g: &Geom) -> usize {
        g.h * g.cin * g.stride * Self::span(g)
    }

    /// Lays out `img` ([h, w, cin]) in `data` (at least `len(g)` floats):
    /// per input row and phase, the columns inside the image in blocks of
    /// TILE columns × TILE channels through a local tile, each channel's
    /// run then written whole. Element by element (a bounds-checked
    /// scatter), `perf` put a fifth of the 17 -> 1 head's forward and
    /// backward here; the tiles took its forward at batch 160 on one
    /// thread from 14.3 to 13.7 ms (`conv_bench 1 160 64x64x17:1 auto`):
    /// the rest is reading the input from memory.
    fn build(g: &Geom, img: &[f32], data: &'a mut [f32]) -> Self {
        let span = Self::span(g);
        let (cin, stride) = (g.cin, g.stride);
        let planes = Self {
            data: &mut data[..Self::len(g)],
            span,
            stride,
            cin,
        };
        for iy in 0..g.h {
            let row_in = &img[iy * g.w * cin..][..g.w * cin];
            let rows = &mut planes.data[iy * cin * stride * span..][..cin * stride * span];
            for ph in 0..stride {
                // Columns m with ix = m·stride + ph − pad inside the image.
                let m_lo = g.pad.saturating_sub(ph).div_ceil(stride).min(span);
                let m_hi = (g.w + g.pad)
                    .saturating_sub(ph)
                    .div_ceil(stride)
                    .clamp(m_lo, span);
                for c in 0..cin {
                    let plane = &mut rows[(c * stride + ph) * span..][..span];
                    plane[..m_lo].fill(0.0);
                    plane[m_hi..].fill(0.0);
                }
                for m0 in (m_lo..m_hi).step_by(TILE) {
                    let columns = TILE.min(m_hi - m0);
                    for c0 in (0..cin).step_by(TILE) {
                        let channels = TILE.min(cin - c0);
                        let mut tile = [[0.0f32; TILE]; TILE];
                        for j in 0..columns {
                            let ix = (m0 + j) * stride + ph - g.pad;
                            let pixel = &row_in[ix * cin + c0..][..channels];
                            for (lane, &v) in tile.iter_mut().zip(pixel) {
                                lane[j] = v;
                            }
                        }
                        for (c, lane) in (c0..).zip(&tile[..channels]) {
                            let at = (c * stride + ph) * span + m0;
                            if columns == TILE {
                                // A known length: one vector move, no memcpy call.
                                rows[at..at + TILE].copy_from_slice(lane);
                            } else {
                                rows[at..at + columns].copy_from_slice(&lane[..columns]);
                            }
                        }
                    }
                }
            }
        }
        planes
    }

    /// Where the plane of input row iy, channel c, phase ph starts: tap
    /// kx = ph + j·stride of output column ox reads it at ox + j.
    #[inline(always)]
    fn plane(&self, iy: usize, c: usize, ph: usize) -> usize {
        ((iy * self.cin + c) * self.stride + ph) * self.span
    }
}

/// The input row that kernel row ky of output row oy reads, if inside.
#[inline(always)]
fn input_row(g: &Geom, oy: usize, ky: usize) -> Option<usize> {
    (oy * g.stride + ky)
        .checked_sub(g.pad)
        .filter(|&iy| iy < g.h)
}

/// Blocks of 16 output columns accumulated together (in registers).
const GROUP: usize = 4;

/// y = conv(x, w) + bias for `imgs` images into `out` (their [oh·ow·cout]),
/// every element written once. `w_by_out` is `by_output(w)`. A kernel row
/// of at least LANES inputs is read as runs (`forward_runs`), a shorter
/// one on channel-planar rows.
pub(super) fn forward(
    g: &Geom,
    x: &[f32],
    imgs: usize,
    w_by_out: &[f32],
    bias: Option<&[f32]>,
    out: &mut [MaybeUninit<f32>],
) -> Result<()> {
    if g.k * g.cin >= LANES {
        return forward_runs(g, x, imgs, w_by_out, bias, out);
    }
    with_scratch(Planes::len(g), |scratch| {
        for img in 0..imgs {
            let planes = Planes::build(g, &x[img * g.in_image()..][..g.in_image()], scratch);
            let out_img = &mut out[img * g.opix() * g.cout..][..g.opix() * g.cout];
            wide(
                #[inline(always)]
                || forward_image(g, &planes, w_by_out, bias, out_img),
            );
        }
    })
}

#[inline(always)]
fn forward_image(
    g: &Geom,
    planes: &Planes,
    w_by_out: &[f32],
    bias: Option<&[f32]>,
    out: &mut [MaybeUninit<f32>],
) {
    for (oy, out_row) in out.chunks_exact_mut(g.ow * g.cout).enumerate() {
        for co in 0..g.cout {
            let w_co = &w_by_out[co * g.kk..][..g.kk];
            let b = bias.map_or(0.0, |b| b[co]);
            let mut first = 0;
            while first < blocks(g) {
                let count = GROUP.min(blocks(g) - first);
                let acc = match count {
                    1 => widen(forward_blocks::<1>(g, planes, w_co, oy, first)),
                    2 => widen(forward_blocks::<2>(g, planes, w_co, oy, first)),
                    3 => widen(forward_blocks::<3>(g, planes, w_co, oy, first)),
                    _ => forward_blocks::<GROUP>(g, planes, w_co, oy, first),
                };
                for (i, lanes) in acc.iter().take(count).enumerate() {
                    let ox0 = (first + i) * LANES;
                    for (l, &v) in lanes.iter().enumerate().take(g.ow.saturating_sub(ox0)) {
                        out_row[(ox0 + l) * g.cout + co].write(b + v);
                    }
                }
                first += count;
            }
        }
    }
}

/// Pads a group of fewer than GROUP blocks to GROUP (the extra never read).
#[inline(always)]
fn widen<const B: usize>(acc: [[f32; LANES]; B]) -> [[f32; LANES]; GROUP] {
    let mut wide = [[0.0; LANES]; GROUP];
    wide[..B].copy_from_slice(&acc);
    wide
}

/// Output row oy, blocks first..first+B, of one output channel: every
/// (ky, c, kx) term in that order (kx by phase where the stride is 2 or more),
/// 16 columns a block, in registers.
#[inline(always)]
fn forward_blocks<const B: usize>(
    g: &Geom,
    planes: &Planes,
    w_co: &[f32],
    oy: usize,
    first: usize,
) -> [[f32; LANES]; B] {
    let mut acc = [[0.0f32; LANES]; B];
    for ky in 0..g.k {
        let Some(iy) = input_row(g, oy, ky) else {
            continue;
        };
        for c in 0..g.cin {
            for ph in 0..g.stride {
                let plane = planes.plane(iy, c, ph) + first * LANES;
                for (j, kx) in (ph..g.k).step_by(g.stride).enumerate() {
                    let wv = w_co[(ky * g.k + kx) * g.cin + c];
                    let src = &planes.data[plane + j..][..B * LANES];
                    for (a, s) in acc.iter_mut().zip(src.chunks_exact(LANES)) {
                        for l in 0..LANES {
                            a[l] += wv * s[l];
                        }
                    }
                }
            }
        }
    }
    acc
}

// ---------------------------------------------------------------------------
// Forward on kernel-row runs, where a run holds at least LANES floats.

/// Where a kernel row's run of k·cin floats is read, LANES at a time:
/// whole blocks from its start and, where the run is not a whole number of
/// blocks, one more ending at its end (its lanes that repeat the last
/// whole block carry zero weights). Every read lies inside the receptive
/// field: no neighbour's value (an inf, say) reaches an output.
fn run_offsets(g: &Geom) -> Vec<usize> {
    let run = g.k * g.cin;
    let mut offsets: Vec<usize> = (0..run / LANES).map(|b| b * LANES).collect();
    if run % LANES != 0 {
        offsets.push(run - LANES);
    }
    offsets
}

/// The weights of each (output channel, kernel row, block of
/// `run_offsets`), LANES floats, zero where a last block repeats lanes.
fn run_weights(g: &Geom, w_by_out: &[f32], offsets: &[usize]) -> Result<Vec<f32>> {
    let run = g.k * g.cin;
    let whole = run / LANES * LANES;
    let mut blocks = try_zeroed(g.cout * g.k * offsets.len() * LANES)?;
    let mut chunks = blocks.chunks_exact_mut(LANES);
    for co in 0..g.cout {
        for ky in 0..g.k {
            let w_row = &w_by_out[co * g.kk + ky * run..][..run];
            for (&off, block) in offsets.iter().zip(&mut chunks) {
                for (l, v) in block.iter_mut().enumerate() {
                    if off % LANES == 0 || off + l >= whole {
                        *v = w_row[off + l];
                    }
                }
            }
        }
    }
    Ok(blocks)
}

/// The forward where a kernel row reads at least LANES inputs: kernel row
/// ky of output pixel ox reads the run of k·cin floats from ox·stride·cin
/// of its zero-padded input row (as dW does), so y = Σ_ky run·w_ky, a
/// dot product along the run, lanes apart, the lanes summed at the end in
/// a fixed tree (`lane_sum`). Nothing is transposed: on `conv_lstm`'s
/// 17 -> 1 head the channel-planar copy was two thirds of the forward.
fn forward_runs(
    g: &Geom,
    x: &[f32],
    imgs: usize,
    w_by_out: &[f32],
    bias: Option<&[f32]>,
    out: &mut [MaybeUninit<f32>],
) -> Result<()> {
    let offsets = run_offsets(g);
    let weights = run_weights(g, w_by_out, &offsets)?;
    let kernel = RunsKernel::for_this_cpu();
    let mut sums = vec![0.0f32; g.ow];
    with_scratch(PaddedRows::len(g), |scratch| {
        for img in 0..imgs {
            let rows = PaddedRows::build(g, &x[img * g.in_image()..][..g.in_image()], scratch);
            let mut taps = Vec::with_capacity(g.k);
            let out_img = &mut out[img * g.opix() * g.cout..][..g.opix() * g.cout];
            for (oy, out_row) in out_img.chunks_exact_mut(g.ow * g.cout).enumerate() {
                for co in 0..g.cout {
                    let per_ky = offsets.len() * LANES;
                    let w_co = &weights[co * g.k * per_ky..][..g.k * per_ky];
                    taps.clear();
                    for ky in 0..g.k {
                        if let Some(iy) = input_row(g, oy, ky) {
                            let row = &rows.data[iy * rows.row..][..rows.row];
                            taps.push((row, &w_co[ky * per_ky..][..per_ky]));
                        }
                    }
                    runs_row(kernel, g, &taps, &offsets, &mut sums);
                    let b = bias.map_or(0.0, |b| b[co]);
                    for (ox, &v) in sums.iter().enumerate() {
                        out_row[ox * g.cout + co].write(b + v);
                    }
                }
            }
        }
    })
}

/// Which loop `runs_row` runs: the same products and sums in the same
/// order in each (the bits do not depend on it), explicit vectors where
/// the CPU has them (written portably, LLVM kept the accumulators in
/// memory and the forward ran 2x slower).
#[derive(Clone, Copy, Debug, PartialEq)]
enum RunsKernel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl RunsKernel {
    fn for_this_cpu() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            use crate::layers::vector_math::{cpu_kernels, CpuKernels};
            if cpu_kernels() == CpuKernels::Auto && is_x86_feature_detected!("avx512f") {
                return Self::Avx512;
            }
            if is_x86_feature_detected!("avx2") {
                return Self::Avx2;
            }
        }
        Self::Portable
    }
}

/// One output row of one output channel, before the bias: sums[ox] =
/// Σ over `taps` (its inside kernel rows: the padded input row and that
/// kernel row's block weights) and `offsets` of the run's products, lanes
/// apart, then `lane_sum`.
fn runs_row(
    kernel: RunsKernel,
    g: &Geom,
    taps: &[(&[f32], &[f32])],
    offsets: &[usize],
    sums: &mut [f32],
) {
    let (step, run) = (g.stride * g.cin, g.k * g.cin);
    let reach = (sums.len().max(1) - 1) * step + run;
    // What makes every vector read of the kernels below in bounds.
    assert!(offsets.iter().all(|&off| off + LANES <= run));
    assert!(taps
        .iter()
        .all(|(row, w)| row.len() >= reach && w.len() >= offsets.len() * LANES));
    match kernel {
        RunsKernel::Portable => runs_row_portable(taps, offsets, step, sums),
        // SAFETY: AVX2 is available (`for_this_cpu`), and every row holds
        // (ox·step + off + LANES) floats for every output pixel and offset
        // (asserted just above), every weight slice its blocks.
        #[cfg(target_arch = "x86_64")]
        RunsKernel::Avx2 => unsafe { runs_simd::row_avx2(taps, offsets, step, sums) },
        // SAFETY: as for AVX2, with AVX-512F available.
        #[cfg(target_arch = "x86_64")]
        RunsKernel::Avx512 => unsafe { runs_simd::row_avx512(taps, offsets, step, sums) },
    }
}

fn runs_row_portable(taps: &[(&[f32], &[f32])], offsets: &[usize], step: usize, sums: &mut [f32]) {
    for (ox, sum) in sums.iter_mut().enumerate() {
        let mut acc = [0.0f32; LANES];
        for &(row, w) in taps {
            for (&off, w) in offsets.iter().zip(w.chunks_exact(LANES)) {
                let xs = &row[ox * step + off..][..LANES];
                for l in 0..LANES {
                    acc[l] += w[l] * xs[l];
                }
            }
        }
        *sum = lane_sum(acc);
    }
}

/// The sum of LANES lanes in a fixed tree (the upper half added to the
/// lower, lane by lane, down to one), as the vector kernels add them.
fn lane_sum(a: [f32; LANES]) -> f32 {
    let s8: [f32; 8] = std::array::from_fn(|l| a[l] + a[l + 8]);
    let s4: [f32; 4] = std::array::from_fn(|l| s8[l] + s8[l + 4]);
    let s2: [f32; 2] = std::array::from_fn(|l| s4[l] + s4[l + 2]);
    s2[0] + s2[1]
}

/// `runs_row` in explicit vectors: several output pixels at a time (their
/// accumulators in registers), each pixel's products w·x (a multiply,
/// then an add, as the portable loop) in (tap, offset) order.
#[cfg(target_arch = "x86_64")]
mod runs_simd {
    use super::LANES;
    use std::arch::x86_64::*;

    /// `lane_sum` of lanes 0..8 + lanes 8..16 (already added): + the upper
    /// four, + the upper two, + lane 1.
    #[target_feature(enable = "avx2")]
    fn sum8(v: __m256) -> f32 {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
        _mm_cvtss_f32(s1)
    }

    /// Pixels ox..ox+P with 16 lanes in one zmm each.
    ///
    /// # Safety
    /// AVX-512F is available; `runs_row`'s bounds hold for these pixels.
    #[target_feature(enable = "avx512f")]
    unsafe fn pixels_avx512<const P: usize>(
        taps: &[(&[f32], &[f32])],
        offsets: &[usize],
        step: usize,
        ox: usize,
        sums: &mut [f32],
    ) {
        let mut acc = [_mm512_setzero_ps(); P];
        for &(row, w) in taps {
            let base = row.as_ptr().add(ox * step);
            for (b, &off) in offsets.iter().enumerate() {
                let wv = _mm512_loadu_ps(w.as_ptr().add(b * LANES));
                for (p, a) in acc.iter_mut().enumerate() {
                    let xv = _mm512_loadu_ps(base.add(p * step + off));
                    *a = _mm512_add_ps(*a, _mm512_mul_ps(wv, xv));
                }
            }
        }
        for (p, a) in acc.into_iter().enumerate() {
            let lo = _mm512_castps512_ps256(a);
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
            sums[ox + p] = sum8(_mm256_add_ps(lo, hi));
        }
    }

    /// Pixels ox..ox+P with 16 lanes in two ymm each.
    ///
    /// # Safety
    /// AVX2 is available; `runs_row`'s bounds hold for these pixels.
    #[target_feature(enable = "avx2")]
    unsafe fn pixels_avx2<const P: usize>(
        taps: &[(&[f32], &[f32])],
        offsets: &[usize],
        step: usize,
        ox: usize,
        sums: &mut [f32],
    ) {
        let mut acc = [[_mm256_setzero_ps(); 2]; P];
        for &(row, w) in taps {
            let base = row.as_ptr().add(ox * step);
            for (b, &off) in offsets.iter().enumerate() {
                let w_at = w.as_ptr().add(b * LANES);
                let wv = [_mm256_loadu_ps(w_at), _mm256_loadu_ps(w_at.add(8))];
                for (p, a) in acc.iter_mut().enumerate() {
                    let x_at = base.add(p * step + off);
                    let xv = [_mm256_loadu_ps(x_at), _mm256_loadu_ps(x_at.add(8))];
                    for h in 0..2 {
                        a[h] = _mm256_add_ps(a[h], _mm256_mul_ps(wv[h], xv[h]));
                    }
                }
            }
        }
        for (p, [lo, hi]) in acc.into_iter().enumerate() {
            sums[ox + p] = sum8(_mm256_add_ps(lo, hi));
        }
    }

    /// Defines `$name`, a whole row of `runs_row`: `$pixels` for $p pixels
    /// at a time (as many accumulators as the registers hold), then for
    /// the pixels left one at a time.
    macro_rules! row_kernel {
        ($name:ident, $feature:literal, $pixels:ident, $p:literal) => {
            /// # Safety
            /// The CPU has the target feature; `runs_row`'s bounds hold.
            #[target_feature(enable = $feature)]
            pub unsafe fn $name(
                taps: &[(&[f32], &[f32])],
                offsets: &[usize],
                step: usize,
                sums: &mut [f32],
            ) {
                let mut ox = 0;
                while ox + $p <= sums.len() {
                    $pixels::<$p>(taps, offsets, step, ox, sums);
                    ox += $p;
                }
                for ox in ox..sums.len() {
                    $pixels::<1>(taps, offsets, step, ox, sums);
                }
            }
        };
    }

    row_kernel!(row_avx512, "avx512f", pixels_avx512, 8);
    row_kernel!(row_avx2, "avx2", pixels_avx2, 4);
}

/// dW of `imgs` images into `dw` ([k·k·cin, cout], overwritten). Kernel
/// row ky of output pixel ox reads the run of k·cin floats from ox·stride·cin
/// in its zero-padded input row, so dW[ky][j] += dY·run[j]: the run's
/// 16-float blocks stay in registers while ox walks the row. Each weight
/// sums over the pixels in order, lanes apart (the bits depend on neither
/// the vector width nor the thread count).
pub(super) fn grad_weight(
    g: &Geom,
    x_g: &[f32],
    dy_g: &[f32],
    imgs: usize,
    dw: &mut [f32],
) -> Result<()> {
    let padded = PaddedRows::len(g);
    let acc_len = g.cout * g.k * run_floats(g);
    with_scratch(padded + acc_len, |scratch| {
        let (rows, acc) = scratch.split_at_mut(padded);
        acc.fill(0.0);
        for img in 0..imgs {
            let rows = PaddedRows::build(g, &x_g[img * g.in_image()..][..g.in_image()], rows);
            let dy_img = &dy_g[img * g.opix() * g.cout..][..g.opix() * g.cout];
            wide(
                #[inline(always)]
                || weight_image(g, &rows, dy_img, acc),
            );
        }
        for (j, row) in dw.chunks_exact_mut(g.cout).enumerate() {
            let (ky, j) = (j / (g.k * g.cin), j % (g.k * g.cin));
            for (co, v) in row.iter_mut().enumerate() {
                *v = acc[(co * g.k + ky) * run_floats(g) + j];
            }
        }
    })
}

/// A kernel row's run, k·cin floats, rounded up to whole blocks.
fn run_floats(g: &Geom) -> usize {
    (g.k * g.cin).div_ceil(LANES) * LANES
}

/// One image's rows with `pad` zero pixels each side and a block of zeros
/// after, so that every run (rounded up to whole blocks) is inside.
struct PaddedRows<'a> {
    data: &'a [f32],
    row: usize,
}

impl<'a> PaddedRows<'a> {
    fn row_len(g: &Geom) -> usize {
        (g.w + 2 * g.pad) * g.cin + LANES
    }

    fn len(g: &Geom) -> usize {
        g.h * Self::row_len(g)
    }

    fn build(g: &Geom, img: &[f32], data: &'a mut [f32]) -> Self {
        let row = Self::row_len(g);
        let data = &mut data[..Self::len(g)];
        let inside = g.w * g.cin;
        for (dst, src) in data.chunks_exact_mut(row).zip(img.chunks_exact(inside)) {
            let (left, rest) = dst.split_at_mut(g.pad * g.cin);
            let (middle, right) = rest.split_at_mut(inside);
            left.fill(0.0);
            middle.copy_from_slice(src);
            right.fill(0.0);
        }
        Self { data, row }
    }
}

/// Blocks of a run accumulated together in registers: 6 zmm, or 12 ymm of
/// AVX2's 16.
const WEIGHT_GROUP: usize = 6;

#[inline(always)]
fn weight_image(g: &Geom, rows: &PaddedRows, dy_img: &[f32], acc: &mut [f32]) {
    let run = run_floats(g);
    let mut blocks = Vec::with_capacity(g.k * run / LANES);
    for oy in 0..g.oh {
        // (input row, offset in the run) of every block of this output row.
        blocks.clear();
        for ky in 0..g.k {
            if let Some(iy) = input_row(g, oy, ky) {
                blocks.extend((0..run).step_by(LANES).map(|j| (iy, ky * run + j)));
            }
        }
        for co in 0..g.cout {
            let acc_co = &mut acc[co * g.k * run..][..g.k * run];
            let dy_row = &dy_img[oy * g.ow * g.cout..][..g.ow * g.cout];
            for group in blocks.chunks(WEIGHT_GROUP) {
                match group.len() {
                    1 => weight_blocks::<1>(g, rows, group, dy_row, co, acc_co),
                    2 => weight_blocks::<2>(g, rows, group, dy_row, co, acc_co),
                    3 => weight_blocks::<3>(g, rows, group, dy_row, co, acc_co),
                    4 => weight_blocks::<4>(g, rows, group, dy_row, co, acc_co),
                    5 => weight_blocks::<5>(g, rows, group, dy_row, co, acc_co),
                    _ => weight_blocks::<WEIGHT_GROUP>(g, rows, group, dy_row, co, acc_co),
                }
            }
        }
    }
}

/// B blocks of dW (`group`: (input row, offset in acc)) over one output
/// row: acc[block] += dY[ox]·x[ox·stride·cin + block], ox in order.
#[inline(always)]
fn weight_blocks<const B: usize>(
    g: &Geom,
    rows: &PaddedRows,
    group: &[(usize, usize)],
    dy_row: &[f32],
    co: usize,
    acc: &mut [f32],
) {
    let run = run_floats(g);
    let mut sums = [[0.0f32; LANES]; B];
    let mut starts = [0usize; B];
    for b in 0..B {
        let (iy, at) = group[b];
        sums[b].copy_from_slice(&acc[at..][..LANES]);
        starts[b] = iy * rows.row + at % run;
    }
    let step = g.stride * g.cin;
    for ox in 0..g.ow {
        let d = dy_row[ox * g.cout + co];
        for b in 0..B {
            let x = &rows.data[starts[b] + ox * step..][..LANES];
            for l in 0..LANES {
                sums[b][l] += d * x[l];
            }
        }
    }
    for (sum, &(_, at)) in sums.iter().zip(group) {
        acc[at..][..LANES].copy_from_slice(sum);
    }
}

// ---------------------------------------------------------------------------
// dX: a gather per input pixel.

/// For each input coordinate along one axis, the (kernel offset, output
/// coordinate) pairs whose tap reads it: o·stride − pad + kk = i.
struct Reach {
    starts: Vec<usize>,
    pairs: Vec<(usize, usize)>,
}

impl Reach {
    fn along(size: usize, out_size: usize, g: &Geom) -> Self {
        let mut starts = Vec::with_capacity(size + 1);
        let mut pairs = Vec::new();
        for i in 0..size {
            starts.push(pairs.len());
            for kk in 0..g.k {
                let Some(at) = (i + g.pad).checked_sub(kk) else {
                    continue;
                };
                if at % g.stride == 0 && at / g.stride < out_size {
                    pairs.push((kk, at / g.stride));
                }
            }
        }
        starts.push(pairs.len());
        Self { starts, pairs }
    }

    #[inline(always)]
    fn of(&self, i: usize) -> &[(usize, usize)] {
        &self.pairs[self.starts[i]..self.starts[i + 1]]
    }
}

/// dX for `imgs` images into `dx` (their [H·W·Cin]), every element written
/// once: each input pixel gathers dY·W over the (tap, output channel)
/// pairs that reach it, in a fixed order, 16 input channels at a time in
/// registers.
pub(super) fn grad_input(
    g: &Geom,
    dy: &[f32],
    imgs: usize,
    wt: &[f32],
    dx: &mut [MaybeUninit<f32>],
) -> Result<()> {
    let rows = Reach::along(g.h, g.oh, g);
    if g.stride == 1 {
        return grad_input_unit_stride(g, dy, imgs, wt, &rows, dx);
    }
    let cols = Reach::along(g.w, g.ow, g);
    wide(
        #[inline(always)]
        || {
            let mut terms = [(0.0f32, 0usize); MAX_TERMS];
            for img in 0..imgs {
                let dy_img = &dy[img * g.opix() * g.cout..][..g.opix() * g.cout];
                let dx_img = &mut dx[img * g.in_image()..][..g.in_image()];
                let mut pixels = dx_img.chunks_exact_mut(g.cin);
                for iy in 0..g.h {
                    for (ix, out) in (&mut pixels).take(g.w).enumerate() {
                        let count = gather_terms(g, rows.of(iy), cols.of(ix), dy_img, &mut terms);
                        gather_pixel(g, &terms[..count], wt, out);
                    }
                }
            }
        },
    );
    Ok(())
}

/// One input pixel's Cin gradients from its terms, 16 channels at a time.
#[inline(always)]
fn gather_pixel(g: &Geom, terms: &[(f32, usize)], wt: &[f32], out: &mut [MaybeUninit<f32>]) {
    let mut chunks = out.chunks_exact_mut(LANES);
    for (c, chunk) in (&mut chunks).enumerate() {
        let mut acc = [0.0f32; LANES];
        for &(d, at) in terms {
            let w16 = &wt[at + c * LANES..][..LANES];
            for l in 0..LANES {
                acc[l] += d * w16[l];
            }
        }
        for (o, &v) in chunk.iter_mut().zip(&acc) {
            o.write(v);
        }
    }
    let first = g.cin / LANES * LANES;
    for (i, o) in chunks.into_remainder().iter_mut().enumerate() {
        let sum = terms
            .iter()
            .fold(0.0f32, |s, &(d, at)| s + d * wt[at + first + i]);
        o.write(sum);
    }
}

/// The (dY, weight offset) pairs that reach one input pixel, given the
/// (ky, oy) pairs of its row and the (kx, ox) pairs of its column: taps in
/// (ky, kx) order, output channels in order. Returns how many.
#[inline(always)]
fn gather_terms(
    g: &Geom,
    rows: &[(usize, usize)],
    cols: &[(usize, usize)],
    dy_img: &[f32],
    terms: &mut [(f32, usize); MAX_TERMS],
) -> usize {
    let mut count = 0;
    for &(ky, oy) in rows {
        for &(kx, ox) in cols {
            let tap = ky * g.k + kx;
            let d_pixel = &dy_img[(oy * g.ow + ox) * g.cout..][..g.cout];
            for (co, &d) in d_pixel.iter().enumerate() {
                terms[count] = (d, (tap * g.cout + co) * g.cin);
                count += 1;
            }
        }
    }
    count
}

// ---------------------------------------------------------------------------
// dX at stride 1: along the channels, a few pixels at a time.

/// dX at stride 1. Input column ix takes tap kx of output column
/// ix + pad − kx, so a (ky, kx, output channel) term reads, for the
/// pixels of an input row, consecutive floats of a zero-padded dY row
/// (zeros where the tap falls outside dY). Each pixel's Cin gradients
/// sum the terms in (ky, kx, output channel) order: whole blocks of 16
/// channels along the channels, DX_PIXELS pixels at a time, stored
/// straight into the pixel; the channels after the last whole block
/// (`tail_channels`) along the columns instead.
fn grad_input_unit_stride(
    g: &Geom,
    dy: &[f32],
    imgs: usize,
    wt: &[f32],
    rows: &Reach,
    dx: &mut [MaybeUninit<f32>],
) -> Result<()> {
    let dy_rows = PaddedDy::len(g);
    let tail = g.cin % LANES;
    with_scratch(dy_rows + tail * LANES, |scratch| {
        let (dy_buf, block) = scratch.split_at_mut(dy_rows);
        for img in 0..imgs {
            let dy_img = &dy[img * g.opix() * g.cout..][..g.opix() * g.cout];
            let padded = PaddedDy::build(g, dy_img, dy_buf);
            let dx_img = &mut dx[img * g.in_image()..][..g.in_image()];
            wide(
                #[inline(always)]
                || unit_stride_image(g, &padded, wt, rows, block, dx_img),
            );
        }
    })
}

/// Input pixels whose whole channel blocks are summed together.
const DX_PIXELS: usize = 4;

#[inline(always)]
fn unit_stride_image(
    g: &Geom,
    dy: &PaddedDy,
    wt: &[f32],
    rows: &Reach,
    block: &mut [f32],
    dx: &mut [MaybeUninit<f32>],
) {
    let mut terms = [(0usize, 0usize); MAX_TERMS];
    let whole = g.cin / LANES * LANES;
    for (iy, dx_row) in dx.chunks_exact_mut(g.w * g.cin).enumerate() {
        // (where the term's dY row holds input column 0's value, its
        // weights in `wt`), in (ky, kx, co) order.
        let mut count = 0;
        for &(ky, oy) in rows.of(iy) {
            for kx in 0..g.k {
                for co in 0..g.cout {
                    let dy_at = dy.at(oy, co) + dy.margin + g.pad - kx;
                    terms[count] = (dy_at, ((ky * g.k + kx) * g.cout + co) * g.cin);
                    count += 1;
                }
            }
        }
        let terms = &terms[..count];
        let mut ix = 0;
        while ix < g.w {
            let pixels = if g.w - ix >= DX_PIXELS { DX_PIXELS } else { 1 };
            for c0 in (0..whole).step_by(LANES) {
                if pixels == DX_PIXELS {
                    channel_block::<DX_PIXELS>(g, dy, wt, terms, ix, c0, dx_row);
                } else {
                    channel_block::<1>(g, dy, wt, terms, ix, c0, dx_row);
                }
            }
            ix += pixels;
        }
        if whole < g.cin {
            tail_channels(g, dy, wt, terms, whole, block, dx_row);
        }
    }
}

/// Channels c0..c0+16 of input pixels ix..ix+P of one row: each sums the
/// terms in order, dY broadcast against 16 weights.
#[inline(always)]
fn channel_block<const P: usize>(
    g: &Geom,
    dy: &PaddedDy,
    wt: &[f32],
    terms: &[(usize, usize)],
    ix: usize,
    c0: usize,
    dx_row: &mut [MaybeUninit<f32>],
) {
    let mut acc = [[0.0f32; LANES]; P];
    for &(dy_at, w_at) in terms {
        let d = &dy.data[dy_at + ix..][..P];
        let w = &wt[w_at + c0..][..LANES];
        for (a, &dv) in acc.iter_mut().zip(d) {
            for l in 0..LANES {
                a[l] += w[l] * dv;
            }
        }
    }
    for (p, a) in acc.iter().enumerate() {
        let out = &mut dx_row[(ix + p) * g.cin + c0..][..LANES];
        for (o, &v) in out.iter_mut().zip(a) {
            o.write(v);
        }
    }
}

/// Channels `first`.. (fewer than 16) of one row, 16 input columns at a
/// time: per channel and term, 16 consecutive dY floats against one
/// broadcast weight; the [channels, 16] block then written pixel by pixel.
#[inline(always)]
fn tail_channels(
    g: &Geom,
    dy: &PaddedDy,
    wt: &[f32],
    terms: &[(usize, usize)],
    first: usize,
    block: &mut [f32],
    dx_row: &mut [MaybeUninit<f32>],
) {
    let channels = g.cin - first;
    for ix0 in (0..g.w).step_by(LANES) {
        for (c, lanes) in (first..g.cin).zip(block.chunks_exact_mut(LANES)) {
            let mut acc = [0.0f32; LANES];
            for &(dy_at, w_at) in terms {
                let wv = wt[w_at + c];
                let d = &dy.data[dy_at + ix0..][..LANES];
                for l in 0..LANES {
                    acc[l] += wv * d[l];
                }
            }
            lanes.copy_from_slice(&acc);
        }
        for l in 0..LANES.min(g.w - ix0) {
            let pixel = &mut dx_row[(ix0 + l) * g.cin + first..][..channels];
            for (c, o) in pixel.iter_mut().enumerate() {
                o.write(block[c * LANES + l]);
            }
        }
    }
}

/// One image's dY as rows per output channel, zero-padded each side: row
/// (oy, co) holds dY[oy][ox][co] at `margin + ox`, zeros around, long
/// enough for every 16-column read of the input columns.
struct PaddedDy<'a> {
    data: &'a [f32],
    row: usize,
    margin: usize,
    cout: usize,
}

impl<'a> PaddedDy<'a> {
    fn margin(g: &Geom) -> usize {
        g.k - 1
    }

    fn row_len(g: &Geom) -> usize {
        g.w.div_ceil(LANES) * LANES + g.pad + Self::margin(g)
    }

    fn len(g: &Geom) -> usize {
        g.oh * g.cout * Self::row_len(g)
    }

    fn build(g: &Geom, dy_img: &[f32], data: &'a mut [f32]) -> Self {
        let (row, margin) = (Self::row_len(g), Self::margin(g));
        let data = &mut data[..Self::len(g)];
        data.fill(0.0);
        for (oy, dy_row) in dy_img.chunks_exact(g.ow * g.cout).enumerate() {
            for (ox, pixel) in dy_row.chunks_exact(g.cout).enumerate() {
                for (co, &v) in pixel.iter().enumerate() {
                    data[(oy * g.cout + co) * row + margin + ox] = v;
                }
            }
        }
        Self {
            data,
            row,
            margin,
            cout: g.cout,
        }
    }

    /// Where row (oy, co) starts.
    #[inline(always)]
    fn at(&self, oy: usize, co: usize) -> usize {
        (oy * self.cout + co) * self.row
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::init::InitRng;

    /// One output row (oh = 1) of a k-row input, one output channel.
    fn geom(w: usize, cin: usize, k: usize, stride: usize) -> Geom {
        let pad = k / 2;
        let ow = (w + 2 * pad - k) / stride + 1;
        let kk = k * k * cin;
        Geom {
            n: 1,
            h: k,
            w,
            cin,
            oh: 1,
            ow,
            cout: 1,
            k,
            stride,
            pad,
            kk,
        }
    }

    fn random(rng: &mut InitRng, len: usize) -> Vec<f32> {
        (0..len).map(|_| rng.normal() as f32).collect()
    }

    /// The portable loop and every vector kernel this CPU has.
    fn kernels() -> Vec<RunsKernel> {
        let mut all = vec![RunsKernel::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") {
                all.push(RunsKernel::Avx2);
            }
            if is_x86_feature_detected!("avx512f") {
                all.push(RunsKernel::Avx512);
            }
        }
        all
    }

    /// Each kernel's sums for k padded input rows `rows` and weights
    /// `w_by_out` ([k·k·cin], one output channel).
    fn sums(kernel: RunsKernel, g: &Geom, rows: &[f32], w_by_out: &[f32]) -> Vec<f32> {
        let offsets = run_offsets(g);
        let weights = run_weights(g, w_by_out, &offsets).expect("weights");
        let per_ky = offsets.len() * LANES;
        let row_len = rows.len() / g.k;
        let taps: Vec<(&[f32], &[f32])> = (0..g.k)
            .map(|ky| {
                (
                    &rows[ky * row_len..][..row_len],
                    &weights[ky * per_ky..][..per_ky],
                )
            })
            .collect();
        let mut out = vec![f32::NAN; g.ow];
        runs_row(kernel, g, &taps, &offsets, &mut out);
        out
    }

    /// Every kernel gives the portable loop's bits, in whole groups of
    /// pixels and in the single pixels after them, and the portable loop
    /// gives the definition's sums: runs of whole blocks, of whole blocks
    /// and a tail (the overlapping block), at stride 1 and 2, k = 3 and 5.
    #[test]
    fn runs_kernels_agree_bit_for_bit() {
        let mut rng = InitRng::new(7);
        for (w, cin, k, stride) in [
            (21, 17, 3, 1),
            (11, 16, 3, 1),
            (13, 33, 3, 2),
            (9, 40, 5, 1),
        ] {
            let g = geom(w, cin, k, stride);
            let row_len = PaddedRows::row_len(&g);
            let rows = random(&mut rng, k * row_len);
            let w_by_out = random(&mut rng, g.kk);
            let portable = sums(RunsKernel::Portable, &g, &rows, &w_by_out);
            let (run, step) = (k * cin, stride * cin);
            for (ox, &got) in portable.iter().enumerate() {
                let want: f64 = (0..k)
                    .flat_map(|ky| (0..run).map(move |j| (ky, j)))
                    .map(|(ky, j)| {
                        w_by_out[ky * run + j] as f64 * rows[ky * row_len + ox * step + j] as f64
                    })
                    .sum();
                assert!(
                    (got as f64 - want).abs() < 1e-4,
                    "pixel {ox} of {w}x{cin} k{k}/{stride}: {got} vs {want}"
                );
            }
            for kernel in kernels() {
                let got = sums(kernel, &g, &rows, &w_by_out);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got),
                    bits(&portable),
                    "{kernel:?} on {w}x{cin} k{k}/{stride}"
                );
            }
        }
    }

    /// An infinity just before or just after a pixel's receptive field
    /// (the floats a last, overlapping block must not read) leaves that
    /// pixel's sum as it was, in every kernel.
    #[test]
    fn runs_read_only_the_receptive_field() {
        let mut rng = InitRng::new(8);
        let g = geom(12, 17, 3, 1);
        let row_len = PaddedRows::row_len(&g);
        let clean = random(&mut rng, 3 * row_len);
        let w_by_out = random(&mut rng, g.kk);
        let (ox, run, step) = (4, 3 * 17, 17);
        for kernel in kernels() {
            let want = sums(kernel, &g, &clean, &w_by_out)[ox];
            for at in [ox * step - 1, ox * step + run] {
                let mut rows = clean.clone();
                for ky in 0..3 {
                    rows[ky * row_len + at] = f32::INFINITY;
                }
                let got = sums(kernel, &g, &rows, &w_by_out)[ox];
                assert_eq!(got.to_bits(), want.to_bits(), "{kernel:?}, inf at {at}");
            }
        }
    }
}
