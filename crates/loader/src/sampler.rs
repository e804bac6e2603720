//! The order in which an epoch visits the samples.

use std::sync::Arc;

use crate::rng::{self, SplitMix64};

/// The visiting order of one epoch: position -> sample index.
#[derive(Clone, Debug)]
pub(crate) enum EpochOrder {
    /// Position `p` reads sample `p`.
    Identity,
    /// Position `p` reads sample `perm[p]`.
    Permuted(Arc<[u32]>),
}

impl EpochOrder {
    /// The order of `epoch` over `len` samples: identity without shuffling,
    /// else a permutation that is a deterministic function of (seed, epoch).
    pub(crate) fn new(len: usize, shuffle: bool, seed: u64, epoch: u64) -> Self {
        if shuffle {
            EpochOrder::Permuted(permutation(len, seed, epoch).into())
        } else {
            EpochOrder::Identity
        }
    }

    #[inline]
    pub(crate) fn index(&self, position: usize) -> usize {
        match self {
            EpochOrder::Identity => position,
            EpochOrder::Permuted(p) => p[position] as usize,
        }
    }
}

/// Fisher-Yates shuffle of `0..len`, driven by SplitMix64 seeded from
/// (seed, epoch).
pub(crate) fn permutation(len: usize, seed: u64, epoch: u64) -> Vec<u32> {
    assert!(
        u32::try_from(len).is_ok(),
        "datasets of more than 2^32 samples are not supported"
    );
    let mut perm: Vec<u32> = (0..len as u32).collect();
    let mut rng = SplitMix64::new(rng::key(&[rng::DOMAIN_SHUFFLE, seed, epoch]));
    for i in (1..len).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        perm.swap(i, j);
    }
    perm
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_is_a_permutation_and_deterministic() {
        let p = permutation(1000, 7, 3);
        let mut sorted = p.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..1000).collect::<Vec<u32>>());
        assert_eq!(p, permutation(1000, 7, 3));
        assert_ne!(p, permutation(1000, 7, 4), "epochs must differ");
        assert_ne!(p, permutation(1000, 8, 3), "seeds must differ");
        assert_ne!(p, (0..1000).collect::<Vec<u32>>());
    }

    #[test]
    fn permutation_is_unbiased_for_small_n() {
        // Each of the 6 orders of 3 elements appears about equally often.
        let mut counts = std::collections::HashMap::new();
        for e in 0..6000 {
            *counts.entry(permutation(3, 1, e)).or_insert(0usize) += 1;
        }
        assert_eq!(counts.len(), 6);
        for (perm, c) in counts {
            assert!((800..1200).contains(&c), "{perm:?}: {c}");
        }
    }

    #[test]
    fn identity_order() {
        let o = EpochOrder::new(10, false, 1, 2);
        assert!((0..10).all(|p| o.index(p) == p));
        assert!(permutation(0, 1, 1).is_empty());
        assert_eq!(permutation(1, 1, 1), vec![0]);
    }
}
