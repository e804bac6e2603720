//! The frame models' ops (CPU layer `conv_lstm.rs`, kernels `frames.cu`,
//! launches `cuda.rs`, GPU layer `layer.rs`): the ConvLSTM cell (its
//! gates' convolution goes through the `conv` family) and the pixel MSE
//! loss. A batch of frame sequences [n, f, h, w, c] is stored as images
//! [n·f, h, w, c]; the forward keeps each step's gates and cells (f32)
//! for backward.
//!
//! | launch (`cuda.rs`) | CPU reference |
//! |---|---|
//! | `conv_lstm_forward` / `conv_lstm_backward` | `layers::ConvLstm` |
//! | `pixel_mse` | `loss::pixel_mse` |
//!
//! Parity tests: `tests/cuda_parity/frames.rs`.

pub(crate) mod conv_lstm;
pub(crate) mod cuda;
pub(crate) mod layer;
