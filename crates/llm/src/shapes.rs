//! Model directories of published shapes with random weights, for the
//! benchmarks (no weights can be downloaded here, and a speed or memory
//! figure depends on the shapes alone). Each preset is the model's own
//! config.json values; the weights are bf16 (as those models ship), drawn
//! uniformly with the config's standard deviation (norms at 1), and written
//! as one `model.safetensors` by a temporary name and a rename. Memory: the
//! whole file's bytes once (2 bytes a parameter) while it is written.

use std::path::Path;

use half::bf16;
use serde_json::{json, Value};

use crate::error::{LlmError, Result};

/// A published model's shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    SmolLm2_360M,
    Qwen25_05B,
    Llama32_1B,
}

impl Preset {
    pub const ALL: [Preset; 3] = [Preset::SmolLm2_360M, Preset::Qwen25_05B, Preset::Llama32_1B];

    pub fn name(self) -> &'static str {
        match self {
            Preset::SmolLm2_360M => "smollm2-360m",
            Preset::Qwen25_05B => "qwen2.5-0.5b",
            Preset::Llama32_1B => "llama-3.2-1b",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }

    /// The config.json of the preset, with `layers` blocks when given (a
    /// shorter model of the same widths, for quick runs).
    pub fn config(self, layers: Option<usize>) -> Value {
        let mut config = match self {
            Preset::SmolLm2_360M => json!({
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 960,
                "intermediate_size": 2560,
                "num_attention_heads": 15,
                "num_key_value_heads": 5,
                "num_hidden_layers": 32,
                "vocab_size": 49152,
                "max_position_embeddings": 8192,
                "rms_norm_eps": 1e-5,
                "rope_theta": 100000.0,
                "hidden_act": "silu",
                "tie_word_embeddings": true,
                "initializer_range": 0.02,
                "bos_token_id": 1,
                "eos_token_id": 2,
                "torch_dtype": "bfloat16",
            }),
            Preset::Qwen25_05B => json!({
                "architectures": ["Qwen2ForCausalLM"],
                "model_type": "qwen2",
                "hidden_size": 896,
                "intermediate_size": 4864,
                "num_attention_heads": 14,
                "num_key_value_heads": 2,
                "num_hidden_layers": 24,
                "vocab_size": 151936,
                "max_position_embeddings": 32768,
                "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0,
                "hidden_act": "silu",
                "tie_word_embeddings": true,
                "use_sliding_window": false,
                "initializer_range": 0.02,
                "bos_token_id": 151643,
                "eos_token_id": 151643,
                "torch_dtype": "bfloat16",
            }),
            Preset::Llama32_1B => json!({
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 2048,
                "intermediate_size": 8192,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 64,
                "num_hidden_layers": 16,
                "vocab_size": 128256,
                "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5,
                "rope_theta": 500000.0,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 32.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192
                },
                "hidden_act": "silu",
                "tie_word_embeddings": true,
                "initializer_range": 0.02,
                "bos_token_id": 128000,
                "eos_token_id": 128001,
                "torch_dtype": "bfloat16",
            }),
        };
        if let (Some(layers), Some(map)) = (layers, config.as_object_mut()) {
            map.insert("num_hidden_layers".into(), json!(layers));
        }
        config
    }
}

/// The tensors (name, shape, is a norm) of a Llama-family config.
fn llama_tensors(config: &Value) -> Result<Vec<(String, Vec<usize>, bool)>> {
    let get = |key: &str| -> Result<usize> {
        config[key]
            .as_u64()
            .map(|v| v as usize)
            .ok_or_else(|| LlmError::Input(format!("preset config has no integer `{key}`")))
    };
    let (h, inter, heads, kv, layers, vocab) = (
        get("hidden_size")?,
        get("intermediate_size")?,
        get("num_attention_heads")?,
        get("num_key_value_heads")?,
        get("num_hidden_layers")?,
        get("vocab_size")?,
    );
    let hd = config["head_dim"]
        .as_u64()
        .map_or(h / heads, |v| v as usize);
    let qkv_bias = config["model_type"] == "qwen2";
    let mut t = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![vocab, h],
        false,
    )];
    for i in 0..layers {
        let p = format!("model.layers.{i}");
        t.push((format!("{p}.input_layernorm.weight"), vec![h], true));
        for (name, out) in [
            ("q_proj", heads * hd),
            ("k_proj", kv * hd),
            ("v_proj", kv * hd),
        ] {
            t.push((format!("{p}.self_attn.{name}.weight"), vec![out, h], false));
            if qkv_bias {
                t.push((format!("{p}.self_attn.{name}.bias"), vec![out], false));
            }
        }
        t.push((
            format!("{p}.self_attn.o_proj.weight"),
            vec![h, heads * hd],
            false,
        ));
        t.push((
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            true,
        ));
        t.push((format!("{p}.mlp.gate_proj.weight"), vec![inter, h], false));
        t.push((format!("{p}.mlp.up_proj.weight"), vec![inter, h], false));
        t.push((format!("{p}.mlp.down_proj.weight"), vec![h, inter], false));
    }
    t.push(("model.norm.weight".into(), vec![h], true));
    if config["tie_word_embeddings"] == false {
        t.push(("lm_head.weight".into(), vec![vocab, h], false));
    }
    Ok(t)
}

/// Writes `dir/config.json` and `dir/model.safetensors` for `preset`
/// (random weights from `seed`); returns the parameter count.
pub fn write_random(dir: &Path, preset: Preset, layers: Option<usize>, seed: u64) -> Result<usize> {
    write_random_config(dir, &preset.config(layers), seed)
}

/// [`write_random`] for any Llama-family `config` (the keys a preset's
/// has: `hidden_size`, `intermediate_size`, the heads, the layers,
/// `vocab_size`, `tie_word_embeddings`, `initializer_range`, optionally
/// `head_dim`).
pub fn write_random_config(dir: &Path, config: &Value, seed: u64) -> Result<usize> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| LlmError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tensors = llama_tensors(config)?;
    let std = config["initializer_range"].as_f64().unwrap_or(0.02);
    let bound = std * 3f64.sqrt();
    let mut state = seed;
    let mut blobs = Vec::with_capacity(tensors.len());
    let mut params = 0usize;
    for (name, shape, norm) in tensors {
        let count: usize = shape.iter().product();
        params += count;
        let mut bytes = Vec::with_capacity(count * 2);
        for _ in 0..count {
            let value = if norm {
                1.0
            } else {
                let z = crate::math::splitmix64(&mut state);
                let u = (z >> 11) as f64 / (1u64 << 53) as f64;
                (u * 2.0 - 1.0) * bound
            };
            bytes.extend_from_slice(&bf16::from_f64(value).to_le_bytes());
        }
        blobs.push((name, shape, bytes));
    }
    let weights = dir.join("model.safetensors");
    let mut views = Vec::with_capacity(blobs.len());
    for (name, shape, bytes) in &blobs {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, shape.clone(), bytes)
                .map_err(|source| LlmError::Safetensors {
                    path: weights.clone(),
                    source,
                })?;
        views.push((name.clone(), view));
    }
    let metadata = Some(
        [("format".to_string(), "pt".to_string())]
            .into_iter()
            .collect(),
    );
    let partial = dir.join("model.safetensors.partial");
    safetensors::serialize_to_file(views, metadata, &partial).map_err(|source| {
        LlmError::Safetensors {
            path: partial.clone(),
            source,
        }
    })?;
    std::fs::rename(&partial, &weights).map_err(io(&weights))?;
    let text = serde_json::to_string_pretty(config).map_err(|source| LlmError::Json {
        path: dir.join("config.json"),
        source,
    })?;
    let config_path = dir.join("config.json");
    std::fs::write(&config_path, text).map_err(io(&config_path))?;
    Ok(params)
}
