//! The steady-state training step as one CUDA graph (`device.graphs`).
//!
//! A step of a small network is hundreds of short kernels; a big GPU runs
//! them faster than the host can launch them. Captured once into a graph,
//! the whole device side of a step (input cast or gather, forward, loss,
//! backward, the optimizer and the copies of its results) is one launch.
//!
//! What a graph needs, and how the step provides it:
//! - Fixed addresses. The batch goes through the staging ring as always,
//!   then one copy on the device moves it into this graph's input buffers;
//!   the loss and correct count land in the learner's step records. Every
//!   other buffer the step allocates is allocated and freed inside the
//!   capture, so the graph owns it (the driver's graph memory), and the
//!   step's working set is held against `device.memory_limit` as one lease.
//! - Arguments that do not change. The learning rate candidates reach the
//!   optimizer kernels through device memory (`FusedAdamW::set_schedule`,
//!   before each launch), and the loss scale and AdamW's t live there. A
//!   new batch size, input kind or micro-batch size is a new capture.
//! - No host synchronisation inside. The step's record is copied out after
//!   the launch and read when the step is collected, as for an eager step.
//!
//! The graph is dropped before evaluation (and dry runs, and cache
//! releases), so that a run's peak memory is what it is without graphs; the
//! first step after captures again.
//!
//! A step is captured only after one eager step of the same shape (kernels
//! compiled and loaded, cuBLAS warmed up). Mixup/CutMix batches, split
//! batches (micro-batches) and the last, smaller batch of an epoch run
//! eagerly. If a capture fails, the run says why and goes on eagerly, with
//! the same results: graph and eager steps launch the same kernels with the
//! same arguments in the same order, so they compute the same bits.

use headroom_loader::{Batch, SampleRecipe};
use std::borrow::Cow;

use headroom_model::cuda::{ops, CapturedGraph, CudaTensor, DeviceBuffer};
use headroom_model::TokenInput;

use super::{cuda, training_loss, CudaLearner};
use crate::{PipelineError, Result};

/// What a captured step is specialised to; it replays only for a batch that
/// matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct GraphKey {
    samples: usize,
    recipes: bool,
}

/// A batch as `replay` stages it: input bytes and labels.
type Staged<'b> = (Cow<'b, [u8]>, Cow<'b, [u32]>);

/// What a step's input buffer holds, for `samples` samples.
#[derive(Clone, Copy)]
enum StepInput {
    /// u8 pixels [n, h, w, c] and a label a sample.
    Pixels,
    /// Recipe words (8 bytes a sample) for the data held on the device.
    Recipes,
    /// A token model's ids as f32 [n, length], and a label a token.
    Tokens(TokenInput),
    /// A frame model's input frames [n·frames, h, w, c] as u8, then its
    /// target frames (as many bytes again); no labels.
    Frames { frames: usize },
}

/// One captured training step and the buffers it reads and writes.
pub(super) struct StepGraph {
    key: GraphKey,
    graph: CapturedGraph,
    /// The batch as `StepInput` says.
    input: DeviceBuffer<u8>,
    labels: DeviceBuffer<u32>,
}

/// Whether steps may be captured, and what has been seen.
#[derive(Default)]
pub(super) struct Graphs {
    pub enabled: bool,
    /// A profile runs (`Learner::profile_start`): steps run eagerly, since
    /// its events are recorded between launches.
    pub profiling: bool,
    /// The key of the last eager step that could be captured.
    warm: Option<GraphKey>,
    pub step: Option<StepGraph>,
    /// Steps run as a graph replay so far.
    pub replays: u64,
}

impl Graphs {
    pub fn new(enabled: bool) -> Self {
        Self {
            enabled,
            ..Self::default()
        }
    }

    /// Drops the captured step (and its memory), keeping graphs on: before
    /// evaluation and dry runs, whose own working sets then have the room
    /// the step had (as in an eager run), and when memory is released. The
    /// next step of the same shape captures again.
    pub fn forget(&mut self) {
        self.step = None;
    }

    fn turn_off(&mut self, why: &dyn std::fmt::Display) {
        tracing::warn!("CUDA graphs off for the rest of this run: {why}; steps run one kernel launch at a time");
        self.enabled = false;
        self.step = None;
    }
}

impl CudaLearner {
    /// The key of `batch` when it can run as a captured step.
    fn graph_key(&self, batch: &Batch) -> Option<GraphKey> {
        let n = batch.len();
        let eligible = self.graphs.enabled
            && !self.graphs.profiling
            && n > 0
            && n <= self.micro_batch
            && batch.soft_targets.is_none()
            && (batch.recipes.is_none() || self.resident.is_some());
        eligible.then(|| GraphKey {
            samples: n,
            recipes: batch.recipes.is_some(),
        })
    }

    /// The step as a graph replay (capturing first if needed), with its one
    /// micro-batch's share; None when this batch runs eagerly (first of its
    /// shape, not eligible, or graphs turned off by a failed capture).
    pub(super) fn graph_step(&mut self, batch: &Batch) -> Result<Option<Vec<f32>>> {
        let Some(key) = self.graph_key(batch) else {
            return Ok(None);
        };
        if self.graphs.step.as_ref().map(|g| g.key) != Some(key) {
            if self.graphs.warm != Some(key) {
                self.graphs.warm = Some(key);
                return Ok(None);
            }
            self.graphs.step = None;
            match self.capture(key) {
                Ok(graph) => {
                    tracing::debug!(
                        "captured the training step of {} samples as a CUDA graph ({:.1} MiB working set)",
                        key.samples,
                        graph.graph.working_set() as f64 / (1 << 20) as f64
                    );
                    self.graphs.step = Some(graph);
                }
                Err(e) => {
                    self.graphs.turn_off(&e);
                    return Ok(None);
                }
            }
        }
        self.replay(batch)?;
        Ok(Some(vec![1.0]))
    }

    fn step_input(&self, key: GraphKey) -> StepInput {
        let spec = self.network.spec();
        match (spec.tokens, spec.frames) {
            (Some(tokens), _) => StepInput::Tokens(tokens),
            (None, Some(frames)) => StepInput::Frames { frames },
            (None, None) if key.recipes => StepInput::Recipes,
            (None, None) => StepInput::Pixels,
        }
    }

    /// Records one step into a new graph (nothing runs).
    fn capture(&mut self, key: GraphKey) -> Result<StepGraph> {
        let be = &self.be;
        let n = key.samples;
        let [h, w, c] = self.network.spec().input;
        let (bytes, labels) = match self.step_input(key) {
            StepInput::Pixels => (n * h * w * c, n),
            StepInput::Recipes => (8 * n, n),
            StepInput::Tokens(tokens) => {
                let ids = n * tokens.length;
                (ids * size_of::<f32>(), ids)
            }
            StepInput::Frames { frames } => (2 * n * frames * h * w * c, 0),
        };
        let input = cuda(be.alloc::<u8>(bytes))?;
        let labels = cuda(be.alloc::<u32>(labels.max(1)))?;
        let before = cuda(be.begin_capture())?;
        let recorded = self.record_step(key, &input, &labels);
        if recorded.is_err() {
            // Inside the capture, so that its frees are the graph's.
            self.network.clear_saved();
        }
        let ended = self.be.end_capture(before);
        recorded?;
        Ok(StepGraph {
            key,
            graph: cuda(ended)?,
            input,
            labels,
        })
    }

    /// The device side of a step, as the eager step queues it for one
    /// micro-batch, reading the batch from `input`/`labels` and leaving the
    /// loss and correct count in the first entry of the step records. Every
    /// buffer it allocates is freed before it returns.
    fn record_step(
        &mut self,
        key: GraphKey,
        input: &DeviceBuffer<u8>,
        labels: &DeviceBuffer<u32>,
    ) -> Result<()> {
        let be = &self.be;
        let n = key.samples;
        let norm = self.normalization();
        let [h, w, c] = self.network.spec().input;
        cuda(self.network.save_step_buffers(be))?;
        let mut frame_targets = None;
        let images = match (self.step_input(key), &self.resident) {
            (StepInput::Tokens(tokens), _) => {
                cuda(CudaTensor::f32_from_bytes(be, input, &[n, tokens.length]))?
            }
            (StepInput::Frames { frames }, _) => {
                let len = n * frames * h * w * c;
                frame_targets = Some(input.slice.slice(len..2 * len));
                let inputs = input.slice.slice(..len);
                cuda(ops::normalize_u8(be, &inputs, &[n * frames, h, w, c], norm))?
            }
            (StepInput::Recipes, Some(set)) => {
                // SAFETY: `input` holds 8 bytes a sample (capture sized it)
                // and device allocations are aligned far beyond 4 bytes.
                let words = unsafe { input.slice.transmute::<u32>(2 * n) }.ok_or_else(|| {
                    PipelineError::value("device.graphs", "recipe buffer too small")
                })?;
                cuda(set.gather(be, &words, n, norm))?
            }
            (StepInput::Recipes | StepInput::Pixels, _) => cuda(ops::normalize_u8(
                be,
                &input.slice.as_view(),
                &[n, h, w, c],
                norm,
            ))?,
        };
        let scale = ops::GradScale {
            loss_scale: self.optimizer.loss_scale(),
            share: 1.0,
        };
        let logits = cuda(self.network.forward_train(be, &images))?;
        let xent = match &frame_targets {
            Some(targets) => cuda(ops::pixel_mse(be, &logits, targets, scale))?,
            None => training_loss(be, &self.settings, &logits, labels, scale)?,
        };
        drop(logits);
        cuda(xent.summary_into(
            be,
            &mut self.records.losses.slice.slice_mut(..1),
            &mut self.records.corrects.slice.slice_mut(..1),
        ))?;
        cuda(self.network.backward(be, &xent.grad))?;
        self.finish_on_device()
    }

    /// What `replay` stages for `batch`: its input bytes and labels, laid
    /// out as the captured step reads them.
    fn replay_input<'b>(&self, key: GraphKey, batch: &'b Batch) -> Result<Staged<'b>> {
        let labels = Cow::Borrowed(batch.labels.as_slice());
        Ok(
            match (self.step_input(key), &batch.recipes, &self.resident) {
                (StepInput::Tokens(tokens), _, _) => {
                    let (ids, targets) = batch.next_token_pairs();
                    let ids = tokens.id_values(&ids)?;
                    let bytes = ids.iter().flat_map(|v| v.to_ne_bytes()).collect();
                    (Cow::Owned(bytes), Cow::Owned(targets))
                }
                (StepInput::Frames { frames }, _, _) => {
                    let (mut inputs, targets) = batch.next_frame_pairs(frames);
                    inputs.extend_from_slice(&targets);
                    (Cow::Owned(inputs), Cow::Owned(Vec::new()))
                }
                (StepInput::Recipes, Some(recipes), Some(set)) => {
                    let packed: Vec<[u32; 2]> = recipes.iter().map(SampleRecipe::packed).collect();
                    (
                        Cow::Owned(cuda(set.recipe_bytes(&packed, &batch.labels))?),
                        labels,
                    )
                }
                _ => (Cow::Borrowed(batch.pixels.as_slice()), labels),
            },
        )
    }

    /// Stages `batch` into the graph's input and launches the graph (the
    /// schedule is set already).
    fn replay(&mut self, batch: &Batch) -> Result<()> {
        let key = self
            .graphs
            .step
            .as_ref()
            .map(|g| g.key)
            .ok_or_else(|| PipelineError::value("device.graphs", "no captured step"))?;
        let staged_samples = match self.step_input(key) {
            StepInput::Frames { frames } => batch.len() * frames,
            _ => batch.len(),
        };
        self.ensure_staging(staged_samples)?;
        let (bytes, labels) = self.replay_input(key, batch)?;
        let classes = self.network.num_classes().max(1);
        let Some(graph) = self.graphs.step.as_mut() else {
            return Err(PipelineError::value("device.graphs", "no captured step"));
        };
        let be = &self.be;
        cuda(self.staging.stage_into(
            be,
            &bytes,
            &labels,
            classes,
            &mut graph.input,
            &mut graph.labels,
        ))?;
        if let Err(e) = graph.graph.launch(be) {
            self.graphs
                .turn_off(&format!("launching the step's graph failed: {e}"));
            return cuda(Err(e));
        }
        self.graphs.replays += 1;
        Ok(())
    }
}
