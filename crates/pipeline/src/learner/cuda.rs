//! The mixed-precision GPU learner: `CudaNetwork` (f16 activations and
//! compute weights, f32 masters), the fused AdamW (unscale, inf check, clip,
//! moments, master update and f16 write-back in one pass per group) and
//! dynamic loss scaling. Batches cross the bus as u8 through the pinned
//! staging ring on the copy stream and are normalised to f16 on the device.
//!
//! A step reads back one small verdict (inf flag, gradient norm) and the
//! loss once the optimizer is queued: the only host synchronisation of a
//! step. A step whose gradients overflow is skipped by the optimizer kernel;
//! the batch-norm running statistics it changed are put back, the loss scale
//! halves, and the step counter (the `t` of AdamW) does not advance.
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
//! CPU) to the soft-target cross-entropy kernel. Not on the GPU yet, each
//! refused with a message naming it: f32 training (`--no-amp`), the
//! sequence layers.

use headroom_loader::{Batch, Dataset, SampleRecipe};
use headroom_model::cuda::params::StepState;
use headroom_model::cuda::{
    ops, CudaBackend, CudaBuildOptions, CudaError, CudaNetwork, DeviceInfo, InputStaging,
    ResidentImages, StagedBatch,
};
use headroom_model::{ModelError, ModelSpec, PoolStats};
use headroom_optim::{AdamWState, FusedAdamW, LossScaler, LossScalerConfig, StepOutcome};

mod graph;

use super::cpu::arg_max;
use super::{softmax_rows, EvalResult, Learner, LearnerState, StepResult, StepSettings};
use crate::{PipelineError, Result};

/// GPU-specific settings.
#[derive(Clone, Debug)]
pub struct CudaOptions {
    pub build: CudaBuildOptions,
    pub loss_scaler: LossScalerConfig,
    /// Hard budget on device memory (bytes).
    pub memory_limit: Option<u64>,
    /// Capture the steady-state step in a CUDA graph (`device.graphs`).
    pub graphs: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            build: CudaBuildOptions::default(),
            loss_scaler: LossScalerConfig::default(),
            memory_limit: None,
            graphs: true,
        }
    }
}

fn cuda<T>(r: std::result::Result<T, CudaError>) -> Result<T> {
    r.map_err(|e| PipelineError::Model(ModelError::from(e)))
}

pub struct CudaLearner {
    be: CudaBackend,
    network: CudaNetwork,
    optimizer: FusedAdamW,
    scaler: LossScaler,
    staging: InputStaging,
    staged_samples: usize,
    /// The training set, when it is held on the device (`data.on_device`).
    resident: Option<ResidentImages>,
    settings: StepSettings,
    micro_batch: usize,
    /// Applied optimizer steps (AdamW's t).
    applied_steps: u64,
    macs_per_sample: u64,
    graphs: graph::Graphs,
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
        // Without a budget, 90% of what was free at start: the policy then
        // adapts before the driver refuses (which is handled too).
        let limit = options
            .memory_limit
            .or_else(|| Some(be.info().free_memory / 10 * 9).filter(|&b| b > 0));
        be.set_memory_limit(limit);
        let mut network = CudaNetwork::build(&be, spec, seed, options.build)?;
        let optimizer = FusedAdamW::new(&be, settings.optimizer.clone(), network.groups_mut())?;
        let scaler = LossScaler::new(options.loss_scaler).map_err(ModelError::State)?;
        let staging = staging_for(&be, spec, batch_size)?;
        Ok(Self {
            macs_per_sample: network.macs_per_sample(),
            be,
            network,
            optimizer,
            scaler,
            staging,
            staged_samples: batch_size.max(1),
            resident: None,
            settings,
            micro_batch: batch_size.max(1),
            applied_steps: 0,
            graphs: graph::Graphs::new(options.graphs),
        })
    }

    pub fn device(&self) -> &DeviceInfo {
        self.be.info()
    }

    pub fn loss_scale(&self) -> f32 {
        self.scaler.scale()
    }

    /// Training steps that ran as a replay of a captured CUDA graph.
    pub fn graph_replays(&self) -> u64 {
        self.graphs.replays
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

    /// Copies a micro-batch to the device and normalises it there.
    fn stage(&mut self, part: &Batch) -> Result<StagedBatch> {
        self.ensure_staging(part.len())?;
        let spec = self.network.spec();
        let classes = self.network.num_classes();
        let Some(recipes) = &part.recipes else {
            return cuda(self.staging.stage(
                &self.be,
                &part.shape,
                &part.pixels,
                &part.labels,
                classes,
                spec.mean,
                spec.std,
            ));
        };
        let set = self.resident.as_ref().ok_or_else(|| {
            PipelineError::value(
                "data.on_device",
                "a batch of sample recipes reached a learner that holds no dataset",
            )
        })?;
        let packed: Vec<[u32; 2]> = recipes.iter().map(SampleRecipe::packed).collect();
        cuda(self.staging.stage_recipes(
            &self.be,
            set,
            &packed,
            &part.labels,
            classes,
            spec.mean,
            spec.std,
        ))
    }

    fn step(&mut self, batch: &Batch, lr: f32) -> Result<StepResult> {
        match self.graph_step(batch, lr)? {
            Some(result) => Ok(result),
            None => self.eager_step(batch, lr),
        }
    }

    /// The step one launch at a time, in micro-batches.
    fn eager_step(&mut self, batch: &Batch, lr: f32) -> Result<StepResult> {
        cuda(self.network.save_running_stats(&self.be))?;
        let scale = self.scaler.scale();
        let n = batch.len();
        let mut summaries = Vec::new();
        for part in batch.micro_batches(self.micro_batch) {
            let share = part.len() as f32 / n as f32;
            let staged = self.stage(&part)?;
            let be = &self.be;
            let logits = cuda(self.network.forward_train(be, &staged.images))?;
            let xent = match &part.soft_targets {
                None => cuda(ops::softmax_cross_entropy(
                    be,
                    &logits,
                    &staged.labels.slice.as_view(),
                    self.settings.label_smoothing,
                    scale * share,
                ))?,
                Some(soft) => {
                    let smoothed =
                        smoothed_targets(soft, self.settings.label_smoothing, part.len());
                    let targets = cuda(be.upload(&smoothed))?;
                    cuda(ops::soft_cross_entropy(
                        be,
                        &logits,
                        &targets.slice.as_view(),
                        scale * share,
                    ))?
                }
            };
            drop(logits);
            summaries.push((cuda(xent.summary(be))?, share));
            cuda(self.network.backward(be, &xent.grad))?;
        }
        let be = &self.be;
        self.optimizer.step(
            be,
            self.network.groups_mut(),
            lr,
            self.applied_steps + 1,
            scale,
            self.settings.clip_norm,
            true,
        )?;
        let verdict = self.optimizer.read_state(be)?;
        let (mut loss, mut correct) = (0.0f64, 0usize);
        for ((loss_dev, correct_dev), share) in &summaries {
            loss += cuda(be.download(&loss_dev.slice))?[0] as f64 * *share as f64;
            correct += cuda(be.download(&correct_dev.slice))?[0] as usize;
        }
        self.finish_step(verdict, scale, loss, correct)
    }

    /// The loss scaler's verdict on a step whose kernels have run: an
    /// applied step advances t; a skipped one puts the running statistics
    /// back.
    fn finish_step(
        &mut self,
        verdict: StepState,
        scale: f32,
        loss: f64,
        correct: usize,
    ) -> Result<StepResult> {
        let grad_norm = match self.scaler.update(scale, verdict.found_inf != 0) {
            StepOutcome::Applied => {
                self.applied_steps += 1;
                Some(verdict.grad_norm)
            }
            StepOutcome::Skipped => {
                cuda(self.network.restore_running_stats(&self.be))?;
                None
            }
        };
        Ok(StepResult {
            loss: loss as f32,
            correct,
            grad_norm,
        })
    }

    /// Back to the state before a step that failed part-way.
    fn undo_step(&mut self) -> Result<()> {
        self.network.clear_saved();
        cuda(self.network.zero_grad(&self.be))?;
        cuda(self.network.restore_running_stats(&self.be))
    }
}

/// Mixup/CutMix targets with label smoothing, as the CPU learner forms them.
fn smoothed_targets(soft: &[f32], smoothing: f32, rows: usize) -> Vec<f32> {
    let classes = soft.len() / rows.max(1);
    soft.iter()
        .map(|&p| (1.0 - smoothing) * p + smoothing / classes as f32)
        .collect()
}

/// A ring for batches of up to `samples` samples, as pixels or as recipes
/// (8 bytes a sample).
fn staging_for(be: &CudaBackend, spec: &ModelSpec, samples: usize) -> Result<InputStaging> {
    let [h, w, c] = spec.input;
    let samples = samples.max(1);
    let per_sample = (h * w * c).max(std::mem::size_of::<[u32; 2]>());
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
    fn train_batch(&mut self, batch: &Batch, lr: f32) -> Result<StepResult> {
        let result = self.step(batch, lr);
        if result.is_err() {
            self.undo_step()?;
        }
        result
    }

    fn eval_batch(&mut self, batch: &Batch) -> Result<EvalResult> {
        self.graphs.forget();
        let classes = self.network.num_classes();
        let mut result = EvalResult {
            loss_sum: 0.0,
            predictions: Vec::with_capacity(batch.len()),
            baseline_loss_sum: None,
        };
        for part in batch.micro_batches(self.micro_batch) {
            let staged = self.stage(&part)?;
            let be = &self.be;
            let logits = cuda(self.network.forward_eval(be, &staged.images))?;
            let xent = cuda(ops::softmax_cross_entropy(
                be,
                &logits,
                &staged.labels.slice.as_view(),
                0.0,
                1.0,
            ))?;
            let (loss, _) = cuda(xent.read_summary(be))?;
            result.loss_sum += loss as f64 * part.len() as f64;
            let values = cuda(logits.to_host(be))?;
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
        let be = &self.be;
        let (first_moment, second_moment) = if self.applied_steps == 0 {
            (Vec::new(), Vec::new())
        } else {
            cuda(self.network.read_moments(be))?
        };
        Ok(LearnerState {
            params: cuda(self.network.read_params(be))?,
            buffers: cuda(self.network.read_buffers(be))?,
            optimizer: AdamWState {
                step: self.applied_steps,
                first_moment,
                second_moment,
            },
            loss_scale: Some(self.scaler.state()),
        })
    }

    fn restore(&mut self, state: LearnerState) -> std::result::Result<(), String> {
        let LearnerState {
            params,
            buffers,
            optimizer,
            loss_scale,
        } = state;
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
        self.applied_steps = optimizer.step;
        // A CPU checkpoint has no scale: the scaler starts afresh.
        let scale = loss_scale.unwrap_or(LossScaler::new(*self.scaler.config())?.state());
        self.scaler.load_state(scale)?;
        Ok(())
    }

    fn measure_step_peak(&mut self, micro_batch: usize) -> Result<u64> {
        self.graphs.forget();
        let be = &self.be;
        let before = be.memory_stats().in_use_bytes;
        be.reset_peak();
        cuda(self.network.save_running_stats(be))?;
        let dry_run = (|| -> std::result::Result<(), CudaError> {
            let input = headroom_model::cuda::zeros_input(be, self.network.spec(), micro_batch)?;
            let logits = self.network.forward_train(be, &input)?;
            let grad = headroom_model::cuda::CudaTensor::zeros(
                be,
                logits.shape(),
                headroom_model::cuda::DType::F16,
            )?;
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

    fn macs_per_sample(&self) -> Result<u64> {
        Ok(self.macs_per_sample)
    }

    fn num_classes(&self) -> usize {
        self.network.num_classes()
    }

    fn device_name(&self) -> String {
        self.be.info().to_string()
    }

    /// A quarter of the device budget: the rest is for the model, its
    /// activations and the cache.
    fn resident_capacity(&self) -> Option<u64> {
        let m = self.be.memory_stats();
        let budget = m.limit.unwrap_or(self.be.info().total_memory);
        Some(budget / 4)
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
