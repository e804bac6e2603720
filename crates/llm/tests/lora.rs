//! LoRA adapters' gradients against peft's on the llama fixture
//! (fixtures/llama/lora_reference.safetensors: r 4, alpha 8 on q/v/o/down,
//! random B) and the gpt2 fixture (fixtures/gpt2/lora_reference.safetensors:
//! r 4, alpha 8 on c_attn, c_proj and c_fc, random B). Tolerance: 5e-6 absolute on gradients up to about 0.4 (the
//! largest difference seen was 4e-7): f32 on both sides with sums in other
//! orders; a wrong term in the backward (a missed residual, RoPE's
//! transpose, the norm's second term) moves them by 1e-3 or more.

mod common;

use common::*;
use headroom_llm::lora::{Adapter, Adapters};
use headroom_llm::Model;

const GRAD_TOL: f32 = 5e-6;

/// The adapters (and peft's gradients) recorded in `model`'s
/// lora_reference.safetensors, scale alpha 8 / r 4.
fn peft_adapters(model: &str) -> (Adapters, Reference) {
    let lora = Reference::from_file(model, "lora_reference.safetensors");
    let mut adapters = Adapters::new();
    for name in lora.names() {
        if let Some(key) = name.strip_suffix(".lora_A") {
            let (a_shape, a) = lora.f32s(&name);
            let (_, b) = lora.f32s(&format!("{key}.lora_B"));
            adapters.insert(
                key.to_string(),
                Adapter {
                    a,
                    b,
                    r: a_shape[0],
                    scale: 8.0 / 4.0,
                },
            );
        }
    }
    (adapters, lora)
}

/// Our loss and adapter gradients against peft's on `model`'s fixture.
fn check_against_peft(model_name: &str, adapters_expected: usize) {
    let model = Model::load(&fixture(model_name)).expect("loads");
    let (adapters, lora) = peft_adapters(model_name);
    let reference = Reference::load(model_name);
    let batch = as_ids(&reference.rows("input_ids"));
    let labels = reference.rows("labels");
    assert_eq!(adapters.len(), adapters_expected);
    let (loss, grads) = model
        .lora_gradients(&adapters, &batch, &labels)
        .expect("gradients");
    let (_, expected_loss) = lora.f32s("loss");
    assert!(
        (loss - expected_loss[0]).abs() < 1e-5,
        "loss {loss} vs peft {}",
        expected_loss[0]
    );
    assert_eq!(grads.len(), adapters.len());
    for (key, (da, db)) in &grads {
        for (ours, name) in [(da, "grad_A"), (db, "grad_B")] {
            let (_, expected) = lora.f32s(&format!("{key}.{name}"));
            assert_eq!(ours.len(), expected.len(), "{key}.{name}");
            let diff = ours
                .iter()
                .zip(&expected)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            println!("{key}.{name}: max |diff| {diff:e}");
            assert!(diff < GRAD_TOL, "{key}.{name} differs by {diff}");
        }
    }
}

#[test]
fn adapter_gradients_match_peft() {
    // q, v, o, down in each of 2 layers.
    check_against_peft("llama", 2 * 4);
}

/// GPT-2: c_attn (the fused q|k|v, one adapter with B [3·hidden, r]), the
/// attention's and the MLP's c_proj, and c_fc, in each of 2 layers
/// (fixtures/gpt2/lora_reference.safetensors, peft with fan_in_fan_out).
#[test]
fn gpt2_adapter_gradients_match_peft() {
    check_against_peft("gpt2", 2 * 4);
}

/// A batch of rows padded on the right (labels -100 on the padding) gives
/// each row's loss and gradients as if it ran alone: causal attention never
/// lets a real position see the padding that follows it.
#[test]
fn right_padding_changes_nothing_for_the_real_tokens() {
    for name in ["llama", "gpt2"] {
        let model = Model::load(&fixture(name)).expect("loads");
        let (adapters, _) = peft_adapters(name);
        let reference = Reference::load(name);
        let ids = as_ids(&reference.rows("input_ids"));
        let labels = reference.rows("labels");
        let short = 9;
        let alone_ids = vec![ids[0][..short].to_vec()];
        let alone_labels = vec![labels[0][..short].to_vec()];
        let (alone, alone_grads) = model
            .lora_gradients(&adapters, &alone_ids, &alone_labels)
            .expect("alone");
        let mut padded_ids = alone_ids[0].clone();
        padded_ids.resize(ids[0].len(), 0);
        let mut padded_labels = alone_labels[0].clone();
        padded_labels.resize(ids[0].len(), -100);
        let (padded, padded_grads) = model
            .lora_gradients(&adapters, &[padded_ids], &[padded_labels])
            .expect("padded");
        assert!((alone - padded).abs() < 1e-6, "{name}: {alone} vs {padded}");
        for (key, (da, db)) in &alone_grads {
            let (pa, pb) = &padded_grads[key];
            let diff = da
                .iter()
                .zip(pa)
                .chain(db.iter().zip(pb))
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(
                diff < 1e-6,
                "{name} {key}: padding moved a gradient by {diff}"
            );
        }
    }
}

#[test]
fn zero_b_adapters_leave_the_base_loss() {
    let model = Model::load(&fixture("llama")).expect("loads");
    let reference = Reference::load("llama");
    let batch = as_ids(&reference.rows("input_ids"));
    let labels = reference.rows("labels");
    let mut adapters = Adapters::new();
    adapters.insert(
        "layers.0.self_attn.q_proj".into(),
        Adapter {
            a: vec![0.1; 4 * 32],
            b: vec![0.0; 32 * 4],
            r: 4,
            scale: 2.0,
        },
    );
    let (loss, grads) = model
        .lora_gradients(&adapters, &batch, &labels)
        .expect("gradients");
    let (_, expected) = reference.f32s("loss");
    assert!(
        (loss - expected[0]).abs() < 1e-5,
        "{loss} vs {}",
        expected[0]
    );
    let (da, db) = &grads["layers.0.self_attn.q_proj"];
    assert!(da.iter().all(|&v| v == 0.0), "B = 0 gives dA = 0");
    assert!(db.iter().any(|&v| v != 0.0), "but dB is not zero");

    // Adapters by Hugging Face names: A drawn, B zero, scale alpha / r.
    let made = headroom_llm::lora::new_adapters(&model, 8, 16.0, &["q_proj", "down_proj"], 1)
        .expect("adapters");
    assert_eq!(made.len(), 4);
    let q = &made["layers.1.self_attn.q_proj"];
    assert_eq!((q.a.len(), q.b.len(), q.scale), (8 * 32, 32 * 8, 2.0));
    assert!(q.a.iter().any(|&v| v != 0.0) && q.b.iter().all(|&v| v == 0.0));
    let err = headroom_llm::lora::new_adapters(&model, 8, 16.0, &["c_attn"], 1)
        .expect_err("not a Llama module");
    assert!(
        err.to_string().contains("c_attn") && err.to_string().contains("q_proj"),
        "{err}"
    );

    // GPT-2's names: c_proj is two modules (the attention's and the MLP's).
    let gpt2 = Model::load(&fixture("gpt2")).expect("loads");
    let made = headroom_llm::lora::new_adapters(&gpt2, 4, 8.0, &["c_attn", "c_proj"], 1)
        .expect("gpt2 adapters");
    assert_eq!(made.len(), 2 * 3);
    assert_eq!(made["h.0.attn.c_attn"].b.len(), 96 * 4);
    assert_eq!(made["h.1.mlp.c_proj"].a.len(), 4 * 128);
    let err = headroom_llm::lora::new_adapters(&gpt2, 4, 8.0, &["q_proj"], 1)
        .expect_err("not a GPT-2 module");
    assert!(err.to_string().contains("c_attn"), "{err}");

    // An adapter that does not fit its module is refused by its key.
    let mut bad = made.clone();
    bad.get_mut("h.0.attn.c_attn").expect("c_attn").b.pop();
    let err = gpt2
        .lora_gradients(&bad, &batch, &labels)
        .expect_err("a short B");
    assert!(err.to_string().contains("h.0.attn.c_attn"), "{err}");
    let mut stray = Adapters::new();
    stray.insert(
        "layers.0.self_attn.q_proj".into(),
        made["h.0.attn.c_proj"].clone(),
    );
    let err = gpt2
        .lora_gradients(&stray, &batch, &labels)
        .expect_err("a Llama key on GPT-2");
    assert!(err.to_string().contains("names no module"), "{err}");
}

/// Dropout's gradients against central differences of the same masked loss
/// (the mask is fixed by the seed, so the loss is a smooth function of B):
/// f32 differences with step 1e-2 agree to about 1e-5 here (tolerance 1e-4
/// + 1%); a mask forgotten in the backward is off by far more.
#[test]
fn dropout_gradients_match_finite_differences() {
    use headroom_llm::lora::Dropout;
    let model = Model::load(&fixture("llama")).expect("loads");
    let reference = Reference::load("llama");
    let batch = as_ids(&reference.rows("input_ids"));
    let labels = reference.rows("labels");
    let mut adapters =
        headroom_llm::lora::new_adapters(&model, 4, 8.0, &["q_proj", "down_proj"], 2).expect("a");
    for (i, ad) in adapters.values_mut().enumerate() {
        for (j, b) in ad.b.iter_mut().enumerate() {
            *b = (((i * 31 + j * 7) % 13) as f32 - 6.0) * 0.03;
        }
    }
    let loss = |adapters: &headroom_llm::lora::Adapters| {
        let mut d = Dropout { p: 0.4, state: 11 };
        model
            .lora_gradients_with(adapters, &batch, &labels, Some(&mut d))
            .expect("loss")
    };
    let (base_loss, grads) = loss(&adapters);
    let (plain, _) = model
        .lora_gradients(&adapters, &batch, &labels)
        .expect("loss");
    assert_ne!(base_loss, plain, "dropout changes the loss");
    // layers.0 q_proj sits below every other adapter: its gradient passes
    // back through their masks.
    for key in ["layers.0.mlp.down_proj", "layers.0.self_attn.q_proj"] {
        let (da, db) = &grads[key];
        for (which, index) in [(0usize, 5usize), (1, 3), (1, 17)] {
            let h = 1e-2f32;
            let mut plus = adapters.clone();
            let mut minus = adapters.clone();
            let (p, m) = match which {
                0 => (
                    &mut plus.get_mut(key).expect("k").a,
                    &mut minus.get_mut(key).expect("k").a,
                ),
                _ => (
                    &mut plus.get_mut(key).expect("k").b,
                    &mut minus.get_mut(key).expect("k").b,
                ),
            };
            p[index] += h;
            m[index] -= h;
            let numeric = (loss(&plus).0 - loss(&minus).0) / (2.0 * h);
            let analytic = if which == 0 { da[index] } else { db[index] };
            println!("{key} {which} {index}: {analytic} vs {numeric}");
            assert!(
                (analytic - numeric).abs() < 1e-4 + 0.01 * analytic.abs(),
                "{key}[{which}][{index}]: {analytic} vs {numeric}"
            );
        }
    }
}

/// Keeping some or all blocks' activations instead of recomputing them
/// gives the same bits: the same products on the same inputs.
#[test]
fn kept_activations_give_the_recomputed_gradients_bit_for_bit() {
    use headroom_llm::lora::Dropout;
    for name in ["llama", "gpt2"] {
        let model = Model::load(&fixture(name)).expect("loads");
        let (adapters, _) = peft_adapters(name);
        let reference = Reference::load(name);
        let batch = as_ids(&reference.rows("input_ids"));
        let labels = reference.rows("labels");
        let run = |keep: usize| {
            let mut d = Dropout { p: 0.2, state: 5 };
            let (loss, grads) = model
                .lora_gradients_kept(&adapters, &batch, &labels, Some(&mut d), keep)
                .expect("gradients");
            (loss, grads, d.state)
        };
        let (loss, grads, state) = run(0);
        // A block's tape is 72 kB on llama and 93 kB on gpt2 here: 100 kB
        // keeps the first block only, the rest keeps both.
        for keep in [100_000, usize::MAX] {
            let (l, g, s) = run(keep);
            assert_eq!(l.to_bits(), loss.to_bits(), "{name} keep {keep}");
            assert_eq!(s, state, "{name}: the dropout stream ends where it did");
            for (key, (da, db)) in &grads {
                let (ka, kb) = &g[key];
                assert!(
                    da.iter()
                        .zip(ka)
                        .chain(db.iter().zip(kb))
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{name} {key} keep {keep}"
                );
            }
        }
    }
}

/// The gradients are the same bits on 1 thread and on 3: attention's tasks
/// and the loss's rows run on the threads and are added in a fixed order.
/// (The fixtures' products are below the size at which the gemm crate uses
/// threads itself; it splits rows and columns, never a sum.)
#[test]
fn gradients_do_not_depend_on_the_thread_count() {
    for name in ["llama", "gpt2"] {
        let model = Model::load(&fixture(name)).expect("loads");
        let (adapters, _) = peft_adapters(name);
        let reference = Reference::load(name);
        let batch = as_ids(&reference.rows("input_ids"));
        let labels = reference.rows("labels");
        let on = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("pool")
                .install(|| model.lora_gradients(&adapters, &batch, &labels))
                .expect("gradients")
        };
        let (loss1, grads1) = on(1);
        let (loss3, grads3) = on(3);
        assert_eq!(loss1.to_bits(), loss3.to_bits(), "{name}");
        for (key, (da, db)) in &grads1 {
            let (ea, eb) = &grads3[key];
            assert!(
                da.iter()
                    .zip(ea)
                    .chain(db.iter().zip(eb))
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name} {key}"
            );
        }
    }
}
