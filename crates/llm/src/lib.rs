//! headroom-llm: Hugging Face causal language models on the CPU.
//!
//! A model directory (`config.json`, `model.safetensors` or its shards,
//! `tokenizer.json`) of the Llama family (Llama, Mistral, Qwen2) or GPT-2 is
//! loaded ([`Model::load`], [`Tokenizer::load`]; the matrices kept in the
//! checkpoint's dtype, computed in f32), run as transformers runs it
//! ([`Model::logits`], [`Model::loss`]) and sampled with a KV cache
//! ([`Model::generate`]). Files: `config` (config.json), `weights`
//! (memory-mapped safetensors), `weight` (one matrix in f32, bf16 or f16,
//! and the products that convert it panel by panel), `model` (the loaded
//! blocks), `forward` (the pass, the loss, the cache), `generate`,
//! `tokenizer`, `math`, `lora`
//! (adapters by Hugging Face module names on the Llama family, and the
//! loss's gradients with respect to them alone, checked against peft;
//! and [`Model::full_gradients`], every base weight's gradient by
//! checkpoint name, checked against transformers),
//! `peft` (adapters in and out of peft's `adapter_model.safetensors` +
//! `adapter_config.json`, for both families, and merged into the base),
//! `merge` (the merged model written as a Hugging Face directory), `data` (JSONL
//! fine-tuning examples, tokenised, labels -100 off the completion),
//! `token_store` (those rows tokenised once into headroom-loader's shard
//! store and read lazily through its cache),
//! `finetune` (LoRA training: AdamW on the adapters, the base frozen;
//! `finetune::full`, AdamW over every weight, in a run directory with
//! checkpoints by `finetune::full_run`, written back as a model
//! directory by `merge::write_model_dir`).

pub mod config;
pub mod data;
pub mod error;
pub mod finetune;
pub mod forward;
pub mod generate;
pub mod lora;
pub mod math;
pub mod merge;
pub mod model;
pub mod peft;
pub mod shapes;
pub mod token_store;
pub mod tokenizer;
pub mod weight;
pub mod weights;

pub use config::{Family, ModelConfig, RopeScaling, SUPPORTED};
pub use error::{LlmError, Result};
pub use forward::{causal_lm_loss, KvCache, Want};
pub use generate::Sampling;
pub use lora::{Grad, WeightGrads};
pub use model::Model;
pub use tokenizer::Tokenizer;
pub use weight::{Weight, WeightDtype};
