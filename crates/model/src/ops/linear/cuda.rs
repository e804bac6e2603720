use cudarc::driver::{CudaViewMut, LaunchConfig, PushKernelArg};

use crate::cuda::backend::CudaBackend;
use crate::cuda::gemm::{gemm, Operand};
use crate::cuda::kernels::{self as k};
use crate::cuda::launch::*;
use crate::cuda::params::*;
use crate::cuda::tensor::{same_dtype, AnyView, AnyViewMut, CudaTensor};
use crate::cuda::{CudaError, CudaResult};

/// `y[r, c] += bias[c]` for y viewed as [rows, cols] with cols = bias.len().
pub fn bias_add(be: &CudaBackend, y: &mut AnyViewMut<'_>, bias: &AnyView<'_>) -> CudaResult<()> {
    same_dtype("bias_add", y.dtype(), &[bias.dtype()])?;
    let cols = bias.len();
    if cols == 0 || !y.len().is_multiple_of(cols) {
        return Err(CudaError::shape(
            "bias_add",
            format!("a multiple of the {cols} bias elements"),
            format!("{} elements", y.len()),
        ));
    }
    let rows = y.len() / cols;
    if rows == 0 {
        return Ok(());
    }
    let p = RowsColsParams {
        rows: u32_of("bias_add", rows)?,
        cols: cols as u32,
    };
    let f = be.function(k::BIAS_ADD.of(y.dtype()))?;
    // SAFETY: bias_add_T(RowsColsParams, T* y, const T* bias); y
    // holds rows·cols elements, bias cols.
    unsafe {
        launch(
            be.compute_stream(),
            &f,
            elementwise(rows * cols),
            "bias_add",
            |b| {
                b.arg(&p).arg(y).arg(bias);
            },
        )
    }?;
    Ok(())
}

/// `grad[c] += Σ_r g[r, c]` for g viewed as [rows, cols], cols = grad.len():
/// per chunk of rows (`bn_chunking`, a rule of the row count alone), then
/// the chunks' partials in order, so the bits do not vary between runs.
pub fn bias_grad(
    be: &CudaBackend,
    g: &AnyView<'_>,
    grad: &mut CudaViewMut<'_, f32>,
) -> CudaResult<()> {
    let cols = grad.len();
    if cols == 0 || !g.len().is_multiple_of(cols) {
        return Err(CudaError::shape(
            "bias_grad",
            format!("a multiple of the {cols} bias elements"),
            format!("{} elements", g.len()),
        ));
    }
    let rows = g.len() / cols;
    let (rows_per_chunk, chunks) = bn_chunking(rows);
    if chunks == 1 {
        return column_sums(be, g, rows, cols, rows_per_chunk, 1, grad);
    }
    let mut partials = be.alloc::<f32>(chunks * cols)?;
    column_sums(
        be,
        g,
        rows,
        cols,
        rows_per_chunk,
        chunks,
        &mut partials.slice.as_view_mut(),
    )?;
    let partials = AnyView::F32(partials.slice.as_view());
    column_sums(be, &partials, chunks, cols, chunks, 1, grad)
}

/// One `bias_grad_T` launch: `out` += the column sums (one chunk), or
/// `out` [chunks, cols] = each chunk's.
pub(crate) fn column_sums(
    be: &CudaBackend,
    g: &AnyView<'_>,
    rows: usize,
    cols: usize,
    rows_per_chunk: usize,
    chunks: usize,
    out: &mut CudaViewMut<'_, f32>,
) -> CudaResult<()> {
    same_len("bias_grad", "column sums", chunks * cols, out.len())?;
    let p = ColumnSumParams {
        rows: u32_of("bias_grad", rows)?,
        cols: u32_of("bias_grad", cols)?,
        rows_per_chunk: u32_of("bias_grad", rows_per_chunk)?,
        chunks: u32_of("bias_grad", chunks)?,
    };
    let f = be.function(k::BIAS_GRAD.of(g.dtype()))?;
    let cfg = LaunchConfig {
        grid_dim: (cols.div_ceil(32) as u32, chunks as u32, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: bias_grad_T(ColumnSumParams, const T* g [rows, cols], float*
    // out [chunks, cols]) with block (32, 8) and grid (⌈cols/32⌉, chunks),
    // as its shared array and chunk index require; lengths checked above.
    unsafe {
        launch(be.compute_stream(), &f, cfg, "bias_grad", |b| {
            b.arg(&p).arg(g).arg(out);
        })
    }?;
    Ok(())
}

pub(crate) fn bias_grad_into(
    be: &CudaBackend,
    dy: &CudaTensor,
    db: &mut CudaViewMut<'_, f32>,
) -> CudaResult<()> {
    bias_grad(be, &dy.view(), db)
}

/// y[n, out] = x[n, in] · W[in, out] (+ bias).
pub fn linear_forward(
    be: &CudaBackend,
    x: &CudaTensor,
    weight: &AnyView<'_>,
    bias: Option<&AnyView<'_>>,
    out_features: usize,
) -> CudaResult<CudaTensor> {
    let (n, inf) = matrix_dims("linear", "features [n, in]", x)?;
    same_len(
        "linear",
        "weight [in, out]",
        inf * out_features,
        weight.len(),
    )?;
    same_dtype("linear", x.dtype(), &[weight.dtype()])?;
    let mut y = CudaTensor::uninit(be, &[n, out_features], x.dtype())?;
    if y.is_empty() {
        return Ok(y);
    }
    {
        gemm(
            be,
            n,
            out_features,
            inf,
            &x.view(),
            Operand {
                transpose: false,
                ld: inf,
            },
            weight,
            Operand {
                transpose: false,
                ld: out_features,
            },
            &mut y.view_mut(),
            out_features,
            1.0,
            0.0,
        )?;
    }
    if let Some(bias) = bias {
        same_len("linear", "bias", out_features, bias.len())?;
        bias_add(be, &mut y.view_mut(), bias)?;
    }
    Ok(y)
}

/// dW += xᵀ·g (f32), db += Σₙ g, returns dx = g·Wᵀ.
pub fn linear_backward(
    be: &CudaBackend,
    x: &CudaTensor,
    g: &CudaTensor,
    weight: &AnyView<'_>,
    weight_grad: &mut CudaViewMut<'_, f32>,
    bias_grad: Option<&mut CudaViewMut<'_, f32>>,
) -> CudaResult<CudaTensor> {
    linear_backward_params(be, x, g, weight, weight_grad, bias_grad)?;
    let inf = x.shape().get(1).copied().unwrap_or(0);
    linear_backward_input(be, g, weight, inf)
}

/// dW += xᵀ·g (f32) and db += Σ g, without dx (a network's first layer,
/// whose input no gradient is wanted for).
pub fn linear_backward_params(
    be: &CudaBackend,
    x: &CudaTensor,
    g: &CudaTensor,
    weight: &AnyView<'_>,
    weight_grad: &mut CudaViewMut<'_, f32>,
    bias_grad: Option<&mut CudaViewMut<'_, f32>>,
) -> CudaResult<()> {
    let (n, inf) = matrix_dims("linear backward", "features [n, in]", x)?;
    let out = weight.len().checked_div(inf).unwrap_or(0);
    same_len(
        "linear backward",
        "weight [in, out]",
        inf * out,
        weight.len(),
    )?;
    same_len(
        "linear backward",
        "weight gradient",
        weight.len(),
        weight_grad.len(),
    )?;
    g.expect_shape("linear backward", &[n, out])?;
    if let Some(db) = bias_grad {
        same_len("linear backward", "bias gradient", out, db.len())?;
        bias_grad_into(be, g, db)?;
    }
    same_dtype("linear backward", x.dtype(), &[g.dtype(), weight.dtype()])?;
    if n > 0 && inf > 0 && out > 0 {
        gemm(
            be,
            inf,
            out,
            n,
            &x.view(),
            Operand {
                transpose: true,
                ld: inf,
            },
            &g.view(),
            Operand {
                transpose: false,
                ld: out,
            },
            &mut AnyViewMut::F32(weight_grad.slice_mut(..)),
            out,
            1.0,
            1.0,
        )?;
    }
    Ok(())
}

/// dx = g·Wᵀ [n, in] for g [n, out] and W [in, out] (a frozen weight's
/// layer needs only this).
pub fn linear_backward_input(
    be: &CudaBackend,
    g: &CudaTensor,
    weight: &AnyView<'_>,
    inf: usize,
) -> CudaResult<CudaTensor> {
    let (n, out) = matrix_dims("linear backward", "gradient [n, out]", g)?;
    same_len(
        "linear backward",
        "weight [in, out]",
        inf * out,
        weight.len(),
    )?;
    let dtype = g.dtype();
    same_dtype("linear backward", dtype, &[weight.dtype()])?;
    if out == 0 {
        return CudaTensor::zeros(be, &[n, inf], dtype);
    }
    let mut dx = CudaTensor::uninit(be, &[n, inf], dtype)?;
    if n == 0 || inf == 0 {
        return Ok(dx);
    }
    gemm(
        be,
        n,
        inf,
        out,
        &g.view(),
        Operand {
            transpose: false,
            ld: out,
        },
        weight,
        Operand {
            transpose: true,
            ld: out,
        },
        &mut dx.view_mut(),
        inf,
        1.0,
        0.0,
    )?;
    Ok(dx)
}
