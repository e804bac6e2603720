//! `predict`: a trained run scores new inputs with the preprocessing it
//! recorded. A CSV regression predicts values in the targets' units from a
//! file without the target column; a CSV classifier names its classes; a
//! tensor-files run scores one `.npy` of inputs; bad inputs are named.

use headroom_loader::npy_bytes;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use headroom_pipeline::learner::DeviceKind;
use headroom_pipeline::predict::{
    predict, predict_with, write_csv, write_json, PredictOptions, PredictedOutputs,
};
use headroom_pipeline::{train, ExperimentConfig, Overrides, Resume, TrainOptions};

fn tabular() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments/tabular.toml")
}

fn options() -> TrainOptions {
    TrainOptions {
        resume: Resume::No,
        allow_install: false,
        stop: None,
        ..Default::default()
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
    // A table's f32 features are scored where they trained: on the CPU.
    let on_gpu = PredictOptions {
        device: DeviceKind::Cuda,
        ..PredictOptions::default()
    };
    let refused = predict_with(&run, &input, &on_gpu).unwrap_err().to_string();
    assert!(
        refused.contains("--device") && refused.contains("on the CPU"),
        "{refused}"
    );
    let auto = PredictOptions {
        device: DeviceKind::Auto,
        batch: 64,
        ..PredictOptions::default()
    };
    let on_auto = predict_with(&run, &input, &auto).unwrap();
    let predictions = predict(&run, &input, 64).unwrap();
    assert_eq!(
        on_auto.outputs, predictions.outputs,
        "auto scores a table on the CPU"
    );
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

/// 4×4 images: class 0 lit on the left half, class 1 on the right.
fn images(ids: std::ops::Range<usize>) -> (Vec<u8>, Vec<u8>) {
    let (mut pixels, mut labels) = (Vec::new(), Vec::new());
    for id in ids {
        let class = id % 2;
        for p in 0..16 {
            let lit = ((p % 4) / 2 == class) as usize;
            pixels.push((lit * 180 + (p * 5 + id * 3) % 50) as u8);
        }
        labels.extend_from_slice(&(class as i64).to_le_bytes());
    }
    (pixels, labels)
}

#[test]
fn a_tensor_files_run_scores_a_npy_of_inputs_and_names_inputs_of_another_shape() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    for (split, ids) in [("train", 0..256), ("test", 1000..1064)] {
        std::fs::create_dir_all(data.join(split)).unwrap();
        let rows = ids.len();
        let (pixels, labels) = images(ids);
        std::fs::write(
            data.join(split).join("b_x.npy"),
            npy_bytes("|u1", &[rows, 4, 4, 1], &pixels),
        )
        .unwrap();
        std::fs::write(
            data.join(split).join("b_y.npy"),
            npy_bytes("<i8", &[rows], &labels),
        )
        .unwrap();
    }
    let experiment = dir.path().join("e.toml");
    std::fs::write(
        &experiment,
        r#"
[run]
name = "npy"
[data]
format = "tensors"
workers = 1
[model]
input = [4, 4, 1]
mean = 0.3
std = 0.3
layers = [{ type = "flatten" }, { type = "linear", out = 16 }, { type = "relu" }, { type = "linear", out = 2 }]
[train]
epochs = 8
batch_size = 16
threads = 2
[optimizer]
lr = 1e-2
[schedule]
kind = "constant"
"#,
    )
    .unwrap();
    let run = dir.path().join("run");
    let sets = [
        format!("data.dir={}", data.display()),
        format!("run.output_dir={}", run.display()),
    ];
    let config = ExperimentConfig::load(&experiment, &Overrides::parse(&sets).unwrap()).unwrap();
    train(&config, &options()).unwrap();

    // Inputs alone: one .npy, no targets beside it.
    let (pixels, _) = images(2000..2010);
    let input = dir.path().join("new.npy");
    std::fs::write(&input, npy_bytes("|u1", &[10, 4, 4, 1], &pixels)).unwrap();
    let predictions = predict(&run, &input, 4).unwrap();
    assert!(
        predictions.sources[3].ends_with("new.npy row 3"),
        "{:?}",
        predictions.sources
    );
    let PredictedOutputs::Classes { names, classes, .. } = &predictions.outputs else {
        panic!("{predictions:?}")
    };
    assert_eq!(names, &["0", "1"], "no recorded names: the ids");
    let expected: Vec<u32> = (2000..2010).map(|id| (id % 2) as u32).collect();
    assert_eq!(classes, &expected);

    // Inputs of another shape are named with both shapes.
    let wrong = dir.path().join("wrong.npy");
    std::fs::write(&wrong, npy_bytes("|u1", &[2, 3, 3, 1], &[0; 18])).unwrap();
    let err = predict(&run, &wrong, 4).unwrap_err().to_string();
    assert!(
        err.contains("wrong.npy") && err.contains("[3, 3, 1]") && err.contains("[4, 4, 1]"),
        "{err}"
    );
}

#[test]
fn an_image_folder_run_scores_a_folder_of_photos_by_class_name() {
    use headroom_loader::write_image;
    let dir = tempfile::tempdir().unwrap();
    let photos = dir.path().join("photos");
    // "dark" and "light" photos of several sizes, PNG and JPEG.
    let photo = |path: &Path, light: bool, i: usize| {
        let (h, w) = (10 + i % 3, 12 + i % 4);
        let base = if light { 200 } else { 40 };
        let pixels: Vec<u8> = (0..h * w * 3)
            .map(|p| (base + (p * 7 + i) % 30) as u8)
            .collect();
        write_image(path, &pixels, [h, w, 3]).unwrap();
    };
    for (split, count) in [("train", 24), ("test", 6)] {
        for (class, light) in [("dark", false), ("light", true)] {
            let folder = photos.join(split).join(class);
            std::fs::create_dir_all(&folder).unwrap();
            for i in 0..count {
                photo(&folder.join(format!("{i}.png")), light, i);
            }
        }
    }
    let new = dir.path().join("new");
    std::fs::create_dir_all(&new).unwrap();
    for (i, light) in [false, true, true, false].into_iter().enumerate() {
        photo(
            &new.join(format!("{i}.{}", if i % 2 == 0 { "png" } else { "jpg" })),
            light,
            50 + i,
        );
    }
    std::fs::write(new.join("notes.txt"), "not an image").unwrap();
    let smoke = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments/smoke.toml");
    let run = dir.path().join("run");
    let sets: Vec<String> = [
        "data.format=image_folder".to_string(),
        format!("data.dir={}", photos.display()),
        "data.image_size=[8, 8]".into(),
        "data.channels=3".into(),
        "data.fit=resize".into(),
        "data.train_samples=0".into(),
        "data.test_samples=0".into(),
        "model.input=[8, 8, 3]".into(),
        "device.kind=cpu".into(),
        "train.epochs=4".into(),
        "train.batch_size=8".into(),
        "train.threads=2".into(),
        "data.workers=1".into(),
        format!("run.output_dir={}", run.display()),
    ]
    .into();
    let config = ExperimentConfig::load(&smoke, &Overrides::parse(&sets).unwrap()).unwrap();
    train(&config, &options()).unwrap();
    let predictions = predict(&run, &new, 3).unwrap();
    assert_eq!(predictions.sources.len(), 4, "{:?}", predictions.sources);
    assert!(predictions.sources[1].ends_with("1.jpg"));
    let PredictedOutputs::Classes { names, classes, .. } = &predictions.outputs else {
        panic!("{predictions:?}")
    };
    assert_eq!(names[..2], ["dark".to_string(), "light".to_string()]);
    let predicted: Vec<&str> = classes
        .iter()
        .map(|&c| names[c as usize].as_str())
        .collect();
    assert_eq!(predicted, ["dark", "light", "light", "dark"]);
}
