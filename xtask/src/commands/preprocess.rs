//! `cargo xtask preprocess`: Fashion-MNIST into a shard store, or a text
//! experiment's corpus into its window store.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use headroom_loader::{IdxDataset, ShardSize, Split};
use headroom_pipeline::{ExperimentConfig, Overrides};

use crate::PreprocessArgs;

pub fn run(args: PreprocessArgs) -> Result<()> {
    let PreprocessArgs {
        input,
        output,
        config,
        overrides,
        no_install,
        shard_size,
        overwrite,
    } = args;
    match (config, output) {
        (Some(config), _) => preprocess_text(&config, &overrides, !no_install),
        (None, Some(output)) => preprocess(input, &output, &shard_size, overwrite),
        (None, None) => bail!("preprocess needs --output (Fashion-MNIST) or --config (text)"),
    }
}

fn preprocess(
    input: Option<PathBuf>,
    output: &std::path::Path,
    shard_size: &str,
    overwrite: bool,
) -> Result<()> {
    let shard_size: ShardSize = shard_size.parse().context("--shard-size")?;
    let input = headroom_pipeline::data::locate_fashion_mnist(input.as_deref(), false)?;
    for (split, name) in [(Split::Train, "train"), (Split::Test, "test")] {
        let source = IdxDataset::fashion_mnist(&input, split)?;
        let summary =
            headroom_loader::preprocess(&source, &output.join(name), shard_size, overwrite)?;
        println!("{name}: {summary}");
    }
    println!(
        "train on it with: cargo xtask train --set data.format=shards --set data.dir={}",
        output.display()
    );
    Ok(())
}

/// Packs a text experiment's corpus into the store `train` reads.
fn preprocess_text(config: &Path, overrides: &[String], allow_install: bool) -> Result<()> {
    let experiment = ExperimentConfig::load(config, &Overrides::parse(overrides)?)?;
    if experiment.data.format != headroom_pipeline::config::DataFormat::Text {
        bail!(
            "{}: data.format is \"{}\"; --config packs text experiments only",
            config.display(),
            experiment.data.format
        );
    }
    let store = headroom_pipeline::text::pack(&experiment, allow_install)?;
    println!(
        "text windows packed in {} (train/ and test/)",
        store.display()
    );
    println!(
        "train on it with: cargo xtask train --config {}",
        config.display()
    );
    Ok(())
}
