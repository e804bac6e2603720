//! Convolutions with fewer than 16 output channels (a frame predictor's
//! last layer to one channel, an RGB head), which the direct tiles do not
//! take. Through im2col + `gemm` each pass was a product with one to
//! fifteen columns behind an im2col copy of k·k·Cin floats per pixel
//! (`conv_lstm`'s 17 -> 1 head at batch 16: 400 MB written and read back
//! per pass), and dX ended in a col2im scatter into a zeroed dX. Here
//! nothing the size of im2col is made, and every pass vectorises along
//! the image's columns or along a kernel row's run of input:
//! - forward: the input image channel-planar (split by column phase for a
//!   stride), so that 16 neighbouring outputs read 16 consecutive floats
//!   per (ky, c, kx) term against one broadcast weight, in registers;
//! - dW: one kernel row of a receptive field is a contiguous run of k·Cin
//!   input floats in NHWC, so dW[ky][run] += dY·run, the run's 16-float
//!   blocks held in registers while ox walks the row;
//! - dX at stride 1: 16 neighbouring input columns read 16 consecutive
//!   floats of a zero-padded dY row per (ky, kx, output channel) term; the
//!   [Cin, 16] block is then written pixel by pixel. At a larger stride
//!   each input pixel gathers dY·Wᵀ over the (tap, output channel) pairs
//!   that reach it (tabled once per call in `Reach`), 16 input channels at
//!   a time.
//!
//! `conv_lstm`'s head, forward + backward: 46 -> 14 ms a step
//! (`xtask bench --profile`, see the README).
//!
//! Loops are compiled for the CPU's widest vectors (`vector_math::wide`)
//! with plain multiplies and adds in a fixed order per output, lanes
//! apart, so the bits depend on neither the vector width nor the thread
//! count.

use std::mem::MaybeUninit;

use super::super::vector_math::wide;
use super::{with_scratch, Geom};
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
/// every element written once. `w_by_out` is `by_output(w)`.
pub(super) fn forward(
    g: &Geom,
    x: &[f32],
    imgs: usize,
    w_by_out: &[f32],
    bias: Option<&[f32]>,
    out: &mut [MaybeUninit<f32>],
) -> Result<()> {
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
        return grad_input_by_columns(g, dy, imgs, wt, &rows, dx);
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
// dX at stride 1: 16 input columns at a time.

/// dX at stride 1, 16 input columns of one channel at a time: input column
/// ix takes tap kx of output column ix + pad − kx, so for each (ky, kx,
/// output channel) term the 16 columns read 16 consecutive floats of a dY
/// row (zero-padded each side) against one broadcast weight. The terms run
/// in the gather's order, (ky, kx, output channel), with zeros where a tap
/// falls outside dY. The [Cin, 16] block is then written pixel by pixel.
fn grad_input_by_columns(
    g: &Geom,
    dy: &[f32],
    imgs: usize,
    wt: &[f32],
    rows: &Reach,
    dx: &mut [MaybeUninit<f32>],
) -> Result<()> {
    let dy_rows = PaddedDy::len(g);
    with_scratch(dy_rows + g.cin * LANES, |scratch| {
        let (dy_buf, block) = scratch.split_at_mut(dy_rows);
        for img in 0..imgs {
            let dy_img = &dy[img * g.opix() * g.cout..][..g.opix() * g.cout];
            let padded = PaddedDy::build(g, dy_img, dy_buf);
            let dx_img = &mut dx[img * g.in_image()..][..g.in_image()];
            wide(
                #[inline(always)]
                || columns_image(g, &padded, wt, rows, block, dx_img),
            );
        }
    })
}

#[inline(always)]
fn columns_image(
    g: &Geom,
    dy: &PaddedDy,
    wt: &[f32],
    rows: &Reach,
    block: &mut [f32],
    dx: &mut [MaybeUninit<f32>],
) {
    let mut terms = [(0usize, 0usize); MAX_TERMS];
    for (iy, dx_row) in dx.chunks_exact_mut(g.w * g.cin).enumerate() {
        for ix0 in (0..g.w).step_by(LANES) {
            // (start of the term's 16 dY values, its weights in `wt`), in
            // (ky, kx, co) order.
            let mut count = 0;
            for &(ky, oy) in rows.of(iy) {
                for kx in 0..g.k {
                    for co in 0..g.cout {
                        let dy_at = dy.at(oy, co) + dy.margin + ix0 + g.pad - kx;
                        terms[count] = (dy_at, ((ky * g.k + kx) * g.cout + co) * g.cin);
                        count += 1;
                    }
                }
            }
            let terms = &terms[..count];
            for c in 0..g.cin {
                let mut acc = [0.0f32; LANES];
                for &(dy_at, w_at) in terms {
                    let wv = wt[w_at + c];
                    let d = &dy.data[dy_at..][..LANES];
                    for l in 0..LANES {
                        acc[l] += wv * d[l];
                    }
                }
                block[c * LANES..][..LANES].copy_from_slice(&acc);
            }
            let valid = LANES.min(g.w - ix0);
            for l in 0..valid {
                let pixel = &mut dx_row[(ix0 + l) * g.cin..][..g.cin];
                for (c, o) in pixel.iter_mut().enumerate() {
                    o.write(block[c * LANES + l]);
                }
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
