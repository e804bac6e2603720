//! The fully connected layer and its bias: `linear_forward` /
//! `linear_backward` (cuBLAS products through `cuda::gemm`), `bias_add`
//! and `bias_grad` (`kernels/elementwise.cu`'s column sums, which the
//! convolutions share). The weight gradient and the bias gradient are
//! accumulated (`+=`) into the caller's f32 views; the input is the only
//! activation backward needs.
//!
//! | launch (`cuda.rs`) | CPU reference |
//! |---|---|
//! | `linear_forward` / `linear_backward`, `bias_add`, `bias_grad` | `layers::Linear` |
//!
//! Parity tests: `tests/cuda_parity/linear.rs`.

pub(crate) mod cuda;
pub(crate) mod layer;
