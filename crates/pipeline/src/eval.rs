//! Evaluation, once for every caller: the epoch-end test pass of a run and
//! `cargo xtask eval --checkpoint <path>`, which rebuilds the learner a
//! checkpoint was written for, restores it, and measures the test split:
//! accuracy, loss and the confusion matrix.

use std::path::{Path, PathBuf};

use headroom_loader::{Batch, DataLoader, SampleKind};
use headroom_model::LayerRegistry;

use crate::checkpoint::{self, Checkpoint};
use crate::config::{ExperimentConfig, TestTimeAugmentation};
use crate::learner::{arg_max, top5_hits, EvalResult, Learner, ValueLoss};
use crate::monitor::Monitored;
use crate::multilabel::{MultiLabelMetrics, MultiLabelSums};
use crate::{data, paths, rundir, PipelineError, Result};

pub use crate::parts::restored_cpu_learner;

/// One pass over a test loader.
#[derive(Clone, Debug, PartialEq)]
pub struct Evaluation {
    pub samples: usize,
    /// Mean loss (no label smoothing); per token for a token model.
    pub loss: f32,
    /// Per sample, or per token for a token model; None for a frame model,
    /// a regression with nothing to count as correct.
    pub accuracy: Option<f32>,
    /// A frame model's copy-last-frame baseline loss on the same frames.
    pub baseline_loss: Option<f32>,
    /// `confusion[truth][predicted]` counts.
    pub confusion: Vec<Vec<u64>>,
    /// A regression's errors in the targets' own units; None otherwise.
    pub regression: Option<RegressionMetrics>,
    /// A classifier of more than 5 classes: the share of samples whose
    /// class is among its 5 highest scores; None otherwise.
    pub top5_accuracy: Option<f32>,
    /// A multi-label model's figures (`train.loss = "bce"`); None otherwise.
    pub multilabel: Option<MultiLabelMetrics>,
}

impl Evaluation {
    /// The watched figure `metric` of this evaluation, or None when its
    /// task has none (here, not in `monitor`, so that the watch names no
    /// evaluation code).
    pub fn figure(&self, metric: Monitored) -> Option<f64> {
        let evaluation = self;
        let regression = evaluation.regression;
        let value = match metric {
            Monitored::Loss => Some(evaluation.loss),
            // A multi-label model's accuracy is its exact-match share.
            Monitored::Accuracy => evaluation
                .accuracy
                .or(evaluation.multilabel.map(|m| m.exact_match)),
            Monitored::MacroF1 => match evaluation.multilabel {
                Some(m) => Some(m.macro_f1),
                None => evaluation
                    .accuracy
                    .and_then(|_| macro_f1(&evaluation.confusion)),
            },
            Monitored::Mae => regression.map(|r| r.mae),
            Monitored::Rmse => regression.map(|r| r.rmse),
            Monitored::R2 => regression.map(|r| r.r2),
        };
        value.map(f64::from)
    }
}

/// A regression's test figures, in the targets' own units (a table's
/// standardisation undone), each the mean over the targets when there are
/// several.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct RegressionMetrics {
    /// Mean absolute error.
    pub mae: f32,
    /// Root mean squared error.
    pub rmse: f32,
    /// Coefficient of determination: 1 - SSE / (the targets' own sum of
    /// squares about their mean); 1 is perfect, 0 is as good as predicting
    /// the mean, negative is worse.
    pub r2: f32,
}

/// Sums over the test set per target, for [`RegressionMetrics`].
#[derive(Clone, Debug, Default)]
struct RegressionSums {
    count: u64,
    /// Per target: Σ|e|, Σe², Σy, Σy².
    per_target: Vec<[f64; 4]>,
}

impl RegressionSums {
    fn add(&mut self, kind: &SampleKind, predicted: &[f32], truth: &[f32]) {
        let k = kind.values.max(1);
        if self.per_target.len() != k {
            self.per_target = vec![[0.0; 4]; k];
        }
        for (p_row, t_row) in predicted.chunks_exact(k).zip(truth.chunks_exact(k)) {
            for (j, (&p, &t)) in p_row.iter().zip(t_row).enumerate() {
                let (p, t) = (f64::from(kind.unscale(j, p)), f64::from(kind.unscale(j, t)));
                let sums = &mut self.per_target[j];
                sums[0] += (p - t).abs();
                sums[1] += (p - t) * (p - t);
                sums[2] += t;
                sums[3] += t * t;
            }
            self.count += 1;
        }
    }

    fn metrics(&self) -> Option<RegressionMetrics> {
        if self.count == 0 || self.per_target.is_empty() {
            return None;
        }
        let n = self.count as f64;
        let targets = self.per_target.len() as f64;
        let (mut mae, mut rmse, mut r2) = (0.0, 0.0, 0.0);
        for &[abs, sq, sum, sum_sq] in &self.per_target {
            mae += abs / n;
            rmse += (sq / n).sqrt();
            let spread = sum_sq - sum * sum / n;
            r2 += if spread > 0.0 { 1.0 - sq / spread } else { 0.0 };
        }
        Some(RegressionMetrics {
            mae: (mae / targets) as f32,
            rmse: (rmse / targets) as f32,
            r2: (r2 / targets) as f32,
        })
    }
}

/// Evaluates `learner` on every batch of `loader` (epoch 0, in order), with
/// test-time augmentation `tta`.
pub fn evaluate(
    learner: &mut dyn Learner,
    loader: &DataLoader,
    tta: TestTimeAugmentation,
) -> Result<Evaluation> {
    evaluate_until(learner, loader, tta, None)?.ok_or_else(|| PipelineError::Stage {
        stage: "evaluation",
        reason: "stopped without a stop request".into(),
    })
}

/// [`evaluate`], given up between two batches once `stop` is set (the
/// first SIGINT or SIGTERM): None then, never the figures of part of the
/// set.
pub fn evaluate_until(
    learner: &mut dyn Learner,
    loader: &DataLoader,
    tta: TestTimeAugmentation,
    stop: Option<&std::sync::atomic::AtomicBool>,
) -> Result<Option<Evaluation>> {
    let classes = learner.num_classes();
    // A data-parallel run shards each batch over its ranks.
    let ranks = learner.ranks().filter(|r| r.active());
    let bar = evaluation_bar(loader.batches_per_epoch());
    let mut confusion = vec![vec![0u64; classes]; classes];
    let (mut loss_sum, mut seen, mut scored) = (0.0f64, 0usize, 0usize);
    let mut baseline_sum: Option<f64> = None;
    let kind = loader.dataset().sample_kind();
    let mut regression: Option<RegressionSums> = None;
    let mut top5: Option<u64> = None;
    let multilabel = learner.value_loss() == Some(ValueLoss::Bce);
    let mut labels: Option<MultiLabelSums> = None;
    for batch in loader.epoch(0, 0) {
        if stop.is_some_and(|s| s.load(std::sync::atomic::Ordering::SeqCst)) {
            bar.finish_and_clear();
            return Ok(None);
        }
        let batch = batch?;
        let result = match &ranks {
            None => score(learner, &batch, tta)?,
            Some(ranks) => {
                let stats = learner.memory_stats();
                crate::eval_shard::score_sharded(ranks, &batch, stats, |part| {
                    score(learner, part, tta)
                })?
            }
        };
        loss_sum += result.loss_sum;
        if let Some(hits) = result.top5_correct {
            *top5.get_or_insert(0) += hits;
        }
        if let (true, Some(predicted), Some(truth)) = (multilabel, &result.values, &batch.values) {
            labels
                .get_or_insert_with(MultiLabelSums::default)
                .add(kind.values, predicted, truth);
            seen += batch.len();
            bar.inc(1);
            continue;
        }
        if let (Some(predicted), Some(truth)) = (&result.values, &batch.values) {
            regression
                .get_or_insert_with(RegressionSums::default)
                .add(&kind, predicted, truth);
            seen += batch.len();
            bar.inc(1);
            continue;
        }
        if let Some(sum) = result.baseline_loss_sum {
            *baseline_sum.get_or_insert(0.0) += sum;
            seen += batch.len();
            bar.inc(1);
            continue;
        }
        // A token model predicts every position of a text window: its
        // predictions are compared with each window's next bytes.
        let truths = if result.predictions.len() == batch.len() {
            batch.labels.clone()
        } else {
            batch.next_token_pairs().1
        };
        for (&truth, &predicted) in truths.iter().zip(&result.predictions) {
            if let Some(cell) = confusion
                .get_mut(truth as usize)
                .and_then(|row| row.get_mut(predicted as usize))
            {
                *cell += 1;
            }
        }
        seen += batch.len();
        scored += truths.len();
        bar.inc(1);
    }
    bar.finish_and_clear();
    let correct: u64 = (0..classes).map(|k| confusion[k][k]).sum();
    let mean = |sum: f64| (sum / seen.max(1) as f64) as f32;
    Ok(Some(Evaluation {
        samples: seen,
        loss: mean(loss_sum),
        accuracy: (baseline_sum.is_none() && regression.is_none() && labels.is_none())
            .then(|| correct as f32 / scored.max(1) as f32),
        baseline_loss: baseline_sum.map(mean),
        confusion,
        regression: regression.as_ref().and_then(RegressionSums::metrics),
        top5_accuracy: top5.map(|hits| hits as f32 / seen.max(1) as f32),
        multilabel: labels.as_ref().and_then(MultiLabelSums::metrics),
    }))
}

/// One batch's result, with test-time augmentation `tta`.
fn score(
    learner: &mut dyn Learner,
    batch: &Batch,
    tta: TestTimeAugmentation,
) -> Result<EvalResult> {
    match tta {
        TestTimeAugmentation::None => learner.eval_batch(batch),
        TestTimeAugmentation::Flip => eval_with_mirror(learner, batch),
    }
}

/// The batch scored by the mean of the class probabilities of each image
/// and its mirror image: the loss is the cross-entropy of that mean.
fn eval_with_mirror(learner: &mut dyn Learner, batch: &Batch) -> Result<EvalResult> {
    let classes = learner.num_classes();
    let mut probabilities = learner.eval_probabilities(batch)?;
    let mirrored = learner.eval_probabilities(&batch.mirrored())?;
    probabilities
        .iter_mut()
        .zip(&mirrored)
        .for_each(|(p, q)| *p = 0.5 * (*p + *q));
    let rows = probabilities.chunks_exact(classes.max(1));
    let loss_sum = rows
        .clone()
        .zip(&batch.labels)
        .map(|(row, &label)| {
            let p = row.get(label as usize).copied().unwrap_or(0.0);
            -f64::from(p.max(f32::MIN_POSITIVE)).ln()
        })
        .sum();
    Ok(EvalResult {
        loss_sum,
        top5_correct: top5_hits(&probabilities, &batch.labels, classes),
        predictions: rows.map(arg_max).collect(),
        baseline_loss_sum: None,
        values: None,
    })
}

/// A progress bar over the test batches on a terminal; hidden otherwise.
fn evaluation_bar(batches: usize) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(batches as u64);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "evaluating [{bar:30}] {pos}/{len} | elapsed {elapsed_precise}, eta {eta_precise}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

#[derive(Clone, Debug)]
pub struct EvalReport {
    pub checkpoint: PathBuf,
    pub epoch: u64,
    pub step: u64,
    pub samples: usize,
    /// None for a frame model (see `Evaluation`).
    pub accuracy: Option<f32>,
    pub loss: f32,
    pub baseline_loss: Option<f32>,
    /// `confusion[truth][predicted]` counts.
    pub confusion: Vec<Vec<u64>>,
    /// A token model's loss in bits per token (byte): loss / ln 2. None for
    /// a classifier. A token model's figures are these, not its
    /// vocabulary-sized confusion matrix.
    pub bits_per_byte: Option<f32>,
    /// A regression's MAE, RMSE and R² in the targets' units.
    pub regression: Option<RegressionMetrics>,
    /// A classifier's macro-averaged F1 ([`macro_f1`]); None for token,
    /// frame and regression models.
    pub macro_f1: Option<f32>,
    /// A classifier of more than 5 classes: top-5 accuracy.
    pub top5_accuracy: Option<f32>,
    /// A multi-label model's figures.
    pub multilabel: Option<MultiLabelMetrics>,
}

/// The mean over classes of each class's F1 score (2·TP / (2·TP + FP +
/// FN)) from `confusion[truth][predicted]`, counting the classes that
/// occur as a truth or a prediction, so that a rare class weighs as much
/// as a common one. None when nothing was counted.
pub fn macro_f1(confusion: &[Vec<u64>]) -> Option<f32> {
    let classes = confusion.len();
    let mut sum = 0.0f64;
    let mut counted = 0usize;
    for k in 0..classes {
        let tp = confusion[k].get(k).copied().unwrap_or(0);
        let truth: u64 = confusion[k].iter().sum();
        let predicted: u64 = confusion.iter().filter_map(|row| row.get(k)).sum();
        let (fn_, fp) = (truth - tp, predicted - tp);
        if truth + predicted == 0 {
            continue;
        }
        sum += 2.0 * tp as f64 / (2 * tp + fp + fn_) as f64;
        counted += 1;
    }
    (counted > 0).then(|| (sum / counted as f64) as f32)
}

/// Evaluates `path` (a checkpoint file, or a run directory's newest valid
/// checkpoint) on the test split of the experiment that wrote it (its
/// data directory replaced by `data_dir` when given), `batch` samples at a
/// time, with the run's test-time augmentation unless `tta` says otherwise.
pub fn evaluate_checkpoint(
    path: &Path,
    data_dir: Option<PathBuf>,
    batch: usize,
    tta: Option<TestTimeAugmentation>,
) -> Result<EvalReport> {
    evaluate_checkpoint_with(path, data_dir, batch, tta, &LayerRegistry::default())
}

/// `evaluate_checkpoint` of a model whose `custom` entries `layers` makes
/// (the registry its run was trained with).
pub fn evaluate_checkpoint_with(
    path: &Path,
    data_dir: Option<PathBuf>,
    batch: usize,
    tta: Option<TestTimeAugmentation>,
    layers: &LayerRegistry,
) -> Result<EvalReport> {
    let (path, saved) = run_checkpoint(path)?;
    let path = path.as_path();
    let mut config: ExperimentConfig =
        serde_json::from_str(&saved.meta.config_json).map_err(|e| PipelineError::Checkpoint {
            path: path.to_path_buf(),
            reason: format!("unreadable experiment record: {e}"),
        })?;
    if data_dir.is_some() {
        config.data.dir = data_dir;
    }
    config.train.batch_size = batch;
    if let Some(tta) = tta {
        config.eval.tta = tta;
        config.validate()?;
    }
    let (epoch, step) = (saved.meta.epoch, saved.meta.step);
    let mut learner = restored_cpu_learner(&config, saved, path, batch, layers)?;
    let (_, test_set) = data::open_splits(&config, false)?;
    let loader = DataLoader::new(test_set, data::loader_config(&config, false)?)?;
    let evaluation = evaluate(&mut learner, &loader, config.eval.tta)?;
    let macro_f1 = evaluation
        .accuracy
        .filter(|_| config.model.tokens.is_none())
        .and_then(|_| macro_f1(&evaluation.confusion));
    Ok(EvalReport {
        checkpoint: path.to_path_buf(),
        epoch,
        step,
        samples: evaluation.samples,
        accuracy: evaluation.accuracy,
        loss: evaluation.loss,
        baseline_loss: evaluation.baseline_loss,
        confusion: evaluation.confusion,
        bits_per_byte: config
            .model
            .tokens
            .map(|_| evaluation.loss / std::f32::consts::LN_2),
        regression: evaluation.regression,
        macro_f1,
        top5_accuracy: evaluation.top5_accuracy,
        multilabel: evaluation.multilabel,
    })
}

/// The checkpoint a command names (`eval`, `export`, a merge's base): a
/// checkpoint file as it is, or a run directory's newest checkpoint that
/// verifies *and is the run's own*. A run directory can hold a file of
/// another run (copied in, or left by a reused `run.output_dir`) whose name
/// sorts last; scoring it would report another model's figures under this
/// run's name. The run's own are those its record (`config.toml`) accepts
/// as `--resume` would: the same model and the same settings that shape
/// the result. Each newer checkpoint skipped is logged with its reason. A
/// directory without a record (a run from before runs kept one) takes the
/// newest that verifies.
pub fn run_checkpoint(path: &Path) -> Result<checkpoint::Found> {
    // A path that is there but is neither a checkpoint nor a run directory
    // (a symlink loop, a FIFO, a directory it may not list) is named as
    // what it is, not as "no such checkpoint".
    if !paths::is_absent(path) {
        let as_dir = path.is_dir().then_some(paths::Want::Dir);
        if let Some(reason) = paths::problem(path, as_dir.unwrap_or(paths::Want::File)) {
            return Err(PipelineError::Checkpoint {
                path: path.to_path_buf(),
                reason,
            });
        }
    }
    let record_path = path.join(rundir::CONFIG_FILE);
    if !path.is_dir() || !record_path.exists() {
        return checkpoint::load_named(path);
    }
    let record = ExperimentConfig::load_resolved(&record_path, &crate::Overrides::default())?;
    let refuse = |reason: String| PipelineError::Checkpoint {
        path: path.to_path_buf(),
        reason,
    };
    let files = checkpoint::list(path)?;
    let mut skipped = 0;
    for file in files.iter().rev() {
        let reason = match checkpoint::load(file) {
            Ok(saved) => match foreign(&record, &saved) {
                None => return Ok((file.clone(), saved)),
                Some(reason) => format!(
                    "checkpoint {}: not this run's own ({reason}; the run's record is {})",
                    file.display(),
                    record_path.display()
                ),
            },
            Err(e) => e.to_string(),
        };
        tracing::warn!("skipped {reason}");
        skipped += 1;
    }
    Err(refuse(match skipped {
        0 => "a directory with no checkpoint in it: name a checkpoint file, or a run directory \
              that holds one"
            .into(),
        n => format!(
            "none of its {n} checkpoints is a verified checkpoint of this run (each is named above)"
        ),
    }))
}

/// Why `saved` is not a checkpoint of the run recorded as `record`: another
/// model, or other settings that shape the result. None: it is the run's.
fn foreign(record: &ExperimentConfig, saved: &Checkpoint) -> Option<String> {
    let model = match saved.model() {
        Ok(model) => model,
        Err(reason) => return Some(reason),
    };
    if model != record.model {
        return Some("written for a different model".into());
    }
    if saved.meta.config_fingerprint == record.fingerprint() {
        return None;
    }
    let written: ExperimentConfig = match serde_json::from_str(&saved.meta.config_json) {
        Ok(config) => config,
        Err(e) => return Some(format!("unreadable experiment record: {e}")),
    };
    let (old, new) = (written.result_keys(), record.result_keys());
    let changed: Vec<&String> = new
        .iter()
        .filter(|(key, value)| old.get(*key) != Some(*value))
        .map(|(key, _)| key)
        .chain(old.keys().filter(|key| !new.contains_key(*key)))
        .collect();
    (!changed.is_empty()).then(|| {
        let keys: Vec<&str> = changed.iter().map(|k| k.as_str()).collect();
        format!("written with other {}", keys.join(", "))
    })
}

#[cfg(test)]
mod tests {
    use super::macro_f1;

    #[test]
    fn macro_f1_weighs_each_class_alike() {
        // Class 0: TP 8, FN 2, FP 1 -> 16/19; class 1: TP 1, FN 1, FP 2
        // -> 2/5; class 2 never occurs and is not counted.
        let confusion = vec![vec![8, 2, 0], vec![1, 1, 0], vec![0, 0, 0]];
        let f1 = macro_f1(&confusion).unwrap();
        let expected = (16.0 / 19.0 + 2.0 / 5.0) / 2.0;
        assert!(
            (f64::from(f1) - expected).abs() < 1e-6,
            "{f1} vs {expected}"
        );
        assert_eq!(macro_f1(&[vec![0, 0], vec![0, 0]]), None);
        assert_eq!(macro_f1(&[vec![5, 0], vec![0, 3]]), Some(1.0));
    }
}
