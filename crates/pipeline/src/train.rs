//! The training run. The loop itself is short: take a batch, forward, loss,
//! backward, clip, step, report. Everything else (data, the sink stage,
//! checkpoints, resume) is set up around it.

use std::path::PathBuf;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Sender};
use headroom_loader::{AugmentConfig, DataLoader, Dataset, IdxDataset, LoaderConfig, Split};
use headroom_model::loss::softmax_cross_entropy;
use headroom_model::{Mode, Network};
use headroom_optim::{clip_grad_norm, grad_norm, AdamW, AdamWConfig, OneCycle, Schedule};

use crate::checkpoint::{self, Checkpoint};
use crate::config::{ExperimentConfig, ScheduleConfig};
use crate::sink::{self, EpochSummary, Event, SinkSettings, StepReport};
use crate::{data, PipelineError, Result};

/// How long the training stage waits for a batch before calling the loader stuck.
const LOADER_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Clone, Debug, Default)]
pub struct TrainOptions {
    /// Continue from the newest valid checkpoint in `run.output_dir`.
    pub resume: bool,
    /// Install the Fashion-MNIST Debian package if it is missing and we can.
    pub allow_install: bool,
}

#[derive(Clone, Debug)]
pub struct RunSummary {
    pub epochs: Vec<EpochSummary>,
    pub resumed_from: Option<PathBuf>,
    pub last_checkpoint: Option<PathBuf>,
    pub test_accuracy: f32,
    pub test_loss: f32,
    pub wall_seconds: f64,
    pub train_samples_per_sec: f64,
    pub peak_rss_bytes: Option<u64>,
    pub parameters: usize,
    pub macs_per_sample: u64,
    pub threads: usize,
}

/// Where the run stands: what a checkpoint restores.
struct Position {
    epoch: u64,
    step: u64,
}

/// What learns: the network, its optimizer and schedule, and where it is.
struct Learner {
    network: Network,
    optimizer: AdamW,
    schedule: Schedule,
    position: Position,
}

struct Run {
    learner: Learner,
    train_loader: DataLoader,
    test_loader: DataLoader,
}

pub fn train(config: &ExperimentConfig, options: &TrainOptions) -> Result<RunSummary> {
    let started = Instant::now();
    let threads = compute_threads(config.train.threads);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("compute-{i}"))
        .build()
        .map_err(|e| PipelineError::Stage {
            stage: "train",
            reason: format!("cannot start {threads} compute threads: {e}"),
        })?;
    let mut run = prepare(config, options)?;
    let resumed_from = if options.resume {
        resume(config, &mut run)?
    } else {
        refuse_to_overwrite(config)?
    };
    let parameters = run.learner.network.num_params();
    let macs_per_sample = run.learner.network.macs_per_sample()?;
    tracing::info!(
        "model: {parameters} parameters, {:.1} M multiply-adds per sample; {threads} compute threads, {} loader workers",
        macs_per_sample as f64 / 1e6,
        config.data.workers
    );

    let (events, receiver) = bounded::<Event>(256);
    let settings = SinkSettings {
        output_dir: config.run.output_dir.clone(),
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

    let result = pool.install(|| run_epochs(config, &mut run, &events));
    drop(events);
    let outcome = sink
        .join()
        .map_err(|_| PipelineError::Stage {
            stage: "sink",
            reason: "the sink thread panicked".into(),
        })
        .and_then(|r| r);
    // A training error explains a sink that stopped early, so it goes first.
    let epochs = result?;
    let outcome = outcome?;

    let (test_loss, test_accuracy) = match epochs.last() {
        Some(last) => (last.test_loss, last.test_accuracy),
        None => pool.install(|| evaluate(&mut run.learner.network, &run.test_loader))?,
    };
    let train_seconds: f64 = epochs.iter().map(|e| e.train_seconds).sum();
    let train_samples = epochs.len() as f64
        * (run.train_loader.batches_per_epoch() * config.train.batch_size) as f64;
    Ok(RunSummary {
        epochs,
        resumed_from,
        last_checkpoint: outcome.last_checkpoint,
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

fn prepare(config: &ExperimentConfig, options: &TrainOptions) -> Result<Run> {
    let dir = data::locate_fashion_mnist(config.data.dir.as_deref(), options.allow_install)?;
    tracing::info!("Fashion-MNIST from {}", dir.display());
    let train_set = limit(
        IdxDataset::fashion_mnist(&dir, Split::Train)?,
        config.data.train_samples,
    );
    let test_set = limit(
        IdxDataset::fashion_mnist(&dir, Split::Test)?,
        config.data.test_samples,
    );
    let network = Network::build(&config.model, config.run.seed)?;
    check_data_fits_model(config, &train_set, &network)?;
    tracing::info!(
        "{} training samples, {} test samples",
        train_set.len(),
        test_set.len()
    );

    let loader = |dataset: IdxDataset, training: bool| {
        DataLoader::new(
            Arc::new(dataset),
            LoaderConfig {
                batch_size: config.train.batch_size,
                shuffle: training,
                drop_last: training,
                seed: config.run.seed,
                workers: config.data.workers,
                prefetch: config.data.prefetch,
                augment: if training {
                    config.augment.clone()
                } else {
                    AugmentConfig::default()
                },
                timeout: LOADER_TIMEOUT,
            },
        )
    };
    let train_loader = loader(train_set, true)?;
    let test_loader = loader(test_set, false)?;
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
            position: Position { epoch: 0, step: 0 },
        },
        train_loader,
        test_loader,
    })
}

fn limit(dataset: IdxDataset, samples: usize) -> IdxDataset {
    if samples > 0 && samples < dataset.len() {
        dataset.truncated(samples)
    } else {
        dataset
    }
}

fn check_data_fits_model(
    config: &ExperimentConfig,
    data: &IdxDataset,
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

/// A fresh run refuses to mix its checkpoints into an earlier run's.
fn refuse_to_overwrite(config: &ExperimentConfig) -> Result<Option<PathBuf>> {
    let existing = checkpoint::list(&config.run.output_dir)?;
    if existing.is_empty() {
        return Ok(None);
    }
    Err(PipelineError::value(
        "run.output_dir",
        format!(
            "{} already holds checkpoints of an earlier run. Continue it with `cargo xtask train --resume`, \
             or start afresh in another directory (--set run.output_dir=runs/NEW) or after `rm -r {}`",
            config.run.output_dir.display(),
            config.run.output_dir.display()
        ),
    ))
}

fn resume(config: &ExperimentConfig, run: &mut Run) -> Result<Option<PathBuf>> {
    let (found, skipped) = checkpoint::newest_valid(&config.run.output_dir)?;
    for reason in &skipped {
        tracing::warn!("skipping {reason}");
    }
    let Some((path, saved)) = found else {
        tracing::warn!(
            "--resume: no valid checkpoint in {}; starting from the beginning",
            config.run.output_dir.display()
        );
        return Ok(None);
    };
    if saved.model != config.model {
        return Err(PipelineError::Checkpoint {
            path,
            reason: "it was written for a different model (model.* differs from the experiment); \
                     resume with the experiment that wrote it, or use another run.output_dir"
                .into(),
        });
    }
    if saved.config_fingerprint != config.fingerprint() {
        tracing::warn!(
            "the experiment differs from the one that wrote {} (other than the model); continuing with the new settings",
            path.display()
        );
    }
    restore(&mut run.learner, &saved).map_err(|reason| PipelineError::Checkpoint {
        path: path.clone(),
        reason,
    })?;
    tracing::info!(
        "resuming from {} (epoch {} of {}, step {})",
        path.display(),
        saved.epoch,
        config.train.epochs,
        saved.step
    );
    Ok(Some(path))
}

fn restore(run: &mut Learner, saved: &Checkpoint) -> std::result::Result<(), String> {
    let mut params = run.network.params_mut();
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
    let mut buffers = run.network.buffers_mut();
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
    run.optimizer
        .load_state(saved.optimizer.clone())
        .map_err(|e| e.to_string())?;
    run.position = Position {
        epoch: saved.epoch,
        step: saved.step,
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
    run: &mut Run,
    events: &Sender<Event>,
) -> Result<Vec<EpochSummary>> {
    let mut summaries = Vec::new();
    while run.learner.position.epoch < config.train.epochs {
        let summary = run_epoch(config, run, events)?;
        send(events, Event::Epoch(summary.clone()))?;
        send(
            events,
            Event::Checkpoint(Box::new(snapshot(config, &mut run.learner))),
        )?;
        summaries.push(summary);
    }
    Ok(summaries)
}

fn send(events: &Sender<Event>, event: Event) -> Result<()> {
    events.send(event).map_err(|_| PipelineError::Stage {
        stage: "sink",
        reason: "it stopped receiving (see the error after this one)".into(),
    })
}

fn run_epoch(
    config: &ExperimentConfig,
    run: &mut Run,
    events: &Sender<Event>,
) -> Result<EpochSummary> {
    let Run {
        learner: run,
        train_loader,
        test_loader,
    } = run;
    let epoch = run.position.epoch;
    let batches_per_epoch = train_loader.batches_per_epoch();
    let started = Instant::now();
    let (mut loss_sum, mut correct, mut seen, mut skipped) = (0.0f64, 0usize, 0usize, 0u64);
    for batch in train_loader.epoch(epoch, 0) {
        let batch = batch?;
        let n = batch.labels.len();
        let input = run.network.input_from_u8(n, &batch.pixels)?;
        let logits = run.network.forward(&input, Mode::Train)?;
        let out = softmax_cross_entropy(&logits, &batch.labels, config.train.label_smoothing)?;
        let lr = run.schedule.lr_at(run.position.step);
        let grad_norm = apply_gradients(config, run, &out.grad, out.loss, lr)?;
        let applied = grad_norm.is_some();
        if applied {
            run.position.step += 1;
            loss_sum += out.loss as f64 * n as f64;
            correct += out.correct;
            seen += n;
        } else {
            skipped += 1;
            tracing::warn!(
                "epoch {} batch {}: non-finite loss or gradient, step skipped",
                epoch + 1,
                batch.index
            );
        }
        send(
            events,
            Event::Step(StepReport {
                epoch,
                step: run.position.step,
                batch: batch.index,
                batches_per_epoch,
                samples: n,
                loss: out.loss,
                lr,
                grad_norm: grad_norm.unwrap_or(f32::NAN),
                skipped: !applied,
            }),
        )?;
    }
    let train_seconds = started.elapsed().as_secs_f64();
    let (test_loss, test_accuracy) = evaluate(&mut run.network, test_loader)?;
    run.position.epoch += 1;
    Ok(EpochSummary {
        epoch,
        train_loss: (loss_sum / seen.max(1) as f64) as f32,
        train_accuracy: correct as f32 / seen.max(1) as f32,
        test_loss,
        test_accuracy,
        train_seconds,
        train_samples_per_sec: seen as f64 / train_seconds.max(1e-9),
        skipped_steps: skipped,
    })
}

/// Backward, clip and AdamW step. Returns the gradient norm, or None when
/// the loss or the gradients are not finite and the step was skipped.
fn apply_gradients(
    config: &ExperimentConfig,
    run: &mut Learner,
    grad_logits: &headroom_model::Tensor,
    loss: f32,
    lr: f32,
) -> Result<Option<f32>> {
    if !loss.is_finite() {
        run.network.clear_saved();
        return Ok(None);
    }
    run.network.backward(grad_logits)?;
    let mut params = run.network.params_mut();
    let norm = if config.train.clip_norm > 0.0 {
        clip_grad_norm(&mut params, config.train.clip_norm)
    } else {
        grad_norm(&params)
    };
    let applied = norm.is_finite();
    if applied {
        run.optimizer.step(&mut params, lr)?;
    }
    for p in params {
        p.zero_grad();
    }
    Ok(applied.then_some(norm))
}

/// Mean test loss (no label smoothing) and accuracy.
fn evaluate(network: &mut Network, test_loader: &DataLoader) -> Result<(f32, f32)> {
    let (mut loss_sum, mut correct, mut seen) = (0.0f64, 0usize, 0usize);
    for batch in test_loader.epoch(0, 0) {
        let batch = batch?;
        let n = batch.labels.len();
        let input = network.input_from_u8(n, &batch.pixels)?;
        let logits = network.forward(&input, Mode::Eval)?;
        let out = softmax_cross_entropy(&logits, &batch.labels, 0.0)?;
        loss_sum += out.loss as f64 * n as f64;
        correct += out.correct;
        seen += n;
    }
    Ok((
        (loss_sum / seen.max(1) as f64) as f32,
        correct as f32 / seen.max(1) as f32,
    ))
}

fn snapshot(config: &ExperimentConfig, run: &mut Learner) -> Checkpoint {
    Checkpoint {
        config_fingerprint: config.fingerprint(),
        epoch: run.position.epoch,
        step: run.position.step,
        model: config.model.clone(),
        params: run
            .network
            .params_mut()
            .iter()
            .map(|p| p.value.data().to_vec())
            .collect(),
        buffers: run
            .network
            .buffers_mut()
            .iter()
            .map(|b| b.data().to_vec())
            .collect(),
        optimizer: run.optimizer.state(),
    }
}
