//! Data-parallel training on ranks as threads of this process (the same
//! collectives and protocol as over MPI): N ranks of one micro-batch end
//! in the weights of one process accumulating N micro-batches, bit for
//! bit; a stop asked by one rank stops every rank after the same step,
//! and the leader's checkpoint resumes to the uninterrupted weights.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Duration;

use headroom_dist::threads::group;
use headroom_pipeline::checkpoint;
use headroom_pipeline::ranks::Ranks;
use headroom_pipeline::{train, ExperimentConfig, Overrides, Resume, TrainOptions};

fn smoke(dir: &Path, sets: &[(&str, String)]) -> ExperimentConfig {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments/smoke.toml");
    let mut all = vec![
        ("run.output_dir", dir.display().to_string()),
        ("data.train_samples", "512".into()),
        ("data.test_samples", "128".into()),
        ("train.epochs", "2".into()),
        ("train.threads", "1".into()),
        ("run.log_every", "1000".into()),
    ];
    all.extend(sets.iter().cloned());
    let overrides = Overrides(all.into_iter().map(|(k, v)| (k.to_string(), v)).collect());
    ExperimentConfig::load(&path, &overrides).expect("smoke experiment")
}

fn options(resume: Resume) -> TrainOptions {
    TrainOptions {
        resume,
        allow_install: true,
        ..TrainOptions::default()
    }
}

/// The weights of the newest checkpoint in `dir`.
fn weights(dir: &Path) -> Vec<Vec<f32>> {
    let (found, _) = checkpoint::newest_valid(dir).expect("listing");
    let (path, _) = found.expect("a checkpoint");
    checkpoint::load(&path).expect("loads").params
}

fn same_bits(a: &[Vec<f32>], b: &[Vec<f32>]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
        })
}

/// Trains `config` on `world` thread ranks; `stop_rank` asks rank k to
/// stop at once (its stop flag set before it starts).
fn on_ranks(
    world: usize,
    config: ExperimentConfig,
    resume: Resume,
    stop_rank: Option<usize>,
) -> Vec<Result<headroom_pipeline::RunSummary, String>> {
    on_ranks_with(world, |_| config.clone(), resume, stop_rank)
}

/// Trains on `world` thread ranks, rank k with `configs(k)`.
fn on_ranks_each(
    world: usize,
    configs: impl Fn(usize) -> ExperimentConfig,
) -> Vec<Result<headroom_pipeline::RunSummary, String>> {
    on_ranks_with(world, configs, Resume::No, None)
}

fn on_ranks_with(
    world: usize,
    configs: impl Fn(usize) -> ExperimentConfig,
    resume: Resume,
    stop_rank: Option<usize>,
) -> Vec<Result<headroom_pipeline::RunSummary, String>> {
    let handles: Vec<_> = group(world)
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            let config = configs(rank);
            let resume = resume.clone();
            std::thread::spawn(move || {
                let ranks = Ranks::new(Box::new(t), 1 << 12, Duration::from_secs(60));
                if stop_rank == Some(ranks.rank) {
                    ranks.requested.store(true, Ordering::SeqCst);
                }
                let options = TrainOptions {
                    ranks: Some(ranks),
                    ..options(resume)
                };
                train(&config, &options).map_err(|e| e.to_string())
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("headroom-dp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn two_ranks_train_the_weights_of_one_process_accumulating_two_bit_for_bit() {
    let (one, two) = (scratch("one"), scratch("two"));
    let single = smoke(
        &one,
        &[
            ("train.batch_size", "64".into()),
            ("train.accumulate", "2".into()),
        ],
    );
    let alone = train(&single, &options(Resume::No)).expect("one process");
    let ranked = smoke(&two, &[("train.batch_size", "32".into())]);
    let results = on_ranks(2, ranked, Resume::No, None);
    for (rank, r) in results.iter().enumerate() {
        let summary = r.as_ref().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(
            summary.step, alone.step,
            "rank {rank} took another number of steps"
        );
        // Every rank scores the same weights and buffers on the same test set.
        assert_eq!(
            summary.test_loss,
            results[0].as_ref().expect("rank 0").test_loss
        );
    }
    assert!(alone.step > 0);
    // The epochs' training figures are the global batch's, as one
    // process's: the same loss and accuracy, to the bit.
    let leader = results[0].as_ref().expect("rank 0");
    for (a, b) in alone.epochs.iter().zip(&leader.epochs) {
        assert_eq!(
            a.train_loss.map(f32::to_bits),
            b.train_loss.map(f32::to_bits)
        );
        assert_eq!(
            a.train_accuracy.map(f32::to_bits),
            b.train_accuracy.map(f32::to_bits)
        );
    }
    assert_eq!(alone.epochs.len(), leader.epochs.len());
    assert!(
        same_bits(&weights(&one), &weights(&two)),
        "2 ranks × 32 ended in other weights than 1 process × 64 in 2 micro-batches"
    );
    // The test set was scored sharded (each rank half of each batch,
    // joined): the figures of one process scoring the same checkpoint.
    let (found, _) = checkpoint::newest_valid(&two).expect("listing");
    let (newest, _) = found.expect("a checkpoint");
    let alone_eval = headroom_pipeline::eval::evaluate_checkpoint(&newest, None, 64, None)
        .expect("one process scores the checkpoint");
    assert_eq!(alone_eval.samples, 128);
    assert_eq!(alone_eval.accuracy, leader.test_accuracy);
    let loss = leader.test_loss.expect("a test loss");
    assert!(
        (alone_eval.loss - loss).abs() <= 1e-5 * loss.abs(),
        "{} against {loss}",
        alone_eval.loss
    );
    // The follower trained in a scratch directory of its own, removed at
    // the end; the leader in the run's.
    let leader = results[0].as_ref().expect("rank 0");
    let follower = results[1].as_ref().expect("rank 1");
    assert_eq!(leader.output_dir, two);
    assert_ne!(follower.output_dir, two);
    assert!(
        !follower.output_dir.exists(),
        "{}",
        follower.output_dir.display()
    );
    let _ = (std::fs::remove_dir_all(&one), std::fs::remove_dir_all(&two));
}

#[test]
fn a_stop_asked_by_one_rank_stops_all_and_the_leader_s_checkpoint_resumes_exactly() {
    let (whole, parts) = (scratch("whole"), scratch("parts"));
    let uninterrupted = on_ranks(2, smoke(&whole, &[]), Resume::No, None);
    let steps = uninterrupted[0].as_ref().expect("rank 0").step;
    // Rank 1 asks to stop at once: both stop after the first step.
    let stopped = on_ranks(2, smoke(&parts, &[]), Resume::No, Some(1));
    for (rank, r) in stopped.iter().enumerate() {
        let summary = r.as_ref().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert!(summary.interrupted, "rank {rank} was not stopped");
        assert_eq!(
            summary.step, 1,
            "rank {rank} stopped after step {}",
            summary.step
        );
    }
    let resumed = on_ranks(2, smoke(&parts, &[]), Resume::Latest, None);
    let errors: Vec<_> = resumed.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(errors.is_empty(), "{errors:?}");
    for (rank, r) in resumed.iter().enumerate() {
        let summary = r.as_ref().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(summary.step, steps, "rank {rank}");
        assert!(summary.resumed_from.is_some(), "rank {rank} did not resume");
    }
    assert!(same_bits(&weights(&whole), &weights(&parts)));
    let _ = (
        std::fs::remove_dir_all(&whole),
        std::fs::remove_dir_all(&parts),
    );
}

#[test]
fn ranks_with_different_settings_are_refused_at_start_naming_the_rank() {
    let dir = scratch("differ");
    let handles: Vec<_> = group(2)
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            let lr = if rank == 0 { "0.005" } else { "0.01" };
            let config = smoke(&dir, &[("optimizer.lr", lr.into())]);
            std::thread::spawn(move || {
                let ranks = Ranks::new(Box::new(t), 1 << 12, Duration::from_secs(60));
                let options = TrainOptions {
                    ranks: Some(ranks),
                    ..options(Resume::No)
                };
                train(&config, &options)
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            })
        })
        .collect();
    for h in handles {
        let err = h.join().expect("rank thread").expect_err("refused");
        assert!(
            err.contains("experiment") && err.contains("rank 1"),
            "{err}"
        );
    }
    assert!(!dir.exists(), "a refused start made the run directory");
}

/// The newest checkpoint's whole learner state in `dir`.
fn state(dir: &Path) -> checkpoint::Checkpoint {
    let (found, _) = checkpoint::newest_valid(dir).expect("listing");
    let (path, _) = found.expect("a checkpoint");
    checkpoint::load(&path).expect("loads")
}

#[test]
fn zero_1_trains_the_weights_and_moments_of_plain_data_parallel_bit_for_bit() {
    for world in [2usize, 3] {
        let (plain, sharded) = (
            scratch(&format!("plain{world}")),
            scratch(&format!("zero{world}")),
        );
        let unsharded = on_ranks(world, smoke(&plain, &[]), Resume::No, None);
        let zero = on_ranks(
            world,
            smoke(&sharded, &[("train.shard_optimizer", "true".into())]),
            Resume::No,
            None,
        );
        for (rank, (a, b)) in unsharded.iter().zip(&zero).enumerate() {
            let a = a
                .as_ref()
                .unwrap_or_else(|e| panic!("plain rank {rank}: {e}"));
            let b = b
                .as_ref()
                .unwrap_or_else(|e| panic!("sharded rank {rank}: {e}"));
            assert_eq!(a.step, b.step);
            assert!(b.step > 0);
            assert_eq!(
                a.test_loss.map(f32::to_bits),
                b.test_loss.map(f32::to_bits),
                "rank {rank}"
            );
        }
        let (a, b) = (state(&plain), state(&sharded));
        assert!(
            same_bits(&a.params, &b.params),
            "world {world}: ZeRO-1 ended in other weights than plain data parallel"
        );
        // The leader's checkpoint holds every rank's moments, gathered.
        assert_eq!(a.optimizer.step, b.optimizer.step);
        assert!(same_bits(
            &a.optimizer.first_moment,
            &b.optimizer.first_moment
        ));
        assert!(same_bits(
            &a.optimizer.second_moment,
            &b.optimizer.second_moment
        ));
        assert!(same_bits(&a.buffers, &b.buffers));
        let _ = (
            std::fs::remove_dir_all(&plain),
            std::fs::remove_dir_all(&sharded),
        );
    }
}

#[test]
fn a_stopped_zero_1_run_resumes_sharded_or_not_to_the_uninterrupted_weights() {
    let zero = || vec![("train.shard_optimizer", "true".to_string())];
    let (whole, parts, mixed) = (scratch("zwhole"), scratch("zparts"), scratch("zmixed"));
    let uninterrupted = on_ranks(2, smoke(&whole, &[]), Resume::No, None);
    let steps = uninterrupted[0].as_ref().expect("rank 0").step;
    for dir in [&parts, &mixed] {
        let stopped = on_ranks(2, smoke(dir, &zero()), Resume::No, Some(0));
        for (rank, r) in stopped.iter().enumerate() {
            let summary = r.as_ref().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            assert!(summary.interrupted && summary.step == 1, "rank {rank}");
        }
    }
    // Resumed sharded, and resumed unsharded from the sharded checkpoint
    // (the checkpoint is whole: the same format either way).
    for (dir, sets) in [(&parts, zero()), (&mixed, Vec::new())] {
        let resumed = on_ranks(2, smoke(dir, &sets), Resume::Latest, None);
        for (rank, r) in resumed.iter().enumerate() {
            let summary = r.as_ref().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            assert_eq!(summary.step, steps, "rank {rank}");
            assert!(summary.resumed_from.is_some());
        }
        assert!(
            same_bits(&weights(&whole), &weights(dir)),
            "{} resumed to other weights",
            dir.display()
        );
    }
    for dir in [&whole, &parts, &mixed] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn when_one_rank_runs_out_of_memory_every_rank_follows_the_policy_and_the_weights_stay_one_run_s() {
    for shard in ["false", "true"] {
        let (plain, oom) = (
            scratch(&format!("nooom{shard}")),
            scratch(&format!("oom{shard}")),
        );
        let sets = |dir: &Path, steps: &str| {
            let mut sets = vec![("train.shard_optimizer", shard.to_string())];
            if !steps.is_empty() {
                sets.push(("device.inject_oom.steps", steps.to_string()));
            }
            smoke(dir, &sets)
        };
        let clean = on_ranks_each(2, |_| sets(&plain, ""));
        // Rank 1 alone is refused a block in steps 0, 3 and 12: the ranks
        // undo the step, release their caches and retry it together.
        let faulty = on_ranks_each(2, |rank| {
            sets(&oom, if rank == 1 { "[0, 3, 12]" } else { "" })
        });
        for (rank, (a, b)) in clean.iter().zip(&faulty).enumerate() {
            let a = a.as_ref().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            let b = b
                .as_ref()
                .unwrap_or_else(|e| panic!("rank {rank} with the fault: {e}"));
            assert_eq!(a.step, b.step, "rank {rank}");
            // Every rank of the faulty run counts rank 1's three refusals.
            assert_eq!((a.oom_events, b.oom_events), (0, 3), "rank {rank}");
        }
        assert!(
            same_bits(&weights(&plain), &weights(&oom)),
            "shard_optimizer = {shard}: the retried steps changed the weights"
        );
        let _ = (
            std::fs::remove_dir_all(&plain),
            std::fs::remove_dir_all(&oom),
        );
    }
}
