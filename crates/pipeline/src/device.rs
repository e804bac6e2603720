//! Where a run trains: the `device.kind` setting, and the one probe of the
//! GPU that turns it into a device.
//!
//! Reading an experiment never touches the GPU: the functions that need to
//! know whether a run will train on one (the "auto" profile, the memory
//! budget's wording, the learner) ask `gpu_memory` here, and only for a
//! kind that may use a GPU. The learner itself is opened in
//! `learner::open_network`, which is where "auto" finally becomes the GPU or
//! the CPU (a model with a CPU-only layer stays on the CPU).

use headroom_model::cuda::{CudaBackend, HalfFormat};

use crate::setting_enum::setting_enum;

setting_enum! {
    /// Where a run trains (`device.kind`).
    #[derive(Default)]
    pub enum DeviceKind {
        /// The GPU when there is one the model can use, else the CPU,
        /// saying why.
        #[default]
        Auto = "auto",
        Cpu = "cpu",
        /// GPU 0, or an error naming what is missing.
        Cuda = "cuda",
    }
}

setting_enum! {
    /// How the GPU stores activations and compute weights
    /// (`device.precision`); the masters, gradients and moments are f32
    /// in every case, and the CPU trains in f32 whatever this says.
    pub enum Precision {
        /// IEEE half, with dynamic loss scaling (f16's range is ±65504).
        F16 = "f16",
        /// bfloat16: f32's range, so no loss scaling, with 8 significand
        /// bits against f16's 11. sm_80 (Ampere) or newer.
        Bf16 = "bf16",
        /// f32 throughout: the masters are the compute weights, no loss
        /// scaling (`device.amp = false`).
        F32 = "f32",
    }
}

impl Precision {
    /// The 2-byte format of the GPU backend (f32 training uses none).
    pub fn half_format(self) -> HalfFormat {
        match self {
            Precision::Bf16 => HalfFormat::Bf16,
            Precision::F16 | Precision::F32 => HalfFormat::F16,
        }
    }
}

/// The memory a run of `kind` would have on its GPU: what the driver
/// reports free now (never more than the card's total), so that another
/// process's allocations or a display's framebuffer count against it as on
/// a shared or laptop GPU. None for "cpu", and for "auto" or "cuda" where no
/// CUDA driver or GPU can be used.
pub fn gpu_memory(kind: DeviceKind) -> Option<u64> {
    if kind == DeviceKind::Cpu {
        return None;
    }
    match CudaBackend::probe() {
        Ok(Some(gpu)) => Some(usable_memory(gpu.total_memory, gpu.free_memory)),
        _ => None,
    }
}

/// What a run can count on of a GPU with `total` bytes of which `free` are
/// free now.
fn usable_memory(total: u64, free: u64) -> u64 {
    total.min(free)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_shared_with_another_process_counts_only_its_free_memory() {
        let gib = 1u64 << 30;
        assert_eq!(usable_memory(140 * gib, 3 * gib), 3 * gib);
        assert_eq!(usable_memory(4 * gib, 4 * gib), 4 * gib);
        // A driver reporting more free than total is read as the total.
        assert_eq!(usable_memory(2 * gib, 3 * gib), 2 * gib);
    }

    #[test]
    fn a_cpu_run_asks_nothing_of_the_gpu() {
        assert_eq!(gpu_memory(DeviceKind::Cpu), None);
    }

    #[test]
    fn the_kind_reads_and_writes_its_word() {
        for kind in [DeviceKind::Auto, DeviceKind::Cpu, DeviceKind::Cuda] {
            assert_eq!(
                DeviceKind::parse("device.kind", kind.as_str()).unwrap(),
                kind
            );
        }
        let err = DeviceKind::parse("device.kind", "gpu")
            .unwrap_err()
            .to_string();
        assert!(err.contains("device.kind"), "{err}");
        assert!(
            err.contains("\"auto\", \"cpu\" or \"cuda\", got \"gpu\""),
            "{err}"
        );
    }
}
