//! The forward passes: each GPU layer's forward arm and what it keeps
//! for backward.

use std::sync::Arc;

use crate::cuda::backend::CudaBackend;
use crate::cuda::ops::{self, BatchNormConfig, BatchNormSaved};
use crate::cuda::tensor::CudaTensor;
use crate::cuda::{CudaError, CudaResult};
use crate::profile;

use super::*;

/// A list's input: lent by the caller (copied if a layer keeps it), or
/// shared (kept by reference, never copied), and then perhaps the output
/// of a batch norm + ReLU that backward can compute again instead.
pub(super) enum Input<'a> {
    Lent(&'a CudaTensor),
    Shared(Shared, Option<Arc<Recomputable>>),
}

impl Input<'_> {
    fn tensor(&self) -> &CudaTensor {
        match self {
            Input::Lent(t) => t,
            Input::Shared(t, _) => t,
        }
    }

    /// The same input for a nested list (a block's body).
    fn lend(&self) -> Input<'_> {
        match self {
            Input::Lent(t) => Input::Lent(t),
            Input::Shared(t, r) => Input::Shared(Arc::clone(t), r.clone()),
        }
    }

    /// A reference to the tensor itself, to keep for backward (a copy only
    /// of a lent tensor).
    fn share(&mut self, be: &CudaBackend) -> CudaResult<Shared> {
        let shared = match self {
            Input::Lent(t) => Arc::new(t.try_clone(be)?),
            Input::Shared(t, _) => return Ok(Arc::clone(t)),
        };
        *self = Input::Shared(Arc::clone(&shared), None);
        Ok(shared)
    }

    /// What backward needs of this input, as `for_backward`, but copying a
    /// lent tensor every time.
    fn activation(&self, be: &CudaBackend) -> CudaResult<Activation> {
        Ok(match self {
            Input::Lent(t) => Activation::Kept(Arc::new(t.try_clone(be)?)),
            Input::Shared(t, None) => Activation::Kept(Arc::clone(t)),
            Input::Shared(_, Some(r)) => Activation::Recomputed(Arc::clone(r)),
        })
    }

    /// What backward needs of this input: the way to compute it again if
    /// there is one, else the tensor.
    fn for_backward(&mut self, be: &CudaBackend) -> CudaResult<Activation> {
        match self {
            Input::Shared(_, Some(r)) => Ok(Activation::Recomputed(Arc::clone(r))),
            _ => self.share(be).map(Activation::Kept),
        }
    }

    /// The input as [n, features]: the same buffer when nothing else holds
    /// it, else a copy (a lent tensor, or an output kept for backward).
    fn flattened(self, be: &CudaBackend) -> CudaResult<Input<'static>> {
        let shape = self.tensor().shape();
        let features = shape.iter().skip(1).product();
        let flat = [shape.first().copied().unwrap_or(0), features];
        let owned = self.into_owned(be)?.reshape(&flat)?;
        Ok(Input::Shared(Arc::new(owned), None))
    }

    /// The tensor itself, copied only if something else still holds it.
    fn into_owned(self, be: &CudaBackend) -> CudaResult<CudaTensor> {
        match self {
            Input::Lent(t) => t.try_clone(be),
            Input::Shared(t, _) => Arc::try_unwrap(t).or_else(|t| t.try_clone(be)),
        }
    }
}

pub(super) fn forward_list(
    be: &CudaBackend,
    layers: &mut [GpuLayer],
    groups: &Groups,
    x: Input<'_>,
    pass: Pass,
    mut saved: Option<&mut Vec<Saved>>,
) -> CudaResult<CudaTensor> {
    let mut current = x;
    for layer in layers.iter_mut() {
        if let (GpuLayer::Dropout(_), Pass::Eval) = (&*layer, pass) {
            // The identity in evaluation: the input itself.
            continue;
        }
        if let GpuLayer::Flatten = layer {
            let shape = current.tensor().shape().to_vec();
            if let Some(list) = saved.as_deref_mut() {
                list.push(Saved::Shape(shape.clone()));
            }
            current = current.flattened(be)?;
            be.profile_mark(|| format!("fwd flatten in {}", profile::dims(&shape)))?;
            continue;
        }
        let (y, keep) = forward_one(be, layer, groups, &current, pass, saved.as_deref_mut())?;
        be.profile_mark(|| format!("fwd {} in {}", layer.describe(), dims(current.tensor())))?;
        let y = Arc::new(y);
        let mut recomputable = None;
        if let Some(list) = saved.as_deref_mut() {
            list.push(match keep {
                Keep::Input => Saved::Input(current.for_backward(be)?),
                Keep::InputAnd(stats) => Saved::LayerNorm(current.for_backward(be)?, stats),
                Keep::Segment => Saved::Segment(current.for_backward(be)?, pass),
                Keep::Output => Saved::Output(Activation::Kept(Arc::clone(&y))),
                Keep::Recomputed(r) => {
                    recomputable = Some(Arc::clone(&r));
                    Saved::Output(Activation::Recomputed(r))
                }
                Keep::BatchNorm { fused_relu, stats } => {
                    let input = current.share(be)?;
                    // The next layer's input, if it keeps it: computed again
                    // from this one's input where recomputing.
                    if let (
                        true,
                        Pass::Train {
                            recompute: true, ..
                        },
                    ) = (fused_relu, pass)
                    {
                        recomputable = Some(Recomputable::new(
                            Arc::clone(&input),
                            Arc::clone(&stats),
                            None,
                        ));
                    }
                    Saved::BatchNorm(Box::new(SavedBatchNorm { input, stats }))
                }
                Keep::Other(s) => s,
                Keep::Lstm(kept) => Saved::Lstm(current.for_backward(be)?, Arc::clone(&y), kept),
                Keep::ConvLstm(kept) => {
                    Saved::ConvLstm(current.for_backward(be)?, Arc::clone(&y), kept)
                }
            });
        }
        current = Input::Shared(y, recomputable);
    }
    current.into_owned(be)
}

/// What one layer's forward keeps: a reference to its input or its output
/// (the caller's, shared with the layers around it), or something of its
/// own.
pub(super) enum Keep {
    Input,
    /// The input, and a layer norm's row statistics.
    InputAnd(ops::LayerNormSaved),
    /// A checkpointed segment's input.
    Segment,
    Output,
    /// The output, to be computed again in backward.
    Recomputed(Arc<Recomputable>),
    BatchNorm {
        /// With the ReLU fused, in a pass that keeps activations: the output
        /// (the next layer's input) can be computed again from the input.
        fused_relu: bool,
        stats: Arc<BatchNormSaved>,
    },
    Other(Saved),
    /// The input and output, and an LSTM's gates and cells.
    Lstm(Box<ops::LstmSaved>),
    ConvLstm(Box<ops::ConvLstmSaved>),
}

/// How a forward runs: inference (running statistics), or training (batch
/// statistics; the running ones updated unless this is the recomputation
/// of a checkpointed segment, which must leave them as the first pass did).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Pass {
    Eval,
    Train {
        update_running: bool,
        /// `CudaBuildOptions::recompute`.
        recompute: bool,
    },
}

pub(super) fn forward_one(
    be: &CudaBackend,
    layer: &mut GpuLayer,
    groups: &Groups,
    input: &Input<'_>,
    pass: Pass,
    mut saved: Option<&mut Vec<Saved>>,
) -> CudaResult<(CudaTensor, Keep)> {
    let x = input.tensor();
    // Inside a checkpointed segment's first pass a training forward keeps
    // nothing: `saved` is None.
    let keeping = saved.is_some();
    Ok(match layer {
        GpuLayer::Conv {
            weight,
            bias,
            kernel,
            stride,
            pad,
            cout,
            plan,
        } => {
            let s = conv_shape(x, *kernel, *stride, *pad, *cout)?;
            let b = bias.as_ref().map(|b| compute(groups, b));
            let y = ops::conv2d_forward(be, x, &compute(groups, weight), b.as_ref(), s, *plan)?;
            (y, Keep::Input)
        }
        GpuLayer::DepthwiseConv {
            weight,
            bias,
            shape,
        } => {
            let b = bias.as_ref().map(|b| compute(groups, b));
            let w = compute(groups, weight);
            let y = ops::depthwise_forward(be, x, &w, b.as_ref(), *shape)?;
            (y, Keep::Input)
        }
        GpuLayer::BatchNorm { bn, relu } => {
            let (y, stats) = batch_norm_forward(be, bn, groups, x, None, *relu, pass)?;
            let Some(stats) = stats else {
                return Ok((y, Keep::Other(Saved::Nothing)));
            };
            let fused_relu = *relu && keeping;
            let stats = Arc::new(stats);
            (y, Keep::BatchNorm { fused_relu, stats })
        }
        GpuLayer::Relu => {
            let y = ops::relu_forward(be, x)?;
            (
                y,
                if keeping {
                    Keep::Output
                } else {
                    Keep::Other(Saved::Nothing)
                },
            )
        }
        GpuLayer::Residual(body) => {
            let body_input = input.lend();
            let mut y = forward_list(be, body, groups, body_input, pass, saved)?;
            ops::add_inplace(be, &mut y, x)?;
            (y, Keep::Other(Saved::Nothing))
        }
        GpuLayer::FusedResidual { body, tail } => {
            let body_input = input.lend();
            let z = forward_list(be, body, groups, body_input, pass, saved.as_deref_mut())?;
            let (y, stats) = batch_norm_forward(be, tail, groups, &z, Some(x), true, pass)?;
            // The tail's entry goes on the stack above the body's, and the
            // block's own (its output, the ReLU's mask) above that.
            let keep = match (saved, stats) {
                (Some(list), Some(stats)) => {
                    let (z, stats) = (Arc::new(z), Arc::new(stats));
                    list.push(Saved::BatchNorm(Box::new(SavedBatchNorm {
                        input: Arc::clone(&z),
                        stats: Arc::clone(&stats),
                    })));
                    let skip = match pass {
                        Pass::Train {
                            recompute: true, ..
                        } => Some(input.activation(be)?),
                        _ => None,
                    };
                    match skip {
                        Some(skip) if skip.depth() < MAX_RECOMPUTE_DEPTH => {
                            Keep::Recomputed(Recomputable::new(z, stats, Some(skip)))
                        }
                        _ => Keep::Output,
                    }
                }
                _ => Keep::Other(Saved::Nothing),
            };
            (y, keep)
        }
        GpuLayer::Checkpointed(body) => {
            let body_input = input.lend();
            let y = forward_list(be, body, groups, body_input, pass, None)?;
            (y, Keep::Segment)
        }
        GpuLayer::MaxPool { kernel, stride } => {
            // Only a pass that keeps activations writes the argmax.
            let (y, kept) = ops::max_pool_forward(be, x, *kernel, *stride, keeping)?;
            let keep = match kept {
                Some(kept) => Saved::MaxPool(Box::new(kept)),
                None => Saved::Nothing,
            };
            (y, Keep::Other(keep))
        }
        GpuLayer::GlobalAvgPool => {
            let y = ops::global_avg_pool_forward(be, x)?;
            (y, Keep::Other(Saved::Shape(x.shape().to_vec())))
        }
        GpuLayer::Linear { weight, bias, out } => {
            let b = bias.as_ref().map(|b| compute(groups, b));
            let y = ops::linear_forward(be, x, &compute(groups, weight), b.as_ref(), *out)?;
            (y, Keep::Input)
        }
        GpuLayer::Smooth(kind) => (ops::smooth_forward(be, *kind, x)?, Keep::Input),
        GpuLayer::Upsample2x => (
            ops::upsample2x_forward(be, x)?,
            Keep::Other(Saved::Shape(x.shape().to_vec())),
        ),
        GpuLayer::UnetSkip { body, .. } => {
            let body_input = input.lend();
            let z = forward_list(be, body, groups, body_input, pass, saved)?;
            (
                ops::channels_concat(be, x, &z)?,
                Keep::Other(Saved::Nothing),
            )
        }
        GpuLayer::Dropout(d) => {
            // A recomputation draws the first pass's mask and counts nothing
            // (evaluation skips the layer in `forward_list`).
            let first_pass = matches!(
                pass,
                Pass::Train {
                    update_running: true,
                    ..
                }
            );
            let y = ops::dropout_apply(be, d.mask, &d.counter.slice, !first_pass, x)?;
            if first_pass {
                ops::dropout_count(be, d.mask, &mut d.counter.slice)?;
            }
            (y, Keep::Other(Saved::Nothing))
        }
        GpuLayer::LayerNorm { gamma, beta, eps } => {
            let (g, b) = (master(groups, gamma), master(groups, beta));
            let (y, stats) = ops::layer_norm_forward(be, x, &g, &b, *eps)?;
            (y, Keep::InputAnd(stats))
        }
        GpuLayer::Embedding {
            table,
            positions,
            shape,
        } => {
            let table = master(groups, table);
            let positions = positions.as_ref().map(|p| master(groups, p));
            let dtype = activations_of(groups);
            let y = ops::embedding_forward(be, x, &table, positions.as_ref(), *shape, dtype)?;
            (y, Keep::Input)
        }
        GpuLayer::ConvLstm {
            weight,
            bias,
            shape,
            plan,
            step_recompute,
        } => {
            let (w, b) = (compute(groups, weight), compute(groups, bias));
            let (y, kept) = ops::conv_lstm_forward(be, x, &w, &b, *shape, *plan, *step_recompute)?;
            (y, Keep::ConvLstm(Box::new(kept)))
        }
        GpuLayer::Lstm {
            wx,
            wh,
            bias,
            length,
        } => {
            let (wx, wh) = (compute(groups, wx), compute(groups, wh));
            let (y, kept) = ops::lstm_forward(be, x, &wx, &wh, &master(groups, bias), *length)?;
            (y, Keep::Lstm(Box::new(kept)))
        }
        GpuLayer::Lora(lora) => {
            let (y, u) = ops::lora_forward(be, x, &lora.weights(groups), lora.out)?;
            let keep = match keeping {
                true => Saved::Lora(input.activation(be)?, Arc::new(u)),
                false => Saved::Nothing,
            };
            (y, Keep::Other(keep))
        }
        GpuLayer::Attention {
            qkv,
            proj,
            length,
            heads,
        } => {
            // The projections' entries go on the stack below attention's own.
            let qkv_out = forward_list(be, qkv, groups, input.lend(), pass, saved.as_deref_mut())?;
            let (heads_out, stats) = ops::attention_forward(be, &qkv_out, *length, *heads)?;
            let heads_out = Arc::new(heads_out);
            let o = Input::Shared(Arc::clone(&heads_out), None);
            let y = forward_list(be, proj, groups, o, pass, saved)?;
            let keep = match keeping {
                true => Saved::Attention(Box::new(SavedAttention {
                    qkv: Arc::new(qkv_out),
                    heads_out,
                    stats,
                })),
                false => Saved::Nothing,
            };
            (y, Keep::Other(keep))
        }
        // A reshape of the input itself, which `forward_list` does.
        GpuLayer::Flatten => {
            return Err(CudaError::Unsupported {
                op: "CudaNetwork::forward",
                reason: "flatten outside forward_list".into(),
            })
        }
    })
}

/// A batch norm's forward, `skip` added before the ReLU when given: the
/// output, and in training the batch statistics backward needs.
#[allow(clippy::too_many_arguments)]
pub(super) fn batch_norm_forward(
    be: &CudaBackend,
    bn: &mut BatchNormLayer,
    groups: &Groups,
    x: &CudaTensor,
    skip: Option<&CudaTensor>,
    relu: bool,
    pass: Pass,
) -> CudaResult<(CudaTensor, Option<BatchNormSaved>)> {
    let (g, b) = (master(groups, &bn.gamma), master(groups, &bn.beta));
    let Pass::Train { update_running, .. } = pass else {
        let cfg = BatchNormConfig {
            momentum: bn.momentum,
            eps: bn.eps,
            relu,
            update_running: false,
        };
        let mean = bn.running.mean.slice.as_view();
        let var = bn.running.var.slice.as_view();
        let y = match skip {
            None => ops::batch_norm_forward_eval(be, x, &g, &b, &mean, &var, cfg)?,
            Some(skip) => ops::batch_norm_add_forward_eval(be, x, skip, &g, &b, &mean, &var, cfg)?,
        };
        return Ok((y, None));
    };
    let cfg = BatchNormConfig {
        momentum: bn.momentum,
        eps: bn.eps,
        relu,
        update_running,
    };
    let RunningStats { mean, var, .. } = &mut *bn.running;
    let (mut mean, mut var) = (mean.slice.as_view_mut(), var.slice.as_view_mut());
    let (y, stats) = match skip {
        None => ops::batch_norm_forward_train(be, x, &g, &b, &mut mean, &mut var, cfg)?,
        Some(skip) => {
            ops::batch_norm_add_forward_train(be, x, skip, &g, &b, &mut mean, &mut var, cfg)?
        }
    };
    Ok((y, Some(stats)))
}
