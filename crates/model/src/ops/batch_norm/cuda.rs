use cudarc::driver::{CudaFunction, CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

use crate::cuda::backend::{CudaBackend, DeviceBuffer};
use crate::cuda::kernels::{self as k, KernelPair, KernelSig};
use crate::cuda::launch::*;
use crate::cuda::params::*;
use crate::cuda::tensor::{same_dtype, CudaTensor, DType};
use crate::cuda::{CudaError, CudaResult};

// ---------------------------------------------------------------------------
// Batch normalisation (optionally fused with the ReLU after it, or with a
// residual block's sum and the ReLU after the block)

/// Settings of one batch-norm call.
#[derive(Clone, Copy, Debug)]
pub struct BatchNormConfig {
    pub momentum: f32,
    pub eps: f32,
    /// Fuse the following ReLU (forward applies it; backward masks by the
    /// saved output).
    pub relu: bool,
    /// Update the running statistics (false when recomputing for
    /// activation checkpointing).
    pub update_running: bool,
}

/// What a training forward saves for backward (besides its input, and its
/// output when the ReLU is fused).
#[derive(Debug)]
pub struct BatchNormSaved {
    pub mean: DeviceBuffer<f32>,
    pub inv_std: DeviceBuffer<f32>,
    /// The affine map the forward applied, y = x·scale + shift, kept so
    /// that backward can compute the output again instead of keeping it,
    /// and the fused ReLU's mask without it.
    pub scale: DeviceBuffer<f32>,
    pub shift: DeviceBuffer<f32>,
}

/// Rows per chunk of a batch norm's partial sums: 256, or more so that
/// there are at most 256 chunks (the finalize kernels then read little).
/// Depends only on the row count.
fn batch_norm_chunking(rows: usize) -> (usize, usize) {
    let rpc = rows.div_ceil(BN_MAX_CHUNKS).max(256);
    (rpc, rows.div_ceil(rpc).max(1))
}

const BN_MAX_CHUNKS: usize = 256;

/// A partial-sums pass over [rows, c] in `chunks`: the _v8 kernels' 256
/// threads a block where `by_eight`, else the scalar kernels' (32, 8).
fn bn_partial_launch(dtype: DType, c: usize, chunks: usize) -> LaunchConfig {
    if by_eight(dtype, c) {
        LaunchConfig {
            grid_dim: ((c / 8).div_ceil(32) as u32, chunks as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    } else {
        LaunchConfig {
            grid_dim: (c.div_ceil(32) as u32, chunks as u32, 1),
            block_dim: (32, 8, 1),
            shared_mem_bytes: 0,
        }
    }
}

fn bn_check(
    op: &'static str,
    x: &CudaTensor,
    gamma: &CudaView<'_, f32>,
    beta: &CudaView<'_, f32>,
) -> CudaResult<(usize, usize)> {
    let [n, h, w, c] = nhwc(op, x.shape())?;
    if c != gamma.len() || c != beta.len() || c == 0 {
        return Err(CudaError::shape(
            op,
            format!(
                "[n, h, w, {}] with gamma and beta of that length",
                gamma.len()
            ),
            format!("{:?} (beta {})", x.shape(), beta.len()),
        ));
    }
    Ok((u32_of(op, n * h * w)? as usize, c))
}

/// y = x·scale + shift (`bn_apply`), or with a skip input
/// relu(T(x·scale + shift) + skip) (`bn_apply_add`, the ReLU as `relu`
/// says).
#[allow(clippy::too_many_arguments)]
fn bn_apply(
    be: &CudaBackend,
    x: &CudaTensor,
    skip: Option<&CudaTensor>,
    rows: usize,
    c: usize,
    scale: &DeviceBuffer<f32>,
    shift: &DeviceBuffer<f32>,
    relu: bool,
) -> CudaResult<CudaTensor> {
    let dtype = x.dtype();
    let mut y = CudaTensor::uninit(be, x.shape(), dtype)?;
    let p = BnApplyParams {
        rows: rows as u32,
        channels: c as u32,
        relu: relu as u32,
        by_channels: FastDiv::new(c as u32),
    };
    let stream = be.compute_stream();
    match skip {
        None => {
            let (f, cfg) = bn_per_element(be, &k::BN_APPLY, &k::BN_APPLY_V8, dtype, rows, c)?;
            // SAFETY: bn_apply_T(BnApplyParams, const T* x, const float*
            // scale, const float* shift, T* y); x, y hold rows·c, scale
            // and shift c (bn_per_element: the v8 kernel's 16-byte
            // accesses are aligned in these whole tensors, and its grid
            // covers every row and channel group).
            unsafe {
                launch(stream, &f, cfg, "bn_apply", |b| {
                    b.arg(&p)
                        .arg(x)
                        .arg(&scale.slice)
                        .arg(&shift.slice)
                        .arg(&mut y);
                })
            }?;
        }
        Some(skip) => {
            same_dtype("batch_norm residual add", dtype, &[skip.dtype()])?;
            let (f, cfg) =
                bn_per_element(be, &k::BN_APPLY_ADD, &k::BN_APPLY_ADD_V8, dtype, rows, c)?;
            // SAFETY: bn_apply_add_T(BnApplyParams, const T* x, const float*
            // scale, const float* shift, const T* skip, T* y); x, skip (its shape checked by both callers) and y hold
            // rows·c, scale and shift c; y is freshly allocated, so it
            // aliases neither input.
            unsafe {
                launch(stream, &f, cfg, "bn_apply_add", |b| {
                    b.arg(&p)
                        .arg(x)
                        .arg(&scale.slice)
                        .arg(&shift.slice)
                        .arg(skip)
                        .arg(&mut y);
                })
            }?;
        }
    }
    Ok(y)
}

/// Training forward: normalise with the batch statistics (biased variance),
/// update the running statistics (unbiased variance, PyTorch's momentum
/// rule) unless `cfg.update_running` is false. Returns the output and what
/// backward needs.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_forward_train(
    be: &CudaBackend,
    x: &CudaTensor,
    gamma: &CudaView<'_, f32>,
    beta: &CudaView<'_, f32>,
    running_mean: &mut CudaViewMut<'_, f32>,
    running_var: &mut CudaViewMut<'_, f32>,
    cfg: BatchNormConfig,
) -> CudaResult<(CudaTensor, BatchNormSaved)> {
    bn_forward_train(be, x, None, gamma, beta, running_mean, running_var, cfg)
}

/// `batch_norm_forward_train` closing a residual block: y = bn(x) + skip,
/// then the ReLU if `cfg.relu`, in one pass over the activations and with
/// the roundings of `batch_norm_forward_train`, `add_inplace` and
/// `relu_forward` run one after another. Backward (with the ReLU):
/// `batch_norm_add_relu_backward`.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_add_forward_train(
    be: &CudaBackend,
    x: &CudaTensor,
    skip: &CudaTensor,
    gamma: &CudaView<'_, f32>,
    beta: &CudaView<'_, f32>,
    running_mean: &mut CudaViewMut<'_, f32>,
    running_var: &mut CudaViewMut<'_, f32>,
    cfg: BatchNormConfig,
) -> CudaResult<(CudaTensor, BatchNormSaved)> {
    bn_forward_train(
        be,
        x,
        Some(skip),
        gamma,
        beta,
        running_mean,
        running_var,
        cfg,
    )
}

#[allow(clippy::too_many_arguments)]
fn bn_forward_train(
    be: &CudaBackend,
    x: &CudaTensor,
    skip: Option<&CudaTensor>,
    gamma: &CudaView<'_, f32>,
    beta: &CudaView<'_, f32>,
    running_mean: &mut CudaViewMut<'_, f32>,
    running_var: &mut CudaViewMut<'_, f32>,
    cfg: BatchNormConfig,
) -> CudaResult<(CudaTensor, BatchNormSaved)> {
    let (rows, c) = bn_check("batch_norm", x, gamma, beta)?;
    same_len("batch_norm", "running_mean", c, running_mean.len())?;
    same_len("batch_norm", "running_var", c, running_var.len())?;
    // Before the running statistics change: a refused call leaves them be.
    if let Some(skip) = skip {
        skip.expect_shape("batch_norm residual add", x.shape())?;
    }
    if rows < 2 {
        return Err(CudaError::shape(
            "batch_norm",
            "more than one value per channel in training (n·h·w ≥ 2)",
            format!("{:?}", x.shape()),
        ));
    }
    let (rpc, chunks) = batch_norm_chunking(rows);
    let mut part_mean = be.alloc::<f32>(chunks * c)?;
    let mut part_m2 = be.alloc::<f32>(chunks * c)?;
    let dims = BnDims {
        rows: rows as u32,
        channels: c as u32,
        rows_per_chunk: rpc as u32,
        chunks: chunks as u32,
    };
    let stream = be.compute_stream();
    {
        let f = if by_eight(x.dtype(), c) {
            be.function(&k::BN_STATS_PARTIAL_V8)?
        } else {
            be.function(k::BN_STATS_PARTIAL.of(x.dtype()))?
        };
        let cfg_partial = bn_partial_launch(x.dtype(), c, chunks);
        // SAFETY: bn_stats_partial_T / _v8_f16 (BnDims, const T* x [rows, c],
        // float* part_mean, float* part_m2 [chunks, c]) with the block and
        // grid bn_partial_launch gives each (its shared arrays are sized by
        // the block); x is a whole tensor, so the v8 loads are aligned.
        unsafe {
            launch(stream, &f, cfg_partial, "bn_stats_partial", |b| {
                b.arg(&dims)
                    .arg(x)
                    .arg(&mut part_mean.slice)
                    .arg(&mut part_m2.slice);
            })
        }?;
    }
    let mut mean = be.alloc::<f32>(c)?;
    let mut inv_std = be.alloc::<f32>(c)?;
    let mut scale = be.alloc::<f32>(c)?;
    let mut shift = be.alloc::<f32>(c)?;
    {
        let p = BnFinalizeParams {
            rows: rows as u32,
            channels: c as u32,
            rows_per_chunk: rpc as u32,
            chunks: chunks as u32,
            eps: cfg.eps,
            momentum: cfg.momentum,
            update_running: cfg.update_running as u32,
        };
        let f = be.function(&k::BN_STATS_FINALIZE)?;
        // SAFETY: bn_stats_finalize(BnFinalizeParams, part_mean, part_m2
        // [chunks, c], gamma, beta, mean, inv_std, scale, shift, running_mean,
        // running_var [c]) with block (8, 32) and grid ceil(c/8), as its
        // shared arrays require.
        unsafe {
            launch(stream, &f, bn_finalize_lanes(c), "bn_stats_finalize", |b| {
                b.arg(&p)
                    .arg(&part_mean.slice)
                    .arg(&part_m2.slice)
                    .arg(gamma)
                    .arg(beta)
                    .arg(&mut mean.slice)
                    .arg(&mut inv_std.slice)
                    .arg(&mut scale.slice)
                    .arg(&mut shift.slice)
                    .arg(running_mean)
                    .arg(running_var);
            })
        }?;
    }
    let y = bn_apply(be, x, skip, rows, c, &scale, &shift, cfg.relu)?;
    let saved = BatchNormSaved {
        mean,
        inv_std,
        scale,
        shift,
    };
    Ok((y, saved))
}

/// The output of `batch_norm_forward_train` with the fused ReLU (or of
/// `batch_norm_add_forward_train` with the ReLU, a residual block's, when
/// `skip` is the block's input), computed again from its input `x` and what
/// that forward saved: the forward's bits (the same kernel on the same
/// values), for a backward that recomputes the output instead of keeping it.
pub fn batch_norm_relu_recompute(
    be: &CudaBackend,
    x: &CudaTensor,
    skip: Option<&CudaTensor>,
    saved: &BatchNormSaved,
) -> CudaResult<CudaTensor> {
    if let Some(skip) = skip {
        skip.expect_shape("batch_norm recompute (residual input)", x.shape())?;
    }
    let [n, h, w, c] = nhwc("batch_norm recompute", x.shape())?;
    for (what, len) in [
        ("saved scale", saved.scale.len()),
        ("saved shift", saved.shift.len()),
    ] {
        same_len("batch_norm recompute", what, c, len)?;
    }
    let rows = u32_of("batch_norm recompute", n * h * w)? as usize;
    bn_apply(be, x, skip, rows, c, &saved.scale, &saved.shift, true)
}

/// Eval forward: normalise with the running statistics; saves nothing.
pub fn batch_norm_forward_eval(
    be: &CudaBackend,
    x: &CudaTensor,
    gamma: &CudaView<'_, f32>,
    beta: &CudaView<'_, f32>,
    running_mean: &CudaView<'_, f32>,
    running_var: &CudaView<'_, f32>,
    cfg: BatchNormConfig,
) -> CudaResult<CudaTensor> {
    bn_forward_eval(be, x, None, gamma, beta, running_mean, running_var, cfg)
}

/// `batch_norm_forward_eval` closing a residual block: y = bn(x) + skip,
/// then the ReLU if `cfg.relu` (see `batch_norm_add_forward_train`).
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_add_forward_eval(
    be: &CudaBackend,
    x: &CudaTensor,
    skip: &CudaTensor,
    gamma: &CudaView<'_, f32>,
    beta: &CudaView<'_, f32>,
    running_mean: &CudaView<'_, f32>,
    running_var: &CudaView<'_, f32>,
    cfg: BatchNormConfig,
) -> CudaResult<CudaTensor> {
    bn_forward_eval(
        be,
        x,
        Some(skip),
        gamma,
        beta,
        running_mean,
        running_var,
        cfg,
    )
}

#[allow(clippy::too_many_arguments)]
fn bn_forward_eval(
    be: &CudaBackend,
    x: &CudaTensor,
    skip: Option<&CudaTensor>,
    gamma: &CudaView<'_, f32>,
    beta: &CudaView<'_, f32>,
    running_mean: &CudaView<'_, f32>,
    running_var: &CudaView<'_, f32>,
    cfg: BatchNormConfig,
) -> CudaResult<CudaTensor> {
    let (rows, c) = bn_check("batch_norm", x, gamma, beta)?;
    same_len("batch_norm", "running_mean", c, running_mean.len())?;
    same_len("batch_norm", "running_var", c, running_var.len())?;
    if let Some(skip) = skip {
        skip.expect_shape("batch_norm residual add", x.shape())?;
    }
    let mut scale = be.alloc::<f32>(c)?;
    let mut shift = be.alloc::<f32>(c)?;
    {
        let p = BnEvalParams {
            channels: c as u32,
            eps: cfg.eps,
        };
        let f = be.function(&k::BN_EVAL_PREPARE)?;
        // SAFETY: bn_eval_prepare(BnEvalParams, gamma, beta, running_mean,
        // running_var, scale, shift), all of c floats; one thread per channel.
        unsafe {
            launch(
                be.compute_stream(),
                &f,
                per_channel(c),
                "bn_eval_prepare",
                |b| {
                    b.arg(&p)
                        .arg(gamma)
                        .arg(beta)
                        .arg(running_mean)
                        .arg(running_var)
                        .arg(&mut scale.slice)
                        .arg(&mut shift.slice);
                },
            )
        }?;
    }
    if rows == 0 {
        return CudaTensor::uninit(be, x.shape(), x.dtype());
    }
    bn_apply(be, x, skip, rows, c, &scale, &shift, cfg.relu)
}

/// Puts the running statistics saved before a step back over `mean`/`var`
/// when that step was skipped (`verdict.skipped`, decided on the device by
/// the optimizer): a skipped step leaves no trace, and the host need not
/// know the verdict before it queues the next step.
pub fn batch_norm_restore_if_skipped(
    be: &CudaBackend,
    verdict: &CudaSlice<StepState>,
    saved: (&CudaSlice<f32>, &CudaSlice<f32>),
    mean: &mut CudaSlice<f32>,
    var: &mut CudaSlice<f32>,
) -> CudaResult<()> {
    let c = mean.len();
    for (name, len) in [
        ("saved mean", saved.0.len()),
        ("saved var", saved.1.len()),
        ("var", var.len()),
    ] {
        same_len("batch_norm_restore_if_skipped", name, c, len)?;
    }
    let p = BnRestoreParams {
        channels: u32_of("batch_norm_restore_if_skipped", c)?,
    };
    let f = be.function(&k::BN_RUNNING_RESTORE)?;
    // SAFETY: bn_running_restore(BnRestoreParams, const StepState* [1],
    // const float* saved_mean, const float* saved_var, float* mean, float*
    // var), each of `channels` elements (checked above).
    unsafe {
        launch(
            be.compute_stream(),
            &f,
            per_channel(c),
            "bn_running_restore",
            |b| {
                b.arg(&p)
                    .arg(verdict)
                    .arg(saved.0)
                    .arg(saved.1)
                    .arg(mean)
                    .arg(var);
            },
        )
    }?;
    Ok(())
}

/// Backward of a training forward: accumulates dγ and dβ into the f32
/// gradients and returns dx. With the ReLU fused (`relu = true`) its mask
/// comes from `x` and the forward's scale and shift, computed as the
/// forward computed its output (so exactly where that output is > 0): the
/// output itself is not read, so backward need not keep or recompute it.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_backward(
    be: &CudaBackend,
    g: &CudaTensor,
    x: &CudaTensor,
    saved: &BatchNormSaved,
    gamma: &CudaView<'_, f32>,
    gamma_grad: &mut CudaViewMut<'_, f32>,
    beta_grad: &mut CudaViewMut<'_, f32>,
    relu: bool,
) -> CudaResult<CudaTensor> {
    bn_backward(
        be,
        BnGrad::Read(g),
        x,
        saved,
        gamma,
        gamma_grad,
        beta_grad,
        relu,
    )
}

/// Backward of `batch_norm_add_forward_train` with the ReLU, `output` the
/// block's output: masks `g` in place (it then holds the gradient of the
/// skip input, and of the batch norm's output), accumulates dγ and dβ and
/// returns the batch norm's dx. The bits of `relu_backward` followed by
/// `batch_norm_backward` without the ReLU, in three kernels instead of four,
/// and no tensor for the masked gradient.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_add_relu_backward(
    be: &CudaBackend,
    g: &mut CudaTensor,
    x: &CudaTensor,
    output: &CudaTensor,
    saved: &BatchNormSaved,
    gamma: &CudaView<'_, f32>,
    gamma_grad: &mut CudaViewMut<'_, f32>,
    beta_grad: &mut CudaViewMut<'_, f32>,
) -> CudaResult<CudaTensor> {
    bn_backward(
        be,
        BnGrad::MaskInPlace(g, output),
        x,
        saved,
        gamma,
        gamma_grad,
        beta_grad,
        true,
    )
}

/// The output gradient a batch-norm backward reads: as it is (masked by
/// the fused ReLU, if any, as it is read), or masked in place by the
/// block's ReLU first, by the block's output (and left masked).
enum BnGrad<'a> {
    Read(&'a CudaTensor),
    MaskInPlace(&'a mut CudaTensor, &'a CudaTensor),
}

#[allow(clippy::too_many_arguments)]
fn bn_backward(
    be: &CudaBackend,
    mut g: BnGrad<'_>,
    x: &CudaTensor,
    saved: &BatchNormSaved,
    gamma: &CudaView<'_, f32>,
    gamma_grad: &mut CudaViewMut<'_, f32>,
    beta_grad: &mut CudaViewMut<'_, f32>,
    relu: bool,
) -> CudaResult<CudaTensor> {
    let (g_shape, dtype) = match &g {
        BnGrad::Read(g) => (g.shape(), g.dtype()),
        BnGrad::MaskInPlace(g, y) => {
            same_dtype("batch_norm backward", g.dtype(), &[y.dtype()])?;
            y.expect_shape("batch_norm backward (saved output)", x.shape())?;
            (g.shape(), g.dtype())
        }
    };
    same_dtype("batch_norm backward", dtype, &[x.dtype()])?;
    if g_shape != x.shape() {
        return Err(CudaError::shape(
            "batch_norm backward",
            format!("{:?}", x.shape()),
            format!("{g_shape:?}"),
        ));
    }
    let [n, h, w, c] = nhwc("batch_norm backward", x.shape())?;
    let rows = u32_of("batch_norm backward", n * h * w)? as usize;
    for (what, len) in [
        ("gamma", gamma.len()),
        ("gamma gradient", gamma_grad.len()),
        ("beta gradient", beta_grad.len()),
        ("saved mean", saved.mean.len()),
        ("saved inv_std", saved.inv_std.len()),
    ] {
        same_len("batch_norm backward", what, c, len)?;
    }
    let (rpc, chunks) = batch_norm_chunking(rows);
    let p = BnBackwardParams {
        rows: rows as u32,
        channels: c as u32,
        rows_per_chunk: rpc as u32,
        chunks: chunks as u32,
        relu: relu as u32,
        by_channels: FastDiv::new(c as u32),
    };
    let stream = be.compute_stream();
    let mut part_g = be.alloc::<f32>(chunks * c)?;
    let mut part_gx = be.alloc::<f32>(chunks * c)?;
    let partial = bn_partial_launch(dtype, c, chunks);
    let eight = by_eight(dtype, c);
    match &mut g {
        BnGrad::Read(g) => {
            let f = if eight {
                be.function(&k::BN_BACKWARD_PARTIAL_V8)?
            } else {
                be.function(k::BN_BACKWARD_PARTIAL.of(dtype))?
            };
            // SAFETY: bn_backward_partial_T / _v8_f16 (BnBackwardParams, g,
            // x [rows, c] T, scale, shift, mean [c], part_sum_g, part_sum_gx
            // [chunks, c]) with bn_partial_launch's block and grid; whole
            // tensors, so the v8 loads are aligned.
            unsafe {
                launch(stream, &f, partial, "bn_backward_partial", |b| {
                    b.arg(&p)
                        .arg(*g)
                        .arg(x)
                        .arg(&saved.scale.slice)
                        .arg(&saved.shift.slice)
                        .arg(&saved.mean.slice)
                        .arg(&mut part_g.slice)
                        .arg(&mut part_gx.slice);
                })
            }?;
        }
        BnGrad::MaskInPlace(g, y) => {
            let f = if eight {
                be.function(&k::BN_BACKWARD_PARTIAL_MASK_V8)?
            } else {
                be.function(k::BN_BACKWARD_PARTIAL_MASK.of(dtype))?
            };
            // SAFETY: bn_backward_partial_mask_T / _v8_f16 (BnBackwardParams,
            // T* g, const x, y [rows, c] T, mean [c], part_sum_g, part_sum_gx
            // [chunks, c]) with bn_partial_launch's block and grid; g,
            // borrowed mutably, is neither x nor y.
            unsafe {
                launch(stream, &f, partial, "bn_backward_partial_mask", |b| {
                    b.arg(&p)
                        .arg(&mut **g)
                        .arg(x)
                        .arg(*y)
                        .arg(&saved.mean.slice)
                        .arg(&mut part_g.slice)
                        .arg(&mut part_gx.slice);
                })
            }?;
        }
    }
    // A gradient masked in place is read as it now is.
    let (g, p) = match g {
        BnGrad::Read(g) => (g, p),
        BnGrad::MaskInPlace(g, _) => (&*g, BnBackwardParams { relu: 0, ..p }),
    };
    let mut coef_k = be.alloc::<f32>(c)?;
    let mut coef_b = be.alloc::<f32>(c)?;
    let mut coef_d = be.alloc::<f32>(c)?;
    {
        let f = be.function(&k::BN_BACKWARD_FINALIZE)?;
        // SAFETY: bn_backward_finalize(BnBackwardParams, part_sum_g,
        // part_sum_gx [chunks, c], gamma, inv_std, gamma_grad, beta_grad,
        // coef_k, coef_b, coef_d [c]) with block (8, 32) and grid
        // ceil(c/8), as its shared arrays require.
        unsafe {
            launch(
                stream,
                &f,
                bn_finalize_lanes(c),
                "bn_backward_finalize",
                |b| {
                    b.arg(&p)
                        .arg(&part_g.slice)
                        .arg(&part_gx.slice)
                        .arg(gamma)
                        .arg(&saved.inv_std.slice)
                        .arg(gamma_grad)
                        .arg(beta_grad)
                        .arg(&mut coef_k.slice)
                        .arg(&mut coef_b.slice)
                        .arg(&mut coef_d.slice);
                },
            )
        }?;
    }
    let mut dx = CudaTensor::uninit(be, x.shape(), dtype)?;
    if rows * c > 0 {
        let (f, cfg) = bn_per_element(
            be,
            &k::BN_BACKWARD_APPLY,
            &k::BN_BACKWARD_APPLY_V8,
            dtype,
            rows,
            c,
        )?;
        // SAFETY: bn_backward_apply_T(BnBackwardParams, g, x [rows, c],
        // scale, shift, mean, coef_k, coef_b, coef_d [c], dx [rows, c]),
        // whole tensors.
        unsafe {
            launch(stream, &f, cfg, "bn_backward_apply", |b| {
                b.arg(&p)
                    .arg(g)
                    .arg(x)
                    .arg(&saved.scale.slice)
                    .arg(&saved.shift.slice)
                    .arg(&saved.mean.slice)
                    .arg(&coef_k.slice)
                    .arg(&coef_b.slice)
                    .arg(&coef_d.slice)
                    .arg(&mut dx);
            })
        }?;
    }
    Ok(dx)
}

/// Rows each thread of a `_v8` apply kernel takes, their loads issued
/// together (batchnorm.cu `BN_V8_ROWS`).
const BN_V8_ROWS: usize = 4;

/// A batch norm's per-element pass over [rows, c] (apply, apply + add, the
/// input gradient): the `_v8` kernel where `by_eight` allows, on the
/// partial kernels' lanes (256 threads a block, min(c/8, 32) groups of 8
/// channels across, row lanes down, `BN_V8_ROWS` rows a thread; grid.x
/// the row blocks, grid.y the channel blocks), else the scalar one for
/// `dtype`, a thread per element.
fn bn_per_element(
    be: &CudaBackend,
    scalar: &KernelPair,
    eight: &KernelSig,
    dtype: DType,
    rows: usize,
    c: usize,
) -> CudaResult<(CudaFunction, LaunchConfig)> {
    if !by_eight(dtype, c) {
        return Ok((be.function(scalar.of(dtype))?, elementwise(rows * c)));
    }
    let groups = c / 8;
    let lanes = 256 / groups.min(32);
    let cfg = LaunchConfig {
        grid_dim: (
            u32_of("batch norm", rows.div_ceil(lanes * BN_V8_ROWS).max(1))?,
            u32_of("batch norm", groups.div_ceil(32))?,
            1,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    Ok((be.function(eight)?, cfg))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_norm_chunks_are_few_and_cover_the_rows() {
        assert_eq!(batch_norm_chunking(2), (256, 1));
        assert_eq!(batch_norm_chunking(64 * 28 * 28), (256, 196));
        assert_eq!(batch_norm_chunking(512 * 28 * 28), (1568, 256));
        for rows in [1usize, 255, 256, 257, 65_536, 65_537, 1 << 31] {
            let (rpc, chunks) = batch_norm_chunking(rows);
            assert!(chunks <= BN_MAX_CHUNKS && rpc * chunks >= rows, "{rows}");
            assert!(
                rpc * (chunks - 1) < rows.max(1),
                "no empty chunk for {rows}"
            );
        }
    }
}
