//! headroom-model: tensors (NHWC), devices, the caching memory pool, layers
//! with hand-written forward and backward, the loss, and the network builder
//! that reads an architecture from an experiment's TOML.
//!
//! There is no autograd tape: every layer saves what its backward needs during
//! a training forward and frees it in backward, so memory is explicit.

pub mod cuda;
mod device;
mod error;
pub mod gradcheck;
pub mod init;
pub mod layers;
pub mod loss;
pub mod memory;
mod network;
mod ops;
pub mod profile;
mod tensor;

pub use device::Device;
pub use error::{ModelError, Result};
pub use layers::vector_math::{lane_sum, wide};
pub use layers::{Layer, Mode, Param};
pub use memory::{MemoryPool, OomInjection, PoolStats};
pub use network::{
    measure_step_peak, BuildOptions, CheckpointPolicy, LayerSpec, ModelSpec, Network, TokenInput,
};
pub use tensor::Tensor;
