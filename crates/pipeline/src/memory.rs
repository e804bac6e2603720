//! The memory policy of a run. Every tensor of the run comes from the run's
//! own pool (so a budget is exact and everything is released when the run
//! ends). When an allocation fails: free the pool's cache and retry the step
//! (or the epoch's evaluation); then halve the micro-batch (accumulating
//! gradients over twice as many micro-batches, so the update, the loss and
//! the schedule do not change), down to `memory.min_micro_batch` (2 unless
//! set: a run is stopped with advice rather than left to crawl at one
//! sample a micro-batch); only then checkpoint and stop with the figures
//! and what to change. Every event is
//! logged with the pool's figures.

use std::sync::Arc;
use std::time::Instant;

use headroom_model::memory::{bytes_text, MemoryPool, OomInjection, PoolStats};
use headroom_model::{Device, ModelError};

use crate::config::{ExperimentConfig, InjectOom};
use crate::learner::{Learner, LearnerState, StateWriter};
use crate::{PipelineError, Result};

/// Head-room kept above a dry run's measured peak when choosing a micro-batch.
const PLANNING_MARGIN: f64 = 1.10;

pub struct MemoryGuard {
    pool: Arc<MemoryPool>,
    adapt: bool,
    min_micro_batch: usize,
    inject: InjectOom,
    /// Checkpoint copies, and writes with no copy, still to refuse
    /// (`inject_oom.snapshots`).
    snapshot_refusals: u64,
    empty_every: u64,
    empty_after_checkpoint: bool,
    /// Releases of the cache for housekeeping, and their total time.
    pub cleanups: u64,
    pub cleanup_seconds: f64,
    pub oom_events: u64,
    /// Where the stop checkpoint goes, for the message.
    dir: std::path::PathBuf,
    /// The block refused just before the last split, and the micro-batch
    /// split from: a refusal as large after it means splitting does not help.
    last_split: Option<(u64, usize)>,
}

/// What the memory policy did about an out-of-memory error.
enum Recovery {
    /// Released this many bytes of cached blocks.
    Released(u64),
    /// Halved the micro-batch to this.
    Split(usize),
}

fn figures(stats: &PoolStats, limit: Option<u64>) -> String {
    format!(
        "in use {}, reserved {}, peak {}, limit {}",
        bytes_text(stats.in_use_bytes),
        bytes_text(stats.reserved_bytes),
        bytes_text(stats.peak_in_use_bytes),
        limit.map_or("none".into(), bytes_text)
    )
}

/// The memory policy's own settings (`[memory]`, `device.memory_limit`,
/// `device.inject_oom`), typed: what a `Trainer` built in code sets.
#[derive(Clone, Debug, PartialEq)]
pub struct MemorySettings {
    /// The tensor budget in bytes; None: derived from what the process may
    /// really use (see [`MemorySettings::budget`]).
    pub limit: Option<u64>,
    pub oom_policy: OomPolicy,
    /// The micro-batch the policy halves down to, no further.
    pub min_micro_batch: usize,
    /// Release the pool's cached blocks every N steps (0 = never) ...
    pub empty_cache_every: u64,
    /// ... and after every checkpoint.
    pub empty_cache_after_checkpoint: bool,
    /// Failures to inject, for tests of the policy.
    pub inject_oom: InjectOom,
    /// Whether the budget is for a GPU run's host side (the GPU learner
    /// states its own budget): then the derived budget is not announced.
    pub trains_on_gpu: bool,
}

pub use crate::config::OomPolicy;

impl Default for MemorySettings {
    fn default() -> Self {
        Self {
            limit: None,
            oom_policy: OomPolicy::Adapt,
            min_micro_batch: crate::config::DEFAULT_MIN_MICRO_BATCH,
            empty_cache_every: 0,
            empty_cache_after_checkpoint: false,
            inject_oom: InjectOom::default(),
            trains_on_gpu: false,
        }
    }
}

impl MemorySettings {
    /// The settings of `config` (which it validated).
    pub fn from_config(config: &ExperimentConfig) -> Result<Self> {
        Ok(Self {
            limit: config.memory_limit()?,
            oom_policy: config.memory.oom_policy,
            min_micro_batch: config.memory.min_micro_batch,
            empty_cache_every: config.memory.empty_cache_every,
            empty_cache_after_checkpoint: config.memory.empty_cache_after_checkpoint,
            inject_oom: config.device.inject_oom.clone(),
            trains_on_gpu: config.memory_limit()?.is_none()
                && crate::device::gpu_memory(config.learner_device()).is_some(),
        })
    }

    /// `limit`, or a budget derived from what the process may really use
    /// (cgroup `memory.max`, RLIMIT_AS / RLIMIT_DATA, available memory), so
    /// that the policy, not the OS, meets the limit first.
    pub fn budget(&self) -> Option<u64> {
        if let Some(limit) = self.limit {
            return Some(limit);
        }
        let Some((budget, ceiling)) = crate::limits::default_budget() else {
            tracing::warn!("no memory ceiling found (no cgroup limit, rlimit or /proc/meminfo): tensor memory is unbounded");
            return None;
        };
        // A GPU run's tensors live on the GPU, whose learner states its own
        // budget; this host one would only mislead there.
        if !self.trains_on_gpu {
            tracing::info!(
                "tensor budget {} (device.memory_limit unset): half of the {} left under {}",
                bytes_text(budget),
                bytes_text(ceiling.room),
                ceiling.source
            );
        }
        Some(budget)
    }
}

impl MemoryGuard {
    /// The policy of `settings`, its stop checkpoints going to `dir`.
    pub fn new(settings: &MemorySettings, dir: &std::path::Path) -> Self {
        let pool = MemoryPool::new(Device::Cpu);
        pool.set_limit(settings.budget());
        Self {
            pool,
            adapt: settings.oom_policy == OomPolicy::Adapt,
            min_micro_batch: settings.min_micro_batch,
            inject: settings.inject_oom.clone(),
            snapshot_refusals: settings.inject_oom.snapshots,
            empty_every: settings.empty_cache_every,
            empty_after_checkpoint: settings.empty_cache_after_checkpoint,
            cleanups: 0,
            cleanup_seconds: 0.0,
            oom_events: 0,
            dir: dir.to_path_buf(),
            last_split: None,
        }
    }

    pub fn pool(&self) -> Arc<MemoryPool> {
        Arc::clone(&self.pool)
    }

    pub fn stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// Arms an injected failure for this step when the test plan says so.
    pub fn before_step(&self, step: u64) {
        let every = self.inject.every > 0 && step > 0 && step.is_multiple_of(self.inject.every);
        if every || self.inject.steps.contains(&step) {
            self.pool.inject_oom(OomInjection::Next);
        }
    }

    /// Arms an injected failure for the evaluation after training epoch
    /// `epoch` (counted from 1) when the test plan says so.
    pub fn before_evaluation(&self, epoch: u64) {
        if self.inject.evaluations.contains(&epoch) {
            self.pool.inject_oom(OomInjection::Next);
        }
    }

    /// Decides what follows an out-of-memory error in a step of `learner`:
    /// Ok to retry (its cache released, or its micro-batch halved), or the
    /// error that stops the run.
    pub fn on_oom(
        &mut self,
        error: &PipelineError,
        step: u64,
        learner: &mut dyn Learner,
        freed_cache: &mut bool,
        batch: usize,
    ) -> Result<()> {
        let here = format!(
            "out of memory at step {step}: {}",
            self.describe(error, learner)
        );
        let requested = refused_bytes(error);
        let by_system = matches!(
            error,
            PipelineError::Model(ModelError::OutOfMemory { limit: None, .. })
        );
        // A block that did not shrink when the micro-batch was halved does
        // not grow with the batch (weights, optimizer state, a fixed
        // workspace): halving again would only slow the run down to
        // micro-batch 1 and still fail.
        if let Some((before, split_from, now)) =
            split_did_not_help(self.last_split, learner.micro_batch(), requested)
        {
            return Err(self.stop_message(
                    &format!(
                        "{here}; halving the micro-batch from {split_from} to {} did not make the refused \
                         block smaller ({} before, {} now): it does not grow with the batch",
                        learner.micro_batch(),
                        bytes_text(before),
                        bytes_text(now)
                    ),
                    None,
                    by_system,
                ));
        }
        let from = learner.micro_batch();
        match self.recover(learner, freed_cache) {
            Some(Recovery::Released(bytes)) => tracing::warn!(
                "{here}: released {} of cached blocks, retrying the step",
                bytes_text(bytes)
            ),
            Some(Recovery::Split(smaller)) => {
                self.last_split = requested.map(|bytes| (bytes, from));
                let effect = if learner.uses_batch_statistics() {
                    format!(
                        "the schedule is unchanged; batch norm's statistics are now those of each \
                         micro-batch of {smaller}, so the updates differ from the whole batch's"
                    )
                } else {
                    "the update and the schedule are unchanged".to_string()
                };
                tracing::warn!(
                    "{here}: splitting the batch of {batch} into micro-batches of {smaller} ({} per step, \
                     gradients accumulated; {effect})",
                    batch.div_ceil(smaller)
                )
            }
            None => {
                let micro = learner.micro_batch();
                let floor = self.min_micro_batch.max(1);
                let here = if self.adapt && micro > 1 && micro / 2 < floor {
                    format!(
                        "{here}; a micro-batch of {} is below memory.min_micro_batch = {floor}, so \
                         the run stops here rather than train that slowly (set memory.min_micro_batch \
                         = {} to allow it)",
                        micro / 2,
                        micro / 2
                    )
                } else {
                    here
                };
                return Err(self.stop_message(&here, Some(micro), by_system));
            }
        }
        Ok(())
    }

    /// The same for an evaluation, which is then run again from its start:
    /// its micro-batch is the training's, and a halved one stays so.
    pub fn on_evaluation_oom(
        &mut self,
        error: &PipelineError,
        epoch: u64,
        learner: &mut dyn Learner,
        freed_cache: &mut bool,
    ) -> Result<()> {
        let here = format!(
            "out of memory in the evaluation after training epoch {epoch}: {}",
            self.describe(error, learner)
        );
        match self.recover(learner, freed_cache) {
            Some(Recovery::Released(bytes)) => tracing::warn!(
                "{here}: released {} of cached blocks, evaluating again",
                bytes_text(bytes)
            ),
            Some(Recovery::Split(smaller)) => tracing::warn!(
                "{here}: evaluating again in micro-batches of {smaller}, as training will go on"
            ),
            None => {
                return Err(PipelineError::OutOfMemory(format!(
                    "{here}; even a micro-batch of {} does not fit",
                    learner.micro_batch()
                )))
            }
        }
        Ok(())
    }

    /// The block that did not fit and the pool's figures then.
    fn describe(&mut self, error: &PipelineError, learner: &mut dyn Learner) -> String {
        self.oom_events += 1;
        let wanted = match error {
            PipelineError::Model(ModelError::OutOfMemory {
                requested, limit, ..
            }) => {
                let why = match limit {
                    Some(limit) => format!("over the {} budget", bytes_text(*limit)),
                    None => {
                        "refused by the system, not by the budget: the device itself had no room"
                            .into()
                    }
                };
                format!("a {} block ({why})", bytes_text(*requested))
            }
            _ => "an allocation".into(),
        };
        format!(
            "{wanted} did not fit ({})",
            figures(&learner.memory_stats(), learner.memory_limit())
        )
    }

    /// The policy's next move after an out-of-memory error: release the
    /// cache, else halve the micro-batch; None when it may do neither.
    fn recover(&mut self, learner: &mut dyn Learner, freed_cache: &mut bool) -> Option<Recovery> {
        if !self.adapt {
            return None;
        }
        if !*freed_cache {
            *freed_cache = true;
            return Some(Recovery::Released(learner.release_cache()));
        }
        let smaller = learner.micro_batch() / 2;
        if smaller < self.min_micro_batch.max(1) {
            return None;
        }
        learner.set_micro_batch(smaller);
        *freed_cache = false;
        Some(Recovery::Split(smaller))
    }

    /// The error that stops the run: `micro_batch` is the smallest tried,
    /// where the reason is that even it did not fit.
    /// `by_system`: the operating system or the driver refused the block,
    /// not the budget, so a larger budget would not help.
    fn stop_message(
        &self,
        here: &str,
        micro_batch: Option<usize>,
        by_system: bool,
    ) -> PipelineError {
        let even = match micro_batch {
            Some(size) => format!("; even a micro-batch of {size} does not fit"),
            None => String::new(),
        };
        let room = if by_system {
            "the system refused the block, so raising device.memory_limit would not help: free \
             memory on the device (or raise the process's own limit: ulimit -v, the cgroup's \
             memory.max), set"
        } else {
            "raise device.memory_limit, set"
        };
        PipelineError::OutOfMemory(format!(
            "{here}{even}. A checkpoint of the last completed step was \
             written to {}; {room} model.checkpoint = \"blocks\", lower train.batch_size, or set \
             memory.oom_policy = \"adapt\" with a lower memory.min_micro_batch, then continue with --resume",
            self.dir.display()
        ))
    }

    /// Periodic release of cached blocks, timed.
    pub fn after_step(&mut self, step: u64, learner: &mut dyn Learner) {
        if self.empty_every > 0 && step.is_multiple_of(self.empty_every) {
            self.release_cache("periodic", learner);
        }
    }

    /// The learner's state, copied for the checkpoint of `step`. A copy the
    /// memory refuses is made once more after the cached blocks go back to
    /// the system: a checkpoint is most needed when memory is short (the
    /// OOM policy's last one, say), and the failed step's blocks are then
    /// still cached. None when it is refused again, or would crowd the
    /// memory left: the caller then writes the learner's own tensors
    /// (`write_state`).
    pub fn snapshot(
        &mut self,
        learner: &mut dyn Learner,
        step: u64,
    ) -> Result<Option<LearnerState>> {
        if let Some(why) = self.copy_would_crowd(learner) {
            tracing::info!(
                "checkpoint of step {step}: {why}; writing the learner's own tensors to the file instead, with no copy"
            );
            return Ok(None);
        }
        let refused = match self.copy_state(learner) {
            Err(e) if e.is_out_of_memory() => e,
            other => return other.map(Some),
        };
        self.oom_events += 1;
        let released = learner.release_cache();
        tracing::warn!(
            "out of memory copying the state for the checkpoint of step {step} ({refused}): released {} of cached blocks, copying again",
            bytes_text(released)
        );
        match self.copy_state(learner) {
            Err(e) if e.is_out_of_memory() => {
                self.oom_events += 1;
                tracing::warn!(
                    "out of memory copying the state for the checkpoint of step {step} again ({e}): writing the \
                     learner's own tensors to the file instead, with no copy"
                );
                Ok(None)
            }
            other => other.map(Some),
        }
    }

    /// Why the state should not be copied: the copy would take more than
    /// half the memory the process has left. The OS may grant such a
    /// request and then kill the process when its pages are touched (a
    /// container's cgroup limit, overcommit), so a refusal is not to be
    /// counted on; the other half is for whatever the run needs meanwhile.
    fn copy_would_crowd(&self, learner: &mut dyn Learner) -> Option<String> {
        let (room, source) = match self.inject.snapshot_room {
            Some(room) => (room, "device.inject_oom.snapshot_room".to_string()),
            None => {
                let ceiling = crate::limits::tightest()?;
                (ceiling.room, ceiling.source)
            }
        };
        // Every parameter, and both moments of the trainable ones; the
        // buffers (batch-norm statistics, dropout counters) are small.
        let values = learner.num_params() + 2 * learner.num_trainable_params();
        let bytes = 4 * values as u64;
        (bytes > room / 2).then(|| {
            format!(
                "a copy of the state ({}) would take more than half of the {} left under {source}",
                bytes_text(bytes),
                bytes_text(room)
            )
        })
    }

    /// Writes the learner's state to `out` with no copy of it, for the
    /// checkpoint of `step` after `snapshot` was refused. Refused even so
    /// (a GPU learner's 1 MiB download buffer, say), the run stops saying
    /// what is on disk.
    pub fn write_state(
        &mut self,
        learner: &mut dyn Learner,
        step: u64,
        out: &mut dyn StateWriter,
    ) -> Result<()> {
        let written = match self.take_refusal(learner) {
            Some(refused) => Err(refused),
            None => learner.write_state(out),
        };
        match written {
            Err(e) if e.is_out_of_memory() => {
                self.oom_events += 1;
                Err(PipelineError::OutOfMemory(format!(
                    "out of memory writing the checkpoint of step {step}, even with no copy of the state: {e}. No \
                     checkpoint of step {step} was written; the newest one in {} is the last that was. Give the run \
                     more memory (fewer other processes, a higher ulimit or cgroup limit), then continue with --resume",
                    self.dir.display()
                )))
            }
            other => other,
        }
    }

    fn copy_state(&mut self, learner: &mut dyn Learner) -> Result<LearnerState> {
        match self.take_refusal(learner) {
            Some(refused) => Err(refused),
            None => learner.snapshot(),
        }
    }

    /// An out-of-memory error while `inject_oom.snapshots` has refusals
    /// left, as the learner's memory would report it.
    fn take_refusal(&mut self, learner: &dyn Learner) -> Option<PipelineError> {
        if self.snapshot_refusals == 0 {
            return None;
        }
        self.snapshot_refusals -= 1;
        let stats = learner.memory_stats();
        Some(PipelineError::Model(ModelError::OutOfMemory {
            requested: 0,
            in_use: stats.in_use_bytes,
            reserved: stats.reserved_bytes,
            limit: learner.memory_limit(),
        }))
    }

    pub fn after_checkpoint(&mut self, learner: &mut dyn Learner) {
        if self.empty_after_checkpoint {
            self.release_cache("after checkpoint", learner);
        }
    }

    fn release_cache(&mut self, why: &str, learner: &mut dyn Learner) {
        let started = Instant::now();
        let released = learner.release_cache();
        let seconds = started.elapsed().as_secs_f64();
        self.cleanups += 1;
        self.cleanup_seconds += seconds;
        tracing::debug!(
            "{why} cache release: {} in {:.3} ms",
            bytes_text(released),
            seconds * 1e3
        );
    }

    /// The largest micro-batch (batch, batch/2, ...) whose dry-run step fits
    /// the budget with a margin. Without a budget, the whole batch.
    pub fn plan_micro_batch(&self, learner: &mut dyn Learner, batch: usize) -> Result<usize> {
        let Some(limit) = learner.memory_limit() else {
            return Ok(batch);
        };
        let mut micro = batch;
        loop {
            let room = limit.saturating_sub(learner.memory_stats().in_use_bytes);
            let fits = match learner.measure_step_peak(micro) {
                Ok(peak) => {
                    tracing::info!(
                        "dry run: a step of {micro} samples peaks at {} ({} per sample); room {}",
                        bytes_text(peak),
                        bytes_text(peak / micro as u64),
                        bytes_text(room)
                    );
                    (peak as f64 * PLANNING_MARGIN) as u64 <= room
                }
                Err(e) if e.is_out_of_memory() => false,
                Err(e) => return Err(e),
            };
            if fits {
                tracing::info!("train.micro_batch = \"auto\": {micro} (of a batch of {batch})");
                return Ok(micro);
            }
            if micro / 2 < self.min_micro_batch.max(1) {
                // Nothing fits: start at the floor and let the OOM policy of
                // the first step checkpoint and stop with its message.
                tracing::warn!(
                    "train.micro_batch = \"auto\": not even {micro} samples fit device.memory_limit = {} \
                     (in use {} before the first step)",
                    bytes_text(limit),
                    bytes_text(learner.memory_stats().in_use_bytes)
                );
                return Ok(micro);
            }
            micro /= 2;
        }
    }

    /// Fails fast, before any training, when the model cannot train within
    /// the budget even at `micro_batch` samples a step: its weights and
    /// gradients (already in the pool) + the optimizer state + one step's
    /// measured peak. The message names each part; nothing spills to host
    /// memory in its place.
    pub fn check_fits(&self, learner: &mut dyn Learner, micro_batch: usize) -> Result<()> {
        let (Some(limit), Some(optimizer)) = (self.pool.limit(), learner.optimizer_state_bytes())
        else {
            return Ok(());
        };
        let weights = self.pool.stats().in_use_bytes;
        // The dry run measures without the budget (an over-budget model
        // would fail it at once), which is put back straight after.
        self.pool.set_limit(None);
        let peak = learner.measure_step_peak(micro_batch);
        self.pool.set_limit(Some(limit));
        let peak = peak?;
        let need = weights + optimizer + peak;
        if need <= limit {
            return Ok(());
        }
        Err(PipelineError::OutOfMemory(format!(
            "the model does not fit device.memory_limit = {}: weights and gradients {} + optimizer state {} + \
             one training step of {micro_batch} samples (measured peak) {} = {} (nothing spills to host memory); \
             raise device.memory_limit, or, where not already set, fine-tune with LoRA (finetune.train = \"lora\") and \
             recompute blocks (model.checkpoint = \"blocks\")",
            bytes_text(limit),
            bytes_text(weights),
            bytes_text(optimizer),
            bytes_text(peak),
            bytes_text(need)
        )))
    }
}

/// Whether the last split failed to make the refused block smaller: the
/// block refused before it and the micro-batch split from (`last_split`),
/// against the block refused now at `micro_batch`. Some((before,
/// split_from, now)) when the micro-batch is smaller and the block is not.
fn split_did_not_help(
    last_split: Option<(u64, usize)>,
    micro_batch: usize,
    refused_now: Option<u64>,
) -> Option<(u64, usize, u64)> {
    let (before, split_from) = last_split?;
    let now = refused_now?;
    (micro_batch < split_from && now >= before).then_some((before, split_from, now))
}

/// The size of the block an out-of-memory error names, where it names one.
fn refused_bytes(error: &PipelineError) -> Option<u64> {
    match error {
        PipelineError::Model(ModelError::OutOfMemory { requested, .. }) => Some(*requested),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::learner::{EvalResult, LearnerState, StepLr, StepResult};
    use headroom_loader::Batch;

    /// A learner that holds only a micro-batch: what the policy reads and
    /// sets on an out-of-memory error. Nothing else is called.
    struct MicroOnly(usize);

    impl Learner for MicroOnly {
        fn submit_batch(&mut self, _: &Batch, _: StepLr<'_>) -> Result<()> {
            unreachable!("the policy never trains")
        }
        fn collect_step(&mut self) -> Result<Option<StepResult>> {
            unreachable!("the policy never trains")
        }
        fn steps_in_flight(&self) -> usize {
            0
        }
        fn eval_batch(&mut self, _: &Batch) -> Result<EvalResult> {
            unreachable!("the policy never evaluates")
        }
        fn eval_probabilities(&mut self, _: &Batch) -> Result<Vec<f32>> {
            unreachable!("the policy never evaluates")
        }
        fn uses_batch_statistics(&self) -> bool {
            false
        }
        fn micro_batch(&self) -> usize {
            self.0
        }
        fn set_micro_batch(&mut self, size: usize) {
            self.0 = size;
        }
        fn snapshot(&mut self) -> Result<LearnerState> {
            unreachable!("the policy takes no snapshot")
        }
        fn write_state(&mut self, _: &mut dyn StateWriter) -> Result<()> {
            unreachable!("the policy writes no state")
        }
        fn restore(&mut self, _: LearnerState) -> std::result::Result<(), String> {
            unreachable!("the policy restores nothing")
        }
        fn measure_step_peak(&mut self, _: usize) -> Result<u64> {
            unreachable!("the policy measures nothing")
        }
        fn memory_stats(&self) -> PoolStats {
            PoolStats::default()
        }
        fn memory_limit(&self) -> Option<u64> {
            Some(1 << 20)
        }
        fn release_cache(&mut self) -> u64 {
            0
        }
        fn num_params(&mut self) -> usize {
            0
        }
        fn num_trainable_params(&mut self) -> usize {
            0
        }
        fn macs_per_sample(&self) -> Result<u64> {
            Ok(0)
        }
        fn num_classes(&self) -> usize {
            10
        }
        fn device_name(&self) -> String {
            "test".into()
        }
    }

    /// Out-of-memory errors, one after another, until the policy stops the
    /// run: the micro-batches it trained at, and its message.
    fn adapt_until_stopped(settings: &MemorySettings, batch: usize) -> (Vec<usize>, String) {
        let dir = tempfile::tempdir().expect("dir");
        let mut guard = MemoryGuard::new(settings, dir.path());
        let mut learner = MicroOnly(batch);
        let mut freed = false;
        let mut seen = vec![batch];
        // Each block asked for is half the last: splitting always helps.
        let mut requested = 64u64 << 20;
        for _ in 0..64 {
            let error = PipelineError::Model(ModelError::OutOfMemory {
                requested,
                in_use: 0,
                reserved: 0,
                limit: Some(1 << 20),
            });
            match guard.on_oom(&error, 0, &mut learner, &mut freed, batch) {
                Ok(()) => {
                    if seen.last() != Some(&learner.micro_batch()) {
                        seen.push(learner.micro_batch());
                        requested /= 2;
                    }
                }
                Err(e) => return (seen, e.to_string()),
            }
        }
        panic!("the policy never stopped: {seen:?}");
    }

    #[test]
    fn adapting_stops_with_advice_instead_of_training_at_micro_batch_one() {
        let settings = MemorySettings {
            limit: Some(1 << 20),
            ..MemorySettings::default()
        };
        assert_eq!(settings.min_micro_batch, 2, "the default floor");
        let (seen, message) = adapt_until_stopped(&settings, 8);
        assert_eq!(seen, [8, 4, 2], "halved down to the floor, never to 1");
        assert!(
            message.contains("a micro-batch of 1 is below memory.min_micro_batch = 2")
                && message.contains("set memory.min_micro_batch = 1 to allow it"),
            "{message}"
        );
        assert!(
            message.contains("A checkpoint of the last completed step"),
            "{message}"
        );
        // Asked for, it goes to 1, and only then stops (without the floor's
        // wording: there is nothing smaller to allow).
        let settings = MemorySettings {
            min_micro_batch: 1,
            ..settings
        };
        let (seen, message) = adapt_until_stopped(&settings, 8);
        assert_eq!(seen, [8, 4, 2, 1]);
        assert!(
            message.contains("even a micro-batch of 1 does not fit"),
            "{message}"
        );
        assert!(
            !message.contains("below memory.min_micro_batch"),
            "{message}"
        );
    }

    #[test]
    fn splitting_stops_when_the_refused_block_does_not_shrink() {
        // 64 -> 32 and the 8 MiB block is now a 4 MiB one: splitting helps.
        assert_eq!(
            split_did_not_help(Some((8 << 20, 64)), 32, Some(4 << 20)),
            None
        );
        // The same 8 MiB block at 32: it does not grow with the batch.
        assert_eq!(
            split_did_not_help(Some((8 << 20, 64)), 32, Some(8 << 20)),
            Some((8 << 20, 64, 8 << 20))
        );
        // A larger one is no better.
        assert!(split_did_not_help(Some((8 << 20, 64)), 32, Some(9 << 20)).is_some());
        // Before any split, or at the micro-batch split from (the cache was
        // released in between), or with no block named: no judgement.
        assert_eq!(split_did_not_help(None, 32, Some(8 << 20)), None);
        assert_eq!(
            split_did_not_help(Some((8 << 20, 64)), 64, Some(8 << 20)),
            None
        );
        assert_eq!(split_did_not_help(Some((8 << 20, 64)), 32, None), None);
    }
}
