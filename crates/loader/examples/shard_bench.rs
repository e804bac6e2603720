//! Augmented samples per second from a shard store of Fashion-MNIST, with
//! shard caches of 1 and 2 shards and full load, against the in-memory IDX
//! dataset; with the peak resident set size of each run.
//!
//! ```text
//! cargo run --release -p headroom-loader --example shard_bench -- \
//!     [--json] [--dir DIR] [--workers N] [--epochs N] [--shard-size SIZE]
//! ```
//!
//! DIR defaults to /usr/share/datasets/fashion-mnist; the store is written
//! to a temporary directory (shard size default 4096 samples). Each row runs
//! `--epochs` (default 2) epochs of batches of 256 after one warm-up epoch,
//! with `ShuffleMode::ShardBlocks`, except the global-shuffle row, which
//! shows why: it thrashes the cache and is cut off after 3 s. Peak RSS
//! is VmHWM from /proc/self/status, reset before each row through
//! /proc/self/clear_refs.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use headroom_loader::{
    preprocess, AugmentConfig, DataLoader, Dataset, IdxDataset, LoaderConfig, RandAugmentConfig,
    ShardCacheConfig, ShardSize, ShardedDataset, ShuffleMode, Split,
};

struct Args {
    json: bool,
    dir: PathBuf,
    workers: usize,
    epochs: u64,
    shard_size: ShardSize,
}

fn args() -> Result<Args, Box<dyn std::error::Error>> {
    let mut a = Args {
        json: false,
        dir: PathBuf::from("/usr/share/datasets/fashion-mnist"),
        workers: 2,
        epochs: 2,
        shard_size: ShardSize::Samples(4096),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--json" => a.json = true,
            "--dir" => a.dir = PathBuf::from(value()?),
            "--workers" => a.workers = value()?.parse()?,
            "--epochs" => a.epochs = value()?.parse()?,
            "--shard-size" => a.shard_size = value()?.parse()?,
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    Ok(a)
}

/// (VmHWM, VmRSS) in bytes.
fn rss() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("VmHWM:"), field("VmRSS:"))
}

fn reset_peak_rss() {
    // "5" resets the peak RSS to the current RSS (Linux >= 4.0).
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

struct Row {
    name: String,
    augment: &'static str,
    samples_per_s: f64,
    epoch_s: f64,
    shard_reads_per_epoch: f64,
    cache_peak_bytes: u64,
    prefetched_bytes_max: u64,
    peak_rss: u64,
}

fn run(
    name: &str,
    augment_name: &'static str,
    dataset: Arc<dyn Dataset>,
    stats: &dyn Fn() -> Option<(u64, u64)>,
    config: LoaderConfig,
    epochs: u64,
    limit: Option<Duration>,
) -> Result<Row, Box<dyn std::error::Error>> {
    let loader = DataLoader::new(dataset, config)?;
    let shard_bytes = || stats().map_or(0, |s| s.0);
    let start = Instant::now();
    let drain = |epoch: u64| -> Result<usize, Box<dyn std::error::Error>> {
        let (mut n, mut checksum) = (0usize, 0u64);
        for b in loader.epoch(epoch, 0) {
            let b = b?;
            n += b.len();
            checksum = checksum.wrapping_add(u64::from(b.pixels[b.pixels.len() / 2]));
            if limit.is_some_and(|l| start.elapsed() > l) {
                break;
            }
        }
        std::hint::black_box(checksum);
        Ok(n)
    };
    if limit.is_none() {
        drain(0)?; // warm-up: thread start, page faults, first shard reads
    }
    let (read0, t, mut samples) = (shard_bytes(), Instant::now(), 0usize);
    for e in 1..=epochs {
        samples += drain(e)?;
    }
    let secs = t.elapsed().as_secs_f64();
    let m = loader.memory_report();
    let full_epochs = samples as f64 / (loader.batches_per_epoch() * 256) as f64;
    let shard_reads_per_epoch = stats().map_or(0.0, |(bytes, shard)| {
        (bytes - read0) as f64 / shard.max(1) as f64 / full_epochs
    });
    Ok(Row {
        name: name.to_string(),
        augment: augment_name,
        samples_per_s: samples as f64 / secs,
        epoch_s: secs / full_epochs,
        shard_reads_per_epoch,
        cache_peak_bytes: m.cache_peak_bytes,
        prefetched_bytes_max: m.prefetched_bytes_max,
        peak_rss: rss().0,
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = args()?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fashion-mnist-train");
    let t = Instant::now();
    let summary = {
        let train = IdxDataset::fashion_mnist(&a.dir, Split::Train)?;
        preprocess(&train, &store, a.shard_size, false)?
    };
    let preprocess_s = t.elapsed().as_secs_f64();
    if !a.json {
        println!("{summary}");
        println!(
            "preprocess: {preprocess_s:.2} s; cores available: {}; workers: {}; batch 256",
            std::thread::available_parallelism().map_or(0, |n| n.get()),
            a.workers
        );
    }

    let crop_flip = AugmentConfig {
        crop_padding: 2,
        flip: true,
        ..AugmentConfig::default()
    };
    let with_ra = AugmentConfig {
        rand_augment: Some(RandAugmentConfig {
            num_ops: 2,
            magnitude: 9,
        }),
        ..crop_flip.clone()
    };
    let base = LoaderConfig {
        batch_size: 256,
        shuffle: true,
        drop_last: true,
        seed: 0,
        workers: a.workers,
        prefetch: 4,
        timeout: Duration::from_secs(120),
        shuffle_mode: ShuffleMode::ShardBlocks,
        ..LoaderConfig::default()
    };
    let caches: [(&str, ShardCacheConfig, ShuffleMode); 5] = [
        (
            "shards, cache 1",
            ShardCacheConfig {
                max_cache_shards: 1,
                ..ShardCacheConfig::default()
            },
            ShuffleMode::ShardBlocks,
        ),
        (
            "shards, cache 2",
            ShardCacheConfig::default(),
            ShuffleMode::ShardBlocks,
        ),
        (
            "shards, cache 3 + read-ahead 1",
            ShardCacheConfig {
                max_cache_shards: 3,
                read_ahead: 1,
                ..ShardCacheConfig::default()
            },
            ShuffleMode::ShardBlocks,
        ),
        (
            "shards, cache 2, global shuffle",
            ShardCacheConfig::default(),
            ShuffleMode::Global,
        ),
        (
            "shards, full load",
            ShardCacheConfig {
                full_load: true,
                ..ShardCacheConfig::default()
            },
            ShuffleMode::ShardBlocks,
        ),
    ];
    let mut rows = Vec::new();
    for (aug_name, augment) in [("crop+flip", &crop_flip), ("crop+flip+RA(2,9)", &with_ra)] {
        for (name, cache, mode) in &caches {
            if *mode == ShuffleMode::Global && aug_name != "crop+flip" {
                continue;
            }
            reset_peak_rss();
            let ds = Arc::new(ShardedDataset::open(&store, *cache)?);
            let shard = ds.store_bytes() / ds.shard_count() as u64;
            let stats_ds = Arc::clone(&ds);
            let stats = move || Some((stats_ds.cache_stats().bytes_read, shard));
            let config = LoaderConfig {
                augment: augment.clone(),
                shuffle_mode: *mode,
                ..base.clone()
            };
            // The thrashing row is cut short.
            let limit = (*mode == ShuffleMode::Global).then(|| Duration::from_secs(3));
            let name = if limit.is_some() {
                format!("{name} (3 s)")
            } else {
                name.to_string()
            };
            rows.push(run(&name, aug_name, ds, &stats, config, a.epochs, limit)?);
        }
        reset_peak_rss();
        let idx: Arc<dyn Dataset> = Arc::new(IdxDataset::fashion_mnist(&a.dir, Split::Train)?);
        let config = LoaderConfig {
            augment: augment.clone(),
            ..base.clone()
        };
        rows.push(run(
            "IDX in memory",
            aug_name,
            idx,
            &|| None,
            config,
            a.epochs,
            None,
        )?);
    }

    if a.json {
        let rows: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "source": r.name,
                    "augment": r.augment,
                    "workers": a.workers,
                    "samples_per_s": r.samples_per_s.round(),
                    "epoch_s": r.epoch_s,
                    "shard_reads_per_epoch": r.shard_reads_per_epoch,
                    "cache_peak_bytes": r.cache_peak_bytes,
                    "prefetched_bytes_max": r.prefetched_bytes_max,
                    "peak_rss_bytes": r.peak_rss,
                })
            })
            .collect();
        let out = serde_json::json!({
            "store": {
                "samples": summary.samples,
                "shards": summary.shards,
                "samples_per_shard": summary.samples_per_shard,
                "index_bytes": summary.index_bytes,
                "index_bytes_per_sample": summary.index_bytes_per_sample(),
                "total_bytes": summary.total_bytes,
                "preprocess_s": preprocess_s,
            },
            "runs": rows,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "\n| {:<37} | {:<17} | {:>10} | {:>7} | {:>12} | {:>10} | {:>10} | {:>9} |",
        "source",
        "augment",
        "samples/s",
        "epoch s",
        "shard reads",
        "cache peak",
        "batches max",
        "peak RSS"
    );
    println!(
        "|{:-<39}|{:-<19}|{:->12}|{:->9}|{:->14}|{:->12}|{:->12}|{:->11}|",
        "", "", "", "", "", "", "", ""
    );
    for r in &rows {
        println!(
            "| {:<37} | {:<17} | {:>10.0} | {:>7.2} | {:>12} | {:>6.1} MiB | {:>6.1} MiB | {:>5.1} MiB |",
            r.name,
            r.augment,
            r.samples_per_s,
            r.epoch_s,
            if r.name.starts_with("IDX") {
                "-".to_string()
            } else {
                format!("{:.1}/epoch", r.shard_reads_per_epoch)
            },
            mib(r.cache_peak_bytes),
            mib(r.prefetched_bytes_max),
            mib(r.peak_rss),
        );
    }
    Ok(())
}
