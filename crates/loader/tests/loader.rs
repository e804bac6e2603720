//! The data loader: determinism across worker counts, order, resume,
//! drop_last, augmentation, errors, panics, timeouts and cancellation.

mod common;

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use headroom_loader::{
    AugmentConfig, Batch, DataLoader, Dataset, EpochIter, LoaderConfig, LoaderError,
};

fn collect(it: EpochIter<'_>) -> Vec<Batch> {
    it.map(|b| b.expect("batch")).collect()
}

fn loader(ds: Synth, config: LoaderConfig) -> DataLoader {
    DataLoader::new(Arc::new(ds), config).expect("valid config")
}

fn augmented(workers: usize, prefetch: usize) -> LoaderConfig {
    LoaderConfig {
        prefetch,
        augment: AugmentConfig {
            crop_padding: 2,
            flip: true,
            ..AugmentConfig::default()
        },
        ..config(7, workers)
    }
}

#[test]
fn loader_types_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<DataLoader>();
    send::<EpochIter<'static>>();
    send_sync::<LoaderError>();
    send_sync::<Batch>();
}

#[test]
fn unshuffled_batches_hold_the_samples_in_order() {
    let ds = Synth::new(10, [3, 2, 2], 4);
    let expected: Vec<Vec<u8>> = (0..10).map(|i| ds.pixels(i)).collect();
    for workers in [0, 2] {
        let l = loader(
            Synth::new(10, [3, 2, 2], 4),
            LoaderConfig {
                shuffle: false,
                ..config(4, workers)
            },
        );
        let batches = collect(l.epoch(0, 0));
        assert_eq!(batches.len(), 3);
        for (k, b) in batches.iter().enumerate() {
            assert_eq!(b.index, k);
            assert_eq!(b.epoch, 0);
            let n = if k < 2 { 4 } else { 2 };
            assert_eq!(b.shape, [n, 3, 2, 2]);
            assert_eq!(b.pixels.len(), n * 12);
            for j in 0..n {
                let i = 4 * k + j;
                assert_eq!(b.sample(j), &expected[i][..]);
                assert_eq!(b.labels[j], (i % 4) as u32);
            }
        }
    }
}

#[test]
fn same_batches_whatever_the_worker_count_and_prefetch() {
    let reference = collect(loader(Synth::new(103, [6, 5, 3], 10), augmented(0, 1)).epoch(3, 0));
    assert_eq!(reference.len(), 15);
    for (workers, prefetch) in [(1, 1), (1, 4), (4, 1), (4, 3), (4, 16), (3, 2)] {
        // Random read delays make workers finish batches out of order.
        let mut ds = Synth::new(103, [6, 5, 3], 10);
        ds.jitter = true;
        let l = loader(ds, augmented(workers, prefetch));
        let got = collect(l.epoch(3, 0));
        assert!(
            got == reference,
            "workers = {workers}, prefetch = {prefetch}"
        );
    }
}

#[test]
fn each_epoch_visits_every_sample_once_in_a_new_order() {
    let l = loader(Synth::new(50, [2, 2, 1], 5), config(8, 2));
    let ids = |e: u64| -> Vec<usize> {
        collect(l.epoch(e, 0))
            .iter()
            .flat_map(|b| {
                (0..b.len())
                    .map(|j| sample_id(b.sample(j)))
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let (e0, e1) = (ids(0), ids(1));
    for ids in [&e0, &e1] {
        assert_eq!(ids.len(), 50);
        assert_eq!(ids.iter().copied().collect::<HashSet<_>>().len(), 50);
    }
    assert_ne!(e0, e1, "epochs must be shuffled differently");
    assert_ne!(
        e0,
        (0..50).collect::<Vec<_>>(),
        "shuffle must not be the identity"
    );
    assert_eq!(e0, ids(0), "the same epoch twice gives the same order");
    // Another seed gives another order.
    let other = loader(
        Synth::new(50, [2, 2, 1], 5),
        LoaderConfig {
            seed: 99,
            ..config(8, 2)
        },
    );
    let o0: Vec<usize> = collect(other.epoch(0, 0))
        .iter()
        .flat_map(|b| {
            (0..b.len())
                .map(|j| sample_id(b.sample(j)))
                .collect::<Vec<_>>()
        })
        .collect();
    assert_ne!(e0, o0);
}

#[test]
fn epochs_differ_in_order_and_augmentation_and_repeat_exactly() {
    let l = loader(Synth::new(40, [8, 8, 1], 3), augmented(2, 3));
    let a = collect(l.epoch(5, 0));
    let b = collect(l.epoch(6, 0));
    let a2 = collect(l.epoch(5, 0));
    assert_eq!(a, a2, "same epoch twice must give the same batches");
    assert_ne!(a[0].pixels, b[0].pixels);
    assert_ne!(
        a.iter().flat_map(|x| x.labels.clone()).collect::<Vec<_>>(),
        b.iter().flat_map(|x| x.labels.clone()).collect::<Vec<_>>()
    );
    // Without shuffling the order is the same but the augmentation differs.
    let l = loader(
        Synth::new(40, [8, 8, 1], 3),
        LoaderConfig {
            shuffle: false,
            ..augmented(2, 3)
        },
    );
    let a = collect(l.epoch(5, 0));
    let b = collect(l.epoch(6, 0));
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.labels, y.labels);
    }
    let differing = a
        .iter()
        .zip(&b)
        .flat_map(|(x, y)| (0..x.len()).map(move |j| x.sample(j) != y.sample(j)))
        .filter(|&d| d)
        .count();
    assert!(
        differing > 20,
        "only {differing}/40 samples augmented differently"
    );
}

#[test]
fn augmentation_depends_on_sample_not_position() {
    // The same sample in the same epoch gets the same augmentation, shuffled
    // or not, whatever batch it lands in.
    let shuffled = loader(Synth::new(30, [5, 5, 1], 3), augmented(2, 2));
    let ordered = loader(
        Synth::new(30, [5, 5, 1], 3),
        LoaderConfig {
            shuffle: false,
            batch_size: 4,
            ..augmented(0, 2)
        },
    );
    let plain = Synth::new(30, [5, 5, 1], 3);
    let samples = |batches: Vec<Batch>| -> Vec<Vec<u8>> {
        batches
            .iter()
            .flat_map(|b| {
                (0..b.len())
                    .map(|j| b.sample(j).to_vec())
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let ordered = samples(collect(ordered.epoch(2, 0)));
    let mut ids = Vec::new();
    for s in samples(collect(shuffled.epoch(2, 0))) {
        // The crop can hide the id bytes; find the sample whose augmented
        // form this is.
        let i = ordered
            .iter()
            .position(|o| *o == s)
            .expect("sample present");
        ids.push(i);
    }
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 30);
    // And it is a genuine augmentation of the source.
    assert!(ordered
        .iter()
        .enumerate()
        .any(|(i, o)| *o != plain.pixels(i)));
}

/// All augmentations of `src` (h x w x 1) with padding `p`.
fn candidates(src: &[u8], h: usize, w: usize, p: usize) -> Vec<(usize, usize, bool, Vec<u8>)> {
    let mut out = Vec::new();
    for dy in 0..=2 * p {
        for dx in 0..=2 * p {
            for flip in [false, true] {
                let mut img = vec![0u8; h * w];
                for y in 0..h {
                    for x in 0..w {
                        let xs = if flip { w - 1 - x } else { x };
                        let (sy, sx) = (y + dy, xs + dx);
                        if sy >= p && sy - p < h && sx >= p && sx - p < w {
                            img[y * w + x] = src[(sy - p) * w + sx - p];
                        }
                    }
                }
                out.push((dy, dx, flip, img));
            }
        }
    }
    out
}

#[test]
fn loader_applies_crop_and_flip() {
    let (h, w, p) = (6, 5, 2);
    let ds = Synth::new(400, [h, w, 1], 2);
    let sources: Vec<Vec<u8>> = (0..400).map(|i| ds.pixels(i)).collect();
    let l = loader(
        ds,
        LoaderConfig {
            shuffle: false,
            augment: AugmentConfig {
                crop_padding: p,
                flip: true,
                ..AugmentConfig::default()
            },
            ..config(64, 2)
        },
    );
    let (mut flips, mut offsets) = (0, HashSet::new());
    for b in collect(l.epoch(0, 0)) {
        for j in 0..b.len() {
            let i = b.index * 64 + j;
            let cands = candidates(&sources[i], h, w, p);
            let (dy, dx, flip, _) = cands
                .iter()
                .find(|c| c.3 == b.sample(j))
                .unwrap_or_else(|| panic!("sample {i} is no crop/flip of its source"));
            flips += usize::from(*flip);
            offsets.insert((*dy, *dx));
        }
    }
    assert!((140..260).contains(&flips), "{flips}/400 flipped");
    assert_eq!(offsets.len(), 25, "every offset in [0, 2p]^2 occurs");
    // Flip only: every sample is its source or its mirror.
    let ds = Synth::new(100, [3, 4, 1], 2);
    let sources: Vec<Vec<u8>> = (0..100).map(|i| ds.pixels(i)).collect();
    let l = loader(
        ds,
        LoaderConfig {
            shuffle: false,
            augment: AugmentConfig {
                crop_padding: 0,
                flip: true,
                ..AugmentConfig::default()
            },
            ..config(10, 0)
        },
    );
    let mut flipped = 0;
    for b in collect(l.epoch(0, 0)) {
        for j in 0..b.len() {
            let src = &sources[b.index * 10 + j];
            let mirror: Vec<u8> = src
                .chunks(4)
                .flat_map(|r| r.iter().rev().copied())
                .collect();
            if b.sample(j) == &mirror[..] {
                flipped += 1;
            } else {
                assert_eq!(b.sample(j), &src[..]);
            }
        }
    }
    assert!((25..75).contains(&flipped), "{flipped}/100 flipped");
}

#[test]
fn resume_mid_epoch_is_exact() {
    for workers in [0, 2] {
        let l = loader(Synth::new(77, [4, 4, 2], 10), augmented(workers, 3));
        let full = collect(l.epoch(4, 0));
        assert_eq!(full.len(), l.batches_per_epoch());
        for k in [0, 1, 5, full.len() - 1, full.len()] {
            let resumed = collect(l.epoch(4, k));
            assert_eq!(resumed.len(), full.len() - k);
            assert!(resumed[..] == full[k..], "workers {workers}, start {k}");
        }
        let mut past = l.epoch(4, full.len() + 1);
        let e = past.next().unwrap().unwrap_err();
        assert!(matches!(e, LoaderError::Start { .. }), "{e}");
        assert!(past.next().is_none());
    }
}

#[test]
fn drop_last_counts() {
    for workers in [0, 3] {
        let keep = loader(
            Synth::new(10, [1, 1, 4], 2),
            LoaderConfig {
                drop_last: false,
                ..config(4, workers)
            },
        );
        assert_eq!(keep.batches_per_epoch(), 3);
        let b = collect(keep.epoch(0, 0));
        assert_eq!(b.iter().map(Batch::len).collect::<Vec<_>>(), [4, 4, 2]);
        assert_eq!(b[2].shape, [2, 1, 1, 4]);
        let drop = loader(
            Synth::new(10, [1, 1, 4], 2),
            LoaderConfig {
                drop_last: true,
                ..config(4, workers)
            },
        );
        assert_eq!(drop.batches_per_epoch(), 2);
        let b = collect(drop.epoch(0, 0));
        assert_eq!(b.iter().map(Batch::len).collect::<Vec<_>>(), [4, 4]);
        // An exact multiple keeps every batch either way.
        let exact = loader(
            Synth::new(12, [1, 1, 4], 2),
            LoaderConfig {
                drop_last: true,
                ..config(4, workers)
            },
        );
        assert_eq!(collect(exact.epoch(0, 0)).len(), 3);
    }
}

#[test]
fn empty_dataset_yields_no_batches() {
    let l = loader(Synth::new(0, [2, 2, 1], 0), config(4, 2));
    assert_eq!(l.batches_per_epoch(), 0);
    assert!(l.epoch(0, 0).next().is_none());
}

#[test]
fn invalid_configs_name_the_field() {
    let cases: Vec<(LoaderConfig, &str)> = vec![
        (
            LoaderConfig {
                batch_size: 0,
                ..config(4, 1)
            },
            "batch_size",
        ),
        (
            LoaderConfig {
                prefetch: 0,
                ..config(4, 1)
            },
            "prefetch",
        ),
        (
            LoaderConfig {
                timeout: Duration::ZERO,
                ..config(4, 1)
            },
            "timeout",
        ),
        (
            LoaderConfig {
                workers: 100_000,
                ..config(4, 1)
            },
            "workers",
        ),
        (
            LoaderConfig {
                augment: AugmentConfig {
                    crop_padding: 9,
                    flip: false,
                    ..AugmentConfig::default()
                },
                ..config(4, 1)
            },
            "augment.crop_padding",
        ),
        (
            LoaderConfig {
                drop_last: true,
                ..config(11, 1)
            },
            "batch_size",
        ),
    ];
    for (cfg, field) in cases {
        let e = DataLoader::new(Arc::new(Synth::new(10, [8, 8, 1], 2)), cfg.clone()).unwrap_err();
        assert!(
            matches!(&e, LoaderError::Config { field: f, .. } if *f == field),
            "{cfg:?}: {e}"
        );
        assert!(e.to_string().contains(field), "{e}");
    }
    let e = DataLoader::new(Arc::new(Synth::new(10, [0, 8, 1], 2)), config(4, 0)).unwrap_err();
    assert!(e.to_string().contains("dataset"), "{e}");
}

/// Runs an epoch expecting an error; returns it and how long it took.
fn first_error(l: &DataLoader) -> (LoaderError, Duration) {
    let start = Instant::now();
    for b in l.epoch(0, 0) {
        if let Err(e) = b {
            return (e, start.elapsed());
        }
    }
    panic!("the epoch ended without an error");
}

#[test]
fn a_panicking_read_is_an_error_naming_the_sample() {
    for workers in [0, 1, 4] {
        let mut ds = Synth::new(200, [4, 4, 1], 3);
        ds.panic_at = Some(137);
        let l = loader(
            ds,
            LoaderConfig {
                shuffle: false,
                ..config(10, workers)
            },
        );
        let (e, took) = first_error(&l);
        assert!(
            matches!(
                e,
                LoaderError::Panic {
                    index: 137,
                    batch: 13,
                    ..
                }
            ),
            "{e}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains("sample 137") && msg.contains("batch 13"),
            "{msg}"
        );
        assert!(
            msg.contains("on purpose"),
            "the panic message is kept: {msg}"
        );
        assert!(took < Duration::from_secs(1), "took {took:?}");
        // The workers survive: the next epoch runs up to the same error.
        let (e, _) = first_error(&l);
        assert!(matches!(e, LoaderError::Panic { index: 137, .. }), "{e}");
    }
}

#[test]
fn a_failing_read_is_an_error_naming_the_sample() {
    for workers in [0, 3] {
        let mut ds = Synth::new(50, [2, 2, 1], 3);
        ds.fail_at = Some(21);
        let l = loader(
            ds,
            LoaderConfig {
                shuffle: false,
                ..config(4, workers)
            },
        );
        let (e, took) = first_error(&l);
        assert!(
            matches!(
                e,
                LoaderError::Sample {
                    index: 21,
                    batch: 5,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("sample 21"), "{e}");
        assert!(took < Duration::from_secs(1), "took {took:?}");
        // The batches before the failing one are delivered, in order.
        let results: Vec<_> = l.epoch(0, 0).collect();
        assert_eq!(results.len(), 6, "workers {workers}");
        for (k, r) in results[..5].iter().enumerate() {
            assert_eq!(r.as_ref().expect("good batch").index, k);
        }
        assert!(results[5].is_err());
        // After an error the iterator ends.
        let mut it = l.epoch(0, 5);
        assert!(it.next().unwrap().is_err());
        assert!(it.next().is_none());
    }
}

#[test]
fn a_label_out_of_range_is_an_error() {
    let mut ds = Synth::new(8, [2, 2, 1], 3);
    ds.bad_label = Some(3);
    let l = loader(ds, config(4, 1));
    let (e, _) = first_error(&l);
    assert!(
        e.to_string().contains("label 3") && e.to_string().contains("num_classes = 3"),
        "{e}"
    );
}

#[test]
fn a_stuck_worker_times_out() {
    let mut ds = Synth::new(20, [2, 2, 1], 2);
    ds.slow_at = Some((0, Duration::from_millis(1500)));
    let l = loader(
        ds,
        LoaderConfig {
            shuffle: false,
            timeout: Duration::from_millis(200),
            ..config(4, 2)
        },
    );
    let (e, took) = first_error(&l);
    assert!(matches!(e, LoaderError::Timeout { batch: 0, .. }), "{e}");
    assert!(
        took >= Duration::from_millis(190) && took < Duration::from_secs(1),
        "{took:?}"
    );
}

#[test]
fn dropping_an_iterator_mid_epoch_then_starting_the_next_epoch() {
    let fresh = loader(Synth::new(300, [5, 5, 1], 7), augmented(0, 1));
    let want1 = collect(fresh.epoch(1, 0));
    let want2 = collect(fresh.epoch(2, 0));
    for workers in [1, 4] {
        let l = loader(Synth::new(300, [5, 5, 1], 7), augmented(workers, 6));
        let mut it = l.epoch(1, 0);
        assert!(it.next().unwrap().unwrap() == want1[0]);
        assert!(it.next().unwrap().unwrap() == want1[1]);
        drop(it);
        // No stale batch of epoch 1 may show up in epoch 2.
        let got = collect(l.epoch(2, 0));
        assert!(got == want2, "workers {workers}");
        // Many short-lived iterators in a row.
        for e in 0..50u64 {
            let mut it = l.epoch(e % 3, (e % 5) as usize);
            let b = it.next().unwrap().unwrap();
            assert_eq!((b.epoch, b.index), (e % 3, (e % 5) as usize));
        }
        let again = collect(l.epoch(1, 0));
        assert!(again == want1);
    }
}

#[test]
fn two_live_iterators_do_not_steal_each_others_batches() {
    let l = loader(Synth::new(90, [3, 3, 1], 5), augmented(3, 2));
    let want_a = collect(l.epoch(0, 0));
    let want_b = collect(l.epoch(1, 0));
    let (mut a, mut b) = (l.epoch(0, 0), l.epoch(1, 0));
    for k in 0..want_a.len() {
        assert!(b.next().unwrap().unwrap() == want_b[k]);
        assert!(a.next().unwrap().unwrap() == want_a[k]);
    }
    assert!(a.next().is_none() && b.next().is_none());
}

#[test]
fn prefetch_bounds_the_work_ahead_of_the_consumer() {
    let prefetch = 3;
    let bs = 5;
    let ds = Arc::new(Synth::new(1000, [2, 2, 1], 2));
    let l = DataLoader::new(
        ds.clone(),
        LoaderConfig {
            prefetch,
            ..config(bs, 4)
        },
    )
    .unwrap();
    let mut it = l.epoch(0, 0);
    it.next().unwrap().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let reads = ds.reads.load(Ordering::Relaxed);
    // Batch 0 was delivered; at most `prefetch` more may be made ahead.
    assert!(reads <= (1 + prefetch) * bs, "{reads} samples read ahead");
    assert!(
        reads >= (1 + prefetch) * bs - bs,
        "the workers prefetch: {reads}"
    );
    drop(it);
    // Dropping the iterator stops the work.
    std::thread::sleep(Duration::from_millis(100));
    assert!(ds.reads.load(Ordering::Relaxed) <= (1 + prefetch) * bs);
}

#[test]
fn dropping_the_loader_joins_its_workers() {
    let ds = Arc::new(Synth::new(100, [4, 4, 1], 2));
    let l = DataLoader::new(ds.clone(), config(3, 4)).unwrap();
    {
        let mut it = l.epoch(0, 0);
        it.next().unwrap().unwrap();
    }
    assert!(Arc::strong_count(&ds) > 1);
    let dyn_ds: &Arc<dyn Dataset> = l.dataset();
    assert_eq!(dyn_ds.len(), 100);
    let start = Instant::now();
    drop(l);
    assert!(start.elapsed() < Duration::from_secs(1));
    // Every worker has exited and released its handle on the dataset.
    assert_eq!(Arc::strong_count(&ds), 1);
}

#[test]
fn an_iterator_can_move_to_another_thread() {
    let l = loader(Synth::new(64, [4, 4, 1], 2), augmented(2, 2));
    let want = collect(l.epoch(0, 0));
    let got = std::thread::scope(|s| {
        let it = l.epoch(0, 0);
        s.spawn(move || collect(it)).join().unwrap()
    });
    assert!(got == want);
}

#[test]
fn micro_batches_cover_the_batch_in_order_and_lend_a_whole_one() {
    let batch = Batch {
        epoch: 3,
        index: 7,
        shape: [5, 1, 2, 1],
        pixels: (0..10).collect(),
        labels: vec![0, 1, 2, 3, 4],
        soft_targets: Some((0..10).map(|i| i as f32).collect()),
        recipes: None,
        features: None,
        values: None,
    };
    let parts: Vec<_> = batch.micro_batches(2).collect();
    assert_eq!(parts.len(), 3);
    assert_eq!(parts[2].shape, [1, 1, 2, 1]);
    assert_eq!(parts[1].pixels, vec![4, 5, 6, 7]);
    assert_eq!(parts[1].labels, vec![2, 3]);
    assert_eq!(parts[1].soft_targets, Some(vec![4.0, 5.0, 6.0, 7.0]));
    assert!(parts.iter().all(|p| p.epoch == 3 && p.index == 7));
    let rejoined: Vec<u8> = parts.iter().flat_map(|p| p.pixels.clone()).collect();
    assert_eq!(rejoined, batch.pixels);
    let whole: Vec<_> = batch.micro_batches(5).collect();
    assert!(matches!(whole[0], std::borrow::Cow::Borrowed(_)));
    assert_eq!(batch.micro_batches(0).count(), 5, "a size of 0 means 1");
}

#[test]
fn a_mirrored_batch_reverses_each_row_keeping_channels_together() {
    // Two samples of 2 rows x 3 columns x 2 channels: pixel (y, x) holds
    // channels [10y + x, 100 + 10y + x], so a reversed channel order shows.
    let sample: Vec<u8> = (0..2)
        .flat_map(|y| (0..3).flat_map(move |x| [10 * y + x, 100 + 10 * y + x]))
        .collect();
    let batch = Batch {
        epoch: 1,
        index: 2,
        shape: [2, 2, 3, 2],
        pixels: [sample.clone(), sample].concat(),
        labels: vec![4, 5],
        soft_targets: None,
        recipes: None,
        features: None,
        values: None,
    };
    let mirrored = batch.mirrored();
    let row0 = &mirrored.sample(1)[..6];
    assert_eq!(row0, &[2, 102, 1, 101, 0, 100]);
    assert_eq!(&mirrored.sample(0)[6..], &[12, 112, 11, 111, 10, 110]);
    assert_eq!(mirrored.labels, batch.labels);
    assert_eq!(
        mirrored.mirrored().pixels,
        batch.pixels,
        "mirroring twice is the identity"
    );
}

/// A resident batch's recipes, applied to the raw samples, give exactly the
/// pixel batch the loader makes without `resident`.
fn assert_recipes_make(ds: &Synth, recipe_batch: &Batch, pixel_batch: &Batch) {
    let [n, h, w, c] = pixel_batch.shape;
    assert_eq!(recipe_batch.shape, pixel_batch.shape);
    assert!(recipe_batch.pixels.is_empty());
    assert_eq!(recipe_batch.labels, pixel_batch.labels);
    let recipes = recipe_batch.recipes.as_ref().expect("recipes");
    assert_eq!(recipes.len(), n);
    let mut out = vec![0u8; h * w * c];
    for (j, r) in recipes.iter().enumerate() {
        r.apply(&ds.pixels(r.id as usize), &mut out, [h, w, c]);
        assert_eq!(&out[..], pixel_batch.sample(j), "sample {j}: {r:?}");
    }
}

#[test]
fn resident_batches_describe_the_same_crops_and_flips() {
    let pixels = collect(loader(Synth::new(53, [6, 5, 3], 10), augmented(2, 2)).epoch(2, 0));
    let resident = LoaderConfig {
        resident: true,
        ..augmented(2, 2)
    };
    let recipes = collect(loader(Synth::new(53, [6, 5, 3], 10), resident.clone()).epoch(2, 0));
    assert_eq!(recipes.len(), pixels.len());
    let ds = Synth::new(53, [6, 5, 3], 10);
    for (r, p) in recipes.iter().zip(&pixels) {
        assert_recipes_make(&ds, r, p);
    }
    let flips = recipes
        .iter()
        .flat_map(|b| b.recipes.iter().flatten())
        .filter(|r| r.flip)
        .count();
    assert!(flips > 10 && flips < 43, "{flips} flips of 53");

    // Mid-epoch resume gives the same recipes.
    let resumed = collect(loader(Synth::new(53, [6, 5, 3], 10), resident).epoch(2, 3));
    assert_eq!(resumed[..], recipes[3..]);
}

#[test]
fn recipe_batches_slice_and_mirror_like_pixel_batches() {
    let config = LoaderConfig {
        resident: true,
        ..augmented(0, 1)
    };
    let ds = Synth::new(9, [4, 4, 2], 3);
    let batch =
        collect(loader(Synth::new(9, [4, 4, 2], 3), config.clone()).epoch(0, 0)).swap_remove(0);
    let pixel_batch =
        collect(loader(Synth::new(9, [4, 4, 2], 3), augmented(0, 1)).epoch(0, 0)).swap_remove(0);
    let parts: Vec<Batch> = batch.micro_batches(3).map(|b| b.into_owned()).collect();
    let pixel_parts: Vec<Batch> = pixel_batch
        .micro_batches(3)
        .map(|b| b.into_owned())
        .collect();
    assert_eq!(parts.len(), 3, "7 samples in parts of 3");
    for (r, p) in parts.iter().zip(&pixel_parts) {
        assert_recipes_make(&ds, r, p);
    }
    assert_recipes_make(&ds, &batch.mirrored(), &pixel_batch.mirrored());
}

#[test]
fn resident_batches_refuse_host_only_augmentations() {
    let cases = [
        (
            AugmentConfig {
                mixup_alpha: 0.2,
                ..AugmentConfig::default()
            },
            "augment.mixup_alpha",
        ),
        (
            AugmentConfig {
                cutmix_alpha: 1.0,
                ..AugmentConfig::default()
            },
            "augment.cutmix_alpha",
        ),
        (
            AugmentConfig {
                rand_augment: Some(headroom_loader::RandAugmentConfig::default()),
                ..AugmentConfig::default()
            },
            "augment.rand_augment",
        ),
    ];
    for (augment, field) in cases {
        let cfg = LoaderConfig {
            resident: true,
            augment,
            ..config(4, 0)
        };
        let e = DataLoader::new(Arc::new(Synth::new(10, [8, 8, 1], 2)), cfg).unwrap_err();
        assert!(
            matches!(&e, LoaderError::Config { field: f, .. } if *f == field),
            "{e}"
        );
        assert!(e.to_string().contains("data.on_device = false"), "{e}");
    }
}

#[test]
fn ranks_make_the_slices_of_one_process_s_global_batches() {
    use headroom_loader::Shard;
    let world = 3;
    let single = LoaderConfig {
        batch_size: 4 * world,
        drop_last: true,
        ..augmented(2, 2)
    };
    let whole = collect(loader(Synth::new(50, [6, 6, 1], 5), single.clone()).epoch(1, 0));
    let ranks: Vec<Vec<Batch>> = (0..world)
        .map(|rank| {
            let config = LoaderConfig {
                batch_size: 4,
                shard: Shard { rank, world },
                ..single.clone()
            };
            let l = loader(Synth::new(50, [6, 6, 1], 5), config);
            assert_eq!(l.batches_per_epoch(), 50 / 12);
            collect(l.epoch(1, 0))
        })
        .collect();
    assert_eq!(whole.len(), 4);
    for (b, global) in whole.iter().enumerate() {
        for (rank, batches) in ranks.iter().enumerate() {
            let part = global.slice(rank * 4..(rank + 1) * 4);
            assert_eq!(batches[b].pixels, part.pixels, "batch {b}, rank {rank}");
            assert_eq!(batches[b].labels, part.labels, "batch {b}, rank {rank}");
        }
    }
    // A shard that keeps an incomplete last batch is refused.
    let keep_last = LoaderConfig {
        batch_size: 4,
        drop_last: false,
        shard: Shard { rank: 0, world },
        ..single
    };
    let err =
        DataLoader::new(Arc::new(Synth::new(50, [6, 6, 1], 5)), keep_last).expect_err("refused");
    assert!(err.to_string().contains("drop_last"), "{err}");
}
