//! The fully connected layer and its bias (CPU layer `cpu.rs`, and LoRA's
//! adapter `lora.rs`, whose GPU side is the `sequence` family's; the GPU
//! layer is `layer.rs`): `linear_forward` / `linear_backward` (cuBLAS
//! products through `cuda::gemm`), `bias_add` and `bias_grad` (column sums
//! in the `activation` family's `elementwise.cu`, which the convolutions
//! share). The weight gradient and the bias gradient are
//! accumulated (`+=`) into the caller's f32 views; the input is the only
//! activation backward needs.
//!
//! | launch (`cuda.rs`) | CPU reference |
//! |---|---|
//! | `linear_forward` / `linear_backward`, `bias_add`, `bias_grad` | `layers::Linear` |
//!
//! Parity tests: `tests/cuda_parity/linear.rs`.

pub(crate) mod cpu;
pub(crate) mod cuda;
pub(crate) mod layer;
pub(crate) mod lora;
