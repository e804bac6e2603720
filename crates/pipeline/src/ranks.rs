//! The ranks of a data-parallel run, as the trainer sees them: who this
//! process is, the link to the others, and what they must agree on.
//!
//! Every rank runs the same loop on its shard of each global batch
//! (`LoaderConfig::shard`), so the ranks take the same steps in the same
//! order. Per step they exchange: the gradients (the learner's
//! `GradientReducer`, in buckets, as backward produces them) and then one
//! small record (`StepRecord`): whether the step succeeded, its share of
//! the loss and of the correct predictions, and whether a stop was asked
//! for. Every rank decides from the same records, so they all apply the
//! step or all undo it, and all stop after the same step.
//!
//! Rank 0 is the leader: it owns the run directory, writes the
//! checkpoints (the ranks' states are the same bits) and logs. The others
//! (followers) write nothing the user sees.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use headroom_dist::collective::{all_gather, require_equal};
use headroom_dist::{SharedTransport, Transport, FIRST_CONTROL_TAG};

use crate::{PipelineError, Result};

/// Tags of the trainer's own messages (above the gradient buckets').
pub(crate) const STEP_TAG: u16 = FIRST_CONTROL_TAG;
pub(crate) const BUFFERS_TAG: u16 = FIRST_CONTROL_TAG + 1;
const START_TAG: u16 = FIRST_CONTROL_TAG + 2;
const TEXT_TAG: u16 = FIRST_CONTROL_TAG + 3;
const SMALLEST_TAG: u16 = FIRST_CONTROL_TAG + 7;
const VARYING_TAG: u16 = FIRST_CONTROL_TAG + 8;
/// A sharded optimizer's messages: the norm's terms, the verdict on the
/// update, the moments gathered for a checkpoint.
pub(crate) const NORM_TAG: u16 = FIRST_CONTROL_TAG + 4;
pub(crate) const VERDICT_TAG: u16 = FIRST_CONTROL_TAG + 5;
pub(crate) const MOMENTS_TAG: u16 = FIRST_CONTROL_TAG + 6;

/// One process's place among the ranks of a data-parallel run.
#[derive(Clone)]
pub struct Ranks {
    pub transport: SharedTransport,
    pub rank: usize,
    pub world: usize,
    /// Values per gradient bucket (`distributed.bucket_mb`).
    pub bucket_values: usize,
    /// How long any exchange may wait for a peer before it is named and
    /// every rank stops (`distributed.timeout_s`).
    pub timeout: Duration,
    /// Set by this process's signal handler: a stop this rank asks for.
    pub requested: Arc<AtomicBool>,
    /// Set when the ranks have agreed to stop (any one asked): the flag
    /// the training loop reads, so every rank stops after the same step.
    pub agreed: Arc<AtomicBool>,
    /// AdamW's moments sharded over the ranks (`train.shard_optimizer`,
    /// ZeRO-1): set from the experiment when the learner joins.
    pub shard_optimizer: bool,
    /// Train through the ranks' path even in a world of one (`train
    /// --devices 1`: the path's own cost, measured against one device);
    /// otherwise a world of one trains alone.
    pub at_world_one: bool,
}

impl std::fmt::Debug for Ranks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {} of {}", self.rank, self.world)
    }
}

impl Ranks {
    /// Ranks over `transport`, with buckets of `bucket_bytes` and
    /// exchanges allowed `timeout`.
    pub fn new(transport: Box<dyn Transport>, bucket_bytes: usize, timeout: Duration) -> Self {
        let (rank, world) = (transport.rank(), transport.world());
        Self {
            transport: Arc::new(Mutex::new(transport)),
            rank,
            world,
            bucket_values: (bucket_bytes / 4).max(1),
            timeout,
            requested: Arc::new(AtomicBool::new(false)),
            agreed: Arc::new(AtomicBool::new(false)),
            shard_optimizer: false,
            at_world_one: false,
        }
    }

    /// Whether the run trains through these ranks (more than one, or one
    /// by request: `at_world_one`).
    pub fn active(&self) -> bool {
        self.world > 1 || self.at_world_one
    }

    pub fn is_leader(&self) -> bool {
        self.rank == 0
    }

    pub(crate) fn deadline(&self) -> Instant {
        Instant::now() + self.timeout
    }

    pub(crate) fn lock(&self) -> Result<std::sync::MutexGuard<'_, Box<dyn Transport>>> {
        self.transport.lock().map_err(|_| PipelineError::Stage {
            stage: "ranks",
            reason: "a thread panicked while it used the transport".into(),
        })
    }

    /// Every rank's `mine` (all of one length), in rank order.
    pub(crate) fn gather(&self, tag: u16, mine: &[u8], during: &str) -> Result<Vec<Vec<u8>>> {
        let mut t = self.lock()?;
        Ok(all_gather(t.as_mut(), tag, mine, self.deadline(), during)?)
    }

    /// Every rank's `mine`, of any length, in rank order: the lengths
    /// first, then the records padded to the longest.
    pub(crate) fn gather_varying(&self, mine: &[u8], during: &str) -> Result<Vec<Vec<u8>>> {
        let lens = self.gather(VARYING_TAG, &(mine.len() as u64).to_le_bytes(), during)?;
        let lens: Vec<usize> = lens
            .iter()
            .map(|l| <[u8; 8]>::try_from(l.as_slice()).map_or(0, u64::from_le_bytes) as usize)
            .collect();
        let longest = lens.iter().copied().max().unwrap_or(0);
        let mut padded = mine.to_vec();
        padded.resize(longest, 0);
        let mut all = self.gather(VARYING_TAG, &padded, during)?;
        for (record, &len) in all.iter_mut().zip(&lens) {
            record.truncate(len);
        }
        Ok(all)
    }

    /// Fails on every rank unless every rank gives the same `record` (the
    /// experiment as resolved, the model, the data): the check at start.
    pub fn require_same(&self, what: &str, record: &[u8]) -> Result<()> {
        let mut t = self.lock()?;
        Ok(require_equal(
            t.as_mut(),
            START_TAG,
            what,
            record,
            self.deadline(),
        )?)
    }

    /// Rank 0's `text` on every rank (a run directory's path, say).
    pub fn leader_text(&self, text: &str) -> Result<String> {
        let len = (text.len() as u64).to_le_bytes();
        let lens = self.gather(TEXT_TAG, &len, "sharing the leader's run directory")?;
        let longest = lens
            .iter()
            .map(|l| u64::from_le_bytes(l.as_slice().try_into().unwrap_or([0; 8])))
            .max()
            .unwrap_or(0) as usize;
        let mut padded = text.as_bytes().to_vec();
        padded.resize(longest, 0);
        let all = self.gather(TEXT_TAG, &padded, "sharing the leader's run directory")?;
        let leader_len = u64::from_le_bytes(lens[0].as_slice().try_into().unwrap_or([0; 8]));
        let bytes = &all[0][..leader_len as usize];
        String::from_utf8(bytes.to_vec()).map_err(|_| PipelineError::Stage {
            stage: "ranks",
            reason: "rank 0 sent a path that is not UTF-8".into(),
        })
    }

    /// The smallest of every rank's `mine`, on every rank.
    pub fn smallest(&self, mine: u64, during: &str) -> Result<u64> {
        let all = self.gather(SMALLEST_TAG, &mine.to_le_bytes(), during)?;
        Ok(all
            .iter()
            .filter_map(|b| <[u8; 8]>::try_from(b.as_slice()).ok())
            .map(u64::from_le_bytes)
            .min()
            .unwrap_or(mine))
    }

    /// The stop this rank asks for (its signal handler's flag).
    pub(crate) fn stop_requested(&self) -> bool {
        self.requested.load(Ordering::SeqCst)
    }

    pub(crate) fn agree_to_stop(&self) {
        self.agreed.store(true, Ordering::SeqCst);
    }
}

/// The run directory of this rank: the leader claims `place` and tells
/// the followers its path (an empty one if it failed); a follower claims
/// a scratch directory of its own (it writes no checkpoint, and its
/// metrics repeat the leader's) and resumes from the checkpoint the
/// leader resumes (the newest valid one of the leader's directory, read,
/// never changed). Returns the directory, the resume and the scratch path
/// to remove at the end. Alone: `place` as always.
pub(crate) fn claim_run_dir(
    ranks: Option<&Ranks>,
    place: &crate::rundir::RunPlace,
    resume: &crate::Resume,
) -> Result<(
    crate::rundir::RunDir,
    crate::Resume,
    Option<std::path::PathBuf>,
)> {
    use crate::rundir::{RunDir, RunPlace};
    use crate::Resume;
    let Some(ranks) = ranks.filter(|r| r.active()) else {
        return Ok((RunDir::claim_at(place, resume)?, resume.clone(), None));
    };
    if ranks.is_leader() {
        let claimed = RunDir::claim_at(place, resume);
        let path = claimed.as_ref().map(|d| d.path().display().to_string());
        ranks.leader_text(path.as_deref().unwrap_or(""))?;
        return Ok((claimed?, resume.clone(), None));
    }
    let leader_dir = ranks.leader_text("")?;
    if leader_dir.is_empty() {
        return Err(PipelineError::Stage {
            stage: "ranks",
            reason: "rank 0 could not claim the run directory (its own output says why)".into(),
        });
    }
    let leader_dir = std::path::PathBuf::from(leader_dir);
    let from = match resume {
        Resume::No => Resume::No,
        Resume::From(path) => Resume::From(path.clone()),
        Resume::Latest => match crate::checkpoint::newest_valid(&leader_dir)?.0 {
            Some((path, _)) => Resume::From(path),
            None => Resume::No,
        },
    };
    // Unique in this process too: ranks as threads share its id.
    static FOLLOWERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let scratch = std::env::temp_dir().join(format!(
        "headroom-rank-{}-of-{}-{}-{}",
        ranks.rank,
        ranks.world,
        std::process::id(),
        FOLLOWERS.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&scratch);
    let run_dir = RunDir::claim_at(&RunPlace::dir(&scratch), &Resume::No)?;
    Ok((run_dir, from, Some(scratch)))
}

/// A block an allocator refused: its size, and the budget it was over
/// (None: the system refused it). What the memory policy decides from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub requested: u64,
    pub limit: Option<u64>,
}

impl Refusal {
    /// The refusal an out-of-memory error names; None for other errors.
    pub fn of(error: &PipelineError) -> Option<Self> {
        match error {
            PipelineError::Model(headroom_model::ModelError::OutOfMemory {
                requested,
                limit,
                ..
            })
            | PipelineError::Optim(headroom_optim::OptimError::OutOfMemory {
                requested,
                limit,
                ..
            }) => Some(Self {
                requested: *requested,
                limit: *limit,
            }),
            _ => None,
        }
    }

    /// The same out-of-memory error on every rank (`stats`: this rank's
    /// pool), so that every rank's memory policy makes the same move.
    pub fn error(self, stats: &headroom_model::PoolStats) -> PipelineError {
        PipelineError::Model(headroom_model::ModelError::OutOfMemory {
            requested: self.requested,
            in_use: stats.in_use_bytes,
            reserved: stats.reserved_bytes,
            limit: self.limit,
        })
    }

    pub fn write(self, out: &mut [u8]) {
        out[..8].copy_from_slice(&self.requested.to_le_bytes());
        out[8] = u8::from(self.limit.is_some());
        out[9..17].copy_from_slice(&self.limit.unwrap_or(0).to_le_bytes());
    }

    pub fn read(bytes: &[u8]) -> Option<Self> {
        let word = |r: std::ops::Range<usize>| -> Option<[u8; 8]> { bytes.get(r)?.try_into().ok() };
        let limit = u64::from_le_bytes(word(9..17)?);
        Some(Self {
            requested: u64::from_le_bytes(word(0..8)?),
            limit: (*bytes.get(8)? != 0).then_some(limit),
        })
    }
}

/// What a rank says after a step's gradients are reduced.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct StepRecord {
    /// 0: its forward and backward succeeded; 1: its loss was not finite;
    /// 2: it failed; 3: it ran out of memory (`refusal`).
    pub status: u8,
    pub stop: bool,
    /// Its share of the batch's mean loss.
    pub loss: f64,
    pub correct: u64,
    pub refusal: Option<Refusal>,
}

impl StepRecord {
    pub const OK: u8 = 0;
    pub const NON_FINITE: u8 = 1;
    pub const FAILED: u8 = 2;
    pub const OUT_OF_MEMORY: u8 = 3;

    /// The status of a rank's outcome, and the refusal of an
    /// out-of-memory error.
    pub fn status_of<T>(local: &Result<T>, finite: impl Fn(&T) -> bool) -> (u8, Option<Refusal>) {
        match local {
            Ok(v) if finite(v) => (Self::OK, None),
            Ok(_) => (Self::NON_FINITE, None),
            Err(e) => match Refusal::of(e) {
                Some(r) => (Self::OUT_OF_MEMORY, Some(r)),
                None => (Self::FAILED, None),
            },
        }
    }

    fn to_bytes(self) -> [u8; 35] {
        let mut out = [0u8; 35];
        out[0] = self.status;
        out[1] = u8::from(self.stop);
        out[2..10].copy_from_slice(&self.loss.to_le_bytes());
        out[10..18].copy_from_slice(&self.correct.to_le_bytes());
        if let Some(r) = self.refusal {
            r.write(&mut out[18..35]);
        }
        out
    }

    fn from_bytes(bytes: &[u8]) -> Option<Self> {
        let word = |r: std::ops::Range<usize>| -> Option<[u8; 8]> { bytes.get(r)?.try_into().ok() };
        let status = *bytes.first()?;
        Some(Self {
            status,
            stop: *bytes.get(1)? != 0,
            loss: f64::from_le_bytes(word(2..10)?),
            correct: u64::from_le_bytes(word(10..18)?),
            refusal: match status {
                Self::OUT_OF_MEMORY => Some(Refusal::read(bytes.get(18..35)?)?),
                _ => None,
            },
        })
    }
}

/// The step as every rank sees it: the first rank that failed (if any),
/// whether a rank's loss was not finite, the loss and correct count summed
/// in rank order, and whether any rank asked to stop.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct AgreedStep {
    pub failed: Option<usize>,
    /// The first rank that ran out of memory, and its refusal: every rank
    /// then undoes the step and follows the memory policy on it.
    pub out_of_memory: Option<(usize, Refusal)>,
    pub non_finite: bool,
    pub loss: f64,
    pub correct: u64,
    pub stop: bool,
}

/// The ranks' verdict on an update, each rank having checked its part
/// (`AdamW::check_step`) before anyone applies it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum UpdateVerdict {
    Apply,
    /// A rank's update would leave a value that is not finite: all skip.
    Skip {
        rank: usize,
    },
    /// A rank ran out of memory preparing it (the first step's moments).
    OutOfMemory {
        rank: usize,
        refusal: Refusal,
    },
    /// A rank failed otherwise.
    Failed {
        rank: usize,
    },
}

/// Every rank's check of its part of the update (`Ok(true)`: it stays
/// finite), exchanged: the first failure wins, then the first refusal,
/// then the first non-finite part.
pub(crate) fn agree_on_update(ranks: &Ranks, mine: &Result<bool>) -> Result<UpdateVerdict> {
    let mut record = [0u8; 18];
    match mine {
        Ok(true) => {}
        Ok(false) => record[0] = 1,
        Err(e) => match Refusal::of(e) {
            Some(r) => {
                record[0] = 2;
                r.write(&mut record[1..18]);
            }
            None => record[0] = 3,
        },
    }
    let all = ranks.gather(VERDICT_TAG, &record, "agreeing on the update")?;
    let first = |code: u8| all.iter().position(|r| r.first() == Some(&code));
    if let Some(rank) = first(3) {
        return Ok(UpdateVerdict::Failed { rank });
    }
    if let Some(rank) = first(2) {
        let refusal = all[rank]
            .get(1..18)
            .and_then(Refusal::read)
            .ok_or_else(|| PipelineError::Stage {
                stage: "ranks",
                reason: format!("rank {rank} sent a malformed verdict"),
            })?;
        return Ok(UpdateVerdict::OutOfMemory { rank, refusal });
    }
    Ok(match first(1) {
        Some(rank) => UpdateVerdict::Skip { rank },
        None => UpdateVerdict::Apply,
    })
}

/// Exchanges `mine` with every rank; the outcome is the same on all.
pub(crate) fn agree_on_step(ranks: &Ranks, mine: StepRecord) -> Result<AgreedStep> {
    let all = ranks.gather(STEP_TAG, &mine.to_bytes(), "the end of a step")?;
    let records: Vec<StepRecord> = all
        .iter()
        .enumerate()
        .map(|(k, b)| {
            StepRecord::from_bytes(b).ok_or_else(|| PipelineError::Stage {
                stage: "ranks",
                reason: format!("rank {k} sent a malformed step record"),
            })
        })
        .collect::<Result<_>>()?;
    let mut agreed = AgreedStep {
        failed: records.iter().position(|r| r.status == StepRecord::FAILED),
        out_of_memory: records
            .iter()
            .enumerate()
            .find_map(|(k, r)| Some((k, r.refusal?))),
        non_finite: records.iter().any(|r| r.status == StepRecord::NON_FINITE),
        loss: 0.0,
        correct: 0,
        stop: records.iter().any(|r| r.stop),
    };
    for r in &records {
        agreed.loss += r.loss;
        agreed.correct += r.correct;
    }
    if agreed.stop {
        ranks.agree_to_stop();
    }
    Ok(agreed)
}
