//! A fine-tuning run's checkpoints: one directory each,
//! `checkpoint-stepNNNNNNNNNN/`, holding the adapters in peft's files
//! (`adapter_model.safetensors`, `adapter_config.json`: a checkpoint loads
//! in `PeftModel.from_pretrained` as it is), AdamW's moments
//! (`optimizer.safetensors`, f32) and `trainer_state.json` (format, step,
//! epoch and position in its order, elapsed seconds, the run's settings,
//! the model's and the data file's fingerprints, and the size and FNV-1a
//! hash of each other file, so a truncated or corrupt one is found before
//! any of it is used).
//!
//! A checkpoint is written into `.checkpoint-stepN.tmp/`, every file synced,
//! the state file last, then renamed into place and the run directory
//! synced: a crash mid-write leaves the previous checkpoints as they were
//! (and a temporary that the next start removes). Memory: the adapters and
//! moments are serialised once each (4× the adapters at most, briefly).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde_json::{json, Value};

use super::TrainState;
use crate::error::{LlmError, Result};
use crate::model::Model;
use crate::peft::{self, LoraConfig, ADAPTER_CONFIG, ADAPTER_WEIGHTS};

pub const STATE_FILE: &str = "trainer_state.json";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const FORMAT: u64 = 1;
const PREFIX: &str = "checkpoint-step";

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> LlmError + '_ {
    move |source| LlmError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// FNV-1a, 64 bits: a checksum of a file's bytes (not a defence against
/// a hostile edit, which the fingerprints do not claim to be).
#[derive(Clone, Copy)]
pub struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Self(0xCBF2_9CE4_8422_2325)
    }
}

impl Fnv {
    pub fn update(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01B3);
        }
    }

    pub fn hex(self) -> String {
        format!("{:016x}", self.0)
    }
}

/// A file's size and hash, read in 1 MiB pieces.
pub fn hash_file(path: &Path) -> Result<(u64, String)> {
    let mut file = std::fs::File::open(path).map_err(io(path))?;
    let mut buf = vec![0u8; 1 << 20];
    let (mut size, mut fnv) = (0u64, Fnv::default());
    loop {
        let got = file.read(&mut buf).map_err(io(path))?;
        if got == 0 {
            return Ok((size, fnv.hex()));
        }
        size += got as u64;
        fnv.update(&buf[..got]);
    }
}

/// Syncs a directory, so a rename in it is on disk.
pub fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(dir))
}

/// Writes `bytes` to `path` through `.NAME.tmp` beside it: written, synced,
/// renamed, the directory synced.
/// `value` as pretty JSON (a line end after it), written atomically: the
/// run records of the LoRA and the full run.
pub fn write_json_atomic(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|source| LlmError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    write_atomic(path, format!("{text}\n").as_bytes())
}

pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut file = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    file.write_all(bytes).map_err(io(&tmp))?;
    file.sync_all().map_err(io(&tmp))?;
    drop(file);
    std::fs::rename(&tmp, path).map_err(io(path))?;
    sync_dir(dir)
}

/// The model directory's fingerprint: config.json's size and hash, and the
/// names and sizes of its weight files (the index and the shards it names,
/// or model.safetensors), so no weight need be read to check it.
pub fn model_fingerprint(dir: &Path) -> Result<Value> {
    let config = dir.join("config.json");
    let (size, hash) = hash_file(&config)?;
    let index = dir.join("model.safetensors.index.json");
    let mut names = Vec::new();
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(io(&index))?;
        let value: Value = serde_json::from_str(&text).map_err(|source| LlmError::Json {
            path: index.clone(),
            source,
        })?;
        let mut shards: Vec<String> = value
            .get("weight_map")
            .and_then(Value::as_object)
            .map(|m| {
                m.values()
                    .filter_map(|v| v.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        shards.sort();
        shards.dedup();
        names.push("model.safetensors.index.json".to_string());
        names.extend(shards);
    } else {
        names.push("model.safetensors".to_string());
    }
    let mut weights = Vec::new();
    for name in names {
        let path = dir.join(&name);
        let meta = std::fs::metadata(&path).map_err(io(&path))?;
        weights.push(json!({"name": name, "size": meta.len()}));
    }
    Ok(json!({
        "config.json": {"size": size, "fnv64": hash},
        "weights": weights,
    }))
}

/// The data file's fingerprint: its size and the hash of its bytes.
pub fn data_fingerprint(path: &Path) -> Result<Value> {
    let (size, hash) = hash_file(path)?;
    Ok(json!({"size": size, "fnv64": hash}))
}

/// What differs between two model fingerprints, in words (None: same).
pub fn model_difference(was: &Value, now: &Value) -> Option<String> {
    let mut parts = Vec::new();
    if was.get("config.json") != now.get("config.json") {
        parts.push("config.json changed".to_string());
    }
    if was.get("weights") != now.get("weights") {
        let list = |v: &Value| {
            v.get("weights")
                .and_then(Value::as_array)
                .map(|w| {
                    w.iter()
                        .map(|e| format!("{} ({} bytes)", e["name"], e["size"]).replace('"', ""))
                        .collect::<Vec<_>>()
                        .join(", ")
                })
                .unwrap_or_default()
        };
        parts.push(format!(
            "the weight files were {}, now {}",
            list(was),
            list(now)
        ));
    }
    (!parts.is_empty()).then(|| parts.join("; "))
}

/// The name of step `step`'s checkpoint directory.
pub fn dir_name(step: usize) -> String {
    format!("{PREFIX}{step:010}")
}

/// The step a checkpoint directory's name gives (None: not one).
pub fn step_of(name: &str) -> Option<usize> {
    let digits = name.strip_prefix(PREFIX)?;
    (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// The checkpoints in `out`, by step, oldest first.
pub fn list(out: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let mut found = Vec::new();
    let entries = match std::fs::read_dir(out) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(found),
        Err(e) => return Err(io(out)(e)),
    };
    for entry in entries {
        let entry = entry.map_err(io(out))?;
        let name = entry.file_name();
        if let Some(step) = name.to_str().and_then(step_of) {
            if entry.path().is_dir() {
                found.push((step, entry.path()));
            }
        }
    }
    found.sort();
    Ok(found)
}

/// Removes what a write killed midway left (`.checkpoint-stepN.tmp`,
/// `.checkpoint-stepN.old`), returning what it removed.
pub fn remove_temporaries(out: &Path) -> Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(out) else {
        return Ok(removed);
    };
    for entry in entries {
        let entry = entry.map_err(io(out))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let ours = name
            .strip_prefix('.')
            .and_then(|n| n.strip_suffix(".tmp").or_else(|| n.strip_suffix(".old")))
            .and_then(step_of)
            .is_some();
        if ours {
            let path = entry.path();
            std::fs::remove_dir_all(&path).map_err(io(&path))?;
            removed.push(path);
        }
    }
    Ok(removed)
}

/// The checkpoints past the newest `keep`, removed (oldest first).
pub fn prune(out: &Path, keep: usize) -> Result<Vec<PathBuf>> {
    let all = list(out)?;
    let mut removed = Vec::new();
    for (_, path) in all.iter().take(all.len().saturating_sub(keep.max(1))) {
        std::fs::remove_dir_all(path).map_err(io(path))?;
        removed.push(path.clone());
    }
    if !removed.is_empty() {
        sync_dir(out)?;
    }
    Ok(removed)
}

/// What a checkpoint records besides the training state.
#[derive(Clone, Debug)]
pub struct Meta {
    pub elapsed_s: f64,
    /// The run's settings (run.json's `settings`) when it was written.
    pub settings: Value,
    pub model: Value,
    pub data: Value,
}

/// A checkpoint read back.
#[derive(Debug)]
pub struct Saved {
    pub path: PathBuf,
    pub state: TrainState,
    pub meta: Meta,
}

fn moment_names(key: &str) -> [String; 4] {
    [
        format!("{key}.lora_A.exp_avg"),
        format!("{key}.lora_B.exp_avg"),
        format!("{key}.lora_A.exp_avg_sq"),
        format!("{key}.lora_B.exp_avg_sq"),
    ]
}

/// The first value that is not finite, named (None: all are).
fn non_finite(state: &TrainState) -> Option<String> {
    for (i, key) in state.keys.iter().enumerate() {
        let ad = &state.adapters[key];
        let [ma, mb, va, vb] = moment_names(key);
        let tensors = [
            (format!("{key}.lora_A"), &ad.a),
            (format!("{key}.lora_B"), &ad.b),
            (ma, &state.m[i].0),
            (mb, &state.m[i].1),
            (va, &state.v[i].0),
            (vb, &state.v[i].1),
        ];
        for (name, values) in tensors {
            if let Some((at, v)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                return Some(format!("{name} (value {at}: {v})"));
            }
        }
    }
    None
}

/// Writes `state` as the checkpoint of its step in `out`, replacing one of
/// that step if there is one; returns its directory.
pub fn write(
    out: &Path,
    model: &Model,
    state: &TrainState,
    config: &LoraConfig,
    meta: &Meta,
) -> Result<PathBuf> {
    let name = dir_name(state.step);
    let path = out.join(&name);
    if let Some(what) = non_finite(state) {
        return Err(LlmError::Checkpoint {
            path,
            what: format!("not written: {what} is not finite"),
        });
    }
    let tmp = out.join(format!(".{name}.tmp"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    peft::save_adapters(&tmp, model, &state.adapters, config)?;

    let optimizer = tmp.join(OPTIMIZER_FILE);
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let mut blobs = Vec::with_capacity(4 * state.keys.len());
    for (i, key) in state.keys.iter().enumerate() {
        let [ma, mb, va, vb] = moment_names(key);
        blobs.push((ma, bytes(&state.m[i].0)));
        blobs.push((mb, bytes(&state.m[i].1)));
        blobs.push((va, bytes(&state.v[i].0)));
        blobs.push((vb, bytes(&state.v[i].1)));
    }
    let mut views = Vec::with_capacity(blobs.len());
    for (name, data) in &blobs {
        let view = TensorView::new(Dtype::F32, vec![data.len() / 4], data).map_err(|source| {
            LlmError::Safetensors {
                path: optimizer.clone(),
                source,
            }
        })?;
        views.push((name.clone(), view));
    }
    let serialized =
        safetensors::serialize(views, None).map_err(|source| LlmError::Safetensors {
            path: optimizer.clone(),
            source,
        })?;
    drop(blobs);
    write_atomic(&optimizer, &serialized)?;
    drop(serialized);

    let mut files = serde_json::Map::new();
    for file in [ADAPTER_WEIGHTS, ADAPTER_CONFIG, OPTIMIZER_FILE] {
        let (size, hash) = hash_file(&tmp.join(file))?;
        files.insert(file.into(), json!({"size": size, "fnv64": hash}));
    }
    let record = json!({
        "format": FORMAT,
        "step": state.step,
        "epoch": state.epoch,
        "position": state.position,
        "elapsed_s": meta.elapsed_s,
        "settings": meta.settings,
        "model": meta.model,
        "data": meta.data,
        "files": files,
    });
    let state_path = tmp.join(STATE_FILE);
    let text = serde_json::to_string_pretty(&record).map_err(|source| LlmError::Json {
        path: state_path.clone(),
        source,
    })?;
    write_atomic(&state_path, text.as_bytes())?;
    sync_dir(&tmp)?;
    if path.exists() {
        // A checkpoint of this step from a history given up (a resume
        // from an older one): set aside, replaced, then removed.
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

/// Reads the checkpoint in `path`, checking every file against the sizes
/// and hashes its state file records before using any.
pub fn load(path: &Path, model: &Model) -> Result<Saved> {
    let bad = |what: String| LlmError::Checkpoint {
        path: path.to_path_buf(),
        what,
    };
    let state_path = path.join(STATE_FILE);
    let text = std::fs::read_to_string(&state_path)
        .map_err(|e| bad(format!("{STATE_FILE} does not read: {e}")))?;
    let record: Value = serde_json::from_str(&text)
        .map_err(|e| bad(format!("{STATE_FILE} is not valid JSON (truncated?): {e}")))?;
    if record.get("format").and_then(Value::as_u64) != Some(FORMAT) {
        return Err(bad(format!(
            "{STATE_FILE}: key `format` is {}, expected {FORMAT}",
            record.get("format").unwrap_or(&Value::Null)
        )));
    }
    let number = |key: &str| -> Result<usize> {
        record
            .get(key)
            .and_then(Value::as_u64)
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| {
                bad(format!(
                    "{STATE_FILE}: key `{key}` is missing or not a count"
                ))
            })
    };
    let (step, epoch, position) = (number("step")?, number("epoch")?, number("position")?);
    for file in [ADAPTER_WEIGHTS, ADAPTER_CONFIG, OPTIMIZER_FILE] {
        let want = record
            .get("files")
            .and_then(|f| f.get(file))
            .ok_or_else(|| bad(format!("{STATE_FILE}: no record of {file}")))?;
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
    let (adapters, _) = peft::load_adapters(path, model).map_err(|e| bad(e.to_string()))?;
    let mut state = TrainState::new(adapters);
    let optimizer = path.join(OPTIMIZER_FILE);
    let bytes = std::fs::read(&optimizer).map_err(|e| bad(format!("{OPTIMIZER_FILE}: {e}")))?;
    let tensors = SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(format!("{OPTIMIZER_FILE} does not parse: {e}")))?;
    for (i, key) in state.keys.clone().iter().enumerate() {
        let [ma, mb, va, vb] = moment_names(key);
        let read = |name: &str, len: usize| -> Result<Vec<f32>> {
            let t = tensors
                .tensor(name)
                .map_err(|_| bad(format!("{OPTIMIZER_FILE}: tensor `{name}` is missing")))?;
            if t.dtype() != Dtype::F32 || t.shape() != [len] {
                return Err(bad(format!(
                    "{OPTIMIZER_FILE}: tensor `{name}` is {:?} {:?}, expected F32 [{len}]",
                    t.dtype(),
                    t.shape()
                )));
            }
            let values: Vec<f32> = t
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            if let Some((at, v)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                return Err(bad(format!(
                    "{OPTIMIZER_FILE}: tensor `{name}` value {at} is {v}"
                )));
            }
            Ok(values)
        };
        let (la, lb) = (state.m[i].0.len(), state.m[i].1.len());
        state.m[i] = (read(&ma, la)?, read(&mb, lb)?);
        state.v[i] = (read(&va, la)?, read(&vb, lb)?);
    }
    if let Some(what) = non_finite(&state) {
        return Err(bad(format!("{what} is not finite")));
    }
    state.step = step;
    state.epoch = epoch;
    state.position = position;
    let meta = Meta {
        elapsed_s: record
            .get("elapsed_s")
            .and_then(Value::as_f64)
            .unwrap_or(0.0),
        settings: record.get("settings").cloned().unwrap_or(Value::Null),
        model: record.get("model").cloned().unwrap_or(Value::Null),
        data: record.get("data").cloned().unwrap_or(Value::Null),
    };
    Ok(Saved {
        path: path.to_path_buf(),
        state,
        meta,
    })
}

/// The newest checkpoint of `out` that loads, with the errors of the newer
/// ones skipped (newest first).
pub fn newest_valid(out: &Path, model: &Model) -> Result<(Option<Saved>, Vec<LlmError>)> {
    let mut skipped = Vec::new();
    for (_, path) in list(out)?.into_iter().rev() {
        match load(&path, model) {
            Ok(saved) => return Ok((Some(saved), skipped)),
            Err(e) => skipped.push(e),
        }
    }
    Ok((None, skipped))
}
