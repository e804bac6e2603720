//! The shard store: preprocess round trips, refusal and atomic replacement,
//! open-reads-only-the-index (and refuses missing shards), the LRU shard cache and its limits,
//! corruption, read-ahead, full load, and shard-aware shuffling.

mod common;

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Synth;
use headroom_loader::{
    preprocess, write_synthetic_store, CacheStats, DataLoader, Dataset, LoaderConfig, LoaderError,
    ShardCacheConfig, ShardSize, ShardedDataset, ShuffleMode, SyntheticDataset, INDEX_FILE,
};

fn cache(max_cache_shards: usize) -> ShardCacheConfig {
    ShardCacheConfig {
        max_cache_shards,
        ..ShardCacheConfig::default()
    }
}

fn open(dir: &Path, config: ShardCacheConfig) -> ShardedDataset {
    ShardedDataset::open(dir, config).expect("open store")
}

/// Opening the store in `dir` fails, naming `file` and `reason`.
fn assert_open_refused(dir: &Path, file: &str, reason: &str) {
    let e = ShardedDataset::open(dir, cache(2)).unwrap_err().to_string();
    assert!(e.contains(file) && e.contains(reason), "{e}");
}

fn read(ds: &dyn Dataset, i: usize) -> (Vec<u8>, u32) {
    let mut out = vec![0; ds.sample_shape().iter().product()];
    let label = ds.read(i, &mut out).expect("read");
    (out, label)
}

fn shard_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("shard-")
        })
        .collect();
    v.sort();
    v
}

fn dir_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

#[test]
fn preprocess_round_trips_every_sample_and_label() {
    let tmp = tempfile::tempdir().unwrap();
    let source = Synth::new(103, [5, 4, 3], 7);
    let sample_len = 60;
    for (name, size, per_shard) in [
        ("by-samples", ShardSize::Samples(10), 10),
        // 48 + 8 fixed bytes, 60 + 12 per sample: 8 samples fit in 632.
        ("by-bytes", ShardSize::Bytes(56 + 72 * 8 + 71), 8),
        ("one-shard", ShardSize::Bytes(1 << 30), 103),
    ] {
        let dir = tmp.path().join(name);
        let s = preprocess(&source, &dir, size, false).unwrap();
        let shards = 103usize.div_ceil(per_shard);
        assert_eq!(
            (s.samples, s.shards, s.samples_per_shard),
            (103, shards, per_shard)
        );
        assert_eq!((s.sample_shape, s.num_classes), ([5, 4, 3], 7));
        assert_eq!(shard_files(&dir).len(), shards, "{name}");
        let on_disk: u64 = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum();
        assert_eq!(s.total_bytes, on_disk);
        assert_eq!(
            s.index_bytes,
            fs::metadata(dir.join(INDEX_FILE)).unwrap().len()
        );
        // 40 + 16 per shard + 4: a few bytes per sample at most.
        assert_eq!(s.index_bytes, 44 + 16 * shards as u64);
        assert!(
            s.index_bytes_per_sample() < 3.0,
            "{}",
            s.index_bytes_per_sample()
        );
        // Every shard within the byte size asked for.
        if let ShardSize::Bytes(b) = size {
            for f in shard_files(&dir) {
                assert!(fs::metadata(&f).unwrap().len() <= b);
            }
        }

        let ds = open(&dir, cache(2));
        assert_eq!(ds.len(), 103);
        assert_eq!(ds.sample_shape(), [5, 4, 3]);
        assert_eq!(ds.num_classes(), 7);
        assert_eq!(ds.shard_count(), shards);
        assert_eq!(ds.index_bytes(), s.index_bytes);
        assert_eq!(ds.store_bytes() + s.index_bytes, s.total_bytes);
        let mut src = vec![0u8; sample_len];
        for i in 0..103 {
            let label = source.read(i, &mut src).unwrap();
            assert_eq!(read(&ds, i), (src.clone(), label), "{name}: sample {i}");
            assert_eq!(ds.shard_of(i), i / per_shard);
        }
        let e = ds.read(103, &mut src).unwrap_err();
        assert!(matches!(e, LoaderError::Index { index: 103, .. }), "{e}");
        let e = ds.read(0, &mut [0u8; 3]).unwrap_err();
        assert!(matches!(e, LoaderError::Buffer { .. }), "{e}");
    }
    // An empty dataset makes an empty store.
    let dir = tmp.path().join("empty");
    let s = preprocess(
        &Synth::new(0, [2, 2, 1], 0),
        &dir,
        ShardSize::Samples(4),
        false,
    )
    .unwrap();
    assert_eq!((s.samples, s.shards), (0, 0));
    let ds = open(&dir, cache(1));
    assert!(ds.is_empty());
}

#[test]
fn the_real_fashion_mnist_test_split_round_trips() {
    let dir = Path::new("/usr/share/datasets/fashion-mnist");
    if !dir.is_dir() {
        eprintln!(
            "skipped: Fashion-MNIST is not installed at {}",
            dir.display()
        );
        return;
    }
    let src =
        headroom_loader::IdxDataset::fashion_mnist(dir, headroom_loader::Split::Test).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("fmnist-test");
    let s = preprocess(&src, &out, "256KiB".parse().unwrap(), false).unwrap();
    assert_eq!(s.samples, 10_000);
    assert!(s.index_bytes_per_sample() < 0.1, "{s}");
    let ds = open(&out, cache(2));
    for i in (0..10_000).step_by(7) {
        let (px, label) = read(&ds, i);
        assert_eq!(&px[..], &src.pixels()[i * 784..(i + 1) * 784]);
        assert_eq!(label, u32::from(src.labels()[i]));
    }
}

#[test]
fn an_existing_store_is_refused_or_replaced_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let a = SyntheticDataset::new(50, [3, 3, 1], 5);
    preprocess(&a, &dir, ShardSize::Samples(8), false).unwrap();

    let b = Synth::new(30, [3, 3, 1], 4);
    let e = preprocess(&b, &dir, ShardSize::Samples(8), false).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, LoaderError::Exists { .. }), "{e}");
    assert!(
        msg.contains(&dir.display().to_string()) && msg.contains("overwrite"),
        "{msg}"
    );
    // Untouched, and nothing left beside it.
    let ds = open(&dir, cache(2));
    assert_eq!((ds.len(), ds.num_classes()), (50, 5));
    assert_eq!(read(&ds, 49), a.sample(49));
    drop(ds);
    assert_eq!(dir_names(tmp.path()), ["store"]);

    // Overwrite replaces the whole store: no shard of the old one survives.
    let s = preprocess(&b, &dir, ShardSize::Samples(8), true).unwrap();
    assert_eq!(s.shards, 4);
    assert_eq!(shard_files(&dir).len(), 4, "the old store had 7 shards");
    let ds = open(&dir, cache(2));
    assert_eq!((ds.len(), ds.num_classes()), (30, 4));
    for i in 0..30 {
        assert_eq!(read(&ds, i).0, b.pixels(i));
    }
    assert_eq!(dir_names(tmp.path()), ["store"]);

    // A directory that is not a store is never replaced, even with overwrite.
    let other = tmp.path().join("photos");
    fs::create_dir(&other).unwrap();
    fs::write(other.join("keep.jpg"), b"precious").unwrap();
    for overwrite in [false, true] {
        let e = preprocess(&b, &other, ShardSize::Samples(8), overwrite).unwrap_err();
        assert!(e.to_string().contains("not a shard store"), "{e}");
    }
    assert_eq!(fs::read(other.join("keep.jpg")).unwrap(), b"precious");
    // Nor is a file.
    let file = tmp.path().join("file");
    fs::write(&file, b"x").unwrap();
    assert!(preprocess(&b, &file, ShardSize::Samples(8), true).is_err());
    // An empty directory is fine.
    let empty = tmp.path().join("empty");
    fs::create_dir(&empty).unwrap();
    preprocess(&b, &empty, ShardSize::Samples(8), false).unwrap();
    assert_eq!(open(&empty, cache(1)).len(), 30);
}

#[test]
fn a_failed_or_crashed_preprocess_leaves_nothing_half_written() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    // A crash of an earlier run (a process that no longer exists) left a
    // temporary directory with a partial store.
    let dead = tmp.path().join(".store.tmp-999999999-123");
    fs::create_dir(&dead).unwrap();
    fs::write(dead.join("shard-000000.bin"), b"partial").unwrap();
    // One of a process that still runs (pid 1) is left alone.
    let live = tmp.path().join(".store.tmp-1-456");
    fs::create_dir(&live).unwrap();

    // A source that fails half-way: the error is reported, no store appears.
    let mut failing = Synth::new(100, [2, 2, 1], 3);
    failing.fail_at = Some(57);
    let e = preprocess(&failing, &dir, ShardSize::Samples(10), false).unwrap_err();
    assert!(e.to_string().contains("57"), "{e}");
    assert!(!dir.exists());
    assert_eq!(
        dir_names(tmp.path()),
        [".store.tmp-1-456"],
        "the dead leftover is removed"
    );

    // A good store, then a failing overwrite: the good store stays whole.
    let good = Synth::new(40, [2, 2, 1], 3);
    preprocess(&good, &dir, ShardSize::Samples(10), false).unwrap();
    let e = preprocess(&failing, &dir, ShardSize::Samples(10), true).unwrap_err();
    assert!(e.to_string().contains("57"), "{e}");
    let ds = open(&dir, cache(1));
    assert_eq!(ds.len(), 40);
    for i in 0..40 {
        assert_eq!(read(&ds, i).0, good.pixels(i));
    }
    assert_eq!(dir_names(tmp.path()), [".store.tmp-1-456", "store"]);
    // A bad label is refused too, naming the sample.
    let mut bad = Synth::new(10, [2, 2, 1], 3);
    bad.bad_label = Some(3);
    let e = preprocess(&bad, &tmp.path().join("bad"), ShardSize::Samples(4), false).unwrap_err();
    assert!(e.to_string().contains("label 3"), "{e}");
}

#[test]
fn open_reads_only_the_index() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let s = write_synthetic_store(&dir, 200, [4, 4, 2], 10, ShardSize::Samples(25)).unwrap();
    // The shards' contents can be garbage: opening does not read them (it
    // checks only that each file is there with the index's size).
    for f in shard_files(&dir) {
        let len = fs::metadata(&f).unwrap().len() as usize;
        fs::write(f, vec![0xA5u8; len]).unwrap();
    }
    let ds = open(&dir, cache(2));
    assert_eq!(
        (ds.len(), ds.sample_shape(), ds.num_classes()),
        (200, [4, 4, 2], 10)
    );
    assert_eq!(ds.index_bytes(), s.index_bytes);
    let st = ds.cache_stats();
    assert_eq!((st.bytes_read, st.resident_bytes, st.misses), (0, 0, 0));
    // The first read needs the shard and names it and the sample.
    let mut out = vec![0; 32];
    let e = ds.read(60, &mut out).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("shard-000002.bin") && msg.contains("sample 60"),
        "{msg}"
    );
    assert!(msg.contains("not a headroom shard"), "{msg}");
    assert_eq!(
        ds.cache_stats().resident_bytes,
        0,
        "a failed read frees its room"
    );
    // A missing shard is refused at open, not at the step that needs it.
    fs::remove_file(dir.join("shard-000005.bin")).unwrap();
    assert_open_refused(&dir, "shard-000005.bin", "missing");
    // A missing index is a clear error.
    let e = ShardedDataset::open(tmp.path(), cache(2)).unwrap_err();
    assert!(e.to_string().contains(INDEX_FILE), "{e}");
}

fn check_limits(st: &CacheStats, ds: &ShardedDataset) {
    assert!(
        st.peak_resident_bytes <= ds.cache_limit_bytes(),
        "peak {} > limit {}",
        st.peak_resident_bytes,
        ds.cache_limit_bytes()
    );
    assert!(st.resident_shards <= ds.cache_capacity_shards());
}

#[test]
fn the_lru_never_exceeds_its_limits_under_random_access() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let src = SyntheticDataset::new(1000, [6, 6, 1], 10);
    preprocess(&src, &dir, ShardSize::Samples(40), false).unwrap();
    let shard_bytes = fs::metadata(dir.join("shard-000000.bin")).unwrap().len();
    for config in [
        cache(1),
        cache(3),
        ShardCacheConfig {
            max_cache_shards: 100,
            cache_bytes: Some(shard_bytes * 5 / 2),
            ..ShardCacheConfig::default()
        },
    ] {
        let ds = Arc::new(open(&dir, config));
        let want_shards = config
            .max_cache_shards
            .min(2 + usize::from(config.cache_bytes.is_none()));
        assert_eq!(
            ds.cache_capacity_shards(),
            want_shards.min(config.max_cache_shards)
        );
        let limit = config
            .cache_bytes
            .unwrap_or(shard_bytes * config.max_cache_shards as u64);
        assert_eq!(ds.cache_limit_bytes(), limit);
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let ds = Arc::clone(&ds);
                let src = &src;
                s.spawn(move || {
                    let mut x = t.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                    for _ in 0..1500 {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let i = (x % 1000) as usize;
                        assert_eq!(read(&*ds, i), src.sample(i));
                    }
                });
            }
        });
        let st = ds.cache_stats();
        check_limits(&st, &ds);
        assert!(st.peak_resident_bytes <= limit);
        assert_eq!(st.hits + st.misses, 6000);
        assert!(
            st.misses > 100,
            "random access over 25 shards misses: {st:?}"
        );
        assert_eq!(st.bytes_read, st.misses * shard_bytes);
        assert_eq!(st.evictions, st.misses - st.resident_shards as u64);
        let usage = ds.memory_usage();
        assert_eq!(usage.peak, st.peak_resident_bytes);
    }
}

#[test]
fn the_least_recently_used_shard_is_evicted() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    write_synthetic_store(&dir, 40, [2, 2, 1], 2, ShardSize::Samples(10)).unwrap();
    let ds = open(&dir, cache(2));
    let misses = |ds: &ShardedDataset| ds.cache_stats().misses;
    read(&ds, 0); // shard 0: miss
    read(&ds, 15); // shard 1: miss
    read(&ds, 3); // shard 0: hit, now most recent
    assert_eq!(misses(&ds), 2);
    read(&ds, 25); // shard 2: evicts shard 1 (least recently used)
    assert_eq!((misses(&ds), ds.cache_stats().evictions), (3, 1));
    read(&ds, 9); // shard 0 is still there
    assert_eq!(misses(&ds), 3);
    read(&ds, 11); // shard 1 was evicted: miss, evicting shard 2
    assert_eq!(misses(&ds), 4);
    read(&ds, 1); // shard 0: hit
    read(&ds, 21); // shard 2: miss
    let st = ds.cache_stats();
    assert_eq!(
        (st.misses, st.hits, st.evictions, st.resident_shards),
        (5, 3, 3, 2)
    );
}

fn corrupt(path: &Path, at: u64) {
    let mut b = fs::read(path).unwrap();
    b[at as usize] ^= 0x40;
    fs::write(path, b).unwrap();
}

/// Runs an unshuffled epoch expecting an error; checks it names the shard
/// file and, once, a sample of that shard, and arrives quickly.
fn expect_loader_error(
    ds: ShardedDataset,
    workers: usize,
    shard: &str,
    samples: std::ops::Range<usize>,
) {
    let l = DataLoader::new(
        Arc::new(ds),
        LoaderConfig {
            batch_size: 8,
            workers,
            prefetch: 3,
            timeout: Duration::from_secs(5),
            ..LoaderConfig::default()
        },
    )
    .unwrap();
    let start = Instant::now();
    let err = l
        .epoch(0, 0)
        .find_map(Result::err)
        .expect("the epoch must fail");
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "took {:?}",
        start.elapsed()
    );
    let msg = err.to_string();
    assert!(msg.contains(shard), "workers {workers}: {msg}");
    let LoaderError::Sample { index, source, .. } = &err else {
        panic!("workers {workers}: {err}");
    };
    assert!(samples.contains(index), "{index} not in {samples:?}");
    // Named once: by the batch's error, not again by the shard's.
    assert_eq!(msg.matches(&format!("sample {index}")).count(), 1, "{msg}");
    assert!(
        matches!(**source, LoaderError::Shard { index: None, .. }),
        "{source}"
    );
}

#[test]
fn a_corrupt_or_truncated_shard_is_an_error_naming_the_file_and_sample() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    write_synthetic_store(&dir, 60, [4, 4, 1], 3, ShardSize::Samples(20)).unwrap();
    let shard1 = dir.join("shard-000001.bin");
    let pristine = fs::read(&shard1).unwrap();

    // A flipped pixel byte: checksum mismatch.
    corrupt(&shard1, pristine.len() as u64 - 5);
    let ds = open(&dir, cache(2));
    assert_eq!(read(&ds, 19).1, 1, "other shards still read");
    let e = ds.read(33, &mut [0; 16]).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("shard-000001.bin") && msg.contains("sample 33"),
        "{msg}"
    );
    assert!(msg.contains("checksum mismatch"), "{msg}");
    for workers in [0, 2] {
        expect_loader_error(open(&dir, cache(2)), workers, "shard-000001.bin", 20..40);
    }
    // full_load fails at open, naming the shard.
    let e = ShardedDataset::open(
        &dir,
        ShardCacheConfig {
            full_load: true,
            ..ShardCacheConfig::default()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("shard-000001.bin"), "{e}");

    // A flipped label or header byte is caught the same way.
    fs::write(&shard1, &pristine).unwrap();
    corrupt(&shard1, 20);
    let e = open(&dir, cache(2)).read(25, &mut [0; 16]).unwrap_err();
    assert!(e.to_string().contains("checksum mismatch"), "{e}");

    // Truncated: refused when the store is opened, and, when it is cut
    // after that, at the read that needs it.
    let truncate = || fs::write(&shard1, &pristine[..pristine.len() - 100]).unwrap();
    truncate();
    assert_open_refused(&dir, "shard-000001.bin", "truncated");
    fs::write(&shard1, &pristine).unwrap();
    let ds = open(&dir, cache(2));
    truncate();
    let msg = ds.read(21, &mut [0; 16]).unwrap_err().to_string();
    assert!(
        msg.contains("truncated") && msg.contains("sample 21"),
        "{msg}"
    );
    for workers in [0, 2] {
        fs::write(&shard1, &pristine).unwrap();
        let ds = open(&dir, cache(1));
        truncate();
        expect_loader_error(ds, workers, "shard-000001.bin", 20..40);
    }
    // Replaced by another valid shard: the index's checksum catches it.
    fs::write(&shard1, fs::read(dir.join("shard-000000.bin")).unwrap()).unwrap();
    let e = open(&dir, cache(2)).read(21, &mut [0; 16]).unwrap_err();
    assert!(e.to_string().contains("index"), "{e}");
}

fn loader(ds: Arc<dyn Dataset>, workers: usize, mode: ShuffleMode) -> DataLoader {
    DataLoader::new(
        ds,
        LoaderConfig {
            batch_size: 16,
            shuffle: true,
            drop_last: false,
            seed: 3,
            workers,
            prefetch: 4,
            shuffle_mode: mode,
            timeout: Duration::from_secs(20),
            ..LoaderConfig::default()
        },
    )
    .unwrap()
}

/// The sample ids of one epoch, in order.
fn epoch_ids(l: &DataLoader, epoch: u64) -> Vec<usize> {
    l.epoch(epoch, 0)
        .flat_map(|b| {
            let b = b.unwrap();
            (0..b.len())
                .map(|j| common::sample_id(b.sample(j)))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Forwards to a shard store, sleeping a pseudo-random 0..200 µs per read
/// so that parallel workers overlap and finish out of order.
struct Jittered(Arc<ShardedDataset>);

impl Dataset for Jittered {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn sample_shape(&self) -> [usize; 3] {
        self.0.sample_shape()
    }
    fn num_classes(&self) -> usize {
        self.0.num_classes()
    }
    fn read(&self, index: usize, out: &mut [u8]) -> Result<u32, LoaderError> {
        let micros = (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56; // 0..256
        std::thread::sleep(Duration::from_micros(micros.min(200)));
        self.0.read(index, out)
    }
    fn shard_layout(&self) -> Option<headroom_loader::ShardLayout> {
        self.0.shard_layout()
    }
    fn prefetch_order(&self, order: &mut dyn Iterator<Item = usize>) {
        self.0.prefetch_order(order)
    }
}

#[test]
fn shard_blocks_read_every_shard_once_per_epoch_and_global_thrashes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let shards = 12;
    write_synthetic_store(&dir, 50 * shards, [4, 4, 1], 10, ShardSize::Samples(50)).unwrap();
    for workers in [0, 2, 4] {
        let ds = Arc::new(open(&dir, cache(2)));
        assert_eq!(ds.shard_layout().unwrap().window, 2);
        let store_bytes = ds.store_bytes();
        let l = loader(
            Arc::new(Jittered(ds.clone())),
            workers,
            ShuffleMode::ShardBlocks,
        );
        for epoch in 0..2 {
            let before = ds.cache_stats();
            let ids = epoch_ids(&l, epoch);
            assert_eq!(ids.iter().copied().collect::<HashSet<_>>().len(), 600);
            let st = ds.cache_stats();
            // Every shard read once; at an epoch's start the shards of the
            // previous epoch's last block may still be cached.
            let read = st.bytes_read - before.bytes_read;
            let cached = if epoch == 0 {
                0
            } else {
                ds.cache_limit_bytes()
            };
            assert!(
                read <= store_bytes && read >= store_bytes - cached,
                "workers {workers}, epoch {epoch}: {read} of {store_bytes} bytes ({st:?})"
            );
            check_limits(&st, &ds);
        }
        // Same order for any worker count.
        assert_eq!(
            epoch_ids(&l, 5),
            epoch_ids(&loader(ds.clone(), 0, ShuffleMode::ShardBlocks), 5)
        );
    }
    // A global shuffle over the same 2-shard cache reads shards again and again.
    let ds = Arc::new(open(&dir, cache(2)));
    let l = loader(ds.clone(), 0, ShuffleMode::Global);
    epoch_ids(&l, 0);
    let st = ds.cache_stats();
    assert!(st.misses > 10 * shards as u64, "{st:?}");
    check_limits(&st, &ds);
}

#[test]
fn read_ahead_loads_the_next_shards_in_the_background() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    write_synthetic_store(&dir, 400, [8, 8, 1], 10, ShardSize::Samples(40)).unwrap();
    let config = ShardCacheConfig {
        max_cache_shards: 3,
        read_ahead: 1,
        ..ShardCacheConfig::default()
    };
    let plain = Arc::new(open(&dir, cache(2)));
    let reference = epoch_ids(&loader(plain, 0, ShuffleMode::ShardBlocks), 1);
    for workers in [0, 2] {
        let ds = Arc::new(open(&dir, config));
        assert_eq!(
            ds.shard_layout().unwrap().window,
            2,
            "capacity 3 minus 1 read ahead"
        );
        let l = loader(ds.clone(), workers, ShuffleMode::ShardBlocks);
        // A consumer slow enough for the background reads to matter.
        let ids: Vec<usize> = l
            .epoch(1, 0)
            .flat_map(|b| {
                std::thread::sleep(Duration::from_millis(3));
                let b = b.unwrap();
                (0..b.len())
                    .map(|j| common::sample_id(b.sample(j)))
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(ids, reference, "read-ahead changes nothing in the batches");
        let st = ds.cache_stats();
        assert!(st.read_ahead_loads >= 3, "workers {workers}: {st:?}");
        assert_eq!(st.bytes_read, ds.store_bytes(), "each shard once: {st:?}");
        assert_eq!(st.misses + st.read_ahead_loads, 10, "{st:?}");
        check_limits(&st, &ds);
    }
    // Unshuffled: shard k + 1 is read while shard k is consumed.
    let ds = Arc::new(open(
        &dir,
        ShardCacheConfig {
            max_cache_shards: 2,
            ..config
        },
    ));
    let l = DataLoader::new(
        ds.clone(),
        LoaderConfig {
            batch_size: 10,
            ..LoaderConfig::default()
        },
    )
    .unwrap();
    for b in l.epoch(0, 0) {
        b.unwrap();
        std::thread::sleep(Duration::from_millis(3)); // a slow consumer
    }
    let st = ds.cache_stats();
    assert!(st.read_ahead_loads >= 8, "{st:?}");
    assert_eq!(st.bytes_read, ds.store_bytes(), "{st:?}");
    check_limits(&st, &ds);
}

#[test]
fn full_load_reads_everything_at_open_and_never_again() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let src = SyntheticDataset::new(300, [3, 5, 2], 6);
    preprocess(&src, &dir, ShardSize::Samples(32), false).unwrap();
    let ds = open(
        &dir,
        ShardCacheConfig {
            full_load: true,
            ..ShardCacheConfig::default()
        },
    );
    let st = ds.cache_stats();
    assert_eq!(st.bytes_read, ds.store_bytes());
    assert_eq!(
        (st.resident_bytes, st.resident_shards),
        (ds.store_bytes(), 10)
    );
    assert_eq!(ds.cache_limit_bytes(), ds.store_bytes());
    for f in shard_files(&dir) {
        fs::remove_file(f).unwrap();
    }
    let l = loader(Arc::new(ds), 2, ShuffleMode::ShardBlocks);
    let ids = epoch_ids(&l, 0);
    assert_eq!(ids.iter().copied().collect::<HashSet<_>>().len(), 300);
    assert_ne!(ids, (0..300).collect::<Vec<_>>());
    let ds = l.dataset();
    let usage = ds.memory_usage();
    assert_eq!(
        (usage.current, usage.peak),
        (l.memory_report().cache_bytes, usage.current)
    );
}

#[test]
fn cache_configs_that_cannot_work_are_refused_naming_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    write_synthetic_store(&dir, 100, [4, 4, 1], 2, ShardSize::Samples(10)).unwrap();
    let shard = fs::metadata(dir.join("shard-000000.bin")).unwrap().len();
    let cases = [
        (cache(0), "max_cache_shards"),
        (
            ShardCacheConfig {
                cache_bytes: Some(shard - 1),
                ..cache(2)
            },
            "cache_bytes",
        ),
        (
            ShardCacheConfig {
                read_ahead: 2,
                ..cache(2)
            },
            "read_ahead",
        ),
        (
            ShardCacheConfig {
                read_ahead: 1,
                cache_bytes: Some(shard),
                ..cache(4)
            },
            "read_ahead",
        ),
        (
            ShardCacheConfig {
                full_load: true,
                cache_bytes: Some(5 * shard),
                ..cache(2)
            },
            "cache_bytes",
        ),
    ];
    for (config, field) in cases {
        let e = ShardedDataset::open(&dir, config).unwrap_err();
        assert!(
            matches!(&e, LoaderError::Config { field: f, .. } if *f == field),
            "{config:?}: {e}"
        );
    }
    // The config deserializes with defaults and rejects unknown keys.
    let c: ShardCacheConfig =
        serde_json::from_str(r#"{"read_ahead": 1, "max_cache_shards": 3}"#).unwrap();
    assert_eq!(
        c,
        ShardCacheConfig {
            read_ahead: 1,
            ..cache(3)
        }
    );
    assert!(serde_json::from_str::<ShardCacheConfig>(r#"{"max_shards": 3}"#).is_err());
}

#[test]
fn a_store_ten_times_the_cache_trains_within_the_memory_budget() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let shards = 20;
    write_synthetic_store(&dir, 64 * shards, [16, 16, 1], 10, ShardSize::Samples(64)).unwrap();
    let ds = Arc::new(open(&dir, cache(2)));
    assert!(ds.store_bytes() >= 10 * ds.cache_limit_bytes());
    let (bs, prefetch) = (32u64, 3u64);
    let batch_bytes = bs * 256 + 4 * bs;
    let budget = ds.cache_limit_bytes() + prefetch * batch_bytes;
    let l = DataLoader::new(
        ds.clone(),
        LoaderConfig {
            batch_size: bs as usize,
            shuffle: true,
            drop_last: true,
            workers: 2,
            prefetch: prefetch as usize,
            shuffle_mode: ShuffleMode::ShardBlocks,
            memory_budget: Some(budget),
            ..LoaderConfig::default()
        },
    )
    .unwrap();
    for epoch in 0..3 {
        let ids = epoch_ids(&l, epoch);
        assert_eq!(
            ids.iter().copied().collect::<HashSet<_>>().len(),
            64 * shards
        );
    }
    let m = l.memory_report();
    assert_eq!((m.limit_bytes, m.budget), (budget, Some(budget)));
    assert!(m.cache_peak_bytes <= ds.cache_limit_bytes(), "{m:?}");
    assert!(m.prefetched_bytes_max <= prefetch * batch_bytes, "{m:?}");
    assert!(m.prefetched_bytes_max >= batch_bytes, "{m:?}");
    let read = ds.cache_stats().bytes_read;
    assert!(
        read <= 3 * ds.store_bytes() && read >= 3 * ds.store_bytes() - 2 * ds.cache_limit_bytes(),
        "each shard once per epoch: {read}"
    );
    // One byte less does not fit.
    let e = DataLoader::new(
        ds.clone(),
        LoaderConfig {
            memory_budget: Some(budget - 1),
            ..l.config().clone()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("loader.memory_budget"), "{e}");
}
