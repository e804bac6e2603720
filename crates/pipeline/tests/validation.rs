//! `data.validation` and `train.early_stopping`: epochs are scored on a
//! split held out of the training set and the test set once at the end;
//! the best epoch's checkpoint is kept as `best.ckpt`, the run stops after
//! `patience` epochs without a better figure, the test figures are the best
//! checkpoint's, and a run stopped and resumed ends as one never stopped.
//! Data: a generated CSV table, trained on the CPU in seconds.

use std::fmt::Write as _;
use std::path::Path;

use headroom_pipeline::eval::evaluate_checkpoint;
use headroom_pipeline::{train, Resume, TrainOptions};

#[path = "tabular_fixtures/mod.rs"]
mod tabular_fixtures;
use tabular_fixtures::{load, noise};

/// `train.csv` and `test.csv`: features a, b, c and the class `size`
/// ("small" when 3a - 2b + c² is below 0).
fn write_tables(dir: &Path, rows: [usize; 2]) {
    std::fs::create_dir_all(dir).unwrap();
    let mut offset = 0;
    for (name, count) in ["train.csv", "test.csv"].into_iter().zip(rows) {
        let mut text = String::from("a,b,c,size\n");
        for i in offset..offset + count {
            let (a, b, c) = (noise(3 * i), noise(3 * i + 1), noise(3 * i + 2));
            let size = if 3.0 * a - 2.0 * b + c * c < 0.0 {
                "small"
            } else {
                "large"
            };
            writeln!(text, "{a:.6},{b:.6},{c:.6},{size}").unwrap();
        }
        std::fs::write(dir.join(name), text).unwrap();
        offset += count;
    }
}

fn sets(tables: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    let mut sets = vec![
        format!("data.dir={}", tables.display()),
        "train.loss=cross_entropy".into(),
        r#"data.targets=["size"]"#.into(),
        "model.input=[1, 3, 1]".into(),
        r#"model.layers=[{type="flatten"}, {type="linear", out=16}, {type="relu"}, {type="linear", out=2}]"#.into(),
        "train.threads=2".into(),
        "data.workers=1".into(),
        // The same learning rate at every step, so that a run cut in two
        // (whose total steps change on resume) follows the same updates.
        "schedule.kind=constant".into(),
        format!("run.output_dir={}", out.display()),
    ];
    sets.extend(extra.iter().map(|s| s.to_string()));
    sets
}

fn options(resume: Resume) -> TrainOptions {
    TrainOptions {
        resume,
        allow_install: false,
        stop: None,
        ..Default::default()
    }
}

/// The `metrics.jsonl` lines of `kind`, as JSON.
fn records(run: &Path, kind: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
        .filter(|line| line["kind"] == kind)
        .map(|line| line["data"].clone())
        .collect()
}

#[test]
fn epochs_are_scored_on_the_validation_split_and_the_test_set_once_at_the_end() {
    let dir = tempfile::tempdir().unwrap();
    let (tables, out) = (dir.path().join("table"), dir.path().join("run"));
    write_tables(&tables, [1000, 200]);
    let extra = ["train.epochs=3", "data.validation=0.2"];
    let summary = train(
        &load(&sets(&tables, &out, &extra)).unwrap(),
        &options(Resume::No),
    )
    .unwrap();

    let epochs = records(&out, "epoch");
    assert_eq!(epochs.len(), 3);
    let lines = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let first = lines
        .lines()
        .find(|l| l.contains(r#""kind":"epoch""#))
        .unwrap();
    let loss = epochs[0]["validation_loss"].as_f64().unwrap() as f32;
    assert!(
        first.contains(&format!(r#""validation_loss":{loss}"#)),
        "an f32 is written in its shortest form: {first}"
    );
    for epoch in &epochs {
        assert!(epoch["validation_loss"].is_f64(), "{epoch}");
        assert!(epoch["validation_accuracy"].is_f64(), "{epoch}");
        assert!(epoch.get("test_loss").is_none(), "{epoch}");
    }
    let tests = records(&out, "test");
    assert_eq!(tests.len(), 1, "the test set is scored once");
    assert_eq!(tests[0]["weights_of_epoch"], 2);
    assert_eq!(tests[0]["from_best_checkpoint"], false);

    // The summary's test figures are the test set's (as `eval` measures the
    // final checkpoint), not the last validation pass's.
    let report = evaluate_checkpoint(&out, None, 64, None).unwrap();
    assert_eq!(report.samples, 200);
    assert_eq!(summary.test_loss, Some(report.loss));
    assert_eq!(summary.test_accuracy, report.accuracy);
    assert_ne!(
        summary.test_loss,
        Some(summary.epochs[2].test_loss),
        "the validation pass is a different set"
    );
    assert!(summary.best_checkpoint.is_none() && !summary.stopped_early);
    // 800 trained, 200 held out: the epoch's sample count says so.
    let steps = records(&out, "step");
    let per_epoch = steps[0]["batches_per_epoch"].as_u64().unwrap();
    let batch = load(&sets(&tables, &out, &extra)).unwrap().train.batch_size as u64;
    assert_eq!(per_epoch, 800 / batch);
}

/// A run whose every epoch after the first fails `min_delta`: the first is
/// the best, and `patience` epochs later the run stops.
const NEVER_BETTER: [&str; 4] = [
    "data.validation=200",
    "train.early_stopping.metric=accuracy",
    "train.early_stopping.patience=2",
    "train.early_stopping.min_delta=2",
];

#[test]
fn early_stopping_keeps_the_best_checkpoint_and_scores_the_test_set_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let (tables, out) = (dir.path().join("table"), dir.path().join("run"));
    write_tables(&tables, [1000, 200]);
    let mut extra = vec!["train.epochs=10", "checkpoint.keep=1"];
    extra.extend(NEVER_BETTER);
    let summary = train(
        &load(&sets(&tables, &out, &extra)).unwrap(),
        &options(Resume::No),
    )
    .unwrap();

    assert_eq!(summary.epochs.len(), 3, "best at 1, then 2 epochs without");
    assert!(summary.stopped_early);
    let marks: Vec<Option<bool>> = summary.epochs.iter().map(|e| e.best).collect();
    assert_eq!(marks, [Some(true), Some(false), Some(false)]);
    let (best, epoch) = summary.best_checkpoint.clone().unwrap();
    assert_eq!((best.clone(), epoch), (out.join("best.ckpt"), 0));
    // keep = 1 pruned epoch 1's own checkpoint: best.ckpt outlives it.
    let report = evaluate_checkpoint(&best, None, 64, None).unwrap();
    assert_eq!(report.epoch, 1);
    assert!(summary.test_from_best);
    assert_eq!(summary.test_loss, Some(report.loss));
    assert_eq!(summary.test_accuracy, report.accuracy);
    let last = evaluate_checkpoint(&out, None, 64, None).unwrap();
    assert_eq!(last.epoch, 3, "the last checkpoint is the stop's");
    let tests = records(&out, "test");
    assert_eq!(tests.len(), 1);
    assert_eq!(tests[0]["from_best_checkpoint"], true);
    assert_eq!(tests[0]["weights_of_epoch"], 0);

    // A resume of the stopped run trains nothing more and scores the same.
    let again = train(
        &load(&sets(&tables, &out, &extra)).unwrap(),
        &options(Resume::Latest),
    )
    .unwrap();
    assert!(again.epochs.is_empty() && again.stopped_early);
    assert_eq!(again.test_loss, summary.test_loss);
}

#[test]
fn a_run_stopped_and_resumed_stops_and_keeps_its_best_as_one_never_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let tables = dir.path().join("table");
    write_tables(&tables, [1000, 200]);
    let whole = dir.path().join("whole");
    let mut extra = vec!["train.epochs=10"];
    extra.extend(NEVER_BETTER);
    let straight = train(
        &load(&sets(&tables, &whole, &extra)).unwrap(),
        &options(Resume::No),
    )
    .unwrap();

    // The same run in two parts: 2 epochs, then a resume with 10.
    let parts = dir.path().join("parts");
    let mut first = vec!["train.epochs=2"];
    first.extend(NEVER_BETTER);
    let head = train(
        &load(&sets(&tables, &parts, &first)).unwrap(),
        &options(Resume::No),
    )
    .unwrap();
    assert!(!head.stopped_early);
    let tail = train(
        &load(&sets(&tables, &parts, &extra)).unwrap(),
        &options(Resume::Latest),
    )
    .unwrap();
    assert_eq!(tail.epochs.len(), 1, "one more epoch, then patience is out");
    assert!(tail.stopped_early);
    assert_eq!(tail.test_loss, straight.test_loss);
    assert_eq!(tail.test_accuracy, straight.test_accuracy);
    let tail_of = |path: &Path| {
        let bytes = std::fs::read(path).unwrap();
        // The header names the run directory (and the checksum at the end
        // covers it); the tensors between must be the same.
        let meta_len = u64::from_le_bytes(bytes[12..20].try_into().unwrap()) as usize;
        bytes[20 + meta_len..bytes.len() - 4].to_vec()
    };
    assert!(
        tail_of(&whole.join("best.ckpt")) == tail_of(&parts.join("best.ckpt")),
        "the best checkpoints differ"
    );
}

#[test]
fn settings_that_cannot_work_are_refused_by_key() {
    let dir = tempfile::tempdir().unwrap();
    let (tables, out) = (dir.path().join("table"), dir.path().join("run"));
    write_tables(&tables, [40, 10]);
    let err = |extra: &[&str]| load(&sets(&tables, &out, extra)).unwrap_err();
    let message = err(&["train.early_stopping.patience=3"]);
    assert!(
        message.contains("train.early_stopping") && message.contains("data.validation"),
        "{message}"
    );
    let message = err(&["data.validation=0.1", "train.early_stopping.metric=rmse"]);
    assert!(
        message.contains("train.early_stopping.metric") && message.contains("classifier"),
        "{message}"
    );
    let message = err(&["data.validation=0.1", "train.early_stopping.metric=speed"]);
    assert!(message.contains("\"macro_f1\""), "{message}");
    for bad in ["1.5", "-0.1", "0"] {
        let message = err(&[&format!("data.validation={bad}")]);
        assert!(message.contains("data.validation"), "{bad}: {message}");
    }
    // A count that leaves no training data is found when the data is read.
    let config = load(&sets(
        &tables,
        &out,
        &["data.validation=40", "train.epochs=1"],
    ))
    .unwrap();
    let message = train(&config, &options(Resume::No))
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("data.validation") && message.contains("40 samples"),
        "{message}"
    );
}

#[test]
fn a_best_checkpoint_that_is_not_the_resumed_states_best_is_set_aside_and_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let tables = dir.path().join("table");
    write_tables(&tables, [1000, 200]);
    let whole = dir.path().join("whole");
    let mut extra = vec!["train.epochs=10"];
    extra.extend(NEVER_BETTER);
    let straight = train(
        &load(&sets(&tables, &whole, &extra)).unwrap(),
        &options(Resume::No),
    )
    .unwrap();

    // Two epochs (best: the first), then best.ckpt overwritten with the
    // second epoch's checkpoint, as a resume from an older state than the
    // best's file would find it.
    let run = dir.path().join("run");
    let mut first = vec!["train.epochs=2"];
    first.extend(NEVER_BETTER);
    let head = train(
        &load(&sets(&tables, &run, &first)).unwrap(),
        &options(Resume::No),
    )
    .unwrap();
    let last = head.last_checkpoint.unwrap();
    std::fs::remove_file(run.join("best.ckpt")).unwrap();
    std::fs::copy(&last, run.join("best.ckpt")).unwrap();
    let tail = train(
        &load(&sets(&tables, &run, &extra)).unwrap(),
        &options(Resume::Latest),
    )
    .unwrap();
    assert!(run.join("best.ckpt.stale").is_file());
    let best = evaluate_checkpoint(&run.join("best.ckpt"), None, 64, None).unwrap();
    assert_eq!(
        best.epoch, 1,
        "the first epoch's checkpoint is best.ckpt again"
    );
    assert!(tail.stopped_early && tail.test_from_best);
    assert_eq!(tail.test_loss, straight.test_loss);
}
