//! `cargo xtask generate` end to end on the committed fixtures: greedy
//! output is transformers' recorded continuation, sampling is seeded, and a
//! bad model directory's error names the file.

// Not every helper is used here.
#[allow(dead_code, unused_imports)]
mod common;

use common::*;

fn fixture(name: &str) -> String {
    repo_root()
        .join("crates/llm/fixtures")
        .join(name)
        .display()
        .to_string()
}

fn stdout(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn greedy_prints_the_recorded_continuation() {
    let model = fixture("llama");
    let out = run(&[
        "generate",
        "--model",
        &model,
        "--prompt",
        "The quick brown",
        "--max-new-tokens",
        "8",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    // The decoded text of transformers' greedy ids (fixtures/llama's
    // reference.safetensors, generated_ids), checked against the library.
    let tokenizer = headroom_llm::Tokenizer::load(std::path::Path::new(&model)).expect("tokenizer");
    let text = tokenizer
        .decode(&[247, 45, 206, 271, 135, 271, 135, 91])
        .expect("decode");
    assert_eq!(stdout(&out).trim_end_matches('\n'), text);
}

#[test]
fn sampling_is_seeded() {
    let model = fixture("gpt2");
    let sample = |seed: &str| {
        let out = run(&[
            "generate",
            "--model",
            &model,
            "--prompt",
            "The lazy",
            "--max-new-tokens",
            "12",
            "--temperature",
            "1.0",
            "--top-p",
            "0.95",
            "--seed",
            seed,
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
    };
    assert_eq!(sample("7"), sample("7"));
    assert!(!sample("7").trim().is_empty());
}

#[test]
fn a_bad_model_directory_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"architectures": ["BertForMaskedLM"]}"#,
    )
    .expect("write");
    let path = dir.path().display().to_string();
    let out = run(&["generate", "--model", &path, "--prompt", "hi"]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("config.json") && err.contains("BertForMaskedLM"),
        "{err}"
    );
    assert!(err.contains("LlamaForCausalLM"), "{err}");

    let out = run(&[
        "generate",
        "--model",
        "/nonexistent/model",
        "--prompt",
        "hi",
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("/nonexistent/model/config.json"), "{err}");
}
