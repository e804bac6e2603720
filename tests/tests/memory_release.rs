//! Memory given back when the settings say, on the CPU: the periodic cache
//! release (`memory.empty_cache_every`) and the release after each
//! checkpoint (`memory.empty_cache_after_checkpoint`) happen as often as
//! set, really return memory, and change no result; two experiments in
//! sequence in one process each leave their pool empty and the second starts
//! from nothing of the first; the micro-batch planned under a
//! `device.memory_limit` is the largest that fits, which is checked by
//! training at it and at twice it, not by the planner's own arithmetic.
//! On the GPU path too (a real GPU where there is one, else the CPU
//! emulator of CUDA; where the build found no NVRTC that test is built as
//! ignored): two runs in sequence give the device back its memory.

use std::path::Path;

use headroom_pipeline::checkpoint;
use headroom_pipeline::device::{gpu_memory, DeviceKind};
use headroom_pipeline::{train, ExperimentConfig, RunSummary, TrainOptions};
use headroom_tests::{
    budget_between_32_and_64, cuda_path_available, smoke_config, write_synthetic_fashion_mnist,
};

headroom_tests::report_nvrtc_tests!("memory_release", include_str!("memory_release.rs"));

/// The smoke experiment, small: 64 samples in batches of 32 make two steps
/// an epoch.
/// On the CPU unless `extra` names a device: a run that only asks which
/// device to use would probe CUDA before the GPU test has loaded the
/// emulator, and the probe's answer is kept for the whole process.
fn config(data: &Path, out: &Path, extra: &[&str]) -> ExperimentConfig {
    let mut sets = vec!["train.threads=2", "augment.crop_padding=0"];
    if !extra.iter().any(|set| set.starts_with("device.kind=")) {
        sets.push("device.kind=cpu");
    }
    sets.extend_from_slice(extra);
    smoke_config(data, out, &sets)
}

fn run(data: &Path, out: &Path, extra: &[&str]) -> RunSummary {
    train(&config(data, out, extra), &TrainOptions::default()).unwrap()
}

fn final_params(dir: &Path) -> Vec<Vec<f32>> {
    let files = checkpoint::list(dir).unwrap();
    checkpoint::load(files.last().unwrap()).unwrap().params
}

fn data(train: usize, test: usize) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(dir.path(), train, test);
    dir
}

#[test]
fn the_periodic_cache_release_comes_every_n_steps_and_changes_nothing() {
    let data = data(64, 32);
    let outs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    // Two epochs of two steps: four steps.
    let every_step = run(
        data.path(),
        outs[0].path(),
        &["train.epochs=2", "memory.empty_cache_every=1"],
    );
    let every_other = run(
        data.path(),
        outs[1].path(),
        &["train.epochs=2", "memory.empty_cache_every=2"],
    );
    let never = run(data.path(), outs[2].path(), &["train.epochs=2"]);
    assert_eq!(every_step.step, 4);
    assert_eq!(every_step.cache_cleanups, 4, "one release per step");
    assert_eq!(every_other.cache_cleanups, 2, "after steps 2 and 4");
    assert_eq!(never.cache_cleanups, 0);
    // Released memory is really gone: the next step takes it from the OS
    // again, where a run that keeps its cache finds it there.
    assert!(
        every_step.memory.cache_misses > never.memory.cache_misses,
        "released every step: {:?}, never: {:?}",
        every_step.memory,
        never.memory
    );
    assert!(every_step.memory.cache_misses > every_other.memory.cache_misses);
    let reference = final_params(outs[2].path());
    assert!(final_params(outs[0].path()) == reference, "weights changed");
    assert!(final_params(outs[1].path()) == reference, "weights changed");
}

#[test]
fn a_cache_release_follows_every_checkpoint() {
    let data = data(64, 32);
    let (on, off) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // One checkpoint an epoch, and every one kept, so the files count them.
    let sets = ["train.epochs=3", "checkpoint.keep=10"];
    let released = run(
        data.path(),
        on.path(),
        &[sets[0], sets[1], "memory.empty_cache_after_checkpoint=true"],
    );
    let kept = run(data.path(), off.path(), &sets);
    let written = checkpoint::list(on.path()).unwrap().len() as u64;
    assert!(written >= 3, "one checkpoint an epoch: {written}");
    assert_eq!(released.cache_cleanups, written, "one release a checkpoint");
    assert_eq!(kept.cache_cleanups, 0);
    assert!(released.memory.cache_misses > kept.memory.cache_misses);
    assert!(final_params(on.path()) == final_params(off.path()));
}

#[test]
fn two_experiments_in_one_process_each_free_their_memory() {
    let data = data(64, 32);
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let first = run(data.path(), a.path(), &["train.epochs=1"]);
    let second = run(data.path(), b.path(), &["train.epochs=1"]);
    assert!(first.memory.peak_in_use_bytes > 0, "{:?}", first.memory);
    assert_eq!(first.memory_left_after_run, 0, "the first run leaked");
    assert_eq!(second.memory_left_after_run, 0, "the second run leaked");
    // Nothing of the first run is in the second's pool: the same
    // experiment needs exactly the same memory, taken from the OS anew.
    assert_eq!(
        first.memory.peak_in_use_bytes,
        second.memory.peak_in_use_bytes
    );
    assert_eq!(
        first.memory.peak_reserved_bytes,
        second.memory.peak_reserved_bytes
    );
    assert_eq!(first.memory.cache_misses, second.memory.cache_misses);
    assert!(final_params(a.path()) == final_params(b.path()));
}

#[test]
fn the_planned_micro_batch_is_the_largest_that_fits() {
    let data = data(256, 32);
    let sets = ["train.epochs=1", "train.batch_size=128", "run.profile=none"];
    let probe_dir = tempfile::tempdir().unwrap();
    let limit = budget_between_32_and_64(&config(data.path(), probe_dir.path(), &sets));
    let limit_set = format!("device.memory_limit={limit}");
    let with = |extra| [sets[0], sets[1], sets[2], limit_set.as_str(), extra];

    let planned_dir = tempfile::tempdir().unwrap();
    let planned = run(
        data.path(),
        planned_dir.path(),
        &with("train.micro_batch=auto"),
    );
    let chosen = planned.micro_batch;
    assert!(chosen < 128, "the whole batch cannot fit: {chosen}");
    // It fits: a whole epoch at it, and not one allocation refused.
    assert_eq!(planned.step, 2, "256 samples in batches of 128");
    assert_eq!(planned.oom_events, 0, "{planned:?}");
    // Twice it does not: a run set to start there is refused memory and
    // splits down to the planned size.
    let doubled_dir = tempfile::tempdir().unwrap();
    let doubled_set = format!("train.micro_batch={}", 2 * chosen);
    let doubled = run(data.path(), doubled_dir.path(), &with(doubled_set.as_str()));
    assert!(
        doubled.oom_events > 0,
        "a micro-batch of {} fits too, so {chosen} was not the largest",
        2 * chosen
    );
    assert_eq!(doubled.micro_batch, chosen);
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn two_experiments_in_one_process_give_the_gpu_its_memory_back() {
    if !cuda_path_available("memory_release") {
        return;
    }
    let data = data(64, 32);
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let gpu = ["device.kind=cuda", "train.epochs=1", "run.profile=none"];
    let free = || gpu_memory(DeviceKind::Cuda).expect("a CUDA device");
    let before = free();
    let first = run(data.path(), a.path(), &gpu);
    let after_first = free();
    let second = run(data.path(), b.path(), &gpu);
    let after_second = free();
    println!(
        "free device memory: {before} before, {after_first} after one run, {after_second} after two; \
         a run's peak reserved {}",
        first.memory.peak_reserved_bytes
    );
    assert!(first.memory.peak_reserved_bytes > 0, "{:?}", first.memory);
    assert_eq!(
        (first.memory.peak_reserved_bytes, second.memory.oom_events),
        (second.memory.peak_reserved_bytes, 0),
        "the second run found the device as the first did"
    );
    // What a run held of the device is given back when it ends: what stays
    // taken (the context's own, set up once) is less than the run held,
    // and a second run leaves no more taken than the first.
    assert!(
        before - after_first.min(before) < first.memory.peak_reserved_bytes,
        "the first run kept its device memory: {before} free before, {after_first} after"
    );
    assert_eq!(
        after_second, after_first,
        "the second run kept device memory"
    );
}
