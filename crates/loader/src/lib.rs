//! headroom-loader: datasets, sample order, augmentations and the
//! prefetching worker pool.
//!
//! - [`Dataset`]: random access to labelled u8 HWC images; [`IdxDataset`]
//!   reads MNIST-format IDX files (raw or gzip); [`ImageFolder`] reads a
//!   folder of PNG and JPEG photos, one subfolder per class, decoding each
//!   image when it is read.
//! - [`preprocess`] packs any dataset into a shard store (shard files with
//!   checksums and a small index); [`ShardedDataset`] reads it through a
//!   bounded LRU shard cache with read-ahead, or all at once (`full_load`).
//!   [`RecordStoreWriter`] writes a store of variable-length records
//!   (format version 3: a language model's token rows), which
//!   [`ShardedDataset::read_record`] reads through the same cache.
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
//!
//! A dataset of your own and an epoch of batches from it:
//!
//! ```
//! use headroom_loader::{DataLoader, Dataset, LoaderConfig, LoaderError};
//! use std::sync::Arc;
//!
//! /// 100 one-pixel "images": the pixel is the index, the label its parity.
//! struct Counting;
//!
//! impl Dataset for Counting {
//!     fn len(&self) -> usize { 100 }
//!     fn sample_shape(&self) -> [usize; 3] { [1, 1, 1] }
//!     fn num_classes(&self) -> usize { 2 }
//!     fn read(&self, index: usize, out: &mut [u8]) -> Result<u32, LoaderError> {
//!         out[0] = index as u8;
//!         Ok(index as u32 % 2)
//!     }
//! }
//!
//! let config = LoaderConfig {
//!     batch_size: 32, shuffle: true, drop_last: true, seed: 1, ..LoaderConfig::default()
//! };
//! let loader = DataLoader::new(Arc::new(Counting), config)?;
//! let mut seen = Vec::new();
//! for batch in loader.epoch(0, 0) {
//!     let batch = batch?;
//!     assert_eq!(batch.labels.len(), batch.pixels.len());
//!     seen.extend(batch.pixels);
//! }
//! seen.sort();
//! assert_eq!(seen.len(), 96, "three whole batches of 32 (drop_last)");
//! seen.dedup();
//! assert_eq!(seen.len(), 96, "each sample at most once an epoch");
//! # Ok::<(), LoaderError>(())
//! ```

mod augment;
mod dataset;
mod error;
mod idx;
mod image_folder;
mod loader;
mod mix;
mod moving;
mod randaugment;
mod rng;
mod sampler;
mod sharded;
mod store;
mod store_fill;
mod store_index;
mod store_read;
mod store_records;
mod subset;
mod table;
mod tensor_files;
mod text;

pub use augment::{AugmentConfig, RandAugmentConfig, MAX_MAGNITUDE};
pub use dataset::{Dataset, Element, MemoryUsage, SampleKind, ShardLayout, Skipped};
pub use error::LoaderError;
pub use idx::{IdxDataset, Split};
pub use image_folder::{
    write_image, ImageFiles, ImageFit, ImageFolder, ImageFolderConfig, IMAGE_EXTENSIONS,
};
pub use loader::{
    Batch, DataLoader, EpochIter, LoaderConfig, LoaderMemory, LoaderState, SampleRecipe, Shard,
};
pub use moving::{GarmentPath, MovingConfig, MovingFashionMnist};
pub use sampler::ShuffleMode;
pub use sharded::{CacheStats, ShardCacheConfig, ShardedDataset, PLAN_WAIT};
pub use store::{
    preprocess, preprocess_from, write_synthetic_store, ParseShardSizeError, ShardSize,
    StoreSource, StoreSummary, SyntheticDataset, INDEX_FILE,
};
pub use store_records::RecordStoreWriter;
pub use subset::{split_off, Subset};
pub use table::{CsvTable, TableConfig, TableScale, TableTarget};
pub use tensor_files::{npy_bytes, TensorFiles, TensorFilesConfig};
pub use text::{split_for_validation, window_length, TextWindows, BYTE_VOCAB};
