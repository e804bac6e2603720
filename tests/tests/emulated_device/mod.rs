//! The CUDA path on the CPU emulator whatever the machine has: for the
//! tests whose claim needs a device of a size they choose
//! (`HEADROOM_CUDA_EMU_MEMORY`), which a real GPU cannot be. Shared by
//! `cuda_small_gpu` and `cuda_driver_oom` (a module, not a test binary).

use headroom_model::cuda::{CudaBackend, MAX_BLOCK_THREADS};
use headroom_tests::cuda_path_available;

/// Loads the emulator before anything touches the CUDA driver, even where a
/// real GPU is present or `HEADROOM_REQUIRE_GPU=1` demands one, then readies
/// NVRTC as [`cuda_path_available`] does (false when it is missing and not
/// required: the binary then says so past the output capture). Panics if
/// the emulator cannot be loaded, or if the device found is not the
/// emulator's: the test's claim would not have been checked.
pub fn emulator_forced(test: &str) -> bool {
    if let Err(e) = headroom_cuda_emu::install_with_widest_block(MAX_BLOCK_THREADS) {
        panic!("{test} runs only on the CUDA emulator, which is unavailable: {e}");
    }
    // So that cuda_path_available asks no real driver about its GPUs.
    std::env::set_var("HEADROOM_CUDA_EMULATE", "1");
    if !cuda_path_available(test) {
        return false;
    }
    match CudaBackend::probe() {
        Ok(Some(info)) => assert_eq!(
            info.name,
            headroom_cuda_emu::DEVICE_NAME,
            "{test}: the device is not the emulator's: {info}"
        ),
        other => panic!("{test}: the emulator is loaded but the probe says {other:?}"),
    }
    true
}
