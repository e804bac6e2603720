//! Stream capture and graph replay in the emulator, through cudarc as the
//! backend uses it: captured work runs only when the graph is launched, with
//! the argument values of the capture; what a real capture refuses
//! invalidates the capture here too, so code that would break capture on a
//! GPU fails on the CPU first.

use std::sync::Arc;

use cudarc::driver::{sys, CudaGraph, CudaStream, DevicePtrMut, PushKernelArg};

mod common;

use common::{one_block, selftest, stream};

const MODE: sys::CUstreamCaptureMode =
    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;

fn end(s: &Arc<CudaStream>) -> Result<Option<CudaGraph>, cudarc::driver::DriverError> {
    s.end_capture(sys::CUgraphInstantiate_flags(0))
}

#[test]
fn captured_work_runs_at_each_replay_with_the_captured_arguments() {
    let s = stream();
    let f = selftest(&s, "hr_emu_selftest_reverse");
    let mut n = 8u32;
    let input = s.clone_htod(&[1u32, 2, 3, 4, 5, 6, 7, 8]).unwrap();
    let mut out = s.alloc_zeros::<u32>(8).unwrap();
    s.synchronize().unwrap();

    s.begin_capture(MODE).unwrap();
    let mut b = s.launch_builder(&f);
    b.arg(&n).arg(&input).arg(&mut out);
    // SAFETY: one block of n = 8 threads reads and writes 8 u32.
    unsafe { b.launch(one_block(8)) }.unwrap();
    let graph = end(&s).unwrap().expect("a graph");
    n = 0; // the kernel node keeps the value it was captured with
    assert_eq!(n, 0);

    assert_eq!(
        s.clone_dtoh(&out).unwrap(),
        [0; 8],
        "nothing ran at capture"
    );
    graph.launch().unwrap();
    assert_eq!(s.clone_dtoh(&out).unwrap(), [8, 7, 6, 5, 4, 3, 2, 1]);
    s.memset_zeros(&mut out).unwrap();
    graph.launch().unwrap();
    assert_eq!(s.clone_dtoh(&out).unwrap(), [8, 7, 6, 5, 4, 3, 2, 1]);
}

#[test]
fn memory_allocated_in_a_capture_is_the_graphs_and_fresh_at_each_replay() {
    let s = stream();
    let mut out = s.alloc_zeros::<u32>(4).unwrap();
    s.synchronize().unwrap();
    s.begin_capture(MODE).unwrap();
    {
        // SAFETY: read below only after the copy that follows it.
        let scratch = unsafe { s.alloc::<u32>(4) }.unwrap();
        s.memcpy_dtod(&scratch, &mut out).unwrap();
    }
    let graph = end(&s).unwrap().expect("a graph");
    graph.launch().unwrap();
    // The scratch was never written: a replay hands it out as fresh
    // (0xff) memory, so reading it shows.
    assert_eq!(s.clone_dtoh(&out).unwrap(), [u32::MAX; 4]);

    s.begin_capture(MODE).unwrap();
    // SAFETY: never read.
    let kept = unsafe { s.alloc::<u32>(4) }.unwrap();
    assert!(
        end(&s).is_err(),
        "memory allocated in a capture must be freed in it"
    );
    drop(kept);
}

#[test]
fn synchronising_inside_a_capture_invalidates_it() {
    let s = stream();
    let mut out = s.alloc_zeros::<u32>(4).unwrap();
    s.synchronize().unwrap();
    s.begin_capture(MODE).unwrap();
    s.memset_zeros(&mut out).unwrap();
    assert!(s.synchronize().is_err());
    assert!(end(&s).is_err());

    // A download is a copy to pageable memory and a synchronisation.
    s.begin_capture(MODE).unwrap();
    assert!(s.clone_dtoh(&out).is_err());
    assert!(end(&s).is_err());

    // A synchronous allocation on the capturing thread.
    s.begin_capture(MODE).unwrap();
    // SAFETY: plain allocation; nothing is read.
    let sync_alloc = unsafe { cudarc::driver::result::malloc_sync(64) };
    assert!(sync_alloc.is_err());
    assert!(end(&s).is_err());
}

#[test]
fn waiting_on_work_recorded_before_the_capture_invalidates_it() {
    let s = stream();
    let other = s.context().new_stream().unwrap();
    let before = other.record_event(None).unwrap();
    s.begin_capture(MODE).unwrap();
    assert!(s.wait(&before).is_err());
    assert!(end(&s).is_err());

    // An event recorded inside the capture may be waited on there.
    s.begin_capture(MODE).unwrap();
    let inside = s.record_event(None).unwrap();
    s.wait(&inside).unwrap();
    assert!(end(&s).unwrap().is_some());
}

#[test]
fn only_pinned_host_memory_may_be_copied_in_a_capture() {
    let s = stream();
    let mut dev = s.alloc_zeros::<u32>(4).unwrap();
    s.synchronize().unwrap();
    let pageable = [5u32; 4];
    s.begin_capture(MODE).unwrap();
    assert!(s.memcpy_htod(&pageable, &mut dev).is_err());
    assert!(end(&s).is_err());

    // SAFETY: written before the copy reads it.
    let mut pinned = unsafe { s.context().alloc_pinned::<u32>(4) }.unwrap();
    pinned
        .as_mut_slice()
        .unwrap()
        .copy_from_slice(&[9, 9, 9, 9]);
    let host: *const u32 = pinned.as_slice().unwrap().as_ptr();
    let (dst, _record) = dev.device_ptr_mut(&s);
    s.begin_capture(MODE).unwrap();
    // cudarc's pinned copies wait on the buffer's own event (recorded
    // outside the capture); the driver call itself is what a capture takes.
    // SAFETY: 4 u32 of pinned memory into a 4-u32 allocation.
    unsafe {
        cudarc::driver::result::memcpy_htod_async(
            dst,
            std::slice::from_raw_parts(host, 4),
            s.cu_stream(),
        )
    }
    .unwrap();
    let graph = end(&s).unwrap().expect("a graph");
    // The node reads the pinned buffer when it runs, not when captured.
    pinned
        .as_mut_slice()
        .unwrap()
        .copy_from_slice(&[1, 2, 3, 4]);
    graph.launch().unwrap();
    drop(_record);
    assert_eq!(s.clone_dtoh(&dev).unwrap(), [1, 2, 3, 4]);
}
