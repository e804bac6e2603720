//! Elementwise layers: ReLU, the smooth activations (SiLU, GELU), dropout
//! (its device-side counter and mask) and the residual sums. The CPU
//! layers are `relu.rs` (with the parallel loops every family's CPU
//! layers share: `par_build`, `par_rows`, `gather_rows`), `smooth.rs` and
//! `dropout.rs`; the kernels are `elementwise.cu`, launched from `cuda.rs`
//! for the GPU layers of `layer.rs`. Forward writes a new tensor; backward
//! reads the saved output (ReLU), the saved input (SiLU, GELU) or the
//! counter the forward drew its mask from (dropout), so nothing else is
//! kept.
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
pub(crate) mod dropout;
pub(crate) mod layer;
pub(crate) mod relu;
pub(crate) mod smooth;
