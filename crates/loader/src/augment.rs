//! Augmentations on u8 HWC images: random crop with zero padding and
//! horizontal flip. Their random numbers are a function of
//! (seed, epoch, sample id) only, and they write straight into the batch
//! buffer without allocating.

use serde::{Deserialize, Serialize};

use crate::rng::{self, SplitMix64};

/// Which augmentations the loader applies. `Default` applies none.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AugmentConfig {
    /// Random crop: pad each side with `crop_padding` zero pixels, then crop
    /// back to h x w at a random offset in `[0, 2 * crop_padding]`. 0 = off.
    #[serde(default)]
    pub crop_padding: usize,
    /// Horizontal flip with probability 0.5.
    #[serde(default)]
    pub flip: bool,
}

impl AugmentConfig {
    /// Whether this configuration leaves every sample unchanged.
    pub fn is_identity(&self) -> bool {
        self.crop_padding == 0 && !self.flip
    }

    /// The random choices for sample `index` in `epoch`. Three numbers are
    /// always drawn in the same order, so switching flip on or off does not
    /// change the crop offsets.
    #[inline]
    pub(crate) fn params(&self, seed: u64, epoch: u64, index: usize) -> AugmentParams {
        let mut r = SplitMix64::new(rng::key(&[rng::DOMAIN_AUGMENT, seed, epoch, index as u64]));
        let span = 2 * self.crop_padding as u64 + 1;
        let dy = r.below(span) as usize;
        let dx = r.below(span) as usize;
        let flip = (r.next_u64() >> 63) == 1;
        AugmentParams {
            pad: self.crop_padding,
            dy,
            dx,
            flip: self.flip && flip,
        }
    }
}

/// The augmentation of one sample: crop the zero-padded image at (dy, dx),
/// then flip horizontally if `flip`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AugmentParams {
    pub pad: usize,
    pub dy: usize,
    pub dx: usize,
    pub flip: bool,
}

/// Writes the augmented `src` (HWC, `shape = [h, w, c]`) into `dst`.
///
/// Output pixel (y, x) is padded-source pixel (y + dy, x' + dx) where
/// x' = x without flip and w - 1 - x with flip; the padded source is `src`
/// shifted by `pad` in both directions with zeros around it.
pub(crate) fn apply(src: &[u8], dst: &mut [u8], shape: [usize; 3], p: AugmentParams) {
    let [h, w, c] = shape;
    let row = w * c;
    assert_eq!(src.len(), h * row);
    assert_eq!(dst.len(), h * row);
    debug_assert!(p.dy <= 2 * p.pad && p.dx <= 2 * p.pad);

    // Columns x of the unflipped crop whose source column x + dx - pad is
    // inside the image: [x_lo, x_hi), starting at source column `sx`; the
    // same for rows: [y_lo, y_hi) from source row `sy`.
    let (x_lo, x_hi, sx) = valid_range(w, p.pad, p.dx);
    let (y_lo, y_hi, sy) = valid_range(h, p.pad, p.dy);
    if x_lo == x_hi || y_lo == y_hi {
        dst.fill(0);
        return;
    }
    let n = x_hi - x_lo;
    dst[..y_lo * row].fill(0);
    dst[y_hi * row..].fill(0);
    let body = &mut dst[y_lo * row..y_hi * row];
    let src = &src[sy * row..(sy + y_hi - y_lo) * row];

    // Output columns that receive pixels: [lo, hi).
    let (lo, hi) = if p.flip {
        (w - x_hi, w - x_lo)
    } else {
        (x_lo, x_hi)
    };
    if !p.flip {
        // One copy of the shifted block is right for columns [lo, hi) of
        // every row; the other columns get neighbouring pixels, zeroed below.
        let len = body.len() - (w - n) * c;
        body[lo * c..lo * c + len].copy_from_slice(&src[sx * c..sx * c + len]);
    } else {
        for (out, inp) in body.chunks_exact_mut(row).zip(src.chunks_exact(row)) {
            let seg = &inp[sx * c..(sx + n) * c];
            let dseg = &mut out[lo * c..hi * c];
            if c == 1 {
                for (d, s) in dseg.iter_mut().zip(seg.iter().rev()) {
                    *d = *s;
                }
            } else {
                for (d, s) in dseg.chunks_exact_mut(c).zip(seg.chunks_exact(c).rev()) {
                    d.copy_from_slice(s);
                }
            }
        }
    }
    if n < w {
        // Columns [hi, w) of one row and [0, lo) of the next are adjacent.
        body[..lo * c].fill(0);
        let mut start = hi * c;
        while start < body.len() {
            let end = (start + (w - n) * c).min(body.len());
            for b in &mut body[start..end] {
                *b = 0;
            }
            start += row;
        }
    }
}

/// For an axis of `size` pixels padded by `pad` and cropped at `offset`:
/// the output range `[lo, hi)` whose source pixel is inside the image, and
/// the source index of `lo` (meaningless when the range is empty).
#[inline]
fn valid_range(size: usize, pad: usize, offset: usize) -> (usize, usize, usize) {
    let lo = pad.saturating_sub(offset).min(size);
    let hi = (size + pad).saturating_sub(offset).min(size).max(lo);
    (lo, hi, (lo + offset).saturating_sub(pad))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(pad: usize, dy: usize, dx: usize, flip: bool) -> AugmentParams {
        AugmentParams { pad, dy, dx, flip }
    }

    /// Straightforward reference: build the padded image, crop, flip.
    fn reference(src: &[u8], shape: [usize; 3], p: AugmentParams) -> Vec<u8> {
        let [h, w, c] = shape;
        let (ph, pw) = (h + 2 * p.pad, w + 2 * p.pad);
        let mut padded = vec![0u8; ph * pw * c];
        for y in 0..h {
            for x in 0..w {
                for k in 0..c {
                    padded[((y + p.pad) * pw + x + p.pad) * c + k] = src[(y * w + x) * c + k];
                }
            }
        }
        let mut out = vec![0u8; h * w * c];
        for y in 0..h {
            for x in 0..w {
                let xs = if p.flip { w - 1 - x } else { x };
                for k in 0..c {
                    out[(y * w + x) * c + k] = padded[((y + p.dy) * pw + xs + p.dx) * c + k];
                }
            }
        }
        out
    }

    #[test]
    fn flip_reverses_columns() {
        // 2 x 3, one channel.
        let src = [1, 2, 3, 4, 5, 6];
        let mut dst = [0u8; 6];
        apply(&src, &mut dst, [2, 3, 1], params(0, 0, 0, true));
        assert_eq!(dst, [3, 2, 1, 6, 5, 4]);
        // Without flip and without padding: a plain copy.
        apply(&src, &mut dst, [2, 3, 1], params(0, 0, 0, false));
        assert_eq!(dst, src);
    }

    #[test]
    fn flip_keeps_channel_order_within_a_pixel() {
        // 1 x 2, three channels: pixels (1,2,3) and (4,5,6).
        let src = [1, 2, 3, 4, 5, 6];
        let mut dst = [0u8; 6];
        apply(&src, &mut dst, [1, 2, 3], params(0, 0, 0, true));
        assert_eq!(dst, [4, 5, 6, 1, 2, 3]);
    }

    #[test]
    fn crop_with_padding_shifts_and_zero_fills() {
        // 3 x 3 image, padding 1.
        let src = [1, 2, 3, 4, 5, 6, 7, 8, 9];
        let mut dst = [0u8; 9];
        // Offset (1, 1) is the centre: unchanged.
        apply(&src, &mut dst, [3, 3, 1], params(1, 1, 1, false));
        assert_eq!(dst, src);
        // Offset (0, 0): content moves down-right by one, zeros on top/left.
        apply(&src, &mut dst, [3, 3, 1], params(1, 0, 0, false));
        assert_eq!(dst, [0, 0, 0, 0, 1, 2, 0, 4, 5]);
        // Offset (2, 2): content moves up-left, zeros at bottom/right.
        apply(&src, &mut dst, [3, 3, 1], params(1, 2, 2, false));
        assert_eq!(dst, [5, 6, 0, 8, 9, 0, 0, 0, 0]);
        // Offset (0, 2): down and left.
        apply(&src, &mut dst, [3, 3, 1], params(1, 0, 2, false));
        assert_eq!(dst, [0, 0, 0, 2, 3, 0, 5, 6, 0]);
        // Crop (0, 0) then flip.
        apply(&src, &mut dst, [3, 3, 1], params(1, 0, 0, true));
        assert_eq!(dst, [0, 0, 0, 2, 1, 0, 5, 4, 0]);
    }

    #[test]
    fn padding_as_large_as_the_image() {
        // 2 x 2 with padding 2: offset (0, 0) shows only zeros.
        let src = [1, 2, 3, 4];
        let mut dst = [9u8; 4];
        apply(&src, &mut dst, [2, 2, 1], params(2, 0, 0, false));
        assert_eq!(dst, [0, 0, 0, 0]);
        apply(&src, &mut dst, [2, 2, 1], params(2, 2, 2, true));
        assert_eq!(dst, [2, 1, 4, 3]);
    }

    #[test]
    fn matches_reference_for_every_offset() {
        for &[h, w, c] in &[[1, 1, 1], [3, 4, 1], [4, 3, 2], [5, 5, 3], [2, 7, 1]] {
            let src: Vec<u8> = (0..h * w * c).map(|i| (i * 7 + 1) as u8).collect();
            let mut dst = vec![0u8; src.len()];
            for pad in 0..4 {
                for dy in 0..=2 * pad {
                    for dx in 0..=2 * pad {
                        for flip in [false, true] {
                            let p = params(pad, dy, dx, flip);
                            dst.fill(0xAA);
                            apply(&src, &mut dst, [h, w, c], p);
                            assert_eq!(dst, reference(&src, [h, w, c], p), "{:?} {p:?}", [h, w, c]);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn params_are_a_function_of_seed_epoch_index() {
        let cfg = AugmentConfig {
            crop_padding: 4,
            flip: true,
        };
        assert_eq!(cfg.params(1, 2, 3), cfg.params(1, 2, 3));
        let all: Vec<_> = (0..1000).map(|i| cfg.params(1, 2, i)).collect();
        assert!(all.iter().all(|p| p.dy <= 8 && p.dx <= 8 && p.pad == 4));
        let flips = all.iter().filter(|p| p.flip).count();
        assert!((400..600).contains(&flips), "flip rate {flips}/1000");
        for v in 0..=8 {
            assert!(all.iter().any(|p| p.dy == v) && all.iter().any(|p| p.dx == v));
        }
        let other: Vec<_> = (0..1000).map(|i| cfg.params(1, 3, i)).collect();
        assert_ne!(all, other, "another epoch must give other augmentations");
        // Turning flip off keeps the offsets.
        let no_flip = AugmentConfig {
            crop_padding: 4,
            flip: false,
        };
        for i in 0..100 {
            let (a, b) = (cfg.params(1, 2, i), no_flip.params(1, 2, i));
            assert_eq!((a.dy, a.dx, b.flip), (b.dy, b.dx, false));
        }
    }

    #[test]
    fn config_deserializes_with_defaults_and_rejects_unknown_keys() {
        let c: AugmentConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(c, AugmentConfig::default());
        assert!(c.is_identity());
        let c: AugmentConfig =
            serde_json::from_str(r#"{"crop_padding": 4, "flip": true}"#).unwrap();
        assert_eq!(
            c,
            AugmentConfig {
                crop_padding: 4,
                flip: true
            }
        );
        let err = serde_json::from_str::<AugmentConfig>(r#"{"flp": true}"#).unwrap_err();
        assert!(err.to_string().contains("flp"), "{err}");
    }
}
