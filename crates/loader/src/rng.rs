//! Small counter-based random numbers.
//!
//! Every random decision of the loader is a pure function of a key such as
//! (seed, epoch) or (seed, epoch, sample id): the key is hashed into a
//! [`SplitMix64`] state, so results never depend on which thread asked, in
//! which order, or how many workers there are.

/// Domain tags keep the streams of different purposes independent.
pub(crate) const DOMAIN_SHUFFLE: u64 = 0x5348_5546_464c_4531; // "SHUFFLE1"
pub(crate) const DOMAIN_AUGMENT: u64 = 0x4155_474d_454e_5431; // "AUGMENT1"
pub(crate) const DOMAIN_SHARD_ORDER: u64 = 0x5348_4152_444f_5244; // "SHARDORD"
pub(crate) const DOMAIN_SHARD_BLOCK: u64 = 0x5348_4152_4442_4c4b; // "SHARDBLK"
pub(crate) const DOMAIN_RANDAUG: u64 = 0x5241_4e44_4155_4731; // "RANDAUG1"
pub(crate) const DOMAIN_MIX: u64 = 0x4d49_5843_5554_4d31; // "MIXCUTM1"
pub(crate) const DOMAIN_MOVING: u64 = 0x4d4f_5649_4e47_3031; // "MOVING01"

/// The SplitMix64 output function (a strong 64-bit mixer).
#[inline]
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Hashes a sequence of words into one key; each word goes through the mixer,
/// so (a, b) and (b, a) give unrelated keys.
#[inline]
pub(crate) fn key(words: &[u64]) -> u64 {
    let mut h = 0x6a09_e667_f3bc_c908u64;
    for &w in words {
        h = mix64(h.wrapping_add(0x9e37_79b9_7f4a_7c15) ^ w);
    }
    h
}

/// SplitMix64 (Steele, Lea, Flood 2014): a tiny generator whose state is a
/// counter, seeded from a [`key`].
#[derive(Clone, Debug)]
pub(crate) struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    #[inline]
    pub(crate) fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    #[inline]
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix64(self.state)
    }

    /// A uniform integer in `0..n` (`n > 0`), without modulo bias (Lemire's
    /// multiply-and-reject method).
    #[inline]
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        debug_assert!(n > 0);
        let mut m = u128::from(self.next_u64()) * u128::from(n);
        if (m as u64) < n {
            let threshold = n.wrapping_neg() % n;
            while (m as u64) < threshold {
                m = u128::from(self.next_u64()) * u128::from(n);
            }
        }
        (m >> 64) as u64
    }

    /// A uniform float in `[0, 1)` with 53 random bits.
    #[inline]
    pub(crate) fn unit_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A standard normal sample (Box-Muller).
    pub(crate) fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.unit_f64(); // (0, 1]: ln is finite
        let u2 = self.unit_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// A Gamma(alpha, 1) sample (`alpha > 0`): Marsaglia and Tsang's method,
    /// with the `U^(1/alpha)` boost for `alpha < 1`.
    pub(crate) fn gamma(&mut self, alpha: f64) -> f64 {
        debug_assert!(alpha > 0.0);
        if alpha < 1.0 {
            let u = 1.0 - self.unit_f64();
            return self.gamma(alpha + 1.0) * u.powf(1.0 / alpha);
        }
        let d = alpha - 1.0 / 3.0;
        let c = 1.0 / (9.0 * d).sqrt();
        loop {
            let x = self.normal();
            let v = 1.0 + c * x;
            if v <= 0.0 {
                continue;
            }
            let v = v * v * v;
            let u = 1.0 - self.unit_f64();
            if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
                return d * v;
            }
        }
    }

    /// A Beta(a, b) sample in `[0, 1]`, as `X / (X + Y)` with
    /// `X ~ Gamma(a)`, `Y ~ Gamma(b)`.
    pub(crate) fn beta(&mut self, a: f64, b: f64) -> f64 {
        let x = self.gamma(a);
        let y = self.gamma(b);
        if x + y > 0.0 {
            x / (x + y)
        } else {
            // Both underflowed (tiny alphas): either end is as likely.
            if self.next_u64() >> 63 == 1 {
                1.0
            } else {
                0.0
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_matches_reference_sequence() {
        // Reference values of SplitMix64 seeded with 0 (Vigna's splitmix64.c).
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(r.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(r.next_u64(), 0x06c4_5d18_8009_454f);
    }

    #[test]
    fn below_is_in_range_and_roughly_uniform() {
        let mut r = SplitMix64::new(42);
        let mut counts = [0usize; 7];
        for _ in 0..70_000 {
            let v = r.below(7) as usize;
            counts[v] += 1;
        }
        for c in counts {
            assert!((9_000..11_000).contains(&c), "{counts:?}");
        }
        assert_eq!(r.below(1), 0);
    }

    #[test]
    fn beta_has_the_right_mean_and_variance() {
        for alpha in [0.2f64, 0.4, 1.0, 2.0] {
            let mut r = SplitMix64::new(key(&[9, alpha.to_bits()]));
            let n = 40_000;
            let xs: Vec<f64> = (0..n).map(|_| r.beta(alpha, alpha)).collect();
            assert!(xs.iter().all(|x| (0.0..=1.0).contains(x)));
            let mean = xs.iter().sum::<f64>() / n as f64;
            let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
            let want_var = 1.0 / (4.0 * (2.0 * alpha + 1.0));
            assert!((mean - 0.5).abs() < 0.01, "alpha {alpha}: mean {mean}");
            assert!(
                (var - want_var).abs() < 0.05 * want_var,
                "alpha {alpha}: variance {var}, want {want_var}"
            );
        }
        let mut r = SplitMix64::new(1);
        let g: f64 = (0..20_000).map(|_| r.gamma(3.0)).sum::<f64>() / 20_000.0;
        assert!((g - 3.0).abs() < 0.05, "Gamma(3) mean {g}");
    }

    #[test]
    fn keys_depend_on_every_word_and_order() {
        assert_ne!(key(&[1, 2, 3]), key(&[1, 2, 4]));
        assert_ne!(key(&[1, 2]), key(&[2, 1]));
        assert_ne!(key(&[0]), key(&[0, 0]));
        assert_eq!(key(&[5, 6, 7]), key(&[5, 6, 7]));
    }
}
