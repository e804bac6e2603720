// Where NVRTC and cuBLAS are looked for when the loader's default path
// lacks them. Plain std, no crate items: `libs.rs` includes it, and so do
// the build scripts of headroom-model, headroom-pipeline and headroom-tests
// (through crates/model/build.rs), which decide with the same lookup
// whether the tests that need NVRTC are built to run or as ignored.

/// The bare names cudarc `dlopen`s for NVRTC on Linux (the Linux subset of
/// its `get_lib_name_candidates("nvrtc")`), tried before any directory.
pub const NVRTC_BARE_NAMES: &[&str] = &[
    "libnvrtc.so",
    "libnvrtc.so.13",
    "libnvrtc.so.12",
    "libnvrtc.so.11",
    "libnvrtc.so.10",
    "libnvrtc.so.9",
    "libnvrtc.so.1",
];

/// The NVRTC files looked for in each search directory, in order.
pub const NVRTC_FILE_NAMES: &[&str] = &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

/// The environment variables that change where the search looks (a build
/// script reruns when one changes).
pub const SEARCH_ENV_VARS: &[&str] = &[
    "HEADROOM_CUDA_LIB_DIR",
    "CUDA_HOME",
    "CUDA_PATH",
    "CUDA_ROOT",
    "HEADROOM_PYTHON",
];

/// Directories searched for NVRTC and cuBLAS when the loader's default path
/// lacks them, in order, given the `nvidia` package directories.
fn search_dirs_with(python_nvidia_dirs: &[std::path::PathBuf]) -> Vec<std::path::PathBuf> {
    use std::path::PathBuf;
    let mut dirs = Vec::new();
    if let Some(list) = std::env::var_os("HEADROOM_CUDA_LIB_DIR") {
        dirs.extend(std::env::split_paths(&list));
    }
    for var in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"] {
        if let Some(root) = std::env::var_os(var) {
            let root = PathBuf::from(root);
            dirs.push(root.join("lib64"));
            dirs.push(root.join("lib"));
            dirs.push(root.join("targets/x86_64-linux/lib"));
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    for base in python_nvidia_dirs {
        // CUDA 13 wheels share nvidia/cu13/lib; CUDA 12 wheels have one
        // directory per package.
        for sub in ["cu13/lib", "cuda_nvrtc/lib", "cublas/lib", "cu12/lib"] {
            dirs.push(base.join(sub));
        }
    }
    dirs.retain(|d| d.is_dir());
    dirs.dedup();
    dirs
}

/// The directories of the `nvidia` namespace package, as `python3` sees them
/// (pip wheels of the CUDA libraries install there), asked afresh. Empty if
/// there is no Python or no such package.
fn query_python_nvidia_dirs() -> Vec<std::path::PathBuf> {
    let python = std::env::var_os("HEADROOM_PYTHON").unwrap_or_else(|| "python3".into());
    let out = std::process::Command::new(python)
        .args(["-c", "import nvidia\nfor p in nvidia.__path__: print(p)"])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output();
    match out {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(std::path::PathBuf::from)
            .collect(),
        _ => Vec::new(),
    }
}
