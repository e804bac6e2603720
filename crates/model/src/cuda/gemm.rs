//! Row-major matrix products through cuBLAS `cublasGemmEx`: half operands
//! (f16 or bf16, the backend's `HalfFormat`)
//! or f32 operands (f32 training), f32 accumulation
//! (`CUBLAS_COMPUTE_32F`: tensor cores for f16 operands; plain f32, not
//! TF32, for f32 operands, since the default math mode is kept), and an f16
//! or f32 result. cuBLAS is column-major; a row-major C = op(A)·op(B) is
//! the column-major Cᵀ = op(B)ᵀ·op(A)ᵀ, so the operands are swapped and the
//! transposes kept.

use cudarc::cublas::{result as cublas, sys as cublas_sys};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};

use super::backend::CudaBackend;
use super::dtype::HalfFormat;
use super::error::Context;
use super::tensor::{AnyView, AnyViewMut, DType};
use super::{CudaError, CudaResult};

/// A row-major matrix operand: `rows × cols` of `op(X)` (after the
/// transpose), stored with leading dimension `ld`.
#[derive(Clone, Copy, Debug)]
pub struct Operand {
    pub transpose: bool,
    pub ld: usize,
}

fn data_type(dtype: DType, half: HalfFormat) -> cublas_sys::cudaDataType {
    match (dtype, half) {
        (DType::F16, HalfFormat::F16) => cublas_sys::cudaDataType::CUDA_R_16F,
        (DType::F16, HalfFormat::Bf16) => cublas_sys::cudaDataType::CUDA_R_16BF,
        (DType::F32, _) => cublas_sys::cudaDataType::CUDA_R_32F,
    }
}

/// The device pointer of an operand on `stream`, and the guard that keeps
/// it in use until dropped (after the call).
fn operand_ptr<'a>(stream: &'a CudaStream, v: &'a AnyView<'_>) -> (u64, SyncOnDrop<'a>) {
    match v {
        AnyView::F16(v) => v.device_ptr(stream),
        AnyView::F32(v) => v.device_ptr(stream),
    }
}

fn check_extent(
    what: &str,
    rows: usize,
    cols: usize,
    ld: usize,
    transpose: bool,
    len: usize,
) -> CudaResult<()> {
    // Stored rows × stored cols, row-major with leading dimension ld.
    let (sr, sc) = if transpose {
        (cols, rows)
    } else {
        (rows, cols)
    };
    if sr == 0 || sc == 0 {
        return Ok(());
    }
    let ok = ld >= sc
        && (sr - 1)
            .checked_mul(ld)
            .and_then(|v| v.checked_add(sc))
            .is_some_and(|end| end <= len);
    if ok {
        Ok(())
    } else {
        Err(CudaError::shape(
            "gemm",
            format!("{what}: a {sr}×{sc} matrix with leading dimension {ld} inside the buffer"),
            format!("a buffer of {len} elements"),
        ))
    }
}

fn as_int(v: usize) -> CudaResult<i32> {
    i32::try_from(v).map_err(|_| CudaError::Unsupported {
        op: "gemm",
        reason: format!("dimension {v} exceeds i32"),
    })
}

/// `c[m×n] = alpha · op(a)[m×k] · op(b)[k×n] + beta · c`, row-major, on the
/// compute stream. `beta = 1` accumulates (gradients).
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    be: &CudaBackend,
    m: usize,
    n: usize,
    k: usize,
    a: &AnyView<'_>,
    op_a: Operand,
    b: &AnyView<'_>,
    op_b: Operand,
    c: &mut AnyViewMut<'_>,
    ldc: usize,
    alpha: f32,
    beta: f32,
) -> CudaResult<()> {
    check_extent("A", m, k, op_a.ld, op_a.transpose, a.len())?;
    check_extent("B", k, n, op_b.ld, op_b.transpose, b.len())?;
    check_extent("C", m, n, ldc, false, c.len())?;
    if a.dtype() != b.dtype() {
        return Err(CudaError::Unsupported {
            op: "gemm",
            reason: format!(
                "operands of mixed types ({:?} and {:?})",
                a.dtype(),
                b.dtype()
            ),
        });
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let (mi, ni, ki) = (as_int(m)?, as_int(n)?, as_int(k)?);
    let (lda, ldb, ldcc) = (
        as_int(op_a.ld.max(1))?,
        as_int(op_b.ld.max(1))?,
        as_int(ldc.max(1))?,
    );
    let op = |t: bool| {
        if t {
            cublas_sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            cublas_sys::cublasOperation_t::CUBLAS_OP_N
        }
    };
    let stream = be.compute_stream();
    let ab_type = data_type(a.dtype(), be.half());
    let (a_ptr, _ra) = operand_ptr(stream, a);
    let (b_ptr, _rb) = operand_ptr(stream, b);
    let handle = *be.blas().handle();
    let alpha_ptr = &alpha as *const f32 as *const std::ffi::c_void;
    let beta_ptr = &beta as *const f32 as *const std::ffi::c_void;
    let c_type = data_type(c.dtype(), be.half());
    let (c_ptr, _rc) = match c {
        AnyViewMut::F16(v) => v.device_ptr_mut(stream),
        AnyViewMut::F32(v) => v.device_ptr_mut(stream),
    };
    // SAFETY: the extents of A, B and C were checked against their buffers
    // above (for the row-major shapes, which are the column-major transposes
    // cuBLAS sees) and A and B share one type; the handle's stream is the
    // compute stream; alpha and beta are f32 as CUBLAS_COMPUTE_32F requires
    // and live across the call.
    unsafe {
        cublas::gemm_ex(
            handle,
            op(op_b.transpose),
            op(op_a.transpose),
            ni,
            mi,
            ki,
            alpha_ptr,
            b_ptr as *const std::ffi::c_void,
            ab_type,
            ldb,
            a_ptr as *const std::ffi::c_void,
            ab_type,
            lda,
            beta_ptr,
            c_ptr as *mut std::ffi::c_void,
            c_type,
            ldcc,
            cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT, // = CUBLAS_GEMM_DEFAULT (-1)
        )
    }
    .during("cublasGemmEx")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_are_checked_before_any_call() {
        // 2×3 row-major with ld 3 needs 6 elements.
        assert!(check_extent("A", 2, 3, 3, false, 6).is_ok());
        assert!(check_extent("A", 2, 3, 3, false, 5).is_err());
        // Transposed: stored 3×2 with ld 2.
        assert!(check_extent("A", 2, 3, 2, true, 6).is_ok());
        assert!(
            check_extent("A", 2, 3, 1, true, 6).is_err(),
            "ld below the stored width"
        );
        assert!(check_extent("A", 0, 3, 0, false, 0).is_ok());
    }
}
