//! Decides whether the tests that need NVRTC are built to run or as ignored.
//!
//! The CUDA tests compile every kernel with NVRTC (also for the CPU emulator
//! of CUDA, which validates them as the GPU path does). On a machine without
//! it they used to return early and count as passed; now each carries
//! `#[cfg_attr(not(headroom_nvrtc), ignore = "NVRTC not found: ...")]`, so
//! `cargo test` reports them as ignored, with the reason. This script sets
//! `--cfg headroom_nvrtc` when NVRTC is found by the lookup the run time
//! uses (`src/cuda/lib_search.rs`, shared with `src/cuda/libs.rs`): the
//! bare names the loader resolves, then `$HEADROOM_CUDA_LIB_DIR`,
//! `$CUDA_HOME`, `$CUDA_PATH`, `$CUDA_ROOT`, `/usr/local/cuda` and the pip
//! package `nvidia` as `python3` (or `$HEADROOM_PYTHON`) reports it.
//!
//! `HEADROOM_REQUIRE_NVRTC=1` (CI) or `HEADROOM_REQUIRE_GPU=1`
//! (`cargo xtask gpu-check`) is checked when the tests run, not here: each
//! CUDA test binary's always-run test (`tests/src/nvrtc_gate.rs`) fails
//! when its tests were built as ignored under either. Reading them here
//! would make every change of them (gpu-check sets one for its inner
//! `cargo test`) rebuild headroom-model and every crate above it.
//!
//! The answer is the build's: NVRTC installed after it is not seen until
//! this script reruns (it reruns when one of the variables above changes,
//! or when this file is touched: the scripts of headroom-pipeline and
//! headroom-tests compile it in, so they rerun too); the tests' exit report
//! says so when it finds NVRTC at run time. headroom-pipeline's and headroom-tests'
//! build scripts run this one's `nvrtc_tests` module.

fn main() {
    nvrtc_tests::configure();
    nvrtc_tests::configure_nvrtc12();
}

pub mod nvrtc_tests {
    use std::ffi::{CString, OsStr};
    use std::os::unix::ffi::OsStrExt;

    // NVRTC_BARE_NAMES, NVRTC_FILE_NAMES, SEARCH_ENV_VARS,
    // search_dirs_with, query_python_nvidia_dirs.
    include!("src/cuda/lib_search.rs");

    /// Set when the tests that need NVRTC are built to run.
    pub const CFG: &str = "headroom_nvrtc";

    pub fn configure() {
        println!("cargo::rustc-check-cfg=cfg({CFG})");
        // Not LD_LIBRARY_PATH or PATH, though the lookup sees them: cargo
        // and `cargo run` rewrite LD_LIBRARY_PATH for the processes they
        // start, and a rerun of this script rebuilds every crate above
        // headroom-model.
        for var in SEARCH_ENV_VARS {
            println!("cargo::rerun-if-env-changed={var}");
        }
        let package = std::env::var("CARGO_PKG_NAME").unwrap_or_default();
        match find_nvrtc() {
            Some(_) => println!("cargo::rustc-cfg={CFG}"),
            None => println!(
                "cargo::warning={package}: NVRTC not found: the tests that need it are \
                 built as ignored (`cargo test` lists them as such, and fails under \
                 HEADROOM_REQUIRE_NVRTC=1); to run them: python3 -m pip install \
                 nvidia-cuda-nvrtc, then touch crates/model/build.rs (the three build \
                 scripts that decide it compile it in)"
            ),
        }
    }

    /// Where NVRTC loads from (a bare name or a path), as the run time's
    /// `libs::ensure_nvrtc` would find it; None if nowhere.
    fn find_nvrtc() -> Option<String> {
        for name in NVRTC_BARE_NAMES {
            if loads(OsStr::new(name)) {
                return Some((*name).to_string());
            }
        }
        for dir in search_dirs_with(&query_python_nvidia_dirs()) {
            for name in NVRTC_FILE_NAMES {
                let path = dir.join(name);
                if path.is_file() && loads(path.as_os_str()) {
                    return Some(path.display().to_string());
                }
            }
        }
        None
    }

    /// Set when NVRTC 12 (`libnvrtc.so.12`, e.g. the pip package
    /// `nvidia-cuda-nvrtc-cu12`) is found beside NVRTC 13: `cuda_ptx`'s
    /// test that compiles every kernel with it for the drivers of CUDA 12
    /// is built to run, and otherwise as ignored with the install command
    /// (headroom-model's own script only; the NVRTC gate does not count it).
    pub const CFG_NVRTC12: &str = "headroom_nvrtc12";

    pub fn configure_nvrtc12() {
        println!("cargo::rustc-check-cfg=cfg({CFG_NVRTC12})");
        if find_nvrtc12().is_some() {
            println!("cargo::rustc-cfg={CFG_NVRTC12}");
        }
    }

    /// The first `libnvrtc.so.12` of the search directories that loads.
    pub fn find_nvrtc12() -> Option<std::path::PathBuf> {
        search_dirs_with(&query_python_nvidia_dirs())
            .into_iter()
            .map(|dir| dir.join("libnvrtc.so.12"))
            .find(|path| path.is_file() && loads(path.as_os_str()))
    }

    /// Whether `dlopen` loads `name` (then closed again).
    fn loads(name: &OsStr) -> bool {
        let Ok(c_name) = CString::new(name.as_bytes()) else {
            return false;
        };
        // SAFETY: c_name is NUL-terminated; loading NVRTC runs only its own
        // initialisers, and the handle is closed before anything else uses
        // it.
        unsafe {
            let handle = libc::dlopen(c_name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
            if handle.is_null() {
                return false;
            }
            libc::dlclose(handle);
        }
        true
    }
}
