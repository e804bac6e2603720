//! The sink stage: everything the training loop reports goes through one
//! bounded channel to this thread, which prints progress, appends metrics as
//! JSON lines and writes checkpoints, so the training thread never waits for
//! the terminal or the disk.
//!
//! A user's own stages ([`Sink`]: a CSV logger, a dashboard client) run on
//! the same thread after the built-in ones, in the order given, and see the
//! same events.

mod records;
mod run_dir;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crossbeam_channel::{bounded, Receiver, Sender};
use serde::Serialize;

use crate::checkpoint::{self, Checkpoint};
use crate::{PipelineError, Result};
pub use records::{BestEpoch, EvaluatedOn, TestSummary};
pub use run_dir::CurrentDir;
use run_dir::{Metrics, Watch};

#[derive(Clone, Debug, Serialize)]
pub struct StepReport {
    pub epoch: u64,
    pub step: u64,
    pub batch: usize,
    pub batches_per_epoch: usize,
    pub samples: usize,
    pub loss: f32,
    pub lr: f32,
    pub grad_norm: f32,
    pub skipped: bool,
    /// Tensor memory the run holds (the pool's reserved bytes).
    pub memory_bytes: u64,
    /// This step's throughput, from batch to batch.
    pub samples_per_sec: f64,
    /// Out-of-memory events handled so far in this run.
    pub oom_events: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct EpochSummary {
    pub epoch: u64,
    /// The mean loss of the epoch's trained steps; None (and left out of
    /// metrics.jsonl) when every step was skipped, so that no 0.0 passes
    /// for a result.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub train_loss: Option<f32>,
    /// None (and left out of metrics.jsonl) for a frame model: a
    /// regression has no accuracy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub train_accuracy: Option<f32>,
    pub test_loss: f32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub test_accuracy: Option<f32>,
    /// A frame model's copy-last-frame baseline on the test frames.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub test_baseline_loss: Option<f32>,
    /// A regression's test MAE, RMSE and R², in the targets' units.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub test_regression: Option<crate::eval::RegressionMetrics>,
    /// A classifier of more than 5 classes: top-5 accuracy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub test_top5_accuracy: Option<f32>,
    /// A classifier's macro-averaged F1 over the classes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub test_macro_f1: Option<f32>,
    /// A multi-label model's figures.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub test_multilabel: Option<crate::multilabel::MultiLabelMetrics>,
    pub train_seconds: f64,
    pub train_samples_per_sec: f64,
    pub skipped_steps: u64,
    /// The split the `test_*` figures come from: the test set, or the
    /// validation split (`data.validation`), when `metrics.jsonl` names
    /// them `validation_*`.
    #[serde(skip_serializing_if = "EvaluatedOn::is_test")]
    pub evaluated_on: EvaluatedOn,
    /// Whether the watched figure (`train.early_stopping`) is the best so
    /// far; None when nothing is watched.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub best: Option<bool>,
}

/// " acc 91.23%", or nothing when there is no accuracy (frame models).
/// A stage of your own on the sink thread, beside the metrics file, the
/// progress bar and the checkpoint writer: it sees every step and epoch the
/// run reports. It runs off the training thread (a slow sink makes training
/// wait only when the channel's 256 events are full).
///
/// Resume: a resumed run reports again every step after its checkpoint, so
/// [`Sink::start`] says where it goes on from and the sink drops what it
/// recorded from there on; [`Sink::sync`] is called before each checkpoint
/// is written, so that what the sink holds durably is never behind a
/// checkpoint. A sink that does both leaves the same record after a kill
/// and a resume as after an uninterrupted run.
///
/// An error ends the run (it is checkpointed first, as for a full disk),
/// with the sink's name and its message.
pub trait Sink: Send {
    /// A short name for error messages ("csv logger").
    fn name(&self) -> String;

    /// Before any event: the run directory, the epochs, and where a
    /// resumed run goes on from (None: from the beginning).
    fn start(&mut self, run: &RunStart) -> SinkResult {
        let _ = run;
        Ok(())
    }

    fn step(&mut self, report: &StepReport) -> SinkResult {
        let _ = report;
        Ok(())
    }

    fn epoch(&mut self, summary: &EpochSummary) -> SinkResult {
        let _ = summary;
        Ok(())
    }

    /// Everything reported so far must be durable: a checkpoint is about to
    /// be written, and a resume from it never reports those steps again.
    fn sync(&mut self) -> SinkResult {
        Ok(())
    }

    /// A checkpoint is on disk at `path`.
    fn checkpoint(&mut self, path: &Path) -> SinkResult {
        let _ = path;
        Ok(())
    }

    /// The test set's one score at the end of a run with a validation
    /// split.
    fn test(&mut self, summary: &TestSummary) -> SinkResult {
        let _ = summary;
        Ok(())
    }

    /// The run directory was removed, renamed or replaced while the run
    /// wrote into it: the run goes on in `moved.to` (the same path made
    /// again, or `<dir>-restored` beside another directory now at the
    /// path), where its own records and `metrics.jsonl` are restored. A
    /// sink that writes files in the run directory writes them there from
    /// now on, and can restore what it wrote: a file it still holds open
    /// keeps its contents when the directory is gone (the example
    /// `CsvSink` copies its files over from their open handles).
    fn moved(&mut self, moved: &RunDirMoved) -> SinkResult {
        let _ = moved;
        Ok(())
    }

    /// The run is over (completed, stopped or failed): the last call.
    fn finish(&mut self) -> SinkResult {
        Ok(())
    }
}

/// Where the run went on when its directory was removed, renamed or
/// replaced ([`Sink::moved`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunDirMoved {
    /// The directory the run was writing into.
    pub from: PathBuf,
    /// Where it writes from now on.
    pub to: PathBuf,
    /// Another directory is now at `from` (left alone; `to` is beside it).
    pub replaced: bool,
}

/// What a [`Sink`] returns: any error, reported with the sink's name.
pub type SinkResult = std::result::Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// What a [`Sink`] is told before the first event.
#[derive(Clone, Debug)]
pub struct RunStart {
    pub output_dir: PathBuf,
    pub epochs: u64,
    /// Where a resumed run goes on from: steps at or after it (and epochs
    /// from its epoch on) will be reported again.
    pub resumed_at: Option<MetricsPosition>,
}

/// The user's sinks, each call's error named after its sink.
struct UserSinks(Vec<Box<dyn Sink>>);

impl UserSinks {
    fn each(&mut self, mut call: impl FnMut(&mut dyn Sink) -> SinkResult) -> Result<()> {
        for sink in &mut self.0 {
            call(sink.as_mut()).map_err(|e| PipelineError::Stage {
                stage: "sink",
                reason: format!("{}: {e}", sink.name()),
            })?;
        }
        Ok(())
    }
}

fn accuracy_text(accuracy: Option<f32>) -> String {
    accuracy.map_or(String::new(), |a| format!(" acc {:.2}%", a * 100.0))
}

pub enum Event {
    Step(StepReport),
    Epoch(EpochSummary),
    Checkpoint(Box<Checkpoint>),
    /// Every event before it is on disk: the sink answers once the
    /// metrics are synced (`SinkLink::write_here`).
    SyncMetrics(Sender<()>),
    /// A checkpoint the training side wrote itself (`SinkLink::write_here`).
    CheckpointWritten(PathBuf),
    /// The last checkpoint written is the best so far: `best.ckpt`.
    Best(BestEpoch),
    /// The test set scored once, after the last epoch.
    Test(TestSummary),
}

pub struct SinkSettings {
    /// The run directory, shared with the training side: the sink moves the
    /// run to a new one when it is removed or replaced (`run_dir`).
    pub output_dir: CurrentDir,
    pub epochs: u64,
    pub log_every: u64,
    pub keep: usize,
    /// The user's own stages, after the built-in ones.
    pub user: Vec<Box<dyn Sink>>,
    /// Where a resumed run goes on from (for the user's stages).
    pub resumed_at: Option<MetricsPosition>,
    /// Where the sink hands back the checkpoint token once a checkpoint is
    /// on disk (see [`SinkLink`]).
    pub checkpoint_written: Sender<()>,
}

/// The training side of the sink: its events, and the one token a
/// checkpoint's snapshot needs. The token goes to the sink with the
/// snapshot and comes back when the file is written, so at most one
/// snapshot lives beside the model: a slow disk makes training wait at its
/// next checkpoint, never memory grow by a model's size per checkpoint
/// queued.
pub struct SinkLink {
    events: Sender<Event>,
    token: Receiver<()>,
    dir: CurrentDir,
}

impl SinkLink {
    /// The link for a run writing into `dir`, and the sender for the
    /// sink's settings; the token starts on the training side.
    pub fn new(capacity: usize, dir: PathBuf) -> (Self, Receiver<Event>, Sender<()>) {
        let (events, receiver) = bounded(capacity);
        let (written, token) = bounded(1);
        // The channel is empty and its receiver alive: this cannot fail.
        let _ = written.send(());
        let dir = CurrentDir::new(dir);
        (Self { events, token, dir }, receiver, written)
    }

    /// The run directory as the sink keeps it (see `SinkSettings::output_dir`).
    pub fn dir(&self) -> CurrentDir {
        self.dir.clone()
    }

    pub fn send(&self, event: Event) -> Result<()> {
        self.events.send(event).map_err(|_| stopped())
    }

    /// Waits until the sink has handled every event sent before (the
    /// best checkpoint is in place, say).
    pub fn sync(&self) -> Result<()> {
        let (synced, wait) = bounded(1);
        self.send(Event::SyncMetrics(synced))?;
        wait.recv().map_err(|_| stopped())
    }

    /// Waits until the previous checkpoint is on disk; the caller then owns
    /// the token until it sends its own checkpoint.
    pub fn take_checkpoint_token(&self) -> Result<()> {
        self.token.recv().map_err(|_| stopped())
    }

    /// Runs `write`, a checkpoint written on this thread (the learner's own
    /// tensors, when memory refused a copy of them), in the sink's order:
    /// every step sent before it is on disk first, as with a checkpoint the
    /// sink writes, and the sink takes it as its last and hands the token
    /// back. The caller holds the token; `write` is given the directory to
    /// write into (the sink checked it is still the run's before answering).
    pub fn write_here(&self, write: impl FnOnce(&Path) -> Result<PathBuf>) -> Result<PathBuf> {
        let (synced, wait) = bounded(1);
        self.send(Event::SyncMetrics(synced))?;
        wait.recv().map_err(|_| stopped())?;
        let path = write(&self.dir.get())?;
        self.send(Event::CheckpointWritten(path.clone()))?;
        Ok(path)
    }
}

fn stopped() -> PipelineError {
    PipelineError::Stage {
        stage: "sink",
        reason: "it stopped receiving events".into(),
    }
}

/// What the sink leaves behind for the summary.
pub struct SinkOutcome {
    pub last_checkpoint: Option<PathBuf>,
    /// `best.ckpt`, when a figure was watched and one was kept.
    pub best_checkpoint: Option<PathBuf>,
}

/// Runs the stage until the channel closes. Its first error ends it and is
/// also logged here, with the file and the OS's reason (a full disk says
/// "No space left on device" and names the file), because the training
/// loop only sees that the sink stopped receiving.
pub fn run(events: Receiver<Event>, mut settings: SinkSettings) -> Result<SinkOutcome> {
    let mut user = UserSinks(std::mem::take(&mut settings.user));
    let start = RunStart {
        output_dir: settings.output_dir.get(),
        epochs: settings.epochs,
        resumed_at: settings.resumed_at,
    };
    let outcome = user
        .each(|sink| sink.start(&start))
        .and_then(|()| receive(events, &settings, &mut user));
    // Every sink hears the end, whatever ended the run; the first error is
    // the one reported.
    let finished = user.each(|sink| sink.finish());
    let outcome = outcome.and_then(|outcome| finished.map(|()| outcome));
    if let Err(e) = &outcome {
        tracing::error!("the sink stage stopped: {e}");
    }
    outcome
}

/// [`Watch::check`], the user's sinks told where the run went on.
fn check_dir(watch: &mut Watch, metrics: &mut Metrics, user: &mut UserSinks) -> Result<()> {
    match watch.check(metrics)? {
        Some(moved) => user.each(|sink| sink.moved(&moved)),
        None => Ok(()),
    }
}

fn receive(
    events: Receiver<Event>,
    settings: &SinkSettings,
    user: &mut UserSinks,
) -> Result<SinkOutcome> {
    let mut watch = Watch::start(settings.output_dir.clone());
    let mut metrics = Metrics::open(&watch.dir())?;
    let mut last_checkpoint = None;
    let mut best_checkpoint = None;
    let mut window = Window::new();
    let mut clock = Clock::new();
    let mut bar = Progress::new(settings.epochs);
    for event in events {
        match event {
            Event::Step(report) => {
                write_json(&mut metrics, "step", &report)?;
                user.each(|sink| sink.step(&report))?;
                window.add(&report);
                let times = clock.text(&report, settings.epochs);
                let boundary = report.step % settings.log_every == 0
                    || report.batch + 1 == report.batches_per_epoch;
                match &mut bar {
                    Some(bar) => bar.update(&report, &mut window, &times),
                    None if boundary => window.log(&report, settings.epochs, &times),
                    None => {}
                }
            }
            Event::Epoch(summary) => {
                if let Some(bar) = &mut bar {
                    bar.finish_epoch();
                }
                check_dir(&mut watch, &mut metrics, user)?;
                // A test-set epoch is written as it always was (its keys in
                // the struct's order); a validation epoch's keys renamed.
                match summary.evaluated_on {
                    EvaluatedOn::Test => write_json(&mut metrics, "epoch", &summary)?,
                    EvaluatedOn::Validation => {
                        let record = records::validation_epoch_record(&summary).map_err(|e| {
                            PipelineError::Stage {
                                stage: "sink",
                                reason: e.to_string(),
                            }
                        })?;
                        write_json(&mut metrics, "epoch", &record)?
                    }
                }
                user.each(|sink| sink.epoch(&summary))?;
                flush(&mut metrics)?;
                tracing::info!(
                    "epoch {}/{} done: train loss {}{} | {} loss {:.4}{}{} | {:.1}s, {:.0} samples/s{}",
                    summary.epoch + 1,
                    settings.epochs,
                    summary.train_loss.map_or_else(
                        || "none (every step skipped)".to_string(),
                        |loss| format!("{loss:.4}")
                    ),
                    accuracy_text(summary.train_accuracy),
                    summary.evaluated_on.name(),
                    summary.test_loss,
                    records::held_out_text(
                        summary.test_accuracy,
                        summary.test_baseline_loss,
                        summary.test_regression,
                        summary.test_multilabel
                    ),
                    if summary.best == Some(true) {
                        ", best so far"
                    } else {
                        ""
                    },
                    summary.train_seconds,
                    summary.train_samples_per_sec,
                    if summary.skipped_steps > 0 {
                        format!(", {} steps skipped (non-finite)", summary.skipped_steps)
                    } else {
                        String::new()
                    }
                );
            }
            Event::Checkpoint(snapshot) => {
                let started = Instant::now();
                // Every step before the checkpoint reaches the disk first: a
                // resume keeps the records that precede its checkpoint and
                // never writes them again, so any still buffered at a kill
                // would be lost for good.
                check_dir(&mut watch, &mut metrics, user)?;
                sync_metrics(&mut metrics)?;
                user.each(|sink| sink.sync())?;
                let path = checkpoint::write(&watch.dir(), &snapshot, settings.keep)?;
                tracing::info!(
                    "checkpoint {} written in {:.0} ms",
                    path.display(),
                    started.elapsed().as_secs_f64() * 1e3
                );
                user.each(|sink| sink.checkpoint(&path))?;
                last_checkpoint = Some(path);
                // The training side holds no token while this one is out,
                // so the slot is free; if it has gone, nobody waits.
                let _ = settings.checkpoint_written.try_send(());
            }
            Event::SyncMetrics(synced) => {
                // The training side writes a checkpoint into the directory
                // once answered.
                check_dir(&mut watch, &mut metrics, user)?;
                sync_metrics(&mut metrics)?;
                user.each(|sink| sink.sync())?;
                // The sender waits; if it has gone, nobody does.
                let _ = synced.send(());
            }
            Event::CheckpointWritten(path) => {
                user.each(|sink| sink.checkpoint(&path))?;
                last_checkpoint = Some(path);
                let _ = settings.checkpoint_written.try_send(());
            }
            Event::Best(best) => {
                let Some(of) = &last_checkpoint else {
                    return Err(PipelineError::Stage {
                        stage: "sink",
                        reason: format!(
                            "epoch {} is the best so far but no checkpoint was written for it",
                            best.epoch + 1
                        ),
                    });
                };
                // The checkpoint may have been written before the
                // directory moved (`run_dir`): link it where it is now.
                let dir = watch.dir();
                let of = dir.join(of.file_name().unwrap_or_default());
                let path = checkpoint::keep_as_best(&dir, &of)?;
                tracing::info!(
                    "best so far: epoch {} ({}): {}",
                    best.epoch + 1,
                    best.figure,
                    path.display()
                );
                best_checkpoint = Some(path);
            }
            Event::Test(test) => {
                check_dir(&mut watch, &mut metrics, user)?;
                write_json(&mut metrics, "test", &test)?;
                user.each(|sink| sink.test(&test))?;
                flush(&mut metrics)?;
                tracing::info!(
                    "test set, scored once with the weights of epoch {}{}: loss {:.4}{}{}{}",
                    test.weights_of_epoch + 1,
                    if test.from_best_checkpoint {
                        " (the best checkpoint)"
                    } else {
                        " (the last)"
                    },
                    test.loss,
                    records::held_out_text(
                        test.accuracy,
                        test.baseline_loss,
                        test.regression,
                        test.multilabel
                    ),
                    test.macro_f1
                        .map_or_else(String::new, |f1| format!(", macro-F1 {f1:.4}")),
                    test.top5_accuracy
                        .map_or_else(String::new, |top5| format!(", top-5 {:.2}%", top5 * 100.0))
                );
            }
        }
    }
    // A directory removed after the last checkpoint still gets its records
    // (and the metrics to the end) back.
    check_dir(&mut watch, &mut metrics, user)?;
    flush(&mut metrics)?;
    Ok(SinkOutcome {
        last_checkpoint,
        best_checkpoint,
    })
}

fn flush(metrics: &mut Metrics) -> Result<()> {
    metrics
        .out
        .flush()
        .map_err(|e| PipelineError::io(&metrics.path, e))
}

fn sync_metrics(metrics: &mut Metrics) -> Result<()> {
    flush(metrics)?;
    metrics
        .out
        .get_ref()
        .sync_data()
        .map_err(|e| PipelineError::io(&metrics.path, e))
}

/// Appends one JSON line with a single `write_all`, so the buffer only
/// ever reaches the file in whole lines: a kill leaves no torn line.
fn write_json<T: Serialize>(out: &mut Metrics, kind: &str, value: &T) -> Result<()> {
    let body = serde_json::to_string(value).map_err(|e| PipelineError::Stage {
        stage: "sink",
        reason: e.to_string(),
    })?;
    let line = format!("{{\"kind\":\"{kind}\",\"data\":{body}}}\n");
    out.out
        .write_all(line.as_bytes())
        .map_err(|e| PipelineError::io(&out.path, e))
}

/// Where a resumed run picks up: metrics of this point and later are
/// dropped, since the resumed run writes them again.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MetricsPosition {
    pub epoch: u64,
    pub batches_done: usize,
}

/// Keeps the complete, valid lines of `dir/metrics.jsonl` that come before
/// `position` (none when starting over), replacing the file atomically. A
/// line torn by a kill, and steps a killed run recorded after its last
/// checkpoint, are dropped.
pub fn truncate_metrics(dir: &Path, position: Option<MetricsPosition>) -> Result<()> {
    let path = dir.join("metrics.jsonl");
    // Only a regular file is ours to rewrite (not a pipe or a device).
    if !std::fs::metadata(&path).is_ok_and(|m| m.is_file()) {
        return Ok(());
    }
    let text = match std::fs::read(&path) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(e) => return Err(PipelineError::io(&path, e)),
    };
    let kept: String = text
        .split_inclusive('\n')
        .filter(|line| line.ends_with('\n'))
        .filter(|line| position.is_some_and(|at| line_precedes(line, at)))
        .collect();
    if kept.len() == text.len() {
        return Ok(());
    }
    let temporary = dir.join(".metrics.jsonl.tmp");
    std::fs::write(&temporary, kept).map_err(|e| PipelineError::io(&temporary, e))?;
    std::fs::rename(&temporary, &path).map_err(|e| PipelineError::io(&path, e))
}

fn line_precedes(line: &str, at: MetricsPosition) -> bool {
    let Ok(value) = serde_json::from_str::<serde_json::Value>(line) else {
        return false;
    };
    let data = &value["data"];
    let (Some(epoch), kind) = (data["epoch"].as_u64(), value["kind"].as_str()) else {
        return false;
    };
    match kind {
        Some("step") => data["batch"]
            .as_u64()
            .is_some_and(|batch| (epoch, batch) < (at.epoch, at.batches_done as u64)),
        Some("epoch") => epoch < at.epoch,
        _ => false,
    }
}

/// Loss and throughput since the last progress line.
struct Window {
    since: Instant,
    samples: usize,
    loss_sum: f64,
    steps: usize,
}

impl Window {
    fn new() -> Self {
        Self {
            since: Instant::now(),
            samples: 0,
            loss_sum: 0.0,
            steps: 0,
        }
    }

    fn add(&mut self, report: &StepReport) {
        self.samples += report.samples;
        if report.loss.is_finite() {
            self.loss_sum += report.loss as f64;
            self.steps += 1;
        }
    }

    fn rate(&self) -> f64 {
        self.samples as f64 / self.since.elapsed().as_secs_f64().max(1e-9)
    }

    fn mean_loss(&self) -> f64 {
        self.loss_sum / self.steps.max(1) as f64
    }

    fn log(&mut self, report: &StepReport, epochs: u64, times: &str) {
        tracing::info!(
            "epoch {}/{} step {}/{} | loss {:.4} | lr {:.2e} | {:.0} samples/s | memory {} | {times}",
            report.epoch + 1,
            epochs,
            report.batch + 1,
            report.batches_per_epoch,
            self.mean_loss(),
            report.lr,
            self.rate(),
            headroom_model::memory::bytes_text(report.memory_bytes)
        );
        *self = Self::new();
    }
}

/// The run's elapsed time and the time it has left, for the progress bar
/// and lines. The bar itself restarts every epoch, so indicatif's own
/// `{elapsed}` and `{eta}` would cover one epoch; this covers the run: the
/// time since this process started training, and the steps left at the
/// rate of the steps it has done (a resumed run's earlier steps, done by
/// another process, do not count towards the rate).
struct Clock {
    started: Instant,
    /// Steps of the run done before this process's first report.
    done_before: Option<u64>,
}

impl Clock {
    fn new() -> Self {
        Self {
            started: Instant::now(),
            done_before: None,
        }
    }

    /// "elapsed 00:01:05, eta 00:10:00" after `report`.
    fn text(&mut self, report: &StepReport, epochs: u64) -> String {
        let per_epoch = report.batches_per_epoch.max(1) as u64;
        let done = report.epoch * per_epoch + report.batch as u64 + 1;
        let before = *self.done_before.get_or_insert(done.saturating_sub(1));
        let elapsed = self.started.elapsed().as_secs_f64();
        let left = eta_seconds(
            elapsed,
            done.saturating_sub(before),
            (epochs * per_epoch).saturating_sub(done),
        );
        format!(
            "elapsed {}, eta {}",
            hms(elapsed),
            left.map_or_else(|| "?".to_string(), hms)
        )
    }
}

/// The seconds `left` steps take at the rate of `done` steps in `elapsed`
/// seconds; None before any step is done.
fn eta_seconds(elapsed: f64, done: u64, left: u64) -> Option<f64> {
    (done > 0).then(|| elapsed / done as f64 * left as f64)
}

/// `HH:MM:SS` (hours past 99 kept whole), as indicatif's `{elapsed_precise}`.
fn hms(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    format!("{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

/// A live progress bar when stderr is a terminal; None otherwise (CI, files),
/// where the plain log lines above are the progress.
struct Progress {
    bar: indicatif::ProgressBar,
    epochs: u64,
    last_draw: Instant,
}

impl Progress {
    fn new(epochs: u64) -> Option<Self> {
        use std::io::IsTerminal;
        if !std::io::stderr().is_terminal() {
            return None;
        }
        let bar = indicatif::ProgressBar::new(0);
        let style =
            indicatif::ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> ");
        bar.set_style(style);
        Some(Self {
            bar,
            epochs,
            last_draw: Instant::now(),
        })
    }

    fn update(&mut self, report: &StepReport, window: &mut Window, times: &str) {
        self.bar.set_length(report.batches_per_epoch as u64);
        self.bar.set_position(report.batch as u64 + 1);
        self.bar
            .set_prefix(format!("epoch {}/{}", report.epoch + 1, self.epochs));
        if self.last_draw.elapsed().as_millis() >= 500 {
            self.bar.set_message(format!(
                "| loss {:.4} | lr {:.2e} | {:.0} samples/s | memory {} | {times}",
                window.mean_loss(),
                report.lr,
                window.rate(),
                headroom_model::memory::bytes_text(report.memory_bytes)
            ));
            *window = Window::new();
            self.last_draw = Instant::now();
        }
    }

    fn finish_epoch(&mut self) {
        self.bar.finish_and_clear();
        self.bar.reset();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::CheckpointMeta;

    fn step(epoch: u64, batch: usize) -> String {
        format!("{{\"kind\":\"step\",\"data\":{{\"epoch\":{epoch},\"batch\":{batch},\"step\":{batch}}}}}\n")
    }

    fn report(step: u64) -> StepReport {
        StepReport {
            epoch: 0,
            step,
            batch: step as usize - 1,
            batches_per_epoch: 100,
            samples: 8,
            loss: 1.0,
            lr: 1e-3,
            grad_norm: 1.0,
            skipped: false,
            memory_bytes: 0,
            samples_per_sec: 1.0,
            oom_events: 0,
        }
    }

    fn snapshot(step: u64) -> Checkpoint {
        Checkpoint {
            meta: CheckpointMeta {
                config_fingerprint: 0,
                config_json: String::new(),
                model_json: String::new(),
                epoch: 0,
                batches_done: step as usize,
                step,
                consecutive_skips: 0,
                progress: Default::default(),
                tuned_convs: Vec::new(),
                monitor: Default::default(),
            },
            params: vec![vec![0.5; 4]],
            buffers: Vec::new(),
            optimizer: Default::default(),
            loss_scale: None,
        }
    }

    fn start(dir: &Path) -> (SinkLink, std::thread::JoinHandle<Result<SinkOutcome>>) {
        let (link, events, checkpoint_written) = SinkLink::new(16, dir.to_path_buf());
        let settings = SinkSettings {
            output_dir: link.dir(),
            epochs: 1,
            log_every: 1000,
            keep: 2,
            user: Vec::new(),
            resumed_at: None,
            checkpoint_written,
        };
        (link, std::thread::spawn(move || run(events, settings)))
    }

    /// The token comes back only once the checkpoint it went with is on
    /// disk: a second snapshot waits for the first one's write.
    #[test]
    fn the_checkpoint_token_returns_when_the_file_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let (link, sink) = start(dir.path());
        link.take_checkpoint_token().unwrap();
        assert!(
            link.token.try_recv().is_err(),
            "a second token before any checkpoint was sent"
        );
        for step in [1, 2] {
            link.send(Event::Checkpoint(Box::new(snapshot(step))))
                .unwrap();
            link.take_checkpoint_token().unwrap();
            let on_disk = checkpoint::list(dir.path()).unwrap();
            assert_eq!(on_disk.len(), step as usize, "{on_disk:?}");
            assert!(on_disk
                .last()
                .unwrap()
                .ends_with(checkpoint::file_name(step)));
        }
        drop(link);
        sink.join().unwrap().unwrap();
    }

    /// A sink that stopped (here: it cannot create its metrics file) fails
    /// the wait for the token instead of hanging it.
    #[test]
    fn waiting_on_a_stopped_sink_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        // The metrics file's path is taken by a directory.
        std::fs::create_dir_all(dir.path().join("metrics.jsonl")).unwrap();
        let (link, sink) = start(dir.path());
        link.take_checkpoint_token().unwrap();
        assert!(sink.join().unwrap().is_err());
        let err = link.take_checkpoint_token().unwrap_err().to_string();
        assert!(err.contains("sink"), "{err}");
    }

    /// A sink that was sent steps 1 to 3, and the checkpoint token taken.
    fn three_steps_sent(dir: &Path) -> (SinkLink, std::thread::JoinHandle<Result<SinkOutcome>>) {
        let (link, sink) = start(dir);
        for step in 1..=3 {
            link.send(Event::Step(report(step))).unwrap();
        }
        link.take_checkpoint_token().unwrap();
        (link, sink)
    }

    /// A SIGKILL right after a checkpoint must not cost the steps before it:
    /// their records are on disk by the time the checkpoint is.
    #[test]
    fn the_steps_before_a_checkpoint_are_on_disk_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let (link, sink) = three_steps_sent(dir.path());
        link.send(Event::Checkpoint(Box::new(snapshot(3)))).unwrap();
        // The sink is still running (the channel is open): wait for the
        // checkpoint, then read the metrics as a kill would leave them.
        link.take_checkpoint_token().unwrap();
        assert_eq!(checkpoint::list(dir.path()).unwrap().len(), 1);
        let on_disk = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
        assert_eq!(on_disk.lines().count(), 3, "{on_disk}");
        drop(link);
        sink.join().unwrap().unwrap();
    }

    /// A checkpoint the training side writes itself keeps the same order:
    /// the steps before it are on disk when it is written, and the sink
    /// takes it as its last and hands the token back.
    #[test]
    fn a_checkpoint_written_here_follows_the_steps_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let (link, sink) = three_steps_sent(dir.path());
        let metrics = dir.path().join("metrics.jsonl");
        let written = link
            .write_here(|into| {
                let on_disk = std::fs::read_to_string(&metrics).unwrap();
                assert_eq!(on_disk.lines().count(), 3, "{on_disk}");
                checkpoint::write(into, &snapshot(3), 2)
            })
            .unwrap();
        link.take_checkpoint_token().unwrap();
        drop(link);
        let outcome = sink.join().unwrap().unwrap();
        assert_eq!(outcome.last_checkpoint, Some(written));
    }

    #[test]
    fn elapsed_and_eta_are_clock_times_for_the_whole_run() {
        assert_eq!(hms(0.0), "00:00:00");
        assert_eq!(hms(3725.4), "01:02:05");
        assert_eq!(eta_seconds(10.0, 0, 5), None);
        assert_eq!(eta_seconds(10.0, 5, 15), Some(30.0));
        // 2 epochs of 100 batches; this process starts at epoch 1, batch 0
        // (a resumed run): the rate counts only its own steps.
        let mut clock = Clock::new();
        let mut at = report(1);
        at.epoch = 1;
        let text = clock.text(&at, 2);
        assert!(text.starts_with("elapsed 00:00:0"), "{text}");
        assert!(text.contains(", eta "), "{text}");
        assert_eq!(clock.done_before, Some(100));
    }

    #[test]
    fn resume_cuts_metrics_back_to_the_checkpoint_and_drops_torn_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let epoch_line = "{\"kind\":\"epoch\",\"data\":{\"epoch\":0}}\n";
        let mut text =
            step(0, 0) + &step(0, 1) + epoch_line + &step(1, 0) + &step(1, 1) + &step(1, 2);
        text.push_str("{\"kind\":\"step\",\"da");
        std::fs::write(&path, text).unwrap();
        let at = MetricsPosition {
            epoch: 1,
            batches_done: 2,
        };
        truncate_metrics(dir.path(), Some(at)).unwrap();
        let kept = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            kept,
            step(0, 0) + &step(0, 1) + epoch_line + &step(1, 0) + &step(1, 1)
        );
        truncate_metrics(dir.path(), None).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "");
    }
}
