//! Parity tests of whole networks (`src/cuda/network`).

use super::*;

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

#[derive(Deserialize)]
pub(crate) struct SpecFile {
    pub(crate) model: ModelSpec,
}

/// Two basic blocks and a bare residual whose body ends in a batch norm,
/// followed by a ReLU (fused too, unless a checkpointed segment separates
/// the two). 20 channels: a partial 32-channel tile; 6·9·9 rows: 2 chunks.
pub(crate) fn two_block_spec(checkpoint: CheckpointPolicy) -> ModelSpec {
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
pub(crate) fn flattening_specs(checkpoint: CheckpointPolicy) -> Vec<ModelSpec> {
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
pub(crate) fn flattening_network_run(
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
    network_run_with(be, spec, options, batches, grad_logits)
}

/// As `flattening_network_run`, built with `options`.
pub(crate) fn network_run_with(
    be: &CudaBackend,
    spec: &ModelSpec,
    options: CudaBuildOptions,
    batches: &[Tensor],
    grad_logits: &Tensor,
) -> (Vec<f32>, Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let dtype = options.activations;
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
pub(crate) struct CpuRun {
    pub(crate) outputs: Vec<f32>,
    pub(crate) grads: Vec<Vec<f32>>,
    pub(crate) buffers: Vec<Vec<f32>>,
}

pub(crate) fn cpu_run(cpu: &mut Network, batches: &[Tensor], grad: &Tensor) -> CpuRun {
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

/// A small network of `spec`'s layers (a `[model]` TOML, input 6×6×2, 4
/// outputs), with and without checkpointing, in f32 and f16, against the
/// CPU network: two training batches from seed `seed` and an eval pass, the
/// output gradient from `seed + 10`; checkpointing must give the same bits.
/// `what` names the layer in the failures.
pub(crate) fn small_network_matches_the_cpu(be: &CudaBackend, what: &str, spec: &str, seed: u64) {
    let spec = |checkpoint: CheckpointPolicy| {
        let mut spec = toml::from_str::<SpecFile>(spec).unwrap().model;
        spec.checkpoint = checkpoint;
        spec
    };
    let (plain, all) = (spec(CheckpointPolicy::None), spec(CheckpointPolicy::All));
    let n = 5;
    let batches: Vec<Tensor> = (0..2)
        .map(|i| random(&[n, 6, 6, 2], seed + i, 1.0, 0.0))
        .collect();
    let grad_logits = random(&[n, 4], seed + 10, 0.5, 0.0);
    let mut cpu = Network::build(&plain, 9).unwrap();
    let reference = cpu_run(&mut cpu, &batches, &grad_logits);
    for dtype in [DType::F32, DType::F16] {
        let what = format!("{what} network {dtype:?}");
        let (logits, grads, _) = flattening_network_run(be, &plain, dtype, &batches, &grad_logits);
        let again = flattening_network_run(be, &all, dtype, &batches, &grad_logits);
        assert!(
            logits
                .iter()
                .zip(&again.0)
                .all(|(a, b)| a.to_bits() == b.to_bits())
                && grads == again.1,
            "{what}: checkpointing changed the bits"
        );
        let tolerances = Tolerances {
            f32_outputs: (1e-4, 1e-5),
            f32_grads: (1e-3, 1e-5),
            f16_outputs: 4e-3,
            f16_grads: 1e-2,
        };
        assert_matches_cpu(
            &what,
            dtype,
            (&logits, &grads),
            (&reference.outputs, &reference.grads),
            tolerances,
        );
    }
}

/// f32: (relative, absolute fraction) element-wise bounds for outputs and
/// gradients; f16: relative L2 bounds.
pub(crate) struct Tolerances {
    pub(crate) f32_outputs: (f32, f32),
    pub(crate) f32_grads: (f32, f32),
    pub(crate) f16_outputs: f64,
    pub(crate) f16_grads: f64,
}

/// A GPU network's outputs and gradients against the CPU network's.
pub(crate) fn assert_matches_cpu(
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

/// Each top-level layer's floor (`CudaNetwork::backward_with`) marks
/// gradients backward has finished: at every call, the gradients at and
/// above the floor are already their final values (what a data-parallel
/// rank may then reduce while backward goes on), and before the last call
/// some of them, never all, are final. Over every checkpoint policy, fused
/// and not, and the MLP, flattening and UNet networks.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn each_layer_s_floor_marks_gradients_backward_has_finished() {
    let be = gpu_or_skip!();
    let policies = [
        CheckpointPolicy::None,
        CheckpointPolicy::Blocks,
        CheckpointPolicy::All,
    ];
    let mut specs: Vec<(String, ModelSpec, [usize; 3])> = Vec::new();
    for checkpoint in policies {
        specs.push((
            format!("two blocks, {checkpoint:?}"),
            two_block_spec(checkpoint),
            [9, 9, 2],
        ));
        for (i, spec) in flattening_specs(checkpoint).into_iter().enumerate() {
            specs.push((format!("flattening {i}, {checkpoint:?}"), spec, [6, 6, 2]));
        }
    }
    for (name, spec, input) in specs {
        for fuse in [true, false] {
            let what = format!("{name}, fuse {fuse}");
            let options = CudaBuildOptions {
                fuse,
                ..CudaBuildOptions::default()
            };
            let mut network = CudaNetwork::build(&be, &spec, 7, options).unwrap();
            let n = 3;
            let x = upload(
                &be,
                &random(&[n, input[0], input[1], input[2]], 870, 1.0, 0.0),
            );
            let classes = network.num_classes();
            let g = upload(&be, &random(&[n, classes], 871, 0.5, 0.0));
            network.forward_train(&be, &x).unwrap();
            let mut seen: Vec<([usize; 3], Vec<Vec<f32>>)> = Vec::new();
            network
                .backward_with(&be, &g, &mut |groups, floor| {
                    let grads = groups[..2]
                        .iter()
                        .map(|group| download(&be, &group.grad.slice))
                        .collect();
                    seen.push((*floor, grads));
                    Ok(())
                })
                .unwrap();
            let last: Vec<Vec<f32>> = network.groups()[..2]
                .iter()
                .map(|group| download(&be, &group.grad.slice))
                .collect();
            assert!(!seen.is_empty(), "{what}: no call");
            assert_eq!(seen.last().map(|s| s.0), Some([0; 3]), "{what}");
            let mut final_early = false;
            for (call, (floor, grads)) in seen.iter().enumerate() {
                for g in 0..2 {
                    let from = floor[g].min(last[g].len());
                    let same = grads[g][from..]
                        .iter()
                        .zip(&last[g][from..])
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{what}: call {call}: group {g} above {from} not final"
                    );
                    if call + 1 < seen.len() && from < last[g].len() && from > 0 {
                        final_early = true;
                    }
                }
            }
            assert!(final_early, "{what}: no gradient was final before the end");
        }
    }
}
