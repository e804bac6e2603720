//! The weight gradient's partial sums added in split order (conv.cu's
//! `wgrad_reduce`), for the implicit-GEMM and the direct kernels alike.

use cudarc::driver::{CudaViewMut, LaunchConfig, PushKernelArg};

use crate::cuda::backend::CudaBackend;
use crate::cuda::kernels as k;
use crate::cuda::launch::*;
use crate::cuda::params::*;
use crate::cuda::tensor::CudaTensor;
use crate::cuda::CudaResult;

/// dW += the weight gradient's partial sums `partial` [splits, dW's
/// length], added in split order (conv.cu's wgrad_reduce): the same
/// bits every run, where atomics would add in whatever order blocks end.
pub(super) fn add_weight_partials(
    be: &CudaBackend,
    partial: &CudaTensor,
    weight_grad: &mut CudaViewMut<'_, f32>,
    splits: usize,
) -> CudaResult<()> {
    let n = weight_grad.len();
    same_len(
        "weight gradient reduce",
        "partial sums",
        splits * n,
        partial.len(),
    )?;
    let reduce = be.function(&k::WGRAD_REDUCE)?;
    let rp = WgradReduceParams {
        n: n as u32,
        splits: splits as u32,
    };
    // SAFETY: wgrad_reduce(WgradReduceParams, const float* partial [splits,
    // n], float* dw [n]): both lengths checked above (the callers made
    // partial f32); its block of at most WGRAD_REDUCE_THREADS threads, its
    // lanes a power of two, as the kernel's shared tree needs.
    unsafe {
        launch(
            be.compute_stream(),
            &reduce,
            wgrad_reduce_launch(n),
            "weight gradient reduce",
            |b| {
                b.arg(&rp).arg(partial).arg(weight_grad);
            },
        )
    }?;
    Ok(())
}

/// wgrad_reduce's blocks: 32 elements by 8 lanes of splits while that
/// fills the GPU, else (dW of a few thousand floats, whose splits are
/// many: a narrow or thin kernel's up to 1024) 8 elements by 32 lanes.
/// Chosen by dW's length alone, so the order of the sum, and its bits,
/// depend on the shape and not on the GPU.
fn wgrad_reduce_launch(n: usize) -> LaunchConfig {
    const WIDE_FROM: usize = 32 * 512;
    let (cols, lanes) = if n >= WIDE_FROM { (32, 8) } else { (8, 32) };
    LaunchConfig {
        grid_dim: (n.div_ceil(cols).max(1) as u32, 1, 1),
        block_dim: (cols as u32, lanes, 1),
        shared_mem_bytes: 0,
    }
}
