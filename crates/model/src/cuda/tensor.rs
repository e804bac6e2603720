//! `CudaTensor`: a shape and an f16 or f32 device buffer (NHWC like the CPU
//! tensor), with host↔device copies. Activations are f16; f32 tensors hold
//! master weights, gradients, moments and per-channel statistics.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use half::f16;

use super::backend::{CudaBackend, DeviceBuffer};
use super::error::Context;
use super::{CudaError, CudaResult};
use crate::Tensor;

/// Element type of a `CudaTensor`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F16,
    F32,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F16 => 2,
            DType::F32 => 4,
        }
    }
}

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

    /// Uploads f32 host data, converting to f16 on the host (round to
    /// nearest even, as the kernels' conversions) when `dtype` is F16.
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
                let h: Vec<f16> = data.iter().map(|&v| f16::from_f32(v)).collect();
                CudaBuffer::F16(be.upload(&h)?)
            }
            DType::F32 => CudaBuffer::F32(be.upload(data)?),
        };
        Ok(Self {
            shape: shape.to_vec(),
            buffer,
        })
    }

    /// Uploads a CPU tensor.
    pub fn from_tensor(be: &CudaBackend, t: &Tensor, dtype: DType) -> CudaResult<Self> {
        Self::from_host(be, t.shape(), t.data(), dtype)
    }

    /// Downloads as f32 (waits for the compute stream).
    pub fn to_host(&self, be: &CudaBackend) -> CudaResult<Vec<f32>> {
        match &self.buffer {
            CudaBuffer::F16(b) => Ok(be
                .download(&b.slice)?
                .into_iter()
                .map(f16::to_f32)
                .collect()),
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

fn dtype_error(wanted: &str, got: &str) -> CudaError {
    CudaError::Unsupported {
        op: "CudaTensor",
        reason: format!("expected an {wanted} tensor, got {got}"),
    }
}
