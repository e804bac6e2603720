//! `cargo xtask <command>`: the front door. `train` runs an experiment.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use headroom_loader::{IdxDataset, ShardSize, Split};
use headroom_pipeline::config::TestTimeAugmentation;
use headroom_pipeline::{rundir, train, ExperimentConfig, Overrides, Resume, TrainOptions};
use tracing_subscriber::EnvFilter;

mod bench;
mod doctor;
mod gpu_bundle;
mod loader_bench;
mod memcheck;
mod signals;

const DEFAULT_EXPERIMENT: &str = "experiments/fashion_mnist.toml";

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "headroom: train neural networks within the memory you have"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train an experiment (default: the Fashion-MNIST ResNet on the CPU).
    Train {
        /// Experiment TOML file; repeat to run several in sequence
        /// [default: experiments/fashion_mnist.toml; with --resume RUN_DIR,
        /// the run's own config.toml].
        #[arg(long)]
        config: Vec<PathBuf>,
        /// Profile overlay beside the experiment: low_memory, max_speed, cpu, none
        /// (default: auto, which picks low_memory below 4 GiB). Same as --set run.profile=NAME.
        #[arg(long)]
        profile: Option<String>,
        /// Loader worker threads. Same as --set data.workers=N.
        #[arg(long)]
        workers: Option<usize>,
        #[command(flatten)]
        switches: Switches,
        /// Continue a run: a run directory (its own config.toml is the
        /// experiment, --set goes on top), a checkpoint file in one, or, with
        /// no value, the newest run of the experiment.
        #[arg(long, value_name = "RUN_DIR|CHECKPOINT", num_args = 0..=1, default_missing_value = "")]
        resume: Option<String>,
        /// Override a config key, e.g. --set train.epochs=1 (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        overrides: Vec<String>,
        /// Never install the dataset package, even as root.
        #[arg(long)]
        no_install: bool,
    },
    /// Time the training step (and the loader); optionally beside PyTorch.
    Bench {
        #[arg(long, default_value = DEFAULT_EXPERIMENT)]
        config: PathBuf,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        overrides: Vec<String>,
        /// Batch sizes to time [default: 32,128,256 on the CPU, 128,512 on a GPU].
        #[arg(long, value_delimiter = ',', value_parser = at_least_one())]
        batch: Vec<usize>,
        /// Where the step runs: cpu or cuda (the GPU; PyTorch then runs with
        /// AMP, channels_last, fused AdamW and torch.compile).
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Compute threads (default: every core).
        #[arg(long, value_parser = at_least_one())]
        threads: Option<usize>,
        #[arg(long, default_value_t = 3)]
        warmup: usize,
        #[arg(long, default_value_t = 20, value_parser = at_least_one())]
        steps: usize,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Also write the JSON report to this file (the table is still printed).
        #[arg(long, value_name = "PATH")]
        json_out: Option<PathBuf>,
        /// GPU: after the timed steps, time 10 more segment by segment (each
        /// layer's forward and backward, the loss, the optimizer; launched
        /// one kernel at a time) and print where the time goes.
        #[arg(long)]
        profile: bool,
        /// Also run the PyTorch equivalent (same model, batch, threads) and print the ratio.
        #[arg(long)]
        compare_torch: bool,
        /// With --device cuda --compare-torch: torch.compile's mode for
        /// PyTorch's step (`reduce-overhead` replays CUDA graphs, as
        /// headroom's step does).
        #[arg(long, default_value = "default", value_parser = ["default", "reduce-overhead", "max-autotune"])]
        torch_compile_mode: String,
        /// Time the loader alone: shards with cache 1 and 2, full load, and IDX in memory.
        #[arg(long)]
        loader: bool,
        /// Hold headroom and PyTorch to AVX2+FMA (and the peak to the AVX2
        /// FMA loop): an AVX2-only machine's comparison on an AVX-512 one.
        #[arg(long)]
        avx2_only: bool,
    },
    /// One loader configuration as a JSON line (used by `bench --loader`).
    #[command(hide = true)]
    BenchLoaderOne {
        #[arg(long)]
        config: PathBuf,
        #[arg(long)]
        store: PathBuf,
        #[arg(long)]
        mode: String,
    },
    /// Pack a Fashion-MNIST directory into a shard store (train/ and test/),
    /// or, with --config, a text experiment's corpus into its window store.
    Preprocess {
        /// Directory with the IDX files (default: where `train` would look).
        #[arg(long)]
        input: Option<PathBuf>,
        /// The store to write (Fashion-MNIST; required without --config).
        #[arg(long, required_unless_present = "config")]
        output: Option<PathBuf>,
        /// A text experiment (data.format = "text"): pack its `[text]` corpus
        /// where `train` will read it (data.dir), installing the package if
        /// missing and allowed.
        #[arg(long, conflicts_with_all = ["input", "output"])]
        config: Option<PathBuf>,
        /// --set key=value overrides of the text experiment.
        #[arg(long = "set", requires = "config")]
        overrides: Vec<String>,
        /// With --config: never install the corpus package.
        #[arg(long)]
        no_install: bool,
        /// Samples per shard ("4096") or bytes per shard ("64MiB").
        #[arg(long, default_value = "4096")]
        shard_size: String,
        /// Replace an existing store (atomically).
        #[arg(long)]
        overwrite: bool,
    },
    /// Test accuracy, loss and confusion matrix of a checkpoint (a token
    /// model: validation loss and bits per byte).
    Eval {
        #[arg(long)]
        checkpoint: PathBuf,
        /// Dataset directory, if not the one the run used.
        #[arg(long)]
        data_dir: Option<PathBuf>,
        #[arg(long, default_value_t = 256)]
        batch: usize,
        /// Test-time augmentation: "none" or "flip" (default: the run's
        /// eval.tta).
        #[arg(long)]
        tta: Option<String>,
    },
    /// Write a checkpoint's weights for other tools (safetensors: names as in
    /// the model spec, layouts in the file's metadata).
    Export {
        #[arg(long)]
        checkpoint: PathBuf,
        /// Only "safetensors" for now.
        #[arg(long, default_value = "safetensors")]
        format: String,
        /// Default: the checkpoint's path with the extension .safetensors.
        #[arg(long)]
        output: Option<PathBuf>,
    },
    /// Fold LoRA adapters (a run's adapters.safetensors) into their base
    /// weights: the base architecture's tensors as safetensors, named as
    /// `export` names them.
    LoraMerge {
        #[arg(long)]
        adapters: PathBuf,
        /// Base checkpoint or run directory [default: the one the adapters
        /// file records].
        #[arg(long)]
        base: Option<PathBuf>,
        /// Default: merged.safetensors beside the adapters.
        #[arg(long)]
        output: Option<PathBuf>,
    },
    /// What this machine has and what headroom will do on it.
    Doctor,
    /// Every GPU check: driver, GPU, NVRTC and cuBLAS report, kernels compiled for
    /// this GPU, and the CUDA parity tests with skipping turned into failure.
    GpuCheck,
    /// Build, here, the directory a GPU machine without Rust runs: stripped
    /// release binaries (xtask, the CUDA tests), the experiments, the
    /// PyTorch script and run.sh (tests, GPU training, OOM, resume, bench).
    GpuBundle {
        #[arg(long, default_value = "target/gpu-bundle")]
        output: PathBuf,
        /// Also copy the four Fashion-MNIST files (about 30 MB) into data/.
        #[arg(long)]
        with_data: bool,
        /// An earlier bundle's bin/xtask.gz, carried as bin/baseline-xtask.gz:
        /// run.sh's bench-baseline step then times that build's step beside
        /// this one's on the same GPU (an A/B).
        #[arg(long, conflicts_with = "baseline_rev")]
        baseline: Option<PathBuf>,
        /// The same, built here from a git revision of this repository
        /// (a worktree in target/baseline-src; a release build, minutes).
        #[arg(long)]
        baseline_rev: Option<String>,
        /// Then run the bundle's run.sh here, on the CPU emulator of the
        /// driver, with every job shrunk: checks the script, not the GPU.
        #[arg(long)]
        dry_run: bool,
    },
    /// Run every CUDA parity test on the CPU emulator under valgrind's
    /// memcheck (after a control it must fault): finds kernels that read
    /// locals they never wrote. Logs in target/memcheck.
    Memcheck {
        /// Only the tests whose name contains this.
        filter: Option<String>,
        /// Also the learner's and the training runs' CUDA tests
        /// (cuda_learner, cuda_training): about three times as long.
        #[arg(long)]
        all: bool,
    },
    /// One timed configuration as a JSON line (used by `bench`).
    #[command(hide = true)]
    BenchStep {
        #[arg(long)]
        config: PathBuf,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        overrides: Vec<String>,
        #[arg(long, value_parser = at_least_one())]
        batch: usize,
        #[arg(long, value_parser = at_least_one())]
        threads: usize,
        #[arg(long)]
        warmup: usize,
        #[arg(long, value_parser = at_least_one())]
        steps: usize,
        #[arg(long)]
        profile: bool,
    },
}

fn main() -> ExitCode {
    keep_freed_memory();
    init_logging();
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(error) => {
            // One clear message, with its causes, and a failing exit status.
            eprintln!("error: {}", error_chain(&error));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes, each said once: a cause whose text the message
/// already holds (an error that prints its source) is not repeated.
fn error_chain(error: &anyhow::Error) -> String {
    let mut message = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        if message.contains(&text) {
            continue;
        }
        if !message.is_empty() {
            message.push_str(": ");
        }
        message.push_str(&text);
    }
    message
}

/// Keeps freed memory in the process (glibc would hand every freed
/// activation, up to 13 MB each, back to the OS and fault it in again on
/// the next step: measured at 9x the cost of a ReLU forward+backward).
/// Under an address-space limit (RLIMIT_AS), also keeps glibc to one malloc
/// arena: each extra arena reserves 64 MiB of address space per thread that
/// allocates, which alone would exhaust a few hundred MiB of limit and make
/// thread creation fail.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tunables and getrlimit only
    // writes the struct we pass; both run before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_AS, &mut limit) == 0
            && limit.rlim_cur != libc::RLIM_INFINITY
        {
            libc::mallopt(libc::M_ARENA_MAX, 1);
        }
    }
}

fn init_logging() {
    let filter = EnvFilter::try_from_env("HEADROOM_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .with_timer(tracing_subscriber::fmt::time::uptime())
        .init();
}

/// What to train: the experiment, where it came from, and how to start.
struct Planned {
    experiment: ExperimentConfig,
    source: PathBuf,
    resume: Resume,
}

fn or_default(configs: Vec<PathBuf>) -> Vec<PathBuf> {
    if configs.is_empty() {
        vec![PathBuf::from(DEFAULT_EXPERIMENT)]
    } else {
        configs
    }
}

fn fresh_experiments(
    configs: &[PathBuf],
    overrides: &Overrides,
    resume: Resume,
) -> Result<Vec<Planned>> {
    configs
        .iter()
        .map(|path| {
            Ok(Planned {
                experiment: ExperimentConfig::load(path, overrides)?,
                source: path.clone(),
                resume: resume.clone(),
            })
        })
        .collect()
}

/// `--resume RUN_DIR` or `--resume RUN_DIR/checkpoint-....ckpt`: the run's
/// own resolved config.toml is the experiment, so nothing has to be retyped
/// and nothing else can be resumed by mistake; `--set` goes on top (and
/// resume refuses, naming the key, what would change the result).
fn resumed_experiment(path: &Path, configs: &[PathBuf], overrides: &Overrides) -> Result<Planned> {
    if !path.exists() {
        bail!(
            "--resume {}: no such run directory or checkpoint",
            path.display()
        );
    }
    let (dir, resume) = if path.is_dir() {
        (path.to_path_buf(), Resume::Latest)
    } else {
        let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        (dir, Resume::From(path.to_path_buf()))
    };
    let recorded = dir.join(rundir::CONFIG_FILE);
    if configs.is_empty() && !recorded.is_file() {
        refuse_unknown_directory(&dir)?;
    }
    let (experiment, source) = match configs {
        [] if recorded.is_file() => {
            let mut experiment = ExperimentConfig::load_resolved(&recorded, overrides)?;
            experiment.run.output_dir = Some(dir);
            (experiment, recorded)
        }
        // An explicit experiment is checked against the checkpoint (and
        // refused, naming the key, if it would change the result).
        [] | [_] => {
            let config = configs
                .first()
                .cloned()
                .unwrap_or_else(|| PathBuf::from(DEFAULT_EXPERIMENT));
            let mut experiment = ExperimentConfig::load(&config, overrides)?;
            experiment.run.output_dir.get_or_insert(dir);
            (experiment, config)
        }
        _ => bail!(
            "--resume {} continues one run: give at most one --config",
            path.display()
        ),
    };
    Ok(Planned {
        experiment,
        source,
        resume,
    })
}

/// `--resume DIR` without `--config`, where DIR has no `config.toml`: a
/// directory with checkpoints (from before runs recorded their config) is
/// resumed with the default experiment, checked against them; one without
/// is not a run at all (`--resume runs`, a typo), and training the default
/// experiment into it would be a surprise, not a resume.
fn refuse_unknown_directory(dir: &Path) -> Result<()> {
    if !headroom_pipeline::checkpoint::list(dir)?.is_empty() {
        return Ok(());
    }
    bail!(
        "--resume {}: not a run directory (no {} and no checkpoint-step*.ckpt in it). \
         Give a run's directory (runs/NAME-DATE), one of its checkpoints, or \
         `--config EXPERIMENT --resume` for the newest run of that experiment",
        dir.display(),
        rundir::CONFIG_FILE
    )
}

/// The switches that map to config keys become overrides; the one that
/// cannot change anything says so.
fn apply_switches(switches: &Switches, overrides: &mut Vec<String>) {
    let keys = [
        (switches.no_amp, "device.amp=false"),
        (switches.no_fusion, "device.fusion=false"),
        (switches.no_graphs, "device.graphs=false"),
    ];
    overrides.extend(
        keys.iter()
            .filter(|(on, _)| *on)
            .map(|(_, key)| key.to_string()),
    );
    if switches.no_channels_last {
        tracing::warn!(
            "--no-channels-last: headroom is channels-last (NHWC) only; there is no other layout"
        );
    }
}

/// The train switches that map to config keys.
#[derive(clap::Args, Debug)]
struct Switches {
    /// f32 instead of mixed precision on the GPU (f32 activations and
    /// weights, no loss scaling). Same as --set device.amp=false; the CPU
    /// trains in f32 either way.
    #[arg(long)]
    no_amp: bool,
    /// Fusion off: batch norm, ReLU and the residual add as separate
    /// passes (CPU) or kernels (GPU). Same as --set device.fusion=false.
    #[arg(long)]
    no_fusion: bool,
    /// CUDA graphs off: the GPU step launches every kernel from the host
    /// instead of replaying a captured graph. Same as --set device.graphs=false.
    #[arg(long)]
    no_graphs: bool,
    /// Channels-last off. headroom is channels-last (NHWC) only: there is no other layout to switch to.
    #[arg(long)]
    no_channels_last: bool,
}

/// Trains each experiment in turn. A run stopped by a signal ends the
/// sequence with 128 + the signal's number (130 for SIGINT, 143 for
/// SIGTERM), after printing the command that continues it.
fn train_in_sequence(planned: Vec<Planned>, allow_install: bool) -> Result<ExitCode> {
    let stop = signals::StopOnSignals::install()?;
    let count = planned.len();
    for (i, plan) in planned.into_iter().enumerate() {
        let experiment = &plan.experiment;
        tracing::info!(
            "experiment {} from {} ({} of {count})",
            experiment.run.name,
            plan.source.display(),
            i + 1,
        );
        let options = TrainOptions {
            resume: plan.resume.clone(),
            allow_install,
            stop: Some(stop.flag()),
        };
        if !train_missing_base(experiment, &options)? {
            println!("stopped while training the base; run the same command again to continue");
            return Ok(stop.exit_code());
        }
        let summary = train(experiment, &options)
            .with_context(|| format!("training {} failed", experiment.run.name))?;
        print_summary(experiment, &summary);
        if experiment.data.format == "text" && !summary.interrupted {
            let report = headroom_pipeline::text::write_report(experiment, &summary)
                .with_context(|| format!("writing the text report of {}", experiment.run.name))?;
            print_text_report(&report);
        }
        if experiment.finetune.is_some() && !summary.interrupted {
            let report = headroom_pipeline::finetune::write_report(experiment, &summary)
                .with_context(|| {
                    format!("writing the fine-tuning report of {}", experiment.run.name)
                })?;
            print_finetune_report(&report);
        }
        if summary.memory_left_after_run != 0 {
            bail!(
                "{} bytes of tensor memory were still held after {} ended",
                summary.memory_left_after_run,
                experiment.run.name
            );
        }
        if summary.interrupted {
            let dir = summary
                .last_checkpoint
                .as_deref()
                .and_then(Path::parent)
                .map_or_else(
                    || experiment.output_dir().display().to_string(),
                    |d| d.display().to_string(),
                );
            println!(
                "stopped at epoch {} step {}; continue with: cargo xtask train --resume {dir}",
                summary.epoch + 1,
                summary.step,
            );
            return Ok(stop.exit_code());
        }
        if i + 1 < count {
            tracing::info!(
                "{} released all of its tensor memory (pool in use: 0 bytes)",
                experiment.run.name
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A fine-tuning experiment whose base (`finetune.base`, a run directory)
/// holds no checkpoint yet trains it first from `finetune.base_experiment`,
/// so that one command works on a fresh machine. False when a signal
/// stopped that run.
fn train_missing_base(experiment: &ExperimentConfig, options: &TrainOptions) -> Result<bool> {
    use headroom_pipeline::finetune;
    let Some(ft) = &experiment.finetune else {
        return Ok(true);
    };
    let is_file = ft.base.extension().is_some_and(|e| e == "ckpt");
    let (Some(base_experiment), false) = (&ft.base_experiment, is_file) else {
        return Ok(true);
    };
    if finetune::base_checkpoint(ft).is_ok() {
        return Ok(true);
    }
    tracing::info!(
        "finetune.base {} holds no checkpoint: training the base first from {} (finetune.base_experiment)",
        ft.base.display(),
        base_experiment.display()
    );
    let overrides = Overrides::parse(&[format!("run.output_dir={}", ft.base.display())])?;
    let base = ExperimentConfig::load(base_experiment, &overrides)?;
    let options = TrainOptions {
        resume: Resume::No,
        ..options.clone()
    };
    let summary = train(&base, &options)
        .with_context(|| format!("training the base {} failed", base.run.name))?;
    print_summary(&base, &summary);
    Ok(!summary.interrupted)
}

fn print_finetune_report(report: &headroom_pipeline::finetune::FinetuneReport) {
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let f = &report.figures;
    println!(
        "fine-tuning     {:?} from {}",
        report.train,
        report.base_checkpoint.display()
    );
    println!(
        "parameters      {} trainable of {} ({:.2}%)",
        f.trainable,
        f.parameters,
        100.0 * f.trainable as f64 / f.parameters.max(1) as f64
    );
    println!(
        "optimizer state {} bytes ({:.3} MiB)",
        f.optimizer_state_bytes,
        mib(f.optimizer_state_bytes)
    );
    println!(
        "peak memory     tensors {:.2} MiB in use ({:.2} MiB reserved), RSS {}",
        mib(report.tensor_peak_in_use_bytes),
        mib(report.tensor_peak_reserved_bytes),
        report
            .peak_rss_bytes
            .map_or("unknown".into(), |b| format!("{:.0} MiB", mib(b)))
    );
    println!(
        "bits per byte   {:.3} before (the base), {:.3} after",
        report.bits_per_byte_before, report.bits_per_byte_after
    );
    if let (Some(file), Some(bytes)) = (&report.adapters_file, report.adapters_file_bytes) {
        println!(
            "adapters        {} ({:.1} KiB)",
            file.display(),
            bytes as f64 / 1024.0
        );
        println!(
            "merge with      cargo xtask lora-merge --adapters {} --output merged.safetensors",
            file.display()
        );
    }
}

fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Train {
            config,
            profile,
            workers,
            switches,
            resume,
            mut overrides,
            no_install,
        } => {
            apply_switches(&switches, &mut overrides);
            if let Some(name) = profile {
                overrides.push(format!("run.profile={name}"));
            }
            if let Some(n) = workers {
                overrides.push(format!("data.workers={n}"));
            }
            let overrides = Overrides::parse(&overrides)?;
            let experiments = match resume.as_deref() {
                None => fresh_experiments(&or_default(config), &overrides, Resume::No)?,
                Some("") => fresh_experiments(&or_default(config), &overrides, Resume::Latest)?,
                Some(path) => vec![resumed_experiment(Path::new(path), &config, &overrides)?],
            };
            train_in_sequence(experiments, !no_install)
        }
        Command::Bench {
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
        } => {
            if !matches!(device.as_str(), "cpu" | "cuda") {
                bail!("--device: expected cpu or cuda, got {device:?}");
            }
            if torch_compile_mode != "default" && !(device == "cuda" && compare_torch) {
                bail!("--torch-compile-mode sets PyTorch's mode beside headroom on the GPU: it needs --device cuda and --compare-torch");
            }
            let mut overrides = overrides;
            overrides.push(format!("device.kind={device}"));
            let experiment = ExperimentConfig::load(&config, &Overrides::parse(&overrides)?)?;
            if loader {
                return done(loader_bench::run(&config, &experiment, json, compare_torch));
            }
            let threads = threads
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
            let batch = match (batch.is_empty(), device.as_str()) {
                (false, _) => batch,
                (true, "cuda") => vec![128, 512],
                (true, _) => vec![32, 128, 256],
            };
            let args = bench::BenchArgs {
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
            done(bench::run(&args, &experiment))
        }
        Command::BenchLoaderOne {
            config,
            store,
            mode,
        } => {
            let experiment = ExperimentConfig::load(&config, &Overrides::default())?;
            done(loader_bench::one_here(&experiment, &store, &mode))
        }
        Command::Preprocess {
            input,
            output,
            config,
            overrides,
            no_install,
            shard_size,
            overwrite,
        } => match (config, output) {
            (Some(config), _) => done(preprocess_text(&config, &overrides, !no_install)),
            (None, Some(output)) => done(preprocess(input, &output, &shard_size, overwrite)),
            (None, None) => bail!("preprocess needs --output (Fashion-MNIST) or --config (text)"),
        },
        Command::BenchStep {
            config,
            overrides,
            batch,
            threads,
            warmup,
            steps,
            profile,
        } => {
            let experiment = ExperimentConfig::load(&config, &Overrides::parse(&overrides)?)?;
            let run = bench::StepRun {
                batch,
                threads,
                warmup,
                steps,
                profile,
            };
            done(bench::step_here(&experiment, &run))
        }
        Command::Eval {
            checkpoint,
            data_dir,
            batch,
            tta,
        } => {
            let tta = tta.as_deref().map(parse_tta).transpose()?;
            let report =
                headroom_pipeline::eval::evaluate_checkpoint(&checkpoint, data_dir, batch, tta)?;
            print_eval(&report);
            Ok(ExitCode::SUCCESS)
        }
        Command::Export {
            checkpoint,
            format,
            output,
        } => {
            if format != "safetensors" {
                bail!("--format {format}: only \"safetensors\" is supported");
            }
            let exported = headroom_pipeline::export::safetensors(&checkpoint, output.as_deref())?;
            println!(
                "{} tensors of {} written to {}",
                exported.tensors,
                exported.checkpoint.display(),
                exported.output.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::LoraMerge {
            adapters,
            base,
            output,
        } => {
            let base = match base {
                Some(base) => base,
                None => headroom_pipeline::finetune::recorded_base(&adapters)?,
            };
            let output = output.unwrap_or_else(|| adapters.with_file_name("merged.safetensors"));
            let count = headroom_pipeline::finetune::merge(&base, &adapters, &output)?;
            println!(
                "{count} tensors of {} with {} merged, written to {}",
                base.display(),
                adapters.display(),
                output.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Doctor => done(doctor::run()),
        Command::GpuCheck => done(gpu_check()),
        Command::Memcheck { filter, all } => done(memcheck::run(filter.as_deref(), all)),
        Command::GpuBundle {
            output,
            with_data,
            baseline,
            baseline_rev,
            dry_run,
        } => {
            let data = match with_data {
                true => Some(headroom_pipeline::data::locate_fashion_mnist(None, false)?),
                false => None,
            };
            gpu_bundle::build(&gpu_bundle::BundleArgs {
                output: output.clone(),
                data,
                baseline: match (baseline, baseline_rev) {
                    (Some(packed), _) => Some(gpu_bundle::Baseline::Packed(packed)),
                    (None, Some(rev)) => Some(gpu_bundle::Baseline::Revision(rev)),
                    (None, None) => None,
                },
            })?;
            match dry_run {
                true => done(gpu_bundle::dry_run(&output)),
                false => done(Ok(())),
            }
        }
    }
}

/// A command that succeeded exits 0.
fn done(result: Result<()>) -> Result<ExitCode> {
    result.map(|()| ExitCode::SUCCESS)
}

fn preprocess(
    input: Option<PathBuf>,
    output: &std::path::Path,
    shard_size: &str,
    overwrite: bool,
) -> Result<()> {
    let shard_size: ShardSize = shard_size.parse().context("--shard-size")?;
    let input = headroom_pipeline::data::locate_fashion_mnist(input.as_deref(), false)?;
    for (split, name) in [(Split::Train, "train"), (Split::Test, "test")] {
        let source = IdxDataset::fashion_mnist(&input, split)?;
        let summary =
            headroom_loader::preprocess(&source, &output.join(name), shard_size, overwrite)?;
        println!("{name}: {summary}");
    }
    println!(
        "train on it with: cargo xtask train --set data.format=shards --set data.dir={}",
        output.display()
    );
    Ok(())
}

/// Packs a text experiment's corpus into the store `train` reads.
fn preprocess_text(config: &Path, overrides: &[String], allow_install: bool) -> Result<()> {
    let experiment = ExperimentConfig::load(config, &Overrides::parse(overrides)?)?;
    if experiment.data.format != "text" {
        bail!(
            "{}: data.format is \"{}\"; --config packs text experiments only",
            config.display(),
            experiment.data.format
        );
    }
    let store = headroom_pipeline::text::pack(&experiment, allow_install)?;
    println!(
        "text windows packed in {} (train/ and test/)",
        store.display()
    );
    println!(
        "train on it with: cargo xtask train --config {}",
        config.display()
    );
    Ok(())
}

fn print_text_report(report: &headroom_pipeline::text::TextReport) {
    println!(
        "validation loss {:.4} nats per byte",
        report.validation_loss
    );
    println!("bits per byte   {:.3}", report.bits_per_byte);
    println!("token accuracy  {:.2}%", report.token_accuracy * 100.0);
    println!(
        "training        {:.0} windows/s, {:.0} tokens/s",
        report.train_samples_per_sec, report.train_tokens_per_sec
    );
    println!("sample          {}", report.sample_file.display());
    println!("{}", report.sample);
}

/// Runs the CUDA checks: the report, then every CUDA test with skipping
/// turned into failure.
fn gpu_check() -> Result<()> {
    let report = headroom_model::cuda::gpu_check_report();
    println!("{report}");
    if !report.has_gpu() {
        // Every parity test would fail for want of a GPU, 40 failures that
        // say nothing the report above does not.
        bail!(
            "gpu-check needs a GPU, and this machine has none that can be used (see the report above). \
             Here, `cargo test --workspace` runs the same CUDA parity tests on the CPU emulator of the driver"
        );
    }
    let status = std::process::Command::new("cargo")
        .args(["test", "--release", "-p", "headroom-model"])
        .args([
            "--test",
            "cuda_ptx",
            "--test",
            "cuda_probe",
            "--test",
            "cuda_parity",
        ])
        .args(["--", "--nocapture"])
        .env("HEADROOM_REQUIRE_GPU", "1")
        .status()
        .context("running the CUDA tests with cargo")?;
    println!(
        "next: cargo xtask train --set device.kind=cuda, and cargo xtask bench --device cuda --compare-torch"
    );
    if !status.success() || !report.gpu_ready() {
        bail!("gpu-check failed: see the report and the test output above");
    }
    Ok(())
}

/// A count that must be 1 or more (a batch, a number of steps or threads):
/// 0 is refused by the argument parser, naming the switch.
fn at_least_one() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::new().range(1..)
}

fn parse_tta(text: &str) -> Result<TestTimeAugmentation> {
    match text {
        "none" => Ok(TestTimeAugmentation::None),
        "flip" => Ok(TestTimeAugmentation::Flip),
        other => bail!("--tta {other}: expected \"none\" or \"flip\""),
    }
}

fn print_eval(report: &headroom_pipeline::eval::EvalReport) {
    if let Some(bits) = report.bits_per_byte {
        println!(
            "{} (epoch {}, step {}): validation loss {:.4} nats per byte, {bits:.3} bits per byte, \
             token accuracy {:.2}% on {} windows",
            report.checkpoint.display(),
            report.epoch,
            report.step,
            report.loss,
            report.accuracy.unwrap_or(f32::NAN) * 100.0,
            report.samples
        );
        return;
    }
    let Some(accuracy) = report.accuracy else {
        // A frame model: a regression, scored against copying the last frame.
        println!(
            "{} (epoch {}, step {}): test loss {:.5} (per-pixel MSE), copy-last-frame baseline {:.5}, on {} sequences",
            report.checkpoint.display(),
            report.epoch,
            report.step,
            report.loss,
            report.baseline_loss.unwrap_or(f32::NAN),
            report.samples
        );
        return;
    };
    println!(
        "{} (epoch {}, step {}): test accuracy {:.2}%, loss {:.4} on {} samples",
        report.checkpoint.display(),
        report.epoch,
        report.step,
        accuracy * 100.0,
        report.loss,
        report.samples
    );
    println!("confusion matrix (rows: true class, columns: predicted)");
    let classes = report.confusion.len();
    print!("{:>6}", "");
    for k in 0..classes {
        print!("{k:>6}");
    }
    println!();
    for (truth, row) in report.confusion.iter().enumerate() {
        print!("{truth:>6}");
        for count in row {
            print!("{count:>6}");
        }
        println!();
    }
}

fn print_summary(experiment: &ExperimentConfig, summary: &headroom_pipeline::RunSummary) {
    let rss = summary
        .peak_rss_bytes
        .map(|b| format!("{:.0} MiB", b as f64 / (1024.0 * 1024.0)))
        .unwrap_or_else(|| "unknown".into());
    println!();
    println!("== {} ==", experiment.run.name);
    match (
        summary.test_accuracy,
        summary.test_loss,
        summary.test_baseline_loss,
    ) {
        (_, Some(loss), Some(baseline)) => {
            println!("test loss       {loss:.5} (per-pixel MSE of the next frame)");
            println!(
                "copy-last       {baseline:.5} (the same loss, predicting the last frame seen)"
            );
        }
        (Some(accuracy), Some(loss), None) => {
            println!("test accuracy   {:.2}%", accuracy * 100.0);
            println!("test loss       {loss:.4}");
        }
        _ => println!("test accuracy   (not evaluated: stopped mid-epoch)"),
    }
    println!("epochs run      {}", summary.epochs.len());
    println!("wall time       {:.1} s", summary.wall_seconds);
    if summary.epochs.is_empty() {
        println!("train speed     n/a (no epoch completed in this run)");
    } else {
        println!(
            "train speed     {:.0} samples/s ({} threads)",
            summary.train_samples_per_sec, summary.threads
        );
    }
    println!("peak RSS        {rss}");
    let pool = &summary.memory;
    println!(
        "tensor memory   peak {:.1} MiB in use, {:.1} MiB reserved{}; micro-batch {}{}",
        pool.peak_in_use_bytes as f64 / (1 << 20) as f64,
        pool.peak_reserved_bytes as f64 / (1 << 20) as f64,
        summary.memory_limit.map_or(String::new(), |l| format!(
            " (limit {:.1} MiB)",
            l as f64 / (1 << 20) as f64
        )),
        summary.micro_batch,
        if summary.oom_events > 0 {
            format!(", {} out-of-memory events handled", summary.oom_events)
        } else {
            String::new()
        }
    );
    if summary.cache_cleanups > 0 {
        println!(
            "cache cleanups  {} in {:.1} ms total",
            summary.cache_cleanups,
            summary.cache_cleanup_seconds * 1e3
        );
    }
    let loader = &summary.loader_memory;
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!(
        "loader memory   data/cache peak {:.1} MiB, prefetched batches peak {:.1} MiB{}",
        mib(loader.cache_peak_bytes),
        mib(loader.prefetched_bytes_max),
        loader
            .budget
            .map_or(String::new(), |b| format!(" (budget {:.1} MiB)", mib(b)))
    );
    if summary.data_on_device {
        println!("training data   held on the device; batches made there (data.on_device)");
    }
    if let Some(path) = &summary.resumed_from {
        println!("resumed from    {}", path.display());
    }
    if let Some(path) = &summary.last_checkpoint {
        println!("checkpoint      {}", path.display());
    }
}
