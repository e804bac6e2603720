//! `CudaTensor`: a shape and an f16 or f32 device buffer (NHWC like the CPU
//! tensor), with host↔device copies. Activations are f16 in mixed precision
//! and f32 in f32 training; f32 tensors also hold master weights,
//! gradients, moments and per-channel statistics.
//!
//! The layer kernels take their storage type from the tensors they are
//! given: a tensor (or an `AnyView` of parameters) is pushed as a kernel
//! argument whatever its element type, and the op picks the `_f16` or `_f32`
//! entry point from `dtype()` (`kernels::KernelPair`).

use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, LaunchArgs, PushKernelArg,
};
use half::f16;

use super::backend::{CudaBackend, DeviceBuffer};
use super::error::Context;
use super::{CudaError, CudaResult};
use crate::Tensor;

pub use super::dtype::DType;

#[derive(Debug)]
pub enum CudaBuffer {
    F16(DeviceBuffer<f16>),
    F32(DeviceBuffer<f32>),
}

#[derive(Debug)]
pub struct CudaTensor {
    shape: Vec<usize>,
    buffer: CudaBuffer,
}

/// Largest element count a kernel takes (indices are 32-bit and grid-stride
/// loops must not wrap).
pub const MAX_ELEMENTS: usize = i32::MAX as usize;

pub(crate) fn checked_len(op: &'static str, shape: &[usize]) -> CudaResult<usize> {
    let len = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|&l| l <= MAX_ELEMENTS)
        .ok_or_else(|| CudaError::Unsupported {
            op,
            reason: format!("shape {shape:?} has more than {MAX_ELEMENTS} elements"),
        })?;
    Ok(len)
}

impl CudaTensor {
    /// A tensor whose contents are unspecified until a kernel writes them
    /// (every op wrapper writes all of its outputs).
    pub fn uninit(be: &CudaBackend, shape: &[usize], dtype: DType) -> CudaResult<Self> {
        let len = checked_len("CudaTensor::uninit", shape)?;
        let buffer = match dtype {
            DType::F16 => CudaBuffer::F16(be.alloc::<f16>(len)?),
            DType::F32 => CudaBuffer::F32(be.alloc::<f32>(len)?),
        };
        Ok(Self {
            shape: shape.to_vec(),
            buffer,
        })
    }

    pub fn zeros(be: &CudaBackend, shape: &[usize], dtype: DType) -> CudaResult<Self> {
        let len = checked_len("CudaTensor::zeros", shape)?;
        let buffer = match dtype {
            DType::F16 => CudaBuffer::F16(be.alloc_zeros::<f16>(len)?),
            DType::F32 => CudaBuffer::F32(be.alloc_zeros::<f32>(len)?),
        };
        Ok(Self {
            shape: shape.to_vec(),
            buffer,
        })
    }

    /// Uploads f32 host data, converting to the backend's half format on the
    /// host (round to nearest even, as the kernels' conversions) when
    /// `dtype` is F16.
    pub fn from_host(
        be: &CudaBackend,
        shape: &[usize],
        data: &[f32],
        dtype: DType,
    ) -> CudaResult<Self> {
        let len = checked_len("CudaTensor::from_host", shape)?;
        if len != data.len() {
            return Err(CudaError::shape(
                "CudaTensor::from_host",
                format!("{len} elements for shape {shape:?}"),
                format!("{} elements", data.len()),
            ));
        }
        let buffer = match dtype {
            DType::F16 => {
                let half = be.half();
                let h: Vec<f16> = data.iter().map(|&v| half.encode(v)).collect();
                CudaBuffer::F16(be.upload(&h)?)
            }
            DType::F32 => CudaBuffer::F32(be.upload(data)?),
        };
        Ok(Self {
            shape: shape.to_vec(),
            buffer,
        })
    }

    /// An f32 tensor of `shape` copied on the device out of the start of
    /// `bytes` (f32 values in the host's byte order): a captured step reads
    /// its token ids from the graph's fixed input buffer this way, into a
    /// tensor of its own.
    pub fn f32_from_bytes(
        be: &CudaBackend,
        bytes: &DeviceBuffer<u8>,
        shape: &[usize],
    ) -> CudaResult<Self> {
        let op = "CudaTensor::f32_from_bytes";
        let len = checked_len(op, shape)?;
        // SAFETY: f32 has no invalid bit patterns, and device allocations
        // are aligned far beyond 4 bytes; transmute checks the length.
        let values = unsafe { bytes.slice.transmute::<f32>(len) }.ok_or_else(|| {
            CudaError::shape(
                op,
                format!("{} bytes for shape {shape:?}", len * 4),
                format!("{} bytes", bytes.len()),
            )
        })?;
        let mut out = be.alloc::<f32>(len)?;
        be.compute_stream()
            .memcpy_dtod(&values, &mut out.slice)
            .during("cuMemcpyDtoDAsync")?;
        Ok(Self {
            shape: shape.to_vec(),
            buffer: CudaBuffer::F32(out),
        })
    }

    /// Uploads a CPU tensor.
    pub fn from_tensor(be: &CudaBackend, t: &Tensor, dtype: DType) -> CudaResult<Self> {
        Self::from_host(be, t.shape(), t.data(), dtype)
    }

    /// Downloads as f32 (waits for the compute stream).
    pub fn to_host(&self, be: &CudaBackend) -> CudaResult<Vec<f32>> {
        match &self.buffer {
            CudaBuffer::F16(b) => {
                let half = be.half();
                Ok(be
                    .download(&b.slice)?
                    .into_iter()
                    .map(|h| half.decode(h))
                    .collect())
            }
            CudaBuffer::F32(b) => be.download(&b.slice),
        }
    }

    /// Downloads into a CPU tensor (from the CPU pool).
    pub fn to_tensor(&self, be: &CudaBackend) -> crate::Result<Tensor> {
        let data = self.to_host(be)?;
        Tensor::from_vec(&self.shape, data)
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn len(&self) -> usize {
        match &self.buffer {
            CudaBuffer::F16(b) => b.len(),
            CudaBuffer::F32(b) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dtype(&self) -> DType {
        match &self.buffer {
            CudaBuffer::F16(_) => DType::F16,
            CudaBuffer::F32(_) => DType::F32,
        }
    }

    /// Same buffer, another shape of the same element count.
    pub fn reshape(mut self, shape: &[usize]) -> CudaResult<Self> {
        let len = checked_len("CudaTensor::reshape", shape)?;
        if len != self.len() {
            return Err(CudaError::shape(
                "CudaTensor::reshape",
                format!("{} elements", self.len()),
                format!("shape {shape:?} with {len} elements"),
            ));
        }
        self.shape = shape.to_vec();
        Ok(self)
    }

    pub fn expect_shape(&self, op: &'static str, expected: &[usize]) -> CudaResult<()> {
        if self.shape != expected {
            return Err(CudaError::shape(
                op,
                format!("{expected:?}"),
                format!("{:?}", self.shape),
            ));
        }
        Ok(())
    }

    pub fn f16(&self) -> CudaResult<&CudaSlice<f16>> {
        match &self.buffer {
            CudaBuffer::F16(b) => Ok(&b.slice),
            CudaBuffer::F32(_) => Err(dtype_error("f16", "f32")),
        }
    }

    pub fn f16_mut(&mut self) -> CudaResult<&mut CudaSlice<f16>> {
        match &mut self.buffer {
            CudaBuffer::F16(b) => Ok(&mut b.slice),
            CudaBuffer::F32(_) => Err(dtype_error("f16", "f32")),
        }
    }

    pub fn f32(&self) -> CudaResult<&CudaSlice<f32>> {
        match &self.buffer {
            CudaBuffer::F32(b) => Ok(&b.slice),
            CudaBuffer::F16(_) => Err(dtype_error("f32", "f16")),
        }
    }

    pub fn f32_mut(&mut self) -> CudaResult<&mut CudaSlice<f32>> {
        match &mut self.buffer {
            CudaBuffer::F32(b) => Ok(&mut b.slice),
            CudaBuffer::F16(_) => Err(dtype_error("f32", "f16")),
        }
    }

    pub fn f16_view(&self) -> CudaResult<CudaView<'_, f16>> {
        Ok(self.f16()?.as_view())
    }

    pub fn f16_view_mut(&mut self) -> CudaResult<CudaViewMut<'_, f16>> {
        Ok(self.f16_mut()?.as_view_mut())
    }

    pub fn f32_view(&self) -> CudaResult<CudaView<'_, f32>> {
        Ok(self.f32()?.as_view())
    }

    pub fn f32_view_mut(&mut self) -> CudaResult<CudaViewMut<'_, f32>> {
        Ok(self.f32_mut()?.as_view_mut())
    }

    /// The whole buffer, whatever its element type.
    pub fn view(&self) -> AnyView<'_> {
        match &self.buffer {
            CudaBuffer::F16(b) => AnyView::F16(b.slice.as_view()),
            CudaBuffer::F32(b) => AnyView::F32(b.slice.as_view()),
        }
    }

    pub fn view_mut(&mut self) -> AnyViewMut<'_> {
        match &mut self.buffer {
            CudaBuffer::F16(b) => AnyViewMut::F16(b.slice.as_view_mut()),
            CudaBuffer::F32(b) => AnyViewMut::F32(b.slice.as_view_mut()),
        }
    }

    /// A copy on the device (compute stream).
    pub fn try_clone(&self, be: &CudaBackend) -> CudaResult<Self> {
        let mut out = Self::uninit(be, &self.shape, self.dtype())?;
        let stream = be.compute_stream();
        match (&self.buffer, &mut out.buffer) {
            (CudaBuffer::F16(a), CudaBuffer::F16(b)) => stream
                .memcpy_dtod(&a.slice, &mut b.slice)
                .during("cuMemcpyDtoDAsync")?,
            (CudaBuffer::F32(a), CudaBuffer::F32(b)) => stream
                .memcpy_dtod(&a.slice, &mut b.slice)
                .during("cuMemcpyDtoDAsync")?,
            _ => unreachable!("uninit made the same dtype"),
        }
        Ok(out)
    }
}

/// A view of f16 or f32 device memory: a parameter's compute weights (f16
/// copy in mixed precision, the f32 masters in f32 training) or a tensor.
#[derive(Debug)]
pub enum AnyView<'a> {
    F16(CudaView<'a, f16>),
    F32(CudaView<'a, f32>),
}

impl<'a> AnyView<'a> {
    /// Elements `range` (in bounds: the callers check their extents).
    pub fn slice(&self, range: std::ops::Range<usize>) -> AnyView<'a> {
        match self {
            AnyView::F16(v) => AnyView::F16(v.slice(range)),
            AnyView::F32(v) => AnyView::F32(v.slice(range)),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            AnyView::F16(_) => DType::F16,
            AnyView::F32(_) => DType::F32,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            AnyView::F16(v) => v.len(),
            AnyView::F32(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the view starts at a multiple of `bytes` (a kernel's vector
    /// loads need it; a whole buffer does, a range cut from one may not).
    pub(crate) fn is_aligned_to(&self, stream: &CudaStream, bytes: u64) -> bool {
        let address = match self {
            AnyView::F16(v) => v.device_ptr(stream).0,
            AnyView::F32(v) => v.device_ptr(stream).0,
        };
        address.is_multiple_of(bytes)
    }
}

/// The writable counterpart of `AnyView`.
#[derive(Debug)]
pub enum AnyViewMut<'a> {
    F16(CudaViewMut<'a, f16>),
    F32(CudaViewMut<'a, f32>),
}

impl AnyViewMut<'_> {
    /// Elements `range` (in bounds: the callers check their extents).
    pub fn slice_mut(&mut self, range: std::ops::Range<usize>) -> AnyViewMut<'_> {
        match self {
            AnyViewMut::F16(v) => AnyViewMut::F16(v.slice_mut(range)),
            AnyViewMut::F32(v) => AnyViewMut::F32(v.slice_mut(range)),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            AnyViewMut::F16(_) => DType::F16,
            AnyViewMut::F32(_) => DType::F32,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            AnyViewMut::F16(v) => v.len(),
            AnyViewMut::F32(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The tensors an op is given must share one storage type (its kernels are
/// instantiated per type).
pub(crate) fn same_dtype(op: &'static str, expected: DType, got: &[DType]) -> CudaResult<()> {
    match got.iter().find(|&&d| d != expected) {
        None => Ok(()),
        Some(d) => Err(CudaError::Unsupported {
            op,
            reason: format!("operands of mixed storage types ({expected:?} and {d:?})"),
        }),
    }
}

// SAFETY (all four impls): each pushes the tensor's or view's underlying
// `CudaSlice`/`CudaView` through cudarc's own impl for it, so the argument
// is the same device pointer, with the same stream-ordering events, as when
// the typed slice is pushed directly.
unsafe impl<'a, 'b: 'a> PushKernelArg<&'b CudaTensor> for LaunchArgs<'a> {
    fn arg(&mut self, t: &'b CudaTensor) -> &mut Self {
        match &t.buffer {
            CudaBuffer::F16(b) => self.arg(&b.slice),
            CudaBuffer::F32(b) => self.arg(&b.slice),
        }
    }
}

unsafe impl<'a, 'b: 'a> PushKernelArg<&'b mut CudaTensor> for LaunchArgs<'a> {
    fn arg(&mut self, t: &'b mut CudaTensor) -> &mut Self {
        match &mut t.buffer {
            CudaBuffer::F16(b) => self.arg(&mut b.slice),
            CudaBuffer::F32(b) => self.arg(&mut b.slice),
        }
    }
}

unsafe impl<'a, 'b: 'a, 'c: 'b> PushKernelArg<&'b AnyView<'c>> for LaunchArgs<'a> {
    fn arg(&mut self, v: &'b AnyView<'c>) -> &mut Self {
        match v {
            AnyView::F16(v) => self.arg(v),
            AnyView::F32(v) => self.arg(v),
        }
    }
}

unsafe impl<'a, 'b: 'a, 'c: 'b> PushKernelArg<&'b mut AnyViewMut<'c>> for LaunchArgs<'a> {
    fn arg(&mut self, v: &'b mut AnyViewMut<'c>) -> &mut Self {
        match v {
            AnyViewMut::F16(v) => self.arg(v),
            AnyViewMut::F32(v) => self.arg(v),
        }
    }
}

fn dtype_error(wanted: &str, got: &str) -> CudaError {
    CudaError::Unsupported {
        op: "CudaTensor",
        reason: format!("expected an {wanted} tensor, got {got}"),
    }
}
