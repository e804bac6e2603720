//! A CPU emulator of the CUDA driver, cuBLAS and NCCL, for tests only: it lets the
//! real CUDA path of `headroom-model` (`CudaBackend`, its ops, GEMMs, the
//! fused optimizer, the staging ring) run unchanged on a machine without a
//! GPU, with every kernel of headroom-model's `.cu` files
//! (`crates/model/src/ops/<family>/*.cu`, `src/cuda/optim.cu`) compiled as
//! host C++.
//!
//! build.rs compiles a fake `libcuda.so` (driver entry points plus the
//! kernels), a fake `libcublas.so` and a fake `libnccl.so` (the ranks of a
//! data-parallel run as processes, messages through files: shim/nccl.cpp)
//! into OUT_DIR. [`install`] loads them by full path with `RTLD_GLOBAL`;
//! cudarc, which dlopens `libcuda.so`, `libcublas.so` and `libnccl.so` by
//! bare name on first use, then gets these (the dynamic
//! loader matches a bare name against the SONAME of an already loaded
//! library). So `install` must run before anything in the process touches
//! the CUDA driver, and the choice between a real GPU and the emulator is
//! made without cudarc ([`real_gpu_present`]).
//!
//! This crate is a dev-dependency only: no release binary contains it.
//!
//! ```
//! // Load the emulated driver before anything touches CUDA; without a C++
//! // compiler it was not built, which a CI run (HEADROOM_REQUIRE_NVRTC)
//! // does not accept.
//! if let Err(why) = headroom_cuda_emu::install() {
//!     assert!(std::env::var_os("HEADROOM_REQUIRE_NVRTC").is_none(), "{why}");
//!     eprintln!("skipped: {why}");
//!     return;
//! }
//! // The kernels' own f16 rounding, as a kernel computes it.
//! let half = headroom_cuda_emu::f32_to_f16_bits(1.5).unwrap();
//! assert_eq!(half, 0x3e00);
//! assert_eq!(headroom_cuda_emu::f16_bits_to_f32(half).unwrap(), 1.5);
//! // Every kernel of crates/model's .cu files is compiled in, by name.
//! let kernels = headroom_cuda_emu::kernel_names().unwrap();
//! assert!(kernels.iter().any(|name| name.starts_with("adamw")), "{kernels:?}");
//! ```

use std::ffi::{c_char, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The name the emulated device reports.
pub const DEVICE_NAME: &str = "headroom CPU emulator";

const LIB_DIR: &str = env!("HEADROOM_CUDA_EMU_LIB_DIR");
const MISSING: &str = env!("HEADROOM_CUDA_EMU_MISSING");

/// Handles of the loaded fake libraries (never closed).
struct Loaded {
    driver: *mut c_void,
}

// SAFETY: a dlopen handle is a process-wide token that dlsym accepts from
// any thread; it is never closed.
unsafe impl Send for Loaded {}
// SAFETY: as above; the handle is only read.
unsafe impl Sync for Loaded {}

/// Where build.rs put the libraries.
pub fn lib_dir() -> &'static Path {
    Path::new(LIB_DIR)
}

/// Loads the fake driver, cuBLAS and NCCL so that cudarc uses them. Idempotent.
/// Err when the libraries were not built (no C++ compiler) or do not load.
pub fn install() -> Result<(), String> {
    loaded().map(|_| ())
}

fn loaded() -> Result<&'static Loaded, String> {
    static LOADED: OnceLock<Result<Loaded, String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            if !MISSING.is_empty() {
                return Err(format!(
                    "the CUDA emulator was not built: {MISSING} (install g++ or set CXX, then rebuild)"
                ));
            }
            let driver = dlopen_global(&lib_dir().join("libcuda.so"))?;
            dlopen_global(&lib_dir().join("libcublas.so"))?;
            dlopen_global(&lib_dir().join("libnccl.so"))?;
            Ok(Loaded { driver })
        })
        .as_ref()
        .map_err(Clone::clone)
}

fn dlopen_global(path: &Path) -> Result<*mut c_void, String> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| format!("{} contains a NUL byte", path.display()))?;
    // SAFETY: c_path is NUL-terminated; the libraries' initialisers only
    // register the compiled-in kernels. The handle is never closed.
    let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        return Err(format!("dlopen {}: {}", path.display(), dlerror()));
    }
    Ok(handle)
}

fn dlerror() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until
    // the next dl* call on this thread; it is copied at once.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown error".to_string()
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

/// Whether a real CUDA driver with at least one GPU is on this machine,
/// asked of the driver directly (not through cudarc, which would then stay
/// bound to it). Call it before [`install`].
pub fn real_gpu_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // The real driver's SONAME, not the emulator's, so this never finds
        // the fake one.
        let Ok(name) = CString::new("libcuda.so.1") else {
            return false;
        };
        // SAFETY: loading the NVIDIA driver library runs only its own
        // initialisers; RTLD_LOCAL keeps its symbols out of the global scope.
        // The handle stays open: the driver must not be unloaded once
        // initialised.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return false;
        }
        type InitFn = unsafe extern "C" fn(u32) -> i32;
        type CountFn = unsafe extern "C" fn(*mut i32) -> i32;
        // SAFETY: the names are the driver API's cuInit and cuDeviceGetCount,
        // whose C signatures are the types above.
        unsafe {
            let init = libc::dlsym(handle, c"cuInit".as_ptr());
            let count = libc::dlsym(handle, c"cuDeviceGetCount".as_ptr());
            if init.is_null() || count.is_null() {
                return false;
            }
            let init: InitFn = std::mem::transmute::<*mut c_void, InitFn>(init);
            let count_fn: CountFn = std::mem::transmute::<*mut c_void, CountFn>(count);
            if init(0) != 0 {
                return false;
            }
            let mut n = 0i32;
            count_fn(&mut n) == 0 && n > 0
        }
    })
}

fn symbol(name: &CStr) -> Result<*mut c_void, String> {
    let lib = loaded()?;
    // SAFETY: the handle is live (never closed) and name is NUL-terminated.
    let sym = unsafe { libc::dlsym(lib.driver, name.as_ptr()) };
    if sym.is_null() {
        Err(format!("the emulator lacks {}", name.to_string_lossy()))
    } else {
        Ok(sym)
    }
}

/// The kernels' own f32 → f16 conversion (common.cuh built for the host),
/// for testing it against the `half` crate.
pub fn f32_to_f16_bits(x: f32) -> Result<u16, String> {
    type F = unsafe extern "C" fn(f32) -> u16;
    let f = symbol(c"hr_emu_f32_to_f16")?;
    // SAFETY: the symbol is `unsigned short hr_emu_f32_to_f16(float)`.
    Ok(unsafe { std::mem::transmute::<*mut c_void, F>(f)(x) })
}

/// The kernels' own f16 → f32 conversion.
pub fn f16_bits_to_f32(h: u16) -> Result<f32, String> {
    type F = unsafe extern "C" fn(u16) -> f32;
    let f = symbol(c"hr_emu_f16_to_f32")?;
    // SAFETY: the symbol is `float hr_emu_f16_to_f32(unsigned short)`.
    Ok(unsafe { std::mem::transmute::<*mut c_void, F>(f)(h) })
}

/// Prefix of the emulator's own test kernels (shim/selftest.cu).
pub const SELFTEST_PREFIX: &str = "hr_emu_selftest_";

/// The names of every kernel of headroom-model's `.cu` files compiled into the
/// emulator, sorted (the self-test kernels left out).
pub fn kernel_names() -> Result<Vec<String>, String> {
    type F = unsafe extern "C" fn() -> *const c_char;
    let f = symbol(c"hr_emu_kernel_names")?;
    // SAFETY: the symbol returns a NUL-terminated string with static storage.
    let text = unsafe { CStr::from_ptr(std::mem::transmute::<*mut c_void, F>(f)()) };
    Ok(text
        .to_string_lossy()
        .lines()
        .filter(|n| !n.starts_with(SELFTEST_PREFIX))
        .map(str::to_string)
        .collect())
}

/// How many times the kernel `name` has run in this process (launched
/// directly or replayed in a graph).
pub fn kernel_runs(name: &str) -> Result<u64, String> {
    type F = unsafe extern "C" fn(*const c_char) -> u64;
    let f = symbol(c"hr_emu_kernel_runs")?;
    let name = CString::new(name).map_err(|e| format!("kernel name {name:?}: {e}"))?;
    // SAFETY: the symbol has this signature and reads the NUL-terminated
    // name only during the call.
    Ok(unsafe { std::mem::transmute::<*mut c_void, F>(f)(name.as_ptr()) })
}

/// [`install`], and from then on refuse a launch with more than `threads`
/// threads in a block (clamped to 1..=1024) with
/// `CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES`, as a GPU refuses a block whose
/// registers do not fit an SM. A harness passes the width its kernels'
/// resources were checked against, so that a wider launch fails in the
/// tests, not first on a GPU. The limit is the whole process's.
pub fn install_with_widest_block(threads: u32) -> Result<(), String> {
    install()?;
    type F = unsafe extern "C" fn(u32);
    let f = symbol(c"hr_emu_limit_block_threads")?;
    // SAFETY: the symbol is `void hr_emu_limit_block_threads(unsigned int)`.
    unsafe { std::mem::transmute::<*mut c_void, F>(f)(threads) };
    Ok(())
}

/// What the emulated device answers as: its compute capability (×10 +
/// minor, 80 for 8.0) and its driver's CUDA version in
/// `cuDriverGetVersion`'s form (13000 for 13.0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceModel {
    pub arch: u32,
    pub driver: i32,
}

/// [`install`], and from then on answer as `model`: the compute capability
/// the backend picks kernels and NVRTC targets by, the driver version it
/// checks, and what follows (an instruction the architecture lacks fails
/// its launch; an image it or the driver could not load is refused, as
/// shim/device.cpp describes). The whole process's; without a call, the
/// environment's `HEADROOM_CUDA_EMU_ARCH` (e.g. `75`, `7.5`, `sm_75`) and
/// `HEADROOM_CUDA_EMU_DRIVER` (e.g. `12.4`, `12040`), else sm_80 and 13.0.
pub fn answer_as(model: DeviceModel) -> Result<(), String> {
    install()?;
    type F = unsafe extern "C" fn(u32, i32);
    let f = symbol(c"hr_emu_answer_as")?;
    // SAFETY: the symbol is `void hr_emu_answer_as(unsigned int, int)`.
    unsafe { std::mem::transmute::<*mut c_void, F>(f)(model.arch, model.driver) };
    Ok(())
}

/// What the emulated device answers as now.
pub fn device_model() -> Result<DeviceModel, String> {
    type Arch = unsafe extern "C" fn() -> u32;
    type Driver = unsafe extern "C" fn() -> i32;
    let arch = symbol(c"hr_emu_device_arch")?;
    let driver = symbol(c"hr_emu_driver_version")?;
    // SAFETY: the symbols are `unsigned int hr_emu_device_arch()` and
    // `int hr_emu_driver_version()`.
    unsafe {
        Ok(DeviceModel {
            arch: std::mem::transmute::<*mut c_void, Arch>(arch)(),
            driver: std::mem::transmute::<*mut c_void, Driver>(driver)(),
        })
    }
}

/// The fake libraries' paths (for messages).
pub fn libraries() -> [PathBuf; 2] {
    [lib_dir().join("libcuda.so"), lib_dir().join("libcublas.so")]
}
