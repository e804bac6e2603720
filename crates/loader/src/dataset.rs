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

/// A sample left out as unreadable (`data.bad_samples = "skip"`): which,
/// and why.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Skipped {
    /// The file, and for a table the line (`train.csv line 17`).
    pub sample: String,
    /// The error reading it would have been.
    pub reason: String,
}

impl Skipped {
    /// A table's row.
    pub fn row(path: &std::path::Path, line: u64, error: LoaderError) -> Self {
        Self {
            sample: format!("{} line {line}", path.display()),
            reason: error.to_string(),
        }
    }

    /// A whole file.
    pub fn file(path: &std::path::Path, error: LoaderError) -> Self {
        Self {
            sample: path.display().to_string(),
            reason: error.to_string(),
        }
    }
}

/// Bytes a dataset holds in memory (decoded samples, shard cache).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryUsage {
    /// Held now.
    pub current: u64,
    /// The most held at any time so far.
    pub peak: u64,
}

/// What one element of a sample is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Element {
    /// A byte: an image's pixel or a text's byte, normalised by the model.
    #[default]
    U8,
    /// A number already scaled as the model takes it (table features,
    /// preprocessed tensors), stored little-endian.
    F32,
}

impl Element {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Element::U8 => 1,
            Element::F32 => 4,
        }
    }
}

/// How a dataset's samples are laid out beyond their shape: the element
/// type and, for a dataset whose targets are numbers (regression), how
/// many of them each sample carries.
///
/// A sample's record, as [`Dataset::read`] writes it, is its
/// `h * w * c` elements (little-endian for f32) followed by `values`
/// little-endian f32 targets. The loader splits it into
/// [`crate::Batch::features`] (or `pixels`) and [`crate::Batch::values`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SampleKind {
    pub element: Element,
    /// Numeric targets per sample (0: the label is the target).
    pub values: usize,
    /// For each of the `values` targets, `(mean, std)`: the target in the
    /// user's units is `stored * std + mean` (a dataset that standardises
    /// its targets says how to undo it; empty means stored as they are).
    pub value_scale: Vec<(f32, f32)>,
}

impl SampleKind {
    /// Bytes of a sample's record for samples of `shape`, or None on
    /// overflow.
    pub fn record_len(&self, shape: [usize; 3]) -> Option<usize> {
        let elements = shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))?;
        elements
            .checked_mul(self.element.size())?
            .checked_add(self.values.checked_mul(4)?)
    }

    /// Target `k` in the user's units.
    pub fn unscale(&self, k: usize, stored: f32) -> f32 {
        match self.value_scale.get(k) {
            Some(&(mean, std)) => stored * std + mean,
            None => stored,
        }
    }
}

/// A random-access collection of labelled samples: u8 images by default,
/// or f32 features with numeric targets ([`Dataset::sample_kind`]).
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

    /// Copies sample `index`'s record into `out` and returns its label:
    /// for u8 images (the default kind) its pixels, HWC, `h*w*c` bytes;
    /// otherwise the record [`SampleKind`] describes.
    fn read(&self, index: usize, out: &mut [u8]) -> Result<u32, LoaderError>;

    /// The element type and numeric targets of the samples. Default: u8
    /// images with a class label.
    fn sample_kind(&self) -> SampleKind {
        SampleKind::default()
    }

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
