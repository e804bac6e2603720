// Shared by every kernel file. NVRTC is given no include path: the Rust
// loader (crates/model/src/cuda/kernels.rs) splices this file in where a .cu
// file says `#include "common.cuh"`, so the kernels need no CUDA toolkit
// header, only libnvrtc. (nvcc, given -I src/ops/, reads the same text.)
//
// Storage type: `hr_half` is the raw IEEE binary16 bit pattern, exactly the
// storage of `__half`; conversions are the PTX `cvt` instructions that
// cuda_fp16.hpp itself uses (round to nearest even), so no header is needed.
// All arithmetic is in f32 (f64 in the small per-channel finalisations).
//
// Indexing: every buffer a wrapper passes holds fewer than 2^32 elements (the
// Rust side checks it), so indices are 32-bit.
//
// Kernel parameters: each kernel takes one struct of scalars by value, the
// mirror of a #[repr(C)] struct in crates/model/src/cuda/params.rs (same
// field order and types; the sizes are asserted on both sides and checked
// against the PTX by tests/cuda_ptx.rs), followed by the buffers.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short hr_half;

#define HR_CHECK_SIZE(T, BYTES) static_assert(sizeof(T) == (BYTES), #T " must match its Rust mirror")

// The 2-byte format: IEEE binary16, or bfloat16 where the host compiles the
// file with HR_BF16 defined (crates/model/src/cuda/dtype.rs, HalfFormat:
// the same source, one module per format). hr_half names the storage
// either way. HR_HALF_EXPONENT masks the exponent bits of hr_half (all ones:
// inf or NaN).
#ifndef HR_EMULATE
#ifdef HR_BF16
#define HR_HALF_EXPONENT 0x7f80u
// A module compiled for bf16 carries this symbol: the emulator reads the
// format of a module from its image (crates/cuda-emu/shim/driver.cpp).
__device__ int headroom_half_format_bf16;

// bf16 is f32's top half: widening is exact.
__device__ __forceinline__ float h2f(hr_half h) {
    return __uint_as_float((u32)h << 16);
}

// sm_80 and newer (the host refuses bf16 below).
__device__ __forceinline__ hr_half f2h(float f) {
    hr_half h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#else
#define HR_HALF_EXPONENT 0x7c00u
__device__ __forceinline__ float h2f(hr_half h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ hr_half f2h(float f) {
    hr_half h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif
#else
// The emulator compiles each file once and learns the format of a launch
// from its module: ::hr_emu::half_is_bf16() (cuda_shim.h).
#define HR_HALF_EXPONENT (::hr_emu::half_is_bf16() ? 0x7f80u : 0x7c00u)

// bf16 as cvt.rn.bf16.f32: round to nearest even; a NaN stays a quiet NaN
// with the sign and top payload bits kept.
__device__ __forceinline__ float hr_bf16_to_f32(hr_half h) {
    return __uint_as_float((u32)h << 16);
}

__device__ __forceinline__ hr_half hr_f32_to_bf16(float f) {
    const u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (hr_half)((x >> 16) | 0x40u);
    }
    return (hr_half)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// The CPU emulator (crates/cuda-emu) compiles these files as host C++: the
// same conversions in integer arithmetic, IEEE round-to-nearest-even like
// cvt.rn. NaNs stay NaN (quiet, sign and top payload bits kept); their exact
// payload is the one thing not claimed to match the GPU.
__device__ __forceinline__ float hr_f16_to_f32(hr_half h) {
    const u32 sign = (u32)(h & 0x8000u) << 16;
    const u32 exp = (h >> 10) & 0x1fu;
    const u32 man = h & 0x3ffu;
    if (exp == 0x1fu) {
        return __uint_as_float(sign | 0x7f800000u | (man << 13) | (man ? 0x400000u : 0u));
    }
    if (exp != 0u) {
        return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
    }
    // Zero or subnormal: man * 2^-24, exact in f32.
    return __uint_as_float(sign | __float_as_uint((float)man * 5.9604644775390625e-8f));
}

__device__ __forceinline__ hr_half hr_f32_to_f16(float f) {
    const u32 x = __float_as_uint(f);
    const u32 sign = (x >> 16) & 0x8000u;
    const u32 ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) {
        return (hr_half)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    }
    if (ax >= 0x477ff000u) {  // 65520 and up (a tie with odd 65504) round to inf
        return (hr_half)(sign | 0x7c00u);
    }
    if (ax >= 0x38800000u) {  // normal in f16: rebias, round the 13 dropped bits
        u32 r = ax - 0x38000000u;
        r += 0xfffu + ((r >> 13) & 1u);
        return (hr_half)(sign | (r >> 13));
    }
    if (ax < 0x33000000u) {  // below half the smallest subnormal (2^-25 ties to 0)
        return (hr_half)sign;
    }
    // Subnormal result: round the 24-bit significand to a multiple of 2^-24
    // (a carry into 0x400 is the smallest normal, correctly encoded).
    const u32 m = (ax & 0x7fffffu) | 0x800000u;
    const u32 shift = 126u - (ax >> 23);
    u32 r = m >> shift;
    const u32 rem = m & ((1u << shift) - 1u);
    const u32 half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) {
        r += 1u;
    }
    return (hr_half)(sign | r);
}

__device__ __forceinline__ float h2f(hr_half h) {
    return ::hr_emu::half_is_bf16() ? hr_bf16_to_f32(h) : hr_f16_to_f32(h);
}

__device__ __forceinline__ hr_half f2h(float f) {
    return ::hr_emu::half_is_bf16() ? hr_f32_to_bf16(f) : hr_f32_to_f16(f);
}
#endif

// Storage-generic loads and stores: the layer kernels are templates over
// their activation storage T, hr_half (mixed precision) or float (f32
// training, `device.amp = false`), with f32 arithmetic either way. Each .cu
// file instantiates both as `NAME_f16` and `NAME_f32` entry points.
__device__ __forceinline__ float hr_ld(hr_half v) {
    return h2f(v);
}

__device__ __forceinline__ float hr_ld(float v) {
    return v;
}

__device__ __forceinline__ void hr_st(hr_half* p, float v) {
    *p = f2h(v);
}

__device__ __forceinline__ void hr_st(float* p, float v) {
    *p = v;
}

// v rounded to what storage T holds (identity for float).
template <typename T>
__device__ __forceinline__ float hr_round(float v) {
    T t;
    hr_st(&t, v);
    return hr_ld(t);
}

__device__ __forceinline__ bool hr_isfinite(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

__device__ __forceinline__ bool hr_isfinite_d(double x) {
    return (__double_as_longlong(x) & 0x7ff0000000000000ll) != 0x7ff0000000000000ll;
}

__device__ __forceinline__ float hr_neg_inf() {
    return __int_as_float(0xff800000);
}

__device__ __forceinline__ float hr_sigmoid(float x) {
    return 1.0f / (1.0f + expf(-x));
}

// One LSTM unit's step, gates i, f, g, o (the LSTM in sequence.cu and the
// ConvLSTM in frames.cu): the activated gates of the pre-activations into
// act (hr_lstm_gates alone: a recompute of them), the new cell state
// returned.
__device__ __forceinline__ void hr_lstm_gates(const float pre[4], float act[4]) {
    act[0] = hr_sigmoid(pre[0]);
    act[1] = hr_sigmoid(pre[1]);
    act[2] = tanhf(pre[2]);
    act[3] = hr_sigmoid(pre[3]);
}

__device__ __forceinline__ float hr_lstm_step(const float pre[4], float c_prev, float act[4]) {
    hr_lstm_gates(pre, act);
    return act[1] * c_prev + act[0] * act[2];
}

// Its backward: from dh (the output's gradient plus the carry) and the
// carried cell gradient, the pre-activation gradients into d; returns the
// cell gradient carried to the step before.
__device__ __forceinline__ float hr_lstm_step_backward(const float act[4], float c,
                                                       float c_prev, float dh, float dc_in,
                                                       float d[4]) {
    const float tc = tanhf(c);
    const float d_o = dh * tc;
    const float dc = dh * act[3] * (1.0f - tc * tc) + dc_in;
    d[0] = dc * act[2] * act[0] * (1.0f - act[0]);
    d[1] = dc * c_prev * act[1] * (1.0f - act[1]);
    d[2] = dc * act[0] * (1.0f - act[2] * act[2]);
    d[3] = d_o * act[3] * (1.0f - act[3]);
    return dc * act[1];
}

// ReLU that keeps NaN (max(x, 0) would hide it from the inf/NaN check).
__device__ __forceinline__ float hr_relu(float x) {
    return x < 0.0f ? 0.0f : x;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

// fmaxf ignores a NaN operand, like Rust's f32::max in the CPU reference.
__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    return v;
}

// The optimizer's verdict on a step, in device memory: written by
// step_finalize, adamw_check and step_commit (optim.cu), read by
// adamw_fused, by bn_running_restore (batchnorm.cu, which undoes a skipped
// step's running statistics) and, whenever it likes, by the host. It also carries the dynamic loss scaler's
// state from step to step, so that no step waits for the host.
struct StepState {
    u32 skipped;           // found_inf, schedule_missed or update_overflow: nothing was applied
    u32 found_inf;         // a gradient was inf or NaN
    u32 schedule_missed;   // the host gave no learning rate for this t
    float grad_norm;       // global L2 norm of the unscaled gradients
    float clip_factor;     // the clip coefficient applied (1: not clipped)
    float grad_factor;     // clip_factor / loss scale
    float decay_factor;    // this step's AdamW factors (for its t)
    float neg_step_size;
    float bias_correction2_sqrt;
    float next_scale;      // the loss scale of the next step
    u32 clean_steps;       // clean steps since the scale last changed
    u32 update_overflow;   // the update would leave a weight or moment not finite
    u64 applied;           // steps applied so far (AdamW's t of the last)
};
HR_CHECK_SIZE(StepState, 56);

// n / d for n < 2^31 by one multiply-high, an add and a shift: a 32-bit
// division by a value known only at run time costs some twenty
// instructions on a GPU, and im2col/col2im take several per element. The
// host computes m and s for d (FastDiv::new in params.rs, Granlund and
// Montgomery's round-up multiplier); n < 2^31 keeps n + mulhi(n, m) from
// overflowing.
struct FastDiv {
    u32 m;
    u32 s;
};
HR_CHECK_SIZE(FastDiv, 8);

__device__ __forceinline__ u32 hr_div(FastDiv f, u32 n) {
    return (__umulhi(n, f.m) + n) >> f.s;
}

// Whether a convolution's kernel tap t reads input coordinate i from an
// output coordinate below `out` (o * stride + t - pad == i), and that o:
// the input gradient's gathers (col2im, conv_narrow.cu) sum over the taps
// that reach an input element this way, with no atomics.
__device__ __forceinline__ bool hr_tap_source(u32 i, u32 t, u32 pad, u32 stride,
                                              FastDiv by_stride, u32 out, u32* o) {
    const int at = (int)(i + pad) - (int)t;
    if (at < 0) {
        return false;
    }
    *o = hr_div(by_stride, (u32)at);
    return *o * stride == (u32)at && *o < out;
}

// 8 halves, loaded and stored as one 16-byte access.
struct alignas(16) HalfVec8 {
    u32 w[4];
};

// Two or eight halves as one access (p aligned to its size). The emulator
// copies bytes instead, since the casts break C++'s aliasing rules, and
// fails the launch where the GPU would fault on a misaligned address.
#ifndef HR_EMULATE
__device__ __forceinline__ u32 hr_ld_pair(const hr_half* p) {
    return *reinterpret_cast<const u32*>(p);
}
__device__ __forceinline__ void hr_st_pair(hr_half* p, u32 v) {
    *reinterpret_cast<u32*>(p) = v;
}
__device__ __forceinline__ HalfVec8 hr_ld_vec8(const hr_half* p) {
    return *reinterpret_cast<const HalfVec8*>(p);
}
__device__ __forceinline__ void hr_st_vec8(hr_half* p, HalfVec8 v) {
    *reinterpret_cast<HalfVec8*>(p) = v;
}
#else
__device__ __forceinline__ u32 hr_ld_pair(const hr_half* p) {
    hr_emu::check_aligned(p, 4);
    u32 v;
    memcpy(&v, p, sizeof v);
    return v;
}
__device__ __forceinline__ void hr_st_pair(hr_half* p, u32 v) {
    hr_emu::check_aligned(p, 4);
    memcpy(p, &v, sizeof v);
}
__device__ __forceinline__ HalfVec8 hr_ld_vec8(const hr_half* p) {
    hr_emu::check_aligned(p, 16);
    HalfVec8 v;
    memcpy(&v, p, sizeof v);
    return v;
}
__device__ __forceinline__ void hr_st_vec8(hr_half* p, HalfVec8 v) {
    hr_emu::check_aligned(p, 16);
    memcpy(p, &v, sizeof v);
}
#endif

// Element e of 8 halves, widened; and 8 floats rounded into 8 halves.
__device__ __forceinline__ float hr_vec8_at(const HalfVec8& v, u32 e) {
    return h2f((hr_half)(v.w[e >> 1] >> (16u * (e & 1u))));
}

__device__ __forceinline__ HalfVec8 hr_vec8_of(const float* f) {
    HalfVec8 v;
    for (u32 e = 0; e < 4; ++e) {
        v.w[e] = (u32)f2h(f[2 * e]) | (u32)f2h(f[2 * e + 1]) << 16;
    }
    return v;
}

// Grid-stride loop over [0, n).
#define HR_FOR_EACH(i, n)                                                   \
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < (n);           \
         i += blockDim.x * gridDim.x)
