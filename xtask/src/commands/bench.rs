//! `cargo xtask bench`: the training step at several batch sizes, each in its
//! own process so that peak RSS belongs to that configuration alone; the
//! loader on its own; and, with `--compare-torch`, the same step in PyTorch
//! (bench/torch/torch_step.py: the experiment's model built from its `[model]`
//! table by bench/torch/torch_models.py, same settings, batch and threads,
//! channels_last) run right after ours, with the ratio. A ratio is given
//! only when both sides count the same parameters, trainable and all.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use headroom_model::cuda::ops::{ConvPath, TunedConv};
use headroom_pipeline::bench::{self, StepBench, StoreBench};
use headroom_pipeline::{ExperimentConfig, Overrides};
use serde::{Deserialize, Serialize};

use super::loader_bench;
use crate::{BenchCommand, BenchStepCommand};

/// `cargo xtask bench`: checks the switches, then times the loader
/// (`--loader`) or the step at each batch size.
pub fn command(args: BenchCommand) -> Result<()> {
    let BenchCommand {
        config,
        overrides,
        batch,
        threads,
        warmup,
        steps,
        json,
        json_out,
        profile,
        compare_torch,
        torch_compile_mode,
        loader,
        device,
        avx2_only,
    } = args;
    if !matches!(device.as_str(), "cpu" | "cuda") {
        bail!("--device: expected cpu or cuda, got {device:?}");
    }
    if torch_compile_mode != "default" && !(device == "cuda" && compare_torch) {
        bail!("--torch-compile-mode sets PyTorch's mode beside headroom on the GPU: it needs --device cuda and --compare-torch");
    }
    let mut overrides = overrides;
    overrides.push(format!("device.kind={device}"));
    let experiment = super::load_experiment(&config, &Overrides::parse(&overrides)?)?;
    if loader {
        return loader_bench::run(&config, &experiment, json, compare_torch);
    }
    let threads =
        threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let batch = match (batch.is_empty(), device.as_str()) {
        (false, _) => batch,
        (true, "cuda") => vec![128, 512],
        (true, _) => vec![32, 128, 256],
    };
    let args = BenchArgs {
        config_path: &config,
        overrides: &overrides,
        batches: &batch,
        gpu: device == "cuda",
        threads,
        warmup,
        steps,
        json,
        json_out: json_out.as_deref(),
        profile,
        compare_torch,
        torch_compile_mode: &torch_compile_mode,
        avx2_only,
    };
    run(&args, &experiment)
}

/// The hidden `bench-step` command's arguments, checked and run here.
pub fn step_command(args: BenchStepCommand) -> Result<()> {
    let BenchStepCommand {
        config,
        overrides,
        batch,
        threads,
        warmup,
        steps,
        profile,
    } = args;
    let experiment = super::load_experiment(&config, &Overrides::parse(&overrides)?)?;
    let run = StepRun {
        batch,
        threads,
        warmup,
        steps,
        profile,
    };
    step_here(&experiment, &run)
}

pub struct BenchArgs<'a> {
    pub config_path: &'a Path,
    pub overrides: &'a [String],
    pub batches: &'a [usize],
    /// The step runs on the GPU (and PyTorch's with AMP, compiled).
    pub gpu: bool,
    pub threads: usize,
    pub warmup: usize,
    pub steps: usize,
    pub json: bool,
    /// Where to write the JSON report as well.
    pub json_out: Option<&'a Path>,
    /// Time a few more steps segment by segment (GPU).
    pub profile: bool,
    pub compare_torch: bool,
    /// PyTorch's `torch.compile` mode on the GPU (`reduce-overhead`: CUDA
    /// graphs, as headroom's step).
    pub torch_compile_mode: &'a str,
    /// Both sides limited to AVX2+FMA on an AVX-512 CPU, to stand in for an
    /// AVX2-only machine (Zen 3, say) in the same run.
    pub avx2_only: bool,
}

#[derive(Debug, Deserialize, Serialize)]
struct TorchStep {
    version: String,
    samples_per_sec: f64,
    step_ms: f64,
    peak_rss_bytes: u64,
    #[serde(default)]
    device: Option<String>,
    #[serde(default)]
    peak_device_bytes: Option<u64>,
    parameters: usize,
    trainable_parameters: usize,
    /// torch.compile's mode; absent when the step ran eager.
    #[serde(default)]
    compile_mode: Option<String>,
}

#[derive(Debug, Serialize)]
struct Row {
    headroom: StepBench,
    /// Direct-convolution-equivalent FLOP/s over the measured FMA peak.
    share_of_peak: f64,
    pytorch: Option<TorchStep>,
    ratio: Option<f64>,
}

#[derive(Debug, Serialize)]
struct Report {
    /// `run.name` of the experiment timed.
    experiment: String,
    machine_peak_gflops: f64,
    threads: usize,
    avx2_only: bool,
    rows: Vec<Row>,
    loader: Option<StoreBench>,
}

pub fn run(args: &BenchArgs, experiment: &ExperimentConfig) -> Result<()> {
    let peak = bench::peak_gflops(args.threads, args.avx2_only);
    let torch_config = match args.compare_torch {
        true => Some(TorchConfig::write(experiment)?),
        false => None,
    };
    let mut rows = Vec::new();
    for &batch in args.batches {
        let headroom = step_in_subprocess(args, batch)?;
        let pytorch = match &torch_config {
            Some(config) => torch_step(args, config, batch)?,
            None => None,
        };
        if let Some(torch) = &pytorch {
            same_model(&headroom, torch)?;
        }
        let ratio = pytorch
            .as_ref()
            .map(|t| headroom.samples_per_sec / t.samples_per_sec);
        rows.push(Row {
            share_of_peak: headroom.gflops / peak,
            headroom,
            pytorch,
            ratio,
        });
    }
    let workers = experiment.loader_workers();
    let loader = match bench::loader_over_store(experiment, None, workers, 128, 2) {
        Ok(result) => Some(result),
        Err(e) => {
            tracing::warn!("loader not timed: {e}");
            None
        }
    };
    let report = Report {
        experiment: experiment.run.name.clone(),
        machine_peak_gflops: peak,
        threads: args.threads,
        avx2_only: args.avx2_only,
        rows,
        loader,
    };
    let json = serde_json::to_string_pretty(&report)?;
    if let Some(path) = args.json_out {
        std::fs::write(path, format!("{json}\n"))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if args.json {
        println!("{json}");
    } else {
        print_table(&report);
    }
    Ok(())
}

/// This xtask built without the `avx512-gemm` feature, in its own target
/// directory: the gemm crate picks AVX-512 whenever the CPU has it, so
/// `HEADROOM_CPU_KERNELS=avx2` alone would hold only our own kernels to
/// AVX2. Built once (a few minutes), then up to date in seconds.
pub fn avx2_gemm_binary() -> Result<PathBuf> {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    if let Some(path) = BUILT.get() {
        return Ok(path.clone());
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("locating the workspace")?;
    let target_dir = workspace.join("target").join("avx2-gemm");
    eprintln!(
        "--avx2-only: building xtask without the avx512-gemm feature in {}",
        target_dir.display()
    );
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "--release", "--quiet", "--package", "xtask"])
        .arg("--no-default-features")
        .arg("--manifest-path")
        .arg(workspace.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir)
        .status()
        .context("running cargo build for the AVX2-only bench binary")?;
    if !status.success() {
        bail!("cargo build of the AVX2-only bench binary failed ({status})");
    }
    let path = target_dir
        .join("release")
        .join(format!("xtask{}", std::env::consts::EXE_SUFFIX));
    Ok(BUILT.get_or_init(|| path).clone())
}

/// One `bench-step` configuration.
pub struct StepRun {
    pub batch: usize,
    pub threads: usize,
    pub warmup: usize,
    pub steps: usize,
    pub profile: bool,
}

/// The hidden `bench-step` command: one configuration, one JSON line.
pub fn step_here(experiment: &ExperimentConfig, run: &StepRun) -> Result<()> {
    let result = bench::training_step(
        experiment,
        run.batch,
        run.threads,
        run.warmup,
        run.steps,
        run.profile,
    )?;
    println!("{}", serde_json::to_string(&result)?);
    Ok(())
}

fn step_in_subprocess(args: &BenchArgs, batch: usize) -> Result<StepBench> {
    let exe = match args.avx2_only && cfg!(feature = "avx512-gemm") {
        true => avx2_gemm_binary()?,
        false => std::env::current_exe().context("locating the xtask binary")?,
    };
    let mut command = Command::new(exe);
    command
        .arg("bench-step")
        .arg("--config")
        .arg(args.config_path)
        .args(["--batch", &batch.to_string()])
        .args(["--threads", &args.threads.to_string()])
        .args(["--warmup", &args.warmup.to_string()])
        .args(["--steps", &args.steps.to_string()]);
    for pair in args.overrides {
        command.args(["--set", pair]);
    }
    if args.profile {
        command.arg("--profile");
    }
    if args.avx2_only {
        command.env("HEADROOM_CPU_KERNELS", "avx2");
    }
    let output = command.output().context("running bench-step")?;
    if !output.status.success() {
        bail!(
            "bench-step at batch {batch} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let line = String::from_utf8_lossy(&output.stdout);
    serde_json::from_str(line.trim()).with_context(|| format!("bench-step printed {line}"))
}

/// The resolved experiment as JSON in a temporary file, for
/// bench/torch/torch_step.py; removed when dropped.
struct TorchConfig {
    path: std::path::PathBuf,
}

impl TorchConfig {
    fn write(experiment: &ExperimentConfig) -> Result<Self> {
        let path = std::env::temp_dir().join(format!(
            "headroom-bench-{}-{}.json",
            experiment.run.name,
            std::process::id()
        ));
        let json = serde_json::to_string(&headroom_pipeline::finetune::as_trained(experiment))?;
        std::fs::write(&path, json).with_context(|| format!("writing {}", path.display()))?;
        Ok(Self { path })
    }
}

impl Drop for TorchConfig {
    fn drop(&mut self) {
        // A leftover temporary file is harmless; nothing to report.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A ratio between two different models would be meaningless: the counts
/// of parameters, all and trainable, must agree.
fn same_model(headroom: &StepBench, torch: &TorchStep) -> Result<()> {
    let ours = (headroom.parameters, headroom.trainable_parameters);
    let theirs = (torch.parameters, torch.trainable_parameters);
    if ours != theirs {
        bail!(
            "--compare-torch: PyTorch's model has {} parameters ({} trainable), headroom's {} ({} trainable): \
             bench/torch/torch_models.py does not build this experiment's model; no ratio",
            theirs.0,
            theirs.1,
            ours.0,
            ours.1
        );
    }
    Ok(())
}

fn torch_step(args: &BenchArgs, config: &TorchConfig, batch: usize) -> Result<Option<TorchStep>> {
    let script = Path::new("bench/torch/torch_step.py");
    let probe = Command::new("python3")
        .args(["-c", "import torch"])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        tracing::warn!("--compare-torch: `import torch` fails in python3; install it with `pip install torch numpy`");
        return Ok(None);
    }
    let mut command = Command::new("python3");
    command.arg(script).arg("--config-json").arg(&config.path);
    if args.avx2_only {
        hold_torch_to_avx2(&mut command);
    }
    if args.gpu {
        command.args([
            "--device",
            "cuda",
            "--compile-mode",
            args.torch_compile_mode,
        ]);
    } else {
        command.args(["--threads", &args.threads.to_string()]);
    }
    let output = command
        .args(["--batch", &batch.to_string()])
        .args(["--warmup", &args.warmup.to_string()])
        .args(["--steps", &args.steps.to_string()])
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !output.status.success() {
        bail!(
            "{} failed: {}",
            script.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let line = String::from_utf8_lossy(&output.stdout);
    let last = line.lines().last().unwrap_or_default();
    Ok(Some(serde_json::from_str(last).with_context(|| {
        format!("{} printed {line}", script.display())
    })?))
}

/// ATen's vectorised kernels, oneDNN's convolutions and MKL's matrix
/// products, all held to AVX2 (`--avx2-only`).
pub fn hold_torch_to_avx2(command: &mut Command) {
    command.env("ATEN_CPU_CAPABILITY", "avx2");
    command.env("ONEDNN_MAX_CPU_ISA", "AVX2");
    command.env("MKL_ENABLE_INSTRUCTIONS", "AVX2");
}

fn mib(bytes: Option<u64>) -> String {
    bytes.map_or("?".into(), |b| {
        format!("{:.0} MiB", b as f64 / (1 << 20) as f64)
    })
}

fn print_table(report: &Report) {
    if let Some(first) = report.rows.first().filter(|r| r.headroom.device != "cpu") {
        return print_gpu_table(report, &first.headroom.device);
    }
    let algorithm = report
        .rows
        .first()
        .map_or("?", |r| r.headroom.conv_algorithm.as_str());
    let isa = if report.avx2_only {
        "; both sides held to AVX2+FMA"
    } else {
        ""
    };
    println!(
        "training step, {}, {} threads; machine peak {:.0} GFLOP/s (measured FMA loop); \
         convolutions: {algorithm}{isa}",
        report.experiment, report.threads, report.machine_peak_gflops
    );
    println!(
        "{:>6} | {:>12} {:>9} {:>10} {:>7} | {:>12} {:>9} {:>10} | {:>6}",
        "batch",
        "samples/s",
        "step ms",
        "peak RSS",
        "% peak",
        "torch s/s",
        "step ms",
        "peak RSS",
        "ratio"
    );
    for row in &report.rows {
        let h = &row.headroom;
        let (t_rate, t_ms, t_rss) = match &row.pytorch {
            Some(t) => (
                format!("{:.0}", t.samples_per_sec),
                format!("{:.1}", t.step_ms),
                mib(Some(t.peak_rss_bytes)),
            ),
            None => ("-".into(), "-".into(), "-".into()),
        };
        println!(
            "{:>6} | {:>12.0} {:>9.1} {:>10} {:>6.1}% | {:>12} {:>9} {:>10} | {:>6}",
            h.batch,
            h.samples_per_sec,
            h.step_ms,
            mib(h.peak_rss_bytes),
            row.share_of_peak * 100.0,
            t_rate,
            t_ms,
            t_rss,
            row.ratio.map_or("-".into(), |r| format!("{r:.2}"))
        );
    }
    println!(
        "% peak: the step's rate in direct-convolution-equivalent FLOP/s (every layer's direct \
         arithmetic, backward counted as twice the forward, also where it is less: the first \
         trainable layer makes no input gradient, a frozen one no weight gradient) over the peak; \
         Winograd does less arithmetic, so it can pass 100%"
    );
    if let Some(t) = report.rows.iter().find_map(|r| r.pytorch.as_ref()) {
        println!(
            "PyTorch {} (channels_last, same model, batch and threads)",
            t.version
        );
    }
    if let Some(l) = &report.loader {
        println!(
            "loader alone: {:.0} augmented samples/s (batch {}, {} workers)",
            l.samples_per_sec, l.batch, l.workers
        );
    }
    print_profiles(report);
    print_tunings(report);
}

/// On a GPU the share of the CPU's FMA peak means nothing; peak device
/// memory does: "ratio" is samples/s over PyTorch's (≥ 1 is faster),
/// "mem ratio" peak memory over PyTorch's (≤ 1 is smaller).
fn print_gpu_table(report: &Report, device: &str) {
    println!("training step, {}, on {device}", report.experiment);
    println!(
        "{:>6} | {:>12} {:>9} {:>11} | {:>12} {:>9} {:>11} | {:>6} {:>9}",
        "batch",
        "samples/s",
        "step ms",
        "peak mem",
        "torch s/s",
        "step ms",
        "peak mem",
        "ratio",
        "mem ratio"
    );
    for row in &report.rows {
        let h = &row.headroom;
        let (t_rate, t_ms, t_mem) = match &row.pytorch {
            Some(t) => (
                format!("{:.0}", t.samples_per_sec),
                format!("{:.2}", t.step_ms),
                mib(t.peak_device_bytes),
            ),
            None => ("-".into(), "-".into(), "-".into()),
        };
        let mem_ratio = row
            .pytorch
            .as_ref()
            .and_then(|t| t.peak_device_bytes)
            .filter(|&torch| torch > 0)
            .map_or("-".into(), |torch| {
                format!("{:.2}", h.peak_tensor_bytes as f64 / torch as f64)
            });
        println!(
            "{:>6} | {:>12.0} {:>9.2} {:>11} | {:>12} {:>9} {:>11} | {:>6} {:>9}",
            h.batch,
            h.samples_per_sec,
            h.step_ms,
            mib(Some(h.peak_tensor_bytes)),
            t_rate,
            t_ms,
            t_mem,
            row.ratio.map_or("-".into(), |r| format!("{r:.2}")),
            mem_ratio
        );
    }
    if let Some(t) = report.rows.iter().find_map(|r| r.pytorch.as_ref()) {
        println!(
            "PyTorch {} on {} (AMP with GradScaler, channels_last, fused AdamW, torch.compile mode {}; same model and batch)",
            t.version,
            t.device.as_deref().unwrap_or("?"),
            t.compile_mode.as_deref().unwrap_or("off")
        );
        if t.compile_mode.as_deref().is_some_and(|m| m != "default") {
            println!("PyTorch's peak memory in that mode covers its warm-up, when its CUDA graphs were recorded");
        }
    }
    print_profiles(report);
    print_tunings(report);
}

/// Every profiled row's segments (`--profile`).
fn print_profiles(report: &Report) {
    for row in report
        .rows
        .iter()
        .filter(|r| !r.headroom.profile.is_empty())
    {
        print_profile(&row.headroom);
    }
}

/// What `device.conv_algorithm = "tune"` chose in each row that tuned.
fn print_tunings(report: &Report) {
    for row in report
        .rows
        .iter()
        .filter(|r| !r.headroom.tuned_convs.is_empty())
    {
        println!(
            "\nconvolutions tuned at batch {} (device.conv_algorithm = \"tune\"), GPU ms, the faster of two timed runs each way:",
            row.headroom.batch
        );
        for t in &row.headroom.tuned_convs {
            println!("{}", tuning_line(t));
        }
    }
}

fn tuning_line(t: &TunedConv) -> String {
    let s = &t.shape;
    let kept = match t.path {
        ConvPath::Implicit => "implicit",
        ConvPath::Im2col => "im2col",
    };
    format!(
        "  {k}x{k}/{stride} {cin:>4} -> {cout:<4} in {h}x{w} {product:<11} implicit {implicit:>8.3}  im2col {im2col:>8.3}  -> {kept}",
        k = s.k,
        stride = s.stride,
        cin = s.cin,
        cout = s.cout,
        h = s.h,
        w = s.w,
        product = format!("{:?}", t.product),
        implicit = t.implicit_ms,
        im2col = t.im2col_ms,
    )
}

/// A profiled step's segments, longest first.
fn print_profile(step: &StepBench) {
    let total: f64 = step.profile.iter().map(|p| p.ms_per_step).sum();
    let how = match step.device.as_str() {
        "cpu" => "wall time between layers",
        _ => "launched one kernel at a time, timed with CUDA events",
    };
    println!(
        "\nwhere a step of batch {} goes ({} steps, {how}; {total:.3} ms a step):",
        step.batch,
        bench::PROFILE_STEPS
    );
    let mut rows: Vec<_> = step.profile.iter().collect();
    rows.sort_by(|a, b| b.ms_per_step.total_cmp(&a.ms_per_step));
    for p in rows {
        println!(
            "{:>9.3} ms {:>5.1}%  {:>4}x  {}",
            p.ms_per_step,
            100.0 * p.ms_per_step / total.max(1e-12),
            p.per_step,
            p.label
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ours(parameters: usize, trainable_parameters: usize) -> StepBench {
        let json = serde_json::json!({
            "batch": 8, "threads": 2, "steps": 1, "samples_per_sec": 1.0, "step_ms": 1.0,
            "gflops": 1.0, "peak_rss_bytes": null, "parameters": parameters,
            "trainable_parameters": trainable_parameters, "macs_per_sample": 1,
        });
        serde_json::from_value(json).unwrap()
    }

    fn theirs(parameters: usize, trainable_parameters: usize) -> TorchStep {
        TorchStep {
            version: "2".into(),
            samples_per_sec: 1.0,
            step_ms: 1.0,
            peak_rss_bytes: 0,
            device: None,
            peak_device_bytes: None,
            parameters,
            trainable_parameters,
            compile_mode: None,
        }
    }

    #[test]
    fn a_ratio_needs_the_same_parameter_counts_on_both_sides() {
        assert!(same_model(&ours(100, 10), &theirs(100, 10)).is_ok());
        let other_model = same_model(&ours(100, 10), &theirs(104, 10)).unwrap_err();
        assert!(other_model.to_string().contains("104 parameters"));
        let other_freezing = same_model(&ours(100, 10), &theirs(100, 100)).unwrap_err();
        assert!(other_freezing.to_string().contains("(100 trainable)"));
    }
}
