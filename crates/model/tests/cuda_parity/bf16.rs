//! bf16 storage (`device.precision = "bf16"`): a backend opened with
//! `HalfFormat::Bf16` compiles every kernel file with `HR_BF16`, so the
//! same kernels store bfloat16 (the emulator runs the same host code with
//! bf16's conversions, learning the format from the module's image).
//! Checked here: the device's conversions against the `half` crate's, bit
//! for bit; whole networks (im2col + cuBLAS, the implicit-GEMM tensor-core
//! convolutions, batch norm, residuals, the MLP and UNet layers) against
//! the CPU within bf16's rounding, which must also be visibly coarser than
//! f16's (a backend that silently stored f16 fails that); and the refusal
//! on a GPU older than sm_80 (CI reruns this binary as sm_75).

use super::*;
use headroom_model::cuda::HalfFormat;

/// The bf16 backend beside the shared one, or None where the GPU is older
/// than sm_80, whose refusal must then name bf16 and the GPU.
fn bf16_backend(be: &CudaBackend) -> Option<CudaBackend> {
    let arch = be.info().arch();
    match CudaBackend::with_half(0, HalfFormat::Bf16) {
        Ok(bf16) => {
            assert!(arch >= 80, "bf16 was opened on sm_{arch}");
            assert_eq!(bf16.half(), HalfFormat::Bf16);
            Some(bf16)
        }
        Err(e) => {
            let message = e.to_string();
            assert!(arch < 80, "bf16 refused on sm_{arch}: {message}");
            assert!(
                message.contains("bf16")
                    && message.contains(&format!("sm_{arch}"))
                    && message.contains(&be.info().name),
                "{message}"
            );
            announce(&format!(
                "bf16 refused on sm_{arch}, as it must be: {message}"
            ));
            None
        }
    }
}

/// Rounding f32 values to the device's storage and back: the bits
/// `half::bf16` gives (round to nearest even; the values past f16's range
/// stay finite), and NaN stays NaN. The same through the f16 backend gives
/// f16's bits, so the format follows the backend.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn bf16_storage_rounds_as_bfloat16_and_keeps_f32_s_range() {
    let be = gpu_or_skip!();
    let Some(bf16) = bf16_backend(&be) else {
        return;
    };
    let mut values = vec![
        0.0,
        -0.0,
        1.0,
        1.0 + 1.0 / 256.0,        // a tie: to even (1.0)
        1.0 + 3.0 / 256.0,        // a tie: to even (1 + 4/256)
        1.0 + 1.0 / 256.0 + 1e-6, // just past the tie: up
        65504.0,
        1.0e5,   // inf in f16
        -3.0e38, // near f32's largest
        3.4e38,  // rounds up to inf in bf16
        1.0e-30, // 0 in f16
        5.0e-39, // an f32 subnormal
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ];
    values.extend(random_vec(1000, 1601, 3.0));
    for (backend, half) in [(&bf16, HalfFormat::Bf16), (&*be, HalfFormat::F16)] {
        let x = CudaTensor::from_host(backend, &[values.len()], &values, DType::F32).unwrap();
        let stored = ops::cast_f32_to_f16(backend, &x).unwrap();
        let bits = backend.download(stored.f16().unwrap()).unwrap();
        let back = ops::cast_f16_to_f32(backend, &stored).unwrap();
        let back = back.to_host(backend).unwrap();
        for (i, &v) in values.iter().enumerate() {
            let want = half.encode(v);
            if v.is_nan() {
                assert!(
                    half.decode(bits[i]).is_nan() && back[i].is_nan(),
                    "{half} NaN: {:#06x}",
                    bits[i].to_bits()
                );
                continue;
            }
            assert_eq!(
                bits[i].to_bits(),
                want.to_bits(),
                "{half}: {v:e} stored as {:#06x}, expected {:#06x}",
                bits[i].to_bits(),
                want.to_bits()
            );
            assert_eq!(
                back[i].to_bits(),
                half.decode(want).to_bits(),
                "{half}: {v:e} back"
            );
        }
        // The host side of the same backend agrees (from_host and to_host).
        let host = CudaTensor::from_host(backend, &[values.len()], &values, DType::F16).unwrap();
        let host_back = host.to_host(backend).unwrap();
        for (i, (&a, &b)) in host_back.iter().zip(&back).enumerate() {
            assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "{half} host {i}: {a} vs {b}"
            );
        }
    }
}

/// A ResNet-shaped network whose convolutions have 16 channels, so that
/// stride-1 convolutions take the implicit-GEMM tensor-core kernels (bf16
/// `mma` on a GPU) under `ConvAlgorithm::ImplicitGemm`.
fn sixteen_channel_spec() -> ModelSpec {
    let text = r#"
[model]
input = [8, 8, 2]
mean = 0.5
std = 0.25
layers = [
  { type = "conv", out = 16 }, { type = "batch_norm" }, { type = "relu" },
  { type = "basic_block" },
  { type = "conv", out = 16, stride = 2 }, { type = "batch_norm" }, { type = "relu" },
  { type = "global_avg_pool" },
  { type = "linear", out = 4 },
]
"#;
    toml::from_str::<SpecFile>(text).unwrap().model
}

/// The l2 relative error of `gpu` against `cpu`, over all values.
fn l2_error(gpu: &[f32], cpu: &[f32]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&g, &c) in gpu.iter().zip(cpu) {
        num += (g as f64 - c as f64).powi(2);
        den += (c as f64).powi(2);
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// One network on one backend (`network_run_with`): two training passes
/// and an eval forward, with `algorithm` for its convolutions.
fn run_on(
    be: &CudaBackend,
    spec: &ModelSpec,
    algorithm: ConvAlgorithm,
    batches: &[Tensor],
    grad_logits: &Tensor,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let options = CudaBuildOptions {
        conv: ConvPlan {
            algorithm,
            ..ConvPlan::default()
        },
        ..CudaBuildOptions::default()
    };
    let (outputs, grads, _) =
        super::network::network_run_with(be, spec, options, batches, grad_logits);
    (outputs, grads)
}

/// bf16 networks against the CPU network: outputs within 3.2e-2 (8× f16's
/// 4e-3: a bf16 rounding is 2^-8 against f16's 2^-11) and every
/// parameter's gradient within 0.25 (0.8 through the UNet's batch norm:
/// batch norm's backward at 5 samples magnifies ReLU masks that flip near
/// zero, where f16 is already at 2-5e-2; a wrong kernel is off by O(1)),
/// and the outputs' error more than twice the same network's in f16 (5-12×
/// on the emulator), so the values really went through bf16. The inputs
/// are bf16 values, which f16 holds exactly too. Covers im2col + cuBLAS
/// (bf16 GEMMs), the implicit-GEMM kernels (counted on the emulator),
/// batch norm + ReLU and the fused residual, pooling, linear layers, layer
/// norm, SiLU, GELU, dropout, flatten, upsample2x and unet_skip.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn bf16_networks_match_the_cpu_network_within_bf16_rounding() {
    let be = gpu_or_skip!();
    let Some(bf16) = bf16_backend(&be) else {
        return;
    };
    let mut cases: Vec<(String, ModelSpec, ConvAlgorithm, [usize; 3])> = vec![
        (
            "two blocks, im2col".into(),
            super::network::two_block_spec(CheckpointPolicy::None),
            ConvAlgorithm::Im2col,
            [9, 9, 2],
        ),
        (
            "16 channels, implicit GEMM".into(),
            sixteen_channel_spec(),
            ConvAlgorithm::ImplicitGemm,
            [8, 8, 2],
        ),
    ];
    for (i, spec) in super::network::flattening_specs(CheckpointPolicy::None)
        .into_iter()
        .enumerate()
    {
        cases.push((
            format!("MLP/UNet layers {i}"),
            spec,
            ConvAlgorithm::Im2col,
            [6, 6, 2],
        ));
    }
    let implicit = ["implicit_conv_n32_f16", "implicit_conv_n64_f16"];
    for (what, spec, algorithm, input) in &cases {
        let n = 5;
        let bf16_values = |t: Tensor| {
            let data = t
                .data()
                .iter()
                .map(|&v| HalfFormat::Bf16.round(v))
                .collect();
            Tensor::from_vec(t.shape(), data).unwrap()
        };
        let batches: Vec<Tensor> = (0..2)
            .map(|i| {
                bf16_values(random(
                    &[n, input[0], input[1], input[2]],
                    1610 + i,
                    1.0,
                    0.0,
                ))
            })
            .collect();
        let grad_logits = bf16_values(random(&[n, 4], 1620, 0.5, 0.0));
        let mut cpu = Network::build(spec, 9).unwrap();
        let reference = cpu_run(&mut cpu, &batches, &grad_logits);
        let before = kernel_runs(&implicit);
        let (outputs, grads) = run_on(&bf16, spec, *algorithm, &batches, &grad_logits);
        if let (Some(before), Some(after)) = (before, kernel_runs(&implicit)) {
            let ran = after - before;
            match algorithm {
                ConvAlgorithm::ImplicitGemm => assert!(ran > 0, "{what}: no implicit-GEMM launch"),
                _ => assert_eq!(ran, 0, "{what}: implicit GEMM under im2col"),
            }
        }
        let (f16_outputs, _) = run_on(&be, spec, *algorithm, &batches, &grad_logits);
        // The UNet's batch norm backward magnifies rounding (as in f16's
        // test of these networks).
        let grad_tolerance = if what.ends_with('3') { 0.8 } else { 0.25 };
        let tolerances = Tolerances {
            f32_outputs: (0.0, 0.0),
            f32_grads: (0.0, 0.0),
            f16_outputs: 3.2e-2,
            f16_grads: grad_tolerance,
        };
        let what = format!("bf16 {what}");
        assert_matches_cpu(
            &what,
            DType::F16,
            (&outputs, &grads),
            (&reference.outputs, &reference.grads),
            tolerances,
        );
        let bf16_error = l2_error(&outputs, &reference.outputs);
        let f16_error = l2_error(&f16_outputs, &reference.outputs);
        eprintln!("{what}: output error {bf16_error:.2e} (f16: {f16_error:.2e})");
        assert!(
            bf16_error > 2.0 * f16_error,
            "{what}: bf16's output error {bf16_error:e} is not above twice f16's {f16_error:e}"
        );
    }
}

/// The fused AdamW on a bf16 backend: the masters stay f32 (the
/// reference's to f32 rounding), every compute copy is its master rounded
/// to bf16 after each step, the loss scale stays 1 (`LossScalerConfig::unit`,
/// the bf16 recipe's), and an update that takes weights past f16's range
/// (65504) is applied, where an f16 copy would refuse it.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn bf16_adamw_writes_bf16_copies_and_applies_updates_past_f16_s_range() {
    let be = gpu_or_skip!();
    let Some(bf16) = bf16_backend(&be) else {
        return;
    };
    let values = random_vec(1000, 1630, 0.5);
    let mut groups = vec![ParamGroup::from_host(&bf16, true, &values, DType::F16).unwrap()];
    let unit = LossScalerConfig::unit();
    let mut opt = FusedAdamW::new(&bf16, AdamWConfig::default(), unit, &groups).unwrap();
    let copies_are_bf16 = |groups: &[ParamGroup], what: &str| {
        let master = groups[0].read_master(&bf16).unwrap();
        let compute = groups[0].read_compute(&bf16).unwrap();
        let rounded = |w: f32| HalfFormat::Bf16.round(w);
        assert!(
            compute
                .iter()
                .zip(&master)
                .all(|(&c, &w)| c.to_bits() == rounded(w).to_bits()),
            "{what}: a compute copy is not its master in bf16"
        );
        assert!(
            master
                .iter()
                .any(|&w| HalfFormat::F16.round(w) != rounded(w)),
            "{what}: f16 and bf16 copies would agree everywhere (nothing tested)"
        );
        master
    };
    copies_are_bf16(&groups, "at start");
    for (t, lr) in [(0u64, 1e-2f32), (1, 1e5)] {
        let grads = random_vec(1000, 1640 + t, 0.2);
        bf16.compute_stream()
            .memcpy_htod(&grads, &mut groups[0].grad.slice)
            .unwrap();
        opt.step(&bf16, &mut groups, t, lr, 0.0, true).unwrap();
        let state = opt.read_state(&bf16).unwrap();
        let what = format!("step {t} at lr {lr}");
        assert_eq!(
            (state.update_overflow, state.skipped, state.applied),
            (0, 0, t + 1),
            "{what}: applied"
        );
        assert_eq!(state.next_scale, 1.0, "{what}: no loss scaling");
        let master = copies_are_bf16(&groups, &what);
        if lr > 1.0 {
            assert!(
                master.iter().all(|w| w.is_finite()) && master.iter().any(|w| w.abs() > 65_504.0),
                "{what}: finite weights beyond f16's range"
            );
        }
    }
}
