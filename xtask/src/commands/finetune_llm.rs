//! `cargo xtask finetune-llm`: a full fine-tune (every weight, AdamW) of a
//! small Hugging Face model directory on a JSONL file, on the CPU
//! (`headroom_llm::finetune::full`), written at the end as a new model
//! directory OUT in the base's files, shard layout, header and dtypes
//! (`headroom_llm::merge::write_model_dir`), which `Model::load`,
//! `generate --model OUT` and transformers load.
//!
//! Before the first step the run's memory is sized from the shapes and
//! checked against `--memory-limit` or the room the system leaves: the
//! model's f32 weights, the step's gradient sum and AdamW's two moments
//! (four f32 copies of the weights in all), and one gradient pass at the
//! largest micro-batch (`Model::lora_pass_memory` with no adapters, plus
//! the pass's own gradients, one more f32 copy); a run that cannot fit stops
//! there with each part named, and so does an output that would be refused
//! (inside the model directory, or existing and not empty). There are no
//! checkpoints in this round: the first SIGINT or SIGTERM finishes the step
//! under way and exits 128 + the signal writing nothing, saying so.

use std::process::ExitCode;
use std::sync::atomic::Ordering;

use anyhow::{bail, Context, Result};
use headroom_llm::data::{DataOptions, Rows};
use headroom_llm::finetune::full::{FullOptions, FullTrainer};
use headroom_llm::finetune::LrSchedule;
use headroom_llm::merge::{check_output, write_model_dir};
use headroom_llm::token_store::TokenStore;
use headroom_llm::{Model, Tokenizer};
use headroom_model::memory::bytes_text;

use crate::commands::llm_data::open_rows;
use crate::commands::lora_llm::memory_limit;
use crate::signals::StopOnSignals;
use crate::FinetuneLlmArgs;

pub fn run(args: FinetuneLlmArgs) -> Result<ExitCode> {
    let model_dir = std::fs::canonicalize(&args.model)
        .with_context(|| format!("{}: cannot be opened (--model)", args.model.display()))?;
    let data_path = std::fs::canonicalize(&args.data)
        .with_context(|| format!("{}: cannot be opened (--data)", args.data.display()))?;
    // The output's refusals now, not after the training.
    check_output(&args.output, &[(&model_dir, "the model directory")])?;

    let context = || format!("fine-tuning {}", model_dir.display());
    let mut model = Model::load(&model_dir).with_context(context)?;
    let tokenizer = Tokenizer::load(&model_dir).with_context(context)?;
    let data_options = DataOptions {
        max_seq_length: args.max_seq_length,
        packing: args.packing,
    };
    let data = open_rows(
        &model,
        &tokenizer,
        &data_path,
        data_options,
        args.token_cache.as_deref(),
    )?;
    let options = FullOptions {
        epochs: args.epochs,
        lr: args.lr,
        batch_size: args.batch_size,
        accumulate: args.accumulate,
        schedule: match args.warmup_steps {
            Some(warmup_steps) => LrSchedule::WarmupCosine { warmup_steps },
            None => LrSchedule::Constant,
        },
        weight_decay: args.weight_decay,
        max_steps: args.max_steps,
        seed: args.seed,
    };
    check_fits(&model, &data, &options, args.memory_limit.as_deref())?;

    let stop = StopOnSignals::install()?;
    let flag = stop.flag();
    let started = std::time::Instant::now();
    let mut trainer = FullTrainer::new(&mut model, &data, &options).with_context(context)?;
    let mut seen_tokens = 0usize;
    while !trainer.done() {
        let log = trainer.step().with_context(context)?;
        seen_tokens += log.tokens;
        if !log.loss.is_finite() {
            bail!(
                "step {}: the loss is {}; nothing written (lower --lr)",
                log.step,
                log.loss
            );
        }
        tracing::info!(
            "step {}/{} (epoch {}): loss {:.4}, lr {:.3e}, {} tokens, {:.0} tokens/s",
            log.step,
            log.total_steps,
            log.epoch + 1,
            log.loss,
            log.lr,
            log.tokens,
            seen_tokens as f64 / started.elapsed().as_secs_f64().max(1e-9)
        );
        if flag.load(Ordering::SeqCst) && !trainer.done() {
            println!(
                "stopped at epoch {} step {} of {}; nothing written to {} (finetune-llm keeps no \
                 checkpoints yet: run it again to train)",
                trainer.epoch() + 1,
                trainer.steps_done(),
                trainer.total_steps(),
                args.output.display()
            );
            return Ok(stop.exit_code());
        }
    }
    drop(trainer);

    let report = write_model_dir(&model, &model_dir, &args.output)
        .with_context(|| format!("writing the fine-tuned model to {}", args.output.display()))?;
    tracing::info!(
        "wrote {}: {} tensors in {} weight file(s) ({}), copied {} ({})",
        report.output.display(),
        report.tensors.len(),
        report.weight_files.len(),
        bytes_text(report.weight_bytes),
        report.copied.join(", "),
        bytes_text(report.copied_bytes)
    );
    if !report.kept.is_empty() {
        tracing::info!(
            "kept as the base has them (no weights of the model): {}",
            report.kept.join(", ")
        );
    }
    if !report.skipped.is_empty() {
        tracing::info!("not carried over: {}", report.skipped.join(", "));
    }
    Ok(ExitCode::SUCCESS)
}

/// Refuses, before anything trains, a full fine-tune whose memory exceeds
/// the limit: the weights (f32), the step's gradient sum and AdamW's two
/// moments (one f32 copy each), and one gradient pass at the largest
/// micro-batch (`batch_size` rows of the longest example): its activations
/// as `Model::lora_pass_memory` sizes them with no adapters, and its own
/// gradients (one more f32 copy of the weights).
fn check_fits(
    model: &Model,
    data: &TokenStore,
    options: &FullOptions,
    limit: Option<&str>,
) -> Result<()> {
    let Some((limit, source)) = memory_limit(limit)? else {
        return Ok(());
    };
    let f = std::mem::size_of::<f32>() as u64;
    let weights: u64 = model
        .weight_names()
        .iter()
        .map(|(_, shape)| shape.iter().product::<usize>() as u64 * f)
        .sum();
    let longest = data.longest();
    let rows = options.batch_size.min(data.len()).max(1);
    let pass = model.lora_pass_memory(rows, longest, 0, 0, 0);
    let pass_total = pass.total() as u64 + weights;
    let need = weights + weights + 2 * weights + pass_total;
    let parts = format!(
        "weights {} + gradient sum {} + AdamW moments {} + one pass of {rows} × {longest} tokens \
         {} (its gradients {}, block inputs {}, one block's activations {}, loss chunk {}, \
         product workspace {}) = {}",
        bytes_text(weights),
        bytes_text(weights),
        bytes_text(2 * weights),
        bytes_text(pass_total),
        bytes_text(weights),
        bytes_text(pass.checkpoints as u64),
        bytes_text(pass.block as u64),
        bytes_text(pass.head as u64),
        bytes_text(pass.workspace as u64),
        bytes_text(need)
    );
    if need > limit {
        bail!(
            "the full fine-tune does not fit in {} ({source}): {parts}; lower --max-seq-length or \
             --batch-size, fine-tune LoRA adapters instead (cargo xtask lora-llm), or raise \
             --memory-limit",
            bytes_text(limit)
        );
    }
    tracing::info!("memory: {parts}, of {} ({source})", bytes_text(limit));
    Ok(())
}
