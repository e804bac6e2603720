//! Elementwise transcendental math for the activations, branch-free so that
//! the compiler vectorises it: e^x by range reduction and a polynomial,
//! tanh and σ from it. libm's scalar `tanhf`/`expf` calls were a third of a
//! transformer step on the CPU (GELU forward and backward).
//!
//! Every function is plain IEEE adds, multiplies and divides in a fixed
//! order, with no fused multiply-add, so a loop compiled 16, 8 or 1 lanes
//! wide gives the same bits: the choice of width (`map_into`, `zip_into`)
//! changes the speed, never the numbers.
//!
//! Accuracy: `exp` within 2 ulp of e^x over [-87, 88] (clamped outside);
//! `tanh` and `sigmoid` within 3e-7 absolute, `tanh` within 2e-7 relative
//! near zero (|x| < 1/2).

use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU8, Ordering};

// The choice of micro-kernels lives here, beside `wide`, which dispatches on
// it; the convolutions re-export it (`layers::conv`), so it keeps its public
// paths without this module importing its user.
/// Which micro-kernels the direct and Winograd paths may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuKernels {
    /// The widest the CPU has: AVX-512 tiles where it exists, else AVX2+FMA.
    Auto,
    /// AVX2+FMA tiles even where AVX-512 exists (benchmarks compare them).
    Avx2,
}

/// 0 = not yet read from the environment, 1 = Auto, 2 = Avx2.
static KERNELS: AtomicU8 = AtomicU8::new(0);

/// Chooses the micro-kernels for every convolution of this process from now
/// on. Results do not change (the kernels agree bit for bit); speed does.
pub fn set_cpu_kernels(kernels: CpuKernels) {
    let code = match kernels {
        CpuKernels::Auto => 1,
        CpuKernels::Avx2 => 2,
    };
    KERNELS.store(code, Ordering::Relaxed);
}

/// The kernels in force: set by `set_cpu_kernels`, else by the environment
/// variable HEADROOM_CPU_KERNELS (`auto` or `avx2`), else `Auto`.
pub fn cpu_kernels() -> CpuKernels {
    match KERNELS.load(Ordering::Relaxed) {
        1 => CpuKernels::Auto,
        2 => CpuKernels::Avx2,
        _ => {
            let from_env = match std::env::var("HEADROOM_CPU_KERNELS").as_deref() {
                Ok("avx2") => CpuKernels::Avx2,
                _ => CpuKernels::Auto,
            };
            set_cpu_kernels(from_env);
            from_env
        }
    }
}

const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in two (Cody-Waite): the high part has trailing zero bits, so
/// n·LN2_HI is exact for the |n| ≤ 127 used here.
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// 1.5·2^23: adding and subtracting it rounds to the nearest integer.
const ROUND: f32 = 12_582_912.0;

/// e^x, branch-free; x is clamped to [-87, 88] (e^88 < f32::MAX, e^-87 is
/// still normal). NaN stays NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let clamped = x.clamp(-87.0, 88.0);
    // NaN through the clamp: `clamp` keeps NaN, and so does the rest.
    let shifted = clamped * LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = (clamped - n * LN2_HI) - n * LN2_LO;
    // Taylor series of e^r to r^7 on |r| ≤ ln2/2: remainder below 2e-8.
    let mut p = 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    // 2^n from its exponent bits; n + 127 is in [1, 254] after the clamp.
    // `shifted` holds n in its low mantissa bits (ROUND's trick), so n is
    // an integer subtraction away: `n as i32` saturates, which LLVM does
    // one lane at a time (it was most of this function's time). NaN gives
    // some finite scale, and the NaN in p carries through.
    let n_plus_bias = shifted
        .to_bits()
        .wrapping_sub(ROUND.to_bits())
        .wrapping_add(127);
    let scale = f32::from_bits(n_plus_bias << 23);
    p * scale
}

/// tanh(x): its Taylor series to x^15 for |x| < 1/2 (relative error
/// below 1e-7 there, where 1 − 2/(e^{2x} + 1) would cancel), else
/// 1 − 2/(e^{2x} + 1): ±1 at the clamp, NaN for NaN. Both are computed
/// and one selected, so the loop stays branch-free.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let x2 = x * x;
    let mut p = -929_569.0 / 638_512_875.0;
    p = p * x2 + 21_844.0 / 6_081_075.0;
    p = p * x2 + -1_382.0 / 155_925.0;
    p = p * x2 + 62.0 / 2_835.0;
    p = p * x2 + -17.0 / 315.0;
    p = p * x2 + 2.0 / 15.0;
    p = p * x2 + -1.0 / 3.0;
    let small = x + x * x2 * p;
    let large = 1.0 - 2.0 / (exp(2.0 * x) + 1.0);
    if x.abs() < 0.5 {
        small
    } else {
        large
    }
}

/// σ(x) = 1/(1 + e^{−x}).
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `out[i] = f(x[i])`, as wide as the CPU allows (the bits do not depend
/// on the width: see the file's header).
///
/// # Panics
/// If `x` and `out` differ in length.
pub fn map_into(x: &[f32], out: &mut [MaybeUninit<f32>], f: impl Fn(f32) -> f32 + Copy) {
    assert_eq!(x.len(), out.len(), "map_into: lengths");
    wide(
        #[inline(always)]
        || {
            for (o, &v) in out.iter_mut().zip(x) {
                o.write(f(v));
            }
        },
    );
}

/// `out[i] = f(a[i], b[i])`, as wide as the CPU allows.
///
/// # Panics
/// If the slices differ in length.
pub fn zip_into(
    a: &[f32],
    b: &[f32],
    out: &mut [MaybeUninit<f32>],
    f: impl Fn(f32, f32) -> f32 + Copy,
) {
    assert!(
        a.len() == out.len() && b.len() == out.len(),
        "zip_into: lengths"
    );
    wide(
        #[inline(always)]
        || {
            for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                o.write(f(x, y));
            }
        },
    );
}

/// Independent chains of `lane_sum`.
const LANES: usize = 8;

/// `Σ term(a[j], b[j])` (over the shorter slice) as eight chains, added in
/// order at the end, then the tail: the loop vectorises (a single chain
/// would wait on each add) and gives the same bits at any width. Public
/// as `headroom_model::lane_sum` (the gradient norm's sum of squares).
#[inline(always)]
pub fn lane_sum<T>(a: &[f32], b: &[f32], term: impl Fn(f32, f32) -> T) -> T
where
    T: Copy + Default + std::ops::Add<Output = T>,
{
    let mut lanes = [T::default(); LANES];
    let (a8, b8) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (a_tail, b_tail) = (a8.remainder(), b8.remainder());
    for (a8, b8) in a8.zip(b8) {
        for l in 0..LANES {
            lanes[l] = lanes[l] + term(a8[l], b8[l]);
        }
    }
    let mut total = lanes.into_iter().fold(T::default(), |s, v| s + v);
    for (&a, &b) in a_tail.iter().zip(b_tail) {
        total = total + term(a, b);
    }
    total
}

/// The largest of `values` (−∞ for none) over eight lanes, so that the
/// loop vectorises.
#[inline(always)]
pub fn lane_max(values: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = values.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane = lane.max(v);
        }
    }
    lanes
        .into_iter()
        .chain(tail.iter().copied())
        .fold(f32::NEG_INFINITY, f32::max)
}

/// Runs `body` compiled for the widest vectors the CPU has (AVX-512F, or
/// AVX2; `HEADROOM_CPU_KERNELS=avx2` holds it to AVX2), else as it is
/// (public as `headroom_model::wide`, for the optimizer's loops).
/// Mark the closure `#[inline(always)]` (and what it calls): a closure
/// is called from three places here, and one that LLVM leaves outlined
/// runs with the baseline's 4-lane SSE whatever the CPU has.
#[inline(always)]
pub fn wide(body: impl FnOnce()) {
    #[cfg(target_arch = "x86_64")]
    {
        if cpu_kernels() == CpuKernels::Auto && is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked just above).
            return unsafe { avx512(body) };
        }
        if is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { avx2(body) };
        }
    }
    body()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512(body: impl FnOnce()) {
    body()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn avx2(body: impl FnOnce()) {
    body()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid() -> Vec<f32> {
        let mut xs: Vec<f32> = (-40_000..=40_000).map(|i| i as f32 * 2.5e-3).collect();
        xs.extend([
            -1e-30, 1e-30, 0.0, -0.0, 1e-7, -1e-7, 87.5, -86.9, 200.0, -200.0,
        ]);
        xs
    }

    #[test]
    fn exp_is_within_two_ulp() {
        for x in grid().into_iter().filter(|x| (-87.0..=88.0).contains(x)) {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            let ulp = (want as f32).to_bits().abs_diff((got as f32).to_bits());
            assert!(ulp <= 2, "exp({x}) = {got}, e^x = {want}, {ulp} ulp apart");
        }
    }

    #[test]
    fn tanh_and_sigmoid_are_within_3e_7() {
        for x in grid() {
            let (t, s) = (tanh(x) as f64, sigmoid(x) as f64);
            let x = x as f64;
            assert!((t - x.tanh()).abs() < 3e-7, "tanh({x}) = {t}");
            assert!(
                (s - 1.0 / (1.0 + (-x).exp())).abs() < 3e-7,
                "sigmoid({x}) = {s}"
            );
        }
    }

    #[test]
    fn tanh_keeps_its_relative_precision_near_zero() {
        for i in 1..=5_000 {
            let x = i as f32 * 1e-4;
            for x in [x, -x, x * 1e-3] {
                let want = (x as f64).tanh();
                let got = tanh(x) as f64;
                assert!(
                    ((got - want) / want).abs() < 2e-7,
                    "tanh({x}) = {got}, want {want}"
                );
            }
        }
    }

    #[test]
    fn nan_and_infinities_carry_through() {
        assert!(exp(f32::NAN).is_nan());
        assert!(tanh(f32::NAN).is_nan());
        assert!(sigmoid(f32::NAN).is_nan());
        assert_eq!(tanh(f32::INFINITY), 1.0);
        assert_eq!(tanh(f32::NEG_INFINITY), -1.0);
        assert!((0.0..1e-37).contains(&sigmoid(f32::NEG_INFINITY)));
        assert_eq!(exp(f32::NEG_INFINITY), (-87.0f64).exp() as f32);
    }

    #[test]
    fn every_width_gives_the_same_bits() {
        let xs = grid();
        let f = |x: f32| x * sigmoid(x) + tanh(x);
        let mut wide_out = vec![MaybeUninit::uninit(); xs.len()];
        map_into(&xs, &mut wide_out, f);
        let mut zipped = vec![MaybeUninit::uninit(); xs.len()];
        zip_into(&xs, &xs, &mut zipped, |a, b| f(a) - b);
        for (i, &x) in xs.iter().enumerate() {
            // SAFETY: map_into and zip_into wrote every element.
            let (w, z) = unsafe { (wide_out[i].assume_init(), zipped[i].assume_init()) };
            // `f` called here is compiled for the baseline (scalar) target.
            let plain = std::hint::black_box(f)(x);
            assert_eq!(w.to_bits(), plain.to_bits(), "f({x})");
            assert_eq!(z.to_bits(), (plain - x).to_bits(), "f({x}) - {x}");
        }
    }
}
