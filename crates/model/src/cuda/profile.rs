//! Where a step's GPU time goes (`cargo xtask bench --device cuda
//! --profile`): a timing event recorded on the compute stream after each
//! layer's forward and backward, the loss and the optimizer of eagerly
//! launched steps; each segment is the GPU time between its mark and the
//! one before. Off unless a profile is running (a mark then costs one
//! relaxed atomic load), and never inside a graph capture: the learner turns
//! its graphs off for the profiled steps.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use cudarc::driver::{sys, CudaEvent, CudaStream};

use super::error::Context;
use super::CudaResult;
use crate::profile::{add_segment, ProfileSegment};

#[derive(Default)]
pub(crate) struct Profiler {
    on: AtomicBool,
    marks: Mutex<Vec<(String, CudaEvent)>>,
}

impl Profiler {
    fn marks(&self) -> std::sync::MutexGuard<'_, Vec<(String, CudaEvent)>> {
        self.marks.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn start(&self, stream: &CudaStream) -> CudaResult<()> {
        let first = timed_event(stream)?;
        *self.marks() = vec![(String::new(), first)];
        self.on.store(true, Ordering::Relaxed);
        Ok(())
    }

    pub fn mark(&self, stream: &CudaStream, label: impl FnOnce() -> String) -> CudaResult<()> {
        if !self.on.load(Ordering::Relaxed) {
            return Ok(());
        }
        let event = timed_event(stream)?;
        self.marks().push((label(), event));
        Ok(())
    }

    /// Stops recording; the segments in the order their labels first
    /// appeared (waits for the last mark).
    pub fn finish(&self) -> CudaResult<Vec<ProfileSegment>> {
        self.on.store(false, Ordering::Relaxed);
        let marks = std::mem::take(&mut *self.marks());
        let mut segments: Vec<ProfileSegment> = Vec::new();
        for pair in marks.windows(2) {
            let [(_, from), (label, to)] = pair else {
                continue;
            };
            let ms = f64::from(super::backend::event_elapsed_ms(from, to)?);
            add_segment(&mut segments, label.clone(), ms);
        }
        Ok(segments)
    }
}

fn timed_event(stream: &CudaStream) -> CudaResult<CudaEvent> {
    stream
        .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .during("cuEventRecord (profile)")
}
