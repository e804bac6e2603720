//! `cargo xtask predict`: a run's predictions for new inputs, as CSV or
//! JSON (see `headroom_pipeline::predict`).

use std::io::Write;

use anyhow::{Context, Result};
use headroom_pipeline::learner::DeviceKind;
use headroom_pipeline::predict::{predict_with, write_csv, write_json, PredictOptions};

use crate::PredictArgs;

pub fn run(args: PredictArgs) -> Result<()> {
    if let Some(output) = &args.output {
        // The input, a checkpoint and a directory are never written over.
        headroom_pipeline::export::check_output(output, &[&args.input, &args.checkpoint])?;
    }
    let options = PredictOptions {
        batch: args.batch,
        device: DeviceKind::parse("--device", &args.device)?,
        ..PredictOptions::default()
    };
    let predictions = predict_with(&args.checkpoint, &args.input, &options)?;
    let json = args
        .output
        .as_ref()
        .and_then(|p| p.extension())
        .is_some_and(|e| e.eq_ignore_ascii_case("json"));
    let write = |out: &mut dyn Write| {
        if json {
            write_json(&predictions, out)
        } else {
            write_csv(&predictions, out)
        }
    };
    match &args.output {
        None => write(&mut std::io::stdout().lock()).context("writing the predictions")?,
        Some(path) => {
            // Written beside the destination and renamed over it: an
            // interrupted run leaves no half-written file under its name.
            let tmp = path.with_extension("partial");
            let mut file = std::fs::File::create(&tmp)
                .with_context(|| format!("creating {}", tmp.display()))?;
            write(&mut file).with_context(|| format!("writing {}", tmp.display()))?;
            file.sync_all()
                .with_context(|| format!("writing {}", tmp.display()))?;
            std::fs::rename(&tmp, path)
                .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
            eprintln!(
                "{} predictions from {} written to {}",
                predictions.sources.len(),
                predictions.checkpoint.display(),
                path.display()
            );
        }
    }
    Ok(())
}
