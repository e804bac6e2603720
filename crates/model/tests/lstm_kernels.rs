//! The LSTM's recurrent products through the AVX2 panel tiles
//! (`HEADROOM_CPU_KERNELS=avx2`) and the AVX-512 ones (`auto` on an
//! AVX-512 CPU): both are one chain of FMAs per output in the same order,
//! so a network's logits and gradients agree bit for bit (the `gemm`
//! crate's products around them do not look at the setting). On a CPU
//! without AVX-512 both runs take the AVX2 tiles and the test says so.
//!
//! One test in its own binary: the kernel choice is a process-wide setting.

use headroom_model::layers::{set_cpu_kernels, CpuKernels};
use headroom_model::loss::softmax_cross_entropy;
use headroom_model::{Mode, ModelSpec, Network};
use serde::Deserialize;

#[derive(Deserialize)]
struct Wrapper {
    model: ModelSpec,
}

const VOCAB: usize = 13;
const LENGTH: usize = 9;

/// Two stacked LSTMs: 20 and 24 units (part-filled 16-column panels), so
/// both the input and the recurrent widths differ from the tiles' sizes.
fn spec() -> ModelSpec {
    let text = format!(
        r#"
[model]
tokens = {{ length = {LENGTH}, vocab = {VOCAB} }}
layers = [
  {{ type = "embedding", dim = 10 }},
  {{ type = "lstm", hidden = 20 }},
  {{ type = "lstm", hidden = 24 }},
  {{ type = "linear", out = {VOCAB} }},
]
"#
    );
    toml::from_str::<Wrapper>(&text)
        .expect("the test spec parses")
        .model
}

/// Logits, then every parameter's gradient, of one training step on 7
/// sequences (a block of 4 samples and one of 3 on two threads).
fn step(kernels: CpuKernels) -> Vec<f32> {
    set_cpu_kernels(kernels);
    let mut network = Network::build(&spec(), 5).expect("the network builds");
    let n = 7;
    let ids: Vec<u32> = (0..n * LENGTH)
        .map(|i| ((i * 7 + i / 5) % VOCAB) as u32)
        .collect();
    let labels: Vec<u32> = ids.iter().map(|&id| (id + 1) % VOCAB as u32).collect();
    let input = network.input_from_tokens(n, &ids).expect("input");
    let logits = network.forward(&input, Mode::Train).expect("forward");
    let flat = logits
        .clone()
        .reshape(&[n * LENGTH, VOCAB])
        .expect("reshape");
    let loss = softmax_cross_entropy(&flat, &labels, 0.0).expect("loss");
    let grad = loss.grad.reshape(&[n, LENGTH, VOCAB]).expect("reshape");
    network.backward(&grad).expect("backward");
    let mut values = logits.data().to_vec();
    for param in network.params_mut() {
        values.extend_from_slice(param.grad.data());
    }
    values
}

#[test]
fn avx2_and_avx512_panel_tiles_agree_bit_for_bit() {
    #[cfg(target_arch = "x86_64")]
    if !std::arch::is_x86_feature_detected!("avx512f") {
        eprintln!("this CPU has no AVX-512: both runs take the AVX2 panel tiles");
    }
    let narrow = step(CpuKernels::Avx2);
    let wide = step(CpuKernels::Auto);
    assert_eq!(narrow.len(), wide.len());
    let largest = wide.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    assert!(largest > 0.0, "every value is zero");
    let differ = narrow
        .iter()
        .zip(&wide)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(differ, 0, "{differ} of {} values differ", wide.len());
}
