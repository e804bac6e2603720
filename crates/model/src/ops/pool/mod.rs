//! Pooling and reshaping: global average pooling, max pooling, the UNet's
//! 2× upsampling and its channel concatenation / split, and the reshapes
//! (`Flatten`, `PerFrame`, `PerPosition`). CPU layers
//! `global_avg_pool.rs`, `max_pool.rs`, `unet.rs`, `reshape.rs`; kernels
//! `pool.cu`, `unet.cu`; launches `cuda.rs`; GPU layers `layer.rs`. These
//! keep nothing for backward but shapes, except max pooling: one u32
//! argmax per output (`MaxPoolSaved`), not its input.
//!
//! | launch (`cuda.rs`) | CPU reference |
//! |---|---|
//! | `global_avg_pool_forward` / `_backward` | `layers::GlobalAvgPool` |
//! | `max_pool_forward` (eval: `max_pool_forward_*`; train: `max_pool_forward_train_*`, argmax kept) / `max_pool_backward` | `layers::MaxPool2d` |
//! | `upsample2x_forward` / `_backward`, `channels_concat` / `_split` | `layers::Upsample2x`, `layers::UnetSkip` |
//!
//! Parity tests: `tests/cuda_parity/pool.rs`.

pub(crate) mod cuda;
pub(crate) mod global_avg_pool;
pub(crate) mod layer;
pub(crate) mod max_pool;
pub(crate) mod reshape;
pub(crate) mod unet;
