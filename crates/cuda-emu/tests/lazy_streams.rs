//! The emulator's streams are lazy, as a GPU is: queued work runs only when
//! the host waits for it, so host code that reads a result before waiting,
//! or rewrites a pinned buffer before the copy that reads it has run, gets
//! the wrong bits on the CPU too, and a test sees it.

use std::sync::Arc;

use cudarc::driver::{result, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};

mod common;

use common::{one_block, selftest, stream};

/// Pinned host memory holding `values`.
fn pinned_with(s: &Arc<CudaStream>, values: &[u32]) -> cudarc::driver::PinnedHostSlice<u32> {
    // SAFETY: filled before anything reads it.
    let mut p = unsafe { s.context().alloc_pinned::<u32>(values.len()) }.unwrap();
    p.as_mut_slice().unwrap().copy_from_slice(values);
    p
}

/// Reads pinned memory without waiting on anything (cudarc's accessors
/// wait on the buffer's own event).
fn peek(p: &cudarc::driver::PinnedHostSlice<u32>, n: usize) -> Vec<u32> {
    let ptr = p.as_ptr().unwrap();
    // SAFETY: `n` elements of a live pinned allocation.
    unsafe { std::slice::from_raw_parts(ptr, n) }.to_vec()
}

#[test]
fn a_result_copied_to_pinned_memory_arrives_when_its_event_is_waited_on() {
    let s = stream();
    let n = 4u32;
    let input = s.clone_htod(&[1u32, 2, 3, 4]).unwrap();
    let mut dev = s.alloc_zeros::<u32>(4).unwrap();
    let host = pinned_with(&s, &[0; 4]);
    let f = selftest(&s, "hr_emu_selftest_reverse");
    let mut b = s.launch_builder(&f);
    b.arg(&n).arg(&input).arg(&mut dev);
    // SAFETY: hr_emu_selftest_reverse(n, const u32* [n], u32* [n]), n threads.
    unsafe { b.launch(one_block(n)) }.unwrap();
    {
        let (src, _read) = dev.device_ptr(&s);
        let dst = host.as_ptr().unwrap() as *mut u32;
        // SAFETY: 16 bytes of a 16-byte allocation into 16 pinned bytes.
        unsafe {
            result::memcpy_dtoh_async(std::slice::from_raw_parts_mut(dst, 4), src, s.cu_stream())
        }
        .unwrap();
    }
    let done = s.record_event(None).unwrap();
    assert_eq!(peek(&host, 4), [0; 4], "nothing has run before the wait");
    done.synchronize().unwrap();
    assert_eq!(peek(&host, 4), [4, 3, 2, 1], "the kernel, then the copy");
}

#[test]
fn a_pinned_buffer_rewritten_before_its_copy_runs_is_copied_as_rewritten() {
    let s = stream();
    let mut dev = s.alloc_zeros::<u32>(4).unwrap();
    s.synchronize().unwrap();
    let host = pinned_with(&s, &[7; 4]);
    let (dst, _write) = dev.device_ptr_mut(&s);
    // SAFETY: 16 pinned bytes into a 16-byte allocation.
    unsafe {
        result::memcpy_htod_async(
            dst,
            std::slice::from_raw_parts(host.as_ptr().unwrap(), 4),
            s.cu_stream(),
        )
    }
    .unwrap();
    // A host that forgot to wait for the copy before reusing the buffer.
    let ptr = host.as_ptr().unwrap() as *mut u32;
    // SAFETY: 4 elements of a live pinned allocation.
    unsafe { std::slice::from_raw_parts_mut(ptr, 4) }.copy_from_slice(&[9; 4]);
    drop(_write);
    assert_eq!(s.clone_dtoh(&dev).unwrap(), [9; 4]);
}

#[test]
fn pageable_memory_is_taken_at_the_call_and_filled_before_it_returns() {
    let s = stream();
    let mut dev = s.alloc_zeros::<u32>(3).unwrap();
    let mut pageable = vec![5u32, 6, 7];
    s.memcpy_htod(&pageable, &mut dev).unwrap();
    pageable.copy_from_slice(&[0; 3]);
    let mut back = vec![0u32; 3];
    s.memcpy_dtoh(&dev, &mut back).unwrap();
    assert_eq!(back, [5, 6, 7]);
}

#[test]
fn a_stream_waiting_on_an_event_runs_after_the_recorded_work() {
    let s = stream();
    let other = s.context().new_stream().unwrap();
    let n = 4u32;
    let mut dev = s.alloc_zeros::<u32>(4).unwrap();
    let mut out = s.alloc_zeros::<u32>(4).unwrap();
    let host = pinned_with(&s, &[1, 2, 3, 4]);
    {
        let (dst, _write) = dev.device_ptr_mut(&other);
        // SAFETY: 16 pinned bytes into a 16-byte allocation.
        unsafe {
            result::memcpy_htod_async(
                dst,
                std::slice::from_raw_parts(host.as_ptr().unwrap(), 4),
                other.cu_stream(),
            )
        }
        .unwrap();
    }
    let copied = other.record_event(None).unwrap();
    s.wait(&copied).unwrap();
    let f = selftest(&s, "hr_emu_selftest_reverse");
    let mut b = s.launch_builder(&f);
    b.arg(&n).arg(&dev).arg(&mut out);
    // SAFETY: hr_emu_selftest_reverse(n, const u32* [n], u32* [n]), n threads.
    unsafe { b.launch(one_block(n)) }.unwrap();
    let mut back = vec![0u32; 4];
    s.memcpy_dtoh(&out, &mut back).unwrap();
    assert_eq!(back, [4, 3, 2, 1]);
}

/// Two streams that wait on each other's earlier work in turn (a valid
/// program: each waits only on work queued before its wait), run to the end
/// by two threads at once, each synchronising one stream. Each thread then
/// runs its stream's waits, which run the other stream's work; neither may
/// hold up the other on work that has already run.
#[test]
fn two_threads_running_streams_that_wait_on_each_other_both_finish() {
    let a = stream();
    let b = a.context().new_stream().unwrap();
    let n = 64u32;
    let f = selftest(&a, "hr_emu_selftest_reverse");
    let mut bufs = [
        a.alloc_zeros::<u32>(64).unwrap(),
        a.alloc_zeros::<u32>(64).unwrap(),
    ];
    a.synchronize().unwrap();
    for _ in 0..200 {
        for (s, other) in [(&a, &b), (&b, &a)] {
            let [x, y] = &mut bufs;
            let mut launch = s.launch_builder(&f);
            launch.arg(&n).arg(&*x).arg(y);
            // SAFETY: hr_emu_selftest_reverse(n, const u32* [n], u32* [n]),
            // n threads; the streams' waits order every use of the buffers.
            unsafe { launch.launch(one_block(n)) }.unwrap();
            let ready = s.record_event(None).unwrap();
            other.wait(&ready).unwrap();
        }
    }
    // Never freed: a free queues on a stream, and behind a deadlock it
    // would hang this test instead of letting it fail.
    std::mem::forget((bufs, f));
    let start = Arc::new(std::sync::Barrier::new(2));
    let (done, finished) = std::sync::mpsc::channel();
    for s in [a, b] {
        let (done, start) = (done.clone(), Arc::clone(&start));
        std::thread::spawn(move || {
            start.wait();
            s.synchronize().unwrap();
            done.send(()).unwrap();
        });
    }
    for _ in 0..2 {
        finished
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("both streams finish (no deadlock)");
    }
}
