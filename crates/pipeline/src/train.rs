//! `train()`: a TOML experiment run by the [`Trainer`]. It claims the run
//! directory, resolves the experiment (a full fine-tune trains its base's
//! architecture), records it there, and makes the trainer's parts from it:
//! the learner `device.kind` asks for, the data `data.format` names, and
//! each stage's typed settings.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use headroom_loader::{Dataset, LoaderConfig};
use headroom_model::LayerRegistry;

use crate::config::ExperimentConfig;
use crate::learner::{CudaOptions, Learner};
use crate::memory::MemorySettings;
use crate::resume::Resume;
use crate::rundir;
use crate::trainer::{
    LoopSettings, MicroBatch, Parts, ScheduleSettings, Task, Trainer, TrainerParts,
};
use crate::{data, parts, PipelineError, Result};

pub use crate::trainer::RunSummary;

#[derive(Clone, Debug, Default)]
pub struct TrainOptions {
    pub resume: Resume,
    /// Install the Fashion-MNIST Debian package if it is missing and we can.
    pub allow_install: bool,
    /// Set (by a signal handler, say) to stop after the current step with a
    /// checkpoint.
    pub stop: Option<Arc<AtomicBool>>,
    /// Makes the experiment's `{ type = "custom", name = ... }` layers: a
    /// program of your own trains a TOML experiment naming its layers by
    /// registering them here (and passes the same registry to `eval` and
    /// `predict`).
    pub layers: LayerRegistry,
    /// The ranks of a data-parallel run (`crate::ranks`): each trains its
    /// shard of every global batch of `train.batch_size × world` samples;
    /// rank 0 owns the run directory. None (or a world of one): alone.
    pub ranks: Option<crate::ranks::Ranks>,
}

/// The learner `device.kind` asks for, with micro-batches of
/// `train.batch_size` to start with, its fine-tuning base loaded. CPU
/// tensors come from `pool`.
pub fn open(
    config: &ExperimentConfig,
    pool: Arc<headroom_model::memory::MemoryPool>,
    cuda: CudaOptions,
) -> Result<Box<dyn Learner>> {
    open_with_layers(config, pool, cuda, &LayerRegistry::default())
}

/// `open`, the model's `custom` entries made by `layers`.
pub fn open_with_layers(
    config: &ExperimentConfig,
    pool: Arc<headroom_model::memory::MemoryPool>,
    cuda: CudaOptions,
    layers: &LayerRegistry,
) -> Result<Box<dyn Learner>> {
    parts::open_with(config, pool, cuda, crate::finetune::initialise, layers)
}

pub fn train(config: &ExperimentConfig, options: &TrainOptions) -> Result<RunSummary> {
    let ranks = options.ranks.clone().filter(|r| r.active());
    if let Some(ranks) = &ranks {
        // Fault injection (`device.inject_oom`) is a test's, per rank: the
        // one setting that may differ, so that a test can fail one rank.
        let mut compared = config.clone();
        compared.device.inject_oom = Default::default();
        let settings = crate::resume::RunRecord::to_json(&compared);
        ranks.require_same("experiment (its resolved settings)", settings.as_bytes())?;
    }
    // Held (locked) for the whole run; removed on drop if this start made it
    // and it holds no progress. A follower's is its own scratch directory:
    // the leader's holds the run.
    let (run_dir, resume, scratch) = crate::ranks::claim_run_dir(
        ranks.as_ref(),
        &rundir::RunPlace::of(config),
        &options.resume,
    )?;
    // A full fine-tune trains the base architecture (no adapters).
    let mut resolved = crate::finetune::as_trained(config);
    resolved.run.output_dir = Some(run_dir.path().to_path_buf());
    let config = Arc::new(resolved);
    let recorded = Arc::clone(&config);
    let for_parts = Arc::clone(&config);
    let allow_install = options.allow_install;
    let layers = options.layers.clone();
    let ranks_for_parts = ranks.clone();
    let stop = match &ranks {
        Some(ranks) => Some(Arc::clone(&ranks.agreed)),
        None => options.stop.clone(),
    };
    let summary = Trainer::from_parts(TrainerParts {
        run_dir,
        resume,
        stop,
        settings: loop_settings(&config)?,
        checkpoint: config.checkpoint.clone(),
        memory: MemorySettings::from_config(&config)?,
        schedule: ScheduleSettings {
            lr: config.optimizer.lr,
            kind: config.schedule.clone(),
        },
        record: config.clone(),
        parts: Box::new(move |pool| {
            make_parts(
                &for_parts,
                allow_install,
                &layers,
                ranks_for_parts.as_ref(),
                pool,
            )
        }),
        sinks: Vec::new(),
        // The resolved config, written once: a resumed run keeps its own.
        on_open: Some(Box::new(move |dir| {
            rundir::write_resolved_config(dir, &recorded)
        })),
        ranks,
    })
    .run();
    if let Some(scratch) = scratch {
        let _ = std::fs::remove_dir_all(scratch);
    }
    summary
}

/// The loop's settings of `config`.
pub fn loop_settings(config: &ExperimentConfig) -> Result<LoopSettings> {
    Ok(LoopSettings {
        epochs: config.train.epochs,
        batch_size: config.train.batch_size,
        micro_batch: match config.micro_batch()? {
            Some(size) => MicroBatch::Size(size),
            None => MicroBatch::Planned,
        },
        threads: config.train.threads,
        max_consecutive_skips: config.train.max_consecutive_skips,
        log_every: config.run.log_every,
        tta: config.eval.tta,
        task: match (config.model.frames, config.model.tokens) {
            (Some(_), _) => Task::Frames,
            (None, Some(tokens)) => Task::Tokens {
                length: tokens.length,
            },
            (None, None) if config.train.loss.is_regression() => Task::Regression,
            (None, None) if config.train.loss.is_multilabel() => Task::MultiLabel,
            (None, None) => Task::Classifier,
        },
        check_fits: config.finetune.is_some(),
        early_stopping: config.train.early_stopping.clone(),
    })
}

/// The learner and data `config` names, in the run's memory pool.
fn make_parts(
    config: &ExperimentConfig,
    allow_install: bool,
    layers: &LayerRegistry,
    ranks: Option<&crate::ranks::Ranks>,
    pool: Arc<headroom_model::memory::MemoryPool>,
) -> Result<Parts> {
    let (train_set, test_set) = data::open_splits(config, allow_install)?;
    let (train_set, validation) = split_validation(config, train_set)?;
    let mut learner = open_with_layers(config, pool, parts::cuda_options(config)?, layers)?;
    check_data_fits_model(config, train_set.as_ref(), learner.as_ref())?;
    let mut shard = headroom_loader::Shard::default();
    if let Some(ranks) = ranks {
        let data = format!(
            "{} training samples of {:?}, {} classes; {} test samples",
            train_set.len(),
            train_set.sample_shape(),
            train_set.num_classes(),
            test_set.len()
        );
        ranks.require_same("training data", data.as_bytes())?;
        let model = format!("{} parameters", learner.num_params());
        ranks.require_same("model", model.as_bytes())?;
        let mut joined = ranks.clone();
        joined.shard_optimizer = config.train.shard_optimizer;
        learner.join_ranks(joined)?;
        shard = headroom_loader::Shard {
            rank: ranks.rank,
            world: ranks.world,
        };
    }
    match &validation {
        Some(validation) => tracing::info!(
            "{} training samples, {} validation samples (data.validation), {} test samples",
            train_set.len(),
            validation.len(),
            test_set.len()
        ),
        None => tracing::info!(
            "{} training samples, {} test samples",
            train_set.len(),
            test_set.len()
        ),
    }
    let resident = data::hold_on_device(config, train_set.as_ref(), learner.as_mut())?;
    Ok(Parts {
        learner,
        train: train_set,
        test: test_set,
        validation,
        train_loader: LoaderConfig {
            resident,
            shard,
            ..data::loader_config(config, true)?
        },
        test_loader: data::loader_config(config, false)?,
    })
}

/// The seed of `data.validation`'s draw: fixed, so that every run of an
/// experiment (whatever its `loader.seed`) holds out the same samples.
const VALIDATION_SEED: u64 = 0x7661_6c69_6461_7465;

/// A training set, and the validation split held out of it (if any).
type TrainAndValidation = (Arc<dyn Dataset>, Option<Arc<dyn Dataset>>);

/// The training set less `data.validation`'s samples, and those samples.
fn split_validation(
    config: &ExperimentConfig,
    train: Arc<dyn Dataset>,
) -> Result<TrainAndValidation> {
    let Some(count) = config.validation_count(train.len())? else {
        return Ok((train, None));
    };
    let (rest, held_out) = headroom_loader::split_off(train, count, VALIDATION_SEED)?;
    Ok((Arc::new(rest), Some(Arc::new(held_out))))
}

fn check_data_fits_model(
    config: &ExperimentConfig,
    data: &dyn Dataset,
    learner: &dyn Learner,
) -> Result<()> {
    if let Some(tokens) = config.model.tokens {
        return crate::text::check_data_fits_token_model(config, tokens, data, learner);
    }
    if let Some(frames) = config.model.frames {
        return crate::frames::check_data_fits_frame_model(config, frames, data);
    }
    if data.sample_shape() != config.model.input {
        return Err(PipelineError::value(
            "model.input",
            format!(
                "{:?} does not match the dataset's samples {:?}",
                config.model.input,
                data.sample_shape()
            ),
        ));
    }
    if data.num_classes() > learner.num_classes() {
        return Err(PipelineError::value(
            "data",
            format!(
                "the training data has {} classes but the network has only {} outputs (the last layer of model.layers)",
                data.num_classes(),
                learner.num_classes()
            ),
        ));
    }
    Ok(())
}
