//! The emulator's execution model, through cudarc as the backend uses it:
//! __syncthreads is a real barrier and __shared__ is per block, every warp
//! shuffle and vote gives CUDA's answer, atomics add up, a barrier/shuffle
//! deadlock is a launch error (not a hang), and an out-of-bounds write is
//! caught by the guard bytes, and a misaligned vector access fails the
//! launch as it faults on a GPU, a grid or block past CUDA's limits is
//! refused, and so is a launch whose written `__restrict__` argument has
//! another's address, and shared memory a block has not written reads
//! all-ones bits. Kernels: shim/selftest.cu.

mod common;

use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaStream, LaunchConfig, PushKernelArg};

fn stream() -> Arc<CudaStream> {
    static CTX: OnceLock<Arc<CudaContext>> = OnceLock::new();
    let ctx = CTX.get_or_init(|| {
        headroom_cuda_emu::install().unwrap_or_else(|e| panic!("{e}"));
        let ctx = CudaContext::new(0).expect("the emulated device opens");
        assert_eq!(ctx.name().unwrap(), headroom_cuda_emu::DEVICE_NAME);
        ctx
    });
    ctx.new_stream().expect("stream")
}

fn cfg(grid: u32, block: (u32, u32, u32)) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: block,
        shared_mem_bytes: 0,
    }
}

#[test]
fn barriers_and_shared_memory_are_per_block() {
    let s = stream();
    let f = common::selftest(&s, "hr_emu_selftest_reverse");
    // 3 blocks of 16×8 threads (two dimensions, several warps).
    let n = 128u32;
    let input: Vec<u32> = (0..3 * n).map(|i| i * 7 + 1).collect();
    let dev_in = s.clone_htod(&input).unwrap();
    let mut dev_out = s.alloc_zeros::<u32>(input.len()).unwrap();
    let mut b = s.launch_builder(&f);
    b.arg(&n).arg(&dev_in).arg(&mut dev_out);
    // SAFETY: the kernel reads 3·n and writes 3·n u32, the sizes allocated.
    unsafe { b.launch(cfg(3, (16, 8, 1))) }.unwrap();
    let out = s.clone_dtoh(&dev_out).unwrap();
    for blk in 0..3 {
        for t in 0..n {
            let b0 = (blk * n) as usize;
            assert_eq!(
                out[b0 + t as usize],
                input[b0 + (n - 1 - t) as usize],
                "block {blk} thread {t}"
            );
        }
    }
}

/// hr_emu_selftest_warp in one block of `input.len()` threads, each reading
/// its value: 8 results per thread (see selftest.cu).
fn warp_selftest(input: &[u32]) -> Vec<u32> {
    let s = stream();
    let f = common::selftest(&s, "hr_emu_selftest_warp");
    let dev_in = s.clone_htod(input).unwrap();
    let mut dev_out = s.alloc_zeros::<u32>(input.len() * 8).unwrap();
    let mut b = s.launch_builder(&f);
    b.arg(&dev_in).arg(&mut dev_out);
    // SAFETY: each thread reads its one value and writes its 8 results.
    unsafe { b.launch(cfg(1, (input.len() as u32, 1, 1))) }.unwrap();
    s.clone_dtoh(&dev_out).unwrap()
}

#[test]
fn warp_shuffles_and_votes_match_cuda() {
    let threads = 64usize;
    let input: Vec<u32> = (0..threads as u32)
        .map(|i| if i == 37 { 100 } else { i * 3 })
        .collect();
    let out = warp_selftest(&input);
    for t in 0..threads {
        let w = t / 32 * 32;
        let lane = t % 32;
        let v = |l: usize| input[w + l];
        let o = &out[t * 8..t * 8 + 8];
        assert_eq!(o[0], v(lane ^ 5), "xor, thread {t}");
        assert_eq!(
            o[1],
            if lane + 3 < 32 { v(lane + 3) } else { v(lane) },
            "down, thread {t}"
        );
        assert_eq!(
            o[2],
            if lane >= 7 { v(lane - 7) } else { v(lane) },
            "up, thread {t}"
        );
        assert_eq!(o[3], v(9), "idx, thread {t}");
        assert_eq!(o[4], v(lane ^ 1), "width-8 xor, thread {t}");
        let ballot = (0..32)
            .filter(|&l| v(l) & 1 == 1)
            .fold(0u32, |m, l| m | 1 << l);
        assert_eq!(o[5], ballot, "ballot, thread {t}");
        assert_eq!(o[6], u32::from(w == 32), "any, thread {t}");
        assert_eq!(o[7], 1, "all, thread {t}");
    }
}

/// A GPU gives an undefined value to a shuffle that reads a lane past the
/// block's end (or one that has exited); here it reads all-ones bits, so a
/// kernel that uses such a value (a warp sum over a partial warp, say) gets
/// NaN or a wild index instead of the zero that would make it look right.
#[test]
fn a_shuffle_from_a_lane_past_the_blocks_end_reads_all_ones() {
    let threads = 20usize;
    let input: Vec<u32> = (0..threads as u32).map(|i| i * 3 + 1).collect();
    let out = warp_selftest(&input);
    let read = |lane: usize| input.get(lane).copied().unwrap_or(u32::MAX);
    for t in 0..threads {
        let o = &out[t * 8..t * 8 + 8];
        assert_eq!(o[0], read(t ^ 5), "xor, thread {t}");
        assert_eq!(
            o[1],
            read(if t + 3 < 32 { t + 3 } else { t }),
            "down, thread {t}"
        );
        assert_eq!(o[3], read(9), "idx, thread {t}");
    }
    assert!(
        (0..threads).any(|t| out[t * 8] == u32::MAX),
        "some lane read past the block's end"
    );
}

#[test]
fn warp_sum_and_max_of_common_cuh_reduce_the_warp() {
    let s = stream();
    let f = common::selftest(&s, "hr_emu_selftest_warp_reduce");
    let input: Vec<f32> = (0..32).map(|i| (i as f32 - 10.5) * 0.25).collect();
    let dev_in = s.clone_htod(&input).unwrap();
    let mut dev_out = s.alloc_zeros::<f32>(64).unwrap();
    let mut b = s.launch_builder(&f);
    b.arg(&dev_in).arg(&mut dev_out);
    // SAFETY: one warp reads 32 floats and writes 64.
    unsafe { b.launch(cfg(1, (32, 1, 1))) }.unwrap();
    let out = s.clone_dtoh(&dev_out).unwrap();
    let sum: f32 = input.iter().sum();
    let max = input.iter().copied().fold(f32::MIN, f32::max);
    for lane in 0..32 {
        assert!(
            (out[lane * 2] - sum).abs() < 1e-4,
            "sum in lane {lane}: {}",
            out[lane * 2]
        );
        assert_eq!(out[lane * 2 + 1], max, "max in lane {lane}");
    }
}

#[test]
fn atomics_count_every_thread() {
    let s = stream();
    let f = common::selftest(&s, "hr_emu_selftest_atomics");
    let mut counter = s.alloc_zeros::<u32>(1).unwrap();
    let mut sum = s.alloc_zeros::<f32>(1).unwrap();
    let mut max_seen = s.alloc_zeros::<u32>(1).unwrap();
    let mut b = s.launch_builder(&f);
    b.arg(&mut counter).arg(&mut sum).arg(&mut max_seen);
    // SAFETY: each argument is one element, as the kernel expects.
    unsafe { b.launch(cfg(5, (96, 1, 1))) }.unwrap();
    assert_eq!(s.clone_dtoh(&counter).unwrap(), [480]);
    assert_eq!(s.clone_dtoh(&sum).unwrap(), [240.0]);
    assert_eq!(s.clone_dtoh(&max_seen).unwrap(), [479]);
}

#[test]
fn a_barrier_shuffle_deadlock_is_a_launch_error() {
    let s = stream();
    let f = common::selftest(&s, "hr_emu_selftest_deadlock");
    let mut out = s.alloc_zeros::<u32>(32).unwrap();
    let mut b = s.launch_builder(&f);
    b.arg(&mut out);
    // SAFETY: 32 threads, 32 elements.
    unsafe { b.launch(cfg(1, (32, 1, 1))) }.unwrap();
    // As on a GPU, a kernel's failure shows when the host waits for it.
    let err = s.synchronize().unwrap_err();
    assert!(format!("{err:?}").contains("LAUNCH_FAILED"), "{err:?}");
}

#[test]
fn an_out_of_bounds_write_is_caught() {
    let s = stream();
    let f = common::selftest(&s, "hr_emu_selftest_overrun");
    let n = 100u32;
    let mut out = s.alloc_zeros::<u32>(n as usize).unwrap();
    let mut b = s.launch_builder(&f);
    b.arg(&n).arg(&mut out);
    // SAFETY: deliberately not: the kernel writes element n of n. The write
    // lands in the emulator's guard bytes, checked when the kernel has run.
    unsafe { b.launch(cfg(1, (128, 1, 1))) }.unwrap();
    let err = s.synchronize().unwrap_err();
    assert!(format!("{err:?}").contains("ILLEGAL_ADDRESS"), "{err:?}");
}

#[test]
fn a_misaligned_vector_access_fails_the_launch() {
    let s = stream();
    let f = common::selftest(&s, "hr_emu_selftest_vec8");
    let input: Vec<u16> = (0..32).collect();
    let input = s.clone_htod(&input).unwrap();
    let copy = |offset: u32| {
        let mut out = s.alloc_zeros::<u16>(8).unwrap();
        let mut b = s.launch_builder(&f);
        b.arg(&offset).arg(&input).arg(&mut out);
        // SAFETY: one thread reads 8 of the 32 inputs and writes the 8 outputs.
        unsafe { b.launch(cfg(1, (1, 1, 1))) }.unwrap();
        s.synchronize().map(|()| s.clone_dtoh(&out).unwrap())
    };
    // 8 halves in is 16 bytes in: aligned, and the copy is exact.
    assert_eq!(copy(8).unwrap(), (8..16).collect::<Vec<u16>>());
    // 4 halves in is 8 bytes: a GPU faults on the 16-byte load.
    let err = copy(4).unwrap_err();
    assert!(format!("{err:?}").contains("MISALIGNED_ADDRESS"), "{err:?}");
}

#[test]
fn a_grid_past_cudas_limits_is_refused_and_one_at_them_runs() {
    let s = stream();
    let f = common::selftest(&s, "hr_emu_selftest_atomics");
    let launch = |grid: (u32, u32, u32), block: (u32, u32, u32)| {
        let mut counter = s.alloc_zeros::<u32>(1).unwrap();
        let mut sum = s.alloc_zeros::<f32>(1).unwrap();
        let mut max_seen = s.alloc_zeros::<u32>(1).unwrap();
        let mut b = s.launch_builder(&f);
        b.arg(&mut counter).arg(&mut sum).arg(&mut max_seen);
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: block,
            shared_mem_bytes: 0,
        };
        // SAFETY: each argument is one element, as the kernel expects.
        unsafe { b.launch(cfg) }.map(|_| s.clone_dtoh(&counter).unwrap()[0])
    };
    // 65535 blocks in y: CUDA's limit, and every block runs.
    assert_eq!(launch((1, 65_535, 1), (1, 1, 1)).unwrap(), 65_535);
    for (grid, block) in [
        ((1, 65_536, 1), (1, 1, 1)),
        ((1, 1, 65_536), (1, 1, 1)),
        ((1, 1, 1), (1, 1, 65)),
        ((1, 1, 1), (1, 2048, 1)),
    ] {
        let err = launch(grid, block).unwrap_err();
        assert!(
            format!("{err:?}").contains("INVALID_VALUE"),
            "{grid:?} {block:?}: {err:?}"
        );
    }
}

#[test]
fn a_written_restrict_argument_that_aliases_another_is_refused() {
    use cudarc::driver::DevicePtr;
    let s = stream();
    let f = common::selftest(&s, "hr_emu_selftest_restrict");
    let n = 16u32;
    let a = s.clone_htod(&(0..n).collect::<Vec<u32>>()).unwrap();
    let out = s.alloc_zeros::<u32>(n as usize).unwrap();
    // Raw addresses, so that one buffer can be passed twice (a safe launch
    // builder would not allow it for a written argument).
    let (a_ptr, _a_sync) = a.device_ptr(&s);
    let (out_ptr, _out_sync) = out.device_ptr(&s);
    let launch = |x: u64, y: u64, o: u64| {
        let mut b = s.launch_builder(&f);
        b.arg(&n).arg(&x).arg(&y).arg(&o);
        // SAFETY: three device addresses of n u32 each (the refused launch
        // does not run).
        unsafe { b.launch(cfg(1, (32, 1, 1))) }.map(|_| ())
    };
    // a read twice is no alias that matters.
    launch(a_ptr, a_ptr, out_ptr).unwrap();
    s.synchronize().unwrap();
    assert_eq!(
        s.clone_dtoh(&out).unwrap(),
        (0..n).map(|i| 2 * i).collect::<Vec<u32>>()
    );
    for (x, y, o) in [(a_ptr, out_ptr, out_ptr), (out_ptr, a_ptr, out_ptr)] {
        let err = launch(x, y, o).unwrap_err();
        assert!(format!("{err:?}").contains("INVALID_VALUE"), "{err:?}");
    }
}

#[test]
fn shared_memory_no_thread_of_the_block_wrote_reads_all_ones() {
    let s = stream();
    let f = common::selftest(&s, "hr_emu_selftest_unwritten_shared");
    // Twice, so that the blocks run in both orders: block 0 (which writes
    // all 64 words) runs before the others once and after them once.
    for launch in 0..2 {
        let mut out = s.alloc_zeros::<u32>(3 * 64).unwrap();
        let mut b = s.launch_builder(&f);
        b.arg(&mut out);
        // SAFETY: 3 blocks of 64 threads, each writing its one of 3·64 words.
        unsafe { b.launch(cfg(3, (64, 1, 1))) }.unwrap();
        let out = s.clone_dtoh(&out).unwrap();
        for block in 0..3u32 {
            for t in 0..64u32 {
                let expected = if block == 0 || t < 32 {
                    block + 1
                } else {
                    u32::MAX
                };
                assert_eq!(
                    out[(block * 64 + t) as usize],
                    expected,
                    "launch {launch}, block {block}, thread {t}"
                );
            }
        }
    }
}

/// Launches `name` on one stream twice, each time into zeros, and returns
/// both results.
fn launched_twice(name: &str, grid: u32, block: u32) -> [Vec<u32>; 2] {
    let s = stream();
    let f = common::selftest(&s, name);
    let once = || {
        let mut out = s.alloc_zeros::<u32>(32).unwrap();
        let mut b = s.launch_builder(&f);
        b.arg(&mut out);
        // SAFETY: at most 32 blocks or threads, each writing one of 32 elements.
        unsafe { b.launch(cfg(grid, (block, 1, 1))) }.unwrap();
        s.synchronize().unwrap();
        s.clone_dtoh(&out).unwrap()
    };
    [once(), once()]
}

#[test]
fn consecutive_launches_run_blocks_and_threads_in_opposite_orders() {
    // HEADROOM_CUDA_EMU_ORDER unset: forward and reverse take turns, so a
    // kernel whose answer depends on the order gives two answers.
    if std::env::var_os("HEADROOM_CUDA_EMU_ORDER").is_some() {
        return;
    }
    let chained: Vec<u32> = (1..=32).collect();
    for (name, grid, block) in [
        ("hr_emu_selftest_block_order", 32, 1),
        ("hr_emu_selftest_thread_order", 1, 32),
    ] {
        let [a, b] = launched_twice(name, grid, block);
        assert_ne!(a, b, "{name}");
        // First to last, each reads its predecessor's value; last to first,
        // each reads the zero (or the fresh value) its predecessor had not
        // yet replaced.
        assert!(a == chained || b == chained, "{name}: {a:?} {b:?}");
        let other = if a == chained { &b } else { &a };
        assert_eq!(other[0], 1, "{name}");
        assert_eq!(other[1..], [1; 31], "{name}");
    }
}
