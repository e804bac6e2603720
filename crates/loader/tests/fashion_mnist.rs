//! The real Fashion-MNIST, when it is installed (Debian package
//! `dataset-fashion-mnist`); skipped with a printed reason otherwise.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use headroom_loader::{AugmentConfig, DataLoader, Dataset, IdxDataset, LoaderConfig, Split};

const DIR: &str = "/usr/share/datasets/fashion-mnist";

fn dir() -> Option<&'static Path> {
    let dir = Path::new(DIR);
    if dir.is_dir() {
        Some(dir)
    } else {
        eprintln!("skipped: Fashion-MNIST is not installed at {DIR}");
        None
    }
}

#[test]
fn real_fashion_mnist_opens_with_the_expected_sizes() {
    let Some(dir) = dir() else { return };
    let train = IdxDataset::fashion_mnist(dir, Split::Train).unwrap();
    let test = IdxDataset::fashion_mnist(dir, Split::Test).unwrap();
    assert_eq!(train.len(), 60_000);
    assert_eq!(test.len(), 10_000);
    for ds in [&train, &test] {
        assert_eq!(ds.sample_shape(), [28, 28, 1]);
        assert_eq!(ds.num_classes(), 10);
        // Fashion-MNIST is balanced: every class has 1/10 of the samples.
        let mut counts = [0usize; 10];
        for &l in ds.labels() {
            counts[l as usize] += 1;
        }
        assert!(counts.iter().all(|&c| c == ds.len() / 10), "{counts:?}");
    }

    // One augmented epoch over the test split: every sample once.
    let loader = DataLoader::new(
        Arc::new(test),
        LoaderConfig {
            batch_size: 256,
            shuffle: true,
            drop_last: false,
            seed: 7,
            workers: 2,
            prefetch: 4,
            augment: AugmentConfig {
                crop_padding: 4,
                flip: true,
                ..AugmentConfig::default()
            },
            timeout: Duration::from_secs(30),
            ..LoaderConfig::default()
        },
    )
    .unwrap();
    assert_eq!(loader.batches_per_epoch(), 40);
    let mut counts = [0usize; 10];
    let mut n = 0;
    for b in loader.epoch(0, 0) {
        let b = b.unwrap();
        assert_eq!(b.pixels.len(), b.len() * 784);
        for &l in &b.labels {
            counts[l as usize] += 1;
        }
        n += b.len();
    }
    assert_eq!(n, 10_000);
    assert_eq!(counts, [1000; 10]);
}
