//! `config.json` read into one `ModelConfig` for both families. Only the keys
//! the forward pass needs are read; each is checked for presence and type and
//! a failure names the file and the key. Both spellings of the RoPE settings
//! are read: `rope_theta` + `rope_scaling` (transformers 4) and
//! `rope_parameters` (transformers 5).

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{LlmError, Result};

/// The `architectures` values this crate runs.
pub const SUPPORTED: &[&str] = &[
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "GPT2LMHeadModel",
];

/// The two block layouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Llama, Mistral, Qwen2: RMSNorm, RoPE, grouped-query attention, SwiGLU.
    Llama,
    /// GPT-2: learned positions, LayerNorm, Conv1D weights, gelu_new.
    Gpt2,
}

/// How RoPE's inverse frequencies are made.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Llama 3's band-wise scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub architecture: String,
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub norm_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    /// q/k/v projections carry a bias (Qwen2; GPT-2 always has biases).
    pub attention_bias: bool,
    /// The attention's output projection carries a bias (Llama's
    /// `attention_bias`, GPT-2; not Qwen2).
    pub o_bias: bool,
    /// The MLP's projections carry biases (Llama's `mlp_bias`, GPT-2).
    pub mlp_bias: bool,
    pub tie_word_embeddings: bool,
    /// GPT-2's learned positions; the longest sequence it can run.
    pub max_positions: Option<usize>,
    /// Mistral's sliding window: a query sees the keys less than this many
    /// positions before it.
    pub sliding_window: Option<usize>,
    pub eos_token_ids: Vec<u32>,
    /// `pad_token_id` (None when absent or null): what a fine-tuning batch
    /// pads its shorter rows with.
    pub pad_token_id: Option<u32>,
}

struct Keys<'a> {
    path: &'a Path,
    map: &'a Map<String, Value>,
}

impl Keys<'_> {
    fn err(&self, key: &str, problem: &'static str, expected: &'static str) -> LlmError {
        LlmError::ConfigKey {
            path: self.path.to_path_buf(),
            key: key.to_string(),
            problem,
            expected,
        }
    }

    fn usize(&self, key: &str) -> Result<usize> {
        match self.map.get(key) {
            None => Err(self.err(key, "missing", "a positive integer")),
            Some(v) => v
                .as_u64()
                .filter(|&n| n > 0)
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| self.err(key, "wrong type or value", "a positive integer")),
        }
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(_) => self.usize(key).map(Some),
        }
    }

    fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| self.err(key, "wrong type", "a number")),
        }
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.err(key, "wrong type", "true or false")),
        }
    }

    fn str_or<'s>(&'s self, key: &str, default: &'s str) -> Result<&'s str> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_str()
                .ok_or_else(|| self.err(key, "wrong type", "a string")),
        }
    }
}

impl ModelConfig {
    /// Reads `<dir>/config.json`.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| LlmError::Io {
            path: path.clone(),
            source,
        })?;
        Self::parse(&text, &path)
    }

    /// Parses the text of a config.json (`path` is only for messages).
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        let value: Value = serde_json::from_str(text).map_err(|source| LlmError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        let map = value.as_object().ok_or_else(|| LlmError::ConfigKey {
            path: path.to_path_buf(),
            key: "(top level)".into(),
            problem: "not an object",
            expected: "a JSON object",
        })?;
        let keys = Keys { path, map };
        let architectures: Vec<String> = match map.get("architectures") {
            None => return Err(keys.err("architectures", "missing", "a list of class names")),
            Some(v) => v
                .as_array()
                .and_then(|a| a.iter().map(|s| s.as_str().map(String::from)).collect())
                .ok_or_else(|| keys.err("architectures", "wrong type", "a list of strings"))?,
        };
        let Some(architecture) = architectures
            .iter()
            .find(|a| SUPPORTED.contains(&a.as_str()))
            .cloned()
        else {
            return Err(LlmError::UnsupportedArchitecture {
                path: path.to_path_buf(),
                found: architectures,
                supported: SUPPORTED,
            });
        };
        let eos_token_ids = match map.get("eos_token_id") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| {
                    keys.err("eos_token_id", "wrong type", "a token id or a list of them")
                })?,
            Some(v) => vec![v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| {
                    keys.err("eos_token_id", "wrong type", "a token id or a list of them")
                })?],
        };
        let pad_token_id = match map.get("pad_token_id") {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                v.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| keys.err("pad_token_id", "wrong type", "a token id or null"))?,
            ),
        };
        let mut config = if architecture == "GPT2LMHeadModel" {
            Self::gpt2(&keys, architecture, eos_token_ids)
        } else {
            Self::llama(&keys, architecture, eos_token_ids)
        }?;
        config.pad_token_id = pad_token_id;
        Ok(config)
    }

    fn gpt2(keys: &Keys, architecture: String, eos_token_ids: Vec<u32>) -> Result<Self> {
        let hidden = keys.usize("n_embd")?;
        let heads = keys.usize("n_head")?;
        if hidden % heads != 0 {
            return Err(keys.err("n_head", "does not divide n_embd", "a divisor of n_embd"));
        }
        let act = keys.str_or("activation_function", "gelu_new")?;
        if act != "gelu_new" {
            return Err(LlmError::Unsupported {
                path: keys.path.to_path_buf(),
                what: format!("activation_function = {act:?} (gelu_new is)"),
            });
        }
        for (key, default) in [
            ("scale_attn_by_inverse_layer_idx", false),
            ("reorder_and_upcast_attn", false),
        ] {
            if keys.bool_or(key, default)? {
                return Err(LlmError::Unsupported {
                    path: keys.path.to_path_buf(),
                    what: format!("{key} = true"),
                });
            }
        }
        let inner = keys.opt_usize("n_inner")?.unwrap_or(4 * hidden);
        Ok(Self {
            architecture,
            family: Family::Gpt2,
            vocab_size: keys.usize("vocab_size")?,
            hidden_size: hidden,
            intermediate_size: inner,
            num_layers: keys.usize("n_layer")?,
            num_heads: heads,
            num_kv_heads: heads,
            head_dim: hidden / heads,
            norm_eps: keys.f64_or("layer_norm_epsilon", 1e-5)? as f32,
            rope_theta: 0.0,
            rope_scaling: RopeScaling::None,
            attention_bias: true,
            o_bias: true,
            mlp_bias: true,
            tie_word_embeddings: keys.bool_or("tie_word_embeddings", true)?,
            max_positions: Some(keys.usize("n_positions")?),
            sliding_window: None,
            eos_token_ids,
            pad_token_id: None,
        })
    }

    fn llama(keys: &Keys, architecture: String, eos_token_ids: Vec<u32>) -> Result<Self> {
        let hidden = keys.usize("hidden_size")?;
        let heads = keys.usize("num_attention_heads")?;
        let kv_heads = keys.opt_usize("num_key_value_heads")?.unwrap_or(heads);
        if heads % kv_heads != 0 {
            return Err(keys.err(
                "num_key_value_heads",
                "does not divide num_attention_heads",
                "a divisor of num_attention_heads",
            ));
        }
        let head_dim = match keys.opt_usize("head_dim")? {
            Some(d) => d,
            None if hidden % heads == 0 => hidden / heads,
            None => {
                return Err(keys.err(
                    "num_attention_heads",
                    "does not divide hidden_size",
                    "a divisor of hidden_size",
                ))
            }
        };
        if head_dim % 2 != 0 {
            return Err(keys.err("head_dim", "is odd", "an even head size for RoPE"));
        }
        let act = keys.str_or("hidden_act", "silu")?;
        if act != "silu" {
            return Err(LlmError::Unsupported {
                path: keys.path.to_path_buf(),
                what: format!("hidden_act = {act:?} (silu is)"),
            });
        }
        let sliding = keys.bool_or("use_sliding_window", false)?;
        if sliding {
            return Err(LlmError::Unsupported {
                path: keys.path.to_path_buf(),
                what: "use_sliding_window = true".into(),
            });
        }
        let qwen = architecture == "Qwen2ForCausalLM";
        let (rope_theta, rope_scaling) = rope(keys)?;
        Ok(Self {
            family: Family::Llama,
            vocab_size: keys.usize("vocab_size")?,
            hidden_size: hidden,
            intermediate_size: keys.usize("intermediate_size")?,
            num_layers: keys.usize("num_hidden_layers")?,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            norm_eps: keys.f64_or("rms_norm_eps", 1e-6)? as f32,
            rope_theta,
            rope_scaling,
            attention_bias: qwen || keys.bool_or("attention_bias", false)?,
            o_bias: !qwen && keys.bool_or("attention_bias", false)?,
            mlp_bias: keys.bool_or("mlp_bias", false)?,
            tie_word_embeddings: keys.bool_or("tie_word_embeddings", false)?,
            max_positions: None,
            sliding_window: if architecture == "MistralForCausalLM" {
                keys.opt_usize("sliding_window")?
            } else {
                None
            },
            eos_token_ids,
            pad_token_id: None,
            architecture,
        })
    }
}

/// RoPE's base and scaling, from `rope_parameters` or `rope_theta` +
/// `rope_scaling`.
fn rope(keys: &Keys) -> Result<(f64, RopeScaling)> {
    let (key, params) = match keys.map.get("rope_parameters") {
        Some(Value::Object(p)) => ("rope_parameters", Some(p)),
        Some(Value::Null) | None => match keys.map.get("rope_scaling") {
            Some(Value::Object(p)) => ("rope_scaling", Some(p)),
            Some(Value::Null) | None => ("rope_scaling", None),
            Some(_) => return Err(keys.err("rope_scaling", "wrong type", "an object or null")),
        },
        Some(_) => return Err(keys.err("rope_parameters", "wrong type", "an object")),
    };
    let mut theta = keys.f64_or("rope_theta", 10000.0)?;
    let Some(params) = params else {
        return Ok((theta, RopeScaling::None));
    };
    let sub_path: PathBuf = keys.path.to_path_buf();
    let sub = Keys {
        path: &sub_path,
        map: params,
    };
    if params.contains_key("rope_theta") {
        theta = sub.f64_or("rope_theta", theta)?;
    }
    let kind = match params.get("rope_type").or_else(|| params.get("type")) {
        None | Some(Value::Null) => "default",
        Some(v) => v
            .as_str()
            .ok_or_else(|| keys.err(key, "rope_type of the wrong type", "a string"))?,
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "llama3" => {
            let need = |name: &'static str| -> Result<f64> {
                params
                    .get(name)
                    .and_then(Value::as_f64)
                    .ok_or_else(|| LlmError::ConfigKey {
                        path: keys.path.to_path_buf(),
                        key: format!("{key}.{name}"),
                        problem: "missing or not a number",
                        expected: "a number (llama3 RoPE scaling)",
                    })
            };
            RopeScaling::Llama3 {
                factor: need("factor")?,
                low_freq_factor: need("low_freq_factor")?,
                high_freq_factor: need("high_freq_factor")?,
                original_max_position_embeddings: need("original_max_position_embeddings")?,
            }
        }
        other => {
            return Err(LlmError::Unsupported {
                path: keys.path.to_path_buf(),
                what: format!("{key}.rope_type = {other:?} (default and llama3 are)"),
            })
        }
    };
    Ok((theta, scaling))
}
