//! Fine-tuning from a trained checkpoint (`[finetune]`): the model of the
//! experiment is built as usual, then every base tensor is copied in by its
//! name (the names `cargo xtask export` writes), so a `tiny_gpt` checkpoint
//! loads into the same architecture with LoRA adapters added beside its
//! attention projections. With `train = "lora"` everything but the adapters
//! (`*.lora_a`, `*.lora_b`) is frozen, so AdamW keeps state for the adapters
//! only; `train = "full"` drops the adapters from the model and trains every
//! weight, for comparison.
//!
//! After a LoRA run the adapters are written on their own
//! (`adapters.safetensors`, with each adapter's scale alpha/r in the
//! metadata), and `merge` folds them into the base weights.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use headroom_loader::DataLoader;
use headroom_model::memory::MemoryPool;
use headroom_model::{Device, ModelSpec, Network};
use serde::Serialize;

use crate::checkpoint::{self, Checkpoint};
use crate::config::ExperimentConfig;
use crate::export::{self, F32Tensor};
use crate::learner::{CpuLearner, StepSettings};
use crate::{data, PipelineError, Result, RunSummary};

/// The adapters of a LoRA run, in its run directory.
pub const ADAPTERS_FILE: &str = "adapters.safetensors";
/// The figures of a fine-tuning run, as JSON, in its run directory.
pub const REPORT_FILE: &str = "finetune_report.json";

pub use crate::config::finetune::{
    adapter_scales, as_trained, effective_model, is_adapter, FinetuneConfig, FinetuneMode,
};

/// The base checkpoint of `finetune`: the file, or the run directory's
/// newest valid one of its own. Missing: an error naming `finetune.base` and the
/// command that trains it.
pub fn base_checkpoint(finetune: &FinetuneConfig) -> Result<PathBuf> {
    let base = &finetune.base;
    if base.is_file() {
        return Ok(base.clone());
    }
    // The base run's own newest checkpoint, never another run's file that
    // sorts last in its directory (see `eval::run_checkpoint`).
    if base.is_dir() && !checkpoint::list(base)?.is_empty() {
        return crate::eval::run_checkpoint(base).map(|(path, _)| path);
    }
    // There but unusable (a symlink loop, a directory it may not list):
    // named as what it is, not as a base to train.
    if !crate::paths::is_absent(base) {
        let want = if base.is_dir() {
            crate::paths::Want::Dir
        } else {
            crate::paths::Want::File
        };
        if let Some(reason) = crate::paths::problem(base, want) {
            return Err(PipelineError::value(
                "finetune.base",
                format!("{} {reason}", base.display()),
            ));
        }
    }
    let command = match &finetune.base_experiment {
        Some(experiment) => format!(
            "cargo xtask train --config {} --set {}",
            crate::shell::quote_path(experiment),
            crate::shell::quote(&format!("run.output_dir={}", base.display()))
        ),
        None => format!(
            "cargo xtask train --config experiments/tiny_gpt.toml --set {}",
            crate::shell::quote(&format!("run.output_dir={}", base.display()))
        ),
    };
    Err(PipelineError::value(
        "finetune.base",
        format!(
            "{} holds no checkpoint; train the base first: {command}",
            base.display()
        ),
    ))
}

/// Loads the base into `network` by name and, for "lora", freezes all but
/// the adapters. Nothing happens without `[finetune]`. Returns the number
/// of tensors loaded.
pub fn initialise(config: &ExperimentConfig, network: &mut Network) -> Result<usize> {
    let Some(finetune) = &config.finetune else {
        return Ok(0);
    };
    let path = base_checkpoint(finetune)?;
    let base = checkpoint::load(&path)?;
    let loaded = load_by_name(network, &base, &path)?;
    if finetune.train == FinetuneMode::Lora {
        freeze_all_but_adapters(network);
    }
    let figures = Figures::of(network);
    tracing::info!(
        "finetune ({:?}): {loaded} tensors from {}; {} of {} parameters trainable, optimizer state {}",
        finetune.train,
        path.display(),
        figures.trainable,
        figures.parameters,
        headroom_model::memory::bytes_text(figures.optimizer_state_bytes)
    );
    Ok(loaded)
}

/// `initialise` for timing a step (`cargo xtask bench`): a base's values
/// do not change a step's speed, so without a trained base the network
/// keeps its own initial weights, frozen as the run would freeze them.
pub fn initialise_for_timing(config: &ExperimentConfig, network: &mut Network) -> Result<usize> {
    let Some(finetune) = &config.finetune else {
        return Ok(0);
    };
    if base_checkpoint(finetune).is_ok() {
        return initialise(config, network);
    }
    tracing::warn!(
        "finetune.base {} holds no checkpoint: timing with random base weights",
        finetune.base.display()
    );
    if finetune.train == FinetuneMode::Lora {
        freeze_all_but_adapters(network);
    }
    Ok(0)
}

/// Freezes every parameter but the LoRA factors (releasing their
/// gradient buffers: layers compute no gradient for a frozen parameter).
pub fn freeze_all_but_adapters(network: &mut Network) {
    for param in network.params_mut() {
        if !is_adapter(&param.name) {
            param.freeze();
        }
    }
}

/// Copies every tensor of `base` (read from `path`) into the parameter of
/// `network` with the same name. Adapters absent from the base keep their
/// initialisation (B = 0: the model starts as the base). A learned
/// position table may be longer in the base (its first rows are used).
/// Anything else that differs is an error naming the file and the tensor or
/// key: another architecture, vocabulary or context.
pub fn load_by_name(network: &mut Network, base: &Checkpoint, path: &Path) -> Result<usize> {
    check_base_tokens(network.spec(), base, path)?;
    let named = export::named_values(base, path)?;
    let bad = |reason: String| PipelineError::Checkpoint {
        path: path.to_path_buf(),
        reason,
    };
    if let Some(buffer) = named.iter().find(|t| !t.param) {
        return Err(bad(format!(
            "holds the buffer {}, which a tiny_gpt model has not: not the same architecture",
            buffer.name
        )));
    }
    let mut by_name: HashMap<&str, &export::NamedValues> =
        named.iter().map(|t| (t.name.as_str(), t)).collect();
    let mut loaded = 0;
    for param in network.params_mut() {
        let Some(source) = by_name.remove(param.name.as_str()) else {
            if is_adapter(&param.name) {
                continue;
            }
            return Err(bad(format!(
                "has no tensor {}: not a model of the same architecture as model.layers",
                param.name
            )));
        };
        let shape = param.value.shape().to_vec();
        let values = fitted(&param.name, &source.shape, source.values, &shape).ok_or_else(|| {
            bad(format!(
                "tensor {} has shape {:?}, model.layers needs {shape:?}: not a tiny_gpt of the same shape",
                param.name, source.shape
            ))
        })?;
        param.value.try_data_mut()?.copy_from_slice(values);
        loaded += 1;
    }
    if let Some(extra) = by_name.keys().min() {
        return Err(bad(format!(
            "holds the tensor {extra}, which model.layers has not: not a model of the same architecture"
        )));
    }
    Ok(loaded)
}

/// The values of a base tensor for a parameter of `shape`: all of them
/// when the shapes agree, the first rows of a longer position table.
fn fitted<'a>(name: &str, base: &[usize], values: &'a [f32], shape: &[usize]) -> Option<&'a [f32]> {
    if base == shape {
        return Some(values);
    }
    match (base, shape) {
        ([rows, cols], [want, c]) if name.ends_with(".positions") && c == cols && want <= rows => {
            Some(&values[..want * cols])
        }
        _ => None,
    }
}

/// The base must be a token model of the same vocabulary and a context at
/// least as long as the model's: each error names the key and the file.
fn check_base_tokens(spec: &ModelSpec, base: &Checkpoint, path: &Path) -> Result<()> {
    let base_spec = base.model().map_err(|reason| PipelineError::Checkpoint {
        path: path.to_path_buf(),
        reason,
    })?;
    let (Some(ours), Some(theirs)) = (spec.tokens, base_spec.tokens) else {
        return Err(PipelineError::Checkpoint {
            path: path.to_path_buf(),
            reason: "is not a token model (model.tokens): LoRA fine-tuning starts from a tiny_gpt checkpoint"
                .into(),
        });
    };
    if ours.vocab != theirs.vocab {
        return Err(PipelineError::value(
            "model.tokens.vocab",
            format!(
                "is {}, but the base {} has a vocabulary of {}",
                ours.vocab,
                path.display(),
                theirs.vocab
            ),
        ));
    }
    if ours.length > theirs.length {
        return Err(PipelineError::value(
            "model.tokens.length",
            format!(
                "is {}, longer than the context of the base {} ({} tokens): its positions end there",
                ours.length,
                path.display(),
                theirs.length
            ),
        ));
    }
    Ok(())
}

/// Parameter counts and optimizer-state bytes of a model as it trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Figures {
    pub parameters: usize,
    pub trainable: usize,
    pub optimizer_state_bytes: u64,
}

impl Figures {
    pub fn of(network: &mut Network) -> Self {
        let params = network.params_mut();
        Self {
            parameters: params.iter().map(|p| p.value.len()).sum(),
            trainable: params
                .iter()
                .filter(|p| !p.frozen)
                .map(|p| p.value.len())
                .sum(),
            optimizer_state_bytes: headroom_optim::adamw_state_bytes(&params),
        }
    }

    /// The figures of `config`'s run, from its model alone (no base read).
    pub fn of_config(config: &ExperimentConfig) -> Result<Self> {
        let pool = MemoryPool::new(Device::Cpu);
        let mut network = pool.scope(|| Network::build(&effective_model(config), 0))?;
        if config
            .finetune
            .as_ref()
            .is_some_and(|f| f.train == FinetuneMode::Lora)
        {
            freeze_all_but_adapters(&mut network);
        }
        Ok(Self::of(&mut network))
    }
}

/// What `write_report` measured, side by side with another mode's.
#[derive(Clone, Debug, Serialize)]
pub struct FinetuneReport {
    pub train: FinetuneMode,
    pub base_checkpoint: PathBuf,
    pub figures: Figures,
    /// The tensor pool's peak in use and reserved bytes over the run.
    pub tensor_peak_in_use_bytes: u64,
    pub tensor_peak_reserved_bytes: u64,
    pub peak_rss_bytes: Option<u64>,
    /// The base model on the new corpus's validation split; None when a
    /// stop request came before it was measured (left out of the JSON).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub validation_loss_before: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bits_per_byte_before: Option<f32>,
    pub validation_loss_after: f32,
    pub bits_per_byte_after: f32,
    pub adapters_file: Option<PathBuf>,
    pub adapters_file_bytes: Option<u64>,
}

/// After a completed fine-tuning run: writes the adapters (LoRA), evaluates
/// the base on the validation split, and writes `finetune_report.json`
/// beside the run's last checkpoint.
pub fn write_report(config: &ExperimentConfig, summary: &RunSummary) -> Result<FinetuneReport> {
    write_report_until(config, summary, None)
}

/// [`write_report`], whose evaluation of the base is given up once `stop`
/// is set (the first SIGINT or SIGTERM): the adapters are written first,
/// and the report then says the base was not measured.
pub fn write_report_until(
    config: &ExperimentConfig,
    summary: &RunSummary,
    stop: Option<&std::sync::atomic::AtomicBool>,
) -> Result<FinetuneReport> {
    let finetune = config.finetune.as_ref().ok_or_else(|| {
        PipelineError::value("finetune", "the run has no [finetune] table to report on")
    })?;
    let last = summary.last_checkpoint.as_deref().ok_or_else(|| {
        PipelineError::value("checkpoint", "the run wrote no checkpoint to report on")
    })?;
    let dir = last.parent().unwrap_or(Path::new("."));
    let base_checkpoint = base_checkpoint(finetune)?;
    let (adapters_file, adapters_file_bytes) = match finetune.train {
        FinetuneMode::Lora => {
            let file = dir.join(ADAPTERS_FILE);
            write_adapters(last, &base_checkpoint, &file)?;
            let bytes = std::fs::metadata(&file).map_err(|e| PipelineError::io(&file, e))?;
            (Some(file), Some(bytes.len()))
        }
        FinetuneMode::Full => (None, None),
    };
    let before = evaluate_base_until(config, stop)?;
    if before.is_none() {
        tracing::warn!("the base was not evaluated: stopped by request");
    }
    let after = summary.test_loss.unwrap_or(f32::NAN);
    let report = FinetuneReport {
        train: finetune.train,
        base_checkpoint,
        figures: Figures::of_config(config)?,
        tensor_peak_in_use_bytes: summary.memory.peak_in_use_bytes,
        tensor_peak_reserved_bytes: summary.memory.peak_reserved_bytes,
        peak_rss_bytes: summary.peak_rss_bytes,
        validation_loss_before: before,
        bits_per_byte_before: before.map(|loss| loss / std::f32::consts::LN_2),
        validation_loss_after: after,
        bits_per_byte_after: after / std::f32::consts::LN_2,
        adapters_file,
        adapters_file_bytes,
    };
    let path = dir.join(REPORT_FILE);
    let json = serde_json::to_string_pretty(&report).map_err(|e| PipelineError::Stage {
        stage: "finetune report",
        reason: e.to_string(),
    })?;
    std::fs::write(&path, json).map_err(|e| PipelineError::io(&path, e))?;
    Ok(report)
}

/// Validation loss (nats per byte) of the base model, as fine-tuning
/// starts from it, on `config`'s validation split.
pub fn evaluate_base(config: &ExperimentConfig) -> Result<f32> {
    evaluate_base_until(config, None)?.ok_or_else(|| PipelineError::Stage {
        stage: "finetune report",
        reason: "stopped without a stop request".into(),
    })
}

/// [`evaluate_base`], None once `stop` is set.
fn evaluate_base_until(
    config: &ExperimentConfig,
    stop: Option<&std::sync::atomic::AtomicBool>,
) -> Result<Option<f32>> {
    let spec = effective_model(config);
    let batch = config.train.batch_size;
    let pool = MemoryPool::new(Device::Cpu);
    let settings = StepSettings::from_config(config);
    let build = crate::parts::cpu_build_options(config);
    let mut learner = CpuLearner::new(&spec, config.run.seed, build, settings, batch, pool)?;
    initialise(config, learner.network_mut())?;
    let (_, test_set) = data::open_splits(config, false)?;
    let loader = DataLoader::new(test_set, data::loader_config(config, false)?)?;
    let evaluation = crate::eval::evaluate_until(&mut learner, &loader, config.eval.tta, stop)?;
    Ok(evaluation.map(|e| e.loss))
}

/// Writes the adapter factors of `checkpoint_path` (a LoRA run) to
/// `output`, with their scales, the model spec and the base in the
/// metadata; returns the number of tensors.
pub fn write_adapters(checkpoint_path: &Path, base: &Path, output: &Path) -> Result<usize> {
    export::check_output(output, &[checkpoint_path, base])?;
    let saved = checkpoint::load(checkpoint_path)?;
    let spec = saved.model().map_err(|reason| PipelineError::Checkpoint {
        path: checkpoint_path.to_path_buf(),
        reason,
    })?;
    let tensors: Vec<F32Tensor> = export::named_values(&saved, checkpoint_path)?
        .into_iter()
        .filter(|t| is_adapter(&t.name))
        .map(|t| (t.name, t.shape, t.values.to_vec()))
        .collect();
    let scales = serde_json::to_string(&adapter_scales(&spec)).unwrap_or_default();
    let checksum = adapters_checksum(&tensors, &scales);
    let metadata = BTreeMap::from([
        (CHECKSUM_KEY.to_string(), checksum),
        ("producer".to_string(), "headroom".to_string()),
        ("adapter".to_string(), "lora".to_string()),
        ("scales".to_string(), scales),
        ("model_spec".to_string(), saved.meta.model_json.clone()),
        ("base".to_string(), base.display().to_string()),
        ("step".to_string(), saved.meta.step.to_string()),
    ]);
    export::write_f32_safetensors(&tensors, &metadata, output)?;
    Ok(tensors.len())
}

/// The metadata key of an adapters file's checksum.
pub const CHECKSUM_KEY: &str = "checksum";

/// The checksum an adapters file records of its contents: CRC-32 of every
/// tensor's name, shape and values (in name order) and of the scales, as
/// `crc32:XXXXXXXX`. A file changed or damaged after it was written (a
/// flipped bit, a tensor replaced by hand) no longer matches, and `merge`
/// refuses it instead of folding wrong numbers into the base.
pub fn adapters_checksum(tensors: &[F32Tensor], scales: &str) -> String {
    let mut sorted: Vec<&F32Tensor> = tensors.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let mut hasher = crc32fast::Hasher::new();
    for (name, shape, values) in sorted {
        hasher.update(name.as_bytes());
        hasher.update(&[0]);
        hasher.update(&(shape.len() as u64).to_le_bytes());
        for &d in shape {
            hasher.update(&(d as u64).to_le_bytes());
        }
        for v in values {
            hasher.update(&v.to_le_bytes());
        }
    }
    hasher.update(scales.as_bytes());
    format!("crc32:{:08x}", hasher.finalize())
}

/// Checks an adapters file read from disk before anything is folded: its
/// checksum (when it records one; files from before checksums are taken
/// with a warning), that every tensor is an adapter factor of a layer the
/// scales name, and that every value and scale is finite (one NaN would
/// make every merged weight it touches NaN).
fn check_adapters(
    factors: &[F32Tensor],
    metadata: &HashMap<String, String>,
    scales: &BTreeMap<String, f32>,
    bad: &dyn Fn(String) -> PipelineError,
) -> Result<()> {
    let scales_text = metadata.get("scales").map_or("", String::as_str);
    let computed = adapters_checksum(factors, scales_text);
    match metadata.get(CHECKSUM_KEY) {
        Some(recorded) if *recorded != computed => {
            return Err(bad(format!(
                "its metadata records checksum {recorded}, its contents hash to {computed}: \
                 the file was changed or damaged after it was written; use the \
                 {ADAPTERS_FILE} the LoRA run wrote"
            )))
        }
        Some(_) => {}
        None => tracing::warn!(
            "the adapters file records no checksum (written before checksums were kept): \
             its contents cannot be verified"
        ),
    }
    for (layer, scale) in scales {
        if !scale.is_finite() {
            return Err(bad(format!("the scale of {layer} is {scale}, not finite")));
        }
    }
    for (name, _, values) in factors {
        let known = [".lora_a", ".lora_b"]
            .iter()
            .filter_map(|suffix| name.strip_suffix(suffix))
            .any(|layer| scales.contains_key(layer));
        if !known {
            return Err(bad(format!(
                "holds {name}, which is not the lora_a or lora_b of a layer its scales name \
                 ({}): not an adapters file written by a LoRA run",
                scales.keys().cloned().collect::<Vec<_>>().join(", ")
            )));
        }
        if let Some((i, v)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(bad(format!(
                "{name}[{i}] is {v}: every adapter value must be finite"
            )));
        }
    }
    Ok(())
}

/// The adapters file's recorded base checkpoint.
pub fn recorded_base(adapters: &Path) -> Result<PathBuf> {
    let (_, metadata) = export::read_f32_safetensors(adapters)?;
    if metadata.get("adapter").map(String::as_str) != Some("lora") {
        return Err(PipelineError::Checkpoint {
            path: adapters.to_path_buf(),
            reason: "not a LoRA adapters file (its metadata has no adapter = \"lora\"): give the \
                     adapters.safetensors a LoRA run writes"
                .into(),
        });
    }
    metadata
        .get("base")
        .map(PathBuf::from)
        .ok_or_else(|| PipelineError::Checkpoint {
            path: adapters.to_path_buf(),
            reason: "records no base checkpoint: pass --base".into(),
        })
}

/// The base's tensors with every adapter of `adapters` folded in:
/// W[in, out] += s·Aᵀ·Bᵀ, with A [r, in], B [out, r] and s = alpha / r.
/// `base` is a checkpoint file or a run directory.
pub fn merged_tensors(base: &Path, adapters: &Path) -> Result<(Vec<F32Tensor>, String)> {
    let (base_path, saved) = crate::eval::run_checkpoint(base)?;
    let mut tensors: Vec<F32Tensor> = export::named_values(&saved, &base_path)?
        .into_iter()
        .map(|t| (t.name, t.shape, t.values.to_vec()))
        .collect();
    let (factors, metadata) = export::read_f32_safetensors(adapters)?;
    let bad = |reason: String| PipelineError::Checkpoint {
        path: adapters.to_path_buf(),
        reason,
    };
    let scales: BTreeMap<String, f32> = metadata
        .get("scales")
        .and_then(|s| serde_json::from_str(s).ok())
        .ok_or_else(|| {
            bad("no readable \"scales\" in the metadata: not a headroom adapters file".into())
        })?;
    check_adapters(&factors, &metadata, &scales, &bad)?;
    let factor = |name: String| {
        factors
            .iter()
            .find(|t| t.0 == name)
            .ok_or_else(|| bad(format!("has no tensor {name}")))
    };
    for (layer, scale) in &scales {
        let (_, a_shape, a) = factor(format!("{layer}.lora_a"))?;
        let (_, b_shape, b) = factor(format!("{layer}.lora_b"))?;
        let weight = format!("{layer}.weight");
        let Some((_, w_shape, w)) = tensors.iter_mut().find(|t| t.0 == weight) else {
            return Err(bad(format!(
                "adapts {layer}, but the base {} has no tensor {weight}",
                base_path.display()
            )));
        };
        fold(w, w_shape, a, a_shape, b, b_shape, *scale)
            .map_err(|reason| bad(format!("{layer}: {reason} (base {})", base_path.display())))?;
    }
    Ok((tensors, saved.meta.model_json))
}

/// W[in, out] += s·Aᵀ·Bᵀ, shapes checked.
fn fold(
    w: &mut [f32],
    w_shape: &[usize],
    a: &[f32],
    a_shape: &[usize],
    b: &[f32],
    b_shape: &[usize],
    scale: f32,
) -> std::result::Result<(), String> {
    let (&[inputs, outputs], &[r, a_in], &[b_out, b_r]) = (w_shape, a_shape, b_shape) else {
        return Err(format!(
            "shapes W {w_shape:?}, A {a_shape:?}, B {b_shape:?} are not matrices"
        ));
    };
    if a_in != inputs || b_out != outputs || b_r != r {
        return Err(format!(
            "A {a_shape:?} and B {b_shape:?} do not fit the base weight {w_shape:?}"
        ));
    }
    for i in 0..inputs {
        for o in 0..outputs {
            let update: f32 = (0..r).map(|k| a[k * inputs + i] * b[o * r + k]).sum();
            w[i * outputs + o] += scale * update;
        }
    }
    Ok(())
}

/// `cargo xtask lora-merge`: writes the merged weights (the base
/// architecture, adapters folded in) as safetensors named as `export`
/// names them; returns the number of tensors.
pub fn merge(base: &Path, adapters: &Path, output: &Path) -> Result<usize> {
    export::check_output(output, &[base, adapters])?;
    let (tensors, model_json) = merged_tensors(base, adapters)?;
    let metadata = BTreeMap::from([
        ("format".to_string(), "pt".to_string()),
        ("producer".to_string(), "headroom".to_string()),
        ("model_spec".to_string(), model_json),
        (
            "merged_adapters".to_string(),
            adapters.display().to_string(),
        ),
    ]);
    export::write_f32_safetensors(&tensors, &metadata, output)?;
    Ok(tensors.len())
}
