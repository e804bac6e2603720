//! The dataset contract.

use crate::LoaderError;

/// How a dataset's samples are grouped on storage, for shard-aware
/// shuffling ([`crate::ShuffleMode::ShardBlocks`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardLayout {
    /// Samples per shard, in sample-id order: shard `k` holds the
    /// `shard_lens[k]` sample ids that follow those of shard `k - 1`.
    pub shard_lens: Vec<usize>,
    /// How many shards may be in use at once without the cache evicting a
    /// shard that is still needed (>= 1): the shuffle window.
    pub window: usize,
}

/// Bytes a dataset holds in memory (decoded samples, shard cache).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryUsage {
    /// Held now.
    pub current: u64,
    /// The most held at any time so far.
    pub peak: u64,
}

/// A random-access collection of labelled u8 images.
///
/// Implementations are shared by the worker threads through an `Arc`, so
/// `read` takes `&self` and must be safe to call concurrently.
///
/// Only `len`, `sample_shape`, `num_classes` and `read` are required; the
/// other methods let storage-backed datasets (the shard store) cooperate
/// with the loader and have do-nothing defaults.
pub trait Dataset: Send + Sync {
    /// Number of samples.
    fn len(&self) -> usize;

    /// Whether the dataset holds no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shape of every sample, `[h, w, c]` (channels last).
    fn sample_shape(&self) -> [usize; 3];

    /// Number of classes; every label is below it.
    fn num_classes(&self) -> usize;

    /// Copies sample `index`'s pixels (u8, HWC) into `out` (len h*w*c) and
    /// returns its label.
    fn read(&self, index: usize, out: &mut [u8]) -> Result<u32, LoaderError>;

    /// A checksum that changes with the dataset's content, where the
    /// dataset can tell one without reading every sample (a store's index
    /// holds each shard's checksum; data in memory hashes fast). A resumed
    /// run compares it with the one its data had. Default: `None` (the
    /// caller reads every sample instead).
    fn fingerprint(&self) -> Option<u32> {
        None
    }

    /// How samples are grouped into shards, if they are. Default: `None`
    /// (random access is uniformly cheap).
    fn shard_layout(&self) -> Option<ShardLayout> {
        None
    }

    /// A hint: the sample ids the coming reads will ask for, in order (the
    /// rest of an epoch). A caching dataset can read ahead and pick better
    /// eviction victims; correctness never depends on it. Default: ignored.
    fn prefetch_order(&self, order: &mut dyn Iterator<Item = usize>) {
        let _ = order;
    }

    /// The most bytes this dataset will hold in memory (decoded samples,
    /// caches), for the loader's memory budget. Default: 0.
    fn memory_limit(&self) -> u64 {
        0
    }

    /// Bytes held in memory now and at the peak. Default: the limit for
    /// both.
    fn memory_usage(&self) -> MemoryUsage {
        let limit = self.memory_limit();
        MemoryUsage {
            current: limit,
            peak: limit,
        }
    }
}
