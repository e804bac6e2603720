//! The run directory as the sink found it when the run started, and what it
//! does when the directory is removed or replaced under a live run.
//!
//! A run writes its metrics through a file it keeps open and its
//! checkpoints by path. Removed (`rm -r`, a temporary-file cleaner) or
//! renamed, the directory stops being where the run writes: the metrics go
//! on into an unlinked file, and the next checkpoint would make a bare
//! directory holding nothing but itself (no record, no metrics, no lock, so
//! another run could claim it). Replaced by a new directory at the same
//! path, the checkpoints would land beside another run's record.
//!
//! So the sink remembers the directory's identity (device and inode) and
//! its records (config.toml, dataset.json, ...) at the start, and before
//! each epoch's record, each checkpoint and the end it checks that the path
//! still names that directory. When it does not, the run goes on in a
//! directory it makes and locks: the same path when nothing is there any
//! more, else a fresh `<name>-restored[-N]` beside it (a directory now at
//! the path is someone else's); it restores the records and the metrics
//! so far (read back through the open file) there, and says so. Losing no
//! progress is the point: the next checkpoint is then a complete run
//! directory that `--resume` continues.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::RunDirMoved;
use crate::rundir::DirLock;
use crate::{checkpoint, PipelineError, Result};

/// Records larger than this are not the run's own small files (a plot, a
/// stray download): they are not kept in memory to restore.
const RECORD_LIMIT: u64 = 1 << 20;
/// The most the kept records may take in all.
const RECORDS_LIMIT: u64 = 16 << 20;
/// Attempts at a fresh `<name>-restored-N` before giving up.
const RESTORE_ATTEMPTS: usize = 100;

/// The directory the sink writes into, shared with the training side (which
/// writes a checkpoint itself when memory refuses a copy, and names the
/// directory in its messages).
#[derive(Clone, Debug)]
pub struct CurrentDir(Arc<Mutex<PathBuf>>);

impl CurrentDir {
    pub fn new(dir: PathBuf) -> Self {
        Self(Arc::new(Mutex::new(dir)))
    }

    pub fn get(&self) -> PathBuf {
        // A poisoned lock still holds a whole path (only `set` writes it).
        match self.0.lock() {
            Ok(dir) => dir.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn set(&self, dir: PathBuf) {
        match self.0.lock() {
            Ok(mut current) => *current = dir,
            Err(poisoned) => *poisoned.into_inner() = dir,
        }
    }
}

/// The run's metrics file, opened for appending and for reading back (to
/// restore it in a new directory).
pub struct Metrics {
    pub path: PathBuf,
    pub out: BufWriter<File>,
}

impl Metrics {
    /// Appends to `dir/metrics.jsonl` (resume cut it back to its checkpoint).
    pub fn open(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| PipelineError::io(dir, e))?;
        let path = dir.join("metrics.jsonl");
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .read(true)
            .open(&path)
            .map_err(|e| PipelineError::io(&path, e))?;
        Ok(Self {
            path,
            out: BufWriter::new(file),
        })
    }

    /// Everything written so far, read through the open file: still there
    /// when its directory was removed or renamed.
    fn contents(&mut self) -> Result<Vec<u8>> {
        self.out
            .flush()
            .map_err(|e| PipelineError::io(&self.path, e))?;
        let mut file = self.out.get_ref();
        let mut bytes = Vec::new();
        // Appends go to the end whatever the offset: reading from the start
        // disturbs no write.
        file.seek(SeekFrom::Start(0))
            .and_then(|_| file.read_to_end(&mut bytes))
            .map_err(|e| PipelineError::io(&self.path, e))?;
        Ok(bytes)
    }
}

/// The run directory's identity and records, taken when the sink starts.
pub struct Watch {
    dir: CurrentDir,
    identity: Option<(u64, u64)>,
    records: Vec<(OsString, Vec<u8>)>,
    /// The lock on a directory this watch made (the run's own lock went
    /// with the directory it was in).
    lock: Option<DirLock>,
}

impl Watch {
    pub fn start(dir: CurrentDir) -> Self {
        let path = dir.get();
        let identity = std::fs::metadata(&path).ok().map(|m| (m.dev(), m.ino()));
        let records = read_records(&path);
        Self {
            dir,
            identity,
            records,
            lock: None,
        }
    }

    pub fn dir(&self) -> PathBuf {
        self.dir.get()
    }

    /// Makes sure the directory the run started in is still where it
    /// writes; when it was removed or replaced, the run goes on in a new one
    /// with its records and metrics restored (see the module's note).
    pub fn check(&mut self, metrics: &mut Metrics) -> Result<Option<RunDirMoved>> {
        let path = self.dir.get();
        let now = std::fs::metadata(&path).ok().map(|m| (m.dev(), m.ino()));
        if self.identity.is_none() || now == self.identity {
            return Ok(None);
        }
        let replaced = now.is_some();
        let kept = metrics.contents()?;
        let (target, lock) = make_directory(&path, replaced)?;
        for (name, bytes) in &self.records {
            let record = target.join(name);
            checkpoint::write_atomically(&record, |mut out, tmp| {
                out.write_all(bytes)
                    .map_err(|e| PipelineError::io(tmp, e))?;
                Ok(out)
            })?;
        }
        let restored = target.join("metrics.jsonl");
        std::fs::write(&restored, &kept).map_err(|e| PipelineError::io(&restored, e))?;
        *metrics = Metrics::open(&target)?;
        let names: Vec<String> = self
            .records
            .iter()
            .map(|(name, _)| name.to_string_lossy().into_owned())
            .chain(["metrics.jsonl".to_string()])
            .collect();
        tracing::warn!(
            "the run directory {} was {} while the run was writing into it; the run goes on in {}, \
             where its records are restored ({}); its checkpoints go there from now on, and \
             `cargo xtask train --resume {}` continues it",
            path.display(),
            if replaced {
                "replaced by another directory"
            } else {
                "removed or renamed"
            },
            target.display(),
            names.join(", "),
            crate::shell::quote_path(&target)
        );
        self.identity = std::fs::metadata(&target).ok().map(|m| (m.dev(), m.ino()));
        self.lock = Some(lock);
        self.dir.set(target.clone());
        Ok(Some(RunDirMoved {
            from: path,
            to: target,
            replaced,
        }))
    }
}

/// The run's small records in `dir`: regular files that are neither
/// checkpoints, metrics, the lock nor temporaries.
fn read_records(dir: &Path) -> Vec<(OsString, Vec<u8>)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut records = Vec::new();
    let mut total = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let text = name.to_string_lossy();
        let own = !text.starts_with('.') || text == crate::rundir::CREATED_FILE;
        let skipped =
            text == "metrics.jsonl" || text.ends_with(".tmp") || text.contains(".ckpt") || !own;
        // Not followed: a link is no record of this run's own.
        let Ok(meta) = entry.metadata() else { continue };
        if skipped || !meta.is_file() || meta.len() > RECORD_LIMIT {
            continue;
        }
        total += meta.len();
        if total > RECORDS_LIMIT {
            break;
        }
        if let Ok(bytes) = std::fs::read(entry.path()) {
            records.push((name, bytes));
        }
    }
    records.sort();
    records
}

/// A new directory for the run, locked: `path` itself when nothing is
/// there (its parents remade if they went too), else `<path>-restored[-N]`.
fn make_directory(path: &Path, replaced: bool) -> Result<(PathBuf, DirLock)> {
    let refuse = |e: std::io::Error, at: &Path| PipelineError::Output {
        path: path.to_path_buf(),
        reason: format!(
            "the run directory was removed or replaced while the run was writing into it, \
                 and no directory could be made to go on in ({}: {e}); nothing more can be \
                 recorded or checkpointed, and the run stops",
            at.display()
        ),
    };
    if !replaced {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| refuse(e, parent))?;
        }
        match std::fs::create_dir(path) {
            Ok(()) => return Ok((path.to_path_buf(), DirLock::acquire(path)?)),
            // Made by someone else in between: not ours.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(refuse(e, path)),
        }
    }
    let mut name = path.as_os_str().to_owned();
    name.push("-restored");
    for n in 1..=RESTORE_ATTEMPTS {
        let mut candidate = name.clone();
        if n > 1 {
            candidate.push(format!("-{n}"));
        }
        let candidate = PathBuf::from(candidate);
        match std::fs::create_dir(&candidate) {
            Ok(()) => {
                let lock = DirLock::acquire(&candidate)?;
                return Ok((candidate, lock));
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(refuse(e, &candidate)),
        }
    }
    Err(refuse(
        std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            format!("{RESTORE_ATTEMPTS} such directories exist already"),
        ),
        path,
    ))
}
