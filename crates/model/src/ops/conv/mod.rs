//! Convolution. The CPU layers are `cpu/` (`Conv2d`: direct tiles,
//! Winograd, narrow kernels and im2col + GEMM) and `depthwise_conv.rs`
//! (`DepthwiseConv2d`); the GPU layers are `layer.rs`. On the GPU:
//! im2col + cuBLAS, the implicit-GEMM kernels (`conv.cu`, `conv_mma.cu`),
//! the narrow and thin direct kernels (`narrow.rs`, `conv_narrow.cu`) and
//! the per-shape tuner (`tune.rs`, `TunedConv`). Scratch memory is the plan's
//! workspace (`ConvPlan::workspace`, an im2col matrix for a group of whole
//! images); the weight gradient is accumulated into the caller's f32 view.
//!
//! | launch (`cuda.rs`) | CPU reference |
//! |---|---|
//! | `conv2d_forward` / `conv2d_backward` / `conv2d_backward_params` | `layers::Conv2d` |
//! | `depthwise_forward` / `depthwise_backward` / `depthwise_backward_params` (`depthwise.rs`, `depthwise.cu`: direct kernels, the weight gradient by per-image partials summed in image order) | `layers::DepthwiseConv2d` |
//!
//! Parity tests: `tests/cuda_parity/conv.rs`.

pub(crate) mod cpu;
pub(crate) mod cuda;
pub(crate) mod depthwise;
pub(crate) mod depthwise_conv;
pub(crate) mod layer;
pub(crate) mod narrow;
mod partials;
pub(crate) mod plan;
pub(crate) mod tune;
