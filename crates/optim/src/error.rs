use thiserror::Error;

/// Errors of the optimizer crate. Messages name the field, value or parameter
/// at fault.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum OptimError {
    /// A configuration field or argument is out of range (NaN and infinities
    /// included).
    #[error("invalid {field} = {value}: must be {requirement}")]
    InvalidValue {
        field: &'static str,
        value: String,
        requirement: &'static str,
    },

    /// The parameter list handed to `step` has a different length from the
    /// one the optimizer's moments were built (or loaded) for.
    #[error("optimizer holds moments for {expected} parameters but step got {got}")]
    ParamCount { expected: usize, got: usize },

    /// A parameter's shape (or element count, after `load_state`) differs from
    /// the one the optimizer's moments were built for.
    #[error("parameter {index} ({name}): optimizer state expects {expected}, got {got}")]
    ParamShape {
        index: usize,
        name: String,
        expected: String,
        got: String,
    },

    /// A parameter's gradient does not match its value.
    #[error(
        "parameter {index} ({name}): gradient shape {grad:?} differs from value shape {value:?}"
    )]
    GradShape {
        index: usize,
        name: String,
        grad: Vec<usize>,
        value: Vec<usize>,
    },

    /// A state handed to `load_state` is inconsistent in itself.
    #[error("invalid optimizer state: {0}")]
    InvalidState(String),

    /// Memory for the optimizer's state or scratch was refused (the OS or
    /// the GPU); like the model's out-of-memory, a value the memory policy
    /// sees.
    #[error("out of memory in the optimizer: {requested} bytes did not fit ({in_use} bytes in use, limit {limit:?})")]
    OutOfMemory {
        requested: u64,
        in_use: u64,
        limit: Option<u64>,
    },

    /// Any other failure of the device (a launch, a copy, a shape).
    #[error("optimizer: {0}")]
    Device(String),
}

impl From<headroom_model::ModelError> for OptimError {
    /// Host allocations of the optimizer (the moments) fail as the model's
    /// pool reports them.
    fn from(e: headroom_model::ModelError) -> Self {
        match e {
            headroom_model::ModelError::OutOfMemory {
                requested,
                in_use,
                limit,
                ..
            } => OptimError::OutOfMemory {
                requested,
                in_use,
                limit,
            },
            other => OptimError::Device(other.to_string()),
        }
    }
}

impl From<headroom_model::cuda::CudaError> for OptimError {
    fn from(e: headroom_model::cuda::CudaError) -> Self {
        match e {
            headroom_model::cuda::CudaError::OutOfMemory {
                requested,
                in_use,
                limit,
            } => OptimError::OutOfMemory {
                requested,
                in_use,
                limit,
            },
            other => OptimError::Device(other.to_string()),
        }
    }
}
