//! The f32 CPU learner. Its tensors come from the pool it is given: every
//! method runs inside that pool's scope, so a budget on the pool covers the
//! whole step.
//!
//! A token model (`model.tokens`) reads batches of text windows: the first
//! `length` ids of each are its input, the last `length` its per-token
//! targets; its [N, T, V] scores are scored as N·T rows, so loss and
//! accuracy are per token.
//!
//! A frame model (`model.frames`) reads batches of frame sequences: the
//! first `frames` frames are its input, the last `frames` its targets (each
//! frame's successor), scored by per-pixel MSE in [0, 1]; evaluation also
//! scores the copy-last-frame baseline on the same frames.

use std::collections::VecDeque;
use std::sync::Arc;

use headroom_loader::Batch;
use headroom_model::loss::{
    focal_loss, pixel_mse, pixel_mse_u8, soft_cross_entropy, soft_focal_loss,
    softmax_cross_entropy, value_loss, LossOutput, ValueLoss,
};
use headroom_model::memory::{try_scratch, MemoryPool};
use headroom_model::profile::ProfileSegment;
use headroom_model::{BuildOptions, Mode, ModelSpec, Network, PoolStats, Tensor, TokenInput};
use headroom_optim::{clip_grad_norm, clip_to_norm, grad_norm, AdamW, UpdateOutcome};

use super::cpu_ranks::{add_earlier, CpuRanks};
use super::{
    softmax_rows, write_list, EvalResult, Learner, LearnerState, StateWriter, StepLr, StepResult,
    StepSettings,
};
use crate::ranks::{agree_on_step, agree_on_update, Ranks, StepRecord, UpdateVerdict};
use crate::{PipelineError, Result};

/// The f32 CPU learner.
pub struct CpuLearner {
    network: Network,
    optimizer: AdamW,
    settings: StepSettings,
    micro_batch: usize,
    pool: Arc<MemoryPool>,
    /// Set for a token model: batches are text windows.
    tokens: Option<TokenInput>,
    /// Set for a frame model: the frames it reads per sequence.
    frames: Option<usize>,
    /// Results of steps submitted and not yet collected.
    ready: VecDeque<StepResult>,
    /// Set in a data-parallel run: the other ranks and the all-reduce.
    ranks: Option<CpuRanks>,
}

/// A micro-batch as the network takes it, and what its scores are compared
/// against: the labels, or the targets of every token.
struct Prepared {
    input: Tensor,
    targets: Option<Vec<u32>>,
    frames: Option<FramePair>,
}

/// A frame model's u8 input frames and target frames (each input frame's
/// successor), `n * frames * frame_len` bytes each.
struct FramePair {
    inputs: Vec<u8>,
    targets: Vec<u8>,
}

impl FramePair {
    /// Per-pixel MSE of the predictions against the target frames.
    fn loss(&self, predictions: &Tensor) -> Result<LossOutput> {
        Ok(pixel_mse(predictions, &self.targets)?)
    }

    /// The same loss for predicting each frame by the one before it.
    fn copy_last_loss(&self) -> f64 {
        pixel_mse_u8(&self.inputs, &self.targets)
    }
}

impl CpuLearner {
    /// Builds the network of `spec` (initialised from `seed`, fused as
    /// `build` says) with its tensors in `pool`; micro-batch = `batch_size`
    /// until set otherwise.
    pub fn new(
        spec: &ModelSpec,
        seed: u64,
        build: BuildOptions,
        settings: StepSettings,
        batch_size: usize,
        pool: Arc<MemoryPool>,
    ) -> Result<Self> {
        let network = pool.scope(|| Network::build_with(spec, seed, build))?;
        Self::from_network(network, settings, batch_size, pool)
    }

    /// Trains `network` (whose tensors should come from `pool`, so that
    /// the budget counts them).
    pub fn from_network(
        network: Network,
        settings: StepSettings,
        batch_size: usize,
        pool: Arc<MemoryPool>,
    ) -> Result<Self> {
        let (tokens, frames) = (network.spec().tokens, network.spec().frames);
        Ok(Self {
            network,
            optimizer: AdamW::new(settings.optimizer.clone())?,
            settings,
            micro_batch: batch_size.max(1),
            pool,
            tokens,
            frames,
            ready: VecDeque::new(),
            ranks: None,
        })
    }

    pub fn network(&self) -> &Network {
        &self.network
    }

    pub fn network_mut(&mut self) -> &mut Network {
        &mut self.network
    }

    /// The network's outputs for `batch` in evaluation mode (a
    /// classifier's logits, a regression's values as the targets are
    /// stored), `n * outputs`, a micro-batch at a time: what a prediction
    /// reads, with no targets needed.
    pub fn outputs(&mut self, batch: &Batch) -> Result<Vec<f32>> {
        let pool = Arc::clone(&self.pool);
        pool.scope(|| {
            let mut outputs = Vec::new();
            for part in batch.micro_batches(self.micro_batch) {
                let prepared = self.prepare(&part)?;
                let logits = self.network.forward(&prepared.input, Mode::Eval)?;
                outputs.extend_from_slice(logits.data());
            }
            Ok(outputs)
        })
    }

    /// The input tensor of `part`, with per-token targets for a token model.
    fn prepare(&self, part: &Batch) -> Result<Prepared> {
        if let Some(frames) = self.frames {
            let (inputs, targets) = part.next_frame_pairs(frames);
            let input = self.network.input_from_u8(part.len(), &inputs)?;
            return Ok(Prepared {
                input,
                targets: None,
                frames: Some(FramePair { inputs, targets }),
            });
        }
        if let Some(features) = &part.features {
            let input = self.network.input_from_f32(part.len(), features)?;
            return Ok(Prepared {
                input,
                targets: None,
                frames: None,
            });
        }
        if self.tokens.is_none() {
            let input = self.network.input_from_u8(part.len(), &part.pixels)?;
            return Ok(Prepared {
                input,
                targets: None,
                frames: None,
            });
        }
        let (ids, targets) = part.next_token_pairs();
        let input = self.network.input_from_tokens(part.len(), &ids)?;
        Ok(Prepared {
            input,
            targets: Some(targets),
            frames: None,
        })
    }

    /// Forward and backward over the micro-batches, adding up gradients.
    /// Each micro-batch's loss gradient is weighted by its share of the
    /// (global) batch, so the sum is the whole batch's mean-loss gradient.
    /// Each micro-batch's gradients are computed from zero and added to the
    /// earlier ones' sum, ((g0 + g1) + g2) …, the order in which the ranks'
    /// sums are added, so N ranks of one micro-batch give the bits of one
    /// process of N. In a data-parallel run the last micro-batch hands each
    /// layer's gradients to the all-reduce as backward finishes it.
    /// Returns the batch's share of the mean loss (NaN at the first
    /// non-finite micro-batch) and the number of correct predictions.
    fn accumulate_gradients(&mut self, batch: &Batch) -> Result<(f64, usize)> {
        let world = self.ranks.as_ref().map_or(1, |r| r.ranks.world);
        let n = batch.len() * world;
        let parts: Vec<_> = batch.micro_batches(self.micro_batch).collect();
        let count = parts.len();
        // Rank r's micro-batches are one process's r·M … r·M + M − 1 of
        // the global batch: their dropout masks too.
        let rank = self.ranks.as_ref().map_or(0, |r| r.ranks.rank);
        if world > 1 {
            self.network.shift_dropout((rank * count) as u64, 0);
        }
        let (mut loss, mut correct) = (0.0f64, 0usize);
        // The earlier micro-batches' gradient sum, by parameter.
        let mut stash: Vec<Vec<f32>> = Vec::new();
        for (i, part) in parts.iter().enumerate() {
            if i > 0 {
                stash_gradients(&mut self.network, &mut stash)?;
            }
            let prepared = self.prepare(part)?;
            self.network.profile_mark(|| "input: prepared".into());
            let logits = self.network.forward(&prepared.input, Mode::Train)?;
            let smoothing = self.settings.label_smoothing;
            let regression = regression_targets(self.settings.regression, part)?;
            let mut out = match (&prepared.targets, &prepared.frames, regression) {
                (_, Some(pair), _) => pair.loss(&logits)?,
                (None, None, Some((kind, values))) => value_loss(&logits, values, kind)?,
                (None, None, None) => {
                    training_loss(smoothing, self.settings.focal_gamma, &logits, part)?
                }
                (Some(targets), None, _) => per_token_loss(&logits, targets, smoothing)?,
            };
            drop(logits);
            self.network.profile_mark(|| "loss".into());
            if !out.loss.is_finite() {
                return Ok((f64::NAN, 0));
            }
            let share = part.len() as f32 / n as f32;
            if share != 1.0 {
                out.grad
                    .try_data_mut()?
                    .iter_mut()
                    .for_each(|g| *g *= share);
            }
            let Self { network, ranks, .. } = self;
            match ranks.as_mut().filter(|_| i + 1 == count) {
                Some(ranks) => {
                    // The all-reduce's own error, not the model's wrapper.
                    let mut refused = None;
                    let done = network.backward_with(&out.grad, &mut |layer, params| {
                        ranks.hand_over(layer, params, &stash).map_err(|e| {
                            refused = Some(e);
                            headroom_model::ModelError::State("the all-reduce refused it".into())
                        })
                    });
                    if let Some(e) = refused {
                        return Err(e);
                    }
                    done?;
                }
                None => {
                    network.backward(&out.grad)?;
                    if i > 0 {
                        for (p, earlier) in network.params_mut().into_iter().zip(&stash) {
                            if !p.frozen {
                                add_earlier(earlier, p.grad.data_mut());
                            }
                        }
                    }
                }
            }
            loss += out.loss as f64 * share as f64;
            correct += out.correct;
        }
        if world > 1 {
            // The other ranks' forwards: every rank's counter moves on alike.
            self.network
                .shift_dropout((rank * count) as u64, ((world - 1) * count) as u64);
        }
        Ok((loss, correct))
    }

    /// Clip and AdamW step on the accumulated gradients: the gradient norm,
    /// or None (nothing applied) when it is not finite, when a running
    /// statistic the forward updated is not, or when the update would leave
    /// a weight or a moment that is not (a finite gradient can still
    /// overflow one: a learning rate far too high).
    fn apply_gradients(&mut self, lr: f32) -> Result<Option<f32>> {
        if let Some(index) = self
            .network
            .buffers_mut()
            .iter()
            .position(|buffer| buffer.data().iter().any(|v| !v.is_finite()))
        {
            tracing::warn!("step skipped: buffer {index} (running statistics) is not finite");
            return Ok(None);
        }
        if self.ranks.is_some() {
            return self.apply_with_ranks(lr);
        }
        let norm = clip_gradients(&mut self.network, self.settings.clip_norm);
        let mut params = self.network.params_mut();
        if !norm.is_finite() {
            return Ok(None);
        }
        match self.optimizer.step_if_finite(&mut params, lr)? {
            UpdateOutcome::Applied => Ok(Some(norm)),
            UpdateOutcome::NonFinite { name, .. } => {
                tracing::warn!(
                    "step skipped: its update (learning rate {lr:e}) would make {name} or its \
                     AdamW moments not finite"
                );
                Ok(None)
            }
        }
    }

    /// [`Self::apply_gradients`] in a data-parallel run: every rank holds
    /// the reduced gradients (sharded, ZeRO-1: of its own tensors only).
    /// Each rank checks its part of the update before anyone applies it,
    /// and all apply it, skip it or stop together; sharded, the global
    /// norm is made of every rank's terms, each rank clips and updates its
    /// own tensors and the new weights are gathered: the same bits as
    /// unsharded.
    fn apply_with_ranks(&mut self, lr: f32) -> Result<Option<f32>> {
        let Some(ranks) = self.ranks.as_mut() else {
            return Ok(None);
        };
        let sharded = ranks.sharded();
        let norm32 = if sharded {
            let norm = ranks.global_norm(&mut self.network)?;
            let owned = ranks.owned_params().unwrap_or_default();
            let mut own: Vec<&mut headroom_model::Param> = self
                .network
                .params_mut()
                .into_iter()
                .enumerate()
                .filter(|(i, _)| owned.get(*i).copied().unwrap_or(false))
                .map(|(_, p)| p)
                .collect();
            if self.settings.clip_norm > 0.0 {
                clip_to_norm(&mut own, norm, self.settings.clip_norm)
            } else {
                norm as f32
            }
        } else {
            clip_gradients(&mut self.network, self.settings.clip_norm)
        };
        // The same norm on every rank: all skip here together.
        if !norm32.is_finite() {
            return Ok(None);
        }
        let mut params = self.network.params_mut();
        let checked = self.optimizer.check_step(&mut params, lr);
        let mine = checked
            .as_ref()
            .map(|v| *v == UpdateOutcome::Applied)
            .map_err(|e| PipelineError::Optim(e.clone()));
        match agree_on_update(&ranks.ranks, &mine)? {
            UpdateVerdict::Apply => {}
            UpdateVerdict::Skip { rank } => {
                self.optimizer.forget_unapplied();
                match checked {
                    Ok(UpdateOutcome::NonFinite { name, .. }) => tracing::warn!(
                        "step skipped: its update (learning rate {lr:e}) would make {name} or \
                         its AdamW moments not finite"
                    ),
                    _ => tracing::warn!(
                        "step skipped: its update (learning rate {lr:e}) would make a weight \
                         of rank {rank}'s or its AdamW moments not finite"
                    ),
                }
                return Ok(None);
            }
            UpdateVerdict::OutOfMemory { rank, refusal } => {
                self.optimizer.forget_unapplied();
                if rank != ranks.ranks.rank {
                    tracing::warn!("rank {rank} ran out of memory preparing the update");
                }
                return Err(refusal.error(&self.pool.stats()));
            }
            UpdateVerdict::Failed { rank } => {
                self.optimizer.forget_unapplied();
                return Err(failure_of_a_rank(
                    rank,
                    checked.err().map(PipelineError::from),
                    "preparing the update",
                ));
            }
        }
        self.optimizer.step(&mut params, lr)?;
        drop(params);
        if sharded {
            ranks.gather_weights(&mut self.network)?;
        }
        Ok(Some(norm32))
    }

    /// Back to the state before a step that did not apply.
    fn undo_step(&mut self, statistics: &[Vec<f32>]) -> Result<()> {
        self.network.clear_saved();
        self.network.zero_grad();
        self.network.restore_buffer_values(statistics)?;
        Ok(())
    }

    fn train_in_scope(&mut self, batch: &Batch, lr: f32) -> Result<StepResult> {
        // Batch norm updates its running statistics during the forward; a
        // step that is not applied must not keep them.
        let statistics = self.network.buffer_values();
        let accumulated = self.accumulate_gradients(batch);
        let (loss, correct) = match self.agree_with_ranks(accumulated) {
            Ok(done) => done,
            Err(e) => {
                self.undo_step(&statistics)?;
                return Err(e);
            }
        };
        let grad_norm = if loss.is_finite() {
            match self.apply_gradients(lr) {
                Ok(norm) => norm,
                Err(e) => {
                    // Nothing was applied: the gradients must not be carried
                    // into the retry the memory policy may make.
                    self.undo_step(&statistics)?;
                    return Err(e);
                }
            }
        } else {
            None
        };
        match grad_norm {
            Some(_) => self.network.zero_grad(),
            None => self.undo_step(&statistics)?,
        }
        self.network
            .profile_mark(|| "optimizer: clip, AdamW, zero gradients".into());
        Ok(StepResult {
            loss,
            correct,
            grad_norm,
        })
    }

    /// The step's outcome as every rank agrees on it: the gradients summed
    /// over the ranks, the loss and correct count of the global batch, a
    /// skip if any rank's loss was not finite, an error on every rank if
    /// one failed, and the buffers' mean. Alone, this rank's own outcome.
    fn agree_with_ranks(&mut self, local: Result<(f64, usize)>) -> Result<(f32, usize)> {
        let Some(ranks) = self.ranks.as_mut() else {
            return local.map(|(loss, correct)| (loss as f32, correct));
        };
        let (status, refusal) = StepRecord::status_of(&local, |(loss, _)| loss.is_finite());
        ranks.finish(&mut self.network, status != StepRecord::OK)?;
        let (loss, correct) = local.as_ref().map_or((0.0, 0), |&(l, c)| (l, c));
        let agreed = agree_on_step(
            &ranks.ranks,
            StepRecord {
                status,
                stop: ranks.ranks.stop_requested(),
                loss: if loss.is_finite() { loss } else { 0.0 },
                correct: correct as u64,
                refusal,
            },
        )?;
        if let Some(k) = agreed.failed {
            return Err(failure_of_a_rank(k, local.err(), "this step"));
        }
        // Every rank undoes the step and follows the memory policy on the
        // first refusal, so all halve the micro-batch (or stop) together
        // and the step's arithmetic stays the same on every rank.
        if let Some((k, refusal)) = agreed.out_of_memory {
            if k != ranks.ranks.rank {
                tracing::warn!("rank {k} ran out of memory in this step; every rank follows it");
            }
            return Err(refusal.error(&self.pool.stats()));
        }
        if agreed.non_finite {
            return Ok((f32::NAN, 0));
        }
        ranks.average_buffers(&mut self.network)?;
        Ok((agreed.loss as f32, agreed.correct as usize))
    }

    /// Refuses a state whose tensors do not match the model's, naming the
    /// first that differs.
    fn check_shapes(&mut self, state: &LearnerState) -> std::result::Result<(), String> {
        let params: Vec<(String, usize)> = self
            .network
            .params_mut()
            .iter()
            .map(|p| (p.name.clone(), p.value.len()))
            .collect();
        let buffers: Vec<(String, usize)> = self
            .network
            .buffers_mut()
            .iter()
            .enumerate()
            .map(|(i, b)| (format!("buffer {i}"), b.len()))
            .collect();
        for (what, expected, saved) in [
            ("parameter tensors", &params, &state.params),
            ("buffers", &buffers, &state.buffers),
        ] {
            if expected.len() != saved.len() {
                return Err(format!(
                    "{} {what}, the model has {}",
                    saved.len(),
                    expected.len()
                ));
            }
            for ((name, len), values) in expected.iter().zip(saved) {
                if *len != values.len() {
                    return Err(format!(
                        "{name} has {} values, the model expects {len}",
                        values.len()
                    ));
                }
            }
        }
        Ok(())
    }

    fn eval_in_scope(&mut self, batch: &Batch) -> Result<EvalResult> {
        let classes = self.network.num_classes();
        let mut result = EvalResult {
            loss_sum: 0.0,
            predictions: Vec::with_capacity(batch.len()),
            baseline_loss_sum: self.frames.map(|_| 0.0),
            values: self.settings.regression.map(|_| Vec::new()),
            top5_correct: None,
        };
        for part in batch.micro_batches(self.micro_batch) {
            let prepared = self.prepare(&part)?;
            let logits = self.network.forward(&prepared.input, Mode::Eval)?;
            if let Some(pair) = &prepared.frames {
                add_frame_losses(&mut result, pair, &logits, part.len())?;
                continue;
            }
            if let Some((kind, targets)) = regression_targets(self.settings.regression, &part)? {
                // The loss is the mean over every target value; every sample
                // has as many, so the per-sample sum keeps that mean.
                let out = value_loss(&logits, targets, kind)?;
                result.loss_sum += out.loss as f64 * part.len() as f64;
                if let Some(values) = result.values.as_mut() {
                    values.extend_from_slice(logits.data());
                }
                continue;
            }
            // A token model's loss is the mean over its tokens; every sample
            // has as many, so the per-sample sum keeps the per-token mean.
            let out = match &prepared.targets {
                None => {
                    if let Some(hits) = super::top5_hits(logits.data(), &part.labels, classes) {
                        *result.top5_correct.get_or_insert(0) += hits;
                    }
                    softmax_cross_entropy(&logits, &part.labels, 0.0)?
                }
                Some(targets) => per_token_loss(&logits, targets, 0.0)?,
            };
            result.loss_sum += out.loss as f64 * part.len() as f64;
            result
                .predictions
                .extend(logits.data().chunks_exact(classes).map(arg_max));
        }
        Ok(result)
    }
}

/// The global gradient norm, the gradients clipped to `clip_norm` when
/// it is set (> 0).
fn clip_gradients(network: &mut Network, clip_norm: f32) -> f32 {
    let mut params = network.params_mut();
    if clip_norm > 0.0 {
        clip_grad_norm(&mut params, clip_norm)
    } else {
        grad_norm(&params)
    }
}

/// The error every rank stops with when rank `rank` failed `during`: this
/// rank's own error, unless it is out of memory (which the memory policy
/// would retry alone, while the others stop), else one naming the rank.
pub(crate) fn failure_of_a_rank(
    rank: usize,
    own: Option<PipelineError>,
    during: &str,
) -> PipelineError {
    match own {
        Some(e) if !e.is_out_of_memory() => e,
        _ => PipelineError::Stage {
            stage: "ranks",
            reason: format!(
                "rank {rank} failed {during} (its own output says why); every rank undid the step"
            ),
        },
    }
}

/// Moves the gradients so far into `stash` (by parameter; frozen ones
/// empty) and zeroes them, for the next micro-batch to start from zero.
fn stash_gradients(network: &mut Network, stash: &mut Vec<Vec<f32>>) -> Result<()> {
    let params = network.params_mut();
    if stash.is_empty() {
        for p in &params {
            let len = if p.frozen { 0 } else { p.grad.len() };
            stash.push(try_scratch(len)?);
        }
    }
    for (p, kept) in params.into_iter().zip(stash.iter_mut()) {
        if !p.frozen {
            kept.clear();
            kept.extend_from_slice(p.grad.data());
            p.zero_grad();
        }
    }
    Ok(())
}

/// A regression's loss and the batch's numeric targets; None for a
/// classifier. A batch with targets the settings do not score (or the
/// reverse) is an error rather than a silent cross-entropy.
fn regression_targets(
    regression: Option<ValueLoss>,
    batch: &Batch,
) -> Result<Option<(ValueLoss, &[f32])>> {
    match (regression, batch.values.as_deref()) {
        (Some(kind), Some(values)) => Ok(Some((kind, values))),
        (None, None) => Ok(None),
        (Some(_), None) => Err(PipelineError::value(
            "train.loss",
            "scores numeric targets (a regression), and the batches carry classes: use a \
             table with numeric data.targets, or train.loss = \"cross_entropy\"",
        )),
        (None, Some(_)) => Err(PipelineError::value(
            "train.loss",
            "scores classes, and the batches carry numeric targets: set train.loss = \"mse\" \
             or \"huber\"",
        )),
    }
}

/// A frame model's batch losses, the model's and the copy-last baseline's,
/// added to `result` as per-sample sums (every sample has as many pixels).
fn add_frame_losses(
    result: &mut EvalResult,
    pair: &FramePair,
    predictions: &Tensor,
    samples: usize,
) -> Result<()> {
    result.loss_sum += pair.loss(predictions)?.loss as f64 * samples as f64;
    if let Some(sum) = result.baseline_loss_sum.as_mut() {
        *sum += pair.copy_last_loss() * samples as f64;
    }
    Ok(())
}

/// The index of the largest value (the first of equals).
pub fn arg_max(row: &[f32]) -> u32 {
    (0..row.len()).fold(0, |best, k| if row[k] > row[best] { k } else { best }) as u32
}

/// Softmax cross-entropy of [N, T, V] scores against N·T targets, as N·T
/// rows of V: the mean loss per token, the gradient in the scores' shape,
/// and the tokens predicted correctly.
pub fn per_token_loss(logits: &Tensor, targets: &[u32], smoothing: f32) -> Result<LossOutput> {
    let shape = logits.shape().to_vec();
    let vocab = shape.last().copied().unwrap_or(1);
    let rows = logits.len() / vocab.max(1);
    let flat = logits.clone().reshape(&[rows, vocab])?;
    let out = softmax_cross_entropy(&flat, targets, smoothing)?;
    Ok(LossOutput {
        grad: out.grad.reshape(&shape)?,
        ..out
    })
}

/// Label-smoothed cross-entropy, or focal loss with this γ when
/// `focal_gamma` is set (`train.loss = "focal"`), against the batch's soft
/// targets when Mixup or CutMix made them.
fn training_loss(
    smoothing: f32,
    focal_gamma: Option<f32>,
    logits: &Tensor,
    batch: &Batch,
) -> Result<LossOutput> {
    let Some(soft) = &batch.soft_targets else {
        return Ok(match focal_gamma {
            Some(gamma) => focal_loss(logits, &batch.labels, smoothing, gamma)?,
            None => softmax_cross_entropy(logits, &batch.labels, smoothing)?,
        });
    };
    let classes = logits.shape().get(1).copied().unwrap_or(1);
    let smoothed = soft
        .iter()
        .map(|&p| (1.0 - smoothing) * p + smoothing / classes as f32)
        .collect();
    let targets = Tensor::from_vec(&[batch.len(), classes], smoothed)?;
    Ok(match focal_gamma {
        Some(gamma) => soft_focal_loss(logits, &targets, gamma)?,
        None => soft_cross_entropy(logits, &targets)?,
    })
}

impl Learner for CpuLearner {
    /// Runs the step now; its result waits for `collect_step`.
    fn submit_batch(&mut self, batch: &Batch, lr: StepLr<'_>) -> Result<()> {
        let applied = self.ready.iter().filter(|r| r.grad_norm.is_some()).count();
        let lr = (lr.at)(lr.applied + applied as u64);
        let pool = Arc::clone(&self.pool);
        let result = pool.scope(|| self.train_in_scope(batch, lr))?;
        self.ready.push_back(result);
        Ok(())
    }

    fn collect_step(&mut self) -> Result<Option<StepResult>> {
        Ok(self.ready.pop_front())
    }

    /// From the next step on, each step's gradients are the sum over the
    /// ranks' shards of the global batch (`batch_size × world`).
    fn join_ranks(&mut self, ranks: Ranks) -> Result<()> {
        let ranks = CpuRanks::new(&mut self.network, ranks)?;
        self.optimizer
            .shard(ranks.owned_params().map(<[bool]>::to_vec));
        self.ranks = Some(ranks);
        Ok(())
    }

    fn ranks(&self) -> Option<Ranks> {
        self.ranks.as_ref().map(|r| r.ranks.clone())
    }

    /// Sharded: the leader gathers the other ranks' moments (every rank
    /// calls this at the same step).
    fn gather_state(&mut self) -> Result<()> {
        match &self.ranks {
            Some(ranks) => ranks.gather_moments(&mut self.optimizer, &mut self.network),
            None => Ok(()),
        }
    }

    fn release_gathered_state(&mut self) {
        self.optimizer.drop_unowned();
    }

    /// Wall time after each layer's forward and backward, the loss and the
    /// optimizer (steps run one at a time here, as always on the CPU).
    fn profile_start(&mut self) -> Result<bool> {
        self.network.profile_start();
        Ok(true)
    }

    fn profile_finish(&mut self) -> Result<Vec<ProfileSegment>> {
        Ok(self.network.profile_finish())
    }

    fn steps_in_flight(&self) -> usize {
        self.ready.len()
    }

    fn eval_batch(&mut self, batch: &Batch) -> Result<EvalResult> {
        let pool = Arc::clone(&self.pool);
        pool.scope(|| self.eval_in_scope(batch))
    }

    fn eval_probabilities(&mut self, batch: &Batch) -> Result<Vec<f32>> {
        let pool = Arc::clone(&self.pool);
        pool.scope(|| {
            let classes = self.network.num_classes();
            let mut probabilities = Vec::with_capacity(batch.len() * classes);
            for part in batch.micro_batches(self.micro_batch) {
                let prepared = self.prepare(&part)?;
                let logits = self.network.forward(&prepared.input, Mode::Eval)?;
                probabilities.extend_from_slice(logits.data());
            }
            softmax_rows(&mut probabilities, classes);
            Ok(probabilities)
        })
    }

    fn uses_batch_statistics(&self) -> bool {
        self.network.spec().uses_batch_statistics()
    }

    fn value_loss(&self) -> Option<ValueLoss> {
        self.settings.regression
    }

    fn micro_batch(&self) -> usize {
        self.micro_batch
    }

    fn set_micro_batch(&mut self, size: usize) {
        self.micro_batch = size.max(1);
    }

    fn snapshot(&mut self) -> Result<LearnerState> {
        super::require_no_steps_in_flight(self.ready.len(), "snapshot")?;
        // Copies as large as the model, made fallibly: short memory at a
        // checkpoint is an out-of-memory value, never an abort.
        let params = self
            .network
            .params_mut()
            .iter()
            .map(|p| {
                let mut copy = try_scratch(p.value.len())?;
                copy.extend_from_slice(p.value.data());
                Ok(copy)
            })
            .collect::<Result<_>>()?;
        Ok(LearnerState {
            params,
            buffers: self.network.buffer_values(),
            optimizer: self.optimizer.state()?,
            loss_scale: None,
        })
    }

    fn write_state(&mut self, out: &mut dyn StateWriter) -> Result<()> {
        super::require_no_steps_in_flight(self.ready.len(), "write_state")?;
        let params = self.network.params_mut();
        write_list(out, params.iter().map(|p| p.value.data()))?;
        let buffers = self.network.buffers_mut();
        write_list(out, buffers.iter().map(|b| b.data()))?;
        for moments in self.optimizer.moments() {
            write_list(out, moments.iter().map(Vec::as_slice))?;
        }
        out.finish(self.optimizer.steps_taken(), None)
    }

    fn restore(&mut self, state: LearnerState) -> std::result::Result<(), String> {
        super::require_no_steps_in_flight(self.ready.len(), "restore")
            .map_err(|e| e.to_string())?;
        self.check_shapes(&state)?;
        // Last fallible step first, so a refusal changes nothing.
        self.optimizer
            .load_state(state.optimizer)
            .map_err(|e| e.to_string())?;
        for (param, values) in self.network.params_mut().into_iter().zip(&state.params) {
            param.value.data_mut().copy_from_slice(values);
        }
        for (buffer, values) in self.network.buffers_mut().into_iter().zip(&state.buffers) {
            buffer.data_mut().copy_from_slice(values);
        }
        Ok(())
    }

    fn measure_step_peak(&mut self, micro_batch: usize) -> Result<u64> {
        let pool = Arc::clone(&self.pool);
        Ok(pool
            .scope(|| self.network.measure_step(micro_batch))?
            .peak_in_use_bytes)
    }

    fn memory_stats(&self) -> PoolStats {
        self.pool.stats()
    }

    fn memory_limit(&self) -> Option<u64> {
        self.pool.limit()
    }

    fn release_cache(&mut self) -> u64 {
        self.pool.empty_cache()
    }

    fn num_params(&mut self) -> usize {
        self.network.num_params()
    }

    fn num_trainable_params(&mut self) -> usize {
        self.network.num_trainable_params()
    }

    fn macs_per_sample(&self) -> Result<u64> {
        Ok(self.network.macs_per_sample()?)
    }

    fn num_classes(&self) -> usize {
        self.network.num_classes()
    }

    fn device_name(&self) -> String {
        "cpu".into()
    }

    /// Sharded, this rank's share.
    fn optimizer_state_bytes(&mut self) -> Option<u64> {
        let owned = self.ranks.as_ref().and_then(CpuRanks::owned_params);
        let params: Vec<_> = self
            .network
            .params_mut()
            .into_iter()
            .enumerate()
            .filter(|(i, _)| owned.as_ref().is_none_or(|o| o[*i]))
            .map(|(_, p)| p)
            .collect();
        Some(headroom_optim::adamw_state_bytes(&params))
    }
}
