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
        }
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

    /// The stop this rank asks for (its signal handler's flag).
    pub(crate) fn stop_requested(&self) -> bool {
        self.requested.load(Ordering::SeqCst)
    }

    pub(crate) fn agree_to_stop(&self) {
        self.agreed.store(true, Ordering::SeqCst);
    }
}

/// What a rank says after a step's gradients are reduced.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct StepRecord {
    /// 0: its forward and backward succeeded; 1: its loss was not finite;
    /// 2: it failed (out of memory, say).
    pub status: u8,
    pub stop: bool,
    /// Its share of the batch's mean loss.
    pub loss: f64,
    pub correct: u64,
}

impl StepRecord {
    pub const OK: u8 = 0;
    pub const NON_FINITE: u8 = 1;
    pub const FAILED: u8 = 2;

    fn to_bytes(self) -> [u8; 18] {
        let mut out = [0u8; 18];
        out[0] = self.status;
        out[1] = u8::from(self.stop);
        out[2..10].copy_from_slice(&self.loss.to_le_bytes());
        out[10..18].copy_from_slice(&self.correct.to_le_bytes());
        out
    }

    fn from_bytes(bytes: &[u8]) -> Option<Self> {
        let word = |r: std::ops::Range<usize>| -> Option<[u8; 8]> { bytes.get(r)?.try_into().ok() };
        Some(Self {
            status: *bytes.first()?,
            stop: *bytes.get(1)? != 0,
            loss: f64::from_le_bytes(word(2..10)?),
            correct: u64::from_le_bytes(word(10..18)?),
        })
    }
}

/// The step as every rank sees it: the first rank that failed (if any),
/// whether a rank's loss was not finite, the loss and correct count summed
/// in rank order, and whether any rank asked to stop.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct AgreedStep {
    pub failed: Option<usize>,
    pub non_finite: bool,
    pub loss: f64,
    pub correct: u64,
    pub stop: bool,
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
