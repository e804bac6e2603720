//! Times one training step (forward, loss, backward) of the reference ResNet
//! (the `[model]` of experiments/fashion_mnist.toml, Fashion-MNIST 28×28×1) and
//! reports the memory pool's figures: ms per step, then, per checkpointing
//! policy, the peak bytes in use and reserved during a step.
//!
//! cargo run --release -p headroom-model --example step_bench [-- BATCH [STEPS [POLICY]]]
//!
//! POLICY is none (default), blocks or all: the policy that is timed; the
//! memory table always covers all three.

use std::time::Instant;

use headroom_model::init::InitRng;
use headroom_model::loss::softmax_cross_entropy;
use headroom_model::{CheckpointPolicy, Device, Mode, ModelSpec, Network, Tensor};
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

fn policy(name: &str) -> Result<CheckpointPolicy, String> {
    match name {
        "none" => Ok(CheckpointPolicy::None),
        "blocks" => Ok(CheckpointPolicy::Blocks),
        "all" => Ok(CheckpointPolicy::All),
        other => Err(format!("unknown policy {other:?}: none, blocks or all")),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let batch: usize = args.next().map(|b| b.parse()).transpose()?.unwrap_or(128);
    let steps: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(10);
    let timed = policy(args.next().as_deref().unwrap_or("none"))?;
    let base = toml::from_str::<Wrapper>(REFERENCE)?.model;

    let mut rng = InitRng::new(1);
    let pixels: Vec<u8> = (0..batch * 28 * 28)
        .map(|_| (rng.next_u64() % 256) as u8)
        .collect();
    let labels: Vec<u32> = (0..batch).map(|_| (rng.next_u64() % 10) as u32).collect();

    let pool = Device::Cpu.pool();
    println!(
        "step bench: reference ResNet, batch {batch}, {} threads, checkpoint {timed:?}, \
         {steps} timed steps after 3 warm-up steps",
        rayon::current_num_threads()
    );
    let spec = ModelSpec {
        checkpoint: timed,
        ..base.clone()
    };
    let mut net = Network::build(&spec, 0)?;
    let mut times = Vec::new();
    let mut stats_before = pool.stats();
    for s in 0..steps + 3 {
        if s == 3 {
            pool.reset_peak();
            stats_before = pool.stats();
        }
        let t = Instant::now();
        let x: Tensor = net.input_from_u8(batch, &pixels)?;
        net.zero_grad();
        let logits = net.forward(&x, Mode::Train)?;
        let out = softmax_cross_entropy(&logits, &labels, 0.0)?;
        net.backward(&out.grad)?;
        drop((x, logits, out));
        if s >= 3 {
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    let after = pool.stats();
    times.sort_by(f64::total_cmp);
    println!(
        "time per step: best {:.1} ms, median {:.1} ms",
        times[0],
        times[times.len() / 2]
    );
    let per_step = |a: u64, b: u64| (a - b) as f64 / steps as f64;
    println!(
        "device pool over the timed steps: {:.1} allocations/step ({:.1} hits, {:.1} misses), \
         peak in use {:.1} MiB, peak reserved {:.1} MiB (parameters included)",
        per_step(after.allocations, stats_before.allocations),
        per_step(after.cache_hits, stats_before.cache_hits),
        per_step(after.cache_misses, stats_before.cache_misses),
        mib(after.peak_in_use_bytes),
        mib(after.peak_reserved_bytes),
    );

    println!("one step's own memory (Network::measure_step, a private pool):");
    for p in [
        CheckpointPolicy::None,
        CheckpointPolicy::Blocks,
        CheckpointPolicy::All,
    ] {
        let spec = ModelSpec {
            checkpoint: p,
            ..base.clone()
        };
        let mut net = Network::build(&spec, 0)?;
        let s = net.measure_step(batch)?;
        println!(
            "  checkpoint {:<6} peak in use {:7.1} MiB, peak reserved {:7.1} MiB, {} allocations",
            format!("{p:?}").to_lowercase(),
            mib(s.peak_in_use_bytes),
            mib(s.peak_reserved_bytes),
            s.allocations
        );
    }
    Ok(())
}
