//! `[finetune]`: its settings, and the model a run trains (a full
//! fine-tune drops the adapters): what loading and checking an experiment
//! needs, without the fine-tuning machinery of `crate::finetune`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use headroom_model::layers::LoraConfig;
use headroom_model::{LayerSpec, ModelSpec};
use serde::{Deserialize, Serialize};

use super::ExperimentConfig;
use crate::{PipelineError, Result};

/// `[finetune]` in an experiment.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FinetuneConfig {
    /// The base: a checkpoint file, or a run directory (its newest valid
    /// checkpoint).
    pub base: PathBuf,
    /// "lora" (adapters only) or "full" (every weight, no adapters).
    #[serde(default)]
    pub train: FinetuneMode,
    /// The experiment that trains the base when `base` holds no checkpoint
    /// (`cargo xtask train` runs it first, into `base`).
    #[serde(default)]
    pub base_experiment: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FinetuneMode {
    #[default]
    Lora,
    Full,
}

impl FinetuneConfig {
    /// Checks that need no file: a token model, and adapters to train.
    pub fn validate(&self, config: &ExperimentConfig) -> Result<()> {
        if self.base.as_os_str().is_empty() {
            return Err(PipelineError::value(
                "finetune.base",
                "is empty: name the base checkpoint or its run directory",
            ));
        }
        if config.model.tokens.is_none() {
            return Err(PipelineError::value(
                "model.tokens",
                "[finetune] loads a tiny_gpt token model: set model.tokens = { length, vocab }",
            ));
        }
        if self.train == FinetuneMode::Lora && adapter_scales(&config.model).is_empty() {
            return Err(PipelineError::value(
                "finetune.train",
                "\"lora\" needs adapters: set lora = { r, alpha } on the transformer blocks of model.layers",
            ));
        }
        Ok(())
    }
}

/// Whether a parameter is a LoRA adapter factor (trained under "lora").
pub fn is_adapter(name: &str) -> bool {
    name.ends_with(".lora_a") || name.ends_with(".lora_b")
}

/// The experiment as a run trains it, `effective_model` in place of its
/// `[model]`: what training, the step benchmark and any comparison use.
pub fn as_trained(config: &ExperimentConfig) -> ExperimentConfig {
    let mut config = config.clone();
    config.model = effective_model(&config);
    config
}

/// The model a run trains: the experiment's, without its adapters for a
/// full fine-tune (the base architecture, every weight trainable).
pub fn effective_model(config: &ExperimentConfig) -> ModelSpec {
    let mut spec = config.model.clone();
    if config
        .finetune
        .as_ref()
        .is_some_and(|f| f.train == FinetuneMode::Full)
    {
        spec.layers = spec.layers.iter().map(without_adapters).collect();
    }
    spec
}

fn without_adapters(layer: &LayerSpec) -> LayerSpec {
    match layer.clone() {
        LayerSpec::TransformerBlock {
            heads,
            mlp_ratio,
            dropout,
            lean,
            ..
        } => LayerSpec::TransformerBlock {
            heads,
            mlp_ratio,
            dropout,
            lean,
            lora: None,
        },
        LayerSpec::CausalSelfAttention { heads, lean, .. } => LayerSpec::CausalSelfAttention {
            heads,
            lean,
            lora: None,
        },
        LayerSpec::LoraLinear { out, bias, .. } => LayerSpec::Linear { out, bias },
        LayerSpec::Residual { layers } => LayerSpec::Residual {
            layers: layers.iter().map(without_adapters).collect(),
        },
        other => other,
    }
}

/// Each adapted linear layer's name (`model.layers[1].attn.qkv`) and its
/// scale alpha / r, from the spec: what a merge multiplies B·A by.
pub fn adapter_scales(spec: &ModelSpec) -> BTreeMap<String, f32> {
    let mut scales = BTreeMap::new();
    collect_scales(&spec.layers, "model.layers", &mut scales);
    scales
}

fn collect_scales(layers: &[LayerSpec], path: &str, out: &mut BTreeMap<String, f32>) {
    let scale = |c: &LoraConfig| c.alpha.unwrap_or(c.r as f32) / c.r.max(1) as f32;
    for (i, layer) in layers.iter().enumerate() {
        let here = format!("{path}[{i}]");
        match layer {
            LayerSpec::TransformerBlock { lora: Some(c), .. } => {
                out.insert(format!("{here}.attn.qkv"), scale(c));
                out.insert(format!("{here}.attn.proj"), scale(c));
            }
            LayerSpec::CausalSelfAttention { lora: Some(c), .. } => {
                out.insert(format!("{here}.qkv"), scale(c));
                out.insert(format!("{here}.proj"), scale(c));
            }
            LayerSpec::LoraLinear { lora, .. } => {
                out.insert(here, scale(lora));
            }
            LayerSpec::Residual { layers } | LayerSpec::UnetSkip { layers } => {
                collect_scales(layers, &format!("{here}.layers"), out);
            }
            _ => {}
        }
    }
}
