//! Layer norm's GPU layer (`CudaLayer`): keeps its input and each row's
//! mean and rstd for backward; γ and β are read in f32 from the masters,
//! and frozen together or not at all (fine-tuning).

use crate::cuda::backend::CudaBackend;
use crate::cuda::layer::{
    master, missing, with_grads, CudaLayer, Groups, Input, Keep, ParamRef, Pass, Saved,
};
use crate::cuda::ops;
use crate::cuda::tensor::CudaTensor;
use crate::cuda::CudaResult;

#[derive(Debug)]
pub(crate) struct LayerNormLayer {
    pub gamma: ParamRef,
    pub beta: ParamRef,
    pub eps: f32,
}

impl CudaLayer for LayerNormLayer {
    fn describe(&self) -> String {
        "layer_norm".into()
    }

    fn forward(
        &mut self,
        be: &CudaBackend,
        groups: &Groups,
        input: &Input<'_>,
        _pass: Pass,
        _saved: Option<&mut Vec<Saved>>,
    ) -> CudaResult<(CudaTensor, Keep)> {
        let (g, b) = (master(groups, &self.gamma), master(groups, &self.beta));
        let (y, stats) = ops::layer_norm_forward(be, input.tensor(), &g, &b, self.eps)?;
        Ok((y, Keep::InputAnd(stats)))
    }

    fn backward(
        &mut self,
        be: &CudaBackend,
        groups: &mut Groups,
        saved: &mut Vec<Saved>,
        g: CudaTensor,
    ) -> CudaResult<CudaTensor> {
        let Some(Saved::LayerNorm(x, stats)) = saved.pop() else {
            return Err(missing());
        };
        let x = x.take(be)?;
        if !self.gamma.trainable() {
            let gamma = master(groups, &self.gamma);
            return ops::layer_norm_backward_input(be, &g, &x, &stats, &gamma);
        }
        with_grads(groups, &self.gamma, Some(&self.beta), |mut v| {
            let Some(beta_grad) = v.other.as_mut().map(|(_, grad)| grad) else {
                return Err(missing());
            };
            ops::layer_norm_backward(be, &g, &x, &stats, &v.master, &mut v.grad, beta_grad)
        })
    }
}

// The GPU forms of this family's CPU layers (`Layer::to_cuda`): each takes
// its parameters' places in the order of the CPU layer's `params_mut`.

impl LayerNormLayer {
    pub(crate) fn from_cpu(
        cpu: &crate::layers::LayerNorm,
        ctx: &mut crate::cuda::layer::CudaBuildContext<'_, '_>,
    ) -> CudaResult<Box<dyn CudaLayer>> {
        let gamma = ctx.param(cpu.features)?;
        let beta = ctx.param(cpu.features)?;
        ctx.same_freezing(&gamma, Some(&beta))?;
        Ok(Box::new(LayerNormLayer {
            gamma,
            beta,
            eps: cpu.eps,
        }))
    }
}
