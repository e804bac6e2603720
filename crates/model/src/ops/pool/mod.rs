//! Pooling and reshaping: global average pooling, max pooling, the UNet's
//! 2× upsampling and its channel concatenation / split (`kernels/pool.cu`,
//! `kernels/unet.cu`). These keep nothing for backward but shapes, except
//! max pooling: one u32 argmax per output (`MaxPoolSaved`), not its input.
//!
//! | launch (`cuda.rs`) | CPU reference |
//! |---|---|
//! | `global_avg_pool_forward` / `_backward` | `layers::GlobalAvgPool` |
//! | `max_pool_forward` (eval: `max_pool_forward_*`; train: `max_pool_forward_train_*`, argmax kept) / `max_pool_backward` | `layers::MaxPool2d` |
//! | `upsample2x_forward` / `_backward`, `channels_concat` / `_split` | `layers::Upsample2x`, `layers::UnetSkip` |
//!
//! Parity tests: `tests/cuda_parity/pool.rs`.

pub(crate) mod cuda;
pub(crate) mod layer;
