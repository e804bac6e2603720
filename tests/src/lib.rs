//! Shared helpers for headroom's cross-crate tests: a synthetic dataset in
//! Fashion-MNIST's file format, so tests never depend on the system's copy,
//! and the gate of the tests that need NVRTC ([`nvrtc_gate`]).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Once;

pub mod nvrtc_gate;

use headroom_model::cuda::MAX_BLOCK_THREADS;
use headroom_pipeline::{ExperimentConfig, Overrides};

/// Writes gzip IDX files with `train` / `test` samples of 28x28 images whose
/// class sets the brightness and the stripe period, plus noise: cues that
/// survive cropping, flipping and global pooling, so a small network learns
/// them in a few epochs.
pub fn write_synthetic_fashion_mnist(dir: &Path, train: usize, test: usize) {
    write_split(dir, "train", train, 1);
    write_split(dir, "t10k", test, 2);
}

fn write_split(dir: &Path, prefix: &str, count: usize, seed: u64) {
    let mut state = seed;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as u32
    };
    let mut images = Vec::with_capacity(count * 784);
    let mut labels = Vec::with_capacity(count);
    for i in 0..count {
        let label = (i % 10) as u8;
        labels.push(label);
        let period = 2 + (label as usize % 5);
        let base = 20 * label as u32;
        for row in 0..28 {
            for _col in 0..28 {
                let stripe = if (row / period).is_multiple_of(2) {
                    40
                } else {
                    0
                };
                let noise = next() % 30;
                images.push((base + stripe + noise).min(255) as u8);
            }
        }
    }
    let mut image_file = vec![0, 0, 8, 3];
    for d in [count as u32, 28, 28] {
        image_file.extend_from_slice(&d.to_be_bytes());
    }
    image_file.extend_from_slice(&images);
    let mut label_file = vec![0, 0, 8, 1];
    label_file.extend_from_slice(&(count as u32).to_be_bytes());
    label_file.extend_from_slice(&labels);
    gzip_to(
        &dir.join(format!("{prefix}-images-idx3-ubyte.gz")),
        &image_file,
    );
    gzip_to(
        &dir.join(format!("{prefix}-labels-idx1-ubyte.gz")),
        &label_file,
    );
}

pub fn gzip_to(path: &Path, bytes: &[u8]) {
    let file = std::fs::File::create(path).expect("create test file");
    let mut encoder = flate2::write::GzEncoder::new(file, flate2::Compression::fast());
    encoder.write_all(bytes).expect("write test file");
    encoder.finish().expect("finish gzip");
}

/// `experiments/NAME`: in `$HEADROOM_EXPERIMENTS` where that is set (the
/// GPU bundle's run.sh points it at the bundle's own copy), else in the
/// workspace the test was built in, else under the current directory. A
/// test binary carried to another machine (the GPU bundle) does not find
/// the build machine's workspace.
pub fn experiment(name: &str) -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../experiments");
    experiment_in(
        std::env::var_os("HEADROOM_EXPERIMENTS").map(PathBuf::from),
        &built,
        name,
    )
}

/// [`experiment`]'s choice, given the variable and the built workspace's
/// directory.
pub fn experiment_in(set: Option<PathBuf>, built: &Path, name: &str) -> PathBuf {
    if let Some(dir) = set {
        return dir.join(name);
    }
    let beside = built.join(name);
    if beside.is_file() {
        return beside;
    }
    Path::new("experiments").join(name)
}

/// [`smoke_config`] read as a command that trains reads it: `run.profile =
/// "auto"` judged by the GPU the run will use (`device::gpu_memory`), where
/// `smoke_config` touches no device. Call it after `cuda_path_available`.
pub fn smoke_config_for_device(data: &Path, out: &Path, extra: &[&str]) -> ExperimentConfig {
    let mut pairs = vec![
        format!("data.dir={}", data.display()),
        format!("run.output_dir={}", out.display()),
    ];
    pairs.extend(extra.iter().map(|s| s.to_string()));
    let overrides = Overrides::parse(&pairs).expect("overrides");
    match ExperimentConfig::load_for_device(
        &experiment("smoke.toml"),
        &overrides,
        headroom_pipeline::device::gpu_memory,
    ) {
        Ok(config) => config,
        Err(e) => panic!("smoke config: {e}"),
    }
}

/// experiments/smoke.toml on the data in `data`, writing to `out`, with
/// `extra` overrides (`key=value`).
pub fn smoke_config(data: &Path, out: &Path, extra: &[&str]) -> ExperimentConfig {
    let mut pairs = vec![
        format!("data.dir={}", data.display()),
        format!("run.output_dir={}", out.display()),
    ];
    pairs.extend(extra.iter().map(|s| s.to_string()));
    let experiments = experiment("smoke.toml");
    match ExperimentConfig::load(&experiments, &Overrides::parse(&pairs).expect("overrides")) {
        Ok(config) => config,
        Err(e) => panic!("smoke config: {e}"),
    }
}

fn env_is_1(name: &str) -> bool {
    std::env::var(name).as_deref() == Ok("1")
}

/// Readies the CUDA path for test `test`: the CPU emulator of CUDA unless a
/// real GPU is there (or HEADROOM_REQUIRE_GPU=1 demands one), and NVRTC.
/// False, with one line (once per binary, past the output capture), when
/// NVRTC is missing and HEADROOM_REQUIRE_NVRTC is not set; call it before
/// anything touches the CUDA driver. The tests calling it carry
/// [`nvrtc_gate::MARKER`], so where the build found no NVRTC they do not
/// run at all: this skip is for a binary built expecting NVRTC.
pub fn cuda_path_available(test: &str) -> bool {
    static SKIP: Once = Once::new();
    if cuda_path_is_emulated() {
        if let Err(e) = headroom_cuda_emu::install_with_widest_block(MAX_BLOCK_THREADS) {
            panic!("the CUDA emulator is unavailable: {e}");
        }
    }
    match headroom_model::cuda::libs::ensure_nvrtc() {
        Ok(_) => true,
        Err(e) if !env_is_1("HEADROOM_REQUIRE_NVRTC") => {
            SKIP.call_once(|| {
                nvrtc_gate::print_past_capture(&[format!(
                    "{test}: SKIPPED, every test: {e} (this binary was built expecting NVRTC; \
                     HEADROOM_REQUIRE_NVRTC=1 makes this a failure)"
                )])
            });
            false
        }
        Err(e) => panic!("HEADROOM_REQUIRE_NVRTC=1 but {e}"),
    }
}

/// Whether [`cuda_path_available`] gives the CPU emulator of CUDA, not a GPU.
pub fn cuda_path_is_emulated() -> bool {
    !env_is_1("HEADROOM_REQUIRE_GPU")
        && (env_is_1("HEADROOM_CUDA_EMULATE") || !headroom_cuda_emu::real_gpu_present())
}

/// The `device.conv_algorithm` override of a CUDA training test whose claim
/// is not about the convolutions (where the data lives, a budget's split):
/// `im2col` on the emulator, which runs the tensor cores' implicit GEMM
/// (every lane's fragments exchanged across its warp) several times
/// slower than im2col + cuBLAS (docs/testing.md), and the default on a GPU, so that there
/// the test takes the path users get. cuda_parity proves the implicit
/// GEMM kernels on the emulator, and the tests of the default path and of
/// `tune` train through them.
pub fn conv_algorithm_fast_on_the_emulator() -> &'static str {
    match cuda_path_is_emulated() {
        true => "device.conv_algorithm=im2col",
        false => "device.conv_algorithm=auto",
    }
}

/// A memory budget between what a training step of `config`'s model needs
/// at micro-batch 32 and at 64 (measured on the CPU, on top of the network's
/// own parameters and gradients): a run under it must plan or split to 32.
pub fn budget_between_32_and_64(config: &ExperimentConfig) -> u64 {
    use headroom_model::{measure_step_peak, Device, MemoryPool, Network};
    let pool = MemoryPool::new(Device::Cpu);
    pool.scope(|| {
        let mut network = Network::build(&config.model, config.run.seed).expect("the model builds");
        let base = pool.stats().in_use_bytes;
        let at32 = measure_step_peak(&mut network, 32).expect("a step at 32 is measured");
        let at64 = measure_step_peak(&mut network, 64).expect("a step at 64 is measured");
        assert!(at64 > at32 * 3 / 2, "peaks {at32} and {at64}");
        base + (at32 + at64) / 2
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bundle unpacked on another machine: the build's workspace is not
    /// there, so the experiment is found under the current directory, or
    /// wherever HEADROOM_EXPERIMENTS says.
    #[test]
    fn experiments_are_found_away_from_the_build_machine() {
        let gone = Path::new("/nonexistent/build/machine/experiments");
        assert_eq!(
            experiment_in(None, gone, "smoke.toml"),
            Path::new("experiments/smoke.toml")
        );
        let bundle = PathBuf::from("/bundle/experiments");
        assert_eq!(
            experiment_in(Some(bundle.clone()), gone, "smoke.toml"),
            bundle.join("smoke.toml")
        );
        let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../experiments");
        assert_eq!(
            experiment_in(None, &built, "smoke.toml"),
            built.join("smoke.toml")
        );
        assert!(experiment("smoke.toml").is_file());
    }
}
