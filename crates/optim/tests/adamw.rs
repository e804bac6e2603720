//! AdamW against hand-computed values, against an independent f64
//! transcription of PyTorch's `_single_tensor_adamw`, and the state and
//! error contracts.

use headroom_model::{Param, Tensor};
use headroom_optim::{AdamW, AdamWConfig, AdamWState, OptimError, UpdateOutcome};

fn param(name: &str, shape: &[usize], values: &[f32], decay: bool) -> Param {
    Param::new(
        name,
        Tensor::from_vec(shape, values.to_vec()).unwrap(),
        decay,
    )
}

fn vector(name: &str, values: &[f32], decay: bool) -> Param {
    param(name, &[values.len()], values, decay)
}

fn set_grad(p: &mut Param, g: &[f32]) {
    p.grad.data_mut().copy_from_slice(g);
}

fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(
            err <= tol * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w} (error {err:e})"
        );
    }
}

/// A deterministic pseudo-random stream in [-1, 1) (no rand dependency).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
}

/// β1 = 0.5, β2 = 0.75, ε = 1e-8, wd = 0.1, lr = 0.1: round numbers by hand.
/// Two parameters with the same values and gradients, one decayed, one not.
///
/// grads: g1 = [0.5, -1], g2 = [-0.25, 2], g3 = [1, 0]
///
/// step 1: m = 0.5·g1 = [0.25, -0.5]; v = 0.25·g1² = [0.0625, 0.25];
///   bc1 = 0.5, bc2 = 0.25 → m̂ = [0.5, -1], √v̂ = [0.5, 1] → update lr·m̂/√v̂ = [0.1, -0.1]
///   (less ε: 0.1·0.5/(0.5+1e-8) = 0.1 − 2e-9).
///   decayed:   p = [1, -2]·(1 − 0.01) − [0.1, -0.1] = [0.89, -1.88]
///   undecayed: p = [1, -2] − [0.1, -0.1]            = [0.9, -1.9]
/// step 2: m = 0.5·m + 0.5·g2 = [0, 0.75]; v = 0.75·v + 0.25·g2² = [0.0625, 1.1875];
///   bc1 = 0.75, bc2 = 0.4375 → update = [0, 0.1·1/√(1.1875/0.4375)] = [0, 0.0606976985]
///   decayed:   p = [0.89·0.99, -1.88·0.99 − 0.0606976985] = [0.8811, -1.9218976985]
///   undecayed: p = [0.9, -1.9 − 0.0606976985]            = [0.9, -1.9606976985]
/// step 3: m = [0.5, 0.375]; v = [0.296875, 0.890625]; bc1 = 0.875, bc2 = 0.578125
///   update = 0.1/0.875 · m / √(v/0.578125) = [0.0797427949, 0.0345282107]
///   decayed:   p = [0.8811·0.99, -1.9218976985·0.99] − update = [0.7925472071, -1.9372079318]
///   undecayed: p = [0.9, -1.9606976985] − update             = [0.8202582071, -1.9952269088]
#[test]
fn hand_computed_three_steps_with_and_without_decay() {
    let mut opt = AdamW::new(AdamWConfig {
        beta1: 0.5,
        beta2: 0.75,
        eps: 1e-8,
        weight_decay: 0.1,
    })
    .unwrap();
    let mut w = vector("w", &[1.0, -2.0], true);
    let mut b = vector("b", &[1.0, -2.0], false);
    let grads = [[0.5, -1.0], [-0.25, 2.0], [1.0, 0.0]];
    let want_w = [
        [0.890000002, -1.880000001],
        [0.88110000198, -1.9218976984882674],
        [0.7925472070816264, -1.9372079317611441],
    ];
    let want_b = [
        [0.900000002, -1.900000001],
        [0.900000002, -1.9606976984982674],
        [0.8202582071214264, -1.9952269087560268],
    ];
    for step in 0..3 {
        set_grad(&mut w, &grads[step]);
        set_grad(&mut b, &grads[step]);
        opt.step(&mut [&mut w, &mut b], 0.1).unwrap();
        assert_eq!(opt.steps_taken(), step as u64 + 1);
        assert_close(
            w.value.data(),
            &want_w[step],
            1e-6,
            &format!("w after step {}", step + 1),
        );
        assert_close(
            b.value.data(),
            &want_b[step],
            1e-6,
            &format!("b after step {}", step + 1),
        );
    }
    // The moments do not depend on decay: both parameters hold the same ones.
    let state = opt.state().unwrap();
    assert_eq!(state.step, 3);
    for i in 0..2 {
        assert_close(&state.first_moment[i], &[0.5, 0.375], 1e-7, "m");
        assert_close(&state.second_moment[i], &[0.296875, 0.890625], 1e-7, "v");
    }
}

/// Adam's first update is lr·sign(g) whatever |g| (bias correction at work).
#[test]
fn first_step_moves_every_weight_by_lr() {
    let mut opt = AdamW::new(AdamWConfig::default()).unwrap();
    let mut p = vector("p", &[0.0; 5], true);
    set_grad(&mut p, &[1e-3, -5.0, 300.0, -0.02, 1.0]);
    opt.step(&mut [&mut p], 0.01).unwrap();
    assert_close(
        p.value.data(),
        &[-0.01, 0.01, -0.01, 0.01, -0.01],
        1e-6,
        "p",
    );
}

#[test]
fn decay_false_params_get_no_weight_decay() {
    let mut rng = Lcg(7);
    let init = rng.vec(19, 1.0);
    let grads: Vec<Vec<f32>> = (0..6).map(|_| rng.vec(19, 0.5)).collect();
    let run = |weight_decay: f32, decay: bool| {
        let mut opt = AdamW::new(AdamWConfig {
            weight_decay,
            ..AdamWConfig::default()
        })
        .unwrap();
        let mut p = vector("p", &init, decay);
        for g in &grads {
            set_grad(&mut p, g);
            opt.step(&mut [&mut p], 0.05).unwrap();
        }
        p.value.data().to_vec()
    };
    let no_decay = run(0.0, true);
    // A decay = false parameter under a large weight decay: bit for bit the
    // same as no weight decay at all.
    assert_eq!(run(0.5, false), no_decay);
    // ... while a decay = true parameter does change (and shrinks).
    let decayed = run(0.5, true);
    assert_ne!(decayed, no_decay);
    let norm = |x: &[f32]| x.iter().map(|v| v * v).sum::<f32>();
    assert!(norm(&decayed) < norm(&no_decay));
}

/// PyTorch's `torch.optim.adamw._single_tensor_adamw` (amsgrad=False,
/// maximize=False), transcribed in f64:
///
/// ```python
/// param.mul_(1 - lr * weight_decay)
/// exp_avg.lerp_(grad, 1 - beta1)
/// exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
/// bias_correction1 = 1 - beta1 ** step
/// bias_correction2 = 1 - beta2 ** step
/// step_size = lr / bias_correction1
/// bias_correction2_sqrt = bias_correction2 ** 0.5
/// denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
/// param.addcdiv_(exp_avg, denom, value=-step_size)
/// ```
struct TorchAdamW {
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    step: i32,
    exp_avg: Vec<Vec<f64>>,
    exp_avg_sq: Vec<Vec<f64>>,
}

impl TorchAdamW {
    fn step(&mut self, params: &mut [(Vec<f64>, bool)], grads: &[Vec<f32>], lr: f64) {
        self.step += 1;
        for (i, ((param, decay), grad)) in params.iter_mut().zip(grads).enumerate() {
            // Parameter groups: weight_decay = 0 for the no-decay group.
            let wd = if *decay { self.weight_decay } else { 0.0 };
            let bias_correction1 = 1.0 - self.beta1.powi(self.step);
            let bias_correction2 = 1.0 - self.beta2.powi(self.step);
            let step_size = lr / bias_correction1;
            for j in 0..param.len() {
                let g = grad[j] as f64;
                param[j] *= 1.0 - lr * wd;
                self.exp_avg[i][j] += (1.0 - self.beta1) * (g - self.exp_avg[i][j]);
                self.exp_avg_sq[i][j] =
                    self.beta2 * self.exp_avg_sq[i][j] + (1.0 - self.beta2) * g * g;
                let denom = self.exp_avg_sq[i][j].sqrt() / bias_correction2.sqrt() + self.eps;
                param[j] -= step_size * self.exp_avg[i][j] / denom;
            }
        }
    }
}

#[test]
fn matches_pytorch_reference_over_many_steps() {
    // PyTorch's defaults plus weight decay; the f32 betas are widened exactly
    // so both sides use the same numbers.
    let config = AdamWConfig {
        weight_decay: 0.05,
        ..AdamWConfig::default()
    };
    let mut opt = AdamW::new(config.clone()).unwrap();
    let mut rng = Lcg(42);
    // A conv-like weight (tail of a vector lane), a bias, a norm scale.
    let shapes: [(&str, Vec<usize>, bool); 3] = [
        ("conv.weight", vec![3, 3, 2, 5], true),
        ("conv.bias", vec![5], false),
        ("bn.gamma", vec![37], false),
    ];
    let mut params: Vec<Param> = shapes
        .iter()
        .map(|(name, shape, decay)| {
            let n = shape.iter().product();
            param(name, shape, &rng.vec(n, 1.0), *decay)
        })
        .collect();
    let mut reference: Vec<(Vec<f64>, bool)> = params
        .iter()
        .map(|p| (p.value.data().iter().map(|&x| x as f64).collect(), p.decay))
        .collect();
    let mut torch = TorchAdamW {
        beta1: config.beta1 as f64,
        beta2: config.beta2 as f64,
        eps: config.eps as f64,
        weight_decay: config.weight_decay as f64,
        step: 0,
        exp_avg: reference.iter().map(|(p, _)| vec![0.0; p.len()]).collect(),
        exp_avg_sq: reference.iter().map(|(p, _)| vec![0.0; p.len()]).collect(),
    };
    for step in 0..60 {
        // A changing lr, as under a schedule; gradients of varied scale.
        let lr = 1e-2 * (1.0 + (step as f32 * 0.3).sin()) / 2.0;
        let scale = [1e-4, 1.0, 30.0][step % 3];
        let grads: Vec<Vec<f32>> = params
            .iter()
            .map(|p| rng.vec(p.value.len(), scale))
            .collect();
        for (p, g) in params.iter_mut().zip(&grads) {
            set_grad(p, g);
        }
        let mut refs: Vec<&mut Param> = params.iter_mut().collect();
        opt.step(&mut refs, lr).unwrap();
        torch.step(&mut reference, &grads, lr as f64);
        for (p, (r, _)) in params.iter().zip(&reference) {
            assert_close(
                p.value.data(),
                r,
                2e-6,
                &format!("{} at step {step}", p.name),
            );
        }
    }
    // The decayed parameter really was decayed relative to a no-decay run.
    assert!(params[0].decay && !params[1].decay);
}

fn toy_net(values: &mut Lcg) -> Vec<Param> {
    vec![
        param("conv.weight", &[2, 3], &values.vec(6, 1.0), true),
        param("conv.bias", &[3], &values.vec(3, 1.0), false),
    ]
}

fn apply_grads(net: &mut [Param], rng: &mut Lcg) {
    for p in net {
        let g = rng.vec(p.value.len(), 1.0);
        set_grad(p, &g);
    }
}

#[test]
fn state_round_trip_continues_identically() {
    let config = AdamWConfig {
        weight_decay: 0.01,
        ..AdamWConfig::default()
    };
    let mut init = Lcg(1);
    let mut net = toy_net(&mut init);
    let mut grads = Lcg(2);
    let mut opt = AdamW::new(config.clone()).unwrap();
    for _ in 0..5 {
        apply_grads(&mut net, &mut grads);
        opt.step(&mut net.iter_mut().collect::<Vec<_>>(), 1e-2)
            .unwrap();
    }

    // "Checkpoint": the parameters and the state, through a serde format.
    let saved = serde_json::to_string(&opt.state().unwrap()).unwrap();
    let mut resumed_net = net.clone();
    let mut resumed = AdamW::new(config).unwrap();
    resumed
        .load_state(serde_json::from_str::<AdamWState>(&saved).unwrap())
        .unwrap();
    assert_eq!(resumed.steps_taken(), 5);
    assert_eq!(resumed.state().unwrap(), opt.state().unwrap());

    let mut resumed_grads = Lcg(grads.0);
    for _ in 0..5 {
        apply_grads(&mut net, &mut grads);
        opt.step(&mut net.iter_mut().collect::<Vec<_>>(), 1e-2)
            .unwrap();
        apply_grads(&mut resumed_net, &mut resumed_grads);
        resumed
            .step(&mut resumed_net.iter_mut().collect::<Vec<_>>(), 1e-2)
            .unwrap();
    }
    for (a, b) in net.iter().zip(&resumed_net) {
        assert_eq!(a.value.data(), b.value.data(), "{}", a.name);
    }
    assert_eq!(opt.state().unwrap(), resumed.state().unwrap());
    assert_eq!(resumed.steps_taken(), 10);
}

#[test]
fn fresh_state_round_trips_to_a_fresh_optimizer() {
    let opt = AdamW::new(AdamWConfig::default()).unwrap();
    let state = opt.state().unwrap();
    assert_eq!(state, AdamWState::default());
    let mut other = AdamW::new(AdamWConfig::default()).unwrap();
    other.load_state(state).unwrap();
    // Moments are created lazily, for whatever the first step brings.
    let mut p = vector("p", &[1.0, 2.0, 3.0], true);
    set_grad(&mut p, &[1.0, 1.0, 1.0]);
    other.step(&mut [&mut p], 0.1).unwrap();
    assert_eq!(other.state().unwrap().first_moment.len(), 1);
    assert_eq!(other.state().unwrap().first_moment[0].len(), 3);
}

#[test]
fn step_with_changed_params_fails_naming_them_and_changes_nothing() {
    let mut opt = AdamW::new(AdamWConfig::default()).unwrap();
    let mut a = param("fc.weight", &[2, 3], &[1.0; 6], true);
    let mut b = vector("fc.bias", &[0.0; 3], false);
    set_grad(&mut a, &[1.0; 6]);
    set_grad(&mut b, &[1.0; 3]);
    opt.step(&mut [&mut a, &mut b], 0.1).unwrap();
    let state = opt.state().unwrap();

    // Same element count, different shape.
    let mut transposed = param("fc.weight", &[3, 2], &[1.0; 6], true);
    let err = opt.step(&mut [&mut transposed, &mut b], 0.1).unwrap_err();
    assert!(
        matches!(err, OptimError::ParamShape { index: 0, .. }),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("parameter 0") && msg.contains("fc.weight"),
        "{msg}"
    );
    assert!(msg.contains("[2, 3]") && msg.contains("[3, 2]"), "{msg}");

    // Different element count in the second parameter.
    let mut wider = vector("fc.bias", &[0.0; 4], false);
    let msg = opt
        .step(&mut [&mut a, &mut wider], 0.1)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("parameter 1") && msg.contains("fc.bias"),
        "{msg}"
    );

    // A parameter fewer.
    let err = opt.step(&mut [&mut a], 0.1).unwrap_err();
    assert_eq!(
        err,
        OptimError::ParamCount {
            expected: 2,
            got: 1
        }
    );

    // Nothing moved: neither the optimizer nor the good parameter.
    assert_eq!(opt.state().unwrap(), state);
    assert_eq!(opt.steps_taken(), 1);
    let before = a.value.data().to_vec();
    let _ = opt.step(&mut [&mut a, &mut wider], 0.1);
    assert_eq!(a.value.data(), before.as_slice());
    // And the right parameters still step.
    opt.step(&mut [&mut a, &mut b], 0.1).unwrap();
    assert_eq!(opt.steps_taken(), 2);
}

#[test]
fn gradient_shape_mismatch_is_an_error() {
    let mut opt = AdamW::new(AdamWConfig::default()).unwrap();
    let mut p = vector("head.weight", &[1.0; 4], true);
    p.grad = Tensor::zeros(&[3]);
    let msg = opt.step(&mut [&mut p], 0.1).unwrap_err().to_string();
    assert!(
        msg.contains("head.weight") && msg.contains("gradient"),
        "{msg}"
    );
    assert_eq!(opt.steps_taken(), 0);
}

#[test]
fn loaded_state_is_checked_against_the_params_on_the_next_step() {
    let mut opt = AdamW::new(AdamWConfig::default()).unwrap();
    opt.load_state(AdamWState {
        step: 3,
        first_moment: vec![vec![0.0; 6], vec![0.0; 3]],
        second_moment: vec![vec![0.0; 6], vec![0.0; 3]],
    })
    .unwrap();
    let mut a = param("fc.weight", &[2, 3], &[1.0; 6], true);
    let mut b = vector("fc.bias", &[0.0; 4], false);
    let err = opt.step(&mut [&mut a, &mut b], 0.1).unwrap_err();
    assert!(
        matches!(err, OptimError::ParamShape { index: 1, .. }),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("fc.bias") && msg.contains('3') && msg.contains('4'),
        "{msg}"
    );
    assert_eq!(opt.steps_taken(), 3);

    // Matching lengths pass, and the shapes seen then are enforced later.
    let mut b = vector("fc.bias", &[0.0; 3], false);
    opt.step(&mut [&mut a, &mut b], 0.1).unwrap();
    assert_eq!(opt.steps_taken(), 4);
    let mut transposed = param("fc.weight", &[3, 2], &[1.0; 6], true);
    assert!(opt.step(&mut [&mut transposed, &mut b], 0.1).is_err());
}

#[test]
fn inconsistent_states_are_rejected_and_leave_the_optimizer_unchanged() {
    let mut opt = AdamW::new(AdamWConfig::default()).unwrap();
    let mut p = vector("p", &[1.0, 2.0], true);
    set_grad(&mut p, &[0.5, 0.5]);
    opt.step(&mut [&mut p], 0.1).unwrap();
    let good = opt.state().unwrap();

    let bad = [
        AdamWState {
            step: 1,
            first_moment: vec![vec![0.0; 2]],
            second_moment: vec![],
        },
        AdamWState {
            step: 1,
            first_moment: vec![vec![0.0; 2]],
            second_moment: vec![vec![0.0; 3]],
        },
        AdamWState {
            step: 1,
            first_moment: vec![vec![f32::NAN, 0.0]],
            second_moment: vec![vec![0.0; 2]],
        },
        AdamWState {
            step: 1,
            first_moment: vec![vec![0.0; 2]],
            second_moment: vec![vec![-1.0, 0.0]],
        },
        AdamWState {
            step: 0,
            first_moment: vec![vec![0.0; 2]],
            second_moment: vec![vec![0.0; 2]],
        },
    ];
    for state in bad {
        let err = opt.load_state(state.clone()).unwrap_err();
        assert!(
            matches!(err, OptimError::InvalidState(_)),
            "{state:?}: {err:?}"
        );
        assert_eq!(opt.state().unwrap(), good);
    }
}

#[test]
fn invalid_configs_name_the_field() {
    let cases = [
        (
            "beta1",
            AdamWConfig {
                beta1: 1.0,
                ..Default::default()
            },
        ),
        (
            "beta1",
            AdamWConfig {
                beta1: f32::NAN,
                ..Default::default()
            },
        ),
        (
            "beta2",
            AdamWConfig {
                beta2: -0.1,
                ..Default::default()
            },
        ),
        (
            "eps",
            AdamWConfig {
                eps: 0.0,
                ..Default::default()
            },
        ),
        (
            "eps",
            AdamWConfig {
                eps: f32::INFINITY,
                ..Default::default()
            },
        ),
        (
            "weight_decay",
            AdamWConfig {
                weight_decay: -1e-4,
                ..Default::default()
            },
        ),
        (
            "weight_decay",
            AdamWConfig {
                weight_decay: f32::NAN,
                ..Default::default()
            },
        ),
    ];
    for (field, config) in cases {
        let err = config.validate().unwrap_err();
        assert!(
            matches!(&err, OptimError::InvalidValue { field: f, .. } if *f == field),
            "{config:?}: {err:?}"
        );
        assert!(err.to_string().contains(field), "{err}");
        assert!(AdamW::new(config).is_err());
    }
    assert!(AdamWConfig::default().validate().is_ok());
    assert!(AdamWConfig {
        beta1: 0.0,
        weight_decay: 0.1,
        ..Default::default()
    }
    .validate()
    .is_ok());
}

#[test]
fn bad_learning_rates_are_errors_naming_lr() {
    let mut opt = AdamW::new(AdamWConfig::default()).unwrap();
    let mut p = vector("p", &[1.0], true);
    for lr in [-1e-3, f32::NAN, f32::INFINITY] {
        let msg = opt.step(&mut [&mut p], lr).unwrap_err().to_string();
        assert!(msg.contains("lr"), "{msg}");
    }
    assert_eq!(opt.steps_taken(), 0);
    assert_eq!(p.value.data(), &[1.0]);
    // lr = 0 is allowed: the moments advance, the weights do not.
    set_grad(&mut p, &[1.0]);
    opt.step(&mut [&mut p], 0.0).unwrap();
    assert_eq!(p.value.data(), &[1.0]);
    assert_eq!(opt.steps_taken(), 1);
}

#[test]
fn config_deserialises_with_defaults_and_rejects_unknown_keys() {
    let config: AdamWConfig = toml::from_str("weight_decay = 0.05").unwrap();
    assert_eq!(
        config,
        AdamWConfig {
            weight_decay: 0.05,
            ..Default::default()
        }
    );
    let err = toml::from_str::<AdamWConfig>("beta3 = 0.5").unwrap_err();
    assert!(err.to_string().contains("beta3"), "{err}");
}

#[test]
fn a_checked_step_that_applies_is_the_plain_step_bit_for_bit() {
    let config = AdamWConfig {
        weight_decay: 0.01,
        ..AdamWConfig::default()
    };
    let mut init = Lcg(3);
    let mut plain_net = toy_net(&mut init);
    let mut checked_net = plain_net.clone();
    let (mut plain, mut checked) = (
        AdamW::new(config.clone()).unwrap(),
        AdamW::new(config).unwrap(),
    );
    let (mut a, mut b) = (Lcg(4), Lcg(4));
    for _ in 0..6 {
        apply_grads(&mut plain_net, &mut a);
        apply_grads(&mut checked_net, &mut b);
        plain
            .step(&mut plain_net.iter_mut().collect::<Vec<_>>(), 3e-2)
            .unwrap();
        let outcome = checked
            .step_if_finite(&mut checked_net.iter_mut().collect::<Vec<_>>(), 3e-2)
            .unwrap();
        assert_eq!(outcome, UpdateOutcome::Applied);
    }
    for (x, y) in plain_net.iter().zip(&checked_net) {
        assert_eq!(x.value.data(), y.value.data(), "{}", x.name);
    }
    assert_eq!(plain.state().unwrap(), checked.state().unwrap());
}

#[test]
fn a_step_that_would_overflow_changes_nothing_and_names_the_parameter() {
    let mut init = Lcg(5);
    let mut net = toy_net(&mut init);
    let mut grads = Lcg(6);
    let mut opt = AdamW::new(AdamWConfig::default()).unwrap();
    // Refused on the very first step: no moments are kept from it.
    apply_grads(&mut net, &mut grads);
    let before: Vec<Vec<f32>> = net.iter().map(|p| p.value.data().to_vec()).collect();
    let outcome = opt
        .step_if_finite(&mut net.iter_mut().collect::<Vec<_>>(), 1e38)
        .unwrap();
    assert_eq!(
        outcome,
        UpdateOutcome::NonFinite {
            index: 0,
            name: "conv.weight".into()
        }
    );
    assert_eq!(opt.state().unwrap(), AdamWState::default());
    assert_eq!(opt.steps_taken(), 0);
    for (p, was) in net.iter().zip(&before) {
        assert_eq!(p.value.data(), was.as_slice(), "{}", p.name);
    }
    // The plain step at that rate would have written infinities.
    let mut plain = AdamW::new(AdamWConfig::default()).unwrap();
    let mut unchecked = net.clone();
    plain
        .step(&mut unchecked.iter_mut().collect::<Vec<_>>(), 1e38)
        .unwrap();
    assert!(unchecked[0].value.data().iter().any(|v| !v.is_finite()));

    // After good steps: a gradient whose square overflows (the second
    // moment would be infinite, the weight finite) is refused too, naming
    // the bias, and the state is the good steps' state.
    for _ in 0..3 {
        apply_grads(&mut net, &mut grads);
        let applied = opt
            .step_if_finite(&mut net.iter_mut().collect::<Vec<_>>(), 1e-2)
            .unwrap();
        assert_eq!(applied, UpdateOutcome::Applied);
    }
    let state = opt.state().unwrap();
    let values: Vec<Vec<f32>> = net.iter().map(|p| p.value.data().to_vec()).collect();
    apply_grads(&mut net, &mut grads);
    net[1].grad.data_mut()[2] = 3e22;
    let outcome = opt
        .step_if_finite(&mut net.iter_mut().collect::<Vec<_>>(), 1e-2)
        .unwrap();
    assert_eq!(
        outcome,
        UpdateOutcome::NonFinite {
            index: 1,
            name: "conv.bias".into()
        }
    );
    assert_eq!(opt.state().unwrap(), state);
    assert_eq!(opt.steps_taken(), 3);
    for (p, was) in net.iter().zip(&values) {
        assert_eq!(p.value.data(), was.as_slice(), "{}", p.name);
    }
}

/// Two shards (ZeRO-1's two ranks) over the same parameters, each owning
/// one: together they make the unsharded update's bits, keep only their
/// own moments, and a whole state loaded into a shard keeps its part.
#[test]
fn sharded_optimizers_update_their_own_parameters_as_one_optimizer_does() {
    let config = AdamWConfig {
        weight_decay: 0.01,
        ..AdamWConfig::default()
    };
    let mut init = Lcg(7);
    let mut whole_net = toy_net(&mut init);
    let (mut net0, mut net1) = (whole_net.clone(), whole_net.clone());
    let mut whole = AdamW::new(config.clone()).unwrap();
    let mut shard0 = AdamW::new(config.clone()).unwrap();
    let mut shard1 = AdamW::new(config.clone()).unwrap();
    shard0.shard(Some(vec![true, false]));
    shard1.shard(Some(vec![false, true]));
    let mut grads = Lcg(8);
    for _ in 0..4 {
        apply_grads(&mut whole_net, &mut grads);
        for (a, b) in net0.iter_mut().zip(&whole_net) {
            a.grad = b.grad.clone();
        }
        for (a, b) in net1.iter_mut().zip(&whole_net) {
            a.grad = b.grad.clone();
        }
        whole
            .step(&mut whole_net.iter_mut().collect::<Vec<_>>(), 1e-2)
            .unwrap();
        for (opt, net) in [(&mut shard0, &mut net0), (&mut shard1, &mut net1)] {
            let mut params: Vec<_> = net.iter_mut().collect();
            // Nothing changes in the check, however often it runs.
            let before: Vec<Vec<f32>> = params.iter().map(|p| p.value.data().to_vec()).collect();
            assert_eq!(
                opt.check_step(&mut params, 1e-2).unwrap(),
                UpdateOutcome::Applied
            );
            let after: Vec<Vec<f32>> = params.iter().map(|p| p.value.data().to_vec()).collect();
            assert_eq!(before, after);
            opt.step(&mut params, 1e-2).unwrap();
        }
    }
    let bits = |p: &Param| {
        p.value
            .data()
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>()
    };
    assert_eq!(bits(&net0[0]), bits(&whole_net[0]));
    assert_eq!(bits(&net1[1]), bits(&whole_net[1]));
    // Shard 0 never touched parameter 1, nor kept its moments.
    assert_ne!(bits(&net0[1]), bits(&whole_net[1]));
    let [first, second] = shard0.moments();
    assert!(first[1].is_empty() && second[1].is_empty());
    assert_eq!(first[0], whole.moments()[0][0]);
    // Filled from the other shard, the state is the whole optimizer's.
    let [m1, v1] = shard1.moments();
    let (m1, v1) = (m1[1].clone(), v1[1].clone());
    shard0.fill_moments(1, m1, v1).unwrap();
    assert_eq!(shard0.state().unwrap(), whole.state().unwrap());
    shard0.drop_unowned();
    assert!(shard0.moments()[0][1].is_empty());
    // A whole state loaded into a shard keeps its own part only.
    shard1.load_state(whole.state().unwrap()).unwrap();
    assert!(shard1.moments()[0][0].is_empty());
    assert_eq!(shard1.moments()[1][1], whole.moments()[1][1]);
}
