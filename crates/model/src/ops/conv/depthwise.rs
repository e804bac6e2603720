//! Depthwise convolution's launches (`depthwise.cu`): direct
//! kernels, no im2col and no cuBLAS; the weight gradient by per-image
//! partials summed in image order, so f32 gives the CPU's bits
//! (`layers::DepthwiseConv2d`, whose header states the order of every sum).

use cudarc::driver::{CudaViewMut, PushKernelArg};

use crate::cuda::backend::CudaBackend;
use crate::cuda::kernels as k;
use crate::cuda::launch::*;
use crate::cuda::params::*;
use crate::cuda::tensor::{same_dtype, AnyView, CudaTensor};
use crate::cuda::{CudaError, CudaResult};

/// The layer's settings: `multiplier` `kernel`×`kernel` filters per input
/// channel, every `stride` pixels, `pad` zeros around.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DepthwiseShape {
    pub kernel: usize,
    pub stride: usize,
    pub pad: usize,
    pub multiplier: usize,
}

impl DepthwiseShape {
    /// The kernels' parameters for input `x_shape` [n, h, w, c], and the
    /// output shape [n, oh, ow, c·multiplier].
    fn params(
        &self,
        op: &'static str,
        x_shape: &[usize],
        bias: bool,
    ) -> CudaResult<(DepthwiseParams, [usize; 4])> {
        let [n, h, w, c] = nhwc(op, x_shape)?;
        let side = |d: usize| {
            if d == 0 || self.stride == 0 || self.kernel == 0 || self.multiplier == 0 {
                return None;
            }
            let span = (d + 2 * self.pad).checked_sub(self.kernel)?;
            Some(span / self.stride + 1)
        };
        let (Some(oh), Some(ow)) = (side(h), side(w)) else {
            return Err(CudaError::shape(
                op,
                format!(
                    "an image of at least {k}x{k} after padding {p} (positive stride and \
                     multiplier)",
                    k = self.kernel,
                    p = self.pad
                ),
                format!("{x_shape:?}"),
            ));
        };
        let cout = c * self.multiplier;
        u32_of(op, n * oh * ow * cout)?;
        u32_of(op, n * h * w * c)?;
        u32_of(op, n * (self.kernel * self.kernel + 1) * cout)?;
        let p = DepthwiseParams {
            n: u32_of(op, n)?,
            h: u32_of(op, h)?,
            w: u32_of(op, w)?,
            c: u32_of(op, c)?,
            m: u32_of(op, self.multiplier)?,
            oh: u32_of(op, oh)?,
            ow: u32_of(op, ow)?,
            kernel: u32_of(op, self.kernel)?,
            stride: u32_of(op, self.stride)?,
            pad: u32_of(op, self.pad)?,
            bias: bias as u32,
        };
        Ok((p, [n, oh, ow, cout]))
    }

    fn weight_len(&self, channels: usize) -> usize {
        self.kernel * self.kernel * channels * self.multiplier
    }
}

/// y = depthwise(x, W) (+ bias): x [n, h, w, c], W [k, k, c·m] and bias
/// [c·m] of x's storage type.
pub fn depthwise_forward(
    be: &CudaBackend,
    x: &CudaTensor,
    weight: &AnyView<'_>,
    bias: Option<&AnyView<'_>>,
    s: DepthwiseShape,
) -> CudaResult<CudaTensor> {
    let op = "depthwise_conv";
    let (p, out) = s.params(op, x.shape(), bias.is_some())?;
    let c = x.shape()[3];
    same_dtype(op, x.dtype(), &[weight.dtype()])?;
    same_len(op, "weight", s.weight_len(c), weight.len())?;
    if let Some(b) = bias {
        same_dtype(op, x.dtype(), &[b.dtype()])?;
        same_len(op, "bias", out[3], b.len())?;
    }
    let mut y = CudaTensor::uninit(be, &out, x.dtype())?;
    if y.is_empty() {
        return Ok(y);
    }
    let f = be.function(k::DEPTHWISE_FORWARD.of(x.dtype()))?;
    // Without a bias the kernel reads none (p.bias = 0): W stands in.
    let bias = bias.unwrap_or(weight);
    // SAFETY: depthwise_forward_T(DepthwiseParams of x, const T* x
    // [n, h, w, c], const T* w [k, k, c·m], const T* bias [c·m] (read only
    // when p.bias = 1), T* y [n, oh, ow, c·m]): lengths and types checked
    // above, y allocated with the output shape.
    unsafe {
        launch(
            be.compute_stream(),
            &f,
            elementwise(y.len()),
            "depthwise_forward",
            |b| {
                b.arg(&p).arg(x).arg(weight).arg(bias).arg(&mut y);
            },
        )
    }?;
    Ok(y)
}

/// dW += Σ x·g and db += Σ g over the batch (f32, accumulated), by
/// per-image partials summed in image order.
pub fn depthwise_backward_params(
    be: &CudaBackend,
    x: &CudaTensor,
    g: &CudaTensor,
    weight_grad: &mut CudaViewMut<'_, f32>,
    bias_grad: Option<&mut CudaViewMut<'_, f32>>,
    s: DepthwiseShape,
) -> CudaResult<()> {
    let op = "depthwise_conv backward";
    let (p, out) = s.params(op, x.shape(), bias_grad.is_some())?;
    g.expect_shape(op, &out)?;
    same_dtype(op, x.dtype(), &[g.dtype()])?;
    let [n, _, _, cout] = out;
    let kk = s.kernel * s.kernel;
    same_len(op, "weight gradient", kk * cout, weight_grad.len())?;
    if let Some(db) = bias_grad.as_ref() {
        same_len(op, "bias gradient", cout, db.len())?;
    }
    if n == 0 || g.is_empty() {
        return Ok(());
    }
    let row = (kk + p.bias as usize) * cout;
    let mut partial = be.alloc::<f32>(n * row)?;
    let f = be.function(k::DEPTHWISE_WGRAD_PARTIAL.of(x.dtype()))?;
    // SAFETY: depthwise_wgrad_partial_T(DepthwiseParams of x, const T* x
    // [n, h, w, c], const T* g [n, oh, ow, c·m], float* partial
    // [n, k·k + bias, c·m]): g's shape checked above, partial allocated with
    // n·row elements.
    unsafe {
        launch(
            be.compute_stream(),
            &f,
            elementwise(n * row),
            "depthwise_wgrad_partial",
            |b| {
                b.arg(&p).arg(x).arg(g).arg(&mut partial.slice);
            },
        )
    }?;
    let reduce = be.function(&k::DEPTHWISE_WGRAD_REDUCE)?;
    let add = |grad: &mut CudaViewMut<'_, f32>, offset: usize| -> CudaResult<()> {
        let rp = DepthwiseReduceParams {
            images: n as u32,
            len: grad.len() as u32,
            offset: offset as u32,
            row: row as u32,
        };
        // SAFETY: depthwise_wgrad_reduce(DepthwiseReduceParams, const float*
        // partial [images, row], float* grad [len]): offset + len <= row
        // (the weight's k·k·c·m from 0, the bias's c·m after them), grad's
        // length checked above.
        unsafe {
            launch(
                be.compute_stream(),
                &reduce,
                elementwise(grad.len()),
                "depthwise_wgrad_reduce",
                |b| {
                    b.arg(&rp).arg(&partial.slice).arg(grad);
                },
            )
        }
    };
    add(weight_grad, 0)?;
    if let Some(db) = bias_grad {
        add(db, kk * cout)?;
    }
    Ok(())
}

/// Backward: the parameter gradients as `depthwise_backward_params`, and
/// dx [n, h, w, c] by a gather per input pixel.
#[allow(clippy::too_many_arguments)]
pub fn depthwise_backward(
    be: &CudaBackend,
    x: &CudaTensor,
    g: &CudaTensor,
    weight: &AnyView<'_>,
    weight_grad: &mut CudaViewMut<'_, f32>,
    bias_grad: Option<&mut CudaViewMut<'_, f32>>,
    s: DepthwiseShape,
) -> CudaResult<CudaTensor> {
    depthwise_backward_params(be, x, g, weight_grad, bias_grad, s)?;
    let op = "depthwise_conv backward";
    let (p, _) = s.params(op, x.shape(), false)?;
    same_dtype(op, x.dtype(), &[weight.dtype()])?;
    same_len(op, "weight", s.weight_len(x.shape()[3]), weight.len())?;
    let mut dx = CudaTensor::uninit(be, x.shape(), x.dtype())?;
    if dx.is_empty() {
        return Ok(dx);
    }
    let f = be.function(k::DEPTHWISE_BACKWARD_INPUT.of(x.dtype()))?;
    // SAFETY: depthwise_backward_input_T(DepthwiseParams of x, const T* g
    // [n, oh, ow, c·m], const T* w [k, k, c·m], T* dx [n, h, w, c]): g's
    // shape checked by depthwise_backward_params, W's length above, dx
    // allocated with x's shape.
    unsafe {
        launch(
            be.compute_stream(),
            &f,
            elementwise(dx.len()),
            "depthwise_backward_input",
            |b| {
                b.arg(&p).arg(g).arg(weight).arg(&mut dx);
            },
        )
    }?;
    Ok(dx)
}
