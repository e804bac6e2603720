//! `data.format = "csv"`: `data.dir`'s train.csv and test.csv as datasets
//! of standardised f32 features and a class or numeric targets, and
//! `data.format = "tensors"`: its train/ and test/ directories of
//! preprocessed `.npz`, `.safetensors` or `.npy` files, read lazily. Both
//! are checked against the model and the loss before any training.
//!
//! The standardisation (each feature's and numeric target's mean and
//! standard deviation) comes from the training table only and is recorded
//! with the run in `dataset.json`, beside the class names, so that the
//! test table, an evaluation and a later prediction use the same numbers.

use std::path::Path;
use std::sync::Arc;

use headroom_loader::{
    CsvTable, Dataset, Element, SampleKind, ShardedDataset, Skipped, TableConfig, TableScale,
    TensorFiles,
};

use crate::config::ExperimentConfig;
use crate::{PipelineError, Result};

/// The two tables of a CSV experiment, what the run records about them,
/// and the checks that the model reads and predicts what they hold.
pub struct Tables {
    pub train: Arc<dyn Dataset>,
    pub test: Arc<dyn Dataset>,
    /// A classifier's class names by id; None for a regression.
    pub classes: Option<Vec<String>>,
    pub scale: TableScale,
    /// Rows left out as unreadable, each with its split.
    pub skipped: Vec<(&'static str, Skipped)>,
}

/// A folder's train.csv and test.csv, standardised with the training
/// table's statistics: what a CSV run trains on and what `cargo xtask
/// preprocess --kind csv` packs into a store.
pub struct TablePair {
    pub train: CsvTable,
    pub test: CsvTable,
    pub train_path: std::path::PathBuf,
    /// A classifier's class names by id; None for a regression.
    pub classes: Option<Vec<String>>,
    pub scale: TableScale,
    /// Rows left out as unreadable (`data.bad_samples = "skip"`), each
    /// with its split.
    pub skipped: Vec<(&'static str, Skipped)>,
}

/// Reads `root/train.csv` and `root/test.csv` with the columns `table`
/// names (`table(None)` for the training table, `table(Some(classes))` for
/// the test table, which takes the training table's classes) and
/// standardises both with the training table's statistics. `key` names the
/// setting that gave `root`, for errors.
pub fn open_table_pair(
    root: &Path,
    key: &str,
    table: impl Fn(Option<Vec<String>>) -> TableConfig,
) -> Result<TablePair> {
    open_table_pair_with(root, key, table, false)
}

/// [`open_table_pair`]; with `skip`, unreadable rows are left out and
/// listed (`data.bad_samples = "skip"`) instead of stopping at the first.
pub fn open_table_pair_with(
    root: &Path,
    key: &str,
    table: impl Fn(Option<Vec<String>>) -> TableConfig,
    skip: bool,
) -> Result<TablePair> {
    let path = |name: &str| {
        let path = root.join(name);
        match crate::paths::problem(&path, crate::paths::Want::File) {
            None => Ok(path),
            Some(reason) => Err(PipelineError::value(
                key,
                format!(
                    "{} {reason}: a table is read from train.csv and test.csv in {key}",
                    path.display()
                ),
            )),
        }
    };
    let (train_path, test_path) = (path("train.csv")?, path("test.csv")?);
    let mut skipped = Vec::new();
    let mut open = |path: &Path, config: &TableConfig, split: &'static str| {
        if !skip {
            return CsvTable::open(path, config);
        }
        let (table, left_out) = CsvTable::open_skipping(path, config)?;
        skipped.extend(left_out.into_iter().map(|s| (split, s)));
        Ok(table)
    };
    let mut train = open(&train_path, &table(None), "train")?;
    let known = (!train.classes().is_empty()).then(|| train.classes().to_vec());
    let mut test = open(&test_path, &table(known.clone()), "test")?;
    if test.feature_names() != train.feature_names() {
        return Err(PipelineError::BadData(format!(
            "{} and {} must hold the same feature columns: train has {:?}, test has {:?}",
            train_path.display(),
            test_path.display(),
            train.feature_names(),
            test.feature_names()
        )));
    }
    let scale = train.scale();
    train.standardize(&scale)?;
    test.standardize(&scale)?;
    Ok(TablePair {
        train,
        test,
        train_path,
        classes: known,
        scale,
        skipped,
    })
}

/// Opens `data.dir/train.csv` and `data.dir/test.csv` for `config`, whose
/// model has `outputs` outputs.
pub fn open_splits(config: &ExperimentConfig, outputs: usize) -> Result<Tables> {
    let root = config.data.dir.as_deref().ok_or_else(|| {
        PipelineError::value(
            "data.dir",
            "data.format = \"csv\" needs the folder holding train.csv and test.csv",
        )
    })?;
    let skip = config.data.bad_samples == Some(crate::config::BadSamples::Skip);
    let TablePair {
        train,
        test,
        train_path,
        classes: known,
        scale,
        skipped,
    } = open_table_pair_with(
        root,
        "data.dir",
        |classes| config.table_config(classes),
        skip,
    )?;
    check_model(config, &train, &train_path, outputs)?;
    tracing::info!(
        "table from {}: {} training and {} test rows, {} features, {}",
        root.display(),
        train.len(),
        test.len(),
        train.feature_names().len(),
        match &known {
            Some(classes) => format!("{} classes", classes.len()),
            None => format!("targets {:?}", train.target_names()),
        }
    );
    Ok(Tables {
        train: Arc::new(train),
        test: Arc::new(test),
        classes: known,
        scale,
        skipped,
    })
}

/// The model reads `[1, features, 1]` and has one output per class or per
/// numeric target.
fn check_model(
    config: &ExperimentConfig,
    train: &CsvTable,
    path: &Path,
    outputs: usize,
) -> Result<()> {
    let features = train.feature_names().len();
    if config.model.input != [1, features, 1] {
        return Err(PipelineError::value(
            "model.input",
            format!(
                "{:?}, but {} has {features} feature columns ({}): set model.input = [1, \
                 {features}, 1]",
                config.model.input,
                path.display(),
                train.feature_names().join(", ")
            ),
        ));
    }
    let (wanted, what) = match train.classes() {
        [] => (train.target_names().len(), "numeric targets"),
        classes => (classes.len(), "classes"),
    };
    if outputs != wanted {
        return Err(PipelineError::value(
            "model.layers",
            format!(
                "the model has {outputs} outputs, but {} has {wanted} {what}: set the last \
                 linear layer's out = {wanted}",
                path.display()
            ),
        ));
    }
    Ok(())
}

/// Opens `data.dir/train` and `data.dir/test` as tensor files for
/// `config`, whose model has `outputs` outputs: the samples must be the
/// model's input, the targets what `train.loss` scores.
pub fn open_tensor_files(
    config: &ExperimentConfig,
    outputs: usize,
) -> Result<(Arc<dyn Dataset>, Arc<dyn Dataset>)> {
    let root = config.data.dir.as_deref().ok_or_else(|| {
        PipelineError::value(
            "data.dir",
            "data.format = \"tensors\" needs the folder holding train/ and test/",
        )
    })?;
    let open = |split: &str| -> Result<TensorFiles> {
        let path = root.join(split);
        if let Some(reason) = crate::paths::problem(&path, crate::paths::Want::Dir) {
            return Err(PipelineError::value(
                "data.dir",
                format!(
                    "{} {reason}: data.format = \"tensors\" reads train/ and test/ from data.dir, \
                     each a directory of .npz, .safetensors or .npy files",
                    path.display()
                ),
            ));
        }
        Ok(TensorFiles::open(&path, config.tensor_files_config())?)
    };
    let (train, test) = (open("train")?, open("test")?);
    for split in [&train, &test] {
        check_typed(config, split, split.root(), outputs)?;
    }
    tracing::info!(
        "tensor files from {}: {} training rows in {} files, {} test rows in {} files, each \
         {:?} ({:?}), decoded files cached: {}",
        root.display(),
        train.len(),
        train.file_count(),
        test.len(),
        test.file_count(),
        train.sample_shape(),
        train.sample_kind().element,
        config.loader.max_cache_shards.max(1)
    );
    Ok((Arc::new(train), Arc::new(test)))
}

/// A split of typed samples (tensor files, or a store made from a table or
/// tensor files) that `config`'s model, with `outputs` outputs, reads and
/// `train.loss` scores: an error naming `place` otherwise.
fn check_typed(
    config: &ExperimentConfig,
    split: &dyn Dataset,
    place: &Path,
    outputs: usize,
) -> Result<()> {
    let (kind, shape) = (split.sample_kind(), split.sample_shape());
    if shape != config.model.input {
        return Err(PipelineError::value(
            "model.input",
            format!(
                "{:?}, but the samples in {} are {shape:?} (h, w, c): set model.input = {shape:?}",
                config.model.input,
                place.display()
            ),
        ));
    }
    // A multi-label model scores 0/1 values as a regression scores numbers.
    let regression = config.train.loss.scores_values();
    if regression != (kind.values > 0) {
        let what = if kind.values > 0 {
            "float (numeric)"
        } else {
            "integer (class id)"
        };
        return Err(PipelineError::value(
            "train.loss",
            format!(
                "{} holds {what} targets, which train.loss = \"{}\" does not score: use \
                 \"mse\" or \"huber\" for float targets (\"bce\" for 0/1 labels), \
                 \"cross_entropy\" for class ids",
                place.display(),
                if regression {
                    "mse/huber/bce"
                } else {
                    "cross_entropy/focal"
                }
            ),
        ));
    }
    let wanted = if regression {
        kind.values
    } else {
        split.num_classes()
    };
    if (regression && outputs != wanted) || (!regression && outputs < wanted) {
        return Err(PipelineError::value(
            "model.layers",
            format!(
                "the model has {outputs} outputs, but {} has {wanted} {}: set the last linear \
                 layer's out = {wanted}",
                place.display(),
                if regression {
                    "numeric targets"
                } else {
                    "classes (ids up to the largest)"
                }
            ),
        ));
    }
    Ok(())
}

/// A shard store's splits, checked as their source's would be where they
/// hold typed samples (a store made from a table or tensor files); returns
/// a table's standardisation, which the run records as a CSV run does. A
/// store of u8 images with class labels is left as it always was.
pub fn check_store(
    config: &ExperimentConfig,
    outputs: usize,
    train: &ShardedDataset,
    test: &ShardedDataset,
) -> Result<Option<TableScale>> {
    let typed = |s: &ShardedDataset| s.sample_kind() != SampleKind::default();
    if !typed(train) && !typed(test) {
        return Ok(None);
    }
    if train.sample_kind() != test.sample_kind() || train.source() != test.source() {
        return Err(PipelineError::BadData(format!(
            "{} and {} hold different kinds of samples ({:?} from {:?}, {:?} from {:?}): \
             preprocess both from one source",
            train.dir().display(),
            test.dir().display(),
            train.sample_kind(),
            train.source().kind,
            test.sample_kind(),
            test.source().kind
        )));
    }
    for split in [train, test] {
        check_typed(config, split, split.dir(), outputs)?;
    }
    if train.sample_kind().element == Element::F32
        && config.device.kind == crate::device::DeviceKind::Cuda
    {
        return Err(PipelineError::value(
            "device.kind",
            format!(
                "\"cuda\", but {} holds f32 features, which train on the CPU for now (the GPU \
                 learner reads u8 images and token ids): set device.kind = \"cpu\" or \"auto\"",
                train.dir().display()
            ),
        ));
    }
    tracing::info!(
        "typed store from {}: {} training and {} test samples of {:?} ({:?}, {} numeric \
         targets), made from {}",
        train.dir().display(),
        train.len(),
        test.len(),
        train.sample_shape(),
        train.sample_kind().element,
        train.sample_kind().values,
        match train.source().kind.as_str() {
            "" => "an unnamed source",
            kind => kind,
        }
    );
    Ok(train.table_scale())
}
