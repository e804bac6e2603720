use cudarc::driver::PushKernelArg;

use crate::cuda::backend::{CudaBackend, DeviceBuffer};
use crate::cuda::kernels::{self as k};
use crate::cuda::launch::*;
use crate::cuda::params::*;
use crate::cuda::tensor::{same_dtype, CudaTensor};
use crate::cuda::{CudaError, CudaResult};

// ---------------------------------------------------------------------------
// UNet pieces

fn image_dims(op: &'static str, shape: &[usize]) -> CudaResult<UpsampleParams> {
    match *shape {
        [n, h, w, c] => Ok(UpsampleParams {
            n: u32_of(op, n)?,
            h: u32_of(op, h)?,
            w: u32_of(op, w)?,
            c: u32_of(op, c)?,
        }),
        _ => Err(CudaError::shape(
            op,
            "an image batch [n, h, w, c]",
            format!("{shape:?}"),
        )),
    }
}

/// Nearest-neighbour ×2: [n, h, w, c] -> [n, 2h, 2w, c].
pub fn upsample2x_forward(be: &CudaBackend, x: &CudaTensor) -> CudaResult<CudaTensor> {
    let p = image_dims("upsample2x", x.shape())?;
    let (n, h, w, c) = (x.shape()[0], x.shape()[1], x.shape()[2], x.shape()[3]);
    let mut y = CudaTensor::uninit(be, &[n, 2 * h, 2 * w, c], x.dtype())?;
    if !y.is_empty() {
        let cfg = elementwise(y.len());
        let f = be.function(k::UPSAMPLE2X_FORWARD.of(x.dtype()))?;
        // SAFETY: upsample2x_forward_T(UpsampleParams of x, const T* x
        // [n, h, w, c], T* y [n, 2h, 2w, c]).
        unsafe {
            launch(be.compute_stream(), &f, cfg, "upsample2x_forward", |b| {
                b.arg(&p).arg(x).arg(&mut y);
            })
        }?;
    }
    Ok(y)
}

/// Upsample2x backward: each element of `input_shape` the sum of its 2×2
/// block of `g`.
pub fn upsample2x_backward(
    be: &CudaBackend,
    g: &CudaTensor,
    input_shape: &[usize],
) -> CudaResult<CudaTensor> {
    let p = image_dims("upsample2x backward", input_shape)?;
    let [n, h, w, c] = *input_shape else {
        return Err(CudaError::shape(
            "upsample2x backward",
            "[n, h, w, c]",
            format!("{input_shape:?}"),
        ));
    };
    g.expect_shape("upsample2x backward", &[n, 2 * h, 2 * w, c])?;
    let mut dx = CudaTensor::uninit(be, input_shape, g.dtype())?;
    if !dx.is_empty() {
        let cfg = elementwise(dx.len());
        let f = be.function(k::UPSAMPLE2X_BACKWARD.of(g.dtype()))?;
        // SAFETY: upsample2x_backward_T(UpsampleParams of dx, const T* g
        // [n, 2h, 2w, c], T* dx [n, h, w, c]) (shapes checked above).
        unsafe {
            launch(be.compute_stream(), &f, cfg, "upsample2x_backward", |b| {
                b.arg(&p).arg(g).arg(&mut dx);
            })
        }?;
    }
    Ok(dx)
}

/// Every index but the channels' (rows), and the channels, of `t`.
fn rows_and_channels(op: &'static str, t: &CudaTensor) -> CudaResult<(Vec<usize>, usize)> {
    match t.shape() {
        [lead @ .., c] if !lead.is_empty() => Ok((lead.to_vec(), *c)),
        shape => Err(CudaError::shape(op, "[n, ..., c]", format!("{shape:?}"))),
    }
}

/// `a` and `b` side by side along the channels (unet_skip's output); every
/// other axis must agree.
pub fn channels_concat(
    be: &CudaBackend,
    a: &CudaTensor,
    b_in: &CudaTensor,
) -> CudaResult<CudaTensor> {
    let (lead, c1) = rows_and_channels("channels_concat", a)?;
    let (lead_b, c2) = rows_and_channels("channels_concat", b_in)?;
    if lead != lead_b {
        return Err(CudaError::shape(
            "channels_concat",
            format!("{lead:?} and any channels"),
            format!("{:?}", b_in.shape()),
        ));
    }
    same_dtype("channels_concat", a.dtype(), &[b_in.dtype()])?;
    let rows: usize = lead.iter().product();
    let p = ConcatParams {
        rows: u32_of("channels_concat", rows)?,
        c1: u32_of("channels_concat", c1)?,
        c2: u32_of("channels_concat", c2)?,
    };
    let mut shape = lead;
    shape.push(c1 + c2);
    let mut y = CudaTensor::uninit(be, &shape, a.dtype())?;
    if !y.is_empty() {
        let cfg = elementwise(y.len());
        let f = be.function(k::CHANNELS_CONCAT.of(a.dtype()))?;
        // SAFETY: channels_concat_T(ConcatParams, const T* a [rows, c1],
        // const T* b [rows, c2], T* y [rows, c1 + c2]).
        unsafe {
            launch(be.compute_stream(), &f, cfg, "channels_concat", |b| {
                b.arg(&p).arg(a).arg(b_in).arg(&mut y);
            })
        }?;
    }
    Ok(y)
}

/// `g` split along the channels into its first `c1` and the rest.
pub fn channels_split(
    be: &CudaBackend,
    g: &CudaTensor,
    c1: usize,
) -> CudaResult<(CudaTensor, CudaTensor)> {
    let (lead, c) = rows_and_channels("channels_split", g)?;
    if c1 > c {
        return Err(CudaError::shape(
            "channels_split",
            format!("at least {c1} channels"),
            format!("{:?}", g.shape()),
        ));
    }
    let rows: usize = lead.iter().product();
    let p = ConcatParams {
        rows: u32_of("channels_split", rows)?,
        c1: c1 as u32,
        c2: (c - c1) as u32,
    };
    let shape_of = |channels: usize| {
        let mut s = lead.clone();
        s.push(channels);
        s
    };
    let mut ga = CudaTensor::uninit(be, &shape_of(c1), g.dtype())?;
    let mut gb = CudaTensor::uninit(be, &shape_of(c - c1), g.dtype())?;
    if !g.is_empty() {
        let f = be.function(k::CHANNELS_SPLIT.of(g.dtype()))?;
        // SAFETY: channels_split_T(ConcatParams, const T* g [rows, c1 + c2],
        // T* ga [rows, c1], T* gb [rows, c2]).
        unsafe {
            launch(
                be.compute_stream(),
                &f,
                elementwise(g.len()),
                "channels_split",
                |b| {
                    b.arg(&p).arg(g).arg(&mut ga).arg(&mut gb);
                },
            )
        }?;
    }
    Ok((ga, gb))
}

// ---------------------------------------------------------------------------
// Global average pooling

fn pool_params(n: usize, hw: usize, c: usize) -> CudaResult<PoolParams> {
    Ok(PoolParams {
        n: u32_of("global_avg_pool", n)?,
        hw: u32_of("global_avg_pool", hw)?,
        c: u32_of("global_avg_pool", c)?,
        inv_hw: 1.0 / hw.max(1) as f32,
    })
}

/// [n, h, w, c] → [n, c].
pub fn global_avg_pool_forward(be: &CudaBackend, x: &CudaTensor) -> CudaResult<CudaTensor> {
    let [n, h, w, c] = nhwc("global_avg_pool", x.shape())?;
    let mut y = CudaTensor::uninit(be, &[n, c], x.dtype())?;
    if n * c == 0 {
        return Ok(y);
    }
    let p = pool_params(n, h * w, c)?;
    let f = be.function(k::POOL_FORWARD.of(x.dtype()))?;
    {
        // SAFETY: global_avg_pool_forward_T(PoolParams, const T* x
        // [n, hw, c], T* y [n, c]).
        unsafe {
            launch(
                be.compute_stream(),
                &f,
                elementwise(n * c),
                "global_avg_pool_forward",
                |b| {
                    b.arg(&p).arg(x).arg(&mut y);
                },
            )
        }?;
    }
    Ok(y)
}

/// g [n, c] → dx [n, h, w, c] for the forward's input shape.
pub fn global_avg_pool_backward(
    be: &CudaBackend,
    g: &CudaTensor,
    input_shape: &[usize],
) -> CudaResult<CudaTensor> {
    let [n, h, w, c] = nhwc("global_avg_pool backward", input_shape)?;
    g.expect_shape("global_avg_pool backward", &[n, c])?;
    let mut dx = CudaTensor::uninit(be, input_shape, g.dtype())?;
    let total = dx.len();
    if total == 0 {
        return Ok(dx);
    }
    let p = pool_params(n, h * w, c)?;
    let f = be.function(k::POOL_BACKWARD.of(g.dtype()))?;
    {
        // SAFETY: global_avg_pool_backward_T(PoolParams, const T* g
        // [n, c], T* dx [n, hw, c]).
        unsafe {
            launch(
                be.compute_stream(),
                &f,
                elementwise(total),
                "global_avg_pool_backward",
                |b| {
                    b.arg(&p).arg(g).arg(&mut dx);
                },
            )
        }?;
    }
    Ok(dx)
}

// ---------------------------------------------------------------------------
// Max pooling

/// What a training `max_pool_forward` keeps for backward: each output's
/// argmax (its position ky·k + kx in its window, u32) and the input's
/// shape; never the input.
#[derive(Debug)]
pub struct MaxPoolSaved {
    argmax: DeviceBuffer<u32>,
    input_shape: [usize; 4],
    kernel: usize,
    stride: usize,
}

impl MaxPoolSaved {
    /// The argmax positions, for tests (one download).
    pub fn argmax_to_host(&self, be: &CudaBackend) -> CudaResult<Vec<u32>> {
        be.download(&self.argmax.slice)
    }
}

fn max_pool_params(
    op: &'static str,
    input: [usize; 4],
    kernel: usize,
    stride: usize,
) -> CudaResult<(MaxPoolParams, [usize; 4])> {
    let [n, h, w, c] = input;
    let side = |d: usize| {
        (kernel > 0 && stride > 0)
            .then(|| d.checked_sub(kernel).map(|r| r / stride + 1))
            .flatten()
    };
    let (Some(oh), Some(ow)) = (side(h), side(w)) else {
        return Err(CudaError::shape(
            op,
            format!("an image at least {kernel}x{kernel} (the kernel, stride {stride} > 0)"),
            format!("{input:?}"),
        ));
    };
    let p = MaxPoolParams {
        n: u32_of(op, n)?,
        h: u32_of(op, h)?,
        w: u32_of(op, w)?,
        c: u32_of(op, c)?,
        oh: u32_of(op, oh)?,
        ow: u32_of(op, ow)?,
        kernel: u32_of(op, kernel)?,
        stride: u32_of(op, stride)?,
    };
    u32_of(op, n * h * w * c)?;
    Ok((p, [n, oh, ow, c]))
}

/// Max pooling of x [n, h, w, c] over `kernel`×`kernel` windows every
/// `stride` pixels, no padding: y [n, oh, ow, c], and with `train` what
/// backward needs (`MaxPoolSaved`). Ties go to the first in row-major window
/// order, as on the CPU.
pub fn max_pool_forward(
    be: &CudaBackend,
    x: &CudaTensor,
    kernel: usize,
    stride: usize,
    train: bool,
) -> CudaResult<(CudaTensor, Option<MaxPoolSaved>)> {
    let input = nhwc("max_pool", x.shape())?;
    let (p, out_shape) = max_pool_params("max_pool", input, kernel, stride)?;
    let mut y = CudaTensor::uninit(be, &out_shape, x.dtype())?;
    let mut saved = if train {
        Some(MaxPoolSaved {
            argmax: be.alloc::<u32>(y.len())?,
            input_shape: input,
            kernel,
            stride,
        })
    } else {
        None
    };
    if y.is_empty() {
        return Ok((y, saved));
    }
    let cfg = elementwise(y.len());
    match saved.as_mut() {
        Some(s) => {
            let f = be.function(k::MAX_POOL_FORWARD_TRAIN.of(x.dtype()))?;
            // SAFETY: max_pool_forward_train_T(MaxPoolParams of x, const T* x
            // [n, h, w, c], T* y [n, oh, ow, c], u32* argmax [n·oh·ow·c]):
            // y and argmax were allocated above with y's element count.
            unsafe {
                launch(
                    be.compute_stream(),
                    &f,
                    cfg,
                    "max_pool_forward_train",
                    |b| {
                        b.arg(&p).arg(x).arg(&mut y).arg(&mut s.argmax.slice);
                    },
                )
            }?;
        }
        None => {
            let f = be.function(k::MAX_POOL_FORWARD.of(x.dtype()))?;
            // SAFETY: max_pool_forward_T(MaxPoolParams of x, const T* x
            // [n, h, w, c], T* y [n, oh, ow, c]) (y allocated above).
            unsafe {
                launch(be.compute_stream(), &f, cfg, "max_pool_forward", |b| {
                    b.arg(&p).arg(x).arg(&mut y);
                })
            }?;
        }
    }
    Ok((y, saved))
}

/// Max pooling's backward: g [n, oh, ow, c] routed to each output's argmax,
/// dx [n, h, w, c] of the forward's input shape (overlapping windows sum in
/// row-major output order, as on the CPU).
pub fn max_pool_backward(
    be: &CudaBackend,
    g: &CudaTensor,
    saved: &MaxPoolSaved,
) -> CudaResult<CudaTensor> {
    let (p, out_shape) = max_pool_params(
        "max_pool backward",
        saved.input_shape,
        saved.kernel,
        saved.stride,
    )?;
    g.expect_shape("max_pool backward", &out_shape)?;
    let mut dx = CudaTensor::uninit(be, &saved.input_shape, g.dtype())?;
    if dx.is_empty() {
        return Ok(dx);
    }
    let f = be.function(k::MAX_POOL_BACKWARD.of(g.dtype()))?;
    // SAFETY: max_pool_backward_T(MaxPoolParams, const T* g [n, oh, ow, c],
    // const u32* argmax [n·oh·ow·c], T* dx [n, h, w, c]): g's shape checked
    // above, argmax made by the forward with that output shape, dx
    // allocated with the input's.
    unsafe {
        launch(
            be.compute_stream(),
            &f,
            elementwise(dx.len()),
            "max_pool_backward",
            |b| {
                b.arg(&p).arg(g).arg(&saved.argmax.slice).arg(&mut dx);
            },
        )
    }?;
    Ok(dx)
}
