//! Training end to end on the GPU path: `train()` with device.kind = "cuda"
//! runs the whole loop (loader, staging ring, CUDA learner, checkpoints,
//! evaluation), and its checkpoint resumes on the CPU. Without a GPU this
//! runs on the CPU emulator of CUDA (headroom-cuda-emu); without NVRTC it
//! skips with one line unless HEADROOM_REQUIRE_NVRTC=1 (CI).

use headroom_pipeline::{checkpoint, train, Resume, TrainOptions};
use headroom_tests::{cuda_path_available, smoke_config, write_synthetic_fashion_mnist};

#[test]
fn a_run_on_the_gpu_path_trains_checkpoints_and_resumes_on_the_cpu() {
    if !cuda_path_available("cuda_training") {
        return;
    }
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 256, 64);
    let out = tempfile::tempdir().unwrap();
    let gpu = smoke_config(
        data.path(),
        out.path(),
        &[
            "device.kind=cuda",
            "train.epochs=1",
            "augment.crop_padding=0",
        ],
    );
    let summary = train(&gpu, &TrainOptions::default()).unwrap();
    assert_eq!(summary.epochs.len(), 1);
    assert_eq!(summary.step, 8, "256 samples in batches of 32");
    let accuracy = summary.test_accuracy.unwrap();
    assert!(accuracy > 0.1, "{accuracy}");
    assert!(
        summary.memory.peak_in_use_bytes > 0,
        "device memory is reported"
    );
    let files = checkpoint::list(out.path()).unwrap();
    let saved = checkpoint::load(files.last().unwrap()).unwrap();
    let scale = saved
        .loss_scale
        .expect("a GPU checkpoint holds its loss scale");
    assert!(scale.scale > 0.0);

    let cpu = smoke_config(
        data.path(),
        out.path(),
        &[
            "device.kind=cpu",
            "train.epochs=2",
            "augment.crop_padding=0",
        ],
    );
    let options = TrainOptions {
        resume: Resume::Latest,
        ..TrainOptions::default()
    };
    let resumed = train(&cpu, &options).unwrap();
    assert_eq!(resumed.epoch, 2);
    assert_eq!(resumed.step, 16);
    assert!(resumed.test_accuracy.unwrap().is_finite());
}
