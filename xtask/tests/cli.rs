//! The `cargo xtask train` front door, end to end: the errors a user meets
//! first name what is wrong, and a killed run resumes and finishes.

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;
use headroom_tests::gzip_to;

fn checkpoints(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<_> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "ckpt"))
        .collect();
    files.sort();
    files
}

fn args(list: &[String]) -> Vec<&str> {
    list.iter().map(String::as_str).collect()
}

#[test]
fn unknown_config_key_is_named() {
    let out = run(&[
        "train",
        "--config",
        "experiments/smoke.toml",
        "--set",
        "train.batch_sise=4",
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("batch_sise"), "{err}");
}

#[test]
fn bad_value_is_named() {
    let out = run(&[
        "train",
        "--config",
        "experiments/smoke.toml",
        "--set",
        "optimizer.lr=-1",
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("optimizer.lr") && err.contains("positive"),
        "{err}"
    );

    let out = run(&[
        "train",
        "--config",
        "experiments/smoke.toml",
        "--set",
        "train.batch_size=lots",
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("batch_size"), "{err}");
}

#[test]
fn missing_experiment_file_is_named() {
    let out = run(&["train", "--config", "experiments/nope.toml"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("experiments/nope.toml"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn missing_dataset_names_the_directory_and_what_was_expected() {
    let empty = tempfile::tempdir().unwrap();
    let out_dir = tempfile::tempdir().unwrap();
    let out = run(&args(&smoke_args(empty.path(), out_dir.path())));
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains(&empty.path().display().to_string()), "{err}");
    assert!(err.contains("train-images-idx3-ubyte"), "{err}");
}

#[test]
fn malformed_idx_file_is_named() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 64, 32);
    // Cut the training images short: the header promises more than is there.
    let path = data.path().join("train-images-idx3-ubyte.gz");
    let mut header = vec![0, 0, 8, 3];
    for d in [64u32, 28, 28] {
        header.extend_from_slice(&d.to_be_bytes());
    }
    header.extend_from_slice(&[0u8; 100]);
    gzip_to(&path, &header);
    let out_dir = tempfile::tempdir().unwrap();
    let out = run(&args(&smoke_args(data.path(), out_dir.path())));
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("train-images-idx3-ubyte"), "{err}");
}

#[test]
fn killed_run_resumes_from_its_last_checkpoint_and_finishes() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 2048, 256);
    let out_dir = tempfile::tempdir().unwrap();
    let run_dir = out_dir.path().join("run");
    let mut base = smoke_args(data.path(), &run_dir);
    base.extend(["--set".into(), "train.epochs=4".into()]);

    let mut child = xtask(&args(&base))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while checkpoints(&run_dir).is_empty() && Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("training ended before the kill: {status}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        !checkpoints(&run_dir).is_empty(),
        "no checkpoint within two minutes"
    );
    child.kill().unwrap();
    child.wait().unwrap();

    // Without --resume, the old run is not overwritten.
    let refused = run(&args(&base));
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("--resume"),
        "{}",
        stderr(&refused)
    );

    let mut resume = base.clone();
    resume.push("--resume".into());
    let resumed = run(&args(&resume));
    let err = stderr(&resumed);
    assert!(resumed.status.success(), "{err}");
    assert!(err.contains("resuming from"), "{err}");
    assert!(err.contains("epoch 4/4 done"), "{err}");
    let stdout = String::from_utf8_lossy(&resumed.stdout);
    assert!(stdout.contains("test accuracy"), "{stdout}");

    // Resumed once more, the finished run says it is finished, trains
    // nothing and leaves its checkpoints as they are.
    let finished: Vec<_> = checkpoints(&run_dir)
        .into_iter()
        .map(|path| (std::fs::read(&path).unwrap(), path))
        .collect();
    let again = run(&args(&resume));
    let err = stderr(&again);
    assert!(again.status.success(), "{err}");
    assert!(
        err.contains("is the end of the run (step") && err.contains("all 4 epochs done"),
        "{err}"
    );
    assert!(!err.contains("epoch 5"), "{err}");
    let stdout = String::from_utf8_lossy(&again.stdout);
    assert!(stdout.contains("epochs run      0"), "{stdout}");
    let after: Vec<_> = checkpoints(&run_dir)
        .into_iter()
        .map(|path| (std::fs::read(&path).unwrap(), path))
        .collect();
    assert!(finished == after, "the checkpoints changed");
}

/// `--resume` of a directory that is not a run (no config.toml, no
/// checkpoint) is refused, and nothing is written into it.
#[test]
fn resuming_a_directory_that_is_no_run_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("notes.txt"), "not a run").unwrap();
    let out = run(&["train", "--resume", &dir.path().display().to_string()]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("not a run directory") && err.contains("config.toml"),
        "{err}"
    );
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        names,
        ["notes.txt"],
        "the refused resume wrote into the directory"
    );
}

#[test]
fn negative_size_and_nan_learning_rate_are_named() {
    let out = run(&[
        "train",
        "--config",
        "experiments/smoke.toml",
        "--set",
        "train.batch_size=-4",
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("batch_size"), "{}", stderr(&out));

    let out = run(&[
        "train",
        "--config",
        "experiments/smoke.toml",
        "--set",
        "optimizer.lr=NaN",
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("optimizer.lr"), "{err}");
}

#[test]
fn unwritable_output_directory_is_named() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 64, 32);
    let blocker = tempfile::NamedTempFile::new().unwrap();
    let out_dir = blocker.path().join("run");
    let out = run(&args(&smoke_args(data.path(), &out_dir)));
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("run.output_dir") && err.contains(&out_dir.display().to_string()),
        "{err}"
    );
}

#[test]
fn checkpoint_of_another_model_is_refused_with_the_difference() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 256, 32);
    let out_dir = tempfile::tempdir().unwrap();
    let mut first = smoke_args(data.path(), out_dir.path());
    first.extend(["--set".into(), "train.epochs=1".into()]);
    assert!(run(&args(&first)).status.success());

    let checkpoint = std::fs::read_dir(out_dir.path())
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "ckpt"))
        .unwrap();
    let mut other = vec![
        "train".to_string(),
        "--config".into(),
        "experiments/fashion_mnist.toml".into(),
        "--no-install".into(),
        "--set".into(),
        format!("data.dir={}", data.path().display()),
        "--resume".into(),
    ];
    other.push(checkpoint.display().to_string());
    let out = run(&args(&other));
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("different model") && err.contains("model.layers"),
        "{err}"
    );
}

/// Without a GPU, gpu-check says so after its report and runs no test (each
/// of the 40 parity tests would fail for want of one).
#[test]
fn gpu_check_without_a_gpu_says_so_instead_of_failing_every_test() {
    let out = run(&["gpu-check"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !stdout.contains("GPU: none") {
        eprintln!("a GPU is here: gpu-check is the GPU's own check");
        return;
    }
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("gpu-check needs a GPU"), "{err}");
    assert!(err.contains("CPU emulator"), "{err}");
    assert!(
        !stdout.contains("test result") && !err.contains("test result"),
        "{err}"
    );
}

/// The package of a crate directory, from its Cargo.toml's `name = "..."`.
fn package_name(dir: &std::path::Path) -> String {
    let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
    manifest
        .lines()
        .find_map(|line| line.strip_prefix("name = \""))
        .and_then(|rest| rest.strip_suffix('"'))
        .unwrap_or_else(|| panic!("no package name in {}", dir.display()))
        .to_string()
}

/// gpu-check runs every CUDA test binary: the list it runs is the set of
/// `cuda_*.rs` files (and `cuda_*/main.rs` folders) under crates/*/tests and tests/tests, so a new CUDA
/// test file cannot be left out of it.
#[test]
fn gpu_check_runs_every_cuda_test_file() {
    let out = run(&["gpu-check", "--list"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut listed: Vec<(String, String)> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|line| {
            let (package, test) = line.split_once(' ').expect("PACKAGE TEST");
            (package.to_string(), test.to_string())
        })
        .collect();
    let root = repo_root();
    let mut crates: Vec<_> = std::fs::read_dir(root.join("crates"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    crates.push(root.join("tests"));
    let mut found = Vec::new();
    for dir in crates {
        let Ok(entries) = std::fs::read_dir(dir.join("tests")) else {
            continue;
        };
        for entry in entries {
            let entry = entry.unwrap();
            let name = entry.file_name().to_string_lossy().into_owned();
            // A test binary is `NAME.rs`, or a folder `NAME/` with a
            // `main.rs` (cuda_parity: one module per op family); a CUDA one
            // is named `cuda_*` or reports NVRTC-gated tests
            // (`report_nvrtc_tests!`: memory_release, CPU tests beside a GPU one).
            let main = entry.path().join("main.rs");
            let (stem, source) = match main.is_file() {
                true => (Some(name.as_str()), main),
                false => (name.strip_suffix(".rs"), entry.path()),
            };
            let gated = || {
                std::fs::read_to_string(&source)
                    .is_ok_and(|text| text.contains("report_nvrtc_tests!("))
            };
            if let Some(test) = stem.filter(|stem| stem.starts_with("cuda_") || gated()) {
                found.push((package_name(&dir), test.to_string()));
            }
        }
    }
    listed.sort();
    found.sort();
    assert!(found.len() >= 7, "{found:?}");
    assert_eq!(listed, found, "gpu-check's CUDA_TESTS against the files");
}

/// The line of doctor's report that starts with `key`.
fn doctor_line(stdout: &str, key: &str) -> String {
    stdout
        .lines()
        .find(|line| line.split_whitespace().next() == Some(key))
        .unwrap_or_else(|| panic!("no {key} line in:\n{stdout}"))
        .to_string()
}

/// doctor says where NVRTC is or how to install it, where the dataset is
/// (searched as `train` searches) or how to install it, and, without a
/// GPU, that every op runs on the CPU.
#[test]
fn doctor_reports_nvrtc_the_dataset_and_the_op_paths() {
    let out = run(&["doctor"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let nvrtc = doctor_line(&stdout, "nvrtc");
    assert!(
        nvrtc.starts_with("nvrtc      found: ")
            || nvrtc
                == "nvrtc      not found: install it with `python3 -m pip install nvidia-cuda-nvrtc`",
        "{nvrtc}"
    );
    let system = std::path::Path::new("/usr/share/datasets/fashion-mnist");
    let installed = [
        "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz",
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
    ]
    .iter()
    .all(|file| system.join(file).is_file());
    let dataset = doctor_line(&stdout, "dataset");
    if installed {
        assert_eq!(
            dataset,
            "dataset    Fashion-MNIST in /usr/share/datasets/fashion-mnist"
        );
    } else {
        assert!(
            dataset.contains("not found")
                && dataset.contains("apt-get install -y dataset-fashion-mnist"),
            "{dataset}"
        );
    }
    let no_gpu = !matches!(headroom_model::cuda::CudaBackend::probe(), Ok(Some(_)));
    let ops = doctor_line(&stdout, "ops");
    assert_eq!(
        ops == "ops        no GPU: every op runs on the CPU",
        no_gpu,
        "{ops}"
    );

    // $FASHION_MNIST_DIR comes before the system directory, as in `train`.
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 8, 4);
    let out = xtask(&["doctor"])
        .env("FASHION_MNIST_DIR", data.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(
        doctor_line(&stdout, "dataset"),
        format!("dataset    Fashion-MNIST in {}", data.path().display())
    );
    let empty = tempfile::tempdir().unwrap();
    let out = xtask(&["doctor"])
        .env("FASHION_MNIST_DIR", empty.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let dataset = doctor_line(&stdout, "dataset");
    assert!(
        dataset.contains("not found") && dataset.contains("dataset-fashion-mnist"),
        "{dataset}"
    );
}
