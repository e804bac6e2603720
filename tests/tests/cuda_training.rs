//! Training end to end on the GPU path: `train()` with device.kind = "cuda"
//! runs the whole loop (loader, staging ring, CUDA learner, checkpoints,
//! evaluation), and its checkpoint resumes on the CPU. Without a GPU this
//! runs on the CPU emulator of CUDA (headroom-cuda-emu). Where the build
//! found no NVRTC its tests are built as ignored, and the binary ends with
//! a line saying how many did not run, here and in the whole workspace;
//! HEADROOM_REQUIRE_NVRTC=1 (CI) makes that a failure.

use headroom_model::cuda::{blas_workspace_bytes, CudaBackend};
use headroom_pipeline::{checkpoint, train, ExperimentConfig, Overrides, Resume, TrainOptions};
use headroom_tests::{
    conv_algorithm_fast_on_the_emulator, cuda_path_available, smoke_config,
    write_synthetic_fashion_mnist,
};

headroom_tests::report_nvrtc_tests!("cuda_training", include_str!("cuda_training.rs"));

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
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

/// The final checkpoint's parameters and buffers, as bits.
fn final_state_bits(dir: &std::path::Path) -> Vec<u32> {
    let files = checkpoint::list(dir).unwrap();
    let saved = checkpoint::load(files.last().unwrap()).unwrap();
    saved
        .params
        .iter()
        .chain(&saved.buffers)
        .flatten()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn data_held_on_the_device_trains_to_the_bits_of_data_staged_from_the_host() {
    if !cuda_path_available("cuda_training") {
        return;
    }
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 192, 64);
    let mut runs = Vec::new();
    // The last run launches every kernel from the host: the others replay
    // a captured step (device.graphs, on by default).
    for (on_device, graphs) in [
        ("true", true),
        ("false", true),
        ("auto", true),
        ("true", false),
    ] {
        let out = tempfile::tempdir().unwrap();
        let config = smoke_config(
            data.path(),
            out.path(),
            &[
                "device.kind=cuda",
                "train.epochs=1",
                "augment.crop_padding=2",
                "augment.flip=true",
                conv_algorithm_fast_on_the_emulator(),
                &format!("data.on_device={on_device}"),
                &format!("device.graphs={graphs}"),
            ],
        );
        let summary = train(&config, &TrainOptions::default()).unwrap();
        assert_eq!(summary.step, 6, "192 samples in batches of 32");
        runs.push((summary, final_state_bits(out.path())));
    }
    let [(held, held_bits), (staged, staged_bits), (auto, _), (_, launched_bits)] = &runs[..]
    else {
        unreachable!()
    };
    assert_eq!(
        held_bits, launched_bits,
        "captured steps compute launched steps' bits"
    );
    assert!(held.data_on_device && !staged.data_on_device);
    assert!(
        auto.data_on_device,
        "auto holds a small set on the (emulated) GPU"
    );
    assert_eq!(held_bits, staged_bits, "same weights and statistics");
    assert_eq!(
        held.test_loss.map(f32::to_bits),
        staged.test_loss.map(f32::to_bits)
    );
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn data_on_device_says_why_it_cannot_hold_the_set() {
    if !cuda_path_available("cuda_training") {
        return;
    }
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 64, 32);
    let cases = [
        (
            vec!["device.kind=cpu", "data.on_device=true"],
            "trains from host memory",
        ),
        (
            vec![
                "device.kind=cuda",
                "data.on_device=true",
                "augment.mixup_alpha=0.2",
            ],
            "augment.mixup_alpha",
        ),
    ];
    for (extra, why) in cases {
        let out = tempfile::tempdir().unwrap();
        let config = smoke_config(data.path(), out.path(), &extra);
        let err = train(&config, &TrainOptions::default()).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("data.on_device") && text.contains(why),
            "{text}"
        );
    }
    // "auto" on the CPU trains from host memory without a word of error.
    let out = tempfile::tempdir().unwrap();
    let config = smoke_config(
        data.path(),
        out.path(),
        &["device.kind=cpu", "train.epochs=1", "data.on_device=auto"],
    );
    assert!(
        !train(&config, &TrainOptions::default())
            .unwrap()
            .data_on_device
    );
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_gpu_budget_below_one_step_splits_the_batch_with_the_data_on_the_device() {
    if !cuda_path_available("cuda_training") {
        return;
    }
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 128, 32);
    let run = |extra: &[&str]| {
        let out = tempfile::tempdir().unwrap();
        let mut sets = vec![
            "device.kind=cuda",
            "train.epochs=1",
            "data.on_device=true",
            conv_algorithm_fast_on_the_emulator(),
        ];
        sets.extend_from_slice(extra);
        train(
            &smoke_config(data.path(), out.path(), &sets),
            &TrainOptions::default(),
        )
        .unwrap()
    };
    let free = run(&[]);
    assert_eq!(free.micro_batch, 32);
    // A budget a little above what the resident set, the model and the
    // optimizer hold, below what a whole step needs on top. cuBLAS's
    // workspace is part of each peak: NVIDIA's size without a budget, 1/32
    // of the budget with one.
    let arch = CudaBackend::probe().unwrap().unwrap().arch();
    let tensors = free.memory.peak_in_use_bytes - blas_workspace_bytes(arch, None);
    let limit = format!("device.memory_limit={}", tensors * 3 / 4 * 32 / 31);
    let tight = run(&[&limit]);
    assert!(tight.data_on_device);
    assert!(tight.micro_batch < 32, "micro-batch {}", tight.micro_batch);
    assert_eq!(tight.step, 4, "128 samples in batches of 32, all applied");
}

/// The final checkpoint's parameters, flattened.
fn final_params(dir: &std::path::Path) -> Vec<f32> {
    let files = checkpoint::list(dir).unwrap();
    let saved = checkpoint::load(files.last().unwrap()).unwrap();
    saved.params.into_iter().flatten().collect()
}

/// ‖GPU run's final parameters − CPU run's‖ / ‖CPU run's‖.
fn weights_apart(gpu_dir: &std::path::Path, cpu_dir: &std::path::Path) -> f64 {
    let (g, c) = (final_params(gpu_dir), final_params(cpu_dir));
    assert_eq!(g.len(), c.len());
    let diff: f64 = g
        .iter()
        .zip(&c)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let norm: f64 = c.iter().map(|b| (*b as f64).powi(2)).sum();
    (diff / norm).sqrt()
}

/// One epoch of the smoke experiment on `device.kind = kind` (no crop
/// padding, `sets` overrides last): its summary and its run directory.
fn smoke_epoch(
    data: &std::path::Path,
    kind: &str,
    sets: &[&str],
) -> (headroom_pipeline::RunSummary, tempfile::TempDir) {
    let out = tempfile::tempdir().unwrap();
    let device = format!("device.kind={kind}");
    let mut all = vec![device.as_str(), "train.epochs=1", "augment.crop_padding=0"];
    all.extend_from_slice(sets);
    let config = smoke_config(data, out.path(), &all);
    let summary = train(&config, &TrainOptions::default()).unwrap();
    (summary, out)
}

/// `device.amp = false` on the GPU path: f32 activations and weights, no
/// loss scale in the checkpoint, and the same training as the CPU's f32
/// run of the same experiment, up to summation order.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn an_f32_run_on_the_gpu_path_trains_as_the_cpu_run_does() {
    if !cuda_path_available("cuda_training") {
        return;
    }
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 256, 64);
    let (gpu, gpu_dir) = smoke_epoch(data.path(), "cuda", &["device.amp=false"]);
    let (cpu, cpu_dir) = smoke_epoch(data.path(), "cpu", &["device.amp=false"]);
    assert_eq!((gpu.step, cpu.step), (8, 8));
    let files = checkpoint::list(gpu_dir.path()).unwrap();
    let saved = checkpoint::load(files.last().unwrap()).unwrap();
    assert!(saved.loss_scale.is_none(), "f32 training has no loss scale");
    let apart = weights_apart(gpu_dir.path(), cpu_dir.path());
    assert!(apart < 1e-3, "GPU f32 and CPU weights differ by {apart}");
    let (ga, ca) = (gpu.test_accuracy.unwrap(), cpu.test_accuracy.unwrap());
    assert!((ga - ca).abs() <= 2.0 / 64.0, "accuracy {ga} vs {ca}");
}

/// `device.precision = "bf16"` on the GPU path: bf16 activations and
/// compute weights over f32 masters, no loss scale (none in the
/// checkpoint, where f16's runs keep one), and training near the CPU's f32
/// run of the same experiment (the bf16 storage itself is checked against
/// the CPU in cuda_parity's bf16 tests); beside `device.amp = false` it is
/// refused, naming both keys.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_bf16_run_on_the_gpu_path_trains_near_the_cpu_run_without_loss_scaling() {
    if !cuda_path_available("cuda_training") {
        return;
    }
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 256, 64);
    let (bf16, bf16_dir) = smoke_epoch(data.path(), "cuda", &["device.precision=bf16"]);
    let (cpu, cpu_dir) = smoke_epoch(data.path(), "cpu", &["device.precision=f32"]);
    assert_eq!((bf16.step, cpu.step), (8, 8));
    let files = checkpoint::list(bf16_dir.path()).unwrap();
    let saved = checkpoint::load(files.last().unwrap()).unwrap();
    // f16's runs keep one (a_run_on_the_gpu_path_trains_checkpoints_...).
    assert!(saved.loss_scale.is_none(), "bf16 has no loss scale");
    // 2.3e-3 on the emulator (f16's run: 1.0e-3).
    let apart = weights_apart(bf16_dir.path(), cpu_dir.path());
    assert!(apart < 2e-2, "bf16 and CPU weights differ by {apart}");
    let (ba, ca) = (bf16.test_accuracy.unwrap(), cpu.test_accuracy.unwrap());
    assert!((ba - ca).abs() <= 4.0 / 64.0, "accuracy {ba} vs {ca}");

    let out = tempfile::tempdir().unwrap();
    let sets = [
        "device.kind=cuda",
        "device.amp=false",
        "device.precision=bf16",
    ];
    let config = smoke_config(data.path(), out.path(), &sets);
    let err = train(&config, &TrainOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("device.precision") && err.contains("device.amp"),
        "{err}"
    );
}

/// The SiLU MLP experiment (`experiments/mlp_silu.toml`, its low-memory
/// profile included) on the GPU path: flatten, linear and SiLU layers on
/// the device, in f32 ending within 1e-3 (relative L2) of the CPU run's
/// weights, and with mixed precision training too.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn the_silu_mlp_experiment_trains_on_the_gpu_path_as_on_the_cpu() {
    if !cuda_path_available("cuda_training") {
        return;
    }
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 256, 64);
    let experiment = headroom_tests::experiment("mlp_silu.toml");
    let run = |sets: &[&str]| {
        let out = tempfile::tempdir().unwrap();
        let mut pairs = vec![
            format!("data.dir={}", data.path().display()),
            format!("run.output_dir={}", out.path().display()),
            "train.epochs=1".to_string(),
            "train.batch_size=32".to_string(),
        ];
        pairs.extend(sets.iter().map(|s| s.to_string()));
        let overrides = Overrides::parse(&pairs).unwrap();
        let config = ExperimentConfig::load(&experiment, &overrides).unwrap();
        assert_eq!(config.run.profile.as_str(), "low_memory");
        let summary = train(&config, &TrainOptions::default()).unwrap();
        (summary, out)
    };
    let (gpu, gpu_dir) = run(&["device.kind=cuda", "device.amp=false"]);
    let (cpu, cpu_dir) = run(&["device.kind=cpu"]);
    assert_eq!((gpu.step, cpu.step), (8, 8));
    let apart = weights_apart(gpu_dir.path(), cpu_dir.path());
    assert!(apart < 1e-3, "GPU f32 and CPU weights differ by {apart}");

    let (mixed, _dir) = run(&["device.kind=cuda"]);
    assert_eq!(mixed.step, 8);
    let (ma, ca) = (mixed.test_accuracy.unwrap(), cpu.test_accuracy.unwrap());
    assert!((ma - ca).abs() <= 4.0 / 64.0, "accuracy {ma} vs {ca}");
}

/// `train.loss = "focal"` with `device.kind = "cuda"` trains on the GPU
/// path (it used to be refused there), in f32 within 1e-5 (relative L2) of
/// the CPU run's weights: cross-entropy in its place ends 1.2e-3 away.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_focal_loss_run_trains_on_the_gpu_path_as_on_the_cpu() {
    if !cuda_path_available("cuda_training") {
        return;
    }
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 128, 64);
    let (gpu, gpu_dir) = smoke_epoch(
        data.path(),
        "cuda",
        &["device.amp=false", "train.loss=focal"],
    );
    let (cpu, cpu_dir) = smoke_epoch(
        data.path(),
        "cpu",
        &["device.amp=false", "train.loss=focal"],
    );
    assert_eq!((gpu.step, cpu.step), (4, 4));
    assert!(gpu.test_accuracy.unwrap().is_finite());
    let apart = weights_apart(gpu_dir.path(), cpu_dir.path());
    eprintln!("focal run: GPU and CPU weights {apart:.2e} apart");
    assert!(
        apart < 1e-5,
        "GPU f32 and CPU focal-loss weights differ by {apart}"
    );
}

/// A tiny GPT over a corpus in `dir` (windows of 16 bytes), run in
/// `dir/<name>` on `kind`; `block` extends the transformer block's spec,
/// `extra` is appended (a `[finetune]` table).
fn text_experiment(
    dir: &std::path::Path,
    name: &str,
    kind: &str,
    block: &str,
    extra: &str,
) -> String {
    let corpus = dir.join("corpus.txt");
    if !corpus.exists() {
        let text = b"the cat sat on the mat. the dog ran to the log. a bird sang.\n".repeat(24);
        std::fs::write(&corpus, text).unwrap();
    }
    format!(
        r#"
[run]
name = "{name}"
seed = 5
log_every = 1000
profile = "none"
output_dir = "{run}"

[data]
format = "text"
dir = "{store}"
workers = 1

[text]
corpus = ["{corpus}"]
sample_bytes = 8

[device]
kind = "{kind}"
amp = false

[model]
tokens = {{ length = 16, vocab = 256 }}
checkpoint = "blocks"
layers = [
  {{ type = "embedding", dim = 16, positions = true }},
  {{ type = "transformer_block", heads = 2, mlp_ratio = 2{block} }},
  {{ type = "layer_norm" }},
  {{ type = "linear", out = 256 }},
]

[train]
epochs = 1
batch_size = 8
threads = 1
clip_norm = 1.0

[optimizer]
lr = 1e-2

[schedule]
kind = "constant"
{extra}
"#,
        run = dir.join(name).display(),
        store = dir.join("store").display(),
        corpus = corpus.display(),
    )
}

fn text_run(dir: &std::path::Path, name: &str, text: &str) -> headroom_pipeline::RunSummary {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    let config = ExperimentConfig::load(&path, &Overrides::default()).unwrap();
    let options = TrainOptions {
        resume: Resume::No,
        allow_install: false,
        stop: None,
        ..Default::default()
    };
    train(&config, &options).unwrap()
}

/// The final checkpoint's tensors by name.
fn named_params(dir: &std::path::Path) -> Vec<(String, Vec<f32>)> {
    let files = checkpoint::list(dir).unwrap();
    let path = files.last().unwrap();
    let saved = checkpoint::load(path).unwrap();
    headroom_pipeline::export::named_values(&saved, path)
        .unwrap()
        .into_iter()
        .map(|t| (t.name, t.values.to_vec()))
        .collect()
}

fn relative_l2(a: &[f32], b: &[f32]) -> f64 {
    let diff: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

/// A tiny GPT (embedding, a checkpointed transformer block with dropout,
/// per-token head) trains on the GPU path as on the CPU: f32 weights
/// within 1e-3 (relative L2) after an epoch, the same per-token accuracy.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_tiny_gpt_trains_on_the_gpu_path_as_on_the_cpu() {
    if !cuda_path_available("cuda_training") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let block = ", dropout = 0.1";
    let gpu = text_run(
        dir.path(),
        "gpu",
        &text_experiment(dir.path(), "gpu", "cuda", block, ""),
    );
    let cpu = text_run(
        dir.path(),
        "cpu",
        &text_experiment(dir.path(), "cpu", "cpu", block, ""),
    );
    assert_eq!(gpu.step, cpu.step);
    assert!(gpu.step > 0);
    let apart = weights_apart(&dir.path().join("gpu"), &dir.path().join("cpu"));
    eprintln!(
        "tiny gpt: {} steps, GPU and CPU weights {apart:.1e} apart",
        gpu.step
    );
    assert!(apart < 1e-3, "GPU f32 and CPU weights differ by {apart}");
    let (ga, ca) = (gpu.test_accuracy.unwrap(), cpu.test_accuracy.unwrap());
    assert!((ga - ca).abs() <= 0.02, "per-token accuracy {ga} vs {ca}");
}

/// LoRA fine-tuning (batch 4 × accumulation 2) on the GPU path: the base
/// loads by name and stays bit for bit frozen, and the adapters end within
/// 1e-3 (relative L2) of the CPU run's.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn lora_finetuning_trains_the_adapters_on_the_gpu_path_as_on_the_cpu() {
    if !cuda_path_available("cuda_training") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let base = text_experiment(dir.path(), "base", "cpu", "", "");
    text_run(dir.path(), "base", &base);
    let finetune = format!(
        "[finetune]\nbase = \"{}\"\ntrain = \"lora\"\n",
        dir.path().join("base").display()
    );
    let lora = ", lora = { r = 2, alpha = 4 }";
    for kind in ["cuda", "cpu"] {
        let text = text_experiment(dir.path(), kind, kind, lora, &finetune)
            .replace("batch_size = 8", "batch_size = 4\naccumulate = 2");
        let summary = text_run(dir.path(), kind, &text);
        assert!(summary.step > 0);
    }
    let base = named_params(&dir.path().join("base"));
    let (gpu, cpu) = (
        named_params(&dir.path().join("cuda")),
        named_params(&dir.path().join("cpu")),
    );
    assert_eq!(gpu.len(), cpu.len());
    let mut adapters = 0;
    for ((name, g), (cpu_name, c)) in gpu.iter().zip(&cpu) {
        assert_eq!(name, cpu_name);
        match base.iter().find(|(b, _)| b == name) {
            Some((_, b)) => assert!(g == b, "{name}: a frozen base tensor changed on the GPU"),
            None => {
                adapters += 1;
                let apart = relative_l2(g, c);
                eprintln!("{name}: GPU and CPU adapters {apart:.1e} apart");
                assert!(
                    apart < 1e-3,
                    "{name}: GPU and CPU adapters differ by {apart}"
                );
            }
        }
    }
    assert_eq!(adapters, 4, "A and B of the qkv and proj adapters");
}

/// A character LSTM (char_lm's layers, smaller) trains on the GPU path as
/// on the CPU: f32 weights within 1e-3 (relative L2) after an epoch.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn an_lstm_language_model_trains_on_the_gpu_path_as_on_the_cpu() {
    if !cuda_path_available("cuda_training") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let lstm = |kind: &str| {
        text_experiment(dir.path(), kind, kind, "", "").replace(
            r#"{ type = "transformer_block", heads = 2, mlp_ratio = 2 }"#,
            r#"{ type = "lstm", hidden = 24 }"#,
        )
    };
    let (gpu_text, cpu_text) = (lstm("cuda"), lstm("cpu"));
    assert!(gpu_text.contains("lstm"));
    let gpu = text_run(dir.path(), "cuda", &gpu_text);
    let cpu = text_run(dir.path(), "cpu", &cpu_text);
    assert_eq!(gpu.step, cpu.step);
    assert!(gpu.step > 0);
    let apart = weights_apart(&dir.path().join("cuda"), &dir.path().join("cpu"));
    eprintln!(
        "lstm: {} steps, GPU and CPU weights {apart:.1e} apart",
        gpu.step
    );
    assert!(apart < 1e-3, "GPU f32 and CPU weights differ by {apart}");
}

/// A tiny UNet-ConvLSTM on Moving-Fashion-MNIST-style sequences (made from
/// synthetic Fashion-MNIST files) on `kind`, f32, its run in `dir/<kind>`.
fn frames_experiment(dir: &std::path::Path, kind: &str) -> String {
    format!(
        r#"
[run]
name = "frames-{kind}"
seed = 1
log_every = 1000
profile = "none"
output_dir = "{run}"

[data]
format = "moving_fashion_mnist"
dir = "{data}"
workers = 1

[frames]
size = 32
garments = 2
train_sequences = 32
test_sequences = 8

[device]
kind = "{kind}"
amp = false

[model]
input = [32, 32, 1]
frames = 4
mean = 0.0
std = 1.0
layers = [
  {{ type = "unet_skip", layers = [
    {{ type = "conv", out = 4, stride = 2, bias = true }}, {{ type = "relu" }},
    {{ type = "conv_lstm", hidden = 4 }},
    {{ type = "upsample2x" }},
  ] }},
  {{ type = "conv", out = 1, bias = true }},
]

[train]
epochs = 1
batch_size = 8
threads = 1

[optimizer]
lr = 1e-2
weight_decay = 0.0

[schedule]
kind = "constant"
"#,
        run = dir.join(kind).display(),
        data = dir.join("data").display(),
    )
}

/// The UNet-ConvLSTM frame model on the GPU path as on the CPU: an f32
/// epoch ends within 1e-3 (relative L2) of the CPU run's weights, with the
/// same validation MSE and copy-last baseline.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_unet_conv_lstm_trains_on_the_gpu_path_as_on_the_cpu() {
    if !cuda_path_available("cuda_training") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("data")).unwrap();
    write_synthetic_fashion_mnist(&dir.path().join("data"), 64, 16);
    let gpu = text_run(dir.path(), "cuda", &frames_experiment(dir.path(), "cuda"));
    let cpu = text_run(dir.path(), "cpu", &frames_experiment(dir.path(), "cpu"));
    assert_eq!(gpu.step, cpu.step);
    assert!(gpu.step > 0);
    let apart = weights_apart(&dir.path().join("cuda"), &dir.path().join("cpu"));
    eprintln!(
        "conv_lstm: {} steps, GPU and CPU weights {apart:.1e} apart",
        gpu.step
    );
    assert!(apart < 1e-3, "GPU f32 and CPU weights differ by {apart}");
    let (g, c) = (gpu.test_loss.unwrap(), cpu.test_loss.unwrap());
    assert!((g - c).abs() <= 1e-3 * c.abs(), "validation MSE {g} vs {c}");
    let (gb, cb) = (
        gpu.test_baseline_loss.unwrap(),
        cpu.test_baseline_loss.unwrap(),
    );
    assert!(
        (gb - cb).abs() <= 1e-6 * cb.abs(),
        "copy-last baseline {gb} vs {cb}"
    );
}

/// `device.conv_algorithm = "tune"`: the checkpoints keep the kernels the
/// run chose for each product of its convolutions, and a resumed run takes
/// them from the checkpoint it resumes from instead of timing again. On the
/// emulator both resumes are checked: with the choices as saved, the
/// resumed run ends with the uninterrupted run's bits; with every choice in
/// that checkpoint flipped, the resumed run's own checkpoint holds the
/// flipped choices (a run that timed again would hold its own).
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_tuned_run_keeps_its_kernels_across_a_resume() {
    use headroom_model::cuda::ops::{ConvPath, ConvProduct};
    if !cuda_path_available("cuda_training") {
        return;
    }
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 128, 64);
    let out = tempfile::tempdir().unwrap();
    let config = smoke_config(
        data.path(),
        out.path(),
        &[
            "device.kind=cuda",
            "device.conv_algorithm=tune",
            "train.epochs=2",
            "augment.crop_padding=0",
        ],
    );
    train(&config, &TrainOptions::default()).unwrap();
    let straight_bits = final_state_bits(out.path());
    let files = checkpoint::list(out.path()).unwrap();
    let [first, last] = &files[..] else {
        panic!("two checkpoints: {files:?}")
    };
    let tuned = checkpoint::load(last).unwrap().meta.tuned_convs;
    // The basic block's 16 → 16 and the strided 16 → 32 convolutions at
    // batch 32, each product (the stem, 1 → 16, runs the thin kernels).
    for (cin, cout, stride) in [(16, 16, 1), (16, 32, 2)] {
        let products: Vec<ConvProduct> = tuned
            .iter()
            .filter(|t| {
                (t.shape.n, t.shape.cin, t.shape.cout, t.shape.stride) == (32, cin, cout, stride)
            })
            .map(|t| t.product)
            .collect();
        assert_eq!(
            products,
            [
                ConvProduct::Forward,
                ConvProduct::InputGrad,
                ConvProduct::WeightGrad
            ],
            "{cin} → {cout}: {tuned:?}"
        );
    }
    assert!(tuned.iter().all(|t| t.shape.cin % 8 == 0), "{tuned:?}");

    let resume = TrainOptions {
        resume: Resume::Latest,
        ..TrainOptions::default()
    };
    std::fs::remove_file(last).unwrap();
    train(&config, &resume).unwrap();
    assert_eq!(
        final_state_bits(out.path()),
        straight_bits,
        "resumed as saved"
    );

    std::fs::remove_file(last).unwrap();
    let mut saved = checkpoint::load(first).unwrap();
    assert!(!saved.meta.tuned_convs.is_empty());
    for t in &mut saved.meta.tuned_convs {
        t.path = match t.path {
            ConvPath::Implicit => ConvPath::Im2col,
            ConvPath::Im2col => ConvPath::Implicit,
        };
    }
    checkpoint::write(out.path(), &saved, 2).unwrap();
    train(&config, &resume).unwrap();
    let resumed = checkpoint::load(checkpoint::list(out.path()).unwrap().last().unwrap())
        .unwrap()
        .meta
        .tuned_convs;
    for flipped in &saved.meta.tuned_convs {
        assert!(
            resumed.contains(flipped),
            "{flipped:?} not kept: {resumed:?}"
        );
    }
}

/// `cargo xtask bench --set device.conv_algorithm=tune` reports what the
/// warm-up step chose for each product (both timings); `auto` tunes nothing.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn the_bench_reports_the_tuned_convolutions() {
    if !cuda_path_available("cuda_training") {
        return;
    }
    let data = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let tuned = |algorithm: &str| {
        let setting = format!("device.conv_algorithm={algorithm}");
        let config = smoke_config(data.path(), out.path(), &["device.kind=cuda", &setting]);
        headroom_pipeline::bench::training_step(&config, 8, 1, 1, 1, false)
            .unwrap()
            .tuned_convs
    };
    assert!(tuned("auto").is_empty());
    let chosen = tuned("tune");
    // Forward, input and weight gradients of the block's two 16 → 16
    // convolutions (one shape) and of the strided 16 → 32 one.
    assert_eq!(chosen.len(), 6, "{chosen:?}");
    assert!(chosen
        .iter()
        .all(|t| t.shape.n == 8 && t.implicit_ms > 0.0 && t.im2col_ms > 0.0));
}
