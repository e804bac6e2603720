//! Small counter-based random numbers.
//!
//! Every random decision of the loader is a pure function of a key such as
//! (seed, epoch) or (seed, epoch, sample id): the key is hashed into a
//! [`SplitMix64`] state, so results never depend on which thread asked, in
//! which order, or how many workers there are.

/// Domain tags keep the streams of different purposes independent.
pub(crate) const DOMAIN_SHUFFLE: u64 = 0x5348_5546_464c_4531; // "SHUFFLE1"
pub(crate) const DOMAIN_AUGMENT: u64 = 0x4155_474d_454e_5431; // "AUGMENT1"

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
    fn keys_depend_on_every_word_and_order() {
        assert_ne!(key(&[1, 2, 3]), key(&[1, 2, 4]));
        assert_ne!(key(&[1, 2]), key(&[2, 1]));
        assert_ne!(key(&[0]), key(&[0, 0]));
        assert_eq!(key(&[5, 6, 7]), key(&[5, 6, 7]));
    }
}
