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

/// The most bytes `text.sample_bytes` may ask for: each is a forward pass
/// after training, so the work after the run stays bounded.
pub const MAX_SAMPLE_BYTES: usize = 1 << 20;

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
    if let Some(text) = &config.text {
        if text.sample_bytes > MAX_SAMPLE_BYTES {
            return Err(PipelineError::value(
                "text.sample_bytes",
                format!(
                    "{} bytes to generate after training, one forward pass each; use at most {MAX_SAMPLE_BYTES}",
                    text.sample_bytes
                ),
            ));
        }
    }
    let model = ModelSize::of(&config.model)?;
    let sequence = SequenceSize::of(config);
    // Weights, their gradients and two AdamW moments, then one sample's
    // activations kept for backward: what even a micro-batch of 1 needs.
    // A sequence model's input and scores per sample (the sequence layers
    // are not walked) count too.
    let needed = model
        .parameters
        .saturating_mul(16)
        .saturating_add(model.activation_bytes)
        .saturating_add(sequence.bytes);
    // Against what the process really has, not device.memory_limit: a budget
    // too small for one sample is the OOM policy's case (checkpoint, stop,
    // resume with more), not a mistake in the experiment.
    let Some(ceiling) = tightest() else {
        return Ok(());
    };
    let (available, from) = (ceiling.room, ceiling.source);
    sequence.check(available, &from)?;
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

/// What one sample of a token or frame model takes beside the layers'
/// activations: its input, its per-position scores and their gradient, the
/// loader's copy of it.
struct SequenceSize {
    bytes: u64,
    key: &'static str,
    what: String,
}

impl SequenceSize {
    /// A sequence model whose one sample alone does not fit: its sizes
    /// (length, vocabulary, frames) are the mistake, named as such.
    fn check(&self, available: u64, from: &str) -> Result<()> {
        if self.bytes <= available {
            return Ok(());
        }
        Err(PipelineError::value(
            self.key,
            format!(
                "one sample needs {} ({}), more than the {} this process may use ({from})",
                bytes_text(self.bytes),
                self.what,
                bytes_text(available)
            ),
        ))
    }

    fn of(config: &ExperimentConfig) -> Self {
        let spec = &config.model;
        let as_u64 = |n: usize| n as u64;
        if let Some(tokens) = spec.tokens {
            let (length, vocab) = (as_u64(tokens.length), as_u64(tokens.vocab));
            // Ids as f32, the window's bytes, scores and their gradient.
            let bytes = length
                .saturating_mul(5)
                .saturating_add(length.saturating_mul(vocab).saturating_mul(8));
            return Self {
                bytes,
                key: "model.tokens",
                what: format!(
                    "model.tokens.length {length} × vocab {vocab}: the scores of every position and their gradient"
                ),
            };
        }
        if let Some(frames) = spec.frames {
            let frame = spec
                .input
                .iter()
                .fold(1u64, |a, &d| a.saturating_mul(as_u64(d)));
            // The loader's bytes of frames + 1 images, the input and the
            // prediction as f32, and each garment's path.
            let steps = as_u64(frames).saturating_add(1);
            let garments = config.frames.as_ref().map_or(0, |f| as_u64(f.garments));
            let bytes = steps
                .saturating_mul(frame)
                .saturating_mul(9)
                .saturating_add(garments.saturating_mul(steps).saturating_mul(16));
            return Self {
                bytes,
                key: "model.frames",
                what: format!(
                    "model.frames {frames} of {:?} each, input and prediction, and frames.garments {garments}",
                    spec.input
                ),
            };
        }
        Self {
            bytes: 0,
            key: "model.layers",
            what: String::new(),
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn experiment(name: &str, sets: &[&str]) -> Result<ExperimentConfig> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../experiments")
            .join(name);
        let sets: Vec<String> = sets.iter().map(|s| (*s).to_string()).collect();
        let overrides = crate::Overrides::parse(&sets)?;
        ExperimentConfig::load(&path, &overrides)
    }

    #[test]
    fn a_sample_too_long_to_generate_is_refused_naming_the_key() {
        let err = experiment(
            "char_lm.toml",
            &[&format!("text.sample_bytes={}", MAX_SAMPLE_BYTES + 1)],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("text.sample_bytes"), "{err}");
        assert!(err.contains(&MAX_SAMPLE_BYTES.to_string()), "{err}");
        experiment(
            "char_lm.toml",
            &[&format!("text.sample_bytes={MAX_SAMPLE_BYTES}")],
        )
        .unwrap();
    }

    #[test]
    fn a_token_sample_larger_than_memory_is_refused_naming_its_sizes() {
        let config = experiment("char_lm.toml", &[]).unwrap();
        let mut huge = config.clone();
        if let Some(tokens) = huge.model.tokens.as_mut() {
            tokens.length = 1 << 30;
        }
        let size = SequenceSize::of(&huge);
        let err = size.check(1 << 34, "RLIMIT_AS").unwrap_err().to_string();
        assert!(err.contains("model.tokens"), "{err}");
        assert!(err.contains("length 1073741824 × vocab 256"), "{err}");
        assert!(err.contains("RLIMIT_AS"), "{err}");
        // The experiment as written: 64 positions of 256 scores.
        SequenceSize::of(&config)
            .check(1 << 20, "RLIMIT_AS")
            .unwrap();
    }

    #[test]
    fn a_frame_sample_counts_every_frame_and_garment() {
        let mut config = experiment("conv_lstm.toml", &[]).unwrap();
        let base = SequenceSize::of(&config).bytes;
        assert!(base > 0);
        config.model.frames = config.model.frames.map(|f| f * 1000);
        let err = SequenceSize::of(&config)
            .check(base * 10, "cgroup v2")
            .unwrap_err()
            .to_string();
        assert!(err.contains("model.frames"), "{err}");
    }
}
