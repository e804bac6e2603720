use std::path::PathBuf;

use thiserror::Error;

pub type Result<T, E = PipelineError> = std::result::Result<T, E>;

#[derive(Debug, Error)]
pub enum PipelineError {
    #[error("config: {0}")]
    Config(String),
    #[error("config key `{key}`: {reason}")]
    ConfigValue { key: String, reason: String },
    #[error("{0}")]
    DatasetMissing(String),
    /// A sample the data files hold that no run can use, named by file and index.
    #[error("bad data: {0}")]
    BadData(String),
    /// The OS's reason is part of the message (not a separate `source`, which
    /// would print it twice in an error chain).
    #[error("{}: {cause}", path.display())]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("checkpoint {path}: {reason}")]
    Checkpoint { path: PathBuf, reason: String },
    /// A file a command was asked to write (`export`, `lora-merge`).
    #[error("output {path}: {reason}")]
    Output { path: PathBuf, reason: String },
    #[error(transparent)]
    Loader(#[from] headroom_loader::LoaderError),
    #[error(transparent)]
    Model(#[from] headroom_model::ModelError),
    #[error(transparent)]
    Optim(#[from] headroom_optim::OptimError),
    #[error("ranks: {0}")]
    Ranks(#[from] headroom_dist::DistError),
    #[error(
        "{skips} steps in a row had a non-finite loss or gradient, after the update that made step \
         {from_step}: stopped in {}. {resume_from} Lower the learning rate (or set a gradient clip) and \
         resume: cargo xtask train --resume {} --set optimizer.lr=<lower> [--set train.clip_norm=1.0]",
        dir.display(),
        crate::shell::quote_path(dir)
    )]
    Diverged {
        skips: u64,
        /// The optimizer steps applied when the skips began: the last of
        /// them is the update the weights may not recover from.
        from_step: u64,
        dir: PathBuf,
        /// Where a resume continues from, once the checkpoints written
        /// after that update are set aside.
        resume_from: String,
    },
    /// The test pass at the end of a training epoch (counted from 1).
    #[error("the evaluation after training epoch {epoch} failed: {cause}")]
    Evaluation {
        epoch: u64,
        cause: Box<PipelineError>,
    },
    /// The data or the evaluation failed mid-run; the steps before were
    /// checkpointed.
    #[error(
        "{cause}. The run up to step {step} is saved in {}: {}, then go on exactly where it \
         stopped: cargo xtask train --resume {}",
        dir.display(),
        remedy(cause),
        crate::shell::quote_path(dir)
    )]
    StoppedSaved {
        cause: Box<PipelineError>,
        step: u64,
        dir: PathBuf,
    },
    #[error("{0}")]
    OutOfMemory(String),
    /// A figure or a state that must be finite is not.
    #[error("{0}")]
    NonFinite(String),
    #[error("{stage} stage stopped unexpectedly: {reason}")]
    Stage { stage: &'static str, reason: String },
    /// A thread the run needs could not be started (a limit on threads or
    /// memory), named with what it is for.
    #[error(
        "cannot start {what}: {reason}. The process may start no more threads: a limit on \
         processes and threads (ulimit -u), on memory (ulimit -v, ulimit -d: each thread needs \
         room for its stack) or the system's kernel.threads-max; raise the limit, or use fewer \
         threads (train.threads, data.workers)"
    )]
    Threads { what: String, reason: String },
}

impl From<headroom_model::cuda::CudaError> for PipelineError {
    fn from(e: headroom_model::cuda::CudaError) -> Self {
        Self::Model(e.into())
    }
}

/// What to do before resuming a run stopped by `cause`.
fn remedy(cause: &PipelineError) -> &'static str {
    match cause {
        PipelineError::Evaluation { cause, .. } => remedy(cause),
        PipelineError::Loader(_)
        | PipelineError::BadData(_)
        | PipelineError::DatasetMissing(_)
        | PipelineError::Io { .. } => {
            "repair or replace the data (for a shard store, run `cargo xtask preprocess` again \
             with --overwrite)"
        }
        PipelineError::OutOfMemory(_) => "free memory (or set a smaller train.micro_batch)",
        e if e.is_out_of_memory() => "free memory (or set a smaller train.micro_batch)",
        _ => "remove the cause above",
    }
}

impl PipelineError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            cause: source,
        }
    }

    /// Out of memory inside the model: the policy decides what happens next.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Self::Model(e) if e.is_out_of_memory())
            || matches!(
                self,
                Self::Optim(headroom_optim::OptimError::OutOfMemory { .. })
            )
    }

    pub fn value(key: &str, reason: impl Into<String>) -> Self {
        Self::ConfigValue {
            key: key.to_string(),
            reason: reason.into(),
        }
    }
}
