//! Probing for CUDA never panics, whatever the machine has. On a machine
//! without a driver (CI, this repository's development machines) it finds
//! nothing and the CPU backend is chosen; with HEADROOM_REQUIRE_GPU=1
//! (`cargo xtask gpu-check`) a GPU must be found.

use std::io::Write as _;

use headroom_model::cuda::{self, libs, CudaBackend, CudaError};

fn env_is_1(name: &str) -> bool {
    std::env::var(name).as_deref() == Ok("1")
}

fn require_gpu() -> bool {
    env_is_1("HEADROOM_REQUIRE_GPU")
}

#[test]
fn probe_never_panics_and_finds_nothing_without_a_driver() {
    let probed = CudaBackend::probe();
    eprintln!("probe: {probed:?}");
    if !libs::driver_present() {
        assert!(
            matches!(probed, Ok(None)),
            "no libcuda on this machine, so no GPU: {probed:?}"
        );
    }
    if require_gpu() {
        assert!(
            matches!(probed, Ok(Some(_))),
            "HEADROOM_REQUIRE_GPU=1 but {probed:?}"
        );
    }
    // Probing twice gives the same answer (the driver is initialised once).
    assert_eq!(
        format!("{:?}", CudaBackend::probe().map(|o| o.map(|i| i.name))),
        format!("{:?}", probed.map(|o| o.map(|i| i.name)))
    );
}

/// Set in the child processes of `the_device_kind_follows_the_probe`: what
/// the child makes of the machine before anything touches CUDA.
const CHILD: &str = "HEADROOM_CUDA_PROBE_CHILD";

/// The line a child prints its answer on.
const ANSWER: &str = "auto_device_kind = ";

/// This test binary again, running only `the_device_kind_follows_the_probe`
/// as a child in `mode`, with `env` added; its answer, or None when the
/// child could not set itself up (it says why on stderr).
fn child_answer(mode: &str, env: &[(&str, &str)]) -> Option<String> {
    let exe = std::env::current_exe().unwrap();
    let mut command = std::process::Command::new(exe);
    command
        .args([
            "the_device_kind_follows_the_probe",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, mode);
    for (key, value) in env {
        command.env(key, value);
    }
    let output = command.output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "child {mode} failed:\n{stdout}\n{stderr}"
    );
    stdout
        .lines()
        // libtest may print "test NAME ... " ahead of it on the same line.
        .find_map(|l| {
            l.split_once(ANSWER)
                .map(|(_, kind)| kind.trim().to_string())
        })
        .or_else(|| {
            eprintln!("child {mode} gave no answer: {stderr}");
            None
        })
}

/// `auto_device_kind` against what is known without it (nor the probe it
/// calls): the real driver asked directly (`real_gpu_present`, no cudarc);
/// a child process whose GPUs are hidden (`CUDA_VISIBLE_DEVICES=""`), which
/// must say "cpu" even on a GPU machine; and a child that loaded the CPU
/// emulator of the driver first, a device known to be there, which must
/// say "cuda" even on a machine without a GPU.
#[test]
fn the_device_kind_follows_the_probe() {
    match std::env::var(CHILD).as_deref() {
        Ok("emulator") => {
            if let Err(e) = headroom_cuda_emu::install() {
                eprintln!("the CUDA emulator is unavailable: {e}");
                return;
            }
            println!("{ANSWER}{}", cuda::auto_device_kind());
            return;
        }
        Ok(_) => {
            println!("{ANSWER}{}", cuda::auto_device_kind());
            return;
        }
        Err(_) => {}
    }
    let real = headroom_cuda_emu::real_gpu_present();
    assert_eq!(
        cuda::auto_device_kind(),
        if real { "cuda" } else { "cpu" },
        "the driver itself says a GPU is {}",
        if real { "present" } else { "absent" }
    );
    assert_eq!(
        child_answer("hidden", &[("CUDA_VISIBLE_DEVICES", "")]).as_deref(),
        Some("cpu"),
        "no visible GPU"
    );
    match child_answer("emulator", &[]) {
        Some(kind) => assert_eq!(kind, "cuda", "the emulated device is a CUDA device"),
        // The emulator is built where there is a C++ compiler (CI has one);
        // a GPU bundle carries no emulator, and there the first check has
        // seen "cuda" already.
        None => {
            assert!(
                !env_is_1("HEADROOM_REQUIRE_NVRTC"),
                "HEADROOM_REQUIRE_NVRTC=1 but the CUDA emulator is unavailable"
            );
            if !real {
                let _ = writeln!(
                    std::io::stderr(),
                    "cuda_probe: the_device_kind_follows_the_probe checked \"cpu\" only: \
                     no GPU and no CUDA emulator (it needs a C++ compiler)"
                );
            }
        }
    }
}

#[test]
fn opening_a_missing_gpu_is_an_error_not_a_panic() {
    if let Ok(Some(_)) = CudaBackend::probe() {
        // Past libtest's output capture: a skip is seen in a plain run.
        let _ = writeln!(
            std::io::stderr(),
            "cuda_probe: opening_a_missing_gpu_is_an_error_not_a_panic skipped: a GPU is present"
        );
        return;
    }
    let err = CudaBackend::new(0).unwrap_err();
    assert!(matches!(err, CudaError::Unavailable(_)), "{err}");
    // And a GPU index past the last one, even with a driver.
    assert!(matches!(
        CudaBackend::probe_device(1 << 20),
        Ok(None) | Err(_)
    ));
}

#[test]
fn the_gpu_check_report_is_complete_and_honest() {
    let report = cuda::gpu_check_report();
    eprintln!("{report}");
    let text = report.to_string();
    assert!(text.contains("CUDA driver library"));
    assert!(text.contains("NVRTC"));
    match report.device {
        Ok(Some(_)) => {}
        _ => assert!(!report.gpu_ready(), "no GPU, so not ready"),
    }
    if require_gpu() {
        assert!(report.gpu_ready(), "HEADROOM_REQUIRE_GPU=1:\n{text}");
    }
}
