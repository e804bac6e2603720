//! `cargo xtask lora-llm` end to end on the llama fixture: a few steps write
//! peft's adapter files, the loss goes down in the log, `generate
//! --adapters` uses them, and a bad JSONL line is named; the run directory
//! (--batch-size, --save-steps, metrics.jsonl, --resume with its overrides
//! and refusals); SIGTERM checkpoints and prints a resume command that,
//! pasted into a shell, ends with the adapters of a run never stopped.

// Not every helper is used here.
#[allow(dead_code, unused_imports)]
mod common;

use common::*;
use std::path::Path;
use std::process::Output;

fn llama() -> String {
    repo_root()
        .join("crates/llm/fixtures/llama")
        .display()
        .to_string()
}

/// The losses the log reports, in order.
fn losses(log: &str) -> Vec<f32> {
    log.lines()
        .filter_map(|l| l.split("loss ").nth(1))
        .filter_map(|rest| rest.split(',').next()?.trim().parse().ok())
        .collect()
}

#[test]
fn trains_writes_peft_files_and_generate_uses_them() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("train.jsonl");
    std::fs::write(
        &data,
        "{\"text\": \"The lazy fox trains a frozen model.\"}\n\
         {\"prompt\": \"The quick brown\", \"completion\": \" fox within the memory it has\"}\n",
    )
    .expect("write");
    let out = tmp.path().join("adapters");
    let (data_s, out_s, model) = (
        data.display().to_string(),
        out.display().to_string(),
        llama(),
    );
    let result = run(&[
        "lora-llm",
        "--model",
        &model,
        "--data",
        &data_s,
        "--output",
        &out_s,
        "--r",
        "4",
        "--alpha",
        "8",
        "--target",
        "q_proj,v_proj,down_proj",
        "--epochs",
        "6",
        "--lr",
        "1e-2",
        "--accumulate",
        "2",
        "--warmup-steps",
        "1",
    ]);
    let log = stderr(&result);
    assert!(result.status.success(), "{log}");
    let losses = losses(&log);
    assert_eq!(losses.len(), 6, "one step an epoch: {log}");
    assert!(losses[5] < losses[1], "{losses:?}");
    let base = headroom_llm::Model::load(std::path::Path::new(&model)).expect("loads");
    let (adapters, config) = headroom_llm::peft::load_adapters(&out, &base).expect("reloads");
    assert_eq!((adapters.len(), config.r, config.alpha), (6, 4, 8.0));

    let generated = run(&[
        "generate",
        "--model",
        &model,
        "--adapters",
        &out_s,
        "--prompt",
        "The quick brown",
        "--max-new-tokens",
        "4",
    ]);
    assert!(generated.status.success(), "{}", stderr(&generated));
    assert!(
        stderr(&generated).contains("merged"),
        "{}",
        stderr(&generated)
    );

    std::fs::write(&data, "{\"text\": \"ok\"}\n{\"prompt\": 1}\n").expect("write");
    let bad = run(&[
        "lora-llm", "--model", &model, "--data", &data_s, "--output", &out_s,
    ]);
    assert!(!bad.status.success());
    let e = stderr(&bad);
    assert!(
        e.contains("train.jsonl, line 2") && e.contains("`prompt`"),
        "{e}"
    );
}

const TWO: &str = "{\"text\": \"The lazy fox trains a frozen model.\"}\n\
     {\"prompt\": \"The quick brown\", \"completion\": \" fox within the memory it has\"}\n\
     {\"text\": \"piece by piece, the lazy fox\"}\n";

/// metrics.jsonl's lines, parsed.
fn metrics(out: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

fn checkpoints(out: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(out)
        .expect("read_dir")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("checkpoint-step"))
        .collect();
    names.sort();
    names
}

fn ok(output: &Output) -> String {
    let log = stderr(output);
    assert!(output.status.success(), "{log}");
    log
}

#[test]
fn batches_checkpoints_metrics_and_resume_with_overrides() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("train.jsonl");
    std::fs::write(&data, TWO).expect("write");
    let out = tmp.path().join("run");
    let (data_s, out_s, model) = (
        data.display().to_string(),
        out.display().to_string(),
        llama(),
    );
    let log = ok(&run(&[
        "lora-llm",
        "--model",
        &model,
        "--data",
        &data_s,
        "--output",
        &out_s,
        "--r",
        "4",
        "--target",
        "q_proj,v_proj",
        "--epochs",
        "20",
        "--lr",
        "1e-2",
        "--batch-size",
        "2",
        "--accumulate",
        "1",
        "--dropout",
        "0.1",
        "--save-steps",
        "2",
        "--max-steps",
        "4",
    ]));
    assert_eq!(losses(&log).len(), 4, "{log}");
    let lines = metrics(&out);
    assert_eq!(lines.len(), 4);
    for (i, line) in lines.iter().enumerate() {
        assert_eq!(line["step"], i + 1);
        for key in ["epoch", "loss", "lr", "tokens", "tokens_per_s", "elapsed_s"] {
            assert!(line[key].is_number(), "{key} in {line}");
        }
    }
    assert_eq!(lines[0]["examples"], 2, "a micro-batch of 2");
    assert_eq!(lines[1]["examples"], 1, "the epoch's last example");
    assert_eq!(lines[1]["epoch"], 1);
    assert_eq!(lines[2]["epoch"], 2);
    assert_eq!(
        checkpoints(&out),
        ["checkpoint-step0000000002", "checkpoint-step0000000004"]
    );
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("run.json")).expect("run.json"))
            .expect("JSON");
    assert_eq!(record["settings"]["batch_size"], 2);
    assert_eq!(record["settings"]["save_steps"], 2);
    assert!(out.join("adapter_model.safetensors").is_file());

    // Resume with one more allowed change: the run goes on from step 4.
    let log = ok(&run(&["lora-llm", "--resume", &out_s, "--max-steps", "6"]));
    assert!(log.contains("max_steps changed on resume: 4 -> 6"), "{log}");
    assert!(log.contains("resuming from"), "{log}");
    assert!(
        log.contains("step 5/6") && !log.contains("step 4/"),
        "{log}"
    );
    let steps: Vec<_> = metrics(&out).iter().map(|l| l["step"].clone()).collect();
    assert_eq!(steps, [1, 2, 3, 4, 5, 6]);
    assert_eq!(
        checkpoints(&out),
        ["checkpoint-step0000000004", "checkpoint-step0000000006"]
    );

    // Refusals name what is wrong.
    let refused = run(&["lora-llm", "--resume", &out_s, "--batch-size", "1"]);
    assert!(!refused.status.success());
    let e = stderr(&refused);
    assert!(
        e.contains("`batch_size` is 2") && e.contains("cannot change"),
        "{e}"
    );
    let again = run(&[
        "lora-llm", "--model", &model, "--data", &data_s, "--output", &out_s,
    ]);
    assert!(!again.status.success());
    assert!(stderr(&again).contains("--resume"), "{}", stderr(&again));
    let nothing = tmp.path().join("nothing");
    std::fs::create_dir_all(&nothing).expect("mkdir");
    let none = run(&["lora-llm", "--resume", &nothing.display().to_string()]);
    assert!(!none.status.success());
    assert!(
        stderr(&none).contains("not a fine-tuning run directory"),
        "{}",
        stderr(&none)
    );
    std::fs::write(&data, format!("{TWO}{{\"text\": \"more\"}}\n")).expect("write");
    let other = run(&["lora-llm", "--resume", &out_s]);
    assert!(!other.status.success());
    assert!(
        stderr(&other).contains("the data file"),
        "{}",
        stderr(&other)
    );
}

/// Runs `line` (a printed command, after `cargo xtask `) in `sh`, with the
/// xtask binary in the place of `cargo xtask`, as a user pasting it would.
fn run_in_shell(line: &str) -> Output {
    std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("exec \"$0\" {line}"))
        .arg(env!("CARGO_BIN_EXE_xtask"))
        .current_dir(repo_root())
        .output()
        .expect("sh")
}

#[test]
fn sigterm_checkpoints_and_the_printed_command_resumes_to_the_same_adapters() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("train.jsonl");
    std::fs::write(&data, TWO).expect("write");
    let (data_s, model) = (data.display().to_string(), llama());
    let args = |out: &Path| -> Vec<String> {
        [
            "lora-llm",
            "--model",
            &model,
            "--data",
            &data_s,
            "--output",
            &out.display().to_string(),
            "--r",
            "4",
            "--epochs",
            "400",
            "--lr",
            "1e-3",
            "--batch-size",
            "2",
            "--accumulate",
            "1",
            "--dropout",
            "0.1",
            "--warmup-steps",
            "10",
            "--save-steps",
            "100000",
        ]
        .map(String::from)
        .to_vec()
    };
    let straight = tmp.path().join("straight");
    let list = args(&straight);
    ok(&run(&list.iter().map(String::as_str).collect::<Vec<_>>()));

    // Everything a shell would otherwise take apart or expand.
    let stopped = tmp.path().join("it's a $HOME run");
    let list = args(&stopped);
    let (output, log) = sigterm_after(
        &list.iter().map(String::as_str).collect::<Vec<_>>(),
        "step 3/",
    );
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert_eq!(output.status.code(), Some(143), "SIGTERM exits 143: {log}");
    assert!(log.contains("SIGTERM: stopping after this step"), "{log}");
    let command = stdout
        .lines()
        .find_map(|l| l.split_once("continue with: cargo xtask ").map(|(_, c)| c))
        .unwrap_or_else(|| panic!("no continue command in {stdout}"));
    assert!(
        command.starts_with("lora-llm --resume '"),
        "quoted: {command}"
    );
    let saved = checkpoints(&stopped);
    assert_eq!(saved.len(), 1, "the stop's checkpoint: {saved:?}");
    assert!(!stopped.join("adapter_model.safetensors").exists());

    let resumed = run_in_shell(command);
    let log = ok(&resumed);
    assert!(log.contains("resuming from"), "{log}");
    for file in ["adapter_model.safetensors", "adapter_config.json"] {
        let (a, b) = (
            std::fs::read(straight.join(file)).expect("straight"),
            std::fs::read(stopped.join(file)).expect("resumed"),
        );
        assert!(a == b, "{file} differs from the uninterrupted run's");
    }
    let losses = |out: &Path| -> Vec<String> {
        metrics(out)
            .iter()
            .map(|l| format!("{} {}", l["step"], l["loss"]))
            .collect()
    };
    assert_eq!(losses(&straight), losses(&stopped));
}

/// Before the first step: a fine-tune that cannot fit `--memory-limit` is
/// refused with each part of its memory named, and nothing is written; one
/// that fits logs the same parts and trains.
#[test]
fn a_fine_tune_that_cannot_fit_is_refused_before_its_first_step() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("train.jsonl");
    std::fs::write(
        &data,
        "{\"text\": \"The lazy fox trains a frozen model.\"}\n",
    )
    .expect("write");
    let out = tmp.path().join("run");
    let (data_s, out_s, model) = (
        data.display().to_string(),
        out.display().to_string(),
        llama(),
    );
    let args = |limit: &'static str| {
        vec![
            "lora-llm".to_string(),
            "--model".into(),
            model.clone(),
            "--data".into(),
            data_s.clone(),
            "--output".into(),
            out_s.clone(),
            "--r".into(),
            "4".into(),
            "--max-steps".into(),
            "1".into(),
            "--accumulate".into(),
            "1".into(),
            "--memory-limit".into(),
            limit.into(),
        ]
    };
    let refused = xtask(&args("1MiB").iter().map(String::as_str).collect::<Vec<_>>())
        .output()
        .expect("run");
    let err = stderr(&refused);
    assert!(!refused.status.success(), "{err}");
    for part in [
        "does not fit in 1.0 MiB (--memory-limit)",
        "weights",
        "adapters with their gradients and AdamW moments",
        "one pass of 1 ×",
        "lower --max-seq-length",
    ] {
        assert!(err.contains(part), "missing {part:?}: {err}");
    }
    assert!(!out.exists(), "a refused run wrote {}", out.display());
    let fits = xtask(&args("1GiB").iter().map(String::as_str).collect::<Vec<_>>())
        .output()
        .expect("run");
    let err = stderr(&fits);
    assert!(fits.status.success(), "{err}");
    assert!(err.contains("memory: weights"), "{err}");
    assert!(out.join("adapter_model.safetensors").is_file());
}
