//! Shared by the learner tests: step settings, synthetic batches, and a
//! learner state as bits (so NaN compares equal to itself).

use headroom_loader::Batch;
use headroom_optim::AdamWConfig;
use headroom_pipeline::learner::{LearnerState, StepSettings};

pub fn settings() -> StepSettings {
    StepSettings {
        label_smoothing: 0.1,
        clip_norm: 1.0,
        focal_gamma: None,
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
