//! `cargo xtask bench --loader`: augmented samples/s from a shard store with
//! a cache of 1 and 2 shards and fully loaded, and from IDX in memory; each in
//! its own process for its own peak RSS; with `--compare-torch`, PyTorch's
//! DataLoader on the same data and augmentations, and the ratio.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};
use headroom_loader::{preprocess, IdxDataset, ShardCacheConfig, ShardSize, Split};
use headroom_pipeline::bench::{self, StoreBench};
use headroom_pipeline::{data, ExperimentConfig};
use serde::Deserialize;

use crate::BenchLoaderOneCommand;

/// The hidden `bench-loader-one` command's arguments.
pub fn one_command(args: BenchLoaderOneCommand) -> Result<()> {
    let BenchLoaderOneCommand {
        config,
        store,
        mode,
    } = args;
    let experiment = ExperimentConfig::load(&config, &headroom_pipeline::Overrides::default())?;
    one_here(&experiment, &store, &mode)
}

const WORKERS: usize = 2;
const BATCH: usize = 256;
const EPOCHS: u64 = 2;

#[derive(Debug, Deserialize)]
struct TorchLoader {
    #[serde(rename = "samples_per_s")]
    samples_per_sec: f64,
    #[serde(rename = "peak_rss_bytes_main", default)]
    peak_rss_bytes: Option<u64>,
    #[serde(rename = "peak_rss_bytes_largest_worker", default)]
    worker_rss_bytes: Option<u64>,
}

pub fn run(
    config_path: &Path,
    experiment: &ExperimentConfig,
    json: bool,
    compare_torch: bool,
) -> Result<()> {
    let source = data::locate_fashion_mnist(experiment.data.dir.as_deref(), false)?;
    let scratch = tempfile_dir()?;
    let store = scratch.join("train");
    let summary = preprocess(
        &IdxDataset::fashion_mnist(&source, Split::Train)?,
        &store,
        ShardSize::Samples(4096),
        true,
    )?;
    let mut rows = Vec::new();
    for mode in ["cache1", "cache2", "full", "idx"] {
        rows.push(one_in_subprocess(config_path, &store, mode)?);
    }
    std::fs::remove_dir_all(&scratch).with_context(|| format!("removing {}", scratch.display()))?;
    let torch = if compare_torch {
        torch_loader(&source)?
    } else {
        None
    };
    if json {
        let report = serde_json::json!({ "store": { "shards": summary.shards, "index_bytes": summary.index_bytes },
            "rows": rows, "pytorch": torch.as_ref().map(|t| t.samples_per_sec) });
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "loader alone: Fashion-MNIST train, crop+flip, batch {BATCH}, {WORKERS} workers; store of {} shards, index {} bytes",
        summary.shards, summary.index_bytes
    );
    println!(
        "{:>20} | {:>12} {:>12} {:>11} {:>10} | {:>6}",
        "source", "samples/s", "shard reads", "cache peak", "peak RSS", "ratio"
    );
    for row in &rows {
        let ratio = torch.as_ref().map_or("-".into(), |t| {
            format!("{:.1}", row.samples_per_sec / t.samples_per_sec)
        });
        println!(
            "{:>20} | {:>12.0} {:>12} {:>9.1} MiB {:>10} | {:>6}",
            row.source,
            row.samples_per_sec,
            row.shard_reads,
            row.cache_peak_bytes as f64 / (1 << 20) as f64,
            mib(row.peak_rss_bytes),
            ratio
        );
    }
    if let Some(t) = &torch {
        println!(
            "PyTorch DataLoader ({WORKERS} workers, same augmentations): {:.0} samples/s, peak RSS {} main + {} largest worker",
            t.samples_per_sec,
            mib(t.peak_rss_bytes),
            mib(t.worker_rss_bytes)
        );
    }
    Ok(())
}

/// The hidden `bench-loader-one` command: one configuration, one JSON line.
pub fn one_here(experiment: &ExperimentConfig, store: &Path, mode: &str) -> Result<()> {
    let cache = |shards: usize, full_load: bool| ShardCacheConfig {
        max_cache_shards: shards,
        full_load,
        ..ShardCacheConfig::default()
    };
    let source = match mode {
        "cache1" => Some((store, cache(1, false))),
        "cache2" => Some((store, cache(2, false))),
        "full" => Some((store, cache(2, true))),
        "idx" => None,
        other => bail!("unknown loader bench mode {other}"),
    };
    let result = bench::loader_over_store(experiment, source, WORKERS, BATCH, EPOCHS)?;
    println!("{}", serde_json::to_string(&result)?);
    Ok(())
}

fn one_in_subprocess(config_path: &Path, store: &Path, mode: &str) -> Result<StoreBench> {
    let exe = std::env::current_exe().context("locating the xtask binary")?;
    let output = Command::new(exe)
        .arg("bench-loader-one")
        .arg("--config")
        .arg(config_path)
        .arg("--store")
        .arg(store)
        .args(["--mode", mode])
        .output()
        .context("running bench-loader-one")?;
    if !output.status.success() {
        bail!(
            "loader bench ({mode}) failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let line = String::from_utf8_lossy(&output.stdout);
    serde_json::from_str(line.trim()).with_context(|| format!("bench-loader-one printed {line}"))
}

fn torch_loader(source: &Path) -> Result<Option<TorchLoader>> {
    let script = Path::new("bench/torch/torch_dataloader.py");
    let output = Command::new("python3")
        .arg(script)
        .arg("--dir")
        .arg(source)
        .args(["--workers", &WORKERS.to_string()])
        .args(["--batch-size", &BATCH.to_string()])
        .args(["--epochs", &EPOCHS.to_string()])
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !output.status.success() {
        tracing::warn!(
            "--compare-torch: {} failed (is torch installed? `pip install torch numpy`): {}",
            script.display(),
            String::from_utf8_lossy(&output.stderr)
        );
        return Ok(None);
    }
    let text = String::from_utf8_lossy(&output.stdout);
    Ok(Some(serde_json::from_str(text.trim()).with_context(
        || format!("{} printed {text}", script.display()),
    )?))
}

fn tempfile_dir() -> Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("headroom-loader-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

fn mib(bytes: Option<u64>) -> String {
    bytes.map_or("?".into(), |b| {
        format!("{:.0} MiB", b as f64 / (1 << 20) as f64)
    })
}
