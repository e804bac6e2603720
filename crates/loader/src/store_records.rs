//! [`RecordStoreWriter`]: a shard store of variable-length records (format
//! version 3, [`crate::store_index`]), for samples that have no fixed
//! shape: a language model's token rows.
//!
//! Records are pushed one at a time and written a shard at a time: the
//! writer holds at most one shard's records (about `shard_bytes`) plus the
//! offsets, so a store larger than memory is written in bounded memory.
//! The store is built in a temporary sibling directory (`.NAME.tmp-PID-…`,
//! the names [`crate::preprocess`] uses, so either one cleans up after the
//! other), every file fsynced, the index last, then renamed into place: an
//! interrupted write leaves no `index.bin` at the output path, so nothing
//! half-written opens. Dropped without [`RecordStoreWriter::finish`], it
//! removes its temporary directory.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::io_err;
use crate::store::{
    clean_leftovers, encode_record_kind, inspect_output, install, shard_crc, shard_file_name,
    shard_head_len, sync_dir, temp_prefix, Existing, ShardMeta, StoreIndex, StoreSource,
    StoreSummary, TempDir, INDEX_FILE, SHARD_MAGIC, VERSION_RECORDS,
};
use crate::{LoaderError, SampleKind};

/// Writes a store of variable-length records; see the module documentation.
pub struct RecordStoreWriter {
    output: PathBuf,
    parent: PathBuf,
    existing: Option<Existing>,
    tmp: TempDir,
    shard_bytes: usize,
    max_record: usize,
    /// The open shard's records, end to end, and where each ends.
    data: Vec<u8>,
    ends: Vec<u64>,
    shards: Vec<ShardMeta>,
    total: u64,
    longest: usize,
}

impl RecordStoreWriter {
    /// Starts a store at `output`. A shard is closed once its records
    /// reach `shard_bytes` (a record is never split); no record may be
    /// longer than `max_record` bytes. `output` is refused as
    /// [`crate::preprocess`] refuses it: an existing store unless
    /// `overwrite`, and a non-empty directory that is no store.
    pub fn create(
        output: &Path,
        shard_bytes: u64,
        max_record: usize,
        overwrite: bool,
    ) -> Result<Self, LoaderError> {
        if shard_bytes == 0 || max_record == 0 || u32::try_from(max_record).is_err() {
            return Err(LoaderError::Config {
                field: "shard_size",
                message: format!(
                    "a store of records needs shards of at least one byte and a record limit \
                     of 1 to {} bytes (got {shard_bytes} and {max_record})",
                    u32::MAX
                ),
            });
        }
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
        Ok(Self {
            output: output.to_path_buf(),
            parent,
            existing: Some(existing),
            tmp: TempDir(Some(tmp)),
            shard_bytes: usize::try_from(shard_bytes).unwrap_or(usize::MAX),
            max_record,
            data: Vec::new(),
            ends: Vec::new(),
            shards: Vec::new(),
            total: 0,
            longest: 0,
        })
    }

    /// Appends one record (its id is the count pushed before it).
    pub fn push(&mut self, record: &[u8]) -> Result<(), LoaderError> {
        if record.len() > self.max_record {
            return Err(LoaderError::Config {
                field: "record",
                message: format!(
                    "record {} is {} bytes, over the store's limit of {}",
                    self.total,
                    record.len(),
                    self.max_record
                ),
            });
        }
        self.data.extend_from_slice(record);
        self.ends.push(self.data.len() as u64);
        self.total += 1;
        self.longest = self.longest.max(record.len());
        if self.data.len() >= self.shard_bytes || self.ends.len() == u32::MAX as usize {
            self.close_shard()?;
        }
        Ok(())
    }

    /// Records pushed so far.
    pub fn len(&self) -> u64 {
        self.total
    }

    /// Whether no record was pushed.
    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    fn tmp_dir(&self) -> &Path {
        // Set from `create` until `finish` consumes the writer.
        self.tmp.0.as_deref().unwrap_or(Path::new("."))
    }

    fn close_shard(&mut self) -> Result<(), LoaderError> {
        let count = self.ends.len();
        if count == 0 {
            return Ok(());
        }
        let k = self.shards.len();
        let first = self.total - count as u64;
        let mut head = Vec::with_capacity(shard_head_len(count));
        head.extend_from_slice(SHARD_MAGIC);
        head.extend_from_slice(&VERSION_RECORDS.to_le_bytes());
        head.extend_from_slice(&0u32.to_le_bytes()); // checksum, below
        head.extend_from_slice(&(k as u32).to_le_bytes());
        head.extend_from_slice(&(count as u32).to_le_bytes());
        head.extend_from_slice(&first.to_le_bytes());
        // The shape of the store: [1, 1, longest allowed record].
        for d in [1, 1, self.max_record as u32] {
            head.extend_from_slice(&d.to_le_bytes());
        }
        head.extend_from_slice(&0u32.to_le_bytes()); // reserved
        head.extend_from_slice(&0u64.to_le_bytes()); // record 0 starts the data
        for end in &self.ends {
            head.extend_from_slice(&end.to_le_bytes());
        }
        head.extend(std::iter::repeat_n(0u8, 4 * count)); // labels: 0
        let mut file_bytes = head;
        file_bytes.extend_from_slice(&self.data);
        let crc = shard_crc(&file_bytes);
        file_bytes[12..16].copy_from_slice(&crc.to_le_bytes());
        let path = self.tmp_dir().join(shard_file_name(k));
        let mut f = File::create(&path).map_err(io_err(&path))?;
        f.write_all(&file_bytes).map_err(io_err(&path))?;
        f.sync_all().map_err(io_err(&path))?;
        self.shards.push(ShardMeta {
            count: count as u32,
            bytes: file_bytes.len() as u64,
            crc,
        });
        self.data.clear();
        self.ends.clear();
        Ok(())
    }

    /// Writes the last shard and the index (recording `source` and
    /// `metadata`, which [`crate::ShardedDataset::metadata`] gives back)
    /// and moves the store into place.
    pub fn finish(
        mut self,
        source: &StoreSource,
        metadata: &str,
    ) -> Result<StoreSummary, LoaderError> {
        self.close_shard()?;
        let kind_bytes = encode_record_kind(source, metadata);
        let shape = [1, 1, self.max_record];
        let index = StoreIndex {
            version: VERSION_RECORDS,
            shape,
            num_classes: 1,
            total: self.total,
            shards: std::mem::take(&mut self.shards),
            file_bytes: 0,
            kind: SampleKind::default(),
            source: source.clone(),
            kind_bytes,
            metadata: metadata.to_string(),
        };
        let bytes = index.to_bytes();
        let tmp = self.tmp_dir().to_path_buf();
        let index_path = tmp.join(INDEX_FILE);
        {
            let mut f = File::create(&index_path).map_err(io_err(&index_path))?;
            f.write_all(&bytes).map_err(io_err(&index_path))?;
            f.sync_all().map_err(io_err(&index_path))?;
        }
        sync_dir(&tmp)?;
        let existing = self.existing.take().unwrap_or(Existing::Nothing);
        install(&tmp, &self.output, existing)?;
        self.tmp.0 = None; // `tmp` is now the output (or held the old store, removed)
        sync_dir(&self.parent)?;
        let per_shard = index.shards.iter().map(|s| s.count as usize).max();
        Ok(StoreSummary {
            path: self.output.clone(),
            samples: self.total,
            shards: index.shards.len(),
            samples_per_shard: per_shard.unwrap_or(0),
            index_bytes: bytes.len() as u64,
            total_bytes: bytes.len() as u64 + index.shards.iter().map(|s| s.bytes).sum::<u64>(),
            sample_shape: shape,
            num_classes: 1,
            version: VERSION_RECORDS,
            kind: SampleKind::default(),
        })
    }

    /// The longest record pushed so far, in bytes.
    pub fn longest(&self) -> usize {
        self.longest
    }
}
