//! Byte-level language models through the pipeline: the per-token loss, a
//! tiny end-to-end training on a corpus the test writes (the loss falls, a
//! sample is written), and the bad-input errors, each naming the key or file.

use std::path::{Path, PathBuf};

use headroom_model::Tensor;
use headroom_pipeline::learner::per_token_loss;
use headroom_pipeline::{text, train, ExperimentConfig, Overrides, Resume, TrainOptions};

const LENGTH: usize = 16;

/// A corpus with a pattern a small model learns in a few steps.
fn write_corpus(dir: &Path) -> PathBuf {
    let line = b"the cat sat on the mat. the dog ran to the log.\n";
    let path = dir.join("corpus.txt");
    std::fs::write(&path, line.repeat(60)).unwrap();
    path
}

/// A small LSTM language model over `corpus`, its store and run in `dir`.
fn experiment_text(dir: &Path, corpus: &Path, length: usize, vocab: usize, out: usize) -> String {
    format!(
        r#"
[run]
name = "text-test"
seed = 3
log_every = 1000
profile = "none"
output_dir = "{run}"

[data]
format = "text"
dir = "{store}"
workers = 1
prefetch = 2

[text]
package = "no-such-package-for-tests"
corpus = ["{corpus}"]
sample_bytes = 20

[device]
kind = "cpu"

[model]
tokens = {{ length = {length}, vocab = {vocab} }}
layers = [
  {{ type = "embedding", dim = 16 }},
  {{ type = "lstm", hidden = 32 }},
  {{ type = "linear", out = {out} }},
]

[train]
epochs = 5
batch_size = 8
threads = 1
clip_norm = 1.0

[optimizer]
lr = 1e-2

[schedule]
kind = "constant"
"#,
        run = dir.join("run").display(),
        store = dir.join("store").display(),
        corpus = corpus.display(),
    )
}

fn load(dir: &Path, text: &str, sets: &[&str]) -> ExperimentConfig {
    let path = dir.join("experiment.toml");
    std::fs::write(&path, text).unwrap();
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
fn per_token_loss_matches_a_manual_computation_and_finite_differences() {
    let (n, t, v) = (2, 3, 5);
    let values: Vec<f32> = (0..n * t * v)
        .map(|i| ((i * 37 % 11) as f32 - 5.0) / 4.0)
        .collect();
    let targets = [0u32, 4, 2, 1, 3, 3];
    let loss_of = |values: &[f32]| -> f32 {
        let logits = Tensor::from_vec(&[n, t, v], values.to_vec()).unwrap();
        per_token_loss(&logits, &targets, 0.0).unwrap().loss
    };
    let manual: f64 = values
        .chunks(v)
        .zip(targets)
        .map(|(row, target)| {
            let sum: f64 = row.iter().map(|&x| (x as f64).exp()).sum();
            sum.ln() - row[target as usize] as f64
        })
        .sum::<f64>()
        / (n * t) as f64;
    assert!((loss_of(&values) as f64 - manual).abs() < 1e-5);

    let logits = Tensor::from_vec(&[n, t, v], values.clone()).unwrap();
    let out = per_token_loss(&logits, &targets, 0.0).unwrap();
    assert_eq!(out.grad.shape(), &[n, t, v]);
    let h = 1e-2;
    for (i, &analytic) in out.grad.data().iter().enumerate() {
        let (mut up, mut down) = (values.clone(), values.clone());
        up[i] += h;
        down[i] -= h;
        let numeric = (loss_of(&up) - loss_of(&down)) / (2.0 * h);
        assert!(
            (numeric - analytic).abs() < 1e-3,
            "logit {i}: {numeric} vs {analytic}"
        );
    }
}

#[test]
fn a_tiny_char_model_learns_a_written_corpus_and_writes_a_sample() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = write_corpus(dir.path());
    let config = load(
        dir.path(),
        &experiment_text(dir.path(), &corpus, LENGTH, 256, 256),
        &[],
    );
    let summary = train(&config, &options()).unwrap();
    let losses: Vec<f32> = summary.epochs.iter().map(|e| e.test_loss).collect();
    assert_eq!(losses.len(), 5);
    // From ln 256 = 5.5 nats (uniform over bytes) to well below half of it.
    assert!(
        losses[4] < losses[0] && losses[4] < 2.0,
        "validation loss per epoch {losses:?}"
    );
    let accuracy = summary.test_accuracy.unwrap();
    assert!(
        accuracy > 0.3 && accuracy <= 1.0,
        "per-token accuracy {accuracy}"
    );

    let report = text::write_report(&config, &summary).unwrap();
    assert!((report.bits_per_byte - losses[4] / std::f32::consts::LN_2).abs() < 1e-6);
    let sample = std::fs::read_to_string(dir.path().join("run").join(text::SAMPLE_FILE)).unwrap();
    assert_eq!(sample, report.sample);
    assert!(
        sample.starts_with("The ") && sample.len() >= 4 + 20,
        "{sample:?}"
    );
    // Same seed, same weights: the same text.
    assert_eq!(
        text::write_report(&config, &summary).unwrap().sample,
        sample
    );
}

#[test]
fn the_store_is_packed_once_and_reused() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = write_corpus(dir.path());
    let config = load(
        dir.path(),
        &experiment_text(dir.path(), &corpus, LENGTH, 256, 256),
        &[],
    );
    let store = text::pack(&config, false).unwrap();
    let index = store.join("train").join(headroom_loader::INDEX_FILE);
    let written = std::fs::metadata(&index).unwrap().modified().unwrap();
    assert_eq!(text::pack(&config, false).unwrap(), store);
    assert_eq!(
        std::fs::metadata(&index).unwrap().modified().unwrap(),
        written
    );
    let (train_set, test_set) = text::open_splits(&config, false).unwrap();
    // 2880 bytes: 2736 for training, the last 144 held out, in 16-byte steps.
    assert_eq!((train_set.len(), test_set.len()), (170, 8));
    assert_eq!(train_set.sample_shape(), [1, LENGTH + 1, 1]);
}

#[test]
fn a_missing_corpus_names_the_file_the_key_and_the_package() {
    let dir = tempfile::tempdir().unwrap();
    let absent = dir.path().join("absent.txt");
    let config = load(
        dir.path(),
        &experiment_text(dir.path(), &absent, LENGTH, 256, 256),
        &[],
    );
    let err = train(&config, &options()).unwrap_err().to_string();
    assert!(err.contains(&absent.display().to_string()), "{err}");
    assert!(err.contains("text.corpus"), "{err}");
    assert!(
        err.contains("apt-get install -y no-such-package-for-tests"),
        "{err}"
    );
}

#[test]
fn a_vocabulary_mismatch_names_model_tokens_vocab() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = write_corpus(dir.path());
    let config = load(
        dir.path(),
        &experiment_text(dir.path(), &corpus, LENGTH, 128, 128),
        &[],
    );
    let err = train(&config, &options()).unwrap_err().to_string();
    assert!(
        err.contains("model.tokens.vocab") && err.contains("256"),
        "{err}"
    );
    assert!(err.contains(&corpus.display().to_string()), "{err}");
}

#[test]
fn a_last_layer_that_does_not_score_the_vocabulary_names_model_layers() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = write_corpus(dir.path());
    let config = load(
        dir.path(),
        &experiment_text(dir.path(), &corpus, LENGTH, 256, 100),
        &[],
    );
    let err = train(&config, &options()).unwrap_err().to_string();
    assert!(err.contains("model.layers") && err.contains("100"), "{err}");
}

#[test]
fn sequences_longer_than_the_context_name_the_store_and_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = write_corpus(dir.path());
    let long = load(
        dir.path(),
        &experiment_text(dir.path(), &corpus, 32, 256, 256),
        &[],
    );
    let store = text::pack(&long, false).unwrap();
    let store_text = store.display().to_string();
    let config = load(
        dir.path(),
        &experiment_text(dir.path(), &corpus, LENGTH, 256, 256),
        &["data.format=shards", &format!("data.dir={store_text}")],
    );
    let err = train(&config, &options()).unwrap_err().to_string();
    assert!(err.contains("model.tokens.length"), "{err}");
    assert!(
        err.contains("32 tokens, longer than the model's context of 16"),
        "{err}"
    );
    assert!(err.contains(&store_text), "{err}");
}

#[test]
fn text_data_without_a_token_model_names_model_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = write_corpus(dir.path());
    let text = experiment_text(dir.path(), &corpus, LENGTH, 256, 256).replace(
        "tokens = { length = 16, vocab = 256 }",
        "input = [28, 28, 1]\nmean = 0.5\nstd = 0.5",
    );
    let path = dir.path().join("experiment.toml");
    std::fs::write(&path, text).unwrap();
    let err = ExperimentConfig::load(&path, &Overrides::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("model.tokens"), "{err}");
}
