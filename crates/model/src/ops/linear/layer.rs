//! The fully connected layer's GPU form (`CudaLayer`): rows [n, features]
//! (a sequence's positions are rows too) times its weight, plus its bias.
//! Keeps its input for backward; a frozen weight (fine-tuning) gets no
//! gradient, only the input's.

use crate::cuda::backend::CudaBackend;
use crate::cuda::layer::{
    compute, missing, with_grads, CudaLayer, Groups, Input, Keep, ParamRef, Pass, Saved,
};
use crate::cuda::ops;
use crate::cuda::tensor::CudaTensor;
use crate::cuda::CudaResult;

#[derive(Debug)]
pub(crate) struct LinearLayer {
    pub weight: ParamRef,
    pub bias: Option<ParamRef>,
    pub out: usize,
}

impl CudaLayer for LinearLayer {
    fn describe(&self) -> String {
        format!("linear to {}", self.out)
    }

    fn forward(
        &mut self,
        be: &CudaBackend,
        groups: &Groups,
        input: &Input<'_>,
        _pass: Pass,
        _saved: Option<&mut Vec<Saved>>,
    ) -> CudaResult<(CudaTensor, Keep)> {
        let b = self.bias.as_ref().map(|b| compute(groups, b));
        let w = compute(groups, &self.weight);
        let y = ops::linear_forward(be, input.tensor(), &w, b.as_ref(), self.out)?;
        Ok((y, Keep::Input))
    }

    fn backward(
        &mut self,
        be: &CudaBackend,
        groups: &mut Groups,
        saved: &mut Vec<Saved>,
        g: CudaTensor,
    ) -> CudaResult<CudaTensor> {
        let Some(Saved::Input(x)) = saved.pop() else {
            return Err(missing());
        };
        if !self.weight.trainable() {
            // Its bias is frozen too (`same_freezing`).
            let inf = x.take(be)?.shape().get(1).copied().unwrap_or(0);
            return ops::linear_backward_input(be, &g, &compute(groups, &self.weight), inf);
        }
        let x = x.take(be)?;
        with_grads(groups, &self.weight, self.bias.as_ref(), |mut v| {
            let bias_grad = v.other.as_mut().map(|(_, grad)| grad);
            ops::linear_backward(be, &x, &g, &v.compute, &mut v.grad, bias_grad)
        })
    }

    fn backward_params_only(
        &mut self,
        be: &CudaBackend,
        groups: &mut Groups,
        saved: &mut Vec<Saved>,
        g: CudaTensor,
    ) -> CudaResult<()> {
        if !self.weight.trainable() {
            return self.backward(be, groups, saved, g).map(drop);
        }
        let Some(Saved::Input(x)) = saved.pop() else {
            return Err(missing());
        };
        let x = x.take(be)?;
        with_grads(groups, &self.weight, self.bias.as_ref(), |mut v| {
            let bias_grad = v.other.as_mut().map(|(_, grad)| grad);
            ops::linear_backward_params(be, &x, &g, &v.compute, &mut v.grad, bias_grad)
        })
    }
}

// The GPU forms of this family's CPU layers (`Layer::to_cuda`): each takes
// its parameters' places in the order of the CPU layer's `params_mut`.

impl LinearLayer {
    pub(crate) fn from_cpu(
        cpu: &crate::layers::Linear,
        ctx: &mut crate::cuda::layer::CudaBuildContext<'_, '_>,
    ) -> CudaResult<Box<dyn CudaLayer>> {
        let out = cpu.out_features;
        let weight = ctx.param(cpu.in_features * out)?;
        let bias = cpu.bias.is_some().then(|| ctx.param(out)).transpose()?;
        ctx.same_freezing(&weight, bias.as_ref())?;
        Ok(Box::new(LinearLayer { weight, bias, out }))
    }
}
