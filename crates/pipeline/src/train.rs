//! The training run. The loop itself is short: take a batch, forward, loss,
//! backward, clip, step, report. Around it: the data, the sink stage, the
//! checkpoints (at epoch ends, every N steps, and when asked to stop), and
//! resume at the exact batch where a checkpoint was taken.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Instant;

use crossbeam_channel::{bounded, Sender};
use headroom_loader::{Batch, DataLoader, Dataset, LoaderMemory};
use headroom_model::loss::{soft_cross_entropy, softmax_cross_entropy, LossOutput};
use headroom_model::{Mode, Network, PoolStats, Tensor};
use headroom_optim::{clip_grad_norm, grad_norm, AdamW, AdamWConfig, OneCycle, Schedule};

use crate::checkpoint::{Checkpoint, CheckpointMeta, EpochProgress};
use crate::config::{ExperimentConfig, ScheduleConfig};
use crate::memory::MemoryGuard;
use crate::resume::{self, Resume};
use crate::rundir;
use crate::sink::{self, EpochSummary, Event, SinkSettings, StepReport};
use crate::{data, PipelineError, Result};

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
    pub wall_seconds: f64,
    pub train_samples_per_sec: f64,
    pub peak_rss_bytes: Option<u64>,
    pub parameters: usize,
    pub macs_per_sample: u64,
    pub threads: usize,
    /// What the training loader held, from its own accounting.
    pub loader_memory: LoaderMemory,
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

/// What learns: the network, its optimizer and schedule, and where it is.
struct Learner {
    network: Network,
    optimizer: AdamW,
    schedule: Schedule,
    position: Position,
    /// Samples per forward/backward; the batch is split into as many as needed.
    micro_batch: usize,
}

struct Run {
    learner: Learner,
    train_loader: DataLoader,
    test_loader: DataLoader,
}

enum Finish {
    Completed,
    Stopped,
}

pub fn train(config: &ExperimentConfig, options: &TrainOptions) -> Result<RunSummary> {
    let started = Instant::now();
    let mut resolved = config.clone();
    resolved.run.output_dir = Some(rundir::resolve(config, &options.resume)?);
    let config = &resolved;
    let threads = compute_threads(config.train.threads);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("compute-{i}"))
        .build()
        .map_err(|e| PipelineError::Stage {
            stage: "train",
            reason: format!("cannot start {threads} compute threads: {e}"),
        })?;
    check_writable(config.output_dir())?;
    tracing::info!("run directory {}", config.output_dir().display());
    rundir::write_resolved_config(config.output_dir(), config)?;
    let resume_point = resume::choose(config, &options.resume)?;
    let mut memory = MemoryGuard::new(config)?;
    let mut run = memory.scope(|| prepare(config, options))?;
    let resumed_from = match resume_point {
        Some((path, saved)) => {
            memory
                .scope(|| restore(&mut run.learner, &saved))
                .map_err(|reason| PipelineError::Checkpoint {
                    path: path.clone(),
                    reason,
                })?;
            let at = &run.learner.position;
            tracing::info!(
                "resuming from {} (epoch {} of {}, batch {}, step {})",
                path.display(),
                at.epoch + 1,
                config.train.epochs,
                at.batches_done,
                at.step
            );
            Some(path)
        }
        None => None,
    };
    run.learner.micro_batch = match config.micro_batch()? {
        Some(size) => size,
        None => memory.plan_micro_batch(&mut run.learner.network, config.train.batch_size)?,
    };
    let parameters = run.learner.network.num_params();
    let macs_per_sample = run.learner.network.macs_per_sample()?;
    tracing::info!(
        "model: {parameters} parameters, {:.1} M multiply-adds per sample; {threads} compute threads, {} loader workers",
        macs_per_sample as f64 / 1e6,
        config.loader_workers()
    );

    let (events, receiver) = bounded::<Event>(256);
    let settings = SinkSettings {
        output_dir: config.output_dir().to_path_buf(),
        epochs: config.train.epochs,
        log_every: config.run.log_every,
        keep: config.checkpoint.keep,
    };
    let sink = thread::Builder::new()
        .name("sink".into())
        .spawn(move || sink::run(receiver, settings))
        .map_err(|e| PipelineError::Stage {
            stage: "sink",
            reason: e.to_string(),
        })?;

    let mut epochs = Vec::new();
    let run_pool = memory.pool();
    let result = pool.install(|| {
        run_pool.scope(|| run_epochs(config, options, &mut run, &events, &mut epochs, &mut memory))
    });
    drop(events);
    let outcome = sink
        .join()
        .map_err(|_| PipelineError::Stage {
            stage: "sink",
            reason: "the sink thread panicked".into(),
        })
        .and_then(|r| r);
    // A training error explains a sink that stopped early, so it goes first.
    let finish = result?;
    let outcome = outcome?;
    match crate::plot::write(config.output_dir()) {
        Ok(path) => tracing::info!("plots: {}", path.display()),
        Err(e) => tracing::warn!("no plot: {e}"),
    }

    let (test_loss, test_accuracy) = match (&finish, epochs.last()) {
        (_, Some(last)) => (Some(last.test_loss), Some(last.test_accuracy)),
        (Finish::Stopped, None) => (None, None),
        (Finish::Completed, None) => {
            let (loss, accuracy) = pool.install(|| {
                run_pool.scope(|| {
                    evaluate(
                        &mut run.learner.network,
                        &run.test_loader,
                        run.learner.micro_batch,
                    )
                })
            })?;
            (Some(loss), Some(accuracy))
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
        epoch: run.learner.position.epoch,
        step: run.learner.position.step,
        test_accuracy,
        test_loss,
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
        memory: memory.stats(),
        memory_limit: memory.limit(),
        micro_batch: run.learner.micro_batch,
        oom_events: memory.oom_events,
        cache_cleanups: memory.cleanups,
        cache_cleanup_seconds: memory.cleanup_seconds,
        memory_left_after_run: {
            drop(run);
            memory.stats().in_use_bytes
        },
    })
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

fn prepare(config: &ExperimentConfig, options: &TrainOptions) -> Result<Run> {
    let (train_set, test_set) = data::open_splits(config, options.allow_install)?;
    let network = Network::build(&config.model, config.run.seed)?;
    check_data_fits_model(config, train_set.as_ref(), &network)?;
    tracing::info!(
        "{} training samples, {} test samples",
        train_set.len(),
        test_set.len()
    );
    let train_loader = DataLoader::new(train_set, data::loader_config(config, true)?)?;
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
    let optimizer = AdamW::new(AdamWConfig {
        beta1: config.optimizer.beta1,
        beta2: config.optimizer.beta2,
        eps: config.optimizer.eps,
        weight_decay: config.optimizer.weight_decay,
    })?;
    let schedule = match &config.schedule {
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
    };
    Ok(Run {
        learner: Learner {
            network,
            optimizer,
            schedule,
            position: Position::default(),
            micro_batch: config.train.batch_size,
        },
        train_loader,
        test_loader,
    })
}

fn check_data_fits_model(
    config: &ExperimentConfig,
    data: &dyn Dataset,
    network: &Network,
) -> Result<()> {
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
    if data.num_classes() > network.num_classes() {
        return Err(PipelineError::value(
            "model.layers",
            format!(
                "the network has {} outputs but the dataset has {} classes",
                network.num_classes(),
                data.num_classes()
            ),
        ));
    }
    Ok(())
}

fn restore(learner: &mut Learner, saved: &Checkpoint) -> std::result::Result<(), String> {
    let mut params = learner.network.params_mut();
    if params.len() != saved.params.len() {
        return Err(format!(
            "{} parameter tensors, the model has {}",
            saved.params.len(),
            params.len()
        ));
    }
    for (param, values) in params.iter_mut().zip(&saved.params) {
        copy_into(param.value.data_mut(), values, &param.name)?;
    }
    let mut buffers = learner.network.buffers_mut();
    if buffers.len() != saved.buffers.len() {
        return Err(format!(
            "{} buffers, the model has {}",
            saved.buffers.len(),
            buffers.len()
        ));
    }
    for (i, (buffer, values)) in buffers.iter_mut().zip(&saved.buffers).enumerate() {
        copy_into(buffer.data_mut(), values, &format!("buffer {i}"))?;
    }
    learner
        .optimizer
        .load_state(saved.optimizer.clone())
        .map_err(|e| e.to_string())?;
    let meta = &saved.meta;
    learner.position = Position {
        epoch: meta.epoch,
        batches_done: meta.batches_done,
        step: meta.step,
        consecutive_skips: meta.consecutive_skips,
        progress: meta.progress.clone(),
    };
    Ok(())
}

fn copy_into(target: &mut [f32], values: &[f32], name: &str) -> std::result::Result<(), String> {
    if target.len() != values.len() {
        return Err(format!(
            "{name} has {} values, the model expects {}",
            values.len(),
            target.len()
        ));
    }
    target.copy_from_slice(values);
    Ok(())
}

fn run_epochs(
    config: &ExperimentConfig,
    options: &TrainOptions,
    run: &mut Run,
    events: &Sender<Event>,
    summaries: &mut Vec<EpochSummary>,
    memory: &mut MemoryGuard,
) -> Result<Finish> {
    while run.learner.position.epoch < config.train.epochs {
        let Some(summary) = run_epoch(config, options, run, events, memory)? else {
            checkpoint_now(config, &mut run.learner, events, memory)?;
            return Ok(Finish::Stopped);
        };
        send(events, Event::Epoch(summary.clone()))?;
        if config.checkpoint.every_epoch || run.learner.position.epoch == config.train.epochs {
            checkpoint_now(config, &mut run.learner, events, memory)?;
        }
        summaries.push(summary);
    }
    Ok(Finish::Completed)
}

/// Snapshots to host memory on this thread; the sink stage writes the file.
fn checkpoint_now(
    config: &ExperimentConfig,
    learner: &mut Learner,
    events: &Sender<Event>,
    memory: &mut MemoryGuard,
) -> Result<()> {
    send(
        events,
        Event::Checkpoint(Box::new(snapshot(config, learner))),
    )?;
    memory.after_checkpoint();
    Ok(())
}

fn send(events: &Sender<Event>, event: Event) -> Result<()> {
    events.send(event).map_err(|_| PipelineError::Stage {
        stage: "sink",
        reason: "it stopped receiving (see the error after this one)".into(),
    })
}

fn stop_requested(options: &TrainOptions) -> bool {
    options
        .stop
        .as_ref()
        .is_some_and(|flag| flag.load(Ordering::SeqCst))
}

/// Trains the rest of the current epoch and evaluates. None when a stop was
/// requested first (the caller writes the checkpoint).
fn run_epoch(
    config: &ExperimentConfig,
    options: &TrainOptions,
    run: &mut Run,
    events: &Sender<Event>,
    memory: &mut MemoryGuard,
) -> Result<Option<EpochSummary>> {
    let Run {
        learner,
        train_loader,
        test_loader,
    } = run;
    let epoch = learner.position.epoch;
    let batches_per_epoch = train_loader.batches_per_epoch();
    let mut started = Instant::now();
    for batch in train_loader.epoch(epoch, learner.position.batches_done) {
        let batch = batch?;
        let report = match train_step(config, learner, &batch, batches_per_epoch, memory) {
            Err(stop @ PipelineError::OutOfMemory(_)) => {
                // The failed step changed nothing: checkpoint the state before it.
                checkpoint_now(config, learner, events, memory)?;
                return Err(stop);
            }
            other => other?,
        };
        let applied = !report.skipped;
        let seconds = started.elapsed().as_secs_f64();
        started = Instant::now();
        learner.position.progress.train_seconds += seconds;
        send(
            events,
            Event::Step(StepReport {
                memory_bytes: memory.stats().reserved_bytes,
                samples_per_sec: report.samples as f64 / seconds.max(1e-9),
                oom_events: memory.oom_events,
                ..report
            }),
        )?;
        if learner.position.consecutive_skips >= config.train.max_consecutive_skips {
            checkpoint_now(config, learner, events, memory)?;
            return Err(PipelineError::Diverged {
                skips: learner.position.consecutive_skips,
                dir: config.output_dir().to_path_buf(),
            });
        }
        let (step, done) = (learner.position.step, learner.position.batches_done);
        memory.after_step(step);
        let every = config.checkpoint.every_steps;
        if applied && every > 0 && step % every == 0 && done < batches_per_epoch {
            checkpoint_now(config, learner, events, memory)?;
        }
        if stop_requested(options) {
            return Ok(None);
        }
    }
    let (test_loss, test_accuracy) =
        evaluate(&mut learner.network, test_loader, learner.micro_batch)?;
    let position = &mut learner.position;
    let progress = std::mem::take(&mut position.progress);
    position.epoch += 1;
    position.batches_done = 0;
    Ok(Some(EpochSummary {
        epoch,
        train_loss: (progress.loss_sum / progress.seen.max(1) as f64) as f32,
        train_accuracy: progress.correct as f32 / progress.seen.max(1) as f32,
        test_loss,
        test_accuracy,
        train_seconds: progress.train_seconds,
        train_samples_per_sec: progress.seen as f64 / progress.train_seconds.max(1e-9),
        skipped_steps: progress.skipped,
    }))
}

/// One optimizer step on one batch, with the position advanced. Out of
/// memory is handled here by the memory policy; a step that fails leaves the
/// model as it was (gradients zeroed, batch-norm statistics restored).
fn train_step(
    config: &ExperimentConfig,
    learner: &mut Learner,
    batch: &Batch,
    batches_per_epoch: usize,
    memory: &mut MemoryGuard,
) -> Result<StepReport> {
    let (n, batch_index) = (batch.labels.len(), batch.index);
    memory.before_step(learner.position.step);
    let statistics = learner.network.buffer_values();
    let mut freed_cache = false;
    let (loss, correct) = loop {
        match accumulate_gradients(config, learner, batch) {
            Ok(result) => break result,
            Err(e) if e.is_out_of_memory() => {
                learner.network.clear_saved();
                learner.network.zero_grad();
                learner.network.restore_buffer_values(&statistics)?;
                let step = learner.position.step;
                memory.on_oom(&e, step, &mut learner.micro_batch, &mut freed_cache, n)?;
            }
            Err(e) => return Err(e),
        }
    };
    let lr = learner.schedule.lr_at(learner.position.step);
    let norm = if loss.is_finite() {
        apply_gradients(config, learner, lr)?
    } else {
        learner.network.zero_grad();
        None
    };
    let position = &mut learner.position;
    position.batches_done = batch_index + 1;
    match norm {
        Some(_) => {
            position.step += 1;
            position.consecutive_skips = 0;
            position.progress.loss_sum += loss as f64 * n as f64;
            position.progress.correct += correct as u64;
            position.progress.seen += n as u64;
        }
        None => {
            position.consecutive_skips += 1;
            position.progress.skipped += 1;
            tracing::warn!(
                "epoch {} batch {}: non-finite loss or gradient, step skipped ({} in a row)",
                position.epoch + 1,
                batch_index,
                position.consecutive_skips
            );
        }
    }
    Ok(StepReport {
        epoch: position.epoch,
        step: position.step,
        batch: batch_index,
        batches_per_epoch,
        samples: n,
        loss,
        lr,
        grad_norm: norm.unwrap_or(f32::NAN),
        skipped: norm.is_none(),
        memory_bytes: 0,
        samples_per_sec: 0.0,
        oom_events: 0,
    })
}

/// Forward and backward over the batch in micro-batches, adding up the
/// gradients. Each micro-batch's loss gradient is weighted by its share of
/// the batch, so the sum is the whole batch's mean-loss gradient. Returns the
/// batch's mean loss (NaN, with no gradients, if any part was not finite)
/// and the number of correct predictions.
fn accumulate_gradients(
    config: &ExperimentConfig,
    learner: &mut Learner,
    batch: &Batch,
) -> Result<(f32, usize)> {
    let n = batch.labels.len();
    let sample = batch.pixels.len() / n.max(1);
    let classes = learner.network.num_classes();
    let (mut loss, mut correct) = (0.0f64, 0usize);
    let mut start = 0;
    while start < n {
        let end = (start + learner.micro_batch.max(1)).min(n);
        // The whole batch is used as it is; only a split copies its slice.
        let slice;
        let part = if start == 0 && end == n {
            batch
        } else {
            slice = Batch {
                epoch: batch.epoch,
                index: batch.index,
                shape: [end - start, batch.shape[1], batch.shape[2], batch.shape[3]],
                pixels: batch.pixels[start * sample..end * sample].to_vec(),
                labels: batch.labels[start..end].to_vec(),
                soft_targets: batch
                    .soft_targets
                    .as_ref()
                    .map(|t| t[start * classes..end * classes].to_vec()),
            };
            &slice
        };
        let input = learner.network.input_from_u8(end - start, &part.pixels)?;
        let logits = learner.network.forward(&input, Mode::Train)?;
        let mut out = training_loss(config, &logits, part)?;
        drop(logits);
        if !out.loss.is_finite() {
            learner.network.clear_saved();
            learner.network.zero_grad();
            return Ok((f32::NAN, 0));
        }
        let share = (end - start) as f32 / n as f32;
        if share != 1.0 {
            out.grad
                .try_data_mut()?
                .iter_mut()
                .for_each(|g| *g *= share);
        }
        learner.network.backward(&out.grad)?;
        loss += out.loss as f64 * share as f64;
        correct += out.correct;
        start = end;
    }
    Ok((loss as f32, correct))
}

/// Label-smoothed cross-entropy, against the batch's soft targets when
/// Mixup or CutMix made them.
fn training_loss(config: &ExperimentConfig, logits: &Tensor, batch: &Batch) -> Result<LossOutput> {
    let smoothing = config.train.label_smoothing;
    let Some(soft) = &batch.soft_targets else {
        return Ok(softmax_cross_entropy(logits, &batch.labels, smoothing)?);
    };
    let classes = logits.shape().get(1).copied().unwrap_or(1);
    let smoothed = soft
        .iter()
        .map(|&p| (1.0 - smoothing) * p + smoothing / classes as f32)
        .collect();
    let targets = Tensor::from_vec(&[batch.labels.len(), classes], smoothed)?;
    Ok(soft_cross_entropy(logits, &targets)?)
}

/// Clip and AdamW step on the accumulated gradients. Returns the gradient
/// norm, or None when it is not finite and the step was skipped.
fn apply_gradients(
    config: &ExperimentConfig,
    learner: &mut Learner,
    lr: f32,
) -> Result<Option<f32>> {
    let mut params = learner.network.params_mut();
    let norm = if config.train.clip_norm > 0.0 {
        clip_grad_norm(&mut params, config.train.clip_norm)
    } else {
        grad_norm(&params)
    };
    let applied = norm.is_finite();
    if applied {
        learner.optimizer.step(&mut params, lr)?;
    }
    for p in params {
        p.zero_grad();
    }
    Ok(applied.then_some(norm))
}

/// Mean test loss (no label smoothing) and accuracy, in micro-batches of
/// at most `micro_batch` samples so that evaluation fits where training did.
fn evaluate(
    network: &mut Network,
    test_loader: &DataLoader,
    micro_batch: usize,
) -> Result<(f32, f32)> {
    let bar = evaluation_bar(test_loader.batches_per_epoch());
    let (mut loss_sum, mut correct, mut seen) = (0.0f64, 0usize, 0usize);
    for batch in test_loader.epoch(0, 0) {
        let batch = batch?;
        let n = batch.labels.len();
        let sample = batch.pixels.len() / n.max(1);
        for start in (0..n).step_by(micro_batch.max(1)) {
            let end = (start + micro_batch.max(1)).min(n);
            let input =
                network.input_from_u8(end - start, &batch.pixels[start * sample..end * sample])?;
            let logits = network.forward(&input, Mode::Eval)?;
            let out = softmax_cross_entropy(&logits, &batch.labels[start..end], 0.0)?;
            loss_sum += out.loss as f64 * (end - start) as f64;
            correct += out.correct;
        }
        seen += n;
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok((
        (loss_sum / seen.max(1) as f64) as f32,
        correct as f32 / seen.max(1) as f32,
    ))
}

/// A progress bar over the test batches on a terminal; hidden otherwise.
fn evaluation_bar(batches: usize) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(batches as u64);
    if let Ok(style) = indicatif::ProgressStyle::with_template("evaluating [{bar:30}] {pos}/{len}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

fn snapshot(config: &ExperimentConfig, learner: &mut Learner) -> Checkpoint {
    let position = learner.position.clone();
    Checkpoint {
        meta: CheckpointMeta {
            config_fingerprint: config.fingerprint(),
            config_json: serde_json::to_string(config).unwrap_or_default(),
            model_json: Checkpoint::model_json(&config.model),
            epoch: position.epoch,
            batches_done: position.batches_done,
            step: position.step,
            consecutive_skips: position.consecutive_skips,
            progress: position.progress,
        },
        params: learner
            .network
            .params_mut()
            .iter()
            .map(|p| p.value.data().to_vec())
            .collect(),
        buffers: learner
            .network
            .buffers_mut()
            .iter()
            .map(|b| b.data().to_vec())
            .collect(),
        optimizer: learner.optimizer.state(),
    }
}
