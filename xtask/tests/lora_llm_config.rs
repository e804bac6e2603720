//! `lora-llm --config FILE --set KEY=VALUE`: a run from a recipe file is
//! the run from the same flags bit for bit (adapters, checkpoints' files,
//! every step's loss, run.json's settings), `--set` goes over the file and
//! the flags over both, the seed recipe (experiments/llm/lora_llm.toml) holds
//! issue #57's settings, and an unknown key or a value of the wrong type is
//! refused naming the file or `--set` and the key.

// Not every helper is used here.
#[allow(dead_code, unused_imports)]
mod common;

use common::*;
use std::path::Path;

const DATA: &str = "{\"text\": \"The lazy fox trains a frozen model.\"}\n\
     {\"prompt\": \"The quick brown\", \"completion\": \" fox within the memory it has\"}\n\
     {\"text\": \"piece by piece, the lazy fox\"}\n";

fn llama() -> String {
    repo_root()
        .join("crates/llm/fixtures/llama")
        .display()
        .to_string()
}

fn metrics_losses(out: &Path) -> Vec<String> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .expect("metrics")
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("json");
            format!("{} {}", v["step"], v["loss"])
        })
        .collect()
}

fn settings(out: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(out.join("run.json")).expect("run.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    v["settings"].clone()
}

#[test]
fn a_run_from_the_file_is_the_run_from_the_flags() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("train.jsonl");
    std::fs::write(&data, DATA).expect("write");
    let cache = tmp.path().join("tokens").display().to_string();
    // The file names the data relatively (from its own directory), puts
    // epochs at 9 and lr at 5e-3: --set brings epochs to 3, the flag lr to 1e-2.
    let recipe = tmp.path().join("recipe.toml");
    std::fs::write(
        &recipe,
        format!(
            "model = {:?}\ndata = \"train.jsonl\"\n\
             [lora]\nr = 4\nalpha = 8\ndropout = 0.1\ntarget_modules = [\"q_proj\", \"v_proj\"]\n\
             [sequence]\nmax_seq_length = 64\npacking = false\n\
             [train]\nepochs = 9\nlr = 5e-3\nbatch_size = 2\naccumulate = 1\nwarmup_steps = 1\n\
             weight_decay = 0.01\nseed = 3\n\
             [checkpoints]\nsave_steps = 2\nkeep = 3\n",
            llama()
        ),
    )
    .expect("write");
    let from_file = tmp.path().join("from-file");
    let result = run(&[
        "lora-llm",
        "--config",
        &recipe.display().to_string(),
        "--set",
        "train.epochs=3",
        "--lr",
        "1e-2",
        "--output",
        &from_file.display().to_string(),
        "--token-cache",
        &cache,
    ]);
    assert!(result.status.success(), "{}", stderr(&result));
    let from_flags = tmp.path().join("from-flags");
    let result = run(&[
        "lora-llm",
        "--model",
        &llama(),
        "--data",
        &data.display().to_string(),
        "--output",
        &from_flags.display().to_string(),
        "--token-cache",
        &cache,
        "--r",
        "4",
        "--alpha",
        "8",
        "--dropout",
        "0.1",
        "--target",
        "q_proj,v_proj",
        "--max-seq-length",
        "64",
        "--epochs",
        "3",
        "--lr",
        "1e-2",
        "--batch-size",
        "2",
        "--accumulate",
        "1",
        "--warmup-steps",
        "1",
        "--weight-decay",
        "0.01",
        "--seed",
        "3",
        "--save-steps",
        "2",
        "--keep-checkpoints",
        "3",
    ]);
    assert!(result.status.success(), "{}", stderr(&result));

    let file_settings = settings(&from_file);
    assert_eq!(file_settings, settings(&from_flags));
    assert_eq!(file_settings["epochs"], 3);
    assert_eq!(file_settings["lr"].as_f64().map(|x| x as f32), Some(1e-2));
    let losses = metrics_losses(&from_file);
    assert_eq!(losses.len(), 6, "two steps an epoch: {losses:?}");
    assert_eq!(losses, metrics_losses(&from_flags));
    for file in [
        "adapter_model.safetensors",
        "adapter_config.json",
        "checkpoint-step0000000006/optimizer.safetensors",
        "checkpoint-step0000000004/adapter_model.safetensors",
    ] {
        let a = std::fs::read(from_file.join(file)).expect("file");
        assert_eq!(
            a,
            std::fs::read(from_flags.join(file)).expect("file"),
            "{file}"
        );
    }
}

#[test]
fn the_seed_recipe_holds_the_issues_settings() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("seed");
    let recipe = repo_root().join("experiments/llm/lora_llm.toml");
    let result = run(&[
        "lora-llm",
        "--config",
        &recipe.display().to_string(),
        "--output",
        &out.display().to_string(),
        "--token-cache",
        &tmp.path().join("tokens").display().to_string(),
    ]);
    assert!(result.status.success(), "{}", stderr(&result));
    let s = settings(&out);
    assert_eq!(
        (&s["r"], &s["alpha"], &s["max_seq_length"], &s["packing"]),
        (&8.into(), &16.0.into(), &1024.into(), &false.into())
    );
    assert_eq!((&s["batch_size"], &s["accumulate"]), (&1.into(), &8.into()));
    assert_eq!(
        s["target_modules"],
        serde_json::json!(["q_proj", "k_proj", "v_proj", "o_proj"])
    );
    assert!(out.join("adapter_model.safetensors").is_file());
}

#[test]
fn unknown_keys_and_wrong_types_are_named() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let recipe = tmp.path().join("bad.toml");
    let out = tmp.path().join("out").display().to_string();
    let refused = |toml: &str, extra: &[&str]| {
        std::fs::write(&recipe, toml).expect("write");
        let path = recipe.display().to_string();
        let mut args = vec!["lora-llm", "--config", &path, "--output", &out];
        args.extend_from_slice(extra);
        let result = run(&args);
        assert!(!result.status.success());
        stderr(&result)
    };
    let err = refused("[lora]\nrank = 4\n", &[]);
    assert!(err.contains("bad.toml: unknown key `lora.rank`"), "{err}");
    assert!(err.contains("lora.r,"), "the known keys listed: {err}");
    let err = refused("[lora]\nr = \"8\"\n", &[]);
    assert!(
        err.contains("key `lora.r` is the string \"8\", expected a whole number"),
        "{err}"
    );
    let err = refused("epochs = 2\n", &[]);
    assert!(err.contains("unknown key `epochs`"), "{err}");
    let err = refused("[train]\naccumulate = 0\n", &[]);
    assert!(
        err.contains("`train.accumulate` is 0, expected at least 1"),
        "{err}"
    );
    let err = refused("", &["--set", "train.lr=fast"]);
    assert!(
        err.contains(
            "--set train.lr=fast: key `train.lr` is the string \"fast\", expected a number"
        ),
        "{err}"
    );
    let err = refused("", &["--set", "train.learning_rate=1"]);
    assert!(err.contains("unknown key `train.learning_rate`"), "{err}");
    let err = refused("[lora\n", &[]);
    assert!(err.contains("bad.toml: not valid TOML"), "{err}");
    assert!(!Path::new(&out).exists());
}
