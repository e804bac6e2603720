//! `data.format = "tensors"`: a directory of preprocessed `.npz` batches
//! trains a conv net lazily with at most two decoded files held, and a
//! `.safetensors` regression trains to a low error; files that do not fit
//! the model or the loss are refused before training, by key.

use headroom_loader::npy_bytes;
use std::io::Write as _;
use std::path::Path;

use headroom_pipeline::{train, ExperimentConfig, Overrides, Resume, TrainOptions};

fn npz(path: &Path, members: &[(&str, Vec<u8>)]) {
    let mut zip = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
    for (name, bytes) in members {
        zip.start_file(
            format!("{name}.npy"),
            zip::write::SimpleFileOptions::default(),
        )
        .unwrap();
        zip.write_all(bytes).unwrap();
    }
    zip.finish().unwrap();
}

/// `files` npz batches of `rows` 8×8 images: class 0 lit in the top half,
/// class 1 in the bottom, with a varying texture.
fn write_image_batches(dir: &Path, files: usize, rows: usize, first: usize) {
    std::fs::create_dir_all(dir).unwrap();
    for f in 0..files {
        let (mut pixels, mut labels) = (Vec::new(), Vec::new());
        for r in 0..rows {
            let id = first + f * rows + r;
            let class = id % 2;
            for p in 0..64 {
                let lit = (p / 32 == class) as usize;
                pixels.push((lit * 160 + (p * 13 + id * 7) % 60) as u8);
            }
            labels.extend_from_slice(&(class as i64).to_le_bytes());
        }
        npz(
            &dir.join(format!("batch{f:03}.npz")),
            &[
                ("x", npy_bytes("|u1", &[rows, 8, 8, 1], &pixels)),
                ("y", npy_bytes("<i8", &[rows], &labels)),
            ],
        );
    }
}

fn experiment(dir: &Path, body: &str) -> std::path::PathBuf {
    let path = dir.join("experiment.toml");
    std::fs::write(&path, body).unwrap();
    path
}

fn load(path: &Path, sets: &[String]) -> Result<ExperimentConfig, String> {
    let overrides = Overrides::parse(sets).map_err(|e| e.to_string())?;
    ExperimentConfig::load(path, &overrides).map_err(|e| e.to_string())
}

fn options() -> TrainOptions {
    TrainOptions {
        resume: Resume::No,
        allow_install: false,
        stop: None,
        ..Default::default()
    }
}

const IMAGES: &str = r#"
[run]
name = "npz_batches"
[data]
format = "tensors"
workers = 1
[loader]
max_cache_shards = 2
[model]
input = [8, 8, 1]
mean = 0.3
std = 0.3
layers = [
  { type = "conv", out = 8 }, { type = "relu" },
  { type = "global_avg_pool" }, { type = "flatten" },
  { type = "linear", out = 2 },
]
[train]
epochs = 3
batch_size = 16
threads = 2
[optimizer]
lr = 1e-2
[schedule]
kind = "constant"
"#;

#[test]
fn npz_batches_train_lazily_with_two_decoded_files_held() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (files, rows) = (8, 48);
    write_image_batches(&data.join("train"), files, rows, 0);
    write_image_batches(&data.join("test"), 2, rows, 10_000);
    let path = experiment(dir.path(), IMAGES);
    let sets = [
        format!("data.dir={}", data.display()),
        format!("run.output_dir={}", dir.path().join("run").display()),
    ];
    let config = load(&path, &sets).unwrap();
    let summary = train(&config, &options()).unwrap();
    assert!(summary.test_accuracy.unwrap() > 0.9, "{summary:?}");
    // The training loader's dataset held at most two decoded files (plus
    // the labels) over three shard-ordered epochs of eight files.
    let one_file = (rows * 64) as u64;
    let labels = 4 * (files * rows) as u64;
    let peak = summary.loader_memory.cache_peak_bytes;
    assert!(peak <= labels + 2 * one_file, "peak {peak} bytes");
    assert!(peak >= labels + one_file, "peak {peak} bytes");
}

#[test]
fn a_safetensors_regression_trains_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    for (split, rows, seed) in [("train", 512usize, 0usize), ("test", 128, 9999)] {
        std::fs::create_dir_all(data.join(split)).unwrap();
        let (mut x, mut y) = (Vec::new(), Vec::new());
        for r in 0..rows {
            let v: Vec<f32> = (0..3)
                .map(|k| (((r + seed) * 31 + k * 17) % 97) as f32 / 48.0 - 1.0)
                .collect();
            y.push(v[0] + 2.0 * v[1] - v[2]);
            x.extend(v);
        }
        let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|f| f.to_le_bytes()).collect() };
        let (xb, yb) = (bytes(&x), bytes(&y));
        fn view(shape: Vec<usize>, b: &[u8]) -> safetensors::tensor::TensorView<'_> {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape, b).unwrap()
        }
        let tensors = [
            ("x", view(vec![rows, 3], &xb)),
            ("y", view(vec![rows, 1], &yb)),
        ];
        safetensors::serialize_to_file(tensors, None, &data.join(split).join("all.safetensors"))
            .unwrap();
    }
    let body = IMAGES
        .replace("input = [8, 8, 1]", "input = [1, 3, 1]")
        .replace(
            r#"{ type = "conv", out = 8 }, { type = "relu" },
  { type = "global_avg_pool" }, { type = "flatten" },
  { type = "linear", out = 2 },"#,
            r#"{ type = "flatten" }, { type = "linear", out = 32 }, { type = "relu" },
  { type = "linear", out = 1 },"#,
        )
        .replace("epochs = 3", "epochs = 20\nloss = \"mse\"")
        .replace("lr = 1e-2", "lr = 3e-3");
    let path = experiment(dir.path(), &body);
    let sets = [
        format!("data.dir={}", data.display()),
        format!("run.output_dir={}", dir.path().join("run").display()),
    ];
    let config = load(&path, &sets).unwrap();
    let summary = train(&config, &options()).unwrap();
    let metrics = summary.test_regression.expect("regression metrics");
    assert!(metrics.r2 > 0.95, "{metrics:?}");

    // The same files under a classifier's loss, or a model of another
    // input: refused, by key, before training.
    let fresh = |extra: &str| {
        let out = format!("run.output_dir={}", dir.path().join("refused").display());
        load(&path, &[sets[0].clone(), out, extra.to_string()]).unwrap()
    };
    let err = train(&fresh("train.loss=cross_entropy"), &options())
        .unwrap_err()
        .to_string();
    assert!(err.contains("train.loss") && err.contains("float"), "{err}");
    let err = train(&fresh("model.input=[1, 4, 1]"), &options())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.input") && err.contains("[1, 3, 1]"),
        "{err}"
    );
    let err = load(&path, &[sets[0].clone(), "device.kind=cuda".into()]).unwrap_err();
    assert!(err.contains("device.kind") && err.contains("CPU"), "{err}");
    let err = load(&path, &[sets[0].clone(), "data.format=idx".into()]).unwrap_err();
    assert!(err.contains("train.loss"), "{err}");
}
