//! The seam between the training loop and the device. Everything that
//! touches tensors sits behind `Learner`: train one batch at a given learning
//! rate (forward, loss, backward and gradient accumulation over micro-batches,
//! clip, optimizer step), evaluate a batch, snapshot and restore the whole
//! state for checkpoints (or write it to one with no copy, when memory
//! refuses the snapshot), and the dry run that plans a micro-batch. The loop
//! (`train.rs`), evaluation (`eval.rs`) and the benchmark (`bench.rs`) only
//! see this trait, so the training step is written once per device.
//!
//! `CpuLearner` (`cpu.rs`) trains in f32 over `Network` and `AdamW`;
//! `CudaLearner` (`cuda.rs`) on the GPU (mixed precision, or f32) over
//! `CudaNetwork`, the fused AdamW and dynamic loss scaling. `open` picks one
//! from `device.kind`.

mod cpu;
mod cpu_ranks;
mod cuda;

pub use cpu::{arg_max, per_token_loss, CpuLearner};
pub use cuda::{CudaLearner, CudaOptions, NcclTransport};

use std::sync::Arc;

use headroom_loader::{Batch, Dataset};
use headroom_model::cuda::ops::TunedConv;
use headroom_model::cuda::{CudaBackend, ProfileSegment};
pub use headroom_model::loss::ValueLoss;
use headroom_model::memory::MemoryPool;
use headroom_model::{BuildOptions, Device, LayerRegistry, ModelSpec, Network, PoolStats};
use headroom_optim::{AdamWConfig, AdamWState, LossScalerState};

use crate::{PipelineError, Result};

/// What shapes a training step besides the learning rate.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepSettings {
    pub label_smoothing: f32,
    /// Global gradient-norm clip; 0 turns clipping off.
    pub clip_norm: f32,
    /// Focal loss with this γ (`train.loss = "focal"`); None: cross-entropy.
    pub focal_gamma: Option<f32>,
    /// A regression's loss against the batch's numeric targets
    /// (`train.loss = "mse"` or `"huber"`); None: a classifier.
    pub regression: Option<ValueLoss>,
    pub optimizer: AdamWConfig,
}

/// The outcome of one training step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepResult {
    /// The batch's mean training loss; NaN when a micro-batch's loss was not
    /// finite.
    pub loss: f32,
    pub correct: usize,
    /// The gradient norm before clipping; None when the step was skipped
    /// (non-finite loss or gradient) and the model left exactly as it was.
    pub grad_norm: Option<f32>,
}

/// The outcome of evaluating one batch.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalResult {
    /// Sum over the batch of the per-sample loss (no label smoothing).
    pub loss_sum: f64,
    /// The predicted class of each sample (none for a frame model).
    pub predictions: Vec<u32>,
    /// A frame model's reference: the same sum for predicting each frame
    /// by the frame before it (copy-last); None for classifiers.
    pub baseline_loss_sum: Option<f64>,
    /// A regression's predicted values, `n * targets`, in the units the
    /// dataset stores its targets (standardised for a table); None
    /// otherwise.
    pub values: Option<Vec<f32>>,
    /// A classifier of more than 5 classes: the samples whose true class
    /// is among the 5 highest scores ([`top5_hits`]); None otherwise.
    pub top5_correct: Option<u64>,
}

/// How many rows of `classes` scores (or probabilities) rank their label
/// among the 5 highest (ties broken in the label's favour); None for 5
/// classes or fewer, where every label is in the top 5.
pub fn top5_hits(scores: &[f32], labels: &[u32], classes: usize) -> Option<u64> {
    if classes <= 5 {
        return None;
    }
    let hits = scores
        .chunks_exact(classes)
        .zip(labels)
        .filter(|(row, &label)| {
            let own = row
                .get(label as usize)
                .copied()
                .unwrap_or(f32::NEG_INFINITY);
            row.iter().filter(|&&s| s > own).count() < 5
        })
        .count();
    Some(hits as u64)
}

/// Everything a checkpoint needs to continue training, in host memory.
#[derive(Clone, Debug)]
pub struct LearnerState {
    /// f32 master values of every parameter, in the model's order.
    pub params: Vec<Vec<f32>>,
    /// Batch-norm running statistics and other buffers, in order.
    pub buffers: Vec<Vec<f32>>,
    pub optimizer: AdamWState,
    /// The dynamic loss scale (mixed precision only).
    pub loss_scale: Option<LossScalerState>,
}

impl LearnerState {
    /// The state out of a checkpoint's four lists (parameters, buffers,
    /// first and second moments), the AdamW step and the loss scale.
    pub fn from_lists(
        [params, buffers, first_moment, second_moment]: [Vec<Vec<f32>>; 4],
        step: u64,
        loss_scale: Option<LossScalerState>,
    ) -> Self {
        Self {
            params,
            buffers,
            optimizer: AdamWState {
                step,
                first_moment,
                second_moment,
            },
            loss_scale,
        }
    }
}

/// The learning rate of a step being submitted: `at(i)` is the rate of the
/// i-th applied step (the schedule), and `applied` counts the applied steps
/// among those already collected. A learner with k steps in flight does not
/// know yet how many of them were applied; it takes `at(applied + j)` for
/// each j in 0..=k and its device picks.
#[derive(Clone, Copy)]
pub struct StepLr<'a> {
    pub applied: u64,
    pub at: &'a dyn Fn(u64) -> f32,
}

/// Where `Learner::write_state` puts the whole state, in a checkpoint's
/// order: four lists (parameters, buffers, first and second moments), each
/// `list(count)` then, per tensor, `tensor(len)` and `values` until it is
/// full; then `finish`. A checkpoint file is one
/// (`checkpoint::write_with`), so a state reaches the disk without a copy
/// of it in memory.
pub trait StateWriter {
    fn list(&mut self, count: usize) -> Result<()>;
    fn tensor(&mut self, len: usize) -> Result<()>;
    fn values(&mut self, values: &[f32]) -> Result<()>;
    fn finish(&mut self, optimizer_step: u64, loss_scale: Option<LossScalerState>) -> Result<()>;
}

/// Writes one of the four lists whole, from host memory.
pub fn write_list<'a>(
    out: &mut dyn StateWriter,
    tensors: impl ExactSizeIterator<Item = &'a [f32]>,
) -> Result<()> {
    out.list(tensors.len())?;
    for values in tensors {
        out.tensor(values.len())?;
        out.values(values)?;
    }
    Ok(())
}

/// A `StateWriter` that keeps the state in host memory, each tensor's
/// taken fallibly: a snapshot made by `write_state`, so that short memory
/// is an out-of-memory value and each tensor is held once.
#[derive(Default)]
pub struct HostState {
    lists: Vec<Vec<Vec<f32>>>,
    finished: Option<(u64, Option<LossScalerState>)>,
}

impl HostState {
    fn malformed(what: &str) -> PipelineError {
        PipelineError::Stage {
            stage: "learner",
            reason: format!("its state is malformed: {what}"),
        }
    }

    pub fn into_state(self) -> Result<LearnerState> {
        let Some((step, loss_scale)) = self.finished else {
            return Err(Self::malformed("it ended before its optimizer step"));
        };
        let Ok(lists) = <[Vec<Vec<f32>>; 4]>::try_from(self.lists) else {
            return Err(Self::malformed("not four lists"));
        };
        Ok(LearnerState::from_lists(lists, step, loss_scale))
    }
}

impl StateWriter for HostState {
    fn list(&mut self, count: usize) -> Result<()> {
        self.lists.push(Vec::with_capacity(count));
        Ok(())
    }

    fn tensor(&mut self, len: usize) -> Result<()> {
        let list = self
            .lists
            .last_mut()
            .ok_or_else(|| Self::malformed("a tensor before any list"))?;
        list.push(headroom_model::memory::try_scratch(len)?);
        Ok(())
    }

    fn values(&mut self, values: &[f32]) -> Result<()> {
        let tensor = self
            .lists
            .last_mut()
            .and_then(|list| list.last_mut())
            .ok_or_else(|| Self::malformed("values before any tensor"))?;
        // Within the capacity `tensor` took: never a reallocation.
        if tensor.len() + values.len() > tensor.capacity() {
            return Err(Self::malformed("more values than the tensor holds"));
        }
        tensor.extend_from_slice(values);
        Ok(())
    }

    fn finish(&mut self, optimizer_step: u64, loss_scale: Option<LossScalerState>) -> Result<()> {
        self.finished = Some((optimizer_step, loss_scale));
        Ok(())
    }
}

pub trait Learner: Send {
    /// Queues one optimizer step on `batch`, in micro-batches of
    /// `micro_batch()` samples whose gradients add up to the whole batch's.
    /// A GPU learner returns before the step has run; its result comes from
    /// `collect_step`, in submission order. A step that fails here (out of
    /// memory, say) was not queued and left the model, its buffers and the
    /// optimizer exactly as they were; a skipped step changes nothing either.
    fn submit_batch(&mut self, batch: &Batch, lr: StepLr<'_>) -> Result<()>;

    /// The result of the oldest step submitted and not yet collected,
    /// waiting for it; None when there is none.
    fn collect_step(&mut self) -> Result<Option<StepResult>>;

    /// Steps submitted and not yet collected.
    fn steps_in_flight(&self) -> usize;

    /// Steps the caller may leave in flight while it prepares and submits
    /// the next: 0 where a step's result is ready when it is submitted (the
    /// CPU).
    fn pipeline_depth(&self) -> usize {
        0
    }

    /// One step at learning rate `lr`, waited for (`submit_batch`, then
    /// `collect_step`); for callers with no step in flight.
    fn train_batch(&mut self, batch: &Batch, lr: f32) -> Result<StepResult> {
        if self.steps_in_flight() > 0 {
            return Err(PipelineError::Stage {
                stage: "learner",
                reason: "train_batch was called with steps in flight; collect them first".into(),
            });
        }
        let at = move |_: u64| lr;
        self.submit_batch(
            batch,
            StepLr {
                applied: 0,
                at: &at,
            },
        )?;
        self.collect_step()?.ok_or_else(|| PipelineError::Stage {
            stage: "learner",
            reason: "a submitted step left no result".into(),
        })
    }

    /// Inference on `batch` in micro-batches; changes nothing.
    fn eval_batch(&mut self, batch: &Batch) -> Result<EvalResult>;

    /// The class probabilities (softmax of the scores) of every sample of
    /// `batch`, `[n, classes]` row-major, in micro-batches; changes nothing.
    /// Test-time augmentation averages these over views of a batch.
    fn eval_probabilities(&mut self, batch: &Batch) -> Result<Vec<f32>>;

    /// Whether training normalises with each batch's own statistics
    /// (batch norm): then micro-batches change the update, and the memory
    /// policy says so instead of "unchanged". Default: true, the claim a
    /// learner that does not know cannot disprove.
    fn uses_batch_statistics(&self) -> bool {
        true
    }

    /// The loss that scores the batches' numeric targets (`Batch::values`):
    /// a regression's or a multi-label model's; None for classes, tokens
    /// and frames. Default: None.
    fn value_loss(&self) -> Option<ValueLoss> {
        None
    }

    fn micro_batch(&self) -> usize;
    fn set_micro_batch(&mut self, size: usize);

    /// The whole state, for a checkpoint; with no step in flight.
    fn snapshot(&mut self) -> Result<LearnerState>;

    /// Writes the state `snapshot` copies to `out`, tensor by tensor, with
    /// no copy of it: what a checkpoint falls back on when memory refuses
    /// the copy. A GPU learner downloads through a small host buffer. With
    /// no step in flight.
    fn write_state(&mut self, out: &mut dyn StateWriter) -> Result<()>;

    /// Replaces the whole state; refuses (saying why) a state of another
    /// shape, leaving the learner as it was.
    fn restore(&mut self, state: LearnerState) -> std::result::Result<(), String>;

    /// The convolution kernels `device.conv_algorithm = "tune"` chose so
    /// far (none on the CPU, or under another algorithm): a checkpoint
    /// keeps them.
    fn tuned_convolutions(&self) -> Vec<TunedConv> {
        Vec::new()
    }

    /// Takes a checkpoint's tuned convolutions, so that a resumed run runs
    /// the kernels the interrupted one chose.
    fn restore_tuned_convolutions(&mut self, _tuned: &[TunedConv]) {}

    /// Peak bytes one training step of `micro_batch` samples needs beyond
    /// what the learner already holds (a dry run; zeroes gradients).
    fn measure_step_peak(&mut self, micro_batch: usize) -> Result<u64>;

    /// The memory the learner's tensors come from.
    fn memory_stats(&self) -> PoolStats;

    /// The hard budget on that memory, if any.
    fn memory_limit(&self) -> Option<u64>;

    /// Returns cached, unused blocks to the system (the driver on a GPU):
    /// the bytes released.
    fn release_cache(&mut self) -> u64;

    fn num_params(&mut self) -> usize;
    /// Parameters the optimizer updates (all but the frozen).
    fn num_trainable_params(&mut self) -> usize;
    fn macs_per_sample(&self) -> Result<u64>;
    fn num_classes(&self) -> usize;

    /// "cpu", or the GPU's description (for logs and benchmarks).
    fn device_name(&self) -> String;

    /// Bytes the optimizer's state takes once it has stepped (none for
    /// frozen parameters), when the learner can say before the first step.
    fn optimizer_state_bytes(&mut self) -> Option<u64> {
        None
    }

    /// Starts timing the device's work by segment (each layer's forward
    /// and backward, the loss, the optimizer) for the steps that follow,
    /// which run without CUDA graphs until `profile_finish`; false when the
    /// learner cannot (the CPU).
    fn profile_start(&mut self) -> Result<bool> {
        Ok(false)
    }

    /// Ends the profile: its segments, summed over the steps since the start
    /// (all of them collected first).
    fn profile_finish(&mut self) -> Result<Vec<ProfileSegment>> {
        Ok(Vec::new())
    }

    /// The most bytes a training set held on the learner's device may take
    /// (`data.on_device`); None when the learner has no device memory of its
    /// own to hold one in (the CPU: its batches are in that memory already),
    /// or no kernels to make batches there from this model's samples.
    fn resident_capacity(&self) -> Option<u64> {
        None
    }

    /// The ranks this learner trains with (a data-parallel run), so that
    /// evaluation can be sharded over them; None alone.
    fn ranks(&self) -> Option<crate::ranks::Ranks> {
        None
    }

    /// Makes the state whole on the rank that writes checkpoints (a
    /// sharded optimizer's moments gathered to rank 0). Every rank calls
    /// it before each checkpoint, at the same step.
    fn gather_state(&mut self) -> Result<()> {
        Ok(())
    }

    /// Releases what `gather_state` brought in, once the checkpoint is
    /// written.
    fn release_gathered_state(&mut self) {}

    /// Joins the ranks of a data-parallel run (`crate::ranks`): each step's
    /// gradients are then summed over the ranks. Default: refused, naming
    /// the device (the CPU learner over any transport and the GPU learner
    /// over NCCL can).
    fn join_ranks(&mut self, ranks: crate::ranks::Ranks) -> Result<()> {
        Err(PipelineError::Stage {
            stage: "ranks",
            reason: format!(
                "{} cannot train data-parallel ({} ranks asked for): only the CPU and GPU learners can",
                self.device_name(),
                ranks.world
            ),
        })
    }

    /// Copies every sample of `dataset` to the device: batches that carry
    /// recipes (`LoaderConfig::resident`) are then made there.
    fn hold_resident(&mut self, dataset: &dyn Dataset) -> Result<()> {
        let _ = dataset;
        Err(PipelineError::value(
            "data.on_device",
            format!("{} cannot hold a dataset", self.device_name()),
        ))
    }
}

/// A snapshot or a restore needs every submitted step collected first: a
/// checkpoint's position counts collected steps only.
fn require_no_steps_in_flight(in_flight: usize, what: &str) -> Result<()> {
    if in_flight == 0 {
        return Ok(());
    }
    Err(PipelineError::Stage {
        stage: "learner",
        reason: format!("{what} with {in_flight} step(s) in flight; collect them first"),
    })
}

pub use crate::device::DeviceKind;

/// A network learner to make: the model, its initialisation and build, the
/// step, and the device. What `open` makes from an experiment and a
/// `Trainer` built in code from its parts.
#[derive(Clone, Debug)]
pub struct NetworkPlan {
    pub spec: ModelSpec,
    pub seed: u64,
    pub build: BuildOptions,
    /// The factories of the spec's `custom` layers (CPU only).
    pub layers: LayerRegistry,
    pub step: StepSettings,
    /// The micro-batch to start with (the loop sets it before a step).
    pub batch: usize,
    pub device: DeviceKind,
    pub cuda: CudaOptions,
}

/// The learner of `plan` on the device it asks for: the one place the
/// device is decided. `initialise` runs on the freshly built CPU network
/// (a fine-tuning base is loaded there), before a GPU copy is made.
pub fn open_network(
    plan: &NetworkPlan,
    pool: Arc<MemoryPool>,
    initialise: impl Fn(&mut Network) -> Result<()>,
) -> Result<Box<dyn Learner>> {
    let on_cpu = || -> Result<Box<dyn Learner>> {
        let mut network = pool.scope(|| {
            Network::build_with_layers(&plan.spec, plan.seed, plan.build, &plan.layers)
        })?;
        initialise(&mut network)?;
        let learner =
            CpuLearner::from_network(network, plan.step.clone(), plan.batch, Arc::clone(&pool))?;
        Ok(Box::new(learner))
    };
    let on_gpu = || -> Result<CudaLearner> {
        let be = CudaBackend::with_half(0, plan.cuda.half).map_err(|e| {
            PipelineError::value("device.kind", format!("\"cuda\" cannot be used: {e}"))
        })?;
        // Built on the CPU first, where a fine-tuning base is loaded and
        // frozen, then copied up.
        let mut network = MemoryPool::new(Device::Cpu).scope(|| {
            Network::build_with_layers(&plan.spec, plan.seed, BuildOptions::default(), &plan.layers)
        })?;
        initialise(&mut network)?;
        CudaLearner::from_network(
            be,
            &mut network,
            plan.step.clone(),
            plan.batch,
            plan.cuda.clone(),
        )
    };
    let cpu_only = plan.spec.first_cpu_only_layer_given(&plan.layers);
    match plan.device {
        DeviceKind::Cpu => on_cpu(),
        DeviceKind::Cuda if cpu_only.is_some() => {
            let (path, name) = cpu_only.unwrap_or_default();
            Err(PipelineError::value(
                "device.kind",
                format!(
                    "\"cuda\", but {path} is the custom layer \"{name}\", which has no CUDA \
                     implementation: train this model with device.kind = \"cpu\""
                ),
            ))
        }
        DeviceKind::Auto if cpu_only.is_some() => {
            let (path, name) = cpu_only.unwrap_or_default();
            tracing::info!(
                "device: CPU (device.kind = \"auto\"; {path} is the custom layer \"{name}\", \
                 which has no CUDA implementation)"
            );
            on_cpu()
        }
        DeviceKind::Cuda => {
            let learner = on_gpu()?;
            tracing::info!("device: {}", learner.device());
            log_op_paths(learner.device().arch());
            Ok(Box::new(learner))
        }
        DeviceKind::Auto => match CudaBackend::probe() {
            Ok(Some(_)) => {
                match on_gpu() {
                    Ok(learner) => {
                        tracing::info!("device: {} (device.kind = \"auto\")", learner.device());
                        log_op_paths(learner.device().arch());
                        Ok(Box::new(learner))
                    }
                    Err(e) => {
                        tracing::warn!("a GPU is present but this run cannot use it ({e}); training on the CPU");
                        on_cpu()
                    }
                }
            }
            Ok(None) => {
                tracing::info!("device: CPU (device.kind = \"auto\" found no CUDA driver or GPU)");
                on_cpu()
            }
            Err(e) => {
                tracing::warn!("device: CPU (the CUDA driver cannot be used: {e})");
                on_cpu()
            }
        },
    }
}

/// Which path each op family takes on this GPU, one line each
/// (`headroom_model::cuda::arch::op_paths`, as `cargo xtask doctor` prints).
fn log_op_paths(arch: u32) {
    for p in headroom_model::cuda::arch::op_paths(arch) {
        tracing::info!("cuda path: {}: {}", p.family, p.path);
    }
}

/// Each row of `classes` scores replaced by its softmax, in place.
pub(crate) fn softmax_rows(scores: &mut [f32], classes: usize) {
    for row in scores.chunks_exact_mut(classes.max(1)) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for v in row.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        row.iter_mut().for_each(|v| *v /= sum);
    }
}

#[cfg(test)]
mod tests {
    use super::top5_hits;

    #[test]
    fn top5_counts_a_label_among_the_five_highest_scores_ties_in_its_favour() {
        // 7 classes; scores rise with the class id.
        let row: Vec<f32> = (0..7).map(|k| k as f32).collect();
        let rows: Vec<f32> = row.iter().chain(&row).chain(&row).copied().collect();
        // Class 6 is first, 2 is fifth, 1 is sixth.
        assert_eq!(top5_hits(&rows, &[6, 2, 1], 7), Some(2));
        // A tie with the fifth counts for the label.
        let tied = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0];
        assert_eq!(top5_hits(&tied, &[0], 7), Some(1));
        // Five classes or fewer: every label is in the top 5.
        assert_eq!(top5_hits(&[0.0; 5], &[0], 5), None);
    }
}
