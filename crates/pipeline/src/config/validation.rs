//! `data.validation` and `train.early_stopping`: the split each epoch is
//! scored on, and the figure of it a run watches.

use super::{DataFormat, ExperimentConfig};
use crate::monitor::Monitored;
use crate::{PipelineError, Result};

impl ExperimentConfig {
    /// How many training samples `data.validation` sets aside from a
    /// training set of `train_len`: None when it is unset.
    pub fn validation_count(&self, train_len: usize) -> Result<Option<usize>> {
        let Some(value) = self.data.validation else {
            return Ok(None);
        };
        let count = if value < 1.0 {
            (value * train_len as f64).round() as usize
        } else {
            value as usize
        };
        if count == 0 || count >= train_len {
            return Err(PipelineError::value(
                "data.validation",
                format!(
                    "{value} of a training set of {train_len} samples is {count}: a validation \
                     split must leave at least one sample on each side"
                ),
            ));
        }
        Ok(Some(count))
    }

    /// A fraction in (0, 1) or a whole count >= 1; formats that have a
    /// split of their own refuse it; early stopping watches a figure the
    /// task has, on a validation split.
    pub(super) fn check_validation_keys(&self) -> Result<()> {
        if let Some(value) = self.data.validation {
            let fraction = value > 0.0 && value < 1.0;
            let count = value >= 1.0 && value.fract() == 0.0 && value < 1e15;
            if !(fraction || count) {
                return Err(PipelineError::value(
                    "data.validation",
                    format!(
                        "expected a fraction of the training set (0 < x < 1, such as 0.1) or a \
                         whole number of samples (such as 5000), got {value}"
                    ),
                ));
            }
            if matches!(
                self.data.format,
                DataFormat::Text | DataFormat::MovingFashionMnist
            ) {
                return Err(PipelineError::value(
                    "data.validation",
                    format!(
                        "data.format = \"{}\" scores each epoch on its own held-out split \
                         already: leave data.validation unset",
                        self.data.format
                    ),
                ));
            }
        }
        if self.data.bad_samples == Some(super::BadSamples::Skip)
            && !matches!(self.data.format, DataFormat::ImageFolder | DataFormat::Csv)
        {
            return Err(PipelineError::value(
                "data.bad_samples",
                format!(
                    "\"skip\" applies to \"image_folder\" and \"csv\" data, whose images and rows \
                     are read one by one; \"{}\" data is checked whole: remove it",
                    self.data.format
                ),
            ));
        }
        let Some(stopping) = &self.train.early_stopping else {
            return Ok(());
        };
        stopping.validate()?;
        if self.data.validation.is_none() {
            return Err(PipelineError::value(
                "train.early_stopping",
                "needs data.validation (a fraction such as 0.1, or a count): choosing the \
                 epoch by the test set would leave no unbiased test figure",
            ));
        }
        let regression = self.train.loss.is_regression();
        let metric = stopping.metric;
        let fits = match metric {
            Monitored::Loss => true,
            Monitored::Accuracy | Monitored::MacroF1 => !regression,
            Monitored::Mae | Monitored::Rmse | Monitored::R2 => regression,
        };
        if !fits {
            let task = if regression {
                "a regression (train.loss = \"mse\" or \"huber\"): loss, mae, rmse or r2"
            } else if self.train.loss.is_multilabel() {
                "a multi-label model (train.loss = \"bce\"): loss, accuracy (exact match) or \
                 macro_f1"
            } else {
                "a classifier: loss, accuracy or macro_f1"
            };
            return Err(PipelineError::value(
                "train.early_stopping.metric",
                format!("\"{metric}\" is not a figure of {task}"),
            ));
        }
        Ok(())
    }
}
