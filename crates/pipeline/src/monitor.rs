//! Early stopping and the best checkpoint (`train.early_stopping`): one
//! figure of each epoch's validation pass is watched; the epoch that
//! improves on the best so far (by more than `min_delta`) has its
//! checkpoint kept as `best.ckpt`, and `patience` epochs in a row without
//! one end the run.
//!
//! The watch's state (the best value, its epoch, the epochs since) is part
//! of every checkpoint, so a killed and resumed run stops at the same
//! epoch and keeps the same best checkpoint as one that was never stopped.

use serde::{Deserialize, Serialize};

use crate::setting_enum::setting_enum;
use crate::{PipelineError, Result};

setting_enum! {
    /// The validation figure `train.early_stopping.metric` watches.
    #[derive(Default)]
    pub enum Monitored {
        /// The mean loss (every task).
        #[default]
        Loss = "loss",
        /// The share of correct predictions (classifiers, token models).
        Accuracy = "accuracy",
        /// The mean over classes of each class's F1 score (classifiers).
        MacroF1 = "macro_f1",
        /// A regression's mean absolute error, in the targets' units.
        Mae = "mae",
        /// A regression's root mean squared error, in the targets' units.
        Rmse = "rmse",
        /// A regression's coefficient of determination.
        R2 = "r2",
    }
}

setting_enum! {
    /// Whether a smaller or a larger figure is better.
    pub enum MonitorMode {
        Min = "min",
        Max = "max",
    }
}

impl Monitored {
    /// The mode a figure is improved in, when `mode` is not given.
    pub fn natural_mode(self) -> MonitorMode {
        match self {
            Monitored::Loss | Monitored::Mae | Monitored::Rmse => MonitorMode::Min,
            Monitored::Accuracy | Monitored::MacroF1 | Monitored::R2 => MonitorMode::Max,
        }
    }
}

/// `train.early_stopping`: what is watched, and how long a run may go
/// without improving it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EarlyStopping {
    /// The validation figure watched (default: the loss).
    #[serde(default)]
    pub metric: Monitored,
    /// "min" or "max" (default: the metric's own: min for loss, MAE and
    /// RMSE, max for accuracy, macro-F1 and R²).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<MonitorMode>,
    /// Epochs in a row without an improvement before the run stops; 0: the
    /// run never stops early (the best checkpoint is still kept).
    #[serde(default = "default_patience")]
    pub patience: u64,
    /// How much better than the best so far a figure must be to count as
    /// an improvement.
    #[serde(default)]
    pub min_delta: f64,
}

fn default_patience() -> u64 {
    5
}

impl Default for EarlyStopping {
    fn default() -> Self {
        Self {
            metric: Monitored::Loss,
            mode: None,
            patience: default_patience(),
            min_delta: 0.0,
        }
    }
}

impl EarlyStopping {
    pub fn mode(&self) -> MonitorMode {
        self.mode.unwrap_or(self.metric.natural_mode())
    }

    /// Refuses settings that cannot work, naming the key.
    pub fn validate(&self) -> Result<()> {
        if !(self.min_delta.is_finite() && self.min_delta >= 0.0) {
            return Err(PipelineError::value(
                "train.early_stopping.min_delta",
                format!("must be a finite number >= 0, got {}", self.min_delta),
            ));
        }
        Ok(())
    }

    /// "validation loss (min, patience 5)".
    pub fn describe(&self) -> String {
        format!(
            "validation {} ({}, patience {})",
            self.metric,
            self.mode(),
            self.patience
        )
    }
}

/// Where the watch stands: kept in every checkpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MonitorState {
    /// The best figure so far and the (0-based) epoch that gave it; None
    /// before the first evaluation.
    pub best: Option<(f64, u64)>,
    /// Epochs evaluated since the best one.
    pub epochs_since_best: u64,
}

/// What an epoch's figure means for the run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Verdict {
    /// A new best: its checkpoint becomes `best.ckpt`.
    pub improved: bool,
    /// `patience` epochs without an improvement: the run ends.
    pub stop: bool,
}

impl MonitorState {
    /// Takes epoch `epoch`'s figure.
    pub fn observe(&mut self, settings: &EarlyStopping, value: f64, epoch: u64) -> Verdict {
        let improved = match self.best {
            None => true,
            Some((best, _)) => match settings.mode() {
                MonitorMode::Min => value < best - settings.min_delta,
                MonitorMode::Max => value > best + settings.min_delta,
            },
        };
        if improved {
            self.best = Some((value, epoch));
            self.epochs_since_best = 0;
        } else {
            self.epochs_since_best += 1;
        }
        Verdict {
            improved,
            stop: self.exhausted(settings),
        }
    }

    /// Whether the run has gone `patience` epochs without improving.
    pub fn exhausted(&self, settings: &EarlyStopping) -> bool {
        settings.patience > 0 && self.epochs_since_best >= settings.patience
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch(metric: Monitored, patience: u64, min_delta: f64, values: &[f64]) -> Vec<Verdict> {
        let settings = EarlyStopping {
            metric,
            mode: None,
            patience,
            min_delta,
        };
        let mut state = MonitorState::default();
        values
            .iter()
            .enumerate()
            .map(|(epoch, &v)| state.observe(&settings, v, epoch as u64))
            .collect()
    }

    #[test]
    fn a_loss_improves_downwards_and_patience_counts_epochs_without() {
        let verdicts = watch(Monitored::Loss, 2, 0.0, &[1.0, 0.8, 0.9, 0.7, 0.75, 0.71]);
        let improved: Vec<bool> = verdicts.iter().map(|v| v.improved).collect();
        let stop: Vec<bool> = verdicts.iter().map(|v| v.stop).collect();
        assert_eq!(improved, [true, true, false, true, false, false]);
        assert_eq!(stop, [false, false, false, false, false, true]);
    }

    #[test]
    fn an_accuracy_improves_upwards_by_more_than_min_delta() {
        let verdicts = watch(Monitored::Accuracy, 0, 0.01, &[0.5, 0.505, 0.52, 0.1]);
        let improved: Vec<bool> = verdicts.iter().map(|v| v.improved).collect();
        assert_eq!(improved, [true, false, true, false]);
        // Patience 0: never stops.
        assert!(verdicts.iter().all(|v| !v.stop));
    }

    #[test]
    fn a_negative_min_delta_is_refused() {
        let settings = EarlyStopping {
            min_delta: -1.0,
            ..EarlyStopping::default()
        };
        let err = settings.validate().unwrap_err().to_string();
        assert!(err.contains("train.early_stopping.min_delta"), "{err}");
    }
}
