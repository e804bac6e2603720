// Casts between f32 and f16, and the fused normalisation of u8 input
// batches: y = f16(x * scale - shift) with scale = 1 / (255 * std) and
// shift = mean / std, i.e. (x / 255 - mean) / std in the same arithmetic as
// the CPU's Tensor::from_u8_normalized. Elementwise, any layout.
#include "common.cuh"

struct CastParams {
    u32 n;
};
HR_CHECK_SIZE(CastParams, 4);

struct NormalizeParams {
    u32 n;
    float scale;
    float shift;
};
HR_CHECK_SIZE(NormalizeParams, 12);

extern "C" __global__ void cast_f32_to_f16(CastParams p, const float* __restrict__ x,
                                           hr_half* __restrict__ y) {
    HR_FOR_EACH(i, p.n) { y[i] = f2h(x[i]); }
}

extern "C" __global__ void cast_f16_to_f32(CastParams p, const hr_half* __restrict__ x,
                                           float* __restrict__ y) {
    HR_FOR_EACH(i, p.n) { y[i] = h2f(x[i]); }
}

extern "C" __global__ void normalize_u8_to_f16(NormalizeParams p,
                                               const unsigned char* __restrict__ x,
                                               hr_half* __restrict__ y) {
    HR_FOR_EACH(i, p.n) { y[i] = f2h((float)x[i] * p.scale - p.shift); }
}
