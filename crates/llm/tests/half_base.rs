//! The frozen base held in its checkpoint's dtype (bf16 here) against the
//! same base converted to f32 at load (`Model::convert_to_f32`, what the
//! loader did before): every result is the same bits, since bf16 converts
//! to f32 exactly and the products convert panels of the weight without
//! splitting any sum. On the qwen2 fixture (bf16, tied head; every matrix
//! fits one panel) and on a random Llama-family model whose head is large
//! enough to be split into panels (a vocabulary of 16,384 × hidden 320:
//! 5.2 M values, over the 4 M-value panel), on 1 and 3 threads.

mod common;

use std::collections::HashMap;

use common::*;
use headroom_llm::lora::{new_adapters, Adapters, Dropout};
use headroom_llm::{Model, Sampling, WeightDtype};

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Adapters on q, v and down with B drawn too (so every product is real).
fn adapters(model: &Model) -> Adapters {
    let mut adapters =
        new_adapters(model, 4, 8.0, &["q_proj", "v_proj", "down_proj"], 3).expect("adapters");
    let mut keys: Vec<String> = adapters.keys().cloned().collect();
    keys.sort();
    let mut state = 11u64;
    for key in keys {
        if let Some(ad) = adapters.get_mut(&key) {
            for b in ad.b.iter_mut() {
                let z = headroom_llm::math::splitmix64(&mut state);
                *b = ((z >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2;
            }
        }
    }
    adapters
}

/// Everything a model computes on `batch`, as bits: logits, loss, LoRA
/// gradients (with dropout), every weight's gradient, a greedy
/// continuation.
#[derive(Debug, PartialEq)]
struct Results {
    logits: Vec<u32>,
    loss: u32,
    lora_loss: u32,
    lora: Vec<(String, Vec<u32>, Vec<u32>)>,
    full_loss: u32,
    full: Vec<(String, Vec<u32>)>,
    continuation: Vec<u32>,
}

fn results(model: &Model, adapters: &Adapters, batch: &[Vec<u32>], labels: &[Vec<i64>]) -> Results {
    let logits = model.logits(batch).expect("logits");
    let loss = model.loss(batch, labels).expect("loss");
    let mut dropout = Dropout { p: 0.1, state: 5 };
    let (lora_loss, grads) = model
        .lora_gradients_with(adapters, batch, labels, Some(&mut dropout))
        .expect("lora gradients");
    let mut lora: Vec<_> = grads
        .into_iter()
        .map(|(k, (da, db))| (k, bits(&da), bits(&db)))
        .collect();
    lora.sort();
    let (full_loss, full) = model.full_gradients(batch, labels).expect("full gradients");
    let continuation = model
        .generate(&batch[0][..5], 6, Sampling::Greedy)
        .expect("generates");
    Results {
        logits: bits(&logits),
        loss: loss.to_bits(),
        lora_loss: lora_loss.to_bits(),
        lora,
        full_loss: full_loss.to_bits(),
        full: full.into_iter().map(|(k, g)| (k, bits(&g.data))).collect(),
        continuation,
    }
}

fn on_threads<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool")
        .install(f)
}

#[test]
fn qwen2_in_bf16_gives_the_bits_of_its_f32_conversion() {
    let dir = fixture("qwen2");
    let half = Model::load(&dir).expect("loads");
    assert!(
        half.matrices()
            .iter()
            .all(|w| w.dtype() == WeightDtype::Bf16),
        "qwen2's matrices stay bf16"
    );
    let mut f32 = Model::load(&dir).expect("loads");
    f32.convert_to_f32();
    assert!(f32.matrices().iter().all(|w| w.dtype() == WeightDtype::F32));
    // The matrices at 2 bytes instead of 4; the vectors the same.
    let matrices: usize = half.matrices().iter().map(|w| w.len()).sum();
    assert_eq!(
        f32.weight_bytes() - half.weight_bytes(),
        2 * matrices as u64,
        "the held size drops by 2 bytes a matrix value"
    );
    assert_eq!(f32.scratch_values(), 0, "an f32 model converts nothing");
    assert!(half.scratch_values() > 0);

    let reference = Reference::load("qwen2");
    let batch = as_ids(&reference.rows("input_ids"));
    let labels = reference.rows("labels");
    let ad = adapters(&half);
    let a = results(&half, &ad, &batch, &labels);
    let b = results(&f32, &ad, &batch, &labels);
    assert_eq!(a, b, "bf16 held as bf16 and as f32 differ");
}

#[test]
fn a_head_split_into_panels_gives_the_f32_bits_on_any_thread_count() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 320,
        "intermediate_size": 640,
        "num_attention_heads": 5,
        "num_key_value_heads": 1,
        "num_hidden_layers": 2,
        "vocab_size": 16384,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": false,
        "initializer_range": 0.05,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    });
    headroom_llm::shapes::write_random_config(tmp.path(), &config, 4).expect("writes");
    let half = Model::load(tmp.path()).expect("loads");
    let mut f32 = Model::load(tmp.path()).expect("loads");
    f32.convert_to_f32();
    let largest = half.matrices().iter().map(|w| w.len()).max().unwrap_or(0);
    assert!(
        half.scratch_values() < largest,
        "the head ({largest} values) is converted in panels ({} at most)",
        half.scratch_values()
    );

    // Two rows of 70 tokens (more than 64, where the gemm crate's blocking
    // is the large matrices'), labels with some positions not counted.
    let mut state = 3u64;
    let batch: Vec<Vec<u32>> = (0..2)
        .map(|_| {
            (0..70)
                .map(|_| (headroom_llm::math::splitmix64(&mut state) % 16384) as u32)
                .collect()
        })
        .collect();
    let labels: Vec<Vec<i64>> = batch
        .iter()
        .map(|row| {
            row.iter()
                .enumerate()
                .map(|(i, &id)| if i % 7 == 3 { -100 } else { id as i64 })
                .collect()
        })
        .collect();
    let ad = adapters(&half);
    let mut seen: HashMap<(usize, &str), Results> = HashMap::new();
    for threads in [1, 3] {
        for (name, model) in [("bf16", &half), ("f32", &f32)] {
            let r = on_threads(threads, || results(model, &ad, &batch, &labels));
            seen.insert((threads, name), r);
        }
    }
    let first = &seen[&(1, "f32")];
    for (key, r) in &seen {
        assert!(r == first, "{key:?} differs from the f32 model on 1 thread");
    }
}
