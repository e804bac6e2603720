//! Sequence models built from TOML: token input, transformer blocks,
//! attention's lean path, checkpointing per block, dropout inside a network,
//! and the errors that name the key.

use headroom_model::init::InitRng;
use headroom_model::loss::softmax_cross_entropy;
use headroom_model::{
    CheckpointPolicy, Device, MemoryPool, Mode, ModelSpec, Network, PoolStats, Result, Tensor,
};
use serde::Deserialize;

#[derive(Deserialize)]
struct Wrapper {
    model: ModelSpec,
}

fn parse(text: &str) -> ModelSpec {
    toml::from_str::<Wrapper>(text).unwrap().model
}

const VOCAB: usize = 11;
const LENGTH: usize = 8;

/// A two-block GPT over 8 tokens of an 11-symbol vocabulary.
fn tiny_gpt(block_options: &str) -> ModelSpec {
    parse(&tiny_gpt_text(block_options))
}

fn tiny_gpt_text(block_options: &str) -> String {
    format!(
        r#"
[model]
tokens = {{ length = {LENGTH}, vocab = {VOCAB} }}
layers = [
  {{ type = "embedding", dim = 16, positions = true }},
  {{ type = "transformer_block", heads = 4 {block_options} }},
  {{ type = "transformer_block", heads = 4 {block_options} }},
  {{ type = "layer_norm" }},
  {{ type = "linear", out = {VOCAB} }},
]
"#
    )
}

fn with_policy(spec: &ModelSpec, checkpoint: CheckpointPolicy) -> ModelSpec {
    ModelSpec {
        checkpoint,
        ..spec.clone()
    }
}

fn token_ids(n: usize, seed: u64) -> Vec<u32> {
    let mut rng = InitRng::new(seed);
    (0..n * LENGTH)
        .map(|_| (rng.next_u64() % VOCAB as u64) as u32)
        .collect()
}

/// Forward, next-token loss over [N, T, V] (the last position predicts the
/// first token, to keep every position in the loss), backward. Returns the
/// logits and the loss.
fn token_step(net: &mut Network, ids: &[u32], n: usize) -> Result<(Tensor, f32)> {
    let x = net.input_from_tokens(n, ids)?;
    let logits = net.forward(&x, Mode::Train)?;
    let labels: Vec<u32> = (0..n * LENGTH)
        .map(|i| ids[(i / LENGTH) * LENGTH + (i % LENGTH + 1) % LENGTH])
        .collect();
    let flat = logits.clone().reshape(&[n * LENGTH, VOCAB])?;
    let out = softmax_cross_entropy(&flat, &labels, 0.0)?;
    net.backward(&out.grad.reshape(&[n, LENGTH, VOCAB])?)?;
    Ok((logits, out.loss))
}

fn grads(net: &mut Network) -> Vec<Vec<f32>> {
    net.params_mut()
        .iter()
        .map(|p| p.grad.data().to_vec())
        .collect()
}

/// The pool's figures over one training step, and the bytes held between
/// forward and backward (what the layers saved, plus the logits).
fn step_stats(net: &mut Network, n: usize) -> (PoolStats, u64) {
    let ids = token_ids(n, 3);
    let pool = MemoryPool::new(Device::Cpu);
    let saved = pool.scope(|| {
        let x = net.input_from_tokens(n, &ids).unwrap();
        let logits = net.forward(&x, Mode::Train).unwrap();
        let saved = pool.stats().in_use_bytes;
        drop((x, logits));
        net.clear_saved();
        net.zero_grad();
        token_step(net, &ids, n).unwrap();
        saved
    });
    (pool.stats(), saved)
}

#[test]
fn a_tiny_gpt_builds_scores_every_token_and_learns() {
    let mut net = Network::build(&tiny_gpt(""), 1).unwrap();
    assert_eq!(net.input_shape(), vec![LENGTH]);
    assert_eq!(net.output_shape(), &[LENGTH, VOCAB]);
    assert_eq!(net.num_classes(), VOCAB);
    let summary = net.summary().unwrap().join("\n");
    assert!(
        summary.contains("residual[layer_norm,causal_self_attention]"),
        "{summary}"
    );
    let ids = token_ids(4, 1);
    let mut losses = Vec::new();
    for _ in 0..30 {
        net.zero_grad();
        let (_, loss) = token_step(&mut net, &ids, 4).unwrap();
        losses.push(loss);
        for p in net.params_mut() {
            let g = p.grad.data().to_vec();
            for (w, g) in p.value.data_mut().iter_mut().zip(g) {
                *w -= 0.1 * g;
            }
        }
    }
    assert!(
        losses[29] < 0.5 * losses[0],
        "memorising one batch: {losses:?}"
    );
}

#[test]
fn lean_attention_gives_the_same_gradients_and_keeps_less() {
    let n = 8;
    let mut keep = Network::build(&tiny_gpt(""), 5).unwrap();
    let mut lean = Network::build(&tiny_gpt(", lean = true"), 5).unwrap();
    let ids = token_ids(n, 2);
    let (logits_keep, loss_keep) = token_step(&mut keep, &ids, n).unwrap();
    let (logits_lean, loss_lean) = token_step(&mut lean, &ids, n).unwrap();
    assert_eq!(logits_keep.data(), logits_lean.data());
    assert_eq!(loss_keep.to_bits(), loss_lean.to_bits());
    assert!(grads(&mut keep).iter().flatten().any(|&g| g != 0.0));
    assert_eq!(grads(&mut keep), grads(&mut lean), "bitwise the same");

    let (_, saved_keep) = step_stats(&mut keep, n);
    let (_, saved_lean) = step_stats(&mut lean, n);
    // Two blocks × 4 heads × T×T probabilities per sample.
    let probabilities = (n * 2 * 4 * LENGTH * LENGTH * 4) as u64;
    println!("held for backward: keep {saved_keep} B, lean {saved_lean} B");
    assert!(
        saved_lean + probabilities <= saved_keep,
        "lean {saved_lean} B + {probabilities} B vs keep {saved_keep} B"
    );
}

#[test]
fn checkpointing_each_transformer_block_is_exact_and_lowers_the_peak() {
    let n = 8;
    // Dropout inside the blocks: the recomputation must draw the same masks.
    let spec = tiny_gpt(", dropout = 0.2");
    let mut plain = Network::build(&spec, 7).unwrap();
    let mut blocks = Network::build(&with_policy(&spec, CheckpointPolicy::Blocks), 7).unwrap();
    let summary = blocks.summary().unwrap();
    assert_eq!(
        summary
            .iter()
            .filter(|l| l.starts_with("checkpoint["))
            .count(),
        2,
        "{summary:#?}"
    );
    for step in 0..2 {
        let ids = token_ids(n, 10 + step);
        plain.zero_grad();
        blocks.zero_grad();
        let (a, _) = token_step(&mut plain, &ids, n).unwrap();
        let (b, _) = token_step(&mut blocks, &ids, n).unwrap();
        assert_eq!(a.data(), b.data());
        assert_eq!(grads(&mut plain), grads(&mut blocks), "step {step}");
        assert_eq!(plain.buffer_values(), blocks.buffer_values());
    }
    let (plain_stats, _) = step_stats(&mut plain, n);
    let (block_stats, _) = step_stats(&mut blocks, n);
    assert!(
        block_stats.peak_in_use_bytes < plain_stats.peak_in_use_bytes,
        "blocks {} vs none {}",
        block_stats.peak_in_use_bytes,
        plain_stats.peak_in_use_bytes
    );
}

#[test]
fn dropout_draws_again_after_a_restore_and_is_off_in_eval() {
    let mut net = Network::build(&tiny_gpt(", dropout = 0.3"), 2).unwrap();
    let ids = token_ids(2, 4);
    let x = net.input_from_tokens(2, &ids).unwrap();
    let eval = net.forward(&x, Mode::Eval).unwrap();
    assert_eq!(eval.data(), net.forward(&x, Mode::Eval).unwrap().data());

    let counters = net.buffer_values();
    let first = net.forward(&x, Mode::Train).unwrap();
    net.clear_saved();
    let second = net.forward(&x, Mode::Train).unwrap();
    net.clear_saved();
    assert_ne!(first.data(), second.data(), "a new mask every forward");
    assert_ne!(first.data(), eval.data());
    // Restoring the counters (as resume does) replays the same masks.
    net.restore_buffer_values(&counters).unwrap();
    assert_eq!(net.forward(&x, Mode::Train).unwrap().data(), first.data());
}

#[test]
fn bad_values_name_their_key() {
    let cases = [
        ("", "heads = 4", "heads = 3", "model.layers[1].attn.heads"),
        (
            ", lora = { r = 4 }",
            "r = 4",
            "r = 0",
            "model.layers[1].attn.lora.r",
        ),
        (
            ", lora = { r = 4 }",
            "r = 4 }",
            "r = 4, alpha = -1.0 }",
            "lora.alpha",
        ),
        (
            ", dropout = 0.1",
            "dropout = 0.1",
            "dropout = 1.5",
            "model.layers[1].dropout",
        ),
        ("", "dim = 16", "dim = 0", "model.layers[0].dim"),
        ("", "vocab = 11", "vocab = 0", "model.tokens.vocab"),
    ];
    for (options, from, to, key) in cases {
        let source = tiny_gpt_text(options);
        assert!(source.contains(from), "{from} in {source}");
        let bad = parse(&source.replacen(from, to, 1));
        let err = Network::build(&bad, 0).err().unwrap().to_string();
        assert!(err.contains(key), "{key}: {err}");
    }
}

#[derive(serde::Serialize)]
struct Wrapper2 {
    model: ModelSpec,
}

#[test]
fn token_and_pixel_inputs_do_not_mix() {
    let embedding_on_pixels = parse(
        r#"
[model]
input = [4, 4, 1]
mean = 0.5
std = 0.25
layers = [{ type = "embedding", dim = 4 }]
"#,
    );
    let err = Network::build(&embedding_on_pixels, 0)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("model.tokens"), "{err}");

    let mut both = tiny_gpt("");
    both.input = [4, 4, 1];
    let err = Network::build(&both, 0).err().unwrap().to_string();
    assert!(err.contains("model.input"), "{err}");

    let net = Network::build(&tiny_gpt(""), 0).unwrap();
    assert!(net.input_from_u8(1, &[0; 16]).is_err());
    let err = net
        .input_from_tokens(1, &[11; LENGTH])
        .unwrap_err()
        .to_string();
    assert!(err.contains("0..11"), "{err}");
    assert!(net.input_from_tokens(1, &[1; LENGTH - 1]).is_err());
    // Pixel specs serialise as before: no `tokens` key.
    let pixels = toml::to_string(&Wrapper2 {
        model: embedding_on_pixels,
    })
    .unwrap();
    assert!(!pixels.contains("tokens"), "{pixels}");
}

#[test]
fn measure_step_works_for_token_models() {
    let mut net = Network::build(&tiny_gpt(", lean = true"), 0).unwrap();
    let peak = headroom_model::measure_step_peak(&mut net, 4).unwrap();
    assert!(peak > 0);
    assert!(grads(&mut net).iter().flatten().all(|&g| g == 0.0));
}
