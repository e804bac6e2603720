//! Training end to end through the library: the smoke network learns, and a
//! resumed run ends with the same weights, bit for bit, as one never stopped.

use std::path::Path;

use headroom_pipeline::checkpoint;
use headroom_pipeline::{train, Resume, TrainOptions};
use headroom_tests::{smoke_config, write_synthetic_fashion_mnist};

fn step_losses(run_dir: &Path) -> Vec<f64> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    text.lines()
        .filter(|l| l.contains("\"kind\":\"step\""))
        .map(|l| {
            let at = l.find("\"loss\":").unwrap() + 7;
            let end = l[at..].find(',').unwrap() + at;
            l[at..end].parse().unwrap()
        })
        .collect()
}

/// The newest checkpoint in `dir`.
fn newest(dir: &Path) -> checkpoint::Checkpoint {
    let files = checkpoint::list(dir).unwrap();
    checkpoint::load(files.last().unwrap()).unwrap()
}

/// Two runs' checkpoints hold the same step and the same state, bit for bit.
fn assert_same_state(a: &checkpoint::Checkpoint, b: &checkpoint::Checkpoint, after: &str) {
    assert_eq!(a.meta.step, b.meta.step);
    assert!(a.params == b.params, "weights differ after {after}");
    assert!(
        a.buffers == b.buffers,
        "batch-norm statistics differ after {after}"
    );
    assert!(
        a.optimizer == b.optimizer,
        "optimizer moments differ after {after}"
    );
}

#[test]
fn smoke_network_loss_falls_well_below_its_start() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 1024, 256);
    let out = tempfile::tempdir().unwrap();
    let config = smoke_config(data.path(), out.path(), &["train.epochs=3"]);
    let summary = train(&config, &TrainOptions::default()).unwrap();

    let losses = step_losses(out.path());
    assert_eq!(losses.len(), 3 * (1024 / 32));
    let first = losses[..4].iter().sum::<f64>() / 4.0;
    let last = losses[losses.len() - 8..].iter().sum::<f64>() / 8.0;
    assert!(
        first > 2.0,
        "the first steps should be near ln(10): {first}"
    );
    assert!(
        last < 0.5 * first,
        "loss fell only from {first:.3} to {last:.3}"
    );
    let accuracy = summary.test_accuracy.unwrap();
    assert!(accuracy > 0.9, "test accuracy {accuracy}");
    assert_eq!(summary.epochs.len(), 3);
    assert!(summary.last_checkpoint.is_some());
}

#[test]
fn resumed_run_matches_an_uninterrupted_one_bit_for_bit() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 512, 64);
    let straight = tempfile::tempdir().unwrap();
    let config = smoke_config(
        data.path(),
        straight.path(),
        &["train.epochs=3", "train.threads=2"],
    );
    train(&config, &TrainOptions::default()).unwrap();

    // Run again, lose the last epoch's checkpoint as a kill would, resume.
    let interrupted = tempfile::tempdir().unwrap();
    let config = smoke_config(
        data.path(),
        interrupted.path(),
        &["train.epochs=3", "train.threads=2"],
    );
    train(&config, &TrainOptions::default()).unwrap();
    let files = checkpoint::list(interrupted.path()).unwrap();
    std::fs::remove_file(files.last().unwrap()).unwrap();
    // A kill in the middle of a write leaves its temporary behind; the
    // resume removes it, and only it.
    let unfinished = interrupted
        .path()
        .join(format!(".{}.tmp", checkpoint::file_name(999_999)));
    let unrelated = interrupted.path().join("notes.tmp");
    std::fs::write(&unfinished, [7u8; 4096]).unwrap();
    std::fs::write(&unrelated, "mine").unwrap();
    let options = TrainOptions {
        resume: Resume::Latest,
        ..Default::default()
    };
    let summary = train(&config, &options).unwrap();
    assert_eq!(summary.epochs.len(), 1, "only the lost epoch is run again");
    assert_eq!(summary.resumed_from.as_ref(), Some(&files[files.len() - 2]));
    assert!(!unfinished.exists() && unrelated.exists());

    assert_same_state(
        &newest(straight.path()),
        &newest(interrupted.path()),
        "resume",
    );
}

#[test]
fn resume_refuses_a_checkpoint_of_another_model() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 256, 64);
    let out = tempfile::tempdir().unwrap();
    let config = smoke_config(data.path(), out.path(), &["train.epochs=1"]);
    train(&config, &TrainOptions::default()).unwrap();

    let mut other = config.clone();
    other.model.layers.pop();
    other.model.layers.push(headroom_model::LayerSpec::Linear {
        out: 12,
        bias: true,
    });
    let options = TrainOptions {
        resume: Resume::Latest,
        ..Default::default()
    };
    let err = train(&other, &options).unwrap_err().to_string();
    assert!(
        err.contains("different model") && err.contains(".ckpt"),
        "{err}"
    );
}

#[test]
fn resume_names_a_changed_setting_and_allows_more_epochs() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 256, 64);
    let out = tempfile::tempdir().unwrap();
    let config = smoke_config(data.path(), out.path(), &["train.epochs=1"]);
    train(&config, &TrainOptions::default()).unwrap();
    let options = TrainOptions {
        resume: Resume::Latest,
        ..Default::default()
    };

    // The seed shapes the result (the lr may change: the divergence advice).
    let changed = smoke_config(data.path(), out.path(), &["train.epochs=1", "run.seed=3"]);
    let err = train(&changed, &options).unwrap_err().to_string();
    assert!(err.contains("run.seed was 0, now 3"), "{err}");

    let longer = smoke_config(data.path(), out.path(), &["train.epochs=2"]);
    let summary = train(&longer, &options).unwrap();
    assert_eq!(summary.epochs.len(), 1);
    assert_eq!(summary.epoch, 2);
}

#[test]
fn a_diverging_run_keeps_no_state_from_after_its_bad_update_and_the_advice_works() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 256, 64);
    let out = tempfile::tempdir().unwrap();
    let settings = |lr: &str, clip: &str| {
        smoke_config(
            data.path(),
            out.path(),
            &[
                "train.epochs=1",
                &format!("optimizer.lr={lr}"),
                &format!("train.clip_norm={clip}"),
                "train.max_consecutive_skips=3",
                "checkpoint.every_steps=1",
            ],
        )
    };
    // A learning rate of 1e35: the first update is accepted (its gradient
    // is finite) and leaves weights that are finite but give NaN; every
    // step after it is skipped.
    let diverging = settings("1e35", "0");
    let err = train(&diverging, &TrainOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("non-finite") && err.contains("3 steps") && err.contains("made step 1"),
        "{err}"
    );
    assert!(err.contains("starts from the beginning"), "{err}");
    // The checkpoint written after that update is set aside, not deleted.
    assert!(checkpoint::list(out.path()).unwrap().is_empty());
    let aside: Vec<_> = std::fs::read_dir(out.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".ckpt.diverged"))
        .collect();
    assert_eq!(aside, vec!["checkpoint-step0000000001.ckpt.diverged"]);

    let resume = TrainOptions {
        resume: Resume::Latest,
        ..Default::default()
    };
    // The same settings again diverge again.
    let err = train(&diverging, &resume).unwrap_err().to_string();
    assert!(err.contains("3 steps"), "{err}");
    // The advice followed: a lower learning rate and a clip. The epoch
    // finishes, its figures real ones.
    let summary = train(&settings("1e-3", "1.0"), &resume).unwrap();
    let epoch = &summary.epochs[0];
    assert!(epoch.train_loss.is_some_and(f32::is_finite), "{epoch:?}");
    assert!(summary.test_loss.is_some_and(f32::is_finite));
    assert_eq!(epoch.skipped_steps, 0, "{epoch:?}");
}

#[test]
fn a_run_whose_updates_would_overflow_skips_them_and_keeps_only_finite_state() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 256, 64);
    let out = tempfile::tempdir().unwrap();
    // A constant learning rate of 1e38: every gradient is finite, but AdamW's step
    // size lr / (1 - β1) is beyond f32, so each update would write
    // infinities. Each is skipped instead, and the run stops as diverging
    // with nothing non-finite ever applied or checkpointed.
    let config = smoke_config(
        data.path(),
        out.path(),
        &[
            "train.epochs=1",
            "optimizer.lr=1e38",
            "schedule.kind=constant",
            "train.clip_norm=0",
            "train.max_consecutive_skips=3",
            "checkpoint.every_steps=1",
        ],
    );
    let err = train(&config, &TrainOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("non-finite") && err.contains("3 steps"),
        "{err}"
    );
    // No update was applied, so nothing is set aside as diverged.
    let names: Vec<_> = std::fs::read_dir(out.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !names.iter().any(|name| name.ends_with(".diverged")),
        "{names:?}"
    );
}

#[test]
fn an_evaluation_whose_loss_is_not_finite_is_an_error_not_a_result() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 64, 32);
    let out = tempfile::tempdir().unwrap();
    // The first update (learning rate 1e35) leaves weights that give NaN;
    // the run would skip 100 steps before stopping, so the epoch ends first.
    let config = smoke_config(
        data.path(),
        out.path(),
        &[
            "train.epochs=1",
            "optimizer.lr=1e35",
            "train.clip_norm=0",
            "train.max_consecutive_skips=100",
        ],
    );
    let err = train(&config, &TrainOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("epoch 1") && err.contains("test loss is NaN") && err.contains("--resume"),
        "{err}"
    );
    assert!(
        checkpoint::list(out.path()).unwrap().is_empty(),
        "no checkpoint of those weights"
    );
}

/// A store of `samples` synthetic 28×28 images in shards of `per_shard`.
fn synthetic_store(dir: &Path, samples: usize, per_shard: usize) -> headroom_loader::StoreSummary {
    headroom_loader::write_synthetic_store(
        dir,
        samples,
        [28, 28, 1],
        10,
        headroom_loader::ShardSize::Samples(per_shard),
    )
    .unwrap()
}

#[test]
fn store_ten_times_the_cache_trains_within_the_loader_budget() {
    let store = tempfile::tempdir().unwrap();
    let mut shard_bytes = 0;
    for (split, samples) in [("train", 2000), ("test", 200)] {
        let summary = synthetic_store(&store.path().join(split), samples, 100);
        if split == "train" {
            assert_eq!(summary.shards, 20, "ten times the two-shard cache");
            shard_bytes = summary.total_bytes.div_ceil(summary.shards as u64) as usize;
        }
    }
    let out = tempfile::tempdir().unwrap();
    let cache_limit = 2 * shard_bytes;
    let budget = cache_limit + 4 * 32 * 784;
    let config = smoke_config(
        store.path(),
        out.path(),
        &[
            "data.format=shards",
            "data.train_samples=0",
            "data.test_samples=0",
            "train.epochs=2",
            "loader.max_cache_shards=2",
            &format!("loader.memory_budget={budget}"),
        ],
    );
    let summary = train(&config, &TrainOptions::default()).unwrap();
    let memory = summary.loader_memory;
    assert_eq!(memory.budget, Some(budget as u64));
    assert!(memory.cache_peak_bytes > 0);
    assert!(
        memory.cache_peak_bytes <= cache_limit as u64,
        "cache peak {}",
        memory.cache_peak_bytes
    );
    assert!(memory.cache_peak_bytes + memory.prefetched_bytes_max <= budget as u64);
    assert_eq!(summary.epochs.len(), 2);

    // One byte less than the cache and the prefetched batches need is refused.
    let tight = smoke_config(
        store.path(),
        out.path().join("tight").as_path(),
        &[
            "data.format=shards",
            "data.train_samples=0",
            "data.test_samples=0",
            "loader.max_cache_shards=2",
            "loader.memory_budget=1000",
        ],
    );
    let err = train(&tight, &TrainOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("memory_budget"), "{err}");
}

/// Flips 8 bytes in the middle of `shard`, as a failing disk or a torn copy
/// would; returns the good bytes.
fn corrupt(shard: &Path) -> Vec<u8> {
    let good = std::fs::read(shard).unwrap();
    let mut bad = good.clone();
    let middle = bad.len() / 2;
    bad[middle..middle + 8].copy_from_slice(b"XXXXXXXX");
    std::fs::write(shard, &bad).unwrap();
    good
}

/// A run of the smoke network on the shard store at `store`, two epochs.
fn store_config(store: &Path, out: &Path, extra: &[&str]) -> headroom_pipeline::ExperimentConfig {
    let mut sets = vec![
        "data.format=shards",
        "data.train_samples=0",
        "data.test_samples=0",
        "train.epochs=2",
        "train.threads=2",
    ];
    sets.extend_from_slice(extra);
    smoke_config(store, out, &sets)
}

/// A run stopped by a bad `shard` says which, and that it is saved.
fn assert_stopped_saved(err: &str, shard: &Path) {
    assert!(
        err.contains(&shard.display().to_string()) && err.contains("checksum"),
        "{err}"
    );
    assert!(
        err.contains("is saved in") && err.contains("--resume"),
        "{err}"
    );
}

#[test]
fn a_corrupt_shard_stops_with_a_checkpoint_and_the_repaired_store_resumes_bit_for_bit() {
    let store = tempfile::tempdir().unwrap();
    for (split, samples) in [("train", 640), ("test", 64)] {
        synthetic_store(&store.path().join(split), samples, 80);
    }
    let straight = tempfile::tempdir().unwrap();
    train(
        &store_config(store.path(), straight.path(), &[]),
        &TrainOptions::default(),
    )
    .unwrap();
    let finished = newest(straight.path());

    // Shards first read at batch 5 and at batch 15 of the first epoch's 20.
    for shard in ["train/shard-000003.bin", "train/shard-000001.bin"] {
        let shard = store.path().join(shard);
        let good = corrupt(&shard);
        let interrupted = tempfile::tempdir().unwrap();
        let config = store_config(store.path(), interrupted.path(), &[]);
        let err = train(&config, &TrainOptions::default())
            .unwrap_err()
            .to_string();
        assert_stopped_saved(&err, &shard);
        // The steps before the bad batch are in the checkpoint, not lost.
        let saved = checkpoint::list(interrupted.path()).unwrap();
        let stopped_at = newest(interrupted.path()).meta.step;
        assert!(
            stopped_at > 0 && stopped_at < 2 * 640 / 32,
            "stopped at step {stopped_at}"
        );
        assert!(err.contains(&format!("up to step {stopped_at}")), "{err}");

        // Repaired, the run goes on from there and ends where the run that
        // never met the bad shard ended.
        std::fs::write(&shard, &good).unwrap();
        let options = TrainOptions {
            resume: Resume::Latest,
            ..Default::default()
        };
        let summary = train(&config, &options).unwrap();
        assert_eq!(summary.resumed_from.as_ref(), saved.last());
        assert_same_state(&finished, &newest(interrupted.path()), "the repair");
        assert_eq!(
            step_losses(straight.path()),
            step_losses(interrupted.path())
        );
    }
}

/// Every line of one kind in a run's `metrics.jsonl`, less its timings.
fn metric_lines(run_dir: &Path, kind: &str) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
        .filter(|value| value["kind"] == kind)
        .map(|mut value| {
            let data = value["data"].as_object_mut().unwrap();
            data.retain(|key, _| !key.contains("seconds") && !key.contains("per_sec"));
            value
        })
        .collect()
}

#[test]
fn an_evaluation_that_fails_keeps_the_epoch_it_ends_and_the_resume_evaluates() {
    // Three test shards and a two-shard cache: each evaluation reads shard
    // 0 from disk again, after the start has checked the whole test set.
    let store = tempfile::tempdir().unwrap();
    synthetic_store(&store.path().join("train"), 640, 80);
    synthetic_store(&store.path().join("test"), 96, 32);
    let sets = [
        "loader.max_cache_shards=2",
        "checkpoint.every_steps=1",
        "checkpoint.keep=2",
    ];
    let straight = tempfile::tempdir().unwrap();
    train(
        &store_config(store.path(), straight.path(), &sets),
        &TrainOptions::default(),
    )
    .unwrap();

    // The test shard goes bad once the run has started (its first
    // checkpoint is on disk), 19 and 39 steps before the two evaluations.
    let shard = store.path().join("test/shard-000000.bin");
    let interrupted = tempfile::tempdir().unwrap();
    let config = store_config(store.path(), interrupted.path(), &sets);
    let good = std::thread::scope(|scope| {
        let spoiler = scope.spawn(|| loop {
            if !checkpoint::list(interrupted.path()).unwrap().is_empty() {
                return corrupt(&shard);
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        });
        let err = train(&config, &TrainOptions::default())
            .unwrap_err()
            .to_string();
        assert_stopped_saved(&err, &shard);
        assert!(err.contains("the evaluation after training epoch"), "{err}");
        spoiler.join().unwrap()
    });
    // The checkpoint holds the whole epoch the failed evaluation ended.
    let stopped = newest(interrupted.path()).meta;
    assert_eq!(stopped.batches_done, 640 / 32, "{stopped:?}");
    assert_eq!(stopped.step % (640 / 32), 0, "{stopped:?}");

    std::fs::write(&shard, &good).unwrap();
    let options = TrainOptions {
        resume: Resume::Latest,
        ..Default::default()
    };
    let summary = train(&config, &options).unwrap();
    assert_eq!(summary.epochs.len() as u64, 2 - stopped.epoch);
    assert_same_state(
        &newest(straight.path()),
        &newest(interrupted.path()),
        "the repair",
    );
    assert_eq!(
        step_losses(straight.path()),
        step_losses(interrupted.path())
    );
    // The resumed run evaluates the epoch that was trained: each epoch's
    // figures once, as the run that never failed logged them.
    assert_eq!(
        metric_lines(straight.path(), "epoch"),
        metric_lines(interrupted.path(), "epoch")
    );
}

#[test]
fn checkpoint_every_minutes_writes_checkpoints_inside_an_epoch() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 512, 64);
    let steps = 512 / 32;
    let run = |minutes: &str| {
        let out = tempfile::tempdir().unwrap();
        let every = format!("checkpoint.every_minutes={minutes}");
        let config = smoke_config(
            data.path(),
            out.path(),
            &["train.epochs=1", "checkpoint.keep=1000", &every],
        );
        train(&config, &TrainOptions::default()).unwrap();
        let files = checkpoint::list(out.path()).unwrap();
        files
            .iter()
            .map(|f| checkpoint::load(f).unwrap().meta.step)
            .collect::<Vec<_>>()
    };
    // 6 µs: overdue after every step, each of which takes longer.
    let every_step: Vec<u64> = (1..=steps).collect();
    assert_eq!(run("1e-7"), every_step);
    // An hour: only the epoch's end.
    assert_eq!(run("60"), vec![steps]);
    let out = tempfile::tempdir().unwrap();
    let err = headroom_pipeline::ExperimentConfig::load(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../experiments/smoke.toml"),
        &headroom_pipeline::Overrides::parse(&[
            format!("run.output_dir={}", out.path().display()),
            "checkpoint.every_minutes=-1".into(),
        ])
        .unwrap(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("checkpoint.every_minutes"), "{err}");
}

#[test]
fn resume_checks_the_training_set_and_never_rewrites_a_lost_record() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 64, 32);
    let out = tempfile::tempdir().unwrap();
    let epochs = |n: usize| smoke_config(data.path(), out.path(), &[&format!("train.epochs={n}")]);
    train(&epochs(1), &TrainOptions::default()).unwrap();
    let resume = TrainOptions {
        resume: Resume::Latest,
        ..Default::default()
    };
    let record = out.path().join("dataset.json");
    let read_record = || -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(&record).unwrap()).unwrap()
    };
    let fingerprint = read_record()["train_digest"].as_u64().expect("recorded");

    // A record from before the training set's fingerprint: compared on the
    // rest, then completed with the same fingerprint.
    let mut older = read_record();
    older.as_object_mut().unwrap().remove("train_digest");
    std::fs::write(&record, older.to_string()).unwrap();
    train(&epochs(2), &resume).unwrap();
    assert_eq!(read_record()["train_digest"].as_u64(), Some(fingerprint));

    // The training labels changed, the counts and the test set the same.
    let mut labels = vec![0, 0, 8, 1];
    labels.extend_from_slice(&64u32.to_be_bytes());
    labels.extend((0..64u8).map(|i| (i + 1) % 10));
    headroom_tests::gzip_to(&data.path().join("train-labels-idx1-ubyte.gz"), &labels);
    let err = train(&epochs(3), &resume).unwrap_err().to_string();
    assert!(
        err.contains("differs from the data this run started with")
            && err.contains("training digest"),
        "{err}"
    );

    // The record gone: refused, and not written anew.
    std::fs::remove_file(&record).unwrap();
    let err = train(&epochs(3), &resume).unwrap_err().to_string();
    assert!(err.contains("dataset.json could not be read"), "{err}");
    assert!(
        !record.exists(),
        "a lost record is never silently rewritten"
    );
}
