//! Winograd convolution, F(2×2, 3×3) and F(4×4, 3×3) (`Tile`), for 3×3,
//! stride 1, padding 1 layers in NHWC: forward, input gradient and weight
//! gradient.
//!
//! What it computes. The output is cut into m×m tiles (m = 2 or 4); each
//! reads an α×α input patch d (α = m + 2, zeros outside the image). Per
//! channel pair, y = Aᵀ·[(G·g·Gᵀ) ⊙ (Bᵀ·d·B)]·A, which needs α² multiplies
//! per tile instead of 9m²: 16 for 4 outputs (2.25× less arithmetic than
//! the direct kernel) or 36 for 16 (4× less). Across channels the α²
//! element-wise products become α² independent matrix products,
//! M[ξ] = V[ξ]·U[ξ] ([tiles × Cin]·[Cin × Cout]), run by the direct
//! convolution's register-tiled micro-kernel (`direct::tiles`).
//! - input gradient: the same forward on dY with the filter flipped in
//!   space and transposed in channels (a 3×3 s1 p1 convolution's adjoint);
//! - weight gradient: the exact adjoint of the forward,
//!   dU[ξ] = Σ_tiles V[ξ]ᵀ·(A·dY·Aᵀ)[ξ], then dW = Gᵀ·dU·G.
//!
//! Accuracy. F(2×2)'s transforms only add, subtract and halve, so its
//! rounding stays close to the direct sum's (2-5·10⁻⁷ of the largest
//! value, as the direct kernels; `tests::winograd_error_is_close_to_direct`).
//! F(4×4)'s scale by up to 8 and 1/24 and its error is about ten times
//! that, 1-6·10⁻⁶ of the largest value on the reference ResNet's layers
//! (same test): far below what f32 training notices (a training curve
//! stays within 10⁻⁴ of the direct kernels', `tests/winograd_training.rs`).
//! F(4×4) also moves less data (36 transformed values per 16 outputs,
//! against 16 per 4), but its tiles waste 23% of their area on 7×7
//! images (8×8 covered, as with 2×2 tiles) as on 14×14 (16×16 covered): which
//! one `Auto` takes, if any, is measured (`super::winograd_pays`).
//!
//! Memory. Per call: the transformed filter U, α²·Cin·Cout floats (2.25
//! MiB for 128→128 with F(4×4)). Per thread, reused (the convolution's
//! thread-local scratch): a zero-padded copy of a few images (~PAD_BYTES),
//! one block of transformed inputs V and products M, α² floats per tile
//! per channel, ~BLOCK_BYTES together; the weight gradient uses longer
//! blocks of V and the transformed dY (~GRAD_BLOCK_BYTES, 1 MiB; more
//! where dU is large, at most MAX_GRAD_BLOCK_BYTES, 4 MiB) and one dU,
//! α²·Cin·Cout floats; the input gradient also takes Wᵀ per tap,
//! 9·Cin·Cout floats, for its filter transform. Nothing is kept between
//! calls.
//!
//! Determinism. Every output is a sum in a fixed order over data that does
//! not depend on how the batch is split across threads: a tile's forward
//! depends on that tile alone, and the weight gradient sums blocks of tiles
//! of a fixed group of images in a fixed order (the groups are the direct
//! path's). The transforms use no fused multiply-add, so the AVX2, AVX-512
//! and portable builds of them round identically.

// The transforms index small matrices (G[a][ky], cols[j][i]) as the
// algebra writes them; iterators would hide which index is which.
#![allow(clippy::needless_range_loop)]

use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::direct::{self, Init, Steps, NR};
use super::{par_build, with_scratch, Geom};
use crate::memory::try_zeroed;
use crate::{Result, Tensor};

/// Which Winograd algorithm: the output tile it computes at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Tile {
    /// F(2×2, 3×3): 4×4 input patches, 16 multiplies per 4 outputs.
    F2,
    /// F(4×4, 3×3): 6×6 input patches, 36 multiplies per 16 outputs.
    F4,
}

impl Tile {
    /// Outputs along each side of a tile.
    fn m(self) -> usize {
        match self {
            Tile::F2 => 2,
            Tile::F4 => 4,
        }
    }

    /// Inputs along each side of a tile's patch (m + 2 for a 3×3 filter).
    fn alpha(self) -> usize {
        self.m() + 2
    }

    /// Positions ξ of a transformed tile.
    fn xi(self) -> usize {
        self.alpha() * self.alpha()
    }

    /// The filter transform G, [α × 3].
    fn g(self) -> &'static [[f32; 3]] {
        match self {
            Tile::F2 => &G2,
            Tile::F4 => &G4,
        }
    }

    /// G[a][ky]·G[b][kx] for ξ = α·a + b and tap = 3·ky + kx: how much
    /// filter tap `tap` weighs in transformed position ξ.
    fn coefficient(self, xi: usize, tap: usize) -> f32 {
        let (g, alpha) = (self.g(), self.alpha());
        g[xi / alpha][tap / 3] * g[xi % alpha][tap % 3]
    }
}

/// Target bytes of one block of V and M together (per thread): small enough
/// to stay in the 1 MiB L2 of a Zen core with U's slice, large enough that
/// the micro-kernel runs long tiles.
const BLOCK_BYTES: usize = 384 * 1024;

/// Target bytes of one block of V and Z in the weight gradient (per thread).
const GRAD_BLOCK_BYTES: usize = 1 << 20;

/// How many times V's and Z's traffic dU's may be, at most, in the weight
/// gradient (`Plan::for_weight_gradient`).
const REDUCTION_RATIO: usize = 4;

/// Most bytes of one block of V and Z in the weight gradient (per thread).
const MAX_GRAD_BLOCK_BYTES: usize = 4 << 20;

/// Target bytes of the zero-padded copy of a chunk of images (per thread).
const PAD_BYTES: usize = 512 * 1024;

/// Lanes the transforms work on at once (one ymm register; 16 would not
/// fit a 4×4 tile in AVX2's 16 registers); every channel count is a multiple.
const LANES: usize = 8;

/// Whether the shape is one this module computes: 3×3, stride 1, padding 1,
/// channel counts in 16s (the micro-kernel's columns, in both directions).
pub(super) fn shape_fits(g: &Geom) -> bool {
    g.k == 3 && g.stride == 1 && g.pad == 1 && g.cin % NR == 0 && g.cout % NR == 0
}

/// The tiling of one image and the block size of one call.
#[derive(Clone, Copy)]
struct Plan {
    tile: Tile,
    h: usize,
    w: usize,
    inputs: usize,
    outputs: usize,
    /// Tiles per image row and column.
    th: usize,
    tw: usize,
    /// Tiles per block.
    block: usize,
    /// Images padded at once.
    chunk: usize,
    /// How a block of transformed tiles is laid out: tile-major
    /// [slot][ξ][c] (the forward: a tile's transform writes one contiguous
    /// run), or ξ-major [ξ][slot][c] (the weight gradient: each ξ's long
    /// reduction reads one contiguous matrix; tile-major strides there ran
    /// its 4 MiB blocks out of L2, measured 25% slower).
    tile_major: bool,
}

impl Plan {
    /// The forward's plan: blocks of ~BLOCK_BYTES, padded chunks of ~PAD_BYTES.
    fn new(tile: Tile, h: usize, w: usize, inputs: usize, outputs: usize) -> Self {
        let (m, xi) = (tile.m(), tile.xi());
        let (th, tw) = (h.div_ceil(m), w.div_ceil(m));
        let padded_image = (m * th + 2) * (m * tw + 2) * inputs;
        Self {
            tile,
            h,
            w,
            inputs,
            outputs,
            th,
            tw,
            block: (BLOCK_BYTES / (4 * xi * (inputs + outputs))).clamp(12, 256),
            chunk: (PAD_BYTES / (4 * padded_image)).max(1),
            tile_major: true,
        }
    }

    /// (slot stride, ξ stride) of a block of `c`-channel transformed tiles.
    fn strides(&self, c: usize) -> (usize, usize) {
        if self.tile_major {
            (self.tile.xi() * c, c)
        } else {
            (c, self.block * c)
        }
    }

    /// Floats a block of `count` such tiles spans.
    fn span(&self, count: usize, c: usize) -> usize {
        let (slot, xi) = self.strides(c);
        (count.max(1) - 1) * slot + (self.tile.xi() - 1) * xi + c
    }

    /// The weight gradient's plan for groups of `imgs` images: blocks of
    /// ~GRAD_BLOCK_BYTES of V and Z, longer where dU is large. Each block
    /// reads and writes all of dU (α²·Cin·Cout floats) once, while V and Z
    /// cost α²·(Cin + Cout) floats per tile: blocks of
    /// REDUCTION_RATIO·Cin·Cout/(Cin + Cout) tiles keep dU's traffic under
    /// 1/REDUCTION_RATIO of theirs (short blocks ran 7×7×128, dU 2.25 MiB,
    /// at 28 tiles a pass), up to MAX_GRAD_BLOCK_BYTES. A block of at least
    /// one image's tiles is cut to whole images, so that no short block is
    /// left at a chunk's end. Where a block ends does not change the bits:
    /// the micro-kernel adds each product to dU's running value in turn.
    fn for_weight_gradient(
        tile: Tile,
        h: usize,
        w: usize,
        inputs: usize,
        outputs: usize,
        imgs: usize,
    ) -> Self {
        let plan = Self::new(tile, h, w, inputs, outputs);
        let per_image = plan.tiles_per_image();
        let tile_bytes = 4 * plan.tile.xi() * (inputs + outputs);
        let by_reduction = (REDUCTION_RATIO * inputs * outputs / (inputs + outputs))
            .min(MAX_GRAD_BLOCK_BYTES / tile_bytes);
        let tiles = (GRAD_BLOCK_BYTES / tile_bytes)
            .max(by_reduction)
            .clamp(12, 1024)
            .min(imgs.max(1) * per_image);
        let (block, chunk) = if tiles >= per_image {
            let chunk = tiles / per_image;
            (chunk * per_image, chunk)
        } else {
            (tiles, 1)
        };
        Self {
            block,
            chunk,
            tile_major: false,
            ..plan
        }
    }

    /// Rows and columns of a padded image (see `pad_images`).
    fn padded_dims(&self) -> (usize, usize) {
        let m = self.tile.m();
        (m * self.th + 2, m * self.tw + 2)
    }

    fn padded_image(&self) -> usize {
        let (hp, wp) = self.padded_dims();
        hp * wp * self.inputs
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
const G2: [[f32; 3]; 4] = [
    [1.0, 0.0, 0.0],
    [0.5, 0.5, 0.5],
    [0.5, -0.5, 0.5],
    [0.0, 0.0, 1.0],
];

/// G of F(4, 3), [6 × 3] (Lavin and Gray's points 0, ±1, ±2, ∞).
const G4: [[f32; 3]; 6] = [
    [1.0 / 4.0, 0.0, 0.0],
    [-1.0 / 6.0, -1.0 / 6.0, -1.0 / 6.0],
    [-1.0 / 6.0, 1.0 / 6.0, -1.0 / 6.0],
    [1.0 / 24.0, 1.0 / 12.0, 1.0 / 6.0],
    [1.0 / 24.0, -1.0 / 12.0, 1.0 / 6.0],
    [0.0, 0.0, 1.0],
];

/// U[ξ][i][o] = (G·f·Gᵀ)[ξ] for the 3×3 filter whose tap 3·ky + kx is the
/// [inputs × outputs] plane `tap_plane(3·ky + kx)`. Each ξ sums its taps
/// plane by plane, so the sum vectorises over the contiguous plane (one
/// element at a time it took 1.1 ms a call at 64→128, more than a batch
/// of 4 images' products); every element still adds the same terms in the
/// same order, from zero.
fn transform_filter<'w>(
    tile: Tile,
    inputs: usize,
    outputs: usize,
    tap_plane: impl Fn(usize) -> &'w [f32] + Sync,
) -> Result<Vec<f32>> {
    let plane = inputs * outputs;
    let mut u = try_zeroed(tile.xi() * plane)?;
    u.par_chunks_mut(plane).enumerate().for_each(|(xi, dst)| {
        for tap in 0..9 {
            let c = tile.coefficient(xi, tap);
            if c != 0.0 {
                for (d, &f) in dst.iter_mut().zip(&tap_plane(tap)[..plane]) {
                    *d += c * f;
                }
            }
        }
    });
    Ok(u)
}

/// Defines `$name` as a function that runs `$body` compiled for AVX-512 or
/// AVX2 where the CPU has them (AVX-512 unless `cpu_kernels` says AVX2) (the element-wise transforms vectorise
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
                let wide_allowed = crate::layers::vector_math::cpu_kernels()
                    == crate::layers::vector_math::CpuKernels::Auto;
                if wide_allowed && std::arch::is_x86_feature_detected!("avx512f") {
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

/// One vector of lanes; written as arrays so that every build (AVX-512,
/// AVX2, portable) vectorises the same scalar code.
type Lanes = [f32; LANES];

/// LANES floats at p.
///
/// # Safety
/// p..p + LANES is readable.
#[inline(always)]
unsafe fn load_at(p: *const f32) -> Lanes {
    // SAFETY: forwarded from the caller; [f32; N] may be unaligned here.
    unsafe { p.cast::<Lanes>().read_unaligned() }
}

/// Writes LANES floats at p.
///
/// # Safety
/// p..p + LANES is writable.
#[inline(always)]
unsafe fn store_at(p: *mut f32, v: Lanes) {
    // SAFETY: forwarded from the caller.
    unsafe { p.cast::<Lanes>().write_unaligned(v) }
}

#[inline(always)]
fn add(a: Lanes, b: Lanes) -> Lanes {
    let mut r = a;
    for (x, y) in r.iter_mut().zip(b) {
        *x += y;
    }
    r
}

#[inline(always)]
fn sub(a: Lanes, b: Lanes) -> Lanes {
    let mut r = a;
    for (x, y) in r.iter_mut().zip(b) {
        *x -= y;
    }
    r
}

#[inline(always)]
fn neg(a: Lanes) -> Lanes {
    let mut r = a;
    for x in r.iter_mut() {
        *x = -*x;
    }
    r
}

/// Bᵀ·(d0, d1, d2, d3) with Bᵀ = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1].
#[inline(always)]
fn bt(d: [Lanes; 4]) -> [Lanes; 4] {
    [
        sub(d[0], d[2]),
        add(d[1], d[2]),
        sub(d[2], d[1]),
        sub(d[1], d[3]),
    ]
}

/// Aᵀ·(m0, m1, m2, m3) with Aᵀ = [1 1 1 0; 0 1 -1 -1].
#[inline(always)]
fn at(m: [Lanes; 4]) -> [Lanes; 2] {
    [add(add(m[0], m[1]), m[2]), sub(sub(m[1], m[2]), m[3])]
}

/// A·(y0, y1) with A = [1 0; 1 1; 1 -1; 0 -1].
#[inline(always)]
fn a(y: [Lanes; 2]) -> [Lanes; 4] {
    [y[0], add(y[0], y[1]), sub(y[0], y[1]), neg(y[1])]
}

#[inline(always)]
fn scale(a: Lanes, k: f32) -> Lanes {
    let mut r = a;
    for x in r.iter_mut() {
        *x *= k;
    }
    r
}

/// Bᵀ·(d0..d5) of F(4, 3), Bᵀ = [4 0 -5 0 1 0; 0 -4 -4 1 1 0; 0 4 -4 -1 1 0;
/// 0 -2 -1 2 1 0; 0 2 -1 -2 1 0; 0 4 0 -5 0 1], in shared differences.
#[inline(always)]
fn bt6(d: [Lanes; 6]) -> [Lanes; 6] {
    let d4_d2 = sub(d[4], d[2]);
    let d3_d1 = sub(d[3], d[1]);
    [
        add(scale(sub(d[0], d[2]), 4.0), d4_d2),
        sub(add(d[4], d[3]), scale(add(d[1], d[2]), 4.0)),
        add(sub(d[4], d[3]), scale(sub(d[1], d[2]), 4.0)),
        add(d4_d2, scale(d3_d1, 2.0)),
        sub(d4_d2, scale(d3_d1, 2.0)),
        add(scale(sub(d[1], d[3]), 4.0), sub(d[5], d[3])),
    ]
}

/// Aᵀ·(m0..m5) of F(4, 3), Aᵀ = [1 1 1 1 1 0; 0 1 -1 2 -2 0; 0 1 1 4 4 0;
/// 0 1 -1 8 -8 1].
#[inline(always)]
fn at6(m: [Lanes; 6]) -> [Lanes; 4] {
    let (p12, d12) = (add(m[1], m[2]), sub(m[1], m[2]));
    let (p34, d34) = (add(m[3], m[4]), sub(m[3], m[4]));
    [
        add(add(m[0], p12), p34),
        add(d12, scale(d34, 2.0)),
        add(p12, scale(p34, 4.0)),
        add(add(d12, scale(d34, 8.0)), m[5]),
    ]
}

/// A·(y0..y3) of F(4, 3) (the adjoint of `at6`).
#[inline(always)]
fn a6(y: [Lanes; 4]) -> [Lanes; 6] {
    let (p02, p13) = (add(y[0], y[2]), add(y[1], y[3]));
    let (q02, q13) = (
        add(y[0], scale(y[2], 4.0)),
        add(scale(y[1], 2.0), scale(y[3], 8.0)),
    );
    [
        y[0],
        add(p02, p13),
        sub(p02, p13),
        add(q02, q13),
        sub(q02, q13),
        y[3],
    ]
}

/// A 2-D transform T·d·Tᵀ of an N×N block, `get(N·i + j)`, by the 1-D
/// transform `t` (N values in, M out): down each column, then along each
/// row, writing the M×M results to `put(M·i + j)`.
#[inline(always)]
fn separable<const N: usize, const M: usize>(
    get: impl Fn(usize) -> Lanes,
    t: impl Fn([Lanes; N]) -> [Lanes; M],
    mut put: impl FnMut(usize, Lanes),
) {
    // Plain loops over fixed sizes: `array::from_fn` here was left as a
    // call and the lanes went through the stack.
    let mut cols = [[[0.0; LANES]; M]; N];
    for (j, col) in cols.iter_mut().enumerate() {
        let mut column = [[0.0; LANES]; N];
        for (i, v) in column.iter_mut().enumerate() {
            *v = get(N * i + j);
        }
        *col = t(column);
    }
    for i in 0..M {
        let mut row = [[0.0; LANES]; N];
        for (j, v) in row.iter_mut().enumerate() {
            *v = cols[j][i];
        }
        for (j, v) in t(row).into_iter().enumerate() {
            put(M * i + j, v);
        }
    }
}

/// Copies `imgs` images of `x` ([h, w, c]) into `dst` with one zero pixel
/// above and left and enough below and right for whole tiles
/// ([m·th + 2, m·tw + 2, c] each), so that every tile reads a full α×α
/// patch at fixed offsets.
fn pad_images(plan: &Plan, x: &[f32], imgs: usize, dst: &mut [f32]) {
    let c = plan.inputs;
    let (hp, wp) = plan.padded_dims();
    let row = plan.w * c;
    for (img, padded) in dst.chunks_exact_mut(hp * wp * c).take(imgs).enumerate() {
        for (y, out) in padded.chunks_exact_mut(wp * c).enumerate() {
            if (1..=plan.h).contains(&y) {
                let src = &x[(img * plan.h + y - 1) * row..][..row];
                out[..c].fill(0.0);
                out[c..c + row].copy_from_slice(src);
                out[c + row..].fill(0.0);
            } else {
                out.fill(0.0);
            }
        }
    }
}

multiversioned! {
    /// V[slot, ξ][c] = (Bᵀ·d·B)[ξ] (laid out as `plan.strides` says) for tiles t0..t0+count of the padded
    /// images `xp` (tile numbers counted from image 0 of `xp`), slot = t - t0.
    fn transform_input_block(plan: &Plan, xp: &[f32], t0: usize, count: usize, v: &mut [f32]) {
        let (c, m, alpha) = (plan.inputs, plan.tile.m(), plan.tile.alpha());
        let (hp, wp) = plan.padded_dims();
        let row = wp * c;
        let (slot_stride, xi_stride) = plan.strides(c);
        assert!(c % LANES == 0 && v.len() >= plan.span(count, c));
        for slot in 0..count {
            let (img, ty, tx) = plan.tile(t0 + slot);
            let base = (img * hp + m * ty) * row + m * tx * c;
            // The whole α×α patch: rows base + i·row, i < α, of α pixels.
            assert!(base + (alpha - 1) * row + alpha * c <= xp.len());
            let src = xp[base..].as_ptr();
            let dst = v[slot * slot_stride..].as_mut_ptr();
            for c0 in (0..c).step_by(LANES) {
                // SAFETY: c0 + LANES <= c (c is a multiple of LANES), so
                // every read lies in the patch checked above and every
                // write at slot·slot_stride + ξ·xi_stride + c0 < span(count),
                // checked on entry.
                unsafe {
                    let patch = |i: usize, j: usize| load_at(src.add(i * row + j * c + c0));
                    let put = |k: usize, v: Lanes| store_at(dst.add(k * xi_stride + c0), v);
                    // Bᵀ down each column, then along each row.
                    match plan.tile {
                        Tile::F2 => separable::<4, 4>(|k| patch(k / 4, k % 4), bt, put),
                        Tile::F4 => separable::<6, 6>(|k| patch(k / 6, k % 6), bt6, put),
                    }
                }
            }
        }
    }
}

multiversioned! {
    /// Writes the output pixels of tiles t0..t0+count: y = Aᵀ·M[slot]·A (+ bias)
    /// into `out` (the images the tiles are counted from), skipping the
    /// pixels of edge tiles that lie outside the image.
    fn transform_output_block(
        plan: &Plan,
        m: &[f32],
        t0: usize,
        count: usize,
        bias: Option<&[f32]>,
        out: &mut [MaybeUninit<f32>],
    ) {
        let (c, side) = (plan.outputs, plan.tile.m());
        let image = plan.h * plan.w * c;
        let (slot_stride, xi_stride) = plan.strides(c);
        assert!(c % LANES == 0 && m.len() >= plan.span(count, c));
        assert!(bias.is_none_or(|b| b.len() == c));
        for slot in 0..count {
            let (img, ty, tx) = plan.tile(t0 + slot);
            let src = m[slot * slot_stride..].as_ptr();
            // The tile's pixels (row-major, side × side) that lie in the
            // image, and where they go.
            let mut targets = [None; 16];
            for (k, target) in targets.iter_mut().take(side * side).enumerate() {
                let (oy, ox) = (side * ty + k / side, side * tx + k % side);
                if oy < plan.h && ox < plan.w {
                    let at = img * image + (oy * plan.w + ox) * c;
                    // Inside `out`: checked once per pixel.
                    *target = Some(out[at..at + c].as_mut_ptr().cast::<f32>());
                }
            }
            for c0 in (0..c).step_by(LANES) {
                // SAFETY: c0 + LANES <= c, so reads stay in this tile's
                // floats of M (slot·slot_stride + ξ·xi_stride + c0 < span(count),
                // checked on entry) and writes in the c floats of a pixel
                // checked above (MaybeUninit<f32> has f32's layout).
                unsafe {
                    let at_m = |k: usize| load_at(src.add(k * xi_stride + c0));
                    let bias = bias.map(|b| load_at(b.as_ptr().add(c0)));
                    let put = |k: usize, v: Lanes| {
                        if let Some(p) = targets[k] {
                            store_at(p.add(c0), bias.map_or(v, |b| add(v, b)));
                        }
                    };
                    // Aᵀ down each column, then along each row.
                    match plan.tile {
                        Tile::F2 => separable::<4, 2>(at_m, at, put),
                        Tile::F4 => separable::<6, 4>(at_m, at6, put),
                    }
                }
            }
        }
    }
}

multiversioned! {
    /// Z[slot, ξ][c] = (A·dy·Aᵀ)[ξ] (laid out as `plan.strides` says) for tiles t0..t0+count of `dy` (the
    /// adjoint of the output transform; pixels outside the image read as 0).
    fn transform_grad_block(plan: &Plan, dy: &[f32], t0: usize, count: usize, z: &mut [f32]) {
        let (c, side) = (plan.outputs, plan.tile.m());
        let image = plan.h * plan.w * c;
        let (slot_stride, xi_stride) = plan.strides(c);
        assert!(c % LANES == 0 && z.len() >= plan.span(count, c));
        for slot in 0..count {
            let (img, ty, tx) = plan.tile(t0 + slot);
            let mut sources: [Option<*const f32>; 16] = [None; 16];
            for (k, source) in sources.iter_mut().take(side * side).enumerate() {
                let (oy, ox) = (side * ty + k / side, side * tx + k % side);
                if oy < plan.h && ox < plan.w {
                    let at = img * image + (oy * plan.w + ox) * c;
                    *source = Some(dy[at..at + c].as_ptr());
                }
            }
            let dst = z[slot * slot_stride..].as_mut_ptr();
            for c0 in (0..c).step_by(LANES) {
                // SAFETY: c0 + LANES <= c: reads stay in the c floats of a
                // pixel checked above, writes below span(count) of Z (checked
                // on entry).
                unsafe {
                    let y = |k: usize| sources[k].map_or([0.0; LANES], |p| load_at(p.add(c0)));
                    let put = |k: usize, v: Lanes| store_at(dst.add(k * xi_stride + c0), v);
                    // A down each column, then along each row.
                    match plan.tile {
                        Tile::F2 => separable::<2, 4>(y, a, put),
                        Tile::F4 => separable::<4, 6>(y, a6, put),
                    }
                }
            }
        }
    }
}

/// y[n, h, w, outputs] = conv3x3(x[n, h, w, inputs], padding 1) through the
/// transformed filter `u`, + bias.
#[allow(clippy::too_many_arguments)]
fn convolve(
    tile: Tile,
    n: usize,
    h: usize,
    w: usize,
    inputs: usize,
    outputs: usize,
    x: &[f32],
    u: &[f32],
    bias: Option<&[f32]>,
) -> Result<Tensor> {
    let plan = Plan::new(tile, h, w, inputs, outputs);
    let (in_image, out_image) = (h * w * inputs, h * w * outputs);
    assert!(x.len() == n * in_image && u.len() == plan.tile.xi() * inputs * outputs);
    // Several tasks per thread for balance; the split does not change results.
    let per_task = n.div_ceil(4 * rayon::current_num_threads()).max(1);
    // SAFETY: `convolve_images` writes every output pixel of its images:
    // each belongs to exactly one tile.
    unsafe {
        par_build(&[n, h, w, outputs], per_task * out_image, |t, out| {
            let imgs = out.len() / out_image;
            let x_t = &x[t * per_task * in_image..][..imgs * in_image];
            convolve_images(&plan, x_t, imgs, u, bias, out)
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
) -> Result<()> {
    let (inputs, outputs, block, xis) = (plan.inputs, plan.outputs, plan.block, plan.tile.xi());
    let (in_image, out_image) = (plan.h * plan.w * inputs, plan.h * plan.w * outputs);
    let rows: Vec<(usize, usize)> = (0..block)
        .map(|t| (t * xis * inputs, t * xis * outputs))
        .collect();
    let steps = Steps {
        segs: &[(0, 0)],
        len: inputs,
        a_step: 1,
        b_step: outputs as isize,
    };
    let padded_len = plan.chunk.min(imgs) * plan.padded_image();
    with_scratch(padded_len + xis * block * (inputs + outputs), |buf| {
        let (xp, rest) = buf.split_at_mut(padded_len);
        let (v, m) = rest.split_at_mut(xis * block * inputs);
        for i0 in (0..imgs).step_by(plan.chunk) {
            let cc = plan.chunk.min(imgs - i0);
            pad_images(plan, &x[i0 * in_image..][..cc * in_image], cc, xp);
            let out_c = &mut out[i0 * out_image..][..cc * out_image];
            let tiles = cc * plan.tiles_per_image();
            for t0 in (0..tiles).step_by(block) {
                let count = block.min(tiles - t0);
                transform_input_block(plan, xp, t0, count, v);
                for xi in 0..xis {
                    let a = &v[xi * inputs..count * xis * inputs];
                    let b = &u[xi * inputs * outputs..][..inputs * outputs];
                    let dst = &mut m[xi * outputs..count * xis * outputs];
                    let width = direct::tile_width(outputs);
                    for co0 in (0..outputs).step_by(width) {
                        // SAFETY: the caller checked `direct::supports`; row t
                        // reads V[t][ξ][0..inputs] and writes M[t][ξ][co0..+16],
                        // its own; U[ξ] is inputs × outputs with co0 + 16 <= outputs.
                        unsafe {
                            direct::tiles(
                                &rows[..count],
                                a,
                                &b[co0..],
                                &steps,
                                width,
                                dst.as_mut_ptr().add(co0),
                                dst.len() - co0,
                                Init::Zero,
                            );
                        }
                    }
                }
                transform_output_block(plan, m, t0, count, bias, out_c);
            }
        }
    })
}

/// y = conv(x, w) + bias for a shape `shape_fits` accepts.
pub(super) fn forward(
    tile: Tile,
    g: &Geom,
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
) -> Result<Tensor> {
    let (cin, cout) = (g.cin, g.cout);
    let u = transform_filter(tile, cin, cout, |tap| &w[tap * cin * cout..])?;
    convolve(tile, g.n, g.h, g.w, cin, cout, x, &u, bias)
}

/// dX: dY convolved with W flipped in space, its channels transposed
/// (`wt`: Wᵀ per tap, [9, cout, cin]).
pub(super) fn grad_input(tile: Tile, g: &Geom, dy: &[f32], wt: &[f32]) -> Result<Tensor> {
    let (cin, cout) = (g.cin, g.cout);
    let u = transform_filter(tile, cout, cin, |tap| &wt[(8 - tap) * cin * cout..])?;
    convolve(tile, g.n, g.h, g.w, cout, cin, dy, &u, None)
}

/// Overwrites `dw` ([3·3·cin × cout]) with the weight gradient of `imgs`
/// images.
pub(super) fn grad_weight(
    tile: Tile,
    g: &Geom,
    x_g: &[f32],
    dy_g: &[f32],
    imgs: usize,
    dw: &mut [f32],
) -> Result<()> {
    let (cin, cout) = (g.cin, g.cout);
    let plan = Plan::for_weight_gradient(tile, g.h, g.w, cin, cout, imgs);
    let (block, xis) = (plan.block, plan.tile.xi());
    assert!(x_g.len() == imgs * g.in_image() && dy_g.len() == imgs * g.opix() * cout);
    assert!(dw.len() == 9 * cin * cout);
    if imgs == 0 {
        // No block would write dU.
        dw.fill(0.0);
        return Ok(());
    }
    let out_image = g.opix() * cout;
    let rows: Vec<(usize, usize)> = (0..cin).map(|ci| (ci, ci * cout)).collect();
    let padded_len = plan.chunk.min(imgs) * plan.padded_image();
    with_scratch(
        xis * cin * cout + padded_len + xis * block * (cin + cout),
        |buf| {
            let (du, rest) = buf.split_at_mut(xis * cin * cout);
            let (xp, rest) = rest.split_at_mut(padded_len);
            let (v, z) = rest.split_at_mut(xis * block * cin);
            // Chunks and blocks depend on the shape alone, so the order of the
            // sums does too. The first block writes dU, the rest add to it.
            for i0 in (0..imgs).step_by(plan.chunk) {
                let cc = plan.chunk.min(imgs - i0);
                pad_images(
                    &plan,
                    &x_g[i0 * g.in_image()..][..cc * g.in_image()],
                    cc,
                    xp,
                );
                let dy_c = &dy_g[i0 * out_image..][..cc * out_image];
                let tiles = cc * plan.tiles_per_image();
                for t0 in (0..tiles).step_by(block) {
                    let count = block.min(tiles - t0);
                    let init = if i0 == 0 && t0 == 0 {
                        Init::Zero
                    } else {
                        Init::Accumulate
                    };
                    transform_input_block(&plan, xp, t0, count, v);
                    transform_grad_block(&plan, dy_c, t0, count, z);
                    let steps = Steps {
                        segs: &[(0, 0)],
                        len: count,
                        a_step: cin as isize,
                        b_step: cout as isize,
                    };
                    for xi in 0..xis {
                        let a = &v[xi * block * cin..][..count * cin];
                        let b = &z[xi * block * cout..][..count * cout];
                        let dst = &mut du[xi * cin * cout..][..cin * cout];
                        let width = direct::tile_width(cout);
                        for co0 in (0..cout).step_by(width) {
                            // SAFETY: the caller checked `direct::supports`; row ci
                            // walks V[ξ][·][ci] over `count` tiles and
                            // Z[ξ][·][co0..+16]; it accumulates into
                            // dU[ξ][ci][co0..+16], its own.
                            unsafe {
                                direct::tiles(
                                    &rows,
                                    a,
                                    &b[co0..],
                                    &steps,
                                    width,
                                    dst.as_mut_ptr().add(co0),
                                    dst.len() - co0,
                                    init,
                                );
                            }
                        }
                    }
                }
            }
            filter_gradient(tile, cin * cout, du, dw);
        },
    )
}

/// Floats of a plane `filter_gradient` finishes at once: four AVX-512
/// vectors, summed in registers (every plane is a multiple: its channel
/// counts are multiples of 16).
const FILTER_CHUNK: usize = 64;

multiversioned! {
    /// dW[ky][kx] = Σ_ξ G[a][ky]·G[b][kx]·dU[ξ] (ξ = α·a + b), each element
    /// summed over ξ in order from zero; multiply then add, never fused, so
    /// every build rounds alike. It runs chunk by chunk of the plane: the α²
    /// planes' chunks are copied together first (the planes lie a multiple
    /// of 4 KiB apart, so read in place they would share one set of L1
    /// lines), then each tap sums its chunk in registers. Tap by tap over
    /// whole planes (reading dU, 2.25 MiB at 128→128, nine times) it took
    /// 0.32 ms a call at 128→128 with F(4×4), eight calls a backward; this
    /// takes 0.16 ms (one thread, measured in isolation).
    fn filter_gradient(tile: Tile, plane: usize, du: &[f32], dw: &mut [f32]) {
        let xis = tile.xi();
        assert!(plane % FILTER_CHUNK == 0 && du.len() >= xis * plane && dw.len() == 9 * plane);
        // Each tap's nonzero (ξ, coefficient) terms, in ξ order.
        let mut terms = [[(0usize, 0.0f32); 36]; 9];
        let mut counts = [0usize; 9];
        for (tap, (terms, count)) in terms.iter_mut().zip(&mut counts).enumerate() {
            for xi in 0..xis {
                let c = tile.coefficient(xi, tap);
                if c != 0.0 {
                    terms[*count] = (xi, c);
                    *count += 1;
                }
            }
        }
        let mut chunks = [[0.0f32; FILTER_CHUNK]; 36];
        for e0 in (0..plane).step_by(FILTER_CHUNK) {
            for (xi, chunk) in chunks.iter_mut().take(xis).enumerate() {
                chunk.copy_from_slice(&du[xi * plane + e0..][..FILTER_CHUNK]);
            }
            for (tap, (terms, &count)) in terms.iter().zip(&counts).enumerate() {
                let mut sum = [0.0f32; FILTER_CHUNK];
                for &(xi, c) in &terms[..count] {
                    for (s, d) in sum.iter_mut().zip(&chunks[xi]) {
                        *s += c * d;
                    }
                }
                dw[tap * plane + e0..][..FILTER_CHUNK].copy_from_slice(&sum);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The weight gradient's blocks stay within their byte bound however
    /// large the images or the layer, and on the reference ResNet's 7×7×128
    /// layer one block covers a whole group (dU read and written once).
    #[test]
    fn weight_gradient_blocks_are_bounded() {
        for tile in [Tile::F2, Tile::F4] {
            for (h, cin, cout, imgs) in [
                (224, 64, 64, 16),
                (56, 256, 256, 16),
                (28, 32, 32, 16),
                (14, 64, 64, 16),
                (7, 128, 128, 16),
                (5, 16, 16, 3),
                (64, 16, 16, 2),
            ] {
                let plan = Plan::for_weight_gradient(tile, h, h, cin, cout, imgs);
                let tile_bytes = 4 * tile.xi() * (cin + cout);
                let what = format!("{tile:?} {h}x{h} {cin}->{cout}: block {}", plan.block);
                assert!(plan.block >= 1 && plan.chunk >= 1, "{what}");
                assert!(
                    plan.block * tile_bytes <= MAX_GRAD_BLOCK_BYTES.max(12 * tile_bytes),
                    "{what}"
                );
                assert!(plan.block <= plan.chunk * plan.tiles_per_image(), "{what}");
            }
        }
        let plan = Plan::for_weight_gradient(Tile::F4, 7, 7, 128, 128, 16);
        assert_eq!(plan.block, 16 * plan.tiles_per_image());
    }

    /// Asserts that `out[o·plane + e]` has the bits of the definition,
    /// Σ_i c(o, i)·src[i·plane + e] over the nonzero c in order of i, from
    /// zero, for every o < outs and e < plane.
    fn assert_definition(
        out: &[f32],
        src: &[f32],
        plane: usize,
        (outs, ins): (usize, usize),
        c: impl Fn(usize, usize) -> f32,
        what: &str,
    ) {
        for o in 0..outs {
            for e in 0..plane {
                let mut s = 0.0f32;
                for i in 0..ins {
                    let c = c(o, i);
                    if c != 0.0 {
                        s += c * src[i * plane + e];
                    }
                }
                let got = out[o * plane + e];
                assert_eq!(got.to_bits(), s.to_bits(), "{what}: {o}, element {e}");
            }
        }
    }

    /// The chunked filter gradient gives the bits of the definition,
    /// dW[ky][kx] = Σ_ξ G[a][ky]·G[b][kx]·dU[ξ], each element summed over
    /// the nonzero coefficients in ξ order from zero.
    #[test]
    fn filter_gradient_matches_the_definition_bit_for_bit() {
        let plane = 48 * 32;
        let mut rng = crate::init::InitRng::new(11);
        for tile in [Tile::F2, Tile::F4] {
            let du: Vec<f32> = (0..tile.xi() * plane)
                .map(|_| rng.normal() as f32)
                .collect();
            let mut dw = vec![f32::NAN; 9 * plane];
            filter_gradient(tile, plane, &du, &mut dw);
            let coefficient = |tap, xi| tile.coefficient(xi, tap);
            let what = format!("{tile:?} tap");
            assert_definition(&dw, &du, plane, (9, tile.xi()), coefficient, &what);
        }
    }

    /// The plane-wise filter transform gives the bits of the definition,
    /// U[ξ][i][o] = Σ_{ky,kx} G[a][ky]·G[b][kx]·f[ky][kx][i][o], each
    /// element summed over the nonzero coefficients in tap order from zero.
    #[test]
    fn filter_transform_matches_the_definition_bit_for_bit() {
        let (inputs, outputs) = (48, 32);
        let plane = inputs * outputs;
        let mut rng = crate::init::InitRng::new(7);
        let f: Vec<f32> = (0..9 * plane).map(|_| rng.normal() as f32).collect();
        for tile in [Tile::F2, Tile::F4] {
            let u = transform_filter(tile, inputs, outputs, |tap| &f[tap * plane..]).unwrap();
            let coefficient = |xi, tap| tile.coefficient(xi, tap);
            let what = format!("{tile:?} ξ");
            assert_definition(&u, &f, plane, (tile.xi(), 9), coefficient, &what);
        }
    }
}
