//! `cargo xtask bench-llm` on a committed fixture: the command times
//! headroom's LoRA step in its child process and prints the table with a
//! real rate; a name that is neither a preset nor a model directory is
//! refused naming the presets. The presets' configs load in our own config
//! reader (a preset the loader refused would only show on a long run).

// Not every helper is used here.
#[allow(dead_code, unused_imports)]
mod common;

use common::*;

#[test]
fn times_a_model_directory_and_prints_the_table() {
    let model = repo_root().join("crates/llm/fixtures/gpt2");
    let report = tempfile::tempdir().expect("tempdir");
    let json = report.path().join("report.json");
    let out = run(&[
        "bench-llm",
        "--shapes",
        &model.display().to_string(),
        "--seq",
        "16",
        "--steps",
        "2",
        "--target",
        "c_attn,c_proj",
        "--keep-activations",
        "1MiB",
        "--json-out",
        &json.display().to_string(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("| headroom |"), "{text}");
    assert!(text.contains("keeping activations within 1MiB"), "{text}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("report")).expect("json");
    let ours = &report["headroom"];
    assert!(
        ours["tokens_per_s"].as_f64().is_some_and(|v| v > 0.0),
        "{report}"
    );
    assert!(
        ours["loss"].as_f64().is_some_and(f64::is_finite),
        "{report}"
    );
    // r 8 on c_attn (32 → 96) and both c_proj (32 → 32, 128 → 32) in 2 layers.
    let per_layer = 8 * (32 + 96) + 8 * (32 + 32) + 8 * (128 + 32);
    assert_eq!(ours["adapter_params"], 2 * per_layer, "{report}");
}

#[test]
fn an_unknown_shape_is_refused_naming_the_presets() {
    let out = run(&["bench-llm", "--shapes", "gpt-9000"]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("gpt-9000") && err.contains("smollm2-360m") && err.contains("llama-3.2-1b"),
        "{err}"
    );
}

#[test]
fn every_preset_config_loads() {
    use headroom_llm::shapes::Preset;
    for preset in Preset::ALL {
        let text = preset.config(Some(2)).to_string();
        let config = headroom_llm::ModelConfig::parse(&text, std::path::Path::new("config.json"))
            .unwrap_or_else(|e| panic!("{}: {e}", preset.name()));
        assert_eq!(config.num_layers, 2, "{}", preset.name());
    }
}
