//! The dataset contract.

use crate::LoaderError;

/// A random-access collection of labelled u8 images.
///
/// Implementations are shared by the worker threads through an `Arc`, so
/// `read` takes `&self` and must be safe to call concurrently.
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
}
