//! A full fine-tune in a run directory OUT, as the LoRA run keeps one
//! (`run`): `run.json` (the settings, the model's and the data file's
//! fingerprints, each resume), `metrics.jsonl` (a line per step, with the
//! gradient's norm), the newest `keep_checkpoints` checkpoints, and at the
//! end the trained model as a Hugging Face directory `OUT/model/`
//! (`merge::write_model_dir`: the base's files, layout and dtypes).
//!
//! The pieces are the LoRA run's: run.json's reading and writing pattern,
//! `Metrics` and `cut_metrics` (`run`), the checkpoint directories' names,
//! listing, pruning, temporaries, fingerprints and atomic writes
//! (`checkpoint`); what differs is what a checkpoint holds. Here that is
//! `model.safetensors` (every weight in f32 by its checkpoint name, as
//! `Model::weight` reads it), `optimizer.safetensors` (AdamW's `exp_avg`
//! and `exp_avg_sq` per weight) and `trainer_state.json` (`kind` "full",
//! step, epoch, position, elapsed seconds, the settings, both
//! fingerprints, each file's size and FNV-1a hash). There is no other
//! randomness to save: the order is a function of (seed, epoch) and there
//! is no dropout. Resume loads the newest checkpoint whose files match
//! their hashes (a newer one that does not is set aside as `.corrupt`),
//! puts the weights into the base model and continues bit for bit.
//!
//! Memory: the safetensors files are written a tensor at a time (one f32
//! copy of one tensor, besides the trainer's), and read back whole, one
//! file at a time, on resume.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use safetensors::tensor::Dtype;
use safetensors::SafeTensors;
use serde_json::{json, Value};

use super::checkpoint::{self, hash_file, sync_dir, Fnv};
use super::full::{FullOptions, FullState, FullTrainer, Moments};
use super::run::{
    cut_metrics, exact, path_text, report_changes, set_aside_skipped, Event, Metrics, METRICS,
    RUN_RECORD,
};
use super::LrSchedule;
use crate::data::{DataOptions, Rows};
use crate::error::{LlmError, Result};
use crate::model::Model;

pub const WEIGHTS_FILE: &str = "model.safetensors";
pub const MOMENTS_FILE: &str = "optimizer.safetensors";
/// The trained model's directory inside OUT.
pub const MODEL_DIR: &str = "model";
const KIND: &str = "full";

/// The settings that may change on resume; any other is refused.
pub const OVERRIDABLE: &[&str] = &[
    "model",
    "data",
    "epochs",
    "lr",
    "max_steps",
    "save_steps",
    "keep_checkpoints",
    "max_grad_norm",
];

/// Everything a full run is started with.
#[derive(Clone, Debug)]
pub struct FullRunSettings {
    pub model: PathBuf,
    pub data: PathBuf,
    pub data_options: DataOptions,
    pub options: FullOptions,
    /// Clip each step's gradient to this global L2 norm (None: no clipping).
    pub max_grad_norm: Option<f32>,
    /// Checkpoint every this many steps (None: at each epoch's end); also
    /// at the end and on a stop.
    pub save_steps: Option<usize>,
    pub keep_checkpoints: usize,
}

impl FullRunSettings {
    pub fn to_json(&self) -> Result<Value> {
        let o = &self.options;
        Ok(json!({
            "model": path_text(&self.model)?,
            "data": path_text(&self.data)?,
            "max_seq_length": self.data_options.max_seq_length,
            "packing": self.data_options.packing,
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
            "max_grad_norm": self.max_grad_norm.map(exact),
            "save_steps": self.save_steps,
            "keep_checkpoints": self.keep_checkpoints,
        }))
    }

    pub fn from_json(path: &Path, s: &Value) -> Result<Self> {
        let err = |key: &str, expected: &'static str| LlmError::ConfigKey {
            path: path.to_path_buf(),
            key: format!("settings.{key}"),
            problem: "missing or of the wrong type",
            expected,
        };
        let get = |key: &str| s.get(key).unwrap_or(&Value::Null);
        let count = |key: &str| {
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
        let real = |key: &str| {
            get(key)
                .as_f64()
                .map(|v| v as f32)
                .ok_or_else(|| err(key, "a number"))
        };
        let text = |key: &str| {
            get(key)
                .as_str()
                .map(PathBuf::from)
                .ok_or_else(|| err(key, "a string"))
        };
        Ok(Self {
            model: text("model")?,
            data: text("data")?,
            data_options: DataOptions {
                max_seq_length: count("max_seq_length")?,
                packing: get("packing")
                    .as_bool()
                    .ok_or_else(|| err("packing", "true or false"))?,
            },
            options: FullOptions {
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
            max_grad_norm: match get("max_grad_norm") {
                Value::Null => None,
                v => Some(
                    v.as_f64()
                        .ok_or_else(|| err("max_grad_norm", "a number or null"))?
                        as f32,
                ),
            },
            save_steps: optional("save_steps")?,
            keep_checkpoints: count("keep_checkpoints")?,
        })
    }
}

/// A full run's run.json read back.
#[derive(Clone, Debug)]
pub struct FullRunRecord {
    pub settings: FullRunSettings,
    pub model: Value,
    pub data: Value,
    pub resumes: Vec<Value>,
}

fn run_error(out: &Path, what: String) -> LlmError {
    LlmError::Run {
        dir: out.to_path_buf(),
        what,
    }
}

impl FullRunRecord {
    /// Reads `out/run.json`, which must be a full fine-tune's.
    pub fn read(out: &Path) -> Result<Self> {
        let path = out.join(RUN_RECORD);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(run_error(
                    out,
                    format!(
                        "not a fine-tuning run directory (no {RUN_RECORD} in it); start one \
                         with --model, --data and --output"
                    ),
                ))
            }
            Err(source) => return Err(LlmError::Io { path, source }),
        };
        let value: Value = serde_json::from_str(&text).map_err(|source| LlmError::Json {
            path: path.clone(),
            source,
        })?;
        if value.get("kind").and_then(Value::as_str) != Some(KIND) {
            return Err(run_error(
                out,
                "is a LoRA run (its run.json has no `kind` \"full\"): continue it with \
                 lora-llm --resume"
                    .into(),
            ));
        }
        Ok(Self {
            settings: FullRunSettings::from_json(
                &path,
                value.get("settings").unwrap_or(&Value::Null),
            )?,
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
            "kind": KIND,
            "settings": self.settings.to_json()?,
            "model": self.model,
            "data": self.data,
            "resumes": self.resumes,
        });
        checkpoint::write_json_atomic(&path, &value)
    }
}

/// How a full run ended.
#[derive(Debug)]
pub enum FullOutcome {
    /// Every step done; the model is at `model_dir` (OUT/model).
    Finished {
        step: usize,
        checkpoint: PathBuf,
        model_dir: PathBuf,
        report: Box<crate::merge::ModelDirReport>,
    },
    Stopped {
        step: usize,
        epoch: usize,
        checkpoint: PathBuf,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> LlmError + '_ {
    move |source| LlmError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes f32 tensors as a safetensors file, one tensor in memory at a
/// time: the header (names, shapes, offsets) first, then each tensor's
/// bytes as `values(name)` gives them. Synced; returns size and hash.
fn write_f32_tensors(
    path: &Path,
    tensors: &[(String, Vec<usize>)],
    mut values: impl FnMut(&str) -> Result<Vec<f32>>,
) -> Result<(u64, String)> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, shape) in tensors {
        let bytes = 4 * shape.iter().product::<usize>();
        header.insert(
            name.clone(),
            json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let mut head = Value::Object(header).to_string().into_bytes();
    while !head.len().is_multiple_of(8) {
        head.push(b' ');
    }
    let file = std::fs::File::create(path).map_err(io(path))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    let mut fnv = Fnv::default();
    let mut size = 0u64;
    let mut put = |w: &mut std::io::BufWriter<std::fs::File>, bytes: &[u8]| -> Result<()> {
        fnv.update(bytes);
        size += bytes.len() as u64;
        w.write_all(bytes).map_err(io(path))
    };
    put(&mut w, &(head.len() as u64).to_le_bytes())?;
    put(&mut w, &head)?;
    for (name, shape) in tensors {
        let data = values(name)?;
        if data.len() != shape.iter().product::<usize>() {
            return Err(LlmError::Input(format!(
                "{}: tensor `{name}` has {} values for shape {shape:?}",
                path.display(),
                data.len()
            )));
        }
        if let Some((at, v)) = data.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(LlmError::Checkpoint {
                path: path.to_path_buf(),
                what: format!("not written: `{name}` value {at} is {v}, not finite"),
            });
        }
        let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        put(&mut w, &bytes)?;
    }
    let file = w.into_inner().map_err(|e| io(path)(e.into_error()))?;
    file.sync_all().map_err(io(path))?;
    Ok((size, fnv.hex()))
}

/// Writes the checkpoint of `trainer`'s step into `out`; returns its path.
fn write_checkpoint(out: &Path, trainer: &FullTrainer, meta: &Value) -> Result<PathBuf> {
    let state_step = trainer.steps_done();
    let name = checkpoint::dir_name(state_step);
    let path = out.join(&name);
    let tmp = out.join(format!(".{name}.tmp"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    let model = trainer.model();
    let names = model.weight_names();
    let weights = write_f32_tensors(&tmp.join(WEIGHTS_FILE), &names, |n| {
        Ok(model.weight(n)?.data)
    })?;
    let moments = trainer.moments();
    let moment_names: Vec<(String, Vec<usize>)> = names
        .iter()
        .flat_map(|(n, shape)| {
            [
                (format!("{n}.exp_avg"), shape.clone()),
                (format!("{n}.exp_avg_sq"), shape.clone()),
            ]
        })
        .collect();
    let optimizer = write_f32_tensors(&tmp.join(MOMENTS_FILE), &moment_names, |n| {
        let (weight, which) = n
            .rsplit_once('.')
            .ok_or_else(|| LlmError::Input(format!("moment `{n}` has no weight")))?;
        let m = moments
            .get(weight)
            .ok_or_else(|| LlmError::Input(format!("no moments for `{weight}`")))?;
        Ok(if which == "exp_avg" {
            m.m.clone()
        } else {
            m.v.clone()
        })
    })?;
    let record = json!({
        "format": checkpoint::FORMAT,
        "kind": KIND,
        "step": state_step,
        "epoch": trainer.epoch(),
        "position": trainer.position(),
        "elapsed_s": meta["elapsed_s"],
        "settings": meta["settings"],
        "model": meta["model"],
        "data": meta["data"],
        "files": {
            WEIGHTS_FILE: {"size": weights.0, "fnv64": weights.1},
            MOMENTS_FILE: {"size": optimizer.0, "fnv64": optimizer.1},
        },
    });
    let state_path = tmp.join(checkpoint::STATE_FILE);
    let text = serde_json::to_string_pretty(&record).map_err(|source| LlmError::Json {
        path: state_path.clone(),
        source,
    })?;
    checkpoint::write_atomic(&state_path, text.as_bytes())?;
    sync_dir(&tmp)?;
    if path.exists() {
        let old = out.join(format!(".{name}.old"));
        if old.exists() {
            std::fs::remove_dir_all(&old).map_err(io(&old))?;
        }
        std::fs::rename(&path, &old).map_err(io(&path))?;
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
        std::fs::remove_dir_all(&old).map_err(io(&old))?;
    } else {
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
    }
    sync_dir(out)?;
    Ok(path)
}

/// A full checkpoint read back: the weights (by name), the trainer's state
/// and its record.
pub struct FullSaved {
    pub path: PathBuf,
    pub weights: Vec<(String, Vec<f32>)>,
    pub state: FullState,
    pub record: Value,
}

/// Reads the checkpoint in `path` for `model`'s weights, checking every
/// file against the size and hash its state file records first.
pub fn load_checkpoint(path: &Path, model: &Model) -> Result<FullSaved> {
    let bad = |what: String| LlmError::Checkpoint {
        path: path.to_path_buf(),
        what,
    };
    let state_file = checkpoint::STATE_FILE;
    let text = std::fs::read_to_string(path.join(state_file))
        .map_err(|e| bad(format!("{state_file} does not read: {e}")))?;
    let record: Value = serde_json::from_str(&text)
        .map_err(|e| bad(format!("{state_file} is not valid JSON (truncated?): {e}")))?;
    if record.get("kind").and_then(Value::as_str) != Some(KIND)
        || record.get("format").and_then(Value::as_u64) != Some(checkpoint::FORMAT)
    {
        return Err(bad(format!(
            "{state_file}: not a full fine-tune's checkpoint of format {}",
            checkpoint::FORMAT
        )));
    }
    let count = |key: &str| {
        record
            .get(key)
            .and_then(Value::as_u64)
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| {
                bad(format!(
                    "{state_file}: key `{key}` is missing or not a count"
                ))
            })
    };
    let (step, epoch, position) = (count("step")?, count("epoch")?, count("position")?);
    for file in [WEIGHTS_FILE, MOMENTS_FILE] {
        let want = record
            .get("files")
            .and_then(|f| f.get(file))
            .ok_or_else(|| bad(format!("{state_file}: no record of {file}")))?;
        let (size, hash) =
            hash_file(&path.join(file)).map_err(|e| bad(format!("{file} does not read: {e}")))?;
        if want.get("size").and_then(Value::as_u64) != Some(size)
            || want.get("fnv64").and_then(Value::as_str) != Some(hash.as_str())
        {
            return Err(bad(format!(
                "{file} is {size} bytes with hash {hash}, not the {} bytes with hash {} recorded: \
                 truncated or corrupt",
                want.get("size").unwrap_or(&Value::Null),
                want.get("fnv64").and_then(Value::as_str).unwrap_or("?")
            )));
        }
    }
    let read_all = |file: &str, names: &mut dyn Iterator<Item = (String, usize)>| {
        let bytes = std::fs::read(path.join(file)).map_err(|e| bad(format!("{file}: {e}")))?;
        let tensors = SafeTensors::deserialize(&bytes)
            .map_err(|e| bad(format!("{file} does not parse: {e}")))?;
        names
            .map(|(name, len)| {
                let t = tensors
                    .tensor(&name)
                    .map_err(|_| bad(format!("{file}: tensor `{name}` is missing")))?;
                if t.dtype() != Dtype::F32 || t.data().len() != 4 * len {
                    return Err(bad(format!(
                        "{file}: tensor `{name}` is {:?} of {} bytes, expected F32 of {len} values",
                        t.dtype(),
                        t.data().len()
                    )));
                }
                let values: Vec<f32> = t
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                if let Some((at, v)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                    return Err(bad(format!("{file}: tensor `{name}` value {at} is {v}")));
                }
                Ok((name, values))
            })
            .collect::<Result<Vec<_>>>()
    };
    let names: Vec<(String, usize)> = model
        .weight_names()
        .into_iter()
        .map(|(n, shape)| (n, shape.iter().product()))
        .collect();
    let weights = read_all(WEIGHTS_FILE, &mut names.iter().cloned())?;
    let mut moment_names = names.iter().flat_map(|(n, len)| {
        [
            (format!("{n}.exp_avg"), *len),
            (format!("{n}.exp_avg_sq"), *len),
        ]
    });
    let mut moment_values = read_all(MOMENTS_FILE, &mut moment_names)?.into_iter();
    let mut moments = std::collections::BTreeMap::new();
    for (name, _) in &names {
        let (Some((_, m)), Some((_, v))) = (moment_values.next(), moment_values.next()) else {
            return Err(bad(format!(
                "{MOMENTS_FILE}: moments of `{name}` are missing"
            )));
        };
        moments.insert(name.clone(), Moments { m, v });
    }
    Ok(FullSaved {
        path: path.to_path_buf(),
        weights,
        state: FullState {
            moments,
            step,
            epoch,
            position,
        },
        record,
    })
}

/// Starts a full run in `out` (one holding a run is refused); `model` is
/// the base, trained in place.
pub fn start(
    out: &Path,
    settings: &FullRunSettings,
    model: &mut Model,
    data: &dyn Rows,
    stop: Option<&AtomicBool>,
    mut on_event: impl FnMut(Event),
) -> Result<FullOutcome> {
    check(settings)?;
    if out.join(RUN_RECORD).exists() || !checkpoint::list(out)?.is_empty() {
        return Err(run_error(
            out,
            "holds a fine-tuning run already: continue it with --resume, or give another \
             --output"
                .into(),
        ));
    }
    let record = FullRunRecord {
        settings: settings.clone(),
        model: checkpoint::model_fingerprint(&model.dir)?,
        data: checkpoint::data_fingerprint(&settings.data)?,
        resumes: Vec::new(),
    };
    let base_dir = model.dir.clone();
    let mut trainer = FullTrainer::new(model, data, &settings.options)?;
    trainer.set_max_grad_norm(settings.max_grad_norm)?;
    std::fs::create_dir_all(out).map_err(io(out))?;
    for removed in checkpoint::remove_temporaries(out)? {
        on_event(Event::RemovedTemporary(&removed));
    }
    let metrics_path = out.join(METRICS);
    if metrics_path.exists() {
        std::fs::remove_file(&metrics_path).map_err(io(&metrics_path))?;
    }
    record.write(out)?;
    drive(out, &record, trainer, &base_dir, 0.0, stop, &mut on_event)
}

fn check(settings: &FullRunSettings) -> Result<()> {
    if settings.keep_checkpoints == 0 || settings.save_steps == Some(0) {
        return Err(LlmError::Input(
            "keep_checkpoints and save_steps must be at least 1".into(),
        ));
    }
    Ok(())
}

/// Continues the full run in `out` from its newest checkpoint that loads,
/// with `settings` (run.json's, with [`OVERRIDABLE`] keys changed).
pub fn resume(
    out: &Path,
    settings: &FullRunSettings,
    model: &mut Model,
    data: &dyn Rows,
    stop: Option<&AtomicBool>,
    mut on_event: impl FnMut(Event),
) -> Result<FullOutcome> {
    check(settings)?;
    let mut record = FullRunRecord::read(out)?;
    let (was, now) = (record.settings.to_json()?, settings.to_json()?);
    let fixed = |was: &Value, source: &str| -> Result<()> {
        for (key, value) in now.as_object().into_iter().flatten() {
            let before = was.get(key).unwrap_or(&Value::Null);
            if before != value && !OVERRIDABLE.contains(&key.as_str()) {
                return Err(run_error(
                    out,
                    format!(
                        "`{key}` is {before} in {source} and {value} now: it shapes the result \
                         and cannot change on resume (these can: {}); start a new run in \
                         another directory instead",
                        OVERRIDABLE.join(", ")
                    ),
                ));
            }
        }
        Ok(())
    };
    fixed(&was, RUN_RECORD)?;
    let model_now = checkpoint::model_fingerprint(&model.dir)?;
    if let Some(what) = checkpoint::model_difference(&record.model, &model_now) {
        return Err(run_error(
            out,
            format!(
                "the model {} is not the one the run started with ({what}); resume with the \
                 run's model",
                model.dir.display()
            ),
        ));
    }
    if checkpoint::data_fingerprint(&settings.data)? != record.data {
        return Err(run_error(
            out,
            format!(
                "the data file {} is not the one the run started with; resume with the run's data",
                settings.data.display()
            ),
        ));
    }
    for removed in checkpoint::remove_temporaries(out)? {
        on_event(Event::RemovedTemporary(&removed));
    }
    let mut skipped = Vec::new();
    let mut found = None;
    for (_, path) in checkpoint::list(out)?.into_iter().rev() {
        match load_checkpoint(&path, model) {
            Ok(saved) => {
                found = Some(saved);
                break;
            }
            Err(e) => skipped.push(e),
        }
    }
    let Some(saved) = found else {
        let why: Vec<String> = skipped.iter().map(ToString::to_string).collect();
        return Err(run_error(
            out,
            if why.is_empty() {
                "no checkpoint to resume from".into()
            } else {
                format!("no checkpoint loads: {}", why.join("; "))
            },
        ));
    };
    fixed(
        saved.record.get("settings").unwrap_or(&Value::Null),
        &saved
            .path
            .join(checkpoint::STATE_FILE)
            .display()
            .to_string(),
    )?;
    if saved.record["model"] != record.model || saved.record["data"] != record.data {
        return Err(run_error(
            out,
            format!(
                "{} records another model or data file than {RUN_RECORD}",
                saved.path.display()
            ),
        ));
    }
    set_aside_skipped(out, &skipped, &mut on_event)?;
    for (name, values) in &saved.weights {
        model.set_weight(name, values)?;
    }
    let state = saved.state;
    on_event(Event::Resumed {
        from: &saved.path,
        step: state.step,
        epoch: state.epoch,
        position: state.position,
    });
    let changed = report_changes(&was, &now, &mut on_event);
    let step = state.step;
    let elapsed = saved.record["elapsed_s"].as_f64().unwrap_or(0.0);
    let base_dir = model.dir.clone();
    let mut trainer = FullTrainer::with_state(model, data, &settings.options, state)?;
    trainer.set_max_grad_norm(settings.max_grad_norm)?;
    cut_metrics(out, step)?;
    record.settings = settings.clone();
    record.resumes.push(json!({
        "from_step": step,
        "checkpoint": saved.path.file_name().map(|n| n.to_string_lossy().into_owned()),
        "changed": changed,
    }));
    record.write(out)?;
    drive(
        out,
        &record,
        trainer,
        &base_dir,
        elapsed,
        stop,
        &mut on_event,
    )
}

/// The loop: steps, metrics, checkpoints, the stop, the final model.
fn drive(
    out: &Path,
    record: &FullRunRecord,
    mut trainer: FullTrainer,
    base_dir: &Path,
    elapsed_before: f64,
    stop: Option<&AtomicBool>,
    on_event: &mut impl FnMut(Event),
) -> Result<FullOutcome> {
    let settings = &record.settings;
    let meta = |elapsed_s: f64| -> Result<Value> {
        Ok(json!({
            "elapsed_s": elapsed_s,
            "settings": settings.to_json()?,
            "model": record.model,
            "data": record.data,
        }))
    };
    let mut metrics = Metrics::open(out)?;
    let started = Instant::now();
    let mut saved_at: Option<(usize, PathBuf)> = None;
    let save = |trainer: &FullTrainer,
                metrics: &Metrics,
                elapsed: f64,
                on_event: &mut dyn FnMut(Event)|
     -> Result<PathBuf> {
        metrics.sync()?;
        let path = write_checkpoint(out, trainer, &meta(elapsed)?)?;
        on_event(Event::Checkpoint(&path));
        for pruned in checkpoint::prune(out, settings.keep_checkpoints)? {
            on_event(Event::Pruned(&pruned));
        }
        Ok(path)
    };
    while !trainer.done() {
        let t0 = Instant::now();
        let log = trainer.step()?;
        if !log.loss.is_finite() {
            return Err(LlmError::Input(format!(
                "step {}: the loss is {}; stopped without a checkpoint of it (lower the lr)",
                log.step, log.loss
            )));
        }
        let seconds = t0.elapsed().as_secs_f64();
        let elapsed = elapsed_before + started.elapsed().as_secs_f64();
        let tokens_per_s = log.tokens as f64 / seconds.max(1e-9);
        metrics.append(&json!({
            "step": log.step,
            "epoch": log.epoch + 1,
            "loss": exact(log.loss),
            "lr": exact(log.lr),
            "grad_norm": trainer.last_grad_norm().map(exact),
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
            saved_at = Some((log.step, save(&trainer, &metrics, elapsed, on_event)?));
        }
        if stopping && !trainer.done() {
            let Some((_, checkpoint)) = saved_at else {
                unreachable!("a checkpoint was written above")
            };
            return Ok(FullOutcome::Stopped {
                step: log.step,
                epoch: trainer.epoch(),
                checkpoint,
            });
        }
    }
    let step = trainer.steps_done();
    let checkpoint = match saved_at {
        Some((at, path)) if at == step => path,
        _ => out.join(checkpoint::dir_name(step)),
    };
    if !checkpoint.is_dir() {
        let elapsed = elapsed_before + started.elapsed().as_secs_f64();
        save(&trainer, &metrics, elapsed, on_event)?;
    }
    let model_dir = out.join(MODEL_DIR);
    let report = crate::merge::write_model_dir(trainer.model(), base_dir, &model_dir)?;
    Ok(FullOutcome::Finished {
        step,
        checkpoint,
        model_dir,
        report: Box::new(report),
    })
}
