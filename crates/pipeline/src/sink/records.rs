//! What the sink records besides steps: which split an epoch was scored
//! on (`metrics.jsonl` names its figures `validation_*` or `test_*`
//! accordingly), the best epoch, and the test set's one score at the end
//! of a run that has a validation split.

use serde::Serialize;

use super::EpochSummary;
use crate::eval::RegressionMetrics;
use crate::multilabel::MultiLabelMetrics;

/// The split an epoch's figures come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EvaluatedOn {
    /// The test set (no `data.validation`).
    #[default]
    Test,
    /// The validation split carved from the training set.
    Validation,
}

impl EvaluatedOn {
    pub fn is_test(&self) -> bool {
        *self == EvaluatedOn::Test
    }

    /// "test" or "validation", as the log and the records name it.
    pub fn name(self) -> &'static str {
        match self {
            EvaluatedOn::Test => "test",
            EvaluatedOn::Validation => "validation",
        }
    }
}

/// The test set scored once, at the end of a run that chose its epochs by
/// a validation split: with the best checkpoint's weights when the run
/// kept one (`train.early_stopping`), else the last.
#[derive(Clone, Debug, Serialize)]
pub struct TestSummary {
    /// Epochs trained.
    pub epoch: u64,
    /// The (0-based) epoch whose weights were scored.
    pub weights_of_epoch: u64,
    /// Whether those are the best checkpoint's.
    pub from_best_checkpoint: bool,
    pub loss: f32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accuracy: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub macro_f1: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top5_accuracy: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub multilabel: Option<MultiLabelMetrics>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline_loss: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub regression: Option<RegressionMetrics>,
}

/// A new best epoch: its checkpoint (the last one written) becomes
/// `best.ckpt`.
#[derive(Clone, Debug)]
pub struct BestEpoch {
    pub epoch: u64,
    /// "validation loss 0.3120", for the log.
    pub figure: String,
}

/// The JSON of a validation epoch's line in `metrics.jsonl`: its held-out
/// figures named `validation_*`, after the split they come from.
pub(super) fn validation_epoch_record(
    summary: &EpochSummary,
) -> serde_json::Result<serde_json::Value> {
    // Through the text, not `to_value`: an f32 is written as its shortest
    // form (0.8397), which `to_value` would widen to f64 (0.83969998...).
    let mut value: serde_json::Value = serde_json::from_str(&serde_json::to_string(summary)?)?;
    if let Some(map) = value.as_object_mut() {
        let renamed: Vec<(String, serde_json::Value)> = map
            .iter()
            .filter_map(|(k, v)| {
                k.strip_prefix("test_")
                    .map(|rest| (format!("validation_{rest}"), v.clone()))
            })
            .collect();
        map.retain(|k, _| !k.starts_with("test_") && k != "evaluated_on");
        map.extend(renamed);
    }
    Ok(value)
}

/// The test figures of a line: " acc 91.23%", " (MAE …)", or nothing.
pub(super) fn held_out_text(
    accuracy: Option<f32>,
    baseline: Option<f32>,
    regression: Option<RegressionMetrics>,
    multilabel: Option<MultiLabelMetrics>,
) -> String {
    match (baseline, regression, multilabel) {
        (Some(baseline), _, _) => format!(" (copy-last baseline {baseline:.4})"),
        (None, Some(r), _) => format!(" (MAE {:.4}, RMSE {:.4}, R² {:.4})", r.mae, r.rmse, r.r2),
        (None, None, Some(m)) => format!(
            " (exact match {:.2}%, per label {:.2}%, macro-F1 {:.4})",
            m.exact_match * 100.0,
            m.label_accuracy * 100.0,
            m.macro_f1
        ),
        (None, None, None) => super::accuracy_text(accuracy),
    }
}
