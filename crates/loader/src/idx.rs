//! MNIST-format IDX files (raw or gzip) held in memory.
//!
//! The header is checked against the file's real size before anything is
//! allocated, so a corrupt header cannot make us allocate more than the file
//! could hold.

use std::fmt;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::Path;

use flate2::bufread::MultiGzDecoder;

use crate::error::{format_err, io_err};
use crate::{Dataset, LoaderError};

const IMAGES_MAGIC: u32 = 0x0000_0803; // u8 data, 3 dimensions: n, rows, cols
const LABELS_MAGIC: u32 = 0x0000_0801; // u8 data, 1 dimension: n
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
/// Deflate cannot expand data by more than about 1032:1; anything beyond
/// this ratio between the declared size and the gzip file size is a corrupt
/// header (or a truncated file).
const MAX_GZIP_RATIO: u64 = 1100;

/// Which half of a dataset with a fixed train/test split.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Split {
    Train,
    Test,
}

impl fmt::Display for Split {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Split::Train => "train",
            Split::Test => "test",
        })
    }
}

/// Images and labels from a pair of IDX files, held in memory.
///
/// Samples are `rows x cols x 1` u8 images; labels are u8, and
/// `num_classes` is the largest label + 1.
#[derive(Clone, Debug)]
pub struct IdxDataset {
    pixels: Vec<u8>,
    labels: Vec<u8>,
    rows: usize,
    cols: usize,
    num_classes: usize,
}

impl IdxDataset {
    /// Reads an IDX image file (magic 0x00000803) and an IDX label file
    /// (magic 0x00000801). Either may be gzip-compressed (detected by its
    /// magic bytes, not its name).
    pub fn open(images: &Path, labels: &Path) -> Result<Self, LoaderError> {
        let img = read_idx(images, IMAGES_MAGIC, "images")?;
        let (count, rows, cols) = (img.dims[0], img.dims[1], img.dims[2]);
        if rows == 0 || cols == 0 {
            return Err(LoaderError::Format {
                path: images.to_path_buf(),
                message: format!("images of {rows} x {cols} pixels: rows and columns must be > 0"),
            });
        }
        let lab = read_idx(labels, LABELS_MAGIC, "labels")?;
        if lab.dims[0] != count {
            return Err(LoaderError::CountMismatch {
                images: images.to_path_buf(),
                image_count: count,
                labels: labels.to_path_buf(),
                label_count: lab.dims[0],
            });
        }
        // Labels are u8, so always < 256.
        let num_classes = lab
            .data
            .iter()
            .copied()
            .max()
            .map_or(0, |m| usize::from(m) + 1);
        Ok(Self {
            pixels: img.data,
            labels: lab.data,
            rows,
            cols,
            num_classes,
        })
    }

    /// Opens the Fashion-MNIST (or MNIST) `split` in `dir`: the files
    /// `{train,t10k}-images-idx3-ubyte` and `{train,t10k}-labels-idx1-ubyte`,
    /// each raw or with `.gz`. A missing file gives [`LoaderError::Missing`]
    /// naming every path tried.
    pub fn fashion_mnist(dir: &Path, split: Split) -> Result<Self, LoaderError> {
        let prefix = match split {
            Split::Train => "train",
            Split::Test => "t10k",
        };
        let mut tried = Vec::new();
        let mut find = |stem: String| {
            let candidates = [dir.join(&stem), dir.join(format!("{stem}.gz"))];
            let found = candidates.iter().find(|p| p.is_file()).cloned();
            if found.is_none() {
                tried.extend(candidates);
            }
            found
        };
        let images = find(format!("{prefix}-images-idx3-ubyte"));
        let labels = find(format!("{prefix}-labels-idx1-ubyte"));
        match (images, labels) {
            (Some(images), Some(labels)) => Self::open(&images, &labels),
            _ => Err(LoaderError::Missing {
                what: format!("Fashion-MNIST {split} split in {}", dir.display()),
                tried,
            }),
        }
    }

    /// Keeps only the first `n` samples (all of them if `n >= len`), for
    /// smoke runs. `num_classes` is unchanged.
    pub fn truncated(mut self, n: usize) -> Self {
        let n = n.min(self.labels.len());
        self.labels.truncate(n);
        self.labels.shrink_to_fit();
        self.pixels.truncate(n * self.rows * self.cols);
        self.pixels.shrink_to_fit();
        self
    }

    /// All labels, in sample order.
    pub fn labels(&self) -> &[u8] {
        &self.labels
    }

    /// All pixels, sample after sample (`len * rows * cols` bytes).
    pub fn pixels(&self) -> &[u8] {
        &self.pixels
    }
}

impl Dataset for IdxDataset {
    fn len(&self) -> usize {
        self.labels.len()
    }

    fn sample_shape(&self) -> [usize; 3] {
        [self.rows, self.cols, 1]
    }

    fn num_classes(&self) -> usize {
        self.num_classes
    }

    fn fingerprint(&self) -> Option<u32> {
        let mut digest = crc32fast::Hasher::new();
        digest.update(&self.pixels);
        digest.update(&self.labels);
        digest.update(&(self.rows as u64).to_le_bytes());
        digest.update(&(self.cols as u64).to_le_bytes());
        Some(digest.finalize())
    }

    #[inline]
    fn read(&self, index: usize, out: &mut [u8]) -> Result<u32, LoaderError> {
        let len = self.rows * self.cols;
        let Some(&label) = self.labels.get(index) else {
            return Err(LoaderError::Index {
                index,
                len: self.labels.len(),
            });
        };
        if out.len() != len {
            return Err(LoaderError::Buffer {
                index,
                expected: len,
                actual: out.len(),
            });
        }
        out.copy_from_slice(&self.pixels[index * len..(index + 1) * len]);
        Ok(u32::from(label))
    }

    /// The whole dataset is in memory: it is its own decoded-sample cache.
    fn memory_limit(&self) -> u64 {
        (self.pixels.len() + self.labels.len()) as u64
    }
}

/// A parsed IDX file: its dimensions and its data.
struct IdxFile {
    dims: Vec<usize>,
    data: Vec<u8>,
}

/// Reads an IDX file whose magic must be `magic` (u8 data; the low byte is
/// the number of dimensions).
fn read_idx(path: &Path, magic: u32, kind: &str) -> Result<IdxFile, LoaderError> {
    let file = File::open(path).map_err(io_err(path))?;
    let file_len = file.metadata().map_err(io_err(path))?.len();
    let mut reader = BufReader::with_capacity(1 << 16, file);
    let gzip = {
        let head = reader.fill_buf().map_err(io_err(path))?;
        head.len() >= 2 && head[..2] == GZIP_MAGIC
    };
    if gzip {
        let mut decoder = MultiGzDecoder::new(reader);
        let header = read_header(&mut decoder, path, magic, kind, "gzip stream")?;
        let max = file_len.saturating_mul(MAX_GZIP_RATIO).saturating_add(4096);
        if header.data_len > max {
            return Err(format_err(
                path,
                format!(
                    "header declares {} = {} bytes of data, more than a {file_len}-byte gzip \
                     file can hold (corrupt header or truncated file)",
                    header.what, header.data_len
                ),
            ));
        }
        // Grow with the data actually decompressed; never read past the
        // declared size + 1 byte.
        let initial = header
            .data_len
            .min(file_len.saturating_mul(4).saturating_add(1 << 20));
        let data = read_data(&mut decoder, path, &header, initial, "decompressed stream")?;
        Ok(IdxFile {
            dims: header.dims,
            data,
        })
    } else {
        let header = read_header(&mut reader, path, magic, kind, "file")?;
        let actual = file_len.saturating_sub(header.header_len);
        if actual != header.data_len {
            return Err(header.length_error(path, actual, "file"));
        }
        let data = read_data(&mut reader, path, &header, header.data_len, "file")?;
        Ok(IdxFile {
            dims: header.dims,
            data,
        })
    }
}

struct Header {
    dims: Vec<usize>,
    header_len: u64,
    data_len: u64,
    /// The dimensions in words, for messages: "60000 images of 28 x 28".
    what: String,
}

impl Header {
    fn length_error(&self, path: &Path, actual: u64, container: &'static str) -> LoaderError {
        LoaderError::Length {
            path: path.to_path_buf(),
            what: self.what.clone(),
            header_len: self.header_len,
            expected: self.data_len,
            actual,
            container,
        }
    }
}

fn read_header(
    r: &mut impl Read,
    path: &Path,
    magic: u32,
    kind: &str,
    container: &str,
) -> Result<Header, LoaderError> {
    let ndims = (magic & 0xff) as usize;
    let header_len = 4 + 4 * ndims;
    let short = |e: io::Error| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            format_err(
                path,
                format!("{container} is shorter than the {header_len}-byte IDX {kind} header"),
            )
        } else {
            io_err(path)(e)
        }
    };
    let mut buf = [0u8; 4 + 4 * 4];
    let buf = &mut buf[..header_len];
    r.read_exact(&mut buf[..4]).map_err(short)?;
    let found = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]);
    if found != magic {
        return Err(format_err(
            path,
            format!(
                "bad magic number 0x{found:08x}, expected 0x{magic:08x} \
                 (IDX {kind}: u8 data in {ndims} dimension{})",
                if ndims == 1 { "" } else { "s" }
            ),
        ));
    }
    r.read_exact(&mut buf[4..]).map_err(short)?;
    let dims: Vec<usize> = buf[4..]
        .chunks_exact(4)
        .map(|d| u32::from_be_bytes([d[0], d[1], d[2], d[3]]) as usize)
        .collect();
    let data_len = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
        .filter(|&n| usize::try_from(n).is_ok())
        .ok_or_else(|| {
            format_err(
                path,
                format!("header dimensions {dims:?} overflow the addressable size"),
            )
        })?;
    let what = match dims.as_slice() {
        [n, rows, cols] => format!("{n} images of {rows} x {cols}"),
        [n] => format!("{n} labels"),
        other => format!("dimensions {other:?}"),
    };
    Ok(Header {
        dims,
        header_len: header_len as u64,
        data_len,
        what,
    })
}

/// Reads exactly `header.data_len` bytes; fewer or more is a length error.
fn read_data(
    r: &mut impl Read,
    path: &Path,
    header: &Header,
    initial_capacity: u64,
    container: &'static str,
) -> Result<Vec<u8>, LoaderError> {
    let map_read_err = |e: io::Error| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            format_err(
                path,
                format!("gzip stream ends early (truncated file?): {e}"),
            )
        } else {
            io_err(path)(e)
        }
    };
    let mut data = Vec::with_capacity(initial_capacity as usize);
    let got = r
        .take(header.data_len + 1)
        .read_to_end(&mut data)
        .map_err(map_read_err)? as u64;
    if got < header.data_len {
        return Err(header.length_error(path, got, container));
    }
    if got > header.data_len {
        // Count the rest to report the real size (memory stays flat).
        let rest = io::copy(r, &mut io::sink()).map_err(map_read_err)?;
        return Err(header.length_error(path, got + rest, container));
    }
    Ok(data)
}
