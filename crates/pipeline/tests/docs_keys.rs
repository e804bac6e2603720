//! The table of configuration keys in `docs/configuration.md` and the code
//! agree: every key the code reads is documented, and every documented key
//! exists. The table moved there from the README, which now only links to it.

use std::collections::BTreeSet;
use std::path::Path;

use headroom_pipeline::{ExperimentConfig, Overrides};

/// Every key of a fully populated experiment (optional tables switched on so
/// that their keys appear).
fn keys_in_code() -> BTreeSet<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    // Keys that cannot all be set in one valid experiment come from several.
    let experiments: [&[&str]; 5] = [
        &[
            "augment.rand_augment.num_ops=2",
            "augment.rand_augment.magnitude=9",
            "model.checkpoint=blocks",
            "text.package=fortunes-min",
            "frames.train_sequences=1",
            "frames.test_sequences=1",
            "model.frames=1",
            // The default experiment scores with flip TTA, which a frame
            // model cannot use.
            "eval.tta=none",
            // [distributed] is left out of the serialised config when default.
            "distributed.bucket_mb=10",
            "distributed.timeout_s=60",
            // Left out when off.
            "train.shard_optimizer=true",
            // Left out when unset.
            "device.precision=bf16",
        ],
        &[
            "augment.rand_augment.num_ops=2",
            "augment.rand_augment.magnitude=9",
            "eval.tta=flip",
            "data.validation=0.1",
            "train.early_stopping.metric=accuracy",
            "train.early_stopping.mode=max",
            "train.early_stopping.patience=3",
            "train.early_stopping.min_delta=0.001",
        ],
        &[
            "augment.rand_augment.num_ops=2",
            "augment.rand_augment.magnitude=9",
            "data.format=image_folder",
            "data.dir=photos",
            "data.image_size=[28, 28]",
            "data.channels=1",
            "data.fit=center_crop",
            "data.bad_samples=skip",
        ],
        &[
            "augment.rand_augment.num_ops=2",
            "augment.rand_augment.magnitude=9",
            "data.format=csv",
            "data.dir=table",
            r#"data.targets=["y"]"#,
            r#"data.features=["a"]"#,
            "train.loss=huber",
            "train.huber_delta=1",
            "train.label_smoothing=0",
            "eval.tta=none",
        ],
        &[
            "augment.rand_augment.num_ops=2",
            "augment.rand_augment.magnitude=9",
            "data.format=tensors",
            "data.dir=batches",
            "data.input_array=x",
            "data.target_array=y",
        ],
    ];
    let mut keys = BTreeSet::new();
    for sets in experiments {
        let pairs: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let overrides = Overrides::parse(&pairs).unwrap();
        let config =
            ExperimentConfig::load(&root.join("experiments/fashion_mnist.toml"), &overrides)
                .unwrap();
        keys.extend(config.flatten().into_keys());
    }
    // [finetune] needs a token model: its keys come from the LoRA experiment.
    let lora = ExperimentConfig::load(
        &root.join("experiments/lora_finetune.toml"),
        &Overrides::default(),
    )
    .unwrap();
    keys.extend(
        lora.flatten()
            .into_keys()
            .filter(|k| k.starts_with("finetune.")),
    );
    // Each schedule has keys of its own; the smoke experiment takes any.
    let warmup_cosine = Overrides::parse(&["schedule.kind=warmup_cosine".to_string()]).unwrap();
    let smoke =
        ExperimentConfig::load(&root.join("experiments/smoke.toml"), &warmup_cosine).unwrap();
    keys.extend(
        smoke
            .flatten()
            .into_keys()
            .filter(|k| k.starts_with("schedule.")),
    );
    keys
}

/// The first cell of each row of the table headed "| key |" in
/// `docs/configuration.md`.
fn keys_in_docs() -> BTreeSet<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/configuration.md");
    let page = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let table = page
        .split("| key |")
        .nth(1)
        .expect("docs/configuration.md has a table headed `| key |`");
    table
        .lines()
        .skip(2)
        .take_while(|line| line.starts_with('|'))
        .filter_map(|line| {
            let cell = line.split('|').nth(1)?.trim();
            Some(cell.trim_matches('`').to_string())
        })
        .collect()
}

#[test]
fn every_config_key_is_documented_and_every_documented_key_exists() {
    let (code, docs) = (keys_in_code(), keys_in_docs());
    let undocumented: Vec<_> = code.difference(&docs).collect();
    let unknown: Vec<_> = docs.difference(&code).collect();
    assert!(
        undocumented.is_empty(),
        "keys missing from the table in docs/configuration.md: {undocumented:?}"
    );
    assert!(
        unknown.is_empty(),
        "docs/configuration.md documents keys the code does not have: {unknown:?}"
    );
}
