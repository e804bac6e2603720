//! headroom-model: tensors (NHWC), devices, the caching memory pool, layers
//! with hand-written forward and backward, the loss, and the network builder
//! that reads an architecture from an experiment's TOML.
//!
//! There is no autograd tape: every layer saves what its backward needs during
//! a training forward and frees it in backward, so memory is explicit.
//!
//! A network from a spec (the `[model]` table of an experiment), one
//! forward and backward on the CPU:
//!
//! ```
//! use headroom_model::{ModelSpec, Mode, Network, Tensor};
//!
//! let spec: ModelSpec = toml::from_str(r#"
//!     input = [4, 4, 1]
//!     mean = 0.5
//!     std = 0.25
//!     layers = [
//!         { type = "conv", out = 8 }, { type = "batch_norm" }, { type = "relu" },
//!         { type = "global_avg_pool" }, { type = "linear", out = 3 },
//!     ]
//! "#).unwrap();
//! let mut network = Network::build(&spec, 42)?;
//! let input = network.input_from_u8(2, &[128u8; 2 * 4 * 4])?;
//! let scores = network.forward(&input, Mode::Train)?;
//! assert_eq!(scores.shape(), &[2, 3]);
//! network.backward(&Tensor::from_vec(&[2, 3], vec![0.1; 6])?)?;
//! assert!(network.params_mut().iter().any(|p| p.grad.data().iter().any(|g| *g != 0.0)));
//! # Ok::<(), headroom_model::ModelError>(())
//! ```

/// A built-in layer's `Layer::to_cuda`: its GPU form is made by `$make`
/// (`fn(&Self, &mut CudaBuildContext) -> CudaResult<Box<dyn CudaLayer>>`),
/// which lives beside the GPU struct in the layer's op family folder; a
/// layer with no parameters or settings names its GPU value (`value X`).
macro_rules! cuda_form {
    (value $gpu:expr) => {
        fn to_cuda(
            &self,
            _ctx: &mut $crate::cuda::layer::CudaBuildContext<'_, '_>,
        ) -> Option<$crate::cuda::CudaResult<Box<dyn $crate::cuda::layer::CudaLayer>>> {
            Some(Ok(Box::new($gpu)))
        }
    };
    ($make:path) => {
        fn to_cuda(
            &self,
            ctx: &mut $crate::cuda::layer::CudaBuildContext<'_, '_>,
        ) -> Option<$crate::cuda::CudaResult<Box<dyn $crate::cuda::layer::CudaLayer>>> {
            Some($make(self, ctx))
        }
    };
}

pub mod address_space;
pub mod cuda;
pub mod custom;
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
mod spec;
mod tensor;

pub use custom::{CustomLayerArgs, LayerFactory, LayerRegistry};
pub use device::Device;
pub use error::{ModelError, Result};
pub use layers::vector_math::{lane_sum, wide};
pub use layers::{Layer, Mode, Param};
pub use memory::{MemoryPool, OomInjection, PoolStats};
pub use network::{
    measure_step_peak, BuildOptions, CheckpointPolicy, LayerSpec, ModelSpec, Network, TokenInput,
};
pub use tensor::Tensor;
