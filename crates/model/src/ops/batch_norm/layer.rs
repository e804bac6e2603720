//! Batch norm's GPU layers (`CudaLayer`): batch norm (with the ReLU after
//! it fused in, `absorb_relu`), and the fused residual block, y =
//! relu(tail(body(x)) + x), whose tail batch norm's normalisation, the sum
//! and the ReLU run as one kernel (`bn_apply_add`).
//!
//! Memory: a batch norm owns its running statistics and the copies taken
//! before a step (its step buffers); a training forward keeps its input
//! and batch statistics (`SavedBatchNorm`), the ReLU's mask coming from
//! those. A fused block keeps its body's entries, its tail's input and
//! statistics, and its output (or the way to compute it again).

use std::sync::Arc;

use cudarc::driver::{CudaView, CudaViewMut};

use crate::cuda::backend::{CudaBackend, DeviceBuffer};
use crate::cuda::layer::{
    backward_list, forward_list, fuse, master, missing, with_grads, Absorbed, CudaLayer, Groups,
    Input, Keep, ParamRef, Pass, Recomputable, Saved, SavedBatchNorm, StepBuffers,
    MAX_RECOMPUTE_DEPTH,
};
use crate::cuda::ops::{self, BatchNormConfig, BatchNormSaved, ConvPlan};
use crate::cuda::tensor::CudaTensor;
use crate::cuda::CudaResult;

#[derive(Debug)]
pub struct RunningStats {
    pub(crate) mean: DeviceBuffer<f32>,
    pub(crate) var: DeviceBuffer<f32>,
    /// Copies taken before a step, put back if the step is not applied.
    pub(crate) saved_mean: DeviceBuffer<f32>,
    pub(crate) saved_var: DeviceBuffer<f32>,
}

/// A batch norm's parameters, running statistics and settings.
#[derive(Debug)]
pub struct BatchNormLayer {
    pub(crate) gamma: ParamRef,
    pub(crate) beta: ParamRef,
    pub(crate) running: Box<RunningStats>,
    pub(crate) momentum: f32,
    pub(crate) eps: f32,
}

#[derive(Debug)]
pub(crate) struct BatchNormGpu {
    pub bn: BatchNormLayer,
    /// Fused with the ReLU that followed it in the spec.
    pub relu: bool,
}

impl CudaLayer for BatchNormGpu {
    fn describe(&self) -> String {
        match self.relu {
            true => "batch_norm+relu".into(),
            false => "batch_norm".into(),
        }
    }

    fn forward(
        &mut self,
        be: &CudaBackend,
        groups: &Groups,
        input: &Input<'_>,
        pass: Pass,
        saved: Option<&mut Vec<Saved>>,
    ) -> CudaResult<(CudaTensor, Keep)> {
        let x = input.tensor();
        let (y, stats) = batch_norm_forward(be, &mut self.bn, groups, x, None, self.relu, pass)?;
        let Some(stats) = stats else {
            return Ok((y, Keep::Other(Saved::Nothing)));
        };
        let fused_relu = self.relu && saved.is_some();
        let stats = Arc::new(stats);
        Ok((y, Keep::BatchNorm { fused_relu, stats }))
    }

    fn backward(
        &mut self,
        be: &CudaBackend,
        groups: &mut Groups,
        saved: &mut Vec<Saved>,
        g: CudaTensor,
    ) -> CudaResult<CudaTensor> {
        let Some(Saved::BatchNorm(saved)) = saved.pop() else {
            return Err(missing());
        };
        let SavedBatchNorm { input, stats } = *saved;
        let relu = self.relu;
        with_bn_grads(groups, &self.bn, |gamma, gamma_grad, beta_grad| {
            ops::batch_norm_backward(be, &g, &input, &stats, gamma, gamma_grad, beta_grad, relu)
        })
    }

    fn absorb_relu(&mut self) -> Absorbed {
        match self.relu {
            true => Absorbed::No,
            false => {
                self.relu = true;
                Absorbed::InPlace
            }
        }
    }

    fn is_plain_batch_norm(&self) -> bool {
        !self.relu
    }

    fn into_batch_norm(self: Box<Self>) -> Option<BatchNormLayer> {
        (!self.relu).then_some(self.bn)
    }

    fn step_buffers(
        &mut self,
        f: &mut dyn FnMut(StepBuffers<'_>) -> CudaResult<()>,
    ) -> CudaResult<()> {
        f(StepBuffers::Running(&mut self.bn.running))
    }

    fn checkpointed_buffers<'a>(&'a self, out: &mut Vec<&'a DeviceBuffer<f32>>) {
        out.extend([&self.bn.running.mean, &self.bn.running.var]);
    }
}

/// A `Residual` whose body ended in a plain batch norm, and the ReLU after
/// it: y = relu(tail(body(x)) + x), the tail's normalisation, the sum and
/// the ReLU in one kernel (`bn_apply_add`).
#[derive(Debug)]
pub(crate) struct FusedResidualLayer {
    pub body: Vec<Box<dyn CudaLayer>>,
    pub tail: BatchNormLayer,
}

impl CudaLayer for FusedResidualLayer {
    fn describe(&self) -> String {
        "residual batch_norm+add+relu".into()
    }

    fn forward(
        &mut self,
        be: &CudaBackend,
        groups: &Groups,
        input: &Input<'_>,
        pass: Pass,
        mut saved: Option<&mut Vec<Saved>>,
    ) -> CudaResult<(CudaTensor, Keep)> {
        let x = input.tensor();
        let body_input = input.lend();
        let z = forward_list(
            be,
            &mut self.body,
            groups,
            body_input,
            pass,
            saved.as_deref_mut(),
        )?;
        let (y, stats) = batch_norm_forward(be, &mut self.tail, groups, &z, Some(x), true, pass)?;
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
        Ok((y, keep))
    }

    fn backward(
        &mut self,
        be: &CudaBackend,
        groups: &mut Groups,
        saved: &mut Vec<Saved>,
        g: CudaTensor,
    ) -> CudaResult<CudaTensor> {
        let Some(Saved::Output(y)) = saved.pop() else {
            return Err(missing());
        };
        let y = y.take(be)?;
        let Some(Saved::BatchNorm(tail_saved)) = saved.pop() else {
            return Err(missing());
        };
        // The tail's backward masks g in place: g is then the gradient of
        // the skip input as well as of the tail's output.
        let SavedBatchNorm { input, stats, .. } = *tail_saved;
        let mut g = g;
        let dz = with_bn_grads(groups, &self.tail, |gamma, gamma_grad, beta_grad| {
            ops::batch_norm_add_relu_backward(
                be, &mut g, &input, &y, &stats, gamma, gamma_grad, beta_grad,
            )
        })?;
        // Freed before the body's backward, as the unfused path frees them.
        drop((input, stats, y));
        let mut dx = backward_list(be, &mut self.body, groups, saved, dz)?;
        ops::add_inplace(be, &mut dx, &g)?;
        Ok(dx)
    }

    fn fuse_within(&mut self) {
        self.body = fuse(std::mem::take(&mut self.body));
    }

    fn set_conv_plan(&mut self, plan: ConvPlan) {
        self.body.iter_mut().for_each(|l| l.set_conv_plan(plan));
    }

    /// The body's statistics come first, as in the CPU's order.
    fn step_buffers(
        &mut self,
        f: &mut dyn FnMut(StepBuffers<'_>) -> CudaResult<()>,
    ) -> CudaResult<()> {
        self.body.iter_mut().try_for_each(|l| l.step_buffers(f))?;
        f(StepBuffers::Running(&mut self.tail.running))
    }

    fn checkpointed_buffers<'a>(&'a self, out: &mut Vec<&'a DeviceBuffer<f32>>) {
        self.body.iter().for_each(|l| l.checkpointed_buffers(out));
        out.extend([&self.tail.running.mean, &self.tail.running.var]);
    }
}

/// A batch norm's forward, `skip` added before the ReLU when given: the
/// output, and in training the batch statistics backward needs.
#[allow(clippy::too_many_arguments)]
pub(crate) fn batch_norm_forward(
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

/// Lends a batch norm's f32 gamma and the f32 gradients of gamma and beta
/// to `f`.
fn with_bn_grads<R>(
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

// The GPU forms of this family's CPU layers (`Layer::to_cuda`): each takes
// its parameters' places in the order of the CPU layer's `params_mut`.

impl BatchNormGpu {
    /// Its running statistics start at zero here; the network then copies
    /// the CPU layer's in with every other buffer (`set_buffers`).
    pub(crate) fn from_cpu(
        cpu: &crate::layers::BatchNorm2d,
        ctx: &mut crate::cuda::layer::CudaBuildContext<'_, '_>,
    ) -> CudaResult<Box<dyn CudaLayer>> {
        let c = cpu.channels;
        let gamma = ctx.trainable_param(c)?;
        let beta = ctx.trainable_param(c)?;
        let be = ctx.backend();
        Ok(Box::new(BatchNormGpu {
            bn: BatchNormLayer {
                gamma,
                beta,
                running: Box::new(RunningStats {
                    mean: be.alloc_zeros(c)?,
                    var: be.alloc_zeros(c)?,
                    saved_mean: be.alloc_zeros(c)?,
                    saved_var: be.alloc_zeros(c)?,
                }),
                momentum: cpu.momentum,
                eps: cpu.eps,
            },
            relu: cpu.relu,
        }))
    }
}
