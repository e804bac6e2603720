//! The fine-tuning data tokenised once, on disk, read lazily: the JSONL's
//! rows (`data::encode_jsonl`) in a shard store of variable-length records
//! (headroom-loader's format version 3), read through the loader's LRU
//! shard cache within a byte budget.
//!
//! Why the loader's store, extended there: its samples were of one fixed
//! shape per store (a record every `sample_len` bytes), which token rows of
//! 2 to `max_seq_length` ids are not; padding every row to the longest
//! would cost up to `max_seq_length` / (mean row) times the disk and cache.
//! Its shard files already carried a per-sample offsets table, so format
//! version 3 fills it with real offsets and adds a metadata string to the
//! index: the checksums, the atomic install, the index, the LRU cache and
//! its accounting are the loader's own, not a second copy here.
//!
//! A row's record: its n ids (u32 little-endian), then its n labels (i32
//! little-endian; -100 or an id). The store's metadata is JSON: the
//! fingerprint (the JSONL's and `tokenizer.json`'s sizes and FNV-1a hashes,
//! EOS, `max_seq_length`, packing, this layout's version) and the
//! truncated/dropped counts of the tokenisation and the longest row. [`TokenStore::open_or_build`]
//! reuses a store whose fingerprint is the one the inputs give now and
//! rebuilds it otherwise (a changed JSONL, tokenizer or option; a store
//! that does not open), saying why. Building streams the JSONL a line at a
//! time and holds one shard of rows; training holds at most the cache
//! budget of shards plus one micro-batch's rows. Reading a row decodes a
//! copy of it, the same ids and labels as `load_jsonl`'s, so training on
//! the store gives the in-memory path's bits.

use std::path::{Path, PathBuf};

use headroom_loader::{
    CacheStats, Dataset as _, RecordStoreWriter, ShardCacheConfig, ShardedDataset, StoreSource,
};
use serde_json::{json, Value};

use crate::data::{encode_jsonl, DataOptions, Example, Rows};
use crate::error::{LlmError, Result};
use crate::finetune::checkpoint::hash_file;
use crate::tokenizer::Tokenizer;

/// The layout of a record and the metadata, recorded in the fingerprint so
/// a store of another layout is rebuilt.
const LAYOUT: &str = "headroom-llm-tokens 1";
/// The store's source kind in its index.
const SOURCE_KIND: &str = "llm-tokens";

/// How the token store is cut and cached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenStoreOptions {
    /// A shard is closed once its records reach this many bytes.
    pub shard_bytes: u64,
    /// The most bytes of shards held in memory at once; it must hold the
    /// largest shard (`shard_bytes` plus one row plus its header).
    pub cache_bytes: u64,
}

impl Default for TokenStoreOptions {
    fn default() -> Self {
        Self {
            shard_bytes: 4 << 20,
            cache_bytes: 32 << 20,
        }
    }
}

/// Whether [`TokenStore::open_or_build`] tokenised the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// A store with the same fingerprint was there.
    Reused,
    /// There was none.
    Built,
    /// One was there but could not be used, for the reason given.
    Rebuilt(String),
}

/// Tokenised rows on disk; see the module documentation.
pub struct TokenStore {
    store: ShardedDataset,
    dir: PathBuf,
    truncated: usize,
    dropped: usize,
    longest: usize,
    origin: Origin,
    fingerprint: Value,
}

/// The fingerprint of `data` encoded by `tokenizer` with `eos` and
/// `options`: what a store must record to be reused.
pub fn fingerprint(
    data: &Path,
    tokenizer: &Tokenizer,
    eos: Option<u32>,
    options: DataOptions,
) -> Result<Value> {
    let (data_size, data_hash) = hash_file(data)?;
    let (tok_size, tok_hash) = hash_file(tokenizer.path())?;
    Ok(json!({
        "layout": LAYOUT,
        "data": {"size": data_size, "fnv64": data_hash},
        "tokenizer.json": {"size": tok_size, "fnv64": tok_hash},
        "eos": eos,
        "max_seq_length": options.max_seq_length,
        "packing": options.packing,
    }))
}

/// A short name for a fingerprint (its FNV-1a hash), for a cache directory
/// per input.
pub fn fingerprint_name(fingerprint: &Value) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in fingerprint.to_string().bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{hash:016x}")
}

fn encode_record(row: &Example, out: &mut Vec<u8>) -> Result<()> {
    out.clear();
    out.extend(row.ids.iter().flat_map(|id| id.to_le_bytes()));
    for &label in &row.labels {
        let label = i32::try_from(label).map_err(|_| {
            LlmError::Input(format!(
                "label {label} does not fit the token store's i32 labels"
            ))
        })?;
        out.extend_from_slice(&label.to_le_bytes());
    }
    Ok(())
}

fn decode_record(bytes: &[u8], dir: &Path, index: usize) -> Result<Example> {
    if !bytes.len().is_multiple_of(8) {
        return Err(LlmError::Input(format!(
            "token store {}: row {index} is {} bytes, not ids and labels of 4 bytes each",
            dir.display(),
            bytes.len()
        )));
    }
    let n = bytes.len() / 8;
    let word = |at: usize| <[u8; 4]>::try_from(&bytes[at..at + 4]).unwrap_or([0; 4]);
    let ids = (0..n).map(|i| u32::from_le_bytes(word(4 * i))).collect();
    let labels = (0..n)
        .map(|i| i64::from(i32::from_le_bytes(word(4 * (n + i)))))
        .collect();
    Ok(Example { ids, labels })
}

impl TokenStore {
    /// The store for `data` in `dir`: reused when its fingerprint is the
    /// inputs' now, else tokenised from `data` (a line at a time) and
    /// written there atomically, replacing what was there.
    pub fn open_or_build(
        dir: &Path,
        data: &Path,
        tokenizer: &Tokenizer,
        eos: Option<u32>,
        options: DataOptions,
        store_options: TokenStoreOptions,
    ) -> Result<Self> {
        let wanted = fingerprint(data, tokenizer, eos, options)?;
        Self::reuse_or_build(dir, wanted, data, tokenizer, eos, options, store_options)
    }

    /// [`TokenStore::open_or_build`] in `root/NAME`, NAME the
    /// fingerprint's hash ([`fingerprint_name`]): a cache holding one
    /// store per input, so a run on data tokenised before (another run's,
    /// or this run's before a resume) reads it as it is.
    pub fn open_or_build_in_cache(
        root: &Path,
        data: &Path,
        tokenizer: &Tokenizer,
        eos: Option<u32>,
        options: DataOptions,
        store_options: TokenStoreOptions,
    ) -> Result<Self> {
        let wanted = fingerprint(data, tokenizer, eos, options)?;
        let dir = root.join(fingerprint_name(&wanted));
        Self::reuse_or_build(&dir, wanted, data, tokenizer, eos, options, store_options)
    }

    fn reuse_or_build(
        dir: &Path,
        wanted: Value,
        data: &Path,
        tokenizer: &Tokenizer,
        eos: Option<u32>,
        options: DataOptions,
        store_options: TokenStoreOptions,
    ) -> Result<Self> {
        let origin = if dir.join("index.bin").exists() {
            match Self::open(dir, store_options) {
                Ok(store) if store.fingerprint == wanted => return Ok(store),
                Ok(store) => Origin::Rebuilt(format!(
                    "it was made from other inputs (recorded {}, now {wanted})",
                    store.fingerprint
                )),
                Err(e) => Origin::Rebuilt(format!("it does not open: {e}")),
            }
        } else {
            Origin::Built
        };
        match Self::build(
            dir,
            &wanted,
            data,
            tokenizer,
            eos,
            options,
            store_options,
            &origin,
        ) {
            Ok(mut store) => {
                store.origin = origin;
                Ok(store)
            }
            // Another process (a second run on the same data) may have put
            // the same store in place first: then its store is this one.
            Err(e) => match Self::open(dir, store_options) {
                Ok(store) if store.fingerprint == wanted => Ok(store),
                _ => Err(e),
            },
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        dir: &Path,
        wanted: &Value,
        data: &Path,
        tokenizer: &Tokenizer,
        eos: Option<u32>,
        options: DataOptions,
        store_options: TokenStoreOptions,
        origin: &Origin,
    ) -> Result<Self> {
        let bad = |source| LlmError::TokenStore {
            dir: dir.to_path_buf(),
            source,
        };
        let max_record = options.max_seq_length.saturating_mul(8);
        let mut writer = RecordStoreWriter::create(
            dir,
            store_options.shard_bytes,
            max_record,
            *origin != Origin::Built,
        )
        .map_err(bad)?;
        let mut record = Vec::new();
        let mut longest = 0usize;
        let counts = encode_jsonl(data, tokenizer, eos, options, |row| {
            longest = longest.max(row.ids.len());
            encode_record(&row, &mut record)?;
            writer.push(&record).map_err(bad)
        })?;
        let metadata = json!({
            "fingerprint": wanted,
            "truncated": counts.truncated,
            "dropped": counts.dropped,
            "longest": longest,
        });
        let source = StoreSource {
            kind: SOURCE_KIND.into(),
            ..StoreSource::default()
        };
        writer.finish(&source, &metadata.to_string()).map_err(bad)?;
        Self::open(dir, store_options)
    }

    /// Opens the store in `dir` as it is (no fingerprint check).
    pub fn open(dir: &Path, options: TokenStoreOptions) -> Result<Self> {
        let bad = |source| LlmError::TokenStore {
            dir: dir.to_path_buf(),
            source,
        };
        let config = ShardCacheConfig {
            max_cache_shards: usize::MAX,
            cache_bytes: Some(options.cache_bytes),
            read_ahead: 0,
            full_load: false,
        };
        let store = ShardedDataset::open(dir, config).map_err(bad)?;
        let refuse = |what: &str| {
            Err(LlmError::Input(format!(
                "{}: not a token store: {what}",
                dir.display()
            )))
        };
        if !store.variable_records() || store.source().kind != SOURCE_KIND {
            return refuse("its index records no token rows");
        }
        let Ok(metadata) = serde_json::from_str::<Value>(store.metadata()) else {
            return refuse("its metadata is not JSON");
        };
        let count = |key: &str| metadata.get(key).and_then(Value::as_u64);
        let (Some(truncated), Some(dropped), Some(longest), Some(fingerprint)) = (
            count("truncated"),
            count("dropped"),
            count("longest"),
            metadata.get("fingerprint").cloned(),
        ) else {
            return refuse("its metadata lacks the fingerprint or the counts");
        };
        Ok(Self {
            store,
            dir: dir.to_path_buf(),
            truncated: truncated as usize,
            dropped: dropped as usize,
            longest: longest as usize,
            origin: Origin::Reused,
            fingerprint,
        })
    }

    /// Examples cut to `max_seq_length` when the store was made.
    pub fn truncated(&self) -> usize {
        self.truncated
    }

    /// Examples (or packed rows) left with no counted label.
    pub fn dropped(&self) -> usize {
        self.dropped
    }

    /// The most ids in a row (for sizing a pass before training).
    pub fn longest(&self) -> usize {
        self.longest
    }

    /// Whether the file was tokenised by this open.
    pub fn origin(&self) -> &Origin {
        &self.origin
    }

    /// The store directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The inputs the rows were made from.
    pub fn fingerprint(&self) -> &Value {
        &self.fingerprint
    }

    /// Bytes of the shard files.
    pub fn store_bytes(&self) -> u64 {
        self.store.store_bytes()
    }

    /// The most bytes of shards the cache holds at once.
    pub fn cache_limit_bytes(&self) -> u64 {
        self.store.cache_limit_bytes()
    }

    /// Number of shard files.
    pub fn shard_count(&self) -> usize {
        self.store.shard_count()
    }

    /// What the shard cache did so far (bytes resident now and at the
    /// peak, reads, evictions).
    pub fn cache_stats(&self) -> CacheStats {
        self.store.cache_stats()
    }
}

impl Rows for TokenStore {
    fn len(&self) -> usize {
        self.store.len()
    }

    fn row(&self, index: usize) -> Result<Example> {
        let mut bytes = Vec::new();
        self.store
            .read_record(index, &mut bytes)
            .map_err(|source| LlmError::TokenStore {
                dir: self.dir.clone(),
                source,
            })?;
        decode_record(&bytes, &self.dir, index)
    }
}
