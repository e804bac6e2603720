//! Parity tests of the frame models' ops (`src/ops/frames`).

use super::*;

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
