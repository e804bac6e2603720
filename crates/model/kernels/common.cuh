// Shared by every kernel file. NVRTC is given no include path: the Rust
// loader (crates/model/src/cuda/kernels.rs) splices this file in where a .cu
// file says `#include "common.cuh"`, so the kernels need no CUDA toolkit
// header, only libnvrtc. (nvcc, given -I kernels/, reads the same text.)
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

__device__ __forceinline__ bool hr_isfinite(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

__device__ __forceinline__ bool hr_isfinite_d(double x) {
    return (__double_as_longlong(x) & 0x7ff0000000000000ll) != 0x7ff0000000000000ll;
}

__device__ __forceinline__ float hr_neg_inf() {
    return __int_as_float(0xff800000);
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

// Grid-stride loop over [0, n).
#define HR_FOR_EACH(i, n)                                                   \
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < (n);           \
         i += blockDim.x * gridDim.x)
