//! headroom-pipeline: the training run as stages joined by bounded
//! channels, driven by a TOML experiment (`train()`, what `cargo xtask
//! train` runs) or from code with your own model, data and sinks
//! ([`Trainer`]):
//!
//! ```text
//! loader workers ──Batch──▶ [bounded: prefetch] ──▶ train stage ──Event──▶ [bounded] ──▶ sink stage
//!                                                   (forward, backward,      (progress, metrics.jsonl,
//!                                                    clip, AdamW step)        checkpoint writes, your sinks)
//! ```
//!
//! A run built in code: a dataset of your own, a model from a spec, a sink
//! of your own; checkpoints, resume, the memory budget and the run
//! directory's lock all apply.
//!
//! ```
//! use std::sync::{Arc, Mutex};
//! use headroom_loader::{Dataset, LoaderError};
//! use headroom_pipeline::trainer::*;
//! use headroom_pipeline::Trainer;
//!
//! /// Two classes: dark and bright 2×2 images.
//! struct DarkOrBright;
//! impl Dataset for DarkOrBright {
//!     fn len(&self) -> usize { 256 }
//!     fn sample_shape(&self) -> [usize; 3] { [2, 2, 1] }
//!     fn num_classes(&self) -> usize { 2 }
//!     fn read(&self, i: usize, out: &mut [u8]) -> Result<u32, LoaderError> {
//!         let bright = i % 2;
//!         out.fill(if bright == 1 { 200 } else { 40 } + (i % 13) as u8);
//!         Ok(bright as u32)
//!     }
//! }
//!
//! /// Counts the steps it is told of.
//! struct StepCounter(Arc<Mutex<u64>>);
//! impl Sink for StepCounter {
//!     fn name(&self) -> String { "step counter".into() }
//!     fn step(&mut self, _: &StepReport) -> SinkResult {
//!         *self.0.lock().unwrap() += 1;
//!         Ok(())
//!     }
//! }
//!
//! let spec = toml::from_str(r#"
//!     input = [2, 2, 1]
//!     mean = 0.5
//!     std = 0.25
//!     layers = [{ type = "flatten" }, { type = "linear", out = 2 }]
//! "#).unwrap();
//! let plan = NetworkPlan {
//!     spec,
//!     seed: 1,
//!     build: Default::default(),
//!     layers: Default::default(),
//!     step: StepSettings { label_smoothing: 0.0, clip_norm: 0.0, focal_gamma: None, regression: None, optimizer: Default::default() },
//!     batch: 32,
//!     device: DeviceKind::Cpu,
//!     cuda: Default::default(),
//! };
//! let steps = Arc::new(Mutex::new(0));
//! let dir = tempfile::tempdir().unwrap();
//! let summary = Trainer::builder()
//!     .output_dir(dir.path().join("run"))
//!     .model("linear", network(plan))
//!     .data(Arc::new(DarkOrBright), Arc::new(DarkOrBright))
//!     .loop_settings(LoopSettings { epochs: 2, batch_size: 32, threads: 1, ..Default::default() })
//!     .schedule(ScheduleSettings { lr: 0.05, kind: ScheduleKind::Constant })
//!     .sink(Box::new(StepCounter(Arc::clone(&steps))))
//!     .build()?
//!     .run()?;
//! assert_eq!(*steps.lock().unwrap(), 16);
//! assert_eq!(summary.test_accuracy, Some(1.0));
//! assert!(summary.last_checkpoint.is_some());
//! # Ok::<(), headroom_pipeline::PipelineError>(())
//! ```

pub mod bench;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod device;
mod error;
pub mod eval;
mod eval_shard;
pub mod export;
pub mod finetune;
pub mod frames;
pub mod learner;
pub mod limits;
pub mod memory;
pub mod monitor;
pub mod multilabel;
pub mod parts;
pub mod paths;
pub mod plot;
pub mod predict;
pub mod ranks;
pub mod resume;
pub mod rundir;
mod setting_enum;
pub mod shell;
mod sink;
mod sources;
pub mod tables;
pub mod text;
pub mod train;
pub mod trainer;

pub use config::{ExperimentConfig, Overrides};
pub use error::{PipelineError, Result};
pub use resume::Resume;
pub use train::{train, TrainOptions};
pub use trainer::{RunSummary, Trainer};

/// Total memory of the machine in bytes (MemTotal), when the OS says.
pub fn system_memory_bytes() -> Option<u64> {
    meminfo("MemTotal:")
}

/// Memory available to new work in bytes (MemAvailable), when the OS says.
pub fn available_memory_bytes() -> Option<u64> {
    meminfo("MemAvailable:")
}

fn meminfo(key: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Peak resident set size of this process in bytes (VmHWM), when the OS says.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
