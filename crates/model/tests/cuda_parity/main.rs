//! Every CUDA op against the CPU layer it replaces: random inputs, the CPU
//! layer's forward and backward, the CUDA op, and a comparison with a stated
//! tolerance.
//!
//! One file, two devices. On a machine with a GPU the tests run on it; on
//! one without, they run on the CPU emulator (`headroom-cuda-emu`: a fake
//! CUDA driver and cuBLAS into which every kernel of the crate's `.cu` files
//! (`src/ops/<family>/*.cu`, `src/cuda/optim.cu`) is compiled as host
//! C++), through the same `CudaBackend`, op wrappers, launch configurations, im2col + GEMM compositions, fused optimizer and
//! staging ring. `HEADROOM_REQUIRE_GPU=1` (`cargo xtask gpu-check`) demands
//! a real GPU; `HEADROOM_CUDA_EMULATE=1` picks the emulator even where a
//! GPU is present. The backend validates each kernel file with NVRTC before
//! loading it, in emulation too: where the build found no NVRTC the tests
//! that need it are built as ignored (crates/model/build.rs), and the
//! binary ends with a line saying how many did not run and how to install
//! it; one built to run that finds no NVRTC at run time skips with one line
//! past the output capture. `HEADROOM_REQUIRE_NVRTC=1` (set by `.ci/run`)
//! makes either a failure.
//!
//! On the emulator the device is sm_80 with a CUDA 13.0 driver unless
//! HEADROOM_CUDA_EMU_ARCH (and _DRIVER) say otherwise; CI runs the binary
//! again as sm_75 and sm_90. A test whose path depends on the architecture
//! (the implicit-GEMM convolutions: sm_80 and newer) expects the path that
//! GPU takes, and counts on the emulator that it ran.
//!
//! Inputs and weights are rounded to f16 before the CPU sees them, so both
//! sides start from the same values and the tolerances measure the device's
//! f16 storage of results and intermediates (and its summation order), not
//! the rounding of the inputs. The tolerance of each comparison is
//! |gpu - cpu| ≤ rel·|cpu| + abs_frac·max|cpu| per element; a value of
//! 2^-11 ≈ 4.9e-4 is one f16 rounding. The emulator rounds exactly like the
//! GPU's conversions but does not contract a·b+c into FMAs and sums in its
//! own order, so it sits inside the same tolerances (checked there). Real
//! GPUs have run them too: every test passed on H100s and, with
//! `HEADROOM_REQUIRE_GPU=1`, on an NVIDIA H200 (the GPU bundles of a350b0d
//! and of 1597ca2; README, "Measured on an NVIDIA H200").

use std::io::Write as _;
use std::sync::{Mutex, MutexGuard, Once, OnceLock};

use cudarc::driver::CudaSlice;
use half::f16;
use headroom_model::cuda::ops::{
    self, BatchNormConfig, ConvAlgorithm, ConvPath, ConvPlan, ConvProduct, ConvShape, TunedConv,
};
use headroom_model::cuda::params::StepState;
use headroom_model::cuda::{
    blas_workspace_bytes, kernels, AnyView, CudaBackend, CudaBuildOptions, CudaError, CudaNetwork,
    CudaTensor, DType, InputStaging, Normalization, ParamGroup, ResidentImages, StateList,
    StatePiece, MAX_BLOCK_THREADS,
};
use headroom_model::init::InitRng;
use headroom_model::layers::{
    BatchNorm2d, Conv2d, DepthwiseConv2d, Dropout, FusedResidual, Gelu, GlobalAvgPool, LayerNorm,
    Linear, MaxPool2d, Relu, Residual, Silu, Upsample2x,
};
use headroom_model::loss::{
    focal_loss, pixel_mse, soft_cross_entropy, soft_focal_loss, softmax_cross_entropy, LossOutput,
};
use headroom_model::{CheckpointPolicy, Layer, Mode, ModelSpec, Network, Tensor};
use headroom_optim::{AdamWConfig, FusedAdamW, LossScaler, LossScalerConfig, StepOutcome};

/// A loss scaler that starts at `init_scale` and does not grow within a
/// test.
fn fixed_scaler(init_scale: f32) -> LossScalerConfig {
    LossScalerConfig {
        init_scale,
        ..LossScalerConfig::default()
    }
}
use serde::Deserialize;

#[path = "../../../../tests/src/nvrtc_gate.rs"]
#[macro_use]
mod nvrtc_gate;

report_nvrtc_tests!(
    "cuda_parity",
    &[
        include_str!("main.rs"),
        include_str!("cast.rs"),
        include_str!("activation.rs"),
        include_str!("pool.rs"),
        include_str!("batch_norm.rs"),
        include_str!("bf16.rs"),
        include_str!("conv.rs"),
        include_str!("linear.rs"),
        include_str!("layer_norm.rs"),
        include_str!("loss.rs"),
        include_str!("optim.rs"),
        include_str!("network.rs"),
        include_str!("frames.rs"),
        include_str!("sequence.rs"),
    ]
    .concat()
);

// ---------------------------------------------------------------------------
// Harness

fn env_is_1(name: &str) -> bool {
    std::env::var(name).as_deref() == Ok("1")
}

fn require_gpu() -> bool {
    env_is_1("HEADROOM_REQUIRE_GPU")
}

/// Set by CI: what these tests need without a GPU (NVRTC, the emulator)
/// must be there, so a skip would hide a regression.
fn require_nvrtc() -> bool {
    env_is_1("HEADROOM_REQUIRE_NVRTC")
}

/// Writes past libtest's output capture, so that the line is seen in a
/// plain `cargo test` (once per test binary).
fn announce(line: &str) {
    let _ = writeln!(std::io::stderr(), "cuda_parity: {line}");
}

/// Whether the tests run on the emulator (decided once, before anything
/// touches the CUDA driver: cudarc stays bound to the first driver library
/// it loads).
fn emulated() -> bool {
    static EMULATED: OnceLock<bool> = OnceLock::new();
    *EMULATED.get_or_init(|| {
        !require_gpu()
            && (env_is_1("HEADROOM_CUDA_EMULATE") || !headroom_cuda_emu::real_gpu_present())
    })
}

fn open_backend() -> Result<CudaBackend, String> {
    let emulate = emulated();
    if emulate {
        if let Err(e) = headroom_cuda_emu::install_with_widest_block(MAX_BLOCK_THREADS) {
            assert!(
                !require_nvrtc(),
                "HEADROOM_REQUIRE_NVRTC=1 but the CUDA emulator is unavailable: {e}"
            );
            return Err(format!("the CPU emulator of CUDA is unavailable: {e}"));
        }
    }
    let info = match CudaBackend::probe() {
        Ok(Some(info)) => info,
        Ok(None) => {
            assert!(
                !emulate,
                "the emulator is installed but the probe found no device"
            );
            assert!(
                !require_gpu(),
                "HEADROOM_REQUIRE_GPU=1 but no GPU was found"
            );
            return Err("the probe found no CUDA driver or GPU".into());
        }
        Err(e) => panic!("probing CUDA failed: {e}"),
    };
    if emulate {
        assert_eq!(info.name, headroom_cuda_emu::DEVICE_NAME, "{info}");
    }
    match CudaBackend::new(0) {
        Ok(be) => {
            announce(&format!("running on {info}"));
            Ok(be)
        }
        // The emulator needs NVRTC only to validate the kernels as the GPU
        // path does; a fresh machine may lack it.
        Err(e @ CudaError::LibraryMissing { .. }) if emulate && !require_nvrtc() => Err(format!(
            "{e} (this binary was built expecting NVRTC; HEADROOM_REQUIRE_NVRTC=1 makes \
             this a failure)"
        )),
        // A device that is there but cannot be used is a failure, not a skip.
        Err(e) => panic!("the CUDA backend failed to open on {info}: {e}"),
    }
}

/// The shared backend, one test at a time (simpler to read, and the tests
/// that change the memory budget make their own backend anyway).
fn gpu() -> Option<MutexGuard<'static, CudaBackend>> {
    static BE: OnceLock<Result<Mutex<CudaBackend>, String>> = OnceLock::new();
    static SKIP: Once = Once::new();
    match BE.get_or_init(|| open_backend().map(Mutex::new)) {
        Ok(m) => Some(m.lock().unwrap_or_else(|p| p.into_inner())),
        Err(why) => {
            SKIP.call_once(|| announce(&format!("SKIPPED, every test: {why}")));
            None
        }
    }
}

macro_rules! gpu_or_skip {
    () => {
        match gpu() {
            Some(be) => be,
            None => return,
        }
    };
}

/// The mixed-precision network input of pixels normalised by (mean, std).
fn f16_input(mean: f32, std: f32) -> Normalization {
    Normalization {
        mean,
        std,
        dtype: DType::F16,
    }
}

fn h(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// Normal values times `scale`, plus `offset·(channel + 1)` along the last
/// axis, rounded to f16.
fn random(shape: &[usize], seed: u64, scale: f32, offset: f32) -> Tensor {
    let mut rng = InitRng::new(seed);
    let c = *shape.last().unwrap_or(&1);
    let len: usize = shape.iter().product();
    let data = (0..len)
        .map(|i| h(offset * ((i % c.max(1)) as f32 + 1.0) + scale * rng.normal() as f32))
        .collect();
    Tensor::from_vec(shape, data).unwrap()
}

fn random_vec(len: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = InitRng::new(seed);
    (0..len).map(|_| h(scale * rng.normal() as f32)).collect()
}

/// Rounds a CPU tensor's values to f16 in place.
fn round_f16(t: &mut Tensor) {
    for v in t.data_mut() {
        *v = h(*v);
    }
}

fn upload(be: &CudaBackend, t: &Tensor) -> CudaTensor {
    CudaTensor::from_tensor(be, t, DType::F16).unwrap()
}

fn upload_f32(be: &CudaBackend, data: &[f32]) -> CudaSlice<f32> {
    be.compute_stream().clone_htod(data).unwrap()
}

fn upload_f16(be: &CudaBackend, data: &[f32]) -> CudaSlice<f16> {
    let v: Vec<f16> = data.iter().map(|&x| f16::from_f32(x)).collect();
    be.compute_stream().clone_htod(&v).unwrap()
}

fn download(be: &CudaBackend, s: &CudaSlice<f32>) -> Vec<f32> {
    be.download(s).unwrap()
}

/// |gpu - cpu| ≤ rel·|cpu| + abs_frac·max|cpu| for every element; NaN only
/// where the CPU has NaN.
fn assert_close(what: &str, gpu: &[f32], cpu: &[f32], rel: f32, abs_frac: f32) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: lengths");
    let scale = cpu
        .iter()
        .filter(|v| v.is_finite())
        .fold(0.0f32, |m, v| m.max(v.abs()));
    let abs = abs_frac * scale;
    let mut worst = (0.0f32, 0usize);
    for (i, (&g, &c)) in gpu.iter().zip(cpu).enumerate() {
        if c.is_nan() || g.is_nan() {
            assert!(c.is_nan() && g.is_nan(), "{what}[{i}]: gpu {g}, cpu {c}");
            continue;
        }
        let err = (g - c).abs();
        let allowed = rel * c.abs() + abs;
        assert!(
            err <= allowed,
            "{what}[{i}]: gpu {g}, cpu {c}, error {err:e} > {allowed:e} (rel {rel}, abs {abs_frac}·{scale})"
        );
        if err / allowed.max(f32::MIN_POSITIVE) > worst.0 {
            worst = (err / allowed.max(f32::MIN_POSITIVE), i);
        }
    }
    eprintln!(
        "{what}: {} elements, worst at {} ({:.2} of the tolerance)",
        cpu.len(),
        worst.1,
        worst.0
    );
}

/// A loss op's device result against the CPU loss: the gradient, divided by
/// `unscale` (the loss scale times the share), within `grad_tol` (rel, abs
/// as `assert_close`); the mean loss within `loss_rel` of the CPU's (of 1
/// where the loss is smaller); the count of correct rows exactly.
fn assert_loss_matches(
    be: &CudaBackend,
    what: &str,
    out: &ops::XentOutput,
    cpu: &LossOutput,
    unscale: f32,
    grad_tol: (f32, f32),
    loss_rel: f32,
) {
    let grad: Vec<f32> = out
        .grad
        .to_host(be)
        .unwrap()
        .iter()
        .map(|g| g / unscale)
        .collect();
    assert_close(
        &format!("{what} grad"),
        &grad,
        cpu.grad.data(),
        grad_tol.0,
        grad_tol.1,
    );
    let (loss, correct) = out.read_summary(be).unwrap();
    assert!(
        (loss - cpu.loss).abs() <= loss_rel * cpu.loss.abs().max(1.0),
        "{what}: loss {loss} vs {}",
        cpu.loss
    );
    assert_eq!(correct as usize, cpu.correct, "{what}: correct");
}

/// ‖gpu - cpu‖₂ / ‖cpu‖₂ ≤ tol: for compositions whose ReLU masks may differ
/// at a few elements within rounding of zero, where an element-wise bound
/// would measure the mask, not the arithmetic.
fn assert_close_l2(what: &str, gpu: &[f32], cpu: &[f32], tol: f64) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: lengths");
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&g, &c) in gpu.iter().zip(cpu) {
        num += (g as f64 - c as f64).powi(2);
        den += (c as f64).powi(2);
    }
    let rel = (num / den.max(f64::MIN_POSITIVE)).sqrt();
    eprintln!("{what}: relative L2 error {rel:.2e}");
    assert!(rel <= tol, "{what}: relative L2 error {rel:e} > {tol:e}");
}

mod activation;
mod batch_norm;
mod bf16;
mod cast;
mod collective;
mod conv;
mod frames;
mod layer_norm;
mod linear;
mod loss;
mod network;
mod optim;
mod pool;
mod sequence;

use batch_norm::{bn_case, BN};
use conv::{kernel_runs, NARROW_KERNELS};
use network::{assert_matches_cpu, cpu_run, small_network_matches_the_cpu, SpecFile, Tolerances};

// ---------------------------------------------------------------------------
// Coverage

/// Which test runs each kernel against its CPU reference. A kernel added to
/// `kernels::FILES` without a line here (and so, presumably, without a
/// parity test) fails `every_kernel_has_a_parity_test`.
const COVERAGE: &[(&str, &str)] = &[
    ("relu_forward_f32", "an_f32_network_matches_the_cpu_network"),
    (
        "relu_backward_f32",
        "an_f32_network_matches_the_cpu_network",
    ),
    ("silu_forward_f16", "silu_and_gelu_match_the_cpu_layers"),
    ("silu_forward_f32", "silu_and_gelu_match_the_cpu_layers"),
    ("silu_backward_f16", "silu_and_gelu_match_the_cpu_layers"),
    ("silu_backward_f32", "silu_and_gelu_match_the_cpu_layers"),
    ("gelu_forward_f16", "silu_and_gelu_match_the_cpu_layers"),
    ("gelu_forward_f32", "silu_and_gelu_match_the_cpu_layers"),
    ("gelu_backward_f16", "silu_and_gelu_match_the_cpu_layers"),
    ("gelu_backward_f32", "silu_and_gelu_match_the_cpu_layers"),
    (
        "embedding_forward_f16",
        "token_networks_match_the_cpu_network",
    ),
    (
        "embedding_forward_f32",
        "token_networks_match_the_cpu_network",
    ),
    (
        "embedding_grad_table_f16",
        "token_networks_match_the_cpu_network",
    ),
    (
        "embedding_grad_table_f32",
        "the_embedding_table_gradient_sums_rows_in_order",
    ),
    (
        "embedding_grad_positions_f16",
        "token_networks_match_the_cpu_network",
    ),
    (
        "embedding_grad_positions_f32",
        "token_networks_match_the_cpu_network",
    ),
    (
        "attention_forward_f16",
        "token_networks_match_the_cpu_network",
    ),
    (
        "attention_forward_f32",
        "token_networks_match_the_cpu_network",
    ),
    (
        "attention_backward_query_f16",
        "token_networks_match_the_cpu_network",
    ),
    (
        "attention_backward_query_f32",
        "token_networks_match_the_cpu_network",
    ),
    (
        "attention_backward_key_f16",
        "token_networks_match_the_cpu_network",
    ),
    (
        "attention_backward_key_f32",
        "token_networks_match_the_cpu_network",
    ),
    (
        "lstm_cell_forward_f16",
        "token_networks_match_the_cpu_network",
    ),
    (
        "lstm_cell_forward_f32",
        "token_networks_match_the_cpu_network",
    ),
    (
        "lstm_cell_backward_f16",
        "token_networks_match_the_cpu_network",
    ),
    (
        "lstm_cell_backward_f32",
        "token_networks_match_the_cpu_network",
    ),
    (
        "frames_step_concat_f16",
        "frame_networks_match_the_cpu_network",
    ),
    (
        "frames_step_concat_f32",
        "frame_networks_match_the_cpu_network",
    ),
    (
        "frames_step_split_f16",
        "frame_networks_match_the_cpu_network",
    ),
    (
        "frames_step_split_f32",
        "frame_networks_match_the_cpu_network",
    ),
    (
        "conv_lstm_cell_forward_f16",
        "frame_networks_match_the_cpu_network",
    ),
    (
        "conv_lstm_cell_forward_f32",
        "frame_networks_match_the_cpu_network",
    ),
    (
        "conv_lstm_cell_backward_f16",
        "frame_networks_match_the_cpu_network",
    ),
    (
        "conv_lstm_cell_backward_f32",
        "frame_networks_match_the_cpu_network",
    ),
    (
        "conv_lstm_cell_forward_cells_f16",
        "frame_networks_match_the_cpu_network",
    ),
    (
        "conv_lstm_cell_forward_cells_f32",
        "frame_networks_match_the_cpu_network",
    ),
    (
        "conv_lstm_cell_backward_rerun_f16",
        "frame_networks_match_the_cpu_network",
    ),
    (
        "conv_lstm_cell_backward_rerun_f32",
        "frame_networks_match_the_cpu_network",
    ),
    (
        "conv_lstm_cell_forward_cells_f16",
        "a_checkpointed_conv_lstm_keeps_its_cells_only",
    ),
    (
        "conv_lstm_cell_backward_rerun_f16",
        "a_checkpointed_conv_lstm_keeps_its_cells_only",
    ),
    ("pixel_mse_f16", "pixel_mse_matches_the_cpu_loss"),
    ("pixel_mse_f32", "pixel_mse_matches_the_cpu_loss"),
    ("layer_norm_forward_f16", "layer_norm_matches_the_cpu_layer"),
    ("layer_norm_forward_f32", "layer_norm_matches_the_cpu_layer"),
    (
        "layer_norm_backward_f16",
        "layer_norm_matches_the_cpu_layer",
    ),
    (
        "layer_norm_backward_f32",
        "layer_norm_matches_the_cpu_layer",
    ),
    (
        "layer_norm_grad_partial_f16",
        "layer_norm_matches_the_cpu_layer",
    ),
    (
        "layer_norm_grad_partial_f32",
        "layer_norm_matches_the_cpu_layer",
    ),
    (
        "layer_norm_grad_finalize",
        "layer_norm_matches_the_cpu_layer",
    ),
    (
        "dropout_apply_f16",
        "dropout_draws_the_cpu_layers_masks_from_the_device_counter",
    ),
    (
        "dropout_apply_f32",
        "dropout_draws_the_cpu_layers_masks_from_the_device_counter",
    ),
    (
        "dropout_count",
        "dropout_draws_the_cpu_layers_masks_from_the_device_counter",
    ),
    (
        "dropout_counter_restore",
        "dropout_draws_the_cpu_layers_masks_from_the_device_counter",
    ),
    ("softmax_focal_f16", "focal_loss_matches_the_cpu_loss"),
    ("softmax_focal_f32", "focal_loss_matches_the_cpu_loss"),
    ("softmax_focal_soft_f16", "focal_loss_matches_the_cpu_loss"),
    ("softmax_focal_soft_f32", "focal_loss_matches_the_cpu_loss"),
    (
        "upsample2x_forward_f16",
        "upsample2x_and_the_channel_concat_match_the_cpu",
    ),
    (
        "upsample2x_forward_f32",
        "upsample2x_and_the_channel_concat_match_the_cpu",
    ),
    (
        "upsample2x_backward_f16",
        "upsample2x_and_the_channel_concat_match_the_cpu",
    ),
    (
        "upsample2x_backward_f32",
        "upsample2x_and_the_channel_concat_match_the_cpu",
    ),
    (
        "channels_concat_f16",
        "upsample2x_and_the_channel_concat_match_the_cpu",
    ),
    (
        "channels_concat_f32",
        "upsample2x_and_the_channel_concat_match_the_cpu",
    ),
    (
        "channels_split_f16",
        "upsample2x_and_the_channel_concat_match_the_cpu",
    ),
    (
        "channels_split_f32",
        "upsample2x_and_the_channel_concat_match_the_cpu",
    ),
    ("add_inplace_f32", "an_f32_network_matches_the_cpu_network"),
    ("add_f32", "an_f32_network_matches_the_cpu_network"),
    ("bias_add_f32", "an_f32_network_matches_the_cpu_network"),
    ("bias_grad_f32", "an_f32_network_matches_the_cpu_network"),
    (
        "bn_stats_partial_f32",
        "an_f32_network_matches_the_cpu_network",
    ),
    ("bn_apply_f32", "an_f32_network_matches_the_cpu_network"),
    ("bn_apply_add_f32", "an_f32_network_matches_the_cpu_network"),
    (
        "bn_backward_partial_f32",
        "an_f32_network_matches_the_cpu_network",
    ),
    (
        "bn_backward_partial_mask_f32",
        "an_f32_network_matches_the_cpu_network",
    ),
    (
        "bn_backward_apply_f32",
        "an_f32_network_matches_the_cpu_network",
    ),
    (
        "global_avg_pool_forward_f32",
        "an_f32_network_matches_the_cpu_network",
    ),
    (
        "global_avg_pool_backward_f32",
        "an_f32_network_matches_the_cpu_network",
    ),
    ("softmax_xent_f32", "an_f32_network_matches_the_cpu_network"),
    (
        "softmax_xent_soft_f32",
        "an_f32_network_matches_the_cpu_network",
    ),
    ("im2col_f32", "an_f32_network_matches_the_cpu_network"),
    ("col2im_f32", "an_f32_network_matches_the_cpu_network"),
    (
        "bn_apply_v8_f16",
        "batch_norm_training_forward_backward_and_running_stats_match",
    ),
    (
        "bn_backward_apply_v8_f16",
        "batch_norm_training_forward_backward_and_running_stats_match",
    ),
    (
        "bn_apply_add_v8_f16",
        "a_fused_basic_block_matches_the_cpu_fused_residual",
    ),
    (
        "im2col_v8_f16",
        "convolution_matches_the_cpu_layer_for_the_reference_shapes",
    ),
    (
        "col2im_v8_f16",
        "convolution_matches_the_cpu_layer_for_the_reference_shapes",
    ),
    (
        "implicit_conv_n32_f16",
        "implicit_gemm_convolution_matches_the_cpu_layer",
    ),
    (
        "narrow_forward_f16",
        "narrow_convolution_matches_the_cpu_layer",
    ),
    (
        "narrow_forward_f32",
        "narrow_convolution_matches_the_cpu_layer",
    ),
    (
        "narrow_grad_input_f16",
        "narrow_convolution_matches_the_cpu_layer",
    ),
    (
        "narrow_grad_input_f32",
        "narrow_convolution_matches_the_cpu_layer",
    ),
    (
        "narrow_wgrad_f16",
        "narrow_convolution_matches_the_cpu_layer",
    ),
    (
        "narrow_wgrad_f32",
        "narrow_convolution_matches_the_cpu_layer",
    ),
    ("thin_forward_f16", "thin_convolution_matches_the_cpu_layer"),
    ("thin_wgrad_f16", "thin_convolution_matches_the_cpu_layer"),
    (
        "implicit_conv_n64_f16",
        "implicit_gemm_convolution_matches_the_cpu_layer",
    ),
    (
        "implicit_dgrad_n32_f16",
        "implicit_gemm_convolution_matches_the_cpu_layer",
    ),
    (
        "implicit_dgrad_n64_f16",
        "implicit_gemm_convolution_matches_the_cpu_layer",
    ),
    (
        "implicit_wgrad_n32_f16",
        "implicit_gemm_convolution_matches_the_cpu_layer",
    ),
    (
        "implicit_wgrad_n64_f16",
        "implicit_gemm_convolution_matches_the_cpu_layer",
    ),
    (
        "implicit_wgrad_n128_f16",
        "implicit_gemm_convolution_matches_the_cpu_layer",
    ),
    (
        "wgrad_reduce",
        "implicit_gemm_convolution_matches_the_cpu_layer",
    ),
    (
        "rank_sum_f32",
        "the_ranks_sum_adds_in_rank_order_to_the_bits_of_the_cpu",
    ),
    ("cast_f32_to_f16", "casts_round_like_half_and_widen_exactly"),
    ("cast_f16_to_f32", "casts_round_like_half_and_widen_exactly"),
    ("normalize_u8_f16", "u8_batches_normalise_like_the_cpu"),
    (
        "gather_crop_flip_u8_f16",
        "batches_made_from_a_resident_set_equal_staged_host_batches",
    ),
    ("normalize_u8_f32", "u8_batches_normalise_like_the_cpu"),
    (
        "normalize_u8_f32",
        "batches_made_from_a_resident_set_equal_staged_host_batches",
    ),
    (
        "gather_crop_flip_u8_f32",
        "batches_made_from_a_resident_set_equal_staged_host_batches",
    ),
    (
        "relu_forward_f16",
        "relu_forward_and_backward_match_the_cpu_layer",
    ),
    (
        "relu_backward_f16",
        "relu_forward_and_backward_match_the_cpu_layer",
    ),
    ("add_inplace_f16", "residual_sums_match_the_cpu_residual"),
    ("add_f16", "residual_sums_match_the_cpu_residual"),
    ("bias_add_f16", "linear_matches_the_cpu_layer"),
    ("bias_grad_f16", "linear_matches_the_cpu_layer"),
    (
        "bn_stats_partial_f16",
        "batch_norm_training_forward_backward_and_running_stats_match",
    ),
    (
        "bn_stats_finalize",
        "batch_norm_training_forward_backward_and_running_stats_match",
    ),
    (
        "bn_eval_prepare",
        "batch_norm_eval_uses_the_running_statistics",
    ),
    (
        "bn_apply_f16",
        "batch_norm_training_forward_backward_and_running_stats_match",
    ),
    (
        "bn_apply_add_f16",
        "a_fused_basic_block_matches_the_cpu_fused_residual",
    ),
    (
        "bn_backward_partial_f16",
        "batch_norm_training_forward_backward_and_running_stats_match",
    ),
    (
        "bn_backward_partial_mask_f16",
        "fused_residual_kernels_round_like_the_unfused_ones",
    ),
    (
        "bn_stats_partial_v8_f16",
        "batch_norm_training_forward_backward_and_running_stats_match",
    ),
    (
        "bn_backward_partial_v8_f16",
        "batch_norm_training_forward_backward_and_running_stats_match",
    ),
    (
        "bn_backward_partial_mask_v8_f16",
        "fused_residual_kernels_round_like_the_unfused_ones",
    ),
    (
        "bn_backward_finalize",
        "batch_norm_with_fused_relu_matches_bn_then_relu",
    ),
    (
        "bn_backward_apply_f16",
        "batch_norm_with_fused_relu_matches_bn_then_relu",
    ),
    (
        "global_avg_pool_forward_f16",
        "global_average_pooling_matches_the_cpu_layer",
    ),
    (
        "global_avg_pool_backward_f16",
        "global_average_pooling_matches_the_cpu_layer",
    ),
    (
        "softmax_xent_f16",
        "softmax_cross_entropy_matches_the_cpu_loss",
    ),
    (
        "softmax_xent_soft_f16",
        "soft_target_cross_entropy_matches_the_cpu_loss",
    ),
    ("xent_reduce", "softmax_cross_entropy_matches_the_cpu_loss"),
    (
        "im2col_f16",
        "convolution_matches_the_cpu_layer_for_the_reference_shapes",
    ),
    (
        "col2im_f16",
        "convolution_matches_the_cpu_layer_for_the_reference_shapes",
    ),
    (
        "grad_sumsq",
        "fused_adamw_matches_the_reference_step_with_clipping_and_loss_scaling",
    ),
    (
        "step_finalize",
        "an_inf_or_nan_gradient_skips_the_step_and_backs_off_the_scale",
    ),
    (
        "step_finalize",
        "the_device_loss_scaler_follows_the_reference_rule",
    ),
    (
        "step_finalize",
        "the_device_picks_the_learning_rate_of_the_t_it_finds",
    ),
    (
        "adamw_check",
        "an_update_that_would_overflow_is_refused_and_the_scale_kept",
    ),
    (
        "adamw_check_f32",
        "an_update_that_would_overflow_is_refused_and_the_scale_kept",
    ),
    (
        "step_commit",
        "an_update_that_would_overflow_is_refused_and_the_scale_kept",
    ),
    (
        "step_commit",
        "the_device_loss_scaler_follows_the_reference_rule",
    ),
    (
        "bn_running_restore",
        "running_statistics_are_put_back_only_after_a_skipped_step",
    ),
    (
        "depthwise_forward_f16",
        "depthwise_convolution_matches_the_cpu_layer_bit_for_bit",
    ),
    (
        "depthwise_forward_f32",
        "depthwise_convolution_matches_the_cpu_layer_bit_for_bit",
    ),
    (
        "depthwise_backward_input_f16",
        "depthwise_convolution_matches_the_cpu_layer_bit_for_bit",
    ),
    (
        "depthwise_backward_input_f32",
        "depthwise_convolution_matches_the_cpu_layer_bit_for_bit",
    ),
    (
        "depthwise_wgrad_partial_f16",
        "depthwise_convolution_matches_the_cpu_layer_bit_for_bit",
    ),
    (
        "depthwise_wgrad_partial_f32",
        "depthwise_convolution_matches_the_cpu_layer_bit_for_bit",
    ),
    (
        "depthwise_wgrad_reduce",
        "depthwise_convolution_matches_the_cpu_layer_bit_for_bit",
    ),
    (
        "max_pool_forward_f16",
        "max_pooling_matches_the_cpu_layer_bit_for_bit",
    ),
    (
        "max_pool_forward_f32",
        "max_pooling_matches_the_cpu_layer_bit_for_bit",
    ),
    (
        "max_pool_forward_train_f16",
        "max_pooling_matches_the_cpu_layer_bit_for_bit",
    ),
    (
        "max_pool_forward_train_f32",
        "max_pooling_matches_the_cpu_layer_bit_for_bit",
    ),
    (
        "max_pool_backward_f16",
        "max_pooling_matches_the_cpu_layer_bit_for_bit",
    ),
    (
        "max_pool_backward_f32",
        "max_pooling_matches_the_cpu_layer_bit_for_bit",
    ),
    (
        "adamw_fused",
        "fused_adamw_matches_the_reference_step_with_clipping_and_loss_scaling",
    ),
    (
        "adamw_fused_f32",
        "fused_adamw_matches_the_reference_step_with_clipping_and_loss_scaling",
    ),
];

#[test]
fn every_kernel_has_a_parity_test() {
    let declared: Vec<&str> = kernels::FILES
        .iter()
        .flat_map(|f| f.kernels.iter().map(|k| k.name))
        .collect();
    for name in &declared {
        assert!(
            COVERAGE.iter().any(|(k, _)| k == name),
            "kernel {name} has no parity test: write one and list it in COVERAGE"
        );
    }
    for (k, _) in COVERAGE {
        assert!(
            declared.contains(k),
            "COVERAGE names {k}, which no kernel file declares"
        );
    }
}

#[test]
fn the_emulator_compiles_exactly_the_declared_kernels() {
    if !emulated() {
        announce("the_emulator_compiles_exactly_the_declared_kernels: skipped on a real GPU");
        return;
    }
    let compiled = match headroom_cuda_emu::kernel_names() {
        Ok(names) => names,
        Err(e) => {
            assert!(!require_nvrtc(), "HEADROOM_REQUIRE_NVRTC=1 but {e}");
            return;
        }
    };
    let mut declared: Vec<String> = kernels::FILES
        .iter()
        .flat_map(|f| f.kernels.iter().map(|k| k.name.to_string()))
        .collect();
    declared.sort();
    // Both sides read the same .cu files: a mismatch means a kernel the Rust
    // side does not know (or a declaration build.rs could not parse).
    assert_eq!(compiled, declared);
}
