//! The CSV sink when its run directory is removed mid-run: the trainer
//! goes on in the directory it makes again and tells the sink
//! (`Sink::moved`), which copies its files there from their open handles,
//! so they end as an undisturbed run's.

use std::path::{Path, PathBuf};

use headroom_examples::csv_sink::{read_rows, CsvSink};
use headroom_examples::{example_trainer, Example};
use headroom_pipeline::trainer::{EpochSummary, Sink, SinkResult};

/// Removes the run directory when the first epoch is reported.
struct Remover(PathBuf);

impl Sink for Remover {
    fn name(&self) -> String {
        "remover".into()
    }

    fn epoch(&mut self, summary: &EpochSummary) -> SinkResult {
        if summary.epoch == 0 {
            std::fs::remove_dir_all(&self.0)?;
        }
        Ok(())
    }
}

fn run(dir: &Path, remove: bool) {
    let example = Example {
        epochs: 2,
        train_samples: 1024,
        ..Example::default()
    };
    let mut trainer = example_trainer(&example, dir, "mlp", false)
        .unwrap()
        .sink(Box::new(CsvSink::new()));
    if remove {
        trainer = trainer.sink(Box::new(Remover(dir.to_path_buf())));
    }
    let summary = trainer.build().unwrap().run().unwrap();
    assert_eq!(summary.epochs.len(), 2);
}

#[test]
fn the_csv_sink_keeps_its_files_when_the_run_directory_is_removed() {
    let root = tempfile::tempdir().unwrap();
    let (straight, removed) = (root.path().join("straight"), root.path().join("removed"));
    run(&straight, false);
    run(&removed, true);
    for file in ["steps.csv", "epochs.csv"] {
        let a = read_rows(&straight.join(file)).unwrap();
        let b = read_rows(&removed.join(file)).unwrap();
        assert!(a.len() > 2, "{file} is nearly empty");
        assert_eq!(a, b, "{file} differs after the removal");
    }
}
