//! The loop: take a batch, forward, loss, backward, clip, step, report;
//! checkpoints at epoch ends, every N steps or minutes, on a stop request
//! and before an error; an evaluation at each epoch's end (of the
//! validation split when there is one, whose watched figure may keep a
//! best checkpoint and end the run early: `crate::monitor`), and then the
//! test set's one score.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use headroom_loader::{Batch, DataLoader};
use headroom_model::cuda::ops::TunedConv;
use headroom_optim::Schedule;

use super::{CheckpointSettings, LoopSettings, Run, Task};
use crate::checkpoint::{self, Checkpoint, CheckpointMeta, EpochProgress};
use crate::eval::{evaluate, macro_f1, Evaluation};
use crate::learner::{Learner, StepLr, StepResult};
use crate::memory::MemoryGuard;
use crate::monitor::{MonitorState, Verdict};
use crate::sink::{BestEpoch, EpochSummary, EvaluatedOn, Event, SinkLink, StepReport, TestSummary};
use crate::{PipelineError, Result};

/// What the loop needs besides the run: its own settings and the record a
/// checkpoint keeps.
pub(crate) struct RunSettings {
    pub settings: LoopSettings,
    pub checkpoint: CheckpointSettings,
    pub dir: PathBuf,
    pub fingerprint: u32,
    pub record_json: String,
    pub model_json: String,
    /// Set (by a signal handler, say) to stop after the current step with a
    /// checkpoint.
    pub stop: Option<Arc<AtomicBool>>,
    /// False on a data-parallel run's followers: the leader writes the
    /// checkpoints (the ranks' states are the same bits).
    pub writes_checkpoints: bool,
    /// Ranks of a data-parallel run (1 alone): a step's loss and correct
    /// count are the global batch's, so its samples count N times a
    /// rank's batch.
    pub world: usize,
}

pub(crate) enum Finish {
    Completed,
    Stopped,
}

/// Where the run stands: what a checkpoint restores.
#[derive(Clone, Debug, Default)]
pub struct Position {
    pub epoch: u64,
    pub batches_done: usize,
    pub step: u64,
    pub consecutive_skips: u64,
    pub progress: EpochProgress,
    /// Where `train.early_stopping`'s watch stands.
    pub monitor: MonitorState,
}

/// What learns, its schedule, and where it is: what a checkpoint holds.
pub(crate) struct Trainee {
    pub learner: Box<dyn Learner>,
    pub schedule: Schedule,
    pub position: Position,
    /// When the last checkpoint was taken (or the run started), for
    /// `checkpoint.every_minutes`.
    pub checkpointed_at: Instant,
}

impl Trainee {
    /// Whether `checkpoint.every_minutes` asks for a checkpoint now.
    fn checkpoint_overdue(&self, settings: &RunSettings) -> bool {
        let minutes = settings.checkpoint.every_minutes;
        minutes > 0.0 && self.checkpointed_at.elapsed().as_secs_f64() >= minutes * 60.0
    }
}

pub(crate) fn run_epochs(
    plan: &RunSettings,
    run: &mut Run,
    events: &SinkLink,
    summaries: &mut Vec<EpochSummary>,
    memory: &mut MemoryGuard,
) -> Result<Finish> {
    while run.trainee.position.epoch < plan.settings.epochs && !stopped_early(plan, run) {
        let Some((summary, watched)) = run_epoch(plan, run, events, memory)? else {
            checkpoint_now(plan, &mut run.trainee, events, memory)?;
            return Ok(Finish::Stopped);
        };
        events.send(Event::Epoch(summary.clone()))?;
        let last = run.trainee.position.epoch == plan.settings.epochs;
        let (improved, stop) = watched
            .as_ref()
            .map_or((false, false), |(v, _)| (v.improved, v.stop));
        // The best epoch's checkpoint is written whatever
        // `checkpoint.every_epoch` says: it becomes `best.ckpt`.
        if plan.checkpoint.every_epoch || last || improved || stop {
            checkpoint_now(plan, &mut run.trainee, events, memory)?;
        }
        if let (true, Some((_, figure))) = (improved, watched) {
            events.send(Event::Best(BestEpoch {
                epoch: summary.epoch,
                figure,
            }))?;
        }
        summaries.push(summary);
    }
    if stopped_early(plan, run) && run.trainee.position.epoch < plan.settings.epochs {
        // After the sink's line for the last epoch, not before it.
        events.sync()?;
        if let (Some(watch), Some((best, epoch))) = (
            &plan.settings.early_stopping,
            run.trainee.position.monitor.best,
        ) {
            tracing::info!(
                "early stop after epoch {} of {}: {} epochs without a better {} than {best:.4} \
                 (epoch {})",
                run.trainee.position.epoch,
                plan.settings.epochs,
                run.trainee.position.monitor.epochs_since_best,
                watch.describe(),
                epoch + 1
            );
        }
    }
    Ok(Finish::Completed)
}

/// An epoch's verdict on the watched figure, and the figure as text.
type Watched = (Verdict, String);

/// Whether `train.early_stopping`'s patience has run out.
pub(crate) fn stopped_early(plan: &RunSettings, run: &Run) -> bool {
    plan.settings
        .early_stopping
        .as_ref()
        .is_some_and(|watch| run.trainee.position.monitor.exhausted(watch))
}

/// The test set scored once after the last epoch of a run with a
/// validation split, with the best checkpoint's weights when the run kept
/// one, and sent to the sink. None for a run without a validation split
/// (its epochs were scored on the test set).
pub(crate) fn final_test(
    plan: &RunSettings,
    run: &mut Run,
    events: &SinkLink,
    memory: &mut MemoryGuard,
) -> Result<Option<TestSummary>> {
    if run.validation_loader.is_none() {
        return Ok(None);
    }
    let position = run.trainee.position.clone();
    let best = plan
        .settings
        .early_stopping
        .as_ref()
        .and(position.monitor.best);
    let last = (position.epoch.saturating_sub(1), false);
    let (weights_of_epoch, from_best_checkpoint) = match best {
        Some((_, epoch)) => {
            // `best.ckpt` is in place once the sink has handled every
            // event sent so far.
            events.sync()?;
            let path = events.dir().get().join(checkpoint::BEST_FILE);
            if path.is_file() {
                restore_weights(run.trainee.learner.as_mut(), &path, epoch)?;
                (epoch, true)
            } else {
                // Set aside on resume as stale, its epoch's checkpoint
                // since pruned: the last weights are scored, and said to be.
                tracing::warn!(
                    "no best checkpoint of epoch {} in {}: the test set is scored with the last \
                     weights",
                    epoch + 1,
                    path.display()
                );
                last
            }
        }
        None => last,
    };
    let test = evaluate_within_memory(&mut run.trainee, &run.test_loader, plan, memory)?;
    if !test.loss.is_finite() {
        return Err(PipelineError::NonFinite(format!(
            "the test loss of the weights of epoch {} is {}",
            weights_of_epoch + 1,
            test.loss
        )));
    }
    let summary = TestSummary {
        epoch: position.epoch,
        weights_of_epoch,
        from_best_checkpoint,
        loss: test.loss,
        accuracy: test.accuracy,
        macro_f1: (plan.settings.task == Task::Classifier)
            .then(|| macro_f1(&test.confusion))
            .flatten(),
        baseline_loss: test.baseline_loss,
        regression: test.regression,
        top5_accuracy: test.top5_accuracy,
        multilabel: test.multilabel,
    };
    events.send(Event::Test(summary.clone()))?;
    Ok(Some(summary))
}

/// Puts the weights of `path` (the best checkpoint, of `epoch`) into the
/// learner, for the test pass.
fn restore_weights(learner: &mut dyn Learner, path: &std::path::Path, epoch: u64) -> Result<()> {
    let saved = checkpoint::load(path)?;
    let fail = |reason: String| PipelineError::Checkpoint {
        path: path.to_path_buf(),
        reason,
    };
    if saved.meta.epoch != epoch + 1 || saved.meta.batches_done != 0 {
        return Err(fail(format!(
            "it holds epoch {} (batch {}), and the run's best is the end of epoch {}",
            saved.meta.epoch,
            saved.meta.batches_done,
            epoch + 1
        )));
    }
    learner.restore(saved.into_parts().1).map_err(fail)
}

/// Snapshots to host memory on this thread, once the previous checkpoint is
/// on disk; the sink stage writes the file. When the copy is refused, or
/// would crowd the memory left, this thread writes the file from the
/// learner's own tensors instead.
fn checkpoint_now(
    plan: &RunSettings,
    trainee: &mut Trainee,
    events: &SinkLink,
    memory: &mut MemoryGuard,
) -> Result<()> {
    trainee.learner.gather_state()?;
    let written = write_checkpoint(plan, trainee, events, memory);
    trainee.learner.release_gathered_state();
    written
}

/// [`checkpoint_now`]'s writing, once the state is whole on this rank.
fn write_checkpoint(
    plan: &RunSettings,
    trainee: &mut Trainee,
    events: &SinkLink,
    memory: &mut MemoryGuard,
) -> Result<()> {
    if !plan.writes_checkpoints {
        trainee.checkpointed_at = Instant::now();
        return Ok(());
    }
    events.take_checkpoint_token()?;
    let tuned_convs = trainee.learner.tuned_convolutions();
    let meta = checkpoint_meta(plan, &trainee.position, tuned_convs);
    match memory.snapshot(trainee.learner.as_mut(), meta.step)? {
        Some(state) => events.send(Event::Checkpoint(Box::new(Checkpoint::new(meta, state))))?,
        None => write_with_no_copy(plan, &meta, trainee.learner.as_mut(), events, memory)?,
    }
    trainee.checkpointed_at = Instant::now();
    memory.after_checkpoint(trainee.learner.as_mut());
    Ok(())
}

/// The checkpoint of `meta` written on this thread from the learner's own
/// tensors, in the sink's order (`SinkLink::write_here`).
fn write_with_no_copy(
    plan: &RunSettings,
    meta: &CheckpointMeta,
    learner: &mut dyn Learner,
    events: &SinkLink,
    memory: &mut MemoryGuard,
) -> Result<()> {
    let started = Instant::now();
    let path = events.write_here(|dir| {
        checkpoint::write_with(dir, meta, plan.checkpoint.keep, |out| {
            memory.write_state(learner, meta.step, out)
        })
    })?;
    tracing::info!(
        "checkpoint {} written from the learner's own tensors in {:.0} ms",
        path.display(),
        started.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}

fn stop_requested(settings: &RunSettings) -> bool {
    settings
        .stop
        .as_ref()
        .is_some_and(|flag| flag.load(Ordering::SeqCst))
}

/// Trains the rest of the current epoch and evaluates; with a watched
/// figure, its verdict and the figure's text. None when a stop was
/// requested first (the caller writes the checkpoint).
///
/// A GPU learner runs a step while the host loads, stages and queues the
/// next (`Learner::pipeline_depth`), so a step's result is collected one
/// step after it was submitted. Every step is collected before a checkpoint
/// (which then holds exactly the collected steps), before evaluation and
/// before a stop.
fn run_epoch(
    plan: &RunSettings,
    run: &mut Run,
    events: &SinkLink,
    memory: &mut MemoryGuard,
) -> Result<Option<(EpochSummary, Option<Watched>)>> {
    let Run {
        trainee,
        train_loader,
        test_loader,
        validation_loader,
    } = run;
    let (held_out, evaluated_on) = match validation_loader {
        Some(loader) => (&*loader, EvaluatedOn::Validation),
        None => (&*test_loader, EvaluatedOn::Test),
    };
    let epoch = trainee.position.epoch;
    let mut steps = Steps {
        plan,
        events,
        batches_per_epoch: train_loader.batches_per_epoch(),
        in_flight: VecDeque::new(),
        started: Instant::now(),
    };
    for batch in train_loader.epoch(epoch, trainee.position.batches_done) {
        let batch = match batch {
            Ok(batch) => batch,
            Err(cause) => {
                return Err(stop_with_checkpoint(
                    &mut steps,
                    trainee,
                    memory,
                    cause.into(),
                ))
            }
        };
        if steps.checkpoint_may_follow(trainee) && steps.drain(trainee, memory)? {
            return Ok(None);
        }
        match submit_step(trainee, &batch, memory) {
            Err(stop @ PipelineError::OutOfMemory(_)) => {
                // The failed step changed nothing: checkpoint the steps before it.
                steps.drain(trainee, memory)?;
                checkpoint_now(plan, trainee, events, memory)?;
                return Err(stop);
            }
            other => other?,
        }
        steps.in_flight.push_back(Submitted {
            index: batch.index,
            samples: batch.len() * plan.world,
        });
        while trainee.learner.steps_in_flight() > trainee.learner.pipeline_depth() {
            if steps.collect(trainee, memory)? {
                return Ok(None);
            }
        }
    }
    if steps.drain(trainee, memory)? {
        return Ok(None);
    }
    // The epoch's training is not lost when its evaluation fails: the
    // checkpoint's position is the epoch's end, and a resume evaluates.
    let test = match evaluate_within_memory(trainee, held_out, plan, memory) {
        // Weights that give a non-finite test loss are no result to report
        // and no state to keep: the run stops with the checkpoints before
        // them as they were.
        Ok(test) if !test.loss.is_finite() => {
            return Err(PipelineError::Evaluation {
                epoch: epoch + 1,
                cause: Box::new(PipelineError::NonFinite(format!(
                    "the {} loss is {}: the weights no longer give finite outputs. Nothing was \
                     checkpointed after the last one written; lower the learning rate (or set \
                     train.clip_norm) and resume: cargo xtask train --resume {} --set optimizer.lr=<lower>",
                    evaluated_on.name(),
                    test.loss,
                    crate::shell::quote_path(&plan.dir)
                ))),
            });
        }
        Ok(test) => test,
        Err(cause) => {
            let cause = PipelineError::Evaluation {
                epoch: epoch + 1,
                cause: Box::new(cause),
            };
            return Err(stop_with_checkpoint(&mut steps, trainee, memory, cause));
        }
    };
    let position = &mut trainee.position;
    let watched = match &plan.settings.early_stopping {
        Some(watch) => {
            let value = test.figure(watch.metric).ok_or_else(|| {
                PipelineError::value(
                    "train.early_stopping.metric",
                    format!("the validation pass has no {} for this task", watch.metric),
                )
            })?;
            let verdict = position.monitor.observe(watch, value, epoch);
            Some((verdict, format!("validation {} {value:.4}", watch.metric)))
        }
        None => None,
    };
    let progress = std::mem::take(&mut position.progress);
    position.epoch += 1;
    position.batches_done = 0;
    let summary = EpochSummary {
        epoch,
        train_loss: train_loss(&progress),
        train_accuracy: train_accuracy(&progress, predictions_per_sample(plan.settings.task)),
        test_loss: test.loss,
        test_accuracy: test.accuracy,
        test_baseline_loss: test.baseline_loss,
        test_regression: test.regression,
        test_top5_accuracy: test.top5_accuracy,
        test_multilabel: test.multilabel,
        test_macro_f1: (plan.settings.task == Task::Classifier)
            .then(|| macro_f1(&test.confusion))
            .flatten(),
        train_seconds: progress.train_seconds,
        train_samples_per_sec: progress.seen as f64 / progress.train_seconds.max(1e-9),
        skipped_steps: progress.skipped,
        evaluated_on,
        best: watched.as_ref().map(|(verdict, _)| verdict.improved),
    };
    Ok(Some((summary, watched)))
}

/// The mean loss of the epoch's trained steps: None when every step was
/// skipped (nothing was trained, so there is no figure to show).
fn train_loss(progress: &EpochProgress) -> Option<f32> {
    (progress.seen > 0).then(|| (progress.loss_sum / progress.seen as f64) as f32)
}

/// The share of correct predictions over the epoch's trained steps, where
/// the task has them (a token model's are tokens, `per_sample` to a sample;
/// a frame model has none): None too when every step was skipped.
fn train_accuracy(progress: &EpochProgress, per_sample: Option<u64>) -> Option<f32> {
    let per_sample = per_sample.filter(|_| progress.seen > 0)?;
    Some(progress.correct as f32 / (progress.seen * per_sample) as f32)
}

/// The epoch-end evaluation, its out-of-memory errors handled by the
/// memory policy as a step's are.
fn evaluate_within_memory(
    trainee: &mut Trainee,
    test_loader: &DataLoader,
    plan: &RunSettings,
    memory: &mut MemoryGuard,
) -> Result<Evaluation> {
    let epoch = trainee.position.epoch + 1;
    let learner = trainee.learner.as_mut();
    memory.before_evaluation(epoch);
    let mut freed_cache = false;
    loop {
        match evaluate(learner, test_loader, plan.settings.tta) {
            Err(e) if e.is_out_of_memory() => {
                memory.on_evaluation_oom(&e, epoch, learner, &mut freed_cache)?
            }
            done => return done,
        }
    }
}

/// The loader could not make a training batch (a corrupt shard, a file gone
/// or unreadable), or the epoch's evaluation failed: the steps before are
/// collected and checkpointed, so that once the cause is removed `--resume`
/// goes on exactly there, instead of losing every step since the last
/// checkpoint. The error says so; should the checkpoint fail too, the
/// original error is still the one returned.
fn stop_with_checkpoint(
    steps: &mut Steps<'_>,
    trainee: &mut Trainee,
    memory: &mut MemoryGuard,
    cause: PipelineError,
) -> PipelineError {
    let saved = steps
        .drain(trainee, memory)
        .and_then(|_| checkpoint_now(steps.plan, trainee, steps.events, memory));
    match saved {
        Ok(()) => PipelineError::StoppedSaved {
            cause: Box::new(cause),
            step: trainee.position.step,
            // Where the sink wrote it: the run's directory, or the one it
            // went on in when that was removed.
            dir: steps.events.dir().get(),
        },
        Err(e) => {
            tracing::error!("no checkpoint after the error: {e}");
            cause
        }
    }
}

/// A batch whose step was submitted and not yet collected.
struct Submitted {
    index: usize,
    samples: usize,
}

/// The steps of an epoch in flight, and what collecting one involves.
struct Steps<'a> {
    plan: &'a RunSettings,
    events: &'a SinkLink,
    batches_per_epoch: usize,
    in_flight: VecDeque<Submitted>,
    /// When the last step was collected (or the epoch began).
    started: Instant,
}

impl Steps<'_> {
    /// Whether a step in flight may be one after which a periodic
    /// checkpoint is due: then it is collected before the next is submitted,
    /// so that the checkpoint holds exactly the steps before it.
    fn checkpoint_may_follow(&self, trainee: &Trainee) -> bool {
        let every = self.plan.checkpoint.every_steps;
        let step = trainee.position.step;
        every > 0 && (1..=self.in_flight.len() as u64).any(|j| (step + j).is_multiple_of(every))
    }

    /// Collects every step in flight; true when a stop was requested.
    fn drain(&mut self, trainee: &mut Trainee, memory: &mut MemoryGuard) -> Result<bool> {
        let mut stop = false;
        while !self.in_flight.is_empty() {
            stop |= self.collect(trainee, memory)?;
        }
        Ok(stop)
    }

    /// Collects the oldest step in flight: the position advances, its
    /// report goes out, then a divergence stop, the memory policy, a
    /// periodic checkpoint. True when a stop was requested (every step
    /// collected by then).
    fn collect(&mut self, trainee: &mut Trainee, memory: &mut MemoryGuard) -> Result<bool> {
        let (plan, events) = (self.plan, self.events);
        let Some(submitted) = self.in_flight.pop_front() else {
            return Ok(false);
        };
        let result = trainee
            .learner
            .collect_step()?
            .ok_or_else(|| PipelineError::Stage {
                stage: "train",
                reason: format!("the step of batch {} left no result", submitted.index),
            })?;
        let report = record_step(trainee, &submitted, result);
        let seconds = self.started.elapsed().as_secs_f64();
        self.started = Instant::now();
        trainee.position.progress.train_seconds += seconds;
        events.send(Event::Step(StepReport {
            batches_per_epoch: self.batches_per_epoch,
            memory_bytes: trainee.learner.memory_stats().reserved_bytes,
            samples_per_sec: report.samples as f64 / seconds.max(1e-9),
            oom_events: memory.oom_events,
            ..report
        }))?;
        if trainee.position.consecutive_skips >= plan.settings.max_consecutive_skips {
            // No checkpoint of this state: the update before the skips may
            // have left weights that are finite but give nothing finite (a
            // learning rate of 1e35 does), and resuming from them with a
            // lower rate would diverge again. The trainer sets aside the
            // checkpoints written after that update once the sink is done.
            self.drain(trainee, memory)?;
            return Err(PipelineError::Diverged {
                skips: trainee.position.consecutive_skips,
                from_step: trainee.position.step,
                dir: plan.dir.clone(),
                resume_from: String::new(),
            });
        }
        let (step, done) = (trainee.position.step, trainee.position.batches_done);
        memory.after_step(step, trainee.learner.as_mut());
        let every = plan.checkpoint.every_steps;
        let by_steps = every > 0 && step % every == 0;
        let due = by_steps || trainee.checkpoint_overdue(plan);
        if !report.skipped && due && done < self.batches_per_epoch {
            // Claimed before the steps in flight are collected, so that
            // none of them is taken for another checkpoint on the way.
            trainee.checkpointed_at = Instant::now();
            let stop = self.drain(trainee, memory)?;
            checkpoint_now(plan, trainee, events, memory)?;
            if stop {
                return Ok(true);
            }
        }
        if stop_requested(self.plan) {
            self.drain(trainee, memory)?;
            return Ok(true);
        }
        Ok(false)
    }
}

/// Submits the optimizer step of `batch` to the learner. Out of memory is
/// handled here by the memory policy (the learner leaves the model as it was
/// when a submission fails).
fn submit_step(trainee: &mut Trainee, batch: &Batch, memory: &mut MemoryGuard) -> Result<()> {
    let Trainee {
        learner,
        schedule,
        position,
        ..
    } = trainee;
    let step = position.step;
    memory.before_step(step);
    let at = |i: u64| schedule.lr_at(i);
    let mut freed_cache = false;
    loop {
        let lr = StepLr {
            applied: position.step,
            at: &at,
        };
        match learner.submit_batch(batch, lr) {
            Ok(()) => return Ok(()),
            Err(e) if e.is_out_of_memory() => {
                memory.on_oom(&e, step, learner.as_mut(), &mut freed_cache, batch.len())?;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Advances the position by a collected step's result.
fn record_step(trainee: &mut Trainee, submitted: &Submitted, result: StepResult) -> StepReport {
    let lr = trainee.schedule.lr_at(trainee.position.step);
    let position = &mut trainee.position;
    position.batches_done = submitted.index + 1;
    match result.grad_norm {
        Some(_) => {
            position.step += 1;
            position.consecutive_skips = 0;
            position.progress.loss_sum += result.loss as f64 * submitted.samples as f64;
            position.progress.correct += result.correct as u64;
            position.progress.seen += submitted.samples as u64;
        }
        None => {
            position.consecutive_skips += 1;
            position.progress.skipped += 1;
            tracing::warn!(
                "epoch {} batch {}: non-finite loss or gradient, step skipped ({} in a row)",
                position.epoch + 1,
                submitted.index,
                position.consecutive_skips
            );
        }
    }
    StepReport {
        epoch: position.epoch,
        step: position.step,
        batch: submitted.index,
        batches_per_epoch: 0,
        samples: submitted.samples,
        loss: result.loss,
        lr,
        grad_norm: result.grad_norm.unwrap_or(f32::NAN),
        skipped: result.grad_norm.is_none(),
        memory_bytes: 0,
        samples_per_sec: 0.0,
        oom_events: 0,
    }
}

fn checkpoint_meta(
    plan: &RunSettings,
    position: &Position,
    tuned_convs: Vec<TunedConv>,
) -> CheckpointMeta {
    let position = position.clone();
    CheckpointMeta {
        config_fingerprint: plan.fingerprint,
        config_json: plan.record_json.clone(),
        model_json: plan.model_json.clone(),
        epoch: position.epoch,
        batches_done: position.batches_done,
        step: position.step,
        consecutive_skips: position.consecutive_skips,
        progress: position.progress,
        tuned_convs,
        monitor: position.monitor,
    }
}

/// The predictions a sample holds, which accuracy counts: one class, or a
/// token model's one per position; a frame model has none.
fn predictions_per_sample(task: Task) -> Option<u64> {
    match task {
        Task::Classifier => Some(1),
        Task::Tokens { length } => Some(length as u64),
        Task::Frames | Task::Regression | Task::MultiLabel => None,
    }
}

#[cfg(test)]
mod figures_tests {
    use super::*;

    #[test]
    fn an_epoch_whose_every_step_was_skipped_has_no_training_figures() {
        let skipped_all = EpochProgress {
            loss_sum: 0.0,
            correct: 0,
            seen: 0,
            skipped: 7,
            train_seconds: 1.0,
        };
        assert_eq!(train_loss(&skipped_all), None);
        assert_eq!(train_accuracy(&skipped_all, Some(1)), None);
        let trained = EpochProgress {
            loss_sum: 6.0,
            correct: 3,
            seen: 4,
            skipped: 1,
            train_seconds: 1.0,
        };
        assert_eq!(train_loss(&trained), Some(1.5));
        assert_eq!(train_accuracy(&trained, Some(1)), Some(0.75));
        assert_eq!(train_accuracy(&trained, Some(3)), Some(0.25));
        assert_eq!(train_accuracy(&trained, None), None);
    }
}
