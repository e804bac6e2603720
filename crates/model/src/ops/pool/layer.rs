//! The pooling and reshaping GPU layers (`CudaLayer`): max pooling (keeps
//! one u32 argmax per output and the input's shape, not the input),
//! global average pooling, nearest ×2 upsampling and flatten (keep the
//! input's shape only), and the UNet skip, concat_c(x, body(x)), which
//! keeps nothing of its own (its body's layers keep theirs).

use crate::cuda::backend::{CudaBackend, DeviceBuffer};
use crate::cuda::layer::{
    backward_list, backward_network, fuse, missing, CudaLayer, Groups, Input, Keep, Pass, Saved,
    StepBuffers,
};
use crate::cuda::ops::{self, ConvPlan};
use crate::cuda::tensor::CudaTensor;
use crate::cuda::{CudaError, CudaResult};

/// Max pooling, no padding.
#[derive(Debug)]
pub(crate) struct MaxPoolLayer {
    pub kernel: usize,
    pub stride: usize,
}

impl CudaLayer for MaxPoolLayer {
    fn describe(&self) -> String {
        let (kernel, stride) = (self.kernel, self.stride);
        format!("max_pool {kernel}x{kernel}/{stride}")
    }

    fn forward(
        &mut self,
        be: &CudaBackend,
        _groups: &Groups,
        input: &Input<'_>,
        _pass: Pass,
        saved: Option<&mut Vec<Saved>>,
    ) -> CudaResult<(CudaTensor, Keep)> {
        // Only a pass that keeps activations writes the argmax.
        let keeping = saved.is_some();
        let (y, kept) =
            ops::max_pool_forward(be, input.tensor(), self.kernel, self.stride, keeping)?;
        let keep = match kept {
            Some(kept) => Saved::MaxPool(Box::new(kept)),
            None => Saved::Nothing,
        };
        Ok((y, Keep::Other(keep)))
    }

    fn backward(
        &mut self,
        be: &CudaBackend,
        _groups: &mut Groups,
        saved: &mut Vec<Saved>,
        g: CudaTensor,
    ) -> CudaResult<CudaTensor> {
        let Some(Saved::MaxPool(kept)) = saved.pop() else {
            return Err(missing());
        };
        ops::max_pool_backward(be, &g, &kept)
    }

    fn may_have_params(&self) -> bool {
        false
    }
}

#[derive(Debug)]
pub(crate) struct GlobalAvgPoolLayer;

impl CudaLayer for GlobalAvgPoolLayer {
    fn describe(&self) -> String {
        "global_avg_pool".into()
    }

    fn forward(
        &mut self,
        be: &CudaBackend,
        _groups: &Groups,
        input: &Input<'_>,
        _pass: Pass,
        _saved: Option<&mut Vec<Saved>>,
    ) -> CudaResult<(CudaTensor, Keep)> {
        let x = input.tensor();
        let y = ops::global_avg_pool_forward(be, x)?;
        Ok((y, Keep::Other(Saved::Shape(x.shape().to_vec()))))
    }

    fn backward(
        &mut self,
        be: &CudaBackend,
        _groups: &mut Groups,
        saved: &mut Vec<Saved>,
        g: CudaTensor,
    ) -> CudaResult<CudaTensor> {
        let Some(Saved::Shape(shape)) = saved.pop() else {
            return Err(missing());
        };
        ops::global_avg_pool_backward(be, &g, &shape)
    }

    fn may_have_params(&self) -> bool {
        false
    }
}

/// Nearest-neighbour ×2; keeps the input's shape.
#[derive(Debug)]
pub(crate) struct Upsample2xLayer;

impl CudaLayer for Upsample2xLayer {
    fn describe(&self) -> String {
        "upsample2x".into()
    }

    fn forward(
        &mut self,
        be: &CudaBackend,
        _groups: &Groups,
        input: &Input<'_>,
        _pass: Pass,
        _saved: Option<&mut Vec<Saved>>,
    ) -> CudaResult<(CudaTensor, Keep)> {
        let x = input.tensor();
        let y = ops::upsample2x_forward(be, x)?;
        Ok((y, Keep::Other(Saved::Shape(x.shape().to_vec()))))
    }

    fn backward(
        &mut self,
        be: &CudaBackend,
        _groups: &mut Groups,
        saved: &mut Vec<Saved>,
        g: CudaTensor,
    ) -> CudaResult<CudaTensor> {
        let Some(Saved::Shape(shape)) = saved.pop() else {
            return Err(missing());
        };
        ops::upsample2x_backward(be, &g, &shape)
    }

    fn may_have_params(&self) -> bool {
        false
    }
}

/// [n, h, w, c] -> [n, h·w·c]: the same bytes (NHWC is the CPU's order),
/// so no kernel; a copy only where its input is still held. The walk
/// (`forward_list`) does its forward.
#[derive(Debug)]
pub(crate) struct FlattenLayer;

impl CudaLayer for FlattenLayer {
    fn describe(&self) -> String {
        "flatten".into()
    }

    fn forward(
        &mut self,
        _be: &CudaBackend,
        _groups: &Groups,
        _input: &Input<'_>,
        _pass: Pass,
        _saved: Option<&mut Vec<Saved>>,
    ) -> CudaResult<(CudaTensor, Keep)> {
        // A reshape of the input itself, which `forward_list` does.
        Err(CudaError::Unsupported {
            op: "CudaNetwork::forward",
            reason: "flatten outside forward_list".into(),
        })
    }

    fn backward(
        &mut self,
        _be: &CudaBackend,
        _groups: &mut Groups,
        saved: &mut Vec<Saved>,
        g: CudaTensor,
    ) -> CudaResult<CudaTensor> {
        let Some(Saved::Shape(shape)) = saved.pop() else {
            return Err(missing());
        };
        g.reshape(&shape)
    }

    fn may_have_params(&self) -> bool {
        false
    }

    fn flattens(&self) -> bool {
        true
    }
}

/// concat_c(x, body(x)); `channels` is x's. Keeps nothing of its own.
#[derive(Debug)]
pub(crate) struct UnetSkipLayer {
    pub body: Vec<Box<dyn CudaLayer>>,
    pub channels: usize,
}

impl CudaLayer for UnetSkipLayer {
    fn describe(&self) -> String {
        "unet_skip concat".into()
    }

    fn forward(
        &mut self,
        be: &CudaBackend,
        groups: &Groups,
        input: &Input<'_>,
        pass: Pass,
        saved: Option<&mut Vec<Saved>>,
    ) -> CudaResult<(CudaTensor, Keep)> {
        let z = forward_list(be, &mut self.body, groups, input.lend(), pass, saved)?;
        let y = ops::channels_concat(be, input.tensor(), &z)?;
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
        let (mut dx, g_body) = ops::channels_split(be, &g, self.channels)?;
        drop(g);
        let dx_body = backward_list(be, &mut self.body, groups, saved, g_body)?;
        ops::add_inplace(be, &mut dx, &dx_body)?;
        Ok(dx)
    }

    /// The skip's share of the gradient goes nowhere; the body is first in
    /// the network too.
    fn backward_params_only(
        &mut self,
        be: &CudaBackend,
        groups: &mut Groups,
        saved: &mut Vec<Saved>,
        g: CudaTensor,
    ) -> CudaResult<()> {
        let _ = saved.pop().ok_or_else(missing)?;
        let (_, g_body) = ops::channels_split(be, &g, self.channels)?;
        drop(g);
        backward_network(be, &mut self.body, groups, saved, g_body)
    }

    fn fuse_within(&mut self) {
        self.body = fuse(std::mem::take(&mut self.body));
    }

    fn set_conv_plan(&mut self, plan: ConvPlan) {
        self.body.iter_mut().for_each(|l| l.set_conv_plan(plan));
    }

    fn step_buffers(
        &mut self,
        f: &mut dyn FnMut(StepBuffers<'_>) -> CudaResult<()>,
    ) -> CudaResult<()> {
        self.body.iter_mut().try_for_each(|l| l.step_buffers(f))
    }

    fn checkpointed_buffers<'a>(&'a self, out: &mut Vec<&'a DeviceBuffer<f32>>) {
        self.body.iter().for_each(|l| l.checkpointed_buffers(out));
    }
}

use crate::cuda::layer::forward_list;

// The GPU forms of this family's CPU layers (`Layer::to_cuda`): each takes
// its parameters' places in the order of the CPU layer's `params_mut`.

impl MaxPoolLayer {
    pub(crate) fn from_cpu(
        cpu: &crate::layers::MaxPool2d,
        _ctx: &mut crate::cuda::layer::CudaBuildContext<'_, '_>,
    ) -> CudaResult<Box<dyn CudaLayer>> {
        Ok(Box::new(MaxPoolLayer {
            kernel: cpu.kernel,
            stride: cpu.stride,
        }))
    }
}

impl UnetSkipLayer {
    pub(crate) fn from_cpu(
        cpu: &crate::layers::UnetSkip,
        ctx: &mut crate::cuda::layer::CudaBuildContext<'_, '_>,
    ) -> CudaResult<Box<dyn CudaLayer>> {
        let Some(&channels) = ctx.input_shape().last() else {
            return Err(ctx.shape_error("an image input [h, w, c]", ctx.input_shape()));
        };
        let body = ctx.convert_all(&cpu.body)?;
        Ok(Box::new(UnetSkipLayer { body, channels }))
    }
}
