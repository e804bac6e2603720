//! LoRA adapters merged into a Hugging Face model directory, written as a
//! new directory that transformers' `AutoModelForCausalLM.from_pretrained`
//! loads as the merged model (`cargo xtask lora-merge --model`).
//!
//! Design: the base's weight files are rewritten one by one with the same
//! names, the same header bytes (names, dtypes, shapes, offsets and the
//! `__metadata__`, verbatim) and the same data layout; only the targeted
//! tensors' bytes change (W + scale · B·A computed in f32 with the in-memory
//! merge's arithmetic, `peft::add_delta`, and rounded back to the tensor's
//! own dtype, round to nearest even). Every other file of the base (config,
//! tokenizer, generation config, the shard index …) is copied byte for byte;
//! weights in other formats and sub-directories are left out and reported.
//!
//! Safety: the adapters are read and checked (config against the model,
//! shapes, finite values, the checksum) and every target tensor found
//! before anything is written. The output is built in a temporary sibling
//! directory (`.NAME.partial-PID`), every file synced, then renamed into
//! place and the parent synced, so an interrupted merge leaves no directory
//! under the output's name; a failed one removes its temporary directory.
//! An output equal to or inside the model or adapters directory, or one that
//! exists and is not empty, is refused.
//!
//! Memory: the base files are memory-mapped and untouched tensors are
//! written from the mapping (borrowed, never copied into memory); one merged
//! tensor at a time is owned, as f32 and in its encoded bytes.
//!
//! The writer (`write_dir`) takes the new values from a source, a function
//! of (name, dtype, stored bytes) giving a tensor's f32 values in the stored
//! layout or None to keep its bytes: the merge is one source, and
//! [`write_model_dir`] (a fully fine-tuned [`Model`], every weight tensor
//! from `Model::weight`, one tensor copied at a time) the other.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype;

use crate::config::{Family, ModelConfig};
use crate::error::{LlmError, Result};
use crate::lora::Adapter;
use crate::math::Layout;
use crate::model::Model;
use crate::peft::{self, ADAPTER_WEIGHTS};
use crate::weights::{RawShard, WeightStore};

/// One base tensor the merge changed.
#[derive(Clone, Debug, PartialEq)]
pub struct MergedTensor {
    /// The checkpoint's tensor name (`model.layers.0.self_attn.q_proj.weight`).
    pub name: String,
    /// Its dtype as safetensors names it (`F32`, `BF16`, `F16`), unchanged.
    pub dtype: String,
    /// The weight file it is in.
    pub file: String,
}

/// What [`merge_to_dir`] wrote.
#[derive(Clone, Debug)]
pub struct MergeReport {
    pub output: PathBuf,
    /// The adapters' module keys, sorted.
    pub modules: Vec<String>,
    /// The base tensors changed, sorted by name.
    pub tensors: Vec<MergedTensor>,
    pub r: usize,
    pub scale: f32,
    /// The weight files written (the base's names).
    pub weight_files: Vec<String>,
    pub weight_bytes: u64,
    /// The base's other files, copied byte for byte.
    pub copied: Vec<String>,
    pub copied_bytes: u64,
    /// What was not carried over, with why.
    pub skipped: Vec<String>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> LlmError + '_ {
    move |source| LlmError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn refusal(path: &Path, what: String) -> LlmError {
    LlmError::Merge {
        path: path.to_path_buf(),
        what,
    }
}

/// `path` made absolute with every existing part's symbolic links resolved
/// (the missing tail, which cannot hold links, appended as written).
fn resolve(path: &Path) -> Result<PathBuf> {
    let abs = std::path::absolute(path).map_err(io(path))?;
    let mut existing = abs.as_path();
    let mut tail = Vec::new();
    while std::fs::symlink_metadata(existing).is_err() {
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                tail.push(name.to_os_string());
                existing = parent;
            }
            _ => break,
        }
    }
    let mut out = existing.canonicalize().map_err(io(existing))?;
    for name in tail.iter().rev() {
        out.push(name);
    }
    Ok(out)
}

/// The output must not be `dir` or inside it.
fn refuse_inside(output: &Path, out_abs: &Path, dir: &Path, what: &str) -> Result<()> {
    let dir_abs = dir.canonicalize().map_err(io(dir))?;
    if out_abs.starts_with(&dir_abs) {
        let how = if out_abs == dir_abs {
            "is"
        } else {
            "is inside"
        };
        return Err(refusal(
            output,
            format!(
                "the output {how} {what} {}; the output must be a new directory",
                dir.display()
            ),
        ));
    }
    Ok(())
}

/// An output that exists must be an empty directory.
fn refuse_existing(output: &Path) -> Result<()> {
    let Ok(meta) = std::fs::metadata(output) else {
        return Ok(());
    };
    if !meta.is_dir() {
        return Err(refusal(
            output,
            "exists and is not a directory; refusing to overwrite it".into(),
        ));
    }
    let mut entries = std::fs::read_dir(output).map_err(io(output))?;
    if entries.next().is_some() {
        return Err(refusal(
            output,
            "exists and is not empty; refusing to overwrite it (remove it or name a new directory)"
                .into(),
        ));
    }
    Ok(())
}

/// The temporary directory, removed unless the merge completed.
struct Partial {
    path: PathBuf,
    done: bool,
}

impl Drop for Partial {
    fn drop(&mut self) {
        if !self.done {
            // Best effort: a directory we cannot remove is named by nothing
            // the output's readers look for.
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
}

/// Why a file of the base is not carried over, if it is not: weights in a
/// format the merge does not rewrite (carried over they would hold the
/// unmerged model beside the merged one), and safetensors files that are
/// not the model's weights (an original checkpoint, reference tensors).
fn left_out(name: &str) -> Option<&'static str> {
    if name.ends_with(".safetensors") {
        Some("safetensors, not among the model's weights")
    } else if [
        ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx",
    ]
    .iter()
    .any(|ext| name.ends_with(ext))
        || name.ends_with(".bin.index.json")
    {
        Some("weights in another format, not merged")
    } else {
        None
    }
}

/// A merge target: the adapter and the tensor's (in, out).
struct Target<'a> {
    adapter: &'a Adapter,
    inp: usize,
    out: usize,
}

/// Merges the peft adapters of `adapters_dir` into the model of
/// `model_dir` and writes the merged model to the new directory
/// `output_dir` (see the module's comment for what is written and checked).
pub fn merge_to_dir(
    model_dir: &Path,
    adapters_dir: &Path,
    output_dir: &Path,
) -> Result<MergeReport> {
    let out_abs = check_output(
        output_dir,
        &[
            (model_dir, "the model directory"),
            (adapters_dir, "the adapters directory"),
        ],
    )?;

    let config = ModelConfig::load(model_dir)?;
    let store = WeightStore::open(model_dir)?;
    let (adapters, lora) = peft::load_for(adapters_dir, &config)?;
    let adapter_file = adapters_dir.join(ADAPTER_WEIGHTS);
    peft::check_adapters(&config, &adapters, &adapter_file)?;

    let family = config.family;
    let layout = peft::layout(family);
    let prefix = match family {
        Family::Llama => "model.",
        // As Model::load: transformers' names, or the original unprefixed.
        Family::Gpt2 if store.contains("transformer.wte.weight") => "transformer.",
        Family::Gpt2 => "",
    };
    let mut targets: HashMap<String, Target> = HashMap::new();
    for (key, adapter) in &adapters {
        let name = format!("{prefix}{key}.weight");
        let (inp, out) = peft::module_dims(&config, key).ok_or_else(|| LlmError::Adapter {
            path: adapter_file.clone(),
            what: format!("adapter `{key}` names no module of the model"),
        })?;
        let expected = match layout {
            Layout::OutIn => vec![out, inp],
            Layout::InOut => vec![inp, out],
        };
        check_tensor(&store, &name, &expected)?;
        targets.insert(name, Target { adapter, inp, out });
    }

    let source = |name: &str, dtype: Dtype, bytes: &[u8]| -> Result<Option<Vec<f32>>> {
        let Some(target) = targets.get(name) else {
            return Ok(None);
        };
        let mut w = decode(bytes, dtype);
        peft::add_delta(&mut w, layout, target.inp, target.out, 0, target.adapter);
        Ok(Some(w))
    };
    let written = write_dir(model_dir, output_dir, &out_abs, &store, "merged", &source)?;

    let mut modules: Vec<String> = adapters.keys().cloned().collect();
    modules.sort();
    Ok(MergeReport {
        output: written.output,
        modules,
        tensors: written.tensors,
        r: lora.r,
        scale: lora.scale(),
        weight_files: written.weight_files,
        weight_bytes: written.weight_bytes,
        copied: written.copied,
        copied_bytes: written.copied_bytes,
        skipped: written.skipped,
    })
}

/// What [`write_model_dir`] wrote.
#[derive(Clone, Debug)]
pub struct ModelDirReport {
    pub output: PathBuf,
    /// The tensors rewritten from the model (every weight tensor), sorted
    /// by name, each in its own dtype.
    pub tensors: Vec<MergedTensor>,
    /// Tensors of the base that are no weight of the model (buffers such as
    /// an old GPT-2 checkpoint's `attn.bias` masks), kept byte for byte.
    pub kept: Vec<String>,
    /// The weight files written (the base's names).
    pub weight_files: Vec<String>,
    pub weight_bytes: u64,
    /// The base's other files, copied byte for byte.
    pub copied: Vec<String>,
    pub copied_bytes: u64,
    /// What was not carried over, with why.
    pub skipped: Vec<String>,
}

/// Writes `model` (loaded from, and trained from, the model of `base_dir`)
/// as the new Hugging Face directory `output_dir`: the base's files, shard
/// layout, index and header bytes, with every weight tensor's data replaced
/// by `model.weight(name)` encoded to the tensor's own dtype (f32, or bf16
/// and f16 by round to nearest even); other files copied. A tied head stays
/// tied: the checkpoint has no head of its own (and if it stores one, it is
/// written from the embedding). Every model weight must be in the base with
/// its shape and a float dtype; a value not finite after encoding is an
/// error naming the tensor. Atomic, with [`merge_to_dir`]'s refusals.
pub fn write_model_dir(
    model: &Model,
    base_dir: &Path,
    output_dir: &Path,
) -> Result<ModelDirReport> {
    let out_abs = check_output(output_dir, &[(base_dir, "the model directory")])?;
    let store = WeightStore::open(base_dir)?;
    let names = model.weight_names();
    for (name, shape) in &names {
        check_tensor(&store, name, shape)?;
    }
    let known: BTreeSet<&str> = names.iter().map(|(n, _)| n.as_str()).collect();
    let embed = names
        .iter()
        .map(|(n, _)| n.as_str())
        .find(|n| n.ends_with("embed_tokens.weight") || n.ends_with("wte.weight"))
        .map(str::to_string);
    // A model with no head of its own runs its embedding as the head.
    let tied_head = !known.contains("lm_head.weight");
    let kept = std::cell::RefCell::new(Vec::new());
    let source = |name: &str, dtype: Dtype, bytes: &[u8]| -> Result<Option<Vec<f32>>> {
        let from = if known.contains(name) {
            name.to_string()
        } else if tied_head && name == "lm_head.weight" && embed.is_some() {
            embed.clone().unwrap_or_default()
        } else {
            kept.borrow_mut().push(name.to_string());
            return Ok(None);
        };
        let values = model.weight(&from)?.data;
        let stored_len = bytes.len() / dtype_size(dtype);
        if values.len() != stored_len {
            return Err(LlmError::Input(format!(
                "tensor `{name}`: the model has {} values, {} stores {stored_len}",
                values.len(),
                base_dir.display()
            )));
        }
        Ok(Some(values))
    };
    let written = write_dir(base_dir, output_dir, &out_abs, &store, "trained", &source)?;
    let mut kept = kept.into_inner();
    kept.sort();
    Ok(ModelDirReport {
        output: written.output,
        tensors: written.tensors,
        kept,
        weight_files: written.weight_files,
        weight_bytes: written.weight_bytes,
        copied: written.copied,
        copied_bytes: written.copied_bytes,
        skipped: written.skipped,
    })
}

/// The refusals of an output, before anything is read or written: equal
/// to or inside any of `inputs` (with what each is, for the message), or
/// existing and not an empty directory. Returns the output resolved.
pub fn check_output(output_dir: &Path, inputs: &[(&Path, &str)]) -> Result<PathBuf> {
    let out_abs = resolve(output_dir)?;
    for (dir, what) in inputs {
        refuse_inside(output_dir, &out_abs, dir, what)?;
    }
    refuse_existing(output_dir)?;
    if out_abs.parent().is_none() || out_abs.file_name().is_none() {
        return Err(refusal(output_dir, "names no directory to create".into()));
    }
    Ok(out_abs)
}

/// A tensor to rewrite must be in the store with `expected` shape and a
/// float dtype.
fn check_tensor(store: &WeightStore, name: &str, expected: &[usize]) -> Result<()> {
    let (info, _, file) = store.raw(name).ok_or_else(|| LlmError::MissingTensor {
        path: store.source().to_path_buf(),
        name: name.to_string(),
    })?;
    if info.shape != expected {
        return Err(LlmError::TensorShape {
            path: file.to_path_buf(),
            name: name.to_string(),
            expected: expected.to_vec(),
            found: info.shape.clone(),
        });
    }
    if !matches!(info.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
        return Err(LlmError::TensorDtype {
            path: file.to_path_buf(),
            name: name.to_string(),
            dtype: format!("{:?}", info.dtype),
        });
    }
    Ok(())
}

/// The new values of a tensor (by name, dtype and stored bytes), in the
/// stored layout, or None to keep its bytes.
type Source<'s> = dyn Fn(&str, Dtype, &[u8]) -> Result<Option<Vec<f32>>> + 's;

/// What [`write_dir`] wrote.
struct Written {
    output: PathBuf,
    tensors: Vec<MergedTensor>,
    weight_files: Vec<String>,
    weight_bytes: u64,
    copied: Vec<String>,
    copied_bytes: u64,
    skipped: Vec<String>,
}

/// The writer both [`merge_to_dir`] and [`write_model_dir`] use: `base_dir`
/// rewritten into the new directory `output_dir` (checked by
/// [`check_output`], resolved to `out_abs`) with the tensors `source`
/// gives new values encoded to their own dtype (`what` names them in a
/// non-finite error: "merged", "trained"), the other files copied, built
/// in a temporary sibling and renamed into place.
fn write_dir(
    base_dir: &Path,
    output_dir: &Path,
    out_abs: &Path,
    store: &WeightStore,
    what: &str,
    source: &Source,
) -> Result<Written> {
    let (Some(parent), Some(out_name)) = (out_abs.parent(), out_abs.file_name()) else {
        return Err(refusal(output_dir, "names no directory to create".into()));
    };
    std::fs::create_dir_all(parent).map_err(io(parent))?;
    let tmp = parent.join(format!(
        ".{}.partial-{}",
        out_name.to_string_lossy(),
        std::process::id()
    ));
    std::fs::create_dir(&tmp).map_err(io(&tmp))?;
    let mut partial = Partial {
        path: tmp.clone(),
        done: false,
    };

    let weight_names: BTreeSet<_> = store
        .raw_shards()
        .filter_map(|s| s.path.file_name().map(|n| n.to_os_string()))
        .collect();
    let mut entries: Vec<_> = std::fs::read_dir(base_dir)
        .map_err(io(base_dir))?
        .collect::<std::io::Result<_>>()
        .map_err(io(base_dir))?;
    entries.sort_by_key(|e| e.file_name());
    let (mut copied, mut skipped, mut copied_bytes) = (Vec::new(), Vec::new(), 0u64);
    for entry in entries {
        let (path, name) = (entry.path(), entry.file_name());
        let shown = name.to_string_lossy().into_owned();
        if weight_names.contains(&name) {
            continue;
        }
        if path.is_dir() {
            skipped.push(format!("{shown}/ (a directory)"));
        } else if let Some(why) = left_out(&shown) {
            skipped.push(format!("{shown} ({why})"));
        } else {
            let dest = tmp.join(&name);
            copied_bytes += std::fs::copy(&path, &dest).map_err(io(&path))?;
            File::open(&dest)
                .and_then(|f| f.sync_all())
                .map_err(io(&dest))?;
            copied.push(shown);
        }
    }

    let (mut weight_files, mut weight_bytes, mut tensors) = (Vec::new(), 0u64, Vec::new());
    for shard in store.raw_shards() {
        let Some(name) = shard.path.file_name() else {
            continue;
        };
        let dest = tmp.join(name);
        let shown = name.to_string_lossy().into_owned();
        for (tensor, dtype) in write_shard(&shard, &dest, source, what)? {
            tensors.push(MergedTensor {
                name: tensor,
                dtype: format!("{dtype:?}"),
                file: shown.clone(),
            });
        }
        weight_bytes += (shard.header.len() + shard.data.len()) as u64;
        weight_files.push(shown);
    }
    sync_dir(&tmp)?;
    // Fails (nothing replaced) if the output gained files since the check.
    std::fs::rename(&tmp, out_abs).map_err(|e| {
        refusal(
            output_dir,
            format!(
                "could not move the written directory {} into place: {e}",
                tmp.display()
            ),
        )
    })?;
    partial.done = true;
    sync_dir(parent)?;
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    weight_files.sort();
    Ok(Written {
        output: out_abs.to_path_buf(),
        tensors,
        weight_files,
        weight_bytes,
        copied,
        copied_bytes,
        skipped,
    })
}

/// Writes one weight file: the base's header bytes, then its data with the
/// bytes of the tensors `source` gives values for replaced by those values
/// encoded to the tensor's dtype (same length). The names and dtypes of the
/// tensors replaced are returned.
fn write_shard(
    shard: &RawShard,
    dest: &Path,
    source: &Source,
    what: &str,
) -> Result<Vec<(String, Dtype)>> {
    let file = File::create(dest).map_err(io(dest))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    w.write_all(shard.header).map_err(io(dest))?;
    let mut order: Vec<(usize, usize, String)> = shard
        .metadata
        .tensors()
        .into_iter()
        .map(|(name, info)| (info.data_offsets.0, info.data_offsets.1, name))
        .collect();
    order.sort();
    let mut replaced = Vec::new();
    let mut pos = 0;
    for (start, end, name) in order {
        let Some(info) = shard.metadata.info(&name) else {
            continue;
        };
        let stored = &shard.data[start..end];
        let Some(values) = source(&name, info.dtype, stored)? else {
            continue;
        };
        // Everything before this tensor, as the base has it.
        w.write_all(&shard.data[pos..start]).map_err(io(dest))?;
        let bytes = encode(&values, info.dtype, shard.path, &name, what)?;
        if bytes.len() != stored.len() {
            return Err(LlmError::Input(format!(
                "tensor `{name}` of {}: {} bytes to write where {} are stored",
                shard.path.display(),
                bytes.len(),
                stored.len()
            )));
        }
        w.write_all(&bytes).map_err(io(dest))?;
        pos = end;
        replaced.push((name, info.dtype));
    }
    w.write_all(&shard.data[pos..]).map_err(io(dest))?;
    let file = w.into_inner().map_err(|e| LlmError::Io {
        path: dest.to_path_buf(),
        source: e.into_error(),
    })?;
    file.sync_all().map_err(io(dest))?;
    Ok(replaced)
}

/// The bytes of one element of a float dtype.
fn dtype_size(dtype: Dtype) -> usize {
    match dtype {
        Dtype::F32 => 4,
        _ => 2,
    }
}

/// A stored float tensor's values as f32.
fn decode(bytes: &[u8], dtype: Dtype) -> Vec<f32> {
    match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
    }
}

/// `values` encoded to `dtype` (bf16 and f16 by round to nearest even); a
/// value that is not finite after encoding (a NaN, or an overflow of the
/// dtype) is an error naming the tensor (`what`: merged, trained).
fn encode(values: &[f32], dtype: Dtype, file: &Path, name: &str, what: &str) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(values.len() * dtype_size(dtype));
    for (index, &v) in values.iter().enumerate() {
        let stored = match dtype {
            Dtype::F32 => {
                out.extend_from_slice(&v.to_le_bytes());
                v
            }
            Dtype::BF16 => {
                let h = half::bf16::from_f32(v);
                out.extend_from_slice(&h.to_le_bytes());
                h.to_f32()
            }
            _ => {
                let h = half::f16::from_f32(v);
                out.extend_from_slice(&h.to_le_bytes());
                h.to_f32()
            }
        };
        if !stored.is_finite() {
            return Err(LlmError::NonFinite {
                path: file.to_path_buf(),
                name: format!("{name} ({what}, {dtype:?})"),
                index,
                value: stored,
            });
        }
    }
    Ok(out)
}
