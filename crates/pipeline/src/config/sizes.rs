//! Sizes an experiment asks for, checked before anything is allocated:
//! thread counts, and a model whose weights alone would not fit in the
//! memory the process may use (its size walked from the spec, unbuilt).

use headroom_model::memory::bytes_text;
use headroom_model::{LayerSpec, ModelSpec};

use super::ExperimentConfig;
use crate::limits::tightest;
use crate::{PipelineError, Result};

/// Compute threads per core beyond which `train.threads` is a mistake.
const MAX_THREADS_PER_CORE: usize = 16;

/// Refuses sizes no run can survive, naming the key, before anything is
/// allocated or a thread started: thread counts far beyond the cores, a
/// padding wider than its kernel, a model whose weights alone would not fit
/// in the memory the process may use.
pub fn check_sizes(config: &ExperimentConfig) -> Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let most_threads = cores * MAX_THREADS_PER_CORE;
    for (key, value) in [
        ("train.threads", config.train.threads),
        ("data.workers", config.data.workers.unwrap_or(0)),
    ] {
        if value > most_threads {
            return Err(PipelineError::value(
                key,
                format!(
                    "{value} threads on a machine with {cores} cores; use at most {most_threads} (0 = every core)"
                ),
            ));
        }
    }
    let model = ModelSize::of(&config.model)?;
    // Weights, their gradients and two AdamW moments, then one sample's
    // activations kept for backward: what even a micro-batch of 1 needs.
    let needed = model.parameters.saturating_mul(16) + model.activation_bytes;
    // Against what the process really has, not device.memory_limit: a budget
    // too small for one sample is the OOM policy's case (checkpoint, stop,
    // resume with more), not a mistake in the experiment.
    let Some(ceiling) = tightest() else {
        return Ok(());
    };
    let (available, from) = (ceiling.room, ceiling.source);
    if needed > available {
        return Err(PipelineError::value(
            &model.largest_key,
            format!(
                "the model needs at least {} ({} parameters with gradients and AdamW moments, plus one sample's \
                 activations), more than the {} this process may use ({from}); the largest layer is {}",
                bytes_text(needed),
                model.parameters,
                bytes_text(available),
                model.largest_key
            ),
        ));
    }
    Ok(())
}

/// The number of outputs (classes) of the model a spec describes.
pub fn output_classes(spec: &ModelSpec) -> Result<usize> {
    let shape = ModelSize::of(spec)?.output;
    match shape[..] {
        [classes] if classes > 0 => Ok(classes as usize),
        _ => Err(PipelineError::value(
            "model.layers",
            format!("the model's output has shape {shape:?}; a classifier ends in a linear layer of `out` classes"),
        )),
    }
}

/// Parameter count and per-sample activation bytes of a model spec, walked
/// without building it.
struct ModelSize {
    parameters: u64,
    activation_bytes: u64,
    /// The key of the layer with the most parameters, to name it.
    largest_key: String,
    largest: u64,
    /// The per-sample output shape.
    output: Vec<u64>,
}

impl ModelSize {
    fn of(spec: &ModelSpec) -> Result<Self> {
        let mut size = Self {
            parameters: 0,
            activation_bytes: 0,
            largest_key: "model.layers".into(),
            largest: 0,
            output: Vec::new(),
        };
        let shape = spec.input.map(|d| d as u64).to_vec();
        size.output = size.walk(&spec.layers, "model.layers", shape)?;
        Ok(size)
    }

    fn walk(
        &mut self,
        layers: &[LayerSpec],
        prefix: &str,
        mut shape: Vec<u64>,
    ) -> Result<Vec<u64>> {
        for (i, layer) in layers.iter().enumerate() {
            let key = format!("{prefix}[{i}]");
            let (params, next) = self.layer(layer, &key, &shape)?;
            if params > self.largest {
                self.largest = params;
                self.largest_key = key;
            }
            self.parameters = self.parameters.saturating_add(params);
            let elements = next.iter().fold(1u64, |a, &d| a.saturating_mul(d));
            self.activation_bytes = self
                .activation_bytes
                .saturating_add(elements.saturating_mul(4));
            shape = next;
        }
        Ok(shape)
    }

    /// A layer's parameters and output shape; Err names a size that cannot be.
    fn layer(&mut self, layer: &LayerSpec, key: &str, shape: &[u64]) -> Result<(u64, Vec<u64>)> {
        let channels = shape.last().copied().unwrap_or(1);
        match layer {
            LayerSpec::Conv {
                out,
                kernel,
                stride,
                padding,
                bias,
            } => {
                let (out, kernel, stride) = (*out as u64, *kernel as u64, *stride as u64);
                let padding = padding.map_or(kernel / 2, |p| p as u64);
                if padding > kernel {
                    return Err(PipelineError::value(
                        &format!("{key}.padding"),
                        format!("{padding} is wider than the kernel ({kernel}): the output would be mostly zeros"),
                    ));
                }
                let [h, w] = match shape {
                    [h, w, _] => [*h, *w],
                    _ => return Ok((0, shape.to_vec())), // the model crate names this one
                };
                let side = |d: u64| {
                    (d + 2 * padding)
                        .checked_sub(kernel)
                        .map(|r| r / stride.max(1) + 1)
                };
                let next = match (side(h), side(w)) {
                    (Some(oh), Some(ow)) => vec![oh, ow, out],
                    _ => return Ok((0, shape.to_vec())),
                };
                let weights = kernel
                    .saturating_mul(kernel)
                    .saturating_mul(channels)
                    .saturating_mul(out);
                Ok((weights.saturating_add(if *bias { out } else { 0 }), next))
            }
            LayerSpec::DepthwiseConv {
                kernel,
                stride,
                padding,
                bias,
                multiplier,
            } => {
                let (kernel, stride) = (*kernel as u64, *stride as u64);
                let padding = padding.map_or(kernel / 2, |p| p as u64);
                let out = channels.saturating_mul(*multiplier as u64);
                let side = |d: u64| {
                    (d + 2 * padding)
                        .checked_sub(kernel)
                        .map(|r| r / stride.max(1) + 1)
                };
                let next = match shape {
                    [h, w, _] => match (side(*h), side(*w)) {
                        (Some(oh), Some(ow)) => vec![oh, ow, out],
                        _ => return Ok((0, shape.to_vec())), // the model crate names this one
                    },
                    _ => return Ok((0, shape.to_vec())),
                };
                let weights = kernel.saturating_mul(kernel).saturating_mul(out);
                Ok((weights.saturating_add(if *bias { out } else { 0 }), next))
            }
            LayerSpec::BatchNorm { .. } => Ok((2 * channels, shape.to_vec())),
            LayerSpec::Relu => Ok((0, shape.to_vec())),
            LayerSpec::Residual { layers } => {
                let before = self.parameters;
                let next = self.walk(layers, &format!("{key}.layers"), shape.to_vec())?;
                let inner = self.parameters - before;
                self.parameters = before;
                Ok((inner, next))
            }
            LayerSpec::BasicBlock => {
                Ok((2 * 9 * channels * channels + 4 * channels, shape.to_vec()))
            }
            LayerSpec::GlobalAvgPool => Ok((0, vec![channels])),
            LayerSpec::MaxPool { kernel, stride } => {
                let (kernel, stride) = (*kernel as u64, stride.unwrap_or(*kernel) as u64);
                let side = |d: u64| d.checked_sub(kernel).map(|r| r / stride.max(1) + 1);
                match shape {
                    [h, w, c] => match (side(*h), side(*w)) {
                        (Some(oh), Some(ow)) => Ok((0, vec![oh, ow, *c])),
                        _ => Ok((0, shape.to_vec())), // the model crate names this one
                    },
                    _ => Ok((0, shape.to_vec())),
                }
            }
            LayerSpec::Linear { out, bias } => {
                let features = shape.iter().fold(1u64, |a, &d| a.saturating_mul(d));
                let out = *out as u64;
                let weights = features.saturating_mul(out);
                Ok((
                    weights.saturating_add(if *bias { out } else { 0 }),
                    vec![out],
                ))
            }
            // The sequence and adapter layers: the model crate checks their
            // sizes as it builds them (fallibly); the estimate carries the
            // shape through unchanged.
            _ => Ok((0, shape.to_vec())),
        }
    }
}
