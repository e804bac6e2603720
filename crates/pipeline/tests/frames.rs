//! Frame prediction through the pipeline: a tiny UNet-ConvLSTM trained a
//! few steps on Moving-Fashion-MNIST-style sequences made from small
//! Fashion-MNIST-format files the test writes; evaluation scores it beside
//! the copy-last-frame baseline and reports no accuracy. (The GPU path's
//! frame training is tests/tests/cuda_training.rs.)

use std::path::Path;

use headroom_pipeline::{train, ExperimentConfig, Overrides, Resume, TrainOptions};

/// An IDX file: magic, dimensions (big-endian u32), then the bytes.
fn write_idx(path: &Path, magic: u32, dims: &[u32], data: &[u8]) {
    let mut bytes = magic.to_be_bytes().to_vec();
    for d in dims {
        bytes.extend(d.to_be_bytes());
    }
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}

/// Fashion-MNIST's four files with `count` 28x28 images per split: a bright
/// block on a dark ground, a different block per image.
fn write_fashion_like(dir: &Path, count: usize) {
    for stem in ["train", "t10k"] {
        let mut pixels = vec![0u8; count * 784];
        for (k, image) in pixels.chunks_exact_mut(784).enumerate() {
            for (p, px) in image.iter_mut().enumerate() {
                let (r, c) = (p / 28, p % 28);
                if (4 + k % 5..20 + k % 5).contains(&r) && (6..22).contains(&c) {
                    *px = 120 + (k * 13 % 130) as u8;
                }
            }
        }
        let labels: Vec<u8> = (0..count).map(|k| (k % 10) as u8).collect();
        let n = count as u32;
        write_idx(
            &dir.join(format!("{stem}-images-idx3-ubyte")),
            0x803,
            &[n, 28, 28],
            &pixels,
        );
        write_idx(
            &dir.join(format!("{stem}-labels-idx1-ubyte")),
            0x801,
            &[n],
            &labels,
        );
    }
}

fn experiment(dir: &Path) -> String {
    format!(
        r#"
[run]
name = "frames-test"
seed = 1
log_every = 1000
profile = "none"
output_dir = "{run}"

[data]
format = "moving_fashion_mnist"
dir = "{data}"
workers = 1
prefetch = 2

[frames]
size = 32
garments = 2
train_sequences = 32
test_sequences = 8

[device]
kind = "cpu"

[model]
input = [32, 32, 1]
frames = 4
mean = 0.0
std = 1.0
layers = [
  {{ type = "unet_skip", layers = [
    {{ type = "conv", out = 4, stride = 2, bias = true }}, {{ type = "relu" }},
    {{ type = "conv_lstm", hidden = 4 }},
    {{ type = "upsample2x" }},
  ] }},
  {{ type = "conv", out = 1, bias = true }},
]

[train]
epochs = 3
batch_size = 8
threads = 1

[optimizer]
lr = 1e-2
weight_decay = 0.0

[schedule]
kind = "constant"
"#,
        run = dir.join("run").display(),
        data = dir.join("data").display(),
    )
}

fn load(dir: &Path, sets: &[&str]) -> ExperimentConfig {
    std::fs::create_dir_all(dir.join("data")).unwrap();
    write_fashion_like(&dir.join("data"), 12);
    let path = dir.join("experiment.toml");
    std::fs::write(&path, experiment(dir)).unwrap();
    let pairs: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    ExperimentConfig::load(&path, &Overrides::parse(&pairs).unwrap()).unwrap()
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
fn a_tiny_conv_lstm_trains_and_is_scored_against_copy_last() {
    let dir = tempfile::tempdir().unwrap();
    let config = load(dir.path(), &[]);
    let summary = train(&config, &options()).unwrap();
    assert_eq!(summary.epochs.len(), 3);
    assert_eq!(summary.step, 3 * 4);
    assert_eq!(summary.test_accuracy, None, "a regression has no accuracy");
    let (loss, baseline) = (
        summary.test_loss.unwrap(),
        summary.test_baseline_loss.unwrap(),
    );
    assert!(loss.is_finite() && loss > 0.0, "{loss}");
    // The blocks cover part of a 32x32 frame and move 2-4 px a frame.
    assert!(baseline > 0.0 && baseline < 0.2, "{baseline}");
    let first = summary.epochs[0].train_loss.expect("epoch 1 trained");
    let last = summary.epochs[2].train_loss.expect("epoch 3 trained");
    assert!(last < first, "the loss falls: {first} -> {last}");
    let metrics = std::fs::read_to_string(dir.path().join("run/metrics.jsonl")).unwrap();
    let epoch_line = metrics.lines().find(|l| l.contains("\"epoch\",")).unwrap();
    assert!(
        epoch_line.contains("test_baseline_loss") && !epoch_line.contains("accuracy"),
        "{epoch_line}"
    );
}

#[test]
fn per_step_recompute_trains_to_the_same_weights() {
    let losses = |sets: &[&str]| {
        let dir = tempfile::tempdir().unwrap();
        let mut sets = sets.to_vec();
        sets.push("train.epochs=1");
        let summary = train(&load(dir.path(), &sets), &options()).unwrap();
        (
            summary.epochs[0].train_loss.unwrap(),
            summary.test_loss.unwrap(),
        )
    };
    assert_eq!(losses(&[]), losses(&["model.checkpoint=blocks"]));
}

#[test]
fn frame_settings_that_do_not_fit_are_named() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("e.toml"), experiment(dir.path())).unwrap();
    let load_with = |set: &str| {
        ExperimentConfig::load(
            &dir.path().join("e.toml"),
            &Overrides::parse(&[set.to_string()]).unwrap(),
        )
        .err()
        .unwrap()
        .to_string()
    };
    let err = load_with("frames.size=64");
    assert!(err.contains("model.input"), "{err}");
    let err = load_with("frames.train_sequences=0");
    assert!(err.contains("frames"), "{err}");
}
