//! Every CUDA op against the CPU layer it replaces: random inputs, the CPU
//! layer's forward and backward, the CUDA op, and a comparison with a stated
//! tolerance.
//!
//! One file, two devices. On a machine with a GPU the tests run on it; on
//! one without, they run on the CPU emulator (`headroom-cuda-emu`: a fake
//! CUDA driver and cuBLAS into which every kernel of `crates/model/kernels`
//! is compiled as host C++), through the same `CudaBackend`, op wrappers,
//! launch configurations, im2col + GEMM compositions, fused optimizer and
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
    BatchNorm2d, Conv2d, Dropout, FusedResidual, Gelu, GlobalAvgPool, LayerNorm, Linear, Relu,
    Residual, Silu, Upsample2x,
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

#[path = "../../../tests/src/nvrtc_gate.rs"]
#[macro_use]
mod nvrtc_gate;

report_nvrtc_tests!("cuda_parity", include_str!("cuda_parity.rs"));

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

// ---------------------------------------------------------------------------
// Casts and input

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn casts_round_like_half_and_widen_exactly() {
    let be = gpu_or_skip!();
    let mut values = random_vec(1000, 1, 10.0);
    // Unrounded values, overflow, subnormals, signed zero, NaN, infinities.
    values.extend([
        0.1,
        1.0 / 3.0,
        65504.0,
        65519.0,
        65520.0,
        1e6,
        -1e6,
        1e-8,
        3e-8,
        6e-8,
        -0.0,
        0.0,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        2049.0,
        2051.0,
    ]);
    let x = CudaTensor::from_host(&be, &[values.len()], &values, DType::F32).unwrap();
    let y = ops::cast_f32_to_f16(&be, &x).unwrap();
    let got: Vec<f16> = be.download(y.f16().unwrap()).unwrap();
    for (i, (&g, &v)) in got.iter().zip(&values).enumerate() {
        let want = f16::from_f32(v);
        assert!(
            g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
            "f32→f16 of {v} at {i}: gpu {g} ({:#06x}), half {want} ({:#06x})",
            g.to_bits(),
            want.to_bits()
        );
    }
    let back = ops::cast_f16_to_f32(&be, &y).unwrap().to_host(&be).unwrap();
    for (i, (&b, &g)) in back.iter().zip(&got).enumerate() {
        assert!(
            b.to_bits() == g.to_f32().to_bits() || (b.is_nan() && g.is_nan()),
            "f16→f32 at {i}"
        );
    }
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn u8_batches_normalise_like_the_cpu() {
    let be = gpu_or_skip!();
    let shape = [4, 28, 28, 1];
    let mut rng = InitRng::new(2);
    let pixels: Vec<u8> = (0..shape.iter().product())
        .map(|_| (rng.next_u64() % 256) as u8)
        .collect();
    let (mean, std) = (0.2860, 0.3530);
    let cpu = Tensor::from_u8_normalized(&shape, &pixels, mean, std).unwrap();
    let dev = be.upload(&pixels).unwrap();
    let gpu = ops::normalize_u8(&be, &dev.slice.as_view(), &shape, f16_input(mean, std)).unwrap();
    // One f16 rounding of the f32 value (the GPU may fuse the multiply-add).
    assert_close(
        "normalize_u8",
        &gpu.to_host(&be).unwrap(),
        cpu.data(),
        1e-3,
        1e-4,
    );
    // f32 training's input: the f32 value itself, up to that fused rounding.
    let f32_input = Normalization {
        mean,
        std,
        dtype: DType::F32,
    };
    let gpu = ops::normalize_u8(&be, &dev.slice.as_view(), &shape, f32_input).unwrap();
    assert_eq!(gpu.dtype(), DType::F32);
    assert_close(
        "normalize_u8 f32",
        &gpu.to_host(&be).unwrap(),
        cpu.data(),
        1e-6,
        1e-6,
    );
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn staged_batches_arrive_normalised_with_their_labels() {
    let be = gpu_or_skip!();
    let shape = [8, 28, 28, 1];
    let per_batch: usize = shape.iter().product();
    let mut staging = InputStaging::new(&be, 2, per_batch, 8).unwrap();
    let mut kept = Vec::new();
    // Three batches through two slots: the third reuses the first slot while
    // the first batch's tensors are still alive.
    for b in 0..3u64 {
        let mut rng = InitRng::new(10 + b);
        let pixels: Vec<u8> = (0..per_batch)
            .map(|_| (rng.next_u64() % 256) as u8)
            .collect();
        let labels: Vec<u32> = (0..8).map(|i| (i + b as u32) % 10).collect();
        let staged = staging
            .stage(&be, &shape, &pixels, &labels, 10, f16_input(0.5, 0.25))
            .unwrap();
        kept.push((pixels, labels, staged));
    }
    for (pixels, labels, staged) in &kept {
        let cpu = Tensor::from_u8_normalized(&shape, pixels, 0.5, 0.25).unwrap();
        assert_close(
            "staged images",
            &staged.images.to_host(&be).unwrap(),
            cpu.data(),
            1e-3,
            1e-4,
        );
        assert_eq!(&be.download(&staged.labels.slice).unwrap(), labels);
    }
    let err = staging
        .stage(
            &be,
            &shape,
            &vec![0u8; per_batch],
            &[10; 8],
            10,
            f16_input(0.5, 0.25),
        )
        .unwrap_err();
    assert!(err.to_string().contains("label 10"), "{err}");
}

/// The loader's crop and flip, pixel by pixel (an independent reference):
/// output (y, x) is padded pixel (y + dy, x' + dx), x' = w - 1 - x if flipped.
fn crop_flip_reference(src: &[u8], [h, w, c]: [usize; 3], [_, word]: [u32; 2]) -> Vec<u8> {
    let (dy, dx) = ((word & 255) as i64, ((word >> 8) & 255) as i64);
    let (flip, pad) = ((word >> 16) & 1 == 1, (word >> 24) as i64);
    let mut out = Vec::with_capacity(h * w * c);
    for y in 0..h as i64 {
        for x in 0..w as i64 {
            let x = if flip { w as i64 - 1 - x } else { x };
            let (sy, sx) = (y + dy - pad, x + dx - pad);
            for ch in 0..c {
                let inside = (0..h as i64).contains(&sy) && (0..w as i64).contains(&sx);
                out.push(if inside {
                    src[((sy as usize * w) + sx as usize) * c + ch]
                } else {
                    0
                });
            }
        }
    }
    out
}

fn recipe(id: u32, pad: u32, dy: u32, dx: u32, flip: bool) -> [u32; 2] {
    [id, dy | dx << 8 | u32::from(flip) << 16 | pad << 24]
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn batches_made_from_a_resident_set_equal_staged_host_batches() {
    let be = gpu_or_skip!();
    let shape = [6, 5, 3];
    let sample: usize = shape.iter().product();
    let mut rng = InitRng::new(21);
    let set_pixels: Vec<u8> = (0..7 * sample)
        .map(|_| (rng.next_u64() % 256) as u8)
        .collect();
    let set = ResidentImages::upload(&be, shape, &set_pixels).unwrap();
    assert_eq!((set.samples(), set.bytes()), (7, 7 * sample as u64));
    let recipes = [
        recipe(6, 0, 0, 0, false),
        recipe(0, 2, 0, 4, true),
        recipe(3, 2, 4, 0, false),
        recipe(3, 2, 2, 2, true),
        recipe(1, 5, 10, 0, true),
        recipe(5, 1, 1, 2, false),
    ];
    let labels: Vec<u32> = (0..recipes.len() as u32).collect();
    let mut staging = InputStaging::new(&be, 2, 6 * sample, 6).unwrap();
    let mut host = Vec::new();
    for r in &recipes {
        let id = r[0] as usize;
        host.extend(crop_flip_reference(
            &set_pixels[id * sample..(id + 1) * sample],
            shape,
            *r,
        ));
    }
    let batch_shape = [recipes.len(), 6, 5, 3];
    // Twice through the ring per storage type, with a host batch between:
    // slots are shared.
    for dtype in [DType::F16, DType::F16, DType::F32, DType::F32] {
        let norm = Normalization {
            mean: 0.3,
            std: 0.4,
            dtype,
        };
        let made = staging
            .stage_recipes(&be, &set, &recipes, &labels, 8, norm)
            .unwrap();
        let staged = staging
            .stage(&be, &batch_shape, &host, &labels, 8, norm)
            .unwrap();
        assert_eq!(made.images.dtype(), dtype);
        let bits = |t: &CudaTensor| -> Vec<u32> {
            t.to_host(&be)
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        assert_eq!(made.images.shape(), &batch_shape);
        assert_eq!(bits(&made.images), bits(&staged.images), "same bits");
        assert_eq!(be.download(&made.labels.slice).unwrap(), labels);
    }
    for (bad, what) in [
        (recipe(7, 0, 0, 0, false), "id 7"),
        (recipe(0, 2, 5, 0, false), "dy 5"),
        (recipe(0, 6, 0, 0, false), "pad 6"),
        ([0, 1 << 17], "word"),
    ] {
        let err = staging
            .stage_recipes(&be, &set, &[bad], &[0], 8, f16_input(0.3, 0.4))
            .unwrap_err();
        assert!(err.to_string().contains(what), "{what}: {err}");
    }
}

// ---------------------------------------------------------------------------
// Elementwise layers

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn relu_forward_and_backward_match_the_cpu_layer() {
    let be = gpu_or_skip!();
    let mut x = random(&[4, 9, 9, 24], 3, 1.0, 0.0);
    x.data_mut()[5] = f32::NAN;
    let g = random(x.shape(), 4, 1.0, 0.0);
    let mut relu = Relu::new();
    let y = relu.forward(&x, Mode::Train).unwrap();
    let dx = relu.backward(&g).unwrap();
    let gy = ops::relu_forward(&be, &upload(&be, &x)).unwrap();
    let gdx = ops::relu_backward(&be, &upload(&be, &g), &gy).unwrap();
    // Same f16 inputs, exact operations: equal.
    assert_close(
        "relu forward",
        &gy.to_host(&be).unwrap(),
        y.data(),
        0.0,
        0.0,
    );
    assert_close(
        "relu backward",
        &gdx.to_host(&be).unwrap(),
        dx.data(),
        0.0,
        0.0,
    );
}

/// SiLU and GELU in f16 and f32 storage: the CPU layers' values and
/// gradients from the same inputs (f16: one rounding of each result).
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn silu_and_gelu_match_the_cpu_layers() {
    let be = gpu_or_skip!();
    // Wide enough to reach both tails of the sigmoid and the tanh.
    let mut x = random(&[4, 9, 9, 24], 31, 3.0, 0.0);
    x.data_mut()[7] = f32::NAN;
    let g = random(x.shape(), 32, 1.0, 0.0);
    for kind in [ops::Smooth::Silu, ops::Smooth::Gelu] {
        let mut layer: Box<dyn Layer> = match kind {
            ops::Smooth::Silu => Box::new(Silu::new()),
            ops::Smooth::Gelu => Box::new(Gelu::new()),
        };
        let y = layer.forward(&x, Mode::Train).unwrap();
        let dx = layer.backward(&g).unwrap();
        for (dtype, rel, abs) in [(DType::F16, 1e-3, 1e-4), (DType::F32, 1e-5, 1e-6)] {
            let what = format!("{} {dtype:?}", kind.name());
            let gx = CudaTensor::from_tensor(&be, &x, dtype).unwrap();
            let gg = CudaTensor::from_tensor(&be, &g, dtype).unwrap();
            let gy = ops::smooth_forward(&be, kind, &gx).unwrap();
            let gdx = ops::smooth_backward(&be, kind, &gg, &gx).unwrap();
            assert_close(
                &format!("{what} forward"),
                &gy.to_host(&be).unwrap(),
                y.data(),
                rel,
                abs,
            );
            assert_close(
                &format!("{what} backward"),
                &gdx.to_host(&be).unwrap(),
                dx.data(),
                rel,
                abs,
            );
        }
    }
}

/// Dropout draws the CPU layer's masks from the counter on the device:
/// forward with the counter, a count, backward (and a recomputation) with
/// the counter before it; at a counter past 2^32 and a seed past 2^32 too.
/// A skipped step's verdict puts the counter back; an applied one does not.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn dropout_draws_the_cpu_layers_masks_from_the_device_counter() {
    let be = gpu_or_skip!();
    let x = random(&[3, 7, 5, 8], 41, 1.0, 0.0);
    let g = random(x.shape(), 42, 1.0, 0.0);
    let seed = 0x0123_4567_89AB_CDEF;
    let mask = ops::DropoutMask { p: 0.3, seed };
    for start in [0u64, 0x1234_5678_9ABC] {
        let limbs: Vec<f32> = (0..4)
            .map(|l| ((start >> (16 * l)) & 0xffff) as f32)
            .collect();
        let mut cpu = Dropout::new(0.3, seed).unwrap();
        cpu.buffers_mut()[0].data_mut().copy_from_slice(&limbs);
        let y = cpu.forward(&x, Mode::Train).unwrap();
        let dx = cpu.backward(&g).unwrap();
        let y_next = cpu.forward(&x, Mode::Train).unwrap();
        assert!(
            y.data() != y_next.data(),
            "the next forward draws a new mask"
        );
        let after: Vec<f32> = cpu.buffers_mut()[0].data().to_vec();
        for (dtype, rel) in [(DType::F32, 0.0), (DType::F16, 1e-3)] {
            let what = format!("dropout from counter {start:#x} {dtype:?}");
            let mut counter = upload_f32(&be, &limbs);
            let gx = CudaTensor::from_tensor(&be, &x, dtype).unwrap();
            let gy = ops::dropout_apply(&be, mask, &counter, false, &gx).unwrap();
            ops::dropout_count(&be, mask, &mut counter).unwrap();
            let again = ops::dropout_apply(&be, mask, &counter, true, &gx).unwrap();
            let gg = CudaTensor::from_tensor(&be, &g, dtype).unwrap();
            let gdx = ops::dropout_apply(&be, mask, &counter, true, &gg).unwrap();
            let gy_next = ops::dropout_apply(&be, mask, &counter, false, &gx).unwrap();
            ops::dropout_count(&be, mask, &mut counter).unwrap();
            let gy = gy.to_host(&be).unwrap();
            assert_close(&format!("{what} forward"), &gy, y.data(), rel, 0.0);
            assert_eq!(gy, again.to_host(&be).unwrap(), "{what}: recomputed");
            assert_close(
                &format!("{what} backward"),
                &gdx.to_host(&be).unwrap(),
                dx.data(),
                rel,
                0.0,
            );
            assert_close(
                &format!("{what} next"),
                &gy_next.to_host(&be).unwrap(),
                y_next.data(),
                rel,
                0.0,
            );
            assert_eq!(download(&be, &counter), after, "{what}: counter");
        }
    }
    let saved = [1.0f32, 2.0, 0.0, 0.0];
    let live = [3.0f32, 2.0, 0.0, 0.0];
    for skipped in [0u32, 1] {
        let verdict = be
            .compute_stream()
            .clone_htod(&[StepState {
                skipped,
                ..StepState::default()
            }])
            .unwrap();
        let mut counter = upload_f32(&be, &live);
        let saved_d = upload_f32(&be, &saved);
        ops::dropout_restore_if_skipped(&be, mask, &verdict, &saved_d, &mut counter).unwrap();
        let expected = if skipped == 1 { saved } else { live };
        assert_eq!(download(&be, &counter), expected, "skipped = {skipped}");
    }
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn residual_sums_match_the_cpu_residual() {
    let be = gpu_or_skip!();
    let x = random(&[4, 7, 7, 32], 5, 1.0, 0.0);
    let g = random(x.shape(), 6, 1.0, 0.0);
    let mut res = Residual::new(vec![Box::new(Relu::new())]);
    let y = res.forward(&x, Mode::Train).unwrap();
    let dx = res.backward(&g).unwrap();

    let gx = upload(&be, &x);
    let body = ops::relu_forward(&be, &gx).unwrap();
    let mut gy = ops::relu_forward(&be, &gx).unwrap();
    ops::add_inplace(&be, &mut gy, &gx).unwrap();
    let gg = upload(&be, &g);
    let mut gdx = ops::relu_backward(&be, &gg, &body).unwrap();
    ops::add_inplace(&be, &mut gdx, &gg).unwrap();
    // One f16 rounding of an exact f32 sum.
    assert_close(
        "residual forward",
        &gy.to_host(&be).unwrap(),
        y.data(),
        1e-3,
        0.0,
    );
    assert_close(
        "residual backward",
        &gdx.to_host(&be).unwrap(),
        dx.data(),
        1e-3,
        0.0,
    );
    let sum = ops::add(&be, &body, &gx).unwrap();
    assert_close("add", &sum.to_host(&be).unwrap(), y.data(), 1e-3, 0.0);
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn global_average_pooling_matches_the_cpu_layer() {
    let be = gpu_or_skip!();
    let x = random(&[6, 7, 7, 128], 7, 1.0, 0.5);
    let g = random(&[6, 128], 8, 1.0, 0.0);
    let mut pool = GlobalAvgPool::new();
    let y = pool.forward(&x, Mode::Train).unwrap();
    let dx = pool.backward(&g).unwrap();
    let gy = ops::global_avg_pool_forward(&be, &upload(&be, &x)).unwrap();
    let gdx = ops::global_avg_pool_backward(&be, &upload(&be, &g), x.shape()).unwrap();
    // f32 sums of 49 values in another order, then one f16 rounding.
    assert_close(
        "pool forward",
        &gy.to_host(&be).unwrap(),
        y.data(),
        1e-3,
        1e-4,
    );
    // g/49 reaches f16's subnormal range: an absolute term for those.
    assert_close(
        "pool backward",
        &gdx.to_host(&be).unwrap(),
        dx.data(),
        1e-3,
        1e-4,
    );
}

// ---------------------------------------------------------------------------
// Batch normalisation

struct BnCase {
    cpu: BatchNorm2d,
    gamma: Vec<f32>,
    beta: Vec<f32>,
}

fn bn_case(c: usize, seed: u64) -> BnCase {
    let mut cpu = BatchNorm2d::new("bn", c, 0.1, 1e-5);
    let gamma: Vec<f32> = random_vec(c, seed, 0.3)
        .iter()
        .map(|v| h(1.0 + v))
        .collect();
    let beta = random_vec(c, seed + 1, 0.5);
    {
        let mut params = cpu.params_mut();
        params[0].value.data_mut().copy_from_slice(&gamma);
        params[1].value.data_mut().copy_from_slice(&beta);
    }
    BnCase { cpu, gamma, beta }
}

const BN: BatchNormConfig = BatchNormConfig {
    momentum: 0.1,
    eps: 1e-5,
    relu: false,
    update_running: true,
};

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn batch_norm_training_forward_backward_and_running_stats_match() {
    let be = gpu_or_skip!();
    // c = 40: a partial 32-channel tile, and 5 groups of 8 channels by 51
    // row lanes in the _v8 partial kernels (a tree over lanes that are not
    // a power of two); rows 392 and 3136: 2 and 13 chunks. c = 264: two
    // blocks across, the second with one group. 66560 rows of 8 channels:
    // 256 chunks of 260 rows, 256 lanes each. c = 12: not a multiple of 8,
    // so every kernel goes one element at a time (bn_apply_f16, ...), not
    // eight (the _v8_f16 entry points); on the emulator, count which ran.
    let shapes = [
        ([8usize, 7, 7, 40], 20u64),
        ([16, 14, 14, 64], 30),
        ([2, 3, 3, 264], 35),
        ([2, 130, 256, 8], 45),
        ([6, 5, 5, 12], 40),
    ];
    let eight = [
        "bn_apply_v8_f16",
        "bn_backward_apply_v8_f16",
        "bn_stats_partial_v8_f16",
        "bn_backward_partial_v8_f16",
    ];
    let one = [
        "bn_apply_f16",
        "bn_backward_apply_f16",
        "bn_stats_partial_f16",
        "bn_backward_partial_f16",
    ];
    for (shape, seed) in shapes {
        let runs = || kernel_runs(&eight).zip(kernel_runs(&one));
        let before = runs();
        let c = shape[3];
        let BnCase {
            mut cpu,
            gamma,
            beta,
        } = bn_case(c, seed);
        let x = random(&shape, seed + 2, 2.0, 0.7);
        let g = random(&shape, seed + 3, 1.0, 0.0);
        let y = cpu.forward(&x, Mode::Train).unwrap();
        let dx = cpu.backward(&g).unwrap();
        let (dgamma, dbeta) = {
            let p = cpu.params_mut();
            (p[0].grad.data().to_vec(), p[1].grad.data().to_vec())
        };
        let (rmean, rvar) = {
            let b = cpu.buffers_mut();
            (b[0].data().to_vec(), b[1].data().to_vec())
        };

        let gx = upload(&be, &x);
        let gamma_d = upload_f32(&be, &gamma);
        let beta_d = upload_f32(&be, &beta);
        let mut rmean_d = upload_f32(&be, &vec![0.0; c]);
        let mut rvar_d = upload_f32(&be, &vec![1.0; c]);
        let (gy, saved) = ops::batch_norm_forward_train(
            &be,
            &gx,
            &gamma_d.as_view(),
            &beta_d.as_view(),
            &mut rmean_d.as_view_mut(),
            &mut rvar_d.as_view_mut(),
            BN,
        )
        .unwrap();
        let mut dgamma_d = upload_f32(&be, &vec![0.0; c]);
        let mut dbeta_d = upload_f32(&be, &vec![0.0; c]);
        let gdx = ops::batch_norm_backward(
            &be,
            &upload(&be, &g),
            &gx,
            &saved,
            &gamma_d.as_view(),
            &mut dgamma_d.as_view_mut(),
            &mut dbeta_d.as_view_mut(),
            false,
        )
        .unwrap();
        // Statistics from the same f16 values, f32 Welford + f64 merge vs
        // f64: near f32 precision.
        assert_close(
            "bn running_mean",
            &download(&be, &rmean_d),
            &rmean,
            1e-4,
            1e-5,
        );
        assert_close("bn running_var", &download(&be, &rvar_d), &rvar, 1e-4, 1e-5);
        // Outputs are stored in f16 (O(1) values).
        assert_close(
            "bn forward",
            &gy.to_host(&be).unwrap(),
            y.data(),
            2e-3,
            2e-3,
        );
        // Parameter gradients: f32 sums over rows of the same f16 g and x.
        assert_close("bn dgamma", &download(&be, &dgamma_d), &dgamma, 1e-3, 1e-4);
        assert_close("bn dbeta", &download(&be, &dbeta_d), &dbeta, 1e-3, 1e-4);
        assert_close(
            "bn backward",
            &gdx.to_host(&be).unwrap(),
            dx.data(),
            5e-3,
            3e-3,
        );
        if let (Some(before), Some(after)) = (before, runs()) {
            let by_eight = c % 8 == 0;
            assert_eq!(after.0 - before.0, if by_eight { 4 } else { 0 }, "c = {c}");
            assert_eq!(after.1 - before.1, if by_eight { 0 } else { 4 }, "c = {c}");
        }
    }
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn batch_norm_with_fused_relu_matches_bn_then_relu() {
    let be = gpu_or_skip!();
    // 32 channels: the _v8 kernels; 12: one element at a time.
    for shape in [[8usize, 14, 14, 32], [6, 5, 5, 12]] {
        fused_relu_case(&be, shape);
    }
}

/// Channel 0's γ is 3e-8 and β 0: its outputs x̂·3e-8 round to ±0 or to
/// f16's smallest subnormals, so the ReLU's mask, which backward
/// takes from x and the forward's scale and shift (not from the output),
/// must round as the output did to agree with it there.
fn fused_relu_case(be: &CudaBackend, shape: [usize; 4]) {
    let c = shape[3];
    let BnCase {
        mut cpu,
        mut gamma,
        mut beta,
    } = bn_case(c, 40);
    gamma[0] = 3e-8;
    beta[0] = 0.0;
    {
        let mut params = cpu.params_mut();
        params[0].value.data_mut()[0] = gamma[0];
        params[1].value.data_mut()[0] = beta[0];
    }
    let mut relu = Relu::new();
    let x = random(&shape, 42, 1.5, -0.3);
    let g = random(&shape, 43, 1.0, 0.0);
    let y = relu
        .forward(&cpu.forward(&x, Mode::Train).unwrap(), Mode::Train)
        .unwrap();
    relu.clear_saved();

    let gx = upload(be, &x);
    let gamma_d = upload_f32(be, &gamma);
    let beta_d = upload_f32(be, &beta);
    let mut rmean_d = upload_f32(be, &vec![0.0; c]);
    let mut rvar_d = upload_f32(be, &vec![1.0; c]);
    let cfg = BatchNormConfig { relu: true, ..BN };
    let (gy, saved) = ops::batch_norm_forward_train(
        be,
        &gx,
        &gamma_d.as_view(),
        &beta_d.as_view(),
        &mut rmean_d.as_view_mut(),
        &mut rvar_d.as_view_mut(),
        cfg,
    )
    .unwrap();
    let gy_host = gy.to_host(be).unwrap();
    // ReLU is 1-Lipschitz: the forward bound of plain batch norm holds.
    assert_close("bn+relu forward", &gy_host, y.data(), 2e-3, 2e-3);

    // Backward: the CPU reference masks g with the GPU's own output, so a
    // value within rounding of zero cannot flip the mask between the two.
    let masked: Vec<f32> = g
        .data()
        .iter()
        .zip(&gy_host)
        .map(|(&gv, &yv)| if yv > 0.0 { gv } else { 0.0 })
        .collect();
    let dx = cpu
        .backward(&Tensor::from_vec(&shape, masked).unwrap())
        .unwrap();
    let (dgamma, dbeta) = {
        let p = cpu.params_mut();
        (p[0].grad.data().to_vec(), p[1].grad.data().to_vec())
    };
    let mut dgamma_d = upload_f32(be, &vec![0.0; c]);
    let mut dbeta_d = upload_f32(be, &vec![0.0; c]);
    let gdx = ops::batch_norm_backward(
        be,
        &upload(be, &g),
        &gx,
        &saved,
        &gamma_d.as_view(),
        &mut dgamma_d.as_view_mut(),
        &mut dbeta_d.as_view_mut(),
        true,
    )
    .unwrap();
    assert_close(
        "bn+relu dgamma",
        &download(be, &dgamma_d),
        &dgamma,
        1e-3,
        1e-4,
    );
    assert_close("bn+relu dbeta", &download(be, &dbeta_d), &dbeta, 1e-3, 1e-4);
    assert_close(
        "bn+relu backward",
        &gdx.to_host(be).unwrap(),
        dx.data(),
        5e-3,
        3e-3,
    );
    // The same bits as the ReLU's backward by the output, then the batch
    // norm's without the ReLU.
    let masked_d = ops::relu_backward(be, &upload(be, &g), &gy).unwrap();
    let mut plain_dgamma = upload_f32(be, &vec![0.0; c]);
    let mut plain_dbeta = upload_f32(be, &vec![0.0; c]);
    let plain_dx = ops::batch_norm_backward(
        be,
        &masked_d,
        &gx,
        &saved,
        &gamma_d.as_view(),
        &mut plain_dgamma.as_view_mut(),
        &mut plain_dbeta.as_view_mut(),
        false,
    )
    .unwrap();
    let bits = |t: &CudaTensor| -> Vec<u32> {
        t.to_host(be).unwrap().iter().map(|v| v.to_bits()).collect()
    };
    let bits32 = |v: Vec<f32>| -> Vec<u32> { v.iter().map(|v| v.to_bits()).collect() };
    assert_eq!(bits(&plain_dx), bits(&gdx), "dx, c = {c}");
    assert_eq!(
        bits32(download(be, &plain_dgamma)),
        bits32(download(be, &dgamma_d)),
        "dgamma, c = {c}"
    );
    assert_eq!(
        bits32(download(be, &plain_dbeta)),
        bits32(download(be, &dbeta_d)),
        "dbeta, c = {c}"
    );
    // Channel 0 had outputs that passed, and some that were above zero
    // before their rounding to f16 and zero after (the mask's edge).
    let gy_host = gy.to_host(be).unwrap();
    let (scale, shift) = (
        download(be, &saved.scale.slice),
        download(be, &saved.shift.slice),
    );
    let xs = gx.to_host(be).unwrap();
    let rows = gy_host.len() / c;
    let passed = (0..rows).filter(|r| gy_host[r * c] > 0.0).count();
    let edge = (0..rows)
        .filter(|r| xs[r * c].mul_add(scale[0], shift[0]) > 0.0 && gy_host[r * c] == 0.0)
        .count();
    assert!(
        passed > 0 && edge > 0,
        "channel 0, c = {c}: {passed} passed, {edge} rounded to zero"
    );
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn batch_norm_eval_uses_the_running_statistics() {
    let be = gpu_or_skip!();
    let shape = [4usize, 7, 7, 48];
    let c = shape[3];
    let BnCase {
        mut cpu,
        gamma,
        beta,
    } = bn_case(c, 50);
    let rmean = random_vec(c, 51, 1.0);
    let rvar: Vec<f32> = random_vec(c, 52, 0.5)
        .iter()
        .map(|v| h(0.2 + v.abs()))
        .collect();
    {
        let mut b = cpu.buffers_mut();
        b[0].data_mut().copy_from_slice(&rmean);
        b[1].data_mut().copy_from_slice(&rvar);
    }
    let x = random(&shape, 53, 1.0, 0.2);
    let y = cpu.forward(&x, Mode::Eval).unwrap();
    let gamma_d = upload_f32(&be, &gamma);
    let beta_d = upload_f32(&be, &beta);
    let rmean_d = upload_f32(&be, &rmean);
    let rvar_d = upload_f32(&be, &rvar);
    let gy = ops::batch_norm_forward_eval(
        &be,
        &upload(&be, &x),
        &gamma_d.as_view(),
        &beta_d.as_view(),
        &rmean_d.as_view(),
        &rvar_d.as_view(),
        BN,
    )
    .unwrap();
    assert_close("bn eval", &gy.to_host(&be).unwrap(), y.data(), 2e-3, 2e-3);
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn batch_norm_recompute_leaves_running_statistics_alone_and_is_deterministic() {
    let be = gpu_or_skip!();
    let shape = [8usize, 14, 14, 64];
    let c = shape[3];
    let gamma_d = upload_f32(&be, &vec![1.0; c]);
    let beta_d = upload_f32(&be, &vec![0.0; c]);
    let mut rmean_d = upload_f32(&be, &vec![0.25; c]);
    let mut rvar_d = upload_f32(&be, &vec![2.0; c]);
    let x = upload(&be, &random(&shape, 60, 1.0, 0.3));
    let run = |rmean: &mut CudaSlice<f32>, rvar: &mut CudaSlice<f32>, update: bool| {
        let cfg = BatchNormConfig {
            update_running: update,
            ..BN
        };
        let (y, _) = ops::batch_norm_forward_train(
            &be,
            &x,
            &gamma_d.as_view(),
            &beta_d.as_view(),
            &mut rmean.as_view_mut(),
            &mut rvar.as_view_mut(),
            cfg,
        )
        .unwrap();
        y.to_host(&be).unwrap()
    };
    let first = run(&mut rmean_d, &mut rvar_d, false);
    assert_eq!(
        download(&be, &rmean_d),
        vec![0.25; c],
        "recompute: running_mean untouched"
    );
    assert_eq!(
        download(&be, &rvar_d),
        vec![2.0; c],
        "recompute: running_var untouched"
    );
    let second = run(&mut rmean_d, &mut rvar_d, true);
    // Fixed chunking and merge order: bit-identical outputs.
    assert!(
        first
            .iter()
            .zip(&second)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "batch norm forward is deterministic"
    );
    assert_ne!(
        download(&be, &rmean_d),
        vec![0.25; c],
        "a training forward updates them"
    );
}

// ---------------------------------------------------------------------------
// Convolution and linear

struct ConvCase {
    shape: ConvShape,
    bias: bool,
    /// Algorithm and im2col workspace (a small one forces several image
    /// groups).
    plan: ConvPlan,
}

fn conv_parity(be: &CudaBackend, case: &ConvCase, seed: u64) {
    let s = case.shape;
    let mut rng = InitRng::new(seed);
    let mut conv = Conv2d::new(
        "c", s.cin, s.cout, s.k, s.stride, s.pad, case.bias, &mut rng,
    )
    .unwrap();
    let bias = random_vec(s.cout, seed + 1, 0.5);
    let weight = {
        let mut p = conv.params_mut();
        round_f16(&mut p[0].value);
        if case.bias {
            p[1].value.data_mut().copy_from_slice(&bias);
        }
        p[0].value.data().to_vec()
    };
    let x = random(&[s.n, s.h, s.w, s.cin], seed + 2, 1.0, 0.0);
    let y = conv.forward(&x, Mode::Train).unwrap();
    let g = random(y.shape(), seed + 3, 1.0, 0.0);
    let dx = conv.backward(&g).unwrap();
    let (dw, db) = {
        let p = conv.params_mut();
        (
            p[0].grad.data().to_vec(),
            p.get(1).map(|b| b.grad.data().to_vec()),
        )
    };

    let w_d = upload_f16(be, &weight);
    let b_d = upload_f16(be, &bias);
    let gx = upload(be, &x);
    let gy = ops::conv2d_forward(
        be,
        &gx,
        &AnyView::F16(w_d.as_view()),
        case.bias.then(|| AnyView::F16(b_d.as_view())).as_ref(),
        s,
        case.plan,
    )
    .unwrap();
    let mut dw_d = upload_f32(be, &vec![0.0; weight.len()]);
    let mut db_d = upload_f32(be, &vec![0.0; s.cout]);
    let gdx = {
        let mut db_view = db_d.as_view_mut();
        ops::conv2d_backward(
            be,
            &gx,
            &upload(be, &g),
            &AnyView::F16(w_d.as_view()),
            &mut dw_d.as_view_mut(),
            if case.bias { Some(&mut db_view) } else { None },
            s,
            case.plan,
        )
        .unwrap()
    };
    let name = format!("conv {s:?} bias {} {:?}", case.bias, case.plan);
    // Products of f16 values accumulated in f32 (tensor cores), one f16
    // rounding of the output.
    assert_close(
        &format!("{name} forward"),
        &gy.to_host(be).unwrap(),
        y.data(),
        2e-3,
        1e-3,
    );
    // dA is stored in f16 before col2im sums up to k·k taps: two roundings.
    assert_close(
        &format!("{name} dx"),
        &gdx.to_host(be).unwrap(),
        dx.data(),
        5e-3,
        2e-3,
    );
    // dW: f32 output of f32 accumulation over n·oh·ow products.
    assert_close(&format!("{name} dW"), &download(be, &dw_d), &dw, 1e-3, 1e-4);
    if let Some(db) = db {
        assert_close(&format!("{name} db"), &download(be, &db_d), &db, 1e-3, 1e-4);
    }
}

/// The backward without dX (a network's first layer) accumulates the dW
/// and db of the whole backward, bit for bit.
fn conv_params_only_parity(be: &CudaBackend, case: &ConvCase, seed: u64) {
    let s = case.shape;
    let (oh, ow) = (
        (s.h + 2 * s.pad - s.k) / s.stride + 1,
        (s.w + 2 * s.pad - s.k) / s.stride + 1,
    );
    let weight = random_vec(s.k * s.k * s.cin * s.cout, seed, 0.2);
    let w_d = upload_f16(be, &weight);
    let gx = upload(be, &random(&[s.n, s.h, s.w, s.cin], seed + 1, 1.0, 0.0));
    let gy = upload(be, &random(&[s.n, oh, ow, s.cout], seed + 2, 1.0, 0.0));
    let grads = |with_dx: bool| {
        let mut dw = upload_f32(be, &vec![0.0; weight.len()]);
        let mut db = upload_f32(be, &vec![0.0; s.cout]);
        {
            let (w, mut dw_view, mut db_view) = (
                AnyView::F16(w_d.as_view()),
                dw.as_view_mut(),
                db.as_view_mut(),
            );
            let db_view = case.bias.then_some(&mut db_view);
            if with_dx {
                ops::conv2d_backward(be, &gx, &gy, &w, &mut dw_view, db_view, s, case.plan)
                    .map(drop)
            } else {
                ops::conv2d_backward_params(be, &gx, &gy, &w, &mut dw_view, db_view, s, case.plan)
            }
            .unwrap();
        }
        (download(be, &dw), download(be, &db))
    };
    assert_eq!(
        grads(false),
        grads(true),
        "conv {s:?} {:?}: dW and db alone",
        case.plan
    );
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn convolution_matches_the_cpu_layer_for_the_reference_shapes() {
    let be = gpu_or_skip!();
    let conv = conv_shape;
    let cases = [
        // The reference ResNet at batch 4: stem, blocks, strided stems.
        ConvCase {
            shape: conv(4, 28, 28, 1, 32, 3, 1, 1),
            bias: false,
            plan: ConvPlan::default(),
        },
        ConvCase {
            shape: conv(4, 28, 28, 32, 32, 3, 1, 1),
            bias: false,
            plan: ConvPlan::default(),
        },
        ConvCase {
            shape: conv(4, 28, 28, 32, 64, 3, 2, 1),
            bias: false,
            plan: ConvPlan::default(),
        },
        ConvCase {
            shape: conv(4, 14, 14, 64, 128, 3, 2, 1),
            bias: false,
            plan: ConvPlan::default(),
        },
        ConvCase {
            shape: conv(4, 7, 7, 128, 128, 3, 1, 1),
            bias: false,
            plan: ConvPlan::default(),
        },
        // Pointwise (no im2col), bias, odd sizes, padding 0, 5×5 kernels.
        ConvCase {
            shape: conv(3, 6, 5, 16, 24, 1, 1, 0),
            bias: true,
            plan: ConvPlan::default(),
        },
        ConvCase {
            shape: conv(3, 5, 7, 3, 8, 3, 2, 1),
            bias: true,
            plan: ConvPlan::default(),
        },
        ConvCase {
            shape: conv(2, 9, 9, 4, 6, 5, 1, 0),
            bias: true,
            plan: ConvPlan::default(),
        },
        ConvCase {
            shape: conv(2, 8, 8, 5, 7, 3, 3, 2),
            bias: false,
            plan: ConvPlan::default(),
        },
        // A scratch of one image forces one group per image.
        ConvCase {
            shape: conv(5, 14, 14, 16, 16, 3, 1, 1),
            bias: true,
            plan: ConvPlan {
                workspace: 1,
                ..ConvPlan::default()
            },
        },
    ];
    // f16 with whole 8-channel runs goes 8 at a time (im2col_v8_f16, and
    // col2im_v8_f16 in backward); on the emulator, count that it did.
    let vectorized = ["im2col_v8_f16", "col2im_v8_f16"];
    for (i, case) in cases.iter().enumerate() {
        let before = kernel_runs(&vectorized);
        conv_parity(&be, case, 100 + 10 * i as u64);
        conv_params_only_parity(&be, case, 150 + 10 * i as u64);
        if let (Some(before), Some(after)) = (before, kernel_runs(&vectorized)) {
            let s = case.shape;
            let expected = s.cin % 8 == 0 && !s.is_pointwise();
            assert_eq!(after > before, expected, "vectorized im2col for {s:?}");
        }
    }
}

/// How many times these kernels have run so far, on the emulator (None on
/// a GPU, where nothing counts them).
fn kernel_runs(names: &[&str]) -> Option<u64> {
    if !emulated() {
        return None;
    }
    Some(
        names
            .iter()
            .map(|name| headroom_cuda_emu::kernel_runs(name).unwrap())
            .sum(),
    )
}

/// `conv_parity` (forward and both gradients) and then
/// `conv_params_only_parity` (dW alone, as a first layer asks) for `case`,
/// the first counted on the emulator: `kernels` must run `runs` times.
fn counted_conv_parity(be: &CudaBackend, case: &ConvCase, kernels: &[&str], runs: u64, seed: u64) {
    let before = kernel_runs(kernels);
    conv_parity(be, case, seed);
    if let (Some(before), Some(after)) = (before, kernel_runs(kernels)) {
        assert_eq!(
            after - before,
            runs,
            "runs of {kernels:?} for {:?}",
            case.shape
        );
    }
    conv_params_only_parity(be, case, seed + 50);
}

/// A convolution's shape, its fields in order.
#[allow(clippy::too_many_arguments)]
fn conv_shape(
    n: usize,
    h: usize,
    w: usize,
    cin: usize,
    cout: usize,
    k: usize,
    stride: usize,
    pad: usize,
) -> ConvShape {
    ConvShape {
        n,
        h,
        w,
        cin,
        cout,
        k,
        stride,
        pad,
    }
}

/// conv_mma.cu's kernels, and conv.cu's reduce of their weight gradient.
const IMPLICIT_KERNELS: [&str; 8] = [
    "implicit_conv_n32_f16",
    "implicit_conv_n64_f16",
    "implicit_dgrad_n32_f16",
    "implicit_dgrad_n64_f16",
    "implicit_wgrad_n32_f16",
    "implicit_wgrad_n64_f16",
    "implicit_wgrad_n128_f16",
    "wgrad_reduce",
];

/// `device.conv_algorithm = "implicit_gemm"`: conv_mma.cu's tensor-core
/// kernels (forward, input gradient, weight gradient and its reduction)
/// against the CPU layer, for the
/// reference shapes and the edges of its tiles: rows past a block of 128,
/// output channels short of a column tile of 32 or 64, K not a multiple of
/// its step of 32, strides whose taps the input gradient's gather must skip.
/// Shapes it does not take (one input channel, pointwise) go to im2col; on
/// the emulator the test counts which kernel ran.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn implicit_gemm_convolution_matches_the_cpu_layer() {
    let be = gpu_or_skip!();
    let conv = conv_shape;
    let plan = ConvPlan {
        algorithm: ConvAlgorithm::ImplicitGemm,
        ..ConvPlan::default()
    };
    // (shape, bias, runs of conv_mma.cu's kernels: forward, input gradient
    // (a run per parity class of dx's pixels: stride² where dx has them
    // all), weight gradient, its reduction)
    let cases = [
        (conv(4, 28, 28, 32, 32, 3, 1, 1), false, 4),
        (conv(4, 28, 28, 32, 64, 3, 2, 1), false, 7),
        (conv(4, 14, 14, 64, 128, 3, 2, 1), false, 7),
        (conv(4, 7, 7, 128, 128, 3, 1, 1), false, 4),
        // dW in 128-column tiles (two of them), and 192 outputs: 64s.
        (conv(2, 4, 4, 16, 256, 3, 1, 1), true, 4),
        (conv(2, 5, 3, 8, 192, 3, 1, 1), false, 4),
        (conv(3, 7, 7, 8, 24, 3, 1, 1), true, 4),
        (conv(2, 9, 9, 16, 48, 5, 1, 0), false, 4),
        (conv(2, 8, 8, 8, 16, 3, 3, 2), true, 12),
        (conv(3, 5, 7, 24, 40, 3, 2, 1), false, 7),
        // A 1×1 stride-2 shortcut: three classes no tap reaches (zeros).
        (conv(2, 7, 6, 16, 24, 1, 2, 0), true, 7),
        // 2×2 stride 2: one tap a class; a dx one row high: two classes.
        (conv(2, 6, 6, 8, 16, 2, 2, 0), false, 7),
        (conv(2, 1, 5, 8, 16, 3, 2, 1), false, 5),
        (conv(4, 28, 28, 1, 32, 3, 1, 1), false, 0),
        (conv(2, 6, 6, 16, 16, 1, 1, 0), true, 0),
    ];
    // A workspace too small for two partial sums of dW: one block sums
    // every pixel, many steps of 32 (the others split them a step or two
    // per block).
    let one_split = ConvPlan {
        workspace: 1,
        ..plan
    };
    let cases = cases
        .into_iter()
        .map(|(shape, bias, runs)| (shape, bias, plan, runs));
    let cases = cases.chain([
        (conv(4, 14, 14, 32, 64, 3, 1, 1), false, one_split, 4),
        (conv(3, 9, 9, 16, 24, 3, 2, 1), true, one_split, 7),
        (conv(2, 9, 9, 8, 128, 3, 1, 1), false, one_split, 4),
    ]);
    for (i, (shape, bias, plan, runs)) in cases.enumerate() {
        let case = ConvCase { shape, bias, plan };
        counted_conv_parity(&be, &case, &IMPLICIT_KERNELS, runs, 300 + 10 * i as u64);
    }
}

/// conv_mma.cu copies weights 8 at a time: a weight that does not start
/// on 16 bytes (a range of a buffer that no network builds: its parameters
/// are 8-aligned in their groups) goes to im2col, with the same bits as an
/// aligned copy of it there, forward and backward.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_weight_off_sixteen_bytes_takes_im2col() {
    let be = gpu_or_skip!();
    let s = conv_shape(2, 6, 6, 8, 16, 3, 1, 1);
    let weight = random_vec(s.kk() * s.cout, 900, 0.3);
    let x = upload(&be, &random(&[s.n, s.h, s.w, s.cin], 901, 1.0, 0.0));
    let dy = upload(&be, &random(&[s.n, s.h, s.w, s.cout], 902, 1.0, 0.0));
    let aligned = upload_f16(&be, &weight);
    let shifted = upload_f16(&be, &[vec![0.0; 4], weight.clone()].concat());
    let implicit = ConvPlan {
        algorithm: ConvAlgorithm::ImplicitGemm,
        ..ConvPlan::default()
    };
    let run = |w: AnyView<'_>, plan: ConvPlan| {
        let y = ops::conv2d_forward(&be, &x, &w, None, s, plan).unwrap();
        let mut dw = upload_f32(&be, &vec![0.0; weight.len()]);
        let dx =
            ops::conv2d_backward(&be, &x, &dy, &w, &mut dw.as_view_mut(), None, s, plan).unwrap();
        (
            y.to_host(&be).unwrap(),
            dx.to_host(&be).unwrap(),
            download(&be, &dw),
        )
    };
    let before = kernel_runs(&IMPLICIT_KERNELS);
    let off = run(AnyView::F16(shifted.slice(4..)), implicit);
    if let (Some(before), Some(after)) = (before, kernel_runs(&IMPLICIT_KERNELS)) {
        assert_eq!(after, before, "implicit kernels ran on a misaligned weight");
    }
    let reference = run(AnyView::F16(aligned.as_view()), ConvPlan::default());
    assert_eq!(off, reference);
    // And the aligned weight does take the implicit kernels.
    let before = kernel_runs(&IMPLICIT_KERNELS);
    run(AnyView::F16(aligned.as_view()), implicit);
    if let (Some(before), Some(after)) = (before, kernel_runs(&IMPLICIT_KERNELS)) {
        assert_eq!(
            after - before,
            4,
            "implicit kernel runs on an aligned weight"
        );
    }
}

/// A network places its parameters 8-aligned in their groups, so a
/// convolution after one of odd length still takes the implicit kernels:
/// here 27 weights (1 → 3) and 216 (3 → 8, im2col: 3 channels) come before
/// the 8 → 8 convolution's in the decay group.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_network_places_weights_where_the_implicit_kernels_take_them() {
    let be = gpu_or_skip!();
    let text = r#"
[model]
input = [6, 6, 1]
mean = 0.0
std = 1.0
layers = [
  { type = "conv", out = 3 }, { type = "conv", out = 8 }, { type = "conv", out = 8 },
  { type = "global_avg_pool" }, { type = "linear", out = 8 },
]
"#;
    let spec = toml::from_str::<SpecFile>(text).unwrap().model;
    let x =
        CudaTensor::from_tensor(&be, &random(&[2, 6, 6, 1], 910, 1.0, 0.0), DType::F16).unwrap();
    let g = CudaTensor::from_tensor(&be, &random(&[2, 8], 911, 0.1, 0.0), DType::F16).unwrap();
    let grads = |algorithm: ConvAlgorithm| {
        let options = CudaBuildOptions {
            activations: DType::F16,
            conv: ConvPlan {
                algorithm,
                ..ConvPlan::default()
            },
            ..CudaBuildOptions::default()
        };
        let mut net = CudaNetwork::build(&be, &spec, 3, options).unwrap();
        net.forward_train(&be, &x).unwrap();
        net.backward(&be, &g).unwrap();
        // Also what the emulator needs to run the queued kernels.
        net.read_grads(&be).unwrap()
    };
    let before = kernel_runs(&IMPLICIT_KERNELS);
    let implicit = grads(ConvAlgorithm::ImplicitGemm);
    if let (Some(before), Some(after)) = (before, kernel_runs(&IMPLICIT_KERNELS)) {
        assert_eq!(
            after - before,
            4,
            "implicit kernel runs of the 8 → 8 convolution"
        );
    }
    // On a GPU, where kernels are not counted: the same gradients as im2col's,
    // within the f16 roundings the two orders of summation differ by.
    let im2col = grads(ConvAlgorithm::Im2col);
    assert_eq!(implicit.len(), im2col.len());
    for (i, (a, b)) in implicit.iter().zip(&im2col).enumerate() {
        assert_close(&format!("parameter {i} gradient"), a, b, 2e-2, 2e-3);
    }
}

/// `device.conv_algorithm = "auto"`: the implicit kernels for a stride-1
/// convolution of at most 64 channels, im2col for stride 2, for 128
/// channels and for shapes the implicit kernels do not take; each matches
/// the CPU layer, and on the emulator the test counts which kernels ran.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn auto_picks_the_convolution_algorithm_by_shape() {
    let be = gpu_or_skip!();
    let conv = |n, h, w, cin, cout, stride| conv_shape(n, h, w, cin, cout, 3, stride, 1);
    let plan = ConvPlan {
        algorithm: ConvAlgorithm::Auto,
        ..ConvPlan::default()
    };
    // (shape, runs of conv_mma.cu's kernels and of wgrad_reduce, which the
    // thin kernels' dW also runs: 1 for the 1 → 32 layer)
    let cases = [
        (conv(4, 28, 28, 32, 32, 1), 4),
        (conv(4, 14, 14, 64, 64, 1), 4),
        (conv(4, 14, 14, 32, 64, 1), 4),
        (conv(4, 28, 28, 32, 64, 2), 0),
        (conv(4, 7, 7, 128, 128, 1), 0),
        (conv(4, 7, 7, 64, 128, 1), 0),
        (conv(4, 28, 28, 1, 32, 1), 1),
    ];
    for (i, (shape, runs)) in cases.into_iter().enumerate() {
        let before = kernel_runs(&IMPLICIT_KERNELS);
        let case = ConvCase {
            shape,
            bias: false,
            plan,
        };
        conv_parity(&be, &case, 500 + 10 * i as u64);
        if let (Some(before), Some(after)) = (before, kernel_runs(&IMPLICIT_KERNELS)) {
            assert_eq!(after - before, runs, "implicit kernel runs for {shape:?}");
        }
    }
}

/// Runs of conv_mma.cu's kernels (and the reduce of its dW) for one
/// convolution of stride 1: forward 1, input gradient 1, weight gradient 2.
fn implicit_runs(product: ConvProduct) -> u64 {
    match product {
        ConvProduct::Forward | ConvProduct::InputGrad => 1,
        ConvProduct::WeightGrad => 2,
    }
}

/// This backend's tuned products of convolution `s`.
fn tuned_of(be: &CudaBackend, s: ConvShape) -> Vec<TunedConv> {
    let all = be.tuned_convolutions();
    all.into_iter().filter(|t| t.shape == s).collect()
}

/// `device.conv_algorithm = "tune"`: the first forward and backward of a
/// shape time each product both ways (a warm-up and two timed runs each),
/// keep the faster, and still match the CPU layer (the weight gradient,
/// which accumulates, timed into scratch: dW once, not seven times); the
/// next run of the shape times nothing and runs the kept ways. Choices
/// restored from a checkpoint are run as given, mixed per product (each
/// mix of im2col for one gradient and the implicit kernel for the other
/// against the CPU layer), and a shape first met in a graph capture takes
/// `auto`'s rule without a timing.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn tune_times_each_product_once_and_keeps_the_faster() {
    let be = gpu_or_skip!();
    let plan = ConvPlan {
        algorithm: ConvAlgorithm::Tune,
        ..ConvPlan::default()
    };
    let case = |shape| ConvCase {
        shape,
        bias: true,
        plan,
    };
    let s = conv_shape(2, 8, 8, 16, 24, 3, 1, 1);
    let before = kernel_runs(&IMPLICIT_KERNELS);
    conv_parity(&be, &case(s), 700);
    let tuned = tuned_of(&be, s);
    let products: Vec<ConvProduct> = tuned.iter().map(|t| t.product).collect();
    let all = [
        ConvProduct::Forward,
        ConvProduct::InputGrad,
        ConvProduct::WeightGrad,
    ];
    assert_eq!(products, all, "{tuned:?}");
    let mut kept_runs = 0;
    for t in &tuned {
        assert!(t.implicit_ms > 0.0 && t.im2col_ms > 0.0, "{t:?}");
        let faster = if t.implicit_ms <= t.im2col_ms {
            ConvPath::Implicit
        } else {
            ConvPath::Im2col
        };
        assert_eq!(t.path, faster, "{t:?}");
        kept_runs += u64::from(t.path == ConvPath::Implicit) * implicit_runs(t.product);
    }
    let every_product: u64 = all.iter().map(|&p| implicit_runs(p)).sum();
    if let (Some(before), Some(after)) = (before, kernel_runs(&IMPLICIT_KERNELS)) {
        assert_eq!(
            after - before,
            3 * every_product + kept_runs,
            "while tuning"
        );
    }
    let before = kernel_runs(&IMPLICIT_KERNELS);
    conv_parity(&be, &case(s), 710);
    if let (Some(before), Some(after)) = (before, kernel_runs(&IMPLICIT_KERNELS)) {
        assert_eq!(after - before, kept_runs, "once tuned");
    }
    assert_eq!(tuned_of(&be, s), tuned, "no second timing");

    // Restored choices, as a resumed run has them.
    use ConvPath::{Im2col, Implicit};
    let mixes = [
        [Im2col, Implicit, Implicit],
        [Implicit, Im2col, Implicit],
        [Implicit, Implicit, Im2col],
        [Im2col, Im2col, Im2col],
    ];
    for (i, mix) in mixes.into_iter().enumerate() {
        let s = conv_shape(2, 6, 6, 8, 16 + 8 * i, 3, 1, 1);
        let restored: Vec<TunedConv> = all
            .iter()
            .zip(mix)
            .map(|(&product, path)| TunedConv {
                shape: s,
                product,
                path,
                implicit_ms: 1.0,
                im2col_ms: 1.0,
            })
            .collect();
        be.restore_tuned_convolutions(&restored);
        let runs = all
            .iter()
            .zip(mix)
            .map(|(&p, path)| u64::from(path == Implicit) * implicit_runs(p))
            .sum();
        counted_conv_parity(&be, &case(s), &IMPLICIT_KERNELS, runs, 720 + 10 * i as u64);
        assert_eq!(tuned_of(&be, s), restored, "{mix:?}");
    }

    // In a capture: auto's rule (the implicit kernel for this shape), no
    // timing, nothing kept.
    let s = conv_shape(2, 6, 6, 16, 16, 3, 1, 1);
    let w = upload_f16(&be, &random_vec(s.kk() * s.cout, 780, 0.3));
    let x = upload(&be, &random(&[s.n, s.h, s.w, s.cin], 781, 1.0, 0.0));
    let in_use = be.begin_capture().unwrap();
    let y = ops::conv2d_forward(&be, &x, &AnyView::F16(w.as_view()), None, s, plan);
    drop(y.expect("a convolution in a capture"));
    let graph = be.end_capture(in_use).unwrap();
    drop(graph);
    assert!(tuned_of(&be, s).is_empty(), "tuned in a capture");
}

/// conv_narrow.cu's kernels.
const NARROW_KERNELS: [&str; 6] = [
    "narrow_forward_f16",
    "narrow_forward_f32",
    "narrow_grad_input_f16",
    "narrow_grad_input_f32",
    "narrow_wgrad_f16",
    "narrow_wgrad_f32",
];

/// `device.conv_algorithm = "auto"` runs a convolution to fewer than 8
/// output channels with conv_narrow.cu's direct kernels: a frame head
/// (17 -> 1), an RGB head with a stride and padding its gathers must skip,
/// 7 outputs (all its registers hold), a stride of 3 with no padding, and
/// a workspace that holds 3 splits of the weight gradient's partial sums.
/// In f16 (against the CPU layer as `conv_parity` does, the kernels' runs
/// counted on the emulator; the weight gradient without dX the same bits)
/// and in f32 (`narrow_f32_parity`).
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn narrow_convolution_matches_the_cpu_layer() {
    let be = gpu_or_skip!();
    let conv = conv_shape;
    let auto = ConvPlan {
        algorithm: ConvAlgorithm::Auto,
        ..ConvPlan::default()
    };
    let three_splits = ConvPlan {
        workspace: 3 * 9 * 17 * 4,
        ..auto
    };
    let cases = [
        (conv(4, 16, 16, 17, 1, 3, 1, 1), true, auto),
        (conv(3, 9, 11, 5, 3, 3, 2, 1), true, auto),
        (conv(2, 8, 8, 24, 7, 5, 1, 2), false, auto),
        (conv(2, 7, 7, 3, 2, 3, 3, 0), true, auto),
        (conv(4, 16, 16, 17, 1, 3, 1, 1), false, three_splits),
    ];
    for (i, (shape, bias, plan)) in cases.into_iter().enumerate() {
        let case = ConvCase { shape, bias, plan };
        counted_conv_parity(&be, &case, &NARROW_KERNELS, 3, 600 + 10 * i as u64);
        narrow_f32_parity(&be, &case, 680 + 10 * i as u64);
    }
}

/// conv_narrow.cu's thin kernels and the gather they borrow for dX.
const THIN_KERNELS: [&str; 3] = [
    "thin_forward_f16",
    "thin_wgrad_f16",
    "narrow_grad_input_f16",
];

/// `device.conv_algorithm = "auto"` runs a convolution from few input
/// channels (not a multiple of 8) to a multiple of 8 with the thin kernels:
/// Fashion-MNIST's first layer (1 → 32), an RGB stem with a stride (3 →
/// 64: 216 groups of a tap, a channel and 8 outputs, so 1 row lane a
/// block), 5×5 from 5 channels with padding 2, a workspace for 3 splits
/// of dW. Shapes past a block's 256 groups go to im2col (7×7, 3 → 64).
/// Against the CPU layer as `conv_parity` does (and dW alone, as a first
/// layer asks for it, the same bits), the runs counted on the emulator:
/// forward, dW, and the input gradient's gather where dX is wanted.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn thin_convolution_matches_the_cpu_layer() {
    let be = gpu_or_skip!();
    let conv = conv_shape;
    let auto = ConvPlan {
        algorithm: ConvAlgorithm::Auto,
        ..ConvPlan::default()
    };
    let three_splits = ConvPlan {
        workspace: 3 * 9 * 32 * 4,
        ..auto
    };
    let cases = [
        (conv(4, 28, 28, 1, 32, 3, 1, 1), false, auto, 3),
        (conv(3, 9, 11, 3, 64, 3, 2, 1), true, auto, 3),
        (conv(2, 8, 8, 5, 8, 5, 1, 2), false, auto, 3),
        (conv(4, 28, 28, 1, 32, 3, 1, 1), true, three_splits, 3),
        (conv(2, 12, 12, 3, 64, 7, 2, 3), false, auto, 0),
    ];
    for (i, (shape, bias, plan, runs)) in cases.into_iter().enumerate() {
        let case = ConvCase { shape, bias, plan };
        counted_conv_parity(&be, &case, &THIN_KERNELS, runs, 700 + 10 * i as u64);
    }
}

/// The f32 entry points against the CPU layer: f32 storage, f32 sums in
/// another order than the CPU's, so within 1e-5.
fn narrow_f32_parity(be: &CudaBackend, case: &ConvCase, seed: u64) {
    let s = case.shape;
    let mut rng = InitRng::new(seed);
    let mut conv = Conv2d::new("c", s.cin, s.cout, s.k, s.stride, s.pad, false, &mut rng).unwrap();
    let weight = conv.params_mut()[0].value.data().to_vec();
    let x = random(&[s.n, s.h, s.w, s.cin], seed + 1, 1.0, 0.0);
    let y = conv.forward(&x, Mode::Train).unwrap();
    let g = random(y.shape(), seed + 2, 1.0, 0.0);
    let dx = conv.backward(&g).unwrap();
    let dw = conv.params_mut()[0].grad.data().to_vec();
    let w_d = upload_f32(be, &weight);
    let gx = CudaTensor::from_tensor(be, &x, DType::F32).unwrap();
    let gg = CudaTensor::from_tensor(be, &g, DType::F32).unwrap();
    let w = AnyView::F32(w_d.as_view());
    let gy = ops::conv2d_forward(be, &gx, &w, None, s, case.plan).unwrap();
    let mut dw_d = upload_f32(be, &vec![0.0; weight.len()]);
    let gdx = ops::conv2d_backward(
        be,
        &gx,
        &gg,
        &w,
        &mut dw_d.as_view_mut(),
        None,
        s,
        case.plan,
    )
    .unwrap();
    let name = format!("f32 conv {s:?}");
    assert_close(
        &format!("{name} forward"),
        &gy.to_host(be).unwrap(),
        y.data(),
        1e-5,
        1e-5,
    );
    assert_close(
        &format!("{name} dx"),
        &gdx.to_host(be).unwrap(),
        dx.data(),
        1e-5,
        1e-5,
    );
    assert_close(&format!("{name} dW"), &download(be, &dw_d), &dw, 1e-5, 1e-5);
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn linear_matches_the_cpu_layer() {
    let be = gpu_or_skip!();
    for (n, inf, out, bias) in [(16usize, 128usize, 10usize, true), (5, 33, 7, false)] {
        let mut rng = InitRng::new(200 + n as u64);
        let mut lin = Linear::new("fc", inf, out, bias, &mut rng);
        let b = random_vec(out, 201, 0.5);
        let weight = {
            let mut p = lin.params_mut();
            round_f16(&mut p[0].value);
            if bias {
                p[1].value.data_mut().copy_from_slice(&b);
            }
            p[0].value.data().to_vec()
        };
        let x = random(&[n, inf], 202, 1.0, 0.0);
        let g = random(&[n, out], 203, 1.0, 0.0);
        let y = lin.forward(&x, Mode::Train).unwrap();
        let dx = lin.backward(&g).unwrap();
        let (dw, db) = {
            let p = lin.params_mut();
            (
                p[0].grad.data().to_vec(),
                p.get(1).map(|b| b.grad.data().to_vec()),
            )
        };
        let w_d = upload_f16(&be, &weight);
        let b_d = upload_f16(&be, &b);
        let gx = upload(&be, &x);
        let gy = ops::linear_forward(
            &be,
            &gx,
            &AnyView::F16(w_d.as_view()),
            bias.then(|| AnyView::F16(b_d.as_view())).as_ref(),
            out,
        )
        .unwrap();
        let mut dw_d = upload_f32(&be, &vec![0.0; weight.len()]);
        let mut db_d = upload_f32(&be, &vec![0.0; out]);
        let gdx = {
            let mut db_view = db_d.as_view_mut();
            ops::linear_backward(
                &be,
                &gx,
                &upload(&be, &g),
                &AnyView::F16(w_d.as_view()),
                &mut dw_d.as_view_mut(),
                if bias { Some(&mut db_view) } else { None },
            )
            .unwrap()
        };
        assert_close(
            "linear forward",
            &gy.to_host(&be).unwrap(),
            y.data(),
            2e-3,
            1e-3,
        );
        assert_close(
            "linear dx",
            &gdx.to_host(&be).unwrap(),
            dx.data(),
            2e-3,
            1e-3,
        );
        assert_close("linear dW", &download(&be, &dw_d), &dw, 1e-3, 1e-4);
        if let Some(db) = db {
            assert_close("linear db", &download(&be, &db_d), &db, 1e-3, 1e-4);
        }
        // Without dx (a network's first layer): the same dW and db, bit for bit.
        let mut dw_p = upload_f32(&be, &vec![0.0; weight.len()]);
        let mut db_p = upload_f32(&be, &vec![0.0; out]);
        {
            let mut db_view = db_p.as_view_mut();
            ops::linear_backward_params(
                &be,
                &gx,
                &upload(&be, &g),
                &AnyView::F16(w_d.as_view()),
                &mut dw_p.as_view_mut(),
                if bias { Some(&mut db_view) } else { None },
            )
            .unwrap();
        }
        assert_eq!(
            download(&be, &dw_p),
            download(&be, &dw_d),
            "linear dW alone"
        );
        assert_eq!(
            download(&be, &db_p),
            download(&be, &db_d),
            "linear db alone"
        );
    }
}

// ---------------------------------------------------------------------------
// UNet pieces

/// Upsample2x forward and backward: f32 gives the CPU's bits (copies, and
/// the 2×2 sums in the CPU's order), f16 one rounding of them; the
/// channel concatenation and split give back what went in.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn upsample2x_and_the_channel_concat_match_the_cpu() {
    let be = gpu_or_skip!();
    let x = random(&[2, 3, 5, 6], 360, 1.0, 0.0);
    let g = random(&[2, 6, 10, 6], 361, 1.0, 0.0);
    let mut up = Upsample2x::new();
    let y = up.forward(&x, Mode::Train).unwrap();
    let dx = up.backward(&g).unwrap();
    for (dtype, rel) in [(DType::F32, 0.0), (DType::F16, 1e-3)] {
        let what = format!("upsample2x {dtype:?}");
        let gx = CudaTensor::from_tensor(&be, &x, dtype).unwrap();
        let gy = ops::upsample2x_forward(&be, &gx).unwrap();
        assert_eq!(gy.shape(), y.shape());
        let gg = CudaTensor::from_tensor(&be, &g, dtype).unwrap();
        let gdx = ops::upsample2x_backward(&be, &gg, x.shape()).unwrap();
        assert_close(
            &format!("{what} forward"),
            &gy.to_host(&be).unwrap(),
            y.data(),
            0.0,
            0.0,
        );
        assert_close(
            &format!("{what} backward"),
            &gdx.to_host(&be).unwrap(),
            dx.data(),
            rel,
            0.0,
        );
        let both = ops::channels_concat(&be, &gx, &gx).unwrap();
        assert_eq!(both.shape(), &[2, 3, 5, 12]);
        let host = both.to_host(&be).unwrap();
        let xs = gx.to_host(&be).unwrap();
        for (row, pair) in host.chunks_exact(12).zip(xs.chunks_exact(6)) {
            assert_eq!(&row[..6], pair, "{what}: concat, first part");
            assert_eq!(&row[6..], pair, "{what}: concat, second part");
        }
        let (a, b) = ops::channels_split(&be, &both, 6).unwrap();
        assert_eq!(a.to_host(&be).unwrap(), xs, "{what}: split, first part");
        assert_eq!(b.to_host(&be).unwrap(), xs, "{what}: split, second part");
    }
    let wrong = CudaTensor::from_tensor(&be, &random(&[2, 6, 9, 6], 362, 1.0, 0.0), DType::F32);
    assert!(
        ops::upsample2x_backward(&be, &wrong.unwrap(), x.shape()).is_err(),
        "shapes are checked"
    );
}

// ---------------------------------------------------------------------------
// Layer normalisation

/// Layer norm over the last axis, f16 and f32: rows not a multiple of a
/// block's 8, columns not of a warp's 32, and enough rows for several
/// chunks of the parameter gradients' sums; the gradients of γ and β are
/// accumulated into what the buffers held.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn layer_norm_matches_the_cpu_layer() {
    let be = gpu_or_skip!();
    for (shape, seed) in [(vec![3usize, 5, 40], 300u64), (vec![2, 300, 24], 310)] {
        let c = *shape.last().unwrap();
        let mut ln = LayerNorm::new("ln", c, 1e-5);
        let (gamma, beta) = (random_vec(c, seed, 1.0), random_vec(c, seed + 1, 0.5));
        {
            let mut p = ln.params_mut();
            p[0].value.data_mut().copy_from_slice(&gamma);
            p[1].value.data_mut().copy_from_slice(&beta);
        }
        // An offset per column, so that mean and variance matter.
        let x = random(&shape, seed + 2, 1.5, 0.25);
        let g = random(&shape, seed + 3, 1.0, 0.0);
        let y = ln.forward(&x, Mode::Train).unwrap();
        let dx = ln.backward(&g).unwrap();
        let (dgamma, dbeta) = {
            let p = ln.params_mut();
            (p[0].grad.data().to_vec(), p[1].grad.data().to_vec())
        };
        let held = random_vec(c, seed + 4, 1.0);
        for (dtype, rel, abs) in [(DType::F16, 2e-3, 2e-3), (DType::F32, 1e-4, 1e-5)] {
            let what = format!("layer norm {shape:?} {dtype:?}");
            let (gamma_d, beta_d) = (upload_f32(&be, &gamma), upload_f32(&be, &beta));
            let gx = CudaTensor::from_tensor(&be, &x, dtype).unwrap();
            let gg = CudaTensor::from_tensor(&be, &g, dtype).unwrap();
            let (gy, saved) =
                ops::layer_norm_forward(&be, &gx, &gamma_d.as_view(), &beta_d.as_view(), 1e-5)
                    .unwrap();
            let mut dgamma_d = upload_f32(&be, &held);
            let mut dbeta_d = upload_f32(&be, &held);
            let gdx = ops::layer_norm_backward(
                &be,
                &gg,
                &gx,
                &saved,
                &gamma_d.as_view(),
                &mut dgamma_d.as_view_mut(),
                &mut dbeta_d.as_view_mut(),
            )
            .unwrap();
            let plus_held =
                |v: &[f32]| -> Vec<f32> { v.iter().zip(&held).map(|(a, b)| a + b).collect() };
            assert_close(
                &format!("{what} forward"),
                &gy.to_host(&be).unwrap(),
                y.data(),
                rel,
                abs,
            );
            assert_close(
                &format!("{what} dx"),
                &gdx.to_host(&be).unwrap(),
                dx.data(),
                rel,
                abs,
            );
            assert_close(
                &format!("{what} dγ"),
                &download(&be, &dgamma_d),
                &plus_held(&dgamma),
                1e-4,
                1e-5,
            );
            assert_close(
                &format!("{what} dβ"),
                &download(&be, &dbeta_d),
                &plus_held(&dbeta),
                1e-4,
                1e-5,
            );
        }
    }
}

// ---------------------------------------------------------------------------
// Loss

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn soft_target_cross_entropy_matches_the_cpu_loss() {
    let be = gpu_or_skip!();
    let (n, k) = (29usize, 10usize);
    let logits = random(&[n, k], 310, 3.0, 0.0);
    // Mixup-like targets: two classes per row, weights λ and 1 - λ, then
    // label smoothing 0.1 as the learner applies it.
    let mut targets = vec![0.0f32; n * k];
    for (i, row) in targets.chunks_exact_mut(k).enumerate() {
        let lambda = (i as f32 * 0.37).fract();
        row[(i * 3) % k] += lambda;
        row[(i * 7 + 1) % k] += 1.0 - lambda;
        for t in row.iter_mut() {
            *t = 0.9 * *t + 0.1 / k as f32;
        }
    }
    let cpu = soft_cross_entropy(
        &logits,
        &Tensor::from_vec(&[n, k], targets.clone()).unwrap(),
    )
    .unwrap();
    let targets_d = upload_f32(&be, &targets);
    for (loss_scale, share) in [(1.0f32, 1.0f32), (1024.0, 0.25)] {
        let scale_d = upload_f32(&be, &[loss_scale]);
        let scale = ops::GradScale {
            loss_scale: &scale_d,
            share,
        };
        let out = ops::soft_cross_entropy(&be, &upload(&be, &logits), &targets_d.as_view(), scale)
            .unwrap();
        let what = format!("soft xent scale={loss_scale} share={share}");
        // f32 softmax vs f64, then one f16 rounding of the gradient.
        assert_loss_matches(
            &be,
            &what,
            &out,
            &cpu,
            loss_scale * share,
            (2e-3, 1e-3),
            1e-4,
        );
    }
    let short = upload_f32(&be, &targets[..k]);
    let one = upload_f32(&be, &[1.0]);
    let unit = ops::GradScale {
        loss_scale: &one,
        share: 1.0,
    };
    assert!(
        ops::soft_cross_entropy(&be, &upload(&be, &logits), &short.as_view(), unit).is_err(),
        "the targets' length is checked"
    );
}

/// Focal loss (`train.loss = "focal"`), hard labels with label smoothing
/// and soft targets, γ of 0 (the cross-entropy), 0.5 and 2, f32 and f16
/// logits: the CPU's loss, gradient (times the loss scale and the
/// micro-batch's share) and correct count. The rows include a confident
/// one (p of its top class ≈ 1), whose small weights the kernel must
/// keep, and a NaN logit, which must poison the loss.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn focal_loss_matches_the_cpu_loss() {
    let be = gpu_or_skip!();
    let (n, k) = (13usize, 10usize);
    let mut logits = random(&[n, k], 340, 3.0, 0.0);
    logits.data_mut()[2 * k + 4] = 12.0;
    let labels: Vec<u32> = (0..n as u32).map(|i| (i * 7 + 3) % k as u32).collect();
    let mut targets = vec![0.0f32; n * k];
    for (i, row) in targets.chunks_exact_mut(k).enumerate() {
        let lambda = (i as f32 * 0.37).fract();
        row[(i * 3) % k] += lambda;
        row[(i * 7 + 1) % k] += 1.0 - lambda;
        for t in row.iter_mut() {
            *t = 0.9 * *t + 0.1 / k as f32;
        }
    }
    let targets_t = Tensor::from_vec(&[n, k], targets.clone()).unwrap();
    let labels_d = ops::upload_labels(&be, &labels, k).unwrap();
    let targets_d = upload_f32(&be, &targets);
    let (loss_scale, share) = (256.0f32, 0.5f32);
    let scale_d = upload_f32(&be, &[loss_scale]);
    let scale = ops::GradScale {
        loss_scale: &scale_d,
        share,
    };
    for gamma in [0.0f32, 0.5, 2.0] {
        let hard = focal_loss(&logits, &labels, 0.1, gamma).unwrap();
        let soft = soft_focal_loss(&logits, &targets_t, gamma).unwrap();
        if gamma == 0.0 {
            let xent = softmax_cross_entropy(&logits, &labels, 0.1).unwrap();
            assert!(
                (hard.loss - xent.loss).abs() <= 1e-5 * xent.loss,
                "γ = 0 is the cross-entropy"
            );
        }
        for (dtype, rel, abs) in [(DType::F32, 1e-4, 1e-5), (DType::F16, 2e-3, 1e-3)] {
            let x = CudaTensor::from_tensor(&be, &logits, dtype).unwrap();
            let outs = [
                (
                    "hard",
                    &hard,
                    ops::focal_loss(&be, &x, &labels_d.slice.as_view(), 0.1, gamma, scale),
                ),
                (
                    "soft",
                    &soft,
                    ops::soft_focal_loss(&be, &x, &targets_d.as_view(), gamma, scale),
                ),
            ];
            for (what, cpu, out) in outs {
                let what = format!("focal {what} γ={gamma} {dtype:?}");
                let out = out.unwrap();
                assert_loss_matches(&be, &what, &out, cpu, loss_scale * share, (rel, abs), 1e-4);
            }
        }
    }
    let mut poisoned = logits.clone();
    poisoned.data_mut()[5] = f32::NAN;
    let x = CudaTensor::from_tensor(&be, &poisoned, DType::F32).unwrap();
    let out = ops::focal_loss(&be, &x, &labels_d.slice.as_view(), 0.1, 2.0, scale).unwrap();
    assert!(
        out.read_summary(&be).unwrap().0.is_nan(),
        "a NaN logit poisons the loss"
    );
    let x = CudaTensor::from_tensor(&be, &logits, DType::F32).unwrap();
    for bad in [-1.0f32, f32::NAN, f32::INFINITY] {
        assert!(
            ops::focal_loss(&be, &x, &labels_d.slice.as_view(), 0.1, bad, scale).is_err(),
            "γ = {bad} is refused"
        );
    }
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn softmax_cross_entropy_matches_the_cpu_loss() {
    let be = gpu_or_skip!();
    let (n, k) = (37usize, 10usize);
    let mut logits = random(&[n, k], 300, 3.0, 0.0);
    let labels: Vec<u32> = (0..n as u32).map(|i| (i * 7 + 3) % k as u32).collect();
    let labels_d = ops::upload_labels(&be, &labels, k).unwrap();
    for smoothing in [0.0f32, 0.1] {
        for (loss_scale, share) in [(1.0f32, 1.0f32), (1024.0, 0.25)] {
            let cpu = softmax_cross_entropy(&logits, &labels, smoothing).unwrap();
            let scale_d = upload_f32(&be, &[loss_scale]);
            let scale = ops::GradScale {
                loss_scale: &scale_d,
                share,
            };
            let out = ops::softmax_cross_entropy(
                &be,
                &upload(&be, &logits),
                &labels_d.slice.as_view(),
                smoothing,
                scale,
            )
            .unwrap();
            let what = format!("xent s={smoothing} scale={loss_scale} share={share}");
            // f32 softmax vs f64, then one f16 rounding of the gradient.
            assert_loss_matches(
                &be,
                &what,
                &out,
                &cpu,
                loss_scale * share,
                (2e-3, 1e-3),
                1e-4,
            );
        }
    }
    // A NaN logit gives a NaN loss (the inf/NaN check downstream sees it).
    logits.data_mut()[3] = f32::NAN;
    let one = upload_f32(&be, &[1.0]);
    let unit = ops::GradScale {
        loss_scale: &one,
        share: 1.0,
    };
    let out = ops::softmax_cross_entropy(
        &be,
        &upload(&be, &logits),
        &labels_d.slice.as_view(),
        0.0,
        unit,
    )
    .unwrap();
    assert!(out.read_summary(&be).unwrap().0.is_nan());
    assert!(
        ops::upload_labels(&be, &[10], k).is_err(),
        "labels are validated"
    );
}

// ---------------------------------------------------------------------------
// Optimizer

/// One parameter group on the host: weights, moments, weight decay.
struct HostGroup {
    p: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    decay: bool,
}

/// headroom-optim's `clip_grad_norm` + `AdamW::step` over the groups, on the
/// host, in the same f32/f64 arithmetic (this crate cannot depend on
/// headroom-optim, which depends on it). Returns the global norm.
fn reference_step(
    groups: &mut [HostGroup],
    grads: &[Vec<f32>],
    h: &AdamWConfig,
    lr: f32,
    t: u64,
    max_norm: f32,
) -> f64 {
    let norm = grads
        .iter()
        .flat_map(|g| g.iter())
        .map(|&v| (v as f64) * (v as f64))
        .sum::<f64>()
        .sqrt();
    let coef = if max_norm > 0.0 && norm > max_norm as f64 {
        (max_norm as f64 / (norm + 1e-6)) as f32
    } else {
        1.0
    };
    let tf = t as f64;
    let bc1 = 1.0 - (h.beta1 as f64).powf(tf);
    let bc2 = 1.0 - (h.beta2 as f64).powf(tf);
    let neg_step = (-(lr as f64) / bc1) as f32;
    let bc2_sqrt = bc2.sqrt() as f32;
    let decay_factor = (1.0 - lr as f64 * h.weight_decay as f64) as f32;
    for (group, g) in groups.iter_mut().zip(grads) {
        let decay = if group.decay { decay_factor } else { 1.0 };
        let HostGroup { p, m, v, .. } = group;
        for (((p, m), v), &g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
            let g = g * coef;
            *m += (1.0 - h.beta1) * (g - *m);
            *v = h.beta2 * *v + (1.0 - h.beta2) * g * g;
            let denom = v.sqrt() / bc2_sqrt + h.eps;
            *p = *p * decay + neg_step * (*m / denom);
        }
    }
    norm
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn fused_adamw_matches_the_reference_step_with_clipping_and_loss_scaling() {
    let be = gpu_or_skip!();
    // With an f16 compute copy (mixed precision: adamw_fused) and without
    // one (f32 training: adamw_fused_f32).
    for dtype in [DType::F16, DType::F32] {
        fused_adamw_case(&be, dtype);
    }
}

fn fused_adamw_case(be: &CudaBackend, dtype: DType) {
    let hyper = AdamWConfig {
        weight_decay: 0.05,
        ..AdamWConfig::default()
    };
    let lens = [(1000usize, true), (37, false)];
    let mut host: Vec<HostGroup> = lens
        .iter()
        .enumerate()
        .map(|(i, &(n, decay))| HostGroup {
            p: random_vec(n, 400 + i as u64, 0.5),
            m: vec![0.0; n],
            v: vec![0.0; n],
            decay,
        })
        .collect();
    let mut groups: Vec<ParamGroup> = host
        .iter()
        .map(|hg| ParamGroup::from_host(be, hg.decay, &hg.p, dtype).unwrap())
        .collect();
    assert_eq!(groups[0].compute.is_some(), dtype == DType::F16);
    let loss_scale = 1024.0f32;
    let mut opt = FusedAdamW::new(be, hyper.clone(), fixed_scaler(loss_scale), &groups).unwrap();
    for (step, (lr, max_norm)) in [(1e-2f32, 0.0f32), (5e-3, 1.0), (1e-3, 1e3)]
        .into_iter()
        .enumerate()
    {
        let t = step as u64 + 1;
        let grads: Vec<Vec<f32>> = lens
            .iter()
            .enumerate()
            .map(|(i, &(n, _))| random_vec(n, 500 + 10 * t + i as u64, 0.2))
            .collect();
        for (group, g) in groups.iter_mut().zip(&grads) {
            // Backward leaves the gradients multiplied by the loss scale (a
            // power of two: exact).
            let scaled: Vec<f32> = g.iter().map(|v| v * loss_scale).collect();
            be.compute_stream()
                .memcpy_htod(&scaled, &mut group.grad.slice)
                .unwrap();
        }
        let norm = reference_step(&mut host, &grads, &hyper, lr, t, max_norm);
        opt.step(be, &mut groups, t - 1, lr, max_norm, true)
            .unwrap();
        let state = opt.read_state(be).unwrap();
        assert_eq!((state.found_inf, state.skipped), (0, 0), "step {t}");
        assert_eq!(state.applied, t, "step {t}: t advances");
        assert_eq!(state.next_scale, loss_scale, "step {t}: no growth");
        assert!(
            (state.grad_norm as f64 - norm).abs() <= 1e-5 * norm,
            "step {t}: norm {} vs {norm}",
            state.grad_norm
        );
        if max_norm > 0.0 && norm > max_norm as f64 {
            assert!(state.clip_factor < 1.0, "step {t} clips");
        } else {
            assert_eq!(state.clip_factor, 1.0, "step {t} does not clip");
        }
        for (i, (group, hg)) in groups.iter().zip(&host).enumerate() {
            let what = format!("{dtype:?} step {t} group {i}");
            assert_close(
                &format!("{what} master"),
                &group.read_master(be).unwrap(),
                &hg.p,
                1e-5,
                1e-6,
            );
            let (gm, gv) = group.read_moments(be).unwrap();
            assert_close(&format!("{what} m"), &gm, &hg.m, 1e-4, 1e-6);
            assert_close(&format!("{what} v"), &gv, &hg.v, 1e-4, 1e-6);
            let master = group.read_master(be).unwrap();
            let compute = group.read_compute(be).unwrap();
            let copy_of = |w: f32| if dtype == DType::F16 { h(w) } else { w };
            assert!(
                compute.iter().zip(&master).all(|(&c, &w)| c == copy_of(w)),
                "{what}: the layers compute with the (rounded) master"
            );
            assert!(
                download(be, &group.grad.slice).iter().all(|&g| g == 0.0),
                "{what}: zero_grad"
            );
        }
    }
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn an_inf_or_nan_gradient_skips_the_step_and_backs_off_the_scale() {
    let be = gpu_or_skip!();
    let values = random_vec(300, 600, 1.0);
    let mut groups = vec![ParamGroup::from_host(&be, true, &values, DType::F16).unwrap()];
    let config = LossScalerConfig::default();
    let mut opt = FusedAdamW::new(&be, AdamWConfig::default(), config, &groups).unwrap();
    let mut scaler = LossScaler::new(config).unwrap();
    for bad in [f32::INFINITY, f32::NAN] {
        let mut grads = random_vec(300, 601, 1.0);
        grads[17] = bad;
        be.compute_stream()
            .memcpy_htod(&grads, &mut groups[0].grad.slice)
            .unwrap();
        opt.step(&be, &mut groups, 0, 1e-2, 1.0, true).unwrap();
        let state = opt.read_state(&be).unwrap();
        assert_eq!((state.found_inf, state.skipped), (1, 1), "{bad}");
        assert_eq!(scaler.update(true), StepOutcome::Skipped);
        assert_eq!(state.next_scale, scaler.scale(), "{bad}: backed off");
        assert_eq!(state.applied, 0, "{bad}: t does not advance");
        assert_eq!(
            groups[0].read_master(&be).unwrap(),
            values,
            "{bad}: weights untouched"
        );
        let (m, v) = groups[0].read_moments(&be).unwrap();
        assert!(
            m.iter().chain(&v).all(|&x| x == 0.0),
            "{bad}: moments untouched"
        );
        assert!(
            download(&be, &groups[0].grad.slice)
                .iter()
                .all(|&g| g == 0.0),
            "{bad}: gradients cleared"
        );
    }
    assert_eq!(scaler.scale(), 16_384.0, "halved twice");
    assert_eq!(download(&be, opt.loss_scale()), [16_384.0]);
}

/// The loss scaler on the device (in step_finalize) against the reference
/// `LossScaler`, over growth, back-off, the floor and the ceiling; the
/// gradients are scaled by the device's scale as backward would leave them,
/// so the norm also shows the kernel unscales by the scale it holds.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn the_device_loss_scaler_follows_the_reference_rule() {
    let be = gpu_or_skip!();
    let n = 64;
    let values = random_vec(n, 610, 1.0);
    let mut groups = vec![ParamGroup::from_host(&be, false, &values, DType::F16).unwrap()];
    let config = LossScalerConfig {
        init_scale: 4096.0,
        growth_interval: 3,
        min_scale: 1024.0,
        max_scale: 16_384.0,
        ..LossScalerConfig::default()
    };
    let mut opt = FusedAdamW::new(&be, AdamWConfig::default(), config, &groups).unwrap();
    let mut reference = LossScaler::new(config).unwrap();
    // Growth twice (to the ceiling), a third growth held at the ceiling,
    // back-off to the floor and past it, then growth again.
    let verdicts = "ccc ccc ccc i c i i i ccc c".replace(' ', "");
    for (step, verdict) in verdicts.chars().enumerate() {
        let overflow = verdict == 'i';
        let grads = random_vec(n, 620 + step as u64, 0.5);
        let scale = reference.scale();
        let mut scaled: Vec<f32> = grads.iter().map(|g| g * scale).collect();
        if overflow {
            scaled[5] = f32::INFINITY;
        }
        be.compute_stream()
            .memcpy_htod(&scaled, &mut groups[0].grad.slice)
            .unwrap();
        opt.step(&be, &mut groups, reference.applied_steps(), 1e-3, 0.0, true)
            .unwrap();
        let state = opt.read_state(&be).unwrap();
        reference.update(overflow);
        let what = format!("step {step} ({verdict})");
        assert_eq!(state.found_inf, overflow as u32, "{what}");
        assert_eq!(state.next_scale, reference.scale(), "{what}: scale");
        assert_eq!(
            state.clean_steps,
            reference.state().clean_steps,
            "{what}: clean steps"
        );
        assert_eq!(state.applied, reference.applied_steps(), "{what}: applied");
        assert_eq!(
            download(&be, opt.loss_scale()),
            [reference.scale()],
            "{what}"
        );
        if !overflow {
            let norm = grads
                .iter()
                .map(|&g| g as f64 * g as f64)
                .sum::<f64>()
                .sqrt();
            assert!(
                (state.grad_norm as f64 - norm).abs() <= 1e-5 * norm,
                "{what}: the norm of the unscaled gradients, {} vs {norm}",
                state.grad_norm
            );
        }
    }
    assert_eq!(
        reference.scale(),
        2048.0,
        "the sequence ends above the floor"
    );
}

/// A step queued while the verdict of the one before is unknown gets one
/// learning rate per count of applied steps it may find; the device picks
/// by the count it holds, and a schedule without that count skips the step
/// and says so.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn the_device_picks_the_learning_rate_of_the_t_it_finds() {
    let be = gpu_or_skip!();
    let n = 100;
    let hyper = AdamWConfig {
        weight_decay: 0.05,
        ..AdamWConfig::default()
    };
    let mut host = vec![HostGroup {
        p: random_vec(n, 630, 0.5),
        m: vec![0.0; n],
        v: vec![0.0; n],
        decay: true,
    }];
    let mut groups = vec![ParamGroup::from_host(&be, true, &host[0].p, DType::F16).unwrap()];
    let mut opt = FusedAdamW::new(&be, hyper.clone(), fixed_scaler(1.0), &groups).unwrap();
    let put = |groups: &mut Vec<ParamGroup>, seed: u64, overflow: bool| {
        let mut g = random_vec(n, seed, 0.2);
        let clean = g.clone();
        if overflow {
            g[0] = f32::NAN;
        }
        be.compute_stream()
            .memcpy_htod(&g, &mut groups[0].grad.slice)
            .unwrap();
        vec![clean]
    };
    // Step 1, applied (t = 1).
    let grads = put(&mut groups, 640, false);
    reference_step(&mut host, &grads, &hyper, 1e-2, 1, 0.0);
    opt.set_schedule(&be, 0, &[1e-2]).unwrap();
    opt.enqueue(&be, &mut groups, 0.0, true).unwrap();
    // Step 2, queued as if step 1's verdict were unknown: candidates for 0
    // and 1 applied steps; the device holds 1, so t = 2 at 5e-3.
    let grads = put(&mut groups, 641, false);
    reference_step(&mut host, &grads, &hyper, 5e-3, 2, 0.0);
    opt.set_schedule(&be, 0, &[7e-2, 5e-3]).unwrap();
    opt.enqueue(&be, &mut groups, 0.0, true).unwrap();
    // Step 3 overflows: skipped, t stays 2.
    put(&mut groups, 642, true);
    opt.set_schedule(&be, 1, &[9e-2, 8e-2]).unwrap();
    opt.enqueue(&be, &mut groups, 0.0, true).unwrap();
    // Step 4: candidates from 1; the device holds 2 applied steps: t = 3.
    let grads = put(&mut groups, 643, false);
    reference_step(&mut host, &grads, &hyper, 2e-3, 3, 0.0);
    opt.set_schedule(&be, 1, &[6e-2, 2e-3, 4e-2]).unwrap();
    opt.enqueue(&be, &mut groups, 0.0, true).unwrap();
    let state = opt.read_state(&be).unwrap();
    assert_eq!((state.skipped, state.applied), (0, 3));
    assert_close(
        "weights after picked rates",
        &groups[0].read_master(&be).unwrap(),
        &host[0].p,
        1e-5,
        1e-6,
    );
    // A schedule that has no rate for 3 applied steps: skipped, nothing
    // changes, the scaler included.
    let before = groups[0].read_master(&be).unwrap();
    put(&mut groups, 644, false);
    opt.set_schedule(&be, 5, &[1e-2]).unwrap();
    opt.enqueue(&be, &mut groups, 0.0, true).unwrap();
    let state = opt.read_state(&be).unwrap();
    assert_eq!(
        (state.schedule_missed, state.skipped, state.found_inf),
        (1, 1, 0)
    );
    assert_eq!((state.applied, state.next_scale), (3, 1.0));
    assert_eq!(groups[0].read_master(&be).unwrap(), before);
    assert!(
        opt.set_schedule(&be, 0, &[1e-3; 5]).is_err(),
        "at most 4 candidates"
    );
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn running_statistics_are_put_back_only_after_a_skipped_step() {
    let be = gpu_or_skip!();
    let c = 300;
    let saved = (random_vec(c, 650, 1.0), random_vec(c, 651, 1.0));
    let live = (random_vec(c, 652, 1.0), random_vec(c, 653, 1.0));
    let saved_d = (upload_f32(&be, &saved.0), upload_f32(&be, &saved.1));
    for skipped in [0u32, 1] {
        let verdict = be
            .compute_stream()
            .clone_htod(&[StepState {
                skipped,
                ..StepState::default()
            }])
            .unwrap();
        let mut mean = upload_f32(&be, &live.0);
        let mut var = upload_f32(&be, &live.1);
        ops::batch_norm_restore_if_skipped(
            &be,
            &verdict,
            (&saved_d.0, &saved_d.1),
            &mut mean,
            &mut var,
        )
        .unwrap();
        let expected = if skipped == 1 { &saved } else { &live };
        assert_eq!(download(&be, &mean), expected.0, "skipped = {skipped}");
        assert_eq!(download(&be, &var), expected.1, "skipped = {skipped}");
    }
    let short = upload_f32(&be, &saved.0[..c - 1]);
    let verdict = be
        .compute_stream()
        .clone_htod(&[StepState::default()])
        .unwrap();
    let (mut mean, mut var) = (upload_f32(&be, &live.0), upload_f32(&be, &live.1));
    assert!(
        ops::batch_norm_restore_if_skipped(
            &be,
            &verdict,
            (&short, &saved_d.1),
            &mut mean,
            &mut var
        )
        .is_err(),
        "lengths are checked"
    );
}

// ---------------------------------------------------------------------------
// Memory and a composed block

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn the_memory_budget_refuses_allocations_as_values() {
    if gpu().is_none() {
        return;
    }
    // A backend of its own: the budget is per backend.
    let be = CudaBackend::new(0).unwrap();
    let limit = 8u64 << 20;
    be.set_memory_limit(Some(limit)).unwrap();
    // All the backend holds now is cuBLAS's workspace, sized to the budget.
    let before = be.memory_stats().in_use_bytes;
    let workspace = blas_workspace_bytes(be.info().arch(), Some(limit));
    assert_eq!(before, workspace);
    assert_eq!(workspace, 256 << 10, "1/32 of the budget");
    let big = CudaTensor::zeros(&be, &[7 << 19], DType::F16).unwrap(); // 7 MiB
    let err = CudaTensor::zeros(&be, &[1 << 19], DType::F16).unwrap_err(); // 1 MiB more
    assert!(err.is_out_of_memory(), "{err}");
    let model_err: headroom_model::ModelError = err.into();
    assert!(model_err.is_out_of_memory());
    drop(big);
    assert_eq!(
        be.memory_stats().in_use_bytes,
        before,
        "freed tensors give their bytes back"
    );
    assert!(CudaTensor::zeros(&be, &[1 << 19], DType::F16).is_ok());
    be.set_memory_limit(None).unwrap();
    assert_eq!(
        be.memory_stats().in_use_bytes,
        blas_workspace_bytes(be.info().arch(), None),
        "without a budget cuBLAS gets NVIDIA's recommended workspace"
    );
    be.empty_cache().unwrap();
    assert!(be.memory_stats().oom_events >= 1);
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_basic_block_forward_and_backward_match_the_cpu_layers() {
    let be = gpu_or_skip!();
    // conv3x3 → BN → ReLU → conv3x3 → BN, + input, ReLU (the reference
    // ResNet's basic_block), at 16 channels.
    let (n, hw, c) = (4usize, 10usize, 16usize);
    let mut rng = InitRng::new(700);
    let mut conv1 = Conv2d::new("b.conv1", c, c, 3, 1, 1, false, &mut rng).unwrap();
    let mut conv2 = Conv2d::new("b.conv2", c, c, 3, 1, 1, false, &mut rng).unwrap();
    let mut w = Vec::new();
    for conv in [&mut conv1, &mut conv2] {
        let mut p = conv.params_mut();
        round_f16(&mut p[0].value);
        w.push(p[0].value.data().to_vec());
    }
    let bn1 = bn_case(c, 701);
    let bn2 = bn_case(c, 702);
    let (g1, b1, g2, b2) = (
        bn1.gamma.clone(),
        bn1.beta.clone(),
        bn2.gamma.clone(),
        bn2.beta.clone(),
    );
    let mut block = Residual::new(vec![
        Box::new(conv1),
        Box::new(bn1.cpu),
        Box::new(Relu::new()),
        Box::new(conv2),
        Box::new(bn2.cpu),
    ]);
    let mut out_relu = Relu::new();
    let x = random(&[n, hw, hw, c], 703, 1.0, 0.0);
    let z_cpu = block.forward(&x, Mode::Train).unwrap();
    let y = out_relu.forward(&z_cpu, Mode::Train).unwrap();
    // No gradient where the output ReLU's input is within rounding of zero:
    // there the device's mask may differ from the CPU's, and one flipped
    // element moves its channel's dgamma by |g·x̂| (≈2 in a sum of ≈10; seen
    // in emulation, where dgamma recomputed in f64 from the device's own
    // tensors matched the kernel to 1e-6). The inner ReLU's flips remain,
    // hence the L2 bounds below.
    let mut g = random(y.shape(), 704, 1.0, 0.0);
    for (gv, zv) in g.data_mut().iter_mut().zip(z_cpu.data()) {
        if zv.abs() < 1e-2 {
            *gv = 0.0;
        }
    }
    let dx = block.backward(&out_relu.backward(&g).unwrap()).unwrap();
    let cpu_grads: Vec<Vec<f32>> = block
        .params_mut()
        .iter()
        .map(|p| p.grad.data().to_vec())
        .collect();

    let s = ConvShape {
        n,
        h: hw,
        w: hw,
        cin: c,
        cout: c,
        k: 3,
        stride: 1,
        pad: 1,
    };
    let (w1, w2) = (upload_f16(&be, &w[0]), upload_f16(&be, &w[1]));
    let (g1d, b1d, g2d, b2d) = (
        upload_f32(&be, &g1),
        upload_f32(&be, &b1),
        upload_f32(&be, &g2),
        upload_f32(&be, &b2),
    );
    let mut running: Vec<CudaSlice<f32>> = [0.0f32, 1.0, 0.0, 1.0]
        .iter()
        .map(|&v| upload_f32(&be, &vec![v; c]))
        .collect();
    let (r1, r2) = running.split_at_mut(2);
    let (rm1, rv1) = r1.split_at_mut(1);
    let (rm2, rv2) = r2.split_at_mut(1);
    let gx = upload(&be, &x);
    // Forward.
    let a1 = ops::conv2d_forward(
        &be,
        &gx,
        &AnyView::F16(w1.as_view()),
        None,
        s,
        ConvPlan::default(),
    )
    .unwrap();
    let relu_cfg = BatchNormConfig { relu: true, ..BN };
    let (h1, saved1) = ops::batch_norm_forward_train(
        &be,
        &a1,
        &g1d.as_view(),
        &b1d.as_view(),
        &mut rm1[0].as_view_mut(),
        &mut rv1[0].as_view_mut(),
        relu_cfg,
    )
    .unwrap();
    let a2 = ops::conv2d_forward(
        &be,
        &h1,
        &AnyView::F16(w2.as_view()),
        None,
        s,
        ConvPlan::default(),
    )
    .unwrap();
    let (mut z, saved2) = ops::batch_norm_forward_train(
        &be,
        &a2,
        &g2d.as_view(),
        &b2d.as_view(),
        &mut rm2[0].as_view_mut(),
        &mut rv2[0].as_view_mut(),
        BN,
    )
    .unwrap();
    ops::add_inplace(&be, &mut z, &gx).unwrap();
    let out = ops::relu_forward(&be, &z).unwrap();
    assert_close_l2("block forward", &out.to_host(&be).unwrap(), y.data(), 1e-2);
    // Backward.
    let gg = upload(&be, &g);
    let gz = ops::relu_backward(&be, &gg, &out).unwrap();
    let mut grads: Vec<CudaSlice<f32>> = cpu_grads
        .iter()
        .map(|v| upload_f32(&be, &vec![0.0; v.len()]))
        .collect();
    let (gw1, rest) = grads.split_at_mut(1);
    let (gbn1, rest) = rest.split_at_mut(2);
    let (gw2, gbn2) = rest.split_at_mut(1);
    let (gbn1g, gbn1b) = gbn1.split_at_mut(1);
    let (gbn2g, gbn2b) = gbn2.split_at_mut(1);
    let ga2 = ops::batch_norm_backward(
        &be,
        &gz,
        &a2,
        &saved2,
        &g2d.as_view(),
        &mut gbn2g[0].as_view_mut(),
        &mut gbn2b[0].as_view_mut(),
        false,
    )
    .unwrap();
    let gh1 = ops::conv2d_backward(
        &be,
        &h1,
        &ga2,
        &AnyView::F16(w2.as_view()),
        &mut gw2[0].as_view_mut(),
        None,
        s,
        ConvPlan::default(),
    )
    .unwrap();
    let ga1 = ops::batch_norm_backward(
        &be,
        &gh1,
        &a1,
        &saved1,
        &g1d.as_view(),
        &mut gbn1g[0].as_view_mut(),
        &mut gbn1b[0].as_view_mut(),
        true,
    )
    .unwrap();
    let mut gdx = ops::conv2d_backward(
        &be,
        &gx,
        &ga1,
        &AnyView::F16(w1.as_view()),
        &mut gw1[0].as_view_mut(),
        None,
        s,
        ConvPlan::default(),
    )
    .unwrap();
    ops::add_inplace(&be, &mut gdx, &gz).unwrap();
    // f16 activations through two convolutions and two batch norms, and
    // ReLU masks that may differ within rounding of zero: an L2 bound.
    assert_close_l2("block dx", &gdx.to_host(&be).unwrap(), dx.data(), 3e-2);
    let names = [
        "conv1 dW",
        "bn1 dgamma",
        "bn1 dbeta",
        "conv2 dW",
        "bn2 dgamma",
        "bn2 dbeta",
    ];
    for ((name, gpu), cpu) in names.iter().zip(&grads).zip(&cpu_grads) {
        assert_close_l2(name, &download(&be, gpu), cpu, 3e-2);
    }
}

// ---------------------------------------------------------------------------
// Fused residual blocks (a basic block's last batch norm, sum and ReLU)

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn fused_residual_kernels_round_like_the_unfused_ones() {
    let be = gpu_or_skip!();
    // 40 channels: the _v8 kernels (bn_apply_add_v8_f16,
    // bn_backward_partial_mask_v8_f16); 12: the one-at-a-time ones. 16×16
    // images: 4 chunks of 256 rows, so each of the 51 row lanes of the
    // partial kernels takes 5 rows (two rounds of its 4 loads at once).
    for shape in [[4usize, 6, 6, 40], [4, 16, 16, 40], [4, 6, 6, 12]] {
        fused_residual_case(&be, shape);
    }
}

fn fused_residual_case(be: &CudaBackend, shape: [usize; 4]) {
    let c = shape[3];
    let BnCase { gamma, beta, .. } = bn_case(c, 800);
    let x = random(&shape, 801, 1.5, 0.2);
    let mut skip = random(&shape, 802, 1.0, 0.0);
    let mut acc = random(&shape, 803, 1.0, 0.0);
    // Signed zeros, infinities, NaN and sums past f16's range.
    let specials = [
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        65504.0,
        -65504.0,
    ];
    for (i, &v) in specials.iter().enumerate() {
        skip.data_mut()[37 * i + 3] = v;
        acc.data_mut()[41 * i + 5] = v;
    }
    let grad = random(&shape, 804, 1.0, 0.0);
    let (gx, gskip, gg) = (upload(be, &x), upload(be, &skip), upload(be, &grad));
    let (gamma_d, beta_d) = (upload_f32(be, &gamma), upload_f32(be, &beta));
    let bits = |t: &CudaTensor| -> Vec<u16> {
        let v: Vec<f16> = be.download(t.f16().unwrap()).unwrap();
        v.iter().map(|h| h.to_bits()).collect()
    };
    let bits32 =
        |s: &CudaSlice<f32>| -> Vec<u32> { download(be, s).iter().map(|v| v.to_bits()).collect() };
    let relu = BatchNormConfig { relu: true, ..BN };
    let mut running: Vec<CudaSlice<f32>> = [0.0f32, 1.0, 0.0, 1.0]
        .iter()
        .map(|&v| upload_f32(be, &vec![v; c]))
        .collect();
    let (plain, fused) = running.split_at_mut(2);

    // Training: bn_apply, add_inplace, relu_forward against bn_apply_add.
    let (mut z, plain_saved) = {
        let (m, v) = plain.split_at_mut(1);
        let (gm, gv) = (&mut m[0].as_view_mut(), &mut v[0].as_view_mut());
        let (g, b) = (gamma_d.as_view(), beta_d.as_view());
        ops::batch_norm_forward_train(be, &gx, &g, &b, gm, gv, BN).unwrap()
    };
    ops::add_inplace(be, &mut z, &gskip).unwrap();
    let want = ops::relu_forward(be, &z).unwrap();
    let (got, fused_saved) = {
        let (m, v) = fused.split_at_mut(1);
        let (gm, gv) = (&mut m[0].as_view_mut(), &mut v[0].as_view_mut());
        let (g, b) = (gamma_d.as_view(), beta_d.as_view());
        ops::batch_norm_add_forward_train(be, &gx, &gskip, &g, &b, gm, gv, relu).unwrap()
    };
    assert_eq!(bits(&want), bits(&got), "training forward");
    assert_eq!(bits32(&plain[0]), bits32(&fused[0]), "running mean");
    assert_eq!(bits32(&plain[1]), bits32(&fused[1]), "running var");
    // A skip of another shape is refused before the running statistics
    // change.
    let before = bits32(&fused[0]);
    let odd = upload(be, &random(&[4, 6, 5, 40], 805, 1.0, 0.0));
    let err = {
        let (m, v) = fused.split_at_mut(1);
        let (gm, gv) = (&mut m[0].as_view_mut(), &mut v[0].as_view_mut());
        let (g, b) = (gamma_d.as_view(), beta_d.as_view());
        ops::batch_norm_add_forward_train(be, &gx, &odd, &g, &b, gm, gv, relu).unwrap_err()
    };
    assert!(matches!(err, CudaError::Shape { .. }), "{err}");
    assert_eq!(
        before,
        bits32(&fused[0]),
        "a refused call left the statistics"
    );

    // Eval, with and without the ReLU.
    let (g, b) = (gamma_d.as_view(), beta_d.as_view());
    let (rm, rv) = (plain[0].as_view(), plain[1].as_view());
    let mut z_eval = ops::batch_norm_forward_eval(be, &gx, &g, &b, &rm, &rv, BN).unwrap();
    ops::add_inplace(be, &mut z_eval, &gskip).unwrap();
    let sum = ops::batch_norm_add_forward_eval(be, &gx, &gskip, &g, &b, &rm, &rv, BN).unwrap();
    assert_eq!(bits(&z_eval), bits(&sum), "eval forward without the ReLU");
    let want_eval = ops::relu_forward(be, &z_eval).unwrap();
    let got_eval =
        ops::batch_norm_add_forward_eval(be, &gx, &gskip, &g, &b, &rm, &rv, relu).unwrap();
    assert_eq!(bits(&want_eval), bits(&got_eval), "eval forward");
    let err = ops::batch_norm_add_forward_eval(be, &gx, &odd, &g, &b, &rm, &rv, relu).unwrap_err();
    assert!(matches!(err, CudaError::Shape { .. }), "{err}");

    // Backward: relu_backward, then batch norm without the ReLU, against
    // batch norm masking g in place.
    let masked = ops::relu_backward(be, &gg, &want).unwrap();
    let mut grads: Vec<CudaSlice<f32>> = (0..4).map(|_| upload_f32(be, &vec![0.0; c])).collect();
    let (plain_grads, fused_grads) = grads.split_at_mut(2);
    let want_dz = {
        let (dg, db) = plain_grads.split_at_mut(1);
        let (dg, db) = (&mut dg[0].as_view_mut(), &mut db[0].as_view_mut());
        ops::batch_norm_backward(be, &masked, &gx, &plain_saved, &g, dg, db, false).unwrap()
    };
    let mut gm = upload(be, &grad);
    let got_dz = {
        let (dg, db) = fused_grads.split_at_mut(1);
        let (dg, db) = (&mut dg[0].as_view_mut(), &mut db[0].as_view_mut());
        ops::batch_norm_add_relu_backward(be, &mut gm, &gx, &got, &fused_saved, &g, dg, db).unwrap()
    };
    assert_eq!(bits(&masked), bits(&gm), "g masked in place");
    assert_eq!(bits(&want_dz), bits(&got_dz), "batch norm dx");
    assert_eq!(bits32(&plain_grads[0]), bits32(&fused_grads[0]), "dgamma");
    assert_eq!(bits32(&plain_grads[1]), bits32(&fused_grads[1]), "dbeta");
    // The block's input gradient: add (unfused) against add_inplace (fused).
    let want_dx = ops::add(be, &upload(be, &acc), &masked).unwrap();
    let mut got_dx = upload(be, &acc);
    ops::add_inplace(be, &mut got_dx, &gm).unwrap();
    assert_eq!(bits(&want_dx), bits(&got_dx), "block dx");
    // A saved output of another shape is refused.
    let err = {
        let (dg, db) = fused_grads.split_at_mut(1);
        let (dg, db) = (&mut dg[0].as_view_mut(), &mut db[0].as_view_mut());
        ops::batch_norm_add_relu_backward(be, &mut gm, &gx, &odd, &fused_saved, &g, dg, db)
            .unwrap_err()
    };
    assert!(matches!(err, CudaError::Shape { .. }), "{err}");
}

/// A basic block's layers at `c` channels, convolution weights rounded to
/// f16 (and returned, with the batch norms' parameters).
struct BlockParts {
    conv1: Conv2d,
    conv2: Conv2d,
    bn1: BnCase,
    bn2: BnCase,
    w: [Vec<f32>; 2],
}

fn basic_block_parts(c: usize) -> BlockParts {
    let mut rng = InitRng::new(710);
    let mut conv1 = Conv2d::new("b.conv1", c, c, 3, 1, 1, false, &mut rng).unwrap();
    let mut conv2 = Conv2d::new("b.conv2", c, c, 3, 1, 1, false, &mut rng).unwrap();
    let mut w = [Vec::new(), Vec::new()];
    for (conv, w) in [&mut conv1, &mut conv2].into_iter().zip(&mut w) {
        let mut p = conv.params_mut();
        round_f16(&mut p[0].value);
        *w = p[0].value.data().to_vec();
    }
    BlockParts {
        conv1,
        conv2,
        bn1: bn_case(c, 711),
        bn2: bn_case(c, 712),
        w,
    }
}

/// 16 channels go through the per-element kernels 8 at a time (the
/// `_v8_f16` entry points: bn_apply_add_v8_f16 here), 12 one at a time; on
/// the emulator, count which ran.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_fused_basic_block_matches_the_cpu_fused_residual() {
    let be = gpu_or_skip!();
    for c in [16, 12] {
        let runs = || kernel_runs(&["bn_apply_add_v8_f16"]).zip(kernel_runs(&["bn_apply_add_f16"]));
        let before = runs();
        fused_block_parity(&be, c);
        if let (Some(before), Some(after)) = (before, runs()) {
            let by_eight = c % 8 == 0;
            assert_eq!(after.0 > before.0, by_eight, "c = {c}");
            assert_eq!(after.1 > before.1, !by_eight, "c = {c}");
        }
    }
}

fn fused_block_parity(be: &CudaBackend, c: usize) {
    let (n, hw) = (4usize, 10usize);
    let x = random(&[n, hw, hw, c], 713, 1.0, 0.0);
    // The unfused CPU block's sum before its ReLU, only to find the elements
    // within rounding of zero (see a_basic_block_forward_and_backward_...).
    let z_cpu = {
        let p = basic_block_parts(c);
        let mut block = Residual::new(vec![
            Box::new(p.conv1),
            Box::new(p.bn1.cpu),
            Box::new(Relu::new()),
            Box::new(p.conv2),
            Box::new(p.bn2.cpu),
        ]);
        block.forward(&x, Mode::Train).unwrap()
    };
    let BlockParts {
        conv1,
        conv2,
        bn1,
        bn2,
        w,
    } = basic_block_parts(c);
    let mut block = FusedResidual::new(
        vec![
            Box::new(conv1),
            Box::new(bn1.cpu.with_relu()),
            Box::new(conv2),
        ],
        bn2.cpu,
    );
    let y = block.forward(&x, Mode::Train).unwrap();
    let mut g = random(y.shape(), 714, 1.0, 0.0);
    for (gv, zv) in g.data_mut().iter_mut().zip(z_cpu.data()) {
        if zv.abs() < 1e-2 {
            *gv = 0.0;
        }
    }
    let dx = block.backward(&g).unwrap();
    let cpu_grads: Vec<Vec<f32>> = block
        .params_mut()
        .iter()
        .map(|p| p.grad.data().to_vec())
        .collect();
    let cpu_running: Vec<Vec<f32>> = block
        .buffers_mut()
        .iter()
        .map(|b| b.data().to_vec())
        .collect();
    let y_eval = block.forward(&x, Mode::Eval).unwrap();

    let s = ConvShape {
        n,
        h: hw,
        w: hw,
        cin: c,
        cout: c,
        k: 3,
        stride: 1,
        pad: 1,
    };
    let (w1, w2) = (upload_f16(be, &w[0]), upload_f16(be, &w[1]));
    let (g1d, b1d, g2d, b2d) = (
        upload_f32(be, &bn1.gamma),
        upload_f32(be, &bn1.beta),
        upload_f32(be, &bn2.gamma),
        upload_f32(be, &bn2.beta),
    );
    let mut running: Vec<CudaSlice<f32>> = [0.0f32, 1.0, 0.0, 1.0]
        .iter()
        .map(|&v| upload_f32(be, &vec![v; c]))
        .collect();
    let gx = upload(be, &x);
    let relu_cfg = BatchNormConfig { relu: true, ..BN };
    // Forward: conv, bn+relu, conv, then bn + x + relu in one kernel.
    let a1 = ops::conv2d_forward(
        be,
        &gx,
        &AnyView::F16(w1.as_view()),
        None,
        s,
        ConvPlan::default(),
    )
    .unwrap();
    let (h1, saved1) = {
        let (m, v) = running[..2].split_at_mut(1);
        let (m, v) = (&mut m[0].as_view_mut(), &mut v[0].as_view_mut());
        let (g, b) = (g1d.as_view(), b1d.as_view());
        ops::batch_norm_forward_train(be, &a1, &g, &b, m, v, relu_cfg).unwrap()
    };
    let a2 = ops::conv2d_forward(
        be,
        &h1,
        &AnyView::F16(w2.as_view()),
        None,
        s,
        ConvPlan::default(),
    )
    .unwrap();
    let (out, saved2) = {
        let (m, v) = running[2..].split_at_mut(1);
        let (m, v) = (&mut m[0].as_view_mut(), &mut v[0].as_view_mut());
        let (g, b) = (g2d.as_view(), b2d.as_view());
        ops::batch_norm_add_forward_train(be, &a2, &gx, &g, &b, m, v, relu_cfg).unwrap()
    };
    assert_close_l2(
        "fused block forward",
        &out.to_host(be).unwrap(),
        y.data(),
        1e-2,
    );
    for (i, (gpu, cpu)) in running.iter().zip(&cpu_running).enumerate() {
        assert_close(
            &format!("fused block running statistic {i}"),
            &download(be, gpu),
            cpu,
            1e-3,
            1e-4,
        );
    }
    // Backward: the tail masks g in place by the block's output; the masked
    // g joins the body's input gradient at the end.
    let mut gg = upload(be, &g);
    let mut grads: Vec<CudaSlice<f32>> = cpu_grads
        .iter()
        .map(|v| upload_f32(be, &vec![0.0; v.len()]))
        .collect();
    let (gw1, rest) = grads.split_at_mut(1);
    let (gbn1, rest) = rest.split_at_mut(2);
    let (gw2, gbn2) = rest.split_at_mut(1);
    let (gbn1g, gbn1b) = gbn1.split_at_mut(1);
    let (gbn2g, gbn2b) = gbn2.split_at_mut(1);
    let ga2 = ops::batch_norm_add_relu_backward(
        be,
        &mut gg,
        &a2,
        &out,
        &saved2,
        &g2d.as_view(),
        &mut gbn2g[0].as_view_mut(),
        &mut gbn2b[0].as_view_mut(),
    )
    .unwrap();
    let gh1 = ops::conv2d_backward(
        be,
        &h1,
        &ga2,
        &AnyView::F16(w2.as_view()),
        &mut gw2[0].as_view_mut(),
        None,
        s,
        ConvPlan::default(),
    )
    .unwrap();
    let ga1 = ops::batch_norm_backward(
        be,
        &gh1,
        &a1,
        &saved1,
        &g1d.as_view(),
        &mut gbn1g[0].as_view_mut(),
        &mut gbn1b[0].as_view_mut(),
        true,
    )
    .unwrap();
    let mut gdx = ops::conv2d_backward(
        be,
        &gx,
        &ga1,
        &AnyView::F16(w1.as_view()),
        &mut gw1[0].as_view_mut(),
        None,
        s,
        ConvPlan::default(),
    )
    .unwrap();
    ops::add_inplace(be, &mut gdx, &gg).unwrap();
    // As for the unfused block: an L2 bound (f16 activations, inner ReLU
    // masks that may differ within rounding of zero).
    assert_close_l2("fused block dx", &gdx.to_host(be).unwrap(), dx.data(), 3e-2);
    let names = [
        "conv1 dW",
        "bn1 dgamma",
        "bn1 dbeta",
        "conv2 dW",
        "bn2 dgamma",
        "bn2 dbeta",
    ];
    for ((name, gpu), cpu) in names.iter().zip(&grads).zip(&cpu_grads) {
        assert_close_l2(name, &download(be, gpu), cpu, 3e-2);
    }
    // Eval forward on the running statistics both sides updated.
    let a1 = ops::conv2d_forward(
        be,
        &gx,
        &AnyView::F16(w1.as_view()),
        None,
        s,
        ConvPlan::default(),
    )
    .unwrap();
    let (g, b) = (g1d.as_view(), b1d.as_view());
    let (m, v) = (running[0].as_view(), running[1].as_view());
    let h1 = ops::batch_norm_forward_eval(be, &a1, &g, &b, &m, &v, relu_cfg).unwrap();
    let a2 = ops::conv2d_forward(
        be,
        &h1,
        &AnyView::F16(w2.as_view()),
        None,
        s,
        ConvPlan::default(),
    )
    .unwrap();
    let (g, b) = (g2d.as_view(), b2d.as_view());
    let (m, v) = (running[2].as_view(), running[3].as_view());
    let out = ops::batch_norm_add_forward_eval(be, &a2, &gx, &g, &b, &m, &v, relu_cfg).unwrap();
    assert_close_l2(
        "fused block eval forward",
        &out.to_host(be).unwrap(),
        y_eval.data(),
        1e-2,
    );
}

#[derive(Deserialize)]
struct SpecFile {
    model: ModelSpec,
}

/// Two basic blocks and a bare residual whose body ends in a batch norm,
/// followed by a ReLU (fused too, unless a checkpointed segment separates
/// the two). 20 channels: a partial 32-channel tile; 6·9·9 rows: 2 chunks.
fn two_block_spec(checkpoint: CheckpointPolicy) -> ModelSpec {
    let text = r#"
[model]
input = [9, 9, 2]
mean = 0.5
std = 0.25
layers = [
  { type = "conv", out = 20 }, { type = "batch_norm" }, { type = "relu" },
  { type = "basic_block" },
  { type = "basic_block" },
  { type = "residual", layers = [{ type = "conv", out = 20 }, { type = "batch_norm" }] },
  { type = "relu" },
  { type = "global_avg_pool" },
  { type = "linear", out = 4 },
]
"#;
    let mut spec = toml::from_str::<SpecFile>(text).unwrap().model;
    spec.checkpoint = checkpoint;
    spec
}

/// Networks of the MLP and UNet layers: an MLP (its flatten's input is the
/// lent batch, which it copies; a layer norm over features; two dropouts),
/// a convolution whose ReLU output, kept for backward, is flattened (copied
/// too), one whose SiLU output, held by nothing else, is flattened in place
/// (a layer norm over each pixel's channels before it), and a UNet block: a
/// down-sampling body brought back up by `upsample2x`, beside its input
/// (`unet_skip`).
fn flattening_specs(checkpoint: CheckpointPolicy) -> Vec<ModelSpec> {
    let layers = [
        r#"{ type = "flatten" }, { type = "linear", out = 16 }, { type = "layer_norm" },
           { type = "silu" }, { type = "dropout", p = 0.25 }, { type = "linear", out = 12 },
           { type = "gelu" }, { type = "dropout", p = 0.1 }, { type = "linear", out = 4 }"#,
        r#"{ type = "conv", out = 4 }, { type = "relu" }, { type = "flatten" },
           { type = "linear", out = 8 }, { type = "silu" }, { type = "linear", out = 4 }"#,
        r#"{ type = "conv", out = 4, bias = true }, { type = "layer_norm" }, { type = "silu" },
           { type = "flatten" }, { type = "gelu" }, { type = "linear", out = 4 }"#,
        r#"{ type = "conv", out = 4 }, { type = "relu" },
           { type = "unet_skip", layers = [
             { type = "conv", out = 6, stride = 2 }, { type = "batch_norm" }, { type = "relu" },
             { type = "upsample2x" }, { type = "conv", out = 3 } ] },
           { type = "batch_norm" }, { type = "relu" },
           { type = "global_avg_pool" }, { type = "linear", out = 4 }"#,
    ];
    layers
        .iter()
        .map(|layers| {
            let text = format!(
                "[model]\ninput = [6, 6, 2]\nmean = 0.5\nstd = 0.25\nlayers = [{layers}]\n"
            );
            let mut spec = toml::from_str::<SpecFile>(&text).unwrap().model;
            spec.checkpoint = checkpoint;
            spec
        })
        .collect()
}

/// A network's first convolution makes no input gradient (no one wants the
/// images'): its backward runs no col2im, where a second one does (the
/// emulator counts kernel runs; the gradients are checked against the CPU
/// network by `networks_of_the_mlp_and_unet_layers_match_the_cpu_network`).
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_first_convolution_makes_no_input_gradient() {
    let be = gpu_or_skip!();
    let col2im = [
        kernels::COL2IM.f16.name,
        kernels::COL2IM.f32.name,
        kernels::COL2IM_V8.name,
    ];
    let x = random(&[3, 6, 6, 2], 890, 1.0, 0.0);
    let g = random(&[3, 4], 891, 0.5, 0.0);
    for (convs, runs) in [(1, 0), (2, 1)] {
        let layers = vec![r#"{ type = "conv", out = 4 }, { type = "relu" }"#; convs].join(", ");
        let text = format!(
            "[model]\ninput = [6, 6, 2]\nmean = 0.5\nstd = 0.25\nlayers = [{layers}, \
             {{ type = \"global_avg_pool\" }}, {{ type = \"linear\", out = 4 }}]\n"
        );
        let spec = toml::from_str::<SpecFile>(&text).unwrap().model;
        let mut net = CudaNetwork::build(&be, &spec, 9, CudaBuildOptions::default()).unwrap();
        let x = CudaTensor::from_tensor(&be, &x, DType::F16).unwrap();
        let g = CudaTensor::from_tensor(&be, &g, DType::F16).unwrap();
        net.forward_train(&be, &x).unwrap();
        // The emulator's streams run when waited for.
        be.compute_stream().synchronize().unwrap();
        let before = kernel_runs(&col2im);
        net.backward(&be, &g).unwrap();
        be.compute_stream().synchronize().unwrap();
        if let (Some(before), Some(after)) = (before, kernel_runs(&col2im)) {
            assert_eq!(after - before, runs, "{convs} convolutions");
        }
    }
}

/// What `flattening_specs`' networks compute on the GPU: the logits of two
/// training forwards and then of an eval forward, the accumulated parameter
/// gradients, and the buffers (dropout counters).
fn flattening_network_run(
    be: &CudaBackend,
    spec: &ModelSpec,
    dtype: DType,
    batches: &[Tensor],
    grad_logits: &Tensor,
) -> (Vec<f32>, Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let options = CudaBuildOptions {
        activations: dtype,
        ..CudaBuildOptions::default()
    };
    let mut net = CudaNetwork::build(be, spec, 9, options).unwrap();
    let g = CudaTensor::from_tensor(be, grad_logits, dtype).unwrap();
    let mut logits = Vec::new();
    for x in batches {
        let x = CudaTensor::from_tensor(be, x, dtype).unwrap();
        let y = net.forward_train(be, &x).unwrap();
        assert_eq!(y.shape(), &[x.shape()[0], 4]);
        logits.extend(y.to_host(be).unwrap());
        net.backward(be, &g).unwrap();
    }
    let x = CudaTensor::from_tensor(be, &batches[0], dtype).unwrap();
    logits.extend(net.forward_eval(be, &x).unwrap().to_host(be).unwrap());
    (
        logits,
        net.read_grads(be).unwrap(),
        net.read_buffers(be).unwrap(),
    )
}

/// What a CPU network computes over `batches` with `grad` as its output
/// gradient: two training passes' outputs and an eval pass's, the
/// gradients the training passes accumulated, and its buffers.
struct CpuRun {
    outputs: Vec<f32>,
    grads: Vec<Vec<f32>>,
    buffers: Vec<Vec<f32>>,
}

fn cpu_run(cpu: &mut Network, batches: &[Tensor], grad: &Tensor) -> CpuRun {
    let mut outputs = Vec::new();
    for x in batches {
        outputs.extend(cpu.forward(x, Mode::Train).unwrap().data().to_vec());
        cpu.backward(grad).unwrap();
    }
    outputs.extend(
        cpu.forward(&batches[0], Mode::Eval)
            .unwrap()
            .data()
            .to_vec(),
    );
    CpuRun {
        outputs,
        grads: cpu
            .params_mut()
            .iter()
            .map(|p| p.grad.data().to_vec())
            .collect(),
        buffers: cpu.buffer_values(),
    }
}

/// f32: (relative, absolute fraction) element-wise bounds for outputs and
/// gradients; f16: relative L2 bounds.
struct Tolerances {
    f32_outputs: (f32, f32),
    f32_grads: (f32, f32),
    f16_outputs: f64,
    f16_grads: f64,
}

/// A GPU network's outputs and gradients against the CPU network's.
fn assert_matches_cpu(
    what: &str,
    dtype: DType,
    (outputs, grads): (&[f32], &[Vec<f32>]),
    (want, cpu_grads): (&[f32], &[Vec<f32>]),
    tol: Tolerances,
) {
    assert_eq!(grads.len(), cpu_grads.len(), "{what}: gradients");
    let pairs = grads.iter().zip(cpu_grads).enumerate();
    if dtype == DType::F32 {
        let ((ro, ao), (rg, ag)) = (tol.f32_outputs, tol.f32_grads);
        assert_close(&format!("{what} outputs"), outputs, want, ro, ao);
        for (p, (g, c)) in pairs {
            assert_close(&format!("{what} param {p} grad"), g, c, rg, ag);
        }
    } else {
        assert_close_l2(&format!("{what} outputs"), outputs, want, tol.f16_outputs);
        for (p, (g, c)) in pairs {
            assert_close_l2(&format!("{what} param {p} grad"), g, c, tol.f16_grads);
        }
    }
}

/// Flatten, SiLU, GELU, layer norm, dropout, upsample2x and unet_skip in
/// whole networks, f32 and f16, with and without
/// checkpointing: the CPU network's logits and gradients (f32 to summation
/// order, f16 to its rounding), and checkpointing the same bits as not.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn networks_of_the_mlp_and_unet_layers_match_the_cpu_network() {
    let be = gpu_or_skip!();
    let n = 5;
    let batches: Vec<Tensor> = (0..2)
        .map(|i| random(&[n, 6, 6, 2], 870 + i, 1.0, 0.0))
        .collect();
    let grad_logits = random(&[n, 4], 880, 0.5, 0.0);
    let plain = flattening_specs(CheckpointPolicy::None);
    let checkpointed = flattening_specs(CheckpointPolicy::All);
    for (i, (spec, spec_all)) in plain.iter().zip(&checkpointed).enumerate() {
        let mut cpu = Network::build(spec, 9).unwrap();
        let reference = cpu_run(&mut cpu, &batches, &grad_logits);
        let (want, cpu_grads, cpu_buffers) =
            (&reference.outputs, &reference.grads, &reference.buffers);
        // Batch norm's backward (the UNet's two) subtracts nearly equal
        // terms, which magnifies f16's rounding in the gradients before it
        // (2e-2 to 3e-2 on the emulator here; a wrong kernel is off by O(1)).
        let f16_grad_tolerance = if i == 3 { 0.1 } else { 1e-2 };
        for dtype in [DType::F32, DType::F16] {
            let what = format!("network {i} {dtype:?}");
            let (logits, grads, buffers) =
                flattening_network_run(&be, spec, dtype, &batches, &grad_logits);
            // Running statistics to the activations' precision; dropout
            // counters (whole numbers) exactly.
            assert_eq!(buffers.len(), cpu_buffers.len(), "{what}: buffers");
            for (b, c) in buffers.iter().zip(cpu_buffers) {
                assert_close(&format!("{what} buffer"), b, c, 1e-3, 1e-3);
            }
            let again = flattening_network_run(&be, spec_all, dtype, &batches, &grad_logits);
            assert!(
                logits
                    .iter()
                    .zip(&again.0)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
                    && grads.len() == again.1.len()
                    && grads.iter().zip(&again.1).all(|(a, b)| a == b),
                "{what}: checkpointing changed the bits"
            );
            let tolerances = Tolerances {
                f32_outputs: (1e-4, 1e-5),
                f32_grads: (1e-3, 1e-5),
                f16_outputs: 4e-3,
                f16_grads: f16_grad_tolerance,
            };
            assert_matches_cpu(
                &what,
                dtype,
                (&logits, &grads),
                (want, cpu_grads),
                tolerances,
            );
        }
    }
}

/// Pixel MSE against u8 targets: the CPU loss's value and gradient (times
/// the loss scale and share), f32 and f16, frames not a multiple of the
/// kernel's 8 rows a block nor of its 32 lanes.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn pixel_mse_matches_the_cpu_loss() {
    let be = gpu_or_skip!();
    let (frames, pixels) = (11usize, 45usize);
    let predictions = random(&[frames, 5, 9, 1], 1300, 0.4, 0.0);
    let targets: Vec<u8> = (0..frames * pixels).map(|i| (i * 37 % 256) as u8).collect();
    let cpu = pixel_mse(&predictions, &targets).unwrap();
    let targets_d = be.compute_stream().clone_htod(&targets).unwrap();
    let (loss_scale, share) = (64.0f32, 0.25f32);
    let scale_d = upload_f32(&be, &[loss_scale]);
    let scale = ops::GradScale {
        loss_scale: &scale_d,
        share,
    };
    for (dtype, rel, abs) in [(DType::F32, 1e-5, 1e-6), (DType::F16, 2e-3, 1e-3)] {
        let what = format!("pixel_mse {dtype:?}");
        let y = CudaTensor::from_tensor(&be, &predictions, dtype).unwrap();
        let out = ops::pixel_mse(&be, &y, &targets_d.as_view(), scale).unwrap();
        let grad: Vec<f32> = out
            .grad
            .to_host(&be)
            .unwrap()
            .iter()
            .map(|g| g / (loss_scale * share))
            .collect();
        assert_close(&format!("{what} grad"), &grad, cpu.grad.data(), rel, abs);
        let (loss, correct) = out.read_summary(&be).unwrap();
        assert!(
            (loss - cpu.loss).abs() <= 1e-5 * cpu.loss,
            "{what}: loss {loss} vs {}",
            cpu.loss
        );
        assert_eq!(
            correct, 0,
            "{what}: a regression counts no correct predictions"
        );
    }
    let short = be.compute_stream().clone_htod(&targets[1..]).unwrap();
    let y = CudaTensor::from_tensor(&be, &predictions, DType::F32).unwrap();
    let err = ops::pixel_mse(&be, &y, &short.as_view(), scale).unwrap_err();
    assert!(err.to_string().contains("pixel_mse"), "{err}");
}

/// A small UNet-ConvLSTM (`experiments/conv_lstm.toml`'s shape): a strided
/// convolution, a ConvLSTM and an upsampling inside a UNet skip, batch norm,
/// ReLU and a last convolution, over 3 frames.
fn frame_spec(checkpoint: &str) -> ModelSpec {
    let text = format!(
        r#"
[model]
checkpoint = "{checkpoint}"
input = [8, 8, 1]
frames = 3
mean = 0.0
std = 1.0
layers = [
  {{ type = "unet_skip", layers = [
    {{ type = "conv", out = 4, stride = 2, bias = true }}, {{ type = "relu" }},
    {{ type = "conv_lstm", hidden = 4, kernel = 3 }},
    {{ type = "upsample2x" }},
  ] }},
  {{ type = "batch_norm" }}, {{ type = "relu" }},
  {{ type = "conv", out = 1, bias = true }},
]
"#
    );
    toml::from_str::<SpecFile>(&text).unwrap().model
}

/// A frame network against the CPU network, f32 and f16: predictions of
/// two training passes and an eval pass, gradients and running statistics;
/// checkpointing every layer gives the same bits as not. With
/// `device.conv_algorithm = "auto"` (its 4- and 1-channel convolutions on
/// conv_narrow.cu's kernels, the ConvLSTM's gates on the implicit ones in
/// f16) it matches the CPU network as well.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn frame_networks_match_the_cpu_network() {
    let be = gpu_or_skip!();
    let (n, frames) = (2, 3);
    let batches: Vec<Tensor> = (0..2)
        .map(|i| random(&[n, frames, 8, 8, 1], 1200 + i, 1.0, 0.0))
        .collect();
    let grad = random(&[n, frames, 8, 8, 1], 1210, 0.1, 0.0);
    let spec = frame_spec("none");
    let mut cpu = Network::build(&spec, 13).unwrap();
    let reference = cpu_run(&mut cpu, &batches, &grad);
    let (want, cpu_grads, cpu_buffers) = (&reference.outputs, &reference.grads, &reference.buffers);
    let images = [n * frames, 8, 8, 1];
    let run = |spec: &ModelSpec, dtype: DType, conv: ConvPlan| {
        let options = CudaBuildOptions {
            activations: dtype,
            conv,
            ..CudaBuildOptions::default()
        };
        let mut net = CudaNetwork::build(&be, spec, 13, options).unwrap();
        let g = CudaTensor::from_tensor(&be, &grad, dtype)
            .unwrap()
            .reshape(&images)
            .unwrap();
        let mut out = Vec::new();
        for x in &batches {
            let x = CudaTensor::from_tensor(&be, x, dtype)
                .unwrap()
                .reshape(&images)
                .unwrap();
            let y = net.forward_train(&be, &x).unwrap();
            assert_eq!(y.shape(), &images);
            out.extend(y.to_host(&be).unwrap());
            net.backward(&be, &g).unwrap();
        }
        let x = CudaTensor::from_tensor(&be, &batches[0], dtype)
            .unwrap()
            .reshape(&images)
            .unwrap();
        out.extend(net.forward_eval(&be, &x).unwrap().to_host(&be).unwrap());
        (
            out,
            net.read_grads(&be).unwrap(),
            net.read_buffers(&be).unwrap(),
        )
    };
    let auto = ConvPlan {
        algorithm: ConvAlgorithm::Auto,
        ..ConvPlan::default()
    };
    let plans = [ConvPlan::default(), auto];
    for (dtype, plan) in [DType::F32, DType::F16]
        .into_iter()
        .flat_map(|d| plans.map(|p| (d, p)))
    {
        let what = format!("frame network {dtype:?} {:?}", plan.algorithm);
        let before = kernel_runs(&NARROW_KERNELS);
        let (out, grads, buffers) = run(&spec, dtype, plan);
        if let (Some(before), Some(after)) = (before, kernel_runs(&NARROW_KERNELS)) {
            let narrow = plan.algorithm == ConvAlgorithm::Auto;
            assert_eq!(after > before, narrow, "{what}: narrow kernels ran");
        }
        let again = run(&frame_spec("all"), dtype, plan);
        assert!(
            out.iter()
                .zip(&again.0)
                .all(|(a, b)| a.to_bits() == b.to_bits())
                && grads == again.1,
            "{what}: checkpointing changed the bits"
        );
        for (b, c) in buffers.iter().zip(cpu_buffers) {
            assert_close(&format!("{what} buffer"), b, c, 1e-3, 1e-3);
        }
        let tolerances = Tolerances {
            f32_outputs: (1e-3, 1e-4),
            f32_grads: (1e-3, 1e-3),
            f16_outputs: 4e-3,
            f16_grads: 5e-2,
        };
        assert_matches_cpu(&what, dtype, (&out, &grads), (want, cpu_grads), tolerances);
    }
}

/// Under `model.checkpoint` a ConvLSTM keeps each step's cell state only
/// and reruns the step's gates in backward, as the CPU layer does: the
/// same gradients, bit for bit, and a training step's peak lower by most
/// of the gates it no longer keeps (4·hidden f32 per pixel and frame).
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_checkpointed_conv_lstm_keeps_its_cells_only() {
    let be = gpu_or_skip!();
    let (n, frames, side, hidden) = (2, 8, 8, 8);
    let images = [n * frames, side, side, 2];
    let x = random(&[n, frames, side, side, 2], 1250, 1.0, 0.0);
    let grad = random(&[n, frames, side, side, 2], 1251, 0.1, 0.0);
    let run = |checkpoint: &str| {
        let text = format!(
            r#"
[model]
checkpoint = "{checkpoint}"
input = [{side}, {side}, 2]
frames = {frames}
mean = 0.0
std = 1.0
layers = [
  {{ type = "conv_lstm", hidden = {hidden}, kernel = 3 }},
  {{ type = "conv", out = 2, bias = true }},
]
"#
        );
        let spec = toml::from_str::<SpecFile>(&text).unwrap().model;
        let options = CudaBuildOptions {
            activations: DType::F16,
            ..CudaBuildOptions::default()
        };
        let mut net = CudaNetwork::build(&be, &spec, 21, options).unwrap();
        let x = CudaTensor::from_tensor(&be, &x, DType::F16)
            .unwrap()
            .reshape(&images)
            .unwrap();
        let g = CudaTensor::from_tensor(&be, &grad, DType::F16)
            .unwrap()
            .reshape(&images)
            .unwrap();
        be.reset_peak();
        let start = be.memory_stats();
        let y = net.forward_train(&be, &x).unwrap().to_host(&be).unwrap();
        net.backward(&be, &g).unwrap();
        let peak = be.memory_stats().peak_in_use_bytes - start.in_use_bytes;
        (y, net.read_grads(&be).unwrap(), peak)
    };
    let (kept_y, kept_grads, kept_peak) = run("none");
    let (rerun_y, rerun_grads, rerun_peak) = run("all");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&kept_y), bits(&rerun_y), "outputs");
    assert_eq!(kept_grads.len(), rerun_grads.len());
    for (a, b) in kept_grads.iter().zip(&rerun_grads) {
        assert_eq!(bits(a), bits(b), "gradients");
    }
    let gates_bytes = (n * frames * side * side * 4 * hidden * 4) as u64;
    assert!(
        rerun_peak + gates_bytes / 2 <= kept_peak,
        "peak {rerun_peak} bytes recomputing, {kept_peak} keeping the gates \
         ({gates_bytes} bytes of them)"
    );
}

/// Bias gradients over many rows (the tokens of a sequence batch) are
/// summed by chunks of rows and then the chunks in order: the column sums
/// of a [1000, 70] gradient (4 chunks, the last part-filled; 3 column
/// blocks, the last part-filled), in f32 and f16, added to what the
/// gradient held, the same bits on a second run.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn bias_gradients_over_many_rows_sum_by_chunks() {
    let be = gpu_or_skip!();
    let (rows, cols) = (1000usize, 70usize);
    let mut g = Tensor::from_vec(&[rows, cols], random_vec(rows * cols, 81, 1.0)).unwrap();
    round_f16(&mut g);
    let start = random_vec(cols, 82, 0.5);
    let mut expected = start.clone();
    for row in g.data().chunks_exact(cols) {
        for (e, &v) in expected.iter_mut().zip(row) {
            *e += v;
        }
    }
    for dtype in [DType::F32, DType::F16] {
        let gd = CudaTensor::from_tensor(&be, &g, dtype).unwrap();
        let runs: Vec<Vec<f32>> = (0..2)
            .map(|_| {
                let mut grad = upload_f32(&be, &start);
                ops::bias_grad(&be, &gd.view(), &mut grad.as_view_mut()).unwrap();
                download(&be, &grad)
            })
            .collect();
        assert_close(
            &format!("{dtype:?} bias gradient"),
            &runs[0],
            &expected,
            1e-5,
            1e-5,
        );
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&runs[0]), bits(&runs[1]), "{dtype:?}: two runs differ");
    }
}

/// The table gradient sums each id's rows in row order, as the CPU layer
/// does: f32 gradients give the host loop's bits. 40 columns leave the
/// second 32-column tile part-empty; 3·37 rows end part-way through a
/// 32-row ballot; id 0 fills most rows, id 5 none, and one id is out of
/// range (its row adds nowhere).
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn the_embedding_table_gradient_sums_rows_in_order() {
    let be = gpu_or_skip!();
    let shape = ops::EmbeddingShape {
        vocab: 6,
        dim: 40,
        length: 37,
        positions: false,
    };
    let rows = 3 * shape.length;
    let ids: Vec<f32> = (0..rows)
        .map(|r| match r % 7 {
            0 => 9.0,
            1 | 2 => (r % 5) as f32,
            _ => 0.0,
        })
        .collect();
    let g = random_vec(rows * shape.dim, 71, 1.0);
    let start = random_vec(shape.vocab * shape.dim, 72, 0.5);
    let mut expected = start.clone();
    for (r, &id) in ids.iter().enumerate() {
        if id < shape.vocab as f32 {
            let v = id as usize;
            for c in 0..shape.dim {
                expected[v * shape.dim + c] += g[r * shape.dim + c];
            }
        }
    }
    let ids = CudaTensor::from_tensor(
        &be,
        &Tensor::from_vec(&[3, shape.length], ids).unwrap(),
        DType::F32,
    )
    .unwrap();
    let g = CudaTensor::from_tensor(
        &be,
        &Tensor::from_vec(&[rows, shape.dim], g).unwrap(),
        DType::F32,
    )
    .unwrap();
    let mut dtable = upload_f32(&be, &start);
    ops::embedding_backward(&be, &ids, &g, shape, Some(&mut dtable.as_view_mut()), None).unwrap();
    let got = download(&be, &dtable);
    for (i, (a, b)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(a.to_bits(), b.to_bits(), "dtable[{i}]: {a} against {b}");
    }
}

/// Token models: an embedding with positions, transformer blocks (dropout,
/// LoRA on the attention projections), a standalone attention and LoRA
/// linear, a per-token head; and two stacked LSTMs. `t` = 37 crosses the
/// attention kernels' 32-key chunks.
fn token_specs(checkpoint: &str) -> Vec<ModelSpec> {
    let models = [
        r#"tokens = { length = 37, vocab = 11 }
           layers = [
             { type = "embedding", dim = 16, positions = true },
             { type = "transformer_block", heads = 2, mlp_ratio = 2, dropout = 0.1 },
             { type = "layer_norm" },
             { type = "linear", out = 11 },
           ]"#,
        r#"tokens = { length = 37, vocab = 11 }
           layers = [
             { type = "embedding", dim = 16, positions = true },
             { type = "transformer_block", heads = 4, mlp_ratio = 2, lora = { r = 2, alpha = 4 } },
             { type = "causal_self_attention", heads = 2, lora = { r = 3 } },
             { type = "gelu" },
             { type = "lora_linear", out = 12, lora = { r = 2, alpha = 8 } },
             { type = "layer_norm" },
             { type = "linear", out = 11 },
           ]"#,
        r#"tokens = { length = 37, vocab = 11 }
           layers = [
             { type = "embedding", dim = 8 },
             { type = "lstm", hidden = 12 },
             { type = "lstm", hidden = 10 },
             { type = "linear", out = 11 },
           ]"#,
    ];
    models
        .iter()
        .map(|m| {
            let text = format!("[model]\ncheckpoint = \"{checkpoint}\"\n{m}");
            toml::from_str::<SpecFile>(&text).unwrap().model
        })
        .collect()
}

/// The CPU network of `spec`, with everything but the LoRA adapters frozen
/// when `frozen` (as `finetune.train = "lora"` does).
fn token_network(spec: &ModelSpec, frozen: bool) -> Network {
    let mut net = Network::build(spec, 21).unwrap();
    // A fresh adapter's B is zero, which would zero A's gradient and the
    // adapter's share of dx: give it values.
    for p in net.params_mut() {
        if p.name.ends_with("lora_b") {
            for (i, v) in p.value.data_mut().iter_mut().enumerate() {
                *v = ((i * 37 % 17) as f32 - 8.0) / 40.0;
            }
        }
    }
    if frozen {
        for p in net.params_mut() {
            if !(p.name.ends_with("lora_a") || p.name.ends_with("lora_b")) {
                p.freeze();
            }
        }
    }
    net
}

/// Two training passes and an eval forward of the GPU network built from
/// `token_network(spec, frozen)`: logits, gradients, buffers.
fn token_network_run(
    be: &CudaBackend,
    spec: &ModelSpec,
    frozen: bool,
    dtype: DType,
    batches: &[Tensor],
    grad_logits: &Tensor,
) -> (Vec<f32>, Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let options = CudaBuildOptions {
        activations: dtype,
        ..CudaBuildOptions::default()
    };
    let mut cpu = token_network(spec, frozen);
    let mut net = CudaNetwork::from_cpu(be, &mut cpu, options).unwrap();
    let g = CudaTensor::from_tensor(be, grad_logits, dtype).unwrap();
    let g = g.reshape(&[grad_logits.len() / 11, 11]).unwrap();
    let mut logits = Vec::new();
    for ids in batches {
        let x = CudaTensor::from_tensor(be, ids, DType::F32).unwrap();
        let y = net.forward_train(be, &x).unwrap();
        assert_eq!(y.shape(), &[ids.len(), 11]);
        logits.extend(y.to_host(be).unwrap());
        net.backward(be, &g).unwrap();
    }
    let x = CudaTensor::from_tensor(be, &batches[0], DType::F32).unwrap();
    logits.extend(net.forward_eval(be, &x).unwrap().to_host(be).unwrap());
    (
        logits,
        net.read_grads(be).unwrap(),
        net.read_buffers(be).unwrap(),
    )
}

/// `stream_state` hands on, in pieces of 5 values that end inside tensors,
/// the very values the network holds: every parameter's master (a frozen
/// one's too, as built from the CPU network), the buffers (dropout
/// counters), and both moments as loaded (none for a frozen parameter).
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_streamed_state_holds_what_the_network_holds() {
    let be = gpu_or_skip!();
    let specs = token_specs("none");
    for (spec, frozen) in [(&specs[0], false), (&specs[1], true)] {
        let mut cpu = token_network(spec, frozen);
        let params: Vec<Vec<f32>> = cpu
            .params_mut()
            .iter()
            .map(|p| p.value.data().to_vec())
            .collect();
        let trainable: Vec<bool> = cpu.params_mut().iter().map(|p| !p.frozen).collect();
        assert_eq!(trainable.contains(&false), frozen);
        let mut net = CudaNetwork::from_cpu(&be, &mut cpu, CudaBuildOptions::default()).unwrap();
        let moment = |seed: u64| -> Vec<Vec<f32>> {
            params
                .iter()
                .zip(&trainable)
                .enumerate()
                .map(|(i, (p, &t))| match t {
                    true => random_vec(p.len(), seed + i as u64, 1.0),
                    false => Vec::new(),
                })
                .collect()
        };
        let (first, second) = (moment(700), moment(800));
        let buffers = net.read_buffers(&be).unwrap();
        assert!(frozen || !buffers.is_empty(), "the dropout counters");
        net.load_state(&be, &params, &buffers, (&first, &second))
            .unwrap();
        let lists = [
            (StateList::Params, &params),
            (StateList::Buffers, &buffers),
            (StateList::FirstMoments, &first),
            (StateList::SecondMoments, &second),
        ];
        for (list, want) in lists {
            let (mut count, mut got) = (None, Vec::<Vec<f32>>::new());
            net.stream_state(&be, list, &mut [0.0; 5], &mut |piece| {
                match piece {
                    StatePiece::List(n) => count = Some(n),
                    StatePiece::Tensor(len) => got.push(Vec::with_capacity(len)),
                    StatePiece::Values(v) => got.last_mut().unwrap().extend_from_slice(v),
                }
                Ok::<(), CudaError>(())
            })
            .unwrap();
            assert_eq!(count, Some(want.len()), "{list:?} frozen {frozen}");
            assert!(got == *want, "{list:?} frozen {frozen}: the values differ");
        }
    }
}

/// Token networks against the CPU network, f32 and f16, trainable and
/// frozen as fine-tuning freezes them: logits, gradients (none for a frozen
/// parameter) and dropout counters; checkpointing blocks gives the same
/// bits as not.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn token_networks_match_the_cpu_network() {
    let be = gpu_or_skip!();
    let (n, t) = (3, 37);
    let batches: Vec<Tensor> = (0..2)
        .map(|b| {
            let ids = (0..n * t)
                .map(|i| ((i * 7 + b * 5 + i / 5) % 11) as f32)
                .collect();
            Tensor::from_vec(&[n, t], ids).unwrap()
        })
        .collect();
    let grad_logits = random(&[n, t, 11], 990, 0.05, 0.0);
    let plain = token_specs("none");
    let checkpointed = token_specs("blocks");
    for (i, (spec, spec_blocks)) in plain.iter().zip(&checkpointed).enumerate() {
        for frozen in [false, true] {
            if frozen && i != 1 {
                continue; // no adapters to train
            }
            let mut cpu = token_network(spec, frozen);
            let reference = cpu_run(&mut cpu, &batches, &grad_logits);
            let (want, cpu_grads, cpu_buffers) =
                (&reference.outputs, &reference.grads, &reference.buffers);
            for dtype in [DType::F32, DType::F16] {
                let what = format!("token network {i} frozen {frozen} {dtype:?}");
                let (logits, grads, buffers) =
                    token_network_run(&be, spec, frozen, dtype, &batches, &grad_logits);
                assert_eq!(&buffers, cpu_buffers, "{what}: dropout counters");
                let again =
                    token_network_run(&be, spec_blocks, frozen, dtype, &batches, &grad_logits);
                assert!(
                    logits
                        .iter()
                        .zip(&again.0)
                        .all(|(a, b)| a.to_bits() == b.to_bits())
                        && grads == again.1,
                    "{what}: checkpointing blocks changed the bits"
                );
                for (p, (g, c)) in grads.iter().zip(cpu_grads).enumerate() {
                    assert_eq!(g.len(), c.len(), "{what} param {p}: gradient length");
                }
                let tolerances = Tolerances {
                    f32_outputs: (1e-3, 1e-4),
                    f32_grads: (1e-3, 1e-3),
                    f16_outputs: 4e-3,
                    f16_grads: 2e-2,
                };
                assert_matches_cpu(
                    &what,
                    dtype,
                    (&logits, &grads),
                    (want, cpu_grads),
                    tolerances,
                );
            }
        }
    }
}

/// What one build computes, as bits: two training forwards and backwards
/// on two batches (the gradients accumulate; no step), the parameter
/// gradients, the running statistics, the parameters and an eval forward.
/// Also the allocations and the peak of the training passes.
fn network_bits(
    be: &CudaBackend,
    fuse: bool,
    recompute: bool,
    checkpoint: CheckpointPolicy,
) -> (Vec<u32>, u64, u64) {
    let spec = two_block_spec(checkpoint);
    let options = CudaBuildOptions {
        fuse,
        activations: DType::F16,
        recompute,
        ..CudaBuildOptions::default()
    };
    let mut network = CudaNetwork::build(be, &spec, 5, options).unwrap();
    let n = 6;
    let batches: Vec<CudaTensor> = (0..2)
        .map(|i| upload(be, &random(&[n, 9, 9, 2], 820 + i, 1.0, 0.0)))
        .collect();
    let grad_logits = upload(be, &random(&[n, 4], 830, 0.5, 0.0));
    let mut bits: Vec<u32> = Vec::new();
    let extend = |bits: &mut Vec<u32>, values: &[f32]| {
        bits.extend(values.iter().map(|v| v.to_bits()));
    };
    be.reset_peak();
    let start = be.memory_stats();
    for x in &batches {
        let logits = network.forward_train(be, x).unwrap();
        extend(&mut bits, &logits.to_host(be).unwrap());
        network.backward(be, &grad_logits).unwrap();
    }
    let end = be.memory_stats();
    for group in network.groups() {
        extend(&mut bits, &download(be, &group.grad.slice));
    }
    for buffer in network.read_buffers(be).unwrap() {
        extend(&mut bits, &buffer);
    }
    for param in network.read_params(be).unwrap() {
        extend(&mut bits, &param);
    }
    let logits = network.forward_eval(be, &batches[0]).unwrap();
    extend(&mut bits, &logits.to_host(be).unwrap());
    (
        bits,
        end.allocations - start.allocations,
        end.peak_in_use_bytes - start.in_use_bytes,
    )
}

/// f32 training (`device.amp = false`): built with f32 activations, the
/// network of `two_block_spec`, fused and unfused, computes what the CPU
/// network computes from the same weights, up to f32 summation order:
/// logits, both losses, parameter gradients of two accumulated passes,
/// running statistics, and an eval forward. Every `_f32` layer kernel runs
/// here (the unfused build runs the standalone ReLU and residual sums, the
/// fused one bn_apply_add and the in-place masked backward).
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn an_f32_network_matches_the_cpu_network() {
    let be = gpu_or_skip!();
    let spec = two_block_spec(CheckpointPolicy::None);
    let n = 6;
    let batches: Vec<Tensor> = (0..2)
        .map(|i| random(&[n, 9, 9, 2], 840 + i, 1.0, 0.0))
        .collect();
    let labels: Vec<u32> = (0..n as u32).map(|i| (i * 3 + 1) % 4).collect();
    let soft: Vec<f32> = (0..n * 4).map(|i| [0.7, 0.1, 0.2, 0.0][i % 4]).collect();
    let mut cpu = Network::build(&spec, 5).unwrap();
    let mut want = Vec::new();
    for x in &batches {
        let logits = cpu.forward(x, Mode::Train).unwrap();
        let hard = softmax_cross_entropy(&logits, &labels, 0.1).unwrap();
        let soft_t = Tensor::from_vec(&[n, 4], soft.clone()).unwrap();
        let smooth = soft_cross_entropy(&logits, &soft_t).unwrap();
        cpu.backward(&hard.grad).unwrap();
        want.push((logits.data().to_vec(), hard, smooth));
    }
    let cpu_grads: Vec<Vec<f32>> = cpu
        .params_mut()
        .iter()
        .map(|p| p.grad.data().to_vec())
        .collect();
    let cpu_buffers = cpu.buffer_values();
    let cpu_eval = cpu.forward(&batches[0], Mode::Eval).unwrap();
    let labels_d = ops::upload_labels(&be, &labels, 4).unwrap();
    let soft_d = upload_f32(&be, &soft);
    let one = upload_f32(&be, &[1.0]);
    let unit = ops::GradScale {
        loss_scale: &one,
        share: 1.0,
    };
    for fuse in [true, false] {
        let options = CudaBuildOptions {
            fuse,
            activations: DType::F32,
            recompute: fuse,
            ..CudaBuildOptions::default()
        };
        let mut net = CudaNetwork::build(&be, &spec, 5, options).unwrap();
        assert!(net.groups().iter().all(|g| g.compute.is_none()));
        let f16_batch = upload(&be, &batches[0]);
        let err = net.forward_train(&be, &f16_batch).unwrap_err();
        assert!(err.to_string().contains("F16"), "{err}");
        for (i, (x, (logits_want, hard, smooth))) in batches.iter().zip(&want).enumerate() {
            let what = format!("fuse={fuse} batch {i}");
            let x = CudaTensor::from_tensor(&be, x, DType::F32).unwrap();
            let logits = net.forward_train(&be, &x).unwrap();
            assert_eq!(logits.dtype(), DType::F32);
            let host = logits.to_host(&be).unwrap();
            assert_close(&format!("{what} logits"), &host, logits_want, 1e-4, 1e-5);
            let view = labels_d.slice.as_view();
            let out = ops::softmax_cross_entropy(&be, &logits, &view, 0.1, unit).unwrap();
            assert_loss_matches(&be, &what, &out, hard, 1.0, (1e-4, 1e-6), 1e-5);
            let soft_out = ops::soft_cross_entropy(&be, &logits, &soft_d.as_view(), unit).unwrap();
            let soft_what = format!("{what} soft");
            assert_loss_matches(&be, &soft_what, &soft_out, smooth, 1.0, (1e-4, 1e-6), 1e-5);
            net.backward(&be, &out.grad).unwrap();
        }
        let grads = net.read_grads(&be).unwrap();
        assert_eq!(grads.len(), cpu_grads.len());
        for (i, (g, c)) in grads.iter().zip(&cpu_grads).enumerate() {
            assert_close(&format!("fuse={fuse} param {i} grad"), g, c, 1e-3, 1e-5);
        }
        for (i, (b, c)) in net
            .read_buffers(&be)
            .unwrap()
            .iter()
            .zip(&cpu_buffers)
            .enumerate()
        {
            assert_close(&format!("fuse={fuse} buffer {i}"), b, c, 1e-5, 1e-6);
        }
        let x = CudaTensor::from_tensor(&be, &batches[0], DType::F32).unwrap();
        let eval = net.forward_eval(&be, &x).unwrap().to_host(&be).unwrap();
        assert_close(
            &format!("fuse={fuse} eval"),
            &eval,
            cpu_eval.data(),
            1e-4,
            1e-5,
        );
    }
}

/// Fusion, recomputing batch norm + ReLU outputs in backward, and
/// activation checkpointing change the kernels and the memory, never the
/// bits.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn fused_residual_networks_compute_the_bits_of_unfused_ones() {
    let be = gpu_or_skip!();
    let (want, plain_allocations, plain_peak) =
        network_bits(&be, false, false, CheckpointPolicy::None);
    let mut fused_peak = [0u64; 2];
    let mut fused_allocations = [0u64; 2];
    for checkpoint in [
        CheckpointPolicy::None,
        CheckpointPolicy::Blocks,
        CheckpointPolicy::All,
    ] {
        for (fuse, recompute) in [(false, false), (false, true), (true, false), (true, true)] {
            let what = format!("{checkpoint:?}, fuse {fuse}, recompute {recompute}");
            let (got, allocations, peak) = network_bits(&be, fuse, recompute, checkpoint);
            eprintln!(
                "{what}: {allocations} allocations, peak {peak} bytes \
                 (unfused, kept: {plain_allocations}, {plain_peak})"
            );
            assert_eq!(want.len(), got.len(), "{what}");
            let differ = want.iter().zip(&got).filter(|(a, b)| a != b).count();
            assert_eq!(differ, 0, "{what}: {differ} values differ");
            if fuse && checkpoint == CheckpointPolicy::None {
                fused_peak[recompute as usize] = peak;
                fused_allocations[recompute as usize] = allocations;
            }
            if fuse && !recompute && checkpoint == CheckpointPolicy::None {
                // Per step, each of the 3 batch norm + ReLU pairs allocates
                // 2 tensors fewer (the ReLU's output, the masked gradient),
                // each of the 3 fused residuals 4 (the ReLU's output, the
                // masked gradient, its copy for the body, the sum's output).
                assert_eq!(plain_allocations - allocations, 2 * (3 * 2 + 3 * 4));
                assert!(peak <= plain_peak);
            }
        }
    }
    // Fused, 5 outputs are not kept through the forward but computed again
    // in backward: 3 batch norm + ReLU outputs (the stem's and each block's
    // first), the first block's output (from the stem's, computed again)
    // and the last residual's (from the second block's, kept: computing it
    // from the first's, itself computed again, would go too deep). Each is
    // computed once per step (2 steps), for the layer after it and then its
    // own ReLU mask, and the stem's once more, not held, for the first
    // block's output.
    assert_eq!(fused_allocations[1] - fused_allocations[0], 2 * 6);
    let [kept, recomputed] = fused_peak;
    assert!(
        recomputed < kept,
        "recomputing peaked at {recomputed} bytes, keeping at {kept}"
    );
}

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
        "bn_running_restore",
        "running_statistics_are_put_back_only_after_a_skipped_step",
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
