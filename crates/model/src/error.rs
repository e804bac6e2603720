use thiserror::Error;

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// Every failure of the model crate. Out-of-memory will join this enum as an
/// ordinary value when the memory pool lands.
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
}
