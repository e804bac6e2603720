//! Parity tests of layer normalisation (`src/ops/layer_norm`).

use super::*;

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
