//! The public path of the op families' CUDA launches: each family
//! (`crate::ops::<family>`, its folder under `src/ops/`) holds its
//! wrappers in its `cuda.rs`, and its `mod.rs` says which CPU reference
//! each mirrors and where its parity tests are. Every wrapper checks
//! shapes, allocates outputs and launches the kernels of the family's
//! `.cu` files, beside it (or cuBLAS) on the compute stream through
//! `cuda::launch::launch`. Activations are `CudaTensor`s (NHWC) stored as
//! f16 (mixed precision) or f32 (f32 training); each op takes the storage
//! type T of its inputs and launches that instantiation of its kernel
//! (`KernelPair::of`), and a mix of types is an error. Parameters are
//! views of the same type into the groups' compute weights (see
//! `ParamGroup`); parameter gradients are f32 and ACCUMULATED (`+=`),
//! like the CPU layers'. In the SAFETY notes, `T*` is `hr_half*` or
//! `float*` as the launched instantiation says.
//!
//! Every launch is asynchronous; nothing here waits for the GPU except the
//! explicit downloads.

pub use super::launch::MAX_BLOCK_THREADS;
pub use crate::ops::activation::cuda::*;
pub use crate::ops::batch_norm::cuda::*;
pub use crate::ops::cast::cuda::*;
pub use crate::ops::collective::cuda::*;
pub use crate::ops::conv::cuda::*;
pub use crate::ops::conv::depthwise::*;
pub use crate::ops::conv::tune::{ConvPath, ConvProduct, TunedConv};
pub use crate::ops::frames::cuda::*;
pub use crate::ops::layer_norm::cuda::*;
pub use crate::ops::linear::cuda::*;
pub use crate::ops::loss::cuda::*;
pub use crate::ops::pool::cuda::*;
pub use crate::ops::sequence::cuda::*;
