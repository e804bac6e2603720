//! Specs and data shared by the integration tests.
#![allow(dead_code)]

use headroom_model::init::InitRng;
use headroom_model::loss::softmax_cross_entropy;
use headroom_model::{Mode, ModelSpec, Network, Result, Tensor};
use serde::Deserialize;

#[derive(Deserialize)]
struct Wrapper {
    model: ModelSpec,
}

/// The default experiment, whose `[model]` is the reference ResNet
/// (Fashion-MNIST 28×28×1); other tables are ignored when parsing.
pub const REFERENCE: &str = include_str!("../../../../experiments/fashion_mnist.toml");

pub fn parse(text: &str) -> std::result::Result<ModelSpec, toml::de::Error> {
    toml::from_str::<Wrapper>(text).map(|w| w.model)
}

pub fn reference() -> ModelSpec {
    parse(REFERENCE).unwrap()
}

/// A small net of the reference's kind on 8×8 inputs: stem, basic block, a
/// bare residual, strided stem, pool, linear.
pub fn small() -> ModelSpec {
    parse(
        r#"
[model]
input = [8, 8, 1]
mean = 0.5
std = 0.25
layers = [
  { type = "conv", out = 8 }, { type = "batch_norm" }, { type = "relu" },
  { type = "basic_block" },
  { type = "residual", layers = [
      { type = "conv", out = 8 }, { type = "batch_norm" }, { type = "relu" },
  ] },
  { type = "conv", out = 16, stride = 2 }, { type = "batch_norm" }, { type = "relu" },
  { type = "global_avg_pool" },
  { type = "linear", out = 4 },
]
"#,
    )
    .unwrap()
}

/// Deterministic pixels and labels for `n` samples of `spec`'s input.
pub fn batch(spec: &ModelSpec, n: usize, seed: u64) -> (Vec<u8>, Vec<u32>) {
    let mut rng = InitRng::new(seed);
    let [h, w, c] = spec.input;
    let pixels = (0..n * h * w * c)
        .map(|_| (rng.next_u64() % 256) as u8)
        .collect();
    let labels = (0..n).map(|_| (rng.next_u64() % 4) as u32).collect();
    (pixels, labels)
}

/// One training step's forward + loss + backward (gradients added into the
/// parameters); returns the logits and the loss.
pub fn step(
    net: &mut Network,
    x: &Tensor,
    labels: &[u32],
    grad_scale: f32,
) -> Result<(Tensor, f32)> {
    let logits = net.forward(x, Mode::Train)?;
    let out = softmax_cross_entropy(&logits, labels, 0.0)?;
    let mut grad = out.grad;
    if grad_scale != 1.0 {
        for g in grad.try_data_mut()? {
            *g *= grad_scale;
        }
    }
    net.backward(&grad)?;
    Ok((logits, out.loss))
}

pub fn grads(net: &mut Network) -> Vec<Vec<f32>> {
    net.params_mut()
        .iter()
        .map(|p| p.grad.data().to_vec())
        .collect()
}

pub fn weights(net: &mut Network) -> Vec<Vec<f32>> {
    net.params_mut()
        .iter()
        .map(|p| p.value.data().to_vec())
        .collect()
}

pub fn sgd(net: &mut Network, lr: f32) {
    for p in net.params_mut() {
        let grad = p.grad.data().to_vec();
        for (w, g) in p.value.data_mut().iter_mut().zip(grad) {
            *w -= lr * g;
        }
    }
}
