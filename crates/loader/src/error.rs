//! The loader's one error type.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Everything that can go wrong while opening a dataset or producing batches.
///
/// Messages name the file (for dataset files) or the sample index and batch
/// (for errors raised while producing batches), and say what was expected.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoaderError {
    /// An I/O error while reading `path` (including a corrupt gzip stream).
    /// The OS's reason is in the message itself, not chained as a source,
    /// so that error reports print it once.
    #[error("reading {}: {reason}", path.display())]
    Io {
        path: PathBuf,
        reason: std::io::Error,
    },

    /// A dataset file was not found; `tried` lists every path looked at.
    #[error("{what} not found; tried: {}", list_paths(tried))]
    Missing { what: String, tried: Vec<PathBuf> },

    /// The file's header or contents are not what the format requires.
    #[error("{}: {message}", path.display())]
    Format { path: PathBuf, message: String },

    /// The data after the header is shorter or longer than the header declares.
    #[error(
        "{}: header declares {what}, so {expected} bytes of data must follow the \
         {header_len}-byte header, but the {container} holds {actual} \
         ({} file)",
        path.display(),
        if actual < expected { "truncated" } else { "overlong" }
    )]
    Length {
        path: PathBuf,
        what: String,
        header_len: u64,
        expected: u64,
        actual: u64,
        container: &'static str,
    },

    /// An image folder, a class folder or an image in it is not what an
    /// [`crate::ImageFolder`] needs (missing, empty, not a PNG or JPEG,
    /// corrupt or truncated); `path` names it.
    #[error("{}: {message}", path.display())]
    Image { path: PathBuf, message: String },

    /// The image file and the label file disagree on the number of samples.
    #[error(
        "{} holds {image_count} images but {} holds {label_count} labels; the counts must agree",
        images.display(),
        labels.display()
    )]
    CountMismatch {
        images: PathBuf,
        image_count: usize,
        labels: PathBuf,
        label_count: usize,
    },

    /// A loader configuration value is invalid; `field` names it.
    #[error("invalid loader config `{field}`: {message}")]
    Config {
        field: &'static str,
        message: String,
    },

    /// A sample index outside the dataset.
    #[error("sample {index} is out of range: the dataset has {len} samples")]
    Index { index: usize, len: usize },

    /// The output buffer handed to `Dataset::read` has the wrong length.
    #[error("sample {index}: output buffer holds {actual} bytes, expected {expected} (h*w*c)")]
    Buffer {
        index: usize,
        expected: usize,
        actual: usize,
    },

    /// A dataset returned a label outside `0..num_classes`.
    #[error("sample {index}: label {label} is not below num_classes = {num_classes}")]
    Label {
        index: usize,
        label: u32,
        num_classes: usize,
    },

    /// Reading a sample failed while producing a batch.
    #[error("epoch {epoch}, batch {batch}: reading sample {index} failed: {source}")]
    Sample {
        epoch: u64,
        batch: usize,
        index: usize,
        #[source]
        source: Box<LoaderError>,
    },

    /// A panic while producing a batch (caught; the worker keeps running).
    #[error("epoch {epoch}, batch {batch}: panic while reading sample {index}: {message}")]
    Panic {
        epoch: u64,
        batch: usize,
        index: usize,
        message: String,
    },

    /// No batch arrived within the configured timeout.
    #[error("epoch {epoch}: batch {batch} did not arrive within {timeout:?} (loader timeout)")]
    Timeout {
        epoch: u64,
        batch: usize,
        timeout: Duration,
    },

    /// The worker threads are gone (the loader is shutting down).
    #[error("epoch {epoch}: loader workers stopped before batch {batch} arrived")]
    WorkersGone { epoch: u64, batch: usize },

    /// A worker thread could not be started.
    #[error("spawning loader worker thread {worker}: {source}")]
    Spawn {
        worker: usize,
        #[source]
        source: std::io::Error,
    },

    /// `preprocess` found a shard store (or something else) at its output
    /// path and may not replace it.
    #[error("{}: {message}", path.display())]
    Exists { path: PathBuf, message: String },

    /// A shard file of a store is missing, unreadable, truncated or corrupt.
    /// `index` is the sample whose read needed the shard (none when the
    /// shard was read at open, in full-load mode, or by read-ahead).
    #[error("shard {}: {message}{}", path.display(), sample_suffix(index))]
    Shard {
        path: PathBuf,
        index: Option<usize>,
        message: String,
    },

    /// `DataLoader::epoch` was asked to start past the end of the epoch.
    #[error("epoch {epoch}: cannot start at batch {start}, the epoch has {batches} batches")]
    Start {
        epoch: u64,
        start: usize,
        batches: usize,
    },

    /// The shard store's read-ahead thread could not be started.
    #[error(
        "cannot start the shard store's read-ahead thread: {source} (a limit on threads or \
         memory: ulimit -u, ulimit -v, ulimit -d)"
    )]
    SpawnReadAhead {
        #[source]
        source: std::io::Error,
    },
}

fn sample_suffix(index: &Option<usize>) -> String {
    match index {
        Some(i) => format!(" (while reading sample {i})"),
        None => String::new(),
    }
}

fn list_paths(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Maps an I/O error on `path` into `LoaderError::Io` (for `map_err`).
pub(crate) fn io_err(path: &Path) -> impl FnOnce(io::Error) -> LoaderError + '_ {
    move |reason| LoaderError::Io {
        path: path.to_path_buf(),
        reason,
    }
}

/// A malformed file, named.
pub(crate) fn format_err(path: &Path, message: String) -> LoaderError {
    LoaderError::Format {
        path: path.to_path_buf(),
        message,
    }
}
