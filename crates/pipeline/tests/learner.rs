//! The CPU learner behind the training loop's seam: a skipped step leaves
//! everything as it was (batch-norm statistics included), a refused restore
//! changes nothing, and snapshot + restore continue bit for bit.

use headroom_loader::Batch;
use headroom_model::memory::MemoryPool;
use headroom_model::{Device, ModelSpec};
use headroom_optim::AdamWConfig;
use headroom_pipeline::learner::{CpuLearner, Learner, LearnerState, StepSettings};

const MODEL: &str = r#"
input = [8, 8, 1]
mean = 0.5
std = 0.25
layers = [
  { type = "conv", out = 4 }, { type = "batch_norm" }, { type = "relu" },
  { type = "global_avg_pool" },
  { type = "linear", out = 3 },
]
"#;

fn settings() -> StepSettings {
    StepSettings {
        label_smoothing: 0.1,
        clip_norm: 1.0,
        optimizer: AdamWConfig {
            weight_decay: 1e-4,
            ..AdamWConfig::default()
        },
    }
}

fn learner(seed: u64) -> CpuLearner {
    let spec: ModelSpec = toml::from_str(MODEL).unwrap();
    CpuLearner::new(&spec, seed, settings(), 6, MemoryPool::new(Device::Cpu)).unwrap()
}

fn batch(index: usize) -> Batch {
    let n = 6;
    Batch {
        epoch: 0,
        index,
        shape: [n, 8, 8, 1],
        pixels: (0..n * 64)
            .map(|i| ((i * 2_654_435_761 + index * 97) >> 11) as u8)
            .collect(),
        labels: (0..n as u32).map(|i| i % 3).collect(),
        soft_targets: None,
    }
}

/// Every value of the state as bits, so NaN compares equal to itself.
fn bits(state: &LearnerState) -> Vec<u32> {
    let params = state.params.iter().flatten();
    let buffers = state.buffers.iter().flatten();
    let moments = state
        .optimizer
        .first_moment
        .iter()
        .chain(&state.optimizer.second_moment)
        .flatten();
    params
        .chain(buffers)
        .chain(moments)
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn skipped_step_leaves_weights_and_batch_norm_statistics_as_they_were() {
    let mut learner = learner(1);
    learner.train_batch(&batch(0), 1e-2).unwrap();
    let mut poisoned = learner.snapshot().unwrap();
    // A NaN weight makes the loss non-finite: the step must be skipped.
    poisoned.params[0][0] = f32::NAN;
    learner.restore(poisoned).unwrap();
    let before = learner.snapshot().unwrap();
    assert!(before.buffers.iter().flatten().all(|v| v.is_finite()));

    let result = learner.train_batch(&batch(1), 1e-2).unwrap();
    assert_eq!(result.grad_norm, None, "the step is skipped");
    let after = learner.snapshot().unwrap();
    assert!(
        after.buffers.iter().flatten().all(|v| v.is_finite()),
        "the skipped batch's statistics were kept"
    );
    assert_eq!(bits(&before), bits(&after));
    assert_eq!(before.optimizer.step, after.optimizer.step);
}

#[test]
fn restore_refuses_another_shape_and_changes_nothing() {
    let mut learner = learner(2);
    learner.train_batch(&batch(0), 1e-2).unwrap();
    let before = learner.snapshot().unwrap();
    let mut wrong = before.clone();
    wrong.params[1].pop();
    let err = learner.restore(wrong).unwrap_err();
    assert!(err.contains("values, the model expects"), "{err}");
    let mut fewer = before.clone();
    fewer.buffers.pop();
    let err = learner.restore(fewer).unwrap_err();
    assert!(err.contains("buffers, the model has"), "{err}");
    assert_eq!(bits(&before), bits(&learner.snapshot().unwrap()));
}

#[test]
fn snapshot_and_restore_continue_bit_for_bit() {
    let mut first = learner(3);
    for i in 0..3 {
        first.train_batch(&batch(i), 1e-2).unwrap();
    }
    let mut second = learner(99);
    second.restore(first.snapshot().unwrap()).unwrap();
    for i in 3..6 {
        let a = first.train_batch(&batch(i), 1e-2).unwrap();
        let b = second.train_batch(&batch(i), 1e-2).unwrap();
        assert_eq!(a.loss.to_bits(), b.loss.to_bits());
    }
    assert_eq!(
        bits(&first.snapshot().unwrap()),
        bits(&second.snapshot().unwrap())
    );
}

#[test]
fn evaluation_changes_nothing_and_predicts_every_sample() {
    let mut learner = learner(4);
    learner.train_batch(&batch(0), 1e-2).unwrap();
    let before = learner.snapshot().unwrap();
    learner.set_micro_batch(4);
    let result = learner.eval_batch(&batch(1)).unwrap();
    assert_eq!(result.predictions.len(), 6);
    assert!(result.predictions.iter().all(|&p| p < 3));
    assert!(result.loss_sum.is_finite() && result.loss_sum > 0.0);
    assert_eq!(bits(&before), bits(&learner.snapshot().unwrap()));
}
