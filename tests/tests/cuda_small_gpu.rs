//! A GPU under 4 GiB: with `run.profile = "auto"` the run applies the
//! low-memory profile (block recomputation, a planned micro-batch) and
//! trains on the GPU. The emulated device is given 2 GiB here
//! (HEADROOM_CUDA_EMU_MEMORY, read once per process: hence a test binary of
//! its own).
//!
//! The claim needs a device whose size the test chooses, which only the
//! emulator gives: so it runs on the emulator on every machine, a GPU
//! machine too (`cargo xtask gpu-check`, `HEADROOM_REQUIRE_GPU=1`, included),
//! and checks that the device it trained on is the emulator. It used to
//! return early on a real GPU, reported as ok without having run. The same
//! claim on a real GPU, a card with all but 4 or 2 GiB held by another
//! process, is the GPU bundle's `small-gpu-4g` and `small-gpu-2g` steps
//! (lab/src/gpu_bundle_run.sh).

mod emulated_device;

use emulated_device::emulator_forced;
use headroom_pipeline::{train, TrainOptions};
use headroom_tests::{smoke_config_for_device, write_synthetic_fashion_mnist};

headroom_tests::report_nvrtc_tests!("cuda_small_gpu", include_str!("cuda_small_gpu.rs"));

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_small_gpu_gets_the_low_memory_profile_and_trains() {
    std::env::set_var("HEADROOM_CUDA_EMU_MEMORY", (2u64 << 30).to_string());
    if !emulator_forced("cuda_small_gpu") {
        return;
    }
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 128, 64);
    let out = tempfile::tempdir().unwrap();
    let config = smoke_config_for_device(
        data.path(),
        out.path(),
        &[
            "device.kind=auto",
            "train.epochs=1",
            "augment.crop_padding=0",
        ],
    );
    let summary = train(&config, &TrainOptions::default()).unwrap();
    assert_eq!(summary.step, 4, "128 samples in batches of 32");
    let recorded = std::fs::read_to_string(out.path().join("config.toml")).unwrap();
    assert!(recorded.contains("checkpoint = \"blocks\""), "{recorded}");
    assert!(summary.memory_limit.is_some_and(|l| l < 2 << 30));
}
