//! Input batches to the GPU: a ring of pinned (page-locked) staging buffers
//! allocated once, host→device copies on the copy stream, and events that
//! order the compute stream after each copy (and each copy after the compute
//! work that last read its slot). Batches cross the link as u8 (4× less than
//! f32) and are normalised and cast to f16 by one kernel on the device.
//!
//! When the training set is held on the device (`ResidentImages`), a batch
//! crosses as recipes instead (sample id, crop, flip: 8 bytes a sample)
//! through the same ring, and one kernel gathers, crops, flips and
//! normalises it there.

use cudarc::driver::{sys, CudaEvent, CudaView, PinnedHostSlice};

use super::backend::{CudaBackend, DeviceBuffer};
use super::error::Context;
use super::ops::{gather_crop_flip, normalize_u8, Normalization};
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
    /// (x/255 - mean)/std, stored as `norm.dtype`. Returns without waiting
    /// for the GPU; the host blocks only if the slot's previous copy has not
    /// finished.
    #[allow(clippy::too_many_arguments)]
    pub fn stage(
        &mut self,
        be: &CudaBackend,
        shape: &[usize],
        pixels: &[u8],
        labels: &[u32],
        classes: usize,
        norm: Normalization,
    ) -> CudaResult<StagedBatch> {
        let index = self.copy_in(be, pixels, labels, classes)?;
        let slot = &self.slots[index];
        let images = normalize_u8(
            be,
            &slot.pixels_dev.slice.slice(..pixels.len()),
            shape,
            norm,
        )?;
        self.finish(be, index, images, labels.len())
    }

    /// A batch made on the device from `set`: only the recipes (two words
    /// per sample, see [`check_recipes`]) and the labels cross the link,
    /// through the next slot; the gather kernel crops, flips and normalises
    /// as the host path would, to the same bits.
    #[allow(clippy::too_many_arguments)]
    pub fn stage_recipes(
        &mut self,
        be: &CudaBackend,
        set: &ResidentImages,
        recipes: &[[u32; 2]],
        labels: &[u32],
        classes: usize,
        norm: Normalization,
    ) -> CudaResult<StagedBatch> {
        let bytes = set.recipe_bytes(recipes, labels)?;
        let index = self.copy_in(be, &bytes, labels, classes)?;
        let slot = &self.slots[index];
        // SAFETY: the slot's device buffer holds at least `bytes.len()` bytes
        // (copy_in checked) and device allocations are aligned far beyond 4
        // bytes; the u32 view covers exactly the words just copied.
        let words = unsafe { slot.pixels_dev.slice.transmute::<u32>(2 * recipes.len()) }
            .ok_or_else(|| {
                CudaError::shape(
                    "InputStaging::stage_recipes",
                    format!("a slot of at least {} bytes", bytes.len()),
                    format!("{} bytes", slot.pixels_dev.slice.len()),
                )
            })?;
        let images = set.gather(be, &words, recipes.len(), norm)?;
        self.finish(be, index, images, labels.len())
    }

    /// Copies one batch's bytes (pixels, or packed recipes checked with
    /// [`check_recipes`]) and labels through the next slot into `bytes_out`
    /// and `labels_out`, fixed device buffers that a captured training step
    /// reads (`CudaLearner`'s step graph): the copy stream carries the
    /// batch, the compute stream copies it on from the slot. Returns without
    /// waiting for the GPU.
    pub fn stage_into(
        &mut self,
        be: &CudaBackend,
        bytes: &[u8],
        labels: &[u32],
        classes: usize,
        bytes_out: &mut DeviceBuffer<u8>,
        labels_out: &mut DeviceBuffer<u32>,
    ) -> CudaResult<()> {
        if bytes.len() > bytes_out.len() || labels.len() > labels_out.len() {
            return Err(CudaError::shape(
                "InputStaging::stage_into",
                format!(
                    "at most {} bytes and {} labels",
                    bytes_out.len(),
                    labels_out.len()
                ),
                format!("{} bytes and {} labels", bytes.len(), labels.len()),
            ));
        }
        let index = self.copy_in(be, bytes, labels, classes)?;
        let slot = &mut self.slots[index];
        let compute = be.compute_stream();
        if !bytes.is_empty() {
            compute
                .memcpy_dtod(
                    &slot.pixels_dev.slice.slice(..bytes.len()),
                    &mut bytes_out.slice.slice_mut(..bytes.len()),
                )
                .during("cuMemcpyDtoDAsync")?;
        }
        if !labels.is_empty() {
            compute
                .memcpy_dtod(
                    &slot.labels_dev.slice.slice(..labels.len()),
                    &mut labels_out.slice.slice_mut(..labels.len()),
                )
                .during("cuMemcpyDtoDAsync")?;
        }
        slot.consumed.record(compute).during("cuEventRecord")?;
        Ok(())
    }

    /// Checks a batch's sizes and labels, then copies its bytes and labels
    /// into the next slot and on to the device on the copy stream, with the
    /// compute stream ordered after the copy. Returns the slot's index.
    fn copy_in(
        &mut self,
        be: &CudaBackend,
        pixels: &[u8],
        labels: &[u32],
        classes: usize,
    ) -> CudaResult<usize> {
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

        // Host side: waits for this slot's previous host→device copy to have
        // read the pinned buffer (cudarc's own wait in as_mut_slice sees
        // only events it records, and the backend turns its tracking off).
        slot.copied.synchronize().during("cuEventSynchronize")?;
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
        be.compute_stream()
            .wait(&slot.copied)
            .during("cuStreamWaitEvent")?;
        Ok(index)
    }

    /// Takes the labels out of slot `index` and marks the slot free once the
    /// compute work queued so far (which read it) is done.
    fn finish(
        &mut self,
        be: &CudaBackend,
        index: usize,
        images: CudaTensor,
        labels: usize,
    ) -> CudaResult<StagedBatch> {
        let slot = &mut self.slots[index];
        let compute = be.compute_stream();
        let mut labels_out = be.alloc::<u32>(labels)?;
        if labels > 0 {
            compute
                .memcpy_dtod(
                    &slot.labels_dev.slice.slice(..labels),
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

/// A training set held on the device, u8 NHWC, sample after sample: batches
/// are then made there from recipes (`InputStaging::stage_recipes`) and no
/// pixels cross the link during training.
pub struct ResidentImages {
    pixels: DeviceBuffer<u8>,
    samples: usize,
    shape: [usize; 3],
}

impl std::fmt::Debug for ResidentImages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResidentImages")
            .field("samples", &self.samples)
            .field("shape", &self.shape)
            .finish()
    }
}

impl ResidentImages {
    /// Uploads `pixels`, whole samples of `shape` one after the other,
    /// through the memory pool (it counts against the device budget).
    pub fn upload(be: &CudaBackend, shape: [usize; 3], pixels: &[u8]) -> CudaResult<Self> {
        let sample = shape.iter().product::<usize>();
        if sample == 0 || !pixels.len().is_multiple_of(sample) {
            return Err(CudaError::shape(
                "ResidentImages::upload",
                format!("whole samples of {shape:?}"),
                format!("{} bytes", pixels.len()),
            ));
        }
        Ok(Self {
            pixels: be.upload(pixels)?,
            samples: pixels.len() / sample,
            shape,
        })
    }

    pub fn samples(&self) -> usize {
        self.samples
    }

    pub fn shape(&self) -> [usize; 3] {
        self.shape
    }

    /// Device bytes the set takes.
    pub fn bytes(&self) -> u64 {
        self.pixels.slice.len() as u64
    }

    /// The bytes that carry `recipes` to the device (two native-endian
    /// words each), once every recipe is checked against this set
    /// ([`check_recipes`]) and there is one label per recipe.
    pub fn recipe_bytes(&self, recipes: &[[u32; 2]], labels: &[u32]) -> CudaResult<Vec<u8>> {
        check_recipes(recipes, self.samples, self.shape)?;
        if recipes.len() != labels.len() {
            return Err(CudaError::shape(
                "ResidentImages::recipe_bytes",
                format!("{} labels (one per recipe)", recipes.len()),
                format!("{} labels", labels.len()),
            ));
        }
        Ok(recipes
            .iter()
            .flatten()
            .flat_map(|w| w.to_ne_bytes())
            .collect())
    }

    /// The batch that `n` recipes on the device (words from
    /// `recipe_bytes`, already checked) make from this set: gathered,
    /// cropped, flipped and normalised in one kernel.
    pub fn gather(
        &self,
        be: &CudaBackend,
        recipes: &CudaView<'_, u32>,
        n: usize,
        norm: Normalization,
    ) -> CudaResult<CudaTensor> {
        gather_crop_flip(
            be,
            &self.pixels.slice.as_view(),
            recipes,
            n,
            self.shape,
            norm,
        )
    }
}

/// Checks recipes `[id, dy | dx << 8 | flip << 16 | pad << 24]` against a set
/// of `samples` images of `shape`: every id inside the set, every crop
/// offset within twice the padding, the padding within the image, no other
/// bits. The gather kernel's reads stay in bounds only for recipes that pass.
pub fn check_recipes(recipes: &[[u32; 2]], samples: usize, shape: [usize; 3]) -> CudaResult<()> {
    let [h, w, _] = shape;
    for (i, &[id, word]) in recipes.iter().enumerate() {
        let pad = (word >> 24) as usize;
        let (dy, dx) = ((word & 255) as usize, ((word >> 8) & 255) as usize);
        let ok = (id as usize) < samples
            && pad <= h.min(w)
            && dy <= 2 * pad
            && dx <= 2 * pad
            && word & 0x00fe_0000 == 0;
        if !ok {
            return Err(CudaError::shape(
                "check_recipes",
                format!(
                    "sample ids below {samples}, pad at most {}, crop offsets at most 2 * pad",
                    h.min(w)
                ),
                format!("recipe {i}: id {id}, pad {pad}, dy {dy}, dx {dx}, word {word:#010x}"),
            ));
        }
    }
    Ok(())
}
