//! Bad model directories: each corrupted copy of a fixture (written to a
//! temporary directory) fails to load with a message that names the file
//! and the key or tensor at fault.

mod common;

use std::path::Path;

use common::*;
use headroom_llm::{Model, Tokenizer};
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;

fn load_error(dir: &Path) -> String {
    match Model::load(dir) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn assert_names(message: &str, parts: &[&str]) {
    for part in parts {
        assert!(message.contains(part), "`{part}` not in: {message}");
    }
}

/// Rewrites `file` in `dir` with `edit` applied to its (name, shape) list:
/// None drops the tensor, Some(shape) gives it that shape (same bytes).
fn rewrite(dir: &Path, file: &str, edit: impl Fn(&str, &[usize]) -> Option<Vec<usize>>) {
    let path = dir.join(file);
    let bytes = std::fs::read(&path).expect("read");
    let st = SafeTensors::deserialize(&bytes).expect("parse");
    let mut kept = Vec::new();
    for (name, view) in st.tensors() {
        if let Some(shape) = edit(&name, view.shape()) {
            let view = TensorView::new(view.dtype(), shape, view.data()).expect("view");
            kept.push((name, view));
        }
    }
    let out = safetensors::serialize(kept, None).expect("serialize");
    std::fs::write(&path, out).expect("write");
}

fn edit_config(dir: &Path, edit: impl Fn(&mut serde_json::Map<String, serde_json::Value>)) {
    let path = dir.join("config.json");
    let mut value: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    edit(value.as_object_mut().expect("object"));
    std::fs::write(&path, value.to_string()).expect("write");
}

#[test]
fn unknown_architecture_lists_the_supported_ones() {
    let dir = copy_fixture("llama");
    edit_config(dir.path(), |c| {
        c.insert(
            "architectures".into(),
            serde_json::json!(["BertForMaskedLM"]),
        );
    });
    let message = load_error(dir.path());
    assert_names(
        &message,
        &[
            "config.json",
            "BertForMaskedLM",
            "LlamaForCausalLM",
            "Qwen2ForCausalLM",
            "GPT2LMHeadModel",
        ],
    );
}

#[test]
fn config_key_missing_or_of_the_wrong_type_is_named() {
    let dir = copy_fixture("llama");
    edit_config(dir.path(), |c| {
        c.remove("hidden_size");
    });
    assert_names(
        &load_error(dir.path()),
        &["config.json", "hidden_size", "missing"],
    );

    let dir = copy_fixture("gpt2");
    edit_config(dir.path(), |c| {
        c.insert("n_head".into(), serde_json::json!("four"));
    });
    assert_names(
        &load_error(dir.path()),
        &["config.json", "n_head", "wrong type"],
    );

    let dir = copy_fixture("llama");
    edit_config(dir.path(), |c| {
        c.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_type": "yarn", "factor": 4.0}),
        );
    });
    assert_names(&load_error(dir.path()), &["config.json", "yarn"]);
}

#[test]
fn missing_tensor_is_named() {
    let dir = copy_fixture("llama");
    let gone = "model.layers.1.mlp.up_proj.weight";
    rewrite(dir.path(), "model.safetensors", |name, shape| {
        (name != gone).then(|| shape.to_vec())
    });
    assert_names(
        &load_error(dir.path()),
        &["model.safetensors", gone, "missing"],
    );
}

#[test]
fn wrong_shape_says_expected_and_found() {
    let dir = copy_fixture("qwen2");
    let bent = "model.layers.0.self_attn.k_proj.weight";
    rewrite(dir.path(), "model.safetensors", |name, shape| {
        Some(if name == bent {
            shape.iter().rev().copied().collect()
        } else {
            shape.to_vec()
        })
    });
    assert_names(
        &load_error(dir.path()),
        &[
            "model.safetensors",
            bent,
            "expected [16, 32]",
            "shape [32, 16]",
        ],
    );
}

#[test]
fn truncated_safetensors_is_named() {
    let dir = copy_fixture("llama");
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).expect("read");
    std::fs::write(&path, &bytes[..bytes.len() - 100]).expect("write");
    assert_names(&load_error(dir.path()), &["model.safetensors", "truncated"]);

    std::fs::write(&path, b"not a safetensors file").expect("write");
    assert_names(&load_error(dir.path()), &["model.safetensors", "corrupt"]);
}

#[test]
fn index_naming_a_missing_shard_is_named() {
    let dir = copy_fixture("gpt2");
    let shard = "model-00003-of-00005.safetensors";
    std::fs::remove_file(dir.path().join(shard)).expect("remove");
    assert_names(
        &load_error(dir.path()),
        &["model.safetensors.index.json", shard, "does not exist"],
    );
}

#[test]
fn a_directory_without_weights_is_named() {
    let dir = copy_fixture("gpt2");
    std::fs::remove_file(dir.path().join("model.safetensors.index.json")).expect("remove");
    assert_names(
        &load_error(dir.path()),
        &["model.safetensors", "index.json"],
    );
}

#[test]
fn a_tokenizer_that_does_not_load_is_named() {
    let dir = copy_fixture("gpt2");
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, "{ not json").expect("write");
    let message = match Tokenizer::load(dir.path()) {
        Ok(_) => panic!("a broken tokenizer.json loaded"),
        Err(e) => e.to_string(),
    };
    assert_names(&message, &["tokenizer.json", "does not load"]);

    std::fs::remove_file(&path).expect("remove");
    assert!(Tokenizer::load(dir.path()).is_err_and(|e| e.to_string().contains("no such file")));
}

#[test]
fn bad_token_ids_and_ragged_batches_are_refused() {
    let model = Model::load(&fixture("gpt2")).expect("loads");
    let err = model
        .logits(&[vec![1, 2, 100_000]])
        .expect_err("out of vocabulary");
    assert!(err.to_string().contains("100000"), "{err}");
    let err = model.logits(&[vec![1, 2], vec![3]]).expect_err("ragged");
    assert!(err.to_string().contains("same length"), "{err}");
    // GPT-2's 64 learned positions are all it has.
    let err = model.logits(&[vec![1; 65]]).expect_err("too long");
    assert!(err.to_string().contains("n_positions"), "{err}");
}
