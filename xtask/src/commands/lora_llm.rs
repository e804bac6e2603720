//! `cargo xtask lora-llm`: LoRA fine-tuning of a Hugging Face model
//! directory on a JSONL file, on the CPU (headroom-llm), writing peft's
//! adapter files (OUT/adapter_model.safetensors, OUT/adapter_config.json,
//! each written to a temporary name and renamed). The loss of every
//! optimizer step goes to the log.

use anyhow::{Context, Result};
use headroom_llm::data::{load_jsonl, DataOptions};
use headroom_llm::finetune::{finetune, FinetuneOptions, LrSchedule};
use headroom_llm::peft::save_adapters;
use headroom_llm::{Model, Tokenizer};

use crate::LoraLlmArgs;

pub fn run(args: LoraLlmArgs) -> Result<()> {
    let context = || format!("fine-tuning {}", args.model.display());
    let model = Model::load(&args.model).with_context(context)?;
    let tokenizer = Tokenizer::load(&args.model).with_context(context)?;
    let data = load_jsonl(
        &args.data,
        &tokenizer,
        model.config.eos_token_ids.first().copied(),
        DataOptions {
            max_seq_length: args.max_seq_length,
            packing: args.packing,
        },
    )?;
    tracing::info!(
        "{}: {} rows from {} ({} truncated to {} tokens, {} without a counted label dropped)",
        model.config.architecture,
        data.examples.len(),
        args.data.display(),
        data.truncated,
        args.max_seq_length,
        data.dropped
    );
    let options = FinetuneOptions {
        r: args.r,
        alpha: args.alpha,
        dropout: args.dropout,
        target_modules: args
            .target
            .split(',')
            .map(|t| t.trim().to_string())
            .collect(),
        epochs: args.epochs,
        lr: args.lr,
        accumulate: args.accumulate,
        schedule: match args.warmup_steps {
            None => LrSchedule::Constant,
            Some(warmup_steps) => LrSchedule::WarmupCosine { warmup_steps },
        },
        weight_decay: args.weight_decay,
        max_steps: args.max_steps,
        seed: args.seed,
    };
    let (adapters, config) = finetune(&model, &data, &options, |s| {
        tracing::info!(
            "step {}/{} (epoch {}): loss {:.4}, lr {:.3e}",
            s.step,
            s.total_steps,
            s.epoch + 1,
            s.loss,
            s.lr
        );
    })?;
    save_adapters(&args.output, &model, &adapters, &config)?;
    tracing::info!(
        "adapters ({} modules, r {}) written to {}",
        adapters.len(),
        config.r,
        args.output.display()
    );
    Ok(())
}
