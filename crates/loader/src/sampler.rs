//! The order in which an epoch visits the samples.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::rng::{self, SplitMix64};
use crate::ShardLayout;

/// How a shuffled epoch orders the samples.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShuffleMode {
    /// A uniform random permutation of all samples.
    #[default]
    Global,
    /// Shard-aware: shuffle the order of the shards, cut it into blocks of
    /// `window` shards (the dataset's [`ShardLayout::window`], which is the
    /// number of shards its cache holds), and shuffle the samples within each
    /// block. A shard cache of `window` shards then reads every shard once
    /// per epoch. Datasets without a shard layout are shuffled globally.
    ShardBlocks,
}

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
    /// else a permutation that is a deterministic function of (seed, epoch)
    /// (and of the shard layout for [`ShuffleMode::ShardBlocks`]).
    pub(crate) fn new(
        len: usize,
        shuffle: bool,
        mode: ShuffleMode,
        layout: Option<&ShardLayout>,
        seed: u64,
        epoch: u64,
    ) -> Self {
        if !shuffle {
            return EpochOrder::Identity;
        }
        let perm = match (mode, layout) {
            (ShuffleMode::ShardBlocks, Some(layout)) => shard_blocks(layout, seed, epoch),
            _ => permutation(len, seed, epoch),
        };
        debug_assert_eq!(perm.len(), len);
        EpochOrder::Permuted(perm.into())
    }

    #[inline]
    pub(crate) fn index(&self, position: usize) -> usize {
        match self {
            EpochOrder::Identity => position,
            EpochOrder::Permuted(p) => p[position] as usize,
        }
    }
}

/// Fisher-Yates shuffle of `v` driven by `rng`.
fn shuffle<T>(v: &mut [T], rng: &mut SplitMix64) {
    for i in (1..v.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        v.swap(i, j);
    }
}

fn check_len(len: usize) {
    assert!(
        u32::try_from(len).is_ok(),
        "datasets of more than 2^32 samples are not supported"
    );
}

/// Fisher-Yates shuffle of `0..len`, driven by SplitMix64 seeded from
/// (seed, epoch).
pub(crate) fn permutation(len: usize, seed: u64, epoch: u64) -> Vec<u32> {
    check_len(len);
    let mut perm: Vec<u32> = (0..len as u32).collect();
    let mut rng = SplitMix64::new(rng::key(&[rng::DOMAIN_SHUFFLE, seed, epoch]));
    shuffle(&mut perm, &mut rng);
    perm
}

/// The [`ShuffleMode::ShardBlocks`] order: shards in a random order, cut
/// into blocks of `layout.window` shards, samples shuffled within each block.
pub(crate) fn shard_blocks(layout: &ShardLayout, seed: u64, epoch: u64) -> Vec<u32> {
    let len: usize = layout.shard_lens.iter().sum();
    check_len(len);
    let mut starts = Vec::with_capacity(layout.shard_lens.len());
    let mut acc = 0u32;
    for &n in &layout.shard_lens {
        starts.push(acc);
        acc += n as u32;
    }
    let mut shards: Vec<u32> = (0..layout.shard_lens.len() as u32).collect();
    let mut rng = SplitMix64::new(rng::key(&[rng::DOMAIN_SHARD_ORDER, seed, epoch]));
    shuffle(&mut shards, &mut rng);
    let mut out = Vec::with_capacity(len);
    for (b, block) in shards.chunks(layout.window.max(1)).enumerate() {
        let from = out.len();
        for &k in block {
            let start = starts[k as usize];
            out.extend(start..start + layout.shard_lens[k as usize] as u32);
        }
        let mut rng = SplitMix64::new(rng::key(&[rng::DOMAIN_SHARD_BLOCK, seed, epoch, b as u64]));
        shuffle(&mut out[from..], &mut rng);
    }
    out
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
        let o = EpochOrder::new(10, false, ShuffleMode::Global, None, 1, 2);
        assert!((0..10).all(|p| o.index(p) == p));
        assert!(permutation(0, 1, 1).is_empty());
        assert_eq!(permutation(1, 1, 1), vec![0]);
    }

    fn shard_of(lens: &[usize], i: u32) -> usize {
        let mut acc = 0;
        for (k, &n) in lens.iter().enumerate() {
            acc += n;
            if (i as usize) < acc {
                return k;
            }
        }
        panic!("sample {i} past the end");
    }

    #[test]
    fn shard_blocks_is_a_deterministic_permutation_with_bounded_live_shards() {
        let lens = vec![7, 7, 7, 7, 7, 7, 7, 3];
        for window in [1, 2, 3, 8, 20] {
            let layout = ShardLayout {
                shard_lens: lens.clone(),
                window,
            };
            let p = shard_blocks(&layout, 5, 1);
            let mut sorted = p.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..52).collect::<Vec<u32>>(), "window {window}");
            assert_eq!(p, shard_blocks(&layout, 5, 1));
            assert_ne!(p, shard_blocks(&layout, 5, 2), "epochs must differ");
            assert_ne!(p, shard_blocks(&layout, 6, 1), "seeds must differ");
            // A shard is live from its first to its last position; at most
            // `window` shards are live at any position.
            let mut first = [usize::MAX; 8];
            let mut last = [0usize; 8];
            for (pos, &i) in p.iter().enumerate() {
                let k = shard_of(&lens, i);
                first[k] = first[k].min(pos);
                last[k] = pos;
            }
            for pos in 0..p.len() {
                let live = (0..8)
                    .filter(|&k| first[k] <= pos && pos <= last[k])
                    .count();
                assert!(live <= window, "window {window}: {live} live at {pos}");
            }
            // The samples are mixed within a block, not left in shard order.
            if window >= 2 {
                let switches = p
                    .windows(2)
                    .filter(|w| shard_of(&lens, w[0]) != shard_of(&lens, w[1]))
                    .count();
                assert!(switches > 16, "window {window}: {switches} shard switches");
            }
        }
        // The shard order itself is shuffled.
        let layout = ShardLayout {
            shard_lens: vec![4; 16],
            window: 1,
        };
        let p = shard_blocks(&layout, 1, 1);
        let order: Vec<usize> = p
            .chunks(4)
            .map(|c| shard_of(&layout.shard_lens, c[0]))
            .collect();
        assert_ne!(order, (0..16).collect::<Vec<_>>());
    }

    #[test]
    fn shard_blocks_falls_back_to_global_without_a_layout() {
        let o = EpochOrder::new(100, true, ShuffleMode::ShardBlocks, None, 3, 4);
        let g = permutation(100, 3, 4);
        assert!((0..100).all(|p| o.index(p) == g[p] as usize));
    }
}
