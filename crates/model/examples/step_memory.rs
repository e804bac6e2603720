//! The memory of one training step (forward, loss, backward) of the reference
//! ResNet (the `[model]` of experiments/fashion_mnist.toml) under each
//! activation-checkpointing policy, from the memory pool's figures. The
//! step's speed is `cargo xtask bench`'s business (the pipeline's learner).
//!
//! cargo run --release -p headroom-model --example step_memory [-- BATCH]

use headroom_model::{CheckpointPolicy, ModelSpec, Network};
use serde::Deserialize;

/// The default experiment; its `[model]` is the reference ResNet.
const REFERENCE: &str = include_str!("../../../experiments/fashion_mnist.toml");

#[derive(Deserialize)]
struct Wrapper {
    model: ModelSpec,
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let batch: usize = std::env::args()
        .nth(1)
        .map(|b| b.parse())
        .transpose()?
        .unwrap_or(128);
    let base = toml::from_str::<Wrapper>(REFERENCE)?.model;
    println!("one step's own memory at batch {batch} (Network::measure_step, a private pool):");
    for policy in [
        CheckpointPolicy::None,
        CheckpointPolicy::Blocks,
        CheckpointPolicy::All,
    ] {
        let spec = ModelSpec {
            checkpoint: policy,
            ..base.clone()
        };
        let stats = Network::build(&spec, 0)?.measure_step(batch)?;
        println!(
            "  checkpoint {:<6} peak in use {:7.1} MiB, peak reserved {:7.1} MiB, {} allocations",
            format!("{policy:?}").to_lowercase(),
            mib(stats.peak_in_use_bytes),
            mib(stats.peak_reserved_bytes),
            stats.allocations
        );
    }
    Ok(())
}
