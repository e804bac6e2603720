//! `cargo xtask finetune-llm` end to end on the llama fixture: a full
//! fine-tune whose logged loss falls writes its run directory (run.json,
//! metrics.jsonl, checkpoints) and OUT/model, a model directory that loads
//! and that `generate --model OUT/model` runs; a run that cannot fit
//! `--memory-limit` is refused naming each part, and an output inside the
//! model directory is refused, both before any step and writing nothing;
//! SIGTERM checkpoints after the step under way and prints a quoted
//! `--resume` command that, pasted into `sh`, ends with the model and the
//! losses of a run never stopped.

// Not every helper is used here.
#[allow(dead_code, unused_imports)]
mod common;

use common::*;

fn llama() -> String {
    repo_root()
        .join("crates/llm/fixtures/llama")
        .display()
        .to_string()
}

const TWO: &str = "{\"text\": \"The lazy fox trains a frozen model.\"}\n\
     {\"prompt\": \"The quick brown\", \"completion\": \" fox within the memory it has\"}\n";

/// The losses the log reports, in order.
fn losses(log: &str) -> Vec<f32> {
    log.lines()
        .filter_map(|l| l.split("loss ").nth(1))
        .filter_map(|rest| rest.split(',').next()?.trim().parse().ok())
        .collect()
}

fn args(model: &str, data: &str, out: &str, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "finetune-llm",
        "--model",
        model,
        "--data",
        data,
        "--output",
        out,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn trains_every_weight_and_writes_a_directory_generate_runs() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("train.jsonl");
    std::fs::write(&data, TWO).expect("write");
    let out = tmp.path().join("trained");
    let (data_s, out_s, model) = (
        data.display().to_string(),
        out.display().to_string(),
        llama(),
    );
    let a = args(
        &model,
        &data_s,
        &out_s,
        &[
            "--epochs",
            "6",
            "--lr",
            "3e-3",
            "--accumulate",
            "2",
            "--warmup-steps",
            "1",
            "--memory-limit",
            "1GiB",
        ],
    );
    let result = run(&strs(&a));
    let log = stderr(&result);
    assert!(result.status.success(), "{log}");
    assert!(log.contains("memory: weights"), "{log}");
    let logged = losses(&log);
    assert_eq!(logged.len(), 6, "one step an epoch: {log}");
    assert!(logged[5] < 0.8 * logged[1], "{logged:?}");
    assert!(log.contains("wrote "), "{log}");

    for file in [
        "run.json",
        "metrics.jsonl",
        "checkpoint-step0000000006/model.safetensors",
    ] {
        assert!(out.join(file).is_file(), "{file}");
    }
    let out = out.join("model");
    let out_s = out.display().to_string();
    let trained = headroom_llm::Model::load(&out).expect("the output loads");
    let base = headroom_llm::Model::load(std::path::Path::new(&model)).expect("loads");
    let ids = vec![vec![1u32, 40, 41, 42]];
    assert_ne!(
        trained.logits(&ids).expect("logits"),
        base.logits(&ids).expect("logits")
    );
    for file in ["config.json", "tokenizer.json", "model.safetensors"] {
        assert!(out.join(file).is_file(), "{file}");
    }

    let generated = run(&[
        "generate",
        "--model",
        &out_s,
        "--prompt",
        "The quick brown",
        "--max-new-tokens",
        "6",
    ]);
    assert!(generated.status.success(), "{}", stderr(&generated));
    assert!(!generated.stdout.is_empty());

    // A second run to the same output is refused before training.
    let again = run(&strs(&a));
    let err = stderr(&again);
    assert!(!again.status.success());
    assert!(err.contains("holds a fine-tuning run already"), "{err}");
    assert!(losses(&err).is_empty(), "trained before refusing: {err}");
}

#[test]
fn a_fine_tune_that_cannot_fit_or_would_write_into_the_model_is_refused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("train.jsonl");
    std::fs::write(&data, TWO).expect("write");
    let out = tmp.path().join("trained");
    let (data_s, out_s, model) = (
        data.display().to_string(),
        out.display().to_string(),
        llama(),
    );
    let refused = run(&strs(&args(
        &model,
        &data_s,
        &out_s,
        &["--memory-limit", "1MiB"],
    )));
    let err = stderr(&refused);
    assert!(!refused.status.success(), "{err}");
    for part in [
        "does not fit in 1.0 MiB (--memory-limit)",
        "weights",
        "gradient sum",
        "AdamW moments",
        "one pass of 1 ×",
        "its gradients",
        "block inputs",
        "lower --max-seq-length",
    ] {
        assert!(err.contains(part), "missing {part:?}: {err}");
    }
    assert!(!out.exists(), "a refused run wrote {}", out.display());

    let inside = std::path::Path::new(&model).join("trained");
    let refused = run(&strs(&args(
        &model,
        &data_s,
        &inside.display().to_string(),
        &[],
    )));
    let err = stderr(&refused);
    assert!(!refused.status.success());
    assert!(err.contains("is inside the model directory"), "{err}");
    assert!(!inside.exists());
}

fn run_in_shell(line: &str) -> std::process::Output {
    std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("exec \"$0\" {line}"))
        .arg(env!("CARGO_BIN_EXE_xtask"))
        .current_dir(repo_root())
        .output()
        .expect("sh")
}

#[test]
fn sigterm_checkpoints_and_the_printed_command_resumes_to_the_same_model() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("train.jsonl");
    std::fs::write(&data, TWO).expect("write");
    let extra = [
        "--epochs",
        "300",
        "--lr",
        "1e-4",
        "--accumulate",
        "1",
        "--max-grad-norm",
        "0.5",
        "--save-steps",
        "100000",
    ];
    let straight = tmp.path().join("straight");
    let a = args(
        &llama(),
        &data.display().to_string(),
        &straight.display().to_string(),
        &extra,
    );
    let done = run(&strs(&a));
    assert!(done.status.success(), "{}", stderr(&done));

    let out = tmp.path().join("it's a $HOME run");
    let a = args(
        &llama(),
        &data.display().to_string(),
        &out.display().to_string(),
        &extra,
    );
    let (output, log) = sigterm_after(&strs(&a), "step 3/");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert_eq!(output.status.code(), Some(143), "SIGTERM exits 143: {log}");
    let command = stdout
        .lines()
        .find_map(|l| l.split_once("continue with: cargo xtask ").map(|(_, c)| c))
        .unwrap_or_else(|| panic!("no continue command in {stdout}"));
    assert!(
        command.starts_with("finetune-llm --resume '"),
        "quoted: {command}"
    );
    assert!(!out.join("model").exists(), "a stopped run wrote its model");
    let resumed = run_in_shell(command);
    let log = stderr(&resumed);
    assert!(resumed.status.success(), "{log}");
    assert!(log.contains("resuming from"), "{log}");
    let file = "model/model.safetensors";
    let (a, b) = (
        std::fs::read(straight.join(file)).expect("straight"),
        std::fs::read(out.join(file)).expect("resumed"),
    );
    assert!(a == b, "{file} differs from the uninterrupted run's");
    let losses = |dir: &std::path::Path| -> Vec<String> {
        std::fs::read_to_string(dir.join("metrics.jsonl"))
            .expect("metrics")
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).expect("json");
                format!("{} {} {}", v["step"], v["loss"], v["grad_norm"])
            })
            .collect()
    };
    assert_eq!(losses(&straight), losses(&out));
}
