//! Parity tests of the optimizer step (`src/cuda/param_group.rs`, `src/cuda/optim.cu`).

use super::*;

// Optimizer

/// One parameter group on the host: weights, moments, weight decay.
struct HostGroup {
    p: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    decay: bool,
}

/// headroom-optim's `clip_grad_norm` + `AdamW::step` over the groups, on the
/// host, in the same f32/f64 arithmetic (this crate cannot depend on
/// headroom-optim, which depends on it). Returns the global norm.
fn reference_step(
    groups: &mut [HostGroup],
    grads: &[Vec<f32>],
    h: &AdamWConfig,
    lr: f32,
    t: u64,
    max_norm: f32,
) -> f64 {
    let norm = grads
        .iter()
        .flat_map(|g| g.iter())
        .map(|&v| (v as f64) * (v as f64))
        .sum::<f64>()
        .sqrt();
    let coef = if max_norm > 0.0 && norm > max_norm as f64 {
        (max_norm as f64 / (norm + 1e-6)) as f32
    } else {
        1.0
    };
    let tf = t as f64;
    let bc1 = 1.0 - (h.beta1 as f64).powf(tf);
    let bc2 = 1.0 - (h.beta2 as f64).powf(tf);
    let neg_step = (-(lr as f64) / bc1) as f32;
    let bc2_sqrt = bc2.sqrt() as f32;
    let decay_factor = (1.0 - lr as f64 * h.weight_decay as f64) as f32;
    for (group, g) in groups.iter_mut().zip(grads) {
        let decay = if group.decay { decay_factor } else { 1.0 };
        let HostGroup { p, m, v, .. } = group;
        for (((p, m), v), &g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
            let g = g * coef;
            *m += (1.0 - h.beta1) * (g - *m);
            *v = h.beta2 * *v + (1.0 - h.beta2) * g * g;
            let denom = v.sqrt() / bc2_sqrt + h.eps;
            *p = *p * decay + neg_step * (*m / denom);
        }
    }
    norm
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn fused_adamw_matches_the_reference_step_with_clipping_and_loss_scaling() {
    let be = gpu_or_skip!();
    // With an f16 compute copy (mixed precision: adamw_fused) and without
    // one (f32 training: adamw_fused_f32).
    for dtype in [DType::F16, DType::F32] {
        fused_adamw_case(&be, dtype);
    }
}

fn fused_adamw_case(be: &CudaBackend, dtype: DType) {
    let hyper = AdamWConfig {
        weight_decay: 0.05,
        ..AdamWConfig::default()
    };
    let lens = [(1000usize, true), (37, false)];
    let mut host: Vec<HostGroup> = lens
        .iter()
        .enumerate()
        .map(|(i, &(n, decay))| HostGroup {
            p: random_vec(n, 400 + i as u64, 0.5),
            m: vec![0.0; n],
            v: vec![0.0; n],
            decay,
        })
        .collect();
    let mut groups: Vec<ParamGroup> = host
        .iter()
        .map(|hg| ParamGroup::from_host(be, hg.decay, &hg.p, dtype).unwrap())
        .collect();
    assert_eq!(groups[0].compute.is_some(), dtype == DType::F16);
    let loss_scale = 1024.0f32;
    let mut opt = FusedAdamW::new(be, hyper.clone(), fixed_scaler(loss_scale), &groups).unwrap();
    for (step, (lr, max_norm)) in [(1e-2f32, 0.0f32), (5e-3, 1.0), (1e-3, 1e3)]
        .into_iter()
        .enumerate()
    {
        let t = step as u64 + 1;
        let grads: Vec<Vec<f32>> = lens
            .iter()
            .enumerate()
            .map(|(i, &(n, _))| random_vec(n, 500 + 10 * t + i as u64, 0.2))
            .collect();
        for (group, g) in groups.iter_mut().zip(&grads) {
            // Backward leaves the gradients multiplied by the loss scale (a
            // power of two: exact).
            let scaled: Vec<f32> = g.iter().map(|v| v * loss_scale).collect();
            be.compute_stream()
                .memcpy_htod(&scaled, &mut group.grad.slice)
                .unwrap();
        }
        let norm = reference_step(&mut host, &grads, &hyper, lr, t, max_norm);
        opt.step(be, &mut groups, t - 1, lr, max_norm, true)
            .unwrap();
        let state = opt.read_state(be).unwrap();
        assert_eq!((state.found_inf, state.skipped), (0, 0), "step {t}");
        assert_eq!(state.applied, t, "step {t}: t advances");
        assert_eq!(state.next_scale, loss_scale, "step {t}: no growth");
        assert!(
            (state.grad_norm as f64 - norm).abs() <= 1e-5 * norm,
            "step {t}: norm {} vs {norm}",
            state.grad_norm
        );
        if max_norm > 0.0 && norm > max_norm as f64 {
            assert!(state.clip_factor < 1.0, "step {t} clips");
        } else {
            assert_eq!(state.clip_factor, 1.0, "step {t} does not clip");
        }
        for (i, (group, hg)) in groups.iter().zip(&host).enumerate() {
            let what = format!("{dtype:?} step {t} group {i}");
            assert_close(
                &format!("{what} master"),
                &group.read_master(be).unwrap(),
                &hg.p,
                1e-5,
                1e-6,
            );
            let (gm, gv) = group.read_moments(be).unwrap();
            assert_close(&format!("{what} m"), &gm, &hg.m, 1e-4, 1e-6);
            assert_close(&format!("{what} v"), &gv, &hg.v, 1e-4, 1e-6);
            let master = group.read_master(be).unwrap();
            let compute = group.read_compute(be).unwrap();
            let copy_of = |w: f32| if dtype == DType::F16 { h(w) } else { w };
            assert!(
                compute.iter().zip(&master).all(|(&c, &w)| c == copy_of(w)),
                "{what}: the layers compute with the (rounded) master"
            );
            assert!(
                download(be, &group.grad.slice).iter().all(|&g| g == 0.0),
                "{what}: zero_grad"
            );
        }
    }
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn an_inf_or_nan_gradient_skips_the_step_and_backs_off_the_scale() {
    let be = gpu_or_skip!();
    let values = random_vec(300, 600, 1.0);
    let mut groups = vec![ParamGroup::from_host(&be, true, &values, DType::F16).unwrap()];
    let config = LossScalerConfig::default();
    let mut opt = FusedAdamW::new(&be, AdamWConfig::default(), config, &groups).unwrap();
    let mut scaler = LossScaler::new(config).unwrap();
    for bad in [f32::INFINITY, f32::NAN] {
        let mut grads = random_vec(300, 601, 1.0);
        grads[17] = bad;
        be.compute_stream()
            .memcpy_htod(&grads, &mut groups[0].grad.slice)
            .unwrap();
        opt.step(&be, &mut groups, 0, 1e-2, 1.0, true).unwrap();
        let state = opt.read_state(&be).unwrap();
        assert_eq!((state.found_inf, state.skipped), (1, 1), "{bad}");
        assert_eq!(scaler.update(true), StepOutcome::Skipped);
        assert_eq!(state.next_scale, scaler.scale(), "{bad}: backed off");
        assert_eq!(state.applied, 0, "{bad}: t does not advance");
        assert_eq!(
            groups[0].read_master(&be).unwrap(),
            values,
            "{bad}: weights untouched"
        );
        let (m, v) = groups[0].read_moments(&be).unwrap();
        assert!(
            m.iter().chain(&v).all(|&x| x == 0.0),
            "{bad}: moments untouched"
        );
        assert!(
            download(&be, &groups[0].grad.slice)
                .iter()
                .all(|&g| g == 0.0),
            "{bad}: gradients cleared"
        );
    }
    assert_eq!(scaler.scale(), 16_384.0, "halved twice");
    assert_eq!(download(&be, opt.loss_scale()), [16_384.0]);
}

/// The loss scaler on the device (in step_finalize) against the reference
/// `LossScaler`, over growth, back-off, the floor and the ceiling; the
/// gradients are scaled by the device's scale as backward would leave them,
/// so the norm also shows the kernel unscales by the scale it holds.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn the_device_loss_scaler_follows_the_reference_rule() {
    let be = gpu_or_skip!();
    let n = 64;
    let values = random_vec(n, 610, 1.0);
    let mut groups = vec![ParamGroup::from_host(&be, false, &values, DType::F16).unwrap()];
    let config = LossScalerConfig {
        init_scale: 4096.0,
        growth_interval: 3,
        min_scale: 1024.0,
        max_scale: 16_384.0,
        ..LossScalerConfig::default()
    };
    let mut opt = FusedAdamW::new(&be, AdamWConfig::default(), config, &groups).unwrap();
    let mut reference = LossScaler::new(config).unwrap();
    // Growth twice (to the ceiling), a third growth held at the ceiling,
    // back-off to the floor and past it, then growth again.
    let verdicts = "ccc ccc ccc i c i i i ccc c".replace(' ', "");
    for (step, verdict) in verdicts.chars().enumerate() {
        let overflow = verdict == 'i';
        let grads = random_vec(n, 620 + step as u64, 0.5);
        let scale = reference.scale();
        let mut scaled: Vec<f32> = grads.iter().map(|g| g * scale).collect();
        if overflow {
            scaled[5] = f32::INFINITY;
        }
        be.compute_stream()
            .memcpy_htod(&scaled, &mut groups[0].grad.slice)
            .unwrap();
        opt.step(&be, &mut groups, reference.applied_steps(), 1e-3, 0.0, true)
            .unwrap();
        let state = opt.read_state(&be).unwrap();
        reference.update(overflow);
        let what = format!("step {step} ({verdict})");
        assert_eq!(state.found_inf, overflow as u32, "{what}");
        assert_eq!(state.next_scale, reference.scale(), "{what}: scale");
        assert_eq!(
            state.clean_steps,
            reference.state().clean_steps,
            "{what}: clean steps"
        );
        assert_eq!(state.applied, reference.applied_steps(), "{what}: applied");
        assert_eq!(
            download(&be, opt.loss_scale()),
            [reference.scale()],
            "{what}"
        );
        if !overflow {
            let norm = grads
                .iter()
                .map(|&g| g as f64 * g as f64)
                .sum::<f64>()
                .sqrt();
            assert!(
                (state.grad_norm as f64 - norm).abs() <= 1e-5 * norm,
                "{what}: the norm of the unscaled gradients, {} vs {norm}",
                state.grad_norm
            );
        }
    }
    assert_eq!(
        reference.scale(),
        2048.0,
        "the sequence ends above the floor"
    );
}

/// A step queued while the verdict of the one before is unknown gets one
/// learning rate per count of applied steps it may find; the device picks
/// by the count it holds, and a schedule without that count skips the step
/// and says so.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn the_device_picks_the_learning_rate_of_the_t_it_finds() {
    let be = gpu_or_skip!();
    let n = 100;
    let hyper = AdamWConfig {
        weight_decay: 0.05,
        ..AdamWConfig::default()
    };
    let mut host = vec![HostGroup {
        p: random_vec(n, 630, 0.5),
        m: vec![0.0; n],
        v: vec![0.0; n],
        decay: true,
    }];
    let mut groups = vec![ParamGroup::from_host(&be, true, &host[0].p, DType::F16).unwrap()];
    let mut opt = FusedAdamW::new(&be, hyper.clone(), fixed_scaler(1.0), &groups).unwrap();
    let put = |groups: &mut Vec<ParamGroup>, seed: u64, overflow: bool| {
        let mut g = random_vec(n, seed, 0.2);
        let clean = g.clone();
        if overflow {
            g[0] = f32::NAN;
        }
        be.compute_stream()
            .memcpy_htod(&g, &mut groups[0].grad.slice)
            .unwrap();
        vec![clean]
    };
    // Step 1, applied (t = 1).
    let grads = put(&mut groups, 640, false);
    reference_step(&mut host, &grads, &hyper, 1e-2, 1, 0.0);
    opt.set_schedule(&be, 0, &[1e-2]).unwrap();
    opt.enqueue(&be, &mut groups, 0.0, true).unwrap();
    // Step 2, queued as if step 1's verdict were unknown: candidates for 0
    // and 1 applied steps; the device holds 1, so t = 2 at 5e-3.
    let grads = put(&mut groups, 641, false);
    reference_step(&mut host, &grads, &hyper, 5e-3, 2, 0.0);
    opt.set_schedule(&be, 0, &[7e-2, 5e-3]).unwrap();
    opt.enqueue(&be, &mut groups, 0.0, true).unwrap();
    // Step 3 overflows: skipped, t stays 2.
    put(&mut groups, 642, true);
    opt.set_schedule(&be, 1, &[9e-2, 8e-2]).unwrap();
    opt.enqueue(&be, &mut groups, 0.0, true).unwrap();
    // Step 4: candidates from 1; the device holds 2 applied steps: t = 3.
    let grads = put(&mut groups, 643, false);
    reference_step(&mut host, &grads, &hyper, 2e-3, 3, 0.0);
    opt.set_schedule(&be, 1, &[6e-2, 2e-3, 4e-2]).unwrap();
    opt.enqueue(&be, &mut groups, 0.0, true).unwrap();
    let state = opt.read_state(&be).unwrap();
    assert_eq!((state.skipped, state.applied), (0, 3));
    assert_close(
        "weights after picked rates",
        &groups[0].read_master(&be).unwrap(),
        &host[0].p,
        1e-5,
        1e-6,
    );
    // A schedule that has no rate for 3 applied steps: skipped, nothing
    // changes, the scaler included.
    let before = groups[0].read_master(&be).unwrap();
    put(&mut groups, 644, false);
    opt.set_schedule(&be, 5, &[1e-2]).unwrap();
    opt.enqueue(&be, &mut groups, 0.0, true).unwrap();
    let state = opt.read_state(&be).unwrap();
    assert_eq!(
        (state.schedule_missed, state.skipped, state.found_inf),
        (1, 1, 0)
    );
    assert_eq!((state.applied, state.next_scale), (3, 1.0));
    assert_eq!(groups[0].read_master(&be).unwrap(), before);
    assert!(
        opt.set_schedule(&be, 0, &[1e-3; 5]).is_err(),
        "at most 4 candidates"
    );
}

/// Everything a step may change in the groups, as bits: each group's
/// masters, moments and compute copy (f16 values widened exactly).
fn group_bits(be: &CudaBackend, groups: &[ParamGroup]) -> Vec<Vec<u32>> {
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<u32>>();
    groups
        .iter()
        .flat_map(|g| {
            let (m, v) = g.read_moments(be).unwrap();
            [
                bits(g.read_master(be).unwrap()),
                bits(m),
                bits(v),
                bits(g.read_compute(be).unwrap()),
            ]
        })
        .collect()
}

/// Finite gradients and a finite learning rate whose update would still
/// overflow (the CPU's `AdamW::step_if_finite` refuses it): `adamw_check`
/// finds it, `step_commit` skips the step without backing off the scale,
/// and `adamw_fused` changes nothing. A second optimizer that never saw the
/// refused steps then takes the same ordinary step to the same bits: t, the
/// scaler and every weight are as if the refused steps had not been made.
/// In mixed precision an update to a finite master that rounds to an
/// infinite f16 compute copy is refused too; in f32 training it applies.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn an_update_that_would_overflow_is_refused_and_the_scale_kept() {
    let be = gpu_or_skip!();
    for dtype in [DType::F16, DType::F32] {
        overflowing_update_case(&be, dtype);
    }
}

fn overflowing_update_case(be: &CudaBackend, dtype: DType) {
    let hyper = AdamWConfig {
        weight_decay: 0.05,
        ..AdamWConfig::default()
    };
    // Growth after 2 clean steps: after one clean step, an applied step
    // would double the scale and an overflowing gradient would halve it.
    let scaler = LossScalerConfig {
        init_scale: 1024.0,
        growth_interval: 2,
        ..LossScalerConfig::default()
    };
    let lens = [(300usize, true), (37, false)];
    let make = || {
        let groups: Vec<ParamGroup> = lens
            .iter()
            .enumerate()
            .map(|(i, &(n, decay))| {
                let values = random_vec(n, 700 + i as u64, 0.5);
                ParamGroup::from_host(be, decay, &values, dtype).unwrap()
            })
            .collect();
        let opt = FusedAdamW::new(be, hyper.clone(), scaler, &groups).unwrap();
        (groups, opt)
    };
    let grads = |seed: u64| -> Vec<Vec<f32>> {
        lens.iter()
            .enumerate()
            .map(|(i, &(n, _))| random_vec(n, seed + i as u64, 0.2))
            .collect()
    };
    let put = |groups: &mut [ParamGroup], grads: &[Vec<f32>], scale: f32| {
        for (group, g) in groups.iter_mut().zip(grads) {
            let scaled: Vec<f32> = g.iter().map(|v| v * scale).collect();
            be.compute_stream()
                .memcpy_htod(&scaled, &mut group.grad.slice)
                .unwrap();
        }
    };
    let (mut a_groups, mut a) = make();
    let (mut b_groups, mut b) = make();
    let first = grads(710);
    for (groups, opt) in [(&mut a_groups, &mut a), (&mut b_groups, &mut b)] {
        put(groups, &first, 1024.0);
        opt.step(be, groups, 0, 1e-2, 0.0, true).unwrap();
        let state = opt.read_state(be).unwrap();
        assert_eq!(
            (state.skipped, state.applied, state.clean_steps),
            (0, 1, 1),
            "{dtype:?}: the first step applies"
        );
    }

    // The step size lr / (1 - β1) of a learning rate of 1e38 is beyond
    // f32; a gradient of 1e21 (finite, and so is the norm) has a square
    // beyond it.
    let mut huge = grads(720);
    huge[1][5] = 1e21;
    let refused = [
        ("a learning rate of 1e38", 1e38f32, grads(720)),
        ("a gradient whose square overflows", 1e-2, huge),
    ];
    for (what, lr, g) in refused {
        let what = format!("{dtype:?}, {what}");
        let before = group_bits(be, &a_groups);
        put(&mut a_groups, &g, 1024.0);
        a.step(be, &mut a_groups, 1, lr, 0.0, true).unwrap();
        let state = a.read_state(be).unwrap();
        assert_eq!(
            (state.update_overflow, state.skipped, state.found_inf),
            (1, 1, 0),
            "{what}: refused, and not for an overflowing gradient"
        );
        assert_eq!(state.applied, 1, "{what}: t does not advance");
        assert_eq!(
            (state.next_scale, state.clean_steps),
            (1024.0, 1),
            "{what}: the scaler is as before the step"
        );
        assert_eq!(download(be, a.loss_scale()), [1024.0], "{what}");
        assert!(
            group_bits(be, &a_groups) == before,
            "{what}: masters, moments and compute copies unchanged, bit for bit"
        );
        for group in &a_groups {
            assert!(
                download(be, &group.grad.slice).iter().all(|&g| g == 0.0),
                "{what}: gradients cleared"
            );
        }
    }

    // The same ordinary step on both: the same bits, the same verdict.
    let next = grads(730);
    for (groups, opt) in [(&mut a_groups, &mut a), (&mut b_groups, &mut b)] {
        put(groups, &next, 1024.0);
        opt.step(be, groups, 1, 5e-3, 0.0, true).unwrap();
    }
    let (sa, sb) = (a.read_state(be).unwrap(), b.read_state(be).unwrap());
    assert_eq!(sa, sb, "{dtype:?}: the same verdict and scaler");
    assert_eq!(
        (sa.skipped, sa.update_overflow, sa.applied, sa.next_scale),
        (0, 0, 2, 2048.0),
        "{dtype:?}: applied, t = 2, the scale grows"
    );
    assert!(
        group_bits(be, &a_groups) == group_bits(be, &b_groups),
        "{dtype:?}: the refused steps left no trace"
    );

    // A learning rate of 1e5 takes weights past 65504 (the largest f16):
    // finite in f32, infinite in an f16 compute copy.
    let before = group_bits(be, &a_groups);
    put(&mut a_groups, &grads(740), 2048.0);
    a.step(be, &mut a_groups, 2, 1e5, 0.0, true).unwrap();
    let state = a.read_state(be).unwrap();
    let masters: Vec<f32> = a_groups
        .iter()
        .flat_map(|g| g.read_master(be).unwrap())
        .collect();
    if dtype == DType::F16 {
        assert_eq!(
            (state.update_overflow, state.skipped, state.applied),
            (1, 1, 2),
            "F16: an f16 copy that would be inf refuses the step"
        );
        assert!(group_bits(be, &a_groups) == before, "F16: unchanged");
    } else {
        assert_eq!(
            (state.update_overflow, state.skipped, state.applied),
            (0, 0, 3),
            "F32: applied"
        );
        assert!(
            masters.iter().all(|w| w.is_finite()) && masters.iter().any(|w| w.abs() > 65_504.0),
            "F32: finite weights beyond the f16 range"
        );
    }
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn running_statistics_are_put_back_only_after_a_skipped_step() {
    let be = gpu_or_skip!();
    let c = 300;
    let saved = (random_vec(c, 650, 1.0), random_vec(c, 651, 1.0));
    let live = (random_vec(c, 652, 1.0), random_vec(c, 653, 1.0));
    let saved_d = (upload_f32(&be, &saved.0), upload_f32(&be, &saved.1));
    for skipped in [0u32, 1] {
        let verdict = be
            .compute_stream()
            .clone_htod(&[StepState {
                skipped,
                ..StepState::default()
            }])
            .unwrap();
        let mut mean = upload_f32(&be, &live.0);
        let mut var = upload_f32(&be, &live.1);
        ops::batch_norm_restore_if_skipped(
            &be,
            &verdict,
            (&saved_d.0, &saved_d.1),
            &mut mean,
            &mut var,
        )
        .unwrap();
        let expected = if skipped == 1 { &saved } else { &live };
        assert_eq!(download(&be, &mean), expected.0, "skipped = {skipped}");
        assert_eq!(download(&be, &var), expected.1, "skipped = {skipped}");
    }
    let short = upload_f32(&be, &saved.0[..c - 1]);
    let verdict = be
        .compute_stream()
        .clone_htod(&[StepState::default()])
        .unwrap();
    let (mut mean, mut var) = (upload_f32(&be, &live.0), upload_f32(&be, &live.1));
    assert!(
        ops::batch_norm_restore_if_skipped(
            &be,
            &verdict,
            (&short, &saved_d.1),
            &mut mean,
            &mut var
        )
        .is_err(),
        "lengths are checked"
    );
}
