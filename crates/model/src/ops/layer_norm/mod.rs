//! Layer normalisation over the last axis (CPU layer `cpu.rs`, kernels
//! `layernorm.cu`, launches `cuda.rs`, GPU layer `layer.rs`): a
//! forward that saves each row's mean and inverse deviation
//! (`LayerNormSaved`, two f32 per row), and a backward that accumulates
//! the scale and shift gradients by chunks of rows.
//!
//! | launch (`cuda.rs`) | CPU reference |
//! |---|---|
//! | `layer_norm_forward` / `layer_norm_backward` / `layer_norm_backward_input` | `layers::LayerNorm` |
//!
//! Parity tests: `tests/cuda_parity/layer_norm.rs`.

pub(crate) mod cpu;
pub(crate) mod cuda;
pub(crate) mod layer;
