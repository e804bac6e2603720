//! Probing for CUDA never panics, whatever the machine has. On a machine
//! without a driver (CI, this repository's development machines) it finds
//! nothing and the CPU backend is chosen; with HEADROOM_REQUIRE_GPU=1
//! (`cargo xtask gpu-check`) a GPU must be found.

use std::io::Write as _;

use headroom_model::cuda::{self, libs, CudaBackend, CudaError};

fn require_gpu() -> bool {
    std::env::var("HEADROOM_REQUIRE_GPU").as_deref() == Ok("1")
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

#[test]
fn the_device_kind_follows_the_probe() {
    let expected = match CudaBackend::probe() {
        Ok(Some(_)) => "cuda",
        _ => "cpu",
    };
    assert_eq!(cuda::auto_device_kind(), expected);
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
