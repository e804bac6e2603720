//! The GPUs and drivers headroom serves, in one place: what each
//! architecture offers our kernels (`ArchFeatures`), which path each op
//! family takes on it (`op_paths`, which `cargo xtask doctor` prints and a
//! CUDA run logs at its start), and what the driver must be
//! (`check_driver`, `check_nvrtc_for_driver`). The kernels' launches ask
//! `ArchFeatures` rather than comparing architecture numbers themselves, so
//! a kernel that needs a newer feature names it here and its fallback is
//! taken everywhere else.
//!
//! One build serves drivers for CUDA 12.4 and newer, 12.x and 13.x alike:
//! - the driver API is bound through cudarc's `cuda-13000` bindings with
//!   dynamic loading, so an entry point is looked up by name on first use.
//!   Every one headroom calls exists in a 12.4 driver under the name those
//!   bindings use except `cuEventElapsedTime_v2` (CUDA 12.8), which
//!   `backend::event_elapsed_ms` replaces with `cuEventElapsedTime` below
//!   12.8;
//! - the kernels are compiled by an NVRTC no newer in its major version
//!   than the driver: NVRTC 13 writes PTX ISA 9.x and CUBINs in the CUDA 13
//!   ELF format (ABI version 8), which a 12.x driver cannot load, while a
//!   CUBIN from NVRTC 12.x loads on every 12.x driver (CUDA's minor-version
//!   compatibility) and on 13.x ones. `libs` looks for the NVRTC and cuBLAS
//!   of the driver's major version first; `HEADROOM_NVRTC` names one;
//! - PTX, compiled only for a GPU newer than NVRTC knows, must not be newer
//!   than the driver's JIT: NVRTC X.Y's PTX needs a driver for X.Y or newer.
//!
//! No memory is held here: plain functions of the compute capability, the
//! driver's version and NVRTC's.

use super::kernels::Target;
use super::{CudaError, CudaResult};

/// The architectures every kernel is compiled for in the tests (NVRTC,
/// `tests/cuda_ptx.rs`) and whose feature sets the emulator models
/// (`tests/cuda_parity` at several of them): Turing (GTX 1650, T4),
/// Ampere (A100; RTX 30xx, A500), Ada (RTX 40xx) and Hopper (H100, H200).
pub const TESTED_ARCHS: [u32; 5] = [75, 80, 86, 89, 90];

/// The oldest driver headroom runs on, in `cuDriverGetVersion`'s form
/// (CUDA 12.4: NVIDIA's R550 drivers).
pub const MIN_DRIVER_VERSION: i32 = 12040;

/// From this driver on, `cuEventElapsedTime_v2` exists (cudarc's
/// `cuda-13000` bindings call it); before it, `cuEventElapsedTime`.
pub const EVENT_ELAPSED_V2_DRIVER: i32 = 12080;

/// A CUDA version as `cuDriverGetVersion` gives it (12040), for messages:
/// "12.4".
pub fn version_text(version: i32) -> String {
    format!("{}.{}", version / 1000, version % 1000 / 10)
}

/// What an architecture offers the kernels (compute capability ×10 + minor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArchFeatures {
    pub arch: u32,
    /// `mma.sync.m16n8k16` with f16 operands and f32 accumulators
    /// (sm_80; Turing's tensor cores have m16n8k8 only).
    pub mma_f16_m16n8k16: bool,
    /// `cp.async`, global to shared memory without registers (sm_80).
    pub cp_async: bool,
    /// `ldmatrix` (sm_75 in the PTX ISA; conv_mma.cu compiles it for sm_80
    /// and newer only, beside the other two).
    pub ldmatrix: bool,
    /// bf16 conversions and tensor-core products (sm_80): what
    /// `HalfFormat::Bf16` needs (`CudaBackend::with_half` refuses it below).
    pub mma_bf16: bool,
}

impl ArchFeatures {
    pub fn of(arch: u32) -> Self {
        Self {
            arch,
            mma_f16_m16n8k16: arch >= 80,
            cp_async: arch >= 80,
            ldmatrix: arch >= 75,
            mma_bf16: arch >= 80,
        }
    }

    /// Whether the implicit-GEMM convolution kernels (conv_mma.cu: cp.async
    /// tiles, ldmatrix fragments, mma.m16n8k16) run here; elsewhere every
    /// convolution takes im2col + cuBLAS or the direct kernels.
    pub fn implicit_gemm(&self) -> bool {
        self.mma_f16_m16n8k16 && self.cp_async && self.ldmatrix
    }
}

/// One op family and the path it takes on a GPU, under the defaults
/// (`device.conv_algorithm = "auto"`, fusion and graphs on, mixed
/// precision).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpPath {
    pub family: &'static str,
    pub path: String,
}

/// Which path each op family takes on a GPU of compute capability `arch`:
/// the rules of the families' launches (`ops/<family>/cuda.rs`), stated once.
pub fn op_paths(arch: u32) -> Vec<OpPath> {
    let features = ArchFeatures::of(arch);
    let path = |family, path: &str| OpPath {
        family,
        path: path.to_string(),
    };
    let convolutions = if features.implicit_gemm() {
        "implicit GEMM on the tensor cores (mma.m16n8k16, cp.async, ldmatrix) for stride 1 and \
         8 to 64 channels in and out (multiples of 8); 1x1 stride-1 unpadded a cuBLAS product; \
         direct kernels for fewer than 8 outputs or a first layer's few input channels; \
         im2col + cuBLAS elsewhere"
            .to_string()
    } else {
        format!(
            "im2col + cuBLAS (the fallback: implicit GEMM needs mma.m16n8k16 and cp.async, \
             sm_80, and this GPU is sm_{arch}); 1x1 stride-1 unpadded a cuBLAS product; direct \
             kernels for fewer than 8 outputs or a first layer's few input channels"
        )
    };
    vec![
        OpPath {
            family: "conv",
            path: convolutions,
        },
        path(
            "linear",
            "cuBLAS GEMM (f16 or bf16 operands, f32 accumulation; f32 with --no-amp)",
        ),
        path(
            "batch_norm",
            "headroom's kernels, 8 channels a thread in f16 (fused with ReLU and the residual \
             add; separate with --no-fusion)",
        ),
        path(
            "activation",
            "headroom's elementwise kernels (ReLU, SiLU, GELU, dropout)",
        ),
        path(
            "pool",
            "headroom's kernels (max, global average, upsample, UNet concat)",
        ),
        path("layer_norm", "headroom's kernels, a warp per row"),
        path(
            "sequence",
            "attention: headroom's kernels, a warp per row (no T x T matrix); LSTM: cuBLAS \
             GEMMs and a cell kernel; embedding: headroom's kernels",
        ),
        path("loss", "headroom's kernels, a warp per row"),
        path(
            "optimizer",
            "the fused AdamW kernels (unscale, check, clip, update, f16 write-back)",
        ),
        path(
            "step",
            "captured into a CUDA graph and replayed (device.graphs; --no-graphs)",
        ),
        OpPath {
            family: "precision",
            path: if features.mma_bf16 {
                "f16 with dynamic loss scaling (the default), bf16 (device.precision = \"bf16\": \
                 bf16 conversions and tensor-core products, no loss scaling) or f32"
                    .to_string()
            } else {
                format!(
                    "f16 with dynamic loss scaling (the default) or f32; no bf16 (it needs sm_80, \
                     and this GPU is sm_{arch})"
                )
            },
        },
    ]
}

/// Refuses a driver older than `MIN_DRIVER_VERSION`, naming both.
pub fn check_driver(version: i32) -> CudaResult<()> {
    if version >= MIN_DRIVER_VERSION {
        return Ok(());
    }
    Err(CudaError::DriverTooOld {
        found: version_text(version),
        needed: version_text(MIN_DRIVER_VERSION),
    })
}

/// Refuses an NVRTC whose output this driver could not load: a newer major
/// version (its PTX ISA and CUBIN format are the newer CUDA's), or PTX
/// (`target`) from a newer NVRTC than the driver's JIT. `nvrtc` is
/// (major, minor), `driver` in `cuDriverGetVersion`'s form.
pub fn check_nvrtc_for_driver(nvrtc: (i32, i32), driver: i32, target: Target) -> CudaResult<()> {
    let (major, minor) = nvrtc;
    let nvrtc_version = major * 1000 + minor * 10;
    let driver_major = driver / 1000;
    let reason = if major > driver_major {
        format!(
            "its PTX and CUBINs are made for drivers of CUDA {major} (NVRTC 13: PTX ISA 9.x, \
             CUBINs of ELF ABI version 8), which a driver for CUDA {} cannot load",
            version_text(driver)
        )
    } else if matches!(target, Target::Ptx(_)) && nvrtc_version > driver {
        format!(
            "this GPU needs PTX (NVRTC has no CUBIN target for it), and PTX from NVRTC \
             {major}.{minor} needs a driver for CUDA {major}.{minor} or newer to compile it"
        )
    } else {
        return Ok(());
    };
    Err(CudaError::NvrtcTooNew {
        nvrtc: format!("{major}.{minor}"),
        driver: version_text(driver),
        reason,
        hint: nvrtc_hint(driver_major),
    })
}

/// How to get an NVRTC that matches a driver of CUDA `major`.
fn nvrtc_hint(major: i32) -> String {
    match major {
        12 => "install NVRTC 12 (`python3 -m pip install nvidia-cuda-nvrtc-cu12`; headroom \
               looks for the driver's major version first, and HEADROOM_NVRTC=/path/to/libnvrtc.so.12 \
               names one) and cuBLAS 12 (`python3 -m pip install nvidia-cublas-cu12`), or update \
               the NVIDIA driver (R580 or newer serves CUDA 13)"
            .into(),
        _ => format!(
            "install the NVRTC of CUDA {major} and name it with HEADROOM_NVRTC, or update the \
             NVIDIA driver"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turing_lacks_the_implicit_kernels_instructions_and_ampere_on_has_them() {
        assert!(!ArchFeatures::of(75).implicit_gemm());
        assert!(ArchFeatures::of(75).ldmatrix);
        assert!(!ArchFeatures::of(75).mma_bf16);
        for arch in [80, 86, 89, 90] {
            assert!(ArchFeatures::of(arch).implicit_gemm(), "sm_{arch}");
        }
        let conv = |arch| op_paths(arch).into_iter().find(|p| p.family == "conv");
        assert!(conv(75)
            .unwrap()
            .path
            .starts_with("im2col + cuBLAS (the fallback"));
        assert!(conv(86).unwrap().path.starts_with("implicit GEMM"));
        let precision = |arch| op_paths(arch).into_iter().find(|p| p.family == "precision");
        assert!(precision(75).unwrap().path.contains("no bf16"));
        assert!(precision(80)
            .unwrap()
            .path
            .contains("bf16 (device.precision"));
    }

    #[test]
    fn a_driver_older_than_12_4_is_refused_naming_both_versions() {
        check_driver(12040).unwrap();
        check_driver(13000).unwrap();
        let e = check_driver(12020).unwrap_err().to_string();
        assert!(e.contains("12.2") && e.contains("12.4"), "{e}");
        assert_eq!(version_text(12090), "12.9");
    }

    #[test]
    fn nvrtc_13_is_refused_on_a_cuda_12_driver_and_ptx_past_the_driver_too() {
        check_nvrtc_for_driver((13, 0), 13000, Target::Cubin(90)).unwrap();
        check_nvrtc_for_driver((12, 9), 13000, Target::Ptx(90)).unwrap();
        check_nvrtc_for_driver((12, 9), 12040, Target::Cubin(86)).unwrap();
        let e = check_nvrtc_for_driver((13, 5), 12040, Target::Cubin(86))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("13.5") && e.contains("12.4") && e.contains("nvidia-cuda-nvrtc-cu12"),
            "{e}"
        );
        let e = check_nvrtc_for_driver((12, 9), 12040, Target::Ptx(90))
            .unwrap_err()
            .to_string();
        assert!(e.contains("PTX") && e.contains("12.9"), "{e}");
    }
}
