//! The experiment: a TOML file, then its profile overlay
//! (`profiles/NAME.toml` beside it), then `HEADROOM__SECTION__KEY`
//! environment variables, then `--set section.key=value` overrides, in that
//! order of precedence (reading: `load`; `--set` typing: `overrides`). Every table denies unknown keys, and `validate` checks values,
//! so a typo or a bad number stops the run with the key's name.

use std::path::{Path, PathBuf};

use headroom_loader::{AugmentConfig, ShuffleMode};
use headroom_model::cuda::ops::{ConvAlgorithm, ConvPlan};
use headroom_model::ModelSpec;
use serde::{Deserialize, Serialize};

use crate::device::{DeviceKind, Precision};
use crate::{PipelineError, Result};

pub mod distributed;
pub mod finetune;
mod images;
mod kinds;
mod load;
mod overrides;
pub mod sizes;
mod table;
mod validation;

pub use kinds::{BadSamples, DataFormat, ImageFit, OomPolicy, Profile};
pub use load::{is_profile, profile_path, PROFILES_DIR};
pub use overrides::Overrides;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ExperimentConfig {
    pub run: RunConfig,
    pub data: DataConfig,
    /// Text corpus and sampling settings, for `data.format = "text"`; absent
    /// otherwise, and then left out of the serialised config (fingerprints
    /// of image experiments unchanged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<TextConfig>,
    /// Moving-Fashion-MNIST settings, for `data.format =
    /// "moving_fashion_mnist"`; absent otherwise and then left out of the
    /// serialised config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frames: Option<FramesConfig>,
    #[serde(default)]
    pub augment: AugmentConfig,
    #[serde(default)]
    pub loader: LoaderSettings,
    #[serde(default)]
    pub device: DeviceConfig,
    #[serde(default)]
    pub memory: MemoryConfig,
    pub model: ModelSpec,
    pub train: TrainConfig,
    /// How the test split is evaluated; left out of the serialised config
    /// when default (fingerprints of earlier runs unchanged).
    #[serde(default, skip_serializing_if = "EvalConfig::is_default")]
    pub eval: EvalConfig,
    pub optimizer: OptimizerConfig,
    pub schedule: ScheduleConfig,
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    /// How the ranks of a data-parallel run talk; left out of the
    /// serialised config when default.
    #[serde(
        default,
        skip_serializing_if = "distributed::DistributedConfig::is_default"
    )]
    pub distributed: distributed::DistributedConfig,
    /// Start from a trained checkpoint (LoRA or full fine-tuning); absent
    /// otherwise, and then left out of the serialised config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finetune: Option<finetune::FinetuneConfig>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    pub name: String,
    #[serde(default)]
    pub seed: u64,
    /// Run directories are made here: `<runs_dir>/<name>-<UTC timestamp>/`.
    #[serde(default = "default_runs_dir")]
    pub runs_dir: PathBuf,
    /// Use exactly this directory instead (checkpoints, metrics, plots).
    #[serde(default)]
    pub output_dir: Option<PathBuf>,
    /// "auto" (the low-memory profile below 4 GiB), "none", or the name of a
    /// profile in `profiles/` beside the experiment (low_memory, max_speed,
    /// cpu): see `load`.
    #[serde(default)]
    pub profile: Profile,
    /// Steps between progress lines.
    #[serde(default = "default_log_every")]
    pub log_every: u64,
}

/// Devices with less than this much memory get the low-memory profile.
pub const SMALL_DEVICE_BYTES: u64 = 4 << 30;

/// The device's memory: the configured limit, else `gpu` (the memory of
/// the GPU this run will train on, from `device::gpu_memory`, or None), else
/// what this process may really use (cgroup, rlimits, RAM; see `limits`),
/// the CPU backend's device memory.
pub fn device_memory(config: &ExperimentConfig, gpu: Option<u64>) -> Result<Option<u64>> {
    if let Some(limit) = config.memory_limit()? {
        return Ok(Some(limit));
    }
    if let Some(gpu) = gpu {
        return Ok(Some(gpu));
    }
    let ceiling = crate::limits::tightest().map(|c| c.limit.min(c.room));
    Ok(ceiling.or_else(crate::system_memory_bytes))
}

fn default_runs_dir() -> PathBuf {
    PathBuf::from("runs")
}

fn default_log_every() -> u64 {
    50
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// "idx" (MNIST-format files), "shards" (a store written by
    /// `cargo xtask preprocess`, with train/ and test/ inside) or "text"
    /// (the `[text]` corpus, packed into a shard store on first use) or
    /// "moving_fashion_mnist" (`[frames]` sequences from Fashion-MNIST) or
    /// "image_folder" (PNG/JPEG photos: train/ and test/, one subfolder per
    /// class).
    #[serde(default)]
    pub format: DataFormat,
    /// Where the dataset is. For "idx", unset means $FASHION_MNIST_DIR, then
    /// the Debian package's /usr/share/datasets/fashion-mnist; "shards" needs
    /// it; for "text" it is where the packed stores are kept (unset:
    /// ~/.cache/headroom/text); "image_folder" needs it (train/, test/).
    #[serde(default)]
    pub dir: Option<PathBuf>,
    /// Use only the first N training / test samples (0 = all).
    #[serde(default)]
    pub train_samples: usize,
    #[serde(default)]
    pub test_samples: usize,
    /// Loader worker threads (0 = in the training thread); unset = a
    /// quarter of the cores, 1 to 4 (one worker makes millions of samples/s).
    #[serde(default)]
    pub workers: Option<usize>,
    /// Batches prepared ahead of the training stage.
    #[serde(default = "default_prefetch")]
    pub prefetch: usize,
    /// Keep the training set on the GPU and make batches there (crop, flip,
    /// normalisation), so no pixels cross the bus while training: "auto"
    /// (when the learner is on a GPU, the augmentations allow it and the
    /// set takes at most a quarter of the device budget), true (the same,
    /// or an error saying which condition fails) or false. Same bits either
    /// way.
    #[serde(default)]
    pub on_device: OnDevice,
    /// For "image_folder": the `[height, width]` every photo is fit to
    /// (unset: [28, 28], the Fashion-MNIST models' input). The three image
    /// keys are left out of the serialised config when unset, so other
    /// experiments' fingerprints are unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_size: Option<[usize; 2]>,
    /// For "image_folder": 1 (grayscale) or 3 (RGB); unset: 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub channels: Option<usize>,
    /// For "image_folder": how a photo of another size is fit,
    /// "center_crop" (unset: the default) or "resize".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fit: Option<ImageFit>,
    /// For "csv": the target column(s) by name. One column of classes
    /// (names or ids) for a classifier; one or more numeric columns for a
    /// regression (`train.loss = "mse"` or `"huber"`). Left out of the
    /// serialised config when unset, as the image keys are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub targets: Option<Vec<String>>,
    /// For "csv": the feature columns, in the order the model takes them
    /// (unset: every column that is not a target, in file order).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub features: Option<Vec<String>>,
    /// For "tensors": the input and target arrays' names in each file
    /// (unset: "x" and "y").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_array: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_array: Option<String>,
    /// A validation split carved from the training set, the same samples
    /// every run: a fraction (0.1) or a count (5000). Each epoch is then
    /// scored on it, the test set once at the end. Unset: none (epochs are
    /// scored on the test set); left out of the serialised config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation: Option<f64>,
    /// For "image_folder" and "csv": "fail" (unset: an unreadable image or
    /// row is an error before training) or "skip" (left out, counted and
    /// named). Left out of the serialised config when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bad_samples: Option<BadSamples>,
}

/// `data.on_device`: true, false or "auto".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OnDevice {
    #[default]
    Auto,
    Always,
    Never,
}

impl Serialize for OnDevice {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            OnDevice::Auto => s.serialize_str("auto"),
            OnDevice::Always => s.serialize_bool(true),
            OnDevice::Never => s.serialize_bool(false),
        }
    }
}

impl<'de> Deserialize<'de> for OnDevice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Flag(bool),
            Word(String),
        }
        match Written::deserialize(d)? {
            Written::Flag(true) => Ok(OnDevice::Always),
            Written::Flag(false) => Ok(OnDevice::Never),
            Written::Word(w) => match w.as_str() {
                "auto" => Ok(OnDevice::Auto),
                "true" => Ok(OnDevice::Always),
                "false" => Ok(OnDevice::Never),
                other => Err(serde::de::Error::custom(format!(
                    "data.on_device: expected true, false or \"auto\", got \"{other}\""
                ))),
            },
        }
    }
}

/// `[text]`: a byte-level corpus (vocabulary 256) and what to generate
/// from the trained model.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TextConfig {
    /// The Debian package holding the corpus: installed when a corpus file
    /// is missing and we are root on Debian or Ubuntu, else named in the
    /// error with the command that installs it.
    #[serde(default)]
    pub package: Option<String>,
    /// The corpus files, read as bytes and joined in this order.
    #[serde(default)]
    pub corpus: Vec<PathBuf>,
    /// The last fraction of the joined bytes held out for validation.
    #[serde(default = "default_validation_fraction")]
    pub validation_fraction: f64,
    /// After training, `sample.txt` in the run directory continues this prompt.
    #[serde(default = "default_prompt")]
    pub prompt: String,
    /// Bytes generated after the prompt.
    #[serde(default = "default_sample_bytes")]
    pub sample_bytes: usize,
    /// Sampling temperature (random numbers from `run.seed`).
    #[serde(default = "default_temperature")]
    pub temperature: f32,
}

/// `[frames]`: Moving-Fashion-MNIST sequences made on the fly from the
/// Fashion-MNIST images (train images for training, test images for
/// testing). A sequence is `model.frames + 1` frames: the model reads the
/// first `model.frames` and predicts each one's successor.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FramesConfig {
    /// Frame height and width (`model.input` must be [size, size, 1]).
    #[serde(default = "default_frame_size")]
    pub size: usize,
    /// Garments moving in each sequence.
    #[serde(default = "default_garments")]
    pub garments: usize,
    pub train_sequences: usize,
    pub test_sequences: usize,
    /// Keys the sequences (not `run.seed`: the test sequences stay the
    /// same whatever the run's seed).
    #[serde(default)]
    pub seed: u64,
}

fn default_frame_size() -> usize {
    64
}
fn default_garments() -> usize {
    2
}

fn default_validation_fraction() -> f64 {
    0.05
}
fn default_prompt() -> String {
    "The ".into()
}
fn default_sample_bytes() -> usize {
    300
}
fn default_temperature() -> f32 {
    0.7
}

fn default_prefetch() -> usize {
    4
}

/// `[device]`: where to train and how much memory it may use.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DeviceConfig {
    /// "auto" (the GPU when one can be used, else the CPU), "cpu" or "cuda".
    #[serde(default)]
    pub kind: DeviceKind,
    /// A hard budget on the memory pool, e.g. "3.5GiB"; unset = none.
    #[serde(default)]
    pub memory_limit: Option<String>,
    /// Mixed precision on the GPU (f16 activations and compute weights, f32
    /// masters, dynamic loss scaling). false trains in f32 on the GPU too
    /// (f32 activations, the masters as compute weights, no loss scaling);
    /// the CPU trains in f32 either way.
    #[serde(default = "default_true")]
    pub amp: bool,
    /// On the GPU, "f16" (mixed precision, as `amp = true`), "bf16" (bf16
    /// activations and compute weights, f32 masters, no loss scaling;
    /// sm_80 or newer) or "f32" (as `amp = false`). Unset, `amp` decides;
    /// set, it must agree with `amp = false` (which only "f32" does). No
    /// effect on the CPU. Left out of the recorded config when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<Precision>,
    /// Batch norm + ReLU, and a basic block's batch norm + add + ReLU, in
    /// one pass; false runs them apart. Same bits either way, on the CPU
    /// and on the GPU.
    #[serde(default = "default_true")]
    pub fusion: bool,
    /// On the GPU, capture the steady-state training step in a CUDA graph
    /// and replay it with one launch; false launches every kernel from the
    /// host. Same bits either way; no effect on the CPU.
    #[serde(default = "default_true")]
    pub graphs: bool,
    /// On the GPU, keep a batch norm + ReLU's input but not its output for
    /// backward, which computes the output again where it is needed (and a
    /// basic block's output from its batch norm's input and the block's
    /// input): one activation fewer per such layer for one more elementwise
    /// pass or two. false keeps the outputs. Same bits either way; no effect
    /// on the CPU.
    #[serde(default = "default_true")]
    pub recompute: bool,
    /// On the GPU, the bytes a convolution's im2col matrix may take at a
    /// time, e.g. "16MiB" (the default): less memory, more and smaller
    /// matrix products (and the weight gradient summed in another order).
    #[serde(default)]
    pub conv_workspace: Option<String>,
    /// On the GPU, how a convolution's forward and input gradient are
    /// multiplied: "im2col" (an im2col matrix in the workspace, cuBLAS),
    /// "implicit_gemm" (our tensor-core kernel that gathers the matrix tile
    /// by tile in shared memory; f16, channels in multiples of 8, sm_80 or
    /// newer, else im2col), or "auto" (the default: each convolution by its
    /// shape, implicit GEMM for stride 1 and at most 64 channels, direct
    /// kernels for fewer than 8 output channels, im2col elsewhere; the
    /// fastest of the three on an H100), or "tune" (auto's direct kernels,
    /// and each other product timed both ways on this GPU the first time
    /// its shape runs, the faster kept; the choices are saved with the
    /// checkpoints, so a resumed run keeps them, but two runs may choose,
    /// and so compute, differently). No effect on the CPU.
    #[serde(default = "default_conv_algorithm")]
    pub conv_algorithm: ConvAlgorithm,
    /// Fault injection for tests: fail an allocation at these steps ...
    #[serde(default)]
    pub inject_oom: InjectOom,
}

impl DeviceConfig {
    /// The GPU's storage: `precision`, else `amp`'s choice; a `precision`
    /// other than "f32" beside `amp = false` is refused, naming both keys.
    pub fn precision(&self) -> Result<Precision> {
        match (self.precision, self.amp) {
            (None, true) => Ok(Precision::F16),
            (None, false) | (Some(Precision::F32), _) => Ok(Precision::F32),
            (Some(p), true) => Ok(p),
            (Some(p), false) => Err(PipelineError::value(
                "device.precision",
                format!(
                    "\"{p}\" disagrees with device.amp = false (--no-amp), which trains in \
                     f32: set one of the two"
                ),
            )),
        }
    }
}

fn default_conv_algorithm() -> ConvAlgorithm {
    ConvAlgorithm::Auto
}

impl Default for DeviceConfig {
    fn default() -> Self {
        Self {
            kind: DeviceKind::default(),
            memory_limit: None,
            amp: true,
            precision: None,
            fusion: true,
            graphs: true,
            recompute: true,
            conv_workspace: None,
            conv_algorithm: default_conv_algorithm(),
            inject_oom: InjectOom::default(),
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct InjectOom {
    /// ... (optimizer steps, counted from 0; a list, or "3,17,40" from --set) ...
    #[serde(default, deserialize_with = "step_list")]
    pub steps: Vec<u64>,
    /// ... and every N steps (0 = never).
    #[serde(default)]
    pub every: u64,
    /// ... and in the evaluations after these training epochs (counted
    /// from 1).
    #[serde(default, deserialize_with = "step_list")]
    pub evaluations: Vec<u64>,
    /// Refuse the first N copies of the state that checkpoints take (each
    /// checkpoint copies once more, after releasing cached blocks, then
    /// writes the learner's own tensors with no copy, which counts as a
    /// third; refused too, the run stops).
    #[serde(default)]
    pub snapshots: u64,
    /// Take this many bytes as the memory the process has left when a
    /// checkpoint decides whether to copy the state (unset: what the OS
    /// says, `limits::tightest`).
    #[serde(default)]
    pub snapshot_room: Option<u64>,
}

/// A list of steps, written as a TOML array, one number, or comma-separated
/// text.
fn step_list<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<Vec<u64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Steps {
        List(Vec<u64>),
        One(u64),
        Text(String),
    }
    match Steps::deserialize(deserializer)? {
        Steps::List(list) => Ok(list),
        Steps::One(step) => Ok(vec![step]),
        Steps::Text(text) => text
            .trim_matches(|c| c == '[' || c == ']')
            .split(',')
            .filter(|t| !t.trim().is_empty())
            .map(|t| {
                t.trim().parse().map_err(|_| {
                    serde::de::Error::custom(format!("expected step numbers, got `{t}`"))
                })
            })
            .collect(),
    }
}

/// `[memory]`: what to do when memory runs out.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MemoryConfig {
    /// "adapt": free the cache and retry, then halve the micro-batch (doubling
    /// accumulation) down to `min_micro_batch`, then checkpoint and stop.
    /// "stop": checkpoint and stop at the first out-of-memory.
    #[serde(default)]
    pub oom_policy: OomPolicy,
    #[serde(default = "default_min_micro")]
    pub min_micro_batch: usize,
    /// Release the pool's cached blocks every N steps (0 = never) ...
    #[serde(default)]
    pub empty_cache_every: u64,
    /// ... and after every checkpoint.
    #[serde(default)]
    pub empty_cache_after_checkpoint: bool,
}

/// The smallest micro-batch `adapt` splits to unless `memory.min_micro_batch`
/// says otherwise: 2, so a run is stopped with advice rather than left to
/// crawl at one sample a micro-batch.
pub const DEFAULT_MIN_MICRO_BATCH: usize = 2;

fn default_min_micro() -> usize {
    DEFAULT_MIN_MICRO_BATCH
}

impl Default for MemoryConfig {
    fn default() -> Self {
        Self {
            oom_policy: OomPolicy::default(),
            min_micro_batch: default_min_micro(),
            empty_cache_every: 0,
            empty_cache_after_checkpoint: false,
        }
    }
}

/// `[loader]`: the shard cache and the loader's memory budget.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LoaderSettings {
    /// Bytes the loader may hold (caches + prefetched batches), e.g. "256MiB".
    #[serde(default)]
    pub memory_budget: Option<String>,
    /// Decoded shards kept in memory (shards only).
    #[serde(default = "default_cache_shards")]
    pub max_cache_shards: usize,
    /// Or a byte limit on the shard cache, e.g. "64MiB" (shards only).
    #[serde(default)]
    pub cache_bytes: Option<String>,
    /// Shards read ahead in the epoch's known order (shards only).
    #[serde(default)]
    pub read_ahead: usize,
    /// Read every shard at start: the decoded-sample cache for data that fits.
    #[serde(default)]
    pub full_load: bool,
    /// "global" or "shard_blocks"; unset picks shard_blocks for shards.
    #[serde(default)]
    pub shuffle_mode: Option<ShuffleMode>,
}

fn default_cache_shards() -> usize {
    2
}

impl Default for LoaderSettings {
    fn default() -> Self {
        Self {
            memory_budget: None,
            max_cache_shards: default_cache_shards(),
            cache_bytes: None,
            read_ahead: 0,
            full_load: false,
            shuffle_mode: None,
        }
    }
}

/// A byte size from the config: a plain number of bytes or a number with a
/// unit, "64MiB", "1.5GB", "500KB".
pub fn parse_bytes(key: &str, text: &str) -> Result<u64> {
    let bad = || {
        PipelineError::value(
            key,
            format!(
                "expected a byte size such as \"256MiB\", \"3.5GiB\" or a number of bytes, got \"{text}\""
            ),
        )
    };
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let number: f64 = number.parse().map_err(|_| bad())?;
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "kib" | "k" => 1 << 10,
        "mb" => 1_000_000,
        "mib" | "m" => 1 << 20,
        "gb" => 1_000_000_000,
        "gib" | "g" => 1 << 30,
        "tb" => 1_000_000_000_000,
        "tib" | "t" => 1 << 40,
        _ => return Err(bad()),
    };
    let bytes = number * scale as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(bad());
    }
    Ok(bytes as u64)
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    pub epochs: u64,
    pub batch_size: usize,
    /// Compute threads (0 = every core).
    #[serde(default)]
    pub threads: usize,
    #[serde(default)]
    pub label_smoothing: f32,
    /// The training loss; label smoothing applies to either.
    #[serde(default)]
    pub loss: LossKind,
    /// Focal loss's γ: a class's log-probability is weighted by (1 - p)^γ.
    #[serde(default = "default_focal_gamma")]
    pub focal_gamma: f32,
    /// Huber loss's δ, in standardised target units (unset: 1); left out
    /// of the serialised config when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub huber_delta: Option<f32>,
    /// Global gradient-norm clip (0 = off).
    #[serde(default)]
    pub clip_norm: f32,
    /// Split every batch into this many micro-batches (gradients accumulate;
    /// the update equals the whole batch's but for batch-norm statistics).
    #[serde(default = "default_accumulate")]
    pub accumulate: usize,
    /// Or a micro-batch size: a number, or "auto" for the largest that fits
    /// device.memory_limit, found by a dry-run step before training.
    #[serde(default)]
    pub micro_batch: Option<String>,
    /// Non-finite steps in a row after which the run stops (its checkpoints
    /// from after the update before them set aside).
    #[serde(default = "default_max_skips")]
    pub max_consecutive_skips: u64,
    /// Watch a validation figure: keep the best epoch's checkpoint as
    /// `best.ckpt` and stop after `patience` epochs without improving it
    /// (needs `data.validation`). Unset: off; left out of the serialised
    /// config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub early_stopping: Option<crate::monitor::EarlyStopping>,
    /// Data parallel: shard AdamW's moments over the ranks (ZeRO-1), each
    /// rank updating its share of the weights; the same weights as
    /// unsharded. Alone it changes nothing. Left out of the serialised
    /// config when off.
    #[serde(default, skip_serializing_if = "is_false")]
    pub shard_optimizer: bool,
}

fn is_false(value: &bool) -> bool {
    !*value
}

fn default_accumulate() -> usize {
    1
}

/// `[eval]`: how the test split is scored.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EvalConfig {
    /// Test-time augmentation.
    #[serde(default)]
    pub tta: TestTimeAugmentation,
}

impl EvalConfig {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

/// `eval.tta`.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum TestTimeAugmentation {
    /// Score each image as it is.
    #[default]
    None,
    /// Average the class probabilities of each image and its mirror image.
    Flip,
}

/// `train.loss`.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum LossKind {
    /// Softmax cross-entropy.
    #[default]
    CrossEntropy,
    /// Focal loss (Lin et al. 2017) with `train.focal_gamma`.
    Focal,
    /// Mean squared error against numeric targets (a regression).
    Mse,
    /// Huber loss with `train.huber_delta` against numeric targets.
    Huber,
    /// Binary cross-entropy of each output's sigmoid against a 0/1 target:
    /// multi-label classification.
    Bce,
}

impl LossKind {
    /// Whether the loss scores numeric targets (a regression) rather than
    /// classes.
    pub fn is_regression(self) -> bool {
        matches!(self, LossKind::Mse | LossKind::Huber)
    }

    /// Whether the loss scores independent 0/1 labels (multi-label).
    pub fn is_multilabel(self) -> bool {
        self == LossKind::Bce
    }

    /// Whether the targets are numbers per sample (a regression's values or
    /// a multi-label's 0/1s), carried as `Batch::values`, not a class.
    pub fn scores_values(self) -> bool {
        self.is_regression() || self.is_multilabel()
    }
}

fn default_focal_gamma() -> f32 {
    2.0
}

fn default_max_skips() -> u64 {
    10
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OptimizerConfig {
    pub lr: f32,
    #[serde(default)]
    pub weight_decay: f32,
    #[serde(default = "default_beta1")]
    pub beta1: f32,
    #[serde(default = "default_beta2")]
    pub beta2: f32,
    #[serde(default = "default_adam_eps")]
    pub eps: f32,
}

fn default_beta1() -> f32 {
    0.9
}
fn default_beta2() -> f32 {
    0.999
}
fn default_adam_eps() -> f32 {
    1e-8
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ScheduleConfig {
    Constant,
    /// Cosine one-cycle; peak = optimizer.lr.
    OneCycle {
        #[serde(default = "default_pct_start")]
        pct_start: f32,
        #[serde(default = "default_div")]
        div_factor: f32,
        #[serde(default = "default_final_div")]
        final_div_factor: f32,
    },
    /// Linear warm-up to optimizer.lr over `warmup_steps` optimizer steps
    /// (step `warmup_steps − 1` at the peak), then a cosine down to
    /// `min_lr`, reached at the run's last step (`headroom_optim`'s
    /// `Schedule::WarmupCosine`).
    WarmupCosine {
        /// At most the run's optimizer steps (checked once they are known,
        /// when the data is open: `train::schedule`).
        #[serde(default)]
        warmup_steps: u64,
        #[serde(default)]
        min_lr: f32,
    },
}

fn default_pct_start() -> f32 {
    0.3
}
fn default_div() -> f32 {
    25.0
}
fn default_final_div() -> f32 {
    1e4
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CheckpointConfig {
    /// How many checkpoints to keep (oldest deleted first).
    #[serde(default = "default_keep")]
    pub keep: usize,
    /// Also write one every N optimizer steps (0 = only at epoch ends).
    #[serde(default)]
    pub every_steps: u64,
    /// Write one at the end of every epoch.
    #[serde(default = "default_true")]
    pub every_epoch: bool,
    /// Also write one once this many minutes have passed since the last
    /// (or the run's start), at the next step (0 = never): bounds the work
    /// a crash can cost whatever an epoch's length.
    #[serde(default = "default_every_minutes")]
    pub every_minutes: f64,
}

fn default_keep() -> usize {
    3
}

/// Half an hour: a crash costs at most that much of a run whose epochs are
/// longer, for one checkpoint's write per half hour.
fn default_every_minutes() -> f64 {
    30.0
}

fn default_true() -> bool {
    true
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            keep: default_keep(),
            every_steps: 0,
            every_epoch: true,
            every_minutes: default_every_minutes(),
        }
    }
}

/// Keys (or key prefixes) that may differ between the run that wrote a
/// checkpoint and the run that resumes it: how the run is carried out, not
/// what it computes, and the keys the divergence advice names
/// (`ADVICE_KEYS`). The model is compared on its own, layer by layer, and
/// the dataset by its recorded identity (`data::DatasetIdentity`).
pub const RESUME_SAFE_KEYS: [&str; 21] = [
    "run.name",
    "distributed.",
    "run.runs_dir",
    "run.output_dir",
    "run.profile",
    "run.log_every",
    "device.",
    "memory.",
    "train.accumulate",
    "train.micro_batch",
    "data.dir",
    "data.workers",
    "data.prefetch",
    "data.on_device",
    "train.threads",
    "train.epochs",
    "train.early_stopping.patience",
    "train.max_consecutive_skips",
    "train.shard_optimizer",
    "checkpoint.",
    "model.",
];

/// Keys a stopped run's advice tells the user to change before resuming
/// (a lower learning rate, a tighter clip): allowed on resume, and logged.
pub const ADVICE_KEYS: [&str; 2] = ["optimizer.lr", "train.clip_norm"];

impl ExperimentConfig {
    /// `data.format = "text"` needs a corpus, a token model and no image
    /// augmentation.
    fn validate_text(&self) -> Result<()> {
        let Some(text) = &self.text else {
            return Err(PipelineError::value(
                "text.corpus",
                "data.format = \"text\" needs a [text] table naming the corpus files",
            ));
        };
        if text.corpus.is_empty() {
            return Err(PipelineError::value(
                "text.corpus",
                "is empty: name the text files to train on",
            ));
        }
        if self.model.tokens.is_none() {
            return Err(PipelineError::value(
                "model.tokens",
                "data.format = \"text\" needs a token model: set model.tokens = { length, vocab = 256 }",
            ));
        }
        if !(text.validation_fraction > 0.0 && text.validation_fraction < 1.0) {
            return Err(PipelineError::value(
                "text.validation_fraction",
                format!("must be in (0, 1), got {}", text.validation_fraction),
            ));
        }
        if !(text.temperature.is_finite() && text.temperature > 0.0) {
            return Err(PipelineError::value(
                "text.temperature",
                format!("must be a positive finite number, got {}", text.temperature),
            ));
        }
        if self.augment != AugmentConfig::default() {
            return Err(PipelineError::value(
                "augment",
                "image augmentations do not apply to text windows; remove [augment]",
            ));
        }
        Ok(())
    }

    /// `data.format = "moving_fashion_mnist"` needs a `[frames]` table, a
    /// frame model whose frames are the table's, and no image augmentation.
    fn validate_frames(&self) -> Result<()> {
        let Some(frames) = &self.frames else {
            return Err(PipelineError::value(
                "frames",
                "data.format = \"moving_fashion_mnist\" needs a [frames] table (train_sequences, test_sequences)",
            ));
        };
        if self.model.frames.is_none() {
            return Err(PipelineError::value(
                "model.frames",
                "data.format = \"moving_fashion_mnist\" needs a frame model: set model.frames to the frames it reads",
            ));
        }
        if self.model.input != [frames.size, frames.size, 1] {
            return Err(PipelineError::value(
                "model.input",
                format!(
                    "must be [{0}, {0}, 1] for frames.size = {0}, got {1:?}",
                    frames.size, self.model.input
                ),
            ));
        }
        if frames.garments == 0 || frames.train_sequences == 0 || frames.test_sequences == 0 {
            return Err(PipelineError::value(
                "frames",
                "garments, train_sequences and test_sequences must be positive",
            ));
        }
        if self.augment != AugmentConfig::default() {
            return Err(PipelineError::value(
                "augment",
                "image augmentations do not apply to frame sequences; remove [augment]",
            ));
        }
        Ok(())
    }

    /// Value checks that types alone cannot express; each error names its key.
    pub fn validate(&self) -> Result<()> {
        let positive = |key: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(PipelineError::value(
                    key,
                    format!("must be a positive finite number, got {v}"),
                ))
            }
        };
        positive("distributed.bucket_mb", self.distributed.bucket_mb)?;
        positive("distributed.timeout_s", self.distributed.timeout_s)?;
        let non_negative = |key: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(PipelineError::value(
                    key,
                    format!("must be a finite number >= 0, got {v}"),
                ))
            }
        };
        check_run_name(&self.run.name)?;
        if let Some(finetune) = &self.finetune {
            finetune.validate(self)?;
        }
        self.data.check_image_keys(&self.model)?;
        self.check_table_keys()?;
        self.check_validation_keys()?;
        match self.data.format {
            DataFormat::Idx | DataFormat::ImageFolder | DataFormat::Csv | DataFormat::Tensors => {}
            DataFormat::Shards => {
                if self.data.dir.is_none() {
                    return Err(PipelineError::value(
                        "data.dir",
                        "data.format = \"shards\" needs data.dir: the store written by `cargo xtask preprocess`",
                    ));
                }
                if self.data.train_samples > 0 || self.data.test_samples > 0 {
                    return Err(PipelineError::value(
                        "data.train_samples",
                        "sample limits apply to \"idx\" data only; preprocess a smaller store instead",
                    ));
                }
            }
            DataFormat::Text => self.validate_text()?,
            DataFormat::MovingFashionMnist => self.validate_frames()?,
        }
        if let Some(text) = &self.device.memory_limit {
            parse_bytes("device.memory_limit", text)?;
        }
        self.conv_plan()?;
        positive("memory.min_micro_batch", self.memory.min_micro_batch as f64)?;
        self.micro_batch()?;
        if let Some(text) = &self.loader.memory_budget {
            parse_bytes("loader.memory_budget", text)?;
        }
        if let Some(text) = &self.loader.cache_bytes {
            parse_bytes("loader.cache_bytes", text)?;
        }
        positive("train.epochs", self.train.epochs as f64)?;
        positive("train.batch_size", self.train.batch_size as f64)?;
        positive("data.prefetch", self.data.prefetch as f64)?;
        positive("run.log_every", self.run.log_every as f64)?;
        positive("checkpoint.keep", self.checkpoint.keep as f64)?;
        non_negative("checkpoint.every_minutes", self.checkpoint.every_minutes)?;
        positive(
            "train.max_consecutive_skips",
            self.train.max_consecutive_skips as f64,
        )?;
        if !(0.0..1.0).contains(&self.train.label_smoothing) {
            return Err(PipelineError::value(
                "train.label_smoothing",
                format!("must be in [0, 1), got {}", self.train.label_smoothing),
            ));
        }
        if !(self.train.focal_gamma >= 0.0 && self.train.focal_gamma.is_finite()) {
            return Err(PipelineError::value(
                "train.focal_gamma",
                format!("must be finite and >= 0, got {}", self.train.focal_gamma),
            ));
        }
        non_negative("train.clip_norm", self.train.clip_norm as f64)?;
        let classifies_images = self.model.tokens.is_none() && self.model.frames.is_none();
        if self.eval.tta == TestTimeAugmentation::Flip && !classifies_images {
            return Err(PipelineError::value(
                "eval.tta",
                "\"flip\" averages an image classifier's class probabilities; a token or frame \
                 model (model.tokens, model.frames) has none: leave it \"none\"",
            ));
        }
        positive("optimizer.lr", self.optimizer.lr as f64)?;
        non_negative("optimizer.weight_decay", self.optimizer.weight_decay as f64)?;
        if self.augment.crop_padding > self.model.input[0].min(self.model.input[1]) {
            return Err(PipelineError::value(
                "augment.crop_padding",
                format!("{} is larger than the image", self.augment.crop_padding),
            ));
        }
        if let ScheduleConfig::OneCycle {
            pct_start,
            div_factor,
            final_div_factor,
        } = &self.schedule
        {
            if !(*pct_start > 0.0 && *pct_start < 1.0) {
                return Err(PipelineError::value(
                    "schedule.pct_start",
                    format!("must be in (0, 1), got {pct_start}"),
                ));
            }
            positive("schedule.div_factor", *div_factor as f64)?;
            positive("schedule.final_div_factor", *final_div_factor as f64)?;
        }
        if let ScheduleConfig::WarmupCosine { min_lr, .. } = &self.schedule {
            non_negative("schedule.min_lr", *min_lr as f64)?;
            if *min_lr > self.optimizer.lr {
                return Err(PipelineError::value(
                    "schedule.min_lr",
                    format!(
                        "must be at most the peak, optimizer.lr = {}, got {min_lr}",
                        self.optimizer.lr
                    ),
                ));
            }
        }
        sizes::check_sizes(self)
    }

    /// Loader workers: `data.workers`, or a quarter of the cores (1 to 4).
    pub fn loader_workers(&self) -> usize {
        self.data.workers.unwrap_or_else(|| {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            (cores / 4).clamp(1, 4)
        })
    }

    /// The micro-batch size the run starts with; None means "auto".
    pub fn micro_batch(&self) -> Result<Option<usize>> {
        let batch = self.train.batch_size;
        let accumulate = self.train.accumulate;
        if accumulate == 0 || !batch.is_multiple_of(accumulate) {
            return Err(PipelineError::value(
                "train.accumulate",
                format!("must divide train.batch_size = {batch} into equal micro-batches, got {accumulate}"),
            ));
        }
        match self.train.micro_batch.as_deref().map(str::trim) {
            None => Ok(Some(batch / accumulate)),
            Some(_) if accumulate != 1 => Err(PipelineError::value(
                "train.micro_batch",
                "set train.micro_batch or train.accumulate, not both",
            )),
            Some("auto") => Ok(None),
            Some(text) => match text.parse::<usize>() {
                Ok(size) if size > 0 && size <= batch => Ok(Some(size)),
                _ => Err(PipelineError::value(
                    "train.micro_batch",
                    format!("expected \"auto\" or a size from 1 to train.batch_size = {batch}, got \"{text}\""),
                )),
            },
        }
    }

    /// `device.memory_limit` in bytes.
    pub fn memory_limit(&self) -> Result<Option<u64>> {
        self.device
            .memory_limit
            .as_deref()
            .map(|text| parse_bytes("device.memory_limit", text))
            .transpose()
    }

    /// `device.conv_algorithm` and `device.conv_workspace`.
    pub fn conv_plan(&self) -> Result<ConvPlan> {
        let algorithm = self.device.conv_algorithm;
        Ok(ConvPlan {
            algorithm,
            workspace: self.conv_workspace()?,
        })
    }

    /// `device.conv_workspace` in bytes, or the default.
    pub fn conv_workspace(&self) -> Result<usize> {
        let Some(text) = self.device.conv_workspace.as_deref() else {
            return Ok(headroom_model::cuda::ops::CONV_SCRATCH_BYTES);
        };
        let bytes = parse_bytes("device.conv_workspace", text)?;
        usize::try_from(bytes)
            .ok()
            .filter(|&b| b > 0)
            .ok_or_else(|| {
                PipelineError::value(
                    "device.conv_workspace",
                    format!("expected a positive byte size such as \"16MiB\", got \"{text}\""),
                )
            })
    }

    /// The run directory once claimed (see `rundir::RunDir::claim`).
    pub fn output_dir(&self) -> &Path {
        self.run.output_dir.as_deref().unwrap_or(&self.run.runs_dir)
    }

    /// The experiment as flat `section.key = value` pairs (JSON values), for
    /// naming what differs between two experiments.
    pub fn flatten(&self) -> std::collections::BTreeMap<String, String> {
        let mut out = std::collections::BTreeMap::new();
        if let Ok(value) = serde_json::to_value(self) {
            flatten_into(&value, String::new(), &mut out);
        }
        out
    }

    /// A stable fingerprint of everything that shapes the result: checkpoints
    /// record it so a resume under a different experiment is noticed.
    pub fn fingerprint(&self) -> u32 {
        let mut hasher = crc32fast::Hasher::new();
        for (key, value) in self.result_keys() {
            hasher.update(key.as_bytes());
            hasher.update(b"=");
            hasher.update(value.as_bytes());
            hasher.update(b"\n");
        }
        hasher.finalize()
    }

    /// The flattened keys that shape the result (all but `RESUME_SAFE_KEYS`).
    pub fn result_keys(&self) -> std::collections::BTreeMap<String, String> {
        let mut keys = self.flatten();
        keys.retain(|key, _| {
            !RESUME_SAFE_KEYS
                .iter()
                .chain(&ADVICE_KEYS)
                .any(|safe| key.starts_with(safe))
        });
        keys
    }
}

/// `run.name` names a directory inside `run.runs_dir`: one plain name, so no
/// run can write outside it (`../../x`, `/etc`, `a/b`).
fn check_run_name(name: &str) -> Result<()> {
    let plain =
        !name.trim().is_empty() && name != "." && name != ".." && !name.contains(['/', '\\', '\0']);
    if plain {
        return Ok(());
    }
    Err(PipelineError::value(
        "run.name",
        format!(
            "\"{name}\" must be one plain directory name (no `/`, `\\`, `..`), so the run stays inside \
             run.runs_dir; use run.runs_dir or run.output_dir to choose where runs go"
        ),
    ))
}

fn flatten_into(
    value: &serde_json::Value,
    prefix: String,
    out: &mut std::collections::BTreeMap<String, String>,
) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, child) in map {
                let path = if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                };
                flatten_into(child, path, out);
            }
        }
        other => {
            out.insert(prefix, other.to_string());
        }
    }
}
