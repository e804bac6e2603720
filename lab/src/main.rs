//! `cargo lab <command>`: what the developers run to measure and prove
//! headroom on machines they borrow, kept apart from the product's
//! `cargo xtask` (as llm.c keeps its `dev/`). `gpu-bundle` builds, here,
//! the directory a GPU machine without Rust runs.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

// The lab builds with cargo as xtask does: one copy of that code, shared
// by path (the lab depends on no part of xtask's crate).
#[path = "../../xtask/src/cargo.rs"]
mod cargo;
mod gpu_bundle;

#[derive(Parser)]
#[command(
    name = "cargo lab",
    about = "headroom's lab: runbooks for measuring on borrowed machines"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Build, here, the directory a GPU machine without Rust runs: stripped
    /// release binaries (xtask, the CUDA tests), the experiments, the
    /// PyTorch scripts and run.sh (tests, GPU training, OOM, resume, bench).
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
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
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
                true => gpu_bundle::dry_run(&output),
                false => Ok(()),
            }
        }
    }
}
