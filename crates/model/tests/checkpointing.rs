//! Activation checkpointing (`model.checkpoint`): bitwise the same results
//! as keeping every activation, with a lower peak of memory in use.

mod common;

use common::{batch, grads, parse, reference, sgd, small, step, weights};
use headroom_model::{
    BuildOptions, CheckpointPolicy, MemoryPool, Mode, ModelSpec, Network, PoolStats, Tensor,
};

const POLICIES: [CheckpointPolicy; 3] = [
    CheckpointPolicy::None,
    CheckpointPolicy::Blocks,
    CheckpointPolicy::All,
];

fn with_policy(spec: &ModelSpec, policy: CheckpointPolicy) -> ModelSpec {
    ModelSpec {
        checkpoint: policy,
        ..spec.clone()
    }
}

/// Everything a run produces, bit for bit.
#[derive(Debug, PartialEq)]
struct Trace {
    logits: Vec<Vec<f32>>,
    losses: Vec<u32>,
    grads: Vec<Vec<Vec<f32>>>,
    buffers: Vec<Vec<Vec<f32>>>,
    weights: Vec<Vec<f32>>,
    eval: Vec<f32>,
}

fn run(spec: &ModelSpec, n: usize, steps: usize) -> Trace {
    let mut net = Network::build(spec, 11).unwrap();
    let mut trace = Trace {
        logits: vec![],
        losses: vec![],
        grads: vec![],
        buffers: vec![],
        weights: vec![],
        eval: vec![],
    };
    for s in 0..steps {
        let (pixels, labels) = batch(spec, n, s as u64);
        let x = net.input_from_u8(n, &pixels).unwrap();
        net.zero_grad();
        let (logits, loss) = step(&mut net, &x, &labels, 1.0).unwrap();
        trace.logits.push(logits.data().to_vec());
        trace.losses.push(loss.to_bits());
        trace.grads.push(grads(&mut net));
        trace.buffers.push(net.buffer_values());
        sgd(&mut net, 0.1);
    }
    trace.weights = weights(&mut net);
    let (pixels, _) = batch(spec, n, 99);
    let x = net.input_from_u8(n, &pixels).unwrap();
    trace.eval = net.forward(&x, Mode::Eval).unwrap().data().to_vec();
    trace
}

#[test]
fn every_policy_gives_bitwise_the_same_step() {
    for (spec, n, steps) in [(small(), 8, 3), (reference(), 4, 2)] {
        let plain = run(&spec, n, steps);
        assert!(plain.grads[0].iter().flatten().any(|&g| g != 0.0));
        for policy in [CheckpointPolicy::Blocks, CheckpointPolicy::All] {
            let ck = run(&with_policy(&spec, policy), n, steps);
            assert!(
                ck == plain,
                "{policy:?} differs from no checkpointing on {:?}",
                spec.input
            );
        }
    }
}

#[test]
fn the_network_is_wrapped_as_the_policy_says() {
    let built = |policy, fuse| {
        Network::build_with(&with_policy(&reference(), policy), 0, BuildOptions { fuse })
            .unwrap()
            .summary()
            .unwrap()
    };
    // Fused: each stem is conv + bn+relu, each block one layer.
    let fused = built(CheckpointPolicy::None, true);
    assert_eq!(fused.len(), 11, "{fused:#?}");
    let fused = built(CheckpointPolicy::Blocks, true);
    assert_eq!(fused.len(), 11, "{fused:#?}");
    assert_eq!(
        fused.iter().filter(|l| l.contains("checkpoint[")).count(),
        3
    );
    let fused = built(CheckpointPolicy::All, true);
    assert_eq!(fused.len(), 7, "{fused:#?}");
    assert!(fused.iter().all(|l| l.starts_with("checkpoint[")));
    // Unfused, layer by layer.
    let summary = |policy| built(policy, false);
    let none = summary(CheckpointPolicy::None);
    assert_eq!(none.len(), 17);
    assert!(none.iter().all(|l| !l.contains("checkpoint")));
    // Stems stay, each basic block (residual + relu) is one segment.
    let blocks = summary(CheckpointPolicy::Blocks);
    assert_eq!(blocks.len(), 14, "{blocks:#?}");
    assert_eq!(
        blocks.iter().filter(|l| l.contains("checkpoint[")).count(),
        3
    );
    // Runs of 3 and 2 plain entries are one segment each (⌊√3⌋ = ⌊√2⌋ = 1).
    let all = summary(CheckpointPolicy::All);
    assert_eq!(all.len(), 7, "{all:#?}");
    assert!(all.iter().all(|l| l.starts_with("checkpoint[")));
    // Same parameters in the same order (checkpoints rely on it).
    let names = |policy| -> Vec<String> {
        Network::build(&with_policy(&reference(), policy), 0)
            .unwrap()
            .params_mut()
            .iter()
            .map(|p| p.name.clone())
            .collect()
    };
    assert_eq!(names(CheckpointPolicy::None), names(CheckpointPolicy::All));
}

#[test]
fn checkpoint_is_a_model_key_with_a_default() {
    let text = common::REFERENCE.replace("std = 0.3530", "std = 0.3530\ncheckpoint = \"blocks\"");
    assert_eq!(parse(&text).unwrap().checkpoint, CheckpointPolicy::Blocks);
    let text = common::REFERENCE.replace("std = 0.3530", "std = 0.3530\ncheckpoint = \"all\"");
    assert_eq!(parse(&text).unwrap().checkpoint, CheckpointPolicy::All);
    assert_eq!(reference().checkpoint, CheckpointPolicy::None);
    let text = common::REFERENCE.replace("std = 0.3530", "std = 0.3530\ncheckpoint = \"some\"");
    let err = parse(&text).unwrap_err();
    assert!(err.to_string().contains("some"), "{err}");
    // `none` is left out of the serialised spec (old fingerprints hold).
    let json = to_toml(&reference());
    assert!(!json.contains("checkpoint"), "{json}");
    let json = to_toml(&with_policy(&reference(), CheckpointPolicy::Blocks));
    assert!(json.contains("checkpoint = \"blocks\""), "{json}");
}

/// The spec serialised to TOML (the crate's dev-dependency).
fn to_toml(spec: &ModelSpec) -> String {
    toml::to_string(spec).unwrap()
}

/// Pool statistics of one training step (forward, loss, backward, all
/// dropped) in a private pool. The parameters live in the device pool.
fn step_stats(net: &mut Network, n: usize) -> PoolStats {
    let spec = net.spec().clone();
    let (pixels, labels) = batch(&spec, n, 1);
    let pool = MemoryPool::new(headroom_model::Device::Cpu);
    pool.scope(|| {
        let x = net.input_from_u8(n, &pixels).unwrap();
        net.zero_grad();
        step(net, &x, &labels, 1.0).unwrap();
    });
    let stats = pool.stats();
    assert_eq!(stats.in_use_bytes, 0, "a step leaves nothing behind");
    stats
}

#[test]
fn checkpointing_lowers_the_peak_of_a_step() {
    let n = 32;
    let mut peaks = Vec::new();
    for policy in POLICIES {
        let mut net = Network::build(&with_policy(&reference(), policy), 0).unwrap();
        let s = step_stats(&mut net, n);
        println!(
            "reference ResNet, batch {n}, checkpoint {policy:?}: peak in use {:.1} MiB, \
             peak reserved {:.1} MiB, {} allocations ({} hits)",
            s.peak_in_use_bytes as f64 / (1 << 20) as f64,
            s.peak_reserved_bytes as f64 / (1 << 20) as f64,
            s.allocations,
            s.cache_hits
        );
        peaks.push(s.peak_in_use_bytes);
    }
    let [none, blocks, all] = peaks[..] else {
        unreachable!()
    };
    assert!(blocks < none, "blocks {blocks} vs none {none}");
    assert!(all < none, "all {all} vs none {none}");
}

#[test]
fn measure_step_peak_matches_a_real_step_and_changes_nothing() {
    for policy in [CheckpointPolicy::None, CheckpointPolicy::Blocks] {
        let spec = with_policy(&reference(), policy);
        let mut net = Network::build(&spec, 0).unwrap();
        let buffers = net.buffer_values();
        let measured = headroom_model::measure_step_peak(&mut net, 16).unwrap();
        assert_eq!(net.buffer_values(), buffers, "running statistics untouched");
        assert!(grads(&mut net).iter().flatten().all(|&g| g == 0.0));
        let real = step_stats(&mut net, 16).peak_in_use_bytes;
        let diff = measured.abs_diff(real) as f64 / real as f64;
        println!("{policy:?}: measured {measured} B, real step {real} B");
        assert!(diff < 0.02, "measured {measured} vs real {real}");
        // Twice the batch, about twice the peak.
        let double = headroom_model::measure_step_peak(&mut net, 32).unwrap();
        let ratio = double as f64 / measured as f64;
        assert!((1.6..2.2).contains(&ratio), "{double} / {measured}");
        // The network still trains after it.
        let (pixels, labels) = batch(&spec, 4, 2);
        let x = net.input_from_u8(4, &pixels).unwrap();
        step(&mut net, &x, &labels, 1.0).unwrap();
    }
}

#[test]
fn eval_under_checkpointing_saves_nothing() {
    let mut net = Network::build(&with_policy(&small(), CheckpointPolicy::All), 1).unwrap();
    let x = Tensor::try_zeros(&[2, 8, 8, 1]).unwrap();
    let logits = net.forward(&x, Mode::Eval).unwrap();
    assert!(net.backward(&logits).is_err());
}
