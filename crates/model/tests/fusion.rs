//! Fusion (`BuildOptions::fuse`) changes how many passes a step makes over
//! memory, not the arithmetic: a fused network and an unfused one built from
//! the same spec and seed have the same parameters in the same order and
//! compute the same bits, forward and backward, in training and evaluation,
//! with and without block recompute.

use headroom_model::loss::softmax_cross_entropy;
use headroom_model::{BuildOptions, CheckpointPolicy, Mode, ModelSpec, Network};
use serde::Deserialize;

#[derive(Deserialize)]
struct Wrapper {
    model: ModelSpec,
}

/// 20 and 40 channels: a full 16-channel group and a partial one in the
/// batch norm's reductions.
fn spec(checkpoint: CheckpointPolicy) -> ModelSpec {
    let text = r#"
[model]
input = [9, 9, 2]
mean = 0.5
std = 0.25
layers = [
  { type = "conv", out = 20 }, { type = "batch_norm" }, { type = "relu" },
  { type = "basic_block" },
  { type = "conv", out = 40, stride = 2 }, { type = "batch_norm" }, { type = "relu" },
  { type = "basic_block" },
  { type = "residual", layers = [{ type = "batch_norm" }, { type = "relu" }] },
  { type = "batch_norm" },
  { type = "global_avg_pool" },
  { type = "linear", out = 4 },
]
"#;
    let mut spec = toml::from_str::<Wrapper>(text)
        .expect("the test spec parses")
        .model;
    spec.checkpoint = checkpoint;
    spec
}

/// Two training steps (a plain SGD update between them) and an evaluation:
/// the logits, gradients, weights and batch-norm statistics, as bits.
fn run(fuse: bool, checkpoint: CheckpointPolicy) -> (Vec<String>, Vec<u32>) {
    let mut network = Network::build_with(&spec(checkpoint), 5, BuildOptions { fuse })
        .expect("the network builds");
    let n = 6;
    let pixels: Vec<u8> = (0..n * 162).map(|i| ((i * 7919) % 251) as u8).collect();
    let labels: Vec<u32> = (0..n as u32).map(|i| i % 4).collect();
    let input = network.input_from_u8(n, &pixels).expect("input");
    let mut bits = Vec::new();
    for _ in 0..2 {
        let logits = network.forward(&input, Mode::Train).expect("forward");
        let loss = softmax_cross_entropy(&logits, &labels, 0.1).expect("loss");
        network.backward(&loss.grad).expect("backward");
        bits.extend(logits.data().iter().map(|v| v.to_bits()));
        for param in network.params_mut() {
            bits.extend(param.grad.data().iter().map(|v| v.to_bits()));
            let grad = param.grad.data().to_vec();
            for (w, g) in param.value.data_mut().iter_mut().zip(grad) {
                *w -= 0.1 * g;
            }
            param.grad.data_mut().fill(0.0);
        }
    }
    let logits = network.forward(&input, Mode::Eval).expect("eval forward");
    bits.extend(logits.data().iter().map(|v| v.to_bits()));
    for buffer in network.buffers_mut() {
        bits.extend(buffer.data().iter().map(|v| v.to_bits()));
    }
    let names = network
        .params_mut()
        .iter()
        .map(|p| p.name.clone())
        .collect();
    (names, bits)
}

#[test]
fn fused_and_unfused_networks_agree_bit_for_bit() {
    for checkpoint in [CheckpointPolicy::None, CheckpointPolicy::Blocks] {
        let (plain_names, plain) = run(false, checkpoint);
        let (fused_names, fused) = run(true, checkpoint);
        assert_eq!(plain_names, fused_names, "{checkpoint:?}: parameter names");
        assert_eq!(plain.len(), fused.len());
        let differ = plain.iter().zip(&fused).filter(|(a, b)| a != b).count();
        assert_eq!(differ, 0, "{checkpoint:?}: {differ} values differ");
    }
}

#[test]
fn the_fused_network_has_fused_layers_and_the_unfused_none() {
    let layers = |fuse| {
        Network::build_with(&spec(CheckpointPolicy::None), 5, BuildOptions { fuse })
            .expect("the network builds")
            .summary()
            .expect("summary")
            .join("\n")
    };
    let fused = layers(true);
    let plain = layers(false);
    assert!(fused.contains("bn+relu 20"), "{fused}");
    assert!(fused.contains("bn+add+relu"), "{fused}");
    assert!(
        !plain.contains("bn+relu") && !plain.contains("bn+add+relu"),
        "{plain}"
    );
    // Inside an explicit residual body a batch norm + ReLU fuses too.
    assert!(fused.contains("residual[bn+relu]"), "{fused}");
}
