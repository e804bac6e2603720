//! `predict`: a trained run scores new inputs with the preprocessing it
//! recorded. A CSV regression predicts values in the targets' units from a
//! file without the target column; a CSV classifier names its classes; a
//! tensor-files run scores one `.npy` of inputs; bad inputs are named.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use headroom_pipeline::predict::{predict, write_csv, write_json, PredictedOutputs};
use headroom_pipeline::{train, ExperimentConfig, Overrides, Resume, TrainOptions};

fn tabular() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments/tabular.toml")
}

fn options() -> TrainOptions {
    TrainOptions {
        resume: Resume::No,
        allow_install: false,
        stop: None,
    }
}

fn noise(i: usize) -> f64 {
    let x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11;
    (x as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
}

fn target(a: f64, b: f64) -> f64 {
    100.0 + 20.0 * a - 10.0 * b
}

/// train.csv and test.csv of columns a, b, kind, y (y = 100 + 20a - 10b;
/// kind "low" or "high" by y), rows `from..from + count` each.
fn write_tables(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    for (name, from, count) in [("train.csv", 0, 800), ("test.csv", 5000, 200)] {
        let mut text = String::from("a,b,kind,y\n");
        for i in from..from + count {
            let (a, b) = (noise(2 * i), noise(2 * i + 1));
            let y = target(a, b);
            let kind = if y < 100.0 { "low" } else { "high" };
            writeln!(text, "{a:.6},{b:.6},{kind},{y:.6}").unwrap();
        }
        std::fs::write(dir.join(name), text).unwrap();
    }
}

fn trained(dir: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let tables = dir.join("table");
    if !tables.exists() {
        write_tables(&tables);
    }
    let out = dir.join(name);
    let mut sets = vec![
        format!("data.dir={}", tables.display()),
        r#"data.features=["a", "b"]"#.to_string(),
        "model.input=[1, 2, 1]".into(),
        "train.epochs=30".into(),
        "train.threads=2".into(),
        "data.workers=1".into(),
        format!("run.output_dir={}", out.display()),
    ];
    sets.extend(extra.iter().map(|s| s.to_string()));
    let overrides = Overrides::parse(&sets).unwrap();
    let config = ExperimentConfig::load(&tabular(), &overrides).unwrap();
    train(&config, &options()).unwrap();
    out
}

#[test]
fn a_csv_regression_predicts_values_in_the_targets_units_from_features_alone() {
    let dir = tempfile::tempdir().unwrap();
    let run = trained(dir.path(), "run", &[]);
    // New rows, the columns in another order, no target column.
    let mut text = String::from("b,a\n");
    let rows: Vec<(f64, f64)> = (0..20)
        .map(|i| (noise(9000 + i) * 0.8, noise(9100 + i) * 0.8))
        .collect();
    for (a, b) in &rows {
        writeln!(text, "{b},{a}").unwrap();
    }
    let input = dir.path().join("new.csv");
    std::fs::write(&input, text).unwrap();
    let predictions = predict(&run, &input, 7).unwrap();
    assert_eq!(predictions.sources[0], "line 2");
    let PredictedOutputs::Values { names, values } = &predictions.outputs else {
        panic!("{predictions:?}")
    };
    assert_eq!(names, &["y"]);
    assert_eq!(values.len(), rows.len());
    // y spans 70..130 (std about 13): a model that ignored the features,
    // or read them unscaled or swapped, would be off by far more.
    let errors: Vec<f64> = rows
        .iter()
        .zip(values)
        .map(|((a, b), &v)| (f64::from(v) - target(*a, *b)).abs())
        .collect();
    let mean = errors.iter().sum::<f64>() / errors.len() as f64;
    assert!(mean < 1.5, "mean error {mean}: {errors:?}");
    assert!(errors.iter().all(|&e| e < 5.0), "{errors:?}");
    let mut csv = Vec::new();
    write_csv(&predictions, &mut csv).unwrap();
    let csv = String::from_utf8(csv).unwrap();
    assert!(csv.starts_with("input,y\nline 2,"), "{csv}");

    // A file whose features differ from the model's is named.
    let bad = dir.path().join("bad.csv");
    std::fs::write(&bad, "a\n1\n").unwrap();
    let err = predict(&run, &bad, 8).unwrap_err().to_string();
    assert!(err.contains("bad.csv") && err.contains("`b`"), "{err}");
}

#[test]
fn a_csv_classifier_names_its_classes_with_their_probabilities() {
    let dir = tempfile::tempdir().unwrap();
    let run = trained(
        dir.path(),
        "classes",
        &[
            "train.loss=cross_entropy",
            r#"data.targets=["kind"]"#,
            r#"model.layers=[{type="flatten"}, {type="linear", out=16}, {type="relu"}, {type="linear", out=2}]"#,
        ],
    );
    let input = dir.path().join("table/test.csv");
    let predictions = predict(&run, &input, 64).unwrap();
    let PredictedOutputs::Classes {
        names,
        classes,
        probabilities,
    } = &predictions.outputs
    else {
        panic!("{predictions:?}")
    };
    assert_eq!(names, &["high", "low"]);
    assert_eq!(classes.len(), 200);
    for row in probabilities.chunks_exact(2) {
        assert!((row[0] + row[1] - 1.0).abs() < 1e-5, "{row:?}");
    }
    // The test rows' own kinds, read back: most are predicted right.
    let text = std::fs::read_to_string(&input).unwrap();
    let right = text
        .lines()
        .skip(1)
        .zip(classes)
        .filter(|(line, &class)| line.split(',').nth(2) == Some(names[class as usize].as_str()))
        .count();
    assert!(right >= 180, "{right} of 200");
    let mut json = Vec::new();
    write_json(&predictions, &mut json).unwrap();
    let json: serde_json::Value = serde_json::from_slice(&json).unwrap();
    assert_eq!(json[0]["input"], "line 2");
    assert!(json[0]["probabilities"]["low"].is_number(), "{json}");
}
