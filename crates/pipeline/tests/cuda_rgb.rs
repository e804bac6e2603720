//! RGB images (C = 3) through a convolutional model on the GPU learner, as
//! on the CPU learner; the GPU learner's top-5 count agrees with the CPU's;
//! and a batch of f32 features (a table's), which only the CPU learner
//! reads, is refused by the GPU learner with the reason rather than read
//! as pixels.
//!
//! Without a GPU these run on the CPU emulator of CUDA, as cuda_learner.rs
//! does (the same gate).

use std::sync::MutexGuard;

#[path = "gpu_gate/mod.rs"]
mod gpu_gate;
#[path = "../../../tests/src/nvrtc_gate.rs"]
#[macro_use]
mod nvrtc_gate;

report_nvrtc_tests!("cuda_rgb", include_str!("cuda_rgb.rs"));

use headroom_loader::Batch;
use headroom_model::cuda::{CudaBackend, CudaBuildOptions, DType};
use headroom_model::memory::MemoryPool;
use headroom_model::{BuildOptions, Device, ModelSpec};
use headroom_optim::{AdamWConfig, LossScalerConfig};
use headroom_pipeline::learner::{CpuLearner, CudaLearner, CudaOptions, Learner, StepSettings};

fn backend() -> Option<MutexGuard<'static, ()>> {
    gpu_gate::backend("cuda_rgb")
}

/// Three channels in, ten classes out (so top-5 means something).
const RGB_MODEL: &str = r#"
input = [8, 8, 3]
mean = 0.5
std = 0.25
layers = [
  { type = "conv", out = 8 }, { type = "batch_norm" }, { type = "relu" },
  { type = "conv", out = 16, stride = 2 }, { type = "batch_norm" }, { type = "relu" },
  { type = "global_avg_pool" },
  { type = "linear", out = 10 },
]
"#;

fn spec() -> ModelSpec {
    toml::from_str(RGB_MODEL).unwrap()
}

fn settings() -> StepSettings {
    StepSettings {
        label_smoothing: 0.0,
        clip_norm: 1.0,
        focal_gamma: None,
        regression: None,
        optimizer: AdamWConfig::default(),
    }
}

/// `n` pseudo-random 8×8 RGB images, a different batch for every index,
/// each channel its own pattern.
fn rgb_batch(index: usize, n: usize) -> Batch {
    Batch {
        epoch: 0,
        index,
        shape: [n, 8, 8, 3],
        pixels: (0..n * 192)
            .map(|i| (((i * 2_654_435_761) >> 9) ^ (index * 97) ^ ((i % 3) * 85)) as u8)
            .collect(),
        labels: (0..n).map(|i| ((i * 3 + index) % 10) as u32).collect(),
        ..Batch::default()
    }
}

fn cpu_learner(seed: u64) -> CpuLearner {
    CpuLearner::new(
        &spec(),
        seed,
        BuildOptions::default(),
        settings(),
        8,
        MemoryPool::new(Device::Cpu),
    )
    .unwrap()
}

/// f32 on the GPU (`device.amp = false`): agrees with the CPU to f32
/// summation order, so ranks (top-5) agree too.
fn gpu_learner(seed: u64, f32: bool) -> CudaLearner {
    let be = CudaBackend::new(0).unwrap();
    let options = if f32 {
        CudaOptions {
            build: CudaBuildOptions {
                activations: DType::F32,
                ..CudaBuildOptions::default()
            },
            loss_scaler: LossScalerConfig::unit(),
            ..CudaOptions::default()
        }
    } else {
        CudaOptions::default()
    };
    CudaLearner::new(be, &spec(), seed, settings(), 8, options).unwrap()
}

fn flat(v: &[Vec<f32>]) -> Vec<f32> {
    v.iter().flatten().copied().collect()
}

fn relative_l2(a: &[f32], b: &[f32]) -> f64 {
    let diff: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (diff / norm.max(1e-30)).sqrt()
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn rgb_images_train_on_the_gpu_as_on_the_cpu() {
    let Some(_gpu) = backend() else { return };
    let (mut cpu, mut gpu) = (cpu_learner(3), gpu_learner(3, false));
    let start = cpu.snapshot().unwrap();
    for i in 0..5 {
        let batch = rgb_batch(i, 8);
        let (c, g) = (
            cpu.train_batch(&batch, 5e-3).unwrap(),
            gpu.train_batch(&batch, 5e-3).unwrap(),
        );
        assert!(
            (g.loss - c.loss).abs() <= 2e-2 * c.loss.abs(),
            "step {i}: loss {} (GPU) vs {} (CPU)",
            g.loss,
            c.loss
        );
    }
    let (end_cpu, end_gpu) = (cpu.snapshot().unwrap(), gpu.snapshot().unwrap());
    let moved = relative_l2(&flat(&end_cpu.params), &flat(&start.params));
    let apart = relative_l2(&flat(&end_gpu.params), &flat(&end_cpu.params));
    assert!(moved > 0.0);
    assert!(
        apart < 0.25 * moved,
        "GPU and CPU weights differ by {apart}, training moved them {moved}"
    );
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn the_gpu_learner_counts_top5_as_the_cpu_learner_does() {
    let Some(_gpu) = backend() else { return };
    let (mut cpu, mut gpu) = (cpu_learner(5), gpu_learner(5, true));
    for i in 0..3 {
        cpu.train_batch(&rgb_batch(i, 8), 5e-3).unwrap();
        gpu.train_batch(&rgb_batch(i, 8), 5e-3).unwrap();
    }
    let batch = rgb_batch(9, 16);
    let (c, g) = (
        cpu.eval_batch(&batch).unwrap(),
        gpu.eval_batch(&batch).unwrap(),
    );
    let hits = c.top5_correct.expect("ten classes: top-5 counted");
    assert!(hits <= 16);
    assert_eq!(g.top5_correct, Some(hits));
    assert_eq!(g.predictions, c.predictions);
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn the_gpu_learner_refuses_f32_features_with_the_reason() {
    let Some(_gpu) = backend() else { return };
    let mut gpu = gpu_learner(1, false);
    let mut batch = rgb_batch(0, 4);
    batch.features = Some(vec![0.5; 4 * 192]);
    let before = gpu.snapshot().unwrap();
    let err = gpu.train_batch(&batch, 5e-3).unwrap_err().to_string();
    assert!(
        err.contains("f32 features") && err.contains("u8 images"),
        "{err}"
    );
    let err = gpu.eval_batch(&batch).unwrap_err().to_string();
    assert!(err.contains("f32 features"), "{err}");
    assert_eq!(
        flat(&gpu.snapshot().unwrap().params),
        flat(&before.params),
        "a refused batch changes nothing"
    );
}

/// A folder of "dark" and "light" RGB photos in `root/{train,test}/CLASS`,
/// and a folder `root/new` of photos to score.
fn write_photos(root: &std::path::Path) {
    let photo = |path: &std::path::Path, light: bool, i: usize| {
        let (h, w) = (10 + i % 3, 12 + i % 4);
        let base = if light { 170 } else { 60 };
        let pixels: Vec<u8> = (0..h * w * 3)
            .map(|p| (base + (p * 7 + i * 13) % 40) as u8)
            .collect();
        headroom_loader::write_image(path, &pixels, [h, w, 3]).unwrap();
    };
    for (split, count) in [("train", 24), ("test", 6)] {
        for (class, light) in [("dark", false), ("light", true)] {
            let folder = root.join(split).join(class);
            std::fs::create_dir_all(&folder).unwrap();
            for i in 0..count {
                photo(&folder.join(format!("{i}.png")), light, i);
            }
        }
    }
    let new = root.join("new");
    std::fs::create_dir_all(&new).unwrap();
    for i in 0..12 {
        photo(&new.join(format!("{i:02}.png")), i % 3 == 0, 40 + i);
    }
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn predict_on_the_gpu_gives_the_cpu_s_classes() {
    use headroom_pipeline::learner::DeviceKind;
    use headroom_pipeline::predict::{predict_with, PredictOptions, PredictedOutputs};
    use headroom_pipeline::{train, ExperimentConfig, Overrides, TrainOptions};

    let Some(_gpu) = backend() else { return };
    let dir = tempfile::tempdir().unwrap();
    let photos = dir.path().join("photos");
    write_photos(&photos);
    let smoke =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments/smoke.toml");
    let run = dir.path().join("run");
    let sets: Vec<String> = [
        "data.format=image_folder".to_string(),
        format!("data.dir={}", photos.display()),
        "data.image_size=[8, 8]".into(),
        "data.channels=3".into(),
        "data.fit=resize".into(),
        "data.train_samples=0".into(),
        "data.test_samples=0".into(),
        "model.input=[8, 8, 3]".into(),
        "device.kind=cpu".into(),
        "train.epochs=3".into(),
        "train.batch_size=8".into(),
        "train.threads=2".into(),
        format!("run.output_dir={}", run.display()),
    ]
    .into();
    let config = ExperimentConfig::load(&smoke, &Overrides::parse(&sets).unwrap()).unwrap();
    train(&config, &TrainOptions::default()).unwrap();
    let score = |device| {
        let options = PredictOptions {
            batch: 5,
            device,
            ..PredictOptions::default()
        };
        match predict_with(&run, &photos.join("new"), &options)
            .unwrap()
            .outputs
        {
            PredictedOutputs::Classes {
                names,
                classes,
                probabilities,
            } => (names, classes, probabilities),
            other => panic!("{other:?}"),
        }
    };
    let (cpu_names, cpu_classes, cpu_p) = score(DeviceKind::Cpu);
    let (gpu_names, gpu_classes, gpu_p) = score(DeviceKind::Cuda);
    assert_eq!(gpu_names, cpu_names);
    assert_eq!(cpu_p.len(), 12 * cpu_names.len());
    assert_eq!(gpu_p.len(), cpu_p.len());
    // The GPU learner scored them: its f16 activations do not give the
    // CPU's f32 bits.
    assert_ne!(gpu_p, cpu_p, "--device cuda scored on the CPU");
    // f16 activations on the GPU: the probabilities agree to about 1e-2,
    // and a class is the same wherever the CPU's margin is clear.
    for (row, (c, g)) in cpu_p
        .chunks_exact(cpu_names.len())
        .zip(gpu_p.chunks_exact(cpu_names.len()))
        .enumerate()
    {
        for (a, b) in c.iter().zip(g) {
            assert!((a - b).abs() < 2e-2, "row {row}: CPU {c:?}, GPU {g:?}");
        }
        let mut sorted = c.to_vec();
        sorted.sort_by(|a, b| b.total_cmp(a));
        if sorted[0] - sorted[1] > 5e-2 {
            assert_eq!(
                gpu_classes[row], cpu_classes[row],
                "row {row}: {c:?} vs {g:?}"
            );
        }
    }
}
