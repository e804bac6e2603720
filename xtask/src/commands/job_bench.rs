//! `cargo xtask bench-job`: the whole job, from the start of the process to
//! its summary, as `cargo xtask train` runs it (start-up, data, training,
//! every epoch's evaluation, checkpoints), each run in its own process; with
//! `--compare-torch`, PyTorch's same job (bench/torch/torch_fashion_mnist.py:
//! the experiment's model and recipe, its DataLoader with the same workers,
//! the same threads) alternated with it round by round, both walls, both
//! accuracies and the ratio. The machine's load average is read before and
//! after every run: a busy machine moves a whole-job figure more than any
//! change does, and the figure is only worth as much as that is known.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use headroom_pipeline::config::DataFormat;
use headroom_pipeline::{data, ExperimentConfig, Overrides};
use serde::{Deserialize, Serialize};

use super::bench::{avx2_gemm_binary, hold_torch_to_avx2};
use crate::BenchJobCommand;

/// The PyTorch job this command runs.
const TORCH_JOB: &str = "bench/torch/torch_fashion_mnist.py";

pub fn run(args: BenchJobCommand) -> Result<()> {
    let BenchJobCommand {
        config,
        mut overrides,
        threads,
        workers,
        rounds,
        compare_torch,
        avx2_only,
        output_dir,
        json_out,
    } = args;
    overrides.push("device.kind=cpu".into());
    let threads =
        threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    overrides.push(format!("train.threads={threads}"));
    if let Some(n) = workers {
        overrides.push(format!("data.workers={n}"));
    }
    let experiment = super::load_experiment(&config, &Overrides::parse(&overrides)?)?;
    let workers = experiment.loader_workers();
    let data_dir = match (compare_torch, &experiment.data.format) {
        (false, _) => None,
        (true, DataFormat::Idx) => Some(data::locate_fashion_mnist(
            experiment.data.dir.as_deref(),
            false,
        )?),
        (true, other) => bail!(
            "--compare-torch: {TORCH_JOB} reads Fashion-MNIST's IDX files only; this experiment has data.format = {other:?}"
        ),
    };
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let base = output_dir.join(format!("{stamp}-{}", std::process::id()));
    std::fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
    let torch_config = match compare_torch {
        true => Some(write_torch_config(&experiment, &base)?),
        false => None,
    };
    let job = Job {
        config: &config,
        overrides: &overrides,
        threads,
        workers,
        avx2_only,
        base: &base,
    };
    eprintln!(
        "bench-job: {} on {}, {threads} threads, {workers} loader workers{}; runs and logs in {}",
        experiment.run.name,
        cpu_model(),
        if avx2_only {
            ", both sides held to AVX2+FMA"
        } else {
            ""
        },
        base.display()
    );
    let mut runs = Vec::new();
    for round in 1..=rounds {
        // Alternated: whoever went first in one round goes second in the
        // next, so that a machine that slows down over time weighs on both.
        let torch_first = round % 2 == 0;
        let mut sides: Vec<Side> = vec![Side::Headroom];
        if compare_torch {
            match torch_first {
                true => sides.insert(0, Side::Torch),
                false => sides.push(Side::Torch),
            }
        }
        for side in sides {
            let run = match (side, &torch_config, &data_dir) {
                (Side::Torch, Some(torch_config), Some(dir)) => {
                    job.torch(round, torch_config, dir)?
                }
                _ => job.headroom(round)?,
            };
            eprintln!("{}", run_line(&run));
            runs.push(run);
        }
    }
    let report = Report {
        experiment: experiment.run.name.clone(),
        cpu: cpu_model(),
        threads,
        workers,
        avx2_only,
        epochs: experiment.train.epochs,
        ratio: ratio(&runs),
        runs,
    };
    if let Some(path) = &json_out {
        std::fs::write(
            path,
            format!("{}\n", serde_json::to_string_pretty(&report)?),
        )
        .with_context(|| format!("writing {}", path.display()))?;
    }
    print_report(&report);
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Side {
    Headroom,
    Torch,
}

/// One whole job, timed from outside: `wall_seconds` from the process's
/// start to its exit, `own_wall_seconds` what the job itself reports.
#[derive(Debug, Serialize)]
struct JobRun {
    side: Side,
    round: usize,
    wall_seconds: f64,
    own_wall_seconds: Option<f64>,
    test_accuracy: Option<f64>,
    train_samples_per_sec: Option<f64>,
    /// The 1-minute load average before and after the run.
    load_before: Option<f64>,
    load_after: Option<f64>,
    /// The run's directory (headroom) and its log.
    run_dir: Option<PathBuf>,
    log: PathBuf,
    version: Option<String>,
}

#[derive(Debug, Serialize)]
struct Report {
    experiment: String,
    cpu: String,
    threads: usize,
    workers: usize,
    avx2_only: bool,
    epochs: u64,
    /// PyTorch's median wall over headroom's (≥ 1: headroom is faster).
    ratio: Option<f64>,
    runs: Vec<JobRun>,
}

struct Job<'a> {
    config: &'a Path,
    overrides: &'a [String],
    threads: usize,
    workers: usize,
    avx2_only: bool,
    base: &'a Path,
}

impl Job<'_> {
    fn headroom(&self, round: usize) -> Result<JobRun> {
        let exe = match self.avx2_only && cfg!(feature = "avx512-gemm") {
            true => avx2_gemm_binary()?,
            false => std::env::current_exe().context("locating the xtask binary")?,
        };
        let run_dir = self.base.join(format!("headroom-{round}"));
        let log = self.base.join(format!("headroom-{round}.log"));
        let mut command = Command::new(exe);
        command
            .arg("train")
            .arg("--no-install")
            .arg("--config")
            .arg(self.config);
        for pair in self.overrides {
            command.args(["--set", pair]);
        }
        command.arg("--set").arg(format!(
            "run.output_dir={}",
            run_dir
                .to_str()
                .context("the run directory's path is not UTF-8")?
        ));
        if self.avx2_only {
            command.env("HEADROOM_CPU_KERNELS", "avx2");
        }
        let (stdout, timed) = timed_run(command, &log)?;
        Ok(JobRun {
            side: Side::Headroom,
            round,
            wall_seconds: timed.seconds,
            own_wall_seconds: summary_figure(&stdout, "wall time", " s"),
            test_accuracy: summary_figure(&stdout, "test accuracy", "%").map(|p| p / 100.0),
            train_samples_per_sec: summary_figure(&stdout, "train speed", " samples/s"),
            load_before: timed.load_before,
            load_after: timed.load_after,
            run_dir: Some(run_dir),
            log,
            version: Some(format!("headroom {}", env!("CARGO_PKG_VERSION"))),
        })
    }

    fn torch(&self, round: usize, config: &Path, data_dir: &Path) -> Result<JobRun> {
        let python = std::env::var_os("PYTHON").unwrap_or_else(|| "python3".into());
        let probe = Command::new(&python)
            .args(["-c", "import torch, numpy"])
            .output();
        if !probe.is_ok_and(|o| o.status.success()) {
            bail!(
                "--compare-torch: `import torch, numpy` fails in {}: install them (`pip install torch numpy`) or put a Python that has them first on PATH (or in $PYTHON)",
                Path::new(&python).display()
            );
        }
        let log = self.base.join(format!("torch-{round}.log"));
        let mut command = Command::new(&python);
        command
            .arg(TORCH_JOB)
            .args(["--device", "cpu"])
            .args(["--threads", &self.threads.to_string()])
            .args(["--workers", &self.workers.to_string()])
            .arg("--config-json")
            .arg(config)
            .arg("--data")
            .arg(data_dir);
        if self.avx2_only {
            hold_torch_to_avx2(&mut command);
        }
        let (stdout, timed) = timed_run(command, &log)?;
        let last = stdout.lines().last().unwrap_or_default();
        let report: TorchJob =
            serde_json::from_str(last).with_context(|| format!("{TORCH_JOB} printed {stdout}"))?;
        Ok(JobRun {
            side: Side::Torch,
            round,
            wall_seconds: timed.seconds,
            own_wall_seconds: Some(report.wall_seconds),
            test_accuracy: report.test_accuracy,
            train_samples_per_sec: Some(report.train_samples_per_sec),
            load_before: timed.load_before,
            load_after: timed.load_after,
            run_dir: None,
            log,
            version: Some(format!("PyTorch {}", report.version)),
        })
    }
}

/// What bench/torch/torch_fashion_mnist.py prints last.
#[derive(Debug, Deserialize)]
struct TorchJob {
    version: String,
    wall_seconds: f64,
    train_samples_per_sec: f64,
    test_accuracy: Option<f64>,
}

struct Timed {
    seconds: f64,
    load_before: Option<f64>,
    load_after: Option<f64>,
}

/// Runs a job to its end, its standard error to `log`; its standard output
/// is returned (and copied to the log as well).
fn timed_run(mut command: Command, log: &Path) -> Result<(String, Timed)> {
    let file = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let load_before = load_average();
    let started = Instant::now();
    let output = command
        .stdin(Stdio::null())
        .stderr(file)
        .output()
        .with_context(|| format!("starting {:?}", command.get_program()))?;
    let seconds = started.elapsed().as_secs_f64();
    let load_after = load_average();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(log)
            .with_context(|| format!("opening {}", log.display()))?;
        file.write_all(stdout.as_bytes())
            .with_context(|| format!("writing {}", log.display()))?;
    }
    if !output.status.success() {
        bail!(
            "{:?} failed ({}); its log: {}",
            command.get_program(),
            output.status,
            log.display()
        );
    }
    Ok((
        stdout,
        Timed {
            seconds,
            load_before,
            load_after,
        },
    ))
}

/// A figure of `train`'s summary: the number after `label` and before
/// `unit` on the line that starts with `label`.
fn summary_figure(stdout: &str, label: &str, unit: &str) -> Option<f64> {
    let line = stdout.lines().rev().find(|l| l.starts_with(label))?;
    let rest = line[label.len()..].trim_start();
    rest.split(unit).next()?.trim().parse().ok()
}

/// The resolved experiment for the PyTorch job (model and recipe).
fn write_torch_config(experiment: &ExperimentConfig, dir: &Path) -> Result<PathBuf> {
    let path = dir.join("torch-job.json");
    let json = serde_json::to_string(&headroom_pipeline::finetune::as_trained(experiment))?;
    std::fs::write(&path, json).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// The 1-minute load average (Linux), to print beside each figure.
fn load_average() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    text.split_whitespace().next()?.parse().ok()
}

/// `lscpu`'s model name, from /proc/cpuinfo.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "an unknown CPU".into())
}

fn median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(values[n / 2]),
        _ => Some((values[n / 2 - 1] + values[n / 2]) / 2.0),
    }
}

fn side_median(runs: &[JobRun], side: Side) -> Option<f64> {
    median(
        runs.iter()
            .filter(|r| r.side == side)
            .map(|r| r.wall_seconds)
            .collect(),
    )
}

fn ratio(runs: &[JobRun]) -> Option<f64> {
    Some(side_median(runs, Side::Torch)? / side_median(runs, Side::Headroom)?)
}

fn load(value: Option<f64>) -> String {
    value.map_or("?".into(), |v| format!("{v:.2}"))
}

fn run_line(run: &JobRun) -> String {
    format!(
        "{:>8} round {}: {:>7.1} s wall (its own {}), test accuracy {}, {} samples/s, load {} -> {}",
        match run.side {
            Side::Headroom => "headroom",
            Side::Torch => "pytorch",
        },
        run.round,
        run.wall_seconds,
        run.own_wall_seconds
            .map_or("?".into(), |s| format!("{s:.1} s")),
        run.test_accuracy
            .map_or("?".into(), |a| format!("{:.2}%", a * 100.0)),
        run.train_samples_per_sec
            .map_or("?".into(), |s| format!("{s:.0}")),
        load(run.load_before),
        load(run.load_after),
    )
}

fn print_report(report: &Report) {
    println!(
        "whole job, {} ({} epochs), on {}: {} threads, {} loader workers{}",
        report.experiment,
        report.epochs,
        report.cpu,
        report.threads,
        report.workers,
        if report.avx2_only {
            "; both sides held to AVX2+FMA"
        } else {
            ""
        }
    );
    for run in &report.runs {
        println!("{}", run_line(run));
    }
    if let Some(version) = report
        .runs
        .iter()
        .find(|r| r.side == Side::Torch)
        .and_then(|r| r.version.as_deref())
    {
        println!("{version}, eager, its DataLoader with the same workers");
    }
    if let (Some(h), Some(t), Some(r)) = (
        side_median(&report.runs, Side::Headroom),
        side_median(&report.runs, Side::Torch),
        report.ratio,
    ) {
        println!(
            "median wall: headroom {h:.1} s, PyTorch {t:.1} s: headroom {r:.2}× PyTorch's speed (wall from each process's start to its exit)"
        );
    }
    if let Some(dir) = report.runs.iter().find_map(|r| r.run_dir.as_ref()) {
        println!(
            "headroom's run directories and both sides' logs beside {}",
            dir.display()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_figures_are_read_from_trains_lines() {
        let stdout = "\n== fashion_mnist ==\ntest accuracy   92.98%\ntest loss       0.2764\n\
                      wall time       362.0 s\ntrain speed     915 samples/s (2 threads)\n";
        assert_eq!(summary_figure(stdout, "test accuracy", "%"), Some(92.98));
        assert_eq!(summary_figure(stdout, "wall time", " s"), Some(362.0));
        assert_eq!(
            summary_figure(stdout, "train speed", " samples/s"),
            Some(915.0)
        );
        assert_eq!(summary_figure(stdout, "peak RSS", " MiB"), None);
    }

    #[test]
    fn the_ratio_is_pytorchs_median_wall_over_headrooms() {
        let run = |side, wall_seconds| JobRun {
            side,
            round: 1,
            wall_seconds,
            own_wall_seconds: None,
            test_accuracy: None,
            train_samples_per_sec: None,
            load_before: None,
            load_after: None,
            run_dir: None,
            log: PathBuf::new(),
            version: None,
        };
        let runs = [
            run(Side::Headroom, 100.0),
            run(Side::Torch, 160.0),
            run(Side::Headroom, 140.0),
            run(Side::Torch, 140.0),
        ];
        assert_eq!(ratio(&runs), Some(150.0 / 120.0));
        assert_eq!(ratio(&runs[..1]), None);
    }
}
