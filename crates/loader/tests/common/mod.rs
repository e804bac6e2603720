//! Helpers shared by the integration tests: IDX writers and test datasets.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use headroom_loader::{AugmentConfig, Dataset, LoaderConfig, LoaderError};

/// The bytes of an IDX file: magic, big-endian u32 dims, data.
pub fn idx_bytes(magic: u32, dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut v = magic.to_be_bytes().to_vec();
    for d in dims {
        v.extend_from_slice(&d.to_be_bytes());
    }
    v.extend_from_slice(data);
    v
}

pub fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

pub fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Deterministic test images: `n` images of `rows x cols`, pixel values
/// depending on the sample and the position.
pub fn images(n: usize, rows: usize, cols: usize) -> Vec<u8> {
    (0..n * rows * cols)
        .map(|k| ((k / (rows * cols)) * 37 + (k % (rows * cols)) * 11 + 5) as u8)
        .collect()
}

pub fn labels(n: usize, classes: u8) -> Vec<u8> {
    (0..n)
        .map(|i| ((i * 3 + 1) % classes as usize) as u8)
        .collect()
}

pub fn images_idx(n: usize, rows: usize, cols: usize) -> Vec<u8> {
    idx_bytes(
        0x0803,
        &[n as u32, rows as u32, cols as u32],
        &images(n, rows, cols),
    )
}

pub fn labels_idx(n: usize, classes: u8) -> Vec<u8> {
    idx_bytes(0x0801, &[n as u32], &labels(n, classes))
}

/// An in-memory dataset whose sample `i` starts with `i` as little-endian
/// u32 (so a batch tells which samples it holds) followed by a pattern.
pub struct Synth {
    pub n: usize,
    pub shape: [usize; 3],
    pub classes: usize,
    /// Index whose read panics.
    pub panic_at: Option<usize>,
    /// Index whose read returns an error.
    pub fail_at: Option<usize>,
    /// Index whose read sleeps this long.
    pub slow_at: Option<(usize, Duration)>,
    /// Label returned for every sample, overriding `i % classes`.
    pub bad_label: Option<u32>,
    /// Sleep a pseudo-random 0..400 µs in every read, so that workers
    /// finish batches out of order.
    pub jitter: bool,
    pub reads: AtomicUsize,
}

impl Synth {
    pub fn new(n: usize, shape: [usize; 3], classes: usize) -> Self {
        Synth {
            n,
            shape,
            classes,
            panic_at: None,
            fail_at: None,
            slow_at: None,
            bad_label: None,
            jitter: false,
            reads: AtomicUsize::new(0),
        }
    }

    pub fn sample_len(&self) -> usize {
        self.shape.iter().product()
    }

    /// The pixels `read` writes for sample `i`.
    pub fn pixels(&self, i: usize) -> Vec<u8> {
        let mut out = vec![0; self.sample_len()];
        fill(i, &mut out);
        out
    }
}

fn fill(i: usize, out: &mut [u8]) {
    for (k, b) in out.iter_mut().enumerate() {
        *b = (i.wrapping_mul(131) + k * 17 + 1) as u8;
    }
    let id = (i as u32).to_le_bytes();
    let m = out.len().min(4);
    out[..m].copy_from_slice(&id[..m]);
}

/// The sample id written at the start of a sample's pixels.
pub fn sample_id(pixels: &[u8]) -> usize {
    u32::from_le_bytes(pixels[..4].try_into().unwrap()) as usize
}

impl Dataset for Synth {
    fn len(&self) -> usize {
        self.n
    }
    fn sample_shape(&self) -> [usize; 3] {
        self.shape
    }
    fn num_classes(&self) -> usize {
        self.classes
    }
    fn read(&self, index: usize, out: &mut [u8]) -> Result<u32, LoaderError> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        if self.panic_at == Some(index) {
            panic!("test dataset panics on purpose at sample {index}");
        }
        if self.fail_at == Some(index) {
            return Err(LoaderError::Index { index, len: 0 });
        }
        if let Some((i, d)) = self.slow_at {
            if i == index {
                std::thread::sleep(d);
            }
        }
        if self.jitter {
            let micros = (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 55; // 0..512
            std::thread::sleep(Duration::from_micros(micros.min(400)));
        }
        assert!(index < self.n);
        assert_eq!(out.len(), self.sample_len());
        fill(index, out);
        Ok(self.bad_label.unwrap_or((index % self.classes) as u32))
    }
}

pub fn config(batch_size: usize, workers: usize) -> LoaderConfig {
    LoaderConfig {
        batch_size,
        shuffle: true,
        drop_last: false,
        seed: 1234,
        workers,
        prefetch: 4,
        augment: AugmentConfig::default(),
        timeout: Duration::from_secs(10),
        ..LoaderConfig::default()
    }
}
