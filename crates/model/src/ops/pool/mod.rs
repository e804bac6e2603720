//! Pooling and reshaping: global average pooling, the UNet's 2× upsampling
//! and its channel concatenation / split (`kernels/pool.cu`,
//! `kernels/unet.cu`). These keep nothing for backward but shapes.
//!
//! | launch (`cuda.rs`) | CPU reference |
//! |---|---|
//! | `global_avg_pool_forward` / `_backward` | `layers::GlobalAvgPool` |
//! | `upsample2x_forward` / `_backward`, `channels_concat` / `_split` | `layers::Upsample2x`, `layers::UnetSkip` |
//!
//! Parity tests: `tests/cuda_parity/pool.rs`.

pub(crate) mod cuda;
