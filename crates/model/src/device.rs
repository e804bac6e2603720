use crate::memory::{self, MemoryPool};

/// Where a tensor's storage lives and where its kernels run.
///
/// Only the CPU exists today. The CUDA backend joins as `Cuda(CudaDevice)`,
/// holding the cudarc context, streams, cuBLAS handle and module cache; code
/// that matches on `Device` is where it plugs in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    #[default]
    Cpu,
}

impl Device {
    /// The device's process-wide caching pool: every tensor on this device
    /// is a block of it (outside `MemoryPool::scope`).
    pub fn pool(self) -> &'static MemoryPool {
        memory::device_pool(self)
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
        }
    }
}
