//! A validation split carved from a training set: [`split_off`] draws a
//! fixed number of sample ids with a seeded generator and returns two
//! [`Subset`]s of the same dataset, the drawn ids and the rest.
//!
//! Memory: only the drawn ids are held (sorted, 8 bytes each); the rest
//! is their complement, mapped by a binary search over them, so splitting
//! ten million samples 90/10 holds 1 M ids, not 10 M. Both subsets keep
//! the source's id order, so a sharded source still reads a shard's
//! samples together: a subset's shard layout is the source's with each
//! shard's count of the subset's ids.

use std::sync::Arc;

use crate::rng::{key, SplitMix64};
use crate::{Dataset, LoaderError, MemoryUsage, SampleKind, ShardLayout};

/// The samples of `inner` whose ids are in `drawn` (sorted, distinct), or,
/// for the complement, those whose ids are not.
pub struct Subset {
    inner: Arc<dyn Dataset>,
    drawn: Arc<Vec<usize>>,
    complement: bool,
}

/// Splits `dataset` into (the rest, `count` samples drawn by `seed`): the
/// same ids for the same dataset length, count and seed, whatever else
/// changes (the loader's seed, the thread count). `count` must leave at
/// least one sample on each side.
pub fn split_off(
    dataset: Arc<dyn Dataset>,
    count: usize,
    seed: u64,
) -> Result<(Subset, Subset), LoaderError> {
    let len = dataset.len();
    if count == 0 || count >= len {
        return Err(LoaderError::Config {
            field: "validation",
            message: format!(
                "a validation split of {count} samples from a training set of {len}: \
                 it must leave at least one sample on each side"
            ),
        });
    }
    let drawn = Arc::new(draw(len, count, seed)?);
    Ok((
        Subset {
            inner: Arc::clone(&dataset),
            drawn: Arc::clone(&drawn),
            complement: true,
        },
        Subset {
            inner: dataset,
            drawn,
            complement: false,
        },
    ))
}

/// `count` distinct ids below `len`, sorted: Floyd's sampling, which
/// draws exactly `count` numbers and holds only the chosen ones.
fn draw(len: usize, count: usize, seed: u64) -> Result<Vec<usize>, LoaderError> {
    let mut rng = SplitMix64::new(key(&[seed, len as u64, count as u64]));
    let mut chosen = std::collections::HashSet::new();
    chosen.try_reserve(count).map_err(|e| LoaderError::Config {
        field: "validation",
        message: format!("{count} validation ids cannot be held in memory: {e}"),
    })?;
    for upper in (len - count)..len {
        let pick = rng.below(upper as u64 + 1) as usize;
        if !chosen.insert(pick) {
            chosen.insert(upper);
        }
    }
    let mut drawn: Vec<usize> = chosen.into_iter().collect();
    drawn.sort_unstable();
    Ok(drawn)
}

impl Subset {
    /// The id in the source of this subset's sample `index`.
    pub fn source_id(&self, index: usize) -> usize {
        if !self.complement {
            return self.drawn[index];
        }
        // The drawn ids below the answer: those whose own place among the
        // rest (`id - j`, non-decreasing in j) is at or before `index`.
        let before = partition(&self.drawn, |j, id| id - j <= index);
        index + before
    }

    /// Whether this is the drawn part (the validation split).
    pub fn is_drawn(&self) -> bool {
        !self.complement
    }
}

/// The number of leading `(j, ids[j])` for which `keep` holds (it holds
/// for a prefix).
fn partition(ids: &[usize], keep: impl Fn(usize, usize) -> bool) -> usize {
    let (mut lo, mut hi) = (0, ids.len());
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if keep(mid, ids[mid]) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

impl Dataset for Subset {
    fn len(&self) -> usize {
        if self.complement {
            self.inner.len() - self.drawn.len()
        } else {
            self.drawn.len()
        }
    }

    fn sample_shape(&self) -> [usize; 3] {
        self.inner.sample_shape()
    }

    fn num_classes(&self) -> usize {
        self.inner.num_classes()
    }

    fn read(&self, index: usize, out: &mut [u8]) -> Result<u32, LoaderError> {
        if index >= self.len() {
            return Err(LoaderError::Index {
                index,
                len: self.len(),
            });
        }
        self.inner.read(self.source_id(index), out)
    }

    fn sample_kind(&self) -> SampleKind {
        self.inner.sample_kind()
    }

    fn fingerprint(&self) -> Option<u32> {
        let source = self.inner.fingerprint()?;
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&source.to_le_bytes());
        hasher.update(&[u8::from(self.complement)]);
        for &id in self.drawn.iter() {
            hasher.update(&(id as u64).to_le_bytes());
        }
        Some(hasher.finalize())
    }

    fn shard_layout(&self) -> Option<ShardLayout> {
        let layout = self.inner.shard_layout()?;
        let mut first = 0usize;
        let mut shard_lens = Vec::with_capacity(layout.shard_lens.len());
        for &len in &layout.shard_lens {
            let end = first + len;
            let drawn = partition(&self.drawn, |_, id| id < end)
                - partition(&self.drawn, |_, id| id < first);
            let here = if self.complement { len - drawn } else { drawn };
            if here > 0 {
                shard_lens.push(here);
            }
            first = end;
        }
        Some(ShardLayout {
            shard_lens,
            window: layout.window,
        })
    }

    fn prefetch_order(&self, order: &mut dyn Iterator<Item = usize>) {
        let mut mapped = order.filter(|&i| i < self.len()).map(|i| self.source_id(i));
        self.inner.prefetch_order(&mut mapped);
    }

    fn memory_limit(&self) -> u64 {
        self.inner.memory_limit()
    }

    fn memory_usage(&self) -> MemoryUsage {
        self.inner.memory_usage()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SyntheticDataset;

    fn ids(subset: &Subset) -> Vec<usize> {
        (0..subset.len()).map(|i| subset.source_id(i)).collect()
    }

    #[test]
    fn the_two_parts_cover_every_sample_once_in_source_order() {
        let data: Arc<dyn Dataset> = Arc::new(SyntheticDataset::new(1000, [2, 2, 1], 10));
        let (rest, drawn) = split_off(Arc::clone(&data), 100, 7).unwrap();
        assert_eq!((rest.len(), drawn.len()), (900, 100));
        let (rest_ids, drawn_ids) = (ids(&rest), ids(&drawn));
        assert!(rest_ids.windows(2).all(|w| w[0] < w[1]));
        assert!(drawn_ids.windows(2).all(|w| w[0] < w[1]));
        let mut all: Vec<usize> = rest_ids.iter().chain(&drawn_ids).copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..1000).collect::<Vec<_>>());
        // Spread over the set, not a block at one end.
        assert!(drawn_ids[0] < 100 && drawn_ids[99] > 900, "{drawn_ids:?}");
    }

    #[test]
    fn the_split_depends_on_the_seed_only() {
        let data: Arc<dyn Dataset> = Arc::new(SyntheticDataset::new(500, [1, 1, 1], 2));
        let once = ids(&split_off(Arc::clone(&data), 50, 3).unwrap().1);
        let again = ids(&split_off(Arc::clone(&data), 50, 3).unwrap().1);
        let other = ids(&split_off(data, 50, 4).unwrap().1);
        assert_eq!(once, again);
        assert_ne!(once, other);
    }

    #[test]
    fn a_subset_reads_its_source_samples() {
        let source = SyntheticDataset::new(64, [3, 3, 1], 4);
        let data: Arc<dyn Dataset> = Arc::new(source.clone());
        let (rest, drawn) = split_off(data, 16, 1).unwrap();
        for part in [&rest, &drawn] {
            let mut out = vec![0u8; 9];
            for i in 0..part.len() {
                let label = part.read(i, &mut out).unwrap();
                let (pixels, expected) = source.sample(part.source_id(i));
                assert_eq!((out.clone(), label), (pixels, expected));
            }
            assert!(matches!(
                part.read(part.len(), &mut out),
                Err(LoaderError::Index { .. })
            ));
        }
    }

    /// A source whose samples sit in shards of 10, 20 and 5.
    struct Sharded(SyntheticDataset);

    impl Dataset for Sharded {
        fn len(&self) -> usize {
            self.0.len()
        }
        fn sample_shape(&self) -> [usize; 3] {
            self.0.sample_shape()
        }
        fn num_classes(&self) -> usize {
            self.0.num_classes()
        }
        fn read(&self, index: usize, out: &mut [u8]) -> Result<u32, LoaderError> {
            self.0.read(index, out)
        }
        fn shard_layout(&self) -> Option<ShardLayout> {
            Some(ShardLayout {
                shard_lens: vec![10, 20, 5],
                window: 2,
            })
        }
    }

    #[test]
    fn each_part_keeps_the_shards_with_its_own_counts() {
        let data: Arc<dyn Dataset> = Arc::new(Sharded(SyntheticDataset::new(35, [1, 1, 1], 2)));
        let (rest, drawn) = split_off(data, 12, 5).unwrap();
        let count_in = |ids: &[usize], range: std::ops::Range<usize>| {
            ids.iter().filter(|&&id| range.contains(&id)).count()
        };
        for part in [&rest, &drawn] {
            let ids = ids(part);
            let expected: Vec<usize> = [0..10, 10..30, 30..35]
                .into_iter()
                .map(|r| count_in(&ids, r))
                .filter(|&n| n > 0)
                .collect();
            let layout = part.shard_layout().unwrap();
            assert_eq!(layout.shard_lens, expected);
            assert_eq!(layout.shard_lens.iter().sum::<usize>(), part.len());
            assert_eq!(layout.window, 2);
        }
    }

    #[test]
    fn a_split_that_leaves_a_side_empty_is_refused() {
        let data: Arc<dyn Dataset> = Arc::new(SyntheticDataset::new(10, [1, 1, 1], 2));
        for count in [0, 10, 11] {
            let err = split_off(Arc::clone(&data), count, 0).err().unwrap();
            assert!(err.to_string().contains("at least one sample"), "{err}");
        }
    }
}
