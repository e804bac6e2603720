//! A fine-tuning run in its directory OUT, as the main trainer keeps one
//! (docs/resume.md): `run.json` (the settings the run goes on with, the
//! model's and the data file's fingerprints, each accepted resume and what
//! it changed; written atomically), `metrics.jsonl` (one line per optimizer
//! step, appended and flushed, synced before each checkpoint), the last
//! `keep_checkpoints` checkpoints (`checkpoint`), and at the end the
//! adapters at OUT's top level (`PeftModel.from_pretrained(base, OUT)`).
//!
//! A checkpoint is written every `save_steps` steps (at each epoch's end
//! when None), at the end, and when `stop` is raised (after the step under
//! way). [`resume`] continues from the newest checkpoint that loads (a
//! corrupt newer one is set aside as `checkpoint-stepN.corrupt` and named),
//! with the recorded settings; only [`OVERRIDABLE`] may change, and a model
//! or data file that is not the run's is refused, naming which. The order
//! and the dropout masks are functions of (seed, epoch, step), so a resumed
//! run is bit-identical to one never stopped. Memory: what `Trainer` holds,
//! plus one checkpoint's serialised adapters and moments while it is written.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use serde_json::{json, Value};

use super::checkpoint::{self, Meta};
use super::{FinetuneOptions, LrSchedule, StepLog, Trainer};
use crate::data::{DataOptions, Rows};
use crate::error::{LlmError, Result};
use crate::model::Model;
use crate::peft;

pub const RUN_RECORD: &str = "run.json";
pub const METRICS: &str = "metrics.jsonl";

/// The settings that may change on resume; any other is refused.
pub const OVERRIDABLE: &[&str] = &[
    "model",
    "data",
    "epochs",
    "lr",
    "max_steps",
    "save_steps",
    "keep_checkpoints",
];

/// Everything a run is started with.
#[derive(Clone, Debug)]
pub struct RunSettings {
    pub model: PathBuf,
    pub data: PathBuf,
    pub data_options: DataOptions,
    pub options: FinetuneOptions,
    /// Checkpoint every this many optimizer steps (None: at each epoch's
    /// end). A checkpoint is also written at the end and on a stop.
    pub save_steps: Option<usize>,
    /// Checkpoints kept (the newest), at least 1.
    pub keep_checkpoints: usize,
}

/// An f32 as the f64 of its shortest decimal form (0.01, not
/// 0.009999999776482582) when that reads back as the same f32, else exactly.
pub(crate) fn exact(v: f32) -> f64 {
    match v.to_string().parse::<f64>() {
        Ok(s) if s as f32 == v => s,
        _ => f64::from(v),
    }
}

pub(crate) fn path_text(path: &Path) -> Result<String> {
    path.to_str().map(String::from).ok_or_else(|| {
        LlmError::Input(format!(
            "{}: run.json records paths as UTF-8, and this one is not",
            path.display()
        ))
    })
}

impl RunSettings {
    /// The settings as run.json's flat `settings` object.
    pub fn to_json(&self) -> Result<Value> {
        let o = &self.options;
        Ok(json!({
            "model": path_text(&self.model)?,
            "data": path_text(&self.data)?,
            "max_seq_length": self.data_options.max_seq_length,
            "packing": self.data_options.packing,
            "r": o.r,
            "alpha": exact(o.alpha),
            "dropout": exact(o.dropout),
            "target_modules": o.target_modules,
            "epochs": o.epochs,
            "lr": exact(o.lr),
            "batch_size": o.batch_size,
            "accumulate": o.accumulate,
            "warmup_steps": match o.schedule {
                LrSchedule::Constant => None,
                LrSchedule::WarmupCosine { warmup_steps } => Some(warmup_steps),
            },
            "weight_decay": exact(o.weight_decay),
            "max_steps": o.max_steps,
            "seed": o.seed,
            "save_steps": self.save_steps,
            "keep_checkpoints": self.keep_checkpoints,
        }))
    }

    /// Reads `settings` back (`path`: the file, for messages).
    pub fn from_json(path: &Path, settings: &Value) -> Result<Self> {
        let err = |key: &str, expected: &'static str| LlmError::ConfigKey {
            path: path.to_path_buf(),
            key: format!("settings.{key}"),
            problem: "missing or of the wrong type",
            expected,
        };
        let get = |key: &str| settings.get(key).unwrap_or(&Value::Null);
        let count = |key: &str| -> Result<usize> {
            get(key)
                .as_u64()
                .and_then(|v| usize::try_from(v).ok())
                .ok_or_else(|| err(key, "a count"))
        };
        let optional = |key: &str| -> Result<Option<usize>> {
            match get(key) {
                Value::Null => Ok(None),
                v => v
                    .as_u64()
                    .and_then(|v| usize::try_from(v).ok())
                    .map(Some)
                    .ok_or_else(|| err(key, "a count or null")),
            }
        };
        let real = |key: &str| -> Result<f32> {
            get(key)
                .as_f64()
                .map(|v| v as f32)
                .ok_or_else(|| err(key, "a number"))
        };
        let text = |key: &str| -> Result<String> {
            get(key)
                .as_str()
                .map(String::from)
                .ok_or_else(|| err(key, "a string"))
        };
        let target_modules = get("target_modules")
            .as_array()
            .and_then(|a| {
                a.iter()
                    .map(|v| v.as_str().map(String::from))
                    .collect::<Option<Vec<_>>>()
            })
            .ok_or_else(|| err("target_modules", "a list of strings"))?;
        Ok(Self {
            model: PathBuf::from(text("model")?),
            data: PathBuf::from(text("data")?),
            data_options: DataOptions {
                max_seq_length: count("max_seq_length")?,
                packing: get("packing")
                    .as_bool()
                    .ok_or_else(|| err("packing", "true or false"))?,
            },
            options: FinetuneOptions {
                r: count("r")?,
                alpha: real("alpha")?,
                dropout: real("dropout")?,
                target_modules,
                epochs: count("epochs")?,
                lr: real("lr")?,
                batch_size: count("batch_size")?,
                accumulate: count("accumulate")?,
                schedule: match optional("warmup_steps")? {
                    None => LrSchedule::Constant,
                    Some(warmup_steps) => LrSchedule::WarmupCosine { warmup_steps },
                },
                weight_decay: real("weight_decay")?,
                max_steps: optional("max_steps")?,
                seed: get("seed").as_u64().ok_or_else(|| err("seed", "a count"))?,
            },
            save_steps: optional("save_steps")?,
            keep_checkpoints: count("keep_checkpoints")?,
        })
    }

    fn check(&self) -> Result<()> {
        if self.keep_checkpoints == 0 || self.save_steps == Some(0) {
            return Err(LlmError::Input(
                "keep_checkpoints and save_steps must be at least 1".into(),
            ));
        }
        Ok(())
    }
}

/// run.json read back.
#[derive(Clone, Debug)]
pub struct RunRecord {
    pub settings: RunSettings,
    /// The model's and the data file's fingerprints when the run started.
    pub model: Value,
    pub data: Value,
    /// Each accepted resume: the step it went on from, what it changed.
    pub resumes: Vec<Value>,
}

impl RunRecord {
    /// Reads `out/run.json`; a directory without one is no run.
    pub fn read(out: &Path) -> Result<Self> {
        let path = out.join(RUN_RECORD);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(LlmError::Run {
                    dir: out.to_path_buf(),
                    what: format!(
                        "not a fine-tuning run directory (no {RUN_RECORD} in it); start one with \
                         --model, --data and --output"
                    ),
                })
            }
            Err(source) => return Err(LlmError::Io { path, source }),
        };
        let value: Value = serde_json::from_str(&text).map_err(|source| LlmError::Json {
            path: path.clone(),
            source,
        })?;
        let settings =
            RunSettings::from_json(&path, value.get("settings").unwrap_or(&Value::Null))?;
        Ok(Self {
            settings,
            model: value.get("model").cloned().unwrap_or(Value::Null),
            data: value.get("data").cloned().unwrap_or(Value::Null),
            resumes: value
                .get("resumes")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default(),
        })
    }

    fn write(&self, out: &Path) -> Result<()> {
        let path = out.join(RUN_RECORD);
        let value = json!({
            "format": 1,
            "settings": self.settings.to_json()?,
            "model": self.model,
            "data": self.data,
            "resumes": self.resumes,
        });
        checkpoint::write_json_atomic(&path, &value)
    }
}

/// What a run reports as it goes.
#[derive(Debug)]
pub enum Event<'a> {
    /// An optimizer step, with its rate and the run's elapsed seconds.
    Step {
        log: &'a StepLog,
        tokens_per_s: f64,
        elapsed_s: f64,
    },
    Checkpoint(&'a Path),
    /// An old checkpoint removed (past `keep_checkpoints`).
    Pruned(&'a Path),
    /// A temporary a killed write left, removed.
    RemovedTemporary(&'a Path),
    /// A newer checkpoint that does not load, and where it was set aside.
    Skipped {
        error: &'a LlmError,
        set_aside: &'a Path,
    },
    Resumed {
        from: &'a Path,
        step: usize,
        epoch: usize,
        position: usize,
    },
    /// A setting the resume changed: key, recorded value, new value.
    Changed {
        key: &'a str,
        was: &'a Value,
        now: &'a Value,
    },
}

/// How a run ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Every step done; the adapters are at OUT's top level.
    Finished { step: usize, checkpoint: PathBuf },
    /// Stopped by `stop` after `step`; `checkpoint` continues it.
    Stopped {
        step: usize,
        epoch: usize,
        checkpoint: PathBuf,
    },
}
/// Sets aside each checkpoint `skipped` names as `NAME.corrupt` (or
/// `.corrupt-N`, a name not taken: an earlier fallback may have used one),
/// reporting each: what a resume does with those that do not load.
pub(crate) fn set_aside_skipped(
    out: &Path,
    skipped: &[LlmError],
    on_event: &mut impl FnMut(Event),
) -> Result<()> {
    for error in skipped {
        if let LlmError::Checkpoint { path, .. } = error {
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let aside = (1..)
                .map(|n| match n {
                    1 => out.join(format!("{name}.corrupt")),
                    n => out.join(format!("{name}.corrupt-{n}")),
                })
                .find(|p| !p.exists())
                .unwrap_or_else(|| out.join(format!("{name}.corrupt")));
            std::fs::rename(path, &aside).map_err(io(path))?;
            on_event(Event::Skipped {
                error,
                set_aside: &aside,
            });
        }
    }
    Ok(())
}

/// The settings a resume changes (`now` against `was`), each reported:
/// `{key: {was, now}}` for the run record.
pub(crate) fn report_changes(
    was: &Value,
    now: &Value,
    on_event: &mut impl FnMut(Event),
) -> serde_json::Map<String, Value> {
    let mut changed = serde_json::Map::new();
    for (key, value) in now.as_object().into_iter().flatten() {
        let before = was.get(key).unwrap_or(&Value::Null);
        if before != value {
            on_event(Event::Changed {
                key,
                was: before,
                now: value,
            });
            changed.insert(key.clone(), json!({"was": before, "now": value}));
        }
    }
    changed
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> LlmError + '_ {
    move |source| LlmError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// metrics.jsonl, appended a whole line at a time.
pub(crate) struct Metrics {
    path: PathBuf,
    file: std::fs::File,
}

impl Metrics {
    pub(crate) fn open(out: &Path) -> Result<Self> {
        let path = out.join(METRICS);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(io(&path))?;
        Ok(Self { path, file })
    }

    pub(crate) fn append(&mut self, line: &Value) -> Result<()> {
        let text = format!("{line}\n");
        self.file
            .write_all(text.as_bytes())
            .and_then(|()| self.file.flush())
            .map_err(io(&self.path))
    }

    pub(crate) fn sync(&self) -> Result<()> {
        self.file.sync_data().map_err(io(&self.path))
    }
}

/// Cuts metrics.jsonl back to the lines of steps up to `step` (a torn last
/// line and the steps logged after the checkpoint go), atomically.
pub(crate) fn cut_metrics(out: &Path, step: usize) -> Result<()> {
    let path = out.join(METRICS);
    let text = match std::fs::read(&path) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(source) => return Err(LlmError::Io { path, source }),
    };
    let mut kept = String::new();
    for line in text.split_inclusive('\n') {
        if !line.ends_with('\n') {
            break; // torn
        }
        let Ok(value) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if value
            .get("step")
            .and_then(Value::as_u64)
            .is_some_and(|s| s as usize <= step)
        {
            kept.push_str(line);
        }
    }
    if kept != text {
        checkpoint::write_atomic(&path, kept.as_bytes())?;
    }
    Ok(())
}

/// Starts a run in `out` (made if missing; one holding a run is refused).
pub fn start(
    out: &Path,
    settings: &RunSettings,
    model: &Model,
    data: &dyn Rows,
    stop: Option<&AtomicBool>,
    mut on_event: impl FnMut(Event),
) -> Result<Outcome> {
    settings.check()?;
    if out.join(RUN_RECORD).exists() || !checkpoint::list(out)?.is_empty() {
        return Err(LlmError::Run {
            dir: out.to_path_buf(),
            what: "holds a fine-tuning run already: continue it with --resume, or give another \
                   --output"
                .into(),
        });
    }
    // Checked before anything is written.
    let mut trainer = Trainer::new(model, data, &settings.options)?;
    std::fs::create_dir_all(out).map_err(io(out))?;
    for removed in checkpoint::remove_temporaries(out)? {
        on_event(Event::RemovedTemporary(&removed));
    }
    let record = RunRecord {
        settings: settings.clone(),
        model: checkpoint::model_fingerprint(&model.dir)?,
        data: checkpoint::data_fingerprint(&settings.data)?,
        resumes: Vec::new(),
    };
    let metrics_path = out.join(METRICS);
    if metrics_path.exists() {
        std::fs::remove_file(&metrics_path).map_err(io(&metrics_path))?;
    }
    record.write(out)?;
    drive(out, &record, &mut trainer, 0.0, stop, &mut on_event)
}

/// Continues the run in `out` from its newest checkpoint that loads, with
/// `settings`: run.json's, with the [`OVERRIDABLE`] keys changed as asked
/// (each change is recorded in run.json and reported).
pub fn resume(
    out: &Path,
    settings: &RunSettings,
    model: &Model,
    data: &dyn Rows,
    stop: Option<&AtomicBool>,
    mut on_event: impl FnMut(Event),
) -> Result<Outcome> {
    settings.check()?;
    let refuse = |what: String| LlmError::Run {
        dir: out.to_path_buf(),
        what,
    };
    let mut record = RunRecord::read(out)?;
    let (was, now) = (record.settings.to_json()?, settings.to_json()?);
    let fixed = |was: &Value, source: &str| -> Result<()> {
        for (key, value) in now.as_object().into_iter().flatten() {
            let before = was.get(key).unwrap_or(&Value::Null);
            if before != value && !OVERRIDABLE.contains(&key.as_str()) {
                return Err(refuse(format!(
                    "`{key}` is {before} in {source} and {value} now: it shapes the result and \
                     cannot change on resume (these can: {}); start a new run in another \
                     directory instead",
                    OVERRIDABLE.join(", ")
                )));
            }
        }
        Ok(())
    };
    fixed(&was, RUN_RECORD)?;
    let model_now = checkpoint::model_fingerprint(&model.dir)?;
    if let Some(what) = checkpoint::model_difference(&record.model, &model_now) {
        return Err(refuse(format!(
            "the model {} is not the one the run started with ({what}); resume with the run's model",
            model.dir.display()
        )));
    }
    let data_now = checkpoint::data_fingerprint(&settings.data)?;
    if data_now != record.data {
        return Err(refuse(format!(
            "the data file {} is not the one the run started with (size and hash {} {}, now {} {}); \
             resume with the run's data",
            settings.data.display(),
            record.data["size"],
            record.data["fnv64"],
            data_now["size"],
            data_now["fnv64"]
        )));
    }
    for removed in checkpoint::remove_temporaries(out)? {
        on_event(Event::RemovedTemporary(&removed));
    }
    let (found, skipped) = checkpoint::newest_valid(out, model)?;
    let Some(saved) = found else {
        let why = skipped
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ");
        return Err(refuse(if skipped.is_empty() {
            "no checkpoint to resume from (checkpoint-step*/ is written every --save-steps \
             steps, at each epoch's end and on a stop)"
                .into()
        } else {
            format!("no checkpoint loads: {why}")
        }));
    };
    fixed(
        &saved.meta.settings,
        &saved
            .path
            .join(checkpoint::STATE_FILE)
            .display()
            .to_string(),
    )?;
    if saved.meta.model != record.model || saved.meta.data != record.data {
        return Err(refuse(format!(
            "{} records another model or data file than {RUN_RECORD}",
            saved.path.display()
        )));
    }
    set_aside_skipped(out, &skipped, &mut on_event)?;
    let state = saved.state;
    on_event(Event::Resumed {
        from: &saved.path,
        step: state.step,
        epoch: state.epoch,
        position: state.position,
    });
    let changed = report_changes(&was, &now, &mut on_event);
    let mut trainer = Trainer::with_state(model, data, &settings.options, state)?;
    cut_metrics(out, trainer.state().step)?;
    record.settings = settings.clone();
    record.resumes.push(json!({
        "from_step": trainer.state().step,
        "checkpoint": saved.path.file_name().map(|n| n.to_string_lossy().into_owned()),
        "changed": changed,
    }));
    record.write(out)?;
    drive(
        out,
        &record,
        &mut trainer,
        saved.meta.elapsed_s,
        stop,
        &mut on_event,
    )
}

/// The loop: steps, metrics, checkpoints, the stop, the final adapters.
fn drive(
    out: &Path,
    record: &RunRecord,
    trainer: &mut Trainer,
    elapsed_before: f64,
    stop: Option<&AtomicBool>,
    on_event: &mut impl FnMut(Event),
) -> Result<Outcome> {
    let settings = &record.settings;
    let meta = |elapsed_s: f64| -> Result<Meta> {
        Ok(Meta {
            elapsed_s,
            settings: settings.to_json()?,
            model: record.model.clone(),
            data: record.data.clone(),
        })
    };
    let config = trainer.lora_config();
    let mut metrics = Metrics::open(out)?;
    let started = Instant::now();
    let mut saved_at: Option<(usize, PathBuf)> = None;
    let save = |trainer: &Trainer,
                metrics: &Metrics,
                elapsed: f64,
                on_event: &mut dyn FnMut(Event)|
     -> Result<PathBuf> {
        // Every record up to the checkpoint is on disk before it.
        metrics.sync()?;
        let path = checkpoint::write(
            out,
            trainer.model,
            trainer.state(),
            &config,
            &meta(elapsed)?,
        )?;
        on_event(Event::Checkpoint(&path));
        for pruned in checkpoint::prune(out, settings.keep_checkpoints)? {
            on_event(Event::Pruned(&pruned));
        }
        Ok(path)
    };
    while !trainer.done() {
        let t0 = Instant::now();
        let log = trainer.step()?;
        let seconds = t0.elapsed().as_secs_f64();
        let elapsed = elapsed_before + started.elapsed().as_secs_f64();
        let tokens_per_s = log.tokens as f64 / seconds.max(1e-9);
        metrics.append(&json!({
            "step": log.step,
            "epoch": log.epoch + 1,
            "loss": exact(log.loss),
            "lr": exact(log.lr),
            "tokens": log.tokens,
            "examples": log.examples,
            "tokens_per_s": tokens_per_s,
            "elapsed_s": elapsed,
        }))?;
        on_event(Event::Step {
            log: &log,
            tokens_per_s,
            elapsed_s: elapsed,
        });
        let due = settings
            .save_steps
            .map_or(log.epoch_end, |n| log.step % n == 0);
        let stopping = stop.is_some_and(|s| s.load(Ordering::SeqCst));
        if due || stopping || trainer.done() {
            saved_at = Some((log.step, save(trainer, &metrics, elapsed, on_event)?));
        }
        if stopping && !trainer.done() {
            let Some((_, checkpoint)) = saved_at else {
                unreachable!("a checkpoint was written above")
            };
            return Ok(Outcome::Stopped {
                step: log.step,
                epoch: trainer.state().epoch,
                checkpoint,
            });
        }
    }
    let step = trainer.state().step;
    let checkpoint = match saved_at {
        Some((at, path)) if at == step => path,
        // Nothing was left to train (a resume of a finished run): the
        // newest checkpoint is this step's.
        _ => out.join(checkpoint::dir_name(step)),
    };
    if !checkpoint.is_dir() {
        let elapsed = elapsed_before + started.elapsed().as_secs_f64();
        save(trainer, &metrics, elapsed, on_event)?;
    }
    peft::save_adapters(out, trainer.model, &trainer.state().adapters, &config)?;
    Ok(Outcome::Finished { step, checkpoint })
}
