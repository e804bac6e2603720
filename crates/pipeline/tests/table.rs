//! `data.format = "csv"`: experiments/tabular.toml trains on generated
//! tables on the CPU, a regression to a low error in the targets' units and
//! a classifier of string classes to a high accuracy; the run records the
//! standardisation and the class names; a table or model that does not fit
//! is refused before training, by key.

use std::fmt::Write as _;
use std::path::Path;

use headroom_pipeline::{data, train, ExperimentConfig, Overrides, Resume, TrainOptions};

#[path = "tabular_fixtures/mod.rs"]
mod tabular_fixtures;
use tabular_fixtures::{load, noise, tabular};

/// `train.csv` and `test.csv` in `dir`: columns a, b, c and y = 40 + 3a -
/// 2b + 0.5c² (b in the thousands, so standardisation matters), plus the
/// class column `size` ("small" below 40, else "large"), in the middle.
fn write_tables(dir: &Path, rows: [usize; 2]) {
    std::fs::create_dir_all(dir).unwrap();
    let mut offset = 0;
    for (name, count) in ["train.csv", "test.csv"].into_iter().zip(rows) {
        let mut text = String::from("a,b,size,c,y\n");
        for i in offset..offset + count {
            let (a, b, c) = (
                noise(3 * i),
                1000.0 + 500.0 * noise(3 * i + 1),
                noise(3 * i + 2),
            );
            let y = 40.0 + 3.0 * a - 2.0 * (b - 1000.0) / 500.0 + 0.5 * c * c;
            let size = if y < 40.0 { "small" } else { "large" };
            writeln!(text, "{a:.6},{b:.3},{size},{c:.6},{y:.6}").unwrap();
        }
        std::fs::write(dir.join(name), text).unwrap();
        offset += count;
    }
}

fn sets(dir: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    let mut sets = vec![
        format!("data.dir={}", dir.display()),
        r#"data.features=["a", "b", "c"]"#.to_string(),
        "model.input=[1, 3, 1]".into(),
        "train.epochs=12".into(),
        "train.threads=2".into(),
        "data.workers=1".into(),
        format!("run.output_dir={}", out.display()),
    ];
    sets.extend(extra.iter().map(|s| s.to_string()));
    sets
}

fn options() -> TrainOptions {
    TrainOptions {
        resume: Resume::No,
        allow_install: false,
        stop: None,
        ..Default::default()
    }
}

#[test]
fn a_regression_learns_the_table_and_reports_its_error_in_the_targets_units() {
    let dir = tempfile::tempdir().unwrap();
    let (tables, out) = (dir.path().join("table"), dir.path().join("run"));
    write_tables(&tables, [1024, 256]);
    let config = load(&sets(&tables, &out, &[])).unwrap();
    let summary = train(&config, &options()).unwrap();
    assert_eq!(summary.test_accuracy, None, "a regression has no accuracy");
    let last = summary.epochs.last().unwrap();
    let metrics = last.test_regression.expect("regression metrics");
    // y spans about 35..45 (std about 2): predicting the mean gives an RMSE
    // near 2 and R² 0.
    assert!(metrics.rmse < 0.5, "{metrics:?}");
    assert!(metrics.mae < metrics.rmse + 1e-6, "{metrics:?}");
    assert!(metrics.r2 > 0.9, "{metrics:?}");
    // The loss is on standardised targets: RMSE² ≈ MSE · std².
    let first = summary.epochs.first().unwrap();
    assert!(last.test_loss < first.test_loss, "{summary:?}");

    // A test-set epoch's line keeps the summary's field order.
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let epoch = metrics
        .lines()
        .find(|l| l.contains(r#""kind":"epoch""#))
        .unwrap();
    assert!(
        epoch.starts_with(r#"{"kind":"epoch","data":{"epoch":0,"train_loss":"#),
        "{epoch}"
    );
    let record = std::fs::read_to_string(out.join("dataset.json")).unwrap();
    let record: serde_json::Value = serde_json::from_str(&record).unwrap();
    let scale = &record["scale"];
    assert_eq!(scale["features"].as_array().unwrap().len(), 3, "{record}");
    let b_mean = scale["features"][1][0].as_f64().unwrap();
    assert!((b_mean - 1000.0).abs() < 50.0, "{record}");
    assert_eq!(record["format"], "csv");
}

#[test]
fn a_classifier_reads_a_string_class_column_and_records_the_class_names() {
    let dir = tempfile::tempdir().unwrap();
    let (tables, out) = (dir.path().join("table"), dir.path().join("run"));
    write_tables(&tables, [1024, 256]);
    let extra = [
        "train.loss=cross_entropy",
        r#"data.targets=["size"]"#,
        r#"data.features=["a", "b", "c", "y"]"#,
        "model.input=[1, 4, 1]",
        "train.epochs=6",
        r#"model.layers=[{type="flatten"}, {type="linear", out=32}, {type="relu"}, {type="linear", out=2}]"#,
    ];
    let config = load(&sets(&tables, &out, &extra)).unwrap();
    let summary = train(&config, &options()).unwrap();
    let accuracy = summary.test_accuracy.unwrap();
    assert!(accuracy > 0.9, "{accuracy}");
    assert_eq!(
        data::recorded_classes(&out).unwrap(),
        Some(vec!["large".to_string(), "small".into()])
    );
}

#[test]
fn a_table_or_model_that_does_not_fit_is_refused_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let (tables, out) = (dir.path().join("table"), dir.path().join("run"));
    write_tables(&tables, [64, 16]);
    let train_err = |extra: &[&str]| -> String {
        let config = load(&sets(&tables, &out, extra)).unwrap();
        train(&config, &options()).unwrap_err().to_string()
    };
    let err = train_err(&["model.input=[1, 5, 1]"]);
    assert!(
        err.contains("model.input") && err.contains("[1, 3, 1]"),
        "{err}"
    );
    let err = train_err(&[r#"data.targets=["price"]"#]);
    assert!(
        err.contains("no column `price`") && err.contains("train.csv"),
        "{err}"
    );
    // Two numeric targets need two outputs.
    let err = train_err(&[
        r#"data.targets=["y", "c"]"#,
        r#"data.features=["a", "b"]"#,
        "model.input=[1, 2, 1]",
    ]);
    assert!(err.contains("out = 2"), "{err}");
    let err = train_err(&["augment.flip=true"]);
    assert!(
        err.contains("augment.flip") && err.contains("f32 features"),
        "{err}"
    );
    // A bad cell stops the run before any training, naming the line.
    let mut text = std::fs::read_to_string(tables.join("test.csv")).unwrap();
    text.push_str("0.1,oops,small,0.2,40\n");
    std::fs::write(tables.join("test.csv"), text).unwrap();
    let err = train_err(&[]);
    assert!(
        err.contains("test.csv") && err.contains("line 18") && err.contains("`b`"),
        "{err}"
    );
    assert!(!out.join("metrics.jsonl").exists(), "nothing trained");

    // Refused while reading the experiment.
    let err = load(&sets(&tables, &out, &["device.kind=cuda"])).unwrap_err();
    assert!(err.contains("device.kind") && err.contains("CPU"), "{err}");
    let err = load(&sets(
        &tables,
        &out,
        &["train.loss=cross_entropy", r#"data.targets=["y", "c"]"#],
    ))
    .unwrap_err();
    assert!(
        err.contains("data.targets") && err.contains("one class column"),
        "{err}"
    );
    let err = load(&["data.format=idx".into(), "data.dir=/nowhere".into()]).unwrap_err();
    assert!(
        err.contains("data.targets") && err.contains("\"csv\" only"),
        "{err}"
    );
}

#[test]
fn a_table_run_is_judged_by_the_host_not_by_a_small_gpu_it_will_not_use() {
    // On a machine whose GPU has 1 GiB free, "auto" would apply the
    // low-memory profile (train.micro_batch = "auto") to a GPU run; a table
    // trains on the CPU, so the GPU is not asked.
    let dir = tempfile::tempdir().unwrap();
    let sets = sets(dir.path(), &dir.path().join("run"), &[]);
    let overrides = Overrides::parse(&sets).unwrap();
    let asked = std::cell::Cell::new(false);
    let config = ExperimentConfig::load_for_device(&tabular(), &overrides, |_| {
        asked.set(true);
        Some(1 << 30)
    })
    .unwrap();
    assert!(!asked.get(), "the GPU was probed for a CPU run");
    assert_eq!(config.train.micro_batch, None);
    assert_eq!(
        config.learner_device(),
        headroom_pipeline::device::DeviceKind::Cpu
    );
    // The same probe does apply the profile to an image run on "auto".
    let smoke = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments/smoke.toml");
    let image = ExperimentConfig::load_for_device(&smoke, &Overrides::default(), |_| Some(1 << 30))
        .unwrap();
    assert_eq!(image.train.micro_batch.as_deref(), Some("auto"));
}

/// `train.csv` and `test.csv` with features a, b, c and two 0/1 label
/// columns: `pos_a` (a > 0) and `big_b` (b > 0.3), independent of each
/// other.
fn write_label_tables(dir: &Path, rows: [usize; 2]) {
    std::fs::create_dir_all(dir).unwrap();
    let mut offset = 0;
    for (name, count) in ["train.csv", "test.csv"].into_iter().zip(rows) {
        let mut text = String::from("a,pos_a,b,c,big_b\n");
        for i in offset..offset + count {
            let (a, b, c) = (noise(3 * i), noise(3 * i + 1), noise(3 * i + 2));
            let (pos_a, big_b) = (u8::from(a > 0.0), if b > 0.3 { "true" } else { "false" });
            writeln!(text, "{a:.6},{pos_a},{b:.6},{c:.6},{big_b}").unwrap();
        }
        std::fs::write(dir.join(name), text).unwrap();
        offset += count;
    }
}

#[test]
fn a_multi_label_model_learns_independent_labels_and_predicts_their_probabilities() {
    let dir = tempfile::tempdir().unwrap();
    let (tables, out) = (dir.path().join("labels"), dir.path().join("run"));
    write_label_tables(&tables, [1024, 256]);
    let extra = [
        "train.loss=bce",
        r#"data.targets=["pos_a", "big_b"]"#,
        "model.input=[1, 3, 1]",
        "train.epochs=8",
        "data.validation=0.2",
        "train.early_stopping.metric=macro_f1",
        "train.early_stopping.patience=0",
        r#"model.layers=[{type="flatten"}, {type="linear", out=32}, {type="relu"}, {type="linear", out=2}]"#,
    ];
    let config = load(&sets(&tables, &out, &extra)).unwrap();
    let summary = train(&config, &options()).unwrap();
    assert_eq!(summary.test_accuracy, None, "no single class to count");
    let m = summary.test_multilabel.expect("multi-label figures");
    assert!(m.exact_match > 0.85, "{m:?}");
    assert!(m.label_accuracy >= m.exact_match, "{m:?}");
    assert!(m.macro_f1 > 0.85 && m.micro_f1 > 0.85, "{m:?}");
    // Patience 0: every epoch ran, the best kept and scored.
    assert_eq!(summary.epochs.len(), 8);
    assert!(summary.test_from_best && summary.best_checkpoint.is_some());
    let last = summary.epochs.last().unwrap();
    assert!(last.test_multilabel.is_some() && last.test_regression.is_none());
    // The labels are kept as 0/1: their recorded scale is the identity.
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("dataset.json")).unwrap()).unwrap();
    assert_eq!(
        record["scale"]["values"],
        serde_json::json!([[0.0, 1.0], [0.0, 1.0]])
    );

    // predict: one probability per label, named after it, that agrees
    // with the labels of the rows it scores (the test table, its label
    // columns left out as for new rows).
    let test = tables.join("test.csv");
    let predicted = headroom_pipeline::predict::predict(&out, &test, 16).unwrap();
    let headroom_pipeline::predict::PredictedOutputs::Values { names, values } = predicted.outputs
    else {
        panic!("{:?}", predicted.outputs);
    };
    assert_eq!(names, ["p_pos_a", "p_big_b"]);
    let text = std::fs::read_to_string(&test).unwrap();
    let truths: Vec<[bool; 2]> = text
        .lines()
        .skip(1)
        .map(|line| {
            let cells: Vec<&str> = line.split(',').collect();
            [cells[1] == "1", cells[4] == "true"]
        })
        .collect();
    assert_eq!(values.len(), 2 * truths.len());
    assert!(values.iter().all(|p| (0.0..=1.0).contains(p)), "{values:?}");
    let agree = values
        .chunks(2)
        .zip(&truths)
        .filter(|(p, t)| (p[0] >= 0.5) == t[0] && (p[1] >= 0.5) == t[1])
        .count() as f32
        / truths.len() as f32;
    assert!(
        (agree - m.exact_match).abs() < 0.15,
        "{agree} vs {}",
        m.exact_match
    );

    // A label cell that is not 0 or 1 is named.
    let mut text = std::fs::read_to_string(tables.join("train.csv")).unwrap();
    text.push_str("0.1,2,0.2,0.3,false\n");
    std::fs::write(tables.join("train.csv"), text).unwrap();
    let out2 = dir.path().join("run2");
    let config = load(&sets(&tables, &out2, &extra)).unwrap();
    let err = train(&config, &options()).unwrap_err().to_string();
    assert!(
        err.contains("train.csv") && err.contains("line 1026") && err.contains("`pos_a`"),
        "{err}"
    );
}

#[test]
fn bad_samples_skip_leaves_out_unreadable_rows_and_names_them() {
    let dir = tempfile::tempdir().unwrap();
    let (tables, out) = (dir.path().join("table"), dir.path().join("run"));
    write_tables(&tables, [256, 64]);
    let mut text = std::fs::read_to_string(tables.join("train.csv")).unwrap();
    text.push_str("0.1,oops,small,0.2,40\n"); // line 258: not a number
    text.push_str("0.1,1000,small\n"); // line 259: ragged
    text.push_str("0.1,NaN,large,0.2,41\n"); // line 260: NaN
    std::fs::write(tables.join("train.csv"), text).unwrap();
    let extra = [
        "train.loss=cross_entropy",
        r#"data.targets=["size"]"#,
        "train.epochs=1",
        "schedule.kind=constant",
        "data.bad_samples=skip",
        r#"model.layers=[{type="flatten"}, {type="linear", out=8}, {type="relu"}, {type="linear", out=2}]"#,
    ];
    let config = load(&sets(&tables, &out, &extra)).unwrap();
    let summary = train(&config, &options()).unwrap();
    assert_eq!(summary.epochs.len(), 1);
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("dataset.json")).unwrap()).unwrap();
    assert_eq!(record["train_samples"], 256, "{record}");
    let lines: Vec<&str> = record["skipped"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["sample"].as_str().unwrap())
        .collect();
    assert_eq!(lines.len(), 3, "{record}");
    for (line, expected) in lines.iter().zip(["line 258", "line 259", "line 260"]) {
        assert!(
            line.ends_with(expected) && line.contains("train.csv"),
            "{lines:?}"
        );
    }

    // Rows of a class that only bad rows hold: the class would be emptied.
    let mut text = std::fs::read_to_string(tables.join("train.csv")).unwrap();
    text.push_str("0.1,oops,medium,0.2,40\n");
    std::fs::write(tables.join("train.csv"), text).unwrap();
    let out2 = dir.path().join("run2");
    let err = train(&load(&sets(&tables, &out2, &extra)).unwrap(), &options())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`medium`") && err.contains("empty the class"),
        "{err}"
    );
}
