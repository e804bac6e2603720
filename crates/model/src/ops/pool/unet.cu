// The pieces of a UNet decoder (layers::unet), NHWC, f16 or f32 storage (T):
//   upsample2x_forward    nearest neighbour, [n, h, w, c] -> [n, 2h, 2w, c],
//                         one thread per output element
//   upsample2x_backward   each input element the sum of its 2x2 block of
//                         the gradient, in the CPU's order ((g00 + g01) +
//                         g10) + g11, f32
//   channels_concat       y[r] = (a[r], b[r]): unet_skip's output, its input
//                         and its body's output side by side
//   channels_split        the inverse, for unet_skip's backward
// Pure copies and one f32 sum: f32 storage gives the CPU's bits.
#include "common.cuh"

struct UpsampleParams {
    u32 n;
    u32 h;  // the input's height and width
    u32 w;
    u32 c;
};
HR_CHECK_SIZE(UpsampleParams, 16);

struct ConcatParams {
    u32 rows;  // every index but the channels'
    u32 c1;
    u32 c2;
};
HR_CHECK_SIZE(ConcatParams, 12);

template <typename T>
__device__ void upsample2x_forward_k(UpsampleParams p, const T* __restrict__ x,
                                     T* __restrict__ y) {
    const u32 ow = 2 * p.w, oh = 2 * p.h;
    HR_FOR_EACH(i, p.n * oh * ow * p.c) {
        const u32 ch = i % p.c;
        const u32 rest = i / p.c;
        const u32 col = rest % ow;
        const u32 row = (rest / ow) % oh;
        const u32 sample = rest / (ow * oh);
        y[i] = x[((sample * p.h + row / 2) * p.w + col / 2) * p.c + ch];
    }
}

template <typename T>
__device__ void upsample2x_backward_k(UpsampleParams p, const T* __restrict__ g,
                                      T* __restrict__ dx) {
    const u32 ow = 2 * p.w;
    HR_FOR_EACH(i, p.n * p.h * p.w * p.c) {
        const u32 ch = i % p.c;
        const u32 rest = i / p.c;
        const u32 col = rest % p.w;
        const u32 row = (rest / p.w) % p.h;
        const u32 sample = rest / (p.w * p.h);
        const u32 top = (sample * 2 * p.h + 2 * row) * ow + 2 * col;
        const float g00 = hr_ld(g[top * p.c + ch]);
        const float g01 = hr_ld(g[(top + 1) * p.c + ch]);
        const float g10 = hr_ld(g[(top + ow) * p.c + ch]);
        const float g11 = hr_ld(g[(top + ow + 1) * p.c + ch]);
        hr_st(&dx[i], ((g00 + g01) + g10) + g11);
    }
}

template <typename T>
__device__ void channels_concat_k(ConcatParams p, const T* __restrict__ a,
                                  const T* __restrict__ b, T* __restrict__ y) {
    const u32 c = p.c1 + p.c2;
    HR_FOR_EACH(i, p.rows * c) {
        const u32 r = i / c, j = i % c;
        y[i] = j < p.c1 ? a[r * p.c1 + j] : b[r * p.c2 + (j - p.c1)];
    }
}

template <typename T>
__device__ void channels_split_k(ConcatParams p, const T* __restrict__ g, T* __restrict__ ga,
                                 T* __restrict__ gb) {
    const u32 c = p.c1 + p.c2;
    HR_FOR_EACH(i, p.rows * c) {
        const u32 r = i / c, j = i % c;
        if (j < p.c1) {
            ga[r * p.c1 + j] = g[i];
        } else {
            gb[r * p.c2 + (j - p.c1)] = g[i];
        }
    }
}

// Entry points, one per storage type.
extern "C" __global__ void upsample2x_forward_f16(UpsampleParams p, const hr_half* __restrict__ x,
                                                  hr_half* __restrict__ y) {
    upsample2x_forward_k(p, x, y);
}

extern "C" __global__ void upsample2x_forward_f32(UpsampleParams p, const float* __restrict__ x,
                                                  float* __restrict__ y) {
    upsample2x_forward_k(p, x, y);
}

extern "C" __global__ void upsample2x_backward_f16(UpsampleParams p,
                                                   const hr_half* __restrict__ g,
                                                   hr_half* __restrict__ dx) {
    upsample2x_backward_k(p, g, dx);
}

extern "C" __global__ void upsample2x_backward_f32(UpsampleParams p, const float* __restrict__ g,
                                                   float* __restrict__ dx) {
    upsample2x_backward_k(p, g, dx);
}

extern "C" __global__ void channels_concat_f16(ConcatParams p, const hr_half* __restrict__ a,
                                               const hr_half* __restrict__ b,
                                               hr_half* __restrict__ y) {
    channels_concat_k(p, a, b, y);
}

extern "C" __global__ void channels_concat_f32(ConcatParams p, const float* __restrict__ a,
                                               const float* __restrict__ b,
                                               float* __restrict__ y) {
    channels_concat_k(p, a, b, y);
}

extern "C" __global__ void channels_split_f16(ConcatParams p, const hr_half* __restrict__ g,
                                              hr_half* __restrict__ ga,
                                              hr_half* __restrict__ gb) {
    channels_split_k(p, g, ga, gb);
}

extern "C" __global__ void channels_split_f32(ConcatParams p, const float* __restrict__ g,
                                              float* __restrict__ ga, float* __restrict__ gb) {
    channels_split_k(p, g, ga, gb);
}
