//! Learning-rate schedules against PyTorch's OneCycleLR and the documented
//! warmup+cosine; validation; the config format.

use std::f64::consts::PI;

use headroom_optim::{OneCycle, OptimError, Schedule};

fn close(got: f32, want: f64) -> bool {
    (got as f64 - want).abs() <= 1e-6 * want.abs().max(1e-12)
}

/// `torch.optim.lr_scheduler.OneCycleLR.get_lr` (cos, two phases), in f64 as
/// Python computes it; `step_num` is `last_epoch`, 0 for the first update.
fn torch_one_cycle(
    max_lr: f64,
    total: u64,
    pct_start: f64,
    div: f64,
    final_div: f64,
    step_num: u64,
) -> f64 {
    let initial_lr = max_lr / div;
    let min_lr = initial_lr / final_div;
    let phases = [
        (pct_start * total as f64 - 1.0, initial_lr, max_lr),
        (total as f64 - 1.0, max_lr, min_lr),
    ];
    let step = step_num as f64;
    let mut start_step = 0.0;
    for (i, &(end_step, start_lr, end_lr)) in phases.iter().enumerate() {
        if step <= end_step || i == phases.len() - 1 {
            let pct = (step - start_step) / (end_step - start_step);
            // _annealing_cos
            return end_lr + (start_lr - end_lr) / 2.0 * ((PI * pct).cos() + 1.0);
        }
        start_step = end_step;
    }
    unreachable!()
}

#[test]
fn one_cycle_endpoints_and_peak() {
    let s = OneCycle::new(0.1, 100, 0.3, 25.0, 1e4).unwrap();
    assert!(close(s.lr_at(0), 0.1 / 25.0), "{}", s.lr_at(0));
    // Peak at step pct_start·total − 1 = 29 (PyTorch's phase end).
    assert_eq!(s.lr_at(29), 0.1);
    assert!(s.lr_at(28) < 0.1 && s.lr_at(30) < 0.1);
    assert!(close(s.lr_at(99), 0.1 / 25.0 / 1e4), "{}", s.lr_at(99));
    // Past the end: the last rate (PyTorch raises).
    assert_eq!(s.lr_at(100), s.lr_at(99));
    assert_eq!(s.lr_at(u64::MAX), s.lr_at(99));
}

#[test]
fn one_cycle_hand_values() {
    // max 1, div 4 → initial 0.25; final_div 100 → min 0.0025;
    // total 10, pct 0.5 → warm-up ends at step 4, annealing from 4 to 9.
    let s = OneCycle::new(1.0, 10, 0.5, 4.0, 100.0).unwrap();
    // Step 2: halfway up, cos(π/2) = 0 → (0.25 + 1)/2.
    assert!(close(s.lr_at(2), 0.625), "{}", s.lr_at(2));
    assert_eq!(s.lr_at(4), 1.0);
    // Step 7: pct = 3/5 → 0.0025 + (1 − 0.0025)/2·(cos(0.6π) + 1),
    // cos(0.6π) = −0.30901699437 → 0.34712777947.
    assert!(close(s.lr_at(7), 0.347_127_779_47), "{}", s.lr_at(7));
    assert!(close(s.lr_at(9), 0.0025), "{}", s.lr_at(9));
}

#[test]
fn one_cycle_matches_pytorch_at_every_step() {
    let configs = [
        (0.1f32, 100u64, 0.3f32, 25.0f32, 1e4f32),
        (3e-3, 1000, 0.25, 10.0, 100.0),
        (1.0, 10, 0.7, 25.0, 1e4),
        (0.5, 7, 0.4, 5.0, 2.0),
        (2e-2, 4690, 0.15, 25.0, 1e4),
    ];
    for (max_lr, total, pct, div, fdiv) in configs {
        let s = OneCycle::new(max_lr, total, pct, div, fdiv).unwrap();
        // The Python floats a config's decimals stand for.
        let py = |x: f32| -> f64 { x.to_string().parse().unwrap() };
        for step in 0..total {
            let want = torch_one_cycle(py(max_lr), total, py(pct), py(div), py(fdiv), step);
            assert!(
                close(s.lr_at(step), want),
                "{s:?} step {step}: {} vs {want}",
                s.lr_at(step)
            );
        }
    }
}

#[test]
fn one_cycle_peak_is_at_pct_start_times_total_minus_one() {
    // pct_start·total − 1 as PyTorch computes it with Python floats: 0.7·10 = 7.
    // f32 0.7 is 0.699999988, which would put the phase end at 5.99999988.
    for (total, pct, peak) in [
        (10u64, 0.7f32, 6u64),
        (8, 0.25, 1),
        (1000, 0.3, 299),
        (20, 0.1, 1),
    ] {
        let s = OneCycle::new(1.0, total, pct, 25.0, 1e4).unwrap();
        assert_eq!(s.lr_at(peak), 1.0, "total {total} pct {pct}");
        assert!(
            s.lr_at(peak - 1) < 1.0 && s.lr_at(peak + 1) < 1.0,
            "total {total} pct {pct}"
        );
    }
    // A one-step warm-up (pct·total = 1, phase end 0; PyTorch divides by
    // zero there): step 0 is already at the peak.
    let s = OneCycle::new(1.0, 10, 0.1, 25.0, 1e4).unwrap();
    assert_eq!(s.lr_at(0), 1.0);
    assert!(s.lr_at(1) < 1.0);
}

#[test]
fn one_cycle_is_monotone_in_each_phase() {
    for (total, pct) in [(100u64, 0.3f32), (4690, 0.15), (10_000, 0.5), (17, 0.9)] {
        let s = OneCycle::new(0.01, total, pct, 25.0, 1e4).unwrap();
        let lrs: Vec<f32> = (0..total).map(|t| s.lr_at(t)).collect();
        let peak = (pct as f64 * total as f64).round() as usize - 1;
        assert!(
            lrs[..=peak].windows(2).all(|w| w[0] <= w[1]),
            "warm-up, total {total}"
        );
        assert!(
            lrs[peak..].windows(2).all(|w| w[0] >= w[1]),
            "annealing, total {total}"
        );
        assert!(lrs[0] < lrs[peak] && lrs[total as usize - 1] < lrs[0]);
        assert!(lrs.iter().all(|&lr| lr > 0.0 && lr <= 0.01));
    }
}

fn field_of(err: OptimError) -> &'static str {
    match err {
        OptimError::InvalidValue { field, .. } => field,
        other => panic!("expected InvalidValue, got {other:?}"),
    }
}

#[test]
fn invalid_one_cycles_name_the_field() {
    let cases = [
        ("max_lr", OneCycle::new(-0.1, 100, 0.3, 25.0, 1e4)),
        ("max_lr", OneCycle::new(0.0, 100, 0.3, 25.0, 1e4)),
        ("max_lr", OneCycle::new(f32::NAN, 100, 0.3, 25.0, 1e4)),
        ("total_steps", OneCycle::new(0.1, 0, 0.3, 25.0, 1e4)),
        ("pct_start", OneCycle::new(0.1, 100, 0.0, 25.0, 1e4)),
        ("pct_start", OneCycle::new(0.1, 100, 1.0, 25.0, 1e4)),
        ("pct_start", OneCycle::new(0.1, 100, -0.2, 25.0, 1e4)),
        ("pct_start", OneCycle::new(0.1, 100, f32::NAN, 25.0, 1e4)),
        ("div_factor", OneCycle::new(0.1, 100, 0.3, 0.0, 1e4)),
        ("div_factor", OneCycle::new(0.1, 100, 0.3, f32::NAN, 1e4)),
        (
            "final_div_factor",
            OneCycle::new(0.1, 100, 0.3, 25.0, f32::INFINITY),
        ),
        ("final_div_factor", OneCycle::new(0.1, 100, 0.3, 25.0, -1.0)),
    ];
    for (field, result) in cases {
        let err = result.unwrap_err();
        assert!(err.to_string().contains(field), "{err}");
        assert_eq!(field_of(err), field);
    }
}

#[test]
fn constant_schedule() {
    let s = Schedule::Constant { lr: 3e-4 };
    s.validate().unwrap();
    assert!([0, 1, 1_000_000].iter().all(|&t| s.lr_at(t) == 3e-4));
    assert_eq!(
        field_of(Schedule::Constant { lr: -1e-3 }.validate().unwrap_err()),
        "lr"
    );
    assert_eq!(
        field_of(Schedule::Constant { lr: f32::NAN }.validate().unwrap_err()),
        "lr"
    );
}

#[test]
fn one_cycle_variant_delegates() {
    let one = OneCycle::new(0.1, 100, 0.3, 25.0, 1e4).unwrap();
    let s = Schedule::OneCycle(one.clone());
    s.validate().unwrap();
    assert!((0..120).all(|t| s.lr_at(t) == one.lr_at(t)));
}

#[test]
fn warmup_cosine_values() {
    let s = Schedule::WarmupCosine {
        max_lr: 1.0,
        warmup_steps: 10,
        total_steps: 110,
        min_lr: 0.1,
    };
    s.validate().unwrap();
    // Linear warm-up: (step + 1)/10.
    assert!(close(s.lr_at(0), 0.1));
    assert!(close(s.lr_at(4), 0.5));
    assert_eq!(s.lr_at(9), 1.0);
    // Cosine from step 9 (max) to step 109 (min): halfway at step 59.
    assert!(close(s.lr_at(59), 0.55), "{}", s.lr_at(59));
    // Quarter way (step 34): 0.1 + 0.9·(1 + cos(π/4))/2.
    let quarter = 0.1 + 0.9 * (1.0 + (PI / 4.0).cos()) / 2.0;
    assert!(close(s.lr_at(34), quarter), "{}", s.lr_at(34));
    assert!(close(s.lr_at(109), 0.1));
    assert_eq!(s.lr_at(500), s.lr_at(109));
    let lrs: Vec<f32> = (0..110).map(|t| s.lr_at(t)).collect();
    assert!(lrs[..10].windows(2).all(|w| w[0] < w[1]));
    assert!(lrs[9..].windows(2).all(|w| w[0] >= w[1]));

    // No warm-up: step 0 at the peak.
    let s = Schedule::WarmupCosine {
        max_lr: 2.0,
        warmup_steps: 0,
        total_steps: 5,
        min_lr: 0.0,
    };
    assert_eq!(s.lr_at(0), 2.0);
    assert!(close(s.lr_at(2), 1.0));
    assert!(s.lr_at(4).abs() < 1e-7);
    // All warm-up.
    let s = Schedule::WarmupCosine {
        max_lr: 2.0,
        warmup_steps: 4,
        total_steps: 4,
        min_lr: 0.0,
    };
    assert_eq!(
        (0..6).map(|t| s.lr_at(t)).collect::<Vec<_>>(),
        [0.5, 1.0, 1.5, 2.0, 2.0, 2.0]
    );
}

#[test]
fn invalid_warmup_cosines_name_the_field() {
    let make = |max_lr, warmup_steps, total_steps, min_lr| Schedule::WarmupCosine {
        max_lr,
        warmup_steps,
        total_steps,
        min_lr,
    };
    let cases = [
        ("max_lr", make(-1.0, 0, 10, 0.0)),
        ("max_lr", make(f32::NAN, 0, 10, 0.0)),
        ("min_lr", make(1.0, 0, 10, -0.1)),
        ("min_lr", make(1.0, 0, 10, 2.0)),
        ("total_steps", make(1.0, 0, 0, 0.0)),
        ("warmup_steps", make(1.0, 11, 10, 0.0)),
    ];
    for (field, s) in cases {
        let err = s.validate().unwrap_err();
        assert!(err.to_string().contains(field), "{err}");
        assert_eq!(field_of(err), field);
    }
}

#[test]
fn schedules_deserialise_from_toml() {
    #[derive(serde::Deserialize)]
    struct Wrapper {
        schedule: Schedule,
    }
    let parse = |s: &str| toml::from_str::<Wrapper>(s).map(|w| w.schedule);
    assert_eq!(
        parse("schedule = { kind = \"constant\", lr = 0.001 }").unwrap(),
        Schedule::Constant { lr: 0.001 }
    );
    // PyTorch's defaults for the omitted one-cycle fields.
    assert_eq!(
        parse("[schedule]\nkind = \"one_cycle\"\nmax_lr = 0.01\ntotal_steps = 500").unwrap(),
        Schedule::OneCycle(OneCycle::new(0.01, 500, 0.3, 25.0, 1e4).unwrap())
    );
    assert_eq!(
        parse("[schedule]\nkind = \"warmup_cosine\"\nmax_lr = 0.01\nwarmup_steps = 5\ntotal_steps = 50\nmin_lr = 0.0")
            .unwrap(),
        Schedule::WarmupCosine {
            max_lr: 0.01,
            warmup_steps: 5,
            total_steps: 50,
            min_lr: 0.0
        }
    );
    for bad in [
        "schedule = { kind = \"constant\", lr = 0.001, typo = 1 }",
        "schedule = { kind = \"one_cycle\", max_lr = 0.01, total_steps = 5, pct = 0.3 }",
        "schedule = { kind = \"step\", lr = 0.1 }",
    ] {
        assert!(parse(bad).is_err(), "{bad}");
    }
    let err =
        parse("schedule = { kind = \"one_cycle\", max_lr = 0.01, total_steps = 5, pct = 0.3 }")
            .unwrap_err();
    assert!(err.to_string().contains("pct"), "{err}");
    // Round trip through JSON as well.
    let s = Schedule::OneCycle(OneCycle::new(0.01, 500, 0.3, 25.0, 1e4).unwrap());
    let json = serde_json::to_string(&s).unwrap();
    assert_eq!(serde_json::from_str::<Schedule>(&json).unwrap(), s);
}
