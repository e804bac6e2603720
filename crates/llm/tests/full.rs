//! Full fine-tuning gradients (`Model::full_gradients`) against
//! transformers' on the three fixtures: `<fixture>/full_reference.safetensors`
//! (make_fixtures.py's `full_reference`) holds the loss on
//! reference.safetensors' batch and every parameter's gradient in f32 by
//! checkpoint name (a tied head's under the embedding's name).
//!
//! Tolerance: the loss within 1e-5 (as tests/fixtures.rs), every gradient
//! within 5e-6 absolute. Both sides are f32 and differ only in the order of
//! sums (the gemm crate's blocking against torch's, the chunked head, the
//! scatter-add of the embedding) and the last bit of exp/tanh. On gradients
//! up to about 0.7 (the embeddings' are the largest) the largest
//! differences seen were 6.6e-7 (llama, `model.embed_tokens.weight`),
//! 7.7e-7 (qwen2) and 2.1e-7 (gpt2), so 5e-6 leaves a margin of six for
//! other CPUs' summation orders; a wrong term (a missed residual, RoPE's
//! transpose, the norm's second term, the tied head's share, a transposed
//! Conv1D) moves some gradient by 1e-3 or more (leaving out the tied
//! head's share puts gpt2's `transformer.wte.weight` 0.33 off).

mod common;

use std::collections::BTreeSet;

use common::*;
use headroom_llm::weights::WeightStore;
use headroom_llm::{LlmError, Model};

const GRAD_TOL: f32 = 5e-6;

fn batch_of(name: &str) -> (Vec<Vec<u32>>, Vec<Vec<i64>>) {
    let reference = Reference::load(name);
    (
        as_ids(&reference.rows("input_ids")),
        reference.rows("labels"),
    )
}

/// Our loss and every gradient against transformers' on `name`'s fixture;
/// returns the largest difference seen.
fn check_against_transformers(name: &str) -> f32 {
    let model = Model::load(&fixture(name)).expect("loads");
    let (batch, labels) = batch_of(name);
    let (loss, grads) = model.full_gradients(&batch, &labels).expect("gradients");
    let full = Reference::from_file(name, "full_reference.safetensors");
    let (_, expected_loss) = full.f32s("loss");
    assert!(
        (loss - expected_loss[0]).abs() < 1e-5,
        "{name}: loss {loss} vs transformers' {}",
        expected_loss[0]
    );
    let theirs: BTreeSet<String> = full.names().into_iter().filter(|n| n != "loss").collect();
    let ours: BTreeSet<String> = grads.keys().cloned().collect();
    assert_eq!(ours, theirs, "{name}: the gradients' names");
    let names: BTreeSet<String> = model.weight_names().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, theirs, "{name}: weight_names");
    let mut worst = 0.0f32;
    for (key, g) in &grads {
        let (shape, expected) = full.f32s(key);
        assert_eq!(g.shape, shape, "{name}: {key}'s shape");
        assert_eq!(g.data.len(), expected.len(), "{name}: {key}");
        let diff = g
            .data
            .iter()
            .zip(&expected)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        let largest = expected.iter().map(|v| v.abs()).fold(0.0, f32::max);
        println!("{name}: {key}: max |diff| {diff:e} (largest |grad| {largest:.3})");
        assert!(largest > 0.0, "{name}: {key}'s reference gradient is zero");
        assert!(diff < GRAD_TOL, "{name}: {key} differs by {diff}");
        worst = worst.max(diff);
    }
    println!(
        "{name}: loss {loss} (transformers {}), worst {worst:e}",
        expected_loss[0]
    );
    worst
}

#[test]
fn llama_gradients_match_transformers() {
    check_against_transformers("llama");
}

#[test]
fn qwen2_gradients_match_transformers() {
    check_against_transformers("qwen2");
}

#[test]
fn gpt2_gradients_match_transformers() {
    check_against_transformers("gpt2");
}

/// One SGD step on every weight lowers the loss on the same batch, and the
/// pass's loss is the forward's.
#[test]
fn a_gradient_step_lowers_the_loss() {
    for name in MODELS {
        let mut model = Model::load(&fixture(name)).expect("loads");
        let (batch, labels) = batch_of(name);
        let before = model.loss(&batch, &labels).expect("loss");
        let (loss, grads) = model.full_gradients(&batch, &labels).expect("gradients");
        assert!((loss - before).abs() < 1e-5, "{name}: {loss} vs {before}");
        model.add_scaled(&grads, -0.05).expect("step");
        let after = model.loss(&batch, &labels).expect("loss");
        println!("{name}: loss {before} -> {after}");
        assert!(after < before - 0.05, "{name}: {before} -> {after}");
    }
}

/// `weight` reads each tensor as the checkpoint stores it (GPT-2's c_attn
/// fused again, Conv1D [in, out]); `add_to_weight` changes that tensor alone.
#[test]
fn weights_read_and_update_by_checkpoint_name() {
    for name in MODELS {
        let dir = fixture(name);
        let mut model = Model::load(&dir).expect("loads");
        let store = WeightStore::open(&dir).expect("opens");
        for (tensor, shape) in model.weight_names() {
            let stored = store.take(&tensor, &shape).expect("stored");
            let ours = model.weight(&tensor).expect("weight");
            assert_eq!(ours.shape, shape, "{name}: {tensor}");
            assert_eq!(ours.data, stored.data, "{name}: {tensor}");
        }
        let fused = if name == "gpt2" {
            "transformer.h.1.attn.c_attn.weight"
        } else {
            "model.layers.1.self_attn.k_proj.weight"
        };
        let before = model.weight(fused).expect("weight").data;
        let delta: Vec<f32> = (0..before.len()).map(|i| i as f32).collect();
        model.add_to_weight(fused, &delta).expect("update");
        let after = model.weight(fused).expect("weight").data;
        for (i, (a, b)) in after.iter().zip(&before).enumerate() {
            assert_eq!(*a, b + i as f32, "{name}: {fused}[{i}]");
        }
    }
}

#[test]
fn errors_name_the_problem() {
    let mut model = Model::load(&fixture("llama")).expect("loads");
    let message = |e: LlmError| e.to_string();
    let e = message(model.full_gradients(&[], &[]).expect_err("empty"));
    assert!(e.contains("non-empty rows"), "{e}");
    let e = message(
        model
            .full_gradients(&[vec![1, 2, 3]], &[vec![1, 2, 999]])
            .expect_err("label"),
    );
    assert!(e.contains("label 999"), "{e}");
    let e = message(
        model
            .full_gradients(&[vec![1, 2, 300]], &[vec![1, 2, 3]])
            .expect_err("id"),
    );
    assert!(e.contains("token id 300"), "{e}");
    let e = message(
        model
            .full_gradients(&[vec![1, 2]], &[vec![-100, -100]])
            .expect_err("nothing counted"),
    );
    assert!(e.contains("no label is counted"), "{e}");
    let e = message(
        model
            .weight("model.layers.9.mlp.up_proj.weight")
            .expect_err("name"),
    );
    assert!(
        e.contains("`model.layers.9.mlp.up_proj.weight` is not a weight"),
        "{e}"
    );
    let e = message(
        model
            .add_to_weight("model.norm.weight", &[1.0; 3])
            .expect_err("length"),
    );
    assert!(
        e.contains("model.norm.weight") && e.contains("3 values"),
        "{e}"
    );
    let e = message(model.weight("lm_head.bias").expect_err("no bias"));
    assert!(e.contains("lm_head.bias"), "{e}");
}
