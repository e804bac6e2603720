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

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype;

use crate::config::{Family, ModelConfig};
use crate::error::{LlmError, Result};
use crate::lora::Adapter;
use crate::math::Layout;
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
                "the output {how} {what} {}; the merge writes a new directory",
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
    let out_abs = resolve(output_dir)?;
    refuse_inside(output_dir, &out_abs, model_dir, "the model directory")?;
    refuse_inside(output_dir, &out_abs, adapters_dir, "the adapters directory")?;
    refuse_existing(output_dir)?;
    let (Some(parent), Some(out_name)) = (out_abs.parent(), out_abs.file_name()) else {
        return Err(refusal(output_dir, "names no directory to create".into()));
    };

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
        let (info, _, file) = store.raw(&name).ok_or_else(|| LlmError::MissingTensor {
            path: store.source().to_path_buf(),
            name: name.clone(),
        })?;
        if info.shape != expected {
            return Err(LlmError::TensorShape {
                path: file.to_path_buf(),
                name,
                expected,
                found: info.shape.clone(),
            });
        }
        if !matches!(info.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
            return Err(LlmError::TensorDtype {
                path: file.to_path_buf(),
                name,
                dtype: format!("{:?}", info.dtype),
            });
        }
        targets.insert(name, Target { adapter, inp, out });
    }

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
    let mut entries: Vec<_> = std::fs::read_dir(model_dir)
        .map_err(io(model_dir))?
        .collect::<std::io::Result<_>>()
        .map_err(io(model_dir))?;
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
        for merged in write_shard(&shard, &dest, &targets, layout)? {
            tensors.push(MergedTensor {
                name: merged.0,
                dtype: format!("{:?}", merged.1),
                file: shown.clone(),
            });
        }
        weight_bytes += (shard.header.len() + shard.data.len()) as u64;
        weight_files.push(shown);
    }
    sync_dir(&tmp)?;
    // Fails (nothing replaced) if the output gained files since the check.
    std::fs::rename(&tmp, &out_abs).map_err(|e| {
        refusal(
            output_dir,
            format!(
                "could not move the merged directory {} into place: {e}",
                tmp.display()
            ),
        )
    })?;
    partial.done = true;
    sync_dir(parent)?;

    let mut modules: Vec<String> = adapters.keys().cloned().collect();
    modules.sort();
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    weight_files.sort();
    Ok(MergeReport {
        output: out_abs,
        modules,
        tensors,
        r: lora.r,
        scale: lora.scale(),
        weight_files,
        weight_bytes,
        copied,
        copied_bytes,
        skipped,
    })
}

/// Writes one weight file: the base's header bytes, then its data with the
/// targeted tensors' bytes replaced by the merged ones (same length). The
/// names and dtypes of the tensors merged are returned.
fn write_shard(
    shard: &RawShard,
    dest: &Path,
    targets: &HashMap<String, Target>,
    layout: Layout,
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
    let mut merged = Vec::new();
    let mut pos = 0;
    for (start, end, name) in order {
        let Some(target) = targets.get(&name) else {
            continue;
        };
        let Some(info) = shard.metadata.info(&name) else {
            continue;
        };
        // Everything before this tensor, as the base has it.
        w.write_all(&shard.data[pos..start]).map_err(io(dest))?;
        let bytes = merge_tensor(
            &shard.data[start..end],
            info.dtype,
            target,
            layout,
            shard.path,
            &name,
        )?;
        w.write_all(&bytes).map_err(io(dest))?;
        pos = end;
        merged.push((name, info.dtype));
    }
    w.write_all(&shard.data[pos..]).map_err(io(dest))?;
    let file = w.into_inner().map_err(|e| LlmError::Io {
        path: dest.to_path_buf(),
        source: e.into_error(),
    })?;
    file.sync_all().map_err(io(dest))?;
    Ok(merged)
}

/// W + scale · B·A for one stored tensor, computed in f32 and encoded back
/// to `dtype` (round to nearest even); a value that is not finite after
/// rounding (an overflow of the dtype) is an error naming the tensor.
fn merge_tensor(
    bytes: &[u8],
    dtype: Dtype,
    target: &Target,
    layout: Layout,
    file: &Path,
    name: &str,
) -> Result<Vec<u8>> {
    let mut w: Vec<f32> = match dtype {
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
    };
    peft::add_delta(&mut w, layout, target.inp, target.out, 0, target.adapter);
    let mut out = Vec::with_capacity(bytes.len());
    for (index, &v) in w.iter().enumerate() {
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
                name: format!("{name} (merged, {dtype:?})"),
                index,
                value: stored,
            });
        }
    }
    Ok(out)
}
