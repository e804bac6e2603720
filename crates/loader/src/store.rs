//! The shard store: samples packed into shard files plus one small index.
//!
//! A store is a directory:
//!
//! ```text
//! index.bin          the index (read at open)
//! shard-000000.bin   samples 0 .. n0
//! shard-000001.bin   samples n0 .. n0 + n1
//! ...
//! ```
//!
//! All integers are little-endian.
//!
//! Shard file (`SHARD_HEADER` = 48 bytes, then tables, then data):
//!
//! | bytes | field |
//! |---|---|
//! | 8 | magic `HDRMSHRD` |
//! | 4 | format version (1) |
//! | 4 | CRC-32 of every byte of the file except these 4 |
//! | 4 | shard number |
//! | 4 | sample count `n` |
//! | 8 | id of the first sample |
//! | 12 | sample shape h, w, c (u32 each) |
//! | 4 | reserved (0) |
//! | 8 (n + 1) | per-sample offsets into the data, the last = data length |
//! | 4 n | labels (u32) |
//! | ... | sample pixels, u8 HWC, one after the other |
//!
//! Index file (`INDEX_HEADER` = 40 bytes + 16 per shard + 4):
//!
//! | bytes | field |
//! |---|---|
//! | 8 | magic `HDRMINDX` |
//! | 4 | format version (1) |
//! | 12 | sample shape h, w, c |
//! | 4 | num_classes |
//! | 8 | total sample count |
//! | 4 | shard count |
//! | 16 per shard | sample count (u32), file size (u64), CRC-32 (u32) |
//! | 4 | CRC-32 of all the bytes before it |
//!
//! The index maps sample id -> shard through the cumulative counts and
//! costs 16 bytes per shard: well under a byte per sample.
//!
//! That is format version 1, which u8 images with class labels are still
//! written in. Typed samples (f32 features, numeric targets: a table or
//! tensor files) are written in format version 2, which adds a kind block
//! to the index and whole records to the shards; see
//! [`crate::store_index`]. Variable-length records (token rows) are
//! format version 3, written by [`crate::RecordStoreWriter`].
//!
//! [`preprocess`] writes a store atomically: into a temporary sibling
//! directory, fsynced, then renamed into place (on Linux an existing store
//! is swapped out with one `renameat2(RENAME_EXCHANGE)`), so the output path
//! holds either the old store or the new one, never a mixture.

use std::fmt;
use std::fs::{self, File};
use std::io::{self, BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use crate::error::io_err;
use crate::{Dataset, Element, LoaderError, SampleKind};

pub(crate) const SHARD_MAGIC: &[u8; 8] = b"HDRMSHRD";
/// Shard bytes per sample besides its pixels: an offset and a label.
pub(crate) const SHARD_PER_SAMPLE: usize = 12;
// The index's and the shard header's sizes belong to the index format
// (`store_index`), which this module writes: the constants live there, so
// the two modules import one way.
pub use crate::store_index::INDEX_FILE;
pub(crate) use crate::store_index::SHARD_HEADER;

/// The file name of shard `k`.
pub(crate) fn shard_file_name(k: usize) -> String {
    format!("shard-{k:06}.bin")
}

/// How big the shards of a new store are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardSize {
    /// This many samples per shard (the last shard may hold fewer).
    Samples(usize),
    /// As many samples per shard as fit in this many bytes of shard file
    /// (header included), at least one.
    Bytes(u64),
}

impl ShardSize {
    /// Samples per shard for samples of `sample_len` bytes.
    pub fn samples_per_shard(&self, sample_len: usize) -> Result<usize, LoaderError> {
        match *self {
            ShardSize::Samples(0) => Err(LoaderError::Config {
                field: "shard_size",
                message: "a shard must hold at least one sample".into(),
            }),
            ShardSize::Samples(n) => Ok(n),
            ShardSize::Bytes(b) => {
                let per = (sample_len + SHARD_PER_SAMPLE) as u64;
                let fixed = (SHARD_HEADER + 8) as u64;
                let n = b.saturating_sub(fixed) / per;
                if n == 0 {
                    return Err(LoaderError::Config {
                        field: "shard_size",
                        message: format!(
                            "{b} bytes cannot hold one sample: a one-sample shard of \
                             {sample_len}-byte samples takes {} bytes",
                            fixed + per
                        ),
                    });
                }
                Ok(usize::try_from(n).unwrap_or(usize::MAX))
            }
        }
    }
}

impl fmt::Display for ShardSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShardSize::Samples(n) => write!(f, "{n} samples"),
            ShardSize::Bytes(b) => write!(f, "{b} bytes"),
        }
    }
}

/// A shard size that does not parse; names the text.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid shard size {text:?}: {reason}; expected a sample count (4096) or a byte size \
     (64MiB, 500KB, 1GiB)"
)]
pub struct ParseShardSizeError {
    /// The text that was parsed.
    pub text: String,
    /// What is wrong with it.
    pub reason: String,
}

impl FromStr for ShardSize {
    type Err = ParseShardSizeError;

    /// `"4096"` (or `"4096 samples"`) is a sample count; a number with a
    /// unit is a byte size: `B`, `KB`/`MB`/`GB`/`TB` (powers of 1000),
    /// `KiB`/`MiB`/`GiB`/`TiB` (powers of 1024), case-insensitive, with an
    /// optional space and an optional fraction (`1.5GiB`).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let err = |reason: &str| ParseShardSizeError {
            text: text.to_string(),
            reason: reason.to_string(),
        };
        let t = text.trim();
        let split = t
            .find(|ch: char| !(ch.is_ascii_digit() || ch == '.'))
            .unwrap_or(t.len());
        let (num, unit) = (&t[..split], t[split..].trim());
        if num.is_empty() {
            return Err(err("it does not start with a number"));
        }
        let unit = unit.to_ascii_lowercase();
        let scale: u64 = match unit.as_str() {
            "" | "samples" | "sample" => {
                let n: usize = num
                    .parse()
                    .map_err(|_| err("a sample count must be a whole number"))?;
                if n == 0 {
                    return Err(err("a shard must hold at least one sample"));
                }
                return Ok(ShardSize::Samples(n));
            }
            "b" => 1,
            "kb" | "k" => 1000,
            "mb" | "m" => 1000_u64.pow(2),
            "gb" | "g" => 1000_u64.pow(3),
            "tb" | "t" => 1000_u64.pow(4),
            "kib" => 1 << 10,
            "mib" => 1 << 20,
            "gib" => 1 << 30,
            "tib" => 1 << 40,
            _ => return Err(err(&format!("unknown unit {:?}", &t[split..].trim()))),
        };
        let bytes = if let Ok(n) = num.parse::<u64>() {
            n.checked_mul(scale).ok_or_else(|| err("too large"))?
        } else {
            let x: f64 = num.parse().map_err(|_| err("not a number"))?;
            let b = (x * scale as f64).round();
            if !(b.is_finite() && b < u64::MAX as f64) {
                return Err(err("too large"));
            }
            b as u64
        };
        if bytes == 0 {
            return Err(err("a shard must have a positive size"));
        }
        Ok(ShardSize::Bytes(bytes))
    }
}

/// What [`preprocess`] wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct StoreSummary {
    /// The store directory.
    pub path: PathBuf,
    /// Samples stored.
    pub samples: u64,
    /// Shard files.
    pub shards: usize,
    /// Samples per shard (the last shard may hold fewer).
    pub samples_per_shard: usize,
    /// Size of the index file.
    pub index_bytes: u64,
    /// Size of the index and all shards.
    pub total_bytes: u64,
    /// `[h, w, c]` of every sample.
    pub sample_shape: [usize; 3],
    /// Number of classes.
    pub num_classes: usize,
    /// The store's format version (1: u8 images, 2: typed samples).
    pub version: u32,
    /// The samples' element type and numeric targets.
    pub kind: SampleKind,
}

impl StoreSummary {
    /// Index bytes per sample (what opening the store costs per sample).
    pub fn index_bytes_per_sample(&self) -> f64 {
        if self.samples == 0 {
            0.0
        } else {
            self.index_bytes as f64 / self.samples as f64
        }
    }
}

impl fmt::Display for StoreSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match (self.kind.element, self.kind.values) {
            (Element::U8, 0) => format!("{} classes", self.num_classes),
            (element, 0) => format!("{element:?}, {} classes", self.num_classes),
            (element, values) => format!("{element:?}, {values} numeric targets"),
        };
        write!(
            f,
            "{}: {} samples of {:?} ({what}) in {} shards of up to {} samples; \
             {} bytes in all, index {} bytes ({:.3} bytes per sample)",
            self.path.display(),
            self.samples,
            self.sample_shape,
            self.shards,
            self.samples_per_shard,
            self.total_bytes,
            self.index_bytes,
            self.index_bytes_per_sample()
        )
    }
}

pub use crate::store_index::StoreSource;
pub(crate) use crate::store_index::{
    encode_kind, encode_record_kind, shard_crc, shard_head_len, version_for, ShardMeta, StoreIndex,
    VERSION_IMAGES, VERSION_RECORDS, VERSION_TYPED,
};

/// What is at the output path.
pub(crate) enum Existing {
    Nothing,
    EmptyDir,
    Store,
}

pub(crate) fn inspect_output(output: &Path, overwrite: bool) -> Result<Existing, LoaderError> {
    let meta = match fs::symlink_metadata(output) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Existing::Nothing),
        Err(e) => return Err(io_err(output)(e)),
    };
    let refuse = |message: String| {
        Err(LoaderError::Exists {
            path: output.to_path_buf(),
            message,
        })
    };
    if !meta.is_dir() {
        return refuse(
            "exists and is not a directory; refusing to replace it with a shard store".into(),
        );
    }
    if output.join(INDEX_FILE).is_file() {
        if overwrite {
            return Ok(Existing::Store);
        }
        return refuse(
            "a shard store already exists here; pass overwrite (`--overwrite`) to replace it, \
             or choose another output directory"
                .into(),
        );
    }
    let mut entries = fs::read_dir(output).map_err(io_err(output))?;
    if entries.next().is_none() {
        return Ok(Existing::EmptyDir);
    }
    refuse(format!(
        "exists and is not a shard store (it has no {INDEX_FILE}); refusing to replace it, \
         even with overwrite: choose another output directory"
    ))
}

/// The prefix of temporary siblings of `output`: `.NAME.tmp-`.
pub(crate) fn temp_prefix(name: &str) -> String {
    format!(".{name}.tmp-")
}

/// Removes temporary siblings left by a crashed `preprocess` of the same
/// output (`.NAME.tmp-PID-...` whose process is gone). Leftovers whose
/// process may still run are left alone (and ignored).
pub(crate) fn clean_leftovers(parent: &Path, name: &str) {
    let prefix = temp_prefix(name);
    let Ok(entries) = fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(rest) = file_name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if process_is_gone(pid) {
            let path = entry.path();
            tracing::info!(path = %path.display(), "removing a leftover of an interrupted preprocess");
            let _ = fs::remove_dir_all(&path);
        }
    }
}

fn process_is_gone(pid: u32) -> bool {
    if pid == std::process::id() {
        return false;
    }
    let proc_root = Path::new("/proc/self");
    if !proc_root.exists() {
        return false; // cannot tell: leave it
    }
    !Path::new("/proc").join(pid.to_string()).exists()
}

/// Removes the directory on drop unless disarmed.
pub(crate) struct TempDir(pub(crate) Option<PathBuf>);

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = fs::remove_dir_all(p);
        }
    }
}

pub(crate) fn sync_dir(path: &Path) -> Result<(), LoaderError> {
    // Directories can be opened read-only and fsynced on Unix; elsewhere
    // this is best effort.
    match File::open(path) {
        Ok(f) => match f.sync_all() {
            Ok(()) => Ok(()),
            Err(e) if cfg!(unix) => Err(io_err(path)(e)),
            Err(_) => Ok(()),
        },
        Err(e) if cfg!(unix) => Err(io_err(path)(e)),
        Err(_) => Ok(()),
    }
}

/// Swaps two paths atomically. `Ok(false)` if the platform or filesystem
/// cannot.
#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> io::Result<bool> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let ca = CString::new(a.as_os_str().as_bytes())?;
    let cb = CString::new(b.as_os_str().as_bytes())?;
    // SAFETY: both paths are valid NUL-terminated strings that outlive the
    // call; renameat2 does not keep them.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ENOSYS) | Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) => Ok(false),
        _ => Err(e),
    }
}

#[cfg(not(target_os = "linux"))]
fn exchange(_: &Path, _: &Path) -> io::Result<bool> {
    Ok(false)
}

/// `len` zero bytes for `what`, or an error: the sizes come from the
/// data's shape and the shard size, which the user sets, so a refused
/// allocation is reported rather than aborting.
fn zeroed(len: usize, what: &str) -> Result<Vec<u8>, LoaderError> {
    let mut buf = Vec::new();
    buf.try_reserve_exact(len)
        .map_err(|e| LoaderError::Config {
            field: "dataset",
            message: format!("{what} takes {len} bytes, which cannot be held in memory: {e}"),
        })?;
    buf.resize(len, 0);
    Ok(buf)
}

/// Packs every sample of `source` into a shard store at `output`.
///
/// Samples keep their ids; shards hold `shard_size` samples (or bytes)
/// each. The store is built in a temporary sibling directory
/// (`.NAME.tmp-PID-...`), fsynced and renamed into place, so `output` never
/// holds a partial store. An existing store at `output` is an error unless
/// `overwrite`, in which case it is replaced as a whole; an existing
/// directory that is not a store (and not empty) is never replaced.
/// Temporary directories left by an interrupted run are removed.
pub fn preprocess(
    source: &dyn Dataset,
    output: &Path,
    shard_size: ShardSize,
    overwrite: bool,
) -> Result<StoreSummary, LoaderError> {
    preprocess_from(
        source,
        &StoreSource::default(),
        output,
        shard_size,
        overwrite,
    )
}

/// [`preprocess`], recording what the samples were made from
/// (`store_source`: a table's columns and standardisation, a tensor
/// file's arrays) in the index. Samples of the default kind with nothing
/// recorded are written in format version 1, byte for byte as before;
/// anything else in format version 2.
pub fn preprocess_from(
    source: &dyn Dataset,
    store_source: &StoreSource,
    output: &Path,
    shard_size: ShardSize,
    overwrite: bool,
) -> Result<StoreSummary, LoaderError> {
    let shape = source.sample_shape();
    let kind = source.sample_kind();
    let version = version_for(&kind, store_source);
    let sample_len = kind
        .record_len(shape)
        .filter(|&n| n > 0 && shape.iter().all(|&d| d > 0 && u32::try_from(d).is_ok()))
        .filter(|&n| u32::try_from(n).is_ok() || version == VERSION_IMAGES)
        .ok_or_else(|| LoaderError::Config {
            field: "dataset",
            message: format!("sample shape {shape:?} (h, w, c) must be non-zero and fit in u32"),
        })?;
    let len = source.len();
    let num_classes = source.num_classes();
    if (len > 0 && num_classes == 0) || u32::try_from(num_classes).is_err() {
        return Err(LoaderError::Config {
            field: "dataset",
            message: format!("{len} samples with num_classes = {num_classes}"),
        });
    }
    let per_shard = shard_size
        .samples_per_shard(sample_len)?
        .min(u32::MAX as usize)
        .min(len.max(1));

    let name = output
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| LoaderError::Exists {
            path: output.to_path_buf(),
            message: "the output path must end in a (UTF-8) directory name".into(),
        })?
        .to_string();
    let existing = inspect_output(output, overwrite)?;
    let parent = match output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    fs::create_dir_all(&parent).map_err(io_err(&parent))?;
    clean_leftovers(&parent, &name);

    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let tmp = parent.join(format!(
        "{}{}-{nanos}",
        temp_prefix(&name),
        std::process::id()
    ));
    fs::create_dir(&tmp).map_err(io_err(&tmp))?;
    let mut guard = TempDir(Some(tmp.clone()));

    let mut shards = Vec::with_capacity(len.div_ceil(per_shard));
    let mut reader = crate::store_fill::BlockReader::new(sample_len)?;
    let mut first = 0usize;
    while first < len {
        let count = per_shard.min(len - first);
        let k = shards.len();
        let path = tmp.join(shard_file_name(k));
        shards.push(write_shard(
            source,
            &path,
            ShardPlan {
                k,
                first,
                count,
                shape,
                num_classes,
                version,
            },
            &mut reader,
        )?);
        tracing::debug!(shard = k, samples = count, "shard written");
        first += count;
    }
    let kind_bytes = match version {
        VERSION_TYPED => encode_kind(&kind, store_source),
        _ => Vec::new(),
    };
    let index = StoreIndex {
        version,
        shape,
        num_classes,
        total: len as u64,
        shards,
        file_bytes: 0,
        kind,
        source: store_source.clone(),
        kind_bytes,
        metadata: String::new(),
    };
    let bytes = index.to_bytes();
    let index_path = tmp.join(INDEX_FILE);
    {
        let mut f = File::create(&index_path).map_err(io_err(&index_path))?;
        f.write_all(&bytes).map_err(io_err(&index_path))?;
        f.sync_all().map_err(io_err(&index_path))?;
    }
    sync_dir(&tmp)?;

    install(&tmp, output, existing)?;
    guard.0 = None; // `tmp` is now `output` (or holds the old store, removed)
    sync_dir(&parent)?;

    let summary = StoreSummary {
        path: output.to_path_buf(),
        samples: len as u64,
        shards: index.shards.len(),
        samples_per_shard: per_shard,
        index_bytes: bytes.len() as u64,
        total_bytes: bytes.len() as u64 + index.shards.iter().map(|s| s.bytes).sum::<u64>(),
        sample_shape: shape,
        num_classes,
        version,
        kind: index.kind.clone(),
    };
    tracing::info!("{summary}");
    Ok(summary)
}

/// Moves the finished store `tmp` to `output`.
pub(crate) fn install(tmp: &Path, output: &Path, existing: Existing) -> Result<(), LoaderError> {
    let exists_err = |e: io::Error| LoaderError::Exists {
        path: output.to_path_buf(),
        message: format!(
            "could not move the new store into place ({e}): something was created there \
             meanwhile; pass overwrite to replace a store"
        ),
    };
    match existing {
        Existing::Nothing | Existing::EmptyDir => {
            // rename() replaces an empty directory and fails on a non-empty one.
            fs::rename(tmp, output).map_err(exists_err)
        }
        Existing::Store => {
            if exchange(tmp, output).map_err(io_err(output))? {
                // `tmp` now holds the old store.
                let _ = fs::remove_dir_all(tmp);
                return Ok(());
            }
            // No atomic swap: move the old store aside, then the new one in.
            let old = tmp.with_file_name(format!(
                "{}old",
                tmp.file_name().and_then(|n| n.to_str()).unwrap_or(".tmp-")
            ));
            fs::rename(output, &old).map_err(io_err(output))?;
            if let Err(e) = fs::rename(tmp, output) {
                let _ = fs::rename(&old, output);
                return Err(exists_err(e));
            }
            let _ = fs::remove_dir_all(&old);
            Ok(())
        }
    }
}

/// Which samples one shard holds, and how they are written.
struct ShardPlan {
    k: usize,
    first: usize,
    count: usize,
    shape: [usize; 3],
    num_classes: usize,
    version: u32,
}

fn write_shard(
    source: &dyn Dataset,
    path: &Path,
    plan: ShardPlan,
    reader: &mut crate::store_fill::BlockReader,
) -> Result<ShardMeta, LoaderError> {
    let ShardPlan {
        k,
        first,
        count,
        shape,
        num_classes,
        version,
    } = plan;
    let sample_len = reader.sample_len();
    let head_len = shard_head_len(count);
    let file = File::create(path).map_err(io_err(path))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    // Header and tables are written last, once the labels are known.
    w.write_all(&zeroed(head_len, "a shard's header")?)
        .map_err(io_err(path))?;
    let mut data_crc = crc32fast::Hasher::new();
    let mut labels = Vec::with_capacity(count);
    // Read on every core a block at a time, written in sample order.
    let mut index = first;
    while index < first + count {
        let n = reader.block().min(first + count - index);
        let (records, block_labels) = reader.read(source, index, n, num_classes)?;
        labels.extend_from_slice(block_labels);
        data_crc.update(records);
        w.write_all(records).map_err(io_err(path))?;
        index += n;
    }
    let mut file = w.into_inner().map_err(|e| io_err(path)(e.into_error()))?;

    let mut head = Vec::with_capacity(head_len);
    head.extend_from_slice(SHARD_MAGIC);
    head.extend_from_slice(&version.to_le_bytes());
    head.extend_from_slice(&0u32.to_le_bytes()); // checksum, below
    head.extend_from_slice(&(k as u32).to_le_bytes());
    head.extend_from_slice(&(count as u32).to_le_bytes());
    head.extend_from_slice(&(first as u64).to_le_bytes());
    for d in shape {
        head.extend_from_slice(&(d as u32).to_le_bytes());
    }
    // Version 1 reserves this field (0); version 2 keeps the record length
    // there, so a shard says how its samples are cut without its index.
    let reserved = match version {
        VERSION_TYPED => sample_len as u32,
        _ => 0,
    };
    head.extend_from_slice(&reserved.to_le_bytes());
    debug_assert_eq!(head.len(), SHARD_HEADER);
    for i in 0..=count {
        head.extend_from_slice(&((i * sample_len) as u64).to_le_bytes());
    }
    for l in &labels {
        head.extend_from_slice(&l.to_le_bytes());
    }
    debug_assert_eq!(head.len(), head_len);
    let mut crc = crc32fast::Hasher::new();
    crc.update(&head[..12]);
    crc.update(&head[16..]);
    crc.combine(&data_crc);
    let crc = crc.finalize();
    head[12..16].copy_from_slice(&crc.to_le_bytes());
    file.seek(SeekFrom::Start(0)).map_err(io_err(path))?;
    file.write_all(&head).map_err(io_err(path))?;
    file.sync_all().map_err(io_err(path))?;
    Ok(ShardMeta {
        count: count as u32,
        bytes: (head_len + count * sample_len) as u64,
        crc,
    })
}

/// A deterministic in-memory dataset for tests and benchmarks: sample `i`
/// starts with `i` as little-endian u32 (as far as it fits) followed by a
/// pattern; its label is `i % num_classes`.
#[derive(Clone, Debug)]
pub struct SyntheticDataset {
    len: usize,
    shape: [usize; 3],
    num_classes: usize,
}

impl SyntheticDataset {
    /// `len` samples of `shape`, labels `0..num_classes` (> 0).
    pub fn new(len: usize, shape: [usize; 3], num_classes: usize) -> Self {
        assert!(num_classes > 0, "num_classes must be > 0");
        Self {
            len,
            shape,
            num_classes,
        }
    }

    /// The pixels and label of sample `i`.
    pub fn sample(&self, i: usize) -> (Vec<u8>, u32) {
        let mut out = vec![0; self.shape.iter().product()];
        let label = self.fill(i, &mut out);
        (out, label)
    }

    fn fill(&self, i: usize, out: &mut [u8]) -> u32 {
        for (k, b) in out.iter_mut().enumerate() {
            *b = (i.wrapping_mul(131) ^ k.wrapping_mul(17)).wrapping_add(k >> 3) as u8;
        }
        let id = (i as u32).to_le_bytes();
        let m = out.len().min(4);
        out[..m].copy_from_slice(&id[..m]);
        (i % self.num_classes) as u32
    }
}

impl Dataset for SyntheticDataset {
    fn len(&self) -> usize {
        self.len
    }

    fn sample_shape(&self) -> [usize; 3] {
        self.shape
    }

    fn num_classes(&self) -> usize {
        self.num_classes
    }

    fn read(&self, index: usize, out: &mut [u8]) -> Result<u32, LoaderError> {
        if index >= self.len {
            return Err(LoaderError::Index {
                index,
                len: self.len,
            });
        }
        let expected = self.shape.iter().product();
        if out.len() != expected {
            return Err(LoaderError::Buffer {
                index,
                expected,
                actual: out.len(),
            });
        }
        Ok(self.fill(index, out))
    }
}

/// Writes a store of `samples` [`SyntheticDataset`] samples at `dir`
/// (replacing a store there), for tests and benchmarks of stores larger
/// than memory.
pub fn write_synthetic_store(
    dir: &Path,
    samples: usize,
    shape: [usize; 3],
    num_classes: usize,
    shard_size: ShardSize,
) -> Result<StoreSummary, LoaderError> {
    preprocess(
        &SyntheticDataset::new(samples, shape, num_classes),
        dir,
        shard_size,
        true,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_sizes_parse() {
        let ok = |s: &str| s.parse::<ShardSize>().unwrap();
        assert_eq!(ok("4096"), ShardSize::Samples(4096));
        assert_eq!(ok(" 10 samples "), ShardSize::Samples(10));
        assert_eq!(ok("64MiB"), ShardSize::Bytes(64 << 20));
        assert_eq!(ok("64 mib"), ShardSize::Bytes(64 << 20));
        assert_eq!(ok("500KB"), ShardSize::Bytes(500_000));
        assert_eq!(ok("1GiB"), ShardSize::Bytes(1 << 30));
        assert_eq!(ok("1.5KiB"), ShardSize::Bytes(1536));
        assert_eq!(ok("100B"), ShardSize::Bytes(100));
        for bad in [
            "",
            "MiB",
            "0",
            "12XB",
            "-5",
            "1.5",
            "0KB",
            "99999999999999999999TiB",
        ] {
            let e = bad.parse::<ShardSize>().unwrap_err();
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
        assert!("12XB"
            .parse::<ShardSize>()
            .unwrap_err()
            .to_string()
            .contains("unknown unit \"XB\""));
    }

    #[test]
    fn byte_sizes_give_shards_that_fit() {
        // 784-byte samples: 796 bytes each in a shard, plus 56 fixed.
        assert_eq!(
            ShardSize::Bytes(56 + 796 * 10)
                .samples_per_shard(784)
                .unwrap(),
            10
        );
        assert_eq!(
            ShardSize::Bytes(56 + 796 * 10 - 1)
                .samples_per_shard(784)
                .unwrap(),
            9
        );
        let e = ShardSize::Bytes(800).samples_per_shard(784).unwrap_err();
        assert!(e.to_string().contains("shard_size"), "{e}");
        assert!(ShardSize::Samples(0).samples_per_shard(1).is_err());
    }

    #[test]
    fn a_sample_too_large_to_hold_is_an_error_not_an_abort() {
        let err = zeroed(usize::MAX / 2, "one sample")
            .unwrap_err()
            .to_string();
        assert!(err.contains("one sample"), "{err}");
        assert!(err.contains("cannot be held in memory"), "{err}");
        assert_eq!(zeroed(3, "one sample").unwrap(), [0, 0, 0]);
    }
}
