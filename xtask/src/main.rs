//! `cargo xtask <command>`: the front door. `train` runs an experiment.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use headroom_pipeline::{train, ExperimentConfig, Overrides, Resume, TrainOptions};
use signal_hook::consts::{SIGINT, SIGTERM};
use tracing_subscriber::EnvFilter;

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
        /// Experiment TOML file.
        #[arg(long, default_value = DEFAULT_EXPERIMENT)]
        config: PathBuf,
        /// Continue from the newest valid checkpoint in run.output_dir, or
        /// from the checkpoint file given.
        #[arg(long, value_name = "CHECKPOINT", num_args = 0..=1, default_missing_value = "")]
        resume: Option<String>,
        /// Override a config key, e.g. --set train.epochs=1 (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        overrides: Vec<String>,
        /// Never install the dataset package, even as root.
        #[arg(long)]
        no_install: bool,
    },
}

fn main() {
    keep_freed_memory();
    init_logging();
    if let Err(error) = run(Cli::parse()) {
        // One clear message, with its causes, and a failing exit status.
        eprintln!("error: {error:#}");
        std::process::exit(1);
    }
}

/// Until the caching memory pool lands, glibc would hand every freed
/// activation (up to 13 MB each) back to the OS and page-fault it in again on
/// the next step: measured at 9x the cost of a ReLU forward+backward. Keeping
/// freed memory in the process costs no more than the step's own peak.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tunables; it is called before any
    // other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
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

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train {
            config,
            resume,
            overrides,
            no_install,
        } => {
            let overrides = Overrides::parse(&overrides)?;
            let experiment = ExperimentConfig::load(&config, &overrides)?;
            tracing::info!(
                "experiment {} from {}",
                experiment.run.name,
                config.display()
            );
            let options = TrainOptions {
                resume: match resume {
                    None => Resume::No,
                    Some(path) if path.is_empty() => Resume::Latest,
                    Some(path) => Resume::From(PathBuf::from(path)),
                },
                allow_install: !no_install,
                stop: Some(stop_on_signals()?),
            };
            let summary = train(&experiment, &options)
                .with_context(|| format!("training {} failed", experiment.run.name))?;
            print_summary(&experiment, &summary);
            if summary.interrupted {
                println!(
                    "stopped at epoch {} step {}; continue with: cargo xtask train --config {} --resume",
                    summary.epoch + 1,
                    summary.step,
                    config.display()
                );
            }
            Ok(())
        }
    }
}

/// The first SIGINT or SIGTERM sets the flag: the run finishes its step,
/// writes a checkpoint and exits cleanly. A second one exits at once.
fn stop_on_signals() -> Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [SIGINT, SIGTERM] {
        signal_hook::flag::register_conditional_shutdown(signal, 130, Arc::clone(&stop))
            .context("installing the signal handler")?;
        signal_hook::flag::register(signal, Arc::clone(&stop))
            .context("installing the signal handler")?;
    }
    Ok(stop)
}

fn print_summary(experiment: &ExperimentConfig, summary: &headroom_pipeline::RunSummary) {
    let rss = summary
        .peak_rss_bytes
        .map(|b| format!("{:.0} MiB", b as f64 / (1024.0 * 1024.0)))
        .unwrap_or_else(|| "unknown".into());
    println!();
    println!("== {} ==", experiment.run.name);
    match (summary.test_accuracy, summary.test_loss) {
        (Some(accuracy), Some(loss)) => {
            println!("test accuracy   {:.2}%", accuracy * 100.0);
            println!("test loss       {loss:.4}");
        }
        _ => println!("test accuracy   (not evaluated: stopped mid-epoch)"),
    }
    println!("epochs run      {}", summary.epochs.len());
    println!("wall time       {:.1} s", summary.wall_seconds);
    println!(
        "train speed     {:.0} samples/s ({} threads)",
        summary.train_samples_per_sec, summary.threads
    );
    println!("peak RSS        {rss}");
    if let Some(path) = &summary.resumed_from {
        println!("resumed from    {}", path.display());
    }
    if let Some(path) = &summary.last_checkpoint {
        println!("checkpoint      {}", path.display());
    }
}
