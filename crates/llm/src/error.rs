//! The crate's one error type. Every variant names the file it is about and,
//! where there is one, the key or tensor, so a user can fix their model
//! directory from the message alone.

use std::path::PathBuf;

/// Everything loading, running or sampling a model can fail with.
#[derive(Debug, thiserror::Error)]
pub enum LlmError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: not valid JSON: {source}", path.display())]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{}: key `{key}`: {problem} (expected {expected})", path.display())]
    ConfigKey {
        path: PathBuf,
        key: String,
        problem: &'static str,
        expected: &'static str,
    },
    #[error("{}: architectures = {found:?} is not supported; supported: {}", path.display(), supported.join(", "))]
    UnsupportedArchitecture {
        path: PathBuf,
        found: Vec<String>,
        supported: &'static [&'static str],
    },
    #[error("{}: {what} is not supported yet", path.display())]
    Unsupported { path: PathBuf, what: String },
    #[error("{}: no model.safetensors, and no model.safetensors.index.json for sharded weights", dir.display())]
    NoWeights { dir: PathBuf },
    #[error("{}: corrupt or truncated safetensors file: {source}", path.display())]
    Safetensors {
        path: PathBuf,
        source: safetensors::SafeTensorError,
    },
    #[error("{}: shard `{shard}` (named for tensor `{tensor}`) does not exist", index.display())]
    MissingShard {
        index: PathBuf,
        shard: String,
        tensor: String,
    },
    #[error("{}: tensor `{name}` is missing", path.display())]
    MissingTensor { path: PathBuf, name: String },
    #[error("{}: tensor `{name}` has shape {found:?}, expected {expected:?}", path.display())]
    TensorShape {
        path: PathBuf,
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("{}: tensor `{name}` is {dtype}, expected BF16, F16 or F32", path.display())]
    TensorDtype {
        path: PathBuf,
        name: String,
        dtype: String,
    },
    #[error("{}: the tokenizer does not load: {message}", path.display())]
    Tokenizer { path: PathBuf, message: String },
    #[error("{}: {what}", path.display())]
    Adapter { path: PathBuf, what: String },
    #[error("{}: checksum mismatch: the file records {recorded}, its tensors with adapter_config.json's r/lora_alpha/use_rslora give {computed} (changed since save_adapters wrote it)", path.display())]
    Checksum {
        path: PathBuf,
        recorded: String,
        computed: String,
    },
    #[error("{}: tensor `{name}` holds {value} at element {index}: not finite, nothing merged", path.display())]
    NonFinite {
        path: PathBuf,
        name: String,
        index: usize,
        value: f32,
    },
    #[error("{}: {what}", path.display())]
    Merge { path: PathBuf, what: String },
    #[error("{}, line {line}: {what}", path.display())]
    Data {
        path: PathBuf,
        line: usize,
        what: String,
    },
    /// A checkpoint that cannot be used (truncated, corrupt, of another
    /// run's shape): resume skips it for the one before.
    #[error("{}: not a usable checkpoint: {what}", path.display())]
    Checkpoint { path: PathBuf, what: String },
    /// A fine-tuning run directory that cannot be started or resumed as
    /// asked (a run already there, a changed model or data file, a setting
    /// that may not change on resume).
    #[error("{}: {what}", dir.display())]
    Run { dir: PathBuf, what: String },
    /// The token store (tokenised JSONL) cannot be written or read.
    #[error("token store {}: {source}", dir.display())]
    TokenStore {
        dir: PathBuf,
        source: headroom_loader::LoaderError,
    },
    #[error("{0}")]
    Input(String),
}

pub type Result<T> = std::result::Result<T, LlmError>;
