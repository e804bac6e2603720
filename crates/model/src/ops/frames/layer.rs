//! The ConvLSTM's GPU layer (`CudaLayer`): a ConvLSTM over each sample's
//! frames (images s·F .. s·F + F − 1 of the batch). Keeps its input, its
//! output, every step's cell state and, without `step_recompute` (on
//! under `model.checkpoint`, as on the CPU), every step's activated gates,
//! all in f32 (`ops::conv_lstm_forward`).

use std::sync::Arc;

use crate::cuda::backend::CudaBackend;
use crate::cuda::layer::{
    compute, missing, with_grads, CudaLayer, Groups, Input, Keep, ParamRef, Pass, Saved,
};
use crate::cuda::ops::{self, ConvPlan};
use crate::cuda::tensor::CudaTensor;
use crate::cuda::CudaResult;

#[derive(Debug)]
pub(crate) struct ConvLstmLayer {
    pub weight: ParamRef,
    pub bias: ParamRef,
    pub shape: ops::ConvLstmShape,
    pub plan: ConvPlan,
    pub step_recompute: bool,
}

impl CudaLayer for ConvLstmLayer {
    fn describe(&self) -> String {
        format!("conv_lstm {}", self.shape.hidden)
    }

    fn forward(
        &mut self,
        be: &CudaBackend,
        groups: &Groups,
        input: &Input<'_>,
        _pass: Pass,
        _saved: Option<&mut Vec<Saved>>,
    ) -> CudaResult<(CudaTensor, Keep)> {
        let (w, b) = (compute(groups, &self.weight), compute(groups, &self.bias));
        let (y, kept) = ops::conv_lstm_forward(
            be,
            input.tensor(),
            &w,
            &b,
            self.shape,
            self.plan,
            self.step_recompute,
        )?;
        Ok((y, Keep::ConvLstm(Box::new(kept))))
    }

    fn backward(
        &mut self,
        be: &CudaBackend,
        groups: &mut Groups,
        saved: &mut Vec<Saved>,
        g: CudaTensor,
    ) -> CudaResult<CudaTensor> {
        let Some(Saved::ConvLstm(x, y, kept)) = saved.pop() else {
            return Err(missing());
        };
        let x = x.take(be)?;
        let y: Arc<CudaTensor> = y;
        let (shape, plan) = (self.shape, self.plan);
        with_grads(groups, &self.weight, Some(&self.bias), |mut v| {
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
                shape,
                plan,
            )
        })
    }

    fn set_conv_plan(&mut self, plan: ConvPlan) {
        self.plan = plan;
    }
}

// The GPU forms of this family's CPU layers (`Layer::to_cuda`): each takes
// its parameters' places in the order of the CPU layer's `params_mut`.

impl ConvLstmLayer {
    /// A ConvLSTM reads a sample's frames [t, h, w, c] (`model.frames`),
    /// which the GPU batches as images.
    pub(crate) fn from_cpu(
        cpu: &crate::layers::ConvLstm,
        ctx: &mut crate::cuda::layer::CudaBuildContext<'_, '_>,
    ) -> CudaResult<Box<dyn CudaLayer>> {
        let (Some(frames), &[_, h, w, channels]) = (ctx.frames(), ctx.cpu_shape()) else {
            return Err(
                ctx.shape_error("frames of [h, w, c] images (model.frames)", ctx.cpu_shape())
            );
        };
        let (hidden, kernel) = (cpu.hidden, cpu.conv.k);
        let weight = ctx.trainable_param(kernel * kernel * (channels + hidden) * 4 * hidden)?;
        let bias = ctx.trainable_param(4 * hidden)?;
        Ok(Box::new(ConvLstmLayer {
            weight,
            bias,
            shape: ops::ConvLstmShape {
                frames,
                h,
                w,
                channels,
                hidden,
                kernel,
            },
            plan: ConvPlan::default(),
            step_recompute: cpu.step_recompute,
        }))
    }
}
