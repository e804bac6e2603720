//! A sink of your own: every step to `steps.csv` and every epoch to
//! `epochs.csv` in the run directory (figures only, no timings, so two runs
//! of the same experiment write the same bytes).
//!
//! Exact across a kill: the trainer calls [`Sink::sync`] before each
//! checkpoint is written (the rows so far reach the disk), and on resume
//! [`Sink::start`] says where the run goes on from, so the rows from there
//! on, which the resumed run reports again, are cut first. A run killed and
//! resumed leaves the same files as one never stopped.
//!
//! A run directory removed, renamed or replaced mid-run: the trainer goes
//! on in a directory it makes and says so ([`Sink::moved`]); the sink
//! copies each file there from its open handle (an open file keeps its
//! contents when its directory is gone) and appends there from then on.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use headroom_pipeline::trainer::{
    EpochSummary, RunDirMoved, RunStart, Sink, SinkResult, StepReport,
};

const STEP_HEADER: &str = "epoch,step,batch,loss,lr,grad_norm,skipped";
const EPOCH_HEADER: &str = "epoch,train_loss,train_accuracy,test_loss,test_accuracy,skipped_steps";

#[derive(Default)]
pub struct CsvSink {
    steps: Option<Table>,
    epochs: Option<Table>,
}

/// One CSV file, appended to.
struct Table {
    path: PathBuf,
    out: BufWriter<File>,
}

impl Table {
    /// Opens `path` keeping the rows `keep` accepts (all of them but a torn
    /// last line: only whole lines are kept), with `header` first.
    fn open(path: PathBuf, header: &str, keep: impl Fn(&[&str]) -> bool) -> std::io::Result<Self> {
        let old = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e),
        };
        let mut kept = format!("{header}\n");
        for line in old.split_inclusive('\n').skip(1) {
            let fields: Vec<&str> = line.trim_end().split(',').collect();
            if line.ends_with('\n') && keep(&fields) {
                kept.push_str(line);
            }
        }
        if kept != old {
            // Replaced whole or not at all: a kill here leaves the old file.
            let temporary = path.with_extension("csv.tmp");
            std::fs::write(&temporary, &kept)?;
            std::fs::rename(&temporary, &path)?;
        }
        let file = OpenOptions::new().read(true).append(true).open(&path)?;
        Ok(Self {
            path,
            out: BufWriter::new(file),
        })
    }

    /// Writes everything so far into `dir` (read back through the open
    /// handle, which outlives a removed directory) and appends there.
    fn move_to(&mut self, dir: &Path) -> std::io::Result<()> {
        self.out.flush()?;
        let file = self.out.get_mut();
        let mut text = Vec::new();
        file.seek(SeekFrom::Start(0))?;
        file.read_to_end(&mut text)?;
        let Some(name) = self.path.file_name() else {
            return Err(std::io::Error::other("a table without a file name"));
        };
        let path = dir.join(name);
        let temporary = path.with_extension("csv.tmp");
        std::fs::write(&temporary, &text)?;
        std::fs::rename(&temporary, &path)?;
        let file = OpenOptions::new().read(true).append(true).open(&path)?;
        *self = Self {
            path,
            out: BufWriter::new(file),
        };
        Ok(())
    }

    fn row(&mut self, line: String) -> SinkResult {
        self.out
            .write_all(line.as_bytes())
            .map_err(|e| format!("{}: {e}", self.path.display()).into())
    }

    fn sync(&mut self) -> SinkResult {
        let synced = self
            .out
            .flush()
            .and_then(|()| self.out.get_ref().sync_data());
        synced.map_err(|e| format!("{}: {e}", self.path.display()).into())
    }
}

fn field<T: std::str::FromStr>(fields: &[&str], i: usize) -> Option<T> {
    fields.get(i)?.parse().ok()
}

fn optional(value: Option<f32>) -> String {
    value.map_or(String::new(), |v| v.to_string())
}

impl CsvSink {
    pub fn new() -> Self {
        Self::default()
    }

    fn tables(&mut self) -> Result<(&mut Table, &mut Table), String> {
        match (&mut self.steps, &mut self.epochs) {
            (Some(steps), Some(epochs)) => Ok((steps, epochs)),
            _ => Err("an event before start".into()),
        }
    }
}

impl Sink for CsvSink {
    fn name(&self) -> String {
        "csv logger".into()
    }

    fn start(&mut self, run: &RunStart) -> SinkResult {
        // From the beginning: no row is kept. On resume: the rows before
        // the position the run goes on from.
        let at = run.resumed_at.map(|at| (at.epoch, at.batches_done as u64));
        let open = |name: &str, header: &str, keep: &dyn Fn(&[&str]) -> bool| {
            let path = run.output_dir.join(name);
            Table::open(path.clone(), header, keep).map_err(|e| format!("{}: {e}", path.display()))
        };
        self.steps = Some(open("steps.csv", STEP_HEADER, &|row| match (
            at,
            field::<u64>(row, 0),
            field::<u64>(row, 2),
        ) {
            (Some(at), Some(epoch), Some(batch)) => (epoch, batch) < at,
            _ => false,
        })?);
        self.epochs = Some(open(
            "epochs.csv",
            EPOCH_HEADER,
            &|row| match (at, field::<u64>(row, 0)) {
                (Some((epoch_at, _)), Some(epoch)) => epoch < epoch_at,
                _ => false,
            },
        )?);
        Ok(())
    }

    fn step(&mut self, report: &StepReport) -> SinkResult {
        let (steps, _) = self.tables()?;
        steps.row(format!(
            "{},{},{},{},{},{},{}\n",
            report.epoch,
            report.step,
            report.batch,
            report.loss,
            report.lr,
            report.grad_norm,
            report.skipped
        ))
    }

    fn epoch(&mut self, summary: &EpochSummary) -> SinkResult {
        let (_, epochs) = self.tables()?;
        epochs.row(format!(
            "{},{},{},{},{},{}\n",
            summary.epoch,
            optional(summary.train_loss),
            optional(summary.train_accuracy),
            summary.test_loss,
            optional(summary.test_accuracy),
            summary.skipped_steps
        ))
    }

    fn sync(&mut self) -> SinkResult {
        let (steps, epochs) = self.tables()?;
        steps.sync()?;
        epochs.sync()
    }

    fn moved(&mut self, moved: &RunDirMoved) -> SinkResult {
        let (steps, epochs) = self.tables()?;
        for table in [steps, epochs] {
            table
                .move_to(&moved.to)
                .map_err(|e| format!("{} to {}: {e}", table.path.display(), moved.to.display()))?;
        }
        Ok(())
    }

    fn finish(&mut self) -> SinkResult {
        match self.tables() {
            Ok((steps, epochs)) => {
                steps.sync()?;
                epochs.sync()
            }
            // Never started (the run failed before its first event).
            Err(_) => Ok(()),
        }
    }
}

/// The rows of a CSV file the sink wrote, for tests and comparisons.
pub fn read_rows(path: &Path) -> std::io::Result<Vec<String>> {
    Ok(std::fs::read_to_string(path)?
        .lines()
        .map(str::to_string)
        .collect())
}
