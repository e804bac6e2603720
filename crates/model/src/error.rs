use thiserror::Error;

use crate::memory::bytes_text;

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// Every failure of the model crate. Running out of memory is an ordinary
/// value like the others: callers free memory, split the batch, or stop.
#[derive(Debug, Error)]
pub enum ModelError {
    #[error("shape mismatch in {op}: expected {expected}, got {got}")]
    Shape {
        op: &'static str,
        expected: String,
        got: String,
    },
    #[error("invalid model specification at {path}: {reason}")]
    Spec { path: String, reason: String },
    #[error("{op}: backward called without a training forward before it")]
    NoSavedActivation { op: &'static str },
    #[error("state does not match the model: {0}")]
    State(String),
    /// A tensor allocation the memory pool refused. `requested` is the block
    /// size (the request rounded up to its size class); `in_use` and
    /// `reserved` are the pool's figures when it refused; `limit` is its
    /// budget on reserved bytes (None: no budget, so the refusal was an
    /// injected fault or the OS).
    #[error(
        "out of memory: a {} block did not fit ({} in use, {} reserved, {}); \
         lower the batch size (or raise gradient accumulation), enable \
         model.checkpoint, or raise the memory budget",
        bytes_text(*.requested), bytes_text(*.in_use), bytes_text(*.reserved), limit_text(*.limit)
    )]
    OutOfMemory {
        requested: u64,
        in_use: u64,
        reserved: u64,
        limit: Option<u64>,
    },
}

impl ModelError {
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, ModelError::OutOfMemory { .. })
    }
}

fn limit_text(limit: Option<u64>) -> String {
    match limit {
        Some(l) => format!("limit {}", bytes_text(l)),
        None => "refused by the system, not by a budget".into(),
    }
}
