//! RandAugment, Mixup and CutMix through the loader; the memory budget;
//! checkpointable loader state.

mod common;

use std::sync::Arc;

use common::*;
use headroom_loader::{
    AugmentConfig, Batch, DataLoader, LoaderConfig, LoaderError, LoaderState, RandAugmentConfig,
};

fn collect(l: &DataLoader, epoch: u64) -> Vec<Batch> {
    l.epoch(epoch, 0).map(|b| b.expect("batch")).collect()
}

fn loader(ds: Synth, config: LoaderConfig) -> DataLoader {
    DataLoader::new(Arc::new(ds), config).expect("valid config")
}

fn rand_augment(num_ops: usize, magnitude: u32) -> Option<RandAugmentConfig> {
    Some(RandAugmentConfig { num_ops, magnitude })
}

fn full_augment() -> AugmentConfig {
    AugmentConfig {
        crop_padding: 2,
        flip: true,
        rand_augment: rand_augment(2, 9),
        mixup_alpha: 0.4,
        cutmix_alpha: 1.0,
    }
}

#[test]
fn same_batches_for_any_worker_count_with_rand_augment_and_mixing() {
    let config = |workers, prefetch| LoaderConfig {
        prefetch,
        augment: full_augment(),
        ..config(8, workers)
    };
    let reference = collect(&loader(Synth::new(100, [12, 10, 1], 5), config(0, 1)), 2);
    assert_eq!(reference.len(), 13);
    for b in &reference {
        let t = b
            .soft_targets
            .as_ref()
            .expect("mixed batches carry soft targets");
        assert_eq!(t.len(), b.len() * 5);
    }
    for (workers, prefetch) in [(1, 1), (1, 3), (4, 2), (4, 8)] {
        let mut ds = Synth::new(100, [12, 10, 1], 5);
        ds.jitter = true;
        let got = collect(&loader(ds, config(workers, prefetch)), 2);
        assert!(got == reference, "workers {workers}, prefetch {prefetch}");
    }
    // And resuming mid-epoch gives the same tail.
    let l = loader(Synth::new(100, [12, 10, 1], 5), config(3, 2));
    let tail: Vec<Batch> = l.epoch(2, 5).map(Result::unwrap).collect();
    assert!(tail[..] == reference[5..]);
    // Another epoch mixes differently.
    let other = collect(&l, 3);
    assert_ne!(other[0].soft_targets, reference[0].soft_targets);
}

/// Batches with the same per-sample augmentation but no mixing.
fn unmixed(config: &LoaderConfig) -> Vec<Batch> {
    let plain = LoaderConfig {
        augment: AugmentConfig {
            mixup_alpha: 0.0,
            cutmix_alpha: 0.0,
            ..config.augment.clone()
        },
        ..config.clone()
    };
    let b = collect(&loader(Synth::new(120, [8, 8, 1], 6), plain), 1);
    assert!(b.iter().all(|b| b.soft_targets.is_none()));
    b
}

/// The weight of each sample's own label in its soft target, checking the
/// rest of the row: 1 - lambda on the previous sample's label, sum 1.
fn lambda_of(b: &Batch, j: usize, classes: usize) -> f32 {
    let n = b.len();
    let t = &b.soft_targets.as_ref().unwrap()[j * classes..(j + 1) * classes];
    let sum: f32 = t.iter().sum();
    assert!((sum - 1.0).abs() < 1e-6, "row {j} sums to {sum}");
    assert!(t.iter().all(|&p| (0.0..=1.0).contains(&p)));
    let (own, prev) = (b.labels[j] as usize, b.labels[(j + n - 1) % n] as usize);
    if own == prev {
        assert!((t[own] - 1.0).abs() < 1e-6);
        return f32::NAN; // not identifiable
    }
    let lambda = t[own];
    assert!((t[prev] - (1.0 - lambda)).abs() < 1e-6);
    assert_eq!(
        t.iter().filter(|&&p| p > 0.0).count(),
        1 + usize::from(lambda < 1.0)
    );
    lambda
}

#[test]
fn mixup_soft_targets_sum_to_one_and_match_the_pixels() {
    let config = LoaderConfig {
        augment: AugmentConfig {
            crop_padding: 1,
            flip: true,
            rand_augment: rand_augment(1, 5),
            mixup_alpha: 0.4,
            cutmix_alpha: 0.0,
        },
        ..config(16, 2)
    };
    let plain = unmixed(&config);
    let mixed = collect(&loader(Synth::new(120, [8, 8, 1], 6), config), 1);
    let mut lambdas = Vec::new();
    for (m, p) in mixed.iter().zip(&plain) {
        assert_eq!(m.labels, p.labels, "hard labels stay the samples' own");
        let n = m.len();
        let mut batch_lambda = None;
        for j in 0..n {
            let l = lambda_of(m, j, 6);
            if !l.is_nan() {
                assert!(
                    batch_lambda.is_none_or(|b: f32| (b - l).abs() < 1e-6),
                    "one lambda per batch"
                );
                batch_lambda = Some(l);
            }
        }
        let lambda = f64::from(batch_lambda.expect("some neighbours differ in label"));
        lambdas.push(lambda);
        for j in 0..n {
            let (a, b) = (p.sample(j), p.sample((j + n - 1) % n));
            for (k, &got) in m.sample(j).iter().enumerate() {
                let want = lambda * f64::from(a[k]) + (1.0 - lambda) * f64::from(b[k]);
                assert!(
                    (f64::from(got) - want).abs() <= 0.51,
                    "batch {}, sample {j}",
                    m.index
                );
            }
        }
    }
    // Beta(0.4, 0.4) puts lambdas near both ends, and they vary.
    assert!(
        lambdas.iter().any(|&l| l < 0.3) && lambdas.iter().any(|&l| l > 0.7),
        "{lambdas:?}"
    );
}

#[test]
fn cutmix_soft_targets_match_the_pasted_area() {
    let config = LoaderConfig {
        augment: AugmentConfig {
            flip: true,
            cutmix_alpha: 1.0,
            ..AugmentConfig::default()
        },
        ..config(16, 0)
    };
    let plain = unmixed(&config);
    let mixed = collect(&loader(Synth::new(120, [8, 8, 1], 6), config), 1);
    let mut pasted_any = false;
    for (m, p) in mixed.iter().zip(&plain) {
        let n = m.len();
        // The box is the same for every sample of the batch: find it from
        // the pixels that differ from the sample's own.
        let mut inside = [false; 64];
        for j in 0..n {
            let (own, other) = (p.sample(j), p.sample((j + n - 1) % n));
            for (k, &px) in m.sample(j).iter().enumerate() {
                assert!(
                    px == own[k] || px == other[k],
                    "every pixel comes from one of the two"
                );
                if px != own[k] {
                    inside[k] = true;
                }
            }
        }
        let area = inside.iter().filter(|&&i| i).count();
        pasted_any |= area > 0;
        for j in 0..n {
            let l = lambda_of(m, j, 6);
            if !l.is_nan() {
                // Pixels equal in both images can hide part of the box, so
                // the visible area is at most the box.
                assert!(
                    area as f32 <= (1.0 - l) * 64.0 + 1e-3,
                    "area {area}, lambda {l}"
                );
                assert!(
                    (1.0 - l) * 64.0 - area as f32 <= 64.0 * 0.25,
                    "area {area}, lambda {l}"
                );
            }
        }
    }
    assert!(pasted_any);
}

#[test]
fn rand_augment_runs_in_the_loader_and_magnitude_zero_changes_nothing() {
    let base = AugmentConfig {
        crop_padding: 2,
        flip: true,
        ..AugmentConfig::default()
    };
    let with = |ra| LoaderConfig {
        augment: AugmentConfig {
            rand_augment: ra,
            ..base.clone()
        },
        ..config(10, 2)
    };
    let crop_flip = collect(&loader(Synth::new(200, [10, 10, 1], 4), with(None)), 0);
    let zero = collect(
        &loader(Synth::new(200, [10, 10, 1], 4), with(rand_augment(3, 0))),
        0,
    );
    assert!(zero == crop_flip, "magnitude 0 is the identity");
    let strong = collect(
        &loader(Synth::new(200, [10, 10, 1], 4), with(rand_augment(2, 9))),
        0,
    );
    let changed = crop_flip
        .iter()
        .zip(&strong)
        .flat_map(|(a, b)| (0..a.len()).map(move |j| a.sample(j) != b.sample(j)))
        .filter(|&d| d)
        .count();
    // Both ops are the identity (or leave this image unchanged) rarely.
    assert!(changed > 170, "{changed}/200 samples changed");
    for (a, b) in crop_flip.iter().zip(&strong) {
        assert_eq!(a.labels, b.labels);
        assert!(b.soft_targets.is_none());
    }
}

#[test]
fn invalid_augment_values_name_the_key() {
    let cases = [
        (
            AugmentConfig {
                rand_augment: rand_augment(2, 31),
                ..AugmentConfig::default()
            },
            "augment.rand_augment.magnitude",
        ),
        (
            AugmentConfig {
                rand_augment: rand_augment(17, 9),
                ..AugmentConfig::default()
            },
            "augment.rand_augment.num_ops",
        ),
        (
            AugmentConfig {
                mixup_alpha: -0.1,
                ..AugmentConfig::default()
            },
            "augment.mixup_alpha",
        ),
        (
            AugmentConfig {
                cutmix_alpha: f32::NAN,
                ..AugmentConfig::default()
            },
            "augment.cutmix_alpha",
        ),
    ];
    for (augment, field) in cases {
        let e = DataLoader::new(
            Arc::new(Synth::new(10, [8, 8, 1], 2)),
            LoaderConfig {
                augment,
                ..config(4, 0)
            },
        )
        .unwrap_err();
        assert!(
            matches!(&e, LoaderError::Config { field: f, .. } if *f == field),
            "{e}"
        );
    }
}

#[test]
fn the_memory_budget_is_checked_and_reported() {
    // 4 x 4 x 2 samples, batches of 8 with 5 classes mixed:
    // 8 * 32 pixels + 8 * 4 labels + 8 * 5 * 4 soft targets = 448 bytes.
    let cfg = |workers, budget| LoaderConfig {
        prefetch: 3,
        augment: AugmentConfig {
            mixup_alpha: 1.0,
            ..AugmentConfig::default()
        },
        memory_budget: budget,
        ..config(8, workers)
    };
    // The test dataset holds nothing in memory: 3 batches in flight.
    let e =
        DataLoader::new(Arc::new(Synth::new(50, [4, 4, 2], 5)), cfg(2, Some(1343))).unwrap_err();
    assert!(
        matches!(
            e,
            LoaderError::Config {
                field: "memory_budget",
                ..
            }
        ),
        "{e}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("loader.memory_budget") && msg.contains("1343"),
        "{msg}"
    );
    assert!(msg.contains("448") && msg.contains("1344"), "{msg}");
    let l = loader(Synth::new(50, [4, 4, 2], 5), cfg(2, Some(1344)));
    for b in l.epoch(0, 0) {
        b.unwrap();
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let m = l.memory_report();
    assert_eq!(
        (m.cache_bytes, m.limit_bytes, m.budget),
        (0, 1344, Some(1344))
    );
    assert!(
        m.prefetched_bytes_max <= 1344 && m.prefetched_bytes_max >= 896,
        "{m:?}"
    );
    // Without workers one batch is in flight.
    let l = loader(Synth::new(50, [4, 4, 2], 5), cfg(0, Some(448)));
    collect(&l, 0);
    assert_eq!(l.memory_report().prefetched_bytes_max, 448);
    // An in-memory IDX dataset counts whole.
    let tmp = tempfile::tempdir().unwrap();
    let images = write(tmp.path(), "i", &images_idx(30, 4, 4));
    let labels = write(tmp.path(), "l", &labels_idx(30, 3));
    let idx = headroom_loader::IdxDataset::open(&images, &labels).unwrap();
    let e = DataLoader::new(
        Arc::new(idx),
        LoaderConfig {
            memory_budget: Some(30 * 17 + 3 * (8 * 16 + 32) - 1),
            prefetch: 3,
            ..config(8, 1)
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("(510 bytes)"), "{e}");
}

#[test]
fn loader_state_resumes_exactly_and_checks_the_seed() {
    for workers in [0, 2] {
        let cfg = LoaderConfig {
            augment: full_augment(),
            ..config(6, workers)
        };
        let l = loader(Synth::new(50, [6, 6, 1], 4), cfg.clone());
        let full = collect(&l, 7);
        let mut it = l.epoch(7, 0);
        for _ in 0..3 {
            it.next().unwrap().unwrap();
        }
        let state = it.state();
        assert_eq!(
            state,
            LoaderState {
                seed: 1234,
                epoch: 7,
                batches_consumed: 3
            }
        );
        drop(it);
        // Through a checkpoint (JSON here) into a fresh loader.
        let saved = serde_json::to_string(&state).unwrap();
        let restored: LoaderState = serde_json::from_str(&saved).unwrap();
        let fresh = loader(Synth::new(50, [6, 6, 1], 4), cfg.clone());
        let rest: Vec<Batch> = fresh
            .resume(&restored)
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert!(rest[..] == full[3..], "workers {workers}");
        // At the end of an epoch the state says so.
        let mut it = fresh.epoch(7, 0);
        while it.next().is_some() {}
        assert_eq!(it.state().batches_consumed, fresh.batches_per_epoch());
        assert!(fresh.resume(&it.state()).unwrap().next().is_none());
        // A state of another seed is refused.
        let other = LoaderState {
            seed: 1,
            ..restored
        };
        let e = fresh.resume(&other).expect_err("seed mismatch");
        assert!(e.to_string().contains("seed"), "{e}");
    }
}
