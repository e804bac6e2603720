//! `cargo xtask finetune-llm`: a full fine-tune (every weight, AdamW) of a
//! small Hugging Face model directory on a JSONL file, on the CPU, in a run
//! directory OUT (`headroom_llm::finetune::full_run`: run.json,
//! metrics.jsonl, the newest checkpoints of every weight and both AdamW
//! moments), ending with the trained model as OUT/model, a Hugging Face
//! directory in the base's files, shard layout, header and dtypes
//! (`merge::write_model_dir`), which `Model::load`, `generate --model
//! OUT/model` and transformers load. `--resume OUT` continues a run from its
//! newest checkpoint that loads, with its recorded settings (the flags that
//! may change: --epochs, --lr, --max-steps, --save-steps,
//! --keep-checkpoints, --max-grad-norm), bit for bit as a run never
//! stopped. The first SIGINT or SIGTERM finishes the step under way,
//! checkpoints and exits 128 + the signal, printing the command that
//! continues, quoted for a POSIX shell.
//!
//! Before the first step the run's memory is sized from the shapes and
//! checked against `--memory-limit` or the room the system leaves: the
//! model's f32 weights, the step's gradient sum and AdamW's two moments
//! (four f32 copies of the weights in all), and one gradient pass at the
//! largest micro-batch (`Model::lora_pass_memory` with no adapters, plus
//! the pass's own gradients, one more f32 copy); a run that cannot fit stops
//! there with each part named, and so does an output inside the model
//! directory.

use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use headroom_llm::data::{DataOptions, Rows};
use headroom_llm::finetune::full::FullOptions;
use headroom_llm::finetune::full_run::{self, FullOutcome, FullRunRecord, FullRunSettings};
use headroom_llm::finetune::run::Event;
use headroom_llm::finetune::LrSchedule;
use headroom_llm::merge::check_output;
use headroom_llm::token_store::TokenStore;
use headroom_llm::{Model, Tokenizer};
use headroom_model::memory::bytes_text;
use headroom_pipeline::shell;

use crate::commands::llm_data::open_rows;
use crate::commands::lora_llm::memory_limit;
use crate::signals::StopOnSignals;
use crate::FinetuneLlmArgs;

/// The flags given, over `s` (a new run's defaults or the recorded ones).
fn apply(args: &FinetuneLlmArgs, s: &mut FullRunSettings) {
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
    if let Some(v) = args.max_grad_norm {
        s.max_grad_norm = Some(v);
    }
    if let Some(v) = args.save_steps {
        s.save_steps = Some(v);
    }
    if let Some(v) = args.keep_checkpoints {
        s.keep_checkpoints = v;
    }
}

pub fn run(args: FinetuneLlmArgs) -> Result<ExitCode> {
    let (mut settings, out, resuming) = match &args.resume {
        Some(out) => {
            let mut settings = FullRunRecord::read(out)?.settings;
            apply(&args, &mut settings);
            (settings, out.clone(), true)
        }
        None => {
            let (Some(model), Some(data), Some(output)) = (&args.model, &args.data, &args.output)
            else {
                bail!(
                    "finetune-llm needs --model, --data and --output (or --resume OUT to \
                     continue a run)"
                );
            };
            let mut settings = FullRunSettings {
                model: model.clone(),
                data: data.clone(),
                data_options: DataOptions::default(),
                options: FullOptions::default(),
                max_grad_norm: None,
                save_steps: None,
                keep_checkpoints: 2,
            };
            apply(&args, &mut settings);
            (settings, output.clone(), false)
        }
    };
    for (path, flag) in [
        (&mut settings.model, "--model"),
        (&mut settings.data, "--data"),
    ] {
        *path = std::fs::canonicalize(&*path).with_context(|| {
            format!(
                "{}: cannot be opened ({flag}{})",
                path.display(),
                if resuming {
                    format!(": the run's; give {flag} where it is now")
                } else {
                    String::new()
                }
            )
        })?;
    }
    if !resuming && out.join(headroom_llm::finetune::run::RUN_RECORD).exists() {
        bail!(
            "{}: holds a fine-tuning run already: continue it with --resume, or give another \
             --output",
            out.display()
        );
    }
    // The output's refusals now, not after the training: OUT/model is
    // written at the end.
    check_output(
        &out.join(full_run::MODEL_DIR),
        &[(&settings.model, "the model directory")],
    )?;
    let context = || format!("fine-tuning {}", settings.model.display());
    let mut model = Model::load(&settings.model).with_context(context)?;
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
        full_run::resume(&out, &settings, &mut model, &data, Some(&flag), on_event)
    } else {
        full_run::start(&out, &settings, &mut model, &data, Some(&flag), on_event)
    }
    .with_context(context)?;
    match outcome {
        FullOutcome::Finished {
            step,
            checkpoint,
            report,
            ..
        } => {
            tracing::info!(
                "wrote {} (step {step}; checkpoint {}): {} tensors in {} weight file(s) ({}), \
                 copied {} ({})",
                report.output.display(),
                checkpoint.display(),
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
        FullOutcome::Stopped {
            step,
            epoch,
            checkpoint,
        } => {
            tracing::info!("checkpoint {} written", checkpoint.display());
            println!(
                "stopped at epoch {} step {step}; continue with: cargo xtask finetune-llm \
                 --resume {}",
                epoch + 1,
                shell::quote_path(&out)
            );
            Ok(stop.exit_code())
        }
    }
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
