use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};

use crate::cuda::backend::CudaBackend;
use crate::cuda::kernels::{self as k};
use crate::cuda::launch::*;
use crate::cuda::params::*;
use crate::cuda::{CudaError, CudaResult};

/// `out[i] = ((parts[i] + parts[stride + i]) + parts[2·stride + i]) + …`
/// over `world` rows, on the compute stream: the ranks' copies of one
/// slice (row r: rank r's) summed in rank order.
pub fn rank_sum(
    be: &CudaBackend,
    parts: &CudaView<'_, f32>,
    world: usize,
    stride: usize,
    out: &mut CudaViewMut<'_, f32>,
) -> CudaResult<()> {
    rank_sum_on(be, be.compute_stream(), parts, world, stride, out)
}

/// `rank_sum` on `stream` (a data-parallel rank's communication stream,
/// so that the sum of a bucket does not hold up the backward queued on the
/// compute stream).
pub fn rank_sum_on(
    be: &CudaBackend,
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    parts: &CudaView<'_, f32>,
    world: usize,
    stride: usize,
    out: &mut CudaViewMut<'_, f32>,
) -> CudaResult<()> {
    let n = out.len();
    if world == 0 || n > stride {
        return Err(CudaError::shape(
            "rank_sum",
            format!("a slice of at most the stride ({stride}) over at least one rank"),
            format!("{n} values over {world} ranks"),
        ));
    }
    let needed = (world - 1) * stride + n;
    if parts.len() < needed {
        return Err(CudaError::shape(
            "rank_sum",
            format!("{needed} values of copies"),
            parts.len().to_string(),
        ));
    }
    if n == 0 {
        return Ok(());
    }
    let p = RankSumParams {
        n: u32_of("rank_sum", n)?,
        world: u32_of("rank_sum", world)?,
        stride: u32_of("rank_sum", stride)?,
    };
    let f = be.function(&k::RANK_SUM)?;
    // SAFETY: rank_sum_f32(RankSumParams, const float*, float*); `parts`
    // holds (world − 1)·stride + n values and `out` n (checked above), and
    // they are distinct buffers (a view and a mutable view).
    unsafe {
        launch(stream, &f, elementwise(n), "rank_sum", |b| {
            b.arg(&p).arg(parts).arg(out);
        })
    }?;
    Ok(())
}
