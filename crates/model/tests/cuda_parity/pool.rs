//! Parity tests of pooling and the UNet pieces (`src/ops/pool`).

use super::*;

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
// Max pooling

/// Each output's argmax (ky·k + kx, the first largest in row-major window
/// order), computed here from the input.
fn first_argmax(x: &Tensor, k: usize, s: usize) -> Vec<u32> {
    let [n, h, w, c] = *x.shape() else {
        panic!("an image batch")
    };
    let (oh, ow) = ((h - k) / s + 1, (w - k) / s + 1);
    let mut out = Vec::new();
    for b in 0..n {
        for oy in 0..oh {
            for ox in 0..ow {
                for ch in 0..c {
                    let at = |ky: usize, kx: usize| {
                        x.data()[(((b * h) + oy * s + ky) * w + ox * s + kx) * c + ch]
                    };
                    let mut best = (at(0, 0), 0u32);
                    for ky in 0..k {
                        for kx in 0..k {
                            if at(ky, kx) > best.0 {
                                best = (at(ky, kx), (ky * k + kx) as u32);
                            }
                        }
                    }
                    out.push(best.1);
                }
            }
        }
    }
    out
}

/// Max pooling forward and backward, f32 and f16, over windows that tile,
/// overlap (stride < kernel) and skip (stride > kernel), on inputs with
/// many ties (values in steps of 0.5): the forward gives the CPU's values
/// exactly in both types (a selection), the argmax is the first largest in
/// row-major window order on both, and the backward gives the CPU's bits
/// in f32 (the same sums in the same order) and one f16 rounding of them.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn max_pooling_matches_the_cpu_layer_bit_for_bit() {
    let be = gpu_or_skip!();
    for (i, (shape, k, s)) in [
        ([3, 6, 8, 5], 2, 2),
        ([2, 7, 9, 3], 3, 2),
        ([2, 5, 6, 4], 2, 1),
        ([2, 6, 7, 2], 3, 1),
        ([1, 7, 7, 3], 2, 3),
    ]
    .into_iter()
    .enumerate()
    {
        let mut x = random(&shape, 900 + i as u64, 1.5, 0.0);
        for v in x.data_mut() {
            *v = (*v * 2.0).round() / 2.0;
        }
        let mut pool = MaxPool2d::new(k, s);
        let y = pool.forward(&x, Mode::Train).unwrap();
        let g = random(y.shape(), 910 + i as u64, 1.0, 0.0);
        let dx = pool.backward(&g).unwrap();
        let argmax = first_argmax(&x, k, s);
        for (dtype, rel) in [(DType::F32, 0.0), (DType::F16, 1e-3)] {
            let what = format!("max_pool {k}/{s} {shape:?} {dtype:?}");
            let gx = CudaTensor::from_tensor(&be, &x, dtype).unwrap();
            let (gy, kept) = ops::max_pool_forward(&be, &gx, k, s, true).unwrap();
            assert_eq!(gy.shape(), y.shape(), "{what}");
            let kept = kept.expect("a training forward keeps the argmax");
            assert_eq!(kept.argmax_to_host(&be).unwrap(), argmax, "{what}: argmax");
            let gy = gy.to_host(&be).unwrap();
            assert_close(&format!("{what} forward"), &gy, y.data(), 0.0, 0.0);
            let (eval, none) = ops::max_pool_forward(&be, &gx, k, s, false).unwrap();
            assert!(none.is_none(), "{what}: evaluation keeps nothing");
            assert_eq!(eval.to_host(&be).unwrap(), gy, "{what}: eval forward");
            let gg = CudaTensor::from_tensor(&be, &g, dtype).unwrap();
            let gdx = ops::max_pool_backward(&be, &gg, &kept).unwrap();
            assert_eq!(gdx.shape(), x.shape(), "{what}");
            let gdx = gdx.to_host(&be).unwrap();
            assert_close(&format!("{what} backward"), &gdx, dx.data(), rel, 0.0);
            if dtype == DType::F32 {
                let same = gdx
                    .iter()
                    .zip(dx.data())
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{what}: backward bits");
            }
        }
    }
    let gx = upload(&be, &random(&[1, 3, 4, 2], 920, 1.0, 0.0));
    let err = ops::max_pool_forward(&be, &gx, 4, 4, true).unwrap_err();
    assert!(err.to_string().contains("max_pool"), "{err}");
    let (_, kept) = ops::max_pool_forward(&be, &gx, 2, 2, true).unwrap();
    let wrong = upload(&be, &random(&[1, 2, 2, 2], 921, 1.0, 0.0));
    assert!(
        ops::max_pool_backward(&be, &wrong, &kept.unwrap()).is_err(),
        "shapes are checked"
    );
}

/// Networks with max pooling (tiling, then overlapping windows), with and
/// without checkpointing, f32 and f16: the CPU network's logits and
/// gradients (as the other network tests), checkpointing the same bits.
///
/// In f16 the pools see f16-rounded convolution outputs, the CPU f32 ones:
/// where two values of a window are within f16's rounding of each other
/// the two may pick different argmaxes, and the whole gradient of that
/// output goes elsewhere. The seeds are ones without such a near-tie: with
/// batches from seed 930 (gradient 940) the first convolution's weight
/// gradient was 9e-2 off in L2 on the emulator, every other gradient and
/// the f32 run within the usual bounds.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_max_pool_network_matches_the_cpu_network() {
    let be = gpu_or_skip!();
    let spec = r#"
[model]
input = [6, 6, 2]
mean = 0.5
std = 0.25
layers = [
  { type = "conv", out = 4 }, { type = "relu" },
  { type = "max_pool", kernel = 2 },
  { type = "conv", out = 5, bias = true },
  { type = "max_pool", kernel = 2, stride = 1 },
  { type = "flatten" }, { type = "linear", out = 4 },
]
"#;
    small_network_matches_the_cpu(&be, "max_pool", spec, 950);
}
