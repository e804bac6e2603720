//! [`ShardedDataset`]: a shard store read through a bounded shard cache.
//!
//! Opening reads only the index. A shard is read (and its checksum checked)
//! when a sample of it is first needed, and kept in an LRU cache of at most
//! `max_cache_shards` shards and `cache_bytes` bytes. A shard being read
//! counts against the limits from the moment its read starts, so the bytes
//! the cache holds never exceed them; samples are copied out under the cache
//! lock, so no shard outlives its eviction. The lock is never held during a
//! disk read.
//!
//! The loader tells the dataset each epoch's order ([`Dataset::prefetch_order`]).
//! With it the cache
//! - evicts shards that the rest of the epoch no longer needs first;
//! - rather than evict a shard that is still needed but whose remaining
//!   samples all come before the requested shard's (they are in batches
//!   other workers are finishing), waits for those reads (at most
//!   [`PLAN_WAIT`], after which the hint is dropped as stale), so parallel
//!   workers crossing a [`crate::ShuffleMode::ShardBlocks`] block boundary do
//!   not thrash;
//! - with `read_ahead > 0`, a background thread reads the next `read_ahead`
//!   shards of the order into free room (never evicting a needed shard).
//!
//! `full_load` reads every shard at open and never evicts: the in-memory
//! decoded-sample cache of the design (augmentation is still applied fresh
//! every epoch, by the loader). [`crate::IdxDataset`] is that cache by nature.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use serde::{Deserialize, Serialize};

use crate::dataset::{MemoryUsage, ShardLayout};
use crate::store::{self, ShardMeta, StoreIndex, StoreSource};
use crate::store_read::{check_shard_files, read_shard_file, with_retries};
use crate::{Dataset, LoaderError, SampleKind, TableScale};

/// The longest a read waits for other readers to finish with a shard it
/// would otherwise evict, before it treats the order hint as stale.
pub const PLAN_WAIT: Duration = Duration::from_secs(1);

/// The pauses before each new try of a shard read that failed with an I/O
/// error that may pass (a network file system's EIO or stale handle, a
/// timeout): the file is opened again each time. A corrupt, truncated or
/// missing file is not read again.
const RETRY_DELAYS: [Duration; 3] = [
    Duration::from_millis(50),
    Duration::from_millis(250),
    Duration::from_secs(1),
];

/// How a [`ShardedDataset`] caches shards.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShardCacheConfig {
    /// Most shards in memory at once (>= 1). Default 2.
    pub max_cache_shards: usize,
    /// Most bytes of shards in memory at once; `None` = no byte limit
    /// besides `max_cache_shards`.
    pub cache_bytes: Option<u64>,
    /// Shards read ahead of the readers in the order the loader announced,
    /// by a background thread; 0 = off. Must be below the cache's capacity
    /// in shards.
    pub read_ahead: usize,
    /// Read every shard at open and keep them all (the limits above then do
    /// not apply, except that `cache_bytes`, if set, must hold the store).
    pub full_load: bool,
}

impl Default for ShardCacheConfig {
    fn default() -> Self {
        Self {
            max_cache_shards: 2,
            cache_bytes: None,
            read_ahead: 0,
            full_load: false,
        }
    }
}

/// What the shard cache did so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Bytes of shards in memory now (including shards being read).
    pub resident_bytes: u64,
    /// The most `resident_bytes` ever was.
    pub peak_resident_bytes: u64,
    /// Shards in memory now (including shards being read).
    pub resident_shards: usize,
    /// Sample reads served from memory (possibly after waiting for another
    /// thread's read of the shard).
    pub hits: u64,
    /// Sample reads that read their shard from disk.
    pub misses: u64,
    /// Shards dropped from the cache.
    pub evictions: u64,
    /// Bytes read from shard files (all reads: misses, read-ahead, full load).
    pub bytes_read: u64,
    /// Shards read by the read-ahead thread.
    pub read_ahead_loads: u64,
    /// Times a read waited for other readers to finish with a shard rather
    /// than evict it.
    pub waits: u64,
}

/// A decoded, verified shard: the file's bytes and where its parts are.
struct ShardData {
    bytes: Vec<u8>,
    labels_at: usize,
    data_at: usize,
    sample_len: usize,
    /// Version 3: records cut at the offsets table, not every `sample_len`.
    variable: bool,
}

impl ShardData {
    #[inline]
    fn sample(&self, local: usize) -> (&[u8], u32) {
        let (from, to) = if self.variable {
            // Checked by `verify`: increasing, within the data.
            let off = |i: usize| {
                let at = store::SHARD_HEADER + 8 * i;
                u64::from_le_bytes(self.bytes[at..at + 8].try_into().expect("8 bytes")) as usize
            };
            (self.data_at + off(local), self.data_at + off(local + 1))
        } else {
            let at = self.data_at + local * self.sample_len;
            (at, at + self.sample_len)
        };
        let l = self.labels_at + 4 * local;
        let label = u32::from_le_bytes(self.bytes[l..l + 4].try_into().expect("4 bytes"));
        (&self.bytes[from..to], label)
    }
}

enum Slot {
    Absent,
    Loading,
    Ready(Box<Resident>),
}

struct Resident {
    data: ShardData,
    last_use: u64,
    /// Read ahead and not touched since.
    fresh: bool,
}

/// The announced order, reduced to per-shard facts.
struct Plan {
    /// Position of the shard's first and last sample in the order
    /// (`u64::MAX` / 0 for shards the order does not visit).
    first: Vec<u64>,
    last: Vec<u64>,
    /// Reads of the shard still to come.
    remaining: Vec<u64>,
    /// Shards in order of first use, and each shard's place in it.
    seq: Vec<u32>,
    seq_pos: Vec<u32>,
    /// The furthest place in `seq` touched so far.
    high: Option<usize>,
    /// Shards whose read-ahead failed (left to the readers to report).
    ahead_failed: Vec<bool>,
}

#[derive(Default)]
struct State {
    slots: Vec<Slot>,
    /// Shards `Loading` or `Ready`.
    resident: Vec<usize>,
    resident_bytes: u64,
    tick: u64,
    stats: CacheStats,
    plan: Option<Plan>,
}

enum Room {
    Ok,
    /// A needed shard that precedes the request is in the way: wait.
    Wait,
    /// Every resident shard is being read: wait for one to finish.
    Busy,
    /// Read-ahead only: nothing can be evicted without harm.
    Skip,
}

struct Inner {
    dir: PathBuf,
    index: StoreIndex,
    /// Cumulative sample counts: shard k holds `starts[k]..starts[k + 1]`.
    starts: Vec<u64>,
    /// Samples per shard if every shard but the last has this many.
    uniform: Option<u64>,
    sample_len: usize,
    config: ShardCacheConfig,
    /// Most shards resident at once.
    capacity: usize,
    /// Most bytes resident at once.
    limit_bytes: u64,
    state: Mutex<State>,
    changed: Condvar,
    wake: Option<Sender<()>>,
    stop: AtomicBool,
}

/// A shard store (written by [`crate::preprocess`]) as a [`Dataset`].
///
/// Safe to share between threads (the loader's workers do, through an
/// `Arc`); see the module documentation for how shards are cached.
pub struct ShardedDataset {
    inner: Arc<Inner>,
    read_ahead: Option<JoinHandle<()>>,
}

impl ShardedDataset {
    /// Opens the store in `dir`, reading only its index (or, with
    /// `full_load`, every shard); each shard file's presence and size are
    /// checked against the index.
    pub fn open(dir: &Path, config: ShardCacheConfig) -> Result<Self, LoaderError> {
        let index = StoreIndex::read(dir)?;
        check_shard_files(dir, &index)?;
        let n = index.shards.len();
        let mut starts = Vec::with_capacity(n + 1);
        let mut acc = 0u64;
        starts.push(0);
        for s in &index.shards {
            acc += u64::from(s.count);
            starts.push(acc);
        }
        let uniform = index
            .shards
            .first()
            .map(|s| u64::from(s.count))
            .filter(|&c| {
                index.shards[..n - 1]
                    .iter()
                    .all(|s| u64::from(s.count) == c)
                    && index.shards[n - 1].count as u64 <= c
            });
        let total_bytes: u64 = index.shards.iter().map(|s| s.bytes).sum();
        let largest = index.shards.iter().map(|s| s.bytes).max().unwrap_or(0);
        let err = |field, message| Err(LoaderError::Config { field, message });
        let (capacity, limit_bytes) = if config.full_load {
            if let Some(b) = config.cache_bytes.filter(|&b| b < total_bytes) {
                return err(
                    "cache_bytes",
                    format!(
                        "{b} bytes cannot hold the whole store ({total_bytes} bytes in {n} \
                         shards) that full_load reads"
                    ),
                );
            }
            (n, total_bytes)
        } else {
            if config.max_cache_shards == 0 {
                return err("max_cache_shards", "must be at least 1".into());
            }
            let by_bytes = match config.cache_bytes {
                Some(b) if n > 0 && b < largest => {
                    return err(
                        "cache_bytes",
                        format!(
                            "{b} bytes cannot hold one shard of this store (the largest is \
                             {largest} bytes): raise it or preprocess with smaller shards"
                        ),
                    );
                }
                Some(b) if largest > 0 => usize::try_from(b / largest).unwrap_or(usize::MAX),
                _ => usize::MAX,
            };
            let capacity = config.max_cache_shards.min(by_bytes);
            if n > 0 && config.read_ahead >= capacity {
                return err(
                    "read_ahead",
                    format!(
                        "{} must be below the cache's capacity of {capacity} shard(s), so that \
                         reading ahead does not evict shards in use",
                        config.read_ahead
                    ),
                );
            }
            let mut sizes: Vec<u64> = index.shards.iter().map(|s| s.bytes).collect();
            sizes.sort_unstable_by(|a, b| b.cmp(a));
            let top: u64 = sizes.iter().take(config.max_cache_shards).sum();
            (capacity, config.cache_bytes.map_or(top, |b| b.min(top)))
        };
        let sample_len = index.record_len();
        let read_ahead = config.read_ahead > 0 && !config.full_load && n > 0;
        let (wake, wake_rx) = if read_ahead {
            let (tx, rx) = crossbeam_channel::bounded(1);
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let state = State {
            slots: (0..n).map(|_| Slot::Absent).collect(),
            ..State::default()
        };
        let inner = Arc::new(Inner {
            dir: dir.to_path_buf(),
            index,
            starts,
            uniform,
            sample_len,
            config,
            capacity,
            limit_bytes,
            state: Mutex::new(state),
            changed: Condvar::new(),
            wake,
            stop: AtomicBool::new(false),
        });
        if config.full_load {
            for k in 0..n {
                let data = inner.load(k, None)?;
                let mut st = inner.lock();
                let size = inner.index.shards[k].bytes;
                st.stats.bytes_read += size;
                st.resident.push(k);
                st.resident_bytes += size;
                st.stats.peak_resident_bytes = st.stats.peak_resident_bytes.max(st.resident_bytes);
                st.slots[k] = Slot::Ready(Box::new(Resident {
                    data,
                    last_use: 0,
                    fresh: false,
                }));
            }
        }
        let read_ahead = match wake_rx {
            Some(rx) => {
                let inner = Arc::clone(&inner);
                Some(
                    std::thread::Builder::new()
                        .name("headroom-read-ahead".into())
                        .spawn(move || read_ahead_main(&inner, &rx))
                        .map_err(|source| LoaderError::SpawnReadAhead { source })?,
                )
            }
            None => None,
        };
        tracing::debug!(
            dir = %dir.display(),
            shards = n,
            capacity,
            limit_bytes,
            "shard store opened"
        );
        Ok(Self { inner, read_ahead })
    }

    /// The element type, numeric targets and source that the store at
    /// `dir` records, reading its index only (a few bytes per shard).
    pub fn read_kind(dir: &Path) -> Result<(SampleKind, StoreSource), LoaderError> {
        let index = StoreIndex::read(dir)?;
        Ok((index.kind, index.source))
    }

    /// The store's format version: 1 for u8 images with class labels, 2
    /// for typed samples.
    pub fn format_version(&self) -> u32 {
        self.inner.index.version
    }

    /// What the samples were made from (empty for a version-1 store).
    pub fn source(&self) -> &StoreSource {
        &self.inner.index.source
    }

    /// The metadata a store of variable-length records was written with
    /// ([`crate::RecordStoreWriter::finish`]); empty for other stores.
    pub fn metadata(&self) -> &str {
        &self.inner.index.metadata
    }

    /// Whether the samples are variable-length records (format version 3),
    /// read with [`ShardedDataset::read_record`] only.
    pub fn variable_records(&self) -> bool {
        self.inner.index.version == store::VERSION_RECORDS
    }

    /// Replaces `out` with sample `index`'s record, through the shard
    /// cache as [`Dataset::read`] reads: for a store of variable-length
    /// records its own bytes, for any other store its fixed-length record.
    pub fn read_record(&self, index: usize, out: &mut Vec<u8>) -> Result<(), LoaderError> {
        let inner = &self.inner;
        if index as u64 >= inner.index.total {
            return Err(LoaderError::Index {
                index,
                len: self.len(),
            });
        }
        let k = inner.shard_of(index as u64);
        let local = (index as u64 - inner.starts[k]) as usize;
        inner.with_shard(k, index, |data| {
            let (record, _) = data.sample(local);
            out.clear();
            out.extend_from_slice(record);
        })
    }

    /// A store made from a table: the standardisation its features and
    /// numeric targets were stored with (the training table's), as a
    /// direct CSV run records it.
    pub fn table_scale(&self) -> Option<TableScale> {
        let index = &self.inner.index;
        (index.source.kind == "csv").then(|| TableScale {
            features: index.source.feature_scale.clone(),
            values: index.kind.value_scale.clone(),
        })
    }

    /// The store directory.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// The cache configuration.
    pub fn config(&self) -> &ShardCacheConfig {
        &self.inner.config
    }

    /// Size of the index file: all that opening the store read (besides the
    /// shards, in full-load mode).
    pub fn index_bytes(&self) -> u64 {
        self.inner.index.file_bytes
    }

    /// Number of shard files.
    pub fn shard_count(&self) -> usize {
        self.inner.index.shards.len()
    }

    /// The path of shard `k`.
    pub fn shard_path(&self, k: usize) -> PathBuf {
        self.inner.dir.join(store::shard_file_name(k))
    }

    /// Total bytes of the shard files.
    pub fn store_bytes(&self) -> u64 {
        self.inner.index.shards.iter().map(|s| s.bytes).sum()
    }

    /// The most shards the cache holds at once.
    pub fn cache_capacity_shards(&self) -> usize {
        self.inner.capacity
    }

    /// The most bytes the cache holds at once.
    pub fn cache_limit_bytes(&self) -> u64 {
        self.inner.limit_bytes
    }

    /// The shard holding sample `index` (< len).
    pub fn shard_of(&self, index: usize) -> usize {
        self.inner.shard_of(index as u64)
    }

    /// What the cache did so far.
    pub fn cache_stats(&self) -> CacheStats {
        let st = self.inner.lock();
        CacheStats {
            resident_bytes: st.resident_bytes,
            resident_shards: st.resident.len(),
            ..st.stats
        }
    }
}

impl Drop for ShardedDataset {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Relaxed);
        if let Some(wake) = &self.inner.wake {
            let _ = wake.try_send(());
        }
        if let Some(h) = self.read_ahead.take() {
            let _ = h.join();
        }
    }
}

impl std::fmt::Debug for ShardedDataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedDataset")
            .field("dir", &self.inner.dir)
            .field("samples", &self.inner.index.total)
            .field("shards", &self.inner.index.shards.len())
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Dataset for ShardedDataset {
    fn len(&self) -> usize {
        self.inner.index.total as usize
    }

    fn sample_shape(&self) -> [usize; 3] {
        self.inner.index.shape
    }

    fn num_classes(&self) -> usize {
        self.inner.index.num_classes
    }

    fn sample_kind(&self) -> SampleKind {
        self.inner.index.kind.clone()
    }

    /// The index's shape, classes and every shard's sample count, size and
    /// checksum: a shard rewritten with other content has another checksum
    /// (checked again as it is read), so no shard need be read here.
    fn fingerprint(&self) -> Option<u32> {
        let index = &self.inner.index;
        let mut digest = crc32fast::Hasher::new();
        for side in index.shape {
            digest.update(&(side as u64).to_le_bytes());
        }
        digest.update(&(index.num_classes as u64).to_le_bytes());
        // Empty for a version-1 store, whose fingerprint stays what it was.
        digest.update(&index.kind_bytes);
        for shard in &index.shards {
            digest.update(&shard.count.to_le_bytes());
            digest.update(&shard.bytes.to_le_bytes());
            digest.update(&shard.crc.to_le_bytes());
        }
        Some(digest.finalize())
    }

    fn read(&self, index: usize, out: &mut [u8]) -> Result<u32, LoaderError> {
        let inner = &self.inner;
        if index as u64 >= inner.index.total {
            return Err(LoaderError::Index {
                index,
                len: self.len(),
            });
        }
        if self.variable_records() {
            return Err(LoaderError::Shard {
                path: inner.dir.clone(),
                index: Some(index),
                message: "the store holds variable-length records (format version 3), which \
                          only read_record reads; it is no store of images or typed samples"
                    .into(),
            });
        }
        if out.len() != inner.sample_len {
            return Err(LoaderError::Buffer {
                index,
                expected: inner.sample_len,
                actual: out.len(),
            });
        }
        let k = inner.shard_of(index as u64);
        let local = (index as u64 - inner.starts[k]) as usize;
        inner.with_shard(k, index, |data| {
            let (pixels, label) = data.sample(local);
            out.copy_from_slice(pixels);
            label
        })
    }

    fn shard_layout(&self) -> Option<ShardLayout> {
        let inner = &self.inner;
        Some(ShardLayout {
            shard_lens: inner
                .index
                .shards
                .iter()
                .map(|s| s.count as usize)
                .collect(),
            window: if inner.config.full_load {
                inner.capacity.max(1)
            } else {
                inner
                    .capacity
                    .saturating_sub(inner.config.read_ahead)
                    .max(1)
            },
        })
    }

    fn prefetch_order(&self, order: &mut dyn Iterator<Item = usize>) {
        let inner = &self.inner;
        if inner.config.full_load {
            return;
        }
        let n = inner.index.shards.len();
        let mut first = vec![u64::MAX; n];
        let mut last = vec![0u64; n];
        let mut remaining = vec![0u64; n];
        for (pos, i) in order.enumerate() {
            if i as u64 >= inner.index.total {
                continue;
            }
            let k = inner.shard_of(i as u64);
            if first[k] == u64::MAX {
                first[k] = pos as u64;
            }
            last[k] = pos as u64;
            remaining[k] += 1;
        }
        let mut seq: Vec<u32> = (0..n as u32)
            .filter(|&k| first[k as usize] != u64::MAX)
            .collect();
        seq.sort_unstable_by_key(|&k| first[k as usize]);
        let mut seq_pos = vec![u32::MAX; n];
        for (p, &k) in seq.iter().enumerate() {
            seq_pos[k as usize] = p as u32;
        }
        let plan = Plan {
            first,
            last,
            remaining,
            seq,
            seq_pos,
            high: None,
            ahead_failed: vec![false; n],
        };
        inner.lock().plan = Some(plan);
        inner.changed.notify_all();
        inner.wake_read_ahead();
    }

    fn memory_limit(&self) -> u64 {
        self.inner.limit_bytes
    }

    fn memory_usage(&self) -> MemoryUsage {
        let st = self.inner.lock();
        MemoryUsage {
            current: st.resident_bytes,
            peak: st.stats.peak_resident_bytes,
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The lock is only held for bookkeeping and copies that cannot
        // panic; recover the state if a panic poisoned it anyway.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    #[inline]
    fn shard_of(&self, i: u64) -> usize {
        match self.uniform {
            Some(c) => (i / c) as usize,
            None => self.starts.partition_point(|&s| s <= i) - 1,
        }
    }

    fn wake_read_ahead(&self) {
        if let Some(w) = &self.wake {
            let _ = w.try_send(()); // full: a wake-up is pending already
        }
    }

    /// Runs `f` on shard `k` (reading it if needed) for sample `index`.
    fn with_shard<R>(
        &self,
        k: usize,
        index: usize,
        f: impl FnOnce(&ShardData) -> R,
    ) -> Result<R, LoaderError> {
        let size = self.index.shards[k].bytes;
        let mut st = self.lock();
        let mut deadline: Option<Instant> = None;
        loop {
            let state = &mut *st;
            let loading = match &mut state.slots[k] {
                Slot::Ready(res) => {
                    state.tick += 1;
                    res.last_use = state.tick;
                    res.fresh = false;
                    let r = f(&res.data);
                    state.stats.hits += 1;
                    self.used(state, k);
                    return Ok(r);
                }
                Slot::Loading => true,
                Slot::Absent => false,
            };
            if loading {
                st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            match self.make_room(&mut st, k, size, true) {
                Room::Ok => break,
                Room::Busy => {
                    st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
                }
                Room::Wait => {
                    let now = Instant::now();
                    let until = *deadline.get_or_insert_with(|| {
                        st.stats.waits += 1;
                        now + PLAN_WAIT
                    });
                    if now >= until {
                        tracing::debug!(
                            shard = k,
                            "shard cache: the order hint looks stale; evicting by LRU"
                        );
                        st.plan = None;
                        continue;
                    }
                    st = self
                        .changed
                        .wait_timeout(st, until - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                Room::Skip => unreachable!("demand reads never skip"),
            }
        }
        self.reserve(&mut st, k, size);
        st.stats.misses += 1;
        drop(st);
        let loaded = self.load(k, Some(index));
        let mut st = self.lock();
        st.stats.bytes_read += size;
        let r = match loaded {
            Ok(data) => {
                st.tick += 1;
                let res = Box::new(Resident {
                    data,
                    last_use: st.tick,
                    fresh: false,
                });
                let r = f(&res.data);
                st.slots[k] = Slot::Ready(res);
                self.used(&mut st, k);
                Ok(r)
            }
            Err(e) => {
                self.unreserve(&mut st, k, size);
                Err(e)
            }
        };
        drop(st);
        self.changed.notify_all();
        r
    }

    /// Bookkeeping after a read of a sample of shard `k`.
    fn used(&self, st: &mut State, k: usize) {
        let Some(plan) = st.plan.as_mut() else {
            return;
        };
        let mut wake = false;
        if plan.remaining[k] > 0 {
            plan.remaining[k] -= 1;
            if plan.remaining[k] == 0 {
                // Room may have become free for waiting readers and read-ahead.
                self.changed.notify_all();
                wake = true;
            }
        }
        let p = plan.seq_pos[k];
        if p != u32::MAX && plan.high.is_none_or(|h| p as usize > h) {
            plan.high = Some(p as usize);
            wake = true;
        }
        if wake {
            self.wake_read_ahead();
        }
    }

    fn reserve(&self, st: &mut State, k: usize, size: u64) {
        st.slots[k] = Slot::Loading;
        st.resident.push(k);
        st.resident_bytes += size;
        st.stats.peak_resident_bytes = st.stats.peak_resident_bytes.max(st.resident_bytes);
        debug_assert!(st.resident.len() <= self.capacity && st.resident_bytes <= self.limit_bytes);
    }

    fn unreserve(&self, st: &mut State, k: usize, size: u64) {
        st.slots[k] = Slot::Absent;
        st.resident.retain(|&r| r != k);
        st.resident_bytes -= size;
    }

    /// Evicts shards until shard `k` of `size` bytes fits.
    fn make_room(&self, st: &mut State, k: usize, size: u64, demand: bool) -> Room {
        loop {
            if st.resident.len() < self.capacity && st.resident_bytes + size <= self.limit_bytes {
                return Room::Ok;
            }
            // Least recently used among: shards the rest of the order does
            // not need; needed ones; needed ones read ahead and not used yet.
            let (mut done, mut needed, mut fresh) = (None, None, None);
            let mut preceding = false;
            let plan = st.plan.as_ref();
            let k_first = plan.map_or(u64::MAX, |p| p.first[k]);
            for &r in &st.resident {
                let Slot::Ready(res) = &st.slots[r] else {
                    continue;
                };
                let pick = |best: &mut Option<(u64, usize)>| {
                    if best.is_none_or(|(t, _)| res.last_use < t) {
                        *best = Some((res.last_use, r));
                    }
                };
                match plan {
                    Some(p) if p.remaining[r] > 0 => {
                        if k_first != u64::MAX && p.last[r] < k_first {
                            preceding = true;
                        }
                        pick(if res.fresh { &mut fresh } else { &mut needed });
                    }
                    _ => pick(&mut done),
                }
            }
            let victim = match done {
                Some((_, v)) => v,
                None if !demand => return Room::Skip,
                None if preceding => return Room::Wait,
                None => match needed.or(fresh) {
                    Some((_, v)) => v,
                    None => return Room::Busy,
                },
            };
            let bytes = self.index.shards[victim].bytes;
            self.unreserve(st, victim, bytes);
            st.stats.evictions += 1;
        }
    }

    /// Reads and verifies shard `k` (for sample `index`, for messages).
    fn load(&self, k: usize, index: Option<usize>) -> Result<ShardData, LoaderError> {
        let path = self.dir.join(store::shard_file_name(k));
        let meta = self.index.shards[k];
        let fail = |message: String| LoaderError::Shard {
            path: path.clone(),
            index,
            message,
        };
        let bytes = with_retries(&path, &RETRY_DELAYS, || read_shard_file(&path, meta.bytes))
            .map_err(|fault| fail(fault.message))?;
        self.verify(&bytes, k, meta).map_err(fail)?;
        let count = meta.count as usize;
        Ok(ShardData {
            labels_at: store::SHARD_HEADER + 8 * (count + 1),
            data_at: store::shard_head_len(count),
            sample_len: self.sample_len,
            variable: self.index.version == store::VERSION_RECORDS,
            bytes,
        })
    }

    /// Checks a shard file's contents against its header and the index.
    fn verify(&self, b: &[u8], k: usize, meta: ShardMeta) -> Result<(), String> {
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        if b.len() < store::SHARD_HEADER || &b[..8] != store::SHARD_MAGIC {
            return Err("bad magic: not a headroom shard file (corrupt)".into());
        }
        let version = u32_at(8);
        if version != self.index.version {
            return Err(format!(
                "format version {version}, but the index is version {} (the shard does not \
                 belong to this store; re-run preprocess)",
                self.index.version
            ));
        }
        let stored = u32_at(12);
        let computed = store::shard_crc(b);
        if stored != computed {
            return Err(format!(
                "checksum mismatch: the header says 0x{stored:08x}, the contents hash to \
                 0x{computed:08x} (corrupt file; re-run preprocess)"
            ));
        }
        if stored != meta.crc {
            return Err(format!(
                "checksum 0x{stored:08x} differs from the index's 0x{:08x} (the shard was \
                 replaced after the index was written; re-run preprocess)",
                meta.crc
            ));
        }
        let count = meta.count as usize;
        let shape = [
            u32_at(32) as usize,
            u32_at(36) as usize,
            u32_at(40) as usize,
        ];
        if u32_at(16) as usize != k
            || u32_at(20) != meta.count
            || u64_at(24) != self.starts[k]
            || shape != self.index.shape
        {
            return Err(format!(
                "header says shard {}, {} samples from {} of {shape:?}; the index expects \
                 shard {k}, {count} samples from {} of {:?}",
                u32_at(16),
                u32_at(20),
                u64_at(24),
                self.starts[k],
                self.index.shape
            ));
        }
        if version == store::VERSION_TYPED && u32_at(44) as usize != self.sample_len {
            return Err(format!(
                "header says {}-byte records, the index {}-byte ones",
                u32_at(44),
                self.sample_len
            ));
        }
        if version == store::VERSION_RECORDS {
            if u32_at(44) != 0 {
                return Err(format!("reserved field is {}, expected 0", u32_at(44)));
            }
            let data_len = (b.len() - store::shard_head_len(count)) as u64;
            let mut previous = 0u64;
            for i in 0..=count {
                let off = u64_at(store::SHARD_HEADER + 8 * i);
                let end = if i == count { data_len } else { off };
                let wrong = (i == 0 && off != 0)
                    || off < previous
                    || off - previous > self.sample_len as u64
                    || off != end;
                if wrong {
                    return Err(format!(
                        "offset of record {i} is {off}: the offsets must start at 0, increase \
                         by at most {} bytes and end at the data's {data_len} bytes",
                        self.sample_len
                    ));
                }
                previous = off;
            }
        }
        for i in (0..=count).filter(|_| version != store::VERSION_RECORDS) {
            let off = u64_at(store::SHARD_HEADER + 8 * i);
            if off != (i * self.sample_len) as u64 {
                return Err(format!(
                    "offset of sample {i} is {off}, expected {}",
                    i * self.sample_len
                ));
            }
        }
        let labels_at = store::SHARD_HEADER + 8 * (count + 1);
        for i in 0..count {
            let label = u32_at(labels_at + 4 * i);
            if label as usize >= self.index.num_classes {
                return Err(format!(
                    "label {label} of sample {} is not below num_classes = {}",
                    self.starts[k] + i as u64,
                    self.index.num_classes
                ));
            }
        }
        Ok(())
    }
}

/// The read-ahead thread: on each wake-up, reads the next `read_ahead`
/// shards after the furthest one touched, into free room only.
fn read_ahead_main(inner: &Inner, wake: &Receiver<()>) {
    while wake.recv().is_ok() {
        loop {
            if inner.stop.load(Ordering::Relaxed) {
                return;
            }
            let mut st = inner.lock();
            let Some(k) = next_to_read_ahead(&st, inner.config.read_ahead) else {
                break;
            };
            let size = inner.index.shards[k].bytes;
            if !matches!(inner.make_room(&mut st, k, size, false), Room::Ok) {
                break;
            }
            inner.reserve(&mut st, k, size);
            st.stats.read_ahead_loads += 1;
            drop(st);
            let loaded = inner.load(k, None);
            let mut st = inner.lock();
            st.stats.bytes_read += size;
            match loaded {
                Ok(data) => {
                    st.tick += 1;
                    st.slots[k] = Slot::Ready(Box::new(Resident {
                        data,
                        last_use: st.tick,
                        fresh: true,
                    }));
                }
                Err(e) => {
                    tracing::debug!("read-ahead: {e}");
                    inner.unreserve(&mut st, k, size);
                    if let Some(p) = st.plan.as_mut() {
                        p.ahead_failed[k] = true;
                    }
                }
            }
            drop(st);
            inner.changed.notify_all();
        }
    }
}

fn next_to_read_ahead(st: &State, read_ahead: usize) -> Option<usize> {
    let plan = st.plan.as_ref()?;
    let from = plan.high.map_or(0, |h| h + 1);
    let to = (from + read_ahead).min(plan.seq.len());
    plan.seq[from.min(to)..to]
        .iter()
        .map(|&k| k as usize)
        .find(|&k| matches!(st.slots[k], Slot::Absent) && !plan.ahead_failed[k])
}
