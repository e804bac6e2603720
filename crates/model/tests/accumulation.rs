//! Gradient accumulation at the model level: k micro-batches of b/k samples,
//! each loss gradient scaled by 1/k and added into the parameter gradients,
//! give the gradient of one batch of b.
//!
//! This is exact (up to f32 rounding of the different summation order) for
//! every layer whose forward treats samples independently: convolution,
//! ReLU, residual, pooling, linear, the mean loss. Batch norm is the one
//! exception: in training it normalises with the statistics of the batch it
//! sees, so a micro-batch of b/k is normalised with its own mean and
//! variance, not those of the full batch — the activations, and so the
//! gradients, differ (and the running statistics get k updates of b/k
//! samples instead of one of b). That is the usual behaviour of gradient
//! accumulation with batch norm (PyTorch's too); the second test proves
//! that the statistics are the whole difference.

mod common;

use common::{batch, grads, parse, step};
use headroom_model::{ModelSpec, Network, Tensor};

fn without_bn() -> ModelSpec {
    parse(
        r#"
[model]
input = [8, 8, 1]
mean = 0.5
std = 0.25
layers = [
  { type = "conv", out = 8, bias = true }, { type = "relu" },
  { type = "residual", layers = [
      { type = "conv", out = 8 }, { type = "relu" }, { type = "conv", out = 8 },
  ] },
  { type = "relu" },
  { type = "conv", out = 16, stride = 2 }, { type = "relu" },
  { type = "global_avg_pool" },
  { type = "linear", out = 4 },
]
"#,
    )
    .unwrap()
}

/// Summed gradients of `k` micro-batches of `b/k` (loss gradient × 1/k).
fn accumulated(spec: &ModelSpec, b: usize, k: usize) -> Vec<Vec<f32>> {
    let mut net = Network::build(spec, 3).unwrap();
    let (pixels, labels) = batch(spec, b, 7);
    let x = net.input_from_u8(b, &pixels).unwrap();
    net.zero_grad();
    let m = b / k;
    for i in 0..k {
        let xi: Tensor = x.try_narrow_batch(i * m, m).unwrap();
        step(&mut net, &xi, &labels[i * m..(i + 1) * m], 1.0 / k as f32).unwrap();
    }
    grads(&mut net)
}

/// Largest |a - b| relative to the largest |a| of the same parameter.
fn worst_relative(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(a, b)| {
            let scale = a.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-12) as f64;
            a.iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs() as f64 / scale)
                .fold(0.0, f64::max)
        })
        .fold(0.0, f64::max)
}

#[test]
fn micro_batches_give_the_full_batch_gradient_without_batch_norm() {
    let spec = without_bn();
    let full = accumulated(&spec, 16, 1);
    assert!(full.iter().flatten().any(|&g| g != 0.0));
    for k in [2, 4, 8] {
        let acc = accumulated(&spec, 16, k);
        let worst = worst_relative(&full, &acc);
        println!(
            "no batch norm, 16 = {k} x {}: worst relative difference {worst:.2e}",
            16 / k
        );
        assert!(worst < 1e-5, "k = {k}: {worst:.3e}");
    }
}

/// The gradient of micro-batch `i` of `k` (of a batch of `b`) alone, on a
/// fresh network with the same weights: normalised by batch norm with that
/// micro-batch's own statistics and nothing else, unscaled.
fn alone(spec: &ModelSpec, b: usize, k: usize, i: usize) -> Vec<Vec<f32>> {
    let mut net = Network::build(spec, 3).unwrap();
    let (pixels, labels) = batch(spec, b, 7);
    let x = net.input_from_u8(b, &pixels).unwrap();
    net.zero_grad();
    let m = b / k;
    let xi: Tensor = x.try_narrow_batch(i * m, m).unwrap();
    step(&mut net, &xi, &labels[i * m..(i + 1) * m], 1.0).unwrap();
    grads(&mut net)
}

#[test]
fn with_batch_norm_micro_batches_differ_by_the_batch_statistics() {
    // See the module docs: with batch norm, accumulating k micro-batches is
    // not the full batch's gradient, and the difference is exactly that
    // each micro-batch is normalised with its own statistics. Proved in
    // two halves: (1) the accumulated gradient is the mean of the
    // gradients of each micro-batch computed on its own (a fresh network
    // that sees only those samples, so only their statistics), to
    // rounding; (2) it is not the full batch's gradient, by far more than
    // rounding, while the same network without batch norm (the first
    // test) agrees to 1e-5: the statistics are the whole difference.
    let spec = common::small();
    let full = accumulated(&spec, 16, 1);
    assert!(full.iter().flatten().any(|&g| g != 0.0));
    for k in [2, 4] {
        let acc = accumulated(&spec, 16, k);
        let mut mean: Vec<Vec<f32>> = full.iter().map(|p| vec![0.0; p.len()]).collect();
        for i in 0..k {
            for (m, g) in mean.iter_mut().zip(alone(&spec, 16, k, i)) {
                for (m, g) in m.iter_mut().zip(g) {
                    *m += g / k as f32;
                }
            }
        }
        let own_statistics = worst_relative(&mean, &acc);
        let versus_full = worst_relative(&full, &acc);
        println!(
            "batch norm, 16 = {k} x {}: against the micro-batches alone {own_statistics:.2e}, \
             against the full batch {versus_full:.2e}",
            16 / k
        );
        assert!(
            own_statistics < 1e-5,
            "k = {k}: accumulation is not the mean of the micro-batches' own gradients: \
             {own_statistics:.3e}"
        );
        assert!(
            versus_full > 1e-3,
            "k = {k}: the micro-batches' statistics should change the gradient: {versus_full:.3e}"
        );
    }
}
