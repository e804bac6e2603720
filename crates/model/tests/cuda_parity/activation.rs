//! Parity tests of the elementwise layers (`src/ops/activation`).

use super::*;

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
