//! Run directories: `runs/<experiment>-<UTC timestamp>/` for a fresh run,
//! the newest one of the experiment for `--resume`, or exactly
//! `run.output_dir` when it is set. Each holds the resolved config, the
//! metrics, the checkpoints and the plots.
//!
//! A fresh directory is made with one `mkdir` that fails if it exists, so
//! two runs started in the same second never share one. A run holds an
//! exclusive `flock` on `.lock` inside its directory for as long as it
//! lives, so a second process cannot write into a live run, and removes
//! the file when it ends (see `DirLock`). A directory this run made and
//! that holds no progress (no checkpoint, no metrics) is removed when the
//! claim ends: a failed start leaves nothing behind.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::config::ExperimentConfig;
use crate::resume::Resume;
use crate::{checkpoint, PipelineError, Result};

const LOCK_FILE: &str = ".lock";
pub const CONFIG_FILE: &str = "config.toml";

/// A run directory claimed by this process: locked, and removed on drop if
/// this claim made it and it holds no progress.
#[derive(Debug)]
pub struct RunDir {
    path: PathBuf,
    lock: Option<DirLock>,
    created: bool,
}

/// Where a run's directory is: `output_dir` when set, else a new
/// `<name>-<UTC time>` inside `runs_dir` (or, on resume, the newest there
/// that holds checkpoints).
#[derive(Clone, Debug, PartialEq)]
pub struct RunPlace {
    pub runs_dir: PathBuf,
    pub name: String,
    pub output_dir: Option<PathBuf>,
}

impl RunPlace {
    /// Exactly `dir`.
    pub fn dir(dir: impl Into<PathBuf>) -> Self {
        let dir = dir.into();
        Self {
            runs_dir: dir.clone(),
            name: String::new(),
            output_dir: Some(dir),
        }
    }

    /// `run.runs_dir`, `run.name` and `run.output_dir` of `config`.
    pub fn of(config: &ExperimentConfig) -> Self {
        Self {
            runs_dir: config.run.runs_dir.clone(),
            name: config.run.name.clone(),
            output_dir: config.run.output_dir.clone(),
        }
    }
}

impl RunDir {
    /// Finds or makes the directory `config` names, and locks it.
    pub fn claim(config: &ExperimentConfig, resume: &Resume) -> Result<Self> {
        Self::claim_at(&RunPlace::of(config), resume)
    }

    /// Finds or makes the directory this run writes to, and locks it.
    pub fn claim_at(place: &RunPlace, resume: &Resume) -> Result<Self> {
        let (path, created) = locate(place, resume)?;
        match DirLock::acquire(&path) {
            Ok(lock) => Ok(Self {
                path,
                lock: Some(lock),
                created,
            }),
            Err(e) => {
                if created {
                    let _ = std::fs::remove_dir_all(&path);
                }
                Err(e)
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        // An empty directory goes while the lock is still held, so no other
        // process can have claimed it; the lock (and its file, if the
        // directory stays) goes last.
        if self.created && holds_no_progress(&self.path) {
            if let Err(e) = std::fs::remove_dir_all(&self.path) {
                tracing::warn!(
                    "could not remove the empty run directory {}: {e}",
                    self.path.display()
                );
            }
        }
        drop(self.lock.take());
    }
}

/// The directory, and whether this call made it.
fn locate(place: &RunPlace, resume: &Resume) -> Result<(PathBuf, bool)> {
    if let Some(dir) = &place.output_dir {
        return make_or_open(dir).map(|created| (dir.clone(), created));
    }
    match resume {
        Resume::From(file) => {
            let dir = file.parent().unwrap_or(Path::new(".")).to_path_buf();
            return Ok((dir, false));
        }
        Resume::Latest => {
            if let Some(dir) = newest_with_checkpoints(&place.runs_dir, &place.name)? {
                return Ok((dir, false));
            }
        }
        Resume::No => {}
    }
    let runs = &place.runs_dir;
    std::fs::create_dir_all(runs).map_err(|e| not_writable("run.runs_dir", runs, e))?;
    let base = format!("{}-{}", place.name, utc_timestamp(SystemTime::now()));
    let mut n = 1;
    loop {
        let name = if n == 1 {
            base.clone()
        } else {
            format!("{base}-{n}")
        };
        let dir = runs.join(name);
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok((dir, true)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => n += 1,
            Err(e) => return Err(not_writable("run.runs_dir", runs, e)),
        }
    }
}

/// Makes `dir` (and its parents); true if it did not exist before.
fn make_or_open(dir: &Path) -> Result<bool> {
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| not_writable("run.output_dir", dir, e))?;
    }
    match std::fs::create_dir(dir) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(false),
        Err(e) => Err(not_writable("run.output_dir", dir, e)),
    }
}

fn not_writable(key: &str, dir: &Path, e: std::io::Error) -> PipelineError {
    PipelineError::value(
        key,
        format!("cannot make the run directory {}: {e}", dir.display()),
    )
}

/// An exclusive `flock` on `dir/.lock`, held while this lives; the file is
/// removed when it is dropped, so a finished run leaves none behind.
///
/// Removing a lock file opens a race that the acquisition closes: another
/// process may have opened the old file before it was unlinked and get its
/// lock once released, a lock on a file no longer in the directory, while a
/// third process creates and locks a new `.lock`. So after `flock` succeeds
/// the path must still name the very file locked (same device and inode,
/// `fstat` against `stat`); if it does not, the lock is worthless and the
/// acquisition starts again. Only a holder unlinks the file, so once the
/// check passes no one else can hold the directory.
#[derive(Debug)]
pub struct DirLock {
    path: PathBuf,
    file: File,
}

/// Attempts at a lock whose file keeps being replaced under us; each
/// retry means another process finished in between, so a few suffice.
const LOCK_ATTEMPTS: usize = 64;

impl DirLock {
    /// Locks `dir/.lock`, or says which process holds it.
    pub fn acquire(dir: &Path) -> Result<Self> {
        let path = dir.join(LOCK_FILE);
        for _ in 0..LOCK_ATTEMPTS {
            let mut file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(|e| not_writable("run.output_dir", dir, e))?;
            // SAFETY: flock only reads the descriptor, which `file` keeps open.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                return Err(in_use(dir, &path));
            }
            if !names_file(&path, &file) {
                // Locked a file its last holder already unlinked: closing
                // it releases the stale lock; try the current one.
                continue;
            }
            // The pid is only for the message in `in_use`; a failure to
            // record it is harmless.
            let _ = file
                .set_len(0)
                .and_then(|()| write!(file, "{}", std::process::id()));
            return Ok(Self { path, file });
        }
        Err(PipelineError::value(
            "run.output_dir",
            format!(
                "{} kept being replaced while this process tried to lock it; try again",
                path.display()
            ),
        ))
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        // Unlinked while still locked, and only if it is still ours: a
        // process that opened it meanwhile finds it gone once it gets the
        // lock, and retries on a fresh file (`acquire`).
        if names_file(&self.path, &self.file) {
            if let Err(e) = std::fs::remove_file(&self.path) {
                tracing::warn!("could not remove {}: {e}", self.path.display());
            }
        }
    }
}

/// Whether `path` names the open `file` (same device and inode).
fn names_file(path: &Path, file: &File) -> bool {
    match (std::fs::metadata(path), file.metadata()) {
        (Ok(named), Ok(open)) => named.dev() == open.dev() && named.ino() == open.ino(),
        _ => false,
    }
}

fn in_use(dir: &Path, path: &Path) -> PipelineError {
    let holder = std::fs::read_to_string(path).unwrap_or_default();
    PipelineError::value(
        "run.output_dir",
        format!(
            "{} is in use by another training process{}; wait for it to end, or choose another run.output_dir",
            dir.display(),
            match holder.trim() {
                "" => String::new(),
                pid => format!(" (pid {pid})"),
            }
        ),
    )
}

/// No checkpoint and no metrics: nothing a user could want back.
fn holds_no_progress(dir: &Path) -> bool {
    let no_checkpoints = checkpoint::list(dir).is_ok_and(|list| list.is_empty());
    let metrics = dir.join("metrics.jsonl");
    let no_metrics = std::fs::metadata(&metrics).map_or(true, |m| m.len() == 0);
    no_checkpoints && no_metrics
}

/// Writes the experiment exactly as resolved (file, environment, --set),
/// once: a resumed or refused start leaves the run's record as it was.
pub fn write_resolved_config(dir: &Path, config: &ExperimentConfig) -> Result<()> {
    let path = dir.join(CONFIG_FILE);
    if path.exists() {
        return Ok(());
    }
    let text = toml::to_string(config)
        .map_err(|e| PipelineError::Config(format!("cannot record the config: {e}")))?;
    let temporary = dir.join(format!(".{CONFIG_FILE}.tmp"));
    std::fs::write(&temporary, text).map_err(|e| PipelineError::io(&temporary, e))?;
    std::fs::rename(&temporary, &path).map_err(|e| PipelineError::io(&path, e))
}

fn newest_with_checkpoints(runs_dir: &Path, name: &str) -> Result<Option<PathBuf>> {
    let Ok(entries) = std::fs::read_dir(runs_dir) else {
        return Ok(None);
    };
    let prefix = format!("{name}-");
    let mut candidates: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.starts_with(&prefix)
                    && n[prefix.len()..].starts_with(|c: char| c.is_ascii_digit())
            })
        })
        .collect();
    candidates.sort();
    for dir in candidates.into_iter().rev() {
        if !checkpoint::list(&dir)?.is_empty() {
            return Ok(Some(dir));
        }
    }
    Ok(None)
}

/// `YYYYMMDD-HHMMSS` in UTC, from the civil-from-days algorithm.
fn utc_timestamp(time: SystemTime) -> String {
    let secs = time.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn smoke_config(runs: &Path) -> ExperimentConfig {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments/smoke.toml");
        let overrides =
            crate::Overrides::parse(&[format!("run.runs_dir={}", runs.display())]).unwrap();
        ExperimentConfig::load(&path, &overrides).unwrap()
    }

    #[test]
    fn runs_started_in_the_same_second_get_their_own_directories() {
        let runs = tempfile::tempdir().unwrap();
        let config = smoke_config(runs.path());
        let claims: Vec<RunDir> = (0..4)
            .map(|_| RunDir::claim(&config, &Resume::No).unwrap())
            .collect();
        let mut paths: Vec<&Path> = claims.iter().map(RunDir::path).collect();
        paths.sort();
        paths.dedup();
        assert_eq!(paths.len(), 4, "{paths:?}");
    }

    #[test]
    fn a_live_run_directory_cannot_be_claimed_twice() {
        let runs = tempfile::tempdir().unwrap();
        let mut config = smoke_config(runs.path());
        config.run.output_dir = Some(runs.path().join("run"));
        let first = RunDir::claim(&config, &Resume::Latest).unwrap();
        let second = RunDir::claim(&config, &Resume::Latest)
            .unwrap_err()
            .to_string();
        assert!(
            second.contains("in use by another training process"),
            "{second}"
        );
        assert!(second.contains(&std::process::id().to_string()), "{second}");
        drop(first);
        RunDir::claim(&config, &Resume::Latest).unwrap();
    }

    #[test]
    fn a_finished_claim_leaves_no_lock_file() {
        let runs = tempfile::tempdir().unwrap();
        let mut config = smoke_config(runs.path());
        let dir = runs.path().join("run");
        config.run.output_dir = Some(dir.clone());
        let claim = RunDir::claim(&config, &Resume::Latest).unwrap();
        assert!(dir.join(LOCK_FILE).is_file());
        // Progress, so that the directory itself stays.
        std::fs::write(dir.join("metrics.jsonl"), "{}\n").unwrap();
        drop(claim);
        assert!(dir.is_dir());
        assert!(!dir.join(LOCK_FILE).exists(), ".lock is left behind");
    }

    /// Threads that lock, check they are alone, and unlock (removing the
    /// file) as fast as they can: the inode check keeps a lock taken on an
    /// unlinked file from counting, so never two hold the directory. (flock
    /// locks belong to open files, so threads contend as processes do.)
    #[test]
    fn racing_claims_never_both_hold_the_lock() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let dir = tempfile::tempdir().unwrap();
        let holders = AtomicUsize::new(0);
        let acquired = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    for _ in 0..300 {
                        let Ok(lock) = DirLock::acquire(dir.path()) else {
                            continue;
                        };
                        assert_eq!(holders.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                        acquired.fetch_add(1, Ordering::SeqCst);
                        std::thread::yield_now();
                        holders.fetch_sub(1, Ordering::SeqCst);
                        drop(lock);
                    }
                });
            }
        });
        assert!(acquired.load(Ordering::SeqCst) > 0);
        assert!(!dir.path().join(LOCK_FILE).exists());
    }

    #[test]
    fn a_failed_start_leaves_no_empty_directory() {
        let runs = tempfile::tempdir().unwrap();
        let config = smoke_config(runs.path());
        let claim = RunDir::claim(&config, &Resume::No).unwrap();
        let path = claim.path().to_path_buf();
        write_resolved_config(&path, &config).unwrap();
        drop(claim);
        assert!(!path.exists(), "{} is left behind", path.display());
    }

    #[test]
    fn the_recorded_config_is_never_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = smoke_config(dir.path());
        write_resolved_config(dir.path(), &config).unwrap();
        let first = std::fs::read_to_string(dir.path().join(CONFIG_FILE)).unwrap();
        config.train.epochs = 99;
        write_resolved_config(dir.path(), &config).unwrap();
        let after = std::fs::read_to_string(dir.path().join(CONFIG_FILE)).unwrap();
        assert_eq!(first, after);
    }

    #[test]
    fn timestamps_are_utc_calendar_dates() {
        assert_eq!(utc_timestamp(UNIX_EPOCH), "19700101-000000");
        let t = UNIX_EPOCH + Duration::from_secs(1_795_258_861); // 2026-11-21 11:01:01
        assert_eq!(utc_timestamp(t), "20261121-110101");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(utc_timestamp(leap), "20000229-000000");
    }
}
