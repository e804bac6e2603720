//! headroom-pipeline: the experiment configuration, the data source, and the
//! training run as stages joined by bounded channels:
//!
//! ```text
//! loader workers ──Batch──▶ [bounded: prefetch] ──▶ train stage ──Event──▶ [bounded] ──▶ sink stage
//!                                                   (forward, backward,      (progress, metrics.jsonl,
//!                                                    clip, AdamW step)        checkpoint writes)
//! ```

pub mod bench;
pub mod checkpoint;
pub mod config;
pub mod data;
mod error;
pub mod eval;
pub mod export;
pub mod finetune;
pub mod frames;
pub mod learner;
pub mod limits;
pub mod memory;
pub mod plot;
pub mod resume;
pub mod rundir;
mod sink;
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
