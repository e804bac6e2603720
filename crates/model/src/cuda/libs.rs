//! Finding the CUDA libraries that cudarc loads at run time.
//!
//! cudarc (feature `dynamic-loading`) `dlopen`s `libcuda`, `libnvrtc` and
//! `libcublas` by bare name on first use, so they are found only on the
//! loader's default path (`LD_LIBRARY_PATH`, `ld.so.cache`, ...), and it
//! PANICS when one is missing. This module checks first and never panics:
//!
//! - The driver (`libcuda.so.1`) comes with the NVIDIA driver, in a system
//!   directory; it is only checked for (`driver_present`).
//! - NVRTC and cuBLAS are often pip wheels (`pip install nvidia-cuda-nvrtc
//!   nvidia-cuda-runtime nvidia-cublas`) whose `lib` directories are not on
//!   the loader path. If the bare name does not load, we look in
//!   `$HEADROOM_CUDA_LIB_DIR` (a `:`-separated list), `$CUDA_HOME`,
//!   `$CUDA_PATH`, `/usr/local/cuda`, and the `nvidia` package directories that
//!   `python3` reports (`$HEADROOM_PYTHON` names another interpreter), and
//!   `dlopen` the file found by full path with `RTLD_GLOBAL`. The loader then
//!   matches cudarc's later bare-name `dlopen("libnvrtc.so.13")` against the
//!   SONAME of the library already loaded, so cudarc uses it.
//!
//! - Which major version is looked for first follows the driver
//!   (`driver_major`): a driver for CUDA 12 gets `libnvrtc.so.12` and
//!   `libcublas.so.12` first, since NVRTC 13's kernels and cuBLAS 13 need a
//!   CUDA 13 driver (`arch.rs`); any other driver, or none, gets the 13s
//!   first. `$HEADROOM_NVRTC` names the NVRTC library file to use, before
//!   any search. cudarc tries its bare names in its own order (`.so.13`
//!   before `.so.12`), so a library of the other major version on the
//!   loader's default path still wins; `CudaBackend::new` then refuses an
//!   NVRTC the driver cannot serve, naming both versions.
//!
//! The result is computed once per process.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::{CudaError, CudaResult};

/// Install command printed when NVRTC is missing.
pub const NVRTC_INSTALL_HINT: &str =
    "install it with `pip install nvidia-cuda-nvrtc nvidia-cuda-runtime` \
     (or a CUDA toolkit), or point HEADROOM_CUDA_LIB_DIR at the directory holding libnvrtc.so.13";

/// Install command printed when cuBLAS is missing.
pub const CUBLAS_INSTALL_HINT: &str =
    "install it with `pip install nvidia-cublas` (or a CUDA toolkit), \
     or point HEADROOM_CUDA_LIB_DIR at the directory holding libcublas.so.13";

/// Whether the CUDA driver library can be loaded (says nothing about GPUs).
pub fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: is_culib_present only tries to dlopen candidate names and
    // reports whether one loaded; it does not call into the library.
    *PRESENT.get_or_init(|| unsafe { cudarc::driver::sys::is_culib_present() })
}

/// Makes NVRTC loadable for cudarc, or says how to install it. Returns the
/// path it preloaded, if it had to.
pub fn ensure_nvrtc() -> CudaResult<Option<PathBuf>> {
    static NVRTC: OnceLock<Result<Option<PathBuf>, String>> = OnceLock::new();
    NVRTC
        .get_or_init(|| {
            // SAFETY: as in driver_present.
            let present = || unsafe { cudarc::nvrtc::sys::is_culib_present() };
            if let Some(path) = std::env::var_os(NVRTC_ENV) {
                let path = PathBuf::from(path);
                return if preload(&path) && present() {
                    Ok(Some(path))
                } else {
                    Err(format!(
                        "{NVRTC_ENV}={} does not load as NVRTC (expected the path of a \
                         libnvrtc.so.12 or libnvrtc.so.13)",
                        path.display()
                    ))
                };
            }
            let names: &[&str] = if driver_major() == Some(12) {
                &["libnvrtc.so.12", "libnvrtc.so", "libnvrtc.so.13"]
            } else {
                NVRTC_FILE_NAMES
            };
            locate(present, names, &[]).ok_or_else(|| NVRTC_INSTALL_HINT.to_string())
        })
        .clone()
        .map_err(|hint| CudaError::LibraryMissing {
            library: "NVRTC (libnvrtc)",
            hint,
        })
}

/// Makes cuBLAS loadable for cudarc, or says how to install it.
pub fn ensure_cublas() -> CudaResult<Option<PathBuf>> {
    static CUBLAS: OnceLock<Result<Option<PathBuf>, String>> = OnceLock::new();
    CUBLAS
        .get_or_init(|| {
            // SAFETY: as in driver_present.
            let present = || unsafe { cudarc::cublas::sys::is_culib_present() };
            // libcublas needs libcublasLt from the same release; loading it
            // first from the same directory satisfies that dependency even
            // without an RPATH.
            let (names, deps): (&[&str], &[&str]) = if driver_major() == Some(12) {
                (
                    &["libcublas.so.12", "libcublas.so", "libcublas.so.13"],
                    &["libcublasLt.so.12", "libcublasLt.so", "libcublasLt.so.13"],
                )
            } else {
                (
                    &["libcublas.so.13", "libcublas.so.12", "libcublas.so"],
                    &["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"],
                )
            };
            locate(present, names, deps).ok_or_else(|| CUBLAS_INSTALL_HINT.to_string())
        })
        .clone()
        .map_err(|hint| CudaError::LibraryMissing {
            library: "cuBLAS (libcublas)",
            hint,
        })
}

/// Install command printed when NCCL is missing.
pub const NCCL_INSTALL_HINT: &str =
    "install it with `pip install nvidia-nccl-cu13` (or nvidia-nccl-cu12 for a CUDA 12 driver, \
     or the libnccl2 package), and start the ranks with `cargo xtask train --devices N`, which \
     puts it on their library path";

/// Whether cudarc can load NCCL (`libnccl.so` and its other bare names on
/// the loader's path): true in a rank that `train --devices N` started,
/// or with the emulator's NCCL loaded. Asked afresh each time (cheap: a
/// dlopen of a library already loaded).
pub fn nccl_present() -> bool {
    // SAFETY: as in driver_present.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// NCCL for cudarc, or an error saying how to get it. NCCL cannot be
/// preloaded as NVRTC and cuBLAS are: its files are named `libnccl.so.2`,
/// a name cudarc never asks for, so it must be on the loader's path as
/// `libnccl.so` before the process starts (`nccl_library` finds one for
/// a launcher).
pub fn ensure_nccl() -> CudaResult<()> {
    if nccl_present() {
        return Ok(());
    }
    let hint = match nccl_library() {
        Some(found) => format!(
            "{} is there but not on this process's library path as libnccl.so; start the ranks \
             with `cargo xtask train --devices N`, which arranges that",
            found.display()
        ),
        None => NCCL_INSTALL_HINT.to_string(),
    };
    Err(CudaError::LibraryMissing {
        library: "NCCL (libnccl)",
        hint,
    })
}

/// An NCCL library file on this machine: the search directories of NVRTC
/// and cuBLAS, NCCL's own pip wheel (`nvidia/nccl/lib`) and the system
/// library directories, `libnccl.so.2` or `libnccl.so`. None when there is
/// none.
pub fn nccl_library() -> Option<PathBuf> {
    let mut dirs = search_dirs();
    for base in python_nvidia_dirs() {
        dirs.push(base.join("nccl/lib"));
    }
    for system in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/lib",
    ] {
        dirs.push(PathBuf::from(system));
    }
    dirs.iter()
        .flat_map(|dir| ["libnccl.so.2", "libnccl.so"].map(|name| dir.join(name)))
        .find(|path| path.is_file())
}

/// The environment variable naming the NVRTC library file to load.
pub const NVRTC_ENV: &str = "HEADROOM_NVRTC";

/// The CUDA major version of the driver, if a driver library loads (no
/// GPU needed: `cuDriverGetVersion` works before `cuInit`). Asked afresh,
/// not through `driver_present`'s cached answer: a test process may look
/// for NVRTC before it loads the emulated driver, and must not leave "no
/// driver" cached for the probe that follows.
pub fn driver_major() -> Option<i32> {
    // SAFETY: as in driver_present.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return None;
    }
    std::panic::catch_unwind(super::backend::driver_version)
        .ok()?
        .ok()
        .map(|v| v / 1000)
}

/// Some(None) if `present()` already; Some(path) after preloading one of
/// `names` (with its `deps` first) from a search directory; None if nothing
/// worked.
fn locate(present: impl Fn() -> bool, names: &[&str], deps: &[&str]) -> Option<Option<PathBuf>> {
    if present() {
        return Some(None);
    }
    // For a CUDA 12 driver the version matters more than the directory
    // (the pip packages of CUDA 13 and 12 have directories of their own):
    // every directory is searched for the first name before the next.
    let dirs = search_dirs();
    let by_name = driver_major() == Some(12);
    let mut candidates = Vec::new();
    if by_name {
        for name in names {
            candidates.extend(dirs.iter().map(|dir| (dir, *name)));
        }
    } else {
        for dir in &dirs {
            candidates.extend(names.iter().map(|name| (dir, *name)));
        }
    }
    for (dir, name) in candidates {
        let path = dir.join(name);
        if !path.is_file() {
            continue;
        }
        for dep in deps {
            let dep = dir.join(dep);
            if dep.is_file() {
                preload(&dep);
            }
        }
        if preload(&path) && present() {
            return Some(Some(path));
        }
    }
    None
}

// search_dirs_with, query_python_nvidia_dirs and the name lists: shared
// with the build scripts that decide whether the NVRTC tests are built to
// run (crates/model/build.rs), so that both look in the same places.
include!("lib_search.rs");

/// Directories searched for NVRTC and cuBLAS when the loader's default path
/// lacks them, in order.
pub fn search_dirs() -> Vec<PathBuf> {
    search_dirs_with(&python_nvidia_dirs())
}

/// The directories of the `nvidia` namespace package, as `python3` sees them
/// (pip wheels of the CUDA libraries install there), asked once per
/// process. Empty if there is no Python or no such package.
fn python_nvidia_dirs() -> Vec<PathBuf> {
    static DIRS: OnceLock<Vec<PathBuf>> = OnceLock::new();
    DIRS.get_or_init(query_python_nvidia_dirs).clone()
}

/// dlopen(path, RTLD_NOW | RTLD_GLOBAL), keeping the handle for the life of
/// the process. True if it loaded.
#[cfg(unix)]
fn preload(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c_path) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: c_path is a NUL-terminated path; loading a shared library runs
    // its initialisers, which for NVIDIA's libraries only set up their own
    // state. The handle is deliberately never closed.
    let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    !handle.is_null()
}

#[cfg(not(unix))]
fn preload(_path: &Path) -> bool {
    false
}
