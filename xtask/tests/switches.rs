//! Each `--no-X` switch of `cargo xtask train` changes the setting it names
//! and nothing else: a one-step smoke run with the switch records in its
//! `config.toml` the same experiment as one without, but for that key.
//! `--no-channels-last` names a layout headroom does not have, so it
//! changes nothing and says so. `--no-install` is no config key: what it
//! forbids (apt-get installing the dataset as root) shows only on a machine
//! without the dataset, where the run without it would install a package,
//! so it is not run here. `cargo xtask bench` has no `--no-X` switch.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::*;
use headroom_pipeline::{ExperimentConfig, Overrides};

/// The recorded experiment of a one-step smoke run with `extra` arguments,
/// every setting by its dotted key (the output directory left out: each
/// run has its own), and the run's stderr.
fn recorded(data: &Path, extra: &[&str]) -> (BTreeMap<String, serde_json::Value>, String) {
    let out = tempfile::tempdir().unwrap();
    let run_dir = out.path().join("run");
    let mut list = smoke_args(data, &run_dir);
    for set in [
        "train.epochs=1",
        "data.train_samples=32",
        "data.test_samples=16",
    ] {
        list.extend(["--set".into(), set.into()]);
    }
    list.extend(extra.iter().map(|s| s.to_string()));
    let output = run(&list.iter().map(String::as_str).collect::<Vec<_>>());
    let err = stderr(&output);
    assert!(output.status.success(), "{extra:?}: {err}");
    let config = ExperimentConfig::load(
        &run_dir.join("config.toml"),
        &Overrides::parse(&[] as &[String]).unwrap(),
    )
    .unwrap();
    let mut keys = BTreeMap::new();
    flatten("", serde_json::to_value(&config).unwrap(), &mut keys);
    keys.remove("run.output_dir");
    (keys, err)
}

fn flatten(prefix: &str, value: serde_json::Value, out: &mut BTreeMap<String, serde_json::Value>) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, value) in map {
                let key = if prefix.is_empty() {
                    key
                } else {
                    format!("{prefix}.{key}")
                };
                flatten(&key, value, out);
            }
        }
        leaf => {
            out.insert(prefix.to_string(), leaf);
        }
    }
}

/// The keys whose values differ between `a` and `b`.
fn differences(
    a: &BTreeMap<String, serde_json::Value>,
    b: &BTreeMap<String, serde_json::Value>,
) -> Vec<String> {
    let mut keys: Vec<String> = a
        .keys()
        .chain(b.keys())
        .filter(|k| a.get(*k) != b.get(*k))
        .cloned()
        .collect();
    keys.dedup();
    keys
}

#[test]
fn each_no_switch_of_train_changes_its_key_and_nothing_else() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 32, 16);
    let (plain, _) = recorded(data.path(), &[]);
    for (switch, key) in [
        ("--no-amp", "device.amp"),
        ("--no-fusion", "device.fusion"),
        ("--no-graphs", "device.graphs"),
    ] {
        assert_eq!(
            plain.get(key),
            Some(&serde_json::Value::Bool(true)),
            "{key} is on without {switch}"
        );
        let (switched, _) = recorded(data.path(), &[switch]);
        assert_eq!(
            switched.get(key),
            Some(&serde_json::Value::Bool(false)),
            "{switch}"
        );
        assert_eq!(
            differences(&plain, &switched),
            vec![key.to_string()],
            "{switch} changed other settings"
        );
    }
    let (switched, err) = recorded(data.path(), &["--no-channels-last"]);
    assert!(
        differences(&plain, &switched).is_empty(),
        "--no-channels-last changed a setting"
    );
    assert!(
        err.contains("--no-channels-last: headroom is channels-last (NHWC) only"),
        "{err}"
    );
}
