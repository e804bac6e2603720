//! One file per checkpoint:
//!
//! ```text
//! "HDRMCKPT" | format version u32 LE | payload length u64 LE | payload (bincode) | CRC-32 of all before u32 LE
//! ```
//!
//! The payload holds the model specification, f32 weights, batch-norm running
//! statistics, optimizer moments and the position in the run. A file is
//! written to a temporary name in the same directory, fsynced, renamed, and
//! the directory fsynced, so a crash leaves either the old set or the new one.
//! On resume the newest file that verifies wins; broken ones are named.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use headroom_model::ModelSpec;
use headroom_optim::AdamWState;
use serde::{Deserialize, Serialize};

use crate::{PipelineError, Result};

const MAGIC: &[u8; 8] = b"HDRMCKPT";
const FORMAT_VERSION: u32 = 1;
const HEADER_LEN: usize = 8 + 4 + 8;
const PREFIX: &str = "checkpoint-";
const SUFFIX: &str = ".ckpt";

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Checkpoint {
    pub config_fingerprint: u32,
    /// Epochs completed; training resumes at this epoch.
    pub epoch: u64,
    /// Optimizer steps applied so far (the schedule's position).
    pub step: u64,
    pub model: ModelSpec,
    pub params: Vec<Vec<f32>>,
    pub buffers: Vec<Vec<f32>>,
    pub optimizer: AdamWState,
}

impl Checkpoint {
    pub fn encode(&self) -> Result<Vec<u8>> {
        let payload =
            bincode::serde::encode_to_vec(self, bincode::config::standard()).map_err(|e| {
                PipelineError::Checkpoint {
                    path: PathBuf::new(),
                    reason: format!("cannot encode: {e}"),
                }
            })?;
        let mut bytes = Vec::with_capacity(HEADER_LEN + payload.len() + 4);
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        bytes.extend_from_slice(&payload);
        let crc = crc32fast::hash(&bytes);
        bytes.extend_from_slice(&crc.to_le_bytes());
        Ok(bytes)
    }

    /// Verifies magic, version, length and checksum before decoding, so a
    /// torn or corrupt file is reported, never half-loaded.
    pub fn decode(bytes: &[u8], path: &Path) -> Result<Self> {
        let bad = |reason: String| PipelineError::Checkpoint {
            path: path.to_path_buf(),
            reason,
        };
        if bytes.len() < HEADER_LEN + 4 || &bytes[..8] != MAGIC {
            return Err(bad(
                "not a headroom checkpoint (bad magic or too short)".into()
            ));
        }
        let version = u32::from_le_bytes(
            bytes[8..12]
                .try_into()
                .map_err(|_| bad("short header".into()))?,
        );
        if version != FORMAT_VERSION {
            return Err(bad(format!(
                "format version {version}, this build reads {FORMAT_VERSION}"
            )));
        }
        let len = u64::from_le_bytes(
            bytes[12..20]
                .try_into()
                .map_err(|_| bad("short header".into()))?,
        );
        let expected = (HEADER_LEN as u64).saturating_add(len).saturating_add(4);
        if expected != bytes.len() as u64 {
            return Err(bad(format!(
                "truncated or padded: header promises {expected} bytes, file has {}",
                bytes.len()
            )));
        }
        let (body, crc_bytes) = bytes.split_at(bytes.len() - 4);
        let stored = u32::from_le_bytes(
            crc_bytes
                .try_into()
                .map_err(|_| bad("short trailer".into()))?,
        );
        if crc32fast::hash(body) != stored {
            return Err(bad("checksum mismatch: the file is corrupt".into()));
        }
        let (checkpoint, _) =
            bincode::serde::decode_from_slice(&body[HEADER_LEN..], bincode::config::standard())
                .map_err(|e| bad(format!("cannot decode: {e}")))?;
        Ok(checkpoint)
    }
}

/// The file name of the checkpoint after `epoch` epochs; zero-padded so that
/// names sort by epoch.
pub fn file_name(epoch: u64) -> String {
    format!("{PREFIX}epoch{epoch:05}{SUFFIX}")
}

/// Writes atomically, then deletes all but the newest `keep` checkpoints.
pub fn write(dir: &Path, checkpoint: &Checkpoint, keep: usize) -> Result<PathBuf> {
    fs::create_dir_all(dir).map_err(|e| PipelineError::io(dir, e))?;
    let bytes = checkpoint.encode()?;
    let path = dir.join(file_name(checkpoint.epoch));
    let tmp = dir.join(format!(".{}.tmp", file_name(checkpoint.epoch)));
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

pub fn load(path: &Path) -> Result<Checkpoint> {
    let bytes = fs::read(path).map_err(|e| PipelineError::io(path, e))?;
    Checkpoint::decode(&bytes, path)
}

/// The newest checkpoint in `dir` that verifies, with the ones skipped on the
/// way (each with its reason).
pub fn newest_valid(dir: &Path) -> Result<(Option<(PathBuf, Checkpoint)>, Vec<PipelineError>)> {
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

    fn sample(epoch: u64) -> Checkpoint {
        Checkpoint {
            config_fingerprint: 7,
            epoch,
            step: epoch * 10,
            model: ModelSpec {
                input: [2, 2, 1],
                mean: 0.0,
                std: 1.0,
                layers: vec![],
            },
            params: vec![vec![1.0, -2.5], vec![3.0]],
            buffers: vec![vec![0.5]],
            optimizer: AdamWState {
                step: 3,
                first_moment: vec![vec![0.1, 0.2], vec![0.3]],
                second_moment: vec![vec![0.01, 0.02], vec![0.03]],
            },
        }
    }

    #[test]
    fn round_trip_and_keep_last_k() {
        let dir = tempfile::tempdir().unwrap();
        for epoch in 1..=4 {
            write(dir.path(), &sample(epoch), 2).unwrap();
        }
        let files = list(dir.path()).unwrap();
        assert_eq!(files.len(), 2);
        let (found, skipped) = newest_valid(dir.path()).unwrap();
        let (path, checkpoint) = found.unwrap();
        assert!(skipped.is_empty());
        assert!(path.ends_with(file_name(4)));
        assert_eq!(checkpoint, sample(4));
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
        assert_eq!(found.unwrap().1.epoch, 1);
        assert_eq!(skipped.len(), 1);
        let reason = skipped[0].to_string();
        assert!(
            reason.contains("checksum") && reason.contains(&file_name(2)),
            "{reason}"
        );
    }

    #[test]
    fn truncated_file_is_rejected() {
        let bytes = sample(1).encode().unwrap();
        for cut in [0, 5, 20, bytes.len() - 1] {
            let err = Checkpoint::decode(&bytes[..cut], Path::new("x.ckpt")).unwrap_err();
            assert!(err.to_string().contains("x.ckpt"), "{err}");
        }
    }
}
