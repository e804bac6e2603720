//! `cargo xtask bench --loader`: augmented samples/s from a shard store with
//! a cache of 1 and 2 shards and fully loaded, and from IDX in memory; each in
//! its own process for its own peak RSS; with `--compare-torch`, PyTorch's
//! DataLoader on the same data and augmentations, and the ratio. The hidden
//! `bench-loader-one --mode csv` times CSV ingest beside pandas' read_csv,
//! `--mode image_folder` preprocessing beside torchvision (`preprocess_bench`).

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};
use headroom_loader::{
    preprocess, CsvTable, IdxDataset, ShardCacheConfig, ShardSize, Split, TableConfig, TableTarget,
};
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
        rows,
    } = args;
    if mode == "csv" {
        return csv_ingest(&store, rows.unwrap_or(CSV_ROWS));
    }
    if mode == "image_folder" {
        return super::preprocess_bench::image_folder(
            &store,
            rows.unwrap_or(super::preprocess_bench::IMAGES),
        );
    }
    if rows.is_some() {
        bail!("--rows applies to --mode csv and image_folder only");
    }
    let Some(config) = config else {
        bail!("--mode {mode} needs --config");
    };
    let experiment = ExperimentConfig::load(&config, &headroom_pipeline::Overrides::default())?;
    one_here(&experiment, &store, &mode)
}

/// Rows of the generated CSV unless `--rows` says otherwise.
const CSV_ROWS: usize = 1_000_000;
/// Reads of the file per reader; the fastest counts (the first may pay
/// for the page cache).
const CSV_REPEAT: usize = 3;

/// `--mode csv`: writes `path` (when missing) with `rows` rows of 8
/// feature columns and a target, then times [`CsvTable::open`] (parse,
/// check and hold every cell as f32, on the cores this process may use:
/// `taskset -c 0` for one) and `pandas.read_csv` (float32, one thread) on
/// it, each the fastest of [`CSV_REPEAT`] reads, side by side.
fn csv_ingest(path: &Path, rows: usize) -> Result<()> {
    if !path.exists() {
        write_bench_csv(path, rows)?;
    }
    let bytes = std::fs::metadata(path)
        .with_context(|| format!("reading {}", path.display()))?
        .len();
    let config = TableConfig {
        targets: vec!["y".into()],
        features: Vec::new(),
        target: TableTarget::Values,
    };
    let mut best = f64::INFINITY;
    let mut read_rows = 0;
    for _ in 0..CSV_REPEAT {
        let start = std::time::Instant::now();
        let table = CsvTable::open(path, &config)?;
        best = best.min(start.elapsed().as_secs_f64());
        read_rows = table.rows();
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "CSV ingest: {} ({read_rows} rows, {:.1} MiB), fastest of {CSV_REPEAT} reads; headroom \
         on the {cores} core(s) this process may use, pandas on one thread",
        path.display(),
        bytes as f64 / (1 << 20) as f64
    );
    let ours = read_rows as f64 / best;
    println!("{:>28} | {:>9} | {:>12}", "reader", "seconds", "rows/s");
    println!(
        "{:>28} | {best:>9.3} | {ours:>12.0}",
        "headroom CsvTable::open"
    );
    let script = Path::new("bench/pandas_read_csv.py");
    let output = Command::new("python3")
        .arg(script)
        .arg(path)
        .args(["--repeat", &CSV_REPEAT.to_string()])
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !output.status.success() {
        println!(
            "pandas: {} failed (is pandas installed? `pip install pandas`): {}",
            script.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
        return Ok(());
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let pandas: PandasRead = serde_json::from_str(text.trim())
        .with_context(|| format!("{} printed {text}", script.display()))?;
    println!(
        "{:>28} | {:>9.3} | {:>12.0}",
        pandas.reader, pandas.seconds, pandas.rows_per_s
    );
    println!(
        "headroom / pandas: {:.2}x the rows/s",
        ours / pandas.rows_per_s
    );
    Ok(())
}

#[derive(Debug, Deserialize)]
struct PandasRead {
    reader: String,
    seconds: f64,
    rows_per_s: f64,
}

/// `rows` rows of `f0..f7,y`: deterministic numbers of six decimals, y a
/// linear function of the features.
fn write_bench_csv(path: &Path, rows: usize) -> Result<()> {
    use std::io::Write as _;
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut out = std::io::BufWriter::new(file);
    let write_err = |e: std::io::Error| anyhow::anyhow!("writing {}: {e}", path.display());
    writeln!(out, "f0,f1,f2,f3,f4,f5,f6,f7,y").map_err(write_err)?;
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for _ in 0..rows {
        let mut y = 0.0;
        for k in 0..8 {
            // xorshift: cheap, fixed numbers for every run.
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let v = (state >> 11) as f64 / (1u64 << 53) as f64 * 200.0 - 100.0;
            y += v * (k as f64 + 1.0);
            write!(out, "{v:.6},").map_err(write_err)?;
        }
        writeln!(out, "{y:.6}").map_err(write_err)?;
    }
    out.flush().map_err(write_err)?;
    Ok(())
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
