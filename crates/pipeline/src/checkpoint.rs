//! One file per checkpoint:
//!
//! ```text
//! "HDRMCKPT" | version u32 | meta length u64 | meta (bincode, ≤ 16 MiB;
//!     from version 4 it ends with the tuned convolutions, in version 5
//!     followed by the early-stopping watch's state)
//!   | 4 tensor lists: params, buffers, Adam first and second moments,
//!     each: count u32, then per tensor: length u64 + f32 LE values
//!   | AdamW step u64 | loss scale: 0 u8, or 1 u8 + scale f32 + clean steps u32
//!   | CRC-32 of everything before u32
//! ```
//!
//! Tensors are written raw with their lengths checked against the bytes that
//! remain, so no corrupt or hostile file can make the reader allocate more
//! than the file holds. Both ways stream through a 1 MiB buffer, the CRC
//! computed on the way: writing encodes the state straight into the file,
//! reading fills each tensor straight from it (fallibly: short memory on
//! resume is an out-of-memory value), so a checkpoint is never in memory
//! twice over. The state comes through `StateWriter`, from a snapshot
//! (`write`) or from the learner's own tensors with no copy at all
//! (`write_with`), and a state that does not fill the layout fails the
//! write. A file is written to a temporary name in the same
//! directory, fsynced, renamed, and the directory fsynced: a crash or a full
//! disk leaves the previous checkpoints intact. Resume picks the newest file
//! that verifies and names any it skips.

use std::fs::{self, File};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use headroom_model::cuda::ops::TunedConv;
use headroom_model::memory::try_scratch;
use headroom_model::ModelSpec;
use headroom_optim::{AdamWState, LossScalerState};
use serde::{Deserialize, Serialize};

use crate::learner::{write_list, LearnerState, StateWriter};
use crate::monitor::MonitorState;
use crate::{PipelineError, Result};

const MAGIC: &[u8; 8] = b"HDRMCKPT";
/// 3 adds the loss scaler's state after the optimizer step, 4 the tuned
/// convolutions to the meta, 5 the early-stopping watch's state; 2 to 4
/// are still read. A run that watches nothing writes version 4, byte for
/// byte as before, so its files stay readable by the builds before 5.
const FORMAT_VERSION: u32 = 5;
const VERSION_WITHOUT_MONITOR: u32 = 4;
const OLDEST_READABLE: u32 = 2;
const MAX_META_BYTES: usize = 16 << 20;
const PREFIX: &str = "checkpoint-";
const SUFFIX: &str = ".ckpt";
/// The file buffer of a checkpoint's write or read: the only copy of its
/// bytes in memory, whatever the model's size.
const IO_BUFFER: usize = 1 << 20;

/// Everything but the tensors.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CheckpointMeta {
    pub config_fingerprint: u32,
    /// The resolved experiment as JSON, to name what changed on resume.
    pub config_json: String,
    /// The model specification as JSON (bincode cannot carry tagged enums).
    pub model_json: String,
    /// The epoch in progress (or the next one, when `batches_done` is 0).
    pub epoch: u64,
    /// Batches of `epoch` already trained: the loader resumes after them.
    pub batches_done: usize,
    /// Optimizer steps applied (the schedule's position).
    pub step: u64,
    /// Consecutive non-finite steps skipped just before this checkpoint.
    pub consecutive_skips: u64,
    /// The epoch's running figures, so its summary survives a resume.
    pub progress: EpochProgress,
    /// The ways `device.conv_algorithm = "tune"` chose for the run's
    /// convolutions, so that a resumed run keeps its kernels (and bits).
    pub tuned_convs: Vec<TunedConv>,
    /// Where `train.early_stopping`'s watch stands (the default when the
    /// run watches nothing).
    pub monitor: MonitorState,
}

/// The meta of format 4, before the watch's state: read as it is, and
/// written (borrowed, the same bytes) for a run that watches nothing.
#[derive(Serialize, Deserialize)]
struct MetaV4<'a> {
    config_fingerprint: u32,
    #[serde(borrow)]
    config_json: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    model_json: std::borrow::Cow<'a, str>,
    epoch: u64,
    batches_done: usize,
    step: u64,
    consecutive_skips: u64,
    progress: EpochProgress,
    tuned_convs: std::borrow::Cow<'a, [TunedConv]>,
}

impl<'a> MetaV4<'a> {
    fn of(meta: &'a CheckpointMeta) -> Self {
        MetaV4 {
            config_fingerprint: meta.config_fingerprint,
            config_json: std::borrow::Cow::Borrowed(&meta.config_json),
            model_json: std::borrow::Cow::Borrowed(&meta.model_json),
            epoch: meta.epoch,
            batches_done: meta.batches_done,
            step: meta.step,
            consecutive_skips: meta.consecutive_skips,
            progress: meta.progress.clone(),
            tuned_convs: std::borrow::Cow::Borrowed(&meta.tuned_convs),
        }
    }

    fn into_meta(self) -> CheckpointMeta {
        CheckpointMeta {
            config_fingerprint: self.config_fingerprint,
            config_json: self.config_json.into_owned(),
            model_json: self.model_json.into_owned(),
            epoch: self.epoch,
            batches_done: self.batches_done,
            step: self.step,
            consecutive_skips: self.consecutive_skips,
            progress: self.progress,
            tuned_convs: self.tuned_convs.into_owned(),
            monitor: MonitorState::default(),
        }
    }
}

/// The meta of formats 2 and 3, before the tuned convolutions.
#[derive(Deserialize)]
struct MetaBeforeTuning {
    config_fingerprint: u32,
    config_json: String,
    model_json: String,
    epoch: u64,
    batches_done: usize,
    step: u64,
    consecutive_skips: u64,
    progress: EpochProgress,
}

impl From<MetaBeforeTuning> for CheckpointMeta {
    fn from(m: MetaBeforeTuning) -> Self {
        CheckpointMeta {
            config_fingerprint: m.config_fingerprint,
            config_json: m.config_json,
            model_json: m.model_json,
            epoch: m.epoch,
            batches_done: m.batches_done,
            step: m.step,
            consecutive_skips: m.consecutive_skips,
            progress: m.progress,
            tuned_convs: Vec::new(),
            monitor: MonitorState::default(),
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct EpochProgress {
    pub loss_sum: f64,
    pub correct: u64,
    pub seen: u64,
    pub skipped: u64,
    pub train_seconds: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    pub meta: CheckpointMeta,
    pub params: Vec<Vec<f32>>,
    pub buffers: Vec<Vec<f32>>,
    pub optimizer: AdamWState,
    /// The dynamic loss scale of a mixed-precision (GPU) run; None on the
    /// CPU, which trains in f32.
    pub loss_scale: Option<LossScalerState>,
}

impl Checkpoint {
    /// The first tensor holding a NaN or an infinity, named by its list and
    /// its index there (the model's order), with the value's position: a
    /// weight, a buffer (running statistics) or an optimizer moment. A file
    /// with one is refused as a corrupt one is, so that resume falls back to
    /// the checkpoint before it and `eval` or `export` never report from it.
    pub fn first_non_finite(&self) -> Option<String> {
        let lists: [&Vec<Vec<f32>>; LISTS] = [
            &self.params,
            &self.buffers,
            &self.optimizer.first_moment,
            &self.optimizer.second_moment,
        ];
        LIST_NAMES.iter().zip(lists).find_map(|(kind, tensors)| {
            tensors.iter().enumerate().find_map(|(index, values)| {
                values
                    .iter()
                    .position(|v| !v.is_finite())
                    .map(|at| format!("{kind} {index} (value {at}: {})", values[at]))
            })
        })
    }

    pub fn new(meta: CheckpointMeta, state: LearnerState) -> Self {
        Self {
            meta,
            params: state.params,
            buffers: state.buffers,
            optimizer: state.optimizer,
            loss_scale: state.loss_scale,
        }
    }

    /// The meta and the learner's state, taken apart (what
    /// `Learner::restore` takes).
    pub fn into_parts(self) -> (CheckpointMeta, LearnerState) {
        let state = LearnerState {
            params: self.params,
            buffers: self.buffers,
            optimizer: self.optimizer,
            loss_scale: self.loss_scale,
        };
        (self.meta, state)
    }

    pub fn model_json(spec: &ModelSpec) -> String {
        serde_json::to_string(spec).unwrap_or_default()
    }

    /// The model that wrote this checkpoint.
    pub fn model(&self) -> std::result::Result<ModelSpec, String> {
        serde_json::from_str(&self.meta.model_json)
            .map_err(|e| format!("unreadable model specification: {e}"))
    }

    /// The whole file in memory (tests and tools; `write` streams it).
    pub fn encode(&self) -> Result<Vec<u8>> {
        encode_with(&self.meta, Vec::new(), Path::new(""), |out| {
            self.write_state(out)
        })
    }

    /// The tensors and the optimizer's and scaler's figures, in the file's
    /// order.
    pub fn write_state(&self, out: &mut dyn StateWriter) -> Result<()> {
        let optimizer = &self.optimizer;
        let lists = [
            &self.params,
            &self.buffers,
            &optimizer.first_moment,
            &optimizer.second_moment,
        ];
        for list in lists {
            write_list(out, list.iter().map(Vec::as_slice))?;
        }
        out.finish(optimizer.step, self.loss_scale)
    }

    /// Verifies magic, version and checksum, then decodes with every length
    /// checked, so a torn or corrupt file is reported, never half-loaded.
    pub fn decode(bytes: &[u8], path: &Path) -> Result<Self> {
        Self::read_from(bytes, bytes.len() as u64, path)
    }

    /// Decodes the `len` bytes `input` holds as they are read, checking every
    /// length against the bytes that remain and the checksum at the end;
    /// nothing is returned before the checksum verified. A file that fails
    /// to parse is read to its end: if its checksum fails too, that is what
    /// is reported (a torn or corrupt file), not the parse error it caused.
    fn read_from(input: impl Read, len: u64, path: &Path) -> Result<Self> {
        let bad = |reason: String| PipelineError::Checkpoint {
            path: path.to_path_buf(),
            reason,
        };
        let too_short = || bad("not a headroom checkpoint (bad magic or too short)".into());
        if len < MAGIC.len() as u64 {
            return Err(too_short());
        }
        let mut source = Source {
            inner: input,
            hasher: crc32fast::Hasher::new(),
            remaining: len,
        };
        let magic: [u8; 8] = source.array().map_err(|e| e.into_error(path))?;
        if &magic != MAGIC {
            return Err(too_short());
        }
        let Some(body) = source.remaining.checked_sub(4) else {
            return Err(bad("truncated".into()));
        };
        source.remaining = body;
        match source.checkpoint() {
            Ok(checkpoint) => match source.checksum_matches() {
                Ok(true) => match checkpoint.first_non_finite() {
                    None => Ok(checkpoint),
                    Some(what) => Err(bad(format!(
                        "{what} holds a non-finite value: not a state to train on or report from"
                    ))),
                },
                Ok(false) => Err(bad(CHECKSUM_FAILED.into())),
                Err(e) => Err(e.into_error(path)),
            },
            Err(parse) => match source.drain_and_check() {
                Ok(false) => Err(bad(CHECKSUM_FAILED.into())),
                Ok(true) | Err(_) => Err(parse.into_error(path)),
            },
        }
    }
}

fn cannot_encode(e: impl std::fmt::Display) -> PipelineError {
    PipelineError::Checkpoint {
        path: PathBuf::new(),
        reason: format!("cannot encode: {e}"),
    }
}

/// Writes a whole file to `out` as its bytes are made, the checksum
/// computed on the way; `state` writes the tensors (a snapshot's, or a
/// learner's own, with no copy): a checkpoint never exists twice in memory.
fn encode_with<W: Write>(
    meta: &CheckpointMeta,
    out: W,
    path: &Path,
    state: impl FnOnce(&mut dyn StateWriter) -> Result<()>,
) -> Result<W> {
    let (version, meta) = if meta.monitor == MonitorState::default() {
        let v4 = MetaV4::of(meta);
        (
            VERSION_WITHOUT_MONITOR,
            bincode::serde::encode_to_vec(&v4, bincode::config::standard()),
        )
    } else {
        (
            FORMAT_VERSION,
            bincode::serde::encode_to_vec(meta, bincode::config::standard()),
        )
    };
    let meta = meta.map_err(cannot_encode)?;
    let mut file = StateFile {
        out: Hashed {
            inner: out,
            hasher: crc32fast::Hasher::new(),
        },
        path,
        lists: 0,
        list_len: 0,
        tensor_len: 0,
        tensors_left: 0,
        values_left: 0,
        finished: false,
    };
    let header = [
        MAGIC.as_slice(),
        &version.to_le_bytes(),
        &(meta.len() as u64).to_le_bytes(),
        &meta,
    ];
    for bytes in header {
        file.write(bytes)?;
    }
    state(&mut file)?;
    if !file.finished {
        return Err(file.misuse("the state ended before its optimizer step"));
    }
    let crc = file.out.hasher.finalize();
    let mut inner = file.out.inner;
    inner
        .write_all(&crc.to_le_bytes())
        .map_err(|e| PipelineError::io(path, e))?;
    Ok(inner)
}

/// The file after its meta, written as a learner hands its state on:
/// every count and length is checked against what follows, so a learner
/// that wrote too little or too much fails the write instead of leaving a
/// file no reader accepts.
struct StateFile<'a, W> {
    out: Hashed<W>,
    path: &'a Path,
    lists: usize,
    /// Tensors in the list being written, and its tensor's length: they
    /// name a non-finite value's place.
    list_len: usize,
    tensor_len: usize,
    tensors_left: usize,
    values_left: usize,
    finished: bool,
}

impl<W: Write> StateFile<'_, W> {
    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.out
            .write_all(bytes)
            .map_err(|e| PipelineError::io(self.path, e))
    }

    fn misuse(&self, what: &str) -> PipelineError {
        PipelineError::Checkpoint {
            path: self.path.to_path_buf(),
            reason: format!(
                "the learner's state is malformed: {what} (list {}, {} tensors and {} values left)",
                self.lists, self.tensors_left, self.values_left
            ),
        }
    }

    fn tensor_done(&self) -> bool {
        self.tensors_left == 0 && self.values_left == 0
    }
}

impl<W: Write> StateWriter for StateFile<'_, W> {
    fn list(&mut self, count: usize) -> Result<()> {
        if self.lists == LISTS || !self.tensor_done() {
            return Err(self.misuse("a list out of place"));
        }
        let count = u32::try_from(count).map_err(|_| self.misuse("a list too long"))?;
        self.lists += 1;
        self.list_len = count as usize;
        self.tensors_left = count as usize;
        self.write(&count.to_le_bytes())
    }

    fn tensor(&mut self, len: usize) -> Result<()> {
        if self.tensors_left == 0 || self.values_left > 0 {
            return Err(self.misuse("a tensor out of place"));
        }
        self.tensors_left -= 1;
        self.tensor_len = len;
        self.values_left = len;
        self.write(&(len as u64).to_le_bytes())
    }

    fn values(&mut self, values: &[f32]) -> Result<()> {
        if values.len() > self.values_left {
            return Err(self.misuse("more values than the tensor holds"));
        }
        // A NaN or an infinity is never written: the write fails, the file
        // is not made and the checkpoints before it are kept (none pruned),
        // so that no resume, `eval` or `export` starts from one.
        if let Some(at) = values.iter().position(|v| !v.is_finite()) {
            let kind = LIST_NAMES[self.lists.saturating_sub(1).min(LISTS - 1)];
            let index = self.list_len - self.tensors_left - 1;
            let offset = self.tensor_len - self.values_left + at;
            return Err(PipelineError::Checkpoint {
                path: self.path.to_path_buf(),
                reason: format!(
                    "{kind} {index} (value {offset}: {}) is not finite: not written, the \
                     checkpoints before it are kept",
                    values[at]
                ),
            });
        }
        self.values_left -= values.len();
        write_values(&mut self.out, values).map_err(|e| PipelineError::io(self.path, e))
    }

    fn finish(&mut self, optimizer_step: u64, loss_scale: Option<LossScalerState>) -> Result<()> {
        if self.lists != LISTS || !self.tensor_done() || self.finished {
            return Err(self.misuse("the end before the last list was written"));
        }
        self.finished = true;
        self.write(&optimizer_step.to_le_bytes())?;
        match loss_scale {
            None => self.write(&[0]),
            Some(state) => {
                self.write(&[1])?;
                self.write(&state.scale.to_le_bytes())?;
                self.write(&state.clean_steps.to_le_bytes())
            }
        }
    }
}

/// Parameters, buffers, first and second moments.
const LISTS: usize = 4;
/// What each list's tensors are, for messages.
const LIST_NAMES: [&str; LISTS] = [
    "parameter",
    "buffer",
    "first moment of parameter",
    "second moment of parameter",
];

const CHECKSUM_FAILED: &str = "checksum mismatch: the file is truncated or corrupt";

/// Values per block written or read at once.
const VALUES_PER_BLOCK: usize = 4096;

pub(crate) fn write_values(out: &mut impl Write, values: &[f32]) -> std::io::Result<()> {
    let mut block = [0u8; 4 * VALUES_PER_BLOCK];
    for chunk in values.chunks(VALUES_PER_BLOCK) {
        for (bytes, value) in block.chunks_exact_mut(4).zip(chunk) {
            bytes.copy_from_slice(&value.to_le_bytes());
        }
        out.write_all(&block[..4 * chunk.len()])?;
    }
    Ok(())
}

/// A writer that hashes what passes through it.
struct Hashed<W> {
    inner: W,
    hasher: crc32fast::Hasher,
}

impl<W: Write> Write for Hashed<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let written = self.inner.write(buf)?;
        self.hasher.update(&buf[..written]);
        Ok(written)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Why a checkpoint could not be read.
enum Fault {
    /// The bytes are not a valid checkpoint.
    Format(String),
    /// The OS failed the read.
    Io(std::io::Error),
    /// A tensor's memory was refused: an out-of-memory value the caller's
    /// policy sees, as everywhere else.
    Memory(headroom_model::ModelError),
}

impl Fault {
    fn into_error(self, path: &Path) -> PipelineError {
        match self {
            Fault::Format(reason) => PipelineError::Checkpoint {
                path: path.to_path_buf(),
                reason,
            },
            Fault::Io(cause) => PipelineError::io(path, cause),
            Fault::Memory(e) => PipelineError::Model(e),
        }
    }
}

/// A reader of the checkpoint's body whose every read is checked against
/// the bytes that remain before the checksum, and hashed.
struct Source<R> {
    inner: R,
    hasher: crc32fast::Hasher,
    remaining: u64,
}

impl<R: Read> Source<R> {
    fn fill(&mut self, buf: &mut [u8]) -> std::result::Result<(), Fault> {
        if buf.len() as u64 > self.remaining {
            return Err(Fault::Format(format!(
                "truncated: needs {} more bytes, {} remain",
                buf.len(),
                self.remaining
            )));
        }
        self.inner.read_exact(buf).map_err(Fault::Io)?;
        self.hasher.update(buf);
        self.remaining -= buf.len() as u64;
        Ok(())
    }

    fn array<const N: usize>(&mut self) -> std::result::Result<[u8; N], Fault> {
        let mut out = [0; N];
        self.fill(&mut out)?;
        Ok(out)
    }

    fn checkpoint(&mut self) -> std::result::Result<Checkpoint, Fault> {
        let version = u32::from_le_bytes(self.array()?);
        if !(OLDEST_READABLE..=FORMAT_VERSION).contains(&version) {
            return Err(Fault::Format(format!(
                "format version {version}, this build reads {OLDEST_READABLE} to {FORMAT_VERSION}"
            )));
        }
        let meta = self.meta(version)?;
        let lists = [
            self.tensors()?,
            self.tensors()?,
            self.tensors()?,
            self.tensors()?,
        ];
        let step = u64::from_le_bytes(self.array()?);
        let loss_scale = if version >= 3 {
            self.loss_scale()?
        } else {
            None
        };
        if self.remaining > 0 {
            return Err(Fault::Format(format!(
                "{} unexpected bytes after the tensors",
                self.remaining
            )));
        }
        let state = LearnerState::from_lists(lists, step, loss_scale);
        Ok(Checkpoint::new(meta, state))
    }

    fn meta(&mut self, version: u32) -> std::result::Result<CheckpointMeta, Fault> {
        let meta_len = u64::from_le_bytes(self.array()?);
        if meta_len > MAX_META_BYTES as u64 || meta_len > self.remaining {
            return Err(Fault::Format(format!(
                "metadata of {meta_len} bytes is implausible"
            )));
        }
        let mut bytes = vec![0; meta_len as usize];
        self.fill(&mut bytes)?;
        let config = bincode::config::standard().with_limit::<MAX_META_BYTES>();
        let meta = if version >= 5 {
            bincode::serde::decode_from_slice::<CheckpointMeta, _>(&bytes, config).map(|m| m.0)
        } else if version == 4 {
            bincode::serde::borrow_decode_from_slice::<MetaV4, _>(&bytes, config)
                .map(|m| m.0.into_meta())
        } else {
            bincode::serde::decode_from_slice::<MetaBeforeTuning, _>(&bytes, config)
                .map(|m| m.0.into())
        };
        meta.map_err(|e| Fault::Format(format!("cannot decode metadata: {e}")))
    }

    fn loss_scale(&mut self) -> std::result::Result<Option<LossScalerState>, Fault> {
        match self.array::<1>()? {
            [0] => Ok(None),
            [1] => {
                let scale = f32::from_le_bytes(self.array()?);
                let clean_steps = u32::from_le_bytes(self.array()?);
                if !(scale.is_finite() && scale > 0.0) {
                    return Err(Fault::Format(format!(
                        "loss scale {scale} is not a positive number"
                    )));
                }
                Ok(Some(LossScalerState { scale, clean_steps }))
            }
            [other] => Err(Fault::Format(format!(
                "loss-scale flag {other} is neither 0 nor 1"
            ))),
        }
    }

    fn tensors(&mut self) -> std::result::Result<Vec<Vec<f32>>, Fault> {
        let count = u32::from_le_bytes(self.array()?) as u64;
        // Each tensor needs at least its 8-byte length: bounds the list.
        if count > self.remaining / 8 {
            return Err(Fault::Format(format!(
                "claims {count} tensors in {} bytes",
                self.remaining
            )));
        }
        let mut list = try_scratch(count as usize).map_err(Fault::Memory)?;
        for _ in 0..count {
            list.push(self.tensor()?);
        }
        Ok(list)
    }

    /// One tensor, read block by block straight into its own memory.
    fn tensor(&mut self) -> std::result::Result<Vec<f32>, Fault> {
        let len = u64::from_le_bytes(self.array()?);
        if len
            .checked_mul(4)
            .is_none_or(|bytes| bytes > self.remaining)
        {
            return Err(Fault::Format(format!(
                "tensor length {len} is implausible: {} bytes remain",
                self.remaining
            )));
        }
        let mut values = try_scratch(len as usize).map_err(Fault::Memory)?;
        let mut block = [0u8; 4 * VALUES_PER_BLOCK];
        let mut left = len as usize;
        while left > 0 {
            let n = left.min(VALUES_PER_BLOCK);
            self.fill(&mut block[..4 * n])?;
            values.extend(
                block[..4 * n]
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
            left -= n;
        }
        Ok(values)
    }

    /// Whether the 4 bytes after the body hold the body's CRC-32.
    fn checksum_matches(&mut self) -> std::result::Result<bool, Fault> {
        let mut stored = [0u8; 4];
        self.inner.read_exact(&mut stored).map_err(Fault::Io)?;
        Ok(self.hasher.clone().finalize() == u32::from_le_bytes(stored))
    }

    /// Hashes the rest of the body, then checks the checksum.
    fn drain_and_check(&mut self) -> std::result::Result<bool, Fault> {
        let mut block = [0u8; 4 * VALUES_PER_BLOCK];
        while self.remaining > 0 {
            let n = self.remaining.min(block.len() as u64) as usize;
            self.fill(&mut block[..n])?;
        }
        self.checksum_matches()
    }
}

/// The file name of the checkpoint at optimizer step `step`; zero-padded so
/// names sort by step.
pub fn file_name(step: u64) -> String {
    format!("{PREFIX}step{step:010}{SUFFIX}")
}

/// Writes atomically, then deletes all but the newest `keep` checkpoints.
/// If the write fails (a full disk, say) the older checkpoints are untouched.
pub fn write(dir: &Path, checkpoint: &Checkpoint, keep: usize) -> Result<PathBuf> {
    write_with(dir, &checkpoint.meta, keep, |out| {
        checkpoint.write_state(out)
    })
}

/// `write`, with the tensors written by `state` as the file is made: a
/// learner's `write_state` puts its own tensors in, with no copy.
pub fn write_with(
    dir: &Path,
    meta: &CheckpointMeta,
    keep: usize,
    state: impl FnOnce(&mut dyn StateWriter) -> Result<()>,
) -> Result<PathBuf> {
    fs::create_dir_all(dir).map_err(|e| PipelineError::io(dir, e))?;
    let path = dir.join(file_name(meta.step));
    write_atomically(&path, |out, tmp| encode_with(meta, out, tmp, state))?;
    prune(dir, keep)?;
    Ok(path)
}

/// `file` behind a buffer of [`IO_BUFFER`] bytes when memory allows, else
/// of the standard 8 KiB: a write buffer is asked for, never assumed, so a
/// process under an address-space limit gets an error naming it rather
/// than an abort.
fn buffered(file: File, path: &Path) -> Result<BufWriter<File>> {
    for capacity in [IO_BUFFER, 8 << 10] {
        let mut probe: Vec<u8> = Vec::new();
        if probe.try_reserve_exact(capacity).is_ok() {
            drop(probe);
            return Ok(BufWriter::with_capacity(capacity, file));
        }
    }
    Err(PipelineError::io(
        path,
        std::io::Error::new(
            std::io::ErrorKind::OutOfMemory,
            "no memory for an 8 KiB write buffer (is the address space limited: ulimit -v, \
             RLIMIT_AS?)",
        ),
    ))
}

/// Makes `path` whole or not at all: `fill` writes a temporary beside it
/// (named for the error messages it makes), which is fsynced and renamed
/// over `path`, then the directory is fsynced. A crash or a full disk
/// leaves what was at `path` before; a failed write removes the temporary.
pub(crate) fn write_atomically(
    path: &Path,
    fill: impl FnOnce(BufWriter<File>, &Path) -> Result<BufWriter<File>>,
) -> Result<()> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    let tmp = dir.join(temporary_name(&name));
    let write_tmp = || -> Result<()> {
        let file = File::create(&tmp).map_err(|e| PipelineError::io(&tmp, e))?;
        let file = fill(buffered(file, &tmp)?, &tmp)?;
        file.into_inner()
            .map_err(|e| e.into_error())
            .and_then(|f| f.sync_all())
            .map_err(|e| PipelineError::io(&tmp, e))
    };
    if let Err(e) = write_tmp() {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    fs::rename(&tmp, path).map_err(|e| PipelineError::io(path, e))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| PipelineError::io(dir, e))
}

/// The name of the best checkpoint (`train.early_stopping`) in a run
/// directory: resume never picks it (it is not named by a step), pruning
/// never removes it.
pub const BEST_FILE: &str = "best.ckpt";

/// Makes `checkpoint` (a file in `dir`) the run's `best.ckpt`, atomically:
/// a hard link (no copy, and it outlives the pruning of the original),
/// or a copy where the file system has no links, renamed into place and
/// the directory fsynced. A crash leaves the previous best whole.
pub fn keep_as_best(dir: &Path, checkpoint: &Path) -> Result<PathBuf> {
    let best = dir.join(BEST_FILE);
    let tmp = dir.join(temporary_name(BEST_FILE));
    let _ = fs::remove_file(&tmp);
    if fs::hard_link(checkpoint, &tmp).is_err() {
        let copied = fs::copy(checkpoint, &tmp)
            .and_then(|_| File::open(&tmp))
            .and_then(|f| f.sync_all());
        if let Err(e) = copied {
            let _ = fs::remove_file(&tmp);
            return Err(PipelineError::io(&tmp, e));
        }
    }
    fs::rename(&tmp, &best).map_err(|e| PipelineError::io(&best, e))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| PipelineError::io(dir, e))?;
    Ok(best)
}

/// The temporary a checkpoint is written to before its rename.
fn temporary_name(name: &str) -> String {
    format!(".{name}.tmp")
}

/// Removes the temporaries of checkpoints whose write never finished: a
/// run killed while writing leaves one, named by its step, so they would
/// pile up, each the size of the model. Call it with the run directory
/// claimed, so that no other process is writing there. Returns each file
/// removed with its size.
pub fn remove_unfinished(dir: &Path) -> Result<Vec<(PathBuf, u64)>> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Ok(Vec::new());
    };
    let mut removed = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| PipelineError::io(dir, e))?;
        let name = entry.file_name();
        let unfinished = name.to_str().is_some_and(|n| {
            n.strip_prefix('.')
                .and_then(|n| n.strip_suffix(".tmp"))
                .is_some_and(|n| (n.starts_with(PREFIX) && n.ends_with(SUFFIX)) || n == BEST_FILE)
        });
        if !unfinished {
            continue;
        }
        let path = entry.path();
        let bytes = entry.metadata().map(|m| m.len()).unwrap_or(0);
        fs::remove_file(&path).map_err(|e| PipelineError::io(&path, e))?;
        removed.push((path, bytes));
    }
    Ok(removed)
}

/// Checkpoint files in `dir`, oldest first.
pub fn list(dir: &Path) -> Result<Vec<PathBuf>> {
    if !dir.exists() {
        return Ok(Vec::new());
    }
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(|e| PipelineError::io(dir, e))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(PREFIX) && n.ends_with(SUFFIX))
        })
        .collect();
    files.sort();
    Ok(files)
}

fn prune(dir: &Path, keep: usize) -> Result<()> {
    let files = list(dir)?;
    let excess = files.len().saturating_sub(keep.max(1));
    for old in &files[..excess] {
        fs::remove_file(old).map_err(|e| PipelineError::io(old, e))?;
    }
    Ok(())
}

/// The step a checkpoint file's name gives (`file_name`'s inverse).
pub fn step_of(path: &Path) -> Option<u64> {
    path.file_name()?
        .to_str()?
        .strip_prefix(PREFIX)?
        .strip_suffix(SUFFIX)?
        .strip_prefix("step")?
        .parse()
        .ok()
}

/// Reads and verifies one checkpoint.
pub fn load(path: &Path) -> Result<Checkpoint> {
    let file = File::open(path).map_err(|e| PipelineError::io(path, e))?;
    let len = file
        .metadata()
        .map_err(|e| PipelineError::io(path, e))?
        .len();
    Checkpoint::read_from(BufReader::with_capacity(IO_BUFFER, file), len, path)
}

/// The meta of the checkpoint at `path` alone (where it stands: epoch,
/// batch, step), read without its tensors and without checking its
/// checksum: for a choice among files, never for a state to train on
/// (`load` checks that).
pub fn read_meta(path: &Path) -> Result<CheckpointMeta> {
    let file = File::open(path).map_err(|e| PipelineError::io(path, e))?;
    let len = file
        .metadata()
        .map_err(|e| PipelineError::io(path, e))?
        .len();
    let mut source = Source {
        inner: BufReader::with_capacity(64 << 10, file),
        hasher: crc32fast::Hasher::new(),
        remaining: len.saturating_sub(4),
    };
    let read = |source: &mut Source<_>| -> std::result::Result<CheckpointMeta, Fault> {
        let magic: [u8; 8] = source.array()?;
        if &magic != MAGIC {
            return Err(Fault::Format(
                "not a headroom checkpoint (bad magic)".into(),
            ));
        }
        let version = u32::from_le_bytes(source.array()?);
        if !(OLDEST_READABLE..=FORMAT_VERSION).contains(&version) {
            return Err(Fault::Format(format!(
                "format version {version}, this build reads {OLDEST_READABLE} to {FORMAT_VERSION}"
            )));
        }
        source.meta(version)
    };
    read(&mut source).map_err(|e| e.into_error(path))
}

/// A checkpoint file and what it holds.
pub type Found = (PathBuf, Checkpoint);

/// The newest checkpoint in `dir` that verifies, with the ones skipped on the
/// way (each with its reason).
pub fn newest_valid(dir: &Path) -> Result<(Option<Found>, Vec<PipelineError>)> {
    let mut skipped = Vec::new();
    for path in list(dir)?.into_iter().rev() {
        match load(&path) {
            Ok(checkpoint) => return Ok((Some((path, checkpoint)), skipped)),
            Err(e) => skipped.push(e),
        }
    }
    Ok((None, skipped))
}

/// The checkpoint a command names (`eval`, `export`): a checkpoint file, or
/// a run directory, whose newest checkpoint that verifies is taken (each
/// newer one it skips is logged with its reason), as `--resume` takes it.
pub fn load_named(path: &Path) -> Result<Found> {
    let refuse = |reason: String| PipelineError::Checkpoint {
        path: path.to_path_buf(),
        reason,
    };
    if !path.is_dir() {
        // "No such" only for a path that is not there: a symlink loop, a
        // dangling link, a FIFO or a permission error each say what it is.
        if crate::paths::is_absent(path) {
            return Err(refuse("no such checkpoint file or run directory".into()));
        }
        if let Some(reason) = crate::paths::problem(path, crate::paths::Want::File) {
            return Err(refuse(format!(
                "the path {reason}; expected a checkpoint file or a run directory"
            )));
        }
        return Ok((path.to_path_buf(), load(path)?));
    }
    let (found, skipped) = newest_valid(path)?;
    for e in &skipped {
        tracing::warn!("skipped {e}");
    }
    found.ok_or_else(|| match skipped.len() {
        0 => refuse(format!(
            "a directory with no {PREFIX}*{SUFFIX} in it: name a checkpoint file, or a run directory that holds one"
        )),
        n => refuse(format!("none of its {n} checkpoints verifies (each is named above)")),
    })
}

#[cfg(test)]
mod tests;
