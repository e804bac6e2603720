//! The driver itself out of memory (another process holding the GPU, say):
//! the emulated device is given 12 MiB (HEADROOM_CUDA_EMU_MEMORY, read once
//! per process: hence a test binary of its own) and the budget is set far
//! above that, so every refusal comes from the driver. The run must handle
//! it as it handles the budget's (release the cache, split the batch) and
//! finish, with the convolutions chosen by rule (`auto`) or timed (`tune`).
//! Skipped on a real GPU, whose memory this test cannot choose (the
//! GPU session's `run.sh oom` holds it with another process instead).

use headroom_pipeline::{train, TrainOptions};
use headroom_tests::nvrtc_gate::print_past_capture;
use headroom_tests::{cuda_path_available, smoke_config, write_synthetic_fashion_mnist};

headroom_tests::report_nvrtc_tests!("cuda_driver_oom", include_str!("cuda_driver_oom.rs"));

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_driver_out_of_memory_splits_the_batch_and_the_run_finishes() {
    if headroom_cuda_emu::real_gpu_present() {
        print_past_capture(&["cuda_driver_oom: skipped on a real GPU".into()]);
        return;
    }
    std::env::set_var("HEADROOM_CUDA_EMU_MEMORY", (12u64 << 20).to_string());
    if !cuda_path_available("cuda_driver_oom") {
        return;
    }
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 512, 64);
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
                "train.batch_size=256",
                &setting,
            ],
        );
        let summary = train(&config, &TrainOptions::default()).unwrap();
        assert_eq!(summary.step, 2, "512 samples in batches of 256");
        assert!(
            summary.oom_events > 0,
            "{algorithm}: the 12 MiB device never refused"
        );
        assert!(
            summary.micro_batch < 256,
            "{algorithm}: the batch was not split: micro-batch {}",
            summary.micro_batch
        );
        assert!(summary.test_accuracy.is_some());
        assert!(summary.memory.peak_in_use_bytes < 12 << 20);
    }
}
