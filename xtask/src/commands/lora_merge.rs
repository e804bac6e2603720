//! `cargo xtask lora-merge`: LoRA adapters folded into their base weights.

use std::process::ExitCode;

use anyhow::Result;

use crate::LoraMergeArgs;

pub fn run(args: LoraMergeArgs) -> Result<ExitCode> {
    let LoraMergeArgs {
        adapters,
        base,
        output,
    } = args;
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
