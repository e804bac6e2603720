//! `cargo xtask export`: a checkpoint's weights as safetensors.

use std::process::ExitCode;

use anyhow::{bail, Result};

use crate::ExportArgs;

pub fn run(args: ExportArgs) -> Result<ExitCode> {
    let ExportArgs {
        checkpoint,
        format,
        output,
    } = args;
    if format != "safetensors" {
        bail!("--format {format}: only \"safetensors\" is supported");
    }
    let exported = headroom_pipeline::export::safetensors(&checkpoint, output.as_deref())?;
    println!(
        "{} tensors of {} written to {}",
        exported.tensors,
        exported.checkpoint.display(),
        exported.output.display()
    );
    Ok(ExitCode::SUCCESS)
}
