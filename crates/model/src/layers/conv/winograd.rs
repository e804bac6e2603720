//! Winograd F(2×2, 3×3) convolution for 3×3, stride 1, padding 1 layers in
//! NHWC: forward, input gradient and weight gradient.
//!
//! What it computes. The output is cut into 2×2 tiles; each reads a 4×4
//! input patch d (zeros outside the image). Per channel pair,
//! y = Aᵀ·[(G·g·Gᵀ) ⊙ (Bᵀ·d·B)]·A, which needs 16 multiplies per tile
//! instead of 36: 2.25× less arithmetic than the direct kernel. Across
//! channels the 16 element-wise products become 16 independent matrix
//! products, M[ξ] = V[ξ]·U[ξ] ([tiles × Cin]·[Cin × Cout]), run by the
//! direct convolution's register-tiled micro-kernel (`direct::tiles`).
//! - input gradient: the same forward on dY with the filter flipped in
//!   space and transposed in channels (a 3×3 s1 p1 convolution's adjoint);
//! - weight gradient: the exact adjoint of the forward,
//!   dU[ξ] = Σ_tiles V[ξ]ᵀ·(A·dY·Aᵀ)[ξ], then dW = Gᵀ·dU·G.
//!
//! Accuracy. The transforms only add, subtract and halve, so rounding grows
//! by a small constant over the direct sum (the tests bound it; see
//! `tests::winograd_error_is_close_to_direct`). F(4×4, 3×3) would cut the
//! arithmetic 4× but its transforms multiply by up to 8 and divide by 24,
//! which costs about an order of magnitude in f32 error, and its 6×6 tiles
//! waste more of the 7×7 and 14×14 images of small networks.
//!
//! Memory. Per call: the transformed filter U, 16·Cin·Cout floats (1 MiB
//! for 128→128). Per thread, reused (the convolution's thread-local
//! scratch): one block of transformed inputs V and products M, 16 floats
//! per tile per channel, ~BLOCK_BYTES together; the weight gradient adds
//! one dU, 16·Cin·Cout floats. Nothing is kept between calls.
//!
//! Determinism. Every output is a sum in a fixed order over data that does
//! not depend on how the batch is split across threads: a tile's forward
//! depends on that tile alone, and the weight gradient sums blocks of tiles
//! of a fixed group of images in a fixed order (the groups are the direct
//! path's). The transforms use no fused multiply-add, so the AVX2, AVX-512
//! and portable builds of them round identically.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::direct::{self, Init, Steps, NR};
use super::{par_build, with_scratch, Geom};
use crate::memory::try_zeroed;
use crate::Result;

/// Positions of a transformed 4×4 tile.
const XI: usize = 16;

/// Target bytes of one block of V and M together (per thread): small enough
/// to stay in the 1 MiB L2 of a Zen core with U's slice, large enough that
/// the micro-kernel runs long tiles.
const BLOCK_BYTES: usize = 384 * 1024;

/// Lanes the transforms work on at once; every channel count is a multiple.
const LANES: usize = 16;

/// Whether the shape is one this module computes: 3×3, stride 1, padding 1,
/// channel counts in 16s (the micro-kernel's columns, in both directions).
pub(super) fn shape_fits(g: &Geom) -> bool {
    g.k == 3 && g.stride == 1 && g.pad == 1 && g.cin % NR == 0 && g.cout % NR == 0
}

/// The tiling of one image and the block size of one call.
#[derive(Clone, Copy)]
struct Plan {
    h: usize,
    w: usize,
    inputs: usize,
    outputs: usize,
    /// Tiles per image row and column.
    th: usize,
    tw: usize,
    /// Tiles per block.
    block: usize,
}

impl Plan {
    fn new(h: usize, w: usize, inputs: usize, outputs: usize) -> Self {
        Self {
            h,
            w,
            inputs,
            outputs,
            th: h.div_ceil(2),
            tw: w.div_ceil(2),
            block: (BLOCK_BYTES / (4 * XI * (inputs + outputs))).clamp(12, 256),
        }
    }

    fn tiles_per_image(&self) -> usize {
        self.th * self.tw
    }

    /// (image, tile row, tile column) of tile `t`.
    fn tile(&self, t: usize) -> (usize, usize, usize) {
        let per = self.tiles_per_image();
        (t / per, (t % per) / self.tw, t % self.tw)
    }
}

/// G of F(2, 3), [4 × 3]: the filter transform.
const G: [[f32; 3]; 4] = [
    [1.0, 0.0, 0.0],
    [0.5, 0.5, 0.5],
    [0.5, -0.5, 0.5],
    [0.0, 0.0, 1.0],
];

/// U[ξ][i][o] = (G·f·Gᵀ)[ξ] for the 3×3 filter f(ky, kx) = tap(3·ky + kx, i, o).
fn transform_filter(
    inputs: usize,
    outputs: usize,
    tap: impl Fn(usize, usize, usize) -> f32 + Sync,
) -> Result<Vec<f32>> {
    let mut u = try_zeroed(XI * inputs * outputs)?;
    u.par_chunks_mut(inputs * outputs)
        .enumerate()
        .for_each(|(xi, dst)| {
            let (a, b) = (xi / 4, xi % 4);
            for (i, row) in dst.chunks_exact_mut(outputs).enumerate() {
                for (o, v) in row.iter_mut().enumerate() {
                    let mut s = 0.0f32;
                    for ky in 0..3 {
                        for kx in 0..3 {
                            let c = G[a][ky] * G[b][kx];
                            if c != 0.0 {
                                s += c * tap(3 * ky + kx, i, o);
                            }
                        }
                    }
                    *v = s;
                }
            }
        });
    Ok(u)
}

/// Defines `$name` as a function that runs `$body` compiled for AVX-512 or
/// AVX2 where the CPU has them (the element-wise transforms vectorise
/// wider), and as portable code elsewhere. The body has no intrinsics and
/// no fused multiply-adds, so every version computes the same bits.
macro_rules! multiversioned {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$doc])*
        fn $name($($arg: $ty),*) {
            #[inline(always)]
            fn body($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) {
                    body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) {
                    body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has AVX-512F (checked just above).
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU has AVX2 and FMA (checked just above).
                    return unsafe { avx2($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}

multiversioned! {
    /// V[ξ][slot][c] = (Bᵀ·d·B)[ξ] for tiles t0..t0+count of `x` (whose
    /// image 0 is the plan's image 0), slot = t - t0. `zeros` is at least
    /// `plan.inputs` zeros, read for the padding.
    fn transform_input_block(plan: &Plan, x: &[f32], t0: usize, count: usize, zeros: &[f32], v: &mut [f32]) {
        let c = plan.inputs;
        let image = plan.h * plan.w * c;
        let xi_stride = plan.block * c;
        for slot in 0..count {
            let (img, ty, tx) = plan.tile(t0 + slot);
            let src: [&[f32]; XI] = std::array::from_fn(|k| {
                let (iy, ix) = ((2 * ty + k / 4) as isize - 1, (2 * tx + k % 4) as isize - 1);
                if iy < 0 || ix < 0 || iy >= plan.h as isize || ix >= plan.w as isize {
                    &zeros[..c]
                } else {
                    &x[img * image + (iy as usize * plan.w + ix as usize) * c..][..c]
                }
            });
            for c0 in (0..c).step_by(LANES) {
                let mut d = [[0.0f32; LANES]; XI];
                for (dk, s) in d.iter_mut().zip(&src) {
                    dk.copy_from_slice(&s[c0..c0 + LANES]);
                }
                // Bᵀ·d (rows), then ·B (columns); Bᵀ = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1].
                let mut t = [[0.0f32; LANES]; XI];
                for j in 0..4 {
                    for l in 0..LANES {
                        let (d0, d1, d2, d3) = (d[j][l], d[4 + j][l], d[8 + j][l], d[12 + j][l]);
                        t[j][l] = d0 - d2;
                        t[4 + j][l] = d1 + d2;
                        t[8 + j][l] = d2 - d1;
                        t[12 + j][l] = d1 - d3;
                    }
                }
                for i in 0..4 {
                    for l in 0..LANES {
                        let (a0, a1, a2, a3) =
                            (t[4 * i][l], t[4 * i + 1][l], t[4 * i + 2][l], t[4 * i + 3][l]);
                        d[4 * i][l] = a0 - a2;
                        d[4 * i + 1][l] = a1 + a2;
                        d[4 * i + 2][l] = a2 - a1;
                        d[4 * i + 3][l] = a1 - a3;
                    }
                }
                for (k, dk) in d.iter().enumerate() {
                    v[k * xi_stride + slot * c + c0..][..LANES].copy_from_slice(dk);
                }
            }
        }
    }
}

multiversioned! {
    /// Writes the output pixels of tiles t0..t0+count: y = Aᵀ·M·A (+ bias),
    /// Aᵀ = [1 1 1 0; 0 1 -1 -1], into `out` (the task's images), skipping
    /// the pixels of edge tiles that lie outside the image.
    fn transform_output_block(
        plan: &Plan,
        m: &[f32],
        t0: usize,
        count: usize,
        bias: Option<&[f32]>,
        out: &mut [MaybeUninit<f32>],
    ) {
        let c = plan.outputs;
        let image = plan.h * plan.w * c;
        let xi_stride = plan.block * c;
        for slot in 0..count {
            let (img, ty, tx) = plan.tile(t0 + slot);
            for c0 in (0..c).step_by(LANES) {
                let row = |k: usize| &m[k * xi_stride + slot * c + c0..][..LANES];
                // Aᵀ·M: two rows of four.
                let mut p = [[0.0f32; LANES]; 8];
                for j in 0..4 {
                    let (m0, m1, m2, m3) = (row(j), row(4 + j), row(8 + j), row(12 + j));
                    for l in 0..LANES {
                        p[j][l] = m0[l] + m1[l] + m2[l];
                        p[4 + j][l] = m1[l] - m2[l] - m3[l];
                    }
                }
                let mut y = [[0.0f32; LANES]; 4];
                for a in 0..2 {
                    for l in 0..LANES {
                        let (q0, q1, q2, q3) = (p[4 * a][l], p[4 * a + 1][l], p[4 * a + 2][l], p[4 * a + 3][l]);
                        y[2 * a][l] = q0 + q1 + q2;
                        y[2 * a + 1][l] = q1 - q2 - q3;
                    }
                }
                if let Some(bias) = bias {
                    for ya in y.iter_mut() {
                        for (v, b) in ya.iter_mut().zip(&bias[c0..c0 + LANES]) {
                            *v += b;
                        }
                    }
                }
                for (k, yk) in y.iter().enumerate() {
                    let (oy, ox) = (2 * ty + k / 2, 2 * tx + k % 2);
                    if oy < plan.h && ox < plan.w {
                        let at = img * image + (oy * plan.w + ox) * c + c0;
                        for (d, s) in out[at..at + LANES].iter_mut().zip(yk) {
                            d.write(*s);
                        }
                    }
                }
            }
        }
    }
}

multiversioned! {
    /// Z[ξ][slot][c] = (A·dy·Aᵀ)[ξ] for tiles t0..t0+count of `dy` (the
    /// adjoint of the output transform; pixels outside the image read as 0).
    fn transform_grad_block(plan: &Plan, dy: &[f32], t0: usize, count: usize, zeros: &[f32], z: &mut [f32]) {
        let c = plan.outputs;
        let image = plan.h * plan.w * c;
        let xi_stride = plan.block * c;
        for slot in 0..count {
            let (img, ty, tx) = plan.tile(t0 + slot);
            let src: [&[f32]; 4] = std::array::from_fn(|k| {
                let (oy, ox) = (2 * ty + k / 2, 2 * tx + k % 2);
                if oy < plan.h && ox < plan.w {
                    &dy[img * image + (oy * plan.w + ox) * c..][..c]
                } else {
                    &zeros[..c]
                }
            });
            for c0 in (0..c).step_by(LANES) {
                // A·dy: A = [1 0; 1 1; 1 -1; 0 -1], then ·Aᵀ.
                let mut p = [[0.0f32; LANES]; 8];
                for b in 0..2 {
                    let (y0, y1) = (&src[b][c0..c0 + LANES], &src[2 + b][c0..c0 + LANES]);
                    for l in 0..LANES {
                        p[b][l] = y0[l];
                        p[2 + b][l] = y0[l] + y1[l];
                        p[4 + b][l] = y0[l] - y1[l];
                        p[6 + b][l] = -y1[l];
                    }
                }
                let mut q = [[0.0f32; LANES]; XI];
                for i in 0..4 {
                    for l in 0..LANES {
                        let (y0, y1) = (p[2 * i][l], p[2 * i + 1][l]);
                        q[4 * i][l] = y0;
                        q[4 * i + 1][l] = y0 + y1;
                        q[4 * i + 2][l] = y0 - y1;
                        q[4 * i + 3][l] = -y1;
                    }
                }
                for (k, qk) in q.iter().enumerate() {
                    z[k * xi_stride + slot * c + c0..][..LANES].copy_from_slice(qk);
                }
            }
        }
    }
}

/// y[n, h, w, outputs] = conv3x3(x[n, h, w, inputs], padding 1) through the
/// transformed filter `u`, + bias.
#[allow(clippy::too_many_arguments)]
fn convolve(
    n: usize,
    h: usize,
    w: usize,
    inputs: usize,
    outputs: usize,
    x: &[f32],
    u: &[f32],
    bias: Option<&[f32]>,
) -> Result<Vec<f32>> {
    let plan = Plan::new(h, w, inputs, outputs);
    let (in_image, out_image) = (h * w * inputs, h * w * outputs);
    assert!(x.len() == n * in_image && u.len() == XI * inputs * outputs);
    // Several tasks per thread for balance; the split does not change results.
    let per_task = n.div_ceil(4 * rayon::current_num_threads()).max(1);
    // SAFETY: `convolve_images` writes every output pixel of its images:
    // each belongs to exactly one tile.
    unsafe {
        par_build(n * out_image, per_task * out_image, |t, out| {
            let imgs = out.len() / out_image;
            let x_t = &x[t * per_task * in_image..][..imgs * in_image];
            convolve_images(&plan, x_t, imgs, u, bias, out);
        })
    }
}

fn convolve_images(
    plan: &Plan,
    x: &[f32],
    imgs: usize,
    u: &[f32],
    bias: Option<&[f32]>,
    out: &mut [MaybeUninit<f32>],
) {
    let (inputs, outputs, block) = (plan.inputs, plan.outputs, plan.block);
    let tiles = imgs * plan.tiles_per_image();
    let zeros = vec![0.0f32; inputs];
    let rows: Vec<(usize, usize)> = (0..block).map(|t| (t * inputs, t * outputs)).collect();
    let steps = Steps {
        segs: &[(0, 0)],
        len: inputs,
        a_step: 1,
        b_step: outputs as isize,
    };
    with_scratch(XI * block * (inputs + outputs), |buf| {
        let (v, m) = buf.split_at_mut(XI * block * inputs);
        for t0 in (0..tiles).step_by(block) {
            let count = block.min(tiles - t0);
            transform_input_block(plan, x, t0, count, &zeros, v);
            for xi in 0..XI {
                let a = &v[xi * block * inputs..][..count * inputs];
                let b = &u[xi * inputs * outputs..][..inputs * outputs];
                let dst = &mut m[xi * block * outputs..][..count * outputs];
                for co0 in (0..outputs).step_by(NR) {
                    // SAFETY: the caller checked `direct::supports`; row t
                    // reads V[ξ][t][0..inputs] and writes M[ξ][t][co0..+16],
                    // its own; U[ξ] is inputs × outputs with co0 + 16 <= outputs.
                    unsafe {
                        direct::tiles(
                            &rows[..count],
                            a,
                            &b[co0..],
                            &steps,
                            dst.as_mut_ptr().add(co0),
                            dst.len() - co0,
                            Init::Zero,
                        );
                    }
                }
            }
            transform_output_block(plan, m, t0, count, bias, out);
        }
    });
}

/// y = conv(x, w) + bias for a shape `shape_fits` accepts.
pub(super) fn forward(g: &Geom, x: &[f32], w: &[f32], bias: Option<&[f32]>) -> Result<Vec<f32>> {
    let (cin, cout) = (g.cin, g.cout);
    let u = transform_filter(cin, cout, |tap, i, o| w[(tap * cin + i) * cout + o])?;
    convolve(g.n, g.h, g.w, cin, cout, x, &u, bias)
}

/// dX: dY convolved with W flipped in space, its channels transposed.
pub(super) fn grad_input(g: &Geom, dy: &[f32], w: &[f32]) -> Result<Vec<f32>> {
    let (cin, cout) = (g.cin, g.cout);
    let u = transform_filter(cout, cin, |tap, co, ci| {
        w[((8 - tap) * cin + ci) * cout + co]
    })?;
    convolve(g.n, g.h, g.w, cout, cin, dy, &u, None)
}

/// Overwrites `dw` ([3·3·cin × cout]) with the weight gradient of `imgs`
/// images.
pub(super) fn grad_weight(g: &Geom, x_g: &[f32], dy_g: &[f32], imgs: usize, dw: &mut [f32]) {
    let (cin, cout) = (g.cin, g.cout);
    let plan = Plan::new(g.h, g.w, cin, cout);
    let block = plan.block;
    assert!(x_g.len() == imgs * g.in_image() && dy_g.len() == imgs * g.opix() * cout);
    assert!(dw.len() == 9 * cin * cout);
    let tiles = imgs * plan.tiles_per_image();
    let zeros = vec![0.0f32; cin.max(cout)];
    let rows: Vec<(usize, usize)> = (0..cin).map(|ci| (ci, ci * cout)).collect();
    with_scratch(XI * cin * cout + XI * block * (cin + cout), |buf| {
        let (du, rest) = buf.split_at_mut(XI * cin * cout);
        let (v, z) = rest.split_at_mut(XI * block * cin);
        du.fill(0.0);
        for t0 in (0..tiles).step_by(block) {
            let count = block.min(tiles - t0);
            transform_input_block(&plan, x_g, t0, count, &zeros, v);
            transform_grad_block(&plan, dy_g, t0, count, &zeros, z);
            let steps = Steps {
                segs: &[(0, 0)],
                len: count,
                a_step: cin as isize,
                b_step: cout as isize,
            };
            for xi in 0..XI {
                let a = &v[xi * block * cin..][..count * cin];
                let b = &z[xi * block * cout..][..count * cout];
                let dst = &mut du[xi * cin * cout..][..cin * cout];
                for co0 in (0..cout).step_by(NR) {
                    // SAFETY: the caller checked `direct::supports`; row ci
                    // walks V[ξ][·][ci] over `count` tiles and Z[ξ][·][co0..+16];
                    // it accumulates into dU[ξ][ci][co0..+16], its own.
                    unsafe {
                        direct::tiles(
                            &rows,
                            a,
                            &b[co0..],
                            &steps,
                            dst.as_mut_ptr().add(co0),
                            dst.len() - co0,
                            Init::Accumulate,
                        );
                    }
                }
            }
        }
        // dW[ky][kx] = Σ_ξ G[a][ky]·G[b][kx]·dU[ξ], in a fixed order.
        let plane = cin * cout;
        for (tap, dst) in dw.chunks_exact_mut(plane).enumerate() {
            let (ky, kx) = (tap / 3, tap % 3);
            dst.fill(0.0);
            for xi in 0..XI {
                let c = G[xi / 4][ky] * G[xi % 4][kx];
                if c != 0.0 {
                    for (d, s) in dst.iter_mut().zip(&du[xi * plane..][..plane]) {
                        *d += c * s;
                    }
                }
            }
        }
    });
}
