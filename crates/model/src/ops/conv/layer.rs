//! The convolutions' GPU layers (`CudaLayer`): a dense convolution and a
//! depthwise one. Each keeps its input for backward (a reference to the
//! activation the layer before it made, `Keep::Input`), nothing else; its
//! weights are ranges of the network's groups.

use crate::cuda::backend::CudaBackend;
use crate::cuda::layer::{
    compute, conv_shape, missing, with_grads, CudaLayer, Groups, Input, Keep, ParamRef, Pass, Saved,
};
use crate::cuda::ops::{self, ConvPlan};
use crate::cuda::tensor::CudaTensor;
use crate::cuda::CudaResult;

/// A convolution: implicit GEMM or im2col + cuBLAS (`plan`).
#[derive(Debug)]
pub(crate) struct ConvLayer {
    pub weight: ParamRef,
    pub bias: Option<ParamRef>,
    pub kernel: usize,
    pub stride: usize,
    pub pad: usize,
    pub cout: usize,
    /// Its algorithm and im2col workspace (`CudaBuildOptions`).
    pub plan: ConvPlan,
}

impl CudaLayer for ConvLayer {
    fn describe(&self) -> String {
        let (kernel, stride, cout) = (self.kernel, self.stride, self.cout);
        format!("conv {kernel}x{kernel}/{stride} to {cout}")
    }

    fn forward(
        &mut self,
        be: &CudaBackend,
        groups: &Groups,
        input: &Input<'_>,
        _pass: Pass,
        _saved: Option<&mut Vec<Saved>>,
    ) -> CudaResult<(CudaTensor, Keep)> {
        let x = input.tensor();
        let s = conv_shape(x, self.kernel, self.stride, self.pad, self.cout)?;
        let b = self.bias.as_ref().map(|b| compute(groups, b));
        let w = compute(groups, &self.weight);
        let y = ops::conv2d_forward(be, x, &w, b.as_ref(), s, self.plan)?;
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
        let x = x.take(be)?;
        let s = conv_shape(&x, self.kernel, self.stride, self.pad, self.cout)?;
        let plan = self.plan;
        with_grads(groups, &self.weight, self.bias.as_ref(), |mut v| {
            let bias_grad = v.other.as_mut().map(|(_, grad)| grad);
            ops::conv2d_backward(be, &x, &g, &v.compute, &mut v.grad, bias_grad, s, plan)
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
        let s = conv_shape(&x, self.kernel, self.stride, self.pad, self.cout)?;
        let plan = self.plan;
        with_grads(groups, &self.weight, self.bias.as_ref(), |mut v| {
            let bias_grad = v.other.as_mut().map(|(_, grad)| grad);
            ops::conv2d_backward_params(be, &x, &g, &v.compute, &mut v.grad, bias_grad, s, plan)
        })
    }

    fn set_conv_plan(&mut self, plan: ConvPlan) {
        self.plan = plan;
    }
}

/// Depthwise convolution (direct kernels).
#[derive(Debug)]
pub(crate) struct DepthwiseConvLayer {
    pub weight: ParamRef,
    pub bias: Option<ParamRef>,
    pub shape: ops::DepthwiseShape,
}

impl CudaLayer for DepthwiseConvLayer {
    fn describe(&self) -> String {
        format!(
            "depthwise_conv {k}x{k}/{s} x{m}",
            k = self.shape.kernel,
            s = self.shape.stride,
            m = self.shape.multiplier
        )
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
        let y = ops::depthwise_forward(be, input.tensor(), &w, b.as_ref(), self.shape)?;
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
        let x = x.take(be)?;
        let shape = self.shape;
        with_grads(groups, &self.weight, self.bias.as_ref(), |mut v| {
            let bias_grad = v.other.as_mut().map(|(_, grad)| grad);
            ops::depthwise_backward(be, &x, &g, &v.compute, &mut v.grad, bias_grad, shape)
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
        let shape = self.shape;
        with_grads(groups, &self.weight, self.bias.as_ref(), |mut v| {
            let bias_grad = v.other.as_mut().map(|(_, grad)| grad);
            ops::depthwise_backward_params(be, &x, &g, &mut v.grad, bias_grad, shape)
        })
    }
}

// The GPU forms of this family's CPU layers (`Layer::to_cuda`): each takes
// its parameters' places in the order of the CPU layer's `params_mut`.

impl ConvLayer {
    pub(crate) fn from_cpu(
        cpu: &crate::layers::Conv2d,
        ctx: &mut crate::cuda::layer::CudaBuildContext<'_, '_>,
    ) -> CudaResult<Box<dyn CudaLayer>> {
        let (k, cout) = (cpu.k, cpu.cout);
        let weight = ctx.trainable_param(k * k * cpu.cin * cout)?;
        let bias = cpu
            .bias
            .is_some()
            .then(|| ctx.trainable_param(cout))
            .transpose()?;
        Ok(Box::new(ConvLayer {
            weight,
            bias,
            kernel: k,
            stride: cpu.stride,
            pad: cpu.pad,
            cout,
            plan: ConvPlan::default(),
        }))
    }
}

impl DepthwiseConvLayer {
    pub(crate) fn from_cpu(
        cpu: &crate::layers::DepthwiseConv2d,
        ctx: &mut crate::cuda::layer::CudaBuildContext<'_, '_>,
    ) -> CudaResult<Box<dyn CudaLayer>> {
        let cout = cpu.c * cpu.m;
        let weight = ctx.trainable_param(cpu.k * cpu.k * cout)?;
        let bias = cpu
            .bias
            .is_some()
            .then(|| ctx.trainable_param(cout))
            .transpose()?;
        Ok(Box::new(DepthwiseConvLayer {
            weight,
            bias,
            shape: ops::DepthwiseShape {
                kernel: cpu.k,
                stride: cpu.stride,
                pad: cpu.pad,
                multiplier: cpu.m,
            },
        }))
    }
}
