//! LoRA fine-tuning through the pipeline on a tiny GPT and corpora the test
//! writes: the base loads by name, only the adapters train (and only they
//! hold optimizer state), the adapters file round-trips and merges into
//! weights that give the adapted model's outputs, bad bases and inputs are
//! errors naming the file or key, and a memory limit too small fails before
//! any step, naming what does not fit.

use std::path::{Path, PathBuf};

use headroom_model::{Mode, ModelSpec, Network};
use headroom_pipeline::checkpoint::{self, Checkpoint};
use headroom_pipeline::finetune::{self, Figures, FinetuneMode};
use headroom_pipeline::{export, train, ExperimentConfig, Overrides, Resume, TrainOptions};

const BLOCK: &str = r#"{ type = "transformer_block", heads = 2, mlp_ratio = 2 LORA }"#;

/// A tiny GPT over `corpus` (length 16, width `dim`), its store and run in
/// `dir/<name>`; `lora` is spliced into the block, `extra` appended.
fn experiment(
    dir: &Path,
    name: &str,
    corpus: &Path,
    dim: usize,
    lora: &str,
    extra: &str,
) -> String {
    let block = BLOCK.replace("LORA", lora);
    format!(
        r#"
[run]
name = "{name}"
seed = 5
log_every = 1000
profile = "none"
output_dir = "{run}"

[data]
format = "text"
dir = "{store}"
workers = 1
prefetch = 2

[text]
corpus = ["{corpus}"]
sample_bytes = 8

[device]
kind = "cpu"

[model]
tokens = {{ length = 16, vocab = 256 }}
layers = [
  {{ type = "embedding", dim = {dim}, positions = true }},
  {block},
  {{ type = "layer_norm" }},
  {{ type = "linear", out = 256 }},
]

[train]
epochs = 1
batch_size = 8
threads = 1
clip_norm = 1.0

[optimizer]
lr = 1e-2

[schedule]
kind = "constant"
{extra}
"#,
        run = dir.join(name).display(),
        store = dir.join("store").display(),
        corpus = corpus.display(),
    )
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn load(path: &Path, sets: &[&str]) -> headroom_pipeline::Result<ExperimentConfig> {
    let pairs: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    ExperimentConfig::load(path, &Overrides::parse(&pairs).unwrap())
}

fn options() -> TrainOptions {
    TrainOptions {
        resume: Resume::No,
        allow_install: false,
        stop: None,
        ..Default::default()
    }
}

/// Two corpora of different domains, and a base trained on the first.
struct Setup {
    dir: tempfile::TempDir,
    base_dir: PathBuf,
    finetune_toml: PathBuf,
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let fortunes = b"the cat sat on the mat. the dog ran to the log.\n".repeat(40);
    let licence =
        b"THIS SOFTWARE IS PROVIDED AS IS, WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED.\n"
            .repeat(30);
    let a = dir.path().join("fortunes.txt");
    let b = dir.path().join("licence.txt");
    std::fs::write(&a, fortunes).unwrap();
    std::fs::write(&b, licence).unwrap();
    let base_toml = write(
        dir.path(),
        "base.toml",
        &experiment(dir.path(), "base", &a, 16, "", ""),
    );
    train(&load(&base_toml, &[]).unwrap(), &options()).unwrap();
    let finetune_table = format!(
        "[finetune]\nbase = \"{}\"\ntrain = \"lora\"\n",
        dir.path().join("base").display()
    );
    let finetune_toml = write(
        dir.path(),
        "finetune.toml",
        &experiment(
            dir.path(),
            "lora",
            &b,
            16,
            ", lora = { r = 2, alpha = 4 }",
            &finetune_table,
        )
        .replace("batch_size = 8", "batch_size = 4\naccumulate = 4"),
    );
    let base_dir = dir.path().join("base");
    Setup {
        dir,
        base_dir,
        finetune_toml,
    }
}

fn base_checkpoint(setup: &Setup) -> (PathBuf, Checkpoint) {
    let (found, _) = checkpoint::newest_valid(&setup.base_dir).unwrap();
    found.unwrap()
}

/// The base's tensors by name.
fn base_tensors(setup: &Setup) -> Vec<(String, Vec<f32>)> {
    let (path, saved) = base_checkpoint(setup);
    export::named_values(&saved, &path)
        .unwrap()
        .into_iter()
        .map(|t| (t.name, t.values.to_vec()))
        .collect()
}

fn ids(n: usize, length: usize) -> Vec<u32> {
    (0..n * length).map(|i| (i * 31 % 97) as u32 + 32).collect()
}

fn forward(network: &mut Network, length: usize) -> Vec<f32> {
    let x = network.input_from_tokens(2, &ids(2, length)).unwrap();
    network.forward(&x, Mode::Eval).unwrap().data().to_vec()
}

fn base_network(setup: &Setup) -> Network {
    let (_, saved) = base_checkpoint(setup);
    let spec: ModelSpec = saved.model().unwrap();
    let mut network = Network::build(&spec, 0).unwrap();
    for (p, values) in network.params_mut().into_iter().zip(&saved.params) {
        p.value.data_mut().copy_from_slice(values);
    }
    network
}

#[test]
fn the_base_loads_by_name_and_a_fresh_adapter_is_the_base_model() {
    let setup = setup();
    let config = load(&setup.finetune_toml, &[]).unwrap();
    let mut network = Network::build(&finetune::effective_model(&config), 9).unwrap();
    let loaded = finetune::initialise(&config, &mut network).unwrap();
    let base = base_tensors(&setup);
    assert_eq!(loaded, base.len());
    for p in network.params_mut() {
        match base.iter().find(|(name, _)| *name == p.name) {
            Some((_, values)) => {
                assert_eq!(p.value.data(), values.as_slice(), "{}", p.name);
                assert!(p.frozen, "{} should be frozen", p.name);
                assert!(p.grad.is_empty(), "{} holds a gradient buffer", p.name);
            }
            None => {
                assert!(finetune::is_adapter(&p.name), "{} not loaded", p.name);
                assert!(!p.frozen, "{} should train", p.name);
            }
        }
    }
    // B starts at zero: the adapted model computes exactly the base's outputs.
    assert_eq!(
        forward(&mut network, 16),
        forward(&mut base_network(&setup), 16)
    );

    // A shorter context takes the first rows of the learned positions.
    let short = load(&setup.finetune_toml, &["model.tokens.length=8"]).unwrap();
    let mut network = Network::build(&finetune::effective_model(&short), 9).unwrap();
    finetune::initialise(&short, &mut network).unwrap();
    let positions = network
        .params_mut()
        .into_iter()
        .find(|p| p.name.ends_with(".positions"))
        .map(|p| p.value.data().to_vec())
        .unwrap();
    let (_, base_positions) = base
        .iter()
        .find(|(n, _)| n.ends_with(".positions"))
        .unwrap();
    assert_eq!(positions.len(), 8 * 16);
    assert_eq!(positions.as_slice(), &base_positions[..8 * 16]);
}

#[test]
fn lora_trains_only_the_adapters_which_alone_hold_optimizer_state() {
    let setup = setup();
    let config = load(&setup.finetune_toml, &[]).unwrap();
    let summary = train(&config, &options()).unwrap();
    assert!(summary.step > 0);
    assert_eq!(summary.micro_batch, 1, "batch 4 x accumulation 4");
    let last = summary.last_checkpoint.clone().unwrap();
    let saved = checkpoint::load(&last).unwrap();
    let named = export::named_values(&saved, &last).unwrap();
    let base = base_tensors(&setup);
    let mut adapter_elements = 0;
    for (t, moment) in named.iter().zip(&saved.optimizer.first_moment) {
        if finetune::is_adapter(&t.name) {
            assert_eq!(moment.len(), t.values.len(), "{}", t.name);
            adapter_elements += t.values.len();
        } else {
            assert!(moment.is_empty(), "{} holds optimizer state", t.name);
            let (_, before) = base.iter().find(|(n, _)| *n == t.name).unwrap();
            assert_eq!(t.values, before.as_slice(), "{} moved", t.name);
        }
    }
    // The B factors trained away from zero.
    assert!(named
        .iter()
        .any(|t| t.name.ends_with(".lora_b") && t.values.iter().any(|&v| v != 0.0)));

    let lora = Figures::of_config(&config).unwrap();
    // qkv 16->48 and proj 16->16 at r = 2: 2·(16+48) + 2·(16+16).
    assert_eq!(lora.trainable, 192);
    assert_eq!(adapter_elements, lora.trainable);
    assert_eq!(lora.optimizer_state_bytes, 8 * 192);

    let full_config = load(&setup.finetune_toml, &["finetune.train=full"]).unwrap();
    let full = Figures::of_config(&full_config).unwrap();
    assert_eq!(full.parameters, lora.parameters - lora.trainable);
    assert_eq!(full.trainable, full.parameters);
    assert_eq!(full.optimizer_state_bytes, 8 * full.parameters as u64);
    let spec = finetune::effective_model(&full_config);
    assert!(finetune::adapter_scales(&spec).is_empty());
    // A full fine-tune trains and reports (its checkpoints hold no adapters).
    let full_config = load(
        &setup.finetune_toml,
        &[
            "finetune.train=full",
            &format!("run.output_dir={}", setup.dir.path().join("full").display()),
        ],
    )
    .unwrap();
    let full_summary = train(&full_config, &options()).unwrap();
    headroom_pipeline::text::write_report(&full_config, &full_summary).unwrap();
    let full_report = finetune::write_report(&full_config, &full_summary).unwrap();
    assert_eq!(
        full_report.figures.optimizer_state_bytes,
        full.optimizer_state_bytes
    );
    assert!(full_report.adapters_file.is_none());

    // The report: adapters written on their own, the base evaluated.
    let report = finetune::write_report(&config, &summary).unwrap();
    assert_eq!(report.train, FinetuneMode::Lora);
    let before = report.bits_per_byte_before.unwrap();
    assert!(before.is_finite() && report.bits_per_byte_after.is_finite());
    assert!(report.bits_per_byte_after < before, "{report:?}");
    // A stop request before the base's evaluation: the adapters are still
    // written, and the report says the base was not measured.
    let stop = std::sync::atomic::AtomicBool::new(true);
    let stopped = finetune::write_report_until(&config, &summary, Some(&stop)).unwrap();
    assert_eq!(stopped.bits_per_byte_before, None);
    assert!(stopped.adapters_file.as_ref().is_some_and(|f| f.exists()));
    let adapters = report.adapters_file.unwrap();
    let ckpt_bytes = std::fs::metadata(&last).unwrap().len();
    assert!(report.adapters_file_bytes.unwrap() * 4 < ckpt_bytes);

    // `cargo xtask eval` on a token model reports bits per byte.
    let eval = headroom_pipeline::eval::evaluate_checkpoint(&last, None, 8, None).unwrap();
    let bits = eval.bits_per_byte.unwrap();
    assert!((bits - eval.loss / std::f32::consts::LN_2).abs() < 1e-6);
    assert!(adapters.is_file());
}

#[test]
fn the_adapters_file_round_trips_and_merged_weights_give_the_adapted_outputs() {
    let setup = setup();
    let config = load(&setup.finetune_toml, &[]).unwrap();
    let summary = train(&config, &options()).unwrap();
    let last = summary.last_checkpoint.unwrap();
    let (base_path, _) = base_checkpoint(&setup);
    let file = setup.dir.path().join("adapters.safetensors");
    let written = finetune::write_adapters(&last, &base_path, &file).unwrap();
    assert_eq!(written, 4, "A and B of qkv and proj");

    // Round trip: the file holds exactly the checkpoint's adapter tensors.
    let saved = checkpoint::load(&last).unwrap();
    let (tensors, metadata) = export::read_f32_safetensors(&file).unwrap();
    let named = export::named_values(&saved, &last).unwrap();
    for (name, shape, values) in &tensors {
        let t = named.iter().find(|t| t.name == *name).unwrap();
        assert_eq!((&t.shape, t.values), (shape, values.as_slice()));
    }
    assert!(metadata["scales"].contains("2.0") || metadata["scales"].contains(":2"));
    assert_eq!(
        metadata[finetune::CHECKSUM_KEY],
        finetune::adapters_checksum(&tensors, &metadata["scales"])
    );
    assert_eq!(finetune::recorded_base(&file).unwrap(), base_path);
    // A file that holds no adapters (the merged weights, below) is named
    // for what it is, not for the base it does not record.
    let not_adapters = setup.dir.path().join("weights.safetensors");
    export::safetensors(&last, Some(&not_adapters)).unwrap();
    let refused = finetune::recorded_base(&not_adapters)
        .unwrap_err()
        .to_string();
    assert!(refused.contains("not a LoRA adapters file"), "{refused}");

    // The adapted model, as trained.
    let mut adapted = Network::build(&saved.model().unwrap(), 0).unwrap();
    for (p, values) in adapted.params_mut().into_iter().zip(&saved.params) {
        p.value.data_mut().copy_from_slice(values);
    }
    // The base architecture with the merged weights, loaded by name.
    let merged_file = setup.dir.path().join("merged.safetensors");
    finetune::merge(&setup.base_dir, &file, &merged_file).unwrap();
    let (merged, _) = export::read_f32_safetensors(&merged_file).unwrap();
    let mut plain = base_network(&setup);
    for p in plain.params_mut() {
        let (_, _, values) = merged.iter().find(|t| t.0 == p.name).unwrap();
        p.value.data_mut().copy_from_slice(values);
    }
    let (a, b) = (forward(&mut adapted, 16), forward(&mut plain, 16));
    let base = forward(&mut base_network(&setup), 16);
    let largest = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    assert!(largest < 1e-4, "merged outputs differ by {largest}");
    let moved = a
        .iter()
        .zip(&base)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    assert!(moved > 1e-3, "the adapters changed nothing ({moved})");
}

fn error_of(setup: &Setup, sets: &[&str]) -> String {
    let config = load(&setup.finetune_toml, sets).unwrap();
    let mut network = match Network::build(&finetune::effective_model(&config), 0) {
        Ok(n) => n,
        Err(e) => return e.to_string(),
    };
    finetune::initialise(&config, &mut network)
        .unwrap_err()
        .to_string()
}

#[test]
fn bad_bases_and_inputs_are_errors_naming_the_file_or_key() {
    let setup = setup();
    let (base_path, _) = base_checkpoint(&setup);
    let base = base_path.display().to_string();

    let longer = error_of(&setup, &["model.tokens.length=32"]);
    assert!(
        longer.contains("model.tokens.length") && longer.contains(&base),
        "{longer}"
    );

    let vocab = error_of(&setup, &["model.tokens.vocab=128"]);
    assert!(
        vocab.contains("model.tokens.vocab") && vocab.contains(&base),
        "{vocab}"
    );

    // Another shape: a wider model than the base.
    let wider_toml = std::fs::read_to_string(&setup.finetune_toml)
        .unwrap()
        .replace("dim = 16", "dim = 32");
    let wider = write(setup.dir.path(), "wider.toml", &wider_toml);
    let config = load(&wider, &[]).unwrap();
    let mut network = Network::build(&finetune::effective_model(&config), 0).unwrap();
    let shape = finetune::initialise(&config, &mut network)
        .unwrap_err()
        .to_string();
    assert!(
        shape.contains(&base)
            && shape.contains("model.layers[0].table")
            && shape.contains("[256, 16]"),
        "{shape}"
    );

    // Another architecture: two blocks where the base has one.
    let deeper_toml = std::fs::read_to_string(&setup.finetune_toml)
        .unwrap()
        .replace(
            "  { type = \"layer_norm\" },",
            &format!(
                "  {},\n  {{ type = \"layer_norm\" }},",
                BLOCK.replace("LORA", ", lora = { r = 2, alpha = 4 }")
            ),
        );
    let deeper = write(setup.dir.path(), "deeper.toml", &deeper_toml);
    let config = load(&deeper, &[]).unwrap();
    let mut network = Network::build(&finetune::effective_model(&config), 0).unwrap();
    let missing = finetune::initialise(&config, &mut network)
        .unwrap_err()
        .to_string();
    assert!(
        missing.contains(&base) && missing.contains("has no tensor model.layers[2]"),
        "{missing}"
    );

    // No base yet: the error names the key and the command that trains it.
    let nowhere = setup.dir.path().join("nowhere");
    let absent = error_of(&setup, &[&format!("finetune.base={}", nowhere.display())]);
    assert!(
        absent.contains("finetune.base") && absent.contains("cargo xtask train --config"),
        "{absent}"
    );

    // A missing corpus names the file.
    let gone_toml = std::fs::read_to_string(&setup.finetune_toml)
        .unwrap()
        .replace("licence.txt", "gone.txt");
    let gone = write(setup.dir.path(), "gone.toml", &gone_toml);
    let err = train(&load(&gone, &[]).unwrap(), &options())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("text.corpus") && err.contains("gone.txt"),
        "{err}"
    );

    // LoRA without adapters in the model is refused by key.
    let plain_toml = std::fs::read_to_string(&setup.finetune_toml)
        .unwrap()
        .replace(", lora = { r = 2, alpha = 4 }", "");
    let plain = write(setup.dir.path(), "plain.toml", &plain_toml);
    let err = load(&plain, &[]).unwrap_err().to_string();
    assert!(err.contains("finetune.train"), "{err}");
}

#[test]
fn a_memory_limit_too_small_fails_before_any_step_naming_each_part() {
    let setup = setup();
    for mode in ["lora", "full"] {
        let config = load(
            &setup.finetune_toml,
            &[
                "device.memory_limit=64KiB",
                &format!("finetune.train={mode}"),
                &format!("run.output_dir={}", setup.dir.path().join(mode).display()),
            ],
        )
        .unwrap();
        let err = train(&config, &options()).unwrap_err();
        assert!(
            matches!(err, headroom_pipeline::PipelineError::OutOfMemory(_)),
            "{err}"
        );
        let text = err.to_string();
        for part in [
            "device.memory_limit = 64.0 KiB",
            "weights and gradients",
            "optimizer state",
            "measured peak",
            "nothing spills to host memory",
        ] {
            assert!(text.contains(part), "{part} missing from: {text}");
        }
        // Failed before the first step: no checkpoint.
        let dir = setup.dir.path().join(mode);
        assert!(!dir.exists() || checkpoint::list(&dir).unwrap().is_empty());
    }
    // A limit that fits trains.
    let config = load(&setup.finetune_toml, &["device.memory_limit=64MiB"]).unwrap();
    assert!(train(&config, &options()).unwrap().step > 0);
}
