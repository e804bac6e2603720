use super::*;
use crate::gradcheck::check_layer;
use std::cell::Cell;

thread_local! {
    /// Makes this thread's convolutions take the im2col + gemm path
    /// (not the direct or the narrow kernels).
    pub(super) static FORCE_GEMM: Cell<bool> = const { Cell::new(false) };
    /// Overrides the process-wide algorithm on this thread only, so
    /// that tests running in parallel do not steer each other.
    pub(super) static FORCE_ALGORITHM: Cell<Option<ConvAlgorithm>> = const { Cell::new(None) };
}

/// Runs `f` once per implementation: Winograd (3×3 s1 p1 with channels
/// in 16s), direct kernels (where this CPU has them; the narrow ones
/// for fewer than 16 outputs) and im2col + gemm.
fn both_paths(f: impl Fn(&str)) {
    for (algorithm, gemm, name) in [
        (ConvAlgorithm::Winograd, false, "winograd"),
        (ConvAlgorithm::Winograd4, false, "winograd4"),
        (ConvAlgorithm::Direct, false, "direct"),
        (ConvAlgorithm::Direct, true, "gemm"),
    ] {
        FORCE_ALGORITHM.set(Some(algorithm));
        FORCE_GEMM.set(gemm);
        f(name);
    }
    FORCE_GEMM.set(false);
    FORCE_ALGORITHM.set(None);
}

/// (n, h, w, cin, cout, k, stride, pad, bias)
type Case = (usize, usize, usize, usize, usize, usize, usize, usize, bool);

const CASES: &[Case] = &[
    (2, 6, 6, 3, 4, 3, 1, 1, false), // 3x3 s1 p1
    (2, 7, 7, 3, 5, 3, 2, 1, false), // 3x3 s2 p1
    (2, 5, 5, 4, 6, 1, 1, 0, false), // 1x1 s1 p0 (no im2col)
    (2, 6, 6, 3, 4, 3, 1, 1, true),  // with bias
    (3, 5, 7, 2, 3, 3, 1, 1, true),  // odd, non-square input
    (2, 8, 8, 1, 4, 3, 1, 1, false), // cin = 1 (the stem)
    (2, 6, 5, 3, 2, 3, 1, 0, false), // valid (no padding)
    (2, 7, 6, 2, 3, 1, 2, 0, true),  // 1x1 stride 2 (general path)
    (2, 8, 8, 2, 3, 2, 2, 0, false), // even kernel
    (1, 6, 7, 2, 3, 5, 2, 2, false), // 5x5 s2 p2, odd output
    // Channel counts that are multiples of 16 take the direct kernels.
    (2, 6, 6, 16, 16, 3, 1, 1, false), // 3x3 s1 p1
    (2, 7, 7, 16, 32, 3, 2, 1, false), // 3x3 s2 p1
    (2, 5, 5, 16, 32, 1, 1, 0, false), // 1x1 s1 p0
    (2, 6, 6, 3, 16, 3, 1, 1, true),   // bias, direct forward only
    (3, 5, 7, 16, 16, 3, 1, 1, true),  // odd sizes
    (2, 8, 8, 1, 16, 3, 1, 1, false),  // cin = 1 (the stem)
    (2, 6, 5, 16, 16, 3, 1, 0, false), // valid: dX pads by 2
    (2, 7, 6, 16, 16, 1, 2, 0, true),  // 1x1 stride 2
    (1, 6, 7, 16, 16, 5, 2, 2, false), // 5x5 s2 p2
    (1, 7, 7, 16, 16, 5, 1, 1, false), // 5x5 s1 p1
    (2, 6, 6, 7, 16, 3, 1, 1, false),  // dW tiles of 4 + 3 channels
    (2, 5, 5, 8, 16, 3, 2, 1, true),   // dW tiles of 4 + 4 channels
    (1, 5, 6, 16, 16, 3, 1, 3, false), // padding 3: pixels no tap reaches
    // Fewer than 16 outputs: dX through the narrow kernels (but in the
    // gemm run).
    (2, 9, 8, 17, 1, 3, 1, 1, true), // a frame head: 16 lanes + a tail
    (1, 7, 6, 33, 3, 3, 2, 1, false), // 3 outputs, stride 2
    (1, 5, 5, 40, 2, 5, 1, 2, false), // 5x5: 5 runs of up to 200 floats
    // Rows wide enough for whole 16 × 16 tiles of the planar input.
    (1, 3, 37, 17, 1, 3, 1, 1, true), // 16 + 16 + 5 columns, 16 + 1 channels
    (1, 4, 41, 33, 3, 3, 2, 1, false), // both phases, 16 + 5 columns each
    // dX of whole channel blocks only, 4 + 3 pixels a row; a forward
    // run of 96 floats, whole blocks only.
    (1, 4, 7, 32, 2, 3, 1, 1, true),
];

fn random(rng: &mut InitRng, len: usize) -> Vec<f32> {
    (0..len).map(|_| rng.normal() as f32).collect()
}

fn layer(case: Case, seed: u64) -> Conv2d {
    let (_, _, _, cin, cout, k, s, p, bias) = case;
    let mut rng = InitRng::new(seed);
    let mut l = Conv2d::new("c", cin, cout, k, s, p, bias, &mut rng).unwrap();
    if let Some(b) = l.bias.as_mut() {
        let v = random(&mut rng, cout);
        b.value.data_mut().copy_from_slice(&v);
    }
    l
}

fn input(case: Case, seed: u64) -> Tensor {
    let (n, h, w, cin, ..) = case;
    let mut rng = InitRng::new(seed);
    Tensor::from_vec(&[n, h, w, cin], random(&mut rng, n * h * w * cin)).unwrap()
}

/// Direct convolution: the definition, index by index.
fn naive_forward(case: Case, x: &[f32], wt: &[f32], bias: Option<&[f32]>) -> Vec<f32> {
    let (n, h, w, cin, cout, k, s, p, _) = case;
    let oh = (h + 2 * p - k) / s + 1;
    let ow = (w + 2 * p - k) / s + 1;
    let mut y = vec![0.0f32; n * oh * ow * cout];
    for b in 0..n {
        for oy in 0..oh {
            for ox in 0..ow {
                for co in 0..cout {
                    let mut acc = bias.map_or(0.0, |bb| bb[co] as f64);
                    for ky in 0..k {
                        for kx in 0..k {
                            let iy = (oy * s + ky) as isize - p as isize;
                            let ix = (ox * s + kx) as isize - p as isize;
                            if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                continue;
                            }
                            let (iy, ix) = (iy as usize, ix as usize);
                            for ci in 0..cin {
                                acc += x[((b * h + iy) * w + ix) * cin + ci] as f64
                                    * wt[((ky * k + kx) * cin + ci) * cout + co] as f64;
                            }
                        }
                    }
                    y[((b * oh + oy) * ow + ox) * cout + co] = acc as f32;
                }
            }
        }
    }
    y
}

/// Direct backward: (dx, dw, db).
fn naive_backward(case: Case, x: &[f32], wt: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (n, h, w, cin, cout, k, s, p, _) = case;
    let oh = (h + 2 * p - k) / s + 1;
    let ow = (w + 2 * p - k) / s + 1;
    let mut dx = vec![0.0f64; x.len()];
    let mut dw = vec![0.0f64; wt.len()];
    let mut db = vec![0.0f64; cout];
    for b in 0..n {
        for oy in 0..oh {
            for ox in 0..ow {
                for co in 0..cout {
                    let g = dy[((b * oh + oy) * ow + ox) * cout + co] as f64;
                    db[co] += g;
                    for ky in 0..k {
                        for kx in 0..k {
                            let iy = (oy * s + ky) as isize - p as isize;
                            let ix = (ox * s + kx) as isize - p as isize;
                            if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                continue;
                            }
                            let (iy, ix) = (iy as usize, ix as usize);
                            for ci in 0..cin {
                                let xi = ((b * h + iy) * w + ix) * cin + ci;
                                let wi = ((ky * k + kx) * cin + ci) * cout + co;
                                dx[xi] += g * wt[wi] as f64;
                                dw[wi] += g * x[xi] as f64;
                            }
                        }
                    }
                }
            }
        }
    }
    let f = |v: Vec<f64>| v.into_iter().map(|a| a as f32).collect();
    (f(dx), f(dw), f(db))
}

/// Element by element within 1e-4 (1 + |want|); F(4×4, 3×3)'s error
/// grows with the terms summed rather than with each output (its
/// transforms scale by up to 8 and 1/24), so its outputs may also be
/// off by 1e-5 of the largest (it measures 1-6e-6 of it in
/// `winograd_error_is_close_to_direct`).
fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let largest = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let floor = if what.starts_with("winograd4") {
        1e-5 * largest
    } else {
        0.0
    };
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let tol = 1e-4 * (1.0 + b.abs()) + floor;
        assert!((a - b).abs() <= tol, "{what}[{i}]: got {a}, want {b}");
    }
}

/// Checks forward and the full backward against the direct definitions.
fn check_against_naive(case: Case, path: &str) {
    let mut l = layer(case, 1);
    let x = input(case, 2);
    let y = l.forward(&x, Mode::Train).unwrap();
    let wt = l.weight.value.data().to_vec();
    let bias = l.bias.as_ref().map(|b| b.value.data().to_vec());
    let want = naive_forward(case, x.data(), &wt, bias.as_deref());
    let (n, h, w, _, cout, k, s, p, _) = case;
    let oh = (h + 2 * p - k) / s + 1;
    let ow = (w + 2 * p - k) / s + 1;
    assert_eq!(y.shape(), &[n, oh, ow, cout]);
    assert_eq!(l.output_shape(&x.shape()[1..]).unwrap(), vec![oh, ow, cout]);
    assert_close(&format!("{path} {case:?} forward"), y.data(), &want);

    let mut rng = InitRng::new(3);
    let dy = Tensor::from_vec(y.shape(), random(&mut rng, y.len())).unwrap();
    let dx = l.backward(&dy).unwrap();
    let (want_dx, want_dw, want_db) = naive_backward(case, x.data(), &wt, dy.data());
    assert_eq!(dx.shape(), x.shape());
    assert_close(&format!("{path} {case:?} dx"), dx.data(), &want_dx);
    assert_close(
        &format!("{path} {case:?} dw"),
        l.weight.grad.data(),
        &want_dw,
    );
    if let Some(b) = l.bias.as_ref() {
        assert_close(&format!("{path} {case:?} db"), b.grad.data(), &want_db);
    }
}

#[test]
fn conv_matches_direct_convolution() {
    both_paths(|path| {
        for &case in CASES {
            check_against_naive(case, path);
        }
    });
}

#[test]
fn conv_matches_direct_convolution_across_blocks_and_groups() {
    both_paths(|path| {
        // More images than backward groups (so groups hold several
        // images), and more rows than one gemm block, with blocks
        // straddling images: kk = 9 gives 1024-row blocks over
        // 37·36 = 1332 rows ...
        check_against_naive((37, 6, 6, 1, 3, 3, 1, 1, true), path);
        // ... and kk = 576 gives 113-row blocks over 20·25 = 500 rows.
        check_against_naive((20, 5, 5, 64, 3, 3, 1, 1, false), path);
        check_against_naive((19, 7, 7, 64, 5, 3, 2, 1, false), path);
        // Pointwise, several blocks.
        check_against_naive((18, 9, 9, 8, 4, 1, 1, 0, true), path);
        // Direct kernels: several images per weight-gradient chunk
        // (small images) and one image per chunk (large ones).
        check_against_naive((37, 5, 5, 16, 32, 3, 1, 1, true), path);
        check_against_naive((17, 7, 7, 32, 16, 3, 2, 1, false), path);
        check_against_naive((3, 40, 36, 32, 16, 3, 1, 1, false), path);
        // Several passes over the rows (long reductions): 64 channels
        // in and out.
        check_against_naive((3, 6, 6, 64, 64, 3, 1, 1, true), path);
        check_against_naive((2, 7, 7, 64, 48, 3, 2, 1, false), path);
    });
}

#[test]
fn conv_gradients_match_finite_differences() {
    both_paths(|path| {
        // The loss is linear in the input and in each weight, so central
        // differences are exact at any step but for rounding. F(4×4,
        // 3×3) rounds its forward ~10× coarser than the others (see
        // `winograd_error_is_close_to_direct`), which at a step of 1e-2
        // put 1.5% of noise into a difference quotient: it takes 0.25.
        let eps = if path == "winograd4" { 0.25 } else { 1e-2 };
        for &case in CASES {
            let mut l = layer(case, 5);
            let x = input(case, 6);
            let report = check_layer(&mut l, &x, eps, 1e-2);
            assert!(report.is_ok(), "{path} {case:?}: {}", report.unwrap_err());
        }
        // Batch larger than the group count, blocks straddling images.
        for case in [
            (20, 5, 5, 64, 3, 3, 1, 1, true),
            (20, 5, 5, 16, 16, 3, 1, 1, true),
        ] {
            let report = check_layer(&mut layer(case, 7), &input(case, 8), eps, 1e-2);
            assert!(report.is_ok(), "{path} {case:?}: {}", report.unwrap_err());
        }
    });
}

/// max |got - want| / max |want|: the error on the scale of the values.
fn relative_error(got: &[f32], want: &[f32]) -> f64 {
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64));
    let err = got
        .iter()
        .zip(want)
        .fold(0.0f64, |m, (a, b)| m.max((a - b).abs() as f64));
    err / scale.max(f64::MIN_POSITIVE)
}

/// Winograd F(2×2, 3×3) on the reference ResNet's 3×3 s1 shapes against
/// the float64 definition, beside the direct kernels' own error: the
/// forward, dX and dW errors stay within WINOGRAD_TOLERANCE of the
/// largest value (measured ~1e-7 to 4e-7) and within 8× the direct
/// kernels' error.
#[test]
fn winograd_error_is_close_to_direct() {
    const WINOGRAD_TOLERANCE: f64 = 2e-6;
    const WINOGRAD4_TOLERANCE: f64 = 1e-5;
    for case in [
        (2, 28, 28, 32, 32, 3, 1, 1, false),
        (2, 14, 14, 64, 64, 3, 1, 1, true),
        (2, 7, 7, 128, 128, 3, 1, 1, false),
        // Two images a group, each a whole weight-gradient block: dU is
        // written by the first block and added to by the second.
        (16, 64, 64, 16, 16, 3, 1, 1, true),
    ] {
        let x = input(case, 2);
        let mut errors = Vec::new();
        for algorithm in [
            ConvAlgorithm::Winograd,
            ConvAlgorithm::Winograd4,
            ConvAlgorithm::Direct,
        ] {
            FORCE_ALGORITHM.set(Some(algorithm));
            let mut l = layer(case, 1);
            let wt = l.weight.value.data().to_vec();
            let bias = l.bias.as_ref().map(|b| b.value.data().to_vec());
            let y = l.forward(&x, Mode::Train).unwrap();
            let dy: Vec<f32> = y.data().iter().map(|v| (v * 0.37).sin()).collect();
            let dx = l
                .backward(&Tensor::from_vec(y.shape(), dy.clone()).unwrap())
                .unwrap();
            let want_y = naive_forward(case, x.data(), &wt, bias.as_deref());
            let (want_dx, want_dw, _) = naive_backward(case, x.data(), &wt, &dy);
            errors.push([
                relative_error(y.data(), &want_y),
                relative_error(dx.data(), &want_dx),
                relative_error(l.weight.grad.data(), &want_dw),
            ]);
        }
        FORCE_ALGORITHM.set(None);
        let (wino, wino4, direct) = (errors[0], errors[1], errors[2]);
        eprintln!(
            "{case:?}: (y, dx, dw) winograd {wino:?}, winograd4 {wino4:?}, direct {direct:?}"
        );
        for (i, what) in ["forward", "dx", "dw"].iter().enumerate() {
            assert!(
                wino[i] <= WINOGRAD_TOLERANCE && wino[i] <= 8.0 * direct[i] + 1e-7,
                "{case:?} {what}: winograd error {:.2e}, direct {:.2e}",
                wino[i],
                direct[i]
            );
            assert!(
                wino4[i] <= WINOGRAD4_TOLERANCE,
                "{case:?} {what}: winograd4 error {:.2e}, direct {:.2e}",
                wino4[i],
                direct[i]
            );
        }
    }
}

/// A scratch growth the OS refuses is an out-of-memory error (which the
/// run's policy handles), not an abort, and the buffer stays usable.
#[test]
fn scratch_the_os_refuses_is_an_error() {
    let err = with_scratch(usize::MAX / 8, |_| ()).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    assert_eq!(with_scratch(16, |buf| buf.len()).unwrap(), 16);
}

/// A kernel's error reaches the caller of `par_build`, whichever chunk
/// it came from; every other chunk written is dropped with the tensor.
#[test]
fn par_build_returns_a_chunks_error() {
    for failing in [0, 3, 7] {
        // SAFETY: every chunk that returns Ok is written whole.
        let built = unsafe {
            par_build(&[8, 5], 5, |i, chunk| {
                if i == failing {
                    return with_scratch(usize::MAX / 8, |_| ());
                }
                chunk.fill(MaybeUninit::new(i as f32));
                Ok(())
            })
        };
        assert!(built.unwrap_err().is_out_of_memory(), "chunk {failing}");
    }
    // SAFETY: as above.
    let built = unsafe {
        par_build(&[8, 5], 5, |i, chunk| {
            chunk.fill(MaybeUninit::new(i as f32));
            Ok(())
        })
    };
    assert_eq!(built.unwrap().data()[5 * 7], 7.0);
}

#[test]
fn conv_backward_without_forward_is_an_error() {
    let case = CASES[0];
    let mut l = layer(case, 1);
    let dy = Tensor::zeros(&[2, 6, 6, 4]);
    assert!(matches!(
        l.backward(&dy),
        Err(ModelError::NoSavedActivation { .. })
    ));
    // An eval forward saves nothing either.
    l.forward(&input(case, 2), Mode::Eval).unwrap();
    assert!(matches!(
        l.backward(&dy),
        Err(ModelError::NoSavedActivation { .. })
    ));
    // And backward consumes what a training forward saved.
    l.forward(&input(case, 2), Mode::Train).unwrap();
    l.backward(&dy).unwrap();
    assert!(l.backward(&dy).is_err());
}

#[test]
fn backward_params_only_adds_the_parameter_gradients_of_backward() {
    both_paths(|path| {
        for &case in CASES {
            let x = input(case, 2);
            let (mut full, mut params_only) = (layer(case, 1), layer(case, 1));
            let y = full.forward(&x, Mode::Train).unwrap();
            params_only.forward(&x, Mode::Train).unwrap();
            let mut rng = InitRng::new(9);
            let dy = Tensor::from_vec(y.shape(), random(&mut rng, y.len())).unwrap();
            full.backward(&dy).unwrap();
            params_only.backward_params_only(&dy).unwrap();
            for (a, b) in full.params_mut().into_iter().zip(params_only.params_mut()) {
                assert!(a.grad.data() == b.grad.data(), "{path} {case:?} {}", a.name);
            }
            // The saved input is used up, as by backward.
            assert!(params_only.backward_params_only(&dy).is_err());
        }
    });
}

#[test]
fn conv_gradients_accumulate() {
    both_paths(|path| {
        for case in [
            (3, 6, 6, 3, 4, 3, 2, 1, true),
            (20, 6, 6, 16, 16, 3, 1, 1, true),
        ] {
            let mut l = layer(case, 1);
            let x = input(case, 2);
            let y = l.forward(&x, Mode::Train).unwrap();
            let mut rng = InitRng::new(9);
            let dy = Tensor::from_vec(y.shape(), random(&mut rng, y.len())).unwrap();
            l.backward(&dy).unwrap();
            let once: Vec<Vec<f32>> = l
                .params_mut()
                .iter()
                .map(|p| p.grad.data().to_vec())
                .collect();
            assert!(once.iter().all(|g| g.iter().any(|&v| v != 0.0)));
            l.forward(&x, Mode::Train).unwrap();
            l.backward(&dy).unwrap();
            for (p, first) in l.params_mut().into_iter().zip(&once) {
                for (a, b) in p.grad.data().iter().zip(first) {
                    assert_eq!(*a, 2.0 * b, "{path} {case:?} {}", p.name);
                }
            }
        }
    });
}

#[test]
fn conv_results_do_not_depend_on_thread_count() {
    // 37 images: more than the backward groups, an uneven split.
    for case in [
        (37, 7, 7, 16, 32, 3, 1, 1, true),
        (37, 8, 8, 32, 16, 3, 2, 1, false),
        // Narrow: the column kernels at stride 1, the gather at 2.
        (37, 9, 8, 17, 1, 3, 1, 1, true),
        (37, 7, 7, 5, 3, 3, 2, 1, false),
    ] {
        let x = input(case, 2);
        for (force_gemm, algorithm) in [
            (false, ConvAlgorithm::Winograd),
            (false, ConvAlgorithm::Winograd4),
            (false, ConvAlgorithm::Direct),
            (true, ConvAlgorithm::Direct),
        ] {
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                pool.install(|| {
                    FORCE_GEMM.set(force_gemm);
                    FORCE_ALGORITHM.set(Some(algorithm));
                    let mut l = layer(case, 1);
                    let y = l.forward(&x, Mode::Train).unwrap();
                    let dy = y.data().iter().map(|v| v.sin()).collect();
                    let dy = Tensor::from_vec(y.shape(), dy).unwrap();
                    let dx = l.backward(&dy).unwrap();
                    let grads: Vec<Vec<f32>> = l
                        .params_mut()
                        .iter()
                        .map(|p| p.grad.data().to_vec())
                        .collect();
                    FORCE_GEMM.set(false);
                    FORCE_ALGORITHM.set(None);
                    (y.data().to_vec(), dx.data().to_vec(), grads)
                })
            };
            let one = run(1);
            for threads in [2, 3] {
                assert!(
                    one == run(threads),
                    "{case:?} gemm={force_gemm} {algorithm:?}: results differ \
                     between 1 and {threads} threads"
                );
            }
        }
    }
}

#[test]
fn conv_rejects_bad_shapes() {
    let mut rng = InitRng::new(1);
    let mut l = Conv2d::new("c", 3, 4, 3, 1, 0, false, &mut rng).unwrap();
    assert_eq!(l.params_mut()[0].name, "c.weight");
    assert_eq!(l.params_mut()[0].value.shape(), &[3, 3, 3, 4]);
    assert!(l.params_mut()[0].decay);
    assert_eq!(l.macs(&[5, 5, 3]).unwrap(), 3 * 3 * 4 * 27);
    // Wrong channel count, too small for the kernel, wrong rank.
    assert!(matches!(
        l.output_shape(&[5, 5, 2]),
        Err(ModelError::Shape { .. })
    ));
    assert!(matches!(
        l.output_shape(&[2, 5, 3]),
        Err(ModelError::Shape { .. })
    ));
    assert!(matches!(
        l.output_shape(&[5, 5]),
        Err(ModelError::Shape { .. })
    ));
    assert!(l
        .forward(&Tensor::zeros(&[1, 5, 5, 2]), Mode::Train)
        .is_err());
    assert!(l.forward(&Tensor::zeros(&[5, 5, 3]), Mode::Train).is_err());
    assert!(l
        .forward(&Tensor::zeros(&[1, 2, 2, 3]), Mode::Train)
        .is_err());
    // A gradient of the wrong shape is an error, not a panic.
    l.forward(&Tensor::zeros(&[1, 5, 5, 3]), Mode::Train)
        .unwrap();
    assert!(l.backward(&Tensor::zeros(&[1, 3, 3, 5])).is_err());
    // Zero-sized hyper-parameters are refused.
    assert!(Conv2d::new("c", 0, 4, 3, 1, 1, false, &mut rng).is_err());
    assert!(Conv2d::new("c", 3, 4, 3, 0, 1, false, &mut rng).is_err());
    // Bias: named, not decayed.
    let mut b = Conv2d::new("b", 3, 4, 3, 1, 1, true, &mut rng).unwrap();
    let params = b.params_mut();
    assert_eq!(params[1].name, "b.bias");
    assert!(!params[1].decay);
    assert_eq!(b.describe(), "conv3x3 3->4");
    assert_eq!(
        Conv2d::new("d", 32, 64, 3, 2, 1, false, &mut rng)
            .unwrap()
            .describe(),
        "conv3x3/2 32->64"
    );
}

#[test]
fn conv_tiles_split_rows_without_tiny_tails() {
    for mr in [direct::MR, direct::MR_WIDE] {
        for n in 0..300 {
            let split = direct::split_rows(n, mr);
            assert_eq!(split.iter().sum::<usize>(), n, "{n}: {split:?}");
            assert!(
                split.iter().all(|&t| (1..=mr).contains(&t)),
                "{n}: {split:?}"
            );
            if n >= mr / 2 {
                assert!(split.iter().all(|&t| t >= mr / 2), "{n}: {split:?}");
            }
        }
    }
    assert_eq!(direct::split_rows(32, direct::MR_WIDE), vec![12, 12, 8]);
    assert_eq!(direct::split_rows(32, direct::MR), vec![6, 6, 5, 5, 5, 5]);
}

#[test]
fn conv_empty_batch() {
    let mut l = layer(CASES[0], 1);
    let y = l
        .forward(&Tensor::zeros(&[0, 6, 6, 3]), Mode::Train)
        .unwrap();
    assert_eq!(y.shape(), &[0, 6, 6, 4]);
    let dx = l.backward(&y).unwrap();
    assert_eq!(dx.shape(), &[0, 6, 6, 3]);
}
