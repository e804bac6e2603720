//! `device.conv_algorithm = "tune"`: where conv_mma.cu's implicit kernels
//! take a convolution, each of its three products (forward, input gradient,
//! weight gradient) is timed both ways the first time its shape runs
//! outside a graph capture, the implicit kernel against im2col + cuBLAS,
//! and the faster is kept for that shape from then on. `Auto`'s rule was
//! measured on one GPU (an H100) at one batch size; this measures the GPU
//! at hand, product by product (a layer whose forward is faster one way and
//! whose gradients are faster the other gets both).
//!
//! A timing: a warm-up run of each way (modules loaded, cuBLAS's heuristics
//! cached, the pool's blocks in place), then the faster of two runs timed
//! by CUDA events. The weight gradient is timed into a zeroed scratch
//! buffer (it accumulates), the forward and input gradient into their own
//! outputs (which the chosen way then overwrites). A shape first met
//! inside a graph capture, which may neither time nor wait, takes `Auto`'s
//! rule for that launch and is tuned at its next eager run.
//!
//! A timing is not a rule: two runs may choose differently, and so compute
//! different bits. A run's choices are `CudaBackend::tuned_convolutions`,
//! which a learner saves with its checkpoints and gives back on resume
//! (`restore_tuned_convolutions`), so that a resumed run keeps its kernels.

use std::collections::HashMap;
use std::sync::Mutex;

use cudarc::driver::{sys, CudaEvent};
use serde::{Deserialize, Serialize};

use super::plan::{ConvAlgorithm, ConvPlan, ConvShape, AUTO_IMPLICIT_CHANNELS};
use crate::cuda::backend::CudaBackend;
use crate::cuda::error::Context;
use crate::cuda::CudaResult;

/// One of the three matrix products of a convolution's step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ConvProduct {
    Forward,
    InputGrad,
    WeightGrad,
}

/// The two ways a product runs where the implicit kernels take its shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ConvPath {
    /// conv_mma.cu, the matrix gathered tile by tile.
    Implicit,
    /// An im2col matrix in the workspace, multiplied by cuBLAS.
    Im2col,
}

/// A tuned product: its shape, the way kept, and what each way took.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct TunedConv {
    pub shape: ConvShape,
    pub product: ConvProduct,
    pub path: ConvPath,
    pub implicit_ms: f32,
    pub im2col_ms: f32,
}

/// A backend's table of tuned products (its `op_state`).
#[derive(Default)]
struct ConvTuning {
    table: Mutex<HashMap<(ConvShape, ConvProduct), TunedConv>>,
}

impl ConvTuning {
    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<(ConvShape, ConvProduct), TunedConv>> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl CudaBackend {
    /// Every product tuned so far, in a fixed order (by shape, then
    /// product): what `device.conv_algorithm = "tune"` chose and why.
    pub fn tuned_convolutions(&self) -> Vec<TunedConv> {
        let mut all: Vec<TunedConv> = self
            .op_state::<ConvTuning>()
            .table()
            .values()
            .copied()
            .collect();
        all.sort_by_key(|t| (shape_key(&t.shape), t.product));
        all
    }

    /// Takes `tuned` as this backend's choices (a resumed run's, from its
    /// checkpoint), replacing any made for the same products.
    pub fn restore_tuned_convolutions(&self, tuned: &[TunedConv]) {
        let tuning = self.op_state::<ConvTuning>();
        let mut table = tuning.table();
        for t in tuned {
            table.insert((t.shape, t.product), *t);
        }
    }
}

fn shape_key(s: &ConvShape) -> [usize; 8] {
    [s.n, s.h, s.w, s.cin, s.cout, s.k, s.stride, s.pad]
}

/// `Auto`'s way for a product the implicit kernels take: stride 1 and at
/// most `AUTO_IMPLICIT_CHANNELS` channels in and out.
fn auto_path(s: &ConvShape) -> ConvPath {
    if s.stride == 1 && s.cin.max(s.cout) <= AUTO_IMPLICIT_CHANNELS {
        ConvPath::Implicit
    } else {
        ConvPath::Im2col
    }
}

/// The way `product` of convolution `s` runs under `plan`: im2col where
/// the implicit kernels do not take the shape (`implicit_takes` false),
/// else as the algorithm says; `Tune` times both ways through `run` when
/// the product is new (`run(path)` does the product that way).
pub(super) fn choose_path(
    be: &CudaBackend,
    plan: ConvPlan,
    implicit_takes: bool,
    s: &ConvShape,
    product: ConvProduct,
    run: impl FnMut(ConvPath) -> CudaResult<()>,
) -> CudaResult<ConvPath> {
    if !implicit_takes {
        return Ok(ConvPath::Im2col);
    }
    match plan.algorithm {
        ConvAlgorithm::Im2col => Ok(ConvPath::Im2col),
        ConvAlgorithm::ImplicitGemm => Ok(ConvPath::Implicit),
        ConvAlgorithm::Auto => Ok(auto_path(s)),
        ConvAlgorithm::Tune => tuned_path(be, s, product, run),
    }
}

fn tuned_path(
    be: &CudaBackend,
    s: &ConvShape,
    product: ConvProduct,
    mut run: impl FnMut(ConvPath) -> CudaResult<()>,
) -> CudaResult<ConvPath> {
    if let Some(t) = be.op_state::<ConvTuning>().table().get(&(*s, product)) {
        return Ok(t.path);
    }
    let capture = be
        .compute_stream()
        .capture_status()
        .during("cuStreamIsCapturing")?;
    if capture != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
        return Ok(auto_path(s));
    }
    let implicit_ms = fastest_ms(be, || run(ConvPath::Implicit))?;
    let im2col_ms = fastest_ms(be, || run(ConvPath::Im2col))?;
    let path = if implicit_ms <= im2col_ms {
        ConvPath::Implicit
    } else {
        ConvPath::Im2col
    };
    let tuned = TunedConv {
        shape: *s,
        product,
        path,
        implicit_ms,
        im2col_ms,
    };
    be.op_state::<ConvTuning>()
        .table()
        .insert((*s, product), tuned);
    Ok(path)
}

/// Timed runs of a way, after one to warm it up.
const TIMED_RUNS: usize = 2;

/// The least GPU time of `TIMED_RUNS` runs of `run` after a warm-up one,
/// in milliseconds (waits for the GPU).
fn fastest_ms(be: &CudaBackend, mut run: impl FnMut() -> CudaResult<()>) -> CudaResult<f32> {
    run()?;
    let mut best = f32::INFINITY;
    for _ in 0..TIMED_RUNS {
        let start = timing_event(be)?;
        run()?;
        let end = timing_event(be)?;
        end.synchronize().during("cuEventSynchronize (tune)")?;
        best = best.min(crate::cuda::backend::event_elapsed_ms(&start, &end)?);
    }
    Ok(best)
}

fn timing_event(be: &CudaBackend) -> CudaResult<CudaEvent> {
    be.compute_stream()
        .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .during("cuEventRecord (tune)")
}
