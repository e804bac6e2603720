//! `cargo xtask lora-llm`: LoRA fine-tuning of a Hugging Face model
//! directory on a JSONL file, on the CPU (headroom-llm), in a run directory
//! OUT (`headroom_llm::finetune::run`: run.json, metrics.jsonl, the last
//! checkpoints, and the final adapters in peft's files at OUT's top level).
//! `--config FILE` (and `--set KEY=VALUE`) take the settings from a recipe
//! file, the flags over it (`lora_llm_config`).
//! `--resume OUT` continues a run from its newest checkpoint with its
//! recorded settings. The first SIGINT or SIGTERM (xtask's `signals`)
//! finishes the step under way, checkpoints and exits 128 + the signal,
//! printing the command that continues the run, quoted for a POSIX shell,
//! as `cargo xtask train` does. Each optimizer step's loss goes to the log.
//! The JSONL is read through the token store (`llm_data`): tokenised once,
//! then read lazily.
//! Before the first step the run's memory (weights, adapters with their
//! gradients and moments, one pass at the largest micro-batch the data
//! holds, sized from the shapes; the token store's cache) is checked against `--memory-limit` or the
//! room the system leaves, and a run that cannot fit stops there, each part
//! named.

use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use headroom_llm::data::{DataOptions, Rows};
use headroom_llm::finetune::run::{self, Event, Outcome, RunRecord, RunSettings};
use headroom_llm::finetune::{FinetuneOptions, LrSchedule};
use headroom_llm::{Model, Tokenizer};
use headroom_pipeline::shell;

use crate::commands::llm_data::open_rows;
use crate::commands::lora_llm_config::apply_config;
use crate::signals::StopOnSignals;
use crate::LoraLlmArgs;

/// The settings of a new run: the flags given, the defaults for the rest.
fn new_settings(args: &LoraLlmArgs) -> Result<(RunSettings, std::path::PathBuf)> {
    let (Some(model), Some(data), Some(output)) = (&args.model, &args.data, &args.output) else {
        bail!(
            "lora-llm needs --model, --data and --output, from the flags or --config (or \
             --resume OUT to continue a run)"
        );
    };
    let defaults = FinetuneOptions::default();
    let mut settings = RunSettings {
        model: model.clone(),
        data: data.clone(),
        data_options: DataOptions::default(),
        options: defaults,
        save_steps: None,
        keep_checkpoints: 2,
    };
    apply(args, &mut settings);
    Ok((settings, output.clone()))
}

/// The flags given, over `settings` (a new run's defaults, or the run's
/// recorded settings on resume).
fn apply(args: &LoraLlmArgs, s: &mut RunSettings) {
    let o = &mut s.options;
    if let Some(v) = &args.model {
        s.model = v.clone();
    }
    if let Some(v) = &args.data {
        s.data = v.clone();
    }
    if let Some(v) = args.max_seq_length {
        s.data_options.max_seq_length = v;
    }
    if args.packing {
        s.data_options.packing = true;
    }
    if let Some(v) = args.r {
        o.r = v;
    }
    if let Some(v) = args.alpha {
        o.alpha = v;
    }
    if let Some(v) = args.dropout {
        o.dropout = v;
    }
    if let Some(v) = &args.target {
        o.target_modules = v.split(',').map(|t| t.trim().to_string()).collect();
    }
    if let Some(v) = args.epochs {
        o.epochs = v;
    }
    if let Some(v) = args.lr {
        o.lr = v;
    }
    if let Some(v) = args.batch_size {
        o.batch_size = v;
    }
    if let Some(v) = args.accumulate {
        o.accumulate = v;
    }
    if let Some(warmup_steps) = args.warmup_steps {
        o.schedule = LrSchedule::WarmupCosine { warmup_steps };
    }
    if let Some(v) = args.weight_decay {
        o.weight_decay = v;
    }
    if let Some(v) = args.max_steps {
        o.max_steps = Some(v);
    }
    if let Some(v) = args.seed {
        o.seed = v;
    }
    if let Some(v) = args.save_steps {
        s.save_steps = Some(v);
    }
    if let Some(v) = args.keep_checkpoints {
        s.keep_checkpoints = v;
    }
}

pub fn run(mut args: LoraLlmArgs) -> Result<ExitCode> {
    if args.resume.is_none() {
        apply_config(&mut args)?;
    }
    let (mut settings, out, resuming) = match &args.resume {
        Some(out) => {
            let record = RunRecord::read(out)?;
            let mut settings = record.settings;
            apply(&args, &mut settings);
            (settings, out.clone(), true)
        }
        None => {
            let (settings, out) = new_settings(&args)?;
            (settings, out, false)
        }
    };
    // Absolute, so `--resume OUT` works from any directory and a path
    // given again in another spelling is no change.
    for (path, flag) in [
        (&mut settings.model, "--model"),
        (&mut settings.data, "--data"),
    ] {
        *path = std::fs::canonicalize(&*path).with_context(|| {
            format!(
                "{}: cannot be opened{}",
                path.display(),
                if resuming {
                    format!(" (the run's {flag}; give {flag} where it is now)")
                } else {
                    String::new()
                }
            )
        })?;
    }
    let context = || format!("fine-tuning {}", settings.model.display());
    let model = Model::load(&settings.model).with_context(context)?;
    let tokenizer = Tokenizer::load(&settings.model).with_context(context)?;
    let data = open_rows(
        &model,
        &tokenizer,
        &settings.data,
        settings.data_options,
        args.token_cache.as_deref(),
    )?;
    check_fits(
        &model,
        &data,
        &settings.options,
        args.memory_limit.as_deref(),
    )?;
    let stop = StopOnSignals::install()?;
    let flag = stop.flag();
    let on_event = |event: Event| match event {
        Event::Step {
            log, tokens_per_s, ..
        } => tracing::info!(
            "step {}/{} (epoch {}): loss {:.4}, lr {:.3e}, {} tokens, {:.0} tokens/s",
            log.step,
            log.total_steps,
            log.epoch + 1,
            log.loss,
            log.lr,
            log.tokens,
            tokens_per_s
        ),
        Event::Checkpoint(path) => tracing::info!("checkpoint {}", path.display()),
        Event::Pruned(path) => tracing::info!("removed the older checkpoint {}", path.display()),
        Event::RemovedTemporary(path) => tracing::info!(
            "removed {}, left by a checkpoint write that did not finish",
            path.display()
        ),
        Event::Skipped { error, set_aside } => {
            tracing::warn!("skipped {error}; set aside as {}", set_aside.display())
        }
        Event::Resumed {
            from,
            step,
            epoch,
            position,
        } => tracing::info!(
            "resuming from {} (epoch {}, example {} of its order, step {step})",
            from.display(),
            epoch + 1,
            position
        ),
        Event::Changed { key, was, now } => {
            tracing::info!("{key} changed on resume: {was} -> {now}")
        }
    };
    let outcome = if resuming {
        run::resume(&out, &settings, &model, &data, Some(&flag), on_event)
    } else {
        run::start(&out, &settings, &model, &data, Some(&flag), on_event)
    }?;
    match outcome {
        Outcome::Finished { step, checkpoint } => {
            tracing::info!(
                "adapters (step {step}) written to {} (and {})",
                out.display(),
                checkpoint.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        Outcome::Stopped {
            step,
            epoch,
            checkpoint,
        } => {
            tracing::info!("checkpoint {} written", checkpoint.display());
            // Quoted: the line is meant to be pasted into a shell.
            println!(
                "stopped at epoch {} step {step}; continue with: cargo xtask lora-llm --resume {}",
                epoch + 1,
                shell::quote_path(&out)
            );
            Ok(stop.exit_code())
        }
    }
}

/// The limit a fine-tune's memory is checked against, with where it comes
/// from: `--memory-limit`, else the room the system leaves (None, with a
/// warning, when no ceiling is found).
pub(crate) fn memory_limit(limit: Option<&str>) -> Result<Option<(u64, String)>> {
    Ok(Some(match limit {
        Some(text) => (
            headroom_pipeline::config::parse_bytes("--memory-limit", text)?,
            "--memory-limit".to_string(),
        ),
        None => match headroom_pipeline::limits::tightest() {
            Some(ceiling) => (ceiling.room, ceiling.source),
            None => {
                tracing::warn!("no memory ceiling found: the fine-tune's memory is not checked");
                return Ok(None);
            }
        },
    }))
}

/// Refuses, before anything trains, a fine-tune whose memory exceeds the
/// limit: the model's weights as held (`Model::weight_bytes`: the
/// checkpoint's dtype), the adapters (values, gradient sums, two
/// AdamW moments: 4 f32s each) and one gradient pass at the largest
/// micro-batch (`batch_size` rows of the longest example), as
/// `Model::lora_pass_memory` sizes it (an upper bound of what a pass
/// allocates, tests/pass_memory.rs).
fn check_fits(
    model: &Model,
    data: &headroom_llm::token_store::TokenStore,
    options: &FinetuneOptions,
    limit: Option<&str>,
) -> Result<()> {
    use headroom_model::memory::bytes_text;
    let Some((limit, source)) = memory_limit(limit)? else {
        return Ok(());
    };
    let c = &model.config;
    let f = std::mem::size_of::<f32>() as u64;
    // The frozen base as held: bf16/f16 matrices at 2 bytes (read from the
    // file's pages), f32 at 4.
    let weights = model.weight_bytes();
    let mut adapter_values = 0usize;
    let mut adapted = 0usize;
    for target in &options.target_modules {
        for key in headroom_llm::lora::module_keys(c.family, 0, target) {
            if let Some((inp, out)) = headroom_llm::lora::module_dims(c, &key) {
                adapter_values += options.r * (inp + out) * c.num_layers;
                adapted += 1;
            }
        }
    }
    let longest = data.longest();
    let rows = options.batch_size.min(data.len()).max(1);
    let pass = model.lora_pass_memory(rows, longest, adapter_values, options.r, adapted);
    let adapters = 4 * adapter_values as u64 * f;
    let tokens = data.cache_limit_bytes();
    let need = weights + adapters + tokens + pass.total() as u64;
    let parts = format!(
        "weights {} + adapters with their gradients and AdamW moments {} + token store cache {} \
         + one pass of {rows} × {longest} tokens {} (block inputs {}, one block's activations \
         {}, loss chunk {}, product workspace {}) = {}",
        bytes_text(weights),
        bytes_text(adapters),
        bytes_text(tokens),
        bytes_text(pass.total() as u64),
        bytes_text(pass.checkpoints as u64),
        bytes_text(pass.block as u64),
        bytes_text(pass.head as u64),
        bytes_text(pass.workspace as u64),
        bytes_text(need)
    );
    if need > limit {
        bail!(
            "the fine-tune does not fit in {} ({source}): {parts}; lower --max-seq-length or \
             --batch-size, target fewer modules, or raise --memory-limit",
            bytes_text(limit)
        );
    }
    tracing::info!("memory: {parts}, of {} ({source})", bytes_text(limit));
    Ok(())
}
