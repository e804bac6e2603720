//! Elementwise layers: ReLU, the smooth activations (SiLU, GELU), dropout
//! (its device-side counter and mask) and the residual sums, from
//! `kernels/elementwise.cu`. Forward writes a new tensor; backward reads
//! the saved output (ReLU), the saved input (SiLU, GELU) or the counter
//! the forward drew its mask from (dropout), so nothing else is kept.
//!
//! | launch (`cuda.rs`) | CPU reference |
//! |---|---|
//! | `relu_forward` / `relu_backward` | `layers::Relu` |
//! | `smooth_forward` / `smooth_backward` | `layers::Silu`, `layers::Gelu` |
//! | `dropout_apply`, `dropout_count`, `dropout_restore_if_skipped` | `layers::Dropout` |
//! | `add_inplace`, `add` | `layers::Residual`'s sums |
//!
//! Parity tests: `tests/cuda_parity/activation.rs`.

pub(crate) mod cuda;
pub(crate) mod layer;
