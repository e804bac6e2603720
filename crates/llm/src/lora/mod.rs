//! LoRA adapters on a loaded model (Llama family and GPT-2, by Hugging
//! Face module names) and the gradients of the causal-LM loss with respect
//! to the adapters alone: the base is frozen, so no weight gradient is
//! formed there. `full` runs the same pass with the weights' gradients
//! switched on instead (a full fine-tune: [`WeightGrads`] by checkpoint
//! name, one f32 copy of the weights more). Files: this one (the adapters,
//! their targets and keys, their initialisation, dropout), `gradients` (the
//! loss and its backward with per-block recompute and a chunked loss over
//! the vocabulary), `block` (one decoder block forward with its tape, and
//! back, with an optional weight-gradient sink), `full`
//! (`Model::full_gradients` and the weights by name), `attention` (causal
//! attention on whole heads through the matrix product, and back).
//!
//! Memory of a gradient pass over n = batch · T tokens: each block's input
//! (layers · n · hidden f32s, the only activations kept across blocks), one
//! block's tape at a time while it is recomputed and run back (its
//! projections, n · intermediate for the MLP, batch · heads · T² attention
//! probabilities), and logits for at most a chunk of counted positions at a
//! time (never n · vocab). Checked against peft on both families
//! (tests/lora.rs).

use std::collections::HashMap;

use crate::config::{Family, ModelConfig};
use crate::error::{LlmError, Result};
use crate::model::Model;

mod attention;
mod block;
mod full;
mod gradients;

pub use full::{Grad, WeightGrads};
pub use gradients::PassMemory;

/// One adapter: y += scale · (x·Aᵀ)·Bᵀ, A [r, in], B [out, r].
#[derive(Clone, Debug)]
pub struct Adapter {
    pub a: Vec<f32>,
    pub b: Vec<f32>,
    pub r: usize,
    pub scale: f32,
}

/// Adapters by module key ([`module_keys`]): `layers.N.self_attn.q_proj`
/// … on the Llama family, `h.N.attn.c_attn` … on GPT-2.
pub type Adapters = HashMap<String, Adapter>;

/// Gradients (dA, dB) by module key.
pub type AdapterGrads = HashMap<String, (Vec<f32>, Vec<f32>)>;

/// The module names (Hugging Face's) an adapter can target on the Llama
/// family.
pub const TARGETS: &[&str] = &[
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// GPT-2's: the fused q/k/v `c_attn`, `c_proj` (both the attention's and
/// the MLP's, as peft matches the name) and `c_fc`.
pub const GPT2_TARGETS: &[&str] = &["c_attn", "c_proj", "c_fc"];

/// The target module names of `family`.
pub fn targets(family: Family) -> &'static [&'static str] {
    match family {
        Family::Llama => TARGETS,
        Family::Gpt2 => GPT2_TARGETS,
    }
}

/// The adapter keys of layer `layer`'s modules called `target` on
/// `family` (module paths under the model, without peft's prefix):
/// `layers.N.self_attn.q_proj` … `layers.N.mlp.down_proj` on the Llama
/// family; `h.N.attn.c_attn`, `h.N.attn.c_proj`, `h.N.mlp.c_fc` and
/// `h.N.mlp.c_proj` on GPT-2 (`c_proj` names two modules). Empty for a name
/// that is not a target.
pub fn module_keys(family: Family, layer: usize, target: &str) -> Vec<String> {
    match (family, target) {
        (Family::Llama, "q_proj" | "k_proj" | "v_proj" | "o_proj") => {
            vec![format!("layers.{layer}.self_attn.{target}")]
        }
        (Family::Llama, "gate_proj" | "up_proj" | "down_proj") => {
            vec![format!("layers.{layer}.mlp.{target}")]
        }
        (Family::Gpt2, "c_attn") => vec![format!("h.{layer}.attn.c_attn")],
        (Family::Gpt2, "c_proj") => vec![
            format!("h.{layer}.attn.c_proj"),
            format!("h.{layer}.mlp.c_proj"),
        ],
        (Family::Gpt2, "c_fc") => vec![format!("h.{layer}.mlp.c_fc")],
        _ => Vec::new(),
    }
}

/// The layer a module key names and whether the key is one of `family`'s.
pub(crate) fn key_layer(family: Family, key: &str) -> Option<usize> {
    let rest = match family {
        Family::Llama => key.strip_prefix("layers.")?,
        Family::Gpt2 => key.strip_prefix("h.")?,
    };
    let layer: usize = rest.split_once('.')?.0.parse().ok()?;
    targets(family)
        .iter()
        .any(|t| module_keys(family, layer, t).iter().any(|k| k == key))
        .then_some(layer)
}

/// (in, out) of the module a key names, from the config (the shapes
/// `Model::load` checks the weights against). GPT-2's `c_attn` is the fused
/// q|k|v: out = 3 · hidden.
pub fn module_dims(config: &ModelConfig, key: &str) -> Option<(usize, usize)> {
    let layer = key_layer(config.family, key)?;
    if layer >= config.num_layers {
        return None;
    }
    let h = config.hidden_size;
    let inter = config.intermediate_size;
    let module = key.rsplit('.').next()?;
    Some(match (config.family, module) {
        (Family::Llama, "q_proj") => (h, config.num_heads * config.head_dim),
        (Family::Llama, "k_proj" | "v_proj") => (h, config.num_kv_heads * config.head_dim),
        (Family::Llama, "o_proj") => (config.num_heads * config.head_dim, h),
        (Family::Llama, "gate_proj" | "up_proj") => (h, inter),
        (Family::Llama, "down_proj") => (inter, h),
        (Family::Gpt2, "c_attn") => (h, 3 * h),
        (Family::Gpt2, "c_fc") => (h, inter),
        (Family::Gpt2, "c_proj") if key.contains(".attn.") => (h, h),
        (Family::Gpt2, "c_proj") => (inter, h),
        _ => return None,
    })
}

/// Adapters on every layer's `target_modules` (Hugging Face names, see
/// [`targets`]): A drawn uniformly in ±1/√in (peft's Kaiming-uniform bound
/// with a = √5) from `seed`, B zero (so the model starts unchanged), scale
/// alpha / r.
pub fn new_adapters(
    model: &Model,
    r: usize,
    alpha: f32,
    target_modules: &[&str],
    seed: u64,
) -> Result<Adapters> {
    let c = &model.config;
    if r == 0 {
        return Err(LlmError::Input("LoRA rank r must be at least 1".into()));
    }
    let names = targets(c.family);
    let mut state = seed;
    let mut uniform = || {
        let z = crate::math::splitmix64(&mut state);
        (z >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut adapters = Adapters::new();
    for target in target_modules {
        if !names.contains(target) {
            return Err(LlmError::Input(format!(
                "LoRA target_modules: `{target}` is not a module of {}; the modules are {}",
                c.architecture,
                names.join(", ")
            )));
        }
        for layer in 0..model.blocks.len() {
            for key in module_keys(c.family, layer, target) {
                let Some((inp, out)) = module_dims(&model.config, &key) else {
                    continue;
                };
                let bound = 1.0 / (inp as f64).sqrt();
                let a = (0..r * inp)
                    .map(|_| ((uniform() * 2.0 - 1.0) * bound) as f32)
                    .collect();
                adapters.insert(
                    key,
                    Adapter {
                        a,
                        b: vec![0.0; out * r],
                        r,
                        scale: alpha / r as f32,
                    },
                );
            }
        }
    }
    Ok(adapters)
}

/// Dropout on the adapters' input (peft's `lora_dropout`): each element
/// kept with probability 1 − p and scaled by 1 / (1 − p), drawn from a
/// splitmix64 stream, so a seed fixes every mask of a pass.
#[derive(Clone, Debug)]
pub struct Dropout {
    pub p: f32,
    pub state: u64,
}

impl Dropout {
    /// The kept elements' factor (0 or 1 / (1 − p)) for `n` inputs.
    pub(crate) fn mask(&mut self, n: usize) -> Vec<f32> {
        let keep = 1.0 / (1.0 - self.p);
        (0..n)
            .map(|_| {
                let z = crate::math::splitmix64(&mut self.state);
                let u = (z >> 40) as f32 / (1u64 << 24) as f32;
                if u < self.p {
                    0.0
                } else {
                    keep
                }
            })
            .collect()
    }
}
