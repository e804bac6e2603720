//! Shared by the learner tests: step settings, synthetic batches, a
//! learner state as bits (so NaN compares equal to itself), and the check
//! that a state written with no copy makes a snapshot's file.

use headroom_loader::Batch;
use headroom_optim::AdamWConfig;
use headroom_pipeline::checkpoint::{self, Checkpoint, CheckpointMeta};
use headroom_pipeline::learner::{Learner, LearnerState, StepSettings};

pub fn settings() -> StepSettings {
    StepSettings {
        label_smoothing: 0.1,
        clip_norm: 1.0,
        focal_gamma: None,
        regression: None,
        optimizer: AdamWConfig {
            weight_decay: 1e-4,
            ..AdamWConfig::default()
        },
    }
}

/// `n` pseudo-random 8×8 grey images labelled 0..classes in turn; a
/// different batch for every `index`.
pub fn batch(index: usize, n: usize, classes: usize) -> Batch {
    Batch {
        epoch: 0,
        index,
        shape: [n, 8, 8, 1],
        pixels: (0..n * 64)
            .map(|i| (((i * 2_654_435_761) >> 7) ^ (index * 131)) as u8)
            .collect(),
        labels: (0..n).map(|i| ((i + index) % classes) as u32).collect(),
        soft_targets: None,
        recipes: None,
        features: None,
        values: None,
    }
}

/// Every value of the state (parameters, buffers, moments) as bits.
pub fn bits(state: &LearnerState) -> Vec<u32> {
    let all = [
        &state.params,
        &state.buffers,
        &state.optimizer.first_moment,
        &state.optimizer.second_moment,
    ];
    all.iter()
        .flat_map(|v| v.iter().flatten())
        .map(|x| x.to_bits())
        .collect()
}

/// The checkpoint file `write_state` makes holds the very bytes of the one
/// a snapshot of the same learner makes: the same tensors, each of the
/// same length, the same optimizer step and loss scale.
#[allow(dead_code)] // cuda_ranks.rs does not write states
pub fn assert_writes_its_snapshot(learner: &mut dyn Learner) {
    let meta = CheckpointMeta {
        config_fingerprint: 1,
        config_json: "{}".into(),
        model_json: "{}".into(),
        epoch: 0,
        batches_done: 3,
        step: 3,
        consecutive_skips: 0,
        progress: Default::default(),
        tuned_convs: Vec::new(),
        monitor: Default::default(),
    };
    let dir = tempfile::tempdir().unwrap();
    let path =
        checkpoint::write_with(dir.path(), &meta, 1, |out| learner.write_state(out)).unwrap();
    let expected = Checkpoint::new(meta, learner.snapshot().unwrap())
        .encode()
        .unwrap();
    let written = std::fs::read(&path).unwrap();
    assert_eq!(written.len(), expected.len());
    assert!(written == expected, "the bytes differ");
}
