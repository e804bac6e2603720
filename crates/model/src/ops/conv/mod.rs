//! Convolution on the GPU: im2col + cuBLAS, the implicit-GEMM kernels
//! (`kernels/conv.cu`, `kernels/conv_mma.cu`), the narrow and thin direct
//! kernels (`narrow.rs`, `kernels/conv_narrow.cu`) and the per-shape
//! tuner (`tune.rs`, `TunedConv`). Scratch memory is the plan's
//! workspace (`ConvPlan::workspace`, an im2col matrix for a group of whole
//! images); the weight gradient is accumulated into the caller's f32 view.
//!
//! | launch (`cuda.rs`) | CPU reference |
//! |---|---|
//! | `conv2d_forward` / `conv2d_backward` / `conv2d_backward_params` | `layers::Conv2d` |
//! | `depthwise_forward` / `depthwise_backward` / `depthwise_backward_params` (`depthwise.rs`, `kernels/depthwise.cu`: direct kernels, the weight gradient by per-image partials summed in image order) | `layers::DepthwiseConv2d` |
//!
//! Parity tests: `tests/cuda_parity/conv.rs`.

pub(crate) mod cuda;
pub(crate) mod depthwise;
pub(crate) mod layer;
pub(crate) mod narrow;
mod partials;
pub(crate) mod plan;
pub(crate) mod tune;
