//! One file per checkpoint:
//!
//! ```text
//! "HDRMCKPT" | version u32 | meta length u64 | meta (bincode, ≤ 16 MiB)
//!   | 4 tensor lists: params, buffers, Adam first and second moments,
//!     each: count u32, then per tensor: length u64 + f32 LE values
//!   | CRC-32 of everything before u32
//! ```
//!
//! Tensors are written raw with their lengths checked against the bytes that
//! remain, so no corrupt or hostile file can make the reader allocate more
//! than the file holds. A file is written to a temporary name in the same
//! directory, fsynced, renamed, and the directory fsynced: a crash or a full
//! disk leaves the previous checkpoints intact. Resume picks the newest file
//! that verifies and names any it skips.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use headroom_model::ModelSpec;
use headroom_optim::{AdamWState, LossScalerState};
use serde::{Deserialize, Serialize};

use crate::{PipelineError, Result};

const MAGIC: &[u8; 8] = b"HDRMCKPT";
/// 3 adds the loss scaler's state after the optimizer step; 2 is still read.
const FORMAT_VERSION: u32 = 3;
const OLDEST_READABLE: u32 = 2;
const MAX_META_BYTES: usize = 16 << 20;
const PREFIX: &str = "checkpoint-";
const SUFFIX: &str = ".ckpt";

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
    pub fn model_json(spec: &ModelSpec) -> String {
        serde_json::to_string(spec).unwrap_or_default()
    }

    /// The model that wrote this checkpoint.
    pub fn model(&self) -> std::result::Result<ModelSpec, String> {
        serde_json::from_str(&self.meta.model_json)
            .map_err(|e| format!("unreadable model specification: {e}"))
    }

    pub fn encode(&self) -> Result<Vec<u8>> {
        let meta = bincode::serde::encode_to_vec(&self.meta, bincode::config::standard()).map_err(
            |e| PipelineError::Checkpoint {
                path: PathBuf::new(),
                reason: format!("cannot encode: {e}"),
            },
        )?;
        let tensors = [
            &self.params,
            &self.buffers,
            &self.optimizer.first_moment,
            &self.optimizer.second_moment,
        ];
        let tensor_bytes: usize = tensors
            .iter()
            .flat_map(|l| l.iter())
            .map(|t| 8 + 4 * t.len())
            .sum();
        let mut bytes = Vec::with_capacity(20 + meta.len() + 16 + tensor_bytes + 4);
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        bytes.extend_from_slice(&(meta.len() as u64).to_le_bytes());
        bytes.extend_from_slice(&meta);
        for list in tensors {
            bytes.extend_from_slice(&(list.len() as u32).to_le_bytes());
            for tensor in list {
                bytes.extend_from_slice(&(tensor.len() as u64).to_le_bytes());
                for value in tensor {
                    bytes.extend_from_slice(&value.to_le_bytes());
                }
            }
        }
        bytes.extend_from_slice(&self.optimizer.step.to_le_bytes());
        match self.loss_scale {
            None => bytes.push(0),
            Some(state) => {
                bytes.push(1);
                bytes.extend_from_slice(&state.scale.to_le_bytes());
                bytes.extend_from_slice(&state.clean_steps.to_le_bytes());
            }
        }
        let crc = crc32fast::hash(&bytes);
        bytes.extend_from_slice(&crc.to_le_bytes());
        Ok(bytes)
    }

    /// Verifies magic, version and checksum, then decodes with every length
    /// checked, so a torn or corrupt file is reported, never half-loaded.
    pub fn decode(bytes: &[u8], path: &Path) -> Result<Self> {
        let bad = |reason: String| PipelineError::Checkpoint {
            path: path.to_path_buf(),
            reason,
        };
        if bytes.len() < 8 || &bytes[..8] != MAGIC {
            return Err(bad(
                "not a headroom checkpoint (bad magic or too short)".into()
            ));
        }
        let Some((body, crc_bytes)) = bytes.split_last_chunk::<4>() else {
            return Err(bad("truncated".into()));
        };
        if crc32fast::hash(body) != u32::from_le_bytes(*crc_bytes) {
            return Err(bad(
                "checksum mismatch: the file is truncated or corrupt".into()
            ));
        }
        let mut reader = Reader { bytes: &body[8..] };
        let version = u32::from_le_bytes(reader.array().map_err(&bad)?);
        if !(OLDEST_READABLE..=FORMAT_VERSION).contains(&version) {
            return Err(bad(format!(
                "format version {version}, this build reads {OLDEST_READABLE} to {FORMAT_VERSION}"
            )));
        }
        let meta_len = u64::from_le_bytes(reader.array().map_err(&bad)?);
        if meta_len > MAX_META_BYTES as u64 {
            return Err(bad(format!("metadata of {meta_len} bytes is implausible")));
        }
        let meta_bytes = reader.take(meta_len as usize).map_err(&bad)?;
        let (meta, _) = bincode::serde::decode_from_slice::<CheckpointMeta, _>(
            meta_bytes,
            bincode::config::standard().with_limit::<MAX_META_BYTES>(),
        )
        .map_err(|e| bad(format!("cannot decode metadata: {e}")))?;
        let params = reader.tensors().map_err(&bad)?;
        let buffers = reader.tensors().map_err(&bad)?;
        let first_moment = reader.tensors().map_err(&bad)?;
        let second_moment = reader.tensors().map_err(&bad)?;
        let step = u64::from_le_bytes(reader.array().map_err(&bad)?);
        let loss_scale = if version >= 3 {
            reader.loss_scale().map_err(&bad)?
        } else {
            None
        };
        if !reader.bytes.is_empty() {
            return Err(bad(format!(
                "{} unexpected bytes after the tensors",
                reader.bytes.len()
            )));
        }
        Ok(Self {
            meta,
            params,
            buffers,
            optimizer: AdamWState {
                step,
                first_moment,
                second_moment,
            },
            loss_scale,
        })
    }
}

/// A cursor whose every read is checked against what remains.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        if n > self.bytes.len() {
            return Err(format!(
                "truncated: needs {n} more bytes, {} remain",
                self.bytes.len()
            ));
        }
        let (head, tail) = self.bytes.split_at(n);
        self.bytes = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> std::result::Result<[u8; N], String> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn loss_scale(&mut self) -> std::result::Result<Option<LossScalerState>, String> {
        match self.array::<1>()? {
            [0] => Ok(None),
            [1] => {
                let scale = f32::from_le_bytes(self.array()?);
                let clean_steps = u32::from_le_bytes(self.array()?);
                if !(scale.is_finite() && scale > 0.0) {
                    return Err(format!("loss scale {scale} is not a positive number"));
                }
                Ok(Some(LossScalerState { scale, clean_steps }))
            }
            [other] => Err(format!("loss-scale flag {other} is neither 0 nor 1")),
        }
    }

    fn tensors(&mut self) -> std::result::Result<Vec<Vec<f32>>, String> {
        let count = u32::from_le_bytes(self.array()?) as usize;
        // Each tensor needs at least its 8-byte length: bounds the list.
        if count > self.bytes.len() / 8 {
            return Err(format!(
                "claims {count} tensors in {} bytes",
                self.bytes.len()
            ));
        }
        let mut list = Vec::with_capacity(count);
        for _ in 0..count {
            let len = u64::from_le_bytes(self.array()?);
            let byte_len = usize::try_from(len)
                .ok()
                .and_then(|l| l.checked_mul(4))
                .ok_or_else(|| format!("tensor length {len} is implausible"))?;
            let raw = self.take(byte_len)?;
            list.push(
                raw.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            );
        }
        Ok(list)
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
    fs::create_dir_all(dir).map_err(|e| PipelineError::io(dir, e))?;
    let bytes = checkpoint.encode()?;
    let name = file_name(checkpoint.meta.step);
    let path = dir.join(&name);
    let tmp = dir.join(format!(".{name}.tmp"));
    let write_tmp = || -> std::io::Result<()> {
        let mut file = File::create(&tmp)?;
        file.write_all(&bytes)?;
        file.sync_all()
    };
    if let Err(e) = write_tmp() {
        let _ = fs::remove_file(&tmp);
        return Err(PipelineError::io(&tmp, e));
    }
    fs::rename(&tmp, &path).map_err(|e| PipelineError::io(&path, e))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| PipelineError::io(dir, e))?;
    prune(dir, keep)?;
    Ok(path)
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

/// Reads and verifies one checkpoint.
pub fn load(path: &Path) -> Result<Checkpoint> {
    let bytes = fs::read(path).map_err(|e| PipelineError::io(path, e))?;
    Checkpoint::decode(&bytes, path)
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

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample(step: u64) -> Checkpoint {
        Checkpoint {
            meta: CheckpointMeta {
                config_fingerprint: 7,
                config_json: "{}".into(),
                model_json: Checkpoint::model_json(&ModelSpec {
                    input: [2, 2, 1],
                    mean: 0.0,
                    std: 1.0,
                    layers: vec![headroom_model::LayerSpec::Relu],
                    checkpoint: Default::default(),
                    tokens: None,
                    frames: None,
                }),
                epoch: step / 10,
                batches_done: (step % 10) as usize,
                step,
                consecutive_skips: 0,
                progress: EpochProgress {
                    loss_sum: 1.5,
                    correct: 3,
                    seen: 4,
                    skipped: 0,
                    train_seconds: 0.25,
                },
            },
            params: vec![vec![1.0, -2.5], vec![3.0]],
            buffers: vec![vec![0.5]],
            optimizer: AdamWState {
                step: 3,
                first_moment: vec![vec![0.1, 0.2], vec![0.3]],
                second_moment: vec![vec![0.01, 0.02], vec![0.03]],
            },
            loss_scale: Some(LossScalerState {
                scale: 32768.0,
                clean_steps: 17,
            }),
        }
    }

    #[test]
    fn a_format_2_file_without_a_loss_scale_still_loads() {
        let checkpoint = Checkpoint {
            loss_scale: None,
            ..sample(12)
        };
        let mut bytes = checkpoint.encode().unwrap();
        // Format 2: version 2 and no loss-scale flag before the checksum.
        bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
        bytes.truncate(bytes.len() - 5);
        let crc = crc32fast::hash(&bytes);
        bytes.extend_from_slice(&crc.to_le_bytes());
        let loaded = Checkpoint::decode(&bytes, Path::new("old.ckpt")).unwrap();
        assert_eq!(loaded, checkpoint);
        bytes.truncate(bytes.len() - 4);
        bytes[8..12].copy_from_slice(&1u32.to_le_bytes());
        let crc = crc32fast::hash(&bytes);
        bytes.extend_from_slice(&crc.to_le_bytes());
        let err = Checkpoint::decode(&bytes, Path::new("older.ckpt")).unwrap_err();
        assert!(err.to_string().contains("format version 1"), "{err}");
    }

    #[test]
    fn round_trip_and_keep_last_k() {
        let dir = tempfile::tempdir().unwrap();
        for step in [5, 10, 15, 20] {
            write(dir.path(), &sample(step), 2).unwrap();
        }
        assert_eq!(list(dir.path()).unwrap().len(), 2);
        let (found, skipped) = newest_valid(dir.path()).unwrap();
        let (path, checkpoint) = found.unwrap();
        assert!(skipped.is_empty());
        assert!(path.ends_with(file_name(20)));
        assert_eq!(checkpoint, sample(20));
        assert_eq!(
            checkpoint.model().unwrap().layers,
            vec![headroom_model::LayerSpec::Relu]
        );
    }

    #[test]
    fn corrupt_newest_is_skipped_and_named() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &sample(1), 3).unwrap();
        let newest = write(dir.path(), &sample(2), 3).unwrap();
        let mut bytes = fs::read(&newest).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0xFF;
        fs::write(&newest, &bytes).unwrap();
        let (found, skipped) = newest_valid(dir.path()).unwrap();
        assert_eq!(found.unwrap().1.meta.step, 1);
        assert_eq!(skipped.len(), 1);
        let reason = skipped[0].to_string();
        assert!(
            reason.contains("checksum") && reason.contains(&file_name(2)),
            "{reason}"
        );
    }

    #[test]
    fn every_truncation_is_rejected_with_the_path() {
        let bytes = sample(1).encode().unwrap();
        for cut in 0..bytes.len() {
            let err = Checkpoint::decode(&bytes[..cut], Path::new("x.ckpt")).unwrap_err();
            assert!(err.to_string().contains("x.ckpt"), "{err}");
        }
    }

    #[test]
    fn full_disk_keeps_the_previous_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &sample(1), 3).unwrap();
        // The temporary file of the next write is /dev/full: every write to
        // it fails with ENOSPC, as on a full disk.
        let tmp = dir.path().join(format!(".{}.tmp", file_name(2)));
        std::os::unix::fs::symlink("/dev/full", &tmp).unwrap();
        let err = write(dir.path(), &sample(2), 3).unwrap_err().to_string();
        assert!(err.contains(".tmp"), "{err}");
        assert!(!tmp.exists(), "the temporary file is cleaned up");
        let (found, skipped) = newest_valid(dir.path()).unwrap();
        assert!(skipped.is_empty());
        assert_eq!(found.unwrap().1, sample(1));
    }
}
