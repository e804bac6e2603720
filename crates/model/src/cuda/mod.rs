//! The CUDA backend: f16 / f32 kernels of our own (`.cu` files beside their
//! launches: `src/ops/<family>/*.cu`, and the optimizer's `optim.cu` here;
//! compiled with NVRTC on first use and cached on disk), cuBLAS for the
//! matrix products, through `cudarc` with run-time loading of the driver and
//! libraries, so the crate builds and its CPU path runs on machines without
//! CUDA.
//!
//! STATUS: this backend has run on GPUs: on NVIDIA H100s, and on an NVIDIA
//! H200 every CUDA test passed with `HEADROOM_REQUIRE_GPU=1` (the GPU
//! bundles of a350b0d and of 1597ca2, the latter holding today's kernels;
//! README, "Measured on an NVIDIA H200"). What is verified on every machine
//! with NVRTC, GPU or not: every kernel compiles to PTX and CUBIN for
//! sm_75, sm_80, sm_86, sm_89 and sm_90 (`arch::TESTED_ARCHS`), with NVRTC
//! 13 and NVRTC 12, with each entry point's parameters checked against the
//! Rust structs (`tests/cuda_ptx.rs`); every kernel, and the whole path through
//! the driver and cuBLAS (op wrappers, `CudaNetwork`, the fused AdamW, the
//! staging ring), runs on the CPU emulator of CUDA (`crates/cuda-emu`)
//! against the CPU layers, the emulator answering as any of those
//! architectures and as a CUDA 12.x or 13.x driver (`arch.rs`;
//! `tests/cuda_parity/`, a file per op family, `tests/cuda_driver.rs`, and the pipeline's
//! `cuda_learner` and the tests crate's `cuda_training`); probing a machine
//! without a driver returns `Ok(None)` without panicking. Without NVRTC
//! those tests are built as ignored (`build.rs`), and `cargo test` says so.
//!
//! Layout:
//! - `arch`: what each GPU architecture offers the kernels, which path each
//!   op family takes on it, and which drivers and NVRTCs serve.
//! - `backend`: `CudaBackend` (context, compute and copy streams, cuBLAS,
//!   module cache, memory accounting), `probe`, `DeviceInfo`,
//!   `auto_device_kind`.
//! - `kernels`: kernel sources and signatures, NVRTC compilation, disk cache.
//! - `params`: the `#[repr(C)]` kernel parameter structs.
//! - `tensor`: `CudaTensor` (shape + f16/f32 device buffer).
//! - `ops`: forward/backward of every op of the reference ResNet.
//! - `gemm`: row-major cuBLAS GEMM, f16 or f32 in, f32 accumulate.
//! - `network`: `CudaNetwork`, a `ModelSpec` on the GPU (same parameter
//!   order as the CPU `Network`), forward and backward over the ops.
//! - `param_group`: parameters on the GPU (f32 masters, gradients and
//!   moments, f16 compute copies in mixed precision); the fused AdamW step over them and the
//!   loss scaler live in headroom-optim.
//! - `staging`: pinned input staging ring, copy stream, events.
//! - `libs`: locating NVRTC/cuBLAS/NCCL (pip wheels included) without panicking.
//! - `nccl`: one rank's NCCL communicator on its communication stream (the
//!   GPU ranks of a data-parallel run).
//! - `optim.cu`: the optimizer's kernels (`grad_sumsq`, `step_finalize`,
//!   `adamw_fused`), here beside `param_group` and the structs they share
//!   with it (`params`); their launches are headroom-optim's (`FusedAdamW`),
//!   and the layers' kernels are their op families' (`crate::ops`).

pub mod arch;
pub(crate) mod backend;
pub(crate) mod containers;
mod dtype;
pub(crate) mod error;
pub mod gemm;
mod graph;
pub mod kernels;
pub(crate) mod launch;
pub mod layer;
pub mod libs;
pub mod nccl;
mod network;
pub mod ops;
mod param_group;
pub mod params;
mod profile;
mod records;
pub mod staging;
pub(crate) mod tensor;

pub use crate::profile::ProfileSegment;
pub use backend::{
    auto_device_kind, blas_workspace_bytes, CudaBackend, DeviceBuffer, DeviceInfo,
    DeviceMemoryStats, Lease,
};
pub use dtype::HalfFormat;
pub use error::{CudaError, CudaResult};
pub use graph::CapturedGraph;
pub use network::{CudaBuildOptions, CudaNetwork, Floor, StateList, StatePiece};
pub use ops::{Normalization, MAX_BLOCK_THREADS};
pub use param_group::ParamGroup;
pub use records::{Record, StepRecords, MAX_IN_FLIGHT};
pub use staging::{check_recipes, InputStaging, ResidentImages, StagedBatch};
pub use tensor::{AnyView, AnyViewMut, CudaBuffer, CudaTensor, DType, MAX_ELEMENTS};

/// The test binaries `cargo xtask gpu-check` should run on a GPU machine,
/// with `HEADROOM_REQUIRE_GPU=1` so that a missing GPU fails instead of
/// skipping:
///
/// ```sh
/// HEADROOM_REQUIRE_GPU=1 cargo test -p headroom-model --test cuda_ptx --test cuda_probe --test cuda_parity -- --nocapture
/// ```
pub const GPU_CHECK_TESTS: &[&str] = &["cuda_ptx", "cuda_probe", "cuda_parity"];

/// What the machine offers the CUDA backend, for `cargo xtask gpu-check`
/// (and `doctor`). Gathering it never panics.
#[derive(Debug)]
pub struct GpuCheckReport {
    pub driver_present: bool,
    /// Ok(None): no GPU. Err: a driver that cannot be used, with the reason.
    pub device: Result<Option<DeviceInfo>, String>,
    /// NVRTC version, or why it is missing.
    pub nvrtc: Result<(i32, i32), String>,
    /// Whether cuBLAS loads, or why not.
    pub cublas: Result<(), String>,
    /// Each kernel file compiled for the device (or for sm_80 and sm_90
    /// without one): (file, target, result).
    pub kernels: Vec<(&'static str, String, Result<(), String>)>,
    pub kernel_cache: Option<std::path::PathBuf>,
}

impl GpuCheckReport {
    /// True when a GPU is present and everything it needs works.
    /// A driver and a GPU were found (whatever else failed).
    pub fn has_gpu(&self) -> bool {
        matches!(self.device, Ok(Some(_)))
    }

    pub fn gpu_ready(&self) -> bool {
        self.has_gpu()
            && self.nvrtc.is_ok()
            && self.cublas.is_ok()
            && self.kernels.iter().all(|(_, _, r)| r.is_ok())
    }
}

impl std::fmt::Display for GpuCheckReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "CUDA driver library: {}",
            if self.driver_present {
                "found"
            } else {
                "not found"
            }
        )?;
        match &self.device {
            Ok(Some(info)) => writeln!(f, "GPU: {info}")?,
            Ok(None) => writeln!(f, "GPU: none")?,
            Err(e) => writeln!(f, "GPU: unusable: {e}")?,
        }
        match &self.nvrtc {
            Ok((a, b)) => writeln!(f, "NVRTC: {a}.{b}")?,
            Err(e) => writeln!(f, "NVRTC: {e}")?,
        }
        match &self.cublas {
            Ok(()) => writeln!(f, "cuBLAS: found")?,
            Err(e) => writeln!(f, "cuBLAS: {e}")?,
        }
        for (file, target, r) in &self.kernels {
            match r {
                Ok(()) => writeln!(f, "kernels {file}.cu for {target}: ok")?,
                Err(e) => writeln!(f, "kernels {file}.cu for {target}: FAILED\n{e}")?,
            }
        }
        match &self.kernel_cache {
            Some(dir) => writeln!(f, "kernel cache: {}", dir.display()),
            None => writeln!(f, "kernel cache: none (set HEADROOM_KERNEL_CACHE)"),
        }
    }
}

/// Probes the driver, the GPU, NVRTC and cuBLAS, and compiles every kernel
/// file (for the GPU's architecture, or for sm_80 and sm_90 without one).
pub fn gpu_check_report() -> GpuCheckReport {
    let driver_present = libs::driver_present();
    let device = CudaBackend::probe().map_err(|e| e.to_string());
    let nvrtc = kernels::nvrtc_version().map_err(|e| e.to_string());
    let cublas = libs::ensure_cublas().map(|_| ()).map_err(|e| e.to_string());
    // With a GPU: its target, through the disk cache (which this warms).
    // Without: sm_80 and sm_90, compiled in memory only.
    let mut targets = Vec::new();
    let mut use_cache = false;
    if nvrtc.is_ok() {
        match &device {
            Ok(Some(info)) => {
                use_cache = true;
                match kernels::target_for(info.arch()) {
                    Ok(t) => targets.push(Ok(t)),
                    Err(e) => targets.push(Err(e.to_string())),
                }
            }
            _ => targets.extend([
                Ok(kernels::Target::Cubin(80)),
                Ok(kernels::Target::Cubin(90)),
            ]),
        }
    }
    let mut compiled = Vec::new();
    for target in targets {
        match target {
            Ok(t) => {
                for file in kernels::FILES {
                    let r = if use_cache {
                        kernels::load_or_compile(file, t, HalfFormat::F16)
                    } else {
                        kernels::compile(file, t)
                    };
                    compiled.push((
                        file.name,
                        t.to_string(),
                        r.map(|_| ()).map_err(|e| e.to_string()),
                    ));
                }
            }
            Err(e) => compiled.push(("(all)", "the GPU".to_string(), Err(e))),
        }
    }
    GpuCheckReport {
        driver_present,
        device,
        nvrtc,
        cublas,
        kernels: compiled,
        kernel_cache: kernels::kernel_cache_dir(),
    }
}
