//! `cargo xtask predict`: a trained run scores new inputs, with the
//! preprocessing it trained with, taken from the run and never given again
//! by hand.
//!
//! What the inputs are follows the run's `data.format`: images (one PNG or
//! JPEG, or a folder of them) for an image model, fit as the run's images
//! were (`data.image_size`, `data.channels`, `data.fit` for an image folder;
//! `model.input` otherwise); a CSV for a table, its features standardised
//! with the statistics the run recorded in `dataset.json`; `.npz`,
//! `.safetensors` or `.npy` inputs for tensor files, and for a store what
//! its source was (its index names a table's columns or a tensor file's
//! arrays). The output is one row
//! per input: a classifier's class (named where the run recorded names) and
//! every class's probability, or a regression's values in the targets' own
//! units. Runs on the CPU, a batch at a time.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use headroom_loader::{
    CsvTable, DataLoader, Dataset, ImageFiles, ImageFit, ImageFolderConfig, LoaderConfig,
    ShardedDataset, StoreSource, TableConfig, TableScale, TableTarget, TensorFiles,
    TensorFilesConfig,
};

use crate::config::{DataFormat, ExperimentConfig};
use crate::eval::{restored_cpu_learner, run_checkpoint};
use crate::learner::{softmax_rows, DeviceKind};
use crate::{data, PipelineError, Result};
use headroom_loader::Element;
use headroom_model::LayerRegistry;

/// What a run predicted for each input.
#[derive(Clone, Debug, PartialEq)]
pub struct Predictions {
    pub checkpoint: PathBuf,
    /// What each row scored: an image file, `line N` of a CSV, `FILE row N`.
    pub sources: Vec<String>,
    pub outputs: PredictedOutputs,
}

#[derive(Clone, Debug, PartialEq)]
pub enum PredictedOutputs {
    /// A classifier: each row's class and its probabilities, `rows *
    /// names.len()`, row-major.
    Classes {
        names: Vec<String>,
        classes: Vec<u32>,
        probabilities: Vec<f32>,
    },
    /// A regression: `rows * names.len()` values in the targets' units.
    Values {
        names: Vec<String>,
        values: Vec<f32>,
    },
}

/// How [`predict_with`] scores.
#[derive(Clone, Debug)]
pub struct PredictOptions {
    /// Samples at a time.
    pub batch: usize,
    /// `Cpu` (the default); `Cuda` for an image classifier (a table's
    /// features and a regression's or multi-label model's values are
    /// scored on the CPU, as they train); `Auto`: the GPU when there is one
    /// and the run is an image classifier, else the CPU.
    pub device: DeviceKind,
    /// Makes the model's `custom` entries (the registry its run was
    /// trained with).
    pub layers: LayerRegistry,
}

impl Default for PredictOptions {
    fn default() -> Self {
        Self {
            batch: 256,
            device: DeviceKind::Cpu,
            layers: LayerRegistry::default(),
        }
    }
}

/// Scores `input` with the model of `checkpoint` (a checkpoint file or a
/// run directory, as `eval` takes it), `batch` samples at a time, on the
/// CPU.
pub fn predict(checkpoint: &Path, input: &Path, batch: usize) -> Result<Predictions> {
    let options = PredictOptions {
        batch,
        ..PredictOptions::default()
    };
    predict_with(checkpoint, input, &options)
}

/// `predict` as `options` say: on the GPU, or with custom layers.
pub fn predict_with(
    checkpoint: &Path,
    input: &Path,
    options: &PredictOptions,
) -> Result<Predictions> {
    let (path, saved) = run_checkpoint(checkpoint)?;
    let config: ExperimentConfig =
        serde_json::from_str(&saved.meta.config_json).map_err(|e| PipelineError::Checkpoint {
            path: path.clone(),
            reason: format!("unreadable experiment record: {e}"),
        })?;
    if config.model.tokens.is_some() || config.model.frames.is_some() {
        return Err(PipelineError::value(
            "model",
            "predict scores classifiers and regressions; a token model samples text (cargo \
             xtask train's sample) and a frame model is scored by eval",
        ));
    }
    let run_dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
    let batch = options.batch.max(1);
    let inputs = open_inputs(&config, &run_dir, input)?;
    let loader = DataLoader::new(
        Arc::clone(&inputs.dataset),
        LoaderConfig {
            batch_size: batch,
            ..LoaderConfig::default()
        },
    )?;
    let scores_values = config.train.loss.is_multilabel() || config.train.loss.is_regression();
    let image_classifier = !scores_values && inputs.dataset.sample_kind().element == Element::U8;
    let device =
        match options.device {
            DeviceKind::Cuda if !image_classifier => return Err(PipelineError::value(
                "--device",
                "\"cuda\" scores image classifiers; this run's inputs or outputs (f32 features, \
                 values or labels) are scored on the CPU, where they trained: leave out --device",
            )),
            DeviceKind::Auto if !image_classifier => DeviceKind::Cpu,
            device => device,
        };
    let (outputs, outputs_per_row) = match device {
        DeviceKind::Cpu => {
            let mut learner = restored_cpu_learner(&config, saved, &path, batch, &options.layers)?;
            let outputs_per_row = learner.network().num_classes();
            let mut outputs = Vec::with_capacity(inputs.dataset.len() * outputs_per_row);
            for part in loader.epoch(0, 0) {
                outputs.extend(learner.outputs(&part?)?);
            }
            (Scores::Outputs(outputs), outputs_per_row)
        }
        device => {
            let mut learner = crate::parts::restored_learner(
                &config,
                saved,
                &path,
                batch,
                device,
                &options.layers,
            )?;
            let outputs_per_row = learner.num_classes();
            let mut probabilities = Vec::with_capacity(inputs.dataset.len() * outputs_per_row);
            for part in loader.epoch(0, 0) {
                probabilities.extend(learner.eval_probabilities(&part?)?);
            }
            (Scores::Probabilities(probabilities), outputs_per_row)
        }
    };
    let outputs = match outputs {
        Scores::Outputs(outputs) => outputs,
        Scores::Probabilities(probabilities) => {
            return Ok(Predictions {
                checkpoint: path,
                sources: inputs.sources,
                outputs: classes_of(&run_dir, probabilities, outputs_per_row),
            })
        }
    };
    let outputs = if config.train.loss.is_multilabel() {
        // Each label's probability: the sigmoid of its output.
        PredictedOutputs::Values {
            names: match inputs.target_names {
                names if names.len() == outputs_per_row => {
                    names.iter().map(|n| format!("p_{n}")).collect()
                }
                _ => (0..outputs_per_row)
                    .map(|k| format!("p_label{k}"))
                    .collect(),
            },
            values: outputs
                .iter()
                .map(|&v| headroom_model::loss::sigmoid(v))
                .collect(),
        }
    } else if config.train.loss.is_regression() {
        let scale = inputs.value_scale;
        let values = outputs
            .chunks_exact(outputs_per_row.max(1))
            .flat_map(|row| {
                row.iter().enumerate().map(|(k, &v)| match scale.get(k) {
                    Some(&(mean, std)) => v * std + mean,
                    None => v,
                })
            })
            .collect();
        PredictedOutputs::Values {
            names: match inputs.target_names {
                names if names.len() == outputs_per_row => names,
                _ => (0..outputs_per_row).map(|k| format!("value{k}")).collect(),
            },
            values,
        }
    } else {
        let mut probabilities = outputs;
        softmax_rows(&mut probabilities, outputs_per_row);
        classes_of(&run_dir, probabilities, outputs_per_row)
    };
    Ok(Predictions {
        checkpoint: path,
        sources: inputs.sources,
        outputs,
    })
}

/// What a learner gave: its raw outputs (the CPU's), or a classifier's
/// probabilities (the GPU learner's).
enum Scores {
    Outputs(Vec<f32>),
    Probabilities(Vec<f32>),
}

/// Each row's class (the most probable) with the run's class names.
fn classes_of(run_dir: &Path, probabilities: Vec<f32>, outputs_per_row: usize) -> PredictedOutputs {
    let classes = probabilities
        .chunks_exact(outputs_per_row.max(1))
        .map(crate::learner::arg_max)
        .collect();
    let recorded = data::recorded_identity(run_dir)
        .ok()
        .and_then(|identity| identity.classes);
    // The recorded names, then ids for any outputs beyond the classes
    // (a model may have more outputs than its data has classes).
    let recorded = recorded.unwrap_or_default();
    PredictedOutputs::Classes {
        names: (0..outputs_per_row)
            .map(|k| recorded.get(k).cloned().unwrap_or_else(|| k.to_string()))
            .collect(),
        classes,
        probabilities,
    }
}

/// The inputs as a dataset, what each row is, and how the run scaled its
/// numeric targets.
struct Inputs {
    dataset: Arc<dyn Dataset>,
    sources: Vec<String>,
    value_scale: Vec<(f32, f32)>,
    target_names: Vec<String>,
}

fn open_inputs(config: &ExperimentConfig, run_dir: &Path, input: &Path) -> Result<Inputs> {
    let [h, w, c] = config.model.input;
    let checked = |dataset: Arc<dyn Dataset>, sources: Vec<String>| -> Result<Inputs> {
        let shape = dataset.sample_shape();
        if shape != config.model.input {
            return Err(PipelineError::BadData(format!(
                "{}: its samples are {shape:?} (h, w, c), and the model reads {:?}",
                input.display(),
                config.model.input
            )));
        }
        Ok(Inputs {
            dataset,
            sources,
            value_scale: Vec::new(),
            target_names: Vec::new(),
        })
    };
    let table = |targets: Vec<String>, features: Vec<String>| -> Result<Inputs> {
        let identity = data::recorded_identity(run_dir)?;
        let scale = identity.scale.ok_or_else(|| {
            PipelineError::BadData(format!(
                "{}: the run recorded no standardisation for its table",
                run_dir.join("dataset.json").display()
            ))
        })?;
        let mut table = CsvTable::open(
            input,
            &TableConfig {
                targets: targets.clone(),
                features,
                target: TableTarget::Absent,
            },
        )?;
        let expected = scale.features.len();
        if table.feature_names().len() != expected {
            return Err(PipelineError::BadData(format!(
                "{}: {} feature columns ({}), and the model was trained on {expected}",
                input.display(),
                table.feature_names().len(),
                table.feature_names().join(", ")
            )));
        }
        table.standardize(&TableScale {
            features: scale.features.clone(),
            values: Vec::new(),
        })?;
        let sources = table.lines().iter().map(|l| format!("line {l}")).collect();
        let mut inputs = checked(Arc::new(table), sources)?;
        inputs.value_scale = scale.values;
        inputs.target_names = targets;
        Ok(inputs)
    };
    let tensors = |files: TensorFilesConfig| -> Result<Inputs> {
        let files = TensorFiles::open_inputs(input, files)?;
        let sources = files.row_names();
        checked(Arc::new(files), sources)
    };
    let store = match config.data.format {
        DataFormat::Shards => store_source(config, run_dir)?,
        _ => StoreSource::default(),
    };
    match config.data.format {
        DataFormat::Csv => table(
            config.data.targets.clone().unwrap_or_default(),
            config.data.features.clone().unwrap_or_default(),
        ),
        DataFormat::Tensors => tensors(config.tensor_files_config()),
        // A store made from a table or tensor files scores what its source
        // held, with the columns or arrays its index names.
        DataFormat::Shards if store.kind == "csv" => table(store.targets, store.inputs),
        DataFormat::Shards if store.kind == "tensors" => {
            let defaults = TensorFilesConfig::default();
            let name =
                |names: &[String], default: String| names.first().cloned().unwrap_or(default);
            let mut inputs = tensors(TensorFilesConfig {
                input: name(&store.inputs, defaults.input),
                target: name(&store.targets, defaults.target),
                ..defaults
            })?;
            inputs.value_scale = store_value_scale(config)?;
            Ok(inputs)
        }
        DataFormat::ImageFolder | DataFormat::Idx | DataFormat::Shards => {
            let images = match config.data.format {
                DataFormat::ImageFolder => config.data.image_folder(),
                // Images in the model's shape; another size is scaled and
                // centred as an image folder's are by default.
                _ => ImageFolderConfig {
                    size: [h, w],
                    channels: c,
                    fit: ImageFit::CenterCrop,
                },
            };
            let files = ImageFiles::open(input, images)?;
            let sources = files
                .files()
                .iter()
                .map(|p| p.display().to_string())
                .collect();
            checked(Arc::new(files), sources)
        }
        other => Err(PipelineError::value(
            "data.format",
            format!("predict reads images, a CSV or tensor files; this run's data is \"{other}\""),
        )),
    }
}

/// What the run's store (`data.dir/train`) was made from. A store that is
/// gone is taken for images (a store of images needs nothing from it),
/// unless the run recorded a table's standardisation: then the store's
/// column names are needed, and its absence is the error.
fn store_source(config: &ExperimentConfig, run_dir: &Path) -> Result<StoreSource> {
    let Some(dir) = config.data.dir.as_deref() else {
        return Ok(StoreSource::default());
    };
    let train = dir.join("train");
    match ShardedDataset::read_kind(&train) {
        Ok((_, source)) => Ok(source),
        Err(e) => match data::recorded_identity(run_dir).map(|i| i.scale.is_some()) {
            Ok(true) => Err(PipelineError::BadData(format!(
                "this run trained on a store made from a table, whose index names the \
                 feature columns to read: {e}"
            ))),
            _ => Ok(StoreSource::default()),
        },
    }
}

/// The numeric targets' scale of the run's store (`data.dir/train`), to
/// undo on predicted values.
fn store_value_scale(config: &ExperimentConfig) -> Result<Vec<(f32, f32)>> {
    match config.data.dir.as_deref() {
        Some(dir) => Ok(ShardedDataset::read_kind(&dir.join("train"))?.0.value_scale),
        None => Ok(Vec::new()),
    }
}

/// Writes `predictions` as CSV: `input`, then `class` and one probability
/// column per class, or one column per target.
pub fn write_csv(predictions: &Predictions, out: &mut dyn Write) -> std::io::Result<()> {
    let mut writer = csv::Writer::from_writer(out);
    match &predictions.outputs {
        PredictedOutputs::Classes {
            names,
            classes,
            probabilities,
        } => {
            let mut header = vec!["input".to_string(), "class".to_string()];
            header.extend(names.iter().map(|n| format!("p_{n}")));
            writer.write_record(&header)?;
            let rows = probabilities.chunks_exact(names.len().max(1));
            for ((source, &class), row) in predictions.sources.iter().zip(classes).zip(rows) {
                let mut record = vec![source.clone(), names[class as usize].clone()];
                record.extend(row.iter().map(|p| format!("{p:.6}")));
                writer.write_record(&record)?;
            }
        }
        PredictedOutputs::Values { names, values } => {
            let mut header = vec!["input".to_string()];
            header.extend(names.iter().cloned());
            writer.write_record(&header)?;
            for (source, row) in predictions
                .sources
                .iter()
                .zip(values.chunks_exact(names.len().max(1)))
            {
                let mut record = vec![source.clone()];
                record.extend(row.iter().map(|v| v.to_string()));
                writer.write_record(&record)?;
            }
        }
    }
    writer.flush()
}

/// Writes `predictions` as a JSON list, one object per input.
pub fn write_json(predictions: &Predictions, out: &mut dyn Write) -> std::io::Result<()> {
    let rows: Vec<serde_json::Value> = match &predictions.outputs {
        PredictedOutputs::Classes {
            names,
            classes,
            probabilities,
        } => predictions
            .sources
            .iter()
            .zip(classes)
            .zip(probabilities.chunks_exact(names.len().max(1)))
            .map(|((source, &class), row)| {
                let probabilities: serde_json::Map<String, serde_json::Value> = names
                    .iter()
                    .zip(row)
                    .map(|(n, &p)| (n.clone(), serde_json::json!(p)))
                    .collect();
                serde_json::json!({
                    "input": source,
                    "class": names[class as usize],
                    "probabilities": probabilities,
                })
            })
            .collect(),
        PredictedOutputs::Values { names, values } => predictions
            .sources
            .iter()
            .zip(values.chunks_exact(names.len().max(1)))
            .map(|(source, row)| {
                let values: serde_json::Map<String, serde_json::Value> = names
                    .iter()
                    .zip(row)
                    .map(|(n, &v)| (n.clone(), serde_json::json!(v)))
                    .collect();
                serde_json::json!({ "input": source, "values": values })
            })
            .collect(),
    };
    serde_json::to_writer_pretty(&mut *out, &rows)?;
    writeln!(out)
}
