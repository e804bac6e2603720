//! `cargo xtask eval --checkpoint <path>`: rebuilds the model a checkpoint
//! was written for, restores its weights and batch-norm statistics, and
//! measures the test split: accuracy, loss and the confusion matrix.

use std::path::{Path, PathBuf};

use headroom_model::loss::softmax_cross_entropy;
use headroom_model::{Mode, Network};

use crate::config::ExperimentConfig;
use crate::{checkpoint, data, PipelineError, Result};

#[derive(Clone, Debug)]
pub struct EvalReport {
    pub checkpoint: PathBuf,
    pub epoch: u64,
    pub step: u64,
    pub samples: usize,
    pub accuracy: f32,
    pub loss: f32,
    /// `confusion[truth][predicted]` counts.
    pub confusion: Vec<Vec<u64>>,
}

/// Evaluates `path` on the test split of the experiment that wrote it (its
/// data directory replaced by `data_dir` when given).
pub fn evaluate_checkpoint(
    path: &Path,
    data_dir: Option<PathBuf>,
    batch: usize,
) -> Result<EvalReport> {
    let saved = checkpoint::load(path)?;
    let bad = |reason: String| PipelineError::Checkpoint {
        path: path.to_path_buf(),
        reason,
    };
    let mut config: ExperimentConfig = serde_json::from_str(&saved.meta.config_json)
        .map_err(|e| bad(format!("unreadable experiment record: {e}")))?;
    if data_dir.is_some() {
        config.data.dir = data_dir;
    }
    let mut network = Network::build(&config.model, config.run.seed)?;
    let mut params = network.params_mut();
    if params.len() != saved.params.len() {
        return Err(bad(format!(
            "{} parameter tensors for a model of {}",
            saved.params.len(),
            params.len()
        )));
    }
    for (param, values) in params.iter_mut().zip(&saved.params) {
        if param.value.len() != values.len() {
            return Err(bad(format!("{} has the wrong size", param.name)));
        }
        param.value.data_mut().copy_from_slice(values);
    }
    network.restore_buffer_values(&saved.buffers)?;

    let (_, test_set) = data::open_splits(&config, false)?;
    config.train.batch_size = batch;
    let loader = headroom_loader::DataLoader::new(test_set, data::loader_config(&config, false)?)?;
    let classes = network.num_classes();
    let mut confusion = vec![vec![0u64; classes]; classes];
    let (mut loss_sum, mut seen) = (0.0f64, 0usize);
    for batch in loader.epoch(0, 0) {
        let batch = batch?;
        let n = batch.labels.len();
        let logits = network.forward(&network.input_from_u8(n, &batch.pixels)?, Mode::Eval)?;
        loss_sum += softmax_cross_entropy(&logits, &batch.labels, 0.0)?.loss as f64 * n as f64;
        for (row, &truth) in logits.data().chunks_exact(classes).zip(&batch.labels) {
            let predicted =
                (0..classes).fold(0, |best, k| if row[k] > row[best] { k } else { best });
            if let Some(cell) = confusion
                .get_mut(truth as usize)
                .and_then(|r| r.get_mut(predicted))
            {
                *cell += 1;
            }
        }
        seen += n;
    }
    let correct: u64 = (0..classes).map(|k| confusion[k][k]).sum();
    Ok(EvalReport {
        checkpoint: path.to_path_buf(),
        epoch: saved.meta.epoch,
        step: saved.meta.step,
        samples: seen,
        accuracy: correct as f32 / seen.max(1) as f32,
        loss: (loss_sum / seen.max(1) as f64) as f32,
        confusion,
    })
}
