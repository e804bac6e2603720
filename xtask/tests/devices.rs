//! `train --devices N` end to end, on the CPU emulator of CUDA and its
//! NCCL (crates/cuda-emu, preloaded into the xtask binary as
//! `cargo xtask gpu-bundle --dry-run` does; each rank a process with an
//! emulated GPU of its own): two GPU ranks of 32 samples end in the
//! weights of one GPU of 64 in two micro-batches, bit for bit; one rank
//! ends in the weights of a run without `--devices`; `--devices` on the
//! CPU is refused with the way to CPU ranks.
//!
//! Skipped, with one line, where NVRTC or the emulator is missing, unless
//! HEADROOM_REQUIRE_NVRTC=1 (CI) makes that a failure.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::*;
use headroom_pipeline::checkpoint;

/// Whether the emulated CUDA path can run here; prints why not.
fn emulator_ready(test: &str) -> bool {
    let require = std::env::var("HEADROOM_REQUIRE_NVRTC").as_deref() == Ok("1");
    let why = if !headroom_cuda_emu::lib_dir().join("libnccl.so").is_file() {
        Some(format!(
            "the CUDA emulator was not built in {}",
            headroom_cuda_emu::lib_dir().display()
        ))
    } else {
        headroom_model::cuda::libs::ensure_nvrtc()
            .err()
            .map(|e| e.to_string())
    };
    match why {
        None => true,
        Some(why) if require => panic!("HEADROOM_REQUIRE_NVRTC=1 but {why}"),
        Some(why) => {
            eprintln!("{test}: SKIPPED: {why} (HEADROOM_REQUIRE_NVRTC=1 makes this a failure)");
            false
        }
    }
}

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("headroom-devices-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn synthetic(name: &str) -> PathBuf {
    let dir = temp(name);
    std::fs::create_dir_all(&dir).expect("data dir");
    write_synthetic_fashion_mnist(&dir, 128, 32);
    dir
}

/// The smoke job on the emulated GPU, small, with `extra` arguments.
fn train(data: &Path, out: &Path, extra: &[&str]) -> Output {
    let lib = headroom_cuda_emu::lib_dir();
    let mut args = smoke_args(data, out);
    for set in [
        "device.kind=cuda",
        "data.train_samples=128",
        "data.test_samples=32",
        "train.epochs=1",
        "train.threads=1",
        "distributed.timeout_s=60",
    ] {
        args.push("--set".into());
        args.push(set.into());
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    xtask(&refs)
        .env("LD_PRELOAD", lib.join("libcuda.so"))
        .env("LD_LIBRARY_PATH", lib)
        .env(
            "HEADROOM_CUDA_EMU_WIDEST_BLOCK",
            headroom_model::cuda::MAX_BLOCK_THREADS.to_string(),
        )
        // im2col + the emulated cuBLAS: far faster here than the emulated
        // tensor-core convolution, the same plumbing (docs/cuda.md).
        .env("HEADROOM__DEVICE__CONV_ALGORITHM", "im2col")
        .env("HEADROOM_NCCL_EMU_TIMEOUT_S", "60")
        .output()
        .expect("run xtask")
}

fn checked(what: &str, output: Output) {
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{}",
        output.status,
        stderr(&output)
    );
}

fn state(dir: &Path) -> checkpoint::Checkpoint {
    let (found, _) = checkpoint::newest_valid(dir).expect("listing");
    let (path, _) = found.unwrap_or_else(|| panic!("no checkpoint in {}", dir.display()));
    checkpoint::load(&path).expect("loads")
}

fn bits(values: &[Vec<f32>]) -> Vec<u32> {
    values.iter().flatten().map(|v| v.to_bits()).collect()
}

#[test]
fn two_gpu_ranks_train_the_weights_of_one_gpu_accumulating_two_bit_for_bit() {
    if !emulator_ready("two_gpu_ranks") {
        return;
    }
    let data = synthetic("two-data");
    let (one, two) = (temp("two-one"), temp("two-two"));
    checked(
        "one GPU, 2 micro-batches",
        train(
            &data,
            &one,
            &[
                "--set",
                "train.batch_size=64",
                "--set",
                "train.accumulate=2",
            ],
        ),
    );
    let ranked = train(
        &data,
        &two,
        &["--devices", "2", "--set", "train.batch_size=32"],
    );
    let log = stderr(&ranked);
    checked("--devices 2", ranked);
    assert!(log.contains("2 GPU rank(s) (NCCL)"), "{log}");
    let (a, b) = (state(&one), state(&two));
    assert!(
        a.meta.step > 0 && a.meta.step == b.meta.step,
        "{} vs {}",
        a.meta.step,
        b.meta.step
    );
    assert!(
        bits(&a.params) == bits(&b.params),
        "2 GPU ranks × 32 ended in other weights than 1 GPU × 64 in 2 micro-batches"
    );
    for dir in [data, one, two] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn one_gpu_rank_trains_the_bits_of_a_run_without_devices() {
    if !emulator_ready("one_gpu_rank") {
        return;
    }
    let data = synthetic("one-data");
    let (plain, ranked) = (temp("one-plain"), temp("one-ranked"));
    checked("plain", train(&data, &plain, &[]));
    checked("--devices 1", train(&data, &ranked, &["--devices", "1"]));
    let (a, b) = (state(&plain), state(&ranked));
    assert_eq!(a.meta.step, b.meta.step);
    assert!(bits(&a.params) == bits(&b.params), "other weights");
    assert!(
        bits(&a.buffers) == bits(&b.buffers),
        "other running statistics"
    );
    for dir in [data, plain, ranked] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn devices_on_the_cpu_is_refused_with_the_way_to_cpu_ranks() {
    let data = synthetic("cpu-data");
    let out = temp("cpu-out");
    let mut args = smoke_args(&data, &out);
    args.extend(["--set", "device.kind=cpu", "--devices", "2"].map(String::from));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let output = run(&refs);
    let log = stderr(&output);
    assert!(!output.status.success(), "{log}");
    assert!(
        log.contains("--devices trains on GPUs") && log.contains("mpirun"),
        "{log}"
    );
    let _ = std::fs::remove_dir_all(data);
    let _ = std::fs::remove_dir_all(out);
}
