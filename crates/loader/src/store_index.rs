//! A shard store's index (`index.bin`): reading, checking and writing it.
//!
//! Format version 1 (u8 HWC samples with a u32 label) is laid out as
//! [`crate::store`] describes. Format version 2 holds typed samples (f32
//! features, numeric targets) and what they were made from; it is written
//! only for such samples, so an image store's bytes are those of version 1.
//! Version 2 inserts a *kind block* after the 40-byte header:
//!
//! | bytes | field |
//! |---|---|
//! | 40 | the header of version 1, with version 2 |
//! | 4 | kind block length `L` |
//! | L | kind block (below) |
//! | 16 per shard | as in version 1 |
//! | 4 | CRC-32 of all the bytes before it (the kind block included) |
//!
//! Kind block (strings are a u32 byte length and UTF-8 bytes):
//!
//! | bytes | field |
//! |---|---|
//! | 4 | element: 0 = u8, 1 = f32 |
//! | 4 | numeric targets per sample (`values`) |
//! | 4 + 8 n | n targets' `(mean, std)`, f32 each ([`SampleKind::value_scale`]) |
//! | 4 + 8 n | n features' `(mean, std)` (a table's standardisation) |
//! | string | the source: `csv`, `tensors` or empty |
//! | 4 + strings | input names (a table's feature columns, the input array) |
//! | 4 + strings | target names (a table's target columns, the target array) |
//!
//! A version-2 shard file has version 2 in its header and its record
//! length (features and targets, in bytes) in the header's reserved field;
//! its samples are whole records ([`crate::Dataset::read`]).
//!
//! Format version 3 holds *variable-length records* (a language model's
//! token rows): the index is laid out as version 2's, its kind block
//! followed by one more string, the writer's metadata (free text the
//! reader checks, e.g. what the records were made from), and its shape
//! `[1, 1, L]` with `L` the longest record's bytes. Its shard files use the
//! per-sample offsets that versions 1 and 2 fill with multiples of the
//! record length: record `i` is data bytes `offset[i]..offset[i + 1]`
//! (the reserved field is 0, labels 0). Only
//! [`crate::ShardedDataset::read_record`] reads them; `Dataset::read`,
//! whose buffer is one fixed size, refuses. Written by
//! [`crate::RecordStoreWriter`].

use std::fs;
use std::io;
use std::path::Path;

use crate::error::{format_err, io_err};
use crate::{Element, LoaderError, SampleKind};

pub(crate) const INDEX_MAGIC: &[u8; 8] = b"HDRMINDX";
pub(crate) const SHARD_HEADER: usize = 48;
pub(crate) const INDEX_HEADER: usize = 40;
pub(crate) const INDEX_ENTRY: usize = 16;
/// The index file's name inside a store.
pub const INDEX_FILE: &str = "index.bin";

/// The format version of a store of u8 images with class labels.
pub(crate) const VERSION_IMAGES: u32 = 1;
/// The format version of a store of typed samples.
pub(crate) const VERSION_TYPED: u32 = 2;
/// The format version of a store of variable-length records.
pub(crate) const VERSION_RECORDS: u32 = 3;

/// What a store of typed samples was made from, kept in its index so
/// that training and `predict` treat its samples as the source's.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StoreSource {
    /// `"csv"`, `"tensors"`, or empty (not recorded).
    pub kind: String,
    /// A table's feature columns in model order; a tensor file's input
    /// array.
    pub inputs: Vec<String>,
    /// A table's target columns; a tensor file's target array.
    pub targets: Vec<String>,
    /// A table's `(mean, std)` per feature, applied before the features
    /// were stored (the training table's, for both splits).
    pub feature_scale: Vec<(f32, f32)>,
}

impl StoreSource {
    /// Whether nothing is recorded.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// One shard as the index describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ShardMeta {
    pub count: u32,
    pub bytes: u64,
    pub crc: u32,
}

/// The parsed index of a store.
#[derive(Clone, Debug)]
pub(crate) struct StoreIndex {
    pub version: u32,
    pub shape: [usize; 3],
    pub num_classes: usize,
    pub total: u64,
    pub shards: Vec<ShardMeta>,
    pub file_bytes: u64,
    pub kind: SampleKind,
    pub source: StoreSource,
    /// The kind block as stored (empty for version 1), for fingerprints.
    pub kind_bytes: Vec<u8>,
    /// Version 3's metadata string (empty otherwise).
    pub metadata: String,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Bytes of a shard's header and tables for `count` samples.
pub(crate) fn shard_head_len(count: usize) -> usize {
    SHARD_HEADER + 8 * (count + 1) + 4 * count
}

/// The CRC-32 of a shard file: every byte but the checksum field.
pub(crate) fn shard_crc(bytes: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&bytes[..12]);
    h.update(&bytes[16..]);
    h.finalize()
}

/// Whether samples of `kind` with `source` need format version 2.
pub(crate) fn version_for(kind: &SampleKind, source: &StoreSource) -> u32 {
    if *kind == SampleKind::default() && source.is_empty() {
        VERSION_IMAGES
    } else {
        VERSION_TYPED
    }
}

/// The kind block of a version-2 index.
pub(crate) fn encode_kind(kind: &SampleKind, source: &StoreSource) -> Vec<u8> {
    let mut b = Vec::new();
    let put_u32 = |b: &mut Vec<u8>, v: usize| b.extend_from_slice(&(v as u32).to_le_bytes());
    let put_pairs = |b: &mut Vec<u8>, pairs: &[(f32, f32)]| {
        put_u32(b, pairs.len());
        for &(mean, std) in pairs {
            b.extend_from_slice(&mean.to_le_bytes());
            b.extend_from_slice(&std.to_le_bytes());
        }
    };
    let put_str = |b: &mut Vec<u8>, s: &str| {
        put_u32(b, s.len());
        b.extend_from_slice(s.as_bytes());
    };
    put_u32(
        &mut b,
        match kind.element {
            Element::U8 => 0,
            Element::F32 => 1,
        },
    );
    put_u32(&mut b, kind.values);
    put_pairs(&mut b, &kind.value_scale);
    put_pairs(&mut b, &source.feature_scale);
    put_str(&mut b, &source.kind);
    for names in [&source.inputs, &source.targets] {
        put_u32(&mut b, names.len());
        for name in names {
            put_str(&mut b, name);
        }
    }
    b
}

/// Version 3's kind block: version 2's, then the metadata string.
pub(crate) fn encode_record_kind(source: &StoreSource, metadata: &str) -> Vec<u8> {
    let mut b = encode_kind(&SampleKind::default(), source);
    b.extend_from_slice(&(metadata.len() as u32).to_le_bytes());
    b.extend_from_slice(metadata.as_bytes());
    b
}

type DecodedKind = (SampleKind, StoreSource, String);

/// Reads a kind block (with version 3's trailing metadata string when
/// `metadata`); every overrun or bad value is a message for the index's
/// error.
fn decode_kind(b: &[u8], metadata: bool) -> Result<DecodedKind, String> {
    struct Cursor<'a> {
        b: &'a [u8],
        at: usize,
    }
    impl Cursor<'_> {
        fn take(&mut self, n: usize, what: &str) -> Result<&[u8], String> {
            let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
            let end = end.ok_or_else(|| {
                format!(
                    "the kind block ends inside {what} (at byte {} of {})",
                    self.at,
                    self.b.len()
                )
            })?;
            let out = &self.b[self.at..end];
            self.at = end;
            Ok(out)
        }
        fn u32(&mut self, what: &str) -> Result<usize, String> {
            let s = self.take(4, what)?;
            Ok(u32::from_le_bytes(s.try_into().expect("4 bytes")) as usize)
        }
        fn f32(&mut self, what: &str) -> Result<f32, String> {
            let s = self.take(4, what)?;
            Ok(f32::from_le_bytes(s.try_into().expect("4 bytes")))
        }
        fn pairs(&mut self, what: &str) -> Result<Vec<(f32, f32)>, String> {
            let n = self.u32(what)?;
            if n > self.b.len() / 8 {
                return Err(format!("{n} {what} cannot fit in the kind block"));
            }
            (0..n)
                .map(|_| {
                    let (mean, std) = (self.f32(what)?, self.f32(what)?);
                    if mean.is_finite() && std.is_finite() && std > 0.0 {
                        Ok((mean, std))
                    } else {
                        Err(format!(
                            "{what}: ({mean}, {std}) is not a finite mean and positive std"
                        ))
                    }
                })
                .collect()
        }
        fn string(&mut self, what: &str) -> Result<String, String> {
            let n = self.u32(what)?;
            let bytes = self.take(n, what)?;
            String::from_utf8(bytes.to_vec()).map_err(|_| format!("{what} is not UTF-8"))
        }
        fn strings(&mut self, what: &str) -> Result<Vec<String>, String> {
            let n = self.u32(what)?;
            if n > self.b.len() / 4 {
                return Err(format!("{n} {what} cannot fit in the kind block"));
            }
            (0..n).map(|_| self.string(what)).collect()
        }
    }
    let mut c = Cursor { b, at: 0 };
    let element = match c.u32("the element type")? {
        0 => Element::U8,
        1 => Element::F32,
        other => return Err(format!("element type {other} is unknown (0: u8, 1: f32)")),
    };
    let values = c.u32("the target count")?;
    let value_scale = c.pairs("target scales")?;
    if !value_scale.is_empty() && value_scale.len() != values {
        return Err(format!(
            "{} target scales for {values} targets",
            value_scale.len()
        ));
    }
    let feature_scale = c.pairs("feature scales")?;
    let kind = c.string("the source kind")?;
    let inputs = c.strings("input names")?;
    let targets = c.strings("target names")?;
    let metadata = if metadata {
        c.string("the metadata")?
    } else {
        String::new()
    };
    if c.at != b.len() {
        return Err(format!(
            "{} bytes follow the kind block's last field",
            b.len() - c.at
        ));
    }
    Ok((
        SampleKind {
            element,
            values,
            value_scale,
        },
        StoreSource {
            kind,
            inputs,
            targets,
            feature_scale,
        },
        metadata,
    ))
}

impl StoreIndex {
    /// Reads and checks `dir/index.bin`.
    pub(crate) fn read(dir: &Path) -> Result<Self, LoaderError> {
        let path = dir.join(INDEX_FILE);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(LoaderError::Missing {
                    what: format!(
                        "shard store index in {} (create the store with preprocess)",
                        dir.display()
                    ),
                    tried: vec![path],
                })
            }
            Err(e) => return Err(io_err(&path)(e)),
        };
        Self::parse(&bytes, &path)
    }

    pub(crate) fn parse(b: &[u8], path: &Path) -> Result<Self, LoaderError> {
        if b.len() < INDEX_HEADER + 4 {
            return Err(format_err(
                path,
                format!("{} bytes is shorter than a shard store index", b.len()),
            ));
        }
        if &b[..8] != INDEX_MAGIC {
            return Err(format_err(
                path,
                "bad magic: not a headroom shard store index".into(),
            ));
        }
        let version = u32_at(b, 8);
        if ![VERSION_IMAGES, VERSION_TYPED, VERSION_RECORDS].contains(&version) {
            return Err(format_err(
                path,
                format!(
                    "format version {version}; this build reads versions {VERSION_IMAGES} \
                     (images), {VERSION_TYPED} (typed samples) and {VERSION_RECORDS} \
                     (variable-length records): a newer headroom wrote it, so update headroom \
                     or re-run preprocess with this one"
                ),
            ));
        }
        let n = u32_at(b, 36) as usize;
        // Versions 2 and 3 keep a kind block between the header and the
        // shards.
        let has_kind = version != VERSION_IMAGES;
        let kind_len = if has_kind {
            u32_at(b, INDEX_HEADER) as usize
        } else {
            0
        };
        let entries_at = if has_kind {
            INDEX_HEADER.saturating_add(4).saturating_add(kind_len)
        } else {
            INDEX_HEADER
        };
        let want = entries_at
            .checked_add(n.saturating_mul(INDEX_ENTRY))
            .and_then(|w| w.checked_add(4))
            .unwrap_or(usize::MAX);
        if b.len() != want {
            return Err(format_err(
                path,
                format!(
                    "{} bytes, but an index of {n} shards{} has {want} ({} file)",
                    b.len(),
                    if has_kind {
                        format!(" and a {kind_len}-byte kind block")
                    } else {
                        String::new()
                    },
                    if b.len() < want {
                        "truncated"
                    } else {
                        "overlong"
                    }
                ),
            ));
        }
        let stored = u32_at(b, want - 4);
        let computed = crc32fast::hash(&b[..want - 4]);
        if stored != computed {
            return Err(format_err(
                path,
                format!(
                    "checksum mismatch: stored 0x{stored:08x}, contents hash to \
                     0x{computed:08x} (corrupt index)"
                ),
            ));
        }
        let kind_bytes = if has_kind {
            b[INDEX_HEADER + 4..entries_at].to_vec()
        } else {
            Vec::new()
        };
        let (kind, source, metadata) = if has_kind {
            decode_kind(&kind_bytes, version == VERSION_RECORDS)
                .map_err(|m| format_err(path, format!("kind block: {m}")))?
        } else {
            (SampleKind::default(), StoreSource::default(), String::new())
        };
        if version == VERSION_RECORDS && kind != SampleKind::default() {
            return Err(format_err(
                path,
                "a store of variable-length records must have u8 elements and no targets".into(),
            ));
        }
        let shape = [
            u32_at(b, 12) as usize,
            u32_at(b, 16) as usize,
            u32_at(b, 20) as usize,
        ];
        let num_classes = u32_at(b, 24) as usize;
        let total = u64_at(b, 28);
        let shards: Vec<ShardMeta> = (0..n)
            .map(|k| {
                let at = entries_at + INDEX_ENTRY * k;
                ShardMeta {
                    count: u32_at(b, at),
                    bytes: u64_at(b, at + 4),
                    crc: u32_at(b, at + 12),
                }
            })
            .collect();
        let sum: u64 = shards.iter().map(|s| u64::from(s.count)).sum();
        if sum != total {
            return Err(format_err(
                path,
                format!("the shards hold {sum} samples but the index says {total}"),
            ));
        }
        let sample_len = kind.record_len(shape).filter(|&n| n > 0);
        let Some(sample_len) = sample_len.filter(|_| shape.iter().all(|&d| d > 0)) else {
            return Err(format_err(
                path,
                format!("sample shape {shape:?} is empty or too large"),
            ));
        };
        for (k, s) in shards.iter().enumerate() {
            let head = shard_head_len(s.count as usize) as u64;
            let full = head.saturating_add(u64::from(s.count).saturating_mul(sample_len as u64));
            // Version 3's records are at most `sample_len` bytes each.
            let fits = match version {
                VERSION_RECORDS => (head..=full).contains(&s.bytes),
                _ => s.bytes == full,
            };
            let want = full;
            if s.count == 0 || !fits {
                return Err(format_err(
                    path,
                    format!(
                        "shard {k}: {} samples in {} bytes is inconsistent (expected {}{want})",
                        s.count,
                        s.bytes,
                        if version == VERSION_RECORDS {
                            "at most "
                        } else {
                            ""
                        }
                    ),
                ));
            }
        }
        Ok(StoreIndex {
            version,
            shape,
            num_classes,
            total,
            shards,
            file_bytes: b.len() as u64,
            kind,
            source,
            kind_bytes,
            metadata,
        })
    }

    /// Bytes of one sample's record in a shard.
    pub(crate) fn record_len(&self) -> usize {
        // Checked when the index was parsed or the store written.
        self.kind.record_len(self.shape).unwrap_or(0)
    }

    pub(crate) fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(
            INDEX_HEADER + 4 + self.kind_bytes.len() + INDEX_ENTRY * self.shards.len() + 4,
        );
        b.extend_from_slice(INDEX_MAGIC);
        b.extend_from_slice(&self.version.to_le_bytes());
        for d in self.shape {
            b.extend_from_slice(&(d as u32).to_le_bytes());
        }
        b.extend_from_slice(&(self.num_classes as u32).to_le_bytes());
        b.extend_from_slice(&self.total.to_le_bytes());
        b.extend_from_slice(&(self.shards.len() as u32).to_le_bytes());
        debug_assert_eq!(b.len(), INDEX_HEADER);
        if self.version != VERSION_IMAGES {
            b.extend_from_slice(&(self.kind_bytes.len() as u32).to_le_bytes());
            b.extend_from_slice(&self.kind_bytes);
        }
        for s in &self.shards {
            b.extend_from_slice(&s.count.to_le_bytes());
            b.extend_from_slice(&s.bytes.to_le_bytes());
            b.extend_from_slice(&s.crc.to_le_bytes());
        }
        let crc = crc32fast::hash(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn typed_index() -> StoreIndex {
        let kind = SampleKind {
            element: Element::F32,
            values: 2,
            value_scale: vec![(1.5, 2.0), (-3.0, 0.5)],
        };
        let source = StoreSource {
            kind: "csv".into(),
            inputs: vec!["a".into(), "b".into(), "c".into()],
            targets: vec!["y".into(), "z".into()],
            feature_scale: vec![(0.0, 1.0), (2.0, 3.0), (4.0, 5.0)],
        };
        let record = kind.record_len([1, 3, 1]).unwrap();
        StoreIndex {
            version: VERSION_TYPED,
            shape: [1, 3, 1],
            num_classes: 1,
            total: 5,
            shards: vec![ShardMeta {
                count: 5,
                bytes: (shard_head_len(5) + 5 * record) as u64,
                crc: 7,
            }],
            file_bytes: 0,
            kind_bytes: encode_kind(&kind, &source),
            kind,
            source,
            metadata: String::new(),
        }
    }

    #[test]
    fn a_typed_index_round_trips() {
        let index = typed_index();
        let bytes = index.to_bytes();
        let back = StoreIndex::parse(&bytes, Path::new("index.bin")).unwrap();
        assert_eq!(back.version, VERSION_TYPED);
        assert_eq!(back.kind, index.kind);
        assert_eq!(back.source, index.source);
        assert_eq!(back.record_len(), 4 * (3 + 2));
        assert_eq!(back.shards, index.shards);
    }

    #[test]
    fn every_flipped_byte_of_a_typed_index_is_refused() {
        let bytes = typed_index().to_bytes();
        for at in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[at] ^= 0x40;
            let err = StoreIndex::parse(&bad, Path::new("idx/index.bin"));
            let err = err.expect_err(&format!("a flip at byte {at} was accepted"));
            assert!(err.to_string().contains("idx/index.bin"), "{err}");
        }
    }

    #[test]
    fn a_newer_version_is_a_clear_error() {
        let mut bytes = typed_index().to_bytes();
        bytes[8..12].copy_from_slice(&4u32.to_le_bytes());
        let err = StoreIndex::parse(&bytes, Path::new("index.bin"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("format version 4"), "{err}");
        assert!(err.contains("newer headroom"), "{err}");
    }

    #[test]
    fn a_kind_block_that_overruns_is_named() {
        let index = typed_index();
        let mut kind_bytes = index.kind_bytes.clone();
        kind_bytes.truncate(kind_bytes.len() - 1);
        let bad = StoreIndex {
            kind_bytes,
            ..index
        };
        // A valid checksum over a kind block that ends early.
        let err = StoreIndex::parse(&bad.to_bytes(), Path::new("index.bin"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("kind block"), "{err}");
    }

    #[test]
    fn images_need_no_new_version() {
        assert_eq!(
            version_for(&SampleKind::default(), &StoreSource::default()),
            VERSION_IMAGES
        );
        let f32s = SampleKind {
            element: Element::F32,
            ..SampleKind::default()
        };
        assert_eq!(version_for(&f32s, &StoreSource::default()), VERSION_TYPED);
    }
}
