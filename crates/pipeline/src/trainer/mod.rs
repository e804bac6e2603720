//! The `Trainer`: the loop `cargo xtask train` runs, driven from code with a
//! model, data and sinks of your own.
//!
//! ```text
//! Trainer::builder()
//!     .output_dir("runs/mine")            // claimed and locked; resume finds its checkpoints
//!     .model("mlp", network(plan))       // or any Learner, made in the run's memory pool
//!     .data(train, test)                  // any headroom_loader::Dataset
//!     .loop_settings(LoopSettings { epochs: 3, batch_size: 64, ..Default::default() })
//!     .sink(Box::new(MyCsvLogger::new())) // any number of Sinks
//!     .build()?
//!     .run()?
//! ```
//!
//! Everything `cargo xtask train` gets applies to what the caller brings:
//! run directories and their locks, checkpoints (at epoch ends, every N
//! steps or minutes, on a stop request, before an error), bit-exact resume
//! from any of them, the memory budget and its OOM policy, divergence
//! stops, metrics, plots. Each part takes its own typed settings
//! ([`LoopSettings`], [`CheckpointSettings`], [`MemorySettings`],
//! [`ScheduleSettings`], the loader's `LoaderConfig`), never the whole
//! experiment: `train()` is one client, which makes them from a TOML
//! experiment (`Trainer::from_parts`).
//!
//! The loop itself is in `epochs`; this module assembles a run and reports
//! it.

mod epochs;

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread;
use std::time::Instant;

use headroom_loader::{DataLoader, Dataset, LoaderConfig, LoaderMemory, ShuffleMode};
use headroom_model::memory::MemoryPool;
use headroom_model::PoolStats;
use headroom_optim::{OneCycle, Schedule};

use crate::checkpoint::{self, Checkpoint};
use crate::eval::evaluate;
use crate::learner::{open_network, Learner};
pub use crate::learner::{DeviceKind, NetworkPlan, StepSettings};
use crate::memory::MemoryGuard;
use crate::rundir::RunDir;
use crate::sink::{self, MetricsPosition, SinkLink, SinkSettings};
use crate::{PipelineError, Result};

pub use crate::config::TestTimeAugmentation;
pub use crate::config::{CheckpointConfig as CheckpointSettings, ScheduleConfig as ScheduleKind};
pub use crate::memory::{MemorySettings, OomPolicy};
pub use crate::resume::{Resume, RunRecord, SettingsRecord};
pub use crate::rundir::RunPlace;
pub use crate::sink::{
    EpochSummary, EvaluatedOn, RunDirMoved, RunStart, Sink, SinkResult, StepReport, TestSummary,
};
pub use epochs::Position;

/// How the loop runs, typed, with defaults for a small run.
#[derive(Clone, Debug, PartialEq)]
pub struct LoopSettings {
    pub epochs: u64,
    pub batch_size: usize,
    pub micro_batch: MicroBatch,
    /// Compute threads; 0: one per core.
    pub threads: usize,
    /// Steps skipped in a row (non-finite loss or gradient) before the run
    /// stops, its checkpoints from after the update before the skips set
    /// aside (`*.ckpt.diverged`), so a resume starts before that update.
    pub max_consecutive_skips: u64,
    /// A log line every N steps where there is no progress bar.
    pub log_every: u64,
    pub tta: TestTimeAugmentation,
    pub task: Task,
    /// Check before the first step that the model, its optimizer state and
    /// a step at `MemorySettings::min_micro_batch` fit the memory budget (a
    /// fine-tuning run does), rather than meeting the limit mid-run.
    pub check_fits: bool,
    /// Watch a figure of the validation split: keep the best epoch's
    /// checkpoint as `best.ckpt`, stop after `patience` epochs without
    /// improving it, and score the test set once with the best weights
    /// (needs validation data: [`TrainerBuilder::validation`]).
    pub early_stopping: Option<crate::monitor::EarlyStopping>,
}

impl Default for LoopSettings {
    fn default() -> Self {
        Self {
            epochs: 1,
            batch_size: 64,
            micro_batch: MicroBatch::Whole,
            threads: 0,
            max_consecutive_skips: 10,
            log_every: 100,
            tta: TestTimeAugmentation::None,
            task: Task::Classifier,
            check_fits: false,
            early_stopping: None,
        }
    }
}

/// The micro-batch a step starts with (the OOM policy may halve it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MicroBatch {
    /// The whole batch at once.
    Whole,
    /// This many samples at a time, gradients accumulated over the batch.
    Size(usize),
    /// The largest that a dry run says fits the memory budget.
    Planned,
}

/// What the model does: how accuracy is counted and what the plot shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Task {
    /// Samples to classes: accuracy per sample.
    Classifier,
    /// Frames to next frames: per-pixel MSE beside the copy-last baseline.
    Frames,
    /// Bytes to next bytes: `length` predictions per sample.
    Tokens { length: usize },
    /// Features to numeric targets: MSE or Huber, MAE, RMSE and R².
    Regression,
    /// Features to independent 0/1 labels: BCE, exact-match and per-label
    /// accuracy, macro- and micro-F1.
    MultiLabel,
}

impl Task {
    fn plot(self) -> crate::plot::Task {
        match self {
            Task::Classifier => crate::plot::Task::Classifier,
            Task::Frames => crate::plot::Task::Frames,
            Task::Tokens { .. } => crate::plot::Task::Tokens,
            Task::Regression => crate::plot::Task::Regression,
            Task::MultiLabel => crate::plot::Task::MultiLabel,
        }
    }
}

/// The learning rate over the run: a peak `lr` and its shape.
#[derive(Clone, Debug, PartialEq)]
pub struct ScheduleSettings {
    pub lr: f32,
    pub kind: ScheduleKind,
}

impl Default for ScheduleSettings {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            kind: ScheduleKind::Constant,
        }
    }
}

/// The model and data of a run, made once the run's memory pool exists
/// (every tensor of the run comes from it, so the budget is exact).
pub struct Parts {
    pub learner: Box<dyn Learner>,
    pub train: Arc<dyn Dataset>,
    pub test: Arc<dyn Dataset>,
    /// Scored at each epoch's end in place of the test set, which is then
    /// scored once at the end (read with `test_loader`'s settings).
    pub validation: Option<Arc<dyn Dataset>>,
    pub train_loader: LoaderConfig,
    pub test_loader: LoaderConfig,
}

/// Makes the learner in the run's memory pool.
pub type MakeLearner = Box<dyn FnOnce(Arc<MemoryPool>) -> Result<Box<dyn Learner>> + Send>;

/// Runs once the run directory is ready (see [`TrainerParts::on_open`]).
pub type OnOpen = Box<dyn FnOnce(&Path) -> Result<()> + Send>;

/// Makes every part of the run in its memory pool.
pub type MakeParts = Box<dyn FnOnce(Arc<MemoryPool>) -> Result<Parts> + Send>;

/// A network learner (built from a spec, custom layers included, on the
/// device the plan asks for), for [`TrainerBuilder::model`].
pub fn network(plan: NetworkPlan) -> MakeLearner {
    Box::new(move |pool: Arc<MemoryPool>| open_network(&plan, pool, |_| Ok(())))
}

/// What a finished (or stopped) run reports.
#[derive(Clone, Debug)]
pub struct RunSummary {
    pub epochs: Vec<EpochSummary>,
    pub resumed_from: Option<PathBuf>,
    pub last_checkpoint: Option<PathBuf>,
    /// Stopped on request before the last epoch ended.
    pub interrupted: bool,
    pub epoch: u64,
    pub step: u64,
    /// The test set's figures: from the last epoch's evaluation, or, in a
    /// run with a validation split, from the one test pass after the last
    /// epoch (with the best checkpoint's weights when one was kept). None
    /// when the run stopped before one.
    pub test_accuracy: Option<f32>,
    pub test_loss: Option<f32>,
    /// A frame model's copy-last-frame baseline loss on the test frames.
    pub test_baseline_loss: Option<f32>,
    /// A regression's test MAE, RMSE and R², in the targets' units.
    pub test_regression: Option<crate::eval::RegressionMetrics>,
    /// A classifier of more than 5 classes: top-5 accuracy.
    pub test_top5_accuracy: Option<f32>,
    /// A classifier's macro-averaged F1 over the classes.
    pub test_macro_f1: Option<f32>,
    /// A multi-label model's figures.
    pub test_multilabel: Option<crate::multilabel::MultiLabelMetrics>,
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
    /// The run directory.
    pub output_dir: PathBuf,
    /// `best.ckpt` and its (0-based) epoch, when a figure was watched.
    pub best_checkpoint: Option<(PathBuf, u64)>,
    /// Ended by `train.early_stopping`'s patience before its last epoch.
    pub stopped_early: bool,
    /// Whether the `test_*` figures are of the best checkpoint's weights.
    pub test_from_best: bool,
}

/// The test set's figures a summary reports.
#[derive(Clone, Copy)]
struct TestFigures {
    loss: f32,
    accuracy: Option<f32>,
    baseline_loss: Option<f32>,
    regression: Option<crate::eval::RegressionMetrics>,
    top5_accuracy: Option<f32>,
    macro_f1: Option<f32>,
    multilabel: Option<crate::multilabel::MultiLabelMetrics>,
}

/// Where the run's directory comes from.
enum Place {
    /// Claimed by the caller (`train()`, which writes its config there).
    Claimed(RunDir),
    At(RunPlace),
}

/// A follower's scratch directory, removed when the run ends.
struct Scratch(Option<PathBuf>);

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Some(dir) = self.0.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A run ready to start: [`Trainer::run`].
pub struct Trainer {
    place: Place,
    resume: Resume,
    stop: Option<Arc<AtomicBool>>,
    settings: LoopSettings,
    checkpoint: CheckpointSettings,
    memory: MemorySettings,
    schedule: ScheduleSettings,
    record: Arc<dyn RunRecord>,
    parts: MakeParts,
    sinks: Vec<Box<dyn Sink>>,
    on_open: Option<OnOpen>,
    ranks: Option<crate::ranks::Ranks>,
}

/// Everything a [`Trainer`] needs, typed: what `train()` makes from an
/// experiment, and a caller from its own parts.
pub struct TrainerParts {
    pub run_dir: RunDir,
    pub resume: Resume,
    pub stop: Option<Arc<AtomicBool>>,
    pub settings: LoopSettings,
    pub checkpoint: CheckpointSettings,
    pub memory: MemorySettings,
    pub schedule: ScheduleSettings,
    pub record: Arc<dyn RunRecord>,
    pub parts: MakeParts,
    pub sinks: Vec<Box<dyn Sink>>,
    /// Runs once the directory is ready, before a checkpoint is looked for
    /// (`train()` records its resolved config there).
    pub on_open: Option<OnOpen>,
    /// The ranks of a data-parallel run (the learner has joined them and
    /// the training loader makes this rank's shard): every rank must start
    /// from the same point, and only the leader writes checkpoints.
    pub ranks: Option<crate::ranks::Ranks>,
}

impl Trainer {
    pub fn builder() -> TrainerBuilder {
        TrainerBuilder::default()
    }

    /// A trainer of parts already made, in a directory already claimed.
    pub fn from_parts(parts: TrainerParts) -> Self {
        Self {
            place: Place::Claimed(parts.run_dir),
            resume: parts.resume,
            stop: parts.stop,
            settings: parts.settings,
            checkpoint: parts.checkpoint,
            memory: parts.memory,
            schedule: parts.schedule,
            record: parts.record,
            parts: parts.parts,
            sinks: parts.sinks,
            on_open: parts.on_open,
            ranks: parts.ranks,
        }
    }

    /// Trains to the last epoch (or a stop request, or an error after a
    /// checkpoint of the steps before it) and reports.
    pub fn run(self) -> Result<RunSummary> {
        let started = Instant::now();
        // Held (locked) for the whole run; removed on drop if this start
        // made it and it holds no progress.
        let ranks = self.ranks.as_ref().filter(|r| r.active());
        let (_scratch, run_dir, resume) = match self.place {
            Place::Claimed(run_dir) => (Scratch(None), run_dir, self.resume.clone()),
            Place::At(place) => {
                // A run built in code over ranks: the ranks compare what
                // they train, then the leader claims the place and the
                // followers scratch directories of their own.
                if let Some(ranks) = ranks {
                    ranks.require_same(
                        "run record (the builder's settings)",
                        self.record.to_json().as_bytes(),
                    )?;
                }
                let (run_dir, resume, scratch) =
                    crate::ranks::claim_run_dir(ranks, &place, &self.resume)?;
                (Scratch(scratch), run_dir, resume)
            }
        };
        let dir = run_dir.path().to_path_buf();
        let threads = compute_threads(self.settings.threads);
        let pool = compute_pool(threads)?;
        // After the threads (whose stacks take their share), before
        // anything is written.
        crate::limits::check_room_to_start()?;
        open_run_dir(&dir)?;
        if let Some(on_open) = self.on_open {
            on_open(&dir)?;
        }
        let resume_point = crate::resume::choose(&dir, self.record.as_ref(), &resume)?;
        let mut memory = MemoryGuard::new(&self.memory, &dir);
        let made = (self.parts)(memory.pool())?;
        let loop_settings = epochs::RunSettings {
            settings: self.settings.clone(),
            checkpoint: self.checkpoint.clone(),
            dir: dir.clone(),
            fingerprint: self.record.fingerprint(),
            record_json: self.record.to_json(),
            model_json: self.record.model_json(),
            stop: self.stop.clone(),
            writes_checkpoints: self.ranks.as_ref().is_none_or(|r| r.is_leader()),
            world: self.ranks.as_ref().map_or(1, |r| r.world),
        };
        let mut run = prepare(&loop_settings, &self.schedule, made)?;
        keep_address_space_headroom(threads, &run);
        let resumed_from = match resume_point {
            Some((path, saved)) => {
                let settings_changed = saved.meta.config_json != loop_settings.record_json;
                restore(&mut run.trainee, saved).map_err(|reason| PipelineError::Checkpoint {
                    path: path.clone(),
                    reason,
                })?;
                restart_skip_count(&mut run.trainee.position, settings_changed);
                log_resume_point(&path, &run.trainee.position, self.settings.epochs);
                Some(path)
            }
            None => None,
        };
        if let Some(ranks) = &self.ranks {
            let at = &run.trainee.position;
            let point = format!(
                "epoch {} batch {} step {}",
                at.epoch, at.batches_done, at.step
            );
            ranks.require_same(
                "starting point (the checkpoint resumed from)",
                point.as_bytes(),
            )?;
        }
        if self.settings.early_stopping.is_some() {
            set_aside_stale_best(&dir, &run.trainee.position)?;
        }
        set_micro_batch(&self.settings, &self.memory, &mut run.trainee, &mut memory)?;
        if let Some(ranks) = &self.ranks {
            // Each rank planned within its own memory: all take the
            // smallest, so the memory policy's moves stay the same on all.
            let micro = run.trainee.learner.micro_batch();
            let agreed = ranks.smallest(micro as u64, "agreeing on the micro-batch")?;
            if agreed as usize != micro {
                tracing::info!(
                    "micro-batch {agreed}, the smallest any rank planned (ours {micro})"
                );
            }
            run.trainee.learner.set_micro_batch(agreed as usize);
        }
        let parameters = run.trainee.learner.num_params();
        let macs_per_sample = run.trainee.learner.macs_per_sample()?;
        tracing::info!(
            "model: {parameters} parameters, {:.1} M multiply-adds per sample; {threads} compute threads, {} loader workers",
            macs_per_sample as f64 / 1e6,
            run.train_loader.config().workers
        );

        let resumed_at = resumed_from.as_ref().map(|_| MetricsPosition {
            epoch: run.trainee.position.epoch,
            batches_done: run.trainee.position.batches_done,
        });
        let (events, sink) = start_sink(&loop_settings, &self.checkpoint, self.sinks, resumed_at)?;
        let mut summaries = Vec::new();
        let mut final_test = None;
        let result = pool.install(|| {
            let finish = epochs::run_epochs(
                &loop_settings,
                &mut run,
                &events,
                &mut summaries,
                &mut memory,
            )?;
            if matches!(finish, epochs::Finish::Completed) {
                final_test = epochs::final_test(&loop_settings, &mut run, &events, &mut memory)?;
            }
            Ok(finish)
        });
        // The sink moves the run to a new directory when its own is removed
        // or replaced mid-run: what follows writes and names that one.
        let current_dir = events.dir();
        drop(events);
        let joined = join_sink(sink, result);
        let dir = current_dir.get();
        let (finish, outcome) = match joined {
            Err(PipelineError::Diverged {
                skips, from_step, ..
            }) => {
                return Err(PipelineError::Diverged {
                    skips,
                    from_step,
                    resume_from: set_aside_after(&dir, from_step)?,
                    dir,
                })
            }
            other => other?,
        };
        match crate::plot::write(&dir, self.settings.task.plot()) {
            Ok(path) => tracing::info!("plots: {}", path.display()),
            Err(e) => tracing::warn!("no plot: {e}"),
        }
        let test = match (&finish, summaries.last()) {
            _ if final_test.is_some() => final_test.as_ref().map(|t| TestFigures {
                loss: t.loss,
                accuracy: t.accuracy,
                baseline_loss: t.baseline_loss,
                regression: t.regression,
                top5_accuracy: t.top5_accuracy,
                macro_f1: t.macro_f1,
                multilabel: t.multilabel,
            }),
            (_, Some(last)) => Some(TestFigures {
                loss: last.test_loss,
                accuracy: last.test_accuracy,
                baseline_loss: last.test_baseline_loss,
                regression: last.test_regression,
                top5_accuracy: last.test_top5_accuracy,
                macro_f1: last.test_macro_f1,
                multilabel: last.test_multilabel,
            }),
            (epochs::Finish::Stopped, None) => None,
            // A resumed run that had done all its epochs: its checkpoint, scored.
            (epochs::Finish::Completed, None) => {
                let learner = run.trainee.learner.as_mut();
                let test =
                    pool.install(|| evaluate(learner, &run.test_loader, self.settings.tta))?;
                Some(TestFigures {
                    loss: test.loss,
                    accuracy: test.accuracy,
                    baseline_loss: test.baseline_loss,
                    regression: test.regression,
                    top5_accuracy: test.top5_accuracy,
                    macro_f1: (self.settings.task == Task::Classifier)
                        .then(|| crate::eval::macro_f1(&test.confusion))
                        .flatten(),
                    multilabel: test.multilabel,
                })
            }
        };
        let stopped_early = epochs::stopped_early(&loop_settings, &run)
            && run.trainee.position.epoch < self.settings.epochs;
        let best_checkpoint = outcome.best_checkpoint.clone().or_else(|| {
            // A resumed run whose best came before its checkpoint.
            let path = dir.join(checkpoint::BEST_FILE);
            (self.settings.early_stopping.is_some() && path.is_file()).then_some(path)
        });
        let best_checkpoint =
            best_checkpoint.zip(run.trainee.position.monitor.best.map(|(_, epoch)| epoch));
        let test_from_best = final_test.as_ref().is_some_and(|t| t.from_best_checkpoint);
        let train_seconds: f64 = summaries.iter().map(|e| e.train_seconds).sum();
        let train_samples: f64 = summaries
            .iter()
            .map(|e| e.train_samples_per_sec * e.train_seconds)
            .sum();
        Ok(RunSummary {
            epochs: summaries,
            resumed_from,
            last_checkpoint: outcome.last_checkpoint,
            interrupted: matches!(finish, epochs::Finish::Stopped),
            epoch: run.trainee.position.epoch,
            step: run.trainee.position.step,
            test_accuracy: test.and_then(|t| t.accuracy),
            test_loss: test.map(|t| t.loss),
            test_baseline_loss: test.and_then(|t| t.baseline_loss),
            test_regression: test.and_then(|t| t.regression),
            test_top5_accuracy: test.and_then(|t| t.top5_accuracy),
            test_macro_f1: test.and_then(|t| t.macro_f1),
            test_multilabel: test.and_then(|t| t.multilabel),
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
            output_dir: dir,
            best_checkpoint,
            stopped_early,
            test_from_best,
        })
    }
}

/// Builds a [`Trainer`] from a model, data and settings made in code.
#[derive(Default)]
pub struct TrainerBuilder {
    place: Option<RunPlace>,
    resume: Resume,
    stop: Option<Arc<AtomicBool>>,
    settings: LoopSettings,
    checkpoint: CheckpointSettings,
    memory: MemorySettings,
    schedule: ScheduleSettings,
    model: Option<MakeLearner>,
    model_description: Option<String>,
    data: Option<(Arc<dyn Dataset>, Arc<dyn Dataset>)>,
    validation: Option<Arc<dyn Dataset>>,
    loader: LoaderSettings,
    record: Option<Arc<dyn RunRecord>>,
    settings_keys: std::collections::BTreeMap<String, String>,
    sinks: Vec<Box<dyn Sink>>,
    ranks: Option<crate::ranks::Ranks>,
}

/// How the data is read: the loader's settings a run built in code may set
/// (batch size and order come from the loop's settings and `seed`).
#[derive(Clone, Debug, PartialEq)]
pub struct LoaderSettings {
    /// The data order's seed (shuffling, augmentation).
    pub seed: u64,
    /// Worker threads reading and augmenting samples.
    pub workers: usize,
    /// Batches made ahead of the training step.
    pub prefetch: usize,
    /// Augmentation of training samples.
    pub augment: headroom_loader::AugmentConfig,
    pub shuffle_mode: ShuffleMode,
}

impl Default for LoaderSettings {
    fn default() -> Self {
        Self {
            seed: 0,
            workers: 1,
            prefetch: 2,
            augment: headroom_loader::AugmentConfig::default(),
            shuffle_mode: ShuffleMode::Global,
        }
    }
}

impl TrainerBuilder {
    /// The run directory: made if missing, locked for the run; a resume
    /// looks for its checkpoints there.
    pub fn output_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.place = Some(RunPlace::dir(dir));
        self
    }

    /// A new `<name>-<UTC time>` directory inside `runs_dir` (on resume,
    /// the newest there holding checkpoints).
    pub fn runs_dir(mut self, runs_dir: impl Into<PathBuf>, name: impl Into<String>) -> Self {
        self.place = Some(RunPlace {
            runs_dir: runs_dir.into(),
            name: name.into(),
            output_dir: None,
        });
        self
    }

    /// The learner, made in the run's memory pool: [`network`], or your
    /// own. `description` names the model in checkpoints: a resume with
    /// another is refused.
    pub fn model(mut self, description: impl Into<String>, make: MakeLearner) -> Self {
        self.model = Some(make);
        self.model_description = Some(description.into());
        self
    }

    pub fn data(mut self, train: Arc<dyn Dataset>, test: Arc<dyn Dataset>) -> Self {
        self.data = Some((train, test));
        self
    }

    /// Data each epoch is scored on in place of the test set (a part of
    /// the training data held out: `headroom_loader::split_off`); the test
    /// set is then scored once, after the last epoch.
    pub fn validation(mut self, validation: Arc<dyn Dataset>) -> Self {
        self.validation = Some(validation);
        self
    }

    pub fn loop_settings(mut self, settings: LoopSettings) -> Self {
        self.settings = settings;
        self
    }

    pub fn checkpoints(mut self, settings: CheckpointSettings) -> Self {
        self.checkpoint = settings;
        self
    }

    pub fn memory(mut self, settings: MemorySettings) -> Self {
        self.memory = settings;
        self
    }

    pub fn schedule(mut self, settings: ScheduleSettings) -> Self {
        self.schedule = settings;
        self
    }

    pub fn loader(mut self, settings: LoaderSettings) -> Self {
        self.loader = settings;
        self
    }

    /// Another stage on the sink thread (any number, run in order).
    pub fn sink(mut self, sink: Box<dyn Sink>) -> Self {
        self.sinks.push(sink);
        self
    }

    pub fn resume(mut self, resume: Resume) -> Self {
        self.resume = resume;
        self
    }

    /// When `flag` turns true (a signal handler's, say), the run stops after
    /// the current step with a checkpoint.
    pub fn stop_flag(mut self, flag: Arc<AtomicBool>) -> Self {
        self.stop = Some(flag);
        self
    }

    /// A setting of your own that shapes the result (a dataset's size, a
    /// layer's option), recorded in checkpoints: a resume with another value
    /// is refused, naming it.
    pub fn record_setting(mut self, key: impl Into<String>, value: impl ToString) -> Self {
        self.settings_keys.insert(key.into(), value.to_string());
        self
    }

    /// Data parallel: this process is one of `ranks` (over MPI, or threads
    /// in tests). The learner joins them (it must support ranks: the CPU
    /// learner does), the training loader makes this rank's shard of
    /// every global batch of `batch_size × world`, rank 0 writes the
    /// checkpoints in the run directory and the others train in scratch
    /// directories of their own; the ranks' records, data and models are
    /// compared at start. A `stop_flag` becomes this rank's stop request,
    /// which stops every rank after the same step.
    pub fn ranks(mut self, ranks: crate::ranks::Ranks) -> Self {
        self.ranks = Some(ranks);
        self
    }

    /// A record of your own in place of the settings the builder records.
    pub fn record(mut self, record: Arc<dyn RunRecord>) -> Self {
        self.record = Some(record);
        self
    }

    /// The trainer, or an error naming what is missing.
    pub fn build(self) -> Result<Trainer> {
        let missing = |what: &str| PipelineError::Config(format!("Trainer: {what}"));
        let place = self
            .place
            .ok_or_else(|| missing("no run directory (output_dir or runs_dir)"))?;
        let make_learner = self
            .model
            .ok_or_else(|| missing("no model (model(description, make))"))?;
        let (train, test) = self
            .data
            .ok_or_else(|| missing("no data (data(train, test))"))?;
        if self.settings.batch_size == 0 || self.settings.epochs == 0 {
            return Err(missing("batch_size and epochs must be at least 1"));
        }
        if self.settings.early_stopping.is_some() && self.validation.is_none() {
            return Err(missing(
                "early stopping watches validation data: give it with validation(data)",
            ));
        }
        let record = match self.record {
            Some(record) => record,
            None => Arc::new(SettingsRecord {
                settings: record_keys(
                    &self.settings,
                    &self.schedule,
                    &self.loader,
                    self.settings_keys,
                ),
                model: self.model_description.unwrap_or_default(),
            }),
        };
        let loader = self.loader;
        let validation = self.validation;
        let batch_size = self.settings.batch_size;
        let mut ranks = self.ranks.filter(|r| r.active());
        let mut stop = self.stop;
        if let Some(ranks) = ranks.as_mut() {
            if let Some(flag) = stop.take() {
                ranks.requested = flag;
            }
            stop = Some(Arc::clone(&ranks.agreed));
        }
        let ranks_for_parts = ranks.clone();
        let parts: MakeParts = Box::new(move |pool| {
            let mut learner = make_learner(pool)?;
            let mut shard = headroom_loader::Shard::default();
            if let Some(ranks) = ranks_for_parts {
                let data = format!(
                    "{} training samples, {} test samples",
                    train.len(),
                    test.len()
                );
                ranks.require_same("training data", data.as_bytes())?;
                let model = format!("{} parameters", learner.num_params());
                ranks.require_same("model", model.as_bytes())?;
                shard = headroom_loader::Shard {
                    rank: ranks.rank,
                    world: ranks.world,
                };
                learner.join_ranks(ranks)?;
            }
            let loader_config = |training: bool| LoaderConfig {
                batch_size,
                shuffle: training,
                drop_last: training,
                seed: loader.seed,
                workers: loader.workers.max(1),
                prefetch: loader.prefetch.max(1),
                augment: if training {
                    loader.augment.clone()
                } else {
                    headroom_loader::AugmentConfig::default()
                },
                shuffle_mode: loader.shuffle_mode,
                shard: if training {
                    shard
                } else {
                    headroom_loader::Shard::default()
                },
                ..LoaderConfig::default()
            };
            Ok(Parts {
                learner,
                train,
                test,
                validation,
                train_loader: loader_config(true),
                test_loader: loader_config(false),
            })
        });
        Ok(Trainer {
            place: Place::At(place),
            resume: self.resume,
            stop,
            settings: self.settings,
            checkpoint: self.checkpoint,
            memory: self.memory,
            schedule: self.schedule,
            record,
            parts,
            sinks: self.sinks,
            on_open: None,
            ranks,
        })
    }
}

/// The builder's settings that shape the result, as the record's keys.
fn record_keys(
    settings: &LoopSettings,
    schedule: &ScheduleSettings,
    loader: &LoaderSettings,
    mut keys: std::collections::BTreeMap<String, String>,
) -> std::collections::BTreeMap<String, String> {
    keys.insert("batch_size".into(), settings.batch_size.to_string());
    keys.insert("lr".into(), schedule.lr.to_string());
    keys.insert("schedule".into(), format!("{:?}", schedule.kind));
    keys.insert("loader.seed".into(), loader.seed.to_string());
    keys.insert("loader.augment".into(), format!("{:?}", loader.augment));
    keys.insert(
        "loader.shuffle_mode".into(),
        format!("{:?}", loader.shuffle_mode),
    );
    keys
}

/// The run as the loop holds it: what learns, and its loaders.
pub(crate) struct Run {
    pub trainee: epochs::Trainee,
    pub train_loader: DataLoader,
    pub test_loader: DataLoader,
    pub validation_loader: Option<DataLoader>,
}

fn prepare(
    settings: &epochs::RunSettings,
    schedule_settings: &ScheduleSettings,
    made: Parts,
) -> Result<Run> {
    let Parts {
        learner,
        train,
        test,
        validation,
        train_loader,
        test_loader,
    } = made;
    let batch_size = settings.settings.batch_size;
    if settings.settings.early_stopping.is_some() && validation.is_none() {
        return Err(PipelineError::Config(
            "early stopping watches validation data, and the run has none".into(),
        ));
    }
    let train_loader = open_loader(train, train_loader, "training")?;
    let validation_loader = validation
        .map(|data| open_loader(data, test_loader.clone(), "validation"))
        .transpose()?;
    let test_loader = open_loader(test, test_loader, "test")?;
    if train_loader.batches_per_epoch() == 0 {
        return Err(PipelineError::value(
            "train.batch_size",
            format!("{batch_size} is larger than the training set"),
        ));
    }
    let epochs = settings.settings.epochs;
    let total_steps = train_loader.batches_per_epoch() as u64 * epochs;
    Ok(Run {
        trainee: epochs::Trainee {
            learner,
            schedule: schedule(schedule_settings, epochs, total_steps)?,
            position: Position::default(),
            checkpointed_at: Instant::now(),
        },
        train_loader,
        test_loader,
        validation_loader,
    })
}

/// A loader whose worker threads could not start says which, and why that
/// may be (a limit on threads or memory).
fn open_loader(data: Arc<dyn Dataset>, config: LoaderConfig, which: &str) -> Result<DataLoader> {
    DataLoader::new(data, config).map_err(|e| match e {
        headroom_loader::LoaderError::Spawn { worker, source } => PipelineError::Threads {
            what: format!("{which} loader worker thread {worker} (data.workers)"),
            reason: source.to_string(),
        },
        other => other.into(),
    })
}

/// The learning rate at every step of a run of `total_steps`.
fn schedule(settings: &ScheduleSettings, epochs: u64, total_steps: u64) -> Result<Schedule> {
    let lr = settings.lr;
    Ok(match &settings.kind {
        ScheduleKind::Constant => Schedule::Constant { lr },
        ScheduleKind::OneCycle {
            pct_start,
            div_factor,
            final_div_factor,
        } => Schedule::OneCycle(OneCycle::new(
            lr,
            total_steps,
            *pct_start,
            *div_factor,
            *final_div_factor,
        )?),
        ScheduleKind::WarmupCosine {
            warmup_steps,
            min_lr,
        } => {
            if *warmup_steps > total_steps {
                return Err(PipelineError::value(
                    "schedule.warmup_steps",
                    format!(
                        "must be at most the run's {total_steps} optimizer steps ({} batches per \
                         epoch × train.epochs = {}), got {warmup_steps}",
                        total_steps / epochs.max(1),
                        epochs
                    ),
                ));
            }
            let schedule = Schedule::WarmupCosine {
                max_lr: lr,
                warmup_steps: *warmup_steps,
                total_steps,
                min_lr: *min_lr,
            };
            schedule.validate()?;
            schedule
        }
    })
}

fn compute_pool(threads: usize) -> Result<rayon::ThreadPool> {
    start_global_pool()?;
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("compute-{i}"))
        .build()
        .map_err(|e| PipelineError::Threads {
            what: format!("{threads} compute threads (train.threads)"),
            reason: e.to_string(),
        })
}

/// Starts rayon's global pool now, so that a refusal is an error: work
/// that runs outside the run's own pool (building the model, a dry run of
/// the micro-batch planner, sampling text after training) would otherwise
/// start it on first use, and rayon panics when it cannot, where a panic
/// whose backtrace meets a refused allocation deadlocks in std.
fn start_global_pool() -> Result<()> {
    match rayon::ThreadPoolBuilder::new()
        .thread_name(|i| format!("rayon-{i}"))
        .build_global()
    {
        Ok(()) => Ok(()),
        // Started before (an earlier run of this process): nothing to do.
        // rayon tells this case only by its message.
        Err(e) if e.to_string().contains("already been initialized") => Ok(()),
        Err(e) => Err(PipelineError::Threads {
            what: "the shared compute threads (rayon's global pool)".into(),
            reason: e.to_string(),
        }),
    }
}

/// Sizes the address space the run's fallible allocations leave free under
/// `RLIMIT_AS` / `RLIMIT_DATA` for what cannot fail softly: its compute
/// threads and the batches its loaders may make while a step runs (each
/// worker's, the prefetch queue's, and the step's own micro-batch copy).
fn keep_address_space_headroom(threads: usize, run: &Run) {
    let loaders = [
        Some(&run.train_loader),
        Some(&run.test_loader),
        run.validation_loader.as_ref(),
    ];
    let batch_bytes_in_flight = loaders
        .into_iter()
        .flatten()
        .map(|loader| {
            let config = loader.config();
            let dataset = loader.dataset();
            let sample: usize = dataset.sample_shape().iter().product();
            let batch = config.batch_size.min(dataset.len());
            ((config.workers + config.prefetch + 1) * batch * sample) as u64
        })
        .sum();
    let headroom = crate::limits::address_space_headroom(threads, batch_bytes_in_flight);
    headroom_model::address_space::set_headroom(headroom);
    if let Some(room) = headroom_model::address_space::room() {
        tracing::info!(
            "address-space limit: tensors and scratch leave {} of the {} left free for what cannot fail \
             softly ({threads} compute threads, loader batches in flight)",
            headroom_model::memory::bytes_text(headroom),
            headroom_model::memory::bytes_text(room)
        );
    }
}

fn compute_threads(configured: usize) -> usize {
    if configured > 0 {
        return configured;
    }
    thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// The run directory made ready: writable, rid of the temporaries of
/// checkpoints a killed run did not finish.
fn open_run_dir(dir: &Path) -> Result<()> {
    check_writable(dir)?;
    tracing::info!("run directory {}", dir.display());
    for (path, bytes) in checkpoint::remove_unfinished(dir)? {
        tracing::warn!(
            "removed {} ({}): a checkpoint a stopped run did not finish writing",
            path.display(),
            headroom_model::memory::bytes_text(bytes)
        );
    }
    Ok(())
}

/// Fails before any training if checkpoints could not be written.
fn check_writable(dir: &Path) -> Result<()> {
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

/// The micro-batch the run starts with: set, the whole batch, or planned
/// within the budget.
fn set_micro_batch(
    settings: &LoopSettings,
    memory_settings: &MemorySettings,
    trainee: &mut epochs::Trainee,
    memory: &mut MemoryGuard,
) -> Result<()> {
    let learner = trainee.learner.as_mut();
    let micro_batch = match settings.micro_batch {
        MicroBatch::Whole => settings.batch_size,
        MicroBatch::Size(size) => size,
        MicroBatch::Planned => memory.plan_micro_batch(learner, settings.batch_size)?,
    };
    learner.set_micro_batch(micro_batch);
    // A run that asks checks up front that the model, its optimizer state
    // and a step fit the budget (the others keep the adaptive OOM policy,
    // which checkpoints and stops when not even one sample fits).
    if settings.check_fits && memory_settings.limit.is_some() {
        let smallest = micro_batch.min(memory_settings.min_micro_batch.max(1));
        memory.check_fits(learner, smallest)?;
    }
    Ok(())
}

/// The writer stage (metrics, checkpoints, the user's sinks) on its own
/// thread, and the link the training thread sends it events through.
fn start_sink(
    settings: &epochs::RunSettings,
    checkpoint: &CheckpointSettings,
    user: Vec<Box<dyn Sink>>,
    resumed_at: Option<MetricsPosition>,
) -> Result<(SinkLink, thread::JoinHandle<Result<sink::SinkOutcome>>)> {
    let (events, receiver, checkpoint_written) = SinkLink::new(256, settings.dir.clone());
    let sink_settings = SinkSettings {
        output_dir: events.dir(),
        epochs: settings.settings.epochs,
        log_every: settings.settings.log_every,
        keep: checkpoint.keep,
        user,
        resumed_at,
        checkpoint_written,
    };
    let sink = thread::Builder::new()
        .name("sink".into())
        .spawn(move || sink::run(receiver, sink_settings))
        .map_err(|e| PipelineError::Threads {
            what: "the thread that writes metrics and checkpoints".into(),
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
    result: Result<epochs::Finish>,
) -> Result<(epochs::Finish, sink::SinkOutcome)> {
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

/// Renames the checkpoints of `dir` written at step `from_step` or later
/// (after the update the run diverged from) to `*.ckpt.diverged`, kept for
/// a look but never resumed from, and says where a resume continues.
fn set_aside_after(dir: &Path, from_step: u64) -> Result<String> {
    let mut set_aside = Vec::new();
    for path in checkpoint::list(dir)? {
        let saved = checkpoint::step_of(&path);
        if saved.is_some_and(|step| step >= from_step) {
            let mut aside = path.clone().into_os_string();
            aside.push(".diverged");
            std::fs::rename(&path, &aside).map_err(|e| PipelineError::io(&path, e))?;
            set_aside.push(PathBuf::from(aside));
        }
    }
    let kept = checkpoint::newest_valid(dir)?.0;
    let mut note = match kept {
        Some((path, saved)) => format!(
            "A resume continues from {} (step {}), before that update.",
            path.display(),
            saved.meta.step
        ),
        None => "No checkpoint precedes that update: a resume starts from the beginning.".into(),
    };
    if !set_aside.is_empty() {
        let names: Vec<String> = set_aside.iter().map(|p| p.display().to_string()).collect();
        note.push_str(&format!(
            " Set aside (written after it): {}.",
            names.join(", ")
        ));
    }
    Ok(note)
}

/// A `best.ckpt` that is not the best of the checkpoint resumed from (a
/// resume from an older checkpoint, the newer ones corrupt) is set aside
/// as `best.ckpt.stale`, and the best epoch's own checkpoint, if the run
/// still keeps it, becomes `best.ckpt` again. Only the files' metas are
/// read.
fn set_aside_stale_best(dir: &Path, position: &Position) -> Result<()> {
    let path = dir.join(checkpoint::BEST_FILE);
    // The end of the best epoch, where its checkpoint stands.
    let expected = position.monitor.best.map(|(_, epoch)| epoch + 1);
    let at_best =
        |meta: &checkpoint::CheckpointMeta| Some(meta.epoch) == expected && meta.batches_done == 0;
    let holds = checkpoint::read_meta(&path).ok();
    if holds.as_ref().is_some_and(at_best) || (!path.exists() && expected.is_none()) {
        return Ok(());
    }
    if path.exists() {
        let mut aside = path.clone().into_os_string();
        aside.push(".stale");
        std::fs::rename(&path, &aside).map_err(|e| PipelineError::io(&path, e))?;
        tracing::warn!(
            "{} is not the best checkpoint of the state resumed from (it holds {}; the best is \
             {}): set aside as {}",
            path.display(),
            holds.map_or_else(
                || "no readable checkpoint".into(),
                |m| format!("epoch {}", m.epoch)
            ),
            expected.map_or_else(|| "not yet chosen".into(), |e| format!("epoch {e}")),
            PathBuf::from(&aside).display()
        );
    }
    let kept = checkpoint::list(dir)?
        .into_iter()
        .find(|file| checkpoint::read_meta(file).is_ok_and(|meta| at_best(&meta)));
    if let Some(file) = kept {
        let best = checkpoint::keep_as_best(dir, &file)?;
        tracing::info!(
            "{} is the best epoch's checkpoint again: {}",
            file.display(),
            best.display()
        );
    }
    Ok(())
}

/// A run stopped for diverging advises a lower learning rate (or a clip)
/// and a resume: with a setting changed, the steps skipped in a row before
/// it say nothing of the new setting, so the count starts again. With the
/// same settings it is kept, and the resume is exact.
fn restart_skip_count(position: &mut Position, settings_changed: bool) {
    if settings_changed && position.consecutive_skips > 0 {
        tracing::info!(
            "{} steps skipped in a row before the checkpoint, under other settings: the count starts again",
            position.consecutive_skips
        );
        position.consecutive_skips = 0;
    }
}

fn restore(trainee: &mut epochs::Trainee, saved: Checkpoint) -> std::result::Result<(), String> {
    let (meta, state) = saved.into_parts();
    trainee.learner.restore(state)?;
    trainee
        .learner
        .restore_tuned_convolutions(&meta.tuned_convs);
    trainee.position = Position {
        epoch: meta.epoch,
        batches_done: meta.batches_done,
        step: meta.step,
        consecutive_skips: meta.consecutive_skips,
        progress: meta.progress,
        monitor: meta.monitor,
    };
    Ok(())
}
