//! CUDA graphs: the work queued on the compute stream between
//! `begin_capture` and `end_capture` is recorded (not run) into a graph that
//! `CapturedGraph::launch` then replays with one launch.
//!
//! Capture is thread-local: the capturing thread may not synchronise, copy
//! to or from pageable memory, or allocate synchronously, and every buffer
//! allocated during the capture must be freed in it (it becomes the graph's
//! memory, which the driver keeps for the graph's lifetime). The most bytes
//! our accounting saw in use during the capture, beyond what was in use
//! before, is that working set: the graph holds it against the budget.

use cudarc::driver::{sys, CudaGraph};

use super::backend::{CudaBackend, Lease};
use super::error::Context;
use super::{CudaError, CudaResult};

/// A recorded graph, ready to launch on the compute stream.
pub struct CapturedGraph {
    graph: CudaGraph,
    working_set: Lease,
}

// SAFETY: a CUDA graph may be used from any thread, one at a time (the
// driver's rule for graph objects); `launch` takes `&mut self`.
unsafe impl Send for CapturedGraph {}

impl std::fmt::Debug for CapturedGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CapturedGraph")
            .field("working_set", &self.working_set.bytes())
            .finish_non_exhaustive()
    }
}

impl CapturedGraph {
    /// Replays the graph on the compute stream (returns without waiting).
    /// A driver out-of-memory (graph memory is mapped at the first launch)
    /// is `CudaError::OutOfMemory`.
    pub fn launch(&mut self, be: &CudaBackend) -> CudaResult<()> {
        self.graph.launch().map_err(|e| {
            if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                let m = be.memory_stats();
                // The driver refused, whatever the budget: limit None.
                CudaError::OutOfMemory {
                    requested: self.working_set.bytes(),
                    in_use: m.in_use_bytes,
                    limit: None,
                }
            } else {
                CudaError::Driver {
                    op: "cuGraphLaunch",
                    source: e,
                }
            }
        })
    }

    /// The device bytes the graph's own buffers take (held in the budget).
    pub fn working_set(&self) -> u64 {
        self.working_set.bytes()
    }
}

impl CudaBackend {
    /// Starts recording the compute stream's work (this thread's capture).
    /// Returns the bytes in use now, for `end_capture`.
    pub fn begin_capture(&self) -> CudaResult<u64> {
        let in_use = self.begin_watermark();
        self.compute_stream()
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .during("cuStreamBeginCapture")?;
        Ok(in_use)
    }

    /// Ends the capture `begin_capture` started and instantiates its graph,
    /// which then holds the capture's working set in the budget. An error
    /// when something during the capture broke it (the driver says what).
    pub fn end_capture(&self, in_use_before: u64) -> CudaResult<CapturedGraph> {
        let graph = self
            .compute_stream()
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .during("cuStreamEndCapture")?
            .ok_or_else(|| CudaError::Unsupported {
                op: "cuStreamEndCapture",
                reason: "the capture recorded no graph".into(),
            })?;
        let bytes = self.watermark().saturating_sub(in_use_before);
        Ok(CapturedGraph {
            graph,
            working_set: self.hold(bytes)?,
        })
    }
}
