//! The token models' ops (CPU layers `attention.rs` with its per-head
//! products `head_products.rs`, `embedding.rs`, `lstm.rs`; kernels
//! `sequence.cu`, launched from `cuda.rs` for the GPU layers of
//! `layer.rs`, and cuBLAS through the `linear` family for the projections
//! and LoRA's low-rank products):
//! embeddings, causal self-attention, the LSTM's recurrence, LoRA. A
//! sequence batch [N, T, C] is an [N·T, C] tensor, a token per row.
//!
//! | launch (`cuda.rs`) | CPU reference |
//! |---|---|
//! | `embedding_forward` / `embedding_backward` | `layers::Embedding` |
//! | `attention_forward` / `attention_backward` | `layers::CausalSelfAttention` |
//! | `lstm_forward` / `lstm_backward_steps` + `linear_backward` | `layers::Lstm` |
//! | `lora_forward` / `lora_backward_input` + `lora_grads` | `layers::LoraLinear` |
//!
//! Parity tests: `tests/cuda_parity/sequence.rs`.

pub(crate) mod attention;
pub(crate) mod cuda;
pub(crate) mod embedding;
mod head_products;
pub(crate) mod layer;
pub(crate) mod lstm;
