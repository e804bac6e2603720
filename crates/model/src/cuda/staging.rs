//! Input batches to the GPU: a ring of pinned (page-locked) staging buffers
//! allocated once, host→device copies on the copy stream, and events that
//! order the compute stream after each copy (and each copy after the compute
//! work that last read its slot). Batches cross the link as u8 (4× less than
//! f32) and are normalised and cast to f16 by one kernel on the device.

use cudarc::driver::{sys, CudaEvent, PinnedHostSlice};

use super::backend::{CudaBackend, DeviceBuffer};
use super::error::Context;
use super::ops::normalize_u8;
use super::tensor::CudaTensor;
use super::{CudaError, CudaResult};

struct Slot {
    pixels_host: PinnedHostSlice<u8>,
    labels_host: PinnedHostSlice<u32>,
    pixels_dev: DeviceBuffer<u8>,
    labels_dev: DeviceBuffer<u32>,
    /// Recorded on the copy stream after this slot's copies.
    copied: CudaEvent,
    /// Recorded on the compute stream after the work that read the slot.
    consumed: CudaEvent,
}

/// A batch on the device: normalised f16 NHWC images and the labels.
#[derive(Debug)]
pub struct StagedBatch {
    pub images: CudaTensor,
    pub labels: DeviceBuffer<u32>,
}

/// The staging ring.
pub struct InputStaging {
    slots: Vec<Slot>,
    next: usize,
    max_pixels: usize,
    max_labels: usize,
}

impl std::fmt::Debug for InputStaging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InputStaging")
            .field("slots", &self.slots.len())
            .field("max_pixels", &self.max_pixels)
            .field("max_labels", &self.max_labels)
            .finish()
    }
}

impl InputStaging {
    /// `slots` buffers (2 lets one batch copy while the previous computes),
    /// each for up to `max_pixels` bytes of images and `max_labels` labels.
    pub fn new(
        be: &CudaBackend,
        slots: usize,
        max_pixels: usize,
        max_labels: usize,
    ) -> CudaResult<Self> {
        let ctx = be.context();
        let mut ring = Vec::with_capacity(slots.max(1));
        for _ in 0..slots.max(1) {
            // SAFETY: pinned memory is uninitialised; `stage` writes the
            // first n elements before each copy, and only those are used on
            // the device. The host only writes (PORTABLE, not write-combined,
            // so a read would not be slow either).
            let pixels_host = unsafe {
                ctx.alloc_pinned_with_flags::<u8>(max_pixels.max(1), sys::CU_MEMHOSTALLOC_PORTABLE)
            }
            .during("cuMemHostAlloc")?;
            // SAFETY: as above.
            let labels_host = unsafe {
                ctx.alloc_pinned_with_flags::<u32>(max_labels.max(1), sys::CU_MEMHOSTALLOC_PORTABLE)
            }
            .during("cuMemHostAlloc")?;
            ring.push(Slot {
                pixels_host,
                labels_host,
                pixels_dev: be.alloc::<u8>(max_pixels.max(1))?,
                labels_dev: be.alloc::<u32>(max_labels.max(1))?,
                copied: ctx.new_event(None).during("cuEventCreate")?,
                consumed: ctx.new_event(None).during("cuEventCreate")?,
            });
        }
        Ok(Self {
            slots: ring,
            next: 0,
            max_pixels,
            max_labels,
        })
    }

    /// Copies one batch (u8 NHWC pixels of `shape`, labels below `classes`)
    /// to the device through the next slot and normalises it there:
    /// (x/255 - mean)/std in f16. Returns without waiting for the GPU; the
    /// host blocks only if the slot's previous copy has not finished.
    #[allow(clippy::too_many_arguments)]
    pub fn stage(
        &mut self,
        be: &CudaBackend,
        shape: &[usize],
        pixels: &[u8],
        labels: &[u32],
        classes: usize,
        mean: f32,
        std: f32,
    ) -> CudaResult<StagedBatch> {
        if pixels.len() > self.max_pixels || labels.len() > self.max_labels {
            return Err(CudaError::shape(
                "InputStaging::stage",
                format!(
                    "at most {} pixels and {} labels",
                    self.max_pixels, self.max_labels
                ),
                format!("{} pixels and {} labels", pixels.len(), labels.len()),
            ));
        }
        if let Some((i, &bad)) = labels
            .iter()
            .enumerate()
            .find(|(_, &l)| l as usize >= classes)
        {
            return Err(CudaError::shape(
                "InputStaging::stage",
                format!("labels below the class count {classes}"),
                format!("label {bad} at sample {i}"),
            ));
        }
        let index = self.next;
        self.next = (index + 1) % self.slots.len();
        let slot = &mut self.slots[index];
        let copy = be.copy_stream();
        let compute = be.compute_stream();

        // Host side: waits (inside as_mut_slice) for this slot's previous
        // host→device copy to have read the pinned buffer.
        slot.pixels_host.as_mut_slice().during("pinned buffer")?[..pixels.len()]
            .copy_from_slice(pixels);
        slot.labels_host.as_mut_slice().during("pinned buffer")?[..labels.len()]
            .copy_from_slice(labels);

        // Copy stream: after the compute work that last read the slot.
        copy.wait(&slot.consumed).during("cuStreamWaitEvent")?;
        copy.memcpy_htod(&slot.pixels_host, &mut slot.pixels_dev.slice)
            .during("cuMemcpyHtoDAsync")?;
        copy.memcpy_htod(&slot.labels_host, &mut slot.labels_dev.slice)
            .during("cuMemcpyHtoDAsync")?;
        slot.copied.record(copy).during("cuEventRecord")?;

        // Compute stream: after the copies.
        compute.wait(&slot.copied).during("cuStreamWaitEvent")?;
        let images = normalize_u8(
            be,
            &slot.pixels_dev.slice.slice(..pixels.len()),
            shape,
            mean,
            std,
        )?;
        let mut labels_out = be.alloc::<u32>(labels.len())?;
        if !labels.is_empty() {
            compute
                .memcpy_dtod(
                    &slot.labels_dev.slice.slice(..labels.len()),
                    &mut labels_out.slice,
                )
                .during("cuMemcpyDtoDAsync")?;
        }
        slot.consumed.record(compute).during("cuEventRecord")?;
        Ok(StagedBatch {
            images,
            labels: labels_out,
        })
    }
}
