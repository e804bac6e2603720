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

/// Finds the checkpoint to resume from, checked against `config`, and cuts
/// the run's metrics back to it, so that no step is recorded twice.
pub fn choose(config: &ExperimentConfig, resume: &Resume) -> Result<Option<(PathBuf, Checkpoint)>> {
    let chosen = find(config, resume)?;
    let position = chosen.as_ref().map(|(_, saved)| MetricsPosition {
        epoch: saved.meta.epoch,
        batches_done: saved.meta.batches_done,
    });
    sink::truncate_metrics(config.output_dir(), position)?;
    Ok(chosen)
}

fn find(config: &ExperimentConfig, resume: &Resume) -> Result<Option<(PathBuf, Checkpoint)>> {
    let found = match resume {
        Resume::No => {
            refuse_to_overwrite(config)?;
            return Ok(None);
        }
        Resume::From(path) => (path.clone(), checkpoint::load(path)?),
        Resume::Latest => {
            let (found, skipped) = checkpoint::newest_valid(config.output_dir())?;
            for reason in &skipped {
                tracing::warn!("skipping {reason}");
            }
            match found {
                Some(found) => found,
                None => {
                    tracing::warn!(
                        "--resume: no valid checkpoint in {}; starting from the beginning",
                        config.output_dir().display()
                    );
                    return Ok(None);
                }
            }
        }
    };
    check_compatible(config, &found.0, &found.1)?;
    Ok(Some(found))
}

fn refuse_to_overwrite(config: &ExperimentConfig) -> Result<()> {
    if checkpoint::list(config.output_dir())?.is_empty() {
        return Ok(());
    }
    Err(PipelineError::value(
        "run.output_dir",
        format!(
            "{} already holds checkpoints of an earlier run. Continue it with `cargo xtask train --resume {}`, \
             or start afresh in another directory (--set run.output_dir=runs/NEW) or after `rm -r {}`",
            config.output_dir().display(),
            config.output_dir().display(),
            config.output_dir().display()
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
