//! The store of variable-length records (format version 3): records of
//! every length read back as written through a cache that stays within its
//! byte budget, a corrupt shard is named, a writer dropped before `finish`
//! leaves nothing that opens, and `Dataset::read` refuses such a store.

use std::path::Path;

use headroom_loader::{Dataset, RecordStoreWriter, ShardCacheConfig, ShardedDataset, StoreSource};

/// Record `i`: `i % 37` bytes (some empty), each byte a function of (i, j).
fn record(i: usize) -> Vec<u8> {
    (0..i % 37).map(|j| (i * 31 + j * 7) as u8).collect()
}

fn write(dir: &Path, n: usize, shard_bytes: u64) {
    let mut w = RecordStoreWriter::create(dir, shard_bytes, 64, false).expect("create");
    for i in 0..n {
        w.push(&record(i)).expect("push");
    }
    let source = StoreSource {
        kind: "test-records".into(),
        ..StoreSource::default()
    };
    let summary = w.finish(&source, "made by the test").expect("finish");
    assert_eq!(summary.samples, n as u64);
    assert!(summary.shards > 4, "{} shards", summary.shards);
}

#[test]
fn records_of_every_length_read_back_within_the_cache_budget() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("records");
    write(&dir, 500, 512);
    let config = ShardCacheConfig {
        max_cache_shards: 64,
        cache_bytes: Some(2048),
        ..ShardCacheConfig::default()
    };
    let store = ShardedDataset::open(&dir, config).expect("open");
    assert!(store.variable_records());
    assert_eq!(store.metadata(), "made by the test");
    assert_eq!(store.source().kind, "test-records");
    assert_eq!(store.len(), 500);
    let mut out = Vec::new();
    // Twice over, in an order that jumps between shards.
    for pass in 0..2 {
        for step in 0..500 {
            let i = (step * 211 + pass) % 500;
            store.read_record(i, &mut out).expect("read");
            assert_eq!(out, record(i), "record {i}");
        }
    }
    let stats = store.cache_stats();
    assert!(
        stats.peak_resident_bytes <= 2048,
        "peak {} bytes over the 2048-byte budget",
        stats.peak_resident_bytes
    );
    assert!(stats.peak_resident_bytes < store.store_bytes() / 4);
    assert!(stats.evictions > 0);
    let mut fixed = vec![0u8; 64];
    let err = store.read(0, &mut fixed).unwrap_err().to_string();
    assert!(err.contains("variable-length records"), "{err}");
    assert!(store.read_record(500, &mut out).is_err());
}

#[test]
fn a_flipped_byte_in_a_shard_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("records");
    write(&dir, 100, 256);
    let shard = dir.join("shard-000001.bin");
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&shard, bytes).unwrap();
    let store = ShardedDataset::open(&dir, ShardCacheConfig::default()).expect("open");
    let mut out = Vec::new();
    let first_of_shard_1 = (0..100).find(|&i| store.shard_of(i) == 1).unwrap();
    let err = store
        .read_record(first_of_shard_1, &mut out)
        .unwrap_err()
        .to_string();
    assert!(err.contains("shard-000001.bin"), "{err}");
    assert!(err.contains("checksum mismatch"), "{err}");
}

#[test]
fn an_unfinished_write_leaves_nothing_that_opens() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("records");
    {
        let mut w = RecordStoreWriter::create(&dir, 128, 64, false).expect("create");
        for i in 0..100 {
            w.push(&record(i)).expect("push");
        }
        // Dropped: as a write that failed or was cut short.
    }
    assert!(ShardedDataset::open(&dir, ShardCacheConfig::default()).is_err());
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
    // An over-long record is refused by its id.
    let mut w = RecordStoreWriter::create(&dir, 128, 4, false).expect("create");
    w.push(&[1, 2, 3, 4]).expect("fits");
    let err = w.push(&[0; 5]).unwrap_err().to_string();
    assert!(err.contains("record 1 is 5 bytes"), "{err}");
}
