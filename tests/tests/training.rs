//! Training end to end through the library: the smoke network learns, and a
//! resumed run ends with the same weights, bit for bit, as one never stopped.

use std::path::Path;

use headroom_pipeline::checkpoint;
use headroom_pipeline::{train, ExperimentConfig, Overrides, TrainOptions};
use headroom_tests::write_synthetic_fashion_mnist;

fn smoke_config(data: &Path, out: &Path, extra: &[&str]) -> ExperimentConfig {
    let mut pairs = vec![
        format!("data.dir={}", data.display()),
        format!("run.output_dir={}", out.display()),
    ];
    pairs.extend(extra.iter().map(|s| s.to_string()));
    let experiments = Path::new(env!("CARGO_MANIFEST_DIR")).join("../experiments/smoke.toml");
    ExperimentConfig::load(&experiments, &Overrides::parse(&pairs).unwrap()).unwrap()
}

fn step_losses(run_dir: &Path) -> Vec<f64> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    text.lines()
        .filter(|l| l.contains("\"kind\":\"step\""))
        .map(|l| {
            let at = l.find("\"loss\":").unwrap() + 7;
            let end = l[at..].find(',').unwrap() + at;
            l[at..end].parse().unwrap()
        })
        .collect()
}

#[test]
fn smoke_network_loss_falls_well_below_its_start() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 1024, 256);
    let out = tempfile::tempdir().unwrap();
    let config = smoke_config(data.path(), out.path(), &["train.epochs=3"]);
    let summary = train(&config, &TrainOptions::default()).unwrap();

    let losses = step_losses(out.path());
    assert_eq!(losses.len(), 3 * (1024 / 32));
    let first = losses[..4].iter().sum::<f64>() / 4.0;
    let last = losses[losses.len() - 8..].iter().sum::<f64>() / 8.0;
    assert!(
        first > 2.0,
        "the first steps should be near ln(10): {first}"
    );
    assert!(
        last < 0.5 * first,
        "loss fell only from {first:.3} to {last:.3}"
    );
    assert!(
        summary.test_accuracy > 0.9,
        "test accuracy {}",
        summary.test_accuracy
    );
    assert_eq!(summary.epochs.len(), 3);
    assert!(summary.last_checkpoint.is_some());
}

#[test]
fn resumed_run_matches_an_uninterrupted_one_bit_for_bit() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 512, 64);
    let straight = tempfile::tempdir().unwrap();
    let config = smoke_config(
        data.path(),
        straight.path(),
        &["train.epochs=3", "train.threads=2"],
    );
    train(&config, &TrainOptions::default()).unwrap();

    // Run again, lose the last epoch's checkpoint as a kill would, resume.
    let interrupted = tempfile::tempdir().unwrap();
    let config = smoke_config(
        data.path(),
        interrupted.path(),
        &["train.epochs=3", "train.threads=2"],
    );
    train(&config, &TrainOptions::default()).unwrap();
    std::fs::remove_file(interrupted.path().join(checkpoint::file_name(3))).unwrap();
    let options = TrainOptions {
        resume: true,
        ..Default::default()
    };
    let summary = train(&config, &options).unwrap();
    assert_eq!(summary.epochs.len(), 1, "only the lost epoch is run again");
    assert!(summary
        .resumed_from
        .unwrap()
        .ends_with(checkpoint::file_name(2)));

    let a = checkpoint::load(&straight.path().join(checkpoint::file_name(3))).unwrap();
    let b = checkpoint::load(&interrupted.path().join(checkpoint::file_name(3))).unwrap();
    assert_eq!(a.step, b.step);
    assert!(a.params == b.params, "weights differ after resume");
    assert!(
        a.buffers == b.buffers,
        "batch-norm statistics differ after resume"
    );
    assert!(
        a.optimizer == b.optimizer,
        "optimizer moments differ after resume"
    );
}

#[test]
fn resume_refuses_a_checkpoint_of_another_model() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 256, 64);
    let out = tempfile::tempdir().unwrap();
    let config = smoke_config(data.path(), out.path(), &["train.epochs=1"]);
    train(&config, &TrainOptions::default()).unwrap();

    let mut other = config.clone();
    other.model.layers.pop();
    other.model.layers.push(headroom_model::LayerSpec::Linear {
        out: 12,
        bias: true,
    });
    let options = TrainOptions {
        resume: true,
        ..Default::default()
    };
    let err = train(&other, &options).unwrap_err().to_string();
    assert!(
        err.contains("different model") && err.contains(".ckpt"),
        "{err}"
    );
}
