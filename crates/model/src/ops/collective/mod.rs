//! The data-parallel ranks' arithmetic on the device: the rank-ordered sum
//! of the ranks' copies of a slice (`collective.cu`, launches `cuda.rs`),
//! which the GPU ranks' reduce-scatter ends with (`crate::cuda::nccl`
//! moves the copies; NCCL's own reductions are never used, their order
//! is not promised). Nothing is kept between calls; the caller owns the
//! buffers (the copies, one row per rank, and the slice written).
//!
//! | launch (`cuda.rs`) | CPU reference |
//! |---|---|
//! | `rank_sum` | `headroom_dist::collective`'s ordered sum: ((r0 + r1) + r2) … |
//!
//! Parity tests: `tests/cuda_parity/collective.rs`.

pub(crate) mod cuda;
