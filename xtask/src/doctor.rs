//! `cargo xtask doctor`: the CPU (cores, vector extensions, measured FP32
//! peak), memory, the GPU if a driver is there, which backend and precision
//! `device.kind = "auto"` picks, and the profile we recommend.

use anyhow::Result;
use headroom_pipeline::bench::peak_gflops;
use headroom_pipeline::config::SMALL_DEVICE_BYTES;
use headroom_pipeline::{available_memory_bytes, limits, system_memory_bytes};

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
    println!("auto picks {}", auto_pick());
    let usable = ceiling.map(|c| c.limit.min(c.room)).or(total);
    let profile = match usable {
        Some(bytes) if bytes < SMALL_DEVICE_BYTES => {
            "low_memory (less than 4 GiB: applied automatically)"
        }
        _ => "max_speed (or the default); low_memory only with a device.memory_limit below 4 GiB",
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
            _ => "the CPU, f32 (no CUDA driver or GPU found)".into(),
        },
    }
}
