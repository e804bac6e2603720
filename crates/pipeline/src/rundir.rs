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
//! claim ends: a failed start leaves nothing behind. Likewise a record
//! that a start replaced (`record_config`) is put back if the start made
//! no checkpoint: a resume refused after its settings were recorded (other
//! data, say) leaves the run's record as it was.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::config::ExperimentConfig;
use crate::{checkpoint, PipelineError, Result};

/// Where a run starts (`--resume`).
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Resume {
    /// Start from scratch; refuse a directory that holds checkpoints.
    #[default]
    No,
    /// The newest valid checkpoint in run.output_dir, or scratch if none.
    Latest,
    /// Exactly this file.
    From(PathBuf),
}

const LOCK_FILE: &str = ".lock";
pub const CONFIG_FILE: &str = "config.toml";

/// A run directory claimed by this process: locked, and removed on drop if
/// this claim made it and it holds no progress.
#[derive(Debug)]
pub struct RunDir {
    path: PathBuf,
    lock: Option<DirLock>,
    created: bool,
    /// The checkpoints there when claimed: a claim whose checkpoints are
    /// the same at its end made no progress under a new record.
    checkpoints_at_claim: Vec<PathBuf>,
    /// The directory's device and inode when claimed: one removed or
    /// replaced meanwhile (the run went on elsewhere, see `sink`) is no
    /// longer this claim's to settle or remove.
    identity: Option<(u64, u64)>,
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
            Ok(lock) => {
                // Left by a process killed after its settings were accepted:
                // they stand (see `settle_record`).
                let _ = std::fs::remove_file(path.join(RECORD_BEFORE));
                Ok(Self {
                    checkpoints_at_claim: checkpoint::list(&path).unwrap_or_default(),
                    identity: identity(&path),
                    path,
                    lock: Some(lock),
                    created,
                })
            }
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

    /// Whether the path still names the directory this claim locked.
    fn still_claimed(&self) -> bool {
        self.identity.is_some() && identity(&self.path) == self.identity
    }
}

/// A directory's device and inode, None when it cannot be read.
fn identity(path: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

impl RunDir {
    /// Keeps the record this claim wrote if a checkpoint was written under
    /// it, else puts back the one it replaced: the record must describe
    /// the run its newest checkpoint belongs to. (A checkpoint list that
    /// cannot be read counts as progress: the newer record is kept.)
    fn settle_record(&self) {
        let before = self.path.join(RECORD_BEFORE);
        if !before.exists() {
            return;
        }
        let progressed =
            checkpoint::list(&self.path).map_or(true, |now| now != self.checkpoints_at_claim);
        let record = self.path.join(CONFIG_FILE);
        // No record was there before: an empty file says so.
        let had_none = std::fs::metadata(&before).is_ok_and(|m| m.len() == 0);
        let settled = if progressed {
            std::fs::remove_file(&before)
        } else if had_none {
            std::fs::remove_file(&record).and_then(|()| std::fs::remove_file(&before))
        } else {
            std::fs::rename(&before, &record)
                .and_then(|()| File::open(&self.path).and_then(|d| d.sync_all()))
        };
        if let Err(e) = settled {
            tracing::warn!("could not settle {}: {e}", before.display());
        }
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        // An empty directory goes while the lock is still held, so no other
        // process can have claimed it; the lock (and its file, if the
        // directory stays) goes last. A directory now at the path that is
        // not the one claimed (the run's own was removed, and another run
        // may have made this one) is left alone.
        if !self.still_claimed() {
            drop(self.lock.take());
            return;
        }
        self.settle_record();
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
    let now = SystemTime::now();
    let base = format!("{}-{}", place.name, utc_timestamp(now));
    let mut n = 1;
    loop {
        let name = if n == 1 {
            base.clone()
        } else {
            format!("{base}-{n}")
        };
        let dir = runs.join(name);
        match std::fs::create_dir(&dir) {
            Ok(()) => {
                record_creation(runs, &dir, now);
                return Ok((dir, true));
            }
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

/// Writes the experiment exactly as resolved (file, environment, --set)
/// when a run starts in a directory with no record and no checkpoint,
/// before its checkpoint is chosen. A directory with checkpoints is being
/// resumed: its record is written only once the resume is accepted
/// ([`record_config`], from `resume::choose`), so a refused one writes
/// nothing, not even into a run from before runs kept a record.
pub fn write_resolved_config(dir: &Path, config: &ExperimentConfig) -> Result<()> {
    if dir.join(CONFIG_FILE).exists() || !checkpoint::list(dir)?.is_empty() {
        return Ok(());
    }
    record_config(dir, config)
}

/// The record a start replaced, kept until the claim ends
/// (`RunDir::settle_record`).
const RECORD_BEFORE: &str = ".config.toml.before";

/// Records `config` as the run's settings in `dir/config.toml`, replacing
/// what is there: called when a run goes ahead with these settings (a
/// resume accepted with overrides), so that `--resume DIR` afterwards
/// continues with them and never with the earlier ones. Atomic (temporary,
/// fsync, rename, directory fsync): a crash leaves the old record or the
/// new, never a torn file. An unchanged record is not written again.
///
/// The replaced record is kept beside it while `dir` is claimed: checks
/// made after this one (the data's identity, when the data is opened) may
/// still refuse the run, and a claim that ends without a checkpoint puts
/// it back.
pub fn record_config(dir: &Path, config: &ExperimentConfig) -> Result<()> {
    let path = dir.join(CONFIG_FILE);
    let text = toml::to_string(config)
        .map_err(|e| PipelineError::Config(format!("cannot record the config: {e}")))?;
    let write = |path: &Path, bytes: &[u8]| {
        checkpoint::write_atomically(path, |mut out, tmp| {
            out.write_all(bytes)
                .map_err(|e| PipelineError::io(tmp, e))?;
            Ok(out)
        })
    };
    let before = dir.join(RECORD_BEFORE);
    match std::fs::read(&path) {
        Ok(old) if old == text.as_bytes() => return Ok(()),
        // The first record replaced in this claim is the one to go back to.
        Ok(old) if !before.exists() => write(&before, &old)?,
        // A resumed run that had no record: an empty one stands for none.
        Err(_) if !checkpoint::list(dir)?.is_empty() && !before.exists() => write(&before, b"")?,
        _ => {}
    }
    write(&path, text.as_bytes())
}

/// `run.output_dir` as the run's `config.toml` at `path` records it,
/// before the environment or `--set` go on top: what `--resume` compares a
/// requested `run.output_dir` with. None when the file holds none (or
/// cannot be read: loading it reports that, naming the file).
pub fn recorded_output_dir(path: &Path) -> Option<PathBuf> {
    let text = std::fs::read_to_string(path).ok()?;
    let table: toml::Table = toml::from_str(&text).ok()?;
    let dir = table.get("run")?.get("output_dir")?.as_str()?;
    Some(PathBuf::from(dir))
}

/// The file, in a directory `locate` made, that records when it was made.
///
/// Why a file of its own: "the newest run" must mean the one made last,
/// and nothing else in the directory keeps that moment. Name order does
/// not (`-10` sorts before `-9` for runs started in the same second, and
/// after the clock is set back a new run gets an older-looking name); the
/// directory's mtime changes with every file written in it; `config.toml`
/// is rewritten by an accepted resume; the earliest checkpoint is pruned
/// (`checkpoint.keep`); and a birth time is not reported by every file
/// system, follows the clock, and is lost by a plain `cp -r`. A file
/// written once, holding the moment as text, survives all of these (a
/// copy keeps the content, if not the mtime).
pub const CREATED_FILE: &str = ".created";

/// Records when `dir`, just made in `runs`, was made: nanoseconds since
/// the Unix epoch, or one more than the latest recorded in `runs` if that
/// is later (the clock was set back), so a new run is always the newest.
/// A failure to record it is not fatal: the timestamp in the directory's
/// name is the fallback (`creation_order`).
fn record_creation(runs: &Path, dir: &Path, now: SystemTime) {
    let now = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let latest = std::fs::read_dir(runs)
        .into_iter()
        .flatten()
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|other| other != dir)
        .filter_map(|other| recorded_creation(&other))
        .max();
    let nanos = latest.map_or(now, |latest| now.max(latest + 1));
    if let Err(e) = std::fs::write(dir.join(CREATED_FILE), format!("{nanos}\n")) {
        tracing::warn!(
            "could not record the creation time of {}: {e}",
            dir.display()
        );
    }
}

/// When `dir` (named `<name>-<YYYYMMDD-HHMMSS>[-n]`, `rest` being the part
/// after `<name>-`) was made, as a key that sorts by creation: the time in
/// `.created` if it is there, else the time in the name (directories made
/// before the file was written), then the same-second counter `n`
/// (numerically). None when `rest` is not such a timestamp, so that a run
/// of another experiment whose name merely starts alike (`smoke-2` beside
/// `smoke`) is never taken for one of this experiment.
fn creation_order(dir: &Path, rest: &str) -> Option<(u128, u64)> {
    let (date, time, n) = match rest.split('-').collect::<Vec<_>>()[..] {
        [date, time] => (date, time, 1),
        [date, time, n] => (date, time, n.parse::<u64>().ok().filter(|&n| n >= 2)?),
        _ => return None,
    };
    let digits = |s: &str, len: usize| s.len() == len && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(date, 8) || !digits(time, 6) {
        return None;
    }
    let nanos = recorded_creation(dir).unwrap_or_else(|| name_time_nanos(date, time));
    Some((nanos, n))
}

/// The moment `dir/.created` records, if it holds one.
fn recorded_creation(dir: &Path) -> Option<u128> {
    let text = std::fs::read_to_string(dir.join(CREATED_FILE)).ok()?;
    text.trim().parse().ok()
}

/// `YYYYMMDD`, `HHMMSS` (UTC, as `utc_timestamp` writes them) as
/// nanoseconds since the Unix epoch; both are known to be all digits.
fn name_time_nanos(date: &str, time: &str) -> u128 {
    let number = |s: &str| s.parse::<i64>().unwrap_or(0);
    let (year, month, day) = (number(&date[..4]), number(&date[4..6]), number(&date[6..]));
    // Days from civil (the inverse of `utc_timestamp`'s algorithm).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs =
        days * 86_400 + number(&time[..2]) * 3600 + number(&time[2..4]) * 60 + number(&time[4..]);
    u128::try_from(secs).unwrap_or(0) * 1_000_000_000
}

/// The run of experiment `name` in `runs_dir` made last that holds a
/// checkpoint: newest by creation ([`CREATED_FILE`]), not by name.
fn newest_with_checkpoints(runs_dir: &Path, name: &str) -> Result<Option<PathBuf>> {
    let Ok(entries) = std::fs::read_dir(runs_dir) else {
        return Ok(None);
    };
    let prefix = format!("{name}-");
    let mut candidates: Vec<((u128, u64), PathBuf)> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .filter_map(|p| {
            let rest = p.file_name()?.to_str()?.strip_prefix(&prefix)?.to_string();
            Some((creation_order(&p, &rest)?, p))
        })
        .collect();
    candidates.sort();
    for (_, dir) in candidates.into_iter().rev() {
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
    fn an_accepted_change_is_recorded_whole_and_replaces_the_old_record() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = smoke_config(dir.path());
        write_resolved_config(dir.path(), &config).unwrap();
        config.optimizer.lr = 1e-4;
        config.train.epochs = 7;
        record_config(dir.path(), &config).unwrap();
        let text = std::fs::read_to_string(dir.path().join(CONFIG_FILE)).unwrap();
        let recorded: ExperimentConfig = toml::from_str(&text).unwrap();
        assert_eq!(recorded.optimizer.lr, 1e-4);
        assert_eq!(recorded.train.epochs, 7);
        let temporaries: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.ends_with(".tmp"))
            .collect();
        assert!(temporaries.is_empty(), "{temporaries:?}");
    }

    /// A run directory holding a checkpoint and a record of `config`,
    /// claimed for a resume, and the record replaced by one with another
    /// learning rate: what a resume with `--set optimizer.lr` does.
    fn resume_with_new_record(runs: &Path) -> (RunDir, ExperimentConfig, String) {
        let mut config = smoke_config(runs);
        let dir = runs.join("run");
        config.run.output_dir = Some(dir.clone());
        std::fs::create_dir(&dir).unwrap();
        write_resolved_config(&dir, &config).unwrap();
        std::fs::write(dir.join(checkpoint::file_name(8)), b"x").unwrap();
        let old = std::fs::read_to_string(dir.join(CONFIG_FILE)).unwrap();
        let claim = RunDir::claim(&config, &Resume::Latest).unwrap();
        config.optimizer.lr = 1e-4;
        record_config(&dir, &config).unwrap();
        let new = std::fs::read_to_string(dir.join(CONFIG_FILE)).unwrap();
        assert_ne!(old, new);
        (claim, config, old)
    }

    #[test]
    fn a_start_refused_after_its_record_was_written_puts_the_old_one_back() {
        let runs = tempfile::tempdir().unwrap();
        let (claim, _, old) = resume_with_new_record(runs.path());
        let dir = claim.path().to_path_buf();
        drop(claim); // the data check refused it: no checkpoint written
        assert_eq!(std::fs::read_to_string(dir.join(CONFIG_FILE)).unwrap(), old);
        assert!(!dir.join(RECORD_BEFORE).exists());
    }

    #[test]
    fn a_refused_resume_of_a_run_without_a_record_leaves_none() {
        let runs = tempfile::tempdir().unwrap();
        let mut config = smoke_config(runs.path());
        let dir = runs.path().join("run");
        config.run.output_dir = Some(dir.clone());
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join(checkpoint::file_name(8)), b"x").unwrap();
        let claim = RunDir::claim(&config, &Resume::Latest).unwrap();
        write_resolved_config(&dir, &config).unwrap();
        assert!(
            !dir.join(CONFIG_FILE).exists(),
            "written before the resume was checked"
        );
        record_config(&dir, &config).unwrap(); // accepted, then refused by the data
        assert!(dir.join(CONFIG_FILE).exists());
        drop(claim);
        assert!(!dir.join(CONFIG_FILE).exists());
        assert!(!dir.join(RECORD_BEFORE).exists());
    }

    #[test]
    fn a_resume_that_checkpoints_keeps_its_new_record() {
        let runs = tempfile::tempdir().unwrap();
        let (claim, config, _) = resume_with_new_record(runs.path());
        let dir = claim.path().to_path_buf();
        std::fs::write(dir.join(checkpoint::file_name(16)), b"x").unwrap();
        drop(claim);
        let text = std::fs::read_to_string(dir.join(CONFIG_FILE)).unwrap();
        assert_eq!(text, toml::to_string(&config).unwrap());
        assert!(!dir.join(RECORD_BEFORE).exists());
    }

    /// Makes `runs/<name>` holding a checkpoint-named file and, when
    /// given, a creation record.
    fn run_with_checkpoint(runs: &Path, name: &str, created: Option<u128>) -> PathBuf {
        let dir = runs.join(name);
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join(checkpoint::file_name(1)), b"x").unwrap();
        if let Some(nanos) = created {
            std::fs::write(dir.join(CREATED_FILE), format!("{nanos}\n")).unwrap();
        }
        dir
    }

    #[test]
    fn the_newest_run_is_the_one_made_last_not_the_last_by_name() {
        // Same second: `-10` was made after `-9` but sorts before it.
        let runs = tempfile::tempdir().unwrap();
        run_with_checkpoint(runs.path(), "smoke-20261128-103000-9", None);
        let tenth = run_with_checkpoint(runs.path(), "smoke-20261128-103000-10", None);
        let newest = newest_with_checkpoints(runs.path(), "smoke").unwrap();
        assert_eq!(newest.as_deref(), Some(tenth.as_path()));

        // The recorded creation time rules over the name (the clock was
        // set back between the two).
        let runs = tempfile::tempdir().unwrap();
        run_with_checkpoint(runs.path(), "smoke-20301128-120000", Some(1_000));
        let made_last = run_with_checkpoint(runs.path(), "smoke-20261128-110000", Some(2_000));
        let newest = newest_with_checkpoints(runs.path(), "smoke").unwrap();
        assert_eq!(newest.as_deref(), Some(made_last.as_path()));
    }

    #[test]
    fn another_experiment_whose_name_starts_alike_is_not_a_candidate() {
        let runs = tempfile::tempdir().unwrap();
        let own = run_with_checkpoint(runs.path(), "smoke-20261128-103000", Some(1_000));
        run_with_checkpoint(runs.path(), "smoke-3-20261128-103001", Some(2_000));
        let newest = newest_with_checkpoints(runs.path(), "smoke").unwrap();
        assert_eq!(newest.as_deref(), Some(own.as_path()));
    }

    #[test]
    fn a_new_run_directory_records_when_it_was_made() {
        let runs = tempfile::tempdir().unwrap();
        let config = smoke_config(runs.path());
        let before = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        let claim = RunDir::claim(&config, &Resume::No).unwrap();
        let text = std::fs::read_to_string(claim.path().join(CREATED_FILE)).unwrap();
        let nanos: u128 = text.trim().parse().unwrap();
        assert!(
            nanos >= before.as_nanos(),
            "{nanos} < {}",
            before.as_nanos()
        );
    }

    #[test]
    fn a_run_made_after_the_clock_was_set_back_is_still_the_newest() {
        let runs = tempfile::tempdir().unwrap();
        let config = smoke_config(runs.path());
        let ahead = 4_000_000_000_000_000_000u128; // 2096
        let earlier = run_with_checkpoint(runs.path(), "smoke-20960101-000000", Some(ahead));
        let claim = RunDir::claim(&config, &Resume::No).unwrap();
        std::fs::write(claim.path().join(checkpoint::file_name(1)), b"x").unwrap();
        let newest = newest_with_checkpoints(runs.path(), "smoke").unwrap();
        assert_eq!(
            newest.as_deref(),
            Some(claim.path()),
            "not {}",
            earlier.display()
        );
    }

    #[test]
    fn names_read_back_as_the_time_they_were_made_from() {
        for secs in [0, 951_782_400, 1_795_258_861] {
            let stamp = utc_timestamp(UNIX_EPOCH + Duration::from_secs(secs));
            let (date, time) = stamp.split_once('-').unwrap();
            assert_eq!(
                name_time_nanos(date, time),
                u128::from(secs) * 1_000_000_000
            );
        }
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
