//! Batch-level Mixup and CutMix.
//!
//! Sample `j` of a batch is mixed with its neighbour `j - 1` (sample 0 with
//! the last one: torchvision's `roll(1)`), with lambda ~ Beta(alpha, alpha)
//! drawn once per batch from (seed, epoch, batch number). The soft target of
//! sample `j` is `lambda * onehot(y_j) + (1 - lambda) * onehot(y_{j-1})`,
//! with lambda the weight actually applied to the pixels.

use crate::augment::AugmentConfig;
use crate::rng::{self, SplitMix64};

/// What was done to a batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Mix {
    /// `out = lambda a + (1 - lambda) b`, with lambda = `weight / 65536`.
    Mixup { weight: u32 },
    /// Rows `y0..y1`, columns `x0..x1` come from the neighbour.
    CutMix {
        y0: usize,
        y1: usize,
        x0: usize,
        x1: usize,
    },
}

impl Mix {
    /// The weight of a sample's own label.
    pub(crate) fn lambda(&self, h: usize, w: usize) -> f32 {
        match *self {
            Mix::Mixup { weight } => weight as f32 / 65536.0,
            Mix::CutMix { y0, y1, x0, x1 } => 1.0 - ((y1 - y0) * (x1 - x0)) as f32 / (h * w) as f32,
        }
    }
}

/// Draws the mix of batch `batch` of `epoch`. `None` if mixing is off.
pub(crate) fn draw(
    cfg: &AugmentConfig,
    seed: u64,
    epoch: u64,
    batch: usize,
    h: usize,
    w: usize,
) -> Option<Mix> {
    if !cfg.mixes() {
        return None;
    }
    let mut r = SplitMix64::new(rng::key(&[rng::DOMAIN_MIX, seed, epoch, batch as u64]));
    let coin = (r.next_u64() >> 63) == 1;
    let cutmix = match (cfg.mixup_alpha > 0.0, cfg.cutmix_alpha > 0.0) {
        (true, true) => coin,
        (false, true) => true,
        _ => false,
    };
    let alpha = f64::from(if cutmix {
        cfg.cutmix_alpha
    } else {
        cfg.mixup_alpha
    });
    let lambda = r.beta(alpha, alpha);
    if !cutmix {
        let weight = (lambda * 65536.0).round() as u32;
        return Some(Mix::Mixup { weight });
    }
    // torchvision v2 CutMix: a box centred uniformly, with half-sides
    // sqrt(1 - lambda) / 2 of the image, clipped to the image.
    let cy = r.below(h as u64) as usize;
    let cx = r.below(w as u64) as usize;
    let half = 0.5 * (1.0 - lambda).sqrt();
    let (hh, hw) = ((half * h as f64) as usize, (half * w as f64) as usize);
    Some(Mix::CutMix {
        y0: cy.saturating_sub(hh),
        y1: (cy + hh).min(h),
        x0: cx.saturating_sub(hw),
        x1: (cx + hw).min(w),
    })
}

/// Mixes the `n` samples of `pixels` (`[n, h, w, c]`) in place and returns
/// the soft targets (`n * num_classes`).
pub(crate) fn apply(
    mix: Mix,
    pixels: &mut [u8],
    labels: &[u32],
    shape: [usize; 4],
    num_classes: usize,
) -> Vec<f32> {
    let [n, h, w, c] = shape;
    let len = h * w * c;
    debug_assert_eq!(pixels.len(), n * len);
    if n > 1 {
        // Sample j reads the original sample j - 1: go downwards so it is not
        // yet mixed, and keep the original last sample for sample 0.
        let last = pixels[(n - 1) * len..].to_vec();
        for j in (0..n).rev() {
            let (before, rest) = pixels.split_at_mut(j * len);
            let other: &[u8] = if j == 0 {
                &last
            } else {
                &before[(j - 1) * len..]
            };
            mix_one(mix, &mut rest[..len], &other[..len], [h, w, c]);
        }
    }
    let lambda = mix.lambda(h, w);
    let mut targets = vec![0f32; n * num_classes];
    for (j, t) in targets.chunks_exact_mut(num_classes).enumerate() {
        let partner = (j + n - 1) % n;
        t[labels[j] as usize] += lambda;
        t[labels[partner] as usize] += 1.0 - lambda;
    }
    targets
}

fn mix_one(mix: Mix, dst: &mut [u8], other: &[u8], [_, w, c]: [usize; 3]) {
    match mix {
        Mix::Mixup { weight } => {
            let (a, b) = (weight, 65536 - weight);
            for (d, &o) in dst.iter_mut().zip(other) {
                *d = ((u32::from(*d) * a + u32::from(o) * b + 32768) >> 16) as u8;
            }
        }
        Mix::CutMix { y0, y1, x0, x1 } => {
            for y in y0..y1 {
                let (s, e) = ((y * w + x0) * c, (y * w + x1) * c);
                dst[s..e].copy_from_slice(&other[s..e]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(mixup: f32, cutmix: f32) -> AugmentConfig {
        AugmentConfig {
            mixup_alpha: mixup,
            cutmix_alpha: cutmix,
            ..AugmentConfig::default()
        }
    }

    #[test]
    fn no_mix_when_off_and_both_kinds_when_both_on() {
        assert_eq!(draw(&AugmentConfig::default(), 1, 2, 3, 28, 28), None);
        let both = cfg(0.4, 1.0);
        let draws: Vec<Mix> = (0..200)
            .map(|b| draw(&both, 1, 2, b, 28, 28).unwrap())
            .collect();
        let cut = draws
            .iter()
            .filter(|m| matches!(m, Mix::CutMix { .. }))
            .count();
        assert!((60..140).contains(&cut), "{cut}/200 CutMix");
        assert_eq!(draw(&both, 1, 2, 3, 28, 28), draw(&both, 1, 2, 3, 28, 28));
        assert!(matches!(
            draw(&cfg(0.0, 1.0), 1, 2, 3, 28, 28),
            Some(Mix::CutMix { .. })
        ));
        assert!(matches!(
            draw(&cfg(1.0, 0.0), 1, 2, 3, 28, 28),
            Some(Mix::Mixup { .. })
        ));
    }

    #[test]
    fn mixup_blends_with_the_previous_sample() {
        let (n, len) = (3, 4);
        let orig: Vec<u8> = vec![0, 100, 200, 255, 10, 20, 30, 40, 255, 255, 0, 0];
        let mut px = orig.clone();
        let labels = [0, 1, 2];
        let mix = Mix::Mixup { weight: 49152 }; // lambda 0.75
        let t = apply(mix, &mut px, &labels, [n, 1, len, 1], 3);
        for j in 0..n {
            let p = (j + n - 1) % n;
            for k in 0..len {
                let want =
                    0.75 * f64::from(orig[j * len + k]) + 0.25 * f64::from(orig[p * len + k]);
                assert!((f64::from(px[j * len + k]) - want).abs() <= 0.5, "{j} {k}");
            }
        }
        assert_eq!(t, vec![0.75, 0.0, 0.25, 0.25, 0.75, 0.0, 0.0, 0.25, 0.75]);
    }

    #[test]
    fn cutmix_pastes_the_box_and_weights_by_area() {
        let (h, w) = (4, 5);
        let orig: Vec<u8> = (0..2 * h * w).map(|i| i as u8).collect();
        let mut px = orig.clone();
        let mix = Mix::CutMix {
            y0: 1,
            y1: 3,
            x0: 2,
            x1: 5,
        };
        let t = apply(mix, &mut px, &[1, 1], [2, h, w, 1], 2);
        for j in 0..2 {
            for y in 0..h {
                for x in 0..w {
                    let inside = (1..3).contains(&y) && (2..5).contains(&x);
                    let src = if inside { 1 - j } else { j };
                    assert_eq!(px[j * 20 + y * w + x], orig[src * 20 + y * w + x]);
                }
            }
        }
        // Same label on both sides: the target is one-hot.
        assert_eq!(t, vec![0.0, 1.0, 0.0, 1.0]);
        assert!((mix.lambda(h, w) - 0.7).abs() < 1e-6);
    }
}
