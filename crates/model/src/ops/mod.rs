//! The op families: one folder per family of layers, holding its CPU
//! layers (re-exported as `crate::layers`), its CUDA launches (`cuda.rs`,
//! re-exported as `crate::cuda::ops`), its kernels (`*.cu`, compiled by
//! `crate::cuda::kernels`; `common.cuh` here is spliced into each) and its
//! GPU layers (`layer.rs`, what each CPU layer's `Layer::to_cuda` makes),
//! beside a design note (its `mod.rs`: what the family holds, what it
//! keeps in memory, and which CPU reference each launch mirrors). A
//! family's parity tests are `tests/cuda_parity/<family>.rs`.
//!
//! Families depend on the shared infrastructure (`crate::layers`' contract
//! and helpers: `vector_math`, `matmul`, `panel_product`; `crate::cuda`'s
//! backend, tensors, kernels, params, gemm and launch helper), and among
//! themselves only downwards: every family's CPU layers use `activation`'s
//! parallel loops (`relu.rs`); `conv` uses `linear`'s bias; `sequence`
//! uses `linear` (LoRA's products) and `conv`'s direct tiles
//! (`head_products.rs`); `frames` uses `conv`, `sequence` (the LSTM cell)
//! and `loss`. `crate::layers` re-exports the CPU layers; of its own files
//! only `residual.rs` (`activation`'s sums) and `panel_product.rs` (the
//! loops and `conv`'s direct tiles) use a family, and no family file they
//! use uses them back.

pub(crate) mod activation;
pub(crate) mod batch_norm;
pub(crate) mod cast;
pub(crate) mod collective;
pub(crate) mod conv;
pub(crate) mod frames;
pub(crate) mod layer_norm;
pub(crate) mod linear;
pub(crate) mod loss;
pub(crate) mod pool;
pub(crate) mod sequence;
