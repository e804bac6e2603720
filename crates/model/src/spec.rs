//! The model as data: `[model]` of an experiment (`ModelSpec`), its layer
//! entries (`LayerSpec`, tagged by `type`), token input and the
//! checkpointing policy. What the CPU and GPU network builders read and
//! checkpoints record; building lives in `network` and `cuda::network`.

use serde::{Deserialize, Serialize};

use crate::custom::LayerRegistry;
use crate::layers::LoraConfig;
use crate::{ModelError, Result};

/// `model.checkpoint`: which activations a training step recomputes in
/// backward instead of keeping from the forward.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum CheckpointPolicy {
    /// Keep every activation backward needs (fastest).
    #[default]
    None,
    /// Each residual block (a top-level `residual`, or a `basic_block`: its
    /// residual and the ReLU after it) keeps only its input and recomputes
    /// the rest in backward: about one more forward of the blocks per step.
    /// A `conv_lstm` recomputes per time step: it keeps each step's cell
    /// state only and reruns the step's gates in backward.
    Blocks,
    /// Every layer is in a checkpointed segment (and `conv_lstm` as in `blocks`): the blocks as in `blocks`,
    /// and each run of L consecutive other top-level entries in ⌊√L⌋ segments
    /// of near-equal length. Least memory, one more forward per step.
    All,
}

impl CheckpointPolicy {
    pub fn is_none(&self) -> bool {
        *self == CheckpointPolicy::None
    }
}

/// `[model]` in an experiment file.
///
/// The input is either u8 pixels (`input`, `mean`, `std`: required) or token
/// ids (`tokens`, and then none of the three).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Per-sample input shape, NHWC without N: [height, width, channels].
    #[serde(default)]
    pub input: [usize; 3],
    /// Input normalisation applied to u8 pixels: (x/255 - mean) / std.
    #[serde(default)]
    pub mean: f32,
    #[serde(default)]
    pub std: f32,
    /// Token input: each sample is `length` ids below `vocab`, fed as a
    /// [N, length] tensor (`Network::input_from_tokens`). Absent for pixels,
    /// and then left out of the serialised spec (fingerprints unchanged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<TokenInput>,
    /// Frame input: each sample is a sequence of `frames` images of shape
    /// `input`, fed as [N, frames, h, w, c]; the network predicts the next
    /// frame at every step and ends in [frames, h, w, c]. Absent for
    /// images, and then left out of the serialised spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frames: Option<usize>,
    pub layers: Vec<LayerSpec>,
    /// Activation checkpointing; absent means `none`. Left out of the
    /// serialised spec when `none`, so specs written before it existed
    /// serialise (and fingerprint) the same.
    #[serde(default, skip_serializing_if = "CheckpointPolicy::is_none")]
    pub checkpoint: CheckpointPolicy,
}

/// `model.tokens`.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TokenInput {
    /// Ids per sample (the sequence length T).
    pub length: usize,
    /// Ids are in 0..vocab.
    pub vocab: usize,
}

/// Ids travel as f32 values, exact up to 2^24.
pub(crate) const MAX_VOCAB: usize = 1 << 24;

impl TokenInput {
    /// A batch's ids as the f32 values the embedding reads (CPU and GPU
    /// alike); an id outside the vocabulary is an error naming it.
    pub fn id_values(&self, ids: &[u32]) -> Result<Vec<f32>> {
        if let Some(at) = ids.iter().position(|&id| id as usize >= self.vocab) {
            return Err(ModelError::Shape {
                op: "network input",
                expected: format!("token ids in 0..{} (model.tokens.vocab)", self.vocab),
                got: format!("{} at index {at}", ids[at]),
            });
        }
        let mut values = Vec::new();
        values
            .try_reserve_exact(ids.len())
            .map_err(|_| ModelError::State("token batch too large".into()))?;
        values.extend(ids.iter().map(|&id| id as f32));
        Ok(values)
    }
}

fn default_kernel() -> usize {
    3
}
fn default_stride() -> usize {
    1
}
fn default_multiplier() -> usize {
    1
}
fn default_true() -> bool {
    true
}
pub(crate) fn default_momentum() -> f32 {
    0.1
}
pub(crate) fn default_eps() -> f32 {
    1e-5
}

/// One entry of `model.layers`, tagged by `type`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum LayerSpec {
    /// Convolution; `padding` defaults to kernel/2 ("same" at stride 1).
    Conv {
        out: usize,
        #[serde(default = "default_kernel")]
        kernel: usize,
        #[serde(default = "default_stride")]
        stride: usize,
        #[serde(default)]
        padding: Option<usize>,
        #[serde(default)]
        bias: bool,
    },
    /// Depthwise convolution: `multiplier` `kernel`×`kernel` filters per
    /// input channel, channels never mixed (output channel c·multiplier + m
    /// from input channel c); `padding` defaults to kernel/2.
    DepthwiseConv {
        #[serde(default = "default_kernel")]
        kernel: usize,
        #[serde(default = "default_stride")]
        stride: usize,
        #[serde(default)]
        padding: Option<usize>,
        #[serde(default)]
        bias: bool,
        #[serde(default = "default_multiplier")]
        multiplier: usize,
    },
    BatchNorm {
        #[serde(default = "default_momentum")]
        momentum: f32,
        #[serde(default = "default_eps")]
        eps: f32,
    },
    Relu,
    /// `layers(x) + x`; the body must keep the shape.
    Residual {
        layers: Vec<LayerSpec>,
    },
    /// The reference ResNet block: conv3x3+BN+ReLU, conv3x3+BN, add the
    /// block's input, ReLU. Its width is its input's.
    BasicBlock,
    GlobalAvgPool,
    /// Max pooling of an image over `kernel`×`kernel` windows every
    /// `stride` pixels (default: `kernel`), no padding, the output side
    /// ⌊(side − kernel)/stride⌋ + 1; ties go to the first in row-major
    /// window order.
    MaxPool {
        kernel: usize,
        #[serde(default)]
        stride: Option<usize>,
    },
    /// Over a feature vector `[c]`, or at every position of a sequence `[t, c]`.
    Linear {
        out: usize,
        #[serde(default = "default_true")]
        bias: bool,
    },
    /// [h, w, c] -> [h·w·c].
    Flatten,
    /// x·σ(x).
    Silu,
    /// GELU, tanh approximation.
    Gelu,
    /// Normalisation over the last axis, with a learned scale and shift.
    LayerNorm {
        #[serde(default = "default_eps")]
        eps: f32,
    },
    /// Token ids `[t]` -> `[t, dim]`; needs `model.tokens` (its vocabulary).
    /// `positions` adds a learned position embedding of t rows.
    Embedding {
        dim: usize,
        #[serde(default)]
        positions: bool,
    },
    /// Zeroes each element with probability `p` in training (counter-based
    /// randomness: resumes draw the same masks); the identity in evaluation.
    Dropout {
        p: f32,
    },
    /// Multi-head causal self-attention over [t, c]; `heads` must divide c.
    /// `lean` recomputes each head's T×T probabilities in backward instead
    /// of keeping them. `lora` freezes both projections and adapts them.
    CausalSelfAttention {
        heads: usize,
        #[serde(default)]
        lean: bool,
        #[serde(default)]
        lora: Option<LoraConfig>,
    },
    /// A linear layer with its weight frozen and a trainable LoRA update.
    LoraLinear {
        out: usize,
        #[serde(default = "default_true")]
        bias: bool,
        lora: LoraConfig,
    },
    /// A pre-norm GPT block, checkpointed as one block: x + attn(ln(x)),
    /// then x + mlp(ln(x)) with mlp = linear c->mlp_ratio·c, gelu, linear
    /// back; `dropout` after the attention and after the MLP when positive.
    TransformerBlock {
        heads: usize,
        #[serde(default = "default_mlp_ratio")]
        mlp_ratio: usize,
        #[serde(default)]
        dropout: f32,
        #[serde(default)]
        lean: bool,
        #[serde(default)]
        lora: Option<LoraConfig>,
    },
    /// One LSTM layer over [t, c] -> all hidden states [t, hidden].
    Lstm {
        hidden: usize,
    },
    /// Nearest-neighbour upsampling of an image by 2.
    Upsample2x,
    /// UNet skip: concatenates its input with its body's output along
    /// channels; the body must give back the input's height and width.
    UnetSkip {
        layers: Vec<LayerSpec>,
    },
    /// A convolutional LSTM over frames [t, h, w, c] -> hidden states
    /// [t, h, w, hidden]; the gates are one `kernel`×`kernel` convolution.
    ConvLstm {
        hidden: usize,
        #[serde(default = "default_kernel")]
        kernel: usize,
    },
    /// A layer of your own, made by the factory registered as `name` (see
    /// `custom::LayerRegistry`); on the GPU only if its layer brings a
    /// CUDA form (`Layer::to_cuda`).
    Custom {
        name: String,
        #[serde(default)]
        options: std::collections::BTreeMap<String, f64>,
    },
}

fn default_mlp_ratio() -> usize {
    4
}

impl ModelSpec {
    /// Whether training normalises with each batch's own statistics (batch
    /// norm, in a layer of its own or inside a basic block; a custom layer
    /// may too, so it counts): then a batch split into micro-batches gives
    /// another update, not only another memory peak.
    pub fn uses_batch_statistics(&self) -> bool {
        fn walk(layers: &[LayerSpec]) -> bool {
            layers.iter().any(|layer| match layer {
                LayerSpec::BatchNorm { .. } | LayerSpec::BasicBlock | LayerSpec::Custom { .. } => {
                    true
                }
                LayerSpec::Residual { layers } | LayerSpec::UnetSkip { layers } => walk(layers),
                _ => false,
            })
        }
        walk(&self.layers)
    }

    /// The first `custom` layer, by path and name: the pipeline trains such
    /// a model on the CPU only (from the spec alone it cannot tell whether
    /// the layer brings a CUDA form; `CudaNetwork::from_cpu` can).
    pub fn first_cpu_only_layer(&self) -> Option<(String, String)> {
        self.first_cpu_only_layer_given(&LayerRegistry::default())
    }

    /// `first_cpu_only_layer`, a custom layer that `layers` says brings a
    /// CUDA form (`LayerRegistry::register_with_cuda`) not counted.
    pub fn first_cpu_only_layer_given(&self, layers: &LayerRegistry) -> Option<(String, String)> {
        fn walk(
            layers: &[LayerSpec],
            path: &str,
            registry: &LayerRegistry,
        ) -> Option<(String, String)> {
            layers.iter().enumerate().find_map(|(i, layer)| {
                let here = format!("{path}[{i}]");
                match layer {
                    LayerSpec::Custom { name, .. } if !registry.brings_cuda(name) => {
                        Some((here, name.clone()))
                    }
                    LayerSpec::Residual { layers } | LayerSpec::UnetSkip { layers } => {
                        walk(layers, &format!("{here}.layers"), registry)
                    }
                    _ => None,
                }
            })
        }
        walk(&self.layers, "model.layers", layers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(layers: Vec<LayerSpec>) -> ModelSpec {
        ModelSpec {
            input: [4, 4, 1],
            mean: 0.0,
            std: 1.0,
            layers,
            checkpoint: Default::default(),
            tokens: None,
            frames: None,
        }
    }

    #[test]
    fn batch_statistics_are_found_wherever_batch_norm_is() {
        let linear = LayerSpec::Linear { out: 2, bias: true };
        assert!(!spec(vec![LayerSpec::Flatten, linear.clone()]).uses_batch_statistics());
        assert!(spec(vec![LayerSpec::BasicBlock, linear.clone()]).uses_batch_statistics());
        let nested = LayerSpec::Residual {
            layers: vec![LayerSpec::BatchNorm {
                momentum: 0.1,
                eps: 1e-5,
            }],
        };
        assert!(spec(vec![nested, linear]).uses_batch_statistics());
    }

    #[test]
    fn a_custom_layer_registered_with_cuda_is_not_cpu_only() {
        let custom = |name: &str| LayerSpec::Custom {
            name: name.into(),
            options: Default::default(),
        };
        let nested = LayerSpec::Residual {
            layers: vec![custom("gpu_too"), custom("cpu_only")],
        };
        let model = spec(vec![LayerSpec::Flatten, nested]);
        let none = LayerRegistry::new();
        assert_eq!(
            model.first_cpu_only_layer_given(&none),
            Some(("model.layers[1].layers[0]".into(), "gpu_too".into()))
        );
        let factory = |_: &mut crate::CustomLayerArgs<'_>| -> Result<Box<dyn crate::Layer>> {
            Err(ModelError::Spec {
                path: String::new(),
                reason: "not built here".into(),
            })
        };
        let registry = LayerRegistry::new()
            .register_with_cuda("gpu_too", factory)
            .register("cpu_only", factory);
        assert!(registry.brings_cuda("gpu_too") && !registry.brings_cuda("cpu_only"));
        assert_eq!(
            model.first_cpu_only_layer_given(&registry),
            Some(("model.layers[1].layers[1]".into(), "cpu_only".into()))
        );
        // Registered again without CUDA: CPU-only again.
        let registry = registry.register("gpu_too", factory);
        assert!(!registry.brings_cuda("gpu_too"));
    }
}
