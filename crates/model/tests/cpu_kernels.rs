//! The AVX-512 tiles (32 columns, two zmm registers per row) against the
//! AVX2+FMA tiles (16 columns): both do the same fused multiply-adds in the
//! same order for every output, so a network's forward and backward must
//! agree bit for bit, through the direct kernels (the stem, the stride-2
//! layers) and through Winograd's products (the 3×3 stride-1 layers,
//! weight gradients included, F(2×2, 3×3) and F(4×4, 3×3)) alike, and the narrow kernels (fewer than 16
//! outputs) compiled for either width. On a CPU without AVX-512 both runs take
//! the AVX2 tiles and the test says so.
//!
//! One test in its own binary: the kernel choice is a process-wide setting.

use headroom_model::layers::{set_conv_algorithm, set_cpu_kernels, ConvAlgorithm, CpuKernels};
use headroom_model::loss::softmax_cross_entropy;
use headroom_model::{Mode, ModelSpec, Network};
use serde::Deserialize;

#[derive(Deserialize)]
struct Wrapper {
    model: ModelSpec,
}

/// Channels of 32, 64 and 96: widths in 32s take the AVX-512 tiles, 48
/// (a multiple of 16 only) keeps the AVX2 tiles beside them. Then 17, 5,
/// 4 and 3 outputs: the narrow kernels at stride 1 and 2 (`wide` loops,
/// and the explicit AVX-512 or AVX2 forward on kernel-row runs: 17 -> 5
/// has a run of 51 floats, three whole blocks and an overlapping fourth,
/// and a dX of one whole channel block and one channel after it).
fn spec() -> ModelSpec {
    let text = r#"
[model]
input = [10, 10, 3]
mean = 0.5
std = 0.25
layers = [
  { type = "conv", out = 32 }, { type = "batch_norm" }, { type = "relu" },
  { type = "basic_block" },
  { type = "conv", out = 64, stride = 2 }, { type = "batch_norm" }, { type = "relu" },
  { type = "basic_block" },
  { type = "conv", out = 48 }, { type = "relu" },
  { type = "conv", out = 96, stride = 2 }, { type = "relu" },
  { type = "conv", out = 17 }, { type = "relu" },
  { type = "conv", out = 5 }, { type = "relu" },
  { type = "conv", out = 4 }, { type = "relu" },
  { type = "conv", out = 3, stride = 2 },
  { type = "global_avg_pool" },
  { type = "linear", out = 5 },
]
"#;
    toml::from_str::<Wrapper>(text)
        .expect("the test spec parses")
        .model
}

/// Logits, input-side gradients of every parameter, as bits.
fn step(kernels: CpuKernels, algorithm: ConvAlgorithm) -> Vec<u32> {
    set_cpu_kernels(kernels);
    set_conv_algorithm(algorithm);
    let mut network = Network::build(&spec(), 3).expect("the network builds");
    let n = 13;
    let pixels: Vec<u8> = (0..n * 300).map(|i| ((i * 7919) % 251) as u8).collect();
    let labels: Vec<u32> = (0..n as u32).map(|i| i % 5).collect();
    let input = network.input_from_u8(n, &pixels).expect("input");
    let logits = network.forward(&input, Mode::Train).expect("forward");
    let loss = softmax_cross_entropy(&logits, &labels, 0.1).expect("loss");
    network.backward(&loss.grad).expect("backward");
    let mut bits: Vec<u32> = logits.data().iter().map(|v| v.to_bits()).collect();
    for param in network.params_mut() {
        bits.extend(param.grad.data().iter().map(|v| v.to_bits()));
    }
    bits
}

#[test]
fn avx512_and_avx2_tiles_agree_bit_for_bit() {
    #[cfg(target_arch = "x86_64")]
    if !std::arch::is_x86_feature_detected!("avx512f") {
        eprintln!("this CPU has no AVX-512: both runs take the AVX2 tiles");
    }
    for algorithm in [
        ConvAlgorithm::Direct,
        ConvAlgorithm::Winograd,
        ConvAlgorithm::Winograd4,
    ] {
        let narrow = step(CpuKernels::Avx2, algorithm);
        let wide = step(CpuKernels::Auto, algorithm);
        assert_eq!(narrow.len(), wide.len());
        let differ = narrow.iter().zip(&wide).filter(|(a, b)| a != b).count();
        assert_eq!(differ, 0, "{algorithm:?}: {differ} values differ");
    }
}
