//! The elementwise GPU layers (`CudaLayer`): ReLU (keeps its output, or
//! nothing when the fusion folds it into the layer before), SiLU and GELU
//! (keep their input), dropout (keeps nothing: backward draws the mask
//! again from its device-side counter, which is its step buffer).

use crate::cuda::backend::{CudaBackend, DeviceBuffer};
use crate::cuda::layer::{
    missing, CudaLayer, DropoutLayer, Groups, Input, Keep, Pass, Saved, StepBuffers,
};
use crate::cuda::ops;
use crate::cuda::tensor::CudaTensor;
use crate::cuda::CudaResult;

#[derive(Debug)]
pub(crate) struct ReluLayer;

impl CudaLayer for ReluLayer {
    fn describe(&self) -> String {
        "relu".into()
    }

    fn forward(
        &mut self,
        be: &CudaBackend,
        _groups: &Groups,
        input: &Input<'_>,
        _pass: Pass,
        saved: Option<&mut Vec<Saved>>,
    ) -> CudaResult<(CudaTensor, Keep)> {
        let y = ops::relu_forward(be, input.tensor())?;
        let keep = match saved.is_some() {
            true => Keep::Output,
            false => Keep::Other(Saved::Nothing),
        };
        Ok((y, keep))
    }

    fn backward(
        &mut self,
        be: &CudaBackend,
        _groups: &mut Groups,
        saved: &mut Vec<Saved>,
        g: CudaTensor,
    ) -> CudaResult<CudaTensor> {
        let Some(Saved::Output(y)) = saved.pop() else {
            return Err(missing());
        };
        let y = y.take(be)?;
        ops::relu_backward(be, &g, &y)
    }

    fn may_have_params(&self) -> bool {
        false
    }

    fn is_relu(&self) -> bool {
        true
    }
}

/// SiLU or GELU; keeps its input for backward.
#[derive(Debug)]
pub(crate) struct SmoothLayer(pub ops::Smooth);

impl CudaLayer for SmoothLayer {
    fn describe(&self) -> String {
        self.0.name().into()
    }

    fn forward(
        &mut self,
        be: &CudaBackend,
        _groups: &Groups,
        input: &Input<'_>,
        _pass: Pass,
        _saved: Option<&mut Vec<Saved>>,
    ) -> CudaResult<(CudaTensor, Keep)> {
        Ok((
            ops::smooth_forward(be, self.0, input.tensor())?,
            Keep::Input,
        ))
    }

    fn backward(
        &mut self,
        be: &CudaBackend,
        _groups: &mut Groups,
        saved: &mut Vec<Saved>,
        g: CudaTensor,
    ) -> CudaResult<CudaTensor> {
        let Some(Saved::Input(x)) = saved.pop() else {
            return Err(missing());
        };
        let x = x.take(be)?;
        ops::smooth_backward(be, self.0, &g, &x)
    }

    fn may_have_params(&self) -> bool {
        false
    }
}

/// Keeps nothing: backward draws the mask again.
#[derive(Debug)]
pub(crate) struct DropoutGpu(pub Box<DropoutLayer>);

impl CudaLayer for DropoutGpu {
    fn describe(&self) -> String {
        format!("dropout {}", self.0.mask.p)
    }

    fn forward(
        &mut self,
        be: &CudaBackend,
        _groups: &Groups,
        input: &Input<'_>,
        pass: Pass,
        _saved: Option<&mut Vec<Saved>>,
    ) -> CudaResult<(CudaTensor, Keep)> {
        let d = &mut *self.0;
        // A recomputation draws the first pass's mask and counts nothing
        // (evaluation skips the layer in `forward_list`).
        let first_pass = matches!(
            pass,
            Pass::Train {
                update_running: true,
                ..
            }
        );
        let y = ops::dropout_apply(be, d.mask, &d.counter.slice, !first_pass, input.tensor())?;
        if first_pass {
            ops::dropout_count(be, d.mask, &mut d.counter.slice)?;
        }
        Ok((y, Keep::Other(Saved::Nothing)))
    }

    fn backward(
        &mut self,
        be: &CudaBackend,
        _groups: &mut Groups,
        saved: &mut Vec<Saved>,
        g: CudaTensor,
    ) -> CudaResult<CudaTensor> {
        let Some(Saved::Nothing) = saved.pop() else {
            return Err(missing());
        };
        let d = &self.0;
        ops::dropout_apply(be, d.mask, &d.counter.slice, true, &g)
    }

    fn may_have_params(&self) -> bool {
        false
    }

    fn eval_identity(&self) -> bool {
        true
    }

    fn step_buffers(
        &mut self,
        f: &mut dyn FnMut(StepBuffers<'_>) -> CudaResult<()>,
    ) -> CudaResult<()> {
        f(StepBuffers::Dropout(&mut self.0))
    }

    fn checkpointed_buffers<'a>(&'a self, out: &mut Vec<&'a DeviceBuffer<f32>>) {
        out.push(&self.0.counter);
    }
}

// The GPU forms of this family's CPU layers (`Layer::to_cuda`): each takes
// its parameters' places in the order of the CPU layer's `params_mut`.

impl DropoutGpu {
    /// Its mask is drawn with the CPU network's seed for this layer.
    pub(crate) fn from_cpu(
        cpu: &crate::layers::Dropout,
        ctx: &mut crate::cuda::layer::CudaBuildContext<'_, '_>,
    ) -> CudaResult<Box<dyn CudaLayer>> {
        let seed = ctx.dropout_seed()?;
        let be = ctx.backend();
        Ok(Box::new(DropoutGpu(Box::new(DropoutLayer {
            mask: ops::DropoutMask { p: cpu.p, seed },
            counter: be.alloc_zeros(4)?,
            saved: be.alloc_zeros(4)?,
        }))))
    }
}
