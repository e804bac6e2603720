//! The CPU profile (`Network::profile_start`, what `cargo xtask bench
//! --profile` prints on the CPU): a segment per layer part, residual blocks
//! opened up, a checkpointed group whole, and only this thread's network.

mod common;

use common::{batch, small, step};
use headroom_model::{CheckpointPolicy, ModelSpec, Network};

/// Labels of one profiled training step of `spec`, each with its count.
fn profiled_step(spec: &ModelSpec) -> Vec<(String, u64)> {
    let mut net = Network::build(spec, 3).unwrap();
    let (pixels, labels) = batch(spec, 4, 1);
    let x = net.input_from_u8(4, &pixels).unwrap();
    net.profile_start();
    step(&mut net, &x, &labels, 1.0).unwrap();
    net.profile_mark(|| "after the step".into());
    let segments = net.profile_finish();
    assert!(segments.iter().all(|s| s.ms >= 0.0), "{segments:?}");
    // Profiling has stopped: another step adds nothing.
    step(&mut net, &x, &labels, 1.0).unwrap();
    assert!(net.profile_finish().is_empty());
    segments.into_iter().map(|s| (s.label, s.count)).collect()
}

#[test]
fn a_profile_opens_residual_blocks_and_names_every_part() {
    let labels = profiled_step(&small());
    let names: Vec<&str> = labels.iter().map(|(l, _)| l.as_str()).collect();
    // No container is marked whole: its parts and its add are.
    assert!(!names.iter().any(|l| l.contains("residual[")), "{names:?}");
    for expected in [
        "fwd residual bn 8+add+relu",
        "bwd residual bn 8+add+relu",
        "fwd residual add in",
        "bwd residual add out",
        "after the step",
    ] {
        assert!(
            names.iter().any(|l| l.starts_with(expected)),
            "no {expected:?} in {names:?}"
        );
    }
    // Five forward convolutions: the stem, the basic block's two, the plain
    // residual's and the stride-2 one (same labels add up).
    let convs: u64 = labels
        .iter()
        .filter(|(l, _)| l.starts_with("fwd conv"))
        .map(|(_, n)| n)
        .sum();
    assert_eq!(convs, 5, "{labels:?}");
    assert!(
        names
            .iter()
            .all(|l| l.starts_with("fwd ") || l.starts_with("bwd ") || *l == "after the step"),
        "{names:?}"
    );
}

#[test]
fn a_checkpointed_group_is_one_segment() {
    let spec = ModelSpec {
        checkpoint: CheckpointPolicy::Blocks,
        ..small()
    };
    let labels = profiled_step(&spec);
    let names: Vec<&str> = labels.iter().map(|(l, _)| l.as_str()).collect();
    assert!(
        names.iter().any(|l| l.starts_with("fwd checkpoint[")),
        "{names:?}"
    );
    assert!(
        names.iter().any(|l| l.starts_with("bwd checkpoint[")),
        "{names:?}"
    );
    // Nothing inside a checkpoint marks (its recompute would read as a
    // second forward).
    assert!(
        !names.iter().any(|l| l.contains("residual add")),
        "{names:?}"
    );
}

#[test]
fn a_profile_sees_only_its_own_thread() {
    let spec = small();
    let mut net = Network::build(&spec, 3).unwrap();
    net.profile_start();
    std::thread::spawn(move || {
        let mut other = Network::build(&spec, 4).unwrap();
        let (pixels, labels) = batch(&spec, 2, 2);
        let x = other.input_from_u8(2, &pixels).unwrap();
        step(&mut other, &x, &labels, 1.0).unwrap();
    })
    .join()
    .unwrap();
    assert!(net.profile_finish().is_empty());
}
