//! The driver needs a context current on the calling thread for everything
//! but device queries and context management; so does the emulator, so a
//! thread of ours that reaches the driver without binding one fails here,
//! not first on a GPU.

use cudarc::driver::{result, sys, CudaContext};

#[test]
fn a_thread_without_a_current_context_is_refused_until_it_binds_one() {
    headroom_cuda_emu::install().unwrap_or_else(|e| panic!("{e}"));
    let ctx = CudaContext::new(0).expect("the emulated device opens");
    std::thread::spawn(move || {
        // SAFETY: asks for 256 bytes; freed below if it is given.
        let refused = unsafe { result::malloc_sync(256) };
        assert_eq!(
            refused.map_err(|e| e.0),
            Err(sys::cudaError_enum::CUDA_ERROR_INVALID_CONTEXT),
            "an allocation on a thread with no current context"
        );
        ctx.bind_to_thread().expect("binding the context");
        // SAFETY: as above.
        let ptr = unsafe { result::malloc_sync(256) }.expect("allocating once bound");
        // SAFETY: allocated just above, by this context, not used since.
        unsafe { result::free_sync(ptr) }.expect("freeing it");
    })
    .join()
    .expect("the thread's assertions hold");
}
