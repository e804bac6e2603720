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
