//! The input gradient of convolutions with fewer than 16 output channels
//! (a frame predictor's last layer to one channel, an RGB head) and an
//! input width the direct tiles do not take (Cin not in 16s). Through
//! im2col + `gemm` it was a product with one to fifteen columns, then a
//! col2im scatter into a zeroed dX (two passes over a dX that is often
//! large: 45 MB for `conv_lstm`'s 17 -> 1 head at batch 16). Here each
//! input pixel gathers dY·W over the (tap, output channel) pairs that
//! reach it, in a fixed order, 16 input channels at a time in registers,
//! and writes its Cin values once: `conv_lstm`'s step 7-8% shorter
//! (`xtask bench-step`, see the README).
//!
//! The forward and the weight gradient stay on im2col + `gemm`: per-pixel
//! dot products (a horizontal sum per output) were no faster there.
//!
//! Loops are compiled for the CPU's widest vectors (`vector_math::wide`)
//! with plain multiplies and adds in a fixed order, so the bits depend on
//! neither the vector width nor the thread count.

use std::mem::MaybeUninit;

use super::super::vector_math::wide;
use super::Geom;

/// Input channels a pixel accumulates at once (one zmm or two ymm).
const LANES: usize = 16;

/// Whether the narrow input gradient takes this geometry: fewer than 16
/// outputs, and at most MAX_TERMS (tap, output channel) pairs a pixel.
pub(super) fn fits(g: &Geom) -> bool {
    #[cfg(test)]
    if super::tests::FORCE_GEMM.get() {
        return false;
    }
    g.cout < 16 && g.k * g.k * g.cout <= MAX_TERMS
}

/// Terms of one input pixel's gradient: (dY value, start of its Cin
/// weights in `wt`, Wᵀ per tap [k·k, cout, cin]), at most MAX_TERMS.
const MAX_TERMS: usize = 64;

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
) {
    wide(
        #[inline(always)]
        || {
            let mut terms = [(0.0f32, 0usize); MAX_TERMS];
            for img in 0..imgs {
                let dy_img = &dy[img * g.opix() * g.cout..][..g.opix() * g.cout];
                let dx_img = &mut dx[img * g.in_image()..][..g.in_image()];
                for (q, out) in dx_img.chunks_exact_mut(g.cin).enumerate() {
                    let count = gather_terms(g, q / g.w, q % g.w, dy_img, &mut terms);
                    let terms = &terms[..count];
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
            }
        },
    );
}

/// The (dY, weight offset) pairs that reach input pixel (iy, ix): taps in
/// (ky, kx) order, output channels in order. Returns how many.
#[inline(always)]
fn gather_terms(
    g: &Geom,
    iy: usize,
    ix: usize,
    dy_img: &[f32],
    terms: &mut [(f32, usize); MAX_TERMS],
) -> usize {
    let mut count = 0;
    for ky in 0..g.k {
        let Some(oy) = output_coordinate(iy, ky, g, g.oh) else {
            continue;
        };
        for kx in 0..g.k {
            let Some(ox) = output_coordinate(ix, kx, g, g.ow) else {
                continue;
            };
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

/// The output coordinate whose tap `kk` reads input coordinate `i`, if
/// there is one: o·stride − pad + kk = i.
#[inline(always)]
fn output_coordinate(i: usize, kk: usize, g: &Geom, size: usize) -> Option<usize> {
    let at = (i + g.pad).checked_sub(kk)?;
    (at % g.stride == 0 && at / g.stride < size).then_some(at / g.stride)
}
