//! The CPU learner behind the training loop's seam: a skipped step leaves
//! everything as it was (batch-norm statistics included), a step whose
//! update would overflow a weight is skipped, a refused restore
//! changes nothing, snapshot + restore continue bit for bit, a state
//! written with no copy is the snapshot's file, and flip
//! test-time augmentation scores an image and its mirror image alike.

mod common;

use common::{bits, settings};
use std::sync::Arc;

use headroom_loader::{Batch, DataLoader, Dataset, LoaderConfig, LoaderError, SyntheticDataset};
use headroom_model::memory::MemoryPool;
use headroom_model::{BuildOptions, Device, ModelSpec};
use headroom_pipeline::config::TestTimeAugmentation;
use headroom_pipeline::eval::{evaluate, Evaluation};
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
    CpuLearner::new(
        &spec,
        seed,
        BuildOptions::default(),
        settings(),
        6,
        MemoryPool::new(Device::Cpu),
    )
    .unwrap()
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
fn a_step_whose_update_would_overflow_a_weight_is_skipped_and_changes_nothing() {
    let mut learner = learner(3);
    learner.train_batch(&batch(0), 1e-2).unwrap();
    let before = learner.snapshot().unwrap();
    // A finite gradient and a finite learning rate whose step size
    // (lr / (1 - β1)) is beyond f32: applied, the update would write
    // infinities into every weight it moves.
    let result = learner.train_batch(&batch(1), 1e38).unwrap();
    assert_eq!(result.grad_norm, None, "the step is skipped");
    assert!(result.loss.is_finite(), "the loss itself was fine");
    let after = learner.snapshot().unwrap();
    assert_eq!(bits(&before), bits(&after));
    assert_eq!(before.optimizer.step, after.optimizer.step);
    // And the next ordinary step applies.
    let result = learner.train_batch(&batch(2), 1e-2).unwrap();
    assert!(result.grad_norm.is_some());
    assert_eq!(
        learner.snapshot().unwrap().optimizer.step,
        before.optimizer.step + 1
    );
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
fn a_state_written_with_no_copy_is_the_snapshot_s_file() {
    let mut learner = learner(3);
    common::assert_writes_its_snapshot(&mut learner);
    for i in 0..3 {
        learner.train_batch(&batch(i), 1e-2).unwrap();
    }
    common::assert_writes_its_snapshot(&mut learner);
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
            regression: None,
            ..settings()
        };
        let mut learner = CpuLearner::new(
            &spec,
            8,
            BuildOptions::default(),
            settings,
            6,
            MemoryPool::new(Device::Cpu),
        )
        .unwrap();
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

#[test]
fn class_probabilities_agree_with_the_evaluation() {
    let mut learner = learner(4);
    learner.train_batch(&batch(0), 1e-2).unwrap();
    let batch = batch(1);
    let evaluated = learner.eval_batch(&batch).unwrap();
    let probabilities = learner.eval_probabilities(&batch).unwrap();
    assert_eq!(probabilities.len(), batch.len() * 3);
    let mut loss_sum = 0.0f64;
    for ((row, &label), &predicted) in probabilities
        .chunks_exact(3)
        .zip(&batch.labels)
        .zip(&evaluated.predictions)
    {
        assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5, "{row:?}");
        assert_eq!(headroom_pipeline::learner::arg_max(row), predicted);
        loss_sum -= f64::from(row[label as usize]).ln();
    }
    assert!(
        (loss_sum - evaluated.loss_sum).abs() < 1e-4 * evaluated.loss_sum,
        "{loss_sum} against {}",
        evaluated.loss_sum
    );
}

/// Synthetic 8×8 images, or the same images mirrored left to right.
struct Images {
    inner: SyntheticDataset,
    mirrored: bool,
}

impl Dataset for Images {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn sample_shape(&self) -> [usize; 3] {
        self.inner.sample_shape()
    }
    fn num_classes(&self) -> usize {
        self.inner.num_classes()
    }
    fn read(&self, index: usize, out: &mut [u8]) -> Result<u32, LoaderError> {
        let label = self.inner.read(index, out)?;
        if self.mirrored {
            out.chunks_exact_mut(8).for_each(|row| row.reverse());
        }
        Ok(label)
    }
}

fn evaluation(learner: &mut CpuLearner, mirrored: bool, tta: TestTimeAugmentation) -> Evaluation {
    let images = Images {
        inner: SyntheticDataset::new(20, [8, 8, 1], 3),
        mirrored,
    };
    let config = LoaderConfig {
        batch_size: 6,
        ..LoaderConfig::default()
    };
    let loader = DataLoader::new(Arc::new(images), config).unwrap();
    evaluate(learner, &loader, tta).unwrap()
}

#[test]
fn flip_test_time_augmentation_scores_an_image_and_its_mirror_alike() {
    let mut learner = learner(5);
    for i in 0..4 {
        learner.train_batch(&batch(i), 1e-2).unwrap();
    }
    let plain = evaluation(&mut learner, false, TestTimeAugmentation::None);
    let plain_mirrored = evaluation(&mut learner, true, TestTimeAugmentation::None);
    assert_ne!(
        plain.loss, plain_mirrored.loss,
        "the model is not symmetric"
    );
    let flip = evaluation(&mut learner, false, TestTimeAugmentation::Flip);
    let flip_mirrored = evaluation(&mut learner, true, TestTimeAugmentation::Flip);
    // Averaging over {x, mirror(x)} cannot tell x from mirror(x).
    assert!((flip.loss - flip_mirrored.loss).abs() < 1e-6);
    assert_eq!(flip.confusion, flip_mirrored.confusion);
    assert_eq!(flip.samples, 20);
    assert_ne!(flip.loss, plain.loss, "flip scored the mirror images too");
}
