//! LoRA adapters in peft's files, both ways: `adapter_model.safetensors`
//! (`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight` [r, in],
//! `….lora_B.weight` [out, r], f32) and `adapter_config.json` (the keys
//! `PeftModel.from_pretrained` reads), so adapters trained here load in peft
//! and peft's load here. Both files are written to a temporary name, synced
//! and renamed, so a reader never sees half a file. Reading checks every
//! tensor against the base model and the config and names the file and
//! tensor when one does not fit; a tensor no target explains is an error,
//! not skipped. Memory: the adapters' f32 values, once.
//!
//! Merging (`Model::merge_adapters`) adds scale · B·A into the base weights,
//! so the cached forward and `generate` run adapted models unchanged.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};

use crate::config::Family;
use crate::error::{LlmError, Result};
use crate::lora::{Adapter, Adapters, TARGETS};
use crate::model::{Linear, Mlp, Model};
use crate::weights::WeightStore;

pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
pub const ADAPTER_CONFIG: &str = "adapter_config.json";

/// peft's prefix before a Llama-family module key (`layers.N.…`).
const PREFIX: &str = "base_model.model.model.";

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

/// The projection a module key (`layers.N.self_attn.q_proj`) names.
fn module_mut<'a>(model: &'a mut Model, key: &str) -> Option<&'a mut Linear> {
    let rest = key.strip_prefix("layers.")?;
    let (layer, module) = rest.split_once('.')?;
    let block = model.blocks.get_mut(layer.parse::<usize>().ok()?)?;
    match module {
        "self_attn.q_proj" => Some(&mut block.q),
        "self_attn.k_proj" => Some(&mut block.k),
        "self_attn.v_proj" => Some(&mut block.v),
        "self_attn.o_proj" => Some(&mut block.o),
        _ => match (&mut block.mlp, module) {
            (Mlp::SwiGlu { gate, .. }, "mlp.gate_proj") => Some(gate),
            (Mlp::SwiGlu { up, .. }, "mlp.up_proj") => Some(up),
            (Mlp::SwiGlu { down, .. }, "mlp.down_proj") => Some(down),
            _ => None,
        },
    }
}

/// (in, out) of the projection a key names.
fn module_dims(model: &Model, key: &str) -> Option<(usize, usize)> {
    let rest = key.strip_prefix("layers.")?;
    let (layer, module) = rest.split_once('.')?;
    let block = model.blocks.get(layer.parse::<usize>().ok()?)?;
    let lin = match module {
        "self_attn.q_proj" => &block.q,
        "self_attn.k_proj" => &block.k,
        "self_attn.v_proj" => &block.v,
        "self_attn.o_proj" => &block.o,
        _ => match (&block.mlp, module) {
            (Mlp::SwiGlu { gate, .. }, "mlp.gate_proj") => gate,
            (Mlp::SwiGlu { up, .. }, "mlp.up_proj") => up,
            (Mlp::SwiGlu { down, .. }, "mlp.down_proj") => down,
            _ => return None,
        },
    };
    Some((lin.inp, lin.out))
}

/// The module key of `target` in `layer`.
fn key_of(layer: usize, target: &str) -> String {
    let part = match target {
        "q_proj" | "k_proj" | "v_proj" | "o_proj" => "self_attn",
        _ => "mlp",
    };
    format!("layers.{layer}.{part}.{target}")
}

fn llama_only(model: &Model, what: &str) -> Result<()> {
    if model.config.family != Family::Llama {
        return Err(LlmError::Unsupported {
            path: model.dir.join("config.json"),
            what: format!("{what} on {}", model.config.architecture),
        });
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

/// Writes `adapters` into `dir` (made if missing) as peft writes them.
pub fn save_adapters(
    dir: &Path,
    model: &Model,
    adapters: &Adapters,
    config: &LoraConfig,
) -> Result<()> {
    llama_only(model, "LoRA adapter files")?;
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let weights_path = dir.join(ADAPTER_WEIGHTS);
    let mut keys: Vec<&String> = adapters.keys().collect();
    keys.sort();
    let mut blobs: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for key in keys {
        let ad = &adapters[key];
        let (inp, out) = module_dims(model, key).ok_or_else(|| LlmError::Adapter {
            path: weights_path.clone(),
            what: format!("adapter `{key}` names no module of the model"),
        })?;
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
            format!("{PREFIX}{key}.lora_A.weight"),
            vec![ad.r, inp],
            bytes(&ad.a),
        ));
        blobs.push((
            format!("{PREFIX}{key}.lora_B.weight"),
            vec![out, ad.r],
            bytes(&ad.b),
        ));
    }
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
    let metadata = Some(
        [("format".to_string(), "pt".to_string())]
            .into_iter()
            .collect(),
    );
    let bytes =
        safetensors::serialize(views, metadata).map_err(|source| LlmError::Safetensors {
            path: weights_path.clone(),
            source,
        })?;
    let json = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model.dir.display().to_string(),
        "r": config.r,
        "lora_alpha": shortest(config.alpha),
        "lora_dropout": shortest(config.dropout),
        "target_modules": config.target_modules,
        "bias": "none",
        "fan_in_fan_out": false,
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
    // Weights first: a directory whose config exists has its weights.
    write_atomic(&weights_path, &bytes)?;
    write_atomic(&config_path, text.as_bytes())
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

/// Reads `dir/adapter_config.json`.
pub fn read_config(dir: &Path) -> Result<LoraConfig> {
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
        let t = t.as_str().filter(|t| TARGETS.contains(t)).ok_or_else(|| {
            key_error(
                &path,
                "target_modules",
                "names a module LoRA here does not cover",
                "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj",
            )
        })?;
        target_modules.insert(t.to_string());
    }
    // Settings that change what the files mean and that this reader does not apply.
    let unsupported = [
        (
            "use_dora",
            v.get("use_dora").and_then(|x| x.as_bool()) == Some(true),
        ),
        (
            "fan_in_fan_out",
            v.get("fan_in_fan_out").and_then(|x| x.as_bool()) == Some(true),
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
    Ok(LoraConfig {
        r,
        alpha,
        dropout,
        target_modules: target_modules.into_iter().collect(),
        use_rslora,
    })
}

/// Reads the adapters of `dir` (peft's files) for `model`: every layer's
/// `target_modules`, checked against the base's shapes and the config's r.
pub fn load_adapters(dir: &Path, model: &Model) -> Result<(Adapters, LoraConfig)> {
    llama_only(model, "LoRA adapter files")?;
    let config = read_config(dir)?;
    let path: PathBuf = dir.join(ADAPTER_WEIGHTS);
    let store = WeightStore::open_file(&path)?;
    let mut adapters = Adapters::new();
    let mut used = BTreeSet::new();
    for layer in 0..model.blocks.len() {
        for target in &config.target_modules {
            let key = key_of(layer, target);
            let (inp, out) = module_dims(model, &key).ok_or_else(|| LlmError::Adapter {
                path: path.clone(),
                what: format!("`{key}` is not a module of the base model"),
            })?;
            let a_name = format!("{PREFIX}{key}.lora_A.weight");
            let b_name = format!("{PREFIX}{key}.lora_B.weight");
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
    if let Some(extra) = store.names().into_iter().find(|n| !used.contains(n)) {
        return Err(LlmError::Adapter {
            path,
            what: format!(
                "tensor `{extra}` is not a lora_A/lora_B of the target_modules {:?} on {} layers",
                config.target_modules,
                model.blocks.len()
            ),
        });
    }
    Ok((adapters, config))
}

impl Model {
    /// Adds each adapter's scale · B·A into its base weight ([out, in]), so
    /// every forward (the cache, `generate`) runs the adapted model.
    pub fn merge_adapters(&mut self, adapters: &Adapters) -> Result<()> {
        llama_only(self, "merging LoRA adapters")?;
        for (key, ad) in adapters {
            let lin = module_mut(self, key).ok_or_else(|| {
                LlmError::Input(format!("adapter `{key}` names no module of the model"))
            })?;
            let (inp, out) = (lin.inp, lin.out);
            if ad.a.len() != ad.r * inp || ad.b.len() != out * ad.r {
                return Err(LlmError::Input(format!(
                    "adapter `{key}`: A {} and B {} values do not fit [{out}, {inp}] at r {}",
                    ad.a.len(),
                    ad.b.len(),
                    ad.r
                )));
            }
            for o in 0..out {
                let brow = &ad.b[o * ad.r..(o + 1) * ad.r];
                let wrow = &mut lin.weight[o * inp..(o + 1) * inp];
                for (k, &bv) in brow.iter().enumerate() {
                    let arow = &ad.a[k * inp..(k + 1) * inp];
                    for (w, &av) in wrow.iter_mut().zip(arow) {
                        *w += ad.scale * bv * av;
                    }
                }
            }
        }
        Ok(())
    }
}
