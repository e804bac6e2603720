//! `cargo xtask lora-llm` end to end on the llama fixture: a few steps write
//! peft's adapter files, the loss goes down in the log, `generate
//! --adapters` uses them, and a bad JSONL line is named.

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
