//! The generic GPU containers (`CudaLayer`s holding layers): a residual,
//! y = x + body(x), and a checkpointed segment (`model.checkpoint`), which
//! keeps only its input after forward and runs again in backward (batch
//! norm on the same batch statistics, running statistics untouched), so
//! gradients are bit for bit those of a run without it. Neither keeps
//! anything else of its own; the body's layers keep theirs.

use crate::cuda::backend::{CudaBackend, DeviceBuffer};
use crate::cuda::layer::{
    backward_list, forward_list, fuse, missing, Absorbed, CudaLayer, Groups, Input, Keep, Pass,
    Saved, StepBuffers,
};
use crate::cuda::ops::{self, ConvPlan};
use crate::cuda::tensor::CudaTensor;
use crate::cuda::CudaResult;
use crate::ops::batch_norm::layer::FusedResidualLayer;

#[derive(Debug)]
pub(crate) struct ResidualLayer(pub Vec<Box<dyn CudaLayer>>);

impl CudaLayer for ResidualLayer {
    fn describe(&self) -> String {
        "residual add".into()
    }

    fn forward(
        &mut self,
        be: &CudaBackend,
        groups: &Groups,
        input: &Input<'_>,
        pass: Pass,
        saved: Option<&mut Vec<Saved>>,
    ) -> CudaResult<(CudaTensor, Keep)> {
        let mut y = forward_list(be, &mut self.0, groups, input.lend(), pass, saved)?;
        ops::add_inplace(be, &mut y, input.tensor())?;
        Ok((y, Keep::Other(Saved::Nothing)))
    }

    fn backward(
        &mut self,
        be: &CudaBackend,
        groups: &mut Groups,
        saved: &mut Vec<Saved>,
        g: CudaTensor,
    ) -> CudaResult<CudaTensor> {
        let _ = saved.pop().ok_or_else(missing)?;
        let dx = backward_list(be, &mut self.0, groups, saved, g.try_clone(be)?)?;
        ops::add(be, &dx, &g)
    }

    /// A body that ends in a plain batch norm becomes a fused residual
    /// with that batch norm as its tail.
    fn absorb_relu(&mut self) -> Absorbed {
        if !self.0.last().is_some_and(|l| l.is_plain_batch_norm()) {
            return Absorbed::No;
        }
        let mut body = std::mem::take(&mut self.0);
        match body.pop().and_then(|last| last.into_batch_norm()) {
            Some(tail) => Absorbed::Replace(Box::new(FusedResidualLayer { body, tail })),
            None => {
                // `is_plain_batch_norm` said it would be one.
                self.0 = body;
                Absorbed::No
            }
        }
    }

    fn fuse_within(&mut self) {
        self.0 = fuse(std::mem::take(&mut self.0));
    }

    fn set_conv_plan(&mut self, plan: ConvPlan) {
        self.0.iter_mut().for_each(|l| l.set_conv_plan(plan));
    }

    fn step_buffers(
        &mut self,
        f: &mut dyn FnMut(StepBuffers<'_>) -> CudaResult<()>,
    ) -> CudaResult<()> {
        self.0.iter_mut().try_for_each(|l| l.step_buffers(f))
    }

    fn checkpointed_buffers<'a>(&'a self, out: &mut Vec<&'a DeviceBuffer<f32>>) {
        self.0.iter().for_each(|l| l.checkpointed_buffers(out));
    }
}

/// A segment whose activations are dropped after forward and recomputed
/// in backward (`model.checkpoint`): it keeps only its input.
#[derive(Debug)]
pub(crate) struct CheckpointedLayer(pub Vec<Box<dyn CudaLayer>>);

impl CudaLayer for CheckpointedLayer {
    fn describe(&self) -> String {
        "checkpointed segment (its own layers apart)".into()
    }

    fn forward(
        &mut self,
        be: &CudaBackend,
        groups: &Groups,
        input: &Input<'_>,
        pass: Pass,
        _saved: Option<&mut Vec<Saved>>,
    ) -> CudaResult<(CudaTensor, Keep)> {
        let y = forward_list(be, &mut self.0, groups, input.lend(), pass, None)?;
        Ok((y, Keep::Segment))
    }

    fn backward(
        &mut self,
        be: &CudaBackend,
        groups: &mut Groups,
        saved: &mut Vec<Saved>,
        g: CudaTensor,
    ) -> CudaResult<CudaTensor> {
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
        let x = Input::Shared(x.take(be)?, None);
        drop(forward_list(
            be,
            &mut self.0,
            groups,
            x,
            again,
            Some(&mut inner),
        )?);
        backward_list(be, &mut self.0, groups, &mut inner, g)
    }

    fn fuse_within(&mut self) {
        self.0 = fuse(std::mem::take(&mut self.0));
    }

    fn set_conv_plan(&mut self, plan: ConvPlan) {
        self.0.iter_mut().for_each(|l| l.set_conv_plan(plan));
    }

    fn step_buffers(
        &mut self,
        f: &mut dyn FnMut(StepBuffers<'_>) -> CudaResult<()>,
    ) -> CudaResult<()> {
        self.0.iter_mut().try_for_each(|l| l.step_buffers(f))
    }

    fn checkpointed_buffers<'a>(&'a self, out: &mut Vec<&'a DeviceBuffer<f32>>) {
        self.0.iter().for_each(|l| l.checkpointed_buffers(out));
    }
}

// The GPU forms of this family's CPU layers (`Layer::to_cuda`): each takes
// its parameters' places in the order of the CPU layer's `params_mut`.

impl ResidualLayer {
    pub(crate) fn from_cpu(
        cpu: &crate::layers::Residual,
        ctx: &mut crate::cuda::layer::CudaBuildContext<'_, '_>,
    ) -> CudaResult<Box<dyn CudaLayer>> {
        Ok(Box::new(ResidualLayer(ctx.convert_all(&cpu.body)?)))
    }
}
