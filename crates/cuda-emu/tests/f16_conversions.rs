//! The kernels' f16 conversions as the emulator compiles them (common.cuh
//! under HR_EMULATE) against the `half` crate, which rounds f32 → f16 to
//! nearest even like the GPU's cvt.rn.f16.f32: all 65536 f16 values one
//! way, and every f32 bit pattern with a stride plus the edge cases the
//! other way (ties, subnormals, overflow, infinities, NaN). NaN payloads
//! are only required to stay NaN with the same sign.

use half::f16;

fn f2h(x: f32) -> u16 {
    headroom_cuda_emu::f32_to_f16_bits(x).unwrap_or_else(|e| panic!("{e}"))
}

fn h2f(h: u16) -> f32 {
    headroom_cuda_emu::f16_bits_to_f32(h).unwrap_or_else(|e| panic!("{e}"))
}

fn check(x: f32) {
    let got = f2h(x);
    let want = f16::from_f32(x).to_bits();
    if x.is_nan() {
        assert!(
            f16::from_bits(got).is_nan() && (got & 0x8000) == (want & 0x8000),
            "f32→f16 of NaN {:#010x}: {got:#06x}",
            x.to_bits()
        );
    } else {
        assert_eq!(
            got,
            want,
            "f32→f16 of {x:e} ({:#010x}): emulator {got:#06x}, half {want:#06x}",
            x.to_bits()
        );
    }
}

#[test]
fn every_f16_widens_exactly() {
    for h in 0..=u16::MAX {
        let got = h2f(h);
        let want = f16::from_bits(h).to_f32();
        if want.is_nan() {
            assert!(
                got.is_nan() && got.is_sign_negative() == want.is_sign_negative(),
                "{h:#06x}"
            );
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "f16→f32 of {h:#06x}");
        }
        // And back: every f16 survives the round trip bit for bit (NaN as NaN).
        if !want.is_nan() {
            assert_eq!(f2h(got), h, "round trip of {h:#06x}");
        }
    }
}

#[test]
fn f32_to_f16_rounds_to_nearest_even_like_half() {
    // Every 4099th bit pattern (a prime stride reaches all exponents and
    // mantissa patterns), both signs.
    let mut bits: u32 = 0;
    loop {
        check(f32::from_bits(bits));
        match bits.checked_add(4099) {
            Some(b) => bits = b,
            None => break,
        }
    }
    // Around every f16 value: the exact value, the ties halfway to the next
    // one, and one f32 ulp either side of them.
    for h in 0..0x7c00u16 {
        let lo = f16::from_bits(h).to_f32() as f64;
        let hi = f16::from_bits(h + 1).to_f32() as f64;
        let mid = ((lo + hi) / 2.0) as f32; // exact: f16 ties fit in f32
        for x in [lo as f32, mid] {
            for v in [
                x,
                f32::from_bits(x.to_bits().wrapping_sub(1)),
                f32::from_bits(x.to_bits() + 1),
            ] {
                check(v);
                check(-v);
            }
        }
    }
    for x in [
        0.0,
        -0.0,
        f32::MIN_POSITIVE,
        1e-45,
        2.9802322e-8, // 2^-25: ties to zero
        2.9802326e-8, // just above: rounds up to the smallest subnormal
        5.9604645e-8,
        6.1035156e-5, // smallest normal f16
        6.1028e-5,
        65504.0,
        65519.996,
        65520.0, // ties to even: infinity
        1e10,
        f32::MAX,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001), // signalling NaN
        f32::from_bits(0xffc0_1234),
    ] {
        check(x);
        check(-x);
    }
}
