//! `cargo xtask lora-merge`: LoRA adapters folded into their base weights.
//! Two forms: a run's `adapters.safetensors` into the project's own
//! checkpoint (`headroom_pipeline::finetune::merge`), and with `--model`
//! peft adapters into a Hugging Face model directory, written as a new
//! directory transformers loads (`headroom_llm::merge::merge_to_dir`: the
//! base's files and layout, only the targeted tensors rewritten, built in a
//! temporary sibling and renamed into place).

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};

use crate::LoraMergeArgs;

pub fn run(args: LoraMergeArgs) -> Result<ExitCode> {
    let LoraMergeArgs {
        adapters,
        base,
        model,
        output,
    } = args;
    if let Some(model) = model {
        // clap requires --output with --model.
        let output = output.context("--output is required with --model")?;
        return hf(&model, &adapters, &output);
    }
    let base = match base {
        Some(base) => base,
        None => headroom_pipeline::finetune::recorded_base(&adapters)?,
    };
    let output = output.unwrap_or_else(|| adapters.with_file_name("merged.safetensors"));
    let count = headroom_pipeline::finetune::merge(&base, &adapters, &output)?;
    println!(
        "{count} tensors of {} with {} merged, written to {}",
        base.display(),
        adapters.display(),
        output.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// The Hugging Face form: what was merged goes to standard output.
fn hf(model: &Path, adapters: &Path, output: &Path) -> Result<ExitCode> {
    let report = headroom_llm::merge::merge_to_dir(model, adapters, output)
        .with_context(|| format!("merging {} into {}", adapters.display(), model.display()))?;
    println!(
        "merged {} LoRA modules (r {}, scale {}) of {} into {}, written to {}",
        report.modules.len(),
        report.r,
        report.scale,
        adapters.display(),
        model.display(),
        report.output.display()
    );
    for t in &report.tensors {
        println!("  {} {} ({})", t.name, t.dtype, t.file);
    }
    println!(
        "{} weight file(s), {} bytes: {}",
        report.weight_files.len(),
        report.weight_bytes,
        report.weight_files.join(", ")
    );
    println!(
        "{} file(s) copied, {} bytes: {}",
        report.copied.len(),
        report.copied_bytes,
        report.copied.join(", ")
    );
    if !report.skipped.is_empty() {
        println!("not carried over: {}", report.skipped.join(", "));
    }
    Ok(ExitCode::SUCCESS)
}
