//! Parity tests of batch normalisation and the fused residual tail (`src/ops/batch_norm`).

use super::*;

// Batch normalisation

pub(crate) struct BnCase {
    pub(crate) cpu: BatchNorm2d,
    pub(crate) gamma: Vec<f32>,
    pub(crate) beta: Vec<f32>,
}

pub(crate) fn bn_case(c: usize, seed: u64) -> BnCase {
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

pub(crate) const BN: BatchNormConfig = BatchNormConfig {
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
