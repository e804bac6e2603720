//! Parts of your own, trained by headroom's [`Trainer`] exactly as
//! `cargo xtask train` trains its own: run directories and locks,
//! checkpoints, bit-exact resume, the memory budget, metrics and plots.
//!
//! - [`gated_residual`]: a layer (`y = x + σ(g) ⊙ (xW + b)`) with its
//!   hand-written backward, registered by name and used in a model spec.
//! - [`spirals`]: a dataset (points on interleaved spirals, one class per
//!   arm) generated from each sample's index, so it needs no files.
//! - [`csv_sink`]: a sink that writes `steps.csv` and `epochs.csv` and
//!   keeps them exact across a kill and a resume.
//!
//! The programs in `src/bin` train with them:
//!
//! ```sh
//! cargo run --release -p headroom-examples --bin custom_dataset -- --out runs/spirals
//! cargo run --release -p headroom-examples --bin custom_layer -- --out runs/gated
//! cargo run --release -p headroom-examples --bin custom_sink -- --out runs/csv
//! # killed? the same command with --resume goes on from the last checkpoint
//! # a TOML experiment naming the custom layer, trained as `cargo xtask
//! # train` trains one, then scored by eval and predict:
//! cargo run --release -p headroom-examples --bin toml_layer -- --out runs/toml
//! ```
//!
//! [`Trainer`]: headroom_pipeline::Trainer
//!
//! A run in a few lines (a doctest, so it stays true):
//!
//! ```
//! use headroom_examples::{example_trainer, Example};
//!
//! let dir = tempfile::tempdir().unwrap();
//! let example = Example { epochs: 1, train_samples: 512, ..Example::default() };
//! let summary = example_trainer(&example, dir.path(), "mlp", false)
//!     .unwrap()
//!     .build()
//!     .unwrap()
//!     .run()
//!     .unwrap();
//! assert_eq!(summary.epochs.len(), 1);
//! assert!(summary.test_accuracy.is_some());
//! ```

pub mod csv_sink;
pub mod gated_residual;
pub mod spirals;

use std::path::Path;
use std::sync::Arc;

use headroom_model::{LayerRegistry, ModelSpec};
use headroom_pipeline::trainer::{
    network, CheckpointSettings, DeviceKind, LoaderSettings, LoopSettings, NetworkPlan,
    ScheduleKind, ScheduleSettings, StepSettings, TrainerBuilder,
};
use headroom_pipeline::{Result, Resume};

/// The settings the example programs share (and their command lines set).
#[derive(Clone, Debug)]
pub struct Example {
    pub epochs: u64,
    pub train_samples: usize,
    pub test_samples: usize,
    pub batch_size: usize,
    pub seed: u64,
    pub device: DeviceKind,
    pub resume: bool,
    /// Hidden width of the model.
    pub width: usize,
}

impl Default for Example {
    fn default() -> Self {
        Self {
            epochs: 4,
            train_samples: 12_000,
            test_samples: 1_200,
            batch_size: 32,
            seed: 7,
            device: DeviceKind::Cpu,
            resume: false,
            width: 128,
        }
    }
}

/// The examples' custom layers by name: what a model spec's `{ type =
/// "custom", name = "gated_residual" }` entry is made by, for a `Trainer`
/// (`NetworkPlan::layers`) and for a TOML experiment (`TrainOptions::layers`,
/// `eval::evaluate_checkpoint_with`, `predict::predict_with`) alike.
pub fn registry() -> LayerRegistry {
    LayerRegistry::new().register("gated_residual", gated_residual::factory)
}

/// The model of the examples: three hidden layers on the spirals' two
/// coordinates; `gated` makes the second a gated residual layer.
pub fn model_spec(width: usize, gated: bool) -> std::result::Result<ModelSpec, toml::de::Error> {
    let middle = if gated {
        r#"{ type = "custom", name = "gated_residual", options = { gate = 0.0 } },"#
    } else {
        r#"{ type = "linear", out = WIDTH }, { type = "relu" },"#
    };
    let text = format!(
        r#"
        input = [1, 1, 2]
        mean = 0.5
        std = 0.25
        layers = [
            {{ type = "flatten" }},
            {{ type = "linear", out = WIDTH }}, {{ type = "relu" }},
            {middle}
            {{ type = "relu" }},
            {{ type = "linear", out = WIDTH }}, {{ type = "relu" }},
            {{ type = "linear", out = {classes} }},
        ]
        "#,
        classes = spirals::ARMS
    )
    .replace("WIDTH", &width.to_string());
    toml::from_str(&text)
}

/// A trainer for the spirals with the example's model, checkpoints every
/// 50 steps; the caller adds sinks and builds it.
pub fn example_trainer(
    example: &Example,
    dir: &Path,
    model: &str,
    gated: bool,
) -> Result<TrainerBuilder> {
    let spec = model_spec(example.width, gated).map_err(|e| {
        headroom_pipeline::PipelineError::Config(format!("the example's model: {e}"))
    })?;
    let plan = NetworkPlan {
        spec,
        seed: example.seed,
        build: Default::default(),
        layers: registry(),
        step: StepSettings {
            clip_norm: 1.0,
            // The rest (cross-entropy, the optimizer's defaults) as the
            // library gives them.
            ..StepSettings::default()
        },
        batch: example.batch_size,
        device: example.device,
        cuda: Default::default(),
    };
    let train = spirals::Spirals::new(example.train_samples, spirals::ARMS, example.seed);
    let test = spirals::Spirals::new(example.test_samples, spirals::ARMS, example.seed + 1);
    Ok(headroom_pipeline::Trainer::builder()
        .output_dir(dir)
        .model(format!("{model} width {}", example.width), network(plan))
        .data(Arc::new(train), Arc::new(test))
        .record_setting("train_samples", example.train_samples)
        .record_setting("seed", example.seed)
        .loop_settings(LoopSettings {
            epochs: example.epochs,
            batch_size: example.batch_size,
            threads: 1,
            ..LoopSettings::default()
        })
        .schedule(ScheduleSettings {
            lr: 1e-2,
            kind: ScheduleKind::OneCycle {
                pct_start: 0.25,
                div_factor: 10.0,
                final_div_factor: 100.0,
            },
        })
        .loader(LoaderSettings {
            seed: example.seed,
            ..LoaderSettings::default()
        })
        .checkpoints(CheckpointSettings {
            every_steps: 50,
            keep: 2,
            ..CheckpointSettings::default()
        })
        .resume(if example.resume {
            Resume::Latest
        } else {
            Resume::No
        }))
}

/// The example programs' command line: `--out DIR` (required), `--resume`,
/// `--epochs N`, `--samples N`, `--width N`, `--device cpu|cuda|auto`.
pub fn parse_args(
    args: impl Iterator<Item = String>,
) -> std::result::Result<(Example, std::path::PathBuf), String> {
    let mut example = Example::default();
    let mut out = None;
    let mut args = args.skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--out" => out = Some(std::path::PathBuf::from(value("--out")?)),
            "--resume" => example.resume = true,
            "--epochs" => {
                example.epochs = value("--epochs")?
                    .parse()
                    .map_err(|e| format!("--epochs: {e}"))?
            }
            "--samples" => {
                example.train_samples = value("--samples")?
                    .parse()
                    .map_err(|e| format!("--samples: {e}"))?
            }
            "--width" => {
                example.width = value("--width")?
                    .parse()
                    .map_err(|e| format!("--width: {e}"))?
            }
            "--device" => {
                example.device = DeviceKind::parse("--device", &value("--device")?)
                    .map_err(|e| e.to_string())?
            }
            other => return Err(format!("unknown argument {other}; expected --out DIR [--resume] [--epochs N] [--samples N] [--width N] [--device cpu|cuda|auto]")),
        }
    }
    let out = out.ok_or("--out DIR is required")?;
    Ok((example, out))
}

/// An example program's `main`: parses the command line, makes the
/// trainer with `make`, runs it; exit 2 on a bad command line, 1 when the
/// run fails.
pub fn main_with(
    make: impl FnOnce(&Example, &Path) -> Result<TrainerBuilder>,
) -> std::process::ExitCode {
    let (example, out) = match parse_args(std::env::args()) {
        Ok(parsed) => parsed,
        Err(e) => {
            eprintln!("error: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    match make(&example, &out) {
        Ok(trainer) => run_and_report(trainer),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Runs `trainer` with log lines on stderr, and prints the result.
pub fn run_and_report(trainer: TrainerBuilder) -> std::process::ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    match trainer.build().and_then(|trainer| trainer.run()) {
        Ok(summary) => {
            println!(
                "done: {} epochs, step {}, test accuracy {}, test loss {}",
                summary.epoch,
                summary.step,
                summary
                    .test_accuracy
                    .map_or("-".into(), |a| format!("{:.2}%", a * 100.0)),
                summary.test_loss.map_or("-".into(), |l| format!("{l:.4}")),
            );
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
