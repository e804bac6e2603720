//! Augmented samples per second over Fashion-MNIST with 0, 1 and 2 workers.
//!
//! ```text
//! cargo run --release -p headroom-loader --example loader_bench [DIR]
//! ```
//! DIR defaults to /usr/share/datasets/fashion-mnist.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use headroom_loader::{AugmentConfig, DataLoader, Dataset, IdxDataset, LoaderConfig, Split};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/share/datasets/fashion-mnist"));
    let t = Instant::now();
    let train: Arc<dyn Dataset> = Arc::new(IdxDataset::fashion_mnist(&dir, Split::Train)?);
    println!(
        "opened {} ({} samples of {:?}, {} classes) in {:.2?}",
        dir.display(),
        train.len(),
        train.sample_shape(),
        train.num_classes(),
        t.elapsed()
    );
    println!(
        "cores available: {}",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );

    for (name, augment) in [
        (
            "crop_padding=4 + flip",
            AugmentConfig {
                crop_padding: 4,
                flip: true,
                ..AugmentConfig::default()
            },
        ),
        ("no augmentation", AugmentConfig::default()),
    ] {
        for workers in [0, 1, 2] {
            let config = LoaderConfig {
                batch_size: 256,
                shuffle: true,
                drop_last: true,
                seed: 0,
                workers,
                prefetch: 8,
                augment: augment.clone(),
                timeout: Duration::from_secs(60),
                ..LoaderConfig::default()
            };
            let loader = DataLoader::new(Arc::clone(&train), config)?;
            // Warm-up epoch (page faults, thread start).
            let _ = loader.epoch(0, 0).count();
            // Three timed runs of about a second each; the median is
            // reported (the machine may be shared).
            let mut rates = Vec::new();
            let mut epoch = 1u64;
            for _ in 0..3 {
                let (mut samples, mut checksum) = (0usize, 0u64);
                let t = Instant::now();
                while t.elapsed() < Duration::from_secs(1) {
                    for b in loader.epoch(epoch, 0) {
                        let b = b?;
                        samples += b.len();
                        checksum = checksum
                            .wrapping_add(u64::from(b.pixels[b.pixels.len() / 2]))
                            .wrapping_add(b.labels.iter().map(|&l| u64::from(l)).sum::<u64>());
                    }
                    epoch += 1;
                }
                std::hint::black_box(checksum);
                rates.push(samples as f64 / t.elapsed().as_secs_f64());
            }
            rates.sort_by(f64::total_cmp);
            println!(
                "{name:>22}, workers={workers}: {:>10.0} samples/s median \
                 (min {:.0}, max {:.0}; {:.0} MB/s of pixels)",
                rates[1],
                rates[0],
                rates[2],
                rates[1] * 784.0 / 1e6,
            );
        }
    }
    Ok(())
}
