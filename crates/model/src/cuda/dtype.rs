//! The element types of device tensors: a leaf that the kernel registry and
//! the tensors both name, so neither imports the other for it.

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
