//! RandAugment for small u8 HWC images (see [`RandAugmentConfig`]).
//!
//! Geometric operations map each output pixel back into the source with a
//! 16.16 fixed-point affine transform and sample it bilinearly (pixels
//! outside the image are 0); the photometric ones use a 256-entry lookup
//! table. Nothing allocates: the caller lends one scratch image.

use crate::augment::{RandAugmentConfig, MAX_MAGNITUDE};
use crate::rng::{self, SplitMix64};

/// The operations, drawn uniformly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    Identity,
    TranslateX,
    TranslateY,
    Rotate,
    ShearX,
    ShearY,
    Brightness,
    Contrast,
    Sharpness,
    Posterize,
    Solarize,
}

pub(crate) const OPS: [Op; 11] = [
    Op::Identity,
    Op::TranslateX,
    Op::TranslateY,
    Op::Rotate,
    Op::ShearX,
    Op::ShearY,
    Op::Brightness,
    Op::Contrast,
    Op::Sharpness,
    Op::Posterize,
    Op::Solarize,
];

/// Applies `cfg.num_ops` random operations to `img` (HWC, `shape`), using
/// `tmp` (same length) as scratch. The choices are a function of
/// (seed, epoch, index) only, independent of the crop/flip stream.
pub(crate) fn apply(
    img: &mut [u8],
    tmp: &mut [u8],
    shape: [usize; 3],
    cfg: RandAugmentConfig,
    seed: u64,
    epoch: u64,
    index: usize,
) {
    let mut r = SplitMix64::new(rng::key(&[rng::DOMAIN_RANDAUG, seed, epoch, index as u64]));
    // `cur` holds the image so far; geometric ops write into `other` and swap.
    let (mut cur, mut other): (&mut [u8], &mut [u8]) = (img, tmp);
    let mut swapped = false;
    for _ in 0..cfg.num_ops {
        let op = OPS[r.below(OPS.len() as u64) as usize];
        let negative = (r.next_u64() >> 63) == 1;
        if apply_op(cur, other, shape, op, cfg.magnitude, negative) {
            std::mem::swap(&mut cur, &mut other);
            swapped = !swapped;
        }
    }
    if swapped {
        // `other` is the caller's `img` again.
        other.copy_from_slice(cur);
    }
}

/// Applies one operation at `magnitude` (0..=30), negated if `negative`
/// (for the signed ones). Point operations change `src` in place and return
/// false; the others write `dst` and return true.
pub(crate) fn apply_op(
    src: &mut [u8],
    dst: &mut [u8],
    shape: [usize; 3],
    op: Op,
    magnitude: u32,
    negative: bool,
) -> bool {
    let [h, w, _] = shape;
    let f = f64::from(magnitude.min(MAX_MAGNITUDE)) / f64::from(MAX_MAGNITUDE);
    let sign = if negative { -1.0 } else { 1.0 };
    match op {
        Op::Identity => false,
        Op::TranslateX | Op::TranslateY => {
            // torchvision: 150/331 of the image size at full magnitude,
            // whole pixels.
            let size = if op == Op::TranslateX { w } else { h };
            let t = (150.0 / 331.0 * size as f64 * f).round() as isize * sign as isize;
            if t == 0 {
                return false;
            }
            let (dx, dy) = if op == Op::TranslateX { (t, 0) } else { (0, t) };
            translate(src, dst, shape, dx, dy);
            true
        }
        Op::Rotate => {
            let theta = (30.0 * f * sign).to_radians();
            if theta == 0.0 {
                return false;
            }
            let (s, c) = theta.sin_cos();
            // Output (x, y) reads source centre + R(-theta) (x - cx, y - cy).
            affine(src, dst, shape, [c, s, -s, c]);
            true
        }
        Op::ShearX | Op::ShearY => {
            let k = 0.3 * f * sign;
            if k == 0.0 {
                return false;
            }
            let m = if op == Op::ShearX {
                [1.0, k, 0.0, 1.0]
            } else {
                [1.0, 0.0, k, 1.0]
            };
            affine(src, dst, shape, m);
            true
        }
        Op::Brightness => {
            let factor = 1.0 + 0.9 * f * sign;
            if factor == 1.0 {
                return false;
            }
            map(src, |p| f64::from(p) * factor);
            false
        }
        Op::Contrast => {
            let factor = 1.0 + 0.9 * f * sign;
            if factor == 1.0 {
                return false;
            }
            let mean = src.iter().map(|&p| u64::from(p)).sum::<u64>() as f64 / src.len() as f64;
            map(src, |p| factor * f64::from(p) + (1.0 - factor) * mean);
            false
        }
        Op::Sharpness => {
            let factor = 1.0 + 0.9 * f * sign;
            if factor == 1.0 {
                return false;
            }
            sharpness(src, dst, shape, factor);
            true
        }
        Op::Posterize => {
            // Keep 8 - round(4 f) high bits.
            let drop = (4.0 * f).round() as u32;
            if drop == 0 {
                return false;
            }
            let mask = !((1u8 << drop) - 1);
            for p in src.iter_mut() {
                *p &= mask;
            }
            false
        }
        Op::Solarize => {
            // Invert the pixels above 255 (1 - f): none at magnitude 0.
            let threshold = 255.0 * (1.0 - f);
            if f == 0.0 {
                return false;
            }
            let mut lut = [0u8; 256];
            for (v, l) in lut.iter_mut().enumerate() {
                *l = if v as f64 > threshold {
                    255 - v as u8
                } else {
                    v as u8
                };
            }
            for p in src.iter_mut() {
                *p = lut[*p as usize];
            }
            false
        }
    }
}

/// Replaces every pixel `p` by `round(f(p))` clamped to 0..=255.
fn map(img: &mut [u8], f: impl Fn(u8) -> f64) {
    let mut lut = [0u8; 256];
    for (v, l) in lut.iter_mut().enumerate() {
        *l = f(v as u8).round().clamp(0.0, 255.0) as u8;
    }
    for p in img.iter_mut() {
        *p = lut[*p as usize];
    }
}

/// Output pixel (x, y) = source pixel (x - dx, y - dy), zero outside.
fn translate(src: &[u8], dst: &mut [u8], shape: [usize; 3], dx: isize, dy: isize) {
    let [h, w, c] = shape;
    dst.fill(0);
    let (hi, wi) = (h as isize, w as isize);
    if dx.abs() >= wi || dy.abs() >= hi {
        return;
    }
    let n = (wi - dx.abs()) as usize; // pixels copied per row
    let (sx, ox) = if dx >= 0 {
        (0, dx as usize)
    } else {
        ((-dx) as usize, 0)
    };
    for y in 0..h {
        let sy = y as isize - dy;
        if sy < 0 || sy >= hi {
            continue;
        }
        let s = (sy as usize * w + sx) * c;
        let d = (y * w + ox) * c;
        dst[d..d + n * c].copy_from_slice(&src[s..s + n * c]);
    }
}

/// Output pixel (x, y) = bilinear sample of the source at
/// `centre + m (x - cx, y - cy)`, `m = [a, b, c, d]` as
/// `sx = a dx + b dy`, `sy = c dx + d dy`; zero outside the image.
fn affine(src: &[u8], dst: &mut [u8], shape: [usize; 3], m: [f64; 4]) {
    const ONE: f64 = 65536.0;
    let [h, w, ch] = shape;
    let (cx, cy) = ((w as f64 - 1.0) / 2.0, (h as f64 - 1.0) / 2.0);
    let [a, b, c, d] = m;
    let step_x = (a * ONE).round() as i64;
    let step_y = (c * ONE).round() as i64;
    let (wi, hi) = (w as i64, h as i64);
    let px = |x: i64, y: i64, k: usize| -> u32 {
        if x >= 0 && x < wi && y >= 0 && y < hi {
            u32::from(src[(y as usize * w + x as usize) * ch + k])
        } else {
            0
        }
    };
    for y in 0..h {
        let dyc = y as f64 - cy;
        // Source position of output (0, y), in 16.16 fixed point.
        let mut fx = ((a * -cx + b * dyc + cx) * ONE).round() as i64;
        let mut fy = ((c * -cx + d * dyc + cy) * ONE).round() as i64;
        let row = &mut dst[y * w * ch..(y + 1) * w * ch];
        for out in row.chunks_exact_mut(ch) {
            let (ix, iy) = (fx >> 16, fy >> 16);
            let (wx, wy) = (((fx >> 8) & 0xff) as u32, ((fy >> 8) & 0xff) as u32);
            if ix >= -1 && ix < wi && iy >= -1 && iy < hi {
                let interior = ix >= 0 && ix + 1 < wi && iy >= 0 && iy + 1 < hi;
                for (k, o) in out.iter_mut().enumerate() {
                    let (p00, p01, p10, p11) = if interior {
                        let i = (iy as usize * w + ix as usize) * ch + k;
                        let j = i + w * ch;
                        (
                            u32::from(src[i]),
                            u32::from(src[i + ch]),
                            u32::from(src[j]),
                            u32::from(src[j + ch]),
                        )
                    } else {
                        (
                            px(ix, iy, k),
                            px(ix + 1, iy, k),
                            px(ix, iy + 1, k),
                            px(ix + 1, iy + 1, k),
                        )
                    };
                    let top = p00 * (256 - wx) + p01 * wx;
                    let bottom = p10 * (256 - wx) + p11 * wx;
                    *o = ((top * (256 - wy) + bottom * wy + 32768) >> 16) as u8;
                }
            } else {
                out.fill(0);
            }
            fx += step_x;
            fy += step_y;
        }
    }
}

/// PIL/torchvision sharpness: blend with the image smoothed by
/// `[[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13` (border pixels kept).
fn sharpness(src: &[u8], dst: &mut [u8], shape: [usize; 3], factor: f64) {
    let [h, w, c] = shape;
    dst.copy_from_slice(src);
    if h < 3 || w < 3 {
        return;
    }
    let fx = (factor * 256.0).round() as i32;
    for y in 1..h - 1 {
        for x in 1..w - 1 {
            for k in 0..c {
                let at = |yy: usize, xx: usize| i32::from(src[(yy * w + xx) * c + k]);
                let sum = at(y - 1, x - 1)
                    + at(y - 1, x)
                    + at(y - 1, x + 1)
                    + at(y, x - 1)
                    + 5 * at(y, x)
                    + at(y, x + 1)
                    + at(y + 1, x - 1)
                    + at(y + 1, x)
                    + at(y + 1, x + 1);
                let smooth = (sum + 6) / 13;
                let p = at(y, x);
                // p' = smooth + factor (p - smooth), rounded.
                let v = smooth * 256 + fx * (p - smooth);
                dst[(y * w + x) * c + k] = ((v + 128).div_euclid(256)).clamp(0, 255) as u8;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(h: usize, w: usize, c: usize, salt: usize) -> Vec<u8> {
        (0..h * w * c)
            .map(|i| ((i * 37 + salt * 101 + (i / w) * 13) % 251) as u8)
            .collect()
    }

    /// Applies one op and returns the result (wherever it was written).
    fn run(img: &[u8], shape: [usize; 3], op: Op, m: u32, neg: bool) -> Vec<u8> {
        let mut src = img.to_vec();
        let mut dst = vec![0xAB; img.len()];
        if apply_op(&mut src, &mut dst, shape, op, m, neg) {
            dst
        } else {
            src
        }
    }

    #[test]
    fn every_op_at_magnitude_zero_is_the_identity() {
        for shape in [[28, 28, 1], [5, 7, 3], [1, 1, 1]] {
            let img = image(shape[0], shape[1], shape[2], 3);
            for op in OPS {
                for neg in [false, true] {
                    assert_eq!(run(&img, shape, op, 0, neg), img, "{op:?} {shape:?}");
                }
            }
            // And RandAugment as a whole at magnitude 0.
            let mut out = img.clone();
            let mut tmp = vec![0; img.len()];
            let cfg = RandAugmentConfig {
                num_ops: 5,
                magnitude: 0,
            };
            for i in 0..50 {
                apply(&mut out, &mut tmp, shape, cfg, 1, 2, i);
                assert_eq!(out, img);
            }
        }
    }

    #[test]
    fn every_op_changes_the_image_at_high_magnitude() {
        let shape = [12, 12, 1];
        let img = image(12, 12, 1, 7);
        for op in &OPS[1..] {
            assert_ne!(run(&img, shape, *op, 30, false), img, "{op:?}");
        }
    }

    #[test]
    fn translate_moves_the_content_by_whole_pixels() {
        let shape = [10, 10, 2];
        let img = image(10, 10, 2, 1);
        // Magnitude 30 of a 10-pixel image: round(4.53) = 5 pixels.
        let out = run(&img, shape, Op::TranslateX, 30, false);
        for y in 0..10 {
            for x in 0..10 {
                for k in 0..2 {
                    let want = if x >= 5 {
                        img[(y * 10 + x - 5) * 2 + k]
                    } else {
                        0
                    };
                    assert_eq!(out[(y * 10 + x) * 2 + k], want);
                }
            }
        }
        let out = run(&img, shape, Op::TranslateY, 30, true);
        for y in 0..10 {
            for x in 0..10 {
                let want = if y < 5 {
                    img[((y + 5) * 10 + x) * 2]
                } else {
                    0
                };
                assert_eq!(out[(y * 10 + x) * 2], want);
            }
        }
    }

    #[test]
    fn affine_quarter_turn_is_exact() {
        // A quarter turn of a square about its centre moves whole pixels.
        let (n, shape) = (5, [5, 5, 1]);
        let img = image(n, n, 1, 2);
        let mut out = vec![0; n * n];
        affine(&img, &mut out, shape, [0.0, 1.0, -1.0, 0.0]);
        for y in 0..n {
            for x in 0..n {
                // sx = cx + (y - cy), sy = cy - (x - cx)
                assert_eq!(out[y * n + x], img[(n - 1 - x) * n + y], "({y}, {x})");
            }
        }
    }

    #[test]
    fn rotation_is_bilinear_and_keeps_the_centre() {
        let shape = [9, 9, 1];
        let mut img = vec![0u8; 81];
        img[4 * 9 + 4] = 200;
        let out = run(&img, shape, Op::Rotate, 15, false);
        assert_eq!(out[4 * 9 + 4], 200, "the centre pixel stays");
        // A constant image stays constant away from the borders.
        let flat = vec![100u8; 81];
        let out = run(&flat, shape, Op::Rotate, 9, true);
        for y in 2..7 {
            for x in 2..7 {
                assert_eq!(out[y * 9 + x], 100);
            }
        }
        // Corners rotate out of the image and blend towards zero.
        assert!(out[0] < 100);
        // Bilinear: a half-pixel shear of a step edge gives the mid value.
        let mut step = vec![0u8; 81];
        for y in 0..9 {
            for x in 5..9 {
                step[y * 9 + x] = 200;
            }
        }
        let mut out = vec![0; 81];
        // Row y reads source x + 0.125 (y - 4): row 8 is shifted by half a pixel.
        affine(&step, &mut out, shape, [1.0, 0.125, 0.0, 1.0]);
        assert_eq!(out[8 * 9 + 4], 100);
        assert_eq!(out[4 * 9 + 4], 0);
        assert_eq!(out[4 * 9 + 5], 200);
    }

    #[test]
    fn photometric_ops_follow_their_formulas() {
        let shape = [4, 4, 1];
        let img: Vec<u8> = (0..16).map(|i| (i * 16) as u8).collect();
        // Brightness at magnitude 10: factor 1.3.
        let out = run(&img, shape, Op::Brightness, 10, false);
        for (o, p) in out.iter().zip(&img) {
            assert_eq!(*o, (f64::from(*p) * 1.3).round().min(255.0) as u8);
        }
        // Contrast at magnitude 30, negative: factor 0.1 towards the mean.
        let mean = img.iter().map(|&p| f64::from(p)).sum::<f64>() / 16.0;
        let out = run(&img, shape, Op::Contrast, 30, true);
        for (o, p) in out.iter().zip(&img) {
            let want = (0.1 * f64::from(*p) + 0.9 * mean).round() as u8;
            assert!(o.abs_diff(want) <= 1, "{o} vs {want}");
        }
        // Posterize at magnitude 30 keeps 4 bits; at 9, 7 bits.
        let out = run(&img, shape, Op::Posterize, 30, false);
        assert!(out.iter().zip(&img).all(|(o, p)| *o == p & 0xF0));
        let odd: Vec<u8> = (0..16).map(|i| (i * 16 + 1) as u8).collect();
        let out = run(&odd, shape, Op::Posterize, 9, false);
        assert!(out.iter().zip(&odd).all(|(o, p)| *o == p & 0xFE));
        // Solarize at magnitude 15 inverts pixels above 127.5.
        let out = run(&img, shape, Op::Solarize, 15, false);
        for (o, p) in out.iter().zip(&img) {
            assert_eq!(*o, if *p > 127 { 255 - p } else { *p });
        }
        // Sharpness keeps a flat image and the border.
        let flat = vec![77u8; 25];
        assert_eq!(run(&flat, [5, 5, 1], Op::Sharpness, 30, false), flat);
        let img5 = image(5, 5, 1, 4);
        let out = run(&img5, [5, 5, 1], Op::Sharpness, 30, true);
        for i in 0..5 {
            assert_eq!(out[i], img5[i]);
            assert_eq!(out[20 + i], img5[20 + i]);
        }
    }

    #[test]
    fn rand_augment_is_a_function_of_seed_epoch_index() {
        let shape = [28, 28, 1];
        let img = image(28, 28, 1, 9);
        let cfg = RandAugmentConfig {
            num_ops: 2,
            magnitude: 9,
        };
        let run = |seed, epoch, index| {
            let mut out = img.clone();
            let mut tmp = vec![0; img.len()];
            apply(&mut out, &mut tmp, shape, cfg, seed, epoch, index);
            out
        };
        assert_eq!(run(1, 2, 3), run(1, 2, 3));
        let outs: Vec<Vec<u8>> = (0..200).map(|i| run(1, 2, i)).collect();
        let changed = outs.iter().filter(|o| **o != img).count();
        // P(both ops are the identity) = 1/121.
        assert!(changed > 180, "{changed}/200 changed");
        let distinct: std::collections::HashSet<_> = outs.iter().collect();
        assert!(distinct.len() > 50, "{} distinct outputs", distinct.len());
        assert!((0..20).any(|i| run(1, 2, i) != run(1, 3, i)));
    }
}
