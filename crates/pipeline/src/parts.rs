//! The parts of a run made from an experiment: the step's settings, the
//! CPU build, the GPU options, and the learner `device.kind` asks for. The
//! stages themselves take only these typed settings.

use std::path::Path;
use std::sync::Arc;

use headroom_model::cuda::{CudaBuildOptions, DType};
use headroom_model::memory::MemoryPool;
use headroom_model::{BuildOptions, Device, LayerRegistry, Network};
use headroom_optim::{AdamWConfig, LossScalerConfig};

use crate::config::{ExperimentConfig, LossKind};
use crate::device::Precision;
use crate::learner::{
    open_network, CpuLearner, CudaOptions, DeviceKind, Learner, NetworkPlan, StepSettings,
    ValueLoss,
};
use crate::{checkpoint, PipelineError, Result};

impl StepSettings {
    pub fn from_config(config: &ExperimentConfig) -> Self {
        Self {
            label_smoothing: config.train.label_smoothing,
            clip_norm: config.train.clip_norm,
            focal_gamma: (config.train.loss == LossKind::Focal).then_some(config.train.focal_gamma),
            regression: match config.train.loss {
                LossKind::Mse => Some(ValueLoss::Mse),
                LossKind::Huber => Some(ValueLoss::Huber {
                    delta: config.train.huber_delta.unwrap_or(1.0),
                }),
                LossKind::Bce => Some(ValueLoss::Bce),
                LossKind::CrossEntropy | LossKind::Focal => None,
            },
            optimizer: AdamWConfig {
                beta1: config.optimizer.beta1,
                beta2: config.optimizer.beta2,
                eps: config.optimizer.eps,
                weight_decay: config.optimizer.weight_decay,
            },
        }
    }
}

/// How the CPU network is built for `config` (`device.fusion`).
pub fn cpu_build_options(config: &ExperimentConfig) -> BuildOptions {
    BuildOptions {
        fuse: config.device.fusion,
    }
}

/// How a fine-tuning base gets into a freshly built network (loaded and
/// frozen; `finetune::initialise`).
pub type Initialise = fn(&ExperimentConfig, &mut Network) -> Result<usize>;

/// `open` with the base put in by `initialise`.
pub fn open_with(
    config: &ExperimentConfig,
    pool: Arc<MemoryPool>,
    cuda: CudaOptions,
    initialise: Initialise,
    layers: &LayerRegistry,
) -> Result<Box<dyn Learner>> {
    let plan = NetworkPlan {
        spec: config.model.clone(),
        seed: config.run.seed,
        build: cpu_build_options(config),
        layers: layers.clone(),
        step: StepSettings::from_config(config),
        batch: config.train.batch_size,
        device: config.learner_device(),
        cuda,
    };
    open_network(&plan, pool, |network| initialise(config, network).map(drop))
}

/// The GPU settings of an experiment: f16 mixed precision with dynamic loss
/// scaling, bf16 with the loss scale held at 1 (its range is f32's), or
/// f32 activations and weights with the loss scale held at 1
/// (`device.precision`, or `device.amp = false`).
pub fn cuda_options(config: &ExperimentConfig) -> Result<CudaOptions> {
    let precision = config.device.precision()?;
    let (activations, loss_scaler) = match precision {
        Precision::F16 => (DType::F16, LossScalerConfig::default()),
        Precision::Bf16 => (DType::F16, LossScalerConfig::unit()),
        Precision::F32 => (DType::F32, LossScalerConfig::unit()),
    };
    Ok(CudaOptions {
        memory_limit: config.memory_limit()?,
        build: CudaBuildOptions {
            fuse: config.device.fusion,
            activations,
            recompute: config.device.recompute,
            conv: config.conv_plan()?,
        },
        loss_scaler,
        half: precision.half_format(),
        graphs: config.device.graphs,
        ..CudaOptions::default()
    })
}

/// A CPU learner for `config`'s model holding the state `saved` (read from
/// `path`, named in errors), evaluating `micro_batch` samples at a time;
/// the model's `custom` entries are made by `layers`.
pub fn restored_cpu_learner(
    config: &ExperimentConfig,
    saved: checkpoint::Checkpoint,
    path: &Path,
    micro_batch: usize,
    layers: &LayerRegistry,
) -> Result<CpuLearner> {
    // A full fine-tune's checkpoints hold the model without its adapters.
    let spec = crate::config::finetune::effective_model(config);
    let pool = MemoryPool::new(Device::Cpu);
    let network = pool.scope(|| {
        Network::build_with_layers(&spec, config.run.seed, cpu_build_options(config), layers)
    })?;
    let mut learner = CpuLearner::from_network(
        network,
        StepSettings::from_config(config),
        micro_batch,
        pool,
    )?;
    restore_state(&mut learner, saved, path)?;
    Ok(learner)
}

/// The learner `device` gives (`open_network` decides `Auto`) for
/// `config`'s model, holding the state `saved` (read from `path`, named in
/// errors), `micro_batch` samples at a time.
pub fn restored_learner(
    config: &ExperimentConfig,
    saved: checkpoint::Checkpoint,
    path: &Path,
    micro_batch: usize,
    device: DeviceKind,
    layers: &LayerRegistry,
) -> Result<Box<dyn Learner>> {
    let plan = NetworkPlan {
        spec: crate::config::finetune::effective_model(config),
        seed: config.run.seed,
        build: cpu_build_options(config),
        layers: layers.clone(),
        step: StepSettings::from_config(config),
        batch: micro_batch,
        device,
        cuda: cuda_options(config)?,
    };
    let mut learner = open_network(&plan, MemoryPool::new(Device::Cpu), |_| Ok(()))?;
    restore_state(learner.as_mut(), saved, path)?;
    Ok(learner)
}

/// Puts `saved`'s weights, buffers and optimizer state into `learner`; a
/// state that does not fit is an error naming `path`.
fn restore_state(
    learner: &mut dyn Learner,
    saved: checkpoint::Checkpoint,
    path: &Path,
) -> Result<()> {
    learner
        .restore(saved.into_parts().1)
        .map_err(|reason| PipelineError::Checkpoint {
            path: path.to_path_buf(),
            reason,
        })
}
