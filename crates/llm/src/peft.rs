//! LoRA adapters in peft's files, both ways: `adapter_model.safetensors`
//! (f32 `lora_A.weight` [r, in] and `lora_B.weight` [out, r] under peft's
//! module names: `base_model.model.model.layers.N.self_attn.q_proj.…` on the
//! Llama family, `base_model.model.transformer.h.N.attn.c_attn.…` on GPT-2)
//! and `adapter_config.json` (the keys `PeftModel.from_pretrained` reads;
//! `fan_in_fan_out` true for GPT-2's Conv1D, false for Linear), so adapters
//! trained here load in peft and peft's load here. Both files are written to
//! a temporary name, synced and renamed, so a reader never sees half a file.
//! The weights file's metadata records `headroom_checksum` (CRC-32 over every
//! tensor's name, dtype, shape and bytes, and r, lora_alpha, use_rslora),
//! verified on reading when present (peft's own files have none). Reading
//! checks every tensor against the base model and the config and names the
//! file and tensor when one does not fit; a tensor no target explains is an
//! error, not skipped. Memory: the adapters' f32 values, once.
//!
//! Merging (`Model::merge_adapters`) checks every adapter (shape, finite
//! values) before it changes anything, then adds scale · B·A into the base
//! weights, so the cached forward and `generate` run adapted models
//! unchanged. `crate::merge` writes the merged model as a directory.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};

use crate::config::{Family, ModelConfig};
use crate::error::{LlmError, Result};
pub use crate::lora::module_dims;
use crate::lora::{key_layer, module_keys, targets, Adapter, Adapters, GPT2_TARGETS, TARGETS};
use crate::math::Layout;
use crate::model::{Linear, Mlp, Model};
use crate::weights::WeightStore;

pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// The metadata key of the adapter file's checksum (`crc32:xxxxxxxx`).
pub const CHECKSUM_KEY: &str = "headroom_checksum";

/// The LoRA settings an adapter directory records.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    pub r: usize,
    pub alpha: f32,
    pub dropout: f32,
    /// Hugging Face module names (`q_proj`, …), sorted.
    pub target_modules: Vec<String>,
    /// peft's rank-stabilised scale alpha / √r instead of alpha / r.
    pub use_rslora: bool,
}

impl LoraConfig {
    /// The factor an adapter's B·A is multiplied by.
    pub fn scale(&self) -> f32 {
        if self.use_rslora {
            self.alpha / (self.r as f32).sqrt()
        } else {
            self.alpha / self.r as f32
        }
    }
}

/// peft's prefix before a module key: peft names the modules of the
/// `…ForCausalLM` / `GPT2LMHeadModel` it wraps.
fn prefix(family: Family) -> &'static str {
    match family {
        Family::Llama => "base_model.model.model.",
        Family::Gpt2 => "base_model.model.transformer.",
    }
}

/// peft's name of an adapter tensor: `part` is `lora_A` or `lora_B`.
pub fn peft_name(family: Family, key: &str, part: &str) -> String {
    format!("{}{key}.{part}.weight", prefix(family))
}

/// How the base checkpoint stores the module's weight: [out, in] (Linear)
/// or [in, out] (GPT-2's Conv1D).
pub fn layout(family: Family) -> Layout {
    match family {
        Family::Llama => Layout::OutIn,
        Family::Gpt2 => Layout::InOut,
    }
}

/// The loaded projections a module key merges into, each with the first
/// row of B it takes (GPT-2's `c_attn` is split into q, k and v at load).
fn modules_mut<'a>(model: &'a mut Model, key: &str) -> Option<Vec<(&'a mut Linear, usize)>> {
    let family = model.config.family;
    let h = model.config.hidden_size;
    let layer = key_layer(family, key)?;
    let block = model.blocks.get_mut(layer)?;
    let module = key.split_once('.')?.1.split_once('.')?.1;
    Some(match (family, module) {
        (Family::Llama, "self_attn.q_proj") => vec![(&mut block.q, 0)],
        (Family::Llama, "self_attn.k_proj") => vec![(&mut block.k, 0)],
        (Family::Llama, "self_attn.v_proj") => vec![(&mut block.v, 0)],
        (Family::Llama, "self_attn.o_proj") => vec![(&mut block.o, 0)],
        (Family::Gpt2, "attn.c_attn") => {
            vec![(&mut block.q, 0), (&mut block.k, h), (&mut block.v, 2 * h)]
        }
        (Family::Gpt2, "attn.c_proj") => vec![(&mut block.o, 0)],
        _ => match (&mut block.mlp, module) {
            (Mlp::SwiGlu { gate, .. }, "mlp.gate_proj") => vec![(gate, 0)],
            (Mlp::SwiGlu { up, .. }, "mlp.up_proj") => vec![(up, 0)],
            (Mlp::SwiGlu { down, .. }, "mlp.down_proj") => vec![(down, 0)],
            (Mlp::Gelu { fc, .. }, "mlp.c_fc") => vec![(fc, 0)],
            (Mlp::Gelu { proj, .. }, "mlp.c_proj") => vec![(proj, 0)],
            _ => return None,
        },
    })
}

/// Adds scale · (B·A) into `w`, a weight of `inp` inputs and `out` outputs
/// laid out as `layout`, taking B's rows `row0..row0 + out`. Each element is
/// W + scale · Σ_k B[o][k]·A[k][i] summed in k order whatever the layout, so
/// the in-memory merge and `crate::merge` give the same f32 bits.
pub(crate) fn add_delta(
    w: &mut [f32],
    layout: Layout,
    inp: usize,
    out: usize,
    row0: usize,
    ad: &Adapter,
) {
    let r = ad.r;
    match layout {
        Layout::OutIn => {
            let mut d = vec![0.0f32; inp];
            for o in 0..out {
                d.fill(0.0);
                let brow = &ad.b[(row0 + o) * r..(row0 + o + 1) * r];
                for (k, &bv) in brow.iter().enumerate() {
                    for (dv, &av) in d.iter_mut().zip(&ad.a[k * inp..(k + 1) * inp]) {
                        *dv += bv * av;
                    }
                }
                for (wv, dv) in w[o * inp..(o + 1) * inp].iter_mut().zip(&d) {
                    *wv += ad.scale * dv;
                }
            }
        }
        Layout::InOut => {
            let mut d = vec![0.0f32; out];
            for i in 0..inp {
                d.fill(0.0);
                for k in 0..r {
                    let av = ad.a[k * inp + i];
                    for (o, dv) in d.iter_mut().enumerate() {
                        *dv += ad.b[(row0 + o) * r + k] * av;
                    }
                }
                for (wv, dv) in w[i * out..(i + 1) * out].iter_mut().zip(&d) {
                    *wv += ad.scale * dv;
                }
            }
        }
    }
}

/// Checks every adapter before anything is merged: its key names a module
/// of the model, A is [r, in] and B [out, r] for that module, and every
/// value (and the scale) is finite. Errors name the tensor by peft's name
/// and `source` (the adapter file, or what holds the adapters).
pub fn check_adapters(config: &ModelConfig, adapters: &Adapters, source: &Path) -> Result<()> {
    let mut keys: Vec<&String> = adapters.keys().collect();
    keys.sort();
    let family = config.family;
    for key in keys {
        let ad = &adapters[key];
        let (inp, out) = module_dims(config, key).ok_or_else(|| LlmError::Adapter {
            path: source.to_path_buf(),
            what: format!(
                "adapter `{key}` names no module of {} ({} layers)",
                config.architecture, config.num_layers
            ),
        })?;
        for (part, values, shape) in [
            ("lora_A", &ad.a, [ad.r, inp]),
            ("lora_B", &ad.b, [out, ad.r]),
        ] {
            let name = peft_name(family, key, part);
            if ad.r == 0 || values.len() != shape[0] * shape[1] {
                return Err(LlmError::Adapter {
                    path: source.to_path_buf(),
                    what: format!(
                        "tensor `{name}` has {} values, but r {} on the module's [in {inp}, out {out}] needs shape {shape:?}",
                        values.len(),
                        ad.r
                    ),
                });
            }
            if let Some((index, &value)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                return Err(LlmError::NonFinite {
                    path: source.to_path_buf(),
                    name,
                    index,
                    value,
                });
            }
        }
        if !ad.scale.is_finite() {
            return Err(LlmError::Adapter {
                path: source.to_path_buf(),
                what: format!("adapter `{key}` has scale {}: not finite", ad.scale),
            });
        }
    }
    Ok(())
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> LlmError + '_ {
    move |source| LlmError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `bytes` to `path` through a temporary file in the same directory.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    let mut file = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    file.write_all(bytes).map_err(io(&tmp))?;
    file.sync_all().map_err(io(&tmp))?;
    drop(file);
    std::fs::rename(&tmp, path).map_err(io(path))
}

/// The checksum of an adapter file: CRC-32 over each tensor (sorted by
/// name: its name, dtype, rank, dims, byte count and bytes) and then r,
/// lora_alpha's f32 bits and use_rslora, written `crc32:xxxxxxxx`.
pub fn checksum<'a>(
    tensors: impl IntoIterator<Item = (&'a str, Dtype, &'a [usize], &'a [u8])>,
    config: &LoraConfig,
) -> String {
    let mut sorted: Vec<_> = tensors.into_iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    let mut h = crc32fast::Hasher::new();
    for (name, dtype, shape, bytes) in sorted {
        h.update(name.as_bytes());
        h.update(&[0]);
        h.update(format!("{dtype:?}").as_bytes());
        h.update(&[0]);
        h.update(&(shape.len() as u64).to_le_bytes());
        for &d in shape {
            h.update(&(d as u64).to_le_bytes());
        }
        h.update(&(bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    }
    h.update(&(config.r as u64).to_le_bytes());
    h.update(&config.alpha.to_bits().to_le_bytes());
    h.update(&[u8::from(config.use_rslora)]);
    format!("crc32:{:08x}", h.finalize())
}

/// Writes `adapters` into `dir` (made if missing) as peft writes them.
/// Every adapter key must be a module of a `config.target_modules` entry,
/// so the files read back.
pub fn save_adapters(
    dir: &Path,
    model: &Model,
    adapters: &Adapters,
    config: &LoraConfig,
) -> Result<()> {
    let mc = &model.config;
    let family = mc.family;
    let weights_path = dir.join(ADAPTER_WEIGHTS);
    check_targets(
        &weights_path,
        family,
        &mc.architecture,
        &config.target_modules,
    )?;
    let mut keys: Vec<&String> = adapters.keys().collect();
    keys.sort();
    let mut blobs: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for key in keys {
        let ad = &adapters[key];
        let (inp, out) = module_dims(mc, key).ok_or_else(|| LlmError::Adapter {
            path: weights_path.clone(),
            what: format!("adapter `{key}` names no module of the model"),
        })?;
        let layer = key_layer(family, key).unwrap_or(0);
        if !config
            .target_modules
            .iter()
            .any(|t| module_keys(family, layer, t).iter().any(|k| k == key))
        {
            return Err(LlmError::Adapter {
                path: weights_path.clone(),
                what: format!(
                    "adapter `{key}` is of no target_modules entry {:?}",
                    config.target_modules
                ),
            });
        }
        if ad.r != config.r || ad.a.len() != ad.r * inp || ad.b.len() != out * ad.r {
            return Err(LlmError::Adapter {
                path: weights_path.clone(),
                what: format!(
                    "adapter `{key}` has r {} and {} + {} values; r {} on [{out}, {inp}] needs {} + {}",
                    ad.r,
                    ad.a.len(),
                    ad.b.len(),
                    config.r,
                    config.r * inp,
                    out * config.r
                ),
            });
        }
        let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        blobs.push((
            peft_name(family, key, "lora_A"),
            vec![ad.r, inp],
            bytes(&ad.a),
        ));
        blobs.push((
            peft_name(family, key, "lora_B"),
            vec![out, ad.r],
            bytes(&ad.b),
        ));
    }
    let sum = checksum(
        blobs
            .iter()
            .map(|(n, shape, data)| (n.as_str(), Dtype::F32, shape.as_slice(), data.as_slice())),
        config,
    );
    let mut views = Vec::with_capacity(blobs.len());
    for (name, shape, data) in &blobs {
        let view = TensorView::new(Dtype::F32, shape.clone(), data).map_err(|source| {
            LlmError::Safetensors {
                path: weights_path.clone(),
                source,
            }
        })?;
        views.push((name.clone(), view));
    }
    // peft reads `format` and ignores other keys.
    let metadata = Some(
        [
            ("format".to_string(), "pt".to_string()),
            (CHECKSUM_KEY.to_string(), sum),
        ]
        .into_iter()
        .collect(),
    );
    let bytes =
        safetensors::serialize(views, metadata).map_err(|source| LlmError::Safetensors {
            path: weights_path.clone(),
            source,
        })?;
    let bytes = sorted_header(bytes, &weights_path)?;
    let json = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model.dir.display().to_string(),
        "r": config.r,
        "lora_alpha": shortest(config.alpha),
        "lora_dropout": shortest(config.dropout),
        "target_modules": config.target_modules,
        "bias": "none",
        // peft sets it for Conv1D (GPT-2), whose weight is [in, out].
        "fan_in_fan_out": family == Family::Gpt2,
        "use_rslora": config.use_rslora,
        "use_dora": false,
        "init_lora_weights": true,
        "inference_mode": true,
        "modules_to_save": null,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": null,
    });
    let config_path = dir.join(ADAPTER_CONFIG);
    let text = serde_json::to_string_pretty(&json).map_err(|source| LlmError::Json {
        path: config_path.clone(),
        source,
    })?;
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    // Weights first: a directory whose config exists has its weights.
    write_atomic(&weights_path, &bytes)?;
    write_atomic(&config_path, text.as_bytes())
}

/// Every target must be one of `family`'s module names.
fn check_targets(path: &Path, family: Family, arch: &str, target_modules: &[String]) -> Result<()> {
    let names = targets(family);
    if let Some(bad) = target_modules.iter().find(|t| !names.contains(&t.as_str())) {
        return Err(LlmError::Adapter {
            path: path.to_path_buf(),
            what: format!(
                "target_modules names `{bad}`, not a LoRA target of {arch}; its targets are {}",
                names.join(", ")
            ),
        });
    }
    Ok(())
}

/// A safetensors file's bytes with its header's keys in sorted order: the
/// crate writes the metadata map in a hash map's order, which differs from
/// one process to the next, and the same adapters must be the same bytes.
/// The tensors' offsets count from the data's start, so a header of
/// another length (padded with spaces to 8 bytes, as the format has it)
/// keeps them.
fn sorted_header(bytes: Vec<u8>, path: &Path) -> Result<Vec<u8>> {
    let broken = |what: &str| LlmError::Adapter {
        path: path.to_path_buf(),
        what: format!("internal: the serialised file {what}"),
    };
    let len_bytes: [u8; 8] = bytes
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| broken("has no header length"))?;
    let len =
        usize::try_from(u64::from_le_bytes(len_bytes)).map_err(|_| broken("header is too long"))?;
    let header = bytes
        .get(8..8 + len)
        .ok_or_else(|| broken("is shorter than its header"))?;
    // serde_json's map is ordered by key, so this writes every level sorted.
    let value: serde_json::Value =
        serde_json::from_slice(header).map_err(|source| LlmError::Json {
            path: path.to_path_buf(),
            source,
        })?;
    let mut text = serde_json::to_vec(&value).map_err(|source| LlmError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    while (8 + text.len()) % 8 != 0 {
        text.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + text.len() + bytes.len() - 8 - len);
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(&text);
    out.extend_from_slice(&bytes[8 + len..]);
    Ok(out)
}

/// An f32 as the f64 of its shortest decimal form, so 0.1 is written 0.1
/// and not 0.10000000149011612.
fn shortest(v: f32) -> f64 {
    v.to_string().parse().unwrap_or(f64::from(v))
}

fn key_error(path: &Path, key: &str, problem: &'static str, expected: &'static str) -> LlmError {
    LlmError::ConfigKey {
        path: path.to_path_buf(),
        key: key.into(),
        problem,
        expected,
    }
}

/// Reads `dir/adapter_config.json` on its own: targets of either family
/// (Llama's or GPT-2's names) and either `fan_in_fan_out`;
/// [`read_config_for`] checks them against a family.
pub fn read_config(dir: &Path) -> Result<LoraConfig> {
    read_config_raw(dir).map(|(config, _)| config)
}

/// Reads `dir/adapter_config.json` for a model of `family`: every target
/// one of the family's (`lora::targets`), and `fan_in_fan_out` true for
/// GPT-2 (its Conv1D weights are [in, out]; peft sets it) and false for the
/// Llama family (a missing key is peft's default, false, and accepted for
/// GPT-2 too: peft itself turns it on for Conv1D).
pub fn read_config_for(dir: &Path, family: Family, arch: &str) -> Result<LoraConfig> {
    let path = dir.join(ADAPTER_CONFIG);
    let (config, fan_in_fan_out) = read_config_raw(dir)?;
    check_targets(&path, family, arch, &config.target_modules)?;
    match (family, fan_in_fan_out) {
        (Family::Llama, Some(true)) => Err(LlmError::Adapter {
            path,
            what: format!(
                "`fan_in_fan_out` is true, which describes [in, out] (Conv1D) weights; {arch} stores its Linear weights [out, in] (fan_in_fan_out false)"
            ),
        }),
        (Family::Gpt2, Some(false)) => Err(LlmError::Adapter {
            path,
            what: format!(
                "`fan_in_fan_out` is false, but {arch}'s Conv1D weights are [in, out] (peft writes fan_in_fan_out true for them)"
            ),
        }),
        _ => Ok(config),
    }
}

/// The config and `fan_in_fan_out` as written (None when absent).
fn read_config_raw(dir: &Path) -> Result<(LoraConfig, Option<bool>)> {
    let path = dir.join(ADAPTER_CONFIG);
    let text = std::fs::read_to_string(&path).map_err(io(&path))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|source| LlmError::Json {
        path: path.clone(),
        source,
    })?;
    if v.get("peft_type").and_then(|t| t.as_str()) != Some("LORA") {
        return Err(key_error(
            &path,
            "peft_type",
            "missing or not LORA",
            "\"LORA\"",
        ));
    }
    let r = v
        .get("r")
        .and_then(serde_json::Value::as_u64)
        .filter(|&r| r > 0)
        .ok_or_else(|| key_error(&path, "r", "missing or not a positive integer", "r ≥ 1"))?
        as usize;
    let alpha = v
        .get("lora_alpha")
        .and_then(serde_json::Value::as_f64)
        .ok_or_else(|| key_error(&path, "lora_alpha", "missing or not a number", "a number"))?
        as f32;
    let dropout = v
        .get("lora_dropout")
        .and_then(serde_json::Value::as_f64)
        .unwrap_or(0.0) as f32;
    let use_rslora = v
        .get("use_rslora")
        .and_then(serde_json::Value::as_bool)
        .unwrap_or(false);
    let targets = v
        .get("target_modules")
        .and_then(serde_json::Value::as_array)
        .ok_or_else(|| {
            key_error(
                &path,
                "target_modules",
                "missing or not a list (a regular expression is not supported)",
                "a list of module names",
            )
        })?;
    let mut target_modules = BTreeSet::new();
    for t in targets {
        let t = t
            .as_str()
            .filter(|t| TARGETS.contains(t) || GPT2_TARGETS.contains(t))
            .ok_or_else(|| {
                key_error(
                    &path,
                    "target_modules",
                    "names a module LoRA here does not cover",
                    "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (Llama family) or c_attn, c_proj, c_fc (GPT-2)",
                )
            })?;
        target_modules.insert(t.to_string());
    }
    let fan_in_fan_out = v.get("fan_in_fan_out").and_then(|x| x.as_bool());
    // Settings that change what the files mean and that this reader does not apply.
    let unsupported = [
        (
            "use_dora",
            v.get("use_dora").and_then(|x| x.as_bool()) == Some(true),
        ),
        (
            "bias",
            v.get("bias")
                .and_then(|x| x.as_str())
                .is_some_and(|b| b != "none"),
        ),
        (
            "rank_pattern",
            v.get("rank_pattern")
                .and_then(|x| x.as_object())
                .is_some_and(|o| !o.is_empty()),
        ),
        (
            "alpha_pattern",
            v.get("alpha_pattern")
                .and_then(|x| x.as_object())
                .is_some_and(|o| !o.is_empty()),
        ),
        (
            "layers_to_transform",
            v.get("layers_to_transform").is_some_and(|x| !x.is_null()),
        ),
        (
            "modules_to_save",
            v.get("modules_to_save").is_some_and(|x| !x.is_null()),
        ),
    ];
    if let Some((key, _)) = unsupported.iter().find(|(_, set)| *set) {
        return Err(LlmError::Unsupported {
            path,
            what: format!("`{key}` as set here"),
        });
    }
    Ok((
        LoraConfig {
            r,
            alpha,
            dropout,
            target_modules: target_modules.into_iter().collect(),
            use_rslora,
        },
        fan_in_fan_out,
    ))
}

/// Reads the adapters of `dir` (peft's files) for `model`: every layer's
/// `target_modules`, checked against the base's shapes and the config's r,
/// and the checksum when the file records one.
pub fn load_adapters(dir: &Path, model: &Model) -> Result<(Adapters, LoraConfig)> {
    load_for(dir, &model.config)
}

/// [`load_adapters`] against a model's config alone (no weights loaded).
pub fn load_for(dir: &Path, mc: &ModelConfig) -> Result<(Adapters, LoraConfig)> {
    let family = mc.family;
    let config = read_config_for(dir, family, &mc.architecture)?;
    let path: PathBuf = dir.join(ADAPTER_WEIGHTS);
    let store = WeightStore::open_file(&path)?;
    let mut adapters = Adapters::new();
    let mut used = BTreeSet::new();
    for layer in 0..mc.num_layers {
        for target in &config.target_modules {
            for key in module_keys(family, layer, target) {
                let (inp, out) = module_dims(mc, &key).ok_or_else(|| LlmError::Adapter {
                    path: path.clone(),
                    what: format!("`{key}` is not a module of the base model"),
                })?;
                let a_name = peft_name(family, &key, "lora_A");
                let b_name = peft_name(family, &key, "lora_B");
                for name in [&a_name, &b_name] {
                    let Some(shape) = store.shape(name) else {
                        return Err(LlmError::MissingTensor {
                            path: path.clone(),
                            name: name.clone(),
                        });
                    };
                    let rank = if name == &a_name {
                        shape.first()
                    } else {
                        shape.get(1)
                    };
                    if shape.len() == 2 && rank != Some(&config.r) {
                        return Err(LlmError::Adapter {
                            path: path.clone(),
                            what: format!(
                                "tensor `{name}` has shape {shape:?}: rank {} disagrees with r = {} in {ADAPTER_CONFIG}",
                                rank.copied().unwrap_or(0),
                                config.r
                            ),
                        });
                    }
                }
                let a = store.take(&a_name, &[config.r, inp])?.data;
                let b = store.take(&b_name, &[out, config.r])?.data;
                used.insert(a_name);
                used.insert(b_name);
                adapters.insert(
                    key,
                    Adapter {
                        a,
                        b,
                        r: config.r,
                        scale: config.scale(),
                    },
                );
            }
        }
    }
    let names = store.names();
    if let Some(extra) = names.iter().find(|n| !used.contains(*n)) {
        return Err(LlmError::Adapter {
            path,
            what: format!(
                "tensor `{extra}` is not a lora_A/lora_B of the target_modules {:?} on {} layers",
                config.target_modules, mc.num_layers
            ),
        });
    }
    if let Some(recorded) = store.file_metadata().and_then(|m| m.get(CHECKSUM_KEY)) {
        let mut tensors = Vec::with_capacity(names.len());
        for name in &names {
            if let Some((info, bytes, _)) = store.raw(name) {
                tensors.push((name.as_str(), info.dtype, info.shape.as_slice(), bytes));
            }
        }
        let computed = checksum(tensors, &config);
        if &computed != recorded {
            return Err(LlmError::Checksum {
                path,
                recorded: recorded.clone(),
                computed,
            });
        }
    }
    Ok((adapters, config))
}

impl Model {
    /// Adds each adapter's scale · B·A into its base weight (as the
    /// checkpoint lays it out: [out, in], or GPT-2's [in, out] with
    /// `c_attn`'s B rows split over q, k and v), so every forward (the
    /// cache, `generate`) runs the adapted model. Every adapter is checked
    /// first ([`check_adapters`]): on an error nothing is merged.
    pub fn merge_adapters(&mut self, adapters: &Adapters) -> Result<()> {
        check_adapters(
            &self.config,
            adapters,
            Path::new("adapters being merged in memory"),
        )?;
        for (key, ad) in adapters {
            let Some(parts) = modules_mut(self, key) else {
                return Err(LlmError::Input(format!(
                    "adapter `{key}` names no module of the model"
                )));
            };
            for (lin, row0) in parts {
                add_delta(lin.weight.f32_mut(), lin.layout, lin.inp, lin.out, row0, ad);
            }
        }
        Ok(())
    }
}
