//! `cargo xtask doctor`: the CPU (cores, vector extensions, measured FP32
//! peak), memory, the GPU if a driver is there, NVRTC, the Fashion-MNIST
//! dataset, which backend and precision `device.kind = "auto"` picks (and,
//! on a GPU, which path each op family takes), and the profile we recommend.

use std::path::{Path, PathBuf};

use anyhow::Result;
use headroom_pipeline::bench::peak_gflops;
use headroom_pipeline::config::SMALL_DEVICE_BYTES;
use headroom_pipeline::device::DeviceKind;
use headroom_pipeline::{available_memory_bytes, limits, system_memory_bytes};
use headroom_pipeline::{ExperimentConfig, Overrides};

/// The command that installs NVRTC where it is missing (the pip wheel the
/// CUDA backend finds through python3).
pub const NVRTC_INSTALL: &str = "python3 -m pip install nvidia-cuda-nvrtc";

fn gib(bytes: Option<u64>) -> String {
    bytes.map_or("unknown".into(), |b| {
        format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
    })
}

pub fn run() -> Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("cpu        {} ({cores} cores available)", cpu_model());
    println!("vectors    {}", vector_extensions().join(" "));
    println!(
        "fp32 peak  {:.0} GFLOP/s on {cores} threads (measured FMA loop)",
        peak_gflops(cores, false)
    );
    let total = system_memory_bytes();
    println!(
        "memory     {} total, {} available",
        gib(total),
        gib(available_memory_bytes())
    );
    let ceiling = limits::tightest();
    match &ceiling {
        Some(c) => println!(
            "limit      {} left of {} under {}",
            gib(Some(c.room)),
            gib(Some(c.limit)),
            c.source
        ),
        None => println!("limit      none found (no cgroup limit, rlimit or /proc/meminfo)"),
    }
    match limits::default_budget() {
        Some((budget, _)) => println!(
            "budget     {} of tensor memory when device.memory_limit is unset (half of that room)",
            gib(Some(budget))
        ),
        None => println!("budget     unbounded when device.memory_limit is unset"),
    }
    println!("gpu        {}", gpu_line());
    println!("nvrtc      {}", nvrtc_line());
    println!("dataset    {}", dataset_line());
    println!("auto picks {}", auto_pick());
    for line in op_paths() {
        println!("ops        {line}");
    }
    // Judged as `run.profile = "auto"` judges a run with device.memory_limit
    // unset: by the GPU's free memory where "auto" trains on the GPU, else
    // by what this process may use of the host's.
    let gpu = headroom_pipeline::device::gpu_memory(DeviceKind::Auto);
    let usable = gpu.or_else(|| ceiling.map(|c| c.limit.min(c.room)).or(total));
    let on = if gpu.is_some() {
        "the GPU has"
    } else {
        "this process may use"
    };
    let profile = match usable {
        Some(bytes) if bytes < SMALL_DEVICE_BYTES => format!(
            "low_memory ({on} {}, less than 4 GiB: applied automatically)",
            gib(Some(bytes))
        ),
        _ => "max_speed (or the default); low_memory only with a device.memory_limit below 4 GiB"
            .into(),
    };
    println!("profile    {profile}");
    Ok(())
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

fn vector_extensions() -> Vec<&'static str> {
    let mut found = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! probe {
            ($($feature:tt),*) => {
                $(if std::arch::is_x86_feature_detected!($feature) { found.push($feature); })*
            };
        }
        probe!(
            "sse4.2",
            "avx",
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512bw",
            "avx512vl",
            "avx512vnni",
            "avx512bf16"
        );
    }
    #[cfg(target_arch = "aarch64")]
    found.push("neon");
    if found.is_empty() {
        found.push("none detected");
    }
    found
}

/// The GPU as the CUDA backend's probe sees it (it never panics; no driver
/// means no GPU).
fn gpu_line() -> String {
    match headroom_model::cuda::CudaBackend::probe() {
        Ok(Some(gpu)) => format!(
            "{} (compute capability {}.{}, {} total, {} free, driver for CUDA {}.{})",
            gpu.name,
            gpu.compute_capability.0,
            gpu.compute_capability.1,
            gib(Some(gpu.total_memory)),
            gib(Some(gpu.free_memory)),
            gpu.driver_version.0,
            gpu.driver_version.1
        ),
        Ok(None) => "none (no CUDA driver or GPU found)".into(),
        Err(e) => format!("a CUDA driver is present but unusable: {e}"),
    }
}

/// What `device.kind = "auto"` will train on here, and why.
fn auto_pick() -> String {
    match headroom_model::cuda::CudaBackend::new(0) {
        Ok(be) => format!(
            "the GPU ({}): mixed precision (f16 activations, f32 masters, loss scaling; f32 with --no-amp)",
            be.info().name
        ),
        Err(e) => match headroom_model::cuda::CudaBackend::probe() {
            Ok(Some(_)) => format!("the CPU, f32: the GPU cannot be opened ({e})"),
            // A driver that is there but refused (too old): its reason.
            Err(refused) => format!("the CPU, f32: {refused}"),
            Ok(None) => "the CPU, f32 (no CUDA driver or GPU found)".into(),
        },
    }
}

/// Where NVRTC was found, by the CUDA backend's own lookup
/// (`cuda::libs::ensure_nvrtc`: the loader's path, then
/// $HEADROOM_CUDA_LIB_DIR, the CUDA toolkit and python3's nvidia packages),
/// or the command that installs it.
fn nvrtc_line() -> String {
    match headroom_model::cuda::libs::ensure_nvrtc() {
        Ok(Some(path)) => format!("found: {}", path.display()),
        // Loaded by bare name: the mapped file says which one it was.
        Ok(None) => match mapped_library("libnvrtc") {
            Some(path) => format!("found: {} (on the loader's default path)", path.display()),
            None => "found: on the loader's default path".into(),
        },
        Err(_) => format!("not found: install it with `{NVRTC_INSTALL}`"),
    }
}

/// The file of a library this process has mapped whose name starts with
/// `stem`, from /proc/self/maps (Linux).
fn mapped_library(stem: &str) -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .map(Path::new)
        .find(|path| {
            path.file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.starts_with(stem))
        })
        .map(Path::to_path_buf)
}

/// Whether Fashion-MNIST is there, searched as `train` searches for the
/// default experiment: its data.dir, then $FASHION_MNIST_DIR, then the
/// Debian package's directory.
fn dataset_line() -> String {
    let configured =
        ExperimentConfig::load(Path::new(crate::DEFAULT_EXPERIMENT), &Overrides::default())
            .ok()
            .and_then(|experiment| experiment.data.dir);
    match headroom_pipeline::data::locate_fashion_mnist(configured.as_deref(), false) {
        Ok(dir) => format!("Fashion-MNIST in {}", dir.display()),
        Err(_) => format!(
            "Fashion-MNIST not found (searched data.dir, $FASHION_MNIST_DIR, {}); install it with \
             `sudo apt-get install -y {}` (train installs it itself when run as root)",
            headroom_pipeline::data::SYSTEM_DIR,
            headroom_pipeline::data::PACKAGE
        ),
    }
}

/// Which path each op family takes on this machine's GPU under the
/// defaults (`device.conv_algorithm = "auto"`, fusion and graphs on, mixed
/// precision): `headroom_model::cuda::arch::op_paths`, the one place that
/// says so (a CUDA run logs the same lines at its start).
fn op_paths() -> Vec<String> {
    let Ok(Some(gpu)) = headroom_model::cuda::CudaBackend::probe() else {
        return vec!["no GPU: every op runs on the CPU".into()];
    };
    headroom_model::cuda::arch::op_paths(gpu.arch())
        .into_iter()
        .map(|p| format!("{}: {}", p.family, p.path))
        .collect()
}
