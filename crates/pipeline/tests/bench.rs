//! `bench::training_step` on every kind of experiment the repository ships:
//! the synthetic batch takes each model's input layout (images, text
//! windows, frame sequences), a fine-tune is timed without a trained base,
//! and the parameter counts that `--compare-torch` checks PyTorch's model
//! against are the run's own.

use std::path::Path;

use headroom_model::Network;
use headroom_pipeline::bench::{self, StepBench};
use headroom_pipeline::finetune;
use headroom_pipeline::{ExperimentConfig, Overrides};

fn experiment(name: &str, sets: &[&str]) -> ExperimentConfig {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../experiments")
        .join(name);
    let pairs: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    ExperimentConfig::load(&path, &Overrides::parse(&pairs).unwrap()).unwrap()
}

fn one_step(config: &ExperimentConfig, batch: usize) -> StepBench {
    let result = bench::training_step(config, batch, 1, 0, 1, false).unwrap();
    assert_eq!(result.batch, batch);
    assert!(result.samples_per_sec.is_finite() && result.samples_per_sec > 0.0);
    assert_eq!(result.device, "cpu");
    result
}

fn parameters_of(config: &ExperimentConfig) -> usize {
    Network::build(&finetune::as_trained(config).model, 0)
        .unwrap()
        .num_params()
}

#[test]
fn every_kind_of_model_is_timed_in_its_own_input_layout() {
    for name in [
        "mlp_silu.toml",
        "tiny_gpt.toml",
        "char_lm.toml",
        "conv_lstm.toml",
    ] {
        let config = experiment(name, &[]);
        let result = one_step(&config, 2);
        let parameters = parameters_of(&config);
        assert_eq!(result.parameters, parameters, "{name}");
        assert_eq!(result.trainable_parameters, parameters, "{name}");
        assert!(result.macs_per_sample > 0, "{name}");
    }
}

#[test]
fn a_fine_tune_is_timed_without_a_trained_base_and_counts_what_it_trains() {
    let missing = tempfile::tempdir().unwrap();
    let base = format!("finetune.base={}", missing.path().join("none").display());
    let lora = one_step(&experiment("lora_finetune.toml", &[&base]), 1);
    let full = one_step(
        &experiment("lora_finetune.toml", &[&base, "finetune.train=full"]),
        1,
    );
    // LoRA trains the adapters alone; the full fine-tune trains the model
    // without adapters, every weight of it.
    assert!(lora.trainable_parameters > 0);
    assert!(lora.trainable_parameters * 10 < lora.parameters);
    assert_eq!(full.trainable_parameters, full.parameters);
    assert_eq!(
        lora.parameters,
        full.parameters + lora.trainable_parameters,
        "the LoRA model is the full model plus its adapters"
    );
}
