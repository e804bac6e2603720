//! The committed transformers fixtures (fixtures/make_fixtures.py): the
//! tokenizer's ids, the logits, the loss and the greedy continuation of each
//! tiny model equal what transformers recorded.
//!
//! Logits tolerance: 2e-5 absolute on logits of standard deviation about
//! 1.1. Both sides compute in f32; they differ only in the order of each
//! sum (≤ 64 terms per product, the matrix kernels block differently) and
//! in the last bit of exp/tanh/sin/cos, a few f32 ulps (~1e-7 relative) per
//! operation through two blocks. A wrong formula (a missed bias, RoPE's
//! pairing, an eps) moves logits by 1e-3 or more.

mod common;

use common::*;
use headroom_llm::{causal_lm_loss, KvCache, Model, Sampling, Tokenizer, Want};

const LOGITS_TOL: f32 = 2e-5;
const LOSS_TOL: f32 = 1e-5;

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn tokenizer_ids_match_transformers() {
    for name in MODELS {
        let reference = Reference::load(name);
        let tokenizer = Tokenizer::load(&fixture(name)).expect("tokenizer loads");
        let ids = tokenizer.encode(TEXT).expect("encode");
        let rows = reference.rows("input_ids");
        let t = rows[0].len();
        let recorded: Vec<u32> = as_ids(&rows).concat();
        assert_eq!(&ids[..2 * t], &recorded[..], "{name}: ids of the text");
        let (_, prompt) = reference.i64s("prompt_ids");
        let prompt: Vec<u32> = prompt.iter().map(|&v| v as u32).collect();
        assert_eq!(
            tokenizer.encode(PROMPT).expect("encode"),
            prompt,
            "{name}: prompt ids"
        );
        assert_eq!(
            tokenizer.decode(&prompt).expect("decode"),
            PROMPT,
            "{name}: round trip"
        );
    }
}

#[test]
fn logits_and_loss_match_transformers() {
    for name in MODELS {
        let reference = Reference::load(name);
        let model = Model::load(&fixture(name)).expect("model loads");
        let batch = as_ids(&reference.rows("input_ids"));
        let (shape, expected) = reference.f32s("logits");
        assert_eq!(
            shape,
            [batch.len(), batch[0].len(), model.config.vocab_size]
        );
        let logits = model.logits(&batch).expect("forward");
        let diff = max_abs_diff(&logits, &expected);
        println!("{name}: max |logit diff| = {diff:e}");
        assert!(diff < LOGITS_TOL, "{name}: logits differ by {diff}");

        let labels = reference.rows("labels");
        let (_, loss) = reference.f32s("loss");
        let ours = model.loss(&batch, &labels).expect("loss");
        println!("{name}: loss {ours} vs transformers {}", loss[0]);
        assert!(
            (ours - loss[0]).abs() < LOSS_TOL,
            "{name}: loss {ours} vs {}",
            loss[0]
        );
        // The -100 labels matter: counting them would change the loss.
        let unmasked =
            causal_lm_loss(&logits, &as_i64(&batch), model.config.vocab_size).expect("loss");
        assert!(
            (unmasked - loss[0]).abs() > 1e-4,
            "{name}: -100 labels had no effect"
        );
    }
}

fn as_i64(batch: &[Vec<u32>]) -> Vec<Vec<i64>> {
    batch
        .iter()
        .map(|r| r.iter().map(|&v| v as i64).collect())
        .collect()
}

#[test]
fn greedy_generation_matches_transformers() {
    for name in MODELS {
        let reference = Reference::load(name);
        let model = Model::load(&fixture(name)).expect("model loads");
        let (_, prompt) = reference.i64s("prompt_ids");
        let prompt: Vec<u32> = prompt.iter().map(|&v| v as u32).collect();
        let (_, expected) = reference.i64s("generated_ids");
        let expected: Vec<u32> = expected.iter().map(|&v| v as u32).collect();
        let ours = model
            .generate(&prompt, expected.len(), Sampling::Greedy)
            .expect("generate");
        assert_eq!(ours, expected, "{name}: greedy continuation");
    }
}

#[test]
fn kv_cache_steps_equal_the_full_pass() {
    for name in MODELS {
        let reference = Reference::load(name);
        let model = Model::load(&fixture(name)).expect("model loads");
        let batch = as_ids(&reference.rows("input_ids"));
        let full = model.logits(&batch).expect("forward");
        let (b, t, v) = (batch.len(), batch[0].len(), model.config.vocab_size);
        let mut cache = KvCache::new(&model, b);
        // A prefix of 5 at once, then one token at a time.
        let prefix: Vec<Vec<u32>> = batch.iter().map(|r| r[..5].to_vec()).collect();
        let mut stepped = vec![Vec::new(); b];
        let first = model
            .forward(&prefix, &mut cache, Want::All)
            .expect("prefix");
        for r in 0..b {
            stepped[r].extend_from_slice(&first[r * 5 * v..(r + 1) * 5 * v]);
        }
        for i in 5..t {
            let step: Vec<Vec<u32>> = batch.iter().map(|r| vec![r[i]]).collect();
            let out = model.forward(&step, &mut cache, Want::Last).expect("step");
            for r in 0..b {
                stepped[r].extend_from_slice(&out[r * v..(r + 1) * v]);
            }
        }
        assert_eq!(cache.len(), t);
        let diff = max_abs_diff(&stepped.concat(), &full);
        assert!(diff < 1e-5, "{name}: cached steps differ by {diff}");
    }
}

#[test]
fn top_p_sampling_is_seeded_and_stays_in_the_nucleus() {
    let model = Model::load(&fixture("llama")).expect("model loads");
    let prompt = [5u32, 6, 7];
    let sample = |seed, top_p| {
        model
            .generate(
                &prompt,
                6,
                Sampling::TopP {
                    temperature: 0.8,
                    top_p,
                    seed,
                },
            )
            .expect("generate")
    };
    assert_eq!(sample(1, 0.9), sample(1, 0.9), "same seed, same tokens");
    let draws: Vec<_> = (0..8).map(|s| sample(s, 0.9)).collect();
    assert!(
        draws.iter().any(|d| d != &draws[0]),
        "seeds change the draw"
    );
    // A nucleus this small holds only the most likely token: greedy.
    let greedy = model
        .generate(&prompt, 6, Sampling::Greedy)
        .expect("greedy");
    assert_eq!(sample(3, 1e-6), greedy);
    let bad = model.generate(
        &prompt,
        2,
        Sampling::TopP {
            temperature: 0.0,
            top_p: 0.9,
            seed: 0,
        },
    );
    assert!(bad.is_err_and(|e| e.to_string().contains("temperature")));
}

/// Hub checkpoints written by transformers 4 spell RoPE as top-level
/// `rope_theta` + `rope_scaling` (older ones with `type`); the fixtures
/// were written by transformers 5 (`rope_parameters`). Both must give the
/// recorded logits.
#[test]
fn transformers_4_rope_keys_give_the_same_logits() {
    for (name, scaling) in [
        (
            "llama",
            serde_json::json!({"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        ),
        ("qwen2", serde_json::Value::Null),
    ] {
        let dir = copy_fixture(name);
        let path = dir.path().join("config.json");
        let text = std::fs::read_to_string(&path).expect("read");
        let mut config: serde_json::Value = serde_json::from_str(&text).expect("json");
        let map = config.as_object_mut().expect("object");
        let params = map
            .remove("rope_parameters")
            .expect("a transformers 5 config");
        map.insert("rope_theta".into(), params["rope_theta"].clone());
        map.insert("rope_scaling".into(), scaling);
        std::fs::write(&path, config.to_string()).expect("write");

        let reference = Reference::load(name);
        let model = Model::load(dir.path()).expect("model loads");
        let batch = as_ids(&reference.rows("input_ids"));
        let (_, expected) = reference.f32s("logits");
        let diff = max_abs_diff(&model.logits(&batch).expect("forward"), &expected);
        assert!(diff < LOGITS_TOL, "{name}: logits differ by {diff}");
    }
}
