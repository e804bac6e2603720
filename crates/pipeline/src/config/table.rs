//! `data.format = "csv"` and `"tensors"`: which columns are features and
//! targets (`data.targets`, `data.features`) or which arrays are inputs and
//! targets (`data.input_array`, `data.target_array`), what the task is
//! (`train.loss`: cross-entropy or focal for classes, MSE or Huber for
//! numeric targets), and the checks that tie them to the model and the
//! device.

use headroom_loader::{TableConfig, TableTarget};

use super::{DataFormat, ExperimentConfig, LossKind, TestTimeAugmentation};
use crate::device::DeviceKind;
use crate::{PipelineError, Result};

impl ExperimentConfig {
    /// The columns of a CSV experiment; a classifier's classes are found in
    /// the training table (`classes`: the names it had, for the test table).
    pub fn table_config(&self, classes: Option<Vec<String>>) -> TableConfig {
        TableConfig {
            targets: self.data.targets.clone().unwrap_or_default(),
            features: self.data.features.clone().unwrap_or_default(),
            target: if self.train.loss.is_regression() {
                TableTarget::Values
            } else if self.train.loss.is_multilabel() {
                TableTarget::Labels
            } else {
                TableTarget::Classes { classes }
            },
        }
    }

    /// The arrays of a "tensors" experiment and the decoded files held at
    /// once (`loader.max_cache_shards`).
    pub fn tensor_files_config(&self) -> headroom_loader::TensorFilesConfig {
        let defaults = headroom_loader::TensorFilesConfig::default();
        headroom_loader::TensorFilesConfig {
            input: self.data.input_array.clone().unwrap_or(defaults.input),
            target: self.data.target_array.clone().unwrap_or(defaults.target),
            cache_files: self.loader.max_cache_shards.max(1),
        }
    }

    /// The device the learner runs on: `device.kind`, except that "auto"
    /// is the CPU for a table of f32 features, for numeric targets and for
    /// a store of either (the GPU learner reads u8 images with class
    /// labels, and token ids).
    pub fn learner_device(&self) -> DeviceKind {
        let features_only = self.data.format == DataFormat::Csv
            || self.train.loss.scores_values()
            || (self.device.kind == DeviceKind::Auto && self.typed_store());
        match self.device.kind {
            DeviceKind::Auto if features_only => DeviceKind::Cpu,
            kind => kind,
        }
    }

    /// Whether `data.dir` is a shard store of typed samples (f32 features
    /// or numeric targets), from its training index alone: a few bytes per
    /// shard. A store that cannot be read is left to the opening of the
    /// data to report.
    fn typed_store(&self) -> bool {
        let (DataFormat::Shards, Some(dir)) = (self.data.format, &self.data.dir) else {
            return false;
        };
        headroom_loader::ShardedDataset::read_kind(&dir.join("train"))
            .is_ok_and(|(kind, _)| kind != headroom_loader::SampleKind::default())
    }

    /// The table keys belong to "csv", a regression loss to numeric
    /// targets, and a table's model reads features on the CPU.
    pub(super) fn check_table_keys(&self) -> Result<()> {
        let loss = self.train.loss;
        if self.data.format != DataFormat::Csv {
            let set = [
                ("data.targets", self.data.targets.is_some()),
                ("data.features", self.data.features.is_some()),
            ];
            if let Some((key, _)) = set.iter().find(|(_, set)| *set) {
                return Err(PipelineError::value(
                    key,
                    format!(
                        "applies to data.format = \"csv\" only (data.format is \"{}\"): remove it",
                        self.data.format
                    ),
                ));
            }
        }
        if self.data.format != DataFormat::Tensors {
            let set = [
                ("data.input_array", self.data.input_array.is_some()),
                ("data.target_array", self.data.target_array.is_some()),
            ];
            if let Some((key, _)) = set.iter().find(|(_, set)| *set) {
                return Err(PipelineError::value(
                    key,
                    format!(
                        "applies to data.format = \"tensors\" only (data.format is \"{}\"): \
                         remove it",
                        self.data.format
                    ),
                ));
            }
        }
        // A store's targets are checked against the loss when it is opened
        // (its index says what it holds).
        let numeric_data = matches!(
            self.data.format,
            DataFormat::Csv | DataFormat::Tensors | DataFormat::Shards
        );
        if loss.scores_values() && !numeric_data {
            return Err(PipelineError::value(
                "train.loss",
                format!(
                    "\"{}\" scores numeric targets (or 0/1 labels), and \"{}\" data has classes: use \
                     data.format = \"csv\" with data.targets naming numeric columns (or \
                     \"tensors\" with float targets), or train.loss = \"cross_entropy\"",
                    loss_word(loss),
                    self.data.format
                ),
            ));
        }
        if let Some(delta) = self.train.huber_delta {
            if loss != LossKind::Huber {
                return Err(PipelineError::value(
                    "train.huber_delta",
                    "applies to train.loss = \"huber\" only: remove it",
                ));
            }
            if !(delta.is_finite() && delta > 0.0) {
                return Err(PipelineError::value(
                    "train.huber_delta",
                    format!("must be a finite number > 0, got {delta}"),
                ));
            }
        }
        match self.data.format {
            DataFormat::Csv => self.check_csv_keys(),
            DataFormat::Tensors => self.check_tensors_keys(),
            DataFormat::Shards if loss.scores_values() => self.check_features_run("shards"),
            _ => Ok(()),
        }
    }

    fn check_tensors_keys(&self) -> Result<()> {
        if self.data.dir.is_none() {
            return Err(PipelineError::value(
                "data.dir",
                "data.format = \"tensors\" needs data.dir: a folder holding train/ and test/, \
                 each a directory of .npz, .safetensors or .npy files",
            ));
        }
        self.check_features_run("tensors")
    }

    fn check_csv_keys(&self) -> Result<()> {
        let loss = self.train.loss;
        if self.data.dir.is_none() {
            return Err(PipelineError::value(
                "data.dir",
                "data.format = \"csv\" needs data.dir: a folder holding train.csv and test.csv",
            ));
        }
        let targets = self.data.targets.as_deref().unwrap_or_default();
        if targets.is_empty() {
            return Err(PipelineError::value(
                "data.targets",
                "data.format = \"csv\" needs the target column(s) by name, e.g. \
                 data.targets = [\"price\"]",
            ));
        }
        if !loss.scores_values() && targets.len() != 1 {
            return Err(PipelineError::value(
                "data.targets",
                format!(
                    "a classifier (train.loss = \"{}\") reads one class column, {} are named; \
                     for numeric targets set train.loss = \"mse\" or \"huber\", for 0/1 label \
                     columns \"bce\"",
                    loss_word(loss),
                    targets.len()
                ),
            ));
        }
        self.check_features_run("csv")?;
        if self.eval.tta != TestTimeAugmentation::None {
            return Err(PipelineError::value(
                "eval.tta",
                "mirrors images; a table's rows have no left and right: remove it",
            ));
        }
        if self.device.kind == DeviceKind::Cuda {
            return Err(PipelineError::value(
                "device.kind",
                "\"cuda\", but a table's f32 features train on the CPU for now (the GPU learner \
                 reads u8 images and token ids): set device.kind = \"cpu\" or \"auto\"",
            ));
        }
        Ok(())
    }

    /// What "csv" and "tensors" data share: no sample limits, no token or
    /// frame model, and a regression has no label smoothing and runs on
    /// the CPU.
    fn check_features_run(&self, format: &str) -> Result<()> {
        let loss = self.train.loss;
        if self.data.train_samples > 0 || self.data.test_samples > 0 {
            return Err(PipelineError::value(
                "data.train_samples",
                format!("sample limits apply to \"idx\" data only; use smaller \"{format}\" data instead"),
            ));
        }
        if self.model.tokens.is_some() || self.model.frames.is_some() {
            return Err(PipelineError::value(
                "data.format",
                format!(
                    "\"{format}\" samples are images or feature vectors; a token or frame model \
                     (model.tokens, model.frames) cannot read them"
                ),
            ));
        }
        if loss.scores_values() && self.train.label_smoothing > 0.0 {
            return Err(PipelineError::value(
                "train.label_smoothing",
                "applies to classes; a regression (train.loss = \"mse\" or \"huber\") or a \
                 multi-label model (\"bce\") has none: remove it",
            ));
        }
        if loss.scores_values() && self.eval.tta != TestTimeAugmentation::None {
            return Err(PipelineError::value(
                "eval.tta",
                "averages class probabilities over mirror images; a regression or a multi-label \
                 model has none: remove it",
            ));
        }
        if loss.scores_values() && self.device.kind == DeviceKind::Cuda {
            return Err(PipelineError::value(
                "device.kind",
                "\"cuda\", but numeric targets train on the CPU for now (the GPU learner \
                 scores classes): set device.kind = \"cpu\" or \"auto\"",
            ));
        }
        Ok(())
    }
}

fn loss_word(loss: LossKind) -> &'static str {
    match loss {
        LossKind::CrossEntropy => "cross_entropy",
        LossKind::Focal => "focal",
        LossKind::Mse => "mse",
        LossKind::Huber => "huber",
        LossKind::Bce => "bce",
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use headroom_loader::{
        preprocess, preprocess_from, CsvTable, ShardSize, StoreSource, SyntheticDataset,
        TableConfig, TableTarget,
    };

    use crate::config::{ExperimentConfig, Overrides};
    use crate::device::DeviceKind;

    fn config_on(store: &Path, device: &str) -> ExperimentConfig {
        let smoke = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments/smoke.toml");
        let sets: Vec<String> = [
            "data.format=shards".to_string(),
            format!("data.dir={}", store.display()),
            "data.train_samples=0".into(),
            "data.test_samples=0".into(),
            format!("device.kind={device}"),
        ]
        .into();
        ExperimentConfig::load(&smoke, &Overrides::parse(&sets).unwrap()).unwrap()
    }

    #[test]
    fn auto_trains_a_typed_store_on_the_cpu_and_an_image_store_as_before() {
        let dir = tempfile::tempdir().unwrap();
        let csv = dir.path().join("t.csv");
        std::fs::write(&csv, "a,b,y\n1,2,3\n4,5,6\n7,8,10\n").unwrap();
        let table = CsvTable::open(
            &csv,
            &TableConfig {
                targets: vec!["y".into()],
                features: Vec::new(),
                target: TableTarget::Values,
            },
        )
        .unwrap();
        let typed = dir.path().join("typed");
        preprocess_from(
            &table,
            &StoreSource::default(),
            &typed.join("train"),
            ShardSize::Samples(2),
            false,
        )
        .unwrap();
        let images = dir.path().join("images");
        preprocess(
            &SyntheticDataset::new(3, [28, 28, 1], 10),
            &images.join("train"),
            ShardSize::Samples(2),
            false,
        )
        .unwrap();
        assert_eq!(config_on(&typed, "auto").learner_device(), DeviceKind::Cpu);
        assert_eq!(
            config_on(&images, "auto").learner_device(),
            DeviceKind::Auto
        );
        // A store that is not there is left to the opening of the data.
        let missing = dir.path().join("missing");
        assert_eq!(
            config_on(&missing, "auto").learner_device(),
            DeviceKind::Auto
        );
        assert_eq!(config_on(&typed, "cpu").learner_device(), DeviceKind::Cpu);
    }
}
