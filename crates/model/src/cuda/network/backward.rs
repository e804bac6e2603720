//! The backward passes: each GPU layer's backward arm, its parameter
//! gradients and the input gradient.

use cudarc::driver::{CudaView, CudaViewMut};

use crate::cuda::backend::{CudaBackend, DeviceBuffer};
use crate::cuda::ops::{self};
use crate::cuda::tensor::{AnyView, CudaTensor};
use crate::cuda::{CudaError, CudaResult};
use crate::profile;

use super::*;

pub(super) fn backward_list(
    be: &CudaBackend,
    layers: &mut [GpuLayer],
    groups: &mut Groups,
    saved: &mut Vec<Saved>,
    mut g: CudaTensor,
) -> CudaResult<CudaTensor> {
    for layer in layers.iter_mut().rev() {
        let out = dims(&g);
        g = backward_one(be, layer, groups, saved, g)?;
        be.profile_mark(|| format!("bwd {} out {out}", layer.describe()))?;
    }
    Ok(g)
}

/// The network's backward, down to its first layer with parameters (what
/// the layers before it saved is dropped unused).
pub(super) fn backward_network(
    be: &CudaBackend,
    layers: &mut [GpuLayer],
    groups: &mut Groups,
    saved: &mut Vec<Saved>,
    mut g: CudaTensor,
) -> CudaResult<()> {
    let Some(first) = layers.iter().position(GpuLayer::may_have_params) else {
        return Ok(());
    };
    let Some((first, after)) = layers[first..].split_first_mut() else {
        return Ok(());
    };
    g = backward_list(be, after, groups, saved, g)?;
    let out = dims(&g);
    backward_params_only(be, first, groups, saved, g)?;
    be.profile_mark(|| format!("bwd {} out {out}", first.describe()))
}

/// `layer`'s parameter gradients for `g`: a convolution or linear layer
/// skips its input gradient, a UNet skip its add (and its body's first
/// input gradient), any other layer computes and drops it.
pub(super) fn backward_params_only(
    be: &CudaBackend,
    layer: &mut GpuLayer,
    groups: &mut Groups,
    saved: &mut Vec<Saved>,
    g: CudaTensor,
) -> CudaResult<()> {
    match layer {
        GpuLayer::Conv {
            weight,
            bias,
            kernel,
            stride,
            pad,
            cout,
            plan,
        } if weight.trainable() => {
            let Some(Saved::Input(x)) = saved.pop() else {
                return Err(missing());
            };
            let x = x.take(be)?;
            let s = conv_shape(&x, *kernel, *stride, *pad, *cout)?;
            with_grads(groups, weight, bias.as_ref(), |mut v| {
                let bias_grad = v.other.as_mut().map(|(_, grad)| grad);
                ops::conv2d_backward_params(
                    be,
                    &x,
                    &g,
                    &v.compute,
                    &mut v.grad,
                    bias_grad,
                    s,
                    *plan,
                )
            })
        }
        GpuLayer::DepthwiseConv {
            weight,
            bias,
            shape,
        } if weight.trainable() => {
            let Some(Saved::Input(x)) = saved.pop() else {
                return Err(missing());
            };
            let x = x.take(be)?;
            with_grads(groups, weight, bias.as_ref(), |mut v| {
                let bias_grad = v.other.as_mut().map(|(_, grad)| grad);
                ops::depthwise_backward_params(be, &x, &g, &mut v.grad, bias_grad, *shape)
            })
        }
        GpuLayer::Linear { weight, bias, .. } if weight.trainable() => {
            let Some(Saved::Input(x)) = saved.pop() else {
                return Err(missing());
            };
            let x = x.take(be)?;
            with_grads(groups, weight, bias.as_ref(), |mut v| {
                let bias_grad = v.other.as_mut().map(|(_, grad)| grad);
                ops::linear_backward_params(be, &x, &g, &v.compute, &mut v.grad, bias_grad)
            })
        }
        // The skip's share of the gradient goes nowhere; the body is first
        // in the network too.
        GpuLayer::UnetSkip { body, channels } => {
            let _ = saved.pop().ok_or_else(missing)?;
            let (_, g_body) = ops::channels_split(be, &g, *channels)?;
            drop(g);
            backward_network(be, body, groups, saved, g_body)
        }
        _ => backward_one(be, layer, groups, saved, g).map(drop),
    }
}

/// A tensor's dimensions after the batch, for profile labels: "28x28x32".
pub(super) fn dims(t: &CudaTensor) -> String {
    profile::dims(t.shape())
}

impl GpuLayer {
    /// Whether its backward may make parameter gradients (a container is
    /// taken to).
    pub(super) fn may_have_params(&self) -> bool {
        !matches!(
            self,
            GpuLayer::Relu
                | GpuLayer::GlobalAvgPool
                | GpuLayer::MaxPool { .. }
                | GpuLayer::Flatten
                | GpuLayer::Smooth(_)
                | GpuLayer::Dropout(_)
                | GpuLayer::Upsample2x
        )
    }

    /// What the layer is, for profile labels.
    pub(super) fn describe(&self) -> String {
        match self {
            GpuLayer::Conv {
                kernel,
                stride,
                cout,
                ..
            } => format!("conv {kernel}x{kernel}/{stride} to {cout}"),
            GpuLayer::DepthwiseConv { shape, .. } => format!(
                "depthwise_conv {k}x{k}/{s} x{m}",
                k = shape.kernel,
                s = shape.stride,
                m = shape.multiplier
            ),
            GpuLayer::BatchNorm { relu: true, .. } => "batch_norm+relu".into(),
            GpuLayer::BatchNorm { relu: false, .. } => "batch_norm".into(),
            GpuLayer::Relu => "relu".into(),
            GpuLayer::Residual(_) => "residual add".into(),
            GpuLayer::FusedResidual { .. } => "residual batch_norm+add+relu".into(),
            GpuLayer::Checkpointed(_) => "checkpointed segment (its own layers apart)".into(),
            GpuLayer::GlobalAvgPool => "global_avg_pool".into(),
            GpuLayer::MaxPool { kernel, stride } => format!("max_pool {kernel}x{kernel}/{stride}"),
            GpuLayer::Linear { out, .. } => format!("linear to {out}"),
            GpuLayer::Flatten => "flatten".into(),
            GpuLayer::Smooth(kind) => kind.name().into(),
            GpuLayer::LayerNorm { .. } => "layer_norm".into(),
            GpuLayer::Dropout(d) => format!("dropout {}", d.mask.p),
            GpuLayer::Upsample2x => "upsample2x".into(),
            GpuLayer::UnetSkip { .. } => "unet_skip concat".into(),
            GpuLayer::Embedding { shape, .. } => {
                format!("embedding {}x{}", shape.vocab, shape.dim)
            }
            GpuLayer::Lora(lora) => format!("lora to {} (r {})", lora.out, lora.rank),
            GpuLayer::Lstm { bias, .. } => format!("lstm {}", bias.len / 4),
            GpuLayer::ConvLstm { shape, .. } => format!("conv_lstm {}", shape.hidden),
            GpuLayer::Attention { heads, .. } => format!("causal attention {heads} heads"),
        }
    }
}

pub(super) fn missing() -> CudaError {
    CudaError::Unsupported {
        op: "CudaNetwork::backward",
        reason: "backward without a training forward before it".into(),
    }
}

/// Views of parameter `a` (the weights it computes with, its f32 master and
/// f32 gradient) and the weights and gradient of `b`, lent together to `f`
/// even when both live in one group.
pub(super) struct Views<'a> {
    compute: AnyView<'a>,
    master: CudaView<'a, f32>,
    grad: CudaViewMut<'a, f32>,
    other: Option<(AnyView<'a>, CudaViewMut<'a, f32>)>,
}

/// The weights a layer computes with, from a group's fields (so that its
/// gradient can be lent mutably beside them).
pub(super) fn compute_view<'a>(
    copy: &'a Option<DeviceBuffer<half::f16>>,
    master: &'a DeviceBuffer<f32>,
    range: std::ops::Range<usize>,
) -> AnyView<'a> {
    match copy {
        Some(copy) => AnyView::F16(copy.slice.slice(range)),
        None => AnyView::F32(master.slice.slice(range)),
    }
}

pub(super) fn with_grads<R>(
    groups: &mut Groups,
    a: &ParamRef,
    b: Option<&ParamRef>,
    f: impl FnOnce(Views<'_>) -> R,
) -> R {
    let [first, second, _] = groups;
    let (ga, gb) = if a.group == DECAY {
        (first, second)
    } else {
        (second, first)
    };
    let compute = compute_view(&ga.compute, &ga.master, a.range());
    let master = ga.master.slice.slice(a.range());
    match b {
        Some(b) if b.group == a.group => {
            // Two disjoint ranges of one buffer: split it between them.
            let (mut low, mut high) = ga.grad.slice.split_at_mut(a.offset.max(b.offset));
            let (grad, other) = if a.offset < b.offset {
                (low.slice_mut(a.range()), high.slice_mut(0..b.len))
            } else {
                (high.slice_mut(0..a.len), low.slice_mut(b.range()))
            };
            let other_compute = compute_view(&ga.compute, &ga.master, b.range());
            f(Views {
                compute,
                master,
                grad,
                other: Some((other_compute, other)),
            })
        }
        Some(b) => f(Views {
            compute,
            master,
            grad: ga.grad.slice.slice_mut(a.range()),
            other: Some((
                compute_view(&gb.compute, &gb.master, b.range()),
                gb.grad.slice.slice_mut(b.range()),
            )),
        }),
        None => f(Views {
            compute,
            master,
            grad: ga.grad.slice.slice_mut(a.range()),
            other: None,
        }),
    }
}

pub(super) fn backward_one(
    be: &CudaBackend,
    layer: &mut GpuLayer,
    groups: &mut Groups,
    saved: &mut Vec<Saved>,
    g: CudaTensor,
) -> CudaResult<CudaTensor> {
    match layer {
        GpuLayer::Residual(body) => {
            let _ = saved.pop().ok_or_else(missing)?;
            let dx = backward_list(be, body, groups, saved, g.try_clone(be)?)?;
            ops::add(be, &dx, &g)
        }
        GpuLayer::UnetSkip { body, channels } => {
            let _ = saved.pop().ok_or_else(missing)?;
            let (mut dx, g_body) = ops::channels_split(be, &g, *channels)?;
            drop(g);
            let dx_body = backward_list(be, body, groups, saved, g_body)?;
            ops::add_inplace(be, &mut dx, &dx_body)?;
            Ok(dx)
        }
        GpuLayer::FusedResidual { body, tail } => {
            let Some(Saved::Output(y)) = saved.pop() else {
                return Err(missing());
            };
            let y = y.take(be)?;
            let Some(Saved::BatchNorm(tail_saved)) = saved.pop() else {
                return Err(missing());
            };
            // The tail's backward masks g in place: g is then the gradient
            // of the skip input as well as of the tail's output.
            let SavedBatchNorm { input, stats, .. } = *tail_saved;
            let mut g = g;
            let dz = with_bn_grads(groups, tail, |gamma, gamma_grad, beta_grad| {
                ops::batch_norm_add_relu_backward(
                    be, &mut g, &input, &y, &stats, gamma, gamma_grad, beta_grad,
                )
            })?;
            // Freed before the body's backward, as the unfused path frees
            // them.
            drop((input, stats, y));
            let mut dx = backward_list(be, body, groups, saved, dz)?;
            ops::add_inplace(be, &mut dx, &g)?;
            Ok(dx)
        }
        GpuLayer::Attention {
            qkv,
            proj,
            length,
            heads,
        } => {
            let Some(Saved::Attention(kept)) = saved.pop() else {
                return Err(missing());
            };
            let d_heads = backward_list(be, proj, groups, saved, g)?;
            let SavedAttention {
                qkv: qkv_out,
                heads_out,
                stats,
            } = *kept;
            let d_qkv = ops::attention_backward(
                be, &qkv_out, &heads_out, &d_heads, &stats, *length, *heads,
            )?;
            drop((qkv_out, heads_out, stats, d_heads));
            backward_list(be, qkv, groups, saved, d_qkv)
        }
        GpuLayer::Checkpointed(body) => {
            let Some(Saved::Segment(x, Pass::Train { recompute, .. })) = saved.pop() else {
                return Err(missing());
            };
            // Recompute the segment, keeping what its backward needs this
            // time; the running statistics stay as the first pass left them.
            let mut inner = Vec::new();
            let again = Pass::Train {
                update_running: false,
                recompute,
            };
            drop(forward_list(
                be,
                body,
                groups,
                Input::Shared(x.take(be)?, None),
                again,
                Some(&mut inner),
            )?);
            backward_list(be, body, groups, &mut inner, g)
        }
        _ => {
            let entry = saved.pop().ok_or_else(missing)?;
            backward_leaf(be, layer, groups, entry, g)
        }
    }
}

pub(super) fn backward_leaf(
    be: &CudaBackend,
    layer: &GpuLayer,
    groups: &mut Groups,
    entry: Saved,
    g: CudaTensor,
) -> CudaResult<CudaTensor> {
    match (layer, entry) {
        (
            GpuLayer::Conv {
                weight,
                bias,
                kernel,
                stride,
                pad,
                cout,
                plan,
            },
            Saved::Input(x),
        ) => {
            let x = x.take(be)?;
            let s = conv_shape(&x, *kernel, *stride, *pad, *cout)?;
            with_grads(groups, weight, bias.as_ref(), |mut v| {
                let bias_grad = v.other.as_mut().map(|(_, grad)| grad);
                ops::conv2d_backward(be, &x, &g, &v.compute, &mut v.grad, bias_grad, s, *plan)
            })
        }
        (
            GpuLayer::DepthwiseConv {
                weight,
                bias,
                shape,
            },
            Saved::Input(x),
        ) => {
            let x = x.take(be)?;
            with_grads(groups, weight, bias.as_ref(), |mut v| {
                let bias_grad = v.other.as_mut().map(|(_, grad)| grad);
                ops::depthwise_backward(be, &x, &g, &v.compute, &mut v.grad, bias_grad, *shape)
            })
        }
        (GpuLayer::Linear { weight, .. }, Saved::Input(x)) if !weight.trainable() => {
            // Its bias is frozen too (`same_freezing`).
            let inf = x.take(be)?.shape().get(1).copied().unwrap_or(0);
            ops::linear_backward_input(be, &g, &compute(groups, weight), inf)
        }
        (GpuLayer::Linear { weight, bias, .. }, Saved::Input(x)) => {
            let x = x.take(be)?;
            with_grads(groups, weight, bias.as_ref(), |mut v| {
                let bias_grad = v.other.as_mut().map(|(_, grad)| grad);
                ops::linear_backward(be, &x, &g, &v.compute, &mut v.grad, bias_grad)
            })
        }
        (GpuLayer::BatchNorm { bn, relu }, Saved::BatchNorm(saved)) => {
            let SavedBatchNorm { input, stats } = *saved;
            with_bn_grads(groups, bn, |gamma, gamma_grad, beta_grad| {
                ops::batch_norm_backward(
                    be, &g, &input, &stats, gamma, gamma_grad, beta_grad, *relu,
                )
            })
        }
        (GpuLayer::Relu, Saved::Output(y)) => {
            let y = y.take(be)?;
            ops::relu_backward(be, &g, &y)
        }
        (GpuLayer::Smooth(kind), Saved::Input(x)) => {
            let x = x.take(be)?;
            ops::smooth_backward(be, *kind, &g, &x)
        }
        (GpuLayer::Flatten, Saved::Shape(shape)) => g.reshape(&shape),
        (GpuLayer::Upsample2x, Saved::Shape(shape)) => ops::upsample2x_backward(be, &g, &shape),
        (GpuLayer::Dropout(d), Saved::Nothing) => {
            ops::dropout_apply(be, d.mask, &d.counter.slice, true, &g)
        }
        (GpuLayer::LayerNorm { gamma, .. }, Saved::LayerNorm(x, stats)) if !gamma.trainable() => {
            let x = x.take(be)?;
            ops::layer_norm_backward_input(be, &g, &x, &stats, &master(groups, gamma))
        }
        (GpuLayer::LayerNorm { gamma, beta, .. }, Saved::LayerNorm(x, stats)) => {
            let x = x.take(be)?;
            with_grads(groups, gamma, Some(beta), |mut v| {
                let Some(beta_grad) = v.other.as_mut().map(|(_, grad)| grad) else {
                    return Err(missing());
                };
                ops::layer_norm_backward(be, &g, &x, &stats, &v.master, &mut v.grad, beta_grad)
            })
        }
        (GpuLayer::MaxPool { .. }, Saved::MaxPool(kept)) => ops::max_pool_backward(be, &g, &kept),
        (GpuLayer::GlobalAvgPool, Saved::Shape(shape)) => {
            ops::global_avg_pool_backward(be, &g, &shape)
        }
        (
            GpuLayer::Lstm {
                wx,
                wh,
                bias,
                length,
            },
            Saved::Lstm(x, y, kept),
        ) => {
            let d_pre = with_grads(groups, wh, None, |mut v| {
                ops::lstm_backward_steps(be, &y, &g, &kept, &v.compute, &mut v.grad, *length)
            })?;
            drop((y, kept));
            let x = x.take(be)?;
            with_grads(groups, wx, Some(bias), |mut v| {
                let bias_grad = v.other.as_mut().map(|(_, grad)| grad);
                ops::linear_backward(be, &x, &d_pre, &v.compute, &mut v.grad, bias_grad)
            })
        }
        (
            GpuLayer::ConvLstm {
                weight,
                bias,
                shape,
                plan,
                ..
            },
            Saved::ConvLstm(x, y, kept),
        ) => {
            let x = x.take(be)?;
            with_grads(groups, weight, Some(bias), |mut v| {
                let Some((bias, bias_grad)) = v.other.as_mut() else {
                    return Err(missing());
                };
                ops::conv_lstm_backward(
                    be,
                    &x,
                    &y,
                    &g,
                    &kept,
                    &v.compute,
                    bias,
                    &mut v.grad,
                    bias_grad,
                    *shape,
                    *plan,
                )
            })
        }
        (GpuLayer::Lora(lora), Saved::Lora(x, u)) => {
            let x = x.take(be)?;
            let inf = x.shape().get(1).copied().unwrap_or(0);
            let (dx, du) = ops::lora_backward_input(be, &g, &lora.weights(groups), inf)?;
            with_grads(groups, &lora.a, Some(&lora.b), |mut v| {
                let Some(b_grad) = v.other.as_mut().map(|(_, grad)| grad) else {
                    return Err(missing());
                };
                ops::lora_grads(be, &x, &u, &g, &du, &mut v.grad, b_grad)
            })?;
            Ok(dx)
        }
        (
            GpuLayer::Embedding {
                table,
                positions,
                shape,
            },
            Saved::Input(ids),
        ) => {
            let ids = ids.take(be)?;
            embedding_grads(be, groups, &ids, &g, *table, *positions, *shape)?;
            // Ids have no gradient.
            CudaTensor::zeros(be, ids.shape(), ids.dtype())
        }
        _ => Err(missing()),
    }
}

/// An embedding's gradients into whichever of its table and positions
/// are trainable.
pub(super) fn embedding_grads(
    be: &CudaBackend,
    groups: &mut Groups,
    ids: &CudaTensor,
    g: &CudaTensor,
    table: ParamRef,
    positions: Option<ParamRef>,
    shape: ops::EmbeddingShape,
) -> CudaResult<()> {
    let positions = positions.filter(ParamRef::trainable);
    match (table.trainable(), positions) {
        (true, positions) => with_grads(groups, &table, positions.as_ref(), |mut v| {
            ops::embedding_backward(
                be,
                ids,
                g,
                shape,
                Some(&mut v.grad),
                v.other.as_mut().map(|(_, grad)| grad),
            )
        }),
        (false, Some(positions)) => with_grads(groups, &positions, None, |mut v| {
            ops::embedding_backward(be, ids, g, shape, None, Some(&mut v.grad))
        }),
        (false, None) => Ok(()),
    }
}

/// Lends a batch norm's f32 gamma and the f32 gradients of gamma and beta
/// to `f`.
pub(super) fn with_bn_grads<R>(
    groups: &mut Groups,
    bn: &BatchNormLayer,
    f: impl FnOnce(
        &CudaView<'_, f32>,
        &mut CudaViewMut<'_, f32>,
        &mut CudaViewMut<'_, f32>,
    ) -> CudaResult<R>,
) -> CudaResult<R> {
    with_grads(groups, &bn.gamma, Some(&bn.beta), |mut v| {
        let Some(beta_grad) = v.other.as_mut().map(|(_, grad)| grad) else {
            return Err(missing());
        };
        f(&v.master, &mut v.grad, beta_grad)
    })
}
