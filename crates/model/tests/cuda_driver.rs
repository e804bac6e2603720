//! The drivers one build serves, on the CPU emulator answering as each
//! (`headroom_cuda_emu::answer_as`): a driver older than CUDA 12.4 is
//! refused naming both versions, and `device.kind = "auto"` then takes the
//! CPU; a CUDA 12.4 driver opens the backend with NVRTC 12, loads its
//! kernels (the emulator refuses NVRTC 13's images on a 12.x driver, as
//! shim/device.cpp describes) and times GPU work without
//! `cuEventElapsedTime_v2`, which drivers before 12.8 lack; NVRTC 13 on a
//! CUDA 12 driver is refused naming both. What a real 12.x driver does was
//! not run: these check headroom's side against the emulator's model of it.
//!
//! Its own test binary: the emulated driver is the whole process's, and
//! which NVRTC a process loads is decided once, by the driver it first
//! sees. So the emulator never answers as sm_80 / CUDA 13.0 here (which
//! other binaries test), and the NVRTC 13 case runs in a child process
//! with `HEADROOM_NVRTC` naming that library.

use std::sync::{Mutex, MutexGuard};

use half::f16;
use headroom_cuda_emu::{answer_as, DeviceModel};
use headroom_model::cuda::ops::{self, ConvAlgorithm, ConvPlan, ConvShape};
use headroom_model::cuda::{
    auto_device_kind, kernels, libs, AnyView, CudaBackend, CudaError, CudaTensor, DType,
};
use headroom_model::Tensor;

#[path = "../../../tests/src/nvrtc_gate.rs"]
#[macro_use]
mod nvrtc_gate;

report_nvrtc_tests!("cuda_driver", include_str!("cuda_driver.rs"));

/// Set in the child process of the NVRTC 13 test.
const CHILD: &str = "HEADROOM_TEST_NVRTC13_ON_CUDA12";

/// The emulator, answering as `arch` and `driver`, for this test alone;
/// None (skip) where it was not built (no C++ compiler) and CI's
/// HEADROOM_REQUIRE_NVRTC does not demand it.
fn answering_as(arch: u32, driver: i32) -> Option<MutexGuard<'static, ()>> {
    static TURN: Mutex<()> = Mutex::new(());
    let turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    match answer_as(DeviceModel { arch, driver }) {
        Ok(()) => Some(turn),
        Err(e) => {
            assert!(
                std::env::var("HEADROOM_REQUIRE_NVRTC").as_deref() != Ok("1"),
                "HEADROOM_REQUIRE_NVRTC=1 but the CUDA emulator is unavailable: {e}"
            );
            eprintln!("skipped: the CUDA emulator is unavailable: {e}");
            None
        }
    }
}

#[test]
fn a_driver_older_than_cuda_12_4_is_refused_by_name_and_auto_takes_the_cpu() {
    let Some(_turn) = answering_as(86, 12020) else {
        return;
    };
    let err = CudaBackend::probe().expect_err("a CUDA 12.2 driver");
    assert!(matches!(err, CudaError::DriverTooOld { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("CUDA 12.2") && text.contains("CUDA 12.4 or newer"),
        "{text}"
    );
    assert_eq!(auto_device_kind(), "cpu");
    let opened = CudaBackend::new(0).map(|_| ()).expect_err("opening it");
    assert!(opened.to_string().contains("12.2"), "{opened}");
    // The oldest one served is served.
    answer_as(DeviceModel {
        arch: 86,
        driver: 12040,
    })
    .unwrap();
    let info = CudaBackend::probe().unwrap().expect("the emulated GPU");
    assert_eq!((info.arch(), info.driver_version), (86, (12, 4)));
}

/// A CUDA 12.4 driver with NVRTC 12: the backend opens, its kernels load
/// and run (the emulator would refuse NVRTC 13's PTX or CUBINs), and the
/// convolution tuner times both ways through `cuEventElapsedTime` (the
/// emulator refuses the 12.8 entry point on this driver).
#[test]
#[cfg_attr(
    not(headroom_nvrtc12),
    ignore = "NVRTC 12 not found: python3 -m pip install nvidia-cuda-nvrtc-cu12"
)]
fn a_cuda_12_4_driver_runs_the_kernels_with_nvrtc_12_and_times_them_without_12_8_calls() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let Some(_turn) = answering_as(86, 12040) else {
        return;
    };
    assert_eq!(libs::driver_major(), Some(12));
    let be = CudaBackend::new(0).unwrap_or_else(|e| panic!("{e}"));
    let (major, _) = kernels::nvrtc_version().unwrap();
    assert_eq!(major, 12, "the NVRTC of the driver's major version first");
    let s = ConvShape {
        n: 2,
        h: 6,
        w: 6,
        cin: 16,
        cout: 16,
        k: 3,
        stride: 1,
        pad: 1,
    };
    let x = Tensor::try_from_fn(&[2, 6, 6, 16], |i| (i % 7) as f32 * 0.125 - 0.375).unwrap();
    let x = CudaTensor::from_tensor(&be, &x, DType::F16).unwrap();
    let w: Vec<f16> = (0..9 * 16 * 16)
        .map(|i| f16::from_f32((i % 5) as f32 * 0.0625 - 0.125))
        .collect();
    let w = be.compute_stream().clone_htod(&w).unwrap();
    let run = |algorithm| {
        let plan = ConvPlan {
            algorithm,
            ..ConvPlan::default()
        };
        ops::conv2d_forward(&be, &x, &AnyView::F16(w.as_view()), None, s, plan)
            .and_then(|y| y.to_host(&be))
            .unwrap_or_else(|e| panic!("{algorithm:?}: {e}"))
    };
    let tuned = run(ConvAlgorithm::Tune);
    let timings = be.tuned_convolutions();
    assert!(
        timings
            .iter()
            .any(|t| t.shape == s && t.implicit_ms > 0.0 && t.im2col_ms > 0.0),
        "{timings:?}"
    );
    let im2col = run(ConvAlgorithm::Im2col);
    for (i, (a, b)) in tuned.iter().zip(&im2col).enumerate() {
        assert!(
            (a - b).abs() <= 2e-2 * b.abs().max(1.0),
            "element {i}: {a} against {b}"
        );
    }
}

/// NVRTC 13 on a CUDA 12.4 driver: refused when the backend opens, naming
/// both versions and how to get NVRTC 12. In a child process whose
/// `HEADROOM_NVRTC` names NVRTC 13 (this process may hold NVRTC 12).
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn nvrtc_13_on_a_cuda_12_driver_is_refused_naming_both_versions() {
    if std::env::var_os(CHILD).is_some() {
        let Some(_turn) = answering_as(86, 12040) else {
            panic!("the parent found the emulator");
        };
        let err = CudaBackend::new(0)
            .map(|_| ())
            .expect_err("NVRTC 13 on a 12.4 driver");
        assert!(matches!(err, CudaError::NvrtcTooNew { .. }), "{err:?}");
        let text = err.to_string();
        assert!(
            text.contains("NVRTC 13.")
                && text.contains("CUDA 12.4")
                && text.contains("nvidia-cuda-nvrtc-cu12"),
            "{text}"
        );
        return;
    }
    let nvrtc13 = libs::search_dirs()
        .into_iter()
        .map(|dir| dir.join("libnvrtc.so.13"))
        .find(|path| path.is_file());
    let Some(nvrtc13) = nvrtc13 else {
        assert!(
            std::env::var("HEADROOM_REQUIRE_NVRTC").as_deref() != Ok("1"),
            "HEADROOM_REQUIRE_NVRTC=1 but no libnvrtc.so.13 in {:?}",
            libs::search_dirs()
        );
        eprintln!("skipped: no libnvrtc.so.13 in {:?}", libs::search_dirs());
        return;
    };
    let name = "nvrtc_13_on_a_cuda_12_driver_is_refused_naming_both_versions";
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture"])
        .env(libs::NVRTC_ENV, &nvrtc13)
        .env(CHILD, "1")
        .output()
        .expect("the test binary runs again");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "with {}:\n{text}",
        nvrtc13.display()
    );
}
