//! headroom-loader: datasets, sample order, augmentations and the
//! prefetching worker pool.
//!
//! - [`Dataset`]: random access to labelled u8 HWC images; [`IdxDataset`]
//!   reads MNIST-format IDX files (raw or gzip).
//! - [`DataLoader`]: persistent worker threads turn an epoch's sample order
//!   into [`Batch`]es, delivered in order, at most `prefetch` ahead.
//! - Randomness is counter-based: the order of epoch `e` is a function of
//!   (seed, e), and the augmentation of sample `i` in epoch `e` a function of
//!   (seed, e, i). The batches never depend on the worker count, the
//!   prefetch depth or the resume point.

mod augment;
mod dataset;
mod error;
mod idx;
mod loader;
mod rng;
mod sampler;

pub use augment::AugmentConfig;
pub use dataset::Dataset;
pub use error::LoaderError;
pub use idx::{IdxDataset, Split};
pub use loader::{Batch, DataLoader, EpochIter, LoaderConfig};
