//! `cargo xtask gpu-check`: the CUDA report, then every CUDA test binary
//! on the GPU with skipping turned into failure.

use anyhow::{bail, Context, Result};

use crate::GpuCheckArgs;

/// (package, test target) of every CUDA test binary: each `cuda_*.rs` (or `cuda_*/main.rs`) under
/// crates/*/tests and tests/tests (xtask's tests check that this list and
/// those files agree, so a new one cannot be left out), and
/// `memory_release`, whose GPU test frees the device between two runs.
/// (`cuda_driver` runs on the emulator even on a GPU machine: it answers
/// as old drivers, which a real GPU cannot; `cuda_ranks` too: its rank
/// processes share one device, which real NCCL refuses.)
pub const CUDA_TESTS: [(&str, &str); 12] = [
    ("headroom-model", "cuda_parity"),
    ("headroom-model", "cuda_driver"),
    ("headroom-model", "cuda_custom_layer"),
    ("headroom-model", "cuda_ptx"),
    ("headroom-model", "cuda_probe"),
    ("headroom-pipeline", "cuda_learner"),
    ("headroom-pipeline", "cuda_rgb"),
    ("headroom-pipeline", "cuda_ranks"),
    ("headroom-tests", "cuda_training"),
    ("headroom-tests", "cuda_driver_oom"),
    ("headroom-tests", "cuda_small_gpu"),
    ("headroom-tests", "memory_release"),
];

pub fn run(args: &GpuCheckArgs) -> Result<()> {
    if args.list {
        for (package, test) in CUDA_TESTS {
            println!("{package} {test}");
        }
        return Ok(());
    }
    gpu_check()
}

/// Runs the CUDA checks: the report, then every CUDA test with skipping
/// turned into failure.
fn gpu_check() -> Result<()> {
    let report = headroom_model::cuda::gpu_check_report();
    println!("{report}");
    if !report.has_gpu() {
        // Every CUDA test would fail for want of a GPU, dozens of failures
        // that say nothing the report above does not.
        bail!(
            "gpu-check needs a GPU, and this machine has none that can be used (see the report above). \
             Here, `cargo test --workspace` runs the same CUDA parity tests on the CPU emulator of the driver"
        );
    }
    let mut command = std::process::Command::new("cargo");
    command.args(["test", "--release"]);
    for (package, test) in CUDA_TESTS {
        command.args(["-p", package, "--test", test]);
    }
    let status = command
        .args(["--", "--nocapture"])
        .env("HEADROOM_REQUIRE_GPU", "1")
        .status()
        .context("running the CUDA tests with cargo")?;
    println!(
        "next: cargo xtask train --set device.kind=cuda, and cargo xtask bench --device cuda --compare-torch"
    );
    if !status.success() || !report.gpu_ready() {
        bail!("gpu-check failed: see the report and the test output above");
    }
    Ok(())
}
