//! The OOM policy end to end on the CPU: a budget that fits a micro-batch of
//! 32 but not 128 adapts and ends bit-identical to 32 x 4 accumulation;
//! injected OOMs change nothing; a budget too small for one sample stops with
//! a checkpoint, and a larger budget resumes it to the end.

use std::path::Path;

use headroom_pipeline::checkpoint::{self, Checkpoint};
use headroom_pipeline::{train, ExperimentConfig, Overrides, Resume, RunSummary, TrainOptions};
use headroom_tests::{budget_between_32_and_64, write_synthetic_fashion_mnist};

fn smoke_config(data: &Path, out: &Path, extra: &[String]) -> ExperimentConfig {
    let mut pairs = vec![
        format!("data.dir={}", data.display()),
        format!("run.output_dir={}", out.display()),
        "train.epochs=2".into(),
        "train.batch_size=128".into(),
        "train.threads=2".into(),
    ];
    pairs.extend(extra.iter().cloned());
    let experiments = Path::new(env!("CARGO_MANIFEST_DIR")).join("../experiments/smoke.toml");
    ExperimentConfig::load(&experiments, &Overrides::parse(&pairs).unwrap()).unwrap()
}

fn newest(dir: &Path) -> Checkpoint {
    checkpoint::load(checkpoint::list(dir).unwrap().last().unwrap()).unwrap()
}

#[test]
fn budget_for_32_adapts_a_batch_of_128_to_match_32_x_4_accumulation() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 1024, 256);
    let (adapted, accumulated) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());

    let probe = smoke_config(data.path(), adapted.path(), &[]);
    let limit = budget_between_32_and_64(&probe);
    // No low-memory profile: its dry-run planning would pick 32 up front,
    // and this test is about adapting when the OOM comes.
    let config = smoke_config(
        data.path(),
        adapted.path(),
        &[
            format!("device.memory_limit={limit}"),
            "run.profile=none".into(),
        ],
    );
    let summary = train(&config, &TrainOptions::default()).unwrap();
    assert_eq!(summary.micro_batch, 32, "128 -> 64 -> 32");
    assert!(summary.oom_events >= 2, "{summary:?}");
    assert!(summary.memory.reserved_bytes <= limit);

    let reference = smoke_config(
        data.path(),
        accumulated.path(),
        &["train.accumulate=4".into()],
    );
    train(&reference, &TrainOptions::default()).unwrap();

    let (a, b) = (newest(adapted.path()), newest(accumulated.path()));
    assert_eq!(a.meta.step, b.meta.step);
    assert!(
        a.params == b.params,
        "weights differ from 32 x 4 accumulation"
    );
    assert!(a.buffers == b.buffers, "batch-norm statistics differ");
    assert!(a.optimizer == b.optimizer, "optimizer state differs");
}

#[test]
fn injected_oom_at_50_random_steps_changes_nothing() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 2048, 256);
    let (clean, faulty) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let base = ["train.batch_size=32".to_string(), "train.epochs=3".into()];
    let config = smoke_config(data.path(), clean.path(), &base);
    let clean_summary = train(&config, &TrainOptions::default()).unwrap();

    // 50 distinct steps out of the 192, from a fixed pseudo-random sequence.
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut steps = std::collections::BTreeSet::new();
    while steps.len() < 50 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        steps.insert(state % 192);
    }
    let list = steps
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let mut extra = base.to_vec();
    extra.push(format!("device.inject_oom.steps=[{list}]"));
    extra.push("run.profile=none".into());
    let config = smoke_config(data.path(), faulty.path(), &extra);
    assert_eq!(config.device.inject_oom.steps.len(), 50);
    let summary = train(&config, &TrainOptions::default()).unwrap();
    assert_eq!(summary.oom_events, 50);

    let (a, b) = (newest(clean.path()), newest(faulty.path()));
    assert!(a.params == b.params, "an injected OOM changed the weights");
    let (clean_loss, faulty_loss) = (
        clean_summary.epochs[2].train_loss,
        summary.epochs[2].train_loss,
    );
    assert_eq!(clean_loss, faulty_loss);
}

#[test]
fn budget_too_small_for_one_sample_stops_with_a_checkpoint_and_resumes_with_more() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 512, 64);
    let out = tempfile::tempdir().unwrap();
    let probe = smoke_config(data.path(), out.path(), &[]);
    let generous = budget_between_32_and_64(&probe) * 4;

    // Enough for the first epoch, then the budget is cut below one sample.
    let first = smoke_config(data.path(), out.path(), &["train.epochs=1".into()]);
    train(&first, &TrainOptions::default()).unwrap();
    let tight = smoke_config(
        data.path(),
        out.path(),
        &["device.memory_limit=120KiB".into()],
    );
    let resume = TrainOptions {
        resume: Resume::Latest,
        ..Default::default()
    };
    let err = train(&tight, &resume).unwrap_err().to_string();
    assert!(
        err.contains("out of memory") && err.contains("device.memory_limit"),
        "{err}"
    );
    assert!(err.contains("--resume"), "{err}");
    let saved = newest(out.path());
    assert_eq!(
        saved.meta.epoch, 1,
        "the checkpoint holds the last completed step"
    );

    let roomy = smoke_config(
        data.path(),
        out.path(),
        &[format!("device.memory_limit={generous}")],
    );
    let summary = train(&roomy, &resume).unwrap();
    assert_eq!(summary.epoch, 2);
    assert!(summary.test_accuracy.is_some());
}

/// Trains the smoke run on `data` twice, as it is and with `sets`; the
/// second writes the checkpoints of the first (weights, buffers, optimizer)
/// and reports the same losses and accuracies. Its summary.
fn train_beside_a_clean_run(data: &Path, sets: &[String]) -> RunSummary {
    let (clean, changed) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let clean_summary = train(
        &smoke_config(data, clean.path(), &[]),
        &TrainOptions::default(),
    )
    .unwrap();
    let summary = train(
        &smoke_config(data, changed.path(), sets),
        &TrainOptions::default(),
    )
    .unwrap();
    let (clean, changed) = (
        checkpoint::list(clean.path()).unwrap(),
        checkpoint::list(changed.path()).unwrap(),
    );
    assert_eq!(changed.len(), 2);
    for (a, b) in clean.iter().zip(&changed) {
        let (a, b) = (checkpoint::load(a).unwrap(), checkpoint::load(b).unwrap());
        assert_eq!(a.meta.step, b.meta.step);
        assert!(a.params == b.params && a.buffers == b.buffers && a.optimizer == b.optimizer);
    }
    let figures = |s: &RunSummary| {
        s.epochs
            .iter()
            .map(|e| (e.train_loss, e.test_loss, e.test_accuracy))
            .collect::<Vec<_>>()
    };
    assert_eq!(figures(&clean_summary), figures(&summary));
    summary
}

#[test]
fn an_evaluation_out_of_memory_is_retried_and_changes_nothing() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 512, 64);
    let sets = ["device.inject_oom.evaluations=1,2".to_string()];
    let summary = train_beside_a_clean_run(data.path(), &sets);
    assert_eq!(summary.oom_events, 2, "{summary:?}");
    assert_eq!(summary.micro_batch, 128, "the cache released was enough");
}

#[test]
fn an_evaluation_out_of_memory_under_the_stop_policy_keeps_the_epoch() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 512, 64);
    let (clean, stopped) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    train(
        &smoke_config(data.path(), clean.path(), &[]),
        &TrainOptions::default(),
    )
    .unwrap();
    let sets = [
        "device.inject_oom.evaluations=1".to_string(),
        "memory.oom_policy=stop".into(),
    ];
    let config = smoke_config(data.path(), stopped.path(), &sets);
    let err = train(&config, &TrainOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("out of memory in the evaluation after training epoch 1"),
        "{err}"
    );
    assert!(
        err.contains("is saved in") && err.contains("--resume"),
        "{err}"
    );
    assert!(err.contains("free memory"), "{err}");
    let saved = newest(stopped.path()).meta;
    assert_eq!(
        (saved.epoch, saved.batches_done),
        (0, 512 / 128),
        "{saved:?}"
    );

    let resume = TrainOptions {
        resume: Resume::Latest,
        ..Default::default()
    };
    let summary = train(&smoke_config(data.path(), stopped.path(), &[]), &resume).unwrap();
    assert_eq!(
        summary.epochs.len(),
        2,
        "the first epoch evaluated on resume"
    );
    let (a, b) = (newest(clean.path()), newest(stopped.path()));
    assert_eq!(a.meta.step, b.meta.step);
    assert!(a.params == b.params && a.optimizer == b.optimizer);
}

/// A run whose first `refusals` checkpoint copies memory refuses writes
/// the checkpoints of a run never refused, with an out-of-memory event for
/// each refusal.
fn refused_copies_leave_the_checkpoints_of_a_clean_run(refusals: u64) {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 512, 64);
    let sets = [format!("device.inject_oom.snapshots={refusals}")];
    let summary = train_beside_a_clean_run(data.path(), &sets);
    assert_eq!(summary.oom_events, refusals, "{summary:?}");
}

#[test]
fn a_refused_checkpoint_copy_is_made_again_after_releasing_the_cache() {
    refused_copies_leave_the_checkpoints_of_a_clean_run(1);
}

/// Refused twice, the copy is not made at all: the loop writes the
/// learner's own tensors to the file.
#[test]
fn a_checkpoint_copy_refused_twice_is_written_from_the_learner_s_own_tensors() {
    refused_copies_leave_the_checkpoints_of_a_clean_run(2);
}

/// A copy that would take more than half the memory left is not made:
/// the checkpoints are written with no copy, and are a clean run's.
#[test]
fn a_copy_that_would_crowd_the_memory_left_is_not_made() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 512, 64);
    let room = "device.inject_oom.snapshot_room=4096".to_string();
    let summary = train_beside_a_clean_run(data.path(), std::slice::from_ref(&room));
    assert_eq!(summary.oom_events, 0, "{summary:?}");

    // No copy was even tried: the one refusal falls on the write with no
    // copy (a copy would have taken it, and its retry succeeded).
    let refused = tempfile::tempdir().unwrap();
    let config = smoke_config(
        data.path(),
        refused.path(),
        &[room, "device.inject_oom.snapshots=1".into()],
    );
    let err = train(&config, &TrainOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("out of memory writing the checkpoint of step"),
        "{err}"
    );
}

#[test]
fn a_checkpoint_refused_even_with_no_copy_stops_and_keeps_the_last_checkpoint() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 512, 64);
    let out = tempfile::tempdir().unwrap();
    let first = smoke_config(data.path(), out.path(), &["train.epochs=1".into()]);
    train(&first, &TrainOptions::default()).unwrap();
    let resume = TrainOptions {
        resume: Resume::Latest,
        ..Default::default()
    };
    let refusing = smoke_config(
        data.path(),
        out.path(),
        &["device.inject_oom.snapshots=3".into()],
    );
    let err = train(&refusing, &resume).unwrap_err().to_string();
    assert!(
        err.contains("out of memory writing the checkpoint of step")
            && err.contains(&out.path().display().to_string())
            && err.contains("--resume"),
        "{err}"
    );
    assert_eq!(
        newest(out.path()).meta.epoch,
        1,
        "epoch 1's checkpoint stays"
    );
    let strays: Vec<_> = std::fs::read_dir(out.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|name| name.to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(strays.is_empty(), "{strays:?}");

    let summary = train(&smoke_config(data.path(), out.path(), &[]), &resume).unwrap();
    assert_eq!(summary.epoch, 2);
}
