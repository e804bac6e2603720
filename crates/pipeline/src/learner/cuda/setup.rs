//! What the GPU learner settles before it builds anything: that its
//! backend stores the 2-byte format the options ask for, and the tensor
//! budget, each logged once.

use headroom_model::cuda::{CudaBackend, DType};
use headroom_model::memory::bytes_text;

use super::CudaOptions;
use crate::{PipelineError, Result};

/// The options' storage must be the backend's (`CudaBackend::with_half`
/// opens it for one format); logs what activations and compute weights
/// are stored as.
pub(super) fn check_storage(be: &CudaBackend, options: &CudaOptions) -> Result<()> {
    if options.half != be.half() {
        return Err(PipelineError::value(
            "device.precision",
            format!(
                "the learner stores {} but its backend was opened for {} \
                 (CudaBackend::with_half)",
                options.half,
                be.half()
            ),
        ));
    }
    let storage = match options.build.activations {
        DType::F16 => be.half().name(),
        DType::F32 => "f32",
    };
    tracing::info!("GPU storage: {storage} activations and compute weights, f32 masters");
    Ok(())
}

/// The budget on tensor memory: `set` (`device.memory_limit`), else 90% of
/// what was free at start, so that the memory policy adapts before the
/// driver refuses (which is handled too); None where the GPU reports no
/// free memory.
pub(super) fn tensor_budget(be: &CudaBackend, set: Option<u64>) -> Option<u64> {
    let limit = set.or_else(|| Some(be.info().free_memory / 10 * 9).filter(|&b| b > 0));
    match (set, limit) {
        (Some(set), _) => {
            tracing::info!(
                "GPU tensor budget {} (device.memory_limit)",
                bytes_text(set)
            )
        }
        (None, Some(budget)) => tracing::info!(
            "GPU tensor budget {}: 90% of the {} free at start",
            bytes_text(budget),
            bytes_text(be.info().free_memory)
        ),
        (None, None) => {
            tracing::warn!("the GPU reports no free memory: tensor memory is unbounded")
        }
    }
    limit
}
