//! The GPU learner against the CPU learner: the same model, seed and
//! batches give the same training within f16 rounding; a checkpoint moves
//! between them, and is written with no copy as a snapshot would be; an
//! overflowing step (its gradients, or its update with finite gradients)
//! is skipped with the model left as it was; and a
//! restored learner continues bit for bit.
//!
//! Without a GPU these run on the CPU emulator of CUDA (headroom-cuda-emu);
//! with one (or HEADROOM_REQUIRE_GPU=1) on the device. Where the build
//! found no NVRTC they are built as ignored (crates/model/build.rs), and
//! the binary ends with a line saying how many did not run; one built to
//! run that finds no NVRTC (or no emulator) at run time skips with one line
//! past the output capture. HEADROOM_REQUIRE_NVRTC=1 (CI) makes either a
//! failure.

use std::sync::MutexGuard;

mod common;
#[path = "gpu_gate/mod.rs"]
mod gpu_gate;
#[path = "../../../tests/src/nvrtc_gate.rs"]
#[macro_use]
mod nvrtc_gate;

report_nvrtc_tests!("cuda_learner", include_str!("cuda_learner.rs"));

use common::{bits, settings};
use headroom_loader::Batch;
use headroom_model::cuda::ops::{ConvAlgorithm, ConvPlan};
use headroom_model::cuda::{CudaBackend, CudaBuildOptions, DType};
use headroom_model::memory::MemoryPool;
use headroom_model::{BuildOptions, CheckpointPolicy, Device, LayerSpec, ModelSpec};
use headroom_optim::LossScalerConfig;
use headroom_pipeline::learner::{
    CpuLearner, CudaLearner, CudaOptions, HostState, Learner, StepLr, StepResult, StepSettings,
};

const MODEL: &str = r#"
input = [8, 8, 1]
mean = 0.5
std = 0.25
layers = [
  { type = "conv", out = 8 }, { type = "batch_norm" }, { type = "relu" },
  { type = "basic_block" },
  { type = "conv", out = 16, stride = 2 }, { type = "batch_norm" }, { type = "relu" },
  { type = "global_avg_pool" },
  { type = "linear", out = 4 },
]
"#;

/// The backend gate (see `gpu_gate::backend`), named for this binary.
fn backend() -> Option<MutexGuard<'static, ()>> {
    gpu_gate::backend("cuda_learner")
}

fn spec() -> ModelSpec {
    toml::from_str(MODEL).unwrap()
}

fn cpu_learner(seed: u64) -> CpuLearner {
    CpuLearner::new(
        &spec(),
        seed,
        BuildOptions::default(),
        settings(),
        8,
        MemoryPool::new(Device::Cpu),
    )
    .unwrap()
}

fn gpu_learner(seed: u64) -> CudaLearner {
    gpu_learner_for(&spec(), seed)
}

fn gpu_learner_for(spec: &ModelSpec, seed: u64) -> CudaLearner {
    let be = CudaBackend::new(0).unwrap();
    CudaLearner::new(be, spec, seed, settings(), 8, CudaOptions::default()).unwrap()
}

fn batch(index: usize) -> Batch {
    common::batch(index, 8, 4)
}

fn flat(v: &[Vec<f32>]) -> Vec<f32> {
    v.iter().flatten().copied().collect()
}

/// ‖a - b‖ / ‖b‖.
fn relative_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let diff: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (diff / norm.max(1e-30)).sqrt()
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn gpu_learner_starts_from_the_cpu_weights_and_trains_like_it() {
    let Some(_gpu) = backend() else { return };
    let (mut cpu, mut gpu) = (cpu_learner(7), gpu_learner(7));
    let (start_cpu, start_gpu) = (cpu.snapshot().unwrap(), gpu.snapshot().unwrap());
    assert_eq!(bits(&start_cpu), bits(&start_gpu), "same initial state");
    assert_eq!(gpu.num_params(), cpu.num_params());
    for i in 0..6 {
        let (c, g) = (
            cpu.train_batch(&batch(i), 5e-3).unwrap(),
            gpu.train_batch(&batch(i), 5e-3).unwrap(),
        );
        let norm = (g.grad_norm.unwrap(), c.grad_norm.unwrap());
        assert!(
            (g.loss - c.loss).abs() <= 2e-2 * c.loss.abs(),
            "step {i}: loss {} vs {}",
            g.loss,
            c.loss
        );
        assert!(
            (norm.0 - norm.1).abs() <= 5e-2 * norm.1,
            "step {i}: grad norm {norm:?}"
        );
    }
    let (end_cpu, end_gpu) = (cpu.snapshot().unwrap(), gpu.snapshot().unwrap());
    let moved = relative_l2(&flat(&end_cpu.params), &flat(&start_cpu.params));
    let apart = relative_l2(&flat(&end_gpu.params), &flat(&end_cpu.params));
    // Adam's first steps move each weight by about ±lr whatever its
    // gradient's size, so weights with near-zero gradients may go either way
    // under f16 rounding: the updates agree closely, not exactly. A wrong
    // gradient or update would put `apart` near `moved`.
    assert!(
        apart < 0.25 * moved,
        "GPU and CPU weights differ by {apart}, training moved them {moved}"
    );
    let stats = relative_l2(&flat(&end_gpu.buffers), &flat(&end_cpu.buffers));
    assert!(stats < 1e-2, "running statistics differ by {stats}");
    assert_eq!(end_gpu.optimizer.step, 6);
}

/// Batch `i` on both learners at one learning rate; their losses agree
/// to within `rel`.
fn train_both(
    cpu: &mut CpuLearner,
    gpu: &mut CudaLearner,
    i: usize,
    rel: f32,
) -> (StepResult, StepResult) {
    let (c, g) = (
        cpu.train_batch(&batch(i), 5e-3).unwrap(),
        gpu.train_batch(&batch(i), 5e-3).unwrap(),
    );
    assert!(
        (g.loss - c.loss).abs() <= rel * c.loss.abs(),
        "step {i}: loss {} vs {}",
        g.loss,
        c.loss
    );
    (c, g)
}

/// f32 activations and weights, no loss scaling (`device.amp = false`).
fn f32_options() -> CudaOptions {
    CudaOptions {
        build: CudaBuildOptions {
            activations: DType::F32,
            ..CudaBuildOptions::default()
        },
        loss_scaler: LossScalerConfig::unit(),
        ..CudaOptions::default()
    }
}

/// f32 training on the GPU (`device.amp = false`): no f16 copy, no loss
/// scaling, and the CPU learner's steps up to f32 summation order, so the
/// two agree far more closely than in mixed precision.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn an_f32_gpu_learner_trains_as_the_cpu_learner_does() {
    let Some(_gpu) = backend() else { return };
    let options = f32_options();
    let be = CudaBackend::new(0).unwrap();
    let mut gpu = CudaLearner::new(be, &spec(), 7, settings(), 8, options).unwrap();
    let mut cpu = cpu_learner(7);
    let start = cpu.snapshot().unwrap();
    for i in 0..6 {
        let (c, g) = train_both(&mut cpu, &mut gpu, i, 1e-4);
        let norm = (g.grad_norm.unwrap(), c.grad_norm.unwrap());
        assert!(
            (norm.0 - norm.1).abs() <= 1e-3 * norm.1,
            "step {i}: grad norm {norm:?}"
        );
        assert_eq!(gpu.loss_scale(), 1.0, "step {i}: no loss scaling");
    }
    let (end_cpu, end_gpu) = (cpu.snapshot().unwrap(), gpu.snapshot().unwrap());
    assert!(end_gpu.loss_scale.is_none(), "an f32 snapshot has no scale");
    let moved = relative_l2(&flat(&end_cpu.params), &flat(&start.params));
    let apart = relative_l2(&flat(&end_gpu.params), &flat(&end_cpu.params));
    assert!(
        apart < 1e-3 * moved,
        "GPU f32 and CPU weights differ by {apart}, training moved them {moved}"
    );
    let stats = relative_l2(&flat(&end_gpu.buffers), &flat(&end_cpu.buffers));
    assert!(stats < 1e-5, "running statistics differ by {stats}");
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_checkpoint_moves_between_gpu_and_cpu() {
    let Some(_gpu) = backend() else { return };
    let mut gpu = gpu_learner(3);
    for i in 0..3 {
        gpu.train_batch(&batch(i), 5e-3).unwrap();
    }
    let saved = gpu.snapshot().unwrap();
    let mut cpu = cpu_learner(99);
    cpu.restore(saved.clone()).unwrap();
    assert_eq!(bits(&cpu.snapshot().unwrap()), bits(&saved));
    let mut back = gpu_learner(42);
    back.restore(cpu.snapshot().unwrap()).unwrap();
    assert_eq!(bits(&back.snapshot().unwrap()), bits(&saved));
    let (on_gpu, on_cpu) = (
        back.eval_batch(&batch(9)).unwrap(),
        cpu.eval_batch(&batch(9)).unwrap(),
    );
    let loss = (on_gpu.loss_sum, on_cpu.loss_sum);
    assert!(
        (loss.0 - loss.1).abs() <= 2e-2 * loss.1,
        "eval loss {loss:?}"
    );
    // Test-time augmentation reads class probabilities: f16 logits put them
    // within a few thousandths of the CPU's.
    let probabilities = (
        back.eval_probabilities(&batch(9)).unwrap(),
        cpu.eval_probabilities(&batch(9)).unwrap(),
    );
    assert_eq!(probabilities.0.len(), 8 * 4);
    let apart = relative_l2(&probabilities.0, &probabilities.1);
    assert!(apart < 1e-2, "probabilities differ by {apart}");
}

/// Downloaded 7 values at a time, so that pieces end inside tensors, the
/// state makes the snapshot's file: mixed precision (with its loss scale)
/// and f32, before the first step (no moments) and after three. The GPU
/// snapshot is collected from the same download (`HostState`); that the
/// download holds the network's values is `cuda_parity`'s
/// `a_streamed_state_holds_what_the_network_holds`, and that the snapshot
/// holds the CPU learner's, the tests above.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_state_written_with_no_copy_is_the_snapshot_s_file() {
    let Some(_gpu) = backend() else { return };
    for options in [CudaOptions::default(), f32_options()] {
        let options = CudaOptions {
            state_staging_values: 7,
            ..options
        };
        let be = CudaBackend::new(0).unwrap();
        let mut gpu = CudaLearner::new(be, &spec(), 3, settings(), 8, options).unwrap();
        common::assert_writes_its_snapshot(&mut gpu);
        for i in 0..3 {
            gpu.train_batch(&batch(i), 5e-3).unwrap();
        }
        common::assert_writes_its_snapshot(&mut gpu);
    }
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn an_overflowing_step_is_skipped_and_leaves_everything_as_it_was() {
    let Some(_gpu) = backend() else { return };
    let mut gpu = gpu_learner(5);
    gpu.train_batch(&batch(0), 5e-3).unwrap();
    let mut poisoned = gpu.snapshot().unwrap();
    poisoned.params[0][0] = f32::INFINITY;
    gpu.restore(poisoned).unwrap();
    let (before, scale) = (gpu.snapshot().unwrap(), gpu.loss_scale());
    let result = gpu.train_batch(&batch(1), 5e-3).unwrap();
    assert_eq!(result.grad_norm, None, "the step is skipped");
    assert_eq!(gpu.loss_scale(), scale / 2.0, "the loss scale backs off");
    let after = gpu.snapshot().unwrap();
    assert_eq!(bits(&after), bits(&before));
    let mut resumed = gpu_learner(6);
    resumed.restore(after).unwrap();
    assert_eq!(
        resumed.loss_scale(),
        scale / 2.0,
        "the scale is checkpointed"
    );
}

/// The GPU side of `learner.rs`'s
/// `a_step_whose_update_would_overflow_a_weight_is_skipped_and_changes_nothing`:
/// finite gradients and a finite learning rate whose update would write
/// infinities. The fused optimizer's check refuses it: nothing changes
/// (weights, running statistics, moments, t), the loss scale is not backed
/// off, and the next ordinary step applies. In mixed precision and in f32,
/// launched and replayed from a captured graph.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_step_whose_update_would_overflow_a_weight_is_skipped_and_changes_nothing() {
    let Some(_gpu) = backend() else { return };
    for (what, options) in [("f16", CudaOptions::default()), ("f32", f32_options())] {
        let be = CudaBackend::new(0).unwrap();
        let mut gpu = CudaLearner::new(be, &spec(), 3, settings(), 8, options).unwrap();
        gpu.train_batch(&batch(0), 5e-3).unwrap();
        // The step size lr / (1 - β1^t) is beyond f32 for 1e38 at t = 2 (as
        // in the CPU test) and, replayed from a graph after two more steps,
        // for 3e38 at t = 4 (1e38 / (1 - 0.9^4) would be finite there).
        for (lr, ordinary) in [(1e38f32, 0), (3e38, 2)] {
            for i in 0..ordinary {
                gpu.train_batch(&batch(1 + i), 5e-3).unwrap();
            }
            let what = format!("{what}, lr {lr:e}");
            let (before, scale, replays) = (
                gpu.snapshot().unwrap(),
                gpu.loss_scale(),
                gpu.graph_replays(),
            );
            let result = gpu.train_batch(&batch(5), lr).unwrap();
            assert_eq!(result.grad_norm, None, "{what}: the step is skipped");
            assert!(result.loss.is_finite(), "{what}: the loss itself was fine");
            if ordinary > 0 {
                assert!(gpu.graph_replays() > replays, "{what}: a replayed step");
            }
            let after = gpu.snapshot().unwrap();
            assert!(
                bits(&before) == bits(&after),
                "{what}: weights, running statistics and moments unchanged"
            );
            assert_eq!(before.optimizer.step, after.optimizer.step, "{what}: t");
            assert_eq!(
                gpu.loss_scale(),
                scale,
                "{what}: the scale is not backed off"
            );
            assert_eq!(
                after.loss_scale, before.loss_scale,
                "{what}: the checkpointed scale and clean-step count neither"
            );
            // And the next ordinary step applies, to finite weights.
            let result = gpu.train_batch(&batch(6), 5e-3).unwrap();
            assert!(result.grad_norm.is_some(), "{what}: applied");
            let state = gpu.snapshot().unwrap();
            assert_eq!(state.optimizer.step, before.optimizer.step + 1, "{what}");
            assert!(
                state.params.iter().flatten().all(|w| w.is_finite()),
                "{what}: every weight finite"
            );
        }
    }
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_restored_gpu_learner_continues_bit_for_bit() {
    let Some(_gpu) = backend() else { return };
    let mut first = gpu_learner(11);
    for i in 0..2 {
        first.train_batch(&batch(i), 5e-3).unwrap();
    }
    let mut second = gpu_learner(12);
    second.restore(first.snapshot().unwrap()).unwrap();
    for i in 2..4 {
        let (a, b) = (
            first.train_batch(&batch(i), 5e-3).unwrap(),
            second.train_batch(&batch(i), 5e-3).unwrap(),
        );
        assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "step {i}");
    }
    assert_eq!(
        bits(&first.snapshot().unwrap()),
        bits(&second.snapshot().unwrap())
    );
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn micro_batches_accumulate_as_on_the_cpu() {
    let Some(_gpu) = backend() else { return };
    let (mut cpu, mut gpu) = (cpu_learner(13), gpu_learner(13));
    cpu.set_micro_batch(3);
    gpu.set_micro_batch(3);
    let start = cpu.snapshot().unwrap();
    for i in 0..2 {
        let (c, g) = (
            cpu.train_batch(&batch(i), 5e-3).unwrap(),
            gpu.train_batch(&batch(i), 5e-3).unwrap(),
        );
        assert!(
            (g.loss - c.loss).abs() <= 2e-2 * c.loss,
            "loss {} vs {}",
            g.loss,
            c.loss
        );
    }
    let end = cpu.snapshot().unwrap();
    let moved = relative_l2(&flat(&end.params), &flat(&start.params));
    let apart = relative_l2(&flat(&gpu.snapshot().unwrap().params), &flat(&end.params));
    assert!(apart < 0.25 * moved, "apart {apart}, moved {moved}");
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn recomputation_trains_bit_for_bit_the_same_with_a_lower_peak() {
    let Some(_gpu) = backend() else { return };
    let mut runs = Vec::new();
    for policy in [
        CheckpointPolicy::None,
        CheckpointPolicy::Blocks,
        CheckpointPolicy::All,
    ] {
        let spec = ModelSpec {
            checkpoint: policy,
            ..spec()
        };
        // The peak of a deeper model on larger images: recomputation pays
        // when many blocks' activations would be alive at once.
        let mut large = ModelSpec {
            input: [32, 32, 1],
            ..spec.clone()
        };
        large.layers.splice(3..3, vec![LayerSpec::BasicBlock; 4]);
        let peak = gpu_learner_for(&large, 17).measure_step_peak(4).unwrap();
        let mut learner = gpu_learner_for(&spec, 17);
        for i in 0..3 {
            learner.train_batch(&batch(i), 5e-3).unwrap();
        }
        runs.push((policy, peak, bits(&learner.snapshot().unwrap())));
    }
    let (_, none_peak, none_state) = &runs[0];
    for (policy, peak, state) in &runs[1..] {
        eprintln!("{policy:?}: peak {peak} (none: {none_peak})");
        assert!(state == none_state, "{policy:?} trains differently");
        assert!(
            peak < none_peak,
            "{policy:?}: peak {peak} not below {none_peak}"
        );
    }
}

fn im2col(workspace: usize) -> ConvPlan {
    ConvPlan {
        algorithm: ConvAlgorithm::Im2col,
        workspace,
    }
}

/// The options of [`step_peak`] and [`train_with`].
fn options_with(recompute: bool, conv: ConvPlan) -> CudaOptions {
    CudaOptions {
        build: CudaBuildOptions {
            recompute,
            conv,
            ..CudaBuildOptions::default()
        },
        ..CudaOptions::default()
    }
}

/// The peak of a dry-run step of a deeper model on larger images (where the
/// activations kept through the forward outweigh the rest) with these
/// options. (On the emulator it takes longer than [`train_with`]: a test
/// that needs no peak does not measure one.)
fn step_peak(recompute: bool, conv: ConvPlan) -> u64 {
    let mut large = ModelSpec {
        input: [32, 32, 1],
        ..spec()
    };
    large.layers.splice(3..3, vec![LayerSpec::BasicBlock; 4]);
    let be = CudaBackend::new(0).unwrap();
    let options = options_with(recompute, conv);
    CudaLearner::new(be, &large, 23, settings(), 8, options)
        .unwrap()
        .measure_step_peak(8)
        .unwrap()
}

/// The state before and after 4 steps of `spec()` with these options: the
/// bits of the end state, and the parameters at the start and the end.
fn train_with(recompute: bool, conv: ConvPlan) -> (Vec<u32>, Vec<f32>, Vec<f32>) {
    let be = CudaBackend::new(0).unwrap();
    let options = options_with(recompute, conv);
    let mut learner = CudaLearner::new(be, &spec(), 23, settings(), 8, options).unwrap();
    let start = flat(&learner.snapshot().unwrap().params);
    for i in 0..4 {
        learner.train_batch(&batch(i), 5e-3).unwrap();
    }
    let end = learner.snapshot().unwrap();
    (bits(&end), start, flat(&end.params))
}

/// `device.recompute` changes what a step keeps, never the bits: steps
/// with graphs (captured and replayed) train to the same weights with batch
/// norm + ReLU outputs kept or recomputed, and recomputing peaks lower.
/// `device.conv_workspace` cuts the weight gradient's sum over the batch
/// into per-chunk products, so it changes the f32 summation order: an
/// im2col workspace of one image's rows trains to within a hair of one
/// holding the whole batch.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn recomputed_outputs_train_to_the_same_bits_and_any_workspace_alike() {
    let Some(_gpu) = backend() else { return };
    let kept_peak = step_peak(false, im2col(64 << 20));
    let peak = step_peak(true, im2col(64 << 20));
    let (kept, start, kept_params) = train_with(false, im2col(64 << 20));
    let (recomputed, ..) = train_with(true, im2col(64 << 20));
    assert!(recomputed == kept, "recomputing trains differently");
    eprintln!("step peak: {peak} bytes recomputing, {kept_peak} keeping");
    assert!(
        peak < kept_peak,
        "recomputing peaked at {peak}, keeping at {kept_peak}"
    );
    let moved = relative_l2(&kept_params, &start);
    // 1 byte: every chunk is a single image.
    let (.., one_image) = train_with(true, im2col(1));
    let apart = relative_l2(&one_image, &kept_params);
    eprintln!("one-image workspace: apart {apart:e}, moved {moved:e}");
    assert!(apart < 1e-3 * moved, "apart {apart}, moved {moved}");
}

/// `device.conv_algorithm = "implicit_gemm"` rounds the input gradient
/// once instead of twice and sums the weight gradient in another order, so
/// it trains close to im2col, not to its bits; it needs no im2col matrix, so
/// its step peaks lower.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn implicit_gemm_trains_close_to_im2col_with_a_lower_peak() {
    let Some(_gpu) = backend() else { return };
    let peak = step_peak(true, im2col(64 << 20));
    let (_, start, params) = train_with(true, im2col(64 << 20));
    let implicit = ConvPlan {
        algorithm: ConvAlgorithm::ImplicitGemm,
        workspace: 64 << 20,
    };
    let implicit_peak = step_peak(true, implicit);
    let (_, _, implicit_params) = train_with(true, implicit);
    let moved = relative_l2(&params, &start);
    let apart = relative_l2(&implicit_params, &params);
    eprintln!(
        "implicit GEMM: apart {apart:e}, moved {moved:e}, peak {implicit_peak} (im2col {peak})"
    );
    assert!(apart < 5e-2 * moved, "apart {apart}, moved {moved}");
    assert!(
        implicit_peak < peak,
        "implicit GEMM peaked at {implicit_peak}, im2col at {peak}"
    );
}

/// `device.conv_algorithm = "auto"` mixes the two algorithms in one
/// network: here the basic block's 8-channel stride-1 convolutions take the
/// implicit kernels, the stride-2 one (which `implicit_gemm` would take)
/// and the first (one channel in) im2col. So its weights differ from both
/// all-im2col and all-implicit runs, stay close to them, and are the same
/// bits every run.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn auto_mixes_the_convolution_algorithms_to_the_same_bits_every_run() {
    let Some(_gpu) = backend() else { return };
    let (im2col_bits, start, params) = train_with(true, im2col(64 << 20));
    let plan = |algorithm| ConvPlan {
        algorithm,
        workspace: 64 << 20,
    };
    let (implicit_bits, ..) = train_with(true, plan(ConvAlgorithm::ImplicitGemm));
    let (auto_bits, _, auto_params) = train_with(true, plan(ConvAlgorithm::Auto));
    let (again_bits, ..) = train_with(true, plan(ConvAlgorithm::Auto));
    assert_eq!(auto_bits, again_bits, "two auto runs");
    assert_ne!(auto_bits, im2col_bits, "auto ran no implicit kernel");
    assert_ne!(
        auto_bits, implicit_bits,
        "auto ran the implicit kernels everywhere"
    );
    let moved = relative_l2(&params, &start);
    let apart = relative_l2(&auto_params, &params);
    assert!(apart < 5e-2 * moved, "apart {apart}, moved {moved}");
}

/// Batch `i` with Mixup-like soft targets: λ on each sample's class, 1 - λ
/// on the next one.
fn mixed_batch(i: usize) -> Batch {
    let mut mixed = batch(i);
    let mut targets = vec![0.0f32; 8 * 4];
    for (row, (t, &label)) in targets.chunks_exact_mut(4).zip(&mixed.labels).enumerate() {
        let lambda = 0.55 + 0.05 * row as f32;
        t[label as usize] += lambda;
        t[(label as usize + 1) % 4] += 1.0 - lambda;
    }
    mixed.soft_targets = Some(targets);
    mixed
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn mixed_soft_targets_train_as_on_the_cpu() {
    let Some(_gpu) = backend() else { return };
    let (mut cpu, mut gpu) = (cpu_learner(19), gpu_learner(19));
    for i in 0..3 {
        let mixed = mixed_batch(i);
        let (c, g) = (
            cpu.train_batch(&mixed, 5e-3).unwrap(),
            gpu.train_batch(&mixed, 5e-3).unwrap(),
        );
        assert!(
            (g.loss - c.loss).abs() <= 2e-2 * c.loss,
            "step {i}: loss {} vs {}",
            g.loss,
            c.loss
        );
        // f16 may flip a near tie between two classes.
        assert!(g.correct.abs_diff(c.correct) <= 1, "step {i}: correct");
    }
}

/// A run of steps that exercises every way a captured step is made, used
/// and given up: eager warm-up, capture, replays across new loss scales
/// (every 3 clean steps here; the scale lives in device memory), a smaller
/// last batch (eager), a split batch (eager), and back.
fn graph_workout(graphs: bool) -> (Vec<u32>, Vec<u32>, u64) {
    let be = CudaBackend::new(0).unwrap();
    let options = CudaOptions {
        graphs,
        loss_scaler: headroom_optim::LossScalerConfig {
            growth_interval: 3,
            ..Default::default()
        },
        ..CudaOptions::default()
    };
    let mut gpu = CudaLearner::new(be, &spec(), 23, settings(), 8, options).unwrap();
    let mut results = Vec::new();
    for i in 0..12 {
        let mut b = batch(i);
        if i == 7 {
            b = b.slice(0..5);
        }
        if i == 9 {
            gpu.set_micro_batch(4);
        }
        if i == 10 {
            gpu.set_micro_batch(8);
        }
        let r = gpu.train_batch(&b, 1e-3 * (1.0 + i as f32)).unwrap();
        results.extend([r.loss.to_bits(), r.correct as u32]);
        results.push(r.grad_norm.map_or(u32::MAX, f32::to_bits));
    }
    (bits(&gpu.snapshot().unwrap()), results, gpu.graph_replays())
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn captured_steps_train_to_the_bits_of_launched_ones() {
    let Some(_gpu) = backend() else { return };
    let (eager_state, eager_results, eager_replays) = graph_workout(false);
    let (graph_state, graph_results, graph_replays) = graph_workout(true);
    assert_eq!(eager_replays, 0, "device.graphs = false never replays");
    // Step 0 warms up (eager); 1 captures and replays, 2 to 6 replay (the
    // scale grows after 2 and 5 without a new capture); 7 (5 samples) runs
    // eagerly and 8 replays 1's graph; 9 (split in two) runs eagerly; 10
    // warms up the new micro-batch size; 11 captures and replays: 8 replays.
    assert_eq!(graph_replays, 8, "replays");
    assert_eq!(graph_results, eager_results, "losses, counts and norms");
    assert_eq!(graph_state, eager_state, "weights, statistics and moments");
}

const TOKEN_MODEL: &str = r#"
tokens = { length = 8, vocab = 32 }
layers = [
  { type = "embedding", dim = 16, positions = true },
  { type = "transformer_block", heads = 2, mlp_ratio = 2, dropout = 0.1 },
  { type = "layer_norm" },
  { type = "linear", out = 32 },
]
"#;

const LSTM_MODEL: &str = r#"
tokens = { length = 8, vocab = 32 }
layers = [
  { type = "embedding", dim = 8 },
  { type = "lstm", hidden = 16 },
  { type = "linear", out = 32 },
]
"#;

/// `n` samples of `shape` (per sample) of pseudo-random bytes below
/// `below`, without labels: text windows or frame sequences.
fn sequence_batch(index: usize, n: usize, shape: [usize; 3], below: usize) -> Batch {
    let len = shape.iter().product::<usize>();
    Batch {
        epoch: 0,
        index,
        shape: [n, shape[0], shape[1], shape[2]],
        pixels: (0..n * len)
            .map(|i| ((((i * 2_654_435_761) >> 7) ^ (index * 131)) % below) as u8)
            .collect(),
        labels: vec![0; n],
        soft_targets: None,
        recipes: None,
        features: None,
        values: None,
    }
}

/// Six steps of `model` at micro-batch `full`, step 4 one sample short
/// (eager): the state's bits, each step's loss, count and norm, and how
/// many steps were graph replays.
fn sequence_workout(
    model: &str,
    full: usize,
    batch: impl Fn(usize, usize) -> Batch,
    graphs: bool,
) -> (Vec<u32>, Vec<u32>, u64) {
    let spec: ModelSpec = toml::from_str(model).unwrap();
    let be = CudaBackend::new(0).unwrap();
    let options = CudaOptions {
        graphs,
        ..CudaOptions::default()
    };
    let mut gpu = CudaLearner::new(be, &spec, 23, settings(), full, options).unwrap();
    let mut results = Vec::new();
    for i in 0..6 {
        let r = gpu
            .train_batch(
                &batch(i, if i == 4 { full - 1 } else { full }),
                1e-3 * (1.0 + i as f32),
            )
            .unwrap();
        results.extend([r.loss.to_bits(), r.correct as u32]);
        results.push(r.grad_norm.map_or(u32::MAX, f32::to_bits));
    }
    (bits(&gpu.snapshot().unwrap()), results, gpu.graph_replays())
}

/// Captured and launched runs of `sequence_workout` give the same bits.
/// Step 0 warms up, 1 captures and replays, 2 and 3 replay, 4 (a sample
/// short) runs eagerly, 5 replays.
fn assert_captured_like_launched(model: &str, full: usize, batch: impl Fn(usize, usize) -> Batch) {
    let (eager_state, eager_results, eager_replays) = sequence_workout(model, full, &batch, false);
    let (graph_state, graph_results, graph_replays) = sequence_workout(model, full, &batch, true);
    assert_eq!(eager_replays, 0, "device.graphs = false never replays");
    assert_eq!(graph_replays, 4, "replays of {model}");
    assert_eq!(graph_results, eager_results, "losses, counts and norms");
    assert_eq!(graph_state, eager_state, "weights and moments");
}

/// A token model's captured step (a transformer with dropout, an LSTM)
/// reads its ids from the graph's input buffer and a label per token, and
/// trains to the bits of launched steps.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn captured_token_steps_train_to_the_bits_of_launched_ones() {
    let Some(_gpu) = backend() else { return };
    for model in [TOKEN_MODEL, LSTM_MODEL] {
        // Windows of 9 ids below the vocabulary of 32.
        assert_captured_like_launched(model, 8, |i, n| sequence_batch(i, n, [9, 1, 1], 32));
    }
}

const FRAME_MODEL: &str = r#"
input = [8, 8, 1]
frames = 3
mean = 0.0
std = 1.0
layers = [
  { type = "unet_skip", layers = [
    { type = "conv", out = 4, stride = 2, bias = true }, { type = "relu" },
    { type = "conv_lstm", hidden = 4 },
    { type = "upsample2x" },
  ] },
  { type = "conv", out = 1, bias = true },
]
"#;

/// A frame model's captured step reads its input frames and then its
/// target frames from the graph's one input buffer, and trains to the bits
/// of launched steps.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn captured_frame_steps_train_to_the_bits_of_launched_ones() {
    let Some(_gpu) = backend() else { return };
    // 4 frames of 8×8 stacked along the height: 3 inputs, each one's
    // successor.
    assert_captured_like_launched(FRAME_MODEL, 4, |i, n| sequence_batch(i, n, [32, 8, 1], 256));
}

/// The learning rate of the i-th applied step: different at every step, so
/// a step that took another step's rate would show in the bits.
fn schedule(i: u64) -> f32 {
    1e-3 * (1.0 + i as f32 * 0.25)
}

/// A learner whose loss scale starts far too high: the first steps
/// overflow and are skipped while the scale backs off, and growth every 3
/// clean steps makes some overflow again later.
fn overflowing_learner(graphs: bool) -> CudaLearner {
    let be = CudaBackend::new(0).unwrap();
    let top = 2f32.powi(30);
    let options = CudaOptions {
        graphs,
        loss_scaler: headroom_optim::LossScalerConfig {
            init_scale: top,
            max_scale: top,
            growth_interval: 3,
            ..Default::default()
        },
        ..CudaOptions::default()
    };
    CudaLearner::new(be, &spec(), 31, settings(), 8, options).unwrap()
}

/// One result as bits: loss, correct count, norm (or a skip).
fn result_bits(r: &StepResult) -> [u32; 3] {
    [
        r.loss.to_bits(),
        r.correct as u32,
        r.grad_norm.map_or(u32::MAX, f32::to_bits),
    ]
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn steps_queued_behind_a_running_step_train_to_the_bits_of_waited_ones() {
    let Some(_gpu) = backend() else { return };
    const STEPS: usize = 30;
    // Each step waited for before the next is queued (graphs off).
    let mut waited = overflowing_learner(false);
    let mut applied = 0u64;
    let mut waited_results = Vec::new();
    for i in 0..STEPS {
        let lr = StepLr {
            applied,
            at: &schedule,
        };
        waited.submit_batch(&batch(i), lr).unwrap();
        let r = waited.collect_step().unwrap().unwrap();
        applied += r.grad_norm.is_some() as u64;
        waited_results.push(result_bits(&r));
    }
    // Step i+1 queued before step i is collected, as the training loop does
    // on a GPU (graphs on): its learning rate is picked on the device.
    let mut queued = overflowing_learner(true);
    assert_eq!(queued.pipeline_depth(), 1);
    let mut applied = 0u64;
    let mut queued_results = Vec::new();
    let mut most_in_flight = 0;
    for i in 0..=STEPS {
        if i < STEPS {
            let lr = StepLr {
                applied,
                at: &schedule,
            };
            queued.submit_batch(&batch(i), lr).unwrap();
        }
        most_in_flight = most_in_flight.max(queued.steps_in_flight());
        if queued.steps_in_flight() > 1 || i == STEPS {
            let r = queued.collect_step().unwrap().unwrap();
            applied += r.grad_norm.is_some() as u64;
            queued_results.push(result_bits(&r));
        }
    }
    assert!(queued.collect_step().unwrap().is_none(), "all collected");
    assert_eq!(most_in_flight, 2, "a step was queued behind another");
    let skipped = waited_results.iter().filter(|r| r[2] == u32::MAX).count();
    assert!(
        (3..STEPS - 5).contains(&skipped),
        "the run mixes skipped and applied steps ({skipped} skipped)"
    );
    assert_eq!(
        queued_results, waited_results,
        "losses, counts, norms, skips"
    );
    let (queued_state, waited_state) = (queued.snapshot().unwrap(), waited.snapshot().unwrap());
    assert_eq!(
        bits(&queued_state),
        bits(&waited_state),
        "weights, statistics and moments"
    );
    assert_eq!(
        queued_state.optimizer.step, applied,
        "t counts applied steps"
    );
    assert_eq!(waited_state.optimizer.step, applied);
    assert_eq!(queued_state.loss_scale, waited_state.loss_scale);
    assert_eq!(queued.loss_scale(), waited.loss_scale());
    assert!(queued.graph_replays() > 0, "graph replays took part");
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_snapshot_waits_for_every_step_to_be_collected() {
    let Some(_gpu) = backend() else { return };
    let mut gpu = gpu_learner(37);
    let lr = StepLr {
        applied: 0,
        at: &schedule,
    };
    gpu.submit_batch(&batch(0), lr).unwrap();
    let err = gpu.snapshot().unwrap_err().to_string();
    assert!(err.contains("in flight"), "{err}");
    let err = gpu.write_state(&mut HostState::default()).unwrap_err();
    assert!(err.to_string().contains("in flight"), "{err}");
    assert!(gpu.train_batch(&batch(1), 1e-3).is_err(), "train_batch too");
    gpu.collect_step().unwrap().unwrap();
    gpu.snapshot().unwrap();
}

/// `bench --profile`: the profiled steps run eagerly, every layer's
/// forward and backward, the input, the loss and the optimizer show up
/// once per step (twice for the block's two equal convolutions), and the
/// captured steps come back after.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_profile_times_every_segment_of_the_steps_it_covers() {
    let Some(_gpu) = backend() else { return };
    let be = CudaBackend::new(0).unwrap();
    let options = CudaOptions {
        graphs: true,
        ..CudaOptions::default()
    };
    let mut gpu = CudaLearner::new(be, &spec(), 5, settings(), 8, options).unwrap();
    for i in 0..3 {
        gpu.train_batch(&batch(i), 1e-3).unwrap();
    }
    let replays = gpu.graph_replays();
    assert!(replays > 0, "the warm-up steps replay a captured graph");
    assert!(gpu.profile_start().unwrap(), "a GPU learner profiles");
    for i in 3..6 {
        gpu.train_batch(&batch(i), 1e-3).unwrap();
    }
    let segments = gpu.profile_finish().unwrap();
    assert_eq!(gpu.graph_replays(), replays, "profiled steps run eagerly");
    let count = |label: &str| {
        segments
            .iter()
            .find(|s| s.label == label)
            .map_or(0, |s| s.count)
    };
    let labels: Vec<&str> = segments.iter().map(|s| s.label.as_str()).collect();
    for (label, per_step) in [
        ("input: staged, normalised", 1),
        ("fwd conv 3x3/1 to 8 in 8x8x1", 1),
        ("fwd conv 3x3/1 to 8 in 8x8x8", 2),
        ("bwd conv 3x3/1 to 8 out 8x8x8", 3),
        ("fwd conv 3x3/2 to 16 in 8x8x8", 1),
        ("bwd conv 3x3/2 to 16 out 4x4x16", 1),
        ("fwd global_avg_pool in 4x4x16", 1),
        ("bwd linear to 4 out 4", 1),
        ("loss: softmax cross-entropy", 1),
        ("optimizer: unscale, clip, AdamW", 1),
        // device.recompute: the block's output for the strided
        // convolution (from the stem's, computed for it alone); the block's
        // first batch norm + ReLU for the convolution after it; the stem's
        // again for the block's first convolution. Not the last batch norm
        // + ReLU's: the pooling after it keeps nothing, and its own
        // backward takes the ReLU's mask from its input.
        ("recompute batch_norm+relu out 4x4x16", 0),
        ("recompute residual batch_norm+add+relu out 8x8x8", 1),
        ("recompute batch_norm+relu out 8x8x8", 3),
    ] {
        assert_eq!(count(label), 3 * per_step, "{label} in {labels:?}");
    }
    assert!(segments.iter().all(|s| s.ms >= 0.0), "{segments:?}");
    assert!(segments.iter().map(|s| s.ms).sum::<f64>() > 0.0);
    for i in 6..9 {
        gpu.train_batch(&batch(i), 1e-3).unwrap();
    }
    assert!(
        gpu.graph_replays() > replays,
        "graphs again after the profile"
    );
    assert!(
        gpu.profile_finish().unwrap().is_empty(),
        "nothing left over"
    );
}

/// An MLP with layer norm and dropout between its layers.
const DROPOUT_MODEL: &str = r#"
input = [8, 8, 1]
mean = 0.5
std = 0.25
layers = [
  { type = "flatten" },
  { type = "linear", out = 32 }, { type = "layer_norm" }, { type = "silu" },
  { type = "dropout", p = 0.25 },
  { type = "linear", out = 16 }, { type = "gelu" }, { type = "dropout", p = 0.1 },
  { type = "linear", out = 4 },
]
"#;

/// Dropout on the GPU draws the CPU learner's masks step after step,
/// through captured graphs (the counter advances on the device in each
/// replay) and a split batch (a count per micro-batch): an f32 GPU
/// learner ends within 1e-3 of how far the CPU learner moved its weights,
/// with the same counters.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn dropout_masks_follow_the_cpu_learner_through_graphs_and_micro_batches() {
    let Some(_gpu) = backend() else { return };
    let spec: ModelSpec = toml::from_str(DROPOUT_MODEL).unwrap();
    let options = f32_options();
    let be = CudaBackend::new(0).unwrap();
    let mut gpu = CudaLearner::new(be, &spec, 13, settings(), 8, options).unwrap();
    let pool = MemoryPool::new(Device::Cpu);
    let mut cpu = CpuLearner::new(&spec, 13, BuildOptions::default(), settings(), 8, pool).unwrap();
    let start = cpu.snapshot().unwrap();
    for i in 0..8 {
        if i == 5 {
            gpu.set_micro_batch(4);
            cpu.set_micro_batch(4);
        }
        train_both(&mut cpu, &mut gpu, i, 1e-4);
    }
    assert!(gpu.graph_replays() > 0, "some steps were replayed");
    let (end_cpu, end_gpu) = (cpu.snapshot().unwrap(), gpu.snapshot().unwrap());
    // 5 whole steps and 3 split in two: 11 forwards.
    assert_eq!(end_gpu.buffers, end_cpu.buffers, "dropout counters");
    assert_eq!(end_gpu.buffers[0], vec![11.0, 0.0, 0.0, 0.0]);
    let moved = relative_l2(&flat(&end_cpu.params), &flat(&start.params));
    let apart = relative_l2(&flat(&end_gpu.params), &flat(&end_cpu.params));
    assert!(
        apart < 1e-3 * moved,
        "GPU f32 and CPU weights differ by {apart}, training moved them {moved}"
    );
    // The counters travel in checkpoints both ways.
    let mut back = gpu_learner_for(&spec, 99);
    back.restore(end_cpu.clone()).unwrap();
    assert_eq!(back.snapshot().unwrap().buffers, end_cpu.buffers);
    let pool = MemoryPool::new(Device::Cpu);
    let mut cpu_again =
        CpuLearner::new(&spec, 99, BuildOptions::default(), settings(), 8, pool).unwrap();
    cpu_again.restore(end_gpu.clone()).unwrap();
    assert_eq!(bits(&cpu_again.snapshot().unwrap()), bits(&end_gpu));
}

/// A skipped step (the loss scale overflows) puts the dropout counters
/// back, as the CPU learner puts back every buffer, eagerly and in a
/// captured graph alike: the counters count only the applied steps.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_skipped_step_puts_the_dropout_counters_back() {
    let Some(_gpu) = backend() else { return };
    let spec: ModelSpec = toml::from_str(DROPOUT_MODEL).unwrap();
    for graphs in [false, true] {
        let be = CudaBackend::new(0).unwrap();
        let top = 2f32.powi(20);
        let options = CudaOptions {
            graphs,
            loss_scaler: LossScalerConfig {
                init_scale: top,
                max_scale: top,
                ..Default::default()
            },
            ..CudaOptions::default()
        };
        let mut gpu = CudaLearner::new(be, &spec, 17, settings(), 8, options).unwrap();
        let mut applied = 0.0f32;
        let mut skipped = 0;
        for i in 0..10 {
            let r = gpu.train_batch(&batch(i), 1e-3).unwrap();
            match r.grad_norm {
                Some(_) => applied += 1.0,
                None => skipped += 1,
            }
            let counters = gpu.snapshot().unwrap().buffers;
            assert_eq!(counters.len(), 2);
            for counter in counters {
                assert_eq!(
                    counter,
                    vec![applied, 0.0, 0.0, 0.0],
                    "graphs {graphs}, step {i}"
                );
            }
        }
        assert!(
            skipped > 0 && applied > 0.0,
            "graphs {graphs}: {skipped} skipped, {applied} applied"
        );
        assert_eq!(gpu.graph_replays() > 0, graphs, "graphs {graphs}: replays");
    }
}

/// `train.loss = "focal"` on the GPU: an f32 learner follows the CPU
/// learner's focal-loss steps, hard labels (eager, then captured and
/// replayed) and a Mixup-like batch of soft targets, to within 1e-3 of how
/// far the CPU moved its weights.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn focal_loss_trains_as_on_the_cpu() {
    let Some(_gpu) = backend() else { return };
    let focal = StepSettings {
        focal_gamma: Some(2.0),
        regression: None,
        ..settings()
    };
    let be = CudaBackend::new(0).unwrap();
    let mut gpu = CudaLearner::new(be, &spec(), 29, focal.clone(), 8, f32_options()).unwrap();
    let pool = MemoryPool::new(Device::Cpu);
    let mut cpu = CpuLearner::new(&spec(), 29, BuildOptions::default(), focal, 8, pool).unwrap();
    let start = cpu.snapshot().unwrap();
    for i in 0..6 {
        if i == 4 {
            let mixed = mixed_batch(i);
            let (c, g) = (
                cpu.train_batch(&mixed, 5e-3).unwrap(),
                gpu.train_batch(&mixed, 5e-3).unwrap(),
            );
            assert!(
                (g.loss - c.loss).abs() <= 1e-4 * c.loss,
                "mixed: {} vs {}",
                g.loss,
                c.loss
            );
            continue;
        }
        train_both(&mut cpu, &mut gpu, i, 1e-4);
    }
    assert!(gpu.graph_replays() > 0, "some focal steps were replayed");
    let (end_cpu, end_gpu) = (cpu.snapshot().unwrap(), gpu.snapshot().unwrap());
    let moved = relative_l2(&flat(&end_cpu.params), &flat(&start.params));
    let apart = relative_l2(&flat(&end_gpu.params), &flat(&end_cpu.params));
    assert!(
        apart < 1e-3 * moved,
        "GPU and CPU focal-loss weights differ by {apart}, training moved them {moved}"
    );
}

#[path = "../../model/tests/common/mix_layer.rs"]
mod mix_layer;

/// One epoch through the `Trainer` with `custom`'s layer registered, on
/// `device`.
fn train_custom(
    dir: &std::path::Path,
    custom: &str,
    device: headroom_pipeline::trainer::DeviceKind,
) -> headroom_pipeline::Result<headroom_pipeline::RunSummary> {
    use headroom_pipeline::trainer::{network, LoopSettings, NetworkPlan};
    let plan = NetworkPlan {
        spec: ModelSpec {
            mean: 0.5,
            std: 0.25,
            ..mix_layer::spec(custom, CheckpointPolicy::default())
        },
        seed: 3,
        build: Default::default(),
        layers: mix_layer::registry(),
        step: settings(),
        batch: 16,
        device,
        cuda: Default::default(),
    };
    let data = || std::sync::Arc::new(headroom_loader::SyntheticDataset::new(64, [6, 6, 2], 4));
    headroom_pipeline::Trainer::builder()
        .output_dir(dir)
        .model("custom", network(plan))
        .data(data(), data())
        .loop_settings(LoopSettings {
            epochs: 1,
            batch_size: 16,
            threads: 1,
            ..Default::default()
        })
        .build()?
        .run()
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_custom_layer_registered_with_cuda_trains_on_the_gpu_through_the_trainer() {
    use headroom_pipeline::trainer::DeviceKind;
    let Some(_gpu) = backend() else { return };
    let root = tempfile::tempdir().unwrap();
    let on_gpu = train_custom(&root.path().join("gpu"), "mix", DeviceKind::Cuda).unwrap();
    let on_cpu = train_custom(&root.path().join("cpu"), "mix", DeviceKind::Cpu).unwrap();
    assert_eq!(on_gpu.step, 4);
    let (g, c) = (
        on_gpu.epochs[0].train_loss.unwrap(),
        on_cpu.epochs[0].train_loss.unwrap(),
    );
    assert!(
        (g - c).abs() <= 2e-2 * c.abs(),
        "train loss {g} (GPU) vs {c} (CPU)"
    );
    // The layer registered without its CUDA form is refused by name.
    let err = train_custom(
        &root.path().join("refused"),
        "mix_cpu_only",
        DeviceKind::Cuda,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("mix_cpu_only") && err.contains("no CUDA implementation"),
        "{err}"
    );
}
