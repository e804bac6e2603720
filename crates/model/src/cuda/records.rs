//! What a queued training step leaves for the host, and how the host reads
//! it without stalling the GPU.
//!
//! A step's kernels write each micro-batch's loss and correct count into
//! `losses`/`corrects` (device memory at fixed addresses, which a captured
//! graph can write too), and the optimizer leaves its verdict and the loss
//! scaler's state in its `StepState`. After the step, `copy_out` queues one
//! copy of each into a pinned slot of a small ring and records an event;
//! `read` waits on that event only when the host collects the step, by
//! which time the GPU is usually running the next one. The ring has a slot
//! more than the steps that may be in flight, so a slot is rewritten only
//! after its step was collected.

use cudarc::driver::{CudaEvent, CudaSlice, PinnedHostSlice};

use super::backend::{CudaBackend, DeviceBuffer};
use super::error::Context;
use super::params::{StepState, SCHEDULE_CANDIDATES};
use super::CudaResult;

/// Steps that may be in flight: the optimizer's schedule holds a learning
/// rate for each count of applied steps a queued step may find.
pub const MAX_IN_FLIGHT: usize = SCHEDULE_CANDIDATES - 1;

/// One step's results in host memory.
#[derive(Clone, Debug)]
pub struct Record {
    pub state: StepState,
    pub losses: Vec<f32>,
    pub corrects: Vec<u32>,
}

struct Slot {
    state: PinnedHostSlice<StepState>,
    losses: PinnedHostSlice<f32>,
    corrects: PinnedHostSlice<u32>,
    copied: CudaEvent,
}

pub struct StepRecords {
    /// One entry per micro-batch of a step.
    pub losses: DeviceBuffer<f32>,
    pub corrects: DeviceBuffer<u32>,
    slots: Vec<Slot>,
    next: usize,
}

impl StepRecords {
    /// Room for steps of up to `parts` micro-batches.
    pub fn new(be: &CudaBackend, parts: usize) -> CudaResult<Self> {
        let parts = parts.max(1);
        let slots = (0..=MAX_IN_FLIGHT)
            .map(|_| slot(be, parts))
            .collect::<CudaResult<Vec<_>>>()?;
        Ok(Self {
            losses: be.alloc_zeros::<f32>(parts)?,
            corrects: be.alloc_zeros::<u32>(parts)?,
            slots,
            next: 0,
        })
    }

    /// Micro-batches a step may have.
    pub fn parts(&self) -> usize {
        self.losses.slice.len()
    }

    /// Queues the copies of a step of `parts` micro-batches (and of
    /// `verdict`) into the next slot; its index, for `read`.
    pub fn copy_out(
        &mut self,
        be: &CudaBackend,
        verdict: &CudaSlice<StepState>,
        parts: usize,
    ) -> CudaResult<usize> {
        let index = self.next;
        self.next = (self.next + 1) % self.slots.len();
        let slot = &mut self.slots[index];
        let stream = be.compute_stream();
        stream
            .memcpy_dtoh(verdict, &mut slot.state)
            .during("cuMemcpyDtoHAsync")?;
        stream
            .memcpy_dtoh(&self.losses.slice.slice(..parts), &mut slot.losses)
            .during("cuMemcpyDtoHAsync")?;
        stream
            .memcpy_dtoh(&self.corrects.slice.slice(..parts), &mut slot.corrects)
            .during("cuMemcpyDtoHAsync")?;
        slot.copied.record(stream).during("cuEventRecord")?;
        Ok(index)
    }

    /// The record in slot `index` (of a step of `parts` micro-batches),
    /// once its copies are done.
    pub fn read(&self, index: usize, parts: usize) -> CudaResult<Record> {
        let slot = &self.slots[index];
        slot.copied.synchronize().during("cuEventSynchronize")?;
        let state = slot.state.as_slice().during("pinned buffer")?[0];
        let losses = slot.losses.as_slice().during("pinned buffer")?[..parts].to_vec();
        let corrects = slot.corrects.as_slice().during("pinned buffer")?[..parts].to_vec();
        Ok(Record {
            state,
            losses,
            corrects,
        })
    }
}

fn slot(be: &CudaBackend, parts: usize) -> CudaResult<Slot> {
    let ctx = be.context();
    // SAFETY: each buffer is written by a copy before `read` reads it (the
    // event orders them).
    let (state, losses, corrects) = unsafe {
        (
            ctx.alloc_pinned::<StepState>(1),
            ctx.alloc_pinned::<f32>(parts),
            ctx.alloc_pinned::<u32>(parts),
        )
    };
    Ok(Slot {
        state: state.during("cuMemHostAlloc")?,
        losses: losses.during("cuMemHostAlloc")?,
        corrects: corrects.during("cuMemHostAlloc")?,
        copied: ctx.new_event(None).during("cuEventCreate")?,
    })
}
