//! The driver itself out of memory (another process holding the GPU, say):
//! the emulated device is given 10 MiB (HEADROOM_CUDA_EMU_MEMORY, read once
//! per process: hence a test binary of its own) and the budget is set far
//! above that, so every refusal comes from the driver. The run must handle
//! it as it handles the budget's (release the cache, split the batch) and
//! finish, with the convolutions chosen by rule (`auto`) or timed (`tune`).
//!
//! The claim needs a device whose size the test chooses, which only the
//! emulator gives: so it runs on the emulator on every machine, a GPU
//! machine too (`cargo xtask gpu-check`, `HEADROOM_REQUIRE_GPU=1`, included),
//! and checks that the device it trained on is the emulator. It used to
//! return early on a real GPU, reported as ok without having run. The same
//! claim on a real GPU, held by another process, is the GPU bundle's
//! `oom-driver` step (lab/src/gpu_bundle_run.sh).

mod emulated_device;

use emulated_device::emulator_forced;
use headroom_pipeline::{train, TrainOptions};
use headroom_tests::{smoke_config, write_synthetic_fashion_mnist};

headroom_tests::report_nvrtc_tests!("cuda_driver_oom", include_str!("cuda_driver_oom.rs"));

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_driver_out_of_memory_splits_the_batch_and_the_run_finishes() {
    std::env::set_var("HEADROOM_CUDA_EMU_MEMORY", (10u64 << 20).to_string());
    if !emulator_forced("cuda_driver_oom") {
        return;
    }
    let data = tempfile::tempdir().unwrap();
    // One batch: its split under the driver's refusals is the claim.
    write_synthetic_fashion_mnist(data.path(), 128, 64);
    // "tune" times its products both ways on the first step of each shape,
    // the refusals among them: the run must still split and finish.
    for algorithm in ["auto", "tune"] {
        let out = tempfile::tempdir().unwrap();
        let setting = format!("device.conv_algorithm={algorithm}");
        let config = smoke_config(
            data.path(),
            out.path(),
            &[
                "device.kind=cuda",
                "device.memory_limit=1GiB",
                "run.profile=none",
                "train.epochs=1",
                "train.batch_size=128",
                &setting,
            ],
        );
        let summary = train(&config, &TrainOptions::default()).unwrap();
        assert_eq!(summary.step, 1, "128 samples in a batch of 128");
        assert!(
            summary.oom_events > 0,
            "{algorithm}: the 10 MiB device never refused"
        );
        assert!(
            summary.micro_batch < 128,
            "{algorithm}: the batch was not split: micro-batch {}",
            summary.micro_batch
        );
        assert!(summary.test_accuracy.is_some());
        assert!(summary.memory.peak_in_use_bytes < 10 << 20);
    }
}
