//! The CPU learner behind the training loop's seam: a skipped step leaves
//! everything as it was (batch-norm statistics included), a refused restore
//! changes nothing, and snapshot + restore continue bit for bit.

mod common;

use common::{bits, settings};
use headroom_loader::Batch;
use headroom_model::memory::MemoryPool;
use headroom_model::{Device, ModelSpec};
use headroom_pipeline::learner::{CpuLearner, Learner, StepSettings};

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

fn learner(seed: u64) -> CpuLearner {
    let spec: ModelSpec = toml::from_str(MODEL).unwrap();
    CpuLearner::new(&spec, seed, settings(), 6, MemoryPool::new(Device::Cpu)).unwrap()
}

fn batch(index: usize) -> Batch {
    common::batch(index, 6, 3)
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

#[test]
fn focal_loss_reaches_the_step_when_configured() {
    let spec: ModelSpec = toml::from_str(MODEL).unwrap();
    let with_gamma = |gamma: Option<f32>| {
        let settings = StepSettings {
            focal_gamma: gamma,
            ..settings()
        };
        let mut learner =
            CpuLearner::new(&spec, 8, settings, 6, MemoryPool::new(Device::Cpu)).unwrap();
        learner.train_batch(&batch(0), 1e-2).unwrap().loss
    };
    let ce_loss = with_gamma(None);
    // γ = 0 is cross-entropy (computed another way: equal within rounding);
    // γ = 2 down-weights every sample.
    let zero_loss = with_gamma(Some(0.0));
    assert!(
        (ce_loss - zero_loss).abs() <= 1e-6 * ce_loss,
        "{ce_loss} vs {zero_loss}"
    );
    let focal_loss = with_gamma(Some(2.0));
    assert!(
        focal_loss < ce_loss,
        "focal {focal_loss}, cross-entropy {ce_loss}"
    );
}
