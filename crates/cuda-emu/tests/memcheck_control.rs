//! The positive control of `cargo xtask memcheck`: a kernel that stores two
//! local words it never wrote. Run plainly, it checks the two it did write.
//! Run under valgrind's memcheck, printing the other two is a use of an
//! uninitialised value, and memcheck must name the kernel as its origin; the
//! xtask refuses to trust a clean memcheck of headroom's kernels otherwise.
//! Its own test binary, so that memcheck of the emulator's other tests stays
//! clean.

mod common;

use cudarc::driver::PushKernelArg;

#[test]
fn a_kernel_storing_locals_it_never_wrote_is_memchecks_positive_control() {
    let s = common::stream();
    let f = common::selftest(&s, "hr_emu_selftest_uninitialised_local");
    let launch = |written: u32| {
        let mut out = s.alloc_zeros::<u32>(4).unwrap();
        let mut b = s.launch_builder(&f);
        b.arg(&written).arg(&mut out);
        // SAFETY: one thread writes its 4 u32, the size allocated.
        unsafe { b.launch(common::one_block(1)) }.unwrap();
        s.clone_dtoh(&out).unwrap()
    };
    // The first launch writes all four, so the second finds them in its
    // stack slots: memcheck must still see that the second never wrote them.
    assert_eq!(launch(4), [1, 2, 3, 4]);
    let words = launch(2);
    assert_eq!(words[..2], [1, 2]);
    // Formatting branches on every digit: memcheck's report lands here.
    println!("the two words the kernel never wrote: {:?}", &words[2..]);
}
