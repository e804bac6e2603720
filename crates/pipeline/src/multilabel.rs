//! Multi-label classification (`train.loss = "bce"`): each output is an
//! independent yes/no, its sigmoid the probability of "yes", and a label
//! is predicted where that probability is at least one half (a logit of at
//! least 0). The figures a run reports for it.

use serde::Serialize;

/// A multi-label model's figures over a set, every label at the 0.5
/// threshold.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct MultiLabelMetrics {
    /// The share of samples whose every label is right.
    pub exact_match: f32,
    /// The share of (sample, label) decisions that are right.
    pub label_accuracy: f32,
    /// The mean over labels of each label's F1 (labels that never occur as
    /// a truth or a prediction left out).
    pub macro_f1: f32,
    /// F1 of all the decisions pooled.
    pub micro_f1: f32,
}

/// Counts over a set, per label: true positives, false positives, false
/// negatives; and the samples with every label right.
#[derive(Clone, Debug, Default)]
pub(crate) struct MultiLabelSums {
    samples: u64,
    exact: u64,
    right: u64,
    per_label: Vec<[u64; 3]>,
}

impl MultiLabelSums {
    /// Adds rows of `labels` logits and their 0/1 truths.
    pub fn add(&mut self, labels: usize, logits: &[f32], truth: &[f32]) {
        let labels = labels.max(1);
        if self.per_label.len() != labels {
            self.per_label = vec![[0; 3]; labels];
        }
        for (row, truth_row) in logits.chunks_exact(labels).zip(truth.chunks_exact(labels)) {
            let mut all_right = true;
            for (j, (&logit, &t)) in row.iter().zip(truth_row).enumerate() {
                let (predicted, actual) = (logit >= 0.0, t >= 0.5);
                let counts = &mut self.per_label[j];
                match (predicted, actual) {
                    (true, true) => counts[0] += 1,
                    (true, false) => counts[1] += 1,
                    (false, true) => counts[2] += 1,
                    (false, false) => {}
                }
                if predicted == actual {
                    self.right += 1;
                } else {
                    all_right = false;
                }
            }
            self.samples += 1;
            self.exact += u64::from(all_right);
        }
    }

    pub fn metrics(&self) -> Option<MultiLabelMetrics> {
        if self.samples == 0 || self.per_label.is_empty() {
            return None;
        }
        let f1 = |[tp, fp, fn_]: [u64; 3]| {
            (tp + fp + fn_ > 0).then(|| 2.0 * tp as f64 / (2 * tp + fp + fn_) as f64)
        };
        let scored: Vec<f64> = self.per_label.iter().filter_map(|&c| f1(c)).collect();
        let pooled = self.per_label.iter().fold([0u64; 3], |acc, c| {
            [acc[0] + c[0], acc[1] + c[1], acc[2] + c[2]]
        });
        let decisions = self.samples * self.per_label.len() as u64;
        Some(MultiLabelMetrics {
            exact_match: (self.exact as f64 / self.samples as f64) as f32,
            label_accuracy: (self.right as f64 / decisions as f64) as f32,
            macro_f1: if scored.is_empty() {
                1.0
            } else {
                (scored.iter().sum::<f64>() / scored.len() as f64) as f32
            },
            micro_f1: f1(pooled).unwrap_or(1.0) as f32,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_decided_at_a_logit_of_zero_and_counted_per_label() {
        let mut sums = MultiLabelSums::default();
        // Two samples, three labels.
        let logits = [2.0, -1.0, 0.5, -3.0, 1.0, -0.5];
        let truth = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0];
        sums.add(3, &logits, &truth);
        let m = sums.metrics().unwrap();
        // Sample 0 all right; sample 1 wrong on labels 1 and 2.
        assert_eq!(m.exact_match, 0.5);
        assert!((m.label_accuracy - 4.0 / 6.0).abs() < 1e-6);
        // Label 0: tp 1 -> F1 1; label 1: fp 1 -> 0; label 2: tp 1, fn 1 -> 2/3.
        assert!((m.macro_f1 - (1.0 + 0.0 + 2.0 / 3.0) / 3.0).abs() < 1e-6);
        // Pooled: tp 2, fp 1, fn 1 -> 4/6.
        assert!((m.micro_f1 - 4.0 / 6.0).abs() < 1e-6);
        assert!(MultiLabelSums::default().metrics().is_none());
    }
}
