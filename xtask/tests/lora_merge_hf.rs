//! `cargo xtask lora-merge --model DIR --adapters A --output OUT` end to end
//! on the llama fixture and peft's own adapters: the new directory loads to
//! peft's logits, `generate` on it continues as `generate --adapters` does,
//! what was merged is printed, and a second run to the same output, a
//! missing --output and --base with --model are refused.

// Not every helper is used here.
#[allow(dead_code, unused_imports)]
mod common;

use common::*;
use safetensors::SafeTensors;

fn fixture(rest: &str) -> String {
    repo_root()
        .join("crates/llm/fixtures")
        .join(rest)
        .display()
        .to_string()
}

#[test]
fn merges_peft_adapters_into_a_model_directory() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("merged");
    let out_s = out.display().to_string();
    let (model, adapters) = (fixture("llama"), fixture("llama/peft_adapter"));
    let result = run(&[
        "lora-merge",
        "--model",
        &model,
        "--adapters",
        &adapters,
        "--output",
        &out_s,
    ]);
    let stdout = String::from_utf8_lossy(&result.stdout).into_owned();
    assert!(result.status.success(), "{}", stderr(&result));
    assert!(
        stdout.contains("merged 6 LoRA modules (r 4, scale 2)")
            && stdout.contains("model.layers.1.self_attn.v_proj.weight F32 (model.safetensors)")
            && stdout.contains("1 weight file(s), 153304 bytes")
            && stdout.contains("config.json, generation_config.json, tokenizer.json"),
        "{stdout}"
    );

    let merged = headroom_llm::Model::load(&out).expect("the output loads");
    let reference = std::fs::read(fixture("llama/reference.safetensors")).expect("read");
    let reference = SafeTensors::deserialize(&reference).expect("parses");
    let ids = reference.tensor("input_ids").expect("ids");
    let width = ids.shape()[1];
    let batch: Vec<Vec<u32>> = ids
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")) as u32)
        .collect::<Vec<_>>()
        .chunks(width)
        .map(<[u32]>::to_vec)
        .collect();
    let logits = merged.logits(&batch).expect("logits");
    let peft = std::fs::read(fixture("llama/peft_adapter_logits.safetensors")).expect("read");
    let peft = SafeTensors::deserialize(&peft).expect("parses");
    let expected: Vec<f32> = peft
        .tensor("logits")
        .expect("logits")
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    let diff = logits
        .iter()
        .zip(&expected)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert_eq!(logits.len(), expected.len());
    assert!(diff < 2e-5, "{diff}");

    let gen = |args: &[&str]| {
        let mut all = vec![
            "generate",
            "--prompt",
            "The quick brown",
            "--max-new-tokens",
            "6",
        ];
        all.extend_from_slice(args);
        let r = run(&all);
        assert!(r.status.success(), "{}", stderr(&r));
        String::from_utf8_lossy(&r.stdout).into_owned()
    };
    assert_eq!(
        gen(&["--model", &out_s]),
        gen(&["--model", &model, "--adapters", &adapters])
    );

    let again = run(&[
        "lora-merge",
        "--model",
        &model,
        "--adapters",
        &adapters,
        "--output",
        &out_s,
    ]);
    assert!(!again.status.success());
    let e = stderr(&again);
    assert!(e.contains("not empty") && e.contains("merged"), "{e}");

    let no_output = run(&["lora-merge", "--model", &model, "--adapters", &adapters]);
    assert!(!no_output.status.success());
    assert!(
        stderr(&no_output).contains("--output"),
        "{}",
        stderr(&no_output)
    );
    let both = run(&[
        "lora-merge",
        "--model",
        &model,
        "--base",
        &model,
        "--adapters",
        &adapters,
        "--output",
        &out_s,
    ]);
    assert!(!both.status.success());
    assert!(stderr(&both).contains("--base"), "{}", stderr(&both));
}
