//! A run directory removed, renamed or replaced while a run writes into it
//! (issue #55, class 6): the run goes on in a directory it makes, with its
//! records and metrics restored and its checkpoints there, and a directory
//! someone else put at the path is left alone. The user's sinks are told
//! where the run went on (`Sink::moved`).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use headroom_loader::SyntheticDataset;
use headroom_pipeline::checkpoint;
use headroom_pipeline::trainer::{
    network, DeviceKind, EpochSummary, LoopSettings, NetworkPlan, RunDirMoved, RunSummary,
    ScheduleKind, ScheduleSettings, Sink, SinkResult, StepSettings,
};
use headroom_pipeline::{Resume, Trainer};

const EPOCHS: u64 = 3;
const SAMPLES: usize = 128;
const BATCH: usize = 32;
/// A record of the run's own that a removal takes with it.
const RECORD: &str = "config.toml";
const RECORD_TEXT: &str = "# this run's record\n";

/// What the sink of the test does to the run directory after epoch 1.
#[derive(Clone, Copy)]
enum Mishap {
    Remove,
    Rename,
    /// Removed, and another directory (another run's) made at the path.
    Replace,
}

/// Does `mishap` to `dir` once, when the first epoch is reported.
struct Vandal {
    dir: PathBuf,
    mishap: Mishap,
    /// What `moved` was told.
    told: Arc<Mutex<Vec<RunDirMoved>>>,
}

impl Sink for Vandal {
    fn name(&self) -> String {
        "vandal".into()
    }

    fn epoch(&mut self, summary: &EpochSummary) -> SinkResult {
        if summary.epoch != 0 {
            return Ok(());
        }
        match self.mishap {
            Mishap::Remove => std::fs::remove_dir_all(&self.dir)?,
            Mishap::Rename => std::fs::rename(&self.dir, moved(&self.dir))?,
            Mishap::Replace => {
                std::fs::remove_dir_all(&self.dir)?;
                std::fs::create_dir(&self.dir)?;
                std::fs::write(self.dir.join(RECORD), "# another run's record\n")?;
            }
        }
        Ok(())
    }

    fn moved(&mut self, moved: &RunDirMoved) -> SinkResult {
        self.told.lock().unwrap().push(moved.clone());
        Ok(())
    }
}

fn moved(dir: &Path) -> PathBuf {
    dir.with_file_name("moved")
}

/// The run's summary, and what its sink was told of moves.
fn run(
    dir: &Path,
    epochs: u64,
    resume: Resume,
    mishap: Option<Mishap>,
) -> (RunSummary, Vec<RunDirMoved>) {
    let spec = toml::from_str(
        r#"
        input = [4, 4, 1]
        mean = 0.5
        std = 0.25
        layers = [{ type = "flatten" }, { type = "linear", out = 8 }, { type = "relu" },
                  { type = "linear", out = 2 }]
        "#,
    )
    .unwrap();
    let plan = NetworkPlan {
        spec,
        seed: 1,
        build: Default::default(),
        layers: Default::default(),
        step: StepSettings {
            label_smoothing: 0.0,
            clip_norm: 0.0,
            focal_gamma: None,
            regression: None,
            optimizer: Default::default(),
        },
        batch: BATCH,
        device: DeviceKind::Cpu,
        cuda: Default::default(),
    };
    let data = || Arc::new(SyntheticDataset::new(SAMPLES, [4, 4, 1], 2));
    let mut builder = Trainer::builder()
        .output_dir(dir)
        .model("mlp", network(plan))
        .data(data(), data())
        .loop_settings(LoopSettings {
            epochs,
            batch_size: BATCH,
            threads: 1,
            ..Default::default()
        })
        .schedule(ScheduleSettings {
            lr: 0.01,
            kind: ScheduleKind::Constant,
        })
        .resume(resume);
    let told = Arc::new(Mutex::new(Vec::new()));
    if let Some(mishap) = mishap {
        builder = builder.sink(Box::new(Vandal {
            dir: dir.to_path_buf(),
            mishap,
            told: Arc::clone(&told),
        }));
    }
    let summary = builder.build().unwrap().run().unwrap();
    let told = told.lock().unwrap().clone();
    (summary, told)
}

/// The one move a sink should have been told of.
fn told_once(told: &[RunDirMoved], from: &Path, to: &Path, replaced: bool) {
    let expected = RunDirMoved {
        from: from.to_path_buf(),
        to: to.to_path_buf(),
        replaced,
    };
    assert_eq!(told, [expected]);
}

/// A run directory holding a record of the run's own, as `train()` leaves
/// one before the first step.
fn run_dir_with_record(root: &Path) -> PathBuf {
    let dir = root.join("run");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join(RECORD), RECORD_TEXT).unwrap();
    dir
}

fn step_lines(dir: &Path) -> usize {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    text.lines()
        .filter(|l| l.contains("\"kind\":\"step\""))
        .count()
}

/// Every step of every epoch is recorded, the record is the run's own, the
/// newest checkpoint is the end of the run and no lock is left.
fn assert_whole_run_in(dir: &Path, summary: &RunSummary) {
    assert_eq!(summary.output_dir, dir);
    assert_eq!(
        std::fs::read_to_string(dir.join(RECORD)).unwrap(),
        RECORD_TEXT,
        "the record is not restored in {}",
        dir.display()
    );
    let steps = EPOCHS as usize * (SAMPLES / BATCH);
    assert_eq!(step_lines(dir), steps, "metrics of {}", dir.display());
    let newest = checkpoint::list(dir).unwrap();
    let last = newest.last().expect("no checkpoint in the run directory");
    assert_eq!(checkpoint::step_of(last), Some(steps as u64));
    assert_eq!(summary.last_checkpoint.as_deref(), Some(last.as_path()));
    assert!(
        !dir.join(".lock").exists(),
        ".lock left in {}",
        dir.display()
    );
}

#[test]
fn a_removed_run_directory_is_made_again_with_its_records_and_the_run_goes_on() {
    let root = tempfile::tempdir().unwrap();
    let dir = run_dir_with_record(root.path());
    let (summary, told) = run(&dir, EPOCHS, Resume::No, Some(Mishap::Remove));
    assert_eq!(summary.epochs.len(), EPOCHS as usize);
    assert_whole_run_in(&dir, &summary);
    told_once(&told, &dir, &dir, false);
    // And it is a run directory a resume goes on from.
    let (resumed, _) = run(&dir, EPOCHS + 1, Resume::Latest, None);
    assert_eq!(resumed.epochs.len(), 1);
    assert!(resumed.resumed_from.is_some());
}

#[test]
fn a_renamed_run_directory_keeps_what_it_had_and_the_run_goes_on_at_its_path() {
    let root = tempfile::tempdir().unwrap();
    let dir = run_dir_with_record(root.path());
    let (summary, told) = run(&dir, EPOCHS, Resume::No, Some(Mishap::Rename));
    assert_whole_run_in(&dir, &summary);
    told_once(&told, &dir, &dir, false);
    // The renamed directory keeps what was written into it before.
    let moved = moved(&dir);
    assert_eq!(
        std::fs::read_to_string(moved.join(RECORD)).unwrap(),
        RECORD_TEXT
    );
    // (The first epoch's steps; its checkpoint comes after its report.)
    assert_eq!(step_lines(&moved), SAMPLES / BATCH);
}

#[test]
fn a_directory_put_in_place_of_the_run_s_is_left_alone() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("run");
    let (summary, told) = run(&dir, EPOCHS, Resume::No, Some(Mishap::Replace));
    // The other run's directory: its record, nothing of this run's, and
    // not removed as an empty directory of this run's.
    assert_eq!(
        std::fs::read_to_string(dir.join(RECORD)).unwrap(),
        "# another run's record\n"
    );
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, [RECORD], "written into another run's directory");
    // This run went on beside it.
    let restored = root.path().join("run-restored");
    assert_eq!(summary.output_dir, restored);
    told_once(&told, &dir, &restored, true);
    let steps = EPOCHS as usize * (SAMPLES / BATCH);
    assert_eq!(step_lines(&restored), steps);
    let last = checkpoint::list(&restored).unwrap();
    assert_eq!(
        last.last().and_then(|p| checkpoint::step_of(p)),
        Some(steps as u64)
    );
}
