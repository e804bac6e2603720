//! What the emulator's cudarc-level tests share: a stream of a context that
//! orders its work itself, as the backend's does, and the self-test kernels.
//! Not every test binary uses every item.
#![allow(dead_code)]

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig};
use cudarc::nvrtc::Ptx;

/// A stream of the emulated device with cudarc's event tracking off (the
/// backend's setting: no waits on events recorded before a capture).
pub fn stream() -> Arc<CudaStream> {
    headroom_cuda_emu::install().unwrap_or_else(|e| panic!("{e}"));
    let ctx = CudaContext::new(0).expect("the emulated device opens");
    // SAFETY: set before any buffer of this context exists.
    unsafe { ctx.disable_event_tracking() };
    ctx.new_stream().expect("stream")
}

/// A kernel of shim/selftest.cu, e.g. hr_emu_selftest_reverse(n, const u32*
/// in, u32* out): each block reverses n elements through shared memory.
pub fn selftest(s: &Arc<CudaStream>, name: &str) -> CudaFunction {
    // Kernels are found by name; the image only has to be one the device
    // and driver would load (the oldest PTX header of any: ISA 7.0, sm_50).
    let module = s
        .context()
        .load_module(Ptx::from_src(".version 7.0\n.target sm_50\n// emulated"))
        .unwrap();
    module.load_function(name).unwrap()
}

pub fn one_block(threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}
