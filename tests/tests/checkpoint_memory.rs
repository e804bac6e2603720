//! A checkpoint is written and read without a second copy of it in memory:
//! writing streams the snapshot to the file, reading fills each tensor from
//! the file; and a learner's state written with no snapshot at all (when
//! memory refuses one) adds no copy of the model. Measured as the growth of
//! this process's peak RSS (its own test binary, one test, so nothing else
//! moves the peak), reset before each part through /proc/self/clear_refs.

use headroom_loader::Batch;
use headroom_model::memory::MemoryPool;
use headroom_model::{BuildOptions, Device, ModelSpec};
use headroom_pipeline::checkpoint::{self, Checkpoint, CheckpointMeta, EpochProgress};
use headroom_pipeline::learner::{CpuLearner, Learner, StepSettings};

const MIB: usize = 1 << 20;
/// The checkpoint's tensors: large beside the bounds below.
const TENSOR_MIB: usize = 160;

fn peak_rss_mib() -> usize {
    (headroom_pipeline::peak_rss_bytes().unwrap_or(0) >> 20) as usize
}

fn current_rss_mib() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<usize>().ok())
        .map_or(0, |kib| kib >> 10)
}

/// Sets the peak RSS back to the current RSS; false where the kernel cannot.
fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok() && peak_rss_mib() <= current_rss_mib() + 1
}

fn meta() -> CheckpointMeta {
    CheckpointMeta {
        config_fingerprint: 3,
        config_json: "{}".into(),
        model_json: "{}".into(),
        epoch: 1,
        batches_done: 2,
        step: 40,
        consecutive_skips: 0,
        progress: EpochProgress::default(),
        tuned_convs: Vec::new(),
        monitor: Default::default(),
    }
}

fn large_checkpoint() -> Checkpoint {
    // Four tensors of distinct values, a quarter of the total each.
    let quarter = TENSOR_MIB * MIB / 4 / 4;
    let tensor = |seed: f32| (0..quarter).map(|i| seed + i as f32).collect::<Vec<f32>>();
    Checkpoint {
        meta: meta(),
        params: vec![tensor(0.5)],
        buffers: vec![tensor(-7.0)],
        optimizer: headroom_optim::AdamWState {
            step: 40,
            first_moment: vec![tensor(0.25)],
            second_moment: vec![tensor(1e-3)],
        },
        loss_scale: None,
    }
}

#[test]
fn checkpoints_are_written_and_read_without_a_second_copy_in_memory() {
    if !reset_peak() {
        eprintln!("skipped: /proc/self/clear_refs cannot reset the peak RSS here");
        return;
    }
    a_snapshot_is_written_and_read_without_a_second_copy();
    a_learner_s_state_is_written_with_no_copy_at_all();
}

fn a_snapshot_is_written_and_read_without_a_second_copy() {
    let dir = tempfile::tempdir().unwrap();
    let saved = large_checkpoint();
    assert!(reset_peak());
    let before = peak_rss_mib();
    let path = checkpoint::write(dir.path(), &saved, 1).unwrap();
    let write_growth = peak_rss_mib() - before;
    let file_mib = std::fs::metadata(&path).unwrap().len() as usize / MIB;
    assert!(file_mib >= TENSOR_MIB, "{file_mib} MiB file");
    // An encoded copy of the file in memory would add 160 MiB.
    assert!(
        write_growth < 16,
        "writing a {file_mib} MiB checkpoint raised the peak RSS by {write_growth} MiB"
    );

    assert!(reset_peak());
    let before = peak_rss_mib();
    let loaded = checkpoint::load(&path).unwrap();
    let read_growth = peak_rss_mib() - before;
    // The loaded tensors themselves, and no more than a file buffer beside
    // them; the whole file read into memory first would add another 160.
    assert!(
        read_growth < TENSOR_MIB + 16,
        "reading a {file_mib} MiB checkpoint raised the peak RSS by {read_growth} MiB"
    );
    assert!(
        loaded == saved,
        "the loaded checkpoint differs from the saved one"
    );
    eprintln!("a {file_mib} MiB checkpoint: peak RSS +{write_growth} MiB writing, +{read_growth} MiB reading");
}

/// A 16.8 M-parameter linear layer: 64 MiB of weights, 192 MiB of state
/// with AdamW's moments once it has stepped.
const WIDE_MODEL: &str = r#"
input = [64, 64, 1]
mean = 0.5
std = 0.25
layers = [{ type = "flatten" }, { type = "linear", out = 4096 }, { type = "relu" }, { type = "linear", out = 2 }]
"#;

fn a_learner_s_state_is_written_with_no_copy_at_all() {
    let spec: ModelSpec = toml::from_str(WIDE_MODEL).unwrap();
    let settings = StepSettings {
        label_smoothing: 0.0,
        clip_norm: 0.0,
        focal_gamma: None,
        regression: None,
        optimizer: Default::default(),
    };
    let pool = MemoryPool::new(Device::Cpu);
    let mut learner =
        CpuLearner::new(&spec, 1, BuildOptions::default(), settings, 2, pool).unwrap();
    let batch = Batch {
        epoch: 0,
        index: 0,
        shape: [2, 64, 64, 1],
        pixels: (0..2 * 64 * 64).map(|i| (i * 7) as u8).collect(),
        labels: vec![0, 1],
        soft_targets: None,
        recipes: None,
        features: None,
        values: None,
    };
    learner.train_batch(&batch, 1e-3).unwrap();
    let dir = tempfile::tempdir().unwrap();

    assert!(reset_peak());
    let before = peak_rss_mib();
    let path =
        checkpoint::write_with(dir.path(), &meta(), 2, |out| learner.write_state(out)).unwrap();
    let in_place_growth = peak_rss_mib() - before;
    let file_mib = std::fs::metadata(&path).unwrap().len() as usize / MIB;
    assert!(file_mib >= 190, "{file_mib} MiB file");
    assert!(
        in_place_growth < 16,
        "writing a learner's {file_mib} MiB state raised the peak RSS by {in_place_growth} MiB"
    );

    // The measurement sees a copy where there is one: the snapshot's.
    assert!(reset_peak());
    let before = peak_rss_mib();
    let state = learner.snapshot().unwrap();
    let snapshot_growth = peak_rss_mib() - before;
    assert!(
        snapshot_growth >= file_mib - 16,
        "a snapshot of {file_mib} MiB raised the peak RSS by only {snapshot_growth} MiB"
    );
    drop(state);
    eprintln!(
        "a learner's {file_mib} MiB state: peak RSS +{in_place_growth} MiB written with no copy, \
         +{snapshot_growth} MiB for a snapshot"
    );
}
