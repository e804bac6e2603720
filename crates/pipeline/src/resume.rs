//! Choosing and restoring a checkpoint. A checkpoint is refused when the
//! model or a setting that shapes the result differs, with the keys named;
//! settings that only change how the run is carried out (threads, workers,
//! where files go, more epochs) may change.

use std::path::{Path, PathBuf};

use headroom_model::ModelSpec;

use crate::checkpoint::{self, Checkpoint};
use crate::config::{ExperimentConfig, ADVICE_KEYS};
use crate::sink::{self, MetricsPosition};
use crate::{PipelineError, Result};

pub use crate::rundir::Resume;

/// What a checkpoint records of the experiment that wrote it, and what a
/// resume checks against it: an `ExperimentConfig` for `cargo xtask train`,
/// a [`SettingsRecord`] for a `Trainer` built in code, or a fork's own.
pub trait RunRecord: Send + Sync {
    /// A hash of the settings that shape the result.
    fn fingerprint(&self) -> u32;
    /// The experiment as JSON, kept in every checkpoint.
    fn to_json(&self) -> String;
    /// The model's description, kept in every checkpoint.
    fn model_json(&self) -> String;
    /// Whether this experiment may go on from `saved` (found at `path`);
    /// the error names what differs and what to do.
    fn check_resume(&self, path: &Path, saved: &Checkpoint) -> Result<()>;
    /// Records these settings in the run directory `dir` as the run's own,
    /// once [`choose`] has accepted them (a fresh start, or a resume whose
    /// changes are allowed), so that the next `--resume` goes on with them.
    /// A record kept elsewhere (a run built in code) writes nothing.
    fn record_in(&self, dir: &Path) -> Result<()> {
        let _ = dir;
        Ok(())
    }
}

impl RunRecord for ExperimentConfig {
    fn fingerprint(&self) -> u32 {
        ExperimentConfig::fingerprint(self)
    }

    fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    fn model_json(&self) -> String {
        Checkpoint::model_json(&self.model)
    }

    fn check_resume(&self, path: &Path, saved: &Checkpoint) -> Result<()> {
        check_compatible(self, path, saved)
    }

    /// The run's `config.toml`: the overrides a resume was allowed (a lower
    /// learning rate, more epochs, ...) become its settings.
    fn record_in(&self, dir: &Path) -> Result<()> {
        crate::rundir::record_config(dir, self)
    }
}

/// The record of a run built in code: its settings as flat `key = value`
/// pairs (those that shape the result) and its model's description. A
/// resume with any pair or the model changed is refused, naming them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SettingsRecord {
    pub settings: std::collections::BTreeMap<String, String>,
    pub model: String,
}

impl RunRecord for SettingsRecord {
    fn fingerprint(&self) -> u32 {
        let mut hasher = crc32fast::Hasher::new();
        for (key, value) in &self.settings {
            hasher.update(key.as_bytes());
            hasher.update(b"=");
            hasher.update(value.as_bytes());
            hasher.update(b"\n");
        }
        hasher.update(self.model.as_bytes());
        hasher.finalize()
    }

    fn to_json(&self) -> String {
        serde_json::json!({ "settings": self.settings }).to_string()
    }

    fn model_json(&self) -> String {
        self.model.clone()
    }

    fn check_resume(&self, path: &Path, saved: &Checkpoint) -> Result<()> {
        let refuse = |reason: String| PipelineError::Checkpoint {
            path: path.to_path_buf(),
            reason,
        };
        if saved.meta.model_json != self.model {
            return Err(refuse(format!(
                "it was written for a different model ({} in the checkpoint, {} now); \
                 resume with the model that wrote it, or use another run directory",
                saved.meta.model_json, self.model
            )));
        }
        let old: Keys = serde_json::from_str::<serde_json::Value>(&saved.meta.config_json)
            .ok()
            .and_then(|v| serde_json::from_value(v["settings"].clone()).ok())
            .ok_or_else(|| {
                refuse("it was not written by a run built in code (no settings record)".into())
            })?;
        let changed = differences(&old, &self.settings);
        if !changed.is_empty() {
            return Err(refuse(format!(
                "the run differs in settings that change the result: {}. \
                 Resume with the values that wrote it, or start a new run in another directory",
                changed.join("; ")
            )));
        }
        Ok(())
    }
}

/// The checkpoint `resume` asks for in `dir`, checked against `record`;
/// once accepted, `record` becomes the run's recorded settings
/// ([`RunRecord::record_in`]) and the metrics after the checkpoint are cut
/// (a resumed run writes them again). A refused resume changes nothing.
pub fn choose(
    dir: &Path,
    record: &dyn RunRecord,
    resume: &Resume,
) -> Result<Option<(PathBuf, Checkpoint)>> {
    let chosen = find(dir, record, resume)?;
    // Recorded before anything else changes, so a failure to record stops
    // the run with the directory as it was.
    record.record_in(dir)?;
    let position = chosen.as_ref().map(|(_, saved)| MetricsPosition {
        epoch: saved.meta.epoch,
        batches_done: saved.meta.batches_done,
    });
    sink::truncate_metrics(dir, position)?;
    Ok(chosen)
}

fn find(
    dir: &Path,
    record: &dyn RunRecord,
    resume: &Resume,
) -> Result<Option<(PathBuf, Checkpoint)>> {
    let found = match resume {
        Resume::No => {
            refuse_to_overwrite(dir)?;
            return Ok(None);
        }
        Resume::From(path) => (path.clone(), checkpoint::load(path)?),
        Resume::Latest => {
            let (found, skipped) = checkpoint::newest_valid(dir)?;
            for reason in &skipped {
                tracing::warn!("skipping {reason}");
            }
            match found {
                Some(found) => found,
                None => {
                    tracing::warn!(
                        "--resume: no valid checkpoint in {}; starting from the beginning",
                        dir.display()
                    );
                    return Ok(None);
                }
            }
        }
    };
    record.check_resume(&found.0, &found.1)?;
    Ok(Some(found))
}

fn refuse_to_overwrite(dir: &Path) -> Result<()> {
    // Checkpoints a diverged run set aside are that run's too: a new run's
    // record beside them would claim them.
    let set_aside = match std::fs::read_dir(dir) {
        Ok(entries) => entries.filter_map(|entry| entry.ok()).any(|entry| {
            entry
                .file_name()
                .to_string_lossy()
                .ends_with(".ckpt.diverged")
        }),
        Err(_) => false,
    };
    if checkpoint::list(dir)?.is_empty() && !set_aside {
        return Ok(());
    }
    Err(PipelineError::value(
        "run.output_dir",
        format!(
            "{} already holds checkpoints of an earlier run{}. Continue it with `cargo xtask train --resume {}`, \
             or start afresh in another directory (--set run.output_dir=runs/NEW) or after `rm -r {}`",
            dir.display(),
            if set_aside { " (set aside when it diverged)" } else { "" },
            crate::shell::quote_path(dir),
            crate::shell::quote_path(dir)
        ),
    ))
}

fn check_compatible(config: &ExperimentConfig, path: &Path, saved: &Checkpoint) -> Result<()> {
    let refuse = |reason: String| PipelineError::Checkpoint {
        path: path.to_path_buf(),
        reason,
    };
    let saved_model = saved.model().map_err(&refuse)?;
    if let Some(difference) = model_difference(&saved_model, &config.model) {
        return Err(refuse(format!(
            "it was written for a different model ({difference}); \
             resume with the experiment that wrote it, or use another run.output_dir"
        )));
    }
    let saved_config: ExperimentConfig = serde_json::from_str(&saved.meta.config_json)
        .map_err(|e| refuse(format!("unreadable experiment record: {e}")))?;
    let (old, new) = (saved_config.result_keys(), config.result_keys());
    // The fingerprint says whether anything differs; the key diff names it.
    // (A fingerprint from a build with other safe keys may differ while no
    // key does: then nothing that shapes the result changed.)
    if saved.meta.config_fingerprint != config.fingerprint() {
        let changed = differences(&old, &new);
        if !changed.is_empty() {
            return Err(refuse(format!(
                "the experiment differs in settings that change the result: {}. \
                 Resume with the values that wrote it, or start a new run in another run.output_dir",
                changed.join("; ")
            )));
        }
    }
    log_advised_changes(&saved_config, config);
    if saved_config.train.epochs != config.train.epochs {
        tracing::info!(
            "train.epochs changed from {} to {}: the schedule is stretched to the new length",
            saved_config.train.epochs,
            config.train.epochs
        );
    }
    Ok(())
}

type Keys = std::collections::BTreeMap<String, String>;

fn differences(old: &Keys, new: &Keys) -> Vec<String> {
    let mut changed: Vec<String> = new
        .iter()
        .filter(|(key, value)| old.get(*key) != Some(value))
        .map(|(key, value)| {
            let was = old.get(key).map(String::as_str).unwrap_or("unset");
            format!("{key} was {was}, now {value}")
        })
        .collect();
    changed.extend(
        old.keys()
            .filter(|key| !new.contains_key(*key))
            .map(|key| format!("{key} was set, now unset")),
    );
    changed
}

/// The keys a stopped run's advice names may change; each change is said.
fn log_advised_changes(saved: &ExperimentConfig, now: &ExperimentConfig) {
    let (old, new) = (saved.flatten(), now.flatten());
    // How a batch is split may change on resume; what that does to the
    // updates depends on batch norm, and is said as it is.
    for key in ["train.accumulate", "train.micro_batch"] {
        if old.get(key) != new.get(key) {
            let effect = if now.model.uses_batch_statistics() {
                "batch norm's statistics are now those of the new micro-batches, so the updates \
                 differ from those the run had"
            } else {
                "the model has no batch norm: the updates are the same, only the memory changes"
            };
            tracing::info!(
                "{key} changed on resume from {} to {}: {effect}",
                old.get(key).map_or("unset", String::as_str),
                new.get(key).map_or("unset", String::as_str)
            );
        }
    }
    for key in ADVICE_KEYS {
        if old.get(key) != new.get(key) {
            tracing::info!(
                "{key} changed on resume from {} to {}",
                old.get(key).map_or("unset", String::as_str),
                new.get(key).map_or("unset", String::as_str)
            );
        }
    }
}

/// The first difference between two model specifications, named by key.
fn model_difference(saved: &ModelSpec, current: &ModelSpec) -> Option<String> {
    if saved.input != current.input {
        return Some(format!(
            "model.input {:?} in the checkpoint, {:?} now",
            saved.input, current.input
        ));
    }
    if saved.mean != current.mean || saved.std != current.std {
        return Some("model.mean / model.std differ".into());
    }
    if saved.layers.len() != current.layers.len() {
        return Some(format!(
            "model.layers has {} entries in the checkpoint, {} now",
            saved.layers.len(),
            current.layers.len()
        ));
    }
    let (i, (was, now)) = saved
        .layers
        .iter()
        .zip(&current.layers)
        .enumerate()
        .find(|(_, (a, b))| a != b)?;
    Some(format!("model.layers[{i}] was {was:?}, now {now:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_run_is_refused_beside_checkpoints_a_diverged_run_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        assert!(
            refuse_to_overwrite(dir.path()).is_ok(),
            "an empty directory"
        );
        std::fs::write(dir.path().join("metrics.jsonl"), "").unwrap();
        assert!(refuse_to_overwrite(dir.path()).is_ok(), "no checkpoint");
        let aside = dir.path().join("checkpoint-step0000000100.ckpt.diverged");
        std::fs::write(&aside, b"state").unwrap();
        let err = refuse_to_overwrite(dir.path()).unwrap_err().to_string();
        assert!(err.contains("set aside when it diverged"), "{err}");
        assert!(err.contains("--resume"), "{err}");
    }
}
