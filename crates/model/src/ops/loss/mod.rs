//! Losses on the GPU (kernels `loss.cu`, launches `cuda.rs`; the CPU
//! losses are `crate::loss`): softmax cross-entropy against
//! labels or soft targets, and their focal forms. One launch writes the
//! logits' gradient (already scaled by the loss scale, `GradScale`) and
//! each row's loss and correctness (`XentOutput`), summed on the host.
//!
//! | launch (`cuda.rs`) | CPU reference |
//! |---|---|
//! | `softmax_cross_entropy`, `XentOutput::summary` | `loss::softmax_cross_entropy` |
//! | `soft_cross_entropy` | `loss::soft_cross_entropy` |
//! | `focal_loss`, `soft_focal_loss` | `loss::focal_loss`, `loss::soft_focal_loss` |
//!
//! Parity tests: `tests/cuda_parity/loss.rs`.

pub(crate) mod cuda;
