//! Text windows packed into the shard store read back byte for byte, lazily
//! (a shard is read when first touched, through the bounded LRU cache), and
//! a batch of windows splits into inputs and next-byte targets.

use headroom_loader::{
    preprocess, Batch, DataLoader, Dataset, LoaderConfig, ShardCacheConfig, ShardSize,
    ShardedDataset, TextWindows,
};

const LENGTH: usize = 8;

fn corpus() -> Vec<u8> {
    (0..2000u32).map(|i| b'a' + (i * 7 % 26) as u8).collect()
}

fn packed(dir: &std::path::Path) -> (TextWindows, ShardedDataset) {
    let windows = TextWindows::new(corpus(), LENGTH, 0, "corpus").unwrap();
    preprocess(&windows, dir, ShardSize::Samples(16), false).unwrap();
    let cache = ShardCacheConfig {
        max_cache_shards: 2,
        ..ShardCacheConfig::default()
    };
    (windows, ShardedDataset::open(dir, cache).unwrap())
}

#[test]
fn packed_windows_read_back_identically_and_lazily() {
    let dir = tempfile::tempdir().unwrap();
    let (windows, store) = packed(&dir.path().join("train"));
    assert_eq!(store.len(), windows.len());
    assert_eq!(store.sample_shape(), [1, LENGTH + 1, 1]);
    assert_eq!(store.num_classes(), 256);
    assert!(store.shard_count() > 4);
    assert_eq!(
        store.cache_stats().bytes_read,
        0,
        "opening reads only the index"
    );

    let (mut from_store, mut from_text) = ([0u8; LENGTH + 1], [0u8; LENGTH + 1]);
    for i in (0..store.len()).rev() {
        store.read(i, &mut from_store).unwrap();
        windows.read(i, &mut from_text).unwrap();
        assert_eq!(from_store, from_text, "window {i}");
    }
    let stats = store.cache_stats();
    assert!(stats.resident_shards <= 2, "{stats:?}");
    assert_eq!(stats.misses, store.shard_count() as u64, "{stats:?}");
    assert!(
        stats.evictions >= store.shard_count() as u64 - 2,
        "{stats:?}"
    );
}

#[test]
fn a_batch_of_windows_splits_into_inputs_and_next_byte_targets() {
    let dir = tempfile::tempdir().unwrap();
    let (_, store) = packed(&dir.path().join("train"));
    let loader = DataLoader::new(
        std::sync::Arc::new(store),
        LoaderConfig {
            batch_size: 3,
            ..LoaderConfig::default()
        },
    )
    .unwrap();
    let batch: Batch = loader.epoch(0, 0).next().unwrap().unwrap();
    let (inputs, targets) = batch.next_token_pairs();
    let text = corpus();
    let expected_inputs: Vec<u32> = (0..3)
        .flat_map(|w| text[w * LENGTH..w * LENGTH + LENGTH].to_vec())
        .map(u32::from)
        .collect();
    let expected_targets: Vec<u32> = (0..3)
        .flat_map(|w| text[w * LENGTH + 1..w * LENGTH + LENGTH + 1].to_vec())
        .map(u32::from)
        .collect();
    assert_eq!(inputs, expected_inputs);
    assert_eq!(targets, expected_targets);
}
