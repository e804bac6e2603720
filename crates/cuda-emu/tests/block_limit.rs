//! A harness's widest block: once `install_with_widest_block(n)` has run, a
//! launch of up to n threads a block runs and a wider one is refused with
//! CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, as a GPU refuses a block whose
//! registers do not fit an SM. Its own test binary: the limit is the
//! process's, and the other tests launch 1024-thread blocks.

mod common;

use cudarc::driver::{LaunchConfig, PushKernelArg};

#[test]
fn a_block_wider_than_the_harness_allows_is_refused() {
    headroom_cuda_emu::install_with_widest_block(256).unwrap_or_else(|e| panic!("{e}"));
    let s = common::stream();
    let f = common::selftest(&s, "hr_emu_selftest_reverse");
    let input: Vec<u32> = (0..512).collect();
    let dev_in = s.clone_htod(&input).unwrap();
    let launch = |threads: u32| {
        let mut out = s.alloc_zeros::<u32>(512).unwrap();
        let mut b = s.launch_builder(&f);
        b.arg(&threads).arg(&dev_in).arg(&mut out);
        let cfg: LaunchConfig = common::one_block(threads);
        // SAFETY: one block reads and writes `threads` ≤ 512 u32 of 512.
        unsafe { b.launch(cfg) }.map(|_| s.clone_dtoh(&out).unwrap())
    };
    let out = launch(256).expect("a 256-thread block runs");
    let reversed: Vec<u32> = (0..256).rev().collect();
    assert_eq!(out[..256], reversed[..]);
    let err = launch(257).expect_err("a 257-thread block is refused");
    assert!(
        format!("{err:?}").contains("LAUNCH_OUT_OF_RESOURCES"),
        "{err:?}"
    );
}
