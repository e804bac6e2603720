// Casts between f32 and f16, and the fused normalisation of u8 input
// batches: y = T(x * scale - shift) in the storage T (f16 or f32), with
// scale = 1 / (255 * std) and shift = mean / std, i.e. (x / 255 - mean) / std
// in the same arithmetic as the CPU's Tensor::from_u8_normalized. Elementwise, any layout.
//
// gather_crop_flip_u8 makes a batch from a training set resident on
// the device (u8 NHWC, sample after sample): sample s of the batch is
// dataset sample recipes[2s], zero-padded by `pad` on every side, cropped
// back to h x w at (dy, dx) and mirrored left to right if `flip`, where
// recipes[2s + 1] = dy | dx << 8 | flip << 16 | pad << 24 (the loader's
// SampleRecipe::packed). That is the loader's crop and flip (output pixel
// (y, x) is padded pixel (y + dy, x' + dx), x' = w - 1 - x when flipped),
// followed by the normalisation above in the same arithmetic, so a batch
// made here has the bits of the same batch made on the host and staged.
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

struct GatherParams {
    u32 n;  // samples in the batch
    u32 h;
    u32 w;
    u32 c;
    float scale;
    float shift;
};
HR_CHECK_SIZE(GatherParams, 24);

extern "C" __global__ void cast_f32_to_f16(CastParams p, const float* __restrict__ x,
                                           hr_half* __restrict__ y) {
    HR_FOR_EACH(i, p.n) { y[i] = f2h(x[i]); }
}

extern "C" __global__ void cast_f16_to_f32(CastParams p, const hr_half* __restrict__ x,
                                           float* __restrict__ y) {
    HR_FOR_EACH(i, p.n) { y[i] = h2f(x[i]); }
}

template <typename T>
__device__ void normalize_u8_k(NormalizeParams p, const unsigned char* __restrict__ x,
                               T* __restrict__ y) {
    HR_FOR_EACH(i, p.n) { hr_st(&y[i], (float)x[i] * p.scale - p.shift); }
}

// The host checks every recipe (id below the set's size, dy and dx at most
// 2 * pad) before the launch, so every read is inside `images`.
template <typename T>
__device__ void gather_crop_flip_u8_k(GatherParams p, const unsigned char* __restrict__ images,
                                      const u32* __restrict__ recipes, T* __restrict__ y) {
    const u32 row = p.w * p.c;
    const u32 per_sample = p.h * row;
    HR_FOR_EACH(i, p.n * per_sample) {
        const u32 s = i / per_sample;
        const u32 r = i - s * per_sample;
        const u32 oy = r / row;
        const u32 ox = (r - oy * row) / p.c;
        const u32 ch = r - oy * row - ox * p.c;
        const u32 word = recipes[2 * s + 1];
        const int pad = (int)(word >> 24);
        const int x = ((word >> 16) & 1u) != 0u ? (int)(p.w - 1u - ox) : (int)ox;
        const int sy = (int)oy + (int)(word & 255u) - pad;
        const int sx = x + (int)((word >> 8) & 255u) - pad;
        float v = 0.0f;
        if (sy >= 0 && sy < (int)p.h && sx >= 0 && sx < (int)p.w) {
            const u64 at = (u64)recipes[2 * s] * per_sample + (u32)sy * row + (u32)sx * p.c + ch;
            v = (float)images[at];
        }
        hr_st(&y[i], v * p.scale - p.shift);
    }
}

// Entry points, one per storage type.
extern "C" __global__ void normalize_u8_f16(NormalizeParams p, const unsigned char* __restrict__ x,
                                            hr_half* __restrict__ y) {
    normalize_u8_k(p, x, y);
}

extern "C" __global__ void normalize_u8_f32(NormalizeParams p, const unsigned char* __restrict__ x,
                                            float* __restrict__ y) {
    normalize_u8_k(p, x, y);
}

extern "C" __global__ void gather_crop_flip_u8_f16(GatherParams p,
                                                   const unsigned char* __restrict__ images,
                                                   const u32* __restrict__ recipes,
                                                   hr_half* __restrict__ y) {
    gather_crop_flip_u8_k(p, images, recipes, y);
}

extern "C" __global__ void gather_crop_flip_u8_f32(GatherParams p,
                                                   const unsigned char* __restrict__ images,
                                                   const u32* __restrict__ recipes,
                                                   float* __restrict__ y) {
    gather_crop_flip_u8_k(p, images, recipes, y);
}
