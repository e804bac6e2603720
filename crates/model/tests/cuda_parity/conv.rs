//! Parity tests of convolution (`src/ops/conv`).

use super::*;

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
pub(crate) fn kernel_runs(names: &[&str]) -> Option<u64> {
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

/// Whether this GPU (or the architecture the emulator answers as, e.g.
/// HEADROOM_CUDA_EMU_ARCH=75) runs conv_mma.cu's kernels; where it does
/// not, every test below expects im2col in their place, matching the CPU
/// layer all the same, and counts that the implicit kernels never ran.
fn implicit_here(be: &CudaBackend) -> bool {
    headroom_model::cuda::arch::ArchFeatures::of(be.info().arch()).implicit_gemm()
}

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
    let here = u64::from(implicit_here(&be));
    for (i, (shape, bias, plan, runs)) in cases.enumerate() {
        let case = ConvCase { shape, bias, plan };
        counted_conv_parity(
            &be,
            &case,
            &IMPLICIT_KERNELS,
            runs * here,
            300 + 10 * i as u64,
        );
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
    // And the aligned weight does take the implicit kernels (where the
    // GPU has them).
    let before = kernel_runs(&IMPLICIT_KERNELS);
    run(AnyView::F16(aligned.as_view()), implicit);
    if let (Some(before), Some(after)) = (before, kernel_runs(&IMPLICIT_KERNELS)) {
        assert_eq!(
            after - before,
            4 * u64::from(implicit_here(&be)),
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
            4 * u64::from(implicit_here(&be)),
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
    let here = implicit_here(&be);
    for (i, (shape, runs)) in cases.into_iter().enumerate() {
        // The thin first layer's one run (its dW's wgrad_reduce) stays.
        let runs = if here || shape.cin == 1 { runs } else { 0 };
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
    if !implicit_here(&be) {
        // Nothing to choose between: im2col, no timing, nothing kept, and
        // a restored choice of the implicit kernels runs im2col too.
        counted_conv_parity(&be, &case(s), &IMPLICIT_KERNELS, 0, 700);
        assert!(
            tuned_of(&be, s).is_empty(),
            "tuned without implicit kernels"
        );
        let restored: Vec<TunedConv> = [
            ConvProduct::Forward,
            ConvProduct::InputGrad,
            ConvProduct::WeightGrad,
        ]
        .into_iter()
        .map(|product| TunedConv {
            shape: s,
            product,
            path: ConvPath::Implicit,
            implicit_ms: 1.0,
            im2col_ms: 1.0,
        })
        .collect();
        be.restore_tuned_convolutions(&restored);
        counted_conv_parity(&be, &case(s), &IMPLICIT_KERNELS, 0, 710);
        return;
    }
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
pub(crate) const NARROW_KERNELS: [&str; 6] = [
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

// ---------------------------------------------------------------------------
// Depthwise convolution

/// Depthwise convolution against the CPU layer, f32 and f16, with and
/// without bias, multiplier 1 to 3, strides 1 and 2, padding 0 to 2:
/// gradients accumulate (+=) onto nonzero values. Both sides sum in one
/// fixed order with fused multiply-adds, so f32 gives the CPU's bits
/// everywhere; in f16 the weight and bias gradients too (f32 sums of the
/// same f16 values in the same order), the output and dx one f16 rounding
/// of the CPU's. The backward without dx accumulates the same bits.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn depthwise_convolution_matches_the_cpu_layer_bit_for_bit() {
    let be = gpu_or_skip!();
    // (x shape, multiplier, kernel, stride, padding, bias)
    let cases = [
        ([2, 7, 6, 5], 1, 3, 1, 1, false),
        ([3, 8, 9, 4], 2, 3, 2, 1, true),
        ([2, 6, 6, 3], 3, 5, 1, 2, true),
        ([2, 7, 5, 6], 1, 2, 2, 0, true),
        ([1, 4, 4, 2], 1, 3, 1, 0, false),
    ];
    for (i, (shape, m, k, stride, pad, bias)) in cases.into_iter().enumerate() {
        let seed = 1000 + 10 * i as u64;
        let c = shape[3];
        let cout = c * m;
        let mut rng = InitRng::new(seed);
        let mut layer = DepthwiseConv2d::new("dw", c, m, k, stride, pad, bias, &mut rng).unwrap();
        let weight = random_vec(k * k * cout, seed + 1, 0.4);
        let bias_v = random_vec(cout, seed + 2, 0.5);
        let (dw0, db0) = (
            random_vec(k * k * cout, seed + 3, 1.0),
            random_vec(cout, seed + 4, 1.0),
        );
        {
            let mut p = layer.params_mut();
            p[0].value.data_mut().copy_from_slice(&weight);
            p[0].grad.data_mut().copy_from_slice(&dw0);
            if bias {
                p[1].value.data_mut().copy_from_slice(&bias_v);
                p[1].grad.data_mut().copy_from_slice(&db0);
            }
        }
        let x = random(&shape, seed + 5, 1.0, 0.0);
        let y = layer.forward(&x, Mode::Train).unwrap();
        let g = random(y.shape(), seed + 6, 1.0, 0.0);
        let dx = layer.backward(&g).unwrap();
        let (dw, db) = {
            let p = layer.params_mut();
            (
                p[0].grad.data().to_vec(),
                p.get(1).map(|b| b.grad.data().to_vec()),
            )
        };
        let s = ops::DepthwiseShape {
            kernel: k,
            stride,
            pad,
            multiplier: m,
        };
        for dtype in [DType::F32, DType::F16] {
            let what =
                format!("depthwise {shape:?} x{m} k{k}/{stride} pad {pad} bias {bias} {dtype:?}");
            let (w16, b16) = (upload_f16(&be, &weight), upload_f16(&be, &bias_v));
            let (w32, b32) = (upload_f32(&be, &weight), upload_f32(&be, &bias_v));
            let (w, b) = match dtype {
                DType::F16 => (AnyView::F16(w16.as_view()), AnyView::F16(b16.as_view())),
                DType::F32 => (AnyView::F32(w32.as_view()), AnyView::F32(b32.as_view())),
            };
            let gx = CudaTensor::from_tensor(&be, &x, dtype).unwrap();
            let gg = CudaTensor::from_tensor(&be, &g, dtype).unwrap();
            let gy = ops::depthwise_forward(&be, &gx, &w, bias.then_some(&b), s).unwrap();
            assert_eq!(gy.shape(), y.shape(), "{what}");
            let mut dw_d = upload_f32(&be, &dw0);
            let mut db_d = upload_f32(&be, &db0);
            let gdx = {
                let mut db_view = db_d.as_view_mut();
                ops::depthwise_backward(
                    &be,
                    &gx,
                    &gg,
                    &w,
                    &mut dw_d.as_view_mut(),
                    bias.then_some(&mut db_view),
                    s,
                )
                .unwrap()
            };
            let rel = if dtype == DType::F32 { 0.0 } else { 1e-3 };
            let (gy, gdx) = (gy.to_host(&be).unwrap(), gdx.to_host(&be).unwrap());
            assert_close(&format!("{what} forward"), &gy, y.data(), rel, 1e-5);
            assert_close(&format!("{what} dx"), &gdx, dx.data(), rel, 1e-5);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            if dtype == DType::F32 {
                assert_eq!(bits(&gy), bits(y.data()), "{what}: forward bits");
                assert_eq!(bits(&gdx), bits(dx.data()), "{what}: dx bits");
            }
            assert_eq!(bits(&download(&be, &dw_d)), bits(&dw), "{what}: dW bits");
            if let Some(db) = &db {
                assert_eq!(bits(&download(&be, &db_d)), bits(db), "{what}: db bits");
            }
            // Without dx: the same accumulation.
            let mut dw_p = upload_f32(&be, &dw0);
            let mut db_p = upload_f32(&be, &db0);
            {
                let mut db_view = db_p.as_view_mut();
                ops::depthwise_backward_params(
                    &be,
                    &gx,
                    &gg,
                    &mut dw_p.as_view_mut(),
                    bias.then_some(&mut db_view),
                    s,
                )
                .unwrap();
            }
            assert_eq!(
                bits(&download(&be, &dw_p)),
                bits(&dw),
                "{what}: params-only dW"
            );
            if let Some(db) = &db {
                assert_eq!(
                    bits(&download(&be, &db_p)),
                    bits(db),
                    "{what}: params-only db"
                );
            }
        }
    }
    // Shapes are checked.
    let s = ops::DepthwiseShape {
        kernel: 5,
        stride: 1,
        pad: 0,
        multiplier: 1,
    };
    let w = upload_f16(&be, &random_vec(25 * 2, 1090, 1.0));
    let gx = upload(&be, &random(&[1, 4, 4, 2], 1091, 1.0, 0.0));
    let err = ops::depthwise_forward(&be, &gx, &AnyView::F16(w.as_view()), None, s).unwrap_err();
    assert!(err.to_string().contains("depthwise_conv"), "{err}");
    let s = ops::DepthwiseShape { pad: 2, ..s };
    let short = upload_f16(&be, &random_vec(24 * 2, 1092, 1.0));
    assert!(ops::depthwise_forward(&be, &gx, &AnyView::F16(short.as_view()), None, s).is_err());
}

/// Networks with depthwise convolutions (multiplier 2 and stride 2, then
/// stride 1; both with a bias), with and without checkpointing, f32 and f16: the CPU network's logits and
/// gradients (as the other network tests), checkpointing the same bits.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_depthwise_network_matches_the_cpu_network() {
    let be = gpu_or_skip!();
    let spec = r#"
[model]
input = [6, 6, 2]
mean = 0.5
std = 0.25
layers = [
  { type = "conv", out = 4 }, { type = "relu" },
  { type = "depthwise_conv", multiplier = 2, stride = 2, bias = true },
  { type = "relu" },
  { type = "depthwise_conv", bias = true },
  { type = "global_avg_pool" }, { type = "linear", out = 4 },
]
"#;
    small_network_matches_the_cpu(&be, "depthwise", spec, 1100);
}
