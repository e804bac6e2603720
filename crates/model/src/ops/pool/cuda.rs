use cudarc::driver::PushKernelArg;

use crate::cuda::backend::CudaBackend;
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
