//! Batch normalisation (CPU layer `cpu.rs`, kernels `batchnorm.cu`,
//! launches `cuda.rs`, GPU layer `layer.rs`), optionally fused with the
//! ReLU after it or with a residual block's sum and the ReLU after the
//! block. A training forward saves four f32 per channel
//! (`BatchNormSaved`: mean, inverse deviation and the affine map it
//! applied) so that backward can recompute the output instead of keeping
//! it; the per-channel reductions go by chunks of rows (at most 256
//! partial sums a channel, then a finalize kernel).
//!
//! | launch (`cuda.rs`) | CPU reference |
//! |---|---|
//! | `batch_norm_forward_train` / `_eval` / `batch_norm_backward` | `layers::BatchNorm2d` (+ `Relu` when fused) |
//! | `batch_norm_add_forward_train` / `_eval` / `batch_norm_add_relu_backward` | `layers::FusedResidual`'s tail (`BatchNorm2d::forward_add_relu`) |
//!
//! Parity tests: `tests/cuda_parity/batch_norm.rs`.

pub(crate) mod cpu;
pub(crate) mod cuda;
pub(crate) mod layer;
