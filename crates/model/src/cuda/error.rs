//! Errors of the CUDA backend. Running out of device memory is an ordinary
//! value (`CudaError::OutOfMemory`), like the CPU pool's
//! `ModelError::OutOfMemory`, into which it converts.

use cudarc::cublas::result::CublasError;
use cudarc::driver::{sys, DriverError};
use thiserror::Error;

use crate::ModelError;

pub type CudaResult<T> = std::result::Result<T, CudaError>;

#[derive(Debug, Error)]
pub enum CudaError {
    /// No CUDA driver library, no GPU, or a driver that cannot be used.
    #[error("CUDA is not available: {0}")]
    Unavailable(String),
    /// A driver older than the build needs (`arch::MIN_DRIVER_VERSION`).
    #[error(
        "the NVIDIA driver supports CUDA {found}; headroom needs a driver for CUDA {needed} or \
         newer (R550 or newer): update the driver"
    )]
    DriverTooOld { found: String, needed: String },
    /// An NVRTC whose kernels this driver cannot load (`arch::check_nvrtc_for_driver`).
    #[error("NVRTC {nvrtc} cannot make kernels for this driver (CUDA {driver}): {reason}; {hint}")]
    NvrtcTooNew {
        nvrtc: String,
        driver: String,
        reason: String,
        hint: String,
    },
    /// A run-time library (NVRTC, cuBLAS) could not be found or loaded.
    #[error("{library} not found: {hint}")]
    LibraryMissing { library: &'static str, hint: String },
    #[error("CUDA driver call failed in {op}: {source}")]
    Driver {
        op: &'static str,
        #[source]
        source: DriverError,
    },
    #[error("cuBLAS call failed in {op}: {source}")]
    Cublas {
        op: &'static str,
        #[source]
        source: CublasError,
    },
    #[error("NVRTC failed to compile {file}.cu for {target}:\n{log}")]
    Compile {
        file: &'static str,
        target: String,
        log: String,
    },
    /// An NCCL call failed, a peer did not answer before the deadline, or
    /// the communicator reported an asynchronous error.
    #[error("NCCL: {op}: {detail}")]
    Nccl { op: &'static str, detail: String },
    #[error("NVRTC call failed in {op}: {detail}")]
    Nvrtc { op: &'static str, detail: String },
    /// A device allocation that the budget or the driver refused. `requested`
    /// is in bytes; `in_use` is what live CUDA tensors held at the time;
    /// `limit` is the budget (None: the driver itself had no memory left).
    #[error(
        "out of GPU memory: {requested} bytes did not fit ({in_use} bytes in use, limit {limit:?}); \
         lower the batch size (or raise gradient accumulation), enable model.checkpoint, \
         or raise the memory budget"
    )]
    OutOfMemory {
        requested: u64,
        in_use: u64,
        limit: Option<u64>,
    },
    #[error("shape mismatch in {op}: expected {expected}, got {got}")]
    Shape {
        op: &'static str,
        expected: String,
        got: String,
    },
    /// A caller asked for something the backend does not do (a dtype an op
    /// does not take, a buffer past the 2^31-element limit of the kernels).
    #[error("{op}: {reason}")]
    Unsupported { op: &'static str, reason: String },
}

impl CudaError {
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, CudaError::OutOfMemory { .. })
    }

    pub fn shape(op: &'static str, expected: impl Into<String>, got: impl Into<String>) -> Self {
        CudaError::Shape {
            op,
            expected: expected.into(),
            got: got.into(),
        }
    }
}

/// `ModelError` has no device variant yet: out-of-memory and shape errors map
/// to theirs, everything else to `ModelError::State` with the full message.
impl From<CudaError> for ModelError {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::OutOfMemory {
                requested,
                in_use,
                limit,
            } => ModelError::OutOfMemory {
                requested,
                in_use,
                reserved: in_use,
                limit,
            },
            CudaError::Shape { op, expected, got } => ModelError::Shape { op, expected, got },
            other => ModelError::State(format!("cuda: {other}")),
        }
    }
}

/// Attaches the name of the operation to a driver or cuBLAS result.
pub(crate) trait Context<T> {
    fn during(self, op: &'static str) -> CudaResult<T>;
}

impl<T> Context<T> for std::result::Result<T, DriverError> {
    fn during(self, op: &'static str) -> CudaResult<T> {
        self.map_err(|source| CudaError::Driver { op, source })
    }
}

impl<T> Context<T> for std::result::Result<T, CublasError> {
    fn during(self, op: &'static str) -> CudaResult<T> {
        self.map_err(|source| CudaError::Cublas { op, source })
    }
}

/// A driver allocation failure: out of memory becomes `OutOfMemory`.
pub(crate) fn alloc_error(e: DriverError, requested: u64, in_use: u64) -> CudaError {
    if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        CudaError::OutOfMemory {
            requested,
            in_use,
            limit: None,
        }
    } else {
        CudaError::Driver {
            op: "device allocation",
            source: e,
        }
    }
}
