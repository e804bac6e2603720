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
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("checkpoint {path}: {reason}")]
    Checkpoint { path: PathBuf, reason: String },
    #[error(transparent)]
    Loader(#[from] headroom_loader::LoaderError),
    #[error(transparent)]
    Model(#[from] headroom_model::ModelError),
    #[error(transparent)]
    Optim(#[from] headroom_optim::OptimError),
    #[error(
        "{skips} steps in a row had a non-finite loss or gradient; stopped with a checkpoint of the last good \
         state in {dir}. Lower optimizer.lr or train.clip_norm, then resume with --resume"
    )]
    Diverged { skips: u64, dir: PathBuf },
    #[error("{0}")]
    OutOfMemory(String),
    #[error("{stage} stage stopped unexpectedly: {reason}")]
    Stage { stage: &'static str, reason: String },
}

impl PipelineError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    /// Out of memory inside the model: the policy decides what happens next.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Self::Model(e) if e.is_out_of_memory())
    }

    pub fn value(key: &str, reason: impl Into<String>) -> Self {
        Self::ConfigValue {
            key: key.to_string(),
            reason: reason.into(),
        }
    }
}
