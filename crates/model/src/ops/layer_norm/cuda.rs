use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

use crate::cuda::backend::{CudaBackend, DeviceBuffer};
use crate::cuda::kernels::{self as k};
use crate::cuda::launch::*;
use crate::cuda::params::*;
use crate::cuda::tensor::{same_dtype, CudaTensor};
use crate::cuda::{CudaError, CudaResult};

// ---------------------------------------------------------------------------
// Layer normalisation

/// What a training forward of `layer_norm_forward` keeps for backward,
/// besides its input: [mean, rstd] of each row.
#[derive(Debug)]
pub struct LayerNormSaved {
    stats: DeviceBuffer<f32>,
    eps: f32,
}

/// Rows and columns of `x` normalised over its last axis by γ and β.
fn ln_dims(
    x: &CudaTensor,
    gamma: &CudaView<'_, f32>,
    beta: &CudaView<'_, f32>,
) -> CudaResult<(usize, usize)> {
    let cols = gamma.len();
    if x.shape().len() < 2 || x.shape().last() != Some(&cols) || beta.len() != cols {
        return Err(CudaError::shape(
            "layer_norm",
            format!("[n, ..., {cols}] with γ and β of {cols}"),
            format!("{:?}, β of {}", x.shape(), beta.len()),
        ));
    }
    Ok((x.len() / cols.max(1), cols))
}

fn ln_params(op: &'static str, rows: usize, cols: usize, eps: f32) -> CudaResult<LnParams> {
    let (rpc, chunks) = bn_chunking(rows);
    Ok(LnParams {
        rows: u32_of(op, rows)?,
        cols: u32_of(op, cols)?,
        rows_per_chunk: rpc as u32,
        chunks: chunks as u32,
        eps,
    })
}

/// A warp per row, 8 rows a block.
fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(8).max(1) as u32, 1, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    }
}

/// Layer norm over the last axis with the f32 γ and β: the output, and
/// what backward needs besides the input.
pub fn layer_norm_forward(
    be: &CudaBackend,
    x: &CudaTensor,
    gamma: &CudaView<'_, f32>,
    beta: &CudaView<'_, f32>,
    eps: f32,
) -> CudaResult<(CudaTensor, LayerNormSaved)> {
    let (rows, cols) = ln_dims(x, gamma, beta)?;
    let p = ln_params("layer_norm", rows, cols, eps)?;
    let mut y = CudaTensor::uninit(be, x.shape(), x.dtype())?;
    let mut stats = be.alloc::<f32>(2 * rows)?;
    if !y.is_empty() {
        let f = be.function(k::LAYER_NORM_FORWARD.of(x.dtype()))?;
        // SAFETY: layer_norm_forward_T(LnParams, const T* x [rows, cols],
        // γ, β [cols], T* y [rows, cols], float* stats [rows, 2]) with block
        // (32, 8) and a row per warp, as the kernel requires.
        unsafe {
            launch(
                be.compute_stream(),
                &f,
                per_row(rows),
                "layer_norm_forward",
                |b| {
                    b.arg(&p)
                        .arg(x)
                        .arg(gamma)
                        .arg(beta)
                        .arg(&mut y)
                        .arg(&mut stats.slice);
                },
            )
        }?;
    }
    Ok((y, LayerNormSaved { stats, eps }))
}

/// Layer norm backward: dx, with dγ += Σ g·x̂ and dβ += Σ g.
pub fn layer_norm_backward(
    be: &CudaBackend,
    g: &CudaTensor,
    x: &CudaTensor,
    saved: &LayerNormSaved,
    gamma: &CudaView<'_, f32>,
    gamma_grad: &mut CudaViewMut<'_, f32>,
    beta_grad: &mut CudaViewMut<'_, f32>,
) -> CudaResult<CudaTensor> {
    let dx = layer_norm_backward_input(be, g, x, saved, gamma)?;
    let (rows, cols) = ln_dims(x, gamma, &gamma_grad.as_view())?;
    same_len("layer_norm backward", "dβ", cols, beta_grad.len())?;
    if dx.is_empty() {
        return Ok(dx);
    }
    let p = ln_params("layer_norm backward", rows, cols, saved.eps)?;
    let stream = be.compute_stream();
    let chunks = p.chunks as usize;
    let mut part_gamma = be.alloc::<f32>(chunks * cols)?;
    let mut part_beta = be.alloc::<f32>(chunks * cols)?;
    {
        let f = be.function(k::LAYER_NORM_GRAD_PARTIAL.of(g.dtype()))?;
        let cfg = LaunchConfig {
            grid_dim: (cols.div_ceil(32) as u32, chunks as u32, 1),
            block_dim: (32, 8, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: layer_norm_grad_partial_T(LnParams, const T* g, const T* x
        // [rows, cols], stats [rows, 2], float* part_gamma, part_beta
        // [chunks, cols]) with block (32, 8) and grid (ceil(cols/32),
        // chunks), as its shared arrays require.
        unsafe {
            launch(stream, &f, cfg, "layer_norm_grad_partial", |b| {
                b.arg(&p)
                    .arg(g)
                    .arg(x)
                    .arg(&saved.stats.slice)
                    .arg(&mut part_gamma.slice)
                    .arg(&mut part_beta.slice);
            })
        }?;
    }
    {
        let f = be.function(&k::LAYER_NORM_GRAD_FINALIZE)?;
        // SAFETY: layer_norm_grad_finalize(LnParams, part_gamma, part_beta
        // [chunks, cols], float* dgamma, dbeta [cols]) with block (32, 8)
        // and grid ceil(cols/32), as its shared arrays require.
        unsafe {
            launch(
                stream,
                &f,
                per_channel_lanes(cols),
                "layer_norm_grad_finalize",
                |b| {
                    b.arg(&p)
                        .arg(&part_gamma.slice)
                        .arg(&part_beta.slice)
                        .arg(gamma_grad)
                        .arg(beta_grad);
                },
            )
        }?;
    }
    Ok(dx)
}

/// Layer norm backward's dx alone (a frozen γ and β get no gradient).
pub fn layer_norm_backward_input(
    be: &CudaBackend,
    g: &CudaTensor,
    x: &CudaTensor,
    saved: &LayerNormSaved,
    gamma: &CudaView<'_, f32>,
) -> CudaResult<CudaTensor> {
    g.expect_shape("layer_norm backward", x.shape())?;
    same_dtype("layer_norm backward", g.dtype(), &[x.dtype()])?;
    let (rows, cols) = ln_dims(x, gamma, gamma)?;
    same_len("layer_norm backward", "stats", 2 * rows, saved.stats.len())?;
    let p = ln_params("layer_norm backward", rows, cols, saved.eps)?;
    let mut dx = CudaTensor::uninit(be, g.shape(), g.dtype())?;
    if dx.is_empty() {
        return Ok(dx);
    }
    let f = be.function(k::LAYER_NORM_BACKWARD.of(g.dtype()))?;
    // SAFETY: layer_norm_backward_T(LnParams, const T* g, const T* x
    // [rows, cols], γ [cols], stats [rows, 2], T* dx [rows, cols]) with
    // block (32, 8) and a row per warp.
    unsafe {
        launch(
            be.compute_stream(),
            &f,
            per_row(rows),
            "layer_norm_backward",
            |b| {
                b.arg(&p)
                    .arg(g)
                    .arg(x)
                    .arg(gamma)
                    .arg(&saved.stats.slice)
                    .arg(&mut dx);
            },
        )
    }?;
    Ok(dx)
}
