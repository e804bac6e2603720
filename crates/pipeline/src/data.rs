//! Finding Fashion-MNIST: `data.dir`, then `$FASHION_MNIST_DIR`, then the
//! Debian package's directory. If none holds it, install the package when we
//! are root on Debian or Ubuntu; otherwise stop with the exact command. Never
//! fall back to other data. Text corpora (`data.format = "text"`) are found
//! and packed by `crate::text`, which installs their package the same way.
//! Photos (`data.format = "image_folder"`) are read from `data.dir`'s
//! train/ and test/ folders, whose class folders must agree; their class
//! names are recorded with the run (`dataset.json`). `hold_on_device`
//! decides `data.on_device`.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use headroom_loader::{
    AugmentConfig, Dataset, IdxDataset, ImageFolder, ImageFolderConfig, LoaderConfig,
    ShardedDataset, ShuffleMode, Skipped, Split,
};

use crate::config::{parse_bytes, DataFormat, ExperimentConfig, OnDevice};
use crate::learner::Learner;
use crate::{PipelineError, Result};

pub(crate) use crate::sources::shard_cache;
pub use crate::sources::{has_fashion_mnist, locate_fashion_mnist, PACKAGE, SYSTEM_DIR};

/// How long the training stage waits for a batch before calling the loader stuck.
const LOADER_TIMEOUT: Duration = Duration::from_secs(60);

/// The training and test datasets the experiment names, checked before
/// any training: every test sample is read once (a missing or corrupt test
/// shard is found now, not after the first epoch), every label is below the
/// model's output count, and a resumed run's data is the data it started
/// with (`DatasetIdentity`).
pub fn open_splits(
    config: &ExperimentConfig,
    allow_install: bool,
) -> Result<(Arc<dyn Dataset>, Arc<dyn Dataset>)> {
    // A frame model has no classes; its samples carry the label 0.
    let classes = match config.model.frames {
        Some(_) => 1,
        None => crate::config::sizes::output_classes(&config.model)?,
    };
    let mut scale = None;
    let mut skipped = Vec::new();
    let (train, test, class_names) = match config.data.format {
        DataFormat::Csv => {
            let tables = crate::tables::open_splits(config, classes)?;
            scale = Some(tables.scale);
            skipped = tables.skipped;
            (tables.train, tables.test, tables.classes)
        }
        DataFormat::Tensors => {
            let (train, test) = crate::tables::open_tensor_files(config, classes)?;
            (train, test, None)
        }
        DataFormat::ImageFolder => {
            let (train, test, left_out) = open_image_folders(config, classes)?;
            skipped = left_out;
            let names = train.classes().to_vec();
            let (train, test): (Arc<dyn Dataset>, Arc<dyn Dataset>) =
                (Arc::new(train), Arc::new(test));
            (train, test, Some(names))
        }
        DataFormat::Shards => {
            let (train, test) = open_stores(config)?;
            // A store made from a table records its standardisation, as a
            // CSV run does.
            scale = crate::tables::check_store(config, classes, &train, &test)?;
            let (train, test): (Arc<dyn Dataset>, Arc<dyn Dataset>) =
                (Arc::new(train), Arc::new(test));
            (train, test, store_classes(config)?)
        }
        _ => {
            let (train, test) = open_unchecked(config, allow_install)?;
            (train, test, store_classes(config)?)
        }
    };
    let place = |split: &str| match (config.data.format, &config.data.dir) {
        (DataFormat::Shards | DataFormat::ImageFolder, Some(dir)) => {
            dir.join(split).display().to_string()
        }
        _ => format!("the {split} split"),
    };
    verify_labels_of_idx(config, classes)?;
    let test_digest = verify_samples(test.as_ref(), classes, &place("test"))?;
    let train_digest = match train.fingerprint() {
        Some(digest) => digest,
        // No cheaper fingerprint: every training sample read once, its
        // label checked as the test set's are.
        None => verify_samples(train.as_ref(), classes, &place("train"))?,
    };
    let identity = DatasetIdentity {
        format: config.data.format.as_str().to_string(),
        sample_shape: train.sample_shape(),
        train_samples: train.len(),
        test_samples: test.len(),
        test_digest,
        train_digest: Some(train_digest),
        classes: class_names,
        scale,
        skipped: skipped
            .into_iter()
            .map(|(split, s)| SkippedSample {
                split: split.to_string(),
                sample: s.sample,
                reason: s.reason,
            })
            .collect(),
    };
    report_skipped(&identity.skipped);
    identity.check_against_run(config)?;
    Ok((train, test))
}

fn open_unchecked(
    config: &ExperimentConfig,
    allow_install: bool,
) -> Result<(Arc<dyn Dataset>, Arc<dyn Dataset>)> {
    if config.data.format == DataFormat::Text {
        return crate::text::open_splits(config, allow_install);
    }
    if config.data.format == DataFormat::MovingFashionMnist {
        return crate::frames::open_splits(config, allow_install);
    }
    if config.data.format == DataFormat::Tensors {
        let outputs = crate::config::sizes::output_classes(&config.model)?;
        return crate::tables::open_tensor_files(config, outputs);
    }
    if config.data.format == DataFormat::Csv {
        let outputs = crate::config::sizes::output_classes(&config.model)?;
        let tables = crate::tables::open_splits(config, outputs)?;
        return Ok((tables.train, tables.test));
    }
    if config.data.format == DataFormat::ImageFolder {
        let (train, test, _) = open_image_folders(config, usize::MAX)?;
        return Ok((Arc::new(train), Arc::new(test)));
    }
    if config.data.format == DataFormat::Shards {
        let (train, test) = open_stores(config)?;
        return Ok((Arc::new(train), Arc::new(test)));
    }
    let dir = locate_fashion_mnist(config.data.dir.as_deref(), allow_install)?;
    tracing::info!("Fashion-MNIST from {}", dir.display());
    let limit = |dataset: IdxDataset, samples: usize| -> Arc<dyn Dataset> {
        if samples > 0 && samples < dataset.len() {
            Arc::new(dataset.truncated(samples))
        } else {
            Arc::new(dataset)
        }
    };
    Ok((
        limit(
            IdxDataset::fashion_mnist(&dir, Split::Train)?,
            config.data.train_samples,
        ),
        limit(
            IdxDataset::fashion_mnist(&dir, Split::Test)?,
            config.data.test_samples,
        ),
    ))
}

/// `data.dir`'s train/ and test/ shard stores (`data.format = "shards"`).
fn open_stores(config: &ExperimentConfig) -> Result<(ShardedDataset, ShardedDataset)> {
    let root = config.data.dir.as_deref().ok_or_else(|| {
        PipelineError::value(
            "data.dir",
            "data.format = \"shards\" needs the store's directory",
        )
    })?;
    let cache = shard_cache(config)?;
    let open = |split: &str| -> Result<ShardedDataset> {
        let dir = root.join(split);
        let store = ShardedDataset::open(&dir, cache)?;
        tracing::info!(
            "{split} shards from {}: {} shards, index {} bytes read at open",
            dir.display(),
            store.shard_count(),
            store.index_bytes()
        );
        Ok(store)
    };
    Ok((open("train")?, open("test")?))
}

/// `data.dir`'s train/ and test/ image folders, which must hold the same
/// classes, no more than the model's `outputs`.
/// An image folder's splits and the images left out as unreadable
/// (`data.bad_samples = "skip"`), each with its split.
type ImageSplits = (ImageFolder, ImageFolder, Vec<(&'static str, Skipped)>);

fn open_image_folders(config: &ExperimentConfig, outputs: usize) -> Result<ImageSplits> {
    let root = config.data.dir.as_deref().ok_or_else(|| {
        PipelineError::value(
            "data.dir",
            "data.format = \"image_folder\" needs the folder holding train/ and test/",
        )
    })?;
    let skip = config.data.bad_samples == Some(crate::config::BadSamples::Skip);
    let (train, test, skipped) =
        open_image_folder_splits_with(root, config.data.image_folder(), skip)?;
    if train.classes().len() > outputs {
        return Err(PipelineError::value(
            "model.layers",
            format!(
                "{} holds {} classes {:?}, but the model has {outputs} outputs: \
                 set the last linear layer's out = {}",
                train.root().display(),
                train.classes().len(),
                train.classes(),
                train.classes().len()
            ),
        ));
    }
    Ok((train, test, skipped))
}

/// `root/train` and `root/test` as image folders, which must hold the same
/// class folders (an error naming both lists otherwise).
pub fn open_image_folder_splits(
    root: &Path,
    images: ImageFolderConfig,
) -> Result<(ImageFolder, ImageFolder)> {
    let (train, test, _) = open_image_folder_splits_with(root, images, false)?;
    Ok((train, test))
}

/// [`open_image_folder_splits`]; with `skip`, every image is decoded once
/// and the unreadable ones are left out and listed.
pub fn open_image_folder_splits_with(
    root: &Path,
    images: ImageFolderConfig,
    skip: bool,
) -> Result<ImageSplits> {
    let mut skipped = Vec::new();
    let mut open = |split: &'static str| -> Result<ImageFolder> {
        let dir = root.join(split);
        if !skip {
            return Ok(ImageFolder::open(&dir, images)?);
        }
        let (folder, left_out) = ImageFolder::open_skipping(&dir, images)?;
        skipped.extend(left_out.into_iter().map(|s| (split, s)));
        Ok(folder)
    };
    let train = open("train")?;
    let test = open("test")?;
    if train.classes() != test.classes() {
        return Err(PipelineError::BadData(format!(
            "{} and {} must hold the same class folders: train has {:?}, test has {:?}",
            train.root().display(),
            test.root().display(),
            train.classes(),
            test.classes()
        )));
    }
    tracing::info!(
        "images from {}: {} training and {} test images, {} classes, each {:?} (h, w, c)",
        root.display(),
        train.len(),
        test.len(),
        train.classes().len(),
        train.sample_shape()
    );
    Ok((train, test, skipped))
}

/// A sample left out as unreadable, as `dataset.json` records it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SkippedSample {
    /// "train" or "test".
    pub split: String,
    pub sample: String,
    pub reason: String,
}

/// Logs how many samples were left out, and the first few.
fn report_skipped(skipped: &[SkippedSample]) {
    if skipped.is_empty() {
        return;
    }
    let count = |split: &str| skipped.iter().filter(|s| s.split == split).count();
    tracing::warn!(
        "data.bad_samples = \"skip\": {} unreadable samples left out ({} training, {} test), \
         each named in the run's dataset.json; the first: {}",
        skipped.len(),
        count("train"),
        count("test"),
        skipped
            .iter()
            .take(3)
            .map(|s| format!("{} ({})", s.sample, s.reason))
            .collect::<Vec<_>>()
            .join("; ")
    );
}

/// The file beside a shard store's train/ and test/ that names its
/// classes in label order (written by `cargo xtask preprocess` from an
/// image folder).
pub const CLASSES_FILE: &str = "classes.json";

/// A shard store's class names, when it has a `classes.json`.
fn store_classes(config: &ExperimentConfig) -> Result<Option<Vec<String>>> {
    match (config.data.format, &config.data.dir) {
        (DataFormat::Shards, Some(dir)) => read_class_names(&dir.join(CLASSES_FILE)),
        _ => Ok(None),
    }
}

/// A JSON list of class names; None when the file does not exist.
pub fn read_class_names(path: &Path) -> Result<Option<Vec<String>>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(PipelineError::io(path, e)),
    };
    serde_json::from_str(&text).map(Some).map_err(|e| {
        PipelineError::BadData(format!(
            "{}: {e}; expected a JSON list of class names such as [\"cat\", \"dog\"]",
            path.display()
        ))
    })
}

/// The class names a run's data had (label order), recorded in its
/// `dataset.json` when it started: an image folder's class folders, or a
/// store's `classes.json`. None for data without names (Fashion-MNIST, text).
pub fn recorded_classes(run_dir: &Path) -> Result<Option<Vec<String>>> {
    Ok(recorded_identity(run_dir)?.classes)
}

/// What a run recorded about its data when it started (`dataset.json`):
/// its shape, class names and a table's standardisation.
pub fn recorded_identity(run_dir: &Path) -> Result<DatasetIdentity> {
    let path = run_dir.join(IDENTITY_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| PipelineError::io(&path, e))?;
    serde_json::from_str(&text)
        .map_err(|e| PipelineError::BadData(format!("{}: {e}", path.display())))
}

/// Reads every sample once: a read error names the shard or file, a label
/// at or above `classes` names the sample. Returns a CRC of the pixels and
/// labels, the split's fingerprint.
fn verify_samples(data: &dyn Dataset, classes: usize, place: &str) -> Result<u32> {
    let shape = data.sample_shape();
    let record = data.sample_kind().record_len(shape).ok_or_else(|| {
        PipelineError::BadData(format!("{place}: samples of shape {shape:?} overflow"))
    })?;
    let mut pixels = vec![0u8; record];
    let mut digest = crc32fast::Hasher::new();
    for index in 0..data.len() {
        let label = data.read(index, &mut pixels)?;
        if label as usize >= classes {
            return Err(PipelineError::BadData(format!(
                "{place}: sample {index} has label {label}, but the model has {classes} outputs (labels 0 to {}); \
                 the data is corrupt or is not the dataset this model is for",
                classes - 1
            )));
        }
        digest.update(&pixels);
        digest.update(&label.to_le_bytes());
    }
    Ok(digest.finalize())
}

/// For IDX data the label files are in memory already: check both splits'
/// labels, naming the file and the sample.
fn verify_labels_of_idx(config: &ExperimentConfig, classes: usize) -> Result<()> {
    if config.data.format != DataFormat::Idx {
        return Ok(());
    }
    let dir = locate_fashion_mnist(config.data.dir.as_deref(), false)?;
    for (split, stem) in [(Split::Train, "train"), (Split::Test, "t10k")] {
        let dataset = IdxDataset::fashion_mnist(&dir, split)?;
        let Some((index, label)) = dataset
            .labels()
            .iter()
            .enumerate()
            .find(|(_, &label)| usize::from(label) >= classes)
        else {
            continue;
        };
        let file = [
            format!("{stem}-labels-idx1-ubyte"),
            format!("{stem}-labels-idx1-ubyte.gz"),
        ]
        .into_iter()
        .map(|name| dir.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| dir.join(format!("{stem}-labels-idx1-ubyte")));
        return Err(PipelineError::BadData(format!(
            "{}: sample {index} has label {label}, but the model has {classes} outputs (labels 0 to {})",
            file.display(),
            classes - 1
        )));
    }
    Ok(())
}

/// What identifies a run's data: recorded in the run directory when it
/// starts, compared on resume, so a checkpoint never continues on other data
/// (another `data.dir` holding the same files is fine).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DatasetIdentity {
    pub format: String,
    pub sample_shape: [usize; 3],
    pub train_samples: usize,
    pub test_samples: usize,
    /// CRC-32 of every test sample's pixels and label.
    pub test_digest: u32,
    /// The training set's fingerprint (`Dataset::fingerprint`: the IDX
    /// files' bytes, a store's index and shard checksums, an image folder's
    /// files and sizes). None in records written before it was kept: a
    /// resume adds it, saying so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_digest: Option<u32>,
    /// Class names in label order, where the data names them (an image
    /// folder's class folders), so a later `predict` can name classes; left
    /// out for data without names (earlier records read back unchanged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub classes: Option<Vec<String>>,
    /// A table's standardisation (`data.format = "csv"`), from its
    /// training rows: what a prediction applies to new rows and undoes on
    /// predicted values. Left out for other data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<headroom_loader::TableScale>,
    /// Samples left out as unreadable (`data.bad_samples = "skip"`); left
    /// out when none were.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<SkippedSample>,
}

const IDENTITY_FILE: &str = "dataset.json";

impl DatasetIdentity {
    fn check_against_run(&self, config: &ExperimentConfig) -> Result<()> {
        let Some(dir) = &config.run.output_dir else {
            return Ok(());
        };
        let path = dir.join(IDENTITY_FILE);
        let resuming = !crate::checkpoint::list(dir)?.is_empty();
        if !resuming {
            return self.record(&path);
        }
        // A run with checkpoints recorded its data when it started: a record
        // that is gone or unreadable cannot vouch for the data, and is
        // never silently written anew.
        let text = std::fs::read_to_string(&path).map_err(|e| {
            PipelineError::value(
                "data.dir",
                format!(
                    "{} could not be read ({e}): it records the data this run started with, \
                     and a resume checks the data against it; put it back, or start a new run",
                    path.display()
                ),
            )
        })?;
        let recorded: Self = serde_json::from_str(&text).map_err(|e| {
            PipelineError::BadData(format!(
                "{}: {e}; it records the data this run started with: put it back as written, \
                 or start a new run",
                path.display()
            ))
        })?;
        // A record from before the training set's fingerprint was kept is
        // compared on everything else, then completed.
        let comparable = Self {
            train_digest: recorded.train_digest.and(self.train_digest),
            ..self.clone()
        };
        if recorded != comparable {
            return Err(PipelineError::value(
                "data.dir",
                format!(
                    "the data differs from the data this run started with ({} recorded in {}: {}; now: {}); \
                     resume with the same dataset, or start a new run",
                    IDENTITY_FILE,
                    dir.display(),
                    recorded.describe(),
                    self.describe()
                ),
            ));
        }
        if recorded.train_digest.is_none() {
            tracing::info!(
                "{} had no fingerprint of the training set (an earlier version wrote it): recorded now",
                path.display()
            );
            return self.record(&path);
        }
        Ok(())
    }

    /// Writes the record atomically (a temporary, renamed over `path`).
    fn record(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(|e| PipelineError::Stage {
            stage: "data",
            reason: e.to_string(),
        })?;
        crate::checkpoint::write_atomically(path, |mut out, tmp| {
            use std::io::Write as _;
            out.write_all(text.as_bytes())
                .map_err(|e| PipelineError::io(tmp, e))?;
            Ok(out)
        })
    }

    fn describe(&self) -> String {
        let classes = match &self.classes {
            Some(names) => format!(", classes {names:?}"),
            None => String::new(),
        };
        let train = match self.train_digest {
            Some(digest) => format!(", training digest {digest:08x}"),
            None => String::new(),
        };
        format!(
            "{} {:?}, {} training and {} test samples, test digest {:08x}{train}{classes}",
            self.format, self.sample_shape, self.train_samples, self.test_samples, self.test_digest
        )
    }
}

/// The loader for training (shuffled, augmented, drop_last) or evaluation.
pub fn loader_config(config: &ExperimentConfig, training: bool) -> Result<LoaderConfig> {
    // Image folders are one file per sample, all equally cheap to reach:
    // shuffled globally like IDX data.
    let default_mode = if matches!(
        config.data.format,
        DataFormat::Shards | DataFormat::Text | DataFormat::Tensors
    ) {
        ShuffleMode::ShardBlocks
    } else {
        ShuffleMode::Global
    };
    Ok(LoaderConfig {
        batch_size: config.train.batch_size,
        shuffle: training,
        drop_last: training,
        seed: config.run.seed,
        workers: config.loader_workers(),
        prefetch: config.data.prefetch,
        augment: if training {
            config.augment.clone()
        } else {
            AugmentConfig::default()
        },
        timeout: LOADER_TIMEOUT,
        shuffle_mode: config.loader.shuffle_mode.unwrap_or(default_mode),
        memory_budget: config
            .loader
            .memory_budget
            .as_deref()
            .map(|text| parse_bytes("loader.memory_budget", text))
            .transpose()?,
        resident: false,
        shard: headroom_loader::Shard::default(),
    })
}

/// `data.on_device`: puts the training set on the learner's device when
/// asked and possible, and says whether it did. "auto" keeps the data on the
/// host, with one line saying why, where true is an error naming the cause.
pub fn hold_on_device(
    config: &ExperimentConfig,
    train_set: &dyn Dataset,
    learner: &mut dyn Learner,
) -> Result<bool> {
    if config.data.on_device == OnDevice::Never {
        return Ok(false);
    }
    let bytes = train_set
        .sample_shape()
        .iter()
        .product::<usize>()
        .saturating_mul(train_set.len()) as u64;
    let host_only = config.augment.host_only_key();
    let typed = train_set.sample_kind() != headroom_loader::SampleKind::default();
    let obstacle = match (learner.resident_capacity(), host_only) {
        (None, _) => Some(format!("{} trains from host memory", learner.device_name())),
        _ if typed => Some("the samples are f32 features or carry numeric targets".to_string()),
        (_, Some(key)) => Some(format!("{key} is applied on the host")),
        (Some(capacity), None) if bytes > capacity => Some(format!(
            "the training set ({:.1} MiB) is more than a quarter of the device budget ({:.1} MiB)",
            mib(bytes),
            mib(capacity.saturating_mul(4))
        )),
        _ => None,
    };
    match (obstacle, config.data.on_device) {
        (Some(why), OnDevice::Always) => Err(PipelineError::value(
            "data.on_device",
            format!("true, but {why}: set data.on_device = false (or \"auto\")"),
        )),
        (Some(why), _) => {
            // On the CPU there is no other place for the data: say it only
            // where the choice was real.
            if learner.resident_capacity().is_some() {
                tracing::info!("training data stays on the host: {why}");
            }
            Ok(false)
        }
        (None, _) => {
            learner.hold_resident(train_set)?;
            tracing::info!(
                "training set held on the device: {} samples, {:.1} MiB; batches are made there",
                train_set.len(),
                mib(bytes)
            );
            Ok(true)
        }
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}
