//! Augmentations on u8 HWC images: random crop with zero padding,
//! horizontal flip, a RandAugment subset ([`crate::randaugment`]) and the
//! batch-level Mixup / CutMix ([`crate::mix`]). Their random numbers are a
//! function of (seed, epoch, sample id) — or (seed, epoch, batch number) for
//! the batch-level ones — only, and the per-sample ones write straight into
//! the batch buffer without allocating.

use serde::{Deserialize, Serialize};

use crate::rng::{self, SplitMix64};

/// Which augmentations the loader applies. `Default` applies none.
///
/// Per sample, in this order: random crop, flip, RandAugment. Per batch,
/// after that: Mixup or CutMix (one of them per batch, each with
/// probability 1/2 when both are on), which give the batch soft targets.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AugmentConfig {
    /// Random crop: pad each side with `crop_padding` zero pixels, then crop
    /// back to h x w at a random offset in `[0, 2 * crop_padding]`. 0 = off.
    #[serde(default)]
    pub crop_padding: usize,
    /// Horizontal flip with probability 0.5.
    #[serde(default)]
    pub flip: bool,
    /// RandAugment: `num_ops` random operations of strength `magnitude` per
    /// sample. `None` = off.
    #[serde(default)]
    pub rand_augment: Option<RandAugmentConfig>,
    /// Mixup: blend each sample with its batch neighbour with weight
    /// lambda ~ Beta(alpha, alpha). 0 = off.
    #[serde(default)]
    pub mixup_alpha: f32,
    /// CutMix: paste a box of the neighbouring sample, of area 1 - lambda
    /// with lambda ~ Beta(alpha, alpha). 0 = off.
    #[serde(default)]
    pub cutmix_alpha: f32,
}

/// RandAugment (Cubuk et al. 2020) restricted to operations that suit small
/// grayscale images: identity, translate x/y, rotate, shear x/y (bilinear,
/// zero fill), brightness, contrast, sharpness, posterize and solarize.
/// Magnitude 0 leaves every image unchanged; the scales follow torchvision's
/// `RandAugment` with 31 bins.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RandAugmentConfig {
    /// Operations applied to each sample (chosen uniformly, with
    /// repetition). Default 2.
    #[serde(default = "default_num_ops")]
    pub num_ops: usize,
    /// Strength of every operation, `0..=30`. Default 9.
    #[serde(default = "default_magnitude")]
    pub magnitude: u32,
}

fn default_num_ops() -> usize {
    2
}

fn default_magnitude() -> u32 {
    9
}

impl Default for RandAugmentConfig {
    fn default() -> Self {
        Self {
            num_ops: default_num_ops(),
            magnitude: default_magnitude(),
        }
    }
}

/// Highest RandAugment magnitude.
pub const MAX_MAGNITUDE: u32 = 30;
/// Most RandAugment operations per sample (a guard against typos).
pub(crate) const MAX_NUM_OPS: usize = 16;

impl AugmentConfig {
    /// Whether this configuration leaves every sample unchanged and mixes
    /// nothing.
    pub fn is_identity(&self) -> bool {
        self.per_sample_identity() && !self.mixes()
    }

    /// Whether the per-sample augmentations (crop, flip, RandAugment) are
    /// all off.
    pub(crate) fn per_sample_identity(&self) -> bool {
        self.crop_padding == 0 && !self.flip && self.rand_augment.is_none_or(|r| r.num_ops == 0)
    }

    /// The key of the first augmentation that needs a sample's pixels on
    /// the host (RandAugment, Mixup, CutMix), if one is on: those cannot be
    /// made from a dataset resident on a device, crop and flip can.
    pub fn host_only_key(&self) -> Option<&'static str> {
        [
            (
                "augment.rand_augment",
                self.rand_augment.is_some_and(|r| r.num_ops > 0),
            ),
            ("augment.mixup_alpha", self.mixup_alpha > 0.0),
            ("augment.cutmix_alpha", self.cutmix_alpha > 0.0),
        ]
        .into_iter()
        .find_map(|(key, on)| on.then_some(key))
    }

    /// Whether batches are mixed (Mixup or CutMix), and so carry soft targets.
    pub fn mixes(&self) -> bool {
        self.mixup_alpha > 0.0 || self.cutmix_alpha > 0.0
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
            ..AugmentConfig::default()
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
            ..AugmentConfig::default()
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
                flip: true,
                ..AugmentConfig::default()
            }
        );
        let err = serde_json::from_str::<AugmentConfig>(r#"{"flp": true}"#).unwrap_err();
        assert!(err.to_string().contains("flp"), "{err}");
        let c: AugmentConfig = serde_json::from_str(
            r#"{"rand_augment": {"num_ops": 3}, "mixup_alpha": 0.2, "cutmix_alpha": 1.0}"#,
        )
        .unwrap();
        assert_eq!(
            c.rand_augment,
            Some(RandAugmentConfig {
                num_ops: 3,
                magnitude: 9
            })
        );
        assert_eq!((c.mixup_alpha, c.cutmix_alpha), (0.2, 1.0));
        assert!(c.mixes() && !c.is_identity() && !c.per_sample_identity());
        let err = serde_json::from_str::<AugmentConfig>(r#"{"rand_augment": {"magnitud": 3}}"#)
            .unwrap_err();
        assert!(err.to_string().contains("magnitud"), "{err}");
        let c = AugmentConfig {
            rand_augment: Some(RandAugmentConfig {
                num_ops: 0,
                magnitude: 5,
            }),
            ..AugmentConfig::default()
        };
        assert!(c.is_identity(), "zero operations change nothing");
    }
}
