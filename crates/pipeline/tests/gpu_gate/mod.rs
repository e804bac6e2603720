//! The GPU tests' gate, shared by the binaries that drive the CUDA
//! learner: a backend on the real GPU when there is one (or
//! HEADROOM_REQUIRE_GPU=1), else on the CPU emulator of CUDA; the tests
//! skip (with one line) only when NVRTC or the emulator is missing and
//! HEADROOM_REQUIRE_NVRTC=1 does not forbid it. One test at a time holds
//! the device.

use std::io::Write as _;
use std::sync::{Mutex, MutexGuard, Once, OnceLock};

use headroom_model::cuda::{CudaBackend, CudaError, MAX_BLOCK_THREADS};

pub fn env_is_1(name: &str) -> bool {
    std::env::var(name).as_deref() == Ok("1")
}

/// A backend on the real GPU when there is one (or one is required), else
/// on the emulator; None (with one line, once, past the output capture)
/// only when NVRTC or the emulator is missing and not required. Decided
/// once per process, before cudarc loads a driver.
pub fn backend(binary: &str) -> Option<MutexGuard<'static, ()>> {
    static OPENED: OnceLock<Result<(), String>> = OnceLock::new();
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    static SKIP: Once = Once::new();
    let opened = OPENED.get_or_init(|| {
        let require_gpu = env_is_1("HEADROOM_REQUIRE_GPU");
        if !require_gpu
            && (env_is_1("HEADROOM_CUDA_EMULATE") || !headroom_cuda_emu::real_gpu_present())
        {
            if let Err(e) = headroom_cuda_emu::install_with_widest_block(MAX_BLOCK_THREADS) {
                assert!(
                    !env_is_1("HEADROOM_REQUIRE_NVRTC"),
                    "HEADROOM_REQUIRE_NVRTC=1 but the CUDA emulator is unavailable: {e}"
                );
                return Err(format!("the CPU emulator of CUDA is unavailable: {e}"));
            }
        }
        match CudaBackend::new(0) {
            Ok(be) => {
                eprintln!("{binary}: running on {}", be.info());
                Ok(())
            }
            Err(e @ CudaError::LibraryMissing { .. })
                if !require_gpu && !env_is_1("HEADROOM_REQUIRE_NVRTC") =>
            {
                Err(e.to_string())
            }
            Err(e) => panic!("the CUDA backend failed to open: {e}"),
        }
    });
    match opened {
        Ok(()) => Some(ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())),
        Err(why) => {
            SKIP.call_once(|| {
                let _ = writeln!(
                    std::io::stderr(),
                    "{binary}: SKIPPED, every test: {why} (HEADROOM_REQUIRE_NVRTC=1 makes this a \
                     failure)"
                );
            });
            None
        }
    }
}
