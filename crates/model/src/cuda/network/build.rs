//! Building the GPU layers from a `ModelSpec`: the parameter cursor's
//! order, the groups, fusing, and each layer spec's GPU layers.

use crate::cuda::backend::CudaBackend;
use crate::cuda::containers::{CheckpointedLayer, ResidualLayer};
use crate::cuda::layer::{BatchNormLayer, DropoutLayer, RunningStats};
use crate::cuda::ops::{self, ConvPlan, ConvShape};
use crate::cuda::{CudaError, CudaResult};
use crate::layers::LoraConfig;
use crate::network::{is_block, Group};
use crate::ops::activation::layer::{DropoutGpu, ReluLayer, SmoothLayer};
use crate::ops::batch_norm::layer::BatchNormGpu;
use crate::ops::conv::layer::{ConvLayer, DepthwiseConvLayer};
use crate::ops::frames::layer::ConvLstmLayer;
use crate::ops::layer_norm::layer::LayerNormLayer;
use crate::ops::linear::layer::LinearLayer;
use crate::ops::pool::layer::{
    FlattenLayer, GlobalAvgPoolLayer, MaxPoolLayer, UnetSkipLayer, Upsample2xLayer,
};
use crate::ops::sequence::layer::{AttentionLayer, EmbeddingLayer, LoraLayer, LstmLayer};
use crate::LayerSpec;

use super::*;

pub(super) fn channels(path: &str, shape: &[usize]) -> CudaResult<usize> {
    match shape {
        [_, _, c] => Ok(*c),
        _ => Err(CudaError::shape(
            "CudaNetwork::build",
            format!("{path}: an image input [h, w, c]"),
            format!("{shape:?}"),
        )),
    }
}

/// One group per spec entry, in order (unfused).
pub(super) fn build_groups(
    be: &CudaBackend,
    specs: &[LayerSpec],
    path: &str,
    shape: &mut Vec<usize>,
    cursor: &mut ParamCursor<'_>,
) -> CudaResult<Vec<Group<Box<dyn CudaLayer>>>> {
    let mut groups = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        let layers = build_one(be, spec, &format!("{path}[{i}]"), shape, cursor)?;
        groups.push(Group {
            block: is_block(spec),
            layers,
        });
    }
    Ok(groups)
}

/// A checkpointed segment of the GPU network (`arrange`'s wrapper).
pub(super) fn checkpointed(layers: Vec<Box<dyn CudaLayer>>) -> Box<dyn CudaLayer> {
    Box::new(CheckpointedLayer(layers))
}

pub(super) fn build_one(
    be: &CudaBackend,
    spec: &LayerSpec,
    path: &str,
    shape: &mut Vec<usize>,
    cursor: &mut ParamCursor<'_>,
) -> CudaResult<Vec<Box<dyn CudaLayer>>> {
    Ok(match spec {
        LayerSpec::Custom { name, .. } => {
            let refuse = || CudaError::Unsupported {
                op: "CudaNetwork::build",
                reason: format!(
                    "{path}: the custom layer \"{name}\" has no CUDA implementation; \
                     train it with device.kind = \"cpu\""
                ),
            };
            let Some(layer) = cursor.network.custom_layer(path) else {
                return Err(refuse());
            };
            let mut ctx = CudaBuildContext {
                be,
                cursor,
                path,
                shape,
            };
            let Some(built) = layer.to_cuda(&mut ctx) else {
                return Err(refuse());
            };
            let built = built?;
            *shape = layer
                .output_shape(shape)
                .map_err(|e| build_error(format!("{path}: its output shape"), e.to_string()))?;
            vec![built]
        }
        LayerSpec::Conv {
            out,
            kernel,
            stride,
            padding,
            bias,
        } => {
            let cin = channels(path, shape)?;
            let pad = padding.unwrap_or(kernel / 2);
            let weight = cursor.take_trainable(path, kernel * kernel * cin * out)?;
            let bias = bias
                .then(|| cursor.take_trainable(path, *out))
                .transpose()?;
            let probe = ConvShape {
                n: 1,
                h: shape[0],
                w: shape[1],
                cin,
                cout: *out,
                k: *kernel,
                stride: *stride,
                pad,
            };
            let (oh, ow) = probe.out_hw()?;
            *shape = vec![oh, ow, *out];
            vec![Box::new(ConvLayer {
                weight,
                bias,
                kernel: *kernel,
                stride: *stride,
                pad,
                cout: *out,
                plan: ConvPlan::default(),
            })]
        }
        LayerSpec::DepthwiseConv {
            kernel,
            stride,
            padding,
            bias,
            multiplier,
        } => {
            let c = channels(path, shape)?;
            let cout = c * multiplier;
            let weight = cursor.take_trainable(path, kernel * kernel * cout)?;
            let bias = bias
                .then(|| cursor.take_trainable(path, cout))
                .transpose()?;
            let dw = ops::DepthwiseShape {
                kernel: *kernel,
                stride: *stride,
                pad: padding.unwrap_or(kernel / 2),
                multiplier: *multiplier,
            };
            let side = |d: usize| {
                let span = (d + 2 * dw.pad).checked_sub(*kernel)?;
                (d > 0 && *stride > 0).then(|| span / stride + 1)
            };
            let (Some(oh), Some(ow)) = (side(shape[0]), side(shape[1])) else {
                return Err(CudaError::shape(
                    "CudaNetwork::build",
                    format!("{path}: an image that fits the depthwise_conv kernel"),
                    format!("{shape:?}"),
                ));
            };
            *shape = vec![oh, ow, cout];
            vec![Box::new(DepthwiseConvLayer {
                weight,
                bias,
                shape: dw,
            })]
        }
        LayerSpec::BatchNorm { momentum, eps } => {
            let c = channels(path, shape)?;
            let gamma = cursor.take_trainable(path, c)?;
            let beta = cursor.take_trainable(path, c)?;
            vec![Box::new(BatchNormGpu {
                bn: BatchNormLayer {
                    gamma,
                    beta,
                    running: Box::new(RunningStats {
                        mean: be.alloc_zeros(c)?,
                        var: be.alloc_zeros(c)?,
                        saved_mean: be.alloc_zeros(c)?,
                        saved_var: be.alloc_zeros(c)?,
                    }),
                    momentum: *momentum,
                    eps: *eps,
                },
                relu: false,
            })]
        }
        LayerSpec::Relu => vec![Box::new(ReluLayer)],
        LayerSpec::GlobalAvgPool => {
            let c = channels(path, shape)?;
            *shape = vec![c];
            vec![Box::new(GlobalAvgPoolLayer)]
        }
        LayerSpec::MaxPool { kernel, stride } => {
            let c = channels(path, shape)?;
            let stride = stride.unwrap_or(*kernel);
            let side = |d: usize| {
                (*kernel > 0 && stride > 0)
                    .then(|| d.checked_sub(*kernel).map(|r| r / stride + 1))
                    .flatten()
            };
            let (Some(oh), Some(ow)) = (side(shape[0]), side(shape[1])) else {
                return Err(CudaError::shape(
                    "CudaNetwork::build",
                    format!("{path}: an image that fits the {kernel}x{kernel} max_pool kernel"),
                    format!("{shape:?}"),
                ));
            };
            *shape = vec![oh, ow, c];
            vec![Box::new(MaxPoolLayer {
                kernel: *kernel,
                stride,
            })]
        }
        LayerSpec::Linear { out, bias } => {
            let features = features(path, shape)?;
            let layer = linear_layer(path, features, *out, *bias, cursor)?;
            set_features(shape, *out);
            vec![layer]
        }
        LayerSpec::LoraLinear { out, bias, lora } => {
            let features = features(path, shape)?;
            let layer = lora_layer(path, features, *out, *bias, lora, cursor)?;
            set_features(shape, *out);
            vec![layer]
        }
        LayerSpec::Embedding { dim, positions } => {
            vec![embedding_layer(path, shape, *dim, *positions, cursor)?]
        }
        LayerSpec::CausalSelfAttention { heads, lora, .. } => {
            vec![attention_layer(path, shape, *heads, lora.as_ref(), cursor)?]
        }
        LayerSpec::ConvLstm { hidden, kernel } => {
            let (Some(frames), &[h, w, channels]) = (cursor.frames, shape.as_slice()) else {
                return Err(build_error(
                    format!("{path}: frames of [h, w, c] images (model.frames)"),
                    format!("{shape:?}"),
                ));
            };
            let weight =
                cursor.take_trainable(path, kernel * kernel * (channels + hidden) * 4 * hidden)?;
            let bias = cursor.take_trainable(path, 4 * hidden)?;
            *shape = vec![h, w, *hidden];
            vec![Box::new(ConvLstmLayer {
                weight,
                bias,
                shape: ops::ConvLstmShape {
                    frames,
                    h,
                    w,
                    channels,
                    hidden: *hidden,
                    kernel: *kernel,
                },
                plan: ConvPlan::default(),
                step_recompute: cursor.step_recompute,
            })]
        }
        LayerSpec::Lstm { hidden } => {
            let [length, features] = shape[..] else {
                return Err(build_error(
                    format!("{path}: a sequence [t, c]"),
                    format!("{shape:?}"),
                ));
            };
            let wx = cursor.take_trainable(path, features * 4 * hidden)?;
            let wh = cursor.take_trainable(path, hidden * 4 * hidden)?;
            let bias = cursor.take_trainable(path, 4 * hidden)?;
            *shape = vec![length, *hidden];
            vec![Box::new(LstmLayer {
                wx,
                wh,
                bias,
                length,
            })]
        }
        LayerSpec::TransformerBlock {
            heads,
            mlp_ratio,
            dropout,
            lora,
            ..
        } => transformer_block(
            be,
            path,
            shape,
            *heads,
            *mlp_ratio,
            *dropout,
            lora.as_ref(),
            cursor,
        )?,
        LayerSpec::Flatten => {
            *shape = vec![shape.iter().product()];
            vec![Box::new(FlattenLayer)]
        }
        LayerSpec::LayerNorm { eps } => {
            let Some(&features) = shape.last() else {
                return Err(CudaError::shape(
                    "CudaNetwork::build",
                    format!("{path}: a non-scalar input"),
                    format!("{shape:?}"),
                ));
            };
            vec![layer_norm_layer(path, features, *eps, cursor)?]
        }
        LayerSpec::Dropout { p } => vec![dropout_layer(be, path, *p, cursor)?],
        LayerSpec::Upsample2x => {
            let c = channels(path, shape)?;
            *shape = vec![2 * shape[0], 2 * shape[1], c];
            vec![Box::new(Upsample2xLayer)]
        }
        LayerSpec::UnetSkip { layers } => {
            let c = channels(path, shape)?;
            let mut inner = shape.clone();
            let groups = build_groups(be, layers, &format!("{path}.layers"), &mut inner, cursor)?;
            let body = groups.into_iter().flat_map(|g| g.layers).collect();
            let body_c = channels(path, &inner)?;
            if inner[..2] != shape[..2] {
                return Err(CudaError::shape(
                    "CudaNetwork::build",
                    format!(
                        "{path}: a body output of {:?} and any channels",
                        &shape[..2]
                    ),
                    format!("{inner:?}"),
                ));
            }
            *shape = vec![shape[0], shape[1], c + body_c];
            vec![Box::new(UnetSkipLayer { body, channels: c })]
        }
        LayerSpec::Silu => vec![Box::new(SmoothLayer(ops::Smooth::Silu))],
        LayerSpec::Gelu => vec![Box::new(SmoothLayer(ops::Smooth::Gelu))],
        LayerSpec::Residual { layers } => {
            let mut inner = shape.clone();
            let groups = build_groups(be, layers, &format!("{path}.layers"), &mut inner, cursor)?;
            let body = groups.into_iter().flat_map(|g| g.layers).collect();
            vec![Box::new(ResidualLayer(body))]
        }
        LayerSpec::BasicBlock => {
            let body = crate::network::basic_block_body(channels(path, shape)?);
            let mut built = build_one(
                be,
                &LayerSpec::Residual { layers: body },
                path,
                shape,
                cursor,
            )?;
            built.push(Box::new(ReluLayer));
            built
        }
    })
}

pub(super) fn build_error(what: String, got: String) -> CudaError {
    CudaError::shape("CudaNetwork::build", what, got)
}

/// The features of a vector [c] or of each position of a sequence [t, c].
pub(super) fn features(path: &str, shape: &[usize]) -> CudaResult<usize> {
    match *shape {
        [c] | [_, c] => Ok(c),
        _ => Err(build_error(
            format!("{path}: a feature vector [c] or a sequence [t, c]"),
            format!("{shape:?}"),
        )),
    }
}

pub(super) fn set_features(shape: &mut [usize], out: usize) {
    if let Some(last) = shape.last_mut() {
        *last = out;
    }
}

/// A parameter pair a layer trains together or not at all (a weight and
/// its bias, γ and β): fine-tuning freezes both or neither.
pub(super) fn same_freezing(path: &str, a: &ParamRef, b: Option<&ParamRef>) -> CudaResult<()> {
    match b {
        Some(b) if b.trainable() != a.trainable() => Err(CudaError::Unsupported {
            op: "CudaNetwork::build",
            reason: format!("{path}: one of its parameters frozen and the other not"),
        }),
        _ => Ok(()),
    }
}

pub(super) fn linear_layer(
    path: &str,
    features: usize,
    out: usize,
    bias: bool,
    cursor: &mut ParamCursor<'_>,
) -> CudaResult<Box<dyn CudaLayer>> {
    let weight = cursor.take(path, features * out)?;
    let bias = bias.then(|| cursor.take(path, out)).transpose()?;
    same_freezing(path, &weight, bias.as_ref())?;
    Ok(Box::new(LinearLayer { weight, bias, out }))
}

pub(super) fn lora_layer(
    path: &str,
    features: usize,
    out: usize,
    bias: bool,
    lora: &LoraConfig,
    cursor: &mut ParamCursor<'_>,
) -> CudaResult<Box<dyn CudaLayer>> {
    let scale = lora
        .validate(&format!("{path}.lora"), features, out)
        .map_err(|e| CudaError::Unsupported {
            op: "CudaNetwork::build",
            reason: e.to_string(),
        })?;
    let weight = cursor.take(path, features * out)?;
    let bias = bias.then(|| cursor.take(path, out)).transpose()?;
    let a = cursor.take_trainable(path, lora.r * features)?;
    let b = cursor.take_trainable(path, out * lora.r)?;
    Ok(Box::new(LoraLayer {
        weight,
        bias,
        a,
        b,
        rank: lora.r,
        scale,
        out,
    }))
}

pub(super) fn layer_norm_layer(
    path: &str,
    features: usize,
    eps: f32,
    cursor: &mut ParamCursor<'_>,
) -> CudaResult<Box<dyn CudaLayer>> {
    let gamma = cursor.take(path, features)?;
    let beta = cursor.take(path, features)?;
    same_freezing(path, &gamma, Some(&beta))?;
    Ok(Box::new(LayerNormLayer { gamma, beta, eps }))
}

pub(super) fn dropout_layer(
    be: &CudaBackend,
    path: &str,
    p: f32,
    cursor: &mut ParamCursor<'_>,
) -> CudaResult<Box<dyn CudaLayer>> {
    let Some(seed) = cursor.dropout_seeds.next() else {
        return Err(build_error(
            format!("a dropout seed for {path}"),
            "none left in the CPU network".to_string(),
        ));
    };
    Ok(Box::new(DropoutGpu(Box::new(DropoutLayer {
        mask: ops::DropoutMask { p, seed },
        counter: be.alloc_zeros(4)?,
        saved: be.alloc_zeros(4)?,
    }))))
}

pub(super) fn embedding_layer(
    path: &str,
    shape: &mut Vec<usize>,
    dim: usize,
    positions: bool,
    cursor: &mut ParamCursor<'_>,
) -> CudaResult<Box<dyn CudaLayer>> {
    let (Some(vocab), &[length]) = (cursor.vocab, shape.as_slice()) else {
        return Err(build_error(
            format!("{path}: token ids [t] (model.tokens)"),
            format!("{shape:?}"),
        ));
    };
    let table = cursor.take(path, vocab * dim)?;
    let positions_at = positions
        .then(|| cursor.take(path, length * dim))
        .transpose()?;
    *shape = vec![length, dim];
    Ok(Box::new(EmbeddingLayer {
        table,
        positions: positions_at,
        shape: ops::EmbeddingShape {
            vocab,
            dim,
            length,
            positions,
        },
    }))
}

/// A projection of attention: linear, or LoRA when the spec adapts it.
pub(super) fn projection(
    path: &str,
    features: usize,
    out: usize,
    lora: Option<&LoraConfig>,
    cursor: &mut ParamCursor<'_>,
) -> CudaResult<Box<dyn CudaLayer>> {
    match lora {
        Some(lora) => lora_layer(path, features, out, true, lora, cursor),
        None => linear_layer(path, features, out, true, cursor),
    }
}

pub(super) fn attention_layer(
    path: &str,
    shape: &[usize],
    heads: usize,
    lora: Option<&LoraConfig>,
    cursor: &mut ParamCursor<'_>,
) -> CudaResult<Box<dyn CudaLayer>> {
    let [length, width] = *shape else {
        return Err(build_error(
            format!("{path}: a sequence [t, c]"),
            format!("{shape:?}"),
        ));
    };
    if heads == 0 || !width.is_multiple_of(heads) {
        return Err(build_error(
            format!("{path}.heads: a divisor of the width {width}"),
            heads.to_string(),
        ));
    }
    if width / heads > ops::ATTENTION_MAX_HEAD {
        return Err(CudaError::Unsupported {
            op: "CudaNetwork::build",
            reason: format!(
                "{path}.heads: heads of {} values; the GPU's attention kernels take at most {} \
                 (use at least {} heads, or device.kind = \"cpu\")",
                width / heads,
                ops::ATTENTION_MAX_HEAD,
                width.div_ceil(ops::ATTENTION_MAX_HEAD)
            ),
        });
    }
    let qkv = projection(&format!("{path}.qkv"), width, 3 * width, lora, cursor)?;
    let proj = projection(&format!("{path}.proj"), width, width, lora, cursor)?;
    Ok(Box::new(AttentionLayer {
        qkv: vec![qkv],
        proj: vec![proj],
        length,
        heads,
    }))
}

/// The CPU's pre-norm GPT block (`network::build_transformer_block`):
/// x + drop(attn(ln1(x))), then x + drop(fc_out(gelu(fc(ln2(x))))).
#[allow(clippy::too_many_arguments)]
pub(super) fn transformer_block(
    be: &CudaBackend,
    path: &str,
    shape: &[usize],
    heads: usize,
    mlp_ratio: usize,
    dropout: f32,
    lora: Option<&LoraConfig>,
    cursor: &mut ParamCursor<'_>,
) -> CudaResult<Vec<Box<dyn CudaLayer>>> {
    let width = match *shape {
        [_, width] => width,
        _ => {
            return Err(build_error(
                format!("{path}: a sequence [t, c]"),
                format!("{shape:?}"),
            ))
        }
    };
    let eps = crate::network::default_eps();
    let mut attention = vec![
        layer_norm_layer(&format!("{path}.ln1"), width, eps, cursor)?,
        attention_layer(&format!("{path}.attn"), shape, heads, lora, cursor)?,
    ];
    if dropout > 0.0 {
        attention.push(dropout_layer(be, path, dropout, cursor)?);
    }
    let hidden = width * mlp_ratio;
    let mut mlp = vec![
        layer_norm_layer(&format!("{path}.ln2"), width, eps, cursor)?,
        linear_layer(&format!("{path}.fc"), width, hidden, true, cursor)?,
        Box::new(SmoothLayer(ops::Smooth::Gelu)),
        linear_layer(&format!("{path}.fc_out"), hidden, width, true, cursor)?,
    ];
    if dropout > 0.0 {
        mlp.push(dropout_layer(be, path, dropout, cursor)?);
    }
    Ok(vec![
        Box::new(ResidualLayer(attention)),
        Box::new(ResidualLayer(mlp)),
    ])
}
