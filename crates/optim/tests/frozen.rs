//! Frozen parameters (LoRA base weights) are left bit-identical by AdamW,
//! weight decay included, while the adapters train.

use headroom_model::loss::softmax_cross_entropy;
use headroom_model::{Mode, ModelSpec, Network, Param, Tensor};
use headroom_optim::{AdamW, AdamWConfig};
use serde::Deserialize;

#[derive(Deserialize)]
struct Wrapper {
    model: ModelSpec,
}

const LORA_MLP: &str = r#"
[model]
input = [2, 3, 1]
mean = 0.5
std = 0.25
layers = [
  { type = "flatten" },
  { type = "lora_linear", out = 5, lora = { r = 2, alpha = 4.0 } },
  { type = "silu" },
  { type = "lora_linear", out = 3, lora = { r = 2 } },
]
"#;

fn decaying_adamw() -> AdamW {
    AdamW::new(AdamWConfig {
        weight_decay: 0.5,
        ..AdamWConfig::default()
    })
    .unwrap()
}

#[test]
fn a_frozen_param_is_not_updated_even_with_a_gradient() {
    // Frozen by the flag alone, so that it keeps a gradient buffer.
    let mut frozen = Param::new(
        "w",
        Tensor::from_vec(&[3], vec![1.0, -2.0, 3.0]).unwrap(),
        true,
    );
    frozen.frozen = true;
    let mut trained = Param::new(
        "v",
        Tensor::from_vec(&[3], vec![1.0, -2.0, 3.0]).unwrap(),
        true,
    );
    for p in [&mut frozen, &mut trained] {
        p.grad.data_mut().copy_from_slice(&[0.5, 0.5, -0.5]);
    }
    decaying_adamw()
        .step(&mut [&mut frozen, &mut trained], 0.1)
        .unwrap();
    assert_eq!(frozen.value.data(), &[1.0, -2.0, 3.0]);
    assert_ne!(trained.value.data(), &[1.0, -2.0, 3.0]);
}

#[test]
fn lora_training_changes_only_the_adapters() {
    let spec = toml::from_str::<Wrapper>(LORA_MLP).unwrap().model;
    let mut net = Network::build(&spec, 3).unwrap();
    let before: Vec<(String, bool, Vec<f32>)> = net
        .params_mut()
        .iter()
        .map(|p| (p.name.clone(), p.frozen, p.value.data().to_vec()))
        .collect();
    assert_eq!(before.iter().filter(|(_, frozen, _)| *frozen).count(), 4);
    let mut optimizer = decaying_adamw();
    let pixels: Vec<u8> = (0..4 * 6).map(|i| (i * 37 % 256) as u8).collect();
    for _ in 0..3 {
        let x = net.input_from_u8(4, &pixels).unwrap();
        let logits = net.forward(&x, Mode::Train).unwrap();
        let out = softmax_cross_entropy(&logits, &[0, 1, 2, 1], 0.0).unwrap();
        net.backward(&out.grad).unwrap();
        optimizer.step(&mut net.params_mut(), 0.05).unwrap();
        net.zero_grad();
    }
    for (p, (name, frozen, value)) in net.params_mut().iter().zip(&before) {
        if *frozen {
            assert_eq!(p.value.data(), value.as_slice(), "{name} moved");
        } else {
            assert_ne!(p.value.data(), value.as_slice(), "{name} did not train");
        }
    }
}

#[test]
fn frozen_params_hold_no_optimizer_state() {
    let spec = toml::from_str::<Wrapper>(LORA_MLP).unwrap().model;
    let mut net = Network::build(&spec, 3).unwrap();
    let trainable: usize = net
        .params_mut()
        .iter()
        .filter(|p| !p.frozen)
        .map(|p| p.value.len())
        .sum();
    // The adapters: A [2, 6] + B [5, 2] and A [2, 5] + B [3, 2].
    assert_eq!(trainable, 12 + 10 + 10 + 6);
    assert_eq!(
        headroom_optim::adamw_state_bytes(&net.params_mut()),
        8 * trainable as u64
    );
    let mut optimizer = decaying_adamw();
    optimizer.step(&mut net.params_mut(), 0.05).unwrap();
    let state = optimizer.state().unwrap();
    for ((p, m), v) in net
        .params_mut()
        .iter()
        .zip(&state.first_moment)
        .zip(&state.second_moment)
    {
        let expected = if p.frozen { 0 } else { p.value.len() };
        assert_eq!((m.len(), v.len()), (expected, expected), "{}", p.name);
    }
    // Frozen parameters hold no gradient buffer either.
    for p in net.params_mut() {
        assert_eq!(p.grad.is_empty(), p.frozen, "{}", p.name);
    }
    // The state round-trips into a fresh optimizer that steps the same net.
    let mut resumed = decaying_adamw();
    resumed.load_state(state).unwrap();
    resumed.step(&mut net.params_mut(), 0.05).unwrap();
}
