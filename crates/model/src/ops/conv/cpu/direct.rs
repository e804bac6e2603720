use super::{pad_into, with_scratch, Geom};
use crate::Result;
use std::mem::MaybeUninit;

pub const MR: usize = 6;
pub const NR: usize = 16;
/// The AVX-512 tile's columns, and its rows at most: 2·MR_WIDE of the
/// 32 zmm registers accumulate.
pub const WIDE: usize = 32;
pub const MR_WIDE: usize = 12;

/// Steps per pass over the rows (see `tiles`).
const PASS_STEPS: usize = 768;

/// A task's images (copied to the thread's scratch), at most about this
/// many bytes unless one image is larger (L2 is 1 MiB per Zen4 core; W,
/// dY and the output share it). 128-768 KiB measured: 256 is as good as
/// any.
pub const CHUNK_BYTES: usize = 256 * 1024;

/// How a tile's accumulators start.
#[derive(Clone, Copy)]
pub enum Init {
    Zero,
    /// From the destination (+=).
    Accumulate,
    /// From 16 floats (the bias).
    Bias(*const f32),
}

/// The reduction walk of one tile: for each segment (a_off, b_off), `len`
/// steps; step i of a segment reads row r's scalar at
/// a[r] + a_off + i·a_step and the 16 columns at b + b_off + i·b_step.
#[derive(Clone, Copy)]
pub struct Steps<'a> {
    pub segs: &'a [(isize, isize)],
    pub len: usize,
    pub a_step: isize,
    pub b_step: isize,
}

/// Whether the direct kernels handle `columns` output columns here.
pub fn supports(columns: usize) -> bool {
    #[cfg(test)]
    if super::tests::FORCE_GEMM.get() {
        return false;
    }
    columns % NR == 0 && simd::available()
}

/// The columns one tile writes for a product with `columns` columns
/// (which `supports`): WIDE where the CPU has AVX-512 (two zmm
/// registers per row; `super::cpu_kernels` can forbid it) and the
/// columns come in 32s, else NR. Both kernels do the same fused
/// multiply-adds in the same order per output, so they agree bit for bit.
pub fn tile_width(columns: usize) -> usize {
    let wide = columns % WIDE == 0
        && super::cpu_kernels() == super::CpuKernels::Auto
        && simd::wide_available();
    if wide {
        WIDE
    } else {
        NR
    }
}

/// The rows of one tile `width` columns wide.
pub fn tile_rows(width: usize) -> usize {
    match width == WIDE {
        true => MR_WIDE,
        false => MR,
    }
}

/// Runs tiles over `rows`: row r walks `a` from rows[r].0 and writes 16
/// floats at dst + rows[r].1 (`dst_len` floats are valid from dst).
///
/// # Safety
/// `supports` returned true; for every row and segment the walk stays
/// inside `a` and `b` (checked in debug builds), and the 16 floats at
/// dst + rows[r].1 are inside dst_len, writable, distinct between rows,
/// and overlap nothing that is read.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tiles(
    rows: &[(usize, usize)],
    a: &[f32],
    b: &[f32],
    st: &Steps,
    width: usize,
    dst: *mut f32,
    dst_len: usize,
    init: Init,
) {
    if cfg!(debug_assertions) {
        check_walk(rows, a.len(), b.len(), st, width, dst_len);
    }
    let (a, b) = (a.as_ptr(), b.as_ptr());
    // Segments run in passes of at most PASS_STEPS steps over all rows,
    // so that the part of b a pass reads (PASS_STEPS × 64 bytes) stays
    // close while every tile reuses it; later passes accumulate. The sums
    // keep their order (acc is stored and reloaded exactly), so passes
    // do not change results. Measured: a few % on the 7x7x128 layers
    // (W is 576 KB) over a single pass; 384-1536 steps do about as well.
    let per_pass = (PASS_STEPS / st.len.max(1)).max(1);
    let mut passes = st.segs.chunks(per_pass).peekable();
    let mut init = init;
    loop {
        let pass = Steps {
            segs: passes.next().unwrap_or(&[]),
            ..*st
        };
        let mut at = 0;
        let mr = tile_rows(width);
        // A block of at most one tile's rows (attention's heads call
        // per block) is that one tile, without a Vec.
        let (one, split);
        let tiles: &[usize] = match (1..=mr).contains(&rows.len()) {
            true => {
                one = [rows.len()];
                &one
            }
            false => {
                split = split_rows(rows.len(), mr);
                &split
            }
        };
        for &n in tiles {
            let t = &rows[at..at + n];
            at += n;
            // SAFETY: forwarded from the caller.
            unsafe {
                let ap = |r: usize| a.add(t[r].0);
                let dp = |r: usize| dst.add(t[r].1);
                macro_rules! tile {
                    ($m:literal) => {
                        if width == WIDE {
                            simd::tile_wide::<$m>(
                                std::array::from_fn(ap),
                                b,
                                &pass,
                                std::array::from_fn(dp),
                                init,
                            )
                        } else {
                            simd::tile::<$m>(
                                std::array::from_fn(ap),
                                b,
                                &pass,
                                std::array::from_fn(dp),
                                init,
                            )
                        }
                    };
                }
                match t.len() {
                    12 => tile!(12),
                    11 => tile!(11),
                    10 => tile!(10),
                    9 => tile!(9),
                    8 => tile!(8),
                    7 => tile!(7),
                    6 => tile!(6),
                    5 => tile!(5),
                    4 => tile!(4),
                    3 => tile!(3),
                    2 => tile!(2),
                    _ => tile!(1),
                }
            }
        }
        init = Init::Accumulate;
        if passes.peek().is_none() {
            break;
        }
    }
}

/// Debug builds (the tests) check every walk against its slices, so that
/// a geometry bug fails loudly instead of reading out of bounds.
fn check_walk(
    rows: &[(usize, usize)],
    a_len: usize,
    b_len: usize,
    st: &Steps,
    width: usize,
    dst_len: usize,
) {
    let span = |off: isize, step: isize| {
        let last = off + (st.len as isize - 1) * step;
        (off.min(last), off.max(last))
    };
    for &(a_off, b_off) in st.segs.iter().filter(|_| st.len > 0) {
        let (lo, hi) = span(b_off, st.b_step);
        assert!(
            lo >= 0 && hi + width as isize <= b_len as isize,
            "b walk out of bounds"
        );
        let (lo, hi) = span(a_off, st.a_step);
        for &(row, _) in rows {
            let row = row as isize;
            assert!(
                row + lo >= 0 && row + hi < a_len as isize,
                "a walk out of bounds"
            );
        }
    }
    assert!(
        rows.iter().all(|&(_, d)| d + width <= dst_len),
        "dst out of bounds"
    );
}

/// Pixels that see the same taps, with their tiles' walk.
struct Class {
    /// (offset into the source, offset into the output) per pixel.
    rows: Vec<(usize, usize)>,
    segs: Vec<(isize, isize)>,
    len: usize,
}

/// Groups positions 0..n by `key`: the distinct keys in first-seen
/// order, and each position's index among them.
fn classify<K: PartialEq + Copy>(n: usize, key: impl Fn(usize) -> K) -> (Vec<K>, Vec<usize>) {
    let mut keys = Vec::new();
    let idx = (0..n)
        .map(|i| {
            let k = key(i);
            keys.iter().position(|&x| x == k).unwrap_or_else(|| {
                keys.push(k);
                keys.len() - 1
            })
        })
        .collect();
    (keys, idx)
}

/// The taps t of one axis with 0 <= o·s - p + t < size, as a range.
fn valid_taps(o: usize, g: &Geom, size: usize) -> (usize, usize) {
    let start = (o * g.stride) as isize - g.pad as isize;
    let k = g.k as isize;
    let lo = (-start).clamp(0, k);
    let hi = (size as isize - start).clamp(lo, k);
    (lo as usize, hi as usize)
}

/// The forward of `imgs` images: writes all of `out` ([imgs·oh·ow × cout]).
///
/// Rows are output pixels, columns output channels; the walk is the
/// pixel's valid taps × input channels, along W's rows. Taps that fall in
/// the padding are skipped, not multiplied by zeros: pixels are grouped by
/// which taps are valid (interior, each edge, each corner) and a tile
/// takes 6 pixels of one group, from anywhere in the task's images. That
/// is 5% of the work at 28x28, 9% at 14x14, 18% at 7x7 (what oneDNN
/// skips too), and no padded copy of the input is needed.
pub fn forward(
    g: &Geom,
    x: &[f32],
    imgs: usize,
    w: &[f32],
    bias: Option<&[f32]>,
    out: &mut [MaybeUninit<f32>],
) -> Result<()> {
    let opix = g.opix();
    assert!(out.len() == imgs * opix * g.cout && x.len() == imgs * g.in_image());
    assert!(w.len() == g.kk * g.cout && g.cout % NR == 0);
    assert!(bias.is_none_or(|b| b.len() == g.cout));
    let (ykeys, ycls) = classify(g.oh, |oy| valid_taps(oy, g, g.h));
    let (xkeys, xcls) = classify(g.ow, |ox| valid_taps(ox, g, g.w));
    let mut classes: Vec<Class> = Vec::with_capacity(ykeys.len() * xkeys.len());
    for &(ky0, ky1) in &ykeys {
        for &(kx0, kx1) in &xkeys {
            let segs = if kx0 < kx1 {
                (ky0..ky1)
                    .map(|ky| {
                        let a = (ky - ky0) * g.w * g.cin;
                        let b = (ky * g.k + kx0) * g.cin * g.cout;
                        (a as isize, b as isize)
                    })
                    .collect()
            } else {
                Vec::new()
            };
            classes.push(Class {
                rows: Vec::new(),
                segs,
                // The valid taps of a kernel row are consecutive pixels
                // and consecutive rows of W: one segment of (kx1-kx0)·cin
                // steps per kernel row.
                len: (kx1 - kx0) * g.cin,
            });
        }
    }
    // A pixel's row starts at its first valid tap: (oy·s - p + ky0,
    // ox·s - p + kx0), inside the image; the segments walk the valid
    // taps only.
    for i in 0..imgs {
        for oy in 0..g.oh {
            let (ky0, ky1) = ykeys[ycls[oy]];
            for ox in 0..g.ow {
                let (kx0, kx1) = xkeys[xcls[ox]];
                let class = &mut classes[ycls[oy] * xkeys.len() + xcls[ox]];
                let a = if ky0 < ky1 && kx0 < kx1 {
                    let iy = oy * g.stride + ky0 - g.pad;
                    let ix = ox * g.stride + kx0 - g.pad;
                    i * g.in_image() + (iy * g.w + ix) * g.cin
                } else {
                    0
                };
                class.rows.push((a, ((i * g.oh + oy) * g.ow + ox) * g.cout));
            }
        }
    }
    let out_len = out.len();
    let out = out.as_mut_ptr().cast::<f32>();
    // Read from a copy: the tiles' scattered reads of the tensor itself
    // ran 10-20% slower (stride-2 layers); the copy streams into L2.
    with_scratch(x.len(), |xs| {
        xs.copy_from_slice(x);
        let x = &*xs;
        let width = tile_width(g.cout);
        for co0 in (0..g.cout).step_by(width) {
            let init = match bias {
                // SAFETY: co0 + 16 <= cout = bias.len().
                Some(b) => Init::Bias(unsafe { b.as_ptr().add(co0) }),
                None => Init::Zero,
            };
            for class in &classes {
                let steps = Steps {
                    segs: &class.segs,
                    len: class.len,
                    a_step: 1,
                    b_step: g.cout as isize,
                };
                // SAFETY: reads as argued above; W rows are kk × cout with
                // co0 + 16 <= cout; each pixel's 16 outputs are its own.
                unsafe {
                    tiles(
                        &class.rows,
                        x,
                        &w[co0..],
                        &steps,
                        width,
                        out.add(co0),
                        out_len - co0,
                        init,
                    );
                }
            }
        }
    })
}

/// dX of `imgs` images: writes all of `dx` ([imgs·h·w × cin]).
///
/// dX[iy, ix, ci] = Σ dY[oy, ox, co]·W[ky, kx, ci, co] over
/// oy·s + ky - p = iy, ox·s + kx - p = ix, with (oy, ox) inside dY.
/// Rows are input pixels, columns input channels; the walk is the taps
/// that reach the pixel × output channels, along Wᵀ's rows (`wt`:
/// [k·k, cout, cin]). Which taps reach a pixel depends on (iy + p) mod s
/// and on the edges, so pixels are grouped by that, as in `forward`.
pub fn grad_input(
    g: &Geom,
    dy: &[f32],
    imgs: usize,
    wt: &[f32],
    dx: &mut [MaybeUninit<f32>],
) -> Result<()> {
    let s = g.stride;
    assert!(dx.len() == imgs * g.in_image() && dy.len() == imgs * g.opix() * g.cout);
    assert!(wt.len() == g.kk * g.cout && g.cin % NR == 0);
    // Along one axis, input position i is reached by the taps
    // r + s·t (r = (i + p) mod s), which read dY at o_ref - t with
    // o_ref = (i + p - r)/s, for the t with 0 <= o_ref - t < out.
    let axis = |i: usize, out: usize| {
        let r = (i + g.pad) % s;
        let o_ref = (i + g.pad - r) / s;
        let taps = g.k.saturating_sub(r).div_ceil(s);
        let t0 = o_ref.saturating_sub(out - 1);
        let t1 = taps.min(o_ref + 1).max(t0);
        (r, t0, t1)
    };
    let (ykeys, ycls) = classify(g.h, |iy| axis(iy, g.oh));
    let (xkeys, xcls) = classify(g.w, |ix| axis(ix, g.ow));
    let mut classes: Vec<Class> = Vec::with_capacity(ykeys.len() * xkeys.len());
    for &(ry, ty0, ty1) in &ykeys {
        for &(rx, tx0, tx1) in &xkeys {
            let mut segs = Vec::new();
            for ty in ty0..ty1 {
                for tx in tx0..tx1 {
                    // Relative to the pixel's first tap (ty0, tx0).
                    let a = -((((ty - ty0) * g.ow + tx - tx0) * g.cout) as isize);
                    let b = (((ry + s * ty) * g.k + rx + s * tx) * g.cout * g.cin) as isize;
                    segs.push((a, b));
                }
            }
            classes.push(Class {
                rows: Vec::new(),
                segs,
                len: g.cout,
            });
        }
    }
    // A pixel's row starts at dY[o_ref_y - ty0, o_ref_x - tx0] (inside
    // dY: see `axis`); its segments go back ty rows and tx columns from
    // there, to at most (o_ref - t1 + 1) >= 0.
    for i in 0..imgs {
        for iy in 0..g.h {
            let (ry, ty0, ty1) = ykeys[ycls[iy]];
            for ix in 0..g.w {
                let (rx, tx0, tx1) = xkeys[xcls[ix]];
                let class = &mut classes[ycls[iy] * xkeys.len() + xcls[ix]];
                let a = if ty0 < ty1 && tx0 < tx1 {
                    let oy = (iy + g.pad - ry) / s - ty0;
                    let ox = (ix + g.pad - rx) / s - tx0;
                    ((i * g.oh + oy) * g.ow + ox) * g.cout
                } else {
                    0
                };
                class.rows.push((a, ((i * g.h + iy) * g.w + ix) * g.cin));
            }
        }
    }
    let dx_len = dx.len();
    let dx = dx.as_mut_ptr().cast::<f32>();
    // Reads from a copy, as in `forward`.
    with_scratch(dy.len(), |dys| {
        dys.copy_from_slice(dy);
        let dy = &*dys;
        let width = tile_width(g.cin);
        for ci0 in (0..g.cin).step_by(width) {
            for class in &classes {
                let steps = Steps {
                    segs: &class.segs,
                    len: class.len,
                    a_step: 1,
                    b_step: g.cin as isize,
                };
                // SAFETY: reads as argued above; Wᵀ rows are k·k·cout × cin
                // with ci0 + 16 <= cin; each input pixel's 16 outputs are its
                // own. A class no tap reaches gets zeros.
                unsafe {
                    tiles(
                        &class.rows,
                        dy,
                        &wt[ci0..],
                        &steps,
                        width,
                        dx.add(ci0),
                        dx_len - ci0,
                        Init::Zero,
                    );
                }
            }
        }
    })
}

/// Splits `n` rows into tiles of at most MR, none smaller than needed:
/// a tile of 1-2 rows keeps too few accumulators in flight to hide the
/// FMA latency, so 32 = 6+6+5+5+5+5, not 6·5+2.
pub(super) fn split_rows(n: usize, mr: usize) -> Vec<usize> {
    // As many tiles of mr as leave a multiple of mr - 1 (10 accumulators
    // of 6 rows still cover the FMA latency); two halves of mr + r for
    // the few counts where that fails.
    let shorter = (mr - n % mr) % mr;
    if (mr - 1) * shorter <= n {
        let mut v = vec![mr; (n - (mr - 1) * shorter) / mr];
        v.extend(std::iter::repeat_n(mr - 1, shorter));
        v
    } else {
        let mut v = vec![mr; n / mr];
        let r = n % mr;
        if (1..=mr / 2).contains(&r) && v.pop().is_some() {
            v.push((mr + r).div_ceil(2));
            v.push((mr + r) / 2);
        } else if r > 0 {
            v.push(r);
        }
        v
    }
}

/// Adds the weight gradient of `imgs` images into `dw` ([kk × cout]),
/// for cin >= MR.
///
/// Rows are the input channels of one tap, columns output channels; the
/// walk is over the output pixels that tap reaches inside the image (a
/// rectangle: taps in the padding are skipped, as in `forward`), one
/// segment per output row, along dY's rows and the input read in place.
pub fn grad_weight(g: &Geom, x_g: &[f32], dy_g: &[f32], imgs: usize, dw: &mut [f32]) -> Result<()> {
    let out_image = g.opix() * g.cout;
    assert!(x_g.len() == imgs * g.in_image() && dy_g.len() == imgs * out_image);
    assert!(dw.len() == g.kk * g.cout && g.cout % NR == 0 && g.cin >= MR);
    let chunk = (CHUNK_BYTES / (4 * g.in_image())).clamp(1, imgs.max(1));
    let mut segs = Vec::new();
    let mut rows = Vec::with_capacity(g.cin);
    let mut c0 = 0;
    while c0 < imgs {
        let cc = chunk.min(imgs - c0);
        let x_c = &x_g[c0 * g.in_image()..(c0 + cc) * g.in_image()];
        let dy_c = &dy_g[c0 * out_image..(c0 + cc) * out_image];
        with_scratch(x_c.len(), |xs| {
            // Read from a copy: the tiles' scattered reads of the tensor
            // itself ran 10-20% slower (stride-2 layers), the copy streams.
            xs.copy_from_slice(x_c);
            let x_c = &*xs;
            for ky in 0..g.k {
                // Output rows whose tap row ky is inside the image.
                let (oy0, oy1) = reach(ky, g.oh, g.h, g);
                for kx in 0..g.k {
                    let (ox0, ox1) = reach(kx, g.ow, g.w, g);
                    if oy0 >= oy1 || ox0 >= ox1 {
                        continue;
                    }
                    // Segment (image i, output row oy) starts at input pixel
                    // (oy·s - p + ky, ox0·s - p + kx), inside the image, and
                    // steps ox1-ox0 pixels of stride s along the row, the
                    // last at ((ox1-1)·s - p + kx) < w.
                    segs.clear();
                    for i in 0..cc {
                        for oy in oy0..oy1 {
                            let (iy, ix) =
                                (oy * g.stride + ky - g.pad, ox0 * g.stride + kx - g.pad);
                            let a = i * g.in_image() + (iy * g.w + ix) * g.cin;
                            let b = ((i * g.oh + oy) * g.ow + ox0) * g.cout;
                            segs.push((a as isize, b as isize));
                        }
                    }
                    let steps = Steps {
                        segs: &segs,
                        len: ox1 - ox0,
                        a_step: (g.stride * g.cin) as isize,
                        b_step: g.cout as isize,
                    };
                    let tap = ky * g.k + kx;
                    rows.clear();
                    rows.extend((0..g.cin).map(|ci| (ci, (tap * g.cin + ci) * g.cout)));
                    let width = tile_width(g.cout);
                    for co0 in (0..g.cout).step_by(width) {
                        // SAFETY: row ci reads x_c at a segment's pixel +
                        // ci < cin; dY columns co0..co0+16 of the segment's
                        // pixels; dW is read and written only through dst
                        // (Accumulate), one row per tile row.
                        unsafe {
                            tiles(
                                &rows,
                                x_c,
                                &dy_c[co0..],
                                &steps,
                                width,
                                dw.as_mut_ptr().add(co0),
                                dw.len() - co0,
                                Init::Accumulate,
                            );
                        }
                    }
                }
            }
        })?;
        c0 += cc;
    }
    Ok(())
}

/// The output positions o in 0..out whose tap t lands inside 0..size:
/// 0 <= o·s - p + t < size, as a range.
fn reach(t: usize, out: usize, size: usize, g: &Geom) -> (usize, usize) {
    let lo = g.pad.saturating_sub(t).div_ceil(g.stride);
    // o·s < size + p - t
    let hi = (size + g.pad).saturating_sub(t).div_ceil(g.stride);
    (lo.min(out), hi.min(out).max(lo.min(out)))
}

/// The weight gradient for fewer than 6 input channels (the stem), on a
/// zero-padded copy of the input, so that a tile's 6 rows can span taps
/// (per-tap tiles of 1 channel would leave the FMAs latency-bound).
/// Rows are dW rows ((tap, input channel) pairs, each a pointer into the
/// padded images at that tap's offset), columns output channels; the walk
/// is over every output pixel of a chunk of images (one segment per
/// output row), along dY's rows.
pub fn grad_weight_padded(
    g: &Geom,
    x_g: &[f32],
    dy_g: &[f32],
    imgs: usize,
    dw: &mut [f32],
) -> Result<()> {
    let (hp, wp) = g.padded();
    let pimg = hp * wp * g.cin;
    let out_image = g.opix() * g.cout;
    assert!(x_g.len() == imgs * g.in_image() && dy_g.len() == imgs * out_image);
    assert!(dw.len() == g.kk * g.cout && g.cout % NR == 0);
    let chunk = (CHUNK_BYTES / (4 * pimg)).clamp(1, imgs.max(1));
    // Row j = (ky, kx, ci) of dW reads the padded image at this offset
    // from each output pixel's corner.
    let rows: Vec<(usize, usize)> = (0..g.kk)
        .map(|j| {
            let (tap, ci) = (j / g.cin, j % g.cin);
            (((tap / g.k) * wp + tap % g.k) * g.cin + ci, j * g.cout)
        })
        .collect();
    let mut segs = Vec::with_capacity(chunk * g.oh);
    let mut c0 = 0;
    while c0 < imgs {
        let cc = chunk.min(imgs - c0);
        let x_c = &x_g[c0 * g.in_image()..(c0 + cc) * g.in_image()];
        let dy_c = &dy_g[c0 * out_image..(c0 + cc) * out_image];
        segs.clear();
        for i in 0..cc {
            for oy in 0..g.oh {
                let a = (i * hp + oy * g.stride) * wp * g.cin;
                let b = (i * g.oh + oy) * g.ow * g.cout;
                segs.push((a as isize, b as isize));
            }
        }
        let steps = Steps {
            segs: &segs,
            len: g.ow,
            a_step: (g.stride * g.cin) as isize,
            b_step: g.cout as isize,
        };
        with_scratch(cc * pimg, |xpad| {
            for (src, dst) in x_c
                .chunks_exact(g.in_image())
                .zip(xpad.chunks_exact_mut(pimg))
            {
                pad_into(src, g.h, g.w, g.cin, g.pad, dst);
            }
            // The last segment of image cc-1 starts at padded row
            // (oh-1)·s and steps to column (ow-1)·s; a row's offset adds
            // at most k-1 rows, k-1 columns and cin-1: inside cc padded
            // images. dY: cc·opix rows of cout, columns co0..co0+16.
            let width = tile_width(g.cout);
            for co0 in (0..g.cout).step_by(width) {
                // SAFETY: as argued above; dW is read and written only
                // through dst (Init::Accumulate), one row per tile row.
                unsafe {
                    tiles(
                        &rows,
                        xpad,
                        &dy_c[co0..],
                        &steps,
                        width,
                        dw.as_mut_ptr().add(co0),
                        dw.len() - co0,
                        Init::Accumulate,
                    );
                }
            }
        })?;
        c0 += cc;
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use super::{Init, Steps};
    use std::arch::x86_64::*;

    pub fn available() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }

    pub fn wide_available() -> bool {
        is_x86_feature_detected!("avx512f")
    }

    /// Defines `$name`, the tile kernel for one vector width: `dst[r]`
    /// (2·$lanes floats per row) = init + Σ_segments Σ_i
    /// a[r][a_off + i·a_step] · b[b_off + i·b_step ..][..2·$lanes].
    /// One macro for both widths, so that they do the same fused
    /// multiply-adds in the same order per output (bit-identical).
    macro_rules! tile_kernel {
        ($(#[$doc:meta])* $name:ident, $feature:literal, $lanes:literal,
         $setzero:ident, $loadu:ident, |$p:ident| $broadcast:expr, $fmadd:ident, $storeu:ident) => {
            $(#[$doc])*
            #[target_feature(enable = $feature)]
            pub unsafe fn $name<const M: usize>(
                a: [*const f32; M],
                b: *const f32,
                st: &Steps,
                dst: [*mut f32; M],
                init: Init,
            ) {
                // SAFETY: the caller's contract covers every pointer used here.
                unsafe {
                    let mut acc = [[$setzero(); 2]; M];
                    match init {
                        Init::Zero => {}
                        Init::Accumulate => {
                            for r in 0..M {
                                acc[r] = [$loadu(dst[r]), $loadu(dst[r].add($lanes))];
                            }
                        }
                        Init::Bias(p) => {
                            acc = [[$loadu(p), $loadu(p.add($lanes))]; M];
                        }
                    }
                    for &(a_off, b_off) in st.segs {
                        // Offsets, not per-segment pointers: the row pointers
                        // stay in registers, and a segment costs two moves
                        // (short segments: the 7-pixel rows of dW at 7x7).
                        // (A pointer for b and an index for a: as two indices
                        // LLVM packs them into one xmm register, and the
                        // extracts serialise the loop — 2x slower, measured.
                        // Unrolling by 2 by hand measured 3% slower.)
                        let mut ia = a_off;
                        let mut pb = b.offset(b_off);
                        for _ in 0..st.len {
                            let b0 = $loadu(pb);
                            let b1 = $loadu(pb.add($lanes));
                            for r in 0..M {
                                let av = {
                                    let $p = a[r].offset(ia);
                                    $broadcast
                                };
                                acc[r][0] = $fmadd(av, b0, acc[r][0]);
                                acc[r][1] = $fmadd(av, b1, acc[r][1]);
                            }
                            ia += st.a_step;
                            pb = pb.wrapping_offset(st.b_step);
                        }
                    }
                    for r in 0..M {
                        $storeu(dst[r], acc[r][0]);
                        $storeu(dst[r].add($lanes), acc[r][1]);
                    }
                }
            }
        };
    }

    tile_kernel!(
        /// 16 columns in two ymm accumulators per row.
        ///
        /// # Safety
        /// AVX2 and FMA are available and every address is valid (see `super::tiles`).
        tile, "avx2,fma", 8,
        _mm256_setzero_ps, _mm256_loadu_ps, |p| _mm256_broadcast_ss(&*p), _mm256_fmadd_ps, _mm256_storeu_ps
    );

    tile_kernel!(
        /// 32 columns in two zmm accumulators per row.
        ///
        /// # Safety
        /// AVX-512F is available and every address is valid for 32
        /// columns (see `super::tiles`).
        tile_wide, "avx512f", 16,
        _mm512_setzero_ps, _mm512_loadu_ps, |p| _mm512_set1_ps(*p), _mm512_fmadd_ps, _mm512_storeu_ps
    );
}

/// Elsewhere the im2col + gemm path runs; this only keeps the build whole.
#[cfg(not(target_arch = "x86_64"))]
mod simd {
    use super::{Init, Steps};

    pub fn available() -> bool {
        false
    }

    pub fn wide_available() -> bool {
        false
    }

    /// Never chosen here (`wide_available`); two 16-column tiles.
    ///
    /// # Safety
    /// Every address is valid for 32 columns (see `super::tiles`).
    pub unsafe fn tile_wide<const M: usize>(
        a: [*const f32; M],
        b: *const f32,
        st: &Steps,
        dst: [*mut f32; M],
        init: Init,
    ) {
        let right = match init {
            // SAFETY: the bias has 32 floats here.
            Init::Bias(p) => Init::Bias(unsafe { p.add(16) }),
            other => other,
        };
        // SAFETY: forwarded from the caller; columns 16..32 are valid.
        unsafe {
            tile(a, b, st, dst, init);
            tile(a, b.add(16), st, dst.map(|d| d.add(16)), right);
        }
    }

    /// Portable reference of the x86 kernel.
    ///
    /// # Safety
    /// Every address is valid (see `super::tiles`).
    pub unsafe fn tile<const M: usize>(
        a: [*const f32; M],
        b: *const f32,
        st: &Steps,
        dst: [*mut f32; M],
        init: Init,
    ) {
        // SAFETY: the caller's contract covers every pointer used here.
        unsafe {
            let mut acc = [[0.0f32; 16]; M];
            match init {
                Init::Zero => {}
                Init::Accumulate => {
                    for r in 0..M {
                        for c in 0..16 {
                            acc[r][c] = *dst[r].add(c);
                        }
                    }
                }
                Init::Bias(p) => {
                    for row in acc.iter_mut() {
                        for (c, v) in row.iter_mut().enumerate() {
                            *v = *p.add(c);
                        }
                    }
                }
            }
            for &(a_off, b_off) in st.segs {
                for i in 0..st.len as isize {
                    let pb = b.offset(b_off + i * st.b_step);
                    for r in 0..M {
                        let av = *a[r].offset(a_off + i * st.a_step);
                        for c in 0..16 {
                            acc[r][c] += av * *pb.add(c);
                        }
                    }
                }
            }
            for r in 0..M {
                for c in 0..16 {
                    *dst[r].add(c) = acc[r][c];
                }
            }
        }
    }
}
