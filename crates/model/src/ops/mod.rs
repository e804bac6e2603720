//! The op families: one folder per family of layers, holding its CUDA
//! launches (`cuda.rs`, re-exported as `crate::cuda::ops`) beside a design
//! note (its `mod.rs`: what the family holds, what it keeps in memory, and
//! which CPU reference each launch mirrors). A family's parity tests are
//! `tests/cuda_parity/<family>.rs`.
//!
//! Families depend on the shared CUDA infrastructure in `crate::cuda`
//! (backend, tensors, kernels, params, gemm, the launch helper), never
//! the reverse; among themselves only downwards: `conv` uses `linear`'s
//! bias, `sequence` uses `linear`, `frames` uses `conv` and `loss`.

pub(crate) mod activation;
pub(crate) mod batch_norm;
pub(crate) mod cast;
pub(crate) mod conv;
pub(crate) mod frames;
pub(crate) mod layer_norm;
pub(crate) mod linear;
pub(crate) mod loss;
pub(crate) mod pool;
pub(crate) mod sequence;
