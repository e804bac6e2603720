//! headroom-loader: datasets, sample order, augmentations and the
//! prefetching worker pool.
//!
//! - [`Dataset`]: random access to labelled u8 HWC images; [`IdxDataset`]
//!   reads MNIST-format IDX files (raw or gzip).
//! - [`preprocess`] packs any dataset into a shard store (shard files with
//!   checksums and a small index); [`ShardedDataset`] reads it through a
//!   bounded LRU shard cache with read-ahead, or all at once (`full_load`).
//! - [`DataLoader`]: persistent worker threads turn an epoch's sample order
//!   into [`Batch`]es, delivered in order, at most `prefetch` ahead, within
//!   an optional memory budget; [`ShuffleMode::ShardBlocks`] orders epochs
//!   so that a small shard cache reads each shard once.
//! - [`TextWindows`]: byte-level text as next-token windows of `length + 1`
//!   bytes (u8 samples `[1, length + 1, 1]`), packed and read like images.
//! - [`MovingFashionMnist`]: sequences of garments bouncing in a frame,
//!   drawn on the fly from (seed, sample index), frames stacked along the
//!   height of one u8 sample.
//! - Augmentations: random crop, flip, RandAugment, and batch-level Mixup /
//!   CutMix with soft targets.
//! - Randomness is counter-based: the order of epoch `e` is a function of
//!   (seed, e), and the augmentation of sample `i` in epoch `e` a function of
//!   (seed, e, i). The batches never depend on the worker count, the
//!   prefetch depth or the resume point.

mod augment;
mod dataset;
mod error;
mod idx;
mod loader;
mod mix;
mod moving;
mod randaugment;
mod rng;
mod sampler;
mod sharded;
mod store;
mod text;

pub use augment::{AugmentConfig, RandAugmentConfig, MAX_MAGNITUDE};
pub use dataset::{Dataset, MemoryUsage, ShardLayout};
pub use error::LoaderError;
pub use idx::{IdxDataset, Split};
pub use loader::{
    Batch, DataLoader, EpochIter, LoaderConfig, LoaderMemory, LoaderState, SampleRecipe,
};
pub use moving::{GarmentPath, MovingConfig, MovingFashionMnist};
pub use sampler::ShuffleMode;
pub use sharded::{CacheStats, ShardCacheConfig, ShardedDataset, PLAN_WAIT};
pub use store::{
    preprocess, write_synthetic_store, ParseShardSizeError, ShardSize, StoreSummary,
    SyntheticDataset, INDEX_FILE,
};
pub use text::{split_for_validation, window_length, TextWindows, BYTE_VOCAB};
