//! The GPU learner: `CudaNetwork` (mixed precision by default: f16
//! activations and compute weights, f32 masters; bf16 ones with
//! `device.precision = "bf16"`; or f32 activations reading the masters,
//! `device.amp = false`), the fused AdamW (unscale, inf check, clip,
//! moments, master update and f16 write-back in one pass per group) and
//! dynamic loss scaling. Batches cross the bus as u8 through the pinned
//! staging ring on the copy stream and are normalised on the device to the
//! network's storage type.
//!
//! A step never waits for the host, nor the host for a step: everything a
//! step decides stays on the device. The optimizer's verdict (inf/NaN),
//! the loss scale and AdamW's t live in device memory; a step whose
//! gradients overflow is skipped by the optimizer kernel, kernels put back
//! the batch-norm running statistics and dropout counters it changed (as
//! the CPU learner puts back every buffer), the scale halves and t
//! does not advance. A step whose finite gradients would still make an
//! update that is not finite (a learning rate far too high: the CPU's
//! `AdamW::step_if_finite`) is skipped the same way, found by a read-only
//! check kernel before any weight is written, but the scale is kept (the
//! overflow is not the scale's fault); `collect_step` logs it as the CPU
//! learner does. `submit_batch` queues a step and returns; its loss,
//! correct count, norm and verdict are copied into pinned memory
//! (`StepRecords`) and read by `collect_step`, which the training loop calls
//! one step later, while the GPU runs the next.
//!
//! With `data.on_device` the training set is held on the device
//! (`ResidentImages`) and a batch crosses the bus as recipes (sample id,
//! crop, flip: 8 bytes a sample) from which a kernel makes the same bits the
//! host would have.
//!
//! The steady-state step is captured into a CUDA graph and replayed
//! (`graph.rs`, `device.graphs`), with the same results as the eager step.
//!
//! Mixup/CutMix soft targets go up as f32 rows (smoothing applied as on the
//! CPU) to the soft-target cross-entropy kernel.
//!
//! A token model (`model.tokens`) reads text windows as the CPU learner
//! does: the ids (checked against the vocabulary on the host) go up as
//! f32 [n, t] and the targets as a label per token, so its loss, accuracy
//! and predictions are per token; its steady-state steps are captured too
//! (the graph reads the ids from its input buffer as f32). A
//! fine-tuning run starts from the CPU network `finetune::initialise`
//! loaded and froze (`from_network`): frozen parameters hold no gradient or
//! optimizer state on the device.
//!
//! A frame model (`model.frames`) reads frame sequences as the CPU learner
//! does: its input frames go up as images [n·f, h, w, c] (normalised on the
//! device like any batch), the target frames as u8, scored by pixel MSE on
//! the device; evaluation also scores the copy-last-frame baseline on the
//! host. Its steady-state steps are captured too: the graph's input
//! buffer holds the input frames and then the target frames.

use std::collections::VecDeque;

use headroom_loader::{Batch, Dataset, SampleRecipe};
use headroom_model::cuda::ops::TunedConv;
use headroom_model::cuda::{
    ops, CudaBackend, CudaBuildOptions, CudaError, CudaNetwork, CudaTensor, DType, DeviceBuffer,
    DeviceInfo, HalfFormat, InputStaging, Normalization, ProfileSegment, ResidentImages,
    StagedBatch, StateList, StatePiece, StepRecords, MAX_IN_FLIGHT,
};
use headroom_model::loss::pixel_mse_u8;
use headroom_model::memory::{try_zeroed, MemoryPool};
use headroom_model::{Device, ModelError, ModelSpec, Network, PoolStats, TokenInput};
use headroom_optim::{FusedAdamW, LossScalerConfig, LossScalerState};

mod graph;
mod ranks;
mod setup;

pub use ranks::NcclTransport;

use super::cpu::arg_max;
use super::top5_hits;
use super::{
    require_no_steps_in_flight, softmax_rows, EvalResult, HostState, Learner, LearnerState,
    StateWriter, StepLr, StepResult, StepSettings,
};
use crate::{PipelineError, Result};

/// GPU-specific settings.
#[derive(Clone, Debug)]
pub struct CudaOptions {
    pub build: CudaBuildOptions,
    pub loss_scaler: LossScalerConfig,
    /// The format of the 2-byte activations and compute weights (the
    /// backend must be opened with it: `CudaBackend::with_half`).
    pub half: HalfFormat,
    /// Hard budget on device memory (bytes).
    pub memory_limit: Option<u64>,
    /// Capture the steady-state step in a CUDA graph (`device.graphs`).
    pub graphs: bool,
    /// Values downloaded at once when the state is written with no copy of
    /// it (`Learner::write_state`): 1 MiB's worth of host memory by default,
    /// whatever the model's size.
    pub state_staging_values: usize,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            build: CudaBuildOptions::default(),
            loss_scaler: LossScalerConfig::default(),
            half: HalfFormat::F16,
            memory_limit: None,
            graphs: true,
            state_staging_values: 1 << 18,
        }
    }
}

fn cuda<T>(r: std::result::Result<T, CudaError>) -> Result<T> {
    r.map_err(|e| PipelineError::Model(ModelError::from(e)))
}

/// A step queued and not yet collected.
struct InFlight {
    /// Its slot in the records ring.
    slot: usize,
    /// Each micro-batch's share of the batch (its loss's weight).
    shares: Vec<f32>,
    /// Its learning-rate candidates: `lrs[j]` if the device found
    /// `first_applied + j` steps applied (for the log of a refused update).
    first_applied: u64,
    lrs: Vec<f32>,
    /// In a data-parallel run: the global batch's loss and correct count,
    /// as the ranks agreed on them.
    agreed: Option<(f64, u64)>,
}

/// An eager step's micro-batch shares and, with ranks, the global batch's
/// loss and correct count as the ranks agreed on them.
type EagerStep = (Vec<f32>, Option<(f64, u64)>);

pub struct CudaLearner {
    be: CudaBackend,
    network: CudaNetwork,
    optimizer: FusedAdamW,
    staging: InputStaging,
    staged_samples: usize,
    /// The training set, when it is held on the device (`data.on_device`).
    resident: Option<ResidentImages>,
    settings: StepSettings,
    micro_batch: usize,
    records: StepRecords,
    in_flight: VecDeque<InFlight>,
    /// Applied steps (AdamW's t) and the loss scale as of the last step
    /// collected (or restored).
    collected_applied: u64,
    collected_scale: f32,
    /// A loss scale of 1 in device memory, for evaluation.
    unit_scale: DeviceBuffer<f32>,
    macs_per_sample: u64,
    graphs: graph::Graphs,
    state_staging_values: usize,
    /// Set in a data-parallel run: the other ranks, over NCCL.
    ranks: Option<ranks::CudaRanks>,
}

impl CudaLearner {
    /// The network of `spec` on `be`, initialised as the CPU learner's.
    pub fn new(
        be: CudaBackend,
        spec: &ModelSpec,
        seed: u64,
        settings: StepSettings,
        batch_size: usize,
        options: CudaOptions,
    ) -> Result<Self> {
        let mut cpu = MemoryPool::new(Device::Cpu).scope(|| Network::build(spec, seed))?;
        Self::from_network(be, &mut cpu, settings, batch_size, options)
    }

    /// The GPU copy of a CPU network (its weights, buffers and frozen
    /// parameters: a fine-tuning base loaded into it).
    pub fn from_network(
        be: CudaBackend,
        cpu: &mut Network,
        settings: StepSettings,
        batch_size: usize,
        options: CudaOptions,
    ) -> Result<Self> {
        setup::check_storage(&be, &options)?;
        let limit = setup::tensor_budget(&be, options.memory_limit);
        cuda(be.set_memory_limit(limit))?;
        let mut network = CudaNetwork::from_cpu(&be, cpu, options.build)?;
        let staging = staging_for(&be, network.spec(), batch_size)?;
        let optimizer = FusedAdamW::new(
            &be,
            settings.optimizer.clone(),
            options.loss_scaler,
            network.groups_mut(),
        )?;
        Ok(Self {
            macs_per_sample: network.macs_per_sample(),
            records: cuda(StepRecords::new(&be, batch_size))?,
            unit_scale: cuda(be.upload(&[1.0f32]))?,
            be,
            network,
            optimizer,
            staging,
            staged_samples: batch_size.max(1),
            resident: None,
            settings,
            micro_batch: batch_size.max(1),
            in_flight: VecDeque::new(),
            collected_applied: 0,
            collected_scale: options.loss_scaler.init_scale,
            graphs: graph::Graphs::new(options.graphs),
            state_staging_values: options.state_staging_values.max(1),
            ranks: None,
        })
    }

    pub fn device(&self) -> &DeviceInfo {
        self.be.info()
    }

    /// The loss scale as of the last step collected.
    pub fn loss_scale(&self) -> f32 {
        self.collected_scale
    }

    /// Training steps that ran as a replay of a captured CUDA graph.
    pub fn graph_replays(&self) -> u64 {
        self.graphs.replays
    }

    /// With GPU ranks, the last step's (gradient buckets queued for the
    /// ranks' reduction while backward still had layers to run, buckets
    /// in all); None without ranks.
    pub fn ranked_buckets(&self) -> Option<(usize, usize)> {
        self.ranks.as_ref().map(|r| r.last_step)
    }

    /// A staging ring for batches of `samples` samples, if the one there
    /// is smaller.
    fn ensure_staging(&mut self, samples: usize) -> Result<()> {
        if samples > self.staged_samples {
            self.staging = staging_for(&self.be, self.network.spec(), samples)?;
            self.staged_samples = samples;
        }
        Ok(())
    }

    /// How a batch becomes the network's input on the device.
    fn normalization(&self) -> Normalization {
        let spec = self.network.spec();
        Normalization {
            mean: spec.mean,
            std: spec.std,
            dtype: self.network.activations(),
        }
    }

    /// Dynamic loss scaling (f16 mixed precision), or a loss scale fixed
    /// at 1 (bf16 and f32 training), whose checkpoints record no scale.
    fn scales_loss(&self) -> bool {
        let scaler = self.optimizer.scaler_config();
        scaler.max_scale > scaler.min_scale
    }

    /// Copies a micro-batch to the device and normalises it there; a token
    /// model's ids and per-token targets.
    fn stage(&mut self, part: &Batch) -> Result<StagedBatch> {
        if part.features.is_some() || part.values.is_some() {
            return Err(PipelineError::value(
                "device.kind",
                "the GPU learner reads u8 images and token ids; this data holds f32 features or \
                 numeric targets, which train on the CPU for now (device.kind = \"cpu\")",
            ));
        }
        if let Some(tokens) = self.network.spec().tokens {
            return self.stage_tokens(part, tokens);
        }
        if self.network.spec().frames.is_some() {
            return Err(PipelineError::value(
                "model.frames",
                "a frame model's batches carry target frames, not labels (stage_frames)",
            ));
        }
        self.ensure_staging(part.len())?;
        let norm = self.normalization();
        let classes = self.network.num_classes();
        let Some(recipes) = &part.recipes else {
            return cuda(self.staging.stage(
                &self.be,
                &part.shape,
                &part.pixels,
                &part.labels,
                classes,
                norm,
            ));
        };
        let set = self.resident.as_ref().ok_or_else(|| {
            PipelineError::value(
                "data.on_device",
                "a batch of sample recipes reached a learner that holds no dataset",
            )
        })?;
        let packed: Vec<[u32; 2]> = recipes.iter().map(SampleRecipe::packed).collect();
        cuda(
            self.staging
                .stage_recipes(&self.be, set, &packed, &part.labels, classes, norm),
        )
    }

    /// A batch of text windows: the ids [n, t] as f32, the next byte of
    /// each as its label.
    fn stage_tokens(&self, part: &Batch, tokens: TokenInput) -> Result<StagedBatch> {
        let (ids, targets) = part.next_token_pairs();
        let ids = tokens.id_values(&ids)?;
        let shape = [part.len(), tokens.length];
        let be = &self.be;
        Ok(StagedBatch {
            images: cuda(CudaTensor::from_host(be, &shape, &ids, DType::F32))?,
            labels: cuda(be.upload(&targets))?,
        })
    }

    /// A batch of frame sequences: the first `frames` frames of each as
    /// images [n·frames, h, w, c], normalised on the device, and the last
    /// `frames` (each input frame's successor) as u8 targets.
    fn stage_frames(&mut self, part: &Batch, frames: usize) -> Result<StagedFrames> {
        let (inputs, targets) = part.next_frame_pairs(frames);
        let [h, w, c] = self.network.spec().input;
        let images = part.len() * frames;
        self.ensure_staging(images)?;
        let norm = self.normalization();
        // The ring carries a label per image; a frame model has none.
        let labels = vec![0u32; images];
        let classes = self.network.num_classes().max(1);
        let shape = [images, h, w, c];
        let staged = cuda(
            self.staging
                .stage(&self.be, &shape, &inputs, &labels, classes, norm),
        )?;
        Ok(StagedFrames {
            staged,
            targets: cuda(self.be.upload(&targets))?,
            host: (inputs, targets),
        })
    }

    /// A micro-batch on the device, with a frame model's target frames.
    fn stage_part(&mut self, part: &Batch) -> Result<(StagedBatch, Option<DeviceBuffer<u8>>)> {
        match self.network.spec().frames {
            Some(frames) => {
                let StagedFrames {
                    staged, targets, ..
                } = self.stage_frames(part, frames)?;
                Ok((staged, Some(targets)))
            }
            None => Ok((self.stage(part)?, None)),
        }
    }

    /// Queues a step: its schedule, its kernels (a graph replay or one
    /// launch at a time), then the copies of its record.
    fn submit(&mut self, batch: &Batch, lr: StepLr<'_>) -> Result<()> {
        if self.in_flight.len() >= MAX_IN_FLIGHT {
            return Err(PipelineError::Stage {
                stage: "learner",
                reason: format!(
                    "{} steps are in flight, the most the GPU learner queues; collect one first",
                    self.in_flight.len()
                ),
            });
        }
        let parts = batch.len().div_ceil(self.micro_batch).max(1);
        if parts > self.records.parts() {
            require_no_steps_in_flight(self.in_flight.len(), "a step with more micro-batches")?;
            self.graphs.forget();
            self.records = cuda(StepRecords::new(&self.be, parts))?;
        }
        let lrs: Vec<f32> = (0..=self.in_flight.len() as u64)
            .map(|j| (lr.at)(lr.applied + j))
            .collect();
        let first_applied = self.collected_applied;
        self.optimizer.set_schedule(&self.be, first_applied, &lrs)?;
        let (shares, agreed) = match self.graph_step(batch)? {
            Some(shares) => (shares, None),
            None => self.eager_step(batch)?,
        };
        let slot = cuda(
            self.records
                .copy_out(&self.be, self.optimizer.state(), shares.len()),
        )?;
        self.in_flight.push_back(InFlight {
            slot,
            shares,
            first_applied,
            lrs,
            agreed,
        });
        Ok(())
    }

    /// The step one launch at a time, in micro-batches: each micro-batch's
    /// share of the batch (and, with ranks, the global batch's loss and
    /// correct count). A failure part-way puts the running statistics and
    /// dropout counters back.
    fn eager_step(&mut self, batch: &Batch) -> Result<EagerStep> {
        cuda(self.network.save_step_buffers(&self.be))?;
        let result = self.eager_parts(batch);
        if result.is_err() {
            cuda(self.network.restore_step_buffers(&self.be))?;
        }
        result
    }

    fn eager_parts(&mut self, batch: &Batch) -> Result<EagerStep> {
        let local = self.forward_backward(batch);
        let (shares, agreed) = match self.ranks.is_some() {
            true => {
                let (shares, agreed) = self.agree_with_ranks(local)?;
                (shares, Some(agreed))
            }
            false => (local?, None),
        };
        self.finish_on_device()?;
        cuda(
            self.be
                .profile_mark(|| "optimizer: unscale, clip, AdamW".into()),
        )?;
        Ok((shares, agreed))
    }

    /// Forward and backward over the micro-batches, each loss weighted by
    /// its share of the (global) batch: the shares.
    fn forward_backward(&mut self, batch: &Batch) -> Result<Vec<f32>> {
        let (rank, world) = self
            .ranks
            .as_ref()
            .map_or((0, 1), |r| (r.ranks.rank, r.ranks.world));
        let n = batch.len() * world;
        let mut shares = Vec::new();
        let parts = batch.micro_batches(self.micro_batch).count();
        // Rank r's micro-batches are one process's r·M … r·M + M − 1 of
        // the global batch: their dropout masks too (the counters were
        // saved before, so a failed or skipped step puts them back).
        cuda(
            self.network
                .advance_dropout(&self.be, (rank * parts) as u64),
        )?;
        for (index, part) in batch.micro_batches(self.micro_batch).enumerate() {
            let share = part.len() as f32 / n as f32;
            let (staged, frames) = self.stage_part(&part)?;
            let be = &self.be;
            cuda(be.profile_mark(|| "input: staged, normalised".into()))?;
            let scale = ops::GradScale {
                loss_scale: self.optimizer.loss_scale(),
                share,
            };
            let logits = cuda(self.network.forward_train(be, &staged.images))?;
            let xent = match (&frames, &part.soft_targets) {
                (Some(targets), _) => {
                    cuda(ops::pixel_mse(be, &logits, &targets.slice.as_view(), scale))?
                }
                (None, None) => training_loss(be, &self.settings, &logits, &staged.labels, scale)?,
                (None, Some(soft)) => {
                    let smoothed =
                        smoothed_targets(soft, self.settings.label_smoothing, part.len());
                    let targets = cuda(be.upload(&smoothed))?;
                    let targets = targets.slice.as_view();
                    cuda(match self.settings.focal_gamma {
                        Some(gamma) => ops::soft_focal_loss(be, &logits, &targets, gamma, scale),
                        None => ops::soft_cross_entropy(be, &logits, &targets, scale),
                    })?
                }
            };
            drop(logits);
            let at = shares.len();
            cuda(xent.summary_into(
                be,
                &mut self.records.losses.slice.slice_mut(at..at + 1),
                &mut self.records.corrects.slice.slice_mut(at..at + 1),
            ))?;
            shares.push(share);
            cuda(be.profile_mark(|| "loss: softmax cross-entropy".into()))?;
            match self.ranks.as_mut() {
                // The last micro-batch's backward hands each bucket of
                // finished gradients to the ranks' reduction as it goes.
                Some(ranks) if index + 1 == parts => cuda(self.network.backward_with(
                    be,
                    &xent.grad,
                    &mut |groups, floor| ranks.queue_final(be, groups, floor),
                ))?,
                _ => cuda(self.network.backward(be, &xent.grad))?,
            }
        }
        // The later ranks' forwards: every rank's counters end the step
        // world·M on.
        let later = (world - 1 - rank) * parts;
        cuda(self.network.advance_dropout(&self.be, later as u64))?;
        Ok(shares)
    }

    /// The end of every step, eager or captured: the optimizer, then the
    /// running statistics and dropout counters put back if it skipped the
    /// step.
    fn finish_on_device(&mut self) -> Result<()> {
        let be = &self.be;
        self.optimizer
            .enqueue(be, self.network.groups_mut(), self.settings.clip_norm, true)?;
        cuda(
            self.network
                .restore_step_buffers_if_skipped(be, self.optimizer.state()),
        )
    }

    /// The oldest step in flight, read once its record is in host memory.
    fn collect(&mut self) -> Result<Option<StepResult>> {
        let Some(step) = self.in_flight.pop_front() else {
            return Ok(None);
        };
        let record = cuda(self.records.read(step.slot, step.shares.len()))?;
        let state = record.state;
        if state.schedule_missed != 0 {
            return Err(PipelineError::Stage {
                stage: "learner",
                reason: format!(
                    "the GPU found {} applied steps, for which the host gave no learning rate",
                    state.applied
                ),
            });
        }
        if state.update_overflow != 0 {
            // The CPU learner's warning (`AdamW::step_if_finite`); the device
            // does not say which weight. The trainer counts the skip like
            // any other (`train.max_consecutive_skips`).
            let lr = state
                .applied
                .checked_sub(step.first_applied)
                .and_then(|j| step.lrs.get(j as usize))
                .map_or_else(|| "?".to_string(), |lr| format!("{lr:e}"));
            tracing::warn!(
                "step skipped: its update (learning rate {lr}) would make a weight or its AdamW \
                 moments not finite (or, in mixed precision, a weight's f16 copy); nothing \
                 changed and the loss scale is kept"
            );
        }
        self.collected_applied = state.applied;
        self.collected_scale = state.next_scale;
        let (loss, correct) = match step.agreed {
            Some((loss, correct)) => (loss, correct as usize),
            None => (
                record
                    .losses
                    .iter()
                    .zip(&step.shares)
                    .map(|(&loss, &share)| loss as f64 * share as f64)
                    .sum(),
                record.corrects.iter().map(|&c| c as usize).sum(),
            ),
        };
        if let Some(ranks) = &self.ranks {
            // An applied step's running statistics become the ranks' mean (a
            // skipped step's were put back, equal on every rank already).
            if state.skipped == 0 {
                ranks.average_buffers(&self.be, &mut self.network)?;
            }
        }
        Ok(Some(StepResult {
            loss: loss as f32,
            correct,
            grad_norm: (state.skipped == 0).then_some(state.grad_norm),
        }))
    }

    /// Back to the state before a dry run.
    fn undo_step(&mut self) -> Result<()> {
        self.network.clear_saved();
        cuda(self.network.zero_grad(&self.be))?;
        cuda(self.network.restore_step_buffers(&self.be))
    }
}

/// A frame model's micro-batch: its input frames as images on the device,
/// its target frames, and both as u8 on the host (the baseline).
struct StagedFrames {
    staged: StagedBatch,
    targets: DeviceBuffer<u8>,
    host: (Vec<u8>, Vec<u8>),
}

impl CudaLearner {
    /// Evaluation of a frame model: the per-pixel MSE of its predictions
    /// and of the copy-last-frame baseline, as per-sample sums.
    fn eval_frames(&mut self, batch: &Batch, frames: usize) -> Result<EvalResult> {
        let mut result = EvalResult {
            loss_sum: 0.0,
            predictions: Vec::new(),
            baseline_loss_sum: Some(0.0),
            values: None,
            top5_correct: None,
        };
        for part in batch.micro_batches(self.micro_batch) {
            let staged = self.stage_frames(&part, frames)?;
            let be = &self.be;
            let predictions = cuda(self.network.forward_eval(be, &staged.staged.images))?;
            let unit = ops::GradScale {
                loss_scale: &self.unit_scale.slice,
                share: 1.0,
            };
            let targets = staged.targets.slice.as_view();
            let mse = cuda(ops::pixel_mse(be, &predictions, &targets, unit))?;
            let (loss, _) = cuda(mse.read_summary(be))?;
            let samples = part.len() as f64;
            result.loss_sum += loss as f64 * samples;
            let (inputs, targets) = &staged.host;
            if let Some(sum) = result.baseline_loss_sum.as_mut() {
                *sum += pixel_mse_u8(inputs, targets) * samples;
            }
        }
        Ok(result)
    }
}

/// Mixup/CutMix targets with label smoothing, as the CPU learner forms them.
/// The training loss against hard labels: label-smoothed cross-entropy, or
/// focal loss with `settings.focal_gamma` (`train.loss = "focal"`).
pub(crate) fn training_loss(
    be: &CudaBackend,
    settings: &StepSettings,
    logits: &CudaTensor,
    labels: &DeviceBuffer<u32>,
    scale: ops::GradScale<'_>,
) -> Result<ops::XentOutput> {
    let smoothing = settings.label_smoothing;
    let labels = &labels.slice.as_view();
    cuda(match settings.focal_gamma {
        Some(gamma) => ops::focal_loss(be, logits, labels, smoothing, gamma, scale),
        None => ops::softmax_cross_entropy(be, logits, labels, smoothing, scale),
    })
}

fn smoothed_targets(soft: &[f32], smoothing: f32, rows: usize) -> Vec<f32> {
    let classes = soft.len() / rows.max(1);
    soft.iter()
        .map(|&p| (1.0 - smoothing) * p + smoothing / classes as f32)
        .collect()
}

/// A ring for batches of up to `samples` samples, as pixels or as recipes
/// (8 bytes a sample), or a token model's ids (f32) and per-token targets.
fn staging_for(be: &CudaBackend, spec: &ModelSpec, samples: usize) -> Result<InputStaging> {
    let samples = samples.max(1);
    if let Some(tokens) = spec.tokens {
        let ids = samples * tokens.length;
        return cuda(InputStaging::new(be, 2, ids * size_of::<f32>(), ids));
    }
    let [h, w, c] = spec.input;
    // A frame model's samples here are frames: its input frames, and for a
    // captured step its target frames beside them.
    let copies = if spec.frames.is_some() { 2 } else { 1 };
    let per_sample = (copies * h * w * c).max(size_of::<[u32; 2]>());
    cuda(InputStaging::new(be, 2, samples * per_sample, samples))
}

/// Every sample of `dataset`, one after the other, for the device.
fn read_all(dataset: &dyn Dataset) -> Result<Vec<u8>> {
    let sample = dataset.sample_shape().iter().product::<usize>();
    let mut pixels = vec![0u8; dataset.len() * sample];
    for (index, out) in pixels.chunks_exact_mut(sample.max(1)).enumerate() {
        dataset.read(index, out).map_err(|e| {
            PipelineError::value(
                "data.on_device",
                format!("reading sample {index} to hold the training set on the GPU: {e}"),
            )
        })?;
    }
    Ok(pixels)
}

impl Learner for CudaLearner {
    fn submit_batch(&mut self, batch: &Batch, lr: StepLr<'_>) -> Result<()> {
        let result = self.submit(batch, lr);
        if result.is_err() {
            // The step's buffers are back already (`eager_step`; a
            // graph that failed to launch ran nothing).
            self.network.clear_saved();
            cuda(self.network.zero_grad(&self.be))?;
        }
        result
    }

    fn collect_step(&mut self) -> Result<Option<StepResult>> {
        self.collect()
    }

    fn steps_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// One step queued behind the one running: the host stages and queues
    /// step s+1 while the GPU runs step s. None with ranks: a ranked step
    /// waits for its reduction and its record exchange, and the buffers'
    /// mean follows it.
    fn pipeline_depth(&self) -> usize {
        match self.ranks {
            Some(_) => 0,
            None => 1,
        }
    }

    fn eval_batch(&mut self, batch: &Batch) -> Result<EvalResult> {
        self.graphs.forget();
        if let Some(frames) = self.network.spec().frames {
            return self.eval_frames(batch, frames);
        }
        let classes = self.network.num_classes();
        let mut result = EvalResult {
            loss_sum: 0.0,
            predictions: Vec::with_capacity(batch.len()),
            baseline_loss_sum: None,
            values: None,
            top5_correct: None,
        };
        for part in batch.micro_batches(self.micro_batch) {
            let staged = self.stage(&part)?;
            let be = &self.be;
            let logits = cuda(self.network.forward_eval(be, &staged.images))?;
            let unit = ops::GradScale {
                loss_scale: &self.unit_scale.slice,
                share: 1.0,
            };
            let xent = cuda(ops::softmax_cross_entropy(
                be,
                &logits,
                &staged.labels.slice.as_view(),
                0.0,
                unit,
            ))?;
            let (loss, _) = cuda(xent.read_summary(be))?;
            result.loss_sum += loss as f64 * part.len() as f64;
            let values = cuda(logits.to_host(be))?;
            // One row per sample (a token model's rows are its tokens').
            if values.len() == classes * part.len() {
                if let Some(hits) = top5_hits(&values, &part.labels, classes) {
                    *result.top5_correct.get_or_insert(0) += hits;
                }
            }
            result
                .predictions
                .extend(values.chunks_exact(classes).map(arg_max));
        }
        Ok(result)
    }

    fn eval_probabilities(&mut self, batch: &Batch) -> Result<Vec<f32>> {
        self.graphs.forget();
        let classes = self.network.num_classes();
        let mut probabilities = Vec::with_capacity(batch.len() * classes);
        for part in batch.micro_batches(self.micro_batch) {
            let staged = self.stage(&part)?;
            let logits = cuda(self.network.forward_eval(&self.be, &staged.images))?;
            probabilities.extend(cuda(logits.to_host(&self.be))?);
        }
        softmax_rows(&mut probabilities, classes);
        Ok(probabilities)
    }

    fn uses_batch_statistics(&self) -> bool {
        self.network.spec().uses_batch_statistics()
    }

    fn micro_batch(&self) -> usize {
        self.micro_batch
    }

    fn set_micro_batch(&mut self, size: usize) {
        if size.max(1) != self.micro_batch {
            self.graphs.forget();
        }
        self.micro_batch = size.max(1);
    }

    fn snapshot(&mut self) -> Result<LearnerState> {
        require_no_steps_in_flight(self.in_flight.len(), "snapshot")?;
        // Downloaded tensor by tensor into memory taken fallibly: the host
        // holds each value once, and short memory is a value, not an abort.
        let mut state = HostState::default();
        self.write_state(&mut state)?;
        state.into_state()
    }

    fn write_state(&mut self, out: &mut dyn StateWriter) -> Result<()> {
        require_no_steps_in_flight(self.in_flight.len(), "write_state")?;
        let be = &self.be;
        let state = self.optimizer.read_state(be)?;
        let mut staging = try_zeroed(self.state_staging_values)?;
        let mut lists = vec![StateList::Params, StateList::Buffers];
        if state.applied > 0 {
            lists.extend([StateList::FirstMoments, StateList::SecondMoments]);
        }
        for list in lists {
            self.network
                .stream_state(be, list, &mut staging, &mut |piece| match piece {
                    StatePiece::List(count) => out.list(count),
                    StatePiece::Tensor(len) => out.tensor(len),
                    StatePiece::Values(values) => out.values(values),
                })?;
        }
        if state.applied == 0 {
            // No step yet: no moments, as the CPU learner has none then.
            out.list(0)?;
            out.list(0)?;
        }
        let loss_scale = self.scales_loss().then_some(LossScalerState {
            scale: state.next_scale,
            clean_steps: state.clean_steps,
        });
        out.finish(state.applied, loss_scale)
    }

    fn restore(&mut self, state: LearnerState) -> std::result::Result<(), String> {
        require_no_steps_in_flight(self.in_flight.len(), "restore").map_err(|e| e.to_string())?;
        let LearnerState {
            params,
            buffers,
            optimizer,
            loss_scale,
        } = state;
        // A CPU or f32 checkpoint has no scale: the scaler starts afresh
        // (f32 training holds it at 1 whatever the checkpoint says). Checked
        // before anything changes.
        let config: LossScalerConfig = *self.optimizer.scaler_config();
        let scale = config.admit(loss_scale.unwrap_or(LossScalerState {
            scale: config.init_scale,
            clean_steps: 0,
        }))?;
        let zeros: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
        let (first, second) = if optimizer.step == 0 {
            (&zeros, &zeros)
        } else {
            (&optimizer.first_moment, &optimizer.second_moment)
        };
        self.network.check_state(&params, &buffers, first)?;
        self.network.check_state(&params, &buffers, second)?;
        self.graphs.forget();
        self.network
            .load_state(&self.be, &params, &buffers, (first, second))
            .map_err(|e| e.to_string())?;
        let admitted = self
            .optimizer
            .load_state(&self.be, scale, optimizer.step)
            .map_err(|e| e.to_string())?;
        self.collected_applied = optimizer.step;
        self.collected_scale = admitted.scale;
        Ok(())
    }

    fn measure_step_peak(&mut self, micro_batch: usize) -> Result<u64> {
        self.graphs.forget();
        let be = &self.be;
        let before = be.memory_stats().in_use_bytes;
        be.reset_peak();
        cuda(self.network.save_step_buffers(be))?;
        let dry_run = (|| -> std::result::Result<(), CudaError> {
            let input = self.network.zeros_input(be, micro_batch)?;
            let logits = self.network.forward_train(be, &input)?;
            let grad = headroom_model::cuda::CudaTensor::zeros(be, logits.shape(), logits.dtype())?;
            drop(logits);
            self.network.backward(be, &grad)
        })();
        self.undo_step()?;
        cuda(dry_run)?;
        let peak = self.be.memory_stats().peak_in_use_bytes;
        Ok(peak.saturating_sub(before))
    }

    fn memory_stats(&self) -> PoolStats {
        let m = self.be.memory_stats();
        PoolStats {
            in_use_bytes: m.in_use_bytes,
            reserved_bytes: m.reserved_bytes.max(m.in_use_bytes),
            peak_in_use_bytes: m.peak_in_use_bytes,
            peak_reserved_bytes: m.reserved_bytes.max(m.peak_in_use_bytes),
            allocations: m.allocations,
            oom_events: m.oom_events,
            ..PoolStats::default()
        }
    }

    fn memory_limit(&self) -> Option<u64> {
        self.be.memory_stats().limit
    }

    fn release_cache(&mut self) -> u64 {
        // A captured step holds its working set; the next step captures
        // afresh.
        self.graphs.forget();
        let before = self.be.memory_stats().reserved_bytes;
        if let Err(e) = self.be.empty_cache() {
            tracing::warn!("could not release cached GPU memory: {e}");
        }
        before.saturating_sub(self.be.memory_stats().reserved_bytes)
    }

    fn num_params(&mut self) -> usize {
        self.network.num_params()
    }

    fn num_trainable_params(&mut self) -> usize {
        self.network.num_trainable_params()
    }

    fn macs_per_sample(&self) -> Result<u64> {
        Ok(self.macs_per_sample)
    }

    fn num_classes(&self) -> usize {
        self.network.num_classes()
    }

    fn device_name(&self) -> String {
        self.be.info().to_string()
    }

    fn tuned_convolutions(&self) -> Vec<TunedConv> {
        self.be.tuned_convolutions()
    }

    fn restore_tuned_convolutions(&mut self, tuned: &[TunedConv]) {
        self.be.restore_tuned_convolutions(tuned);
    }

    /// A quarter of the device budget: the rest is for the model, its
    /// activations and the cache.
    fn profile_start(&mut self) -> Result<bool> {
        require_no_steps_in_flight(self.in_flight.len(), "starting a profile")?;
        self.graphs.forget();
        self.graphs.profiling = true;
        cuda(self.be.profile_start())?;
        Ok(true)
    }

    fn profile_finish(&mut self) -> Result<Vec<ProfileSegment>> {
        require_no_steps_in_flight(self.in_flight.len(), "finishing a profile")?;
        self.graphs.profiling = false;
        cuda(self.be.profile_finish())
    }

    /// None for a token or frame model: its samples are staged per batch
    /// (the resident set and its kernels are images).
    fn resident_capacity(&self) -> Option<u64> {
        let spec = self.network.spec();
        if spec.tokens.is_some() || spec.frames.is_some() {
            return None;
        }
        let m = self.be.memory_stats();
        let budget = m.limit.unwrap_or(self.be.info().total_memory);
        Some(budget / 4)
    }

    /// Joins GPU ranks over NCCL (`NcclTransport`): each step's gradients
    /// are then summed over the ranks on the device, in rank order.
    fn join_ranks(&mut self, ranks: crate::ranks::Ranks) -> Result<()> {
        require_no_steps_in_flight(self.in_flight.len(), "joining ranks")?;
        let joined = ranks::CudaRanks::new(&self.be, &mut self.network, ranks)?;
        self.graphs.forget();
        self.graphs.enabled = false;
        tracing::info!(
            "cuda path: step: launched, not captured (GPU ranks): the gradients are summed over \
             the {} rank(s) through NCCL in rank order, {} bucket(s) queued on the communication \
             stream as backward finishes them; the ranks agree on the step before the optimizer \
             runs",
            joined.ranks.world,
            joined.last_step.1.max(joined.bucket_count())
        );
        self.ranks = Some(joined);
        Ok(())
    }

    fn ranks(&self) -> Option<crate::ranks::Ranks> {
        self.ranks.as_ref().map(|r| r.ranks.clone())
    }

    fn hold_resident(&mut self, dataset: &dyn Dataset) -> Result<()> {
        let shape = dataset.sample_shape();
        if shape != self.network.spec().input {
            return Err(PipelineError::value(
                "data.on_device",
                format!(
                    "the dataset's samples are {shape:?} but the model reads {:?}",
                    self.network.spec().input
                ),
            ));
        }
        self.graphs.forget();
        self.resident = None;
        let pixels = read_all(dataset)?;
        self.resident = Some(cuda(ResidentImages::upload(&self.be, shape, &pixels))?);
        Ok(())
    }
}
