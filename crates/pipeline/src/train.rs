//! The training run. The loop itself is short: take a batch, forward, loss,
//! backward, clip, step, report. Around it: the data, the sink stage, the
//! checkpoints (at epoch ends, every N steps, and when asked to stop), and
//! resume at the exact batch where a checkpoint was taken.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Instant;

use headroom_loader::{Batch, DataLoader, Dataset, LoaderConfig, LoaderMemory};
use headroom_model::PoolStats;
use headroom_optim::{LossScalerConfig, OneCycle, Schedule};

use crate::checkpoint::{self, Checkpoint, CheckpointMeta, EpochProgress};
use crate::config::{ExperimentConfig, ScheduleConfig};
use crate::eval::{evaluate, Evaluation};
use crate::learner::{self, CudaOptions, Learner, LearnerState, StepLr, StepResult};
use crate::memory::MemoryGuard;
use crate::resume::{self, Resume};
use crate::rundir;
use crate::sink::{self, EpochSummary, Event, SinkLink, SinkSettings, StepReport};
use crate::{data, PipelineError, Result};
use headroom_model::cuda::ops::TunedConv;
use headroom_model::cuda::{CudaBuildOptions, DType};

#[derive(Clone, Debug, Default)]
pub struct TrainOptions {
    pub resume: Resume,
    /// Install the Fashion-MNIST Debian package if it is missing and we can.
    pub allow_install: bool,
    /// Set (by a signal handler, say) to stop after the current step with a
    /// checkpoint.
    pub stop: Option<Arc<AtomicBool>>,
}

#[derive(Clone, Debug)]
pub struct RunSummary {
    pub epochs: Vec<EpochSummary>,
    pub resumed_from: Option<PathBuf>,
    pub last_checkpoint: Option<PathBuf>,
    /// Stopped on request before the last epoch ended.
    pub interrupted: bool,
    pub epoch: u64,
    pub step: u64,
    /// From the last evaluation; None when the run stopped before one.
    pub test_accuracy: Option<f32>,
    pub test_loss: Option<f32>,
    /// A frame model's copy-last-frame baseline loss on the test frames.
    pub test_baseline_loss: Option<f32>,
    pub wall_seconds: f64,
    pub train_samples_per_sec: f64,
    pub peak_rss_bytes: Option<u64>,
    pub parameters: usize,
    pub macs_per_sample: u64,
    pub threads: usize,
    /// What the training loader held, from its own accounting.
    pub loader_memory: LoaderMemory,
    /// Whether the training set was held on the device (`data.on_device`).
    pub data_on_device: bool,
    /// The run's memory pool at the end (peak in use, reserved, ...).
    pub memory: PoolStats,
    pub memory_limit: Option<u64>,
    /// The micro-batch the run ended with (smaller than the batch when the
    /// OOM policy split it).
    pub micro_batch: usize,
    pub oom_events: u64,
    pub cache_cleanups: u64,
    pub cache_cleanup_seconds: f64,
    /// Tensor bytes still held by the run's pool after the run let go of
    /// everything: 0 unless something leaked.
    pub memory_left_after_run: u64,
}

/// Where the run stands: what a checkpoint restores.
#[derive(Clone, Debug, Default)]
struct Position {
    epoch: u64,
    batches_done: usize,
    step: u64,
    consecutive_skips: u64,
    progress: EpochProgress,
}

/// What learns, its schedule, and where it is: what a checkpoint holds.
struct Trainee {
    learner: Box<dyn Learner>,
    schedule: Schedule,
    position: Position,
    /// When the last checkpoint was taken (or the run started), for
    /// `checkpoint.every_minutes`.
    checkpointed_at: Instant,
}

impl Trainee {
    /// Whether `checkpoint.every_minutes` asks for a checkpoint now.
    fn checkpoint_overdue(&self, config: &ExperimentConfig) -> bool {
        let minutes = config.checkpoint.every_minutes;
        minutes > 0.0 && self.checkpointed_at.elapsed().as_secs_f64() >= minutes * 60.0
    }
}

struct Run {
    trainee: Trainee,
    train_loader: DataLoader,
    test_loader: DataLoader,
}

enum Finish {
    Completed,
    Stopped,
}

pub fn train(config: &ExperimentConfig, options: &TrainOptions) -> Result<RunSummary> {
    let started = Instant::now();
    // Held (locked) for the whole run; removed on drop if this start made it
    // and it holds no progress.
    let run_dir = rundir::RunDir::claim(config, &options.resume)?;
    // A full fine-tune trains the base architecture (no adapters).
    let mut resolved = crate::finetune::as_trained(config);
    resolved.run.output_dir = Some(run_dir.path().to_path_buf());
    let config = &resolved;
    let threads = compute_threads(config.train.threads);
    let pool = compute_pool(threads)?;
    open_run_dir(config)?;
    let resume_point = resume::choose(config, &options.resume)?;
    let mut memory = MemoryGuard::new(config)?;
    let mut run = prepare(config, options, &memory)?;
    let resumed_from = match resume_point {
        Some((path, saved)) => {
            restore(&mut run.trainee, saved).map_err(|reason| PipelineError::Checkpoint {
                path: path.clone(),
                reason,
            })?;
            log_resume_point(&path, &run.trainee.position, config.train.epochs);
            Some(path)
        }
        None => None,
    };
    set_micro_batch(config, &mut run.trainee, &mut memory)?;
    let parameters = run.trainee.learner.num_params();
    let macs_per_sample = run.trainee.learner.macs_per_sample()?;
    tracing::info!(
        "model: {parameters} parameters, {:.1} M multiply-adds per sample; {threads} compute threads, {} loader workers",
        macs_per_sample as f64 / 1e6,
        config.loader_workers()
    );

    let (events, sink) = start_sink(config)?;
    let mut epochs = Vec::new();
    let result =
        pool.install(|| run_epochs(config, options, &mut run, &events, &mut epochs, &mut memory));
    drop(events);
    let (finish, outcome) = join_sink(sink, result)?;
    match crate::plot::write(config.output_dir(), crate::plot::Task::of(config)) {
        Ok(path) => tracing::info!("plots: {}", path.display()),
        Err(e) => tracing::warn!("no plot: {e}"),
    }
    let test = match (&finish, epochs.last()) {
        (_, Some(last)) => Some((last.test_loss, last.test_accuracy, last.test_baseline_loss)),
        (Finish::Stopped, None) => None,
        // A resumed run that had done all its epochs: its checkpoint, scored.
        (Finish::Completed, None) => {
            let learner = run.trainee.learner.as_mut();
            let test = pool.install(|| evaluate(learner, &run.test_loader, config.eval.tta))?;
            Some((test.loss, test.accuracy, test.baseline_loss))
        }
    };
    let train_seconds: f64 = epochs.iter().map(|e| e.train_seconds).sum();
    let train_samples: f64 = epochs
        .iter()
        .map(|e| e.train_samples_per_sec * e.train_seconds)
        .sum();
    Ok(RunSummary {
        epochs,
        resumed_from,
        last_checkpoint: outcome.last_checkpoint,
        interrupted: matches!(finish, Finish::Stopped),
        epoch: run.trainee.position.epoch,
        step: run.trainee.position.step,
        test_accuracy: test.and_then(|(_, accuracy, _)| accuracy),
        test_loss: test.map(|(loss, _, _)| loss),
        test_baseline_loss: test.and_then(|(_, _, baseline)| baseline),
        wall_seconds: started.elapsed().as_secs_f64(),
        train_samples_per_sec: if train_seconds > 0.0 {
            train_samples / train_seconds
        } else {
            0.0
        },
        peak_rss_bytes: crate::peak_rss_bytes(),
        parameters,
        macs_per_sample,
        threads,
        loader_memory: run.train_loader.memory_report(),
        data_on_device: run.train_loader.config().resident,
        memory: run.trainee.learner.memory_stats(),
        memory_limit: run.trainee.learner.memory_limit(),
        micro_batch: run.trainee.learner.micro_batch(),
        oom_events: memory.oom_events,
        cache_cleanups: memory.cleanups,
        cache_cleanup_seconds: memory.cleanup_seconds,
        memory_left_after_run: {
            drop(run);
            memory.stats().in_use_bytes
        },
    })
}

fn compute_pool(threads: usize) -> Result<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("compute-{i}"))
        .build()
        .map_err(|e| PipelineError::Stage {
            stage: "train",
            reason: format!("cannot start {threads} compute threads: {e}"),
        })
}

/// The run directory made ready: writable, rid of the temporaries of
/// checkpoints a killed run did not finish, the resolved config written
/// (once: a resumed run keeps its own).
fn open_run_dir(config: &ExperimentConfig) -> Result<()> {
    check_writable(config.output_dir())?;
    tracing::info!("run directory {}", config.output_dir().display());
    for (path, bytes) in checkpoint::remove_unfinished(config.output_dir())? {
        tracing::warn!(
            "removed {} ({}): a checkpoint a stopped run did not finish writing",
            path.display(),
            headroom_model::memory::bytes_text(bytes)
        );
    }
    rundir::write_resolved_config(config.output_dir(), config)
}

/// The micro-batch the run starts with: configured, or planned within the
/// budget.
fn set_micro_batch(
    config: &ExperimentConfig,
    trainee: &mut Trainee,
    memory: &mut MemoryGuard,
) -> Result<()> {
    let learner = trainee.learner.as_mut();
    let micro_batch = match config.micro_batch()? {
        Some(size) => size,
        None => memory.plan_micro_batch(learner, config.train.batch_size)?,
    };
    learner.set_micro_batch(micro_batch);
    // A fine-tuning run checks up front that the model, its optimizer state
    // and a step fit the budget (other runs keep the adaptive OOM policy,
    // which checkpoints and stops when not even one sample fits).
    if config.finetune.is_some() && config.memory_limit()?.is_some() {
        let smallest = micro_batch.min(config.memory.min_micro_batch.max(1));
        memory.check_fits(learner, smallest)?;
    }
    Ok(())
}

/// The writer stage (metrics, checkpoints) on its own thread, and the link
/// the training thread sends it events through.
fn start_sink(
    config: &ExperimentConfig,
) -> Result<(SinkLink, thread::JoinHandle<Result<sink::SinkOutcome>>)> {
    let (events, receiver, checkpoint_written) = SinkLink::new(256);
    let settings = SinkSettings {
        output_dir: config.output_dir().to_path_buf(),
        epochs: config.train.epochs,
        log_every: config.run.log_every,
        keep: config.checkpoint.keep,
        checkpoint_written,
    };
    let sink = thread::Builder::new()
        .name("sink".into())
        .spawn(move || sink::run(receiver, settings))
        .map_err(|e| PipelineError::Stage {
            stage: "sink",
            reason: e.to_string(),
        })?;
    Ok((events, sink))
}

/// The training's result and the sink's, once the sink has written
/// everything. A training error explains a sink that stopped early, so it
/// goes first, unless the training stopped because the sink did: then the
/// sink's own error (a full disk, say) is the cause.
fn join_sink(
    sink: thread::JoinHandle<Result<sink::SinkOutcome>>,
    result: Result<Finish>,
) -> Result<(Finish, sink::SinkOutcome)> {
    let outcome = sink
        .join()
        .map_err(|_| PipelineError::Stage {
            stage: "sink",
            reason: "the sink thread panicked".into(),
        })
        .and_then(|r| r);
    match (result, outcome) {
        (Err(PipelineError::Stage { stage: "sink", .. }), Err(cause)) => Err(cause),
        (result, outcome) => Ok((result?, outcome?)),
    }
}

/// Where a resumed run goes on from; a run that has done all its epochs
/// says so instead of "epoch 4 of 3".
fn log_resume_point(path: &Path, at: &Position, epochs: u64) {
    if at.epoch >= epochs {
        tracing::info!(
            "{} is the end of the run (step {}, all {epochs} epochs done): nothing to train, \
             the checkpoint is evaluated; raise train.epochs to train on",
            path.display(),
            at.step
        );
        return;
    }
    tracing::info!(
        "resuming from {} (epoch {} of {epochs}, batch {}, step {})",
        path.display(),
        at.epoch + 1,
        at.batches_done,
        at.step
    );
}

fn compute_threads(configured: usize) -> usize {
    if configured > 0 {
        return configured;
    }
    thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Fails before any training if checkpoints could not be written.
fn check_writable(dir: &std::path::Path) -> Result<()> {
    let not_writable = |e: std::io::Error| {
        PipelineError::value(
            "run.output_dir",
            format!("{} is not a writable directory: {e}", dir.display()),
        )
    };
    std::fs::create_dir_all(dir).map_err(not_writable)?;
    let probe = dir.join(".write-test");
    std::fs::write(&probe, b"").map_err(not_writable)?;
    std::fs::remove_file(&probe).map_err(not_writable)
}

fn prepare(config: &ExperimentConfig, options: &TrainOptions, memory: &MemoryGuard) -> Result<Run> {
    let (train_set, test_set) = data::open_splits(config, options.allow_install)?;
    let mut learner = learner::open(config, memory.pool(), cuda_options(config)?)?;
    check_data_fits_model(config, train_set.as_ref(), learner.as_ref())?;
    tracing::info!(
        "{} training samples, {} test samples",
        train_set.len(),
        test_set.len()
    );
    let resident = data::hold_on_device(config, train_set.as_ref(), learner.as_mut())?;
    let train_loader = DataLoader::new(
        train_set,
        LoaderConfig {
            resident,
            ..data::loader_config(config, true)?
        },
    )?;
    let test_loader = DataLoader::new(test_set, data::loader_config(config, false)?)?;
    if train_loader.batches_per_epoch() == 0 {
        return Err(PipelineError::value(
            "train.batch_size",
            format!(
                "{} is larger than the training set",
                config.train.batch_size
            ),
        ));
    }
    let total_steps = train_loader.batches_per_epoch() as u64 * config.train.epochs;
    Ok(Run {
        trainee: Trainee {
            learner,
            schedule: schedule(config, total_steps)?,
            position: Position::default(),
            checkpointed_at: Instant::now(),
        },
        train_loader,
        test_loader,
    })
}

/// The GPU settings of an experiment: mixed precision with dynamic loss
/// scaling, or (`device.amp = false`) f32 activations and weights with the
/// loss scale held at 1.
pub(crate) fn cuda_options(config: &ExperimentConfig) -> Result<CudaOptions> {
    let (activations, loss_scaler) = if config.device.amp {
        (DType::F16, LossScalerConfig::default())
    } else {
        (DType::F32, LossScalerConfig::unit())
    };
    Ok(CudaOptions {
        memory_limit: config.memory_limit()?,
        build: CudaBuildOptions {
            fuse: config.device.fusion,
            activations,
            recompute: config.device.recompute,
            conv: config.conv_plan()?,
        },
        loss_scaler,
        graphs: config.device.graphs,
        ..CudaOptions::default()
    })
}

fn schedule(config: &ExperimentConfig, total_steps: u64) -> Result<Schedule> {
    Ok(match &config.schedule {
        ScheduleConfig::Constant => Schedule::Constant {
            lr: config.optimizer.lr,
        },
        ScheduleConfig::OneCycle {
            pct_start,
            div_factor,
            final_div_factor,
        } => Schedule::OneCycle(OneCycle::new(
            config.optimizer.lr,
            total_steps,
            *pct_start,
            *div_factor,
            *final_div_factor,
        )?),
        ScheduleConfig::WarmupCosine {
            warmup_steps,
            min_lr,
        } => {
            if *warmup_steps > total_steps {
                return Err(PipelineError::value(
                    "schedule.warmup_steps",
                    format!(
                        "must be at most the run's {total_steps} optimizer steps ({} batches per \
                         epoch × train.epochs = {}), got {warmup_steps}",
                        total_steps / config.train.epochs.max(1),
                        config.train.epochs
                    ),
                ));
            }
            let schedule = Schedule::WarmupCosine {
                max_lr: config.optimizer.lr,
                warmup_steps: *warmup_steps,
                total_steps,
                min_lr: *min_lr,
            };
            schedule.validate()?;
            schedule
        }
    })
}

fn check_data_fits_model(
    config: &ExperimentConfig,
    data: &dyn Dataset,
    learner: &dyn Learner,
) -> Result<()> {
    if let Some(tokens) = config.model.tokens {
        return crate::text::check_data_fits_token_model(config, tokens, data, learner);
    }
    if let Some(frames) = config.model.frames {
        return crate::frames::check_data_fits_frame_model(config, frames, data);
    }
    if data.sample_shape() != config.model.input {
        return Err(PipelineError::value(
            "model.input",
            format!(
                "{:?} does not match the dataset's samples {:?}",
                config.model.input,
                data.sample_shape()
            ),
        ));
    }
    if data.num_classes() > learner.num_classes() {
        return Err(PipelineError::value(
            "data",
            format!(
                "the training data has {} classes but the network has only {} outputs (the last layer of model.layers)",
                data.num_classes(),
                learner.num_classes()
            ),
        ));
    }
    Ok(())
}

fn restore(trainee: &mut Trainee, saved: Checkpoint) -> std::result::Result<(), String> {
    let meta = saved.meta;
    trainee.learner.restore(LearnerState {
        params: saved.params,
        buffers: saved.buffers,
        optimizer: saved.optimizer,
        loss_scale: saved.loss_scale,
    })?;
    trainee
        .learner
        .restore_tuned_convolutions(&meta.tuned_convs);
    trainee.position = Position {
        epoch: meta.epoch,
        batches_done: meta.batches_done,
        step: meta.step,
        consecutive_skips: meta.consecutive_skips,
        progress: meta.progress,
    };
    Ok(())
}

fn run_epochs(
    config: &ExperimentConfig,
    options: &TrainOptions,
    run: &mut Run,
    events: &SinkLink,
    summaries: &mut Vec<EpochSummary>,
    memory: &mut MemoryGuard,
) -> Result<Finish> {
    while run.trainee.position.epoch < config.train.epochs {
        let Some(summary) = run_epoch(config, options, run, events, memory)? else {
            checkpoint_now(config, &mut run.trainee, events, memory)?;
            return Ok(Finish::Stopped);
        };
        events.send(Event::Epoch(summary.clone()))?;
        if config.checkpoint.every_epoch || run.trainee.position.epoch == config.train.epochs {
            checkpoint_now(config, &mut run.trainee, events, memory)?;
        }
        summaries.push(summary);
    }
    Ok(Finish::Completed)
}

/// Snapshots to host memory on this thread, once the previous checkpoint is
/// on disk; the sink stage writes the file. When the copy is refused, or
/// would crowd the memory left, this thread writes the file from the
/// learner's own tensors instead.
fn checkpoint_now(
    config: &ExperimentConfig,
    trainee: &mut Trainee,
    events: &SinkLink,
    memory: &mut MemoryGuard,
) -> Result<()> {
    events.take_checkpoint_token()?;
    let tuned_convs = trainee.learner.tuned_convolutions();
    let meta = checkpoint_meta(config, &trainee.position, tuned_convs);
    match memory.snapshot(trainee.learner.as_mut(), meta.step)? {
        Some(state) => events.send(Event::Checkpoint(Box::new(Checkpoint::new(meta, state))))?,
        None => write_with_no_copy(config, &meta, trainee.learner.as_mut(), events, memory)?,
    }
    trainee.checkpointed_at = Instant::now();
    memory.after_checkpoint(trainee.learner.as_mut());
    Ok(())
}

/// The checkpoint of `meta` written on this thread from the learner's own
/// tensors, in the sink's order (`SinkLink::write_here`).
fn write_with_no_copy(
    config: &ExperimentConfig,
    meta: &CheckpointMeta,
    learner: &mut dyn Learner,
    events: &SinkLink,
    memory: &mut MemoryGuard,
) -> Result<()> {
    let started = Instant::now();
    let path = events.write_here(|| {
        checkpoint::write_with(config.output_dir(), meta, config.checkpoint.keep, |out| {
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

fn stop_requested(options: &TrainOptions) -> bool {
    options
        .stop
        .as_ref()
        .is_some_and(|flag| flag.load(Ordering::SeqCst))
}

/// Trains the rest of the current epoch and evaluates. None when a stop was
/// requested first (the caller writes the checkpoint).
///
/// A GPU learner runs a step while the host loads, stages and queues the
/// next (`Learner::pipeline_depth`), so a step's result is collected one
/// step after it was submitted. Every step is collected before a checkpoint
/// (which then holds exactly the collected steps), before evaluation and
/// before a stop.
fn run_epoch(
    config: &ExperimentConfig,
    options: &TrainOptions,
    run: &mut Run,
    events: &SinkLink,
    memory: &mut MemoryGuard,
) -> Result<Option<EpochSummary>> {
    let Run {
        trainee,
        train_loader,
        test_loader,
    } = run;
    let epoch = trainee.position.epoch;
    let mut steps = Steps {
        config,
        options,
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
                checkpoint_now(config, trainee, events, memory)?;
                return Err(stop);
            }
            other => other?,
        }
        steps.in_flight.push_back(Submitted {
            index: batch.index,
            samples: batch.len(),
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
    let test = match evaluate_within_memory(trainee, test_loader, config, memory) {
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
    let progress = std::mem::take(&mut position.progress);
    position.epoch += 1;
    position.batches_done = 0;
    Ok(Some(EpochSummary {
        epoch,
        train_loss: (progress.loss_sum / progress.seen.max(1) as f64) as f32,
        // A token model's correct predictions are tokens, `length` per
        // sample; a frame model has none to count.
        train_accuracy: config.model.frames.is_none().then(|| {
            progress.correct as f32
                / (progress.seen * config.model.tokens.map_or(1, |t| t.length as u64)).max(1) as f32
        }),
        test_loss: test.loss,
        test_accuracy: test.accuracy,
        test_baseline_loss: test.baseline_loss,
        train_seconds: progress.train_seconds,
        train_samples_per_sec: progress.seen as f64 / progress.train_seconds.max(1e-9),
        skipped_steps: progress.skipped,
    }))
}

/// The epoch-end evaluation, its out-of-memory errors handled by the
/// memory policy as a step's are.
fn evaluate_within_memory(
    trainee: &mut Trainee,
    test_loader: &DataLoader,
    config: &ExperimentConfig,
    memory: &mut MemoryGuard,
) -> Result<Evaluation> {
    let epoch = trainee.position.epoch + 1;
    let learner = trainee.learner.as_mut();
    memory.before_evaluation(epoch);
    let mut freed_cache = false;
    loop {
        match evaluate(learner, test_loader, config.eval.tta) {
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
        .and_then(|_| checkpoint_now(steps.config, trainee, steps.events, memory));
    match saved {
        Ok(()) => PipelineError::StoppedSaved {
            cause: Box::new(cause),
            step: trainee.position.step,
            dir: steps.config.output_dir().to_path_buf(),
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
    config: &'a ExperimentConfig,
    options: &'a TrainOptions,
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
        let every = self.config.checkpoint.every_steps;
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
        let (config, events) = (self.config, self.events);
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
        if trainee.position.consecutive_skips >= config.train.max_consecutive_skips {
            self.drain(trainee, memory)?;
            checkpoint_now(config, trainee, events, memory)?;
            return Err(PipelineError::Diverged {
                skips: trainee.position.consecutive_skips,
                dir: config.output_dir().to_path_buf(),
            });
        }
        let (step, done) = (trainee.position.step, trainee.position.batches_done);
        memory.after_step(step, trainee.learner.as_mut());
        let every = config.checkpoint.every_steps;
        let by_steps = every > 0 && step % every == 0;
        let due = by_steps || trainee.checkpoint_overdue(config);
        if !report.skipped && due && done < self.batches_per_epoch {
            // Claimed before the steps in flight are collected, so that
            // none of them is taken for another checkpoint on the way.
            trainee.checkpointed_at = Instant::now();
            let stop = self.drain(trainee, memory)?;
            checkpoint_now(config, trainee, events, memory)?;
            if stop {
                return Ok(true);
            }
        }
        if stop_requested(self.options) {
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
    config: &ExperimentConfig,
    position: &Position,
    tuned_convs: Vec<TunedConv>,
) -> CheckpointMeta {
    let position = position.clone();
    CheckpointMeta {
        config_fingerprint: config.fingerprint(),
        config_json: serde_json::to_string(config).unwrap_or_default(),
        model_json: Checkpoint::model_json(&config.model),
        epoch: position.epoch,
        batches_done: position.batches_done,
        step: position.step,
        consecutive_skips: position.consecutive_skips,
        progress: position.progress,
        tuned_convs,
    }
}
