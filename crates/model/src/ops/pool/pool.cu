// Global average pooling, [N, H, W, C] -> [N, C] (the CPU's GlobalAvgPool):
// forward sums the H*W rows of each (sample, channel) in f32 and multiplies
// by 1/(H*W); backward spreads g[n, c] * 1/(H*W) over the H*W positions.
// Max pooling (MaxPool2d) below.
#include "common.cuh"

struct PoolParams {
    u32 n;
    u32 hw;
    u32 c;
    float inv_hw;
};
HR_CHECK_SIZE(PoolParams, 16);

// One thread per (sample, channel); consecutive threads read consecutive
// channels of a row (coalesced).
template <typename T>
__device__ void global_avg_pool_forward_k(PoolParams p, const T* __restrict__ x,
                                                   T* __restrict__ y) {
    const u32 total = p.n * p.c;
    HR_FOR_EACH(i, total) {
        const u32 s = i / p.c;
        const u32 ch = i % p.c;
        const T* base = x + s * p.hw * p.c + ch;
        float acc = 0.0f;
        for (u32 q = 0; q < p.hw; ++q) {
            acc += hr_ld(base[q * p.c]);
        }
        hr_st(&y[i], acc * p.inv_hw);
    }
}

template <typename T>
__device__ void global_avg_pool_backward_k(PoolParams p, const T* __restrict__ g,
                                                    T* __restrict__ dx) {
    const u32 total = p.n * p.hw * p.c;
    HR_FOR_EACH(i, total) {
        const u32 s = i / (p.hw * p.c);
        const u32 ch = i % p.c;
        hr_st(&dx[i], hr_ld(g[s * p.c + ch]) * p.inv_hw);
    }
}

// Entry points, one per storage type.
extern "C" __global__ void global_avg_pool_forward_f16(PoolParams p, const hr_half* __restrict__ x,
                                                       hr_half* __restrict__ y) {
    global_avg_pool_forward_k(p, x, y);
}

extern "C" __global__ void global_avg_pool_forward_f32(PoolParams p, const float* __restrict__ x,
                                                       float* __restrict__ y) {
    global_avg_pool_forward_k(p, x, y);
}

extern "C" __global__ void global_avg_pool_backward_f16(PoolParams p, const hr_half* __restrict__ g,
                                                        hr_half* __restrict__ dx) {
    global_avg_pool_backward_k(p, g, dx);
}

extern "C" __global__ void global_avg_pool_backward_f32(PoolParams p, const float* __restrict__ g,
                                                        float* __restrict__ dx) {
    global_avg_pool_backward_k(p, g, dx);
}

// ---------------------------------------------------------------------------
// Max pooling, [N, H, W, C] -> [N, OH, OW, C] over k×k windows every `stride`
// pixels, no padding (the CPU's MaxPool2d). Forward: the largest value of
// each window, the FIRST in row-major window order (ky, then kx) on ties (a
// later value replaces it only when strictly greater, as on the CPU); a
// training forward also writes its position ky·k + kx per output (u32).
// Backward gathers, per input element, the gradients of the outputs whose
// argmax it is, in row-major output order (oy, then ox), summed in f32 from
// 0: the CPU's scatter order, so f32 gives the CPU's bits.

struct MaxPoolParams {
    u32 n;
    u32 h;
    u32 w;
    u32 c;
    u32 oh;
    u32 ow;
    u32 kernel;
    u32 stride;
};
HR_CHECK_SIZE(MaxPoolParams, 32);

// One thread per output element; consecutive threads, consecutive channels.
template <typename T>
__device__ void max_pool_forward_k(MaxPoolParams p, const T* __restrict__ x, T* __restrict__ y,
                                   u32* __restrict__ argmax) {
    const u32 total = p.n * p.oh * p.ow * p.c;
    HR_FOR_EACH(i, total) {
        const u32 ch = i % p.c;
        const u32 ox = (i / p.c) % p.ow;
        const u32 oy = (i / (p.c * p.ow)) % p.oh;
        const u32 s = i / (p.c * p.ow * p.oh);
        const T* base = x + ((s * p.h + oy * p.stride) * p.w + ox * p.stride) * p.c + ch;
        float best = hr_ld(base[0]);
        u32 pos = 0;
        for (u32 ky = 0; ky < p.kernel; ++ky) {
            for (u32 kx = 0; kx < p.kernel; ++kx) {
                const float v = hr_ld(base[(ky * p.w + kx) * p.c]);
                if (v > best) {
                    best = v;
                    pos = ky * p.kernel + kx;
                }
            }
        }
        hr_st(&y[i], best);
        if (argmax != nullptr) {
            argmax[i] = pos;
        }
    }
}

// One thread per input element: the outputs whose windows hold it, in
// row-major order.
template <typename T>
__device__ void max_pool_backward_k(MaxPoolParams p, const T* __restrict__ g,
                                    const u32* __restrict__ argmax, T* __restrict__ dx) {
    const u32 total = p.n * p.h * p.w * p.c;
    HR_FOR_EACH(i, total) {
        const u32 ch = i % p.c;
        const u32 ix = (i / p.c) % p.w;
        const u32 iy = (i / (p.c * p.w)) % p.h;
        const u32 s = i / (p.c * p.w * p.h);
        // Outputs o with o·stride <= i < o·stride + kernel, within [0, out).
        const u32 oy_lo = iy + 1 > p.kernel ? (iy + 1 - p.kernel + p.stride - 1) / p.stride : 0;
        const u32 ox_lo = ix + 1 > p.kernel ? (ix + 1 - p.kernel + p.stride - 1) / p.stride : 0;
        const u32 oy_hi = min(iy / p.stride + 1, p.oh);
        const u32 ox_hi = min(ix / p.stride + 1, p.ow);
        float acc = 0.0f;
        for (u32 oy = oy_lo; oy < oy_hi; ++oy) {
            for (u32 ox = ox_lo; ox < ox_hi; ++ox) {
                const u32 o = ((s * p.oh + oy) * p.ow + ox) * p.c + ch;
                if (argmax[o] == (iy - oy * p.stride) * p.kernel + (ix - ox * p.stride)) {
                    acc += hr_ld(g[o]);
                }
            }
        }
        hr_st(&dx[i], acc);
    }
}

extern "C" __global__ void max_pool_forward_f16(MaxPoolParams p, const hr_half* __restrict__ x,
                                                hr_half* __restrict__ y) {
    max_pool_forward_k(p, x, y, nullptr);
}

extern "C" __global__ void max_pool_forward_f32(MaxPoolParams p, const float* __restrict__ x,
                                                float* __restrict__ y) {
    max_pool_forward_k(p, x, y, nullptr);
}

extern "C" __global__ void max_pool_forward_train_f16(MaxPoolParams p,
                                                      const hr_half* __restrict__ x,
                                                      hr_half* __restrict__ y,
                                                      u32* __restrict__ argmax) {
    max_pool_forward_k(p, x, y, argmax);
}

extern "C" __global__ void max_pool_forward_train_f32(MaxPoolParams p,
                                                      const float* __restrict__ x,
                                                      float* __restrict__ y,
                                                      u32* __restrict__ argmax) {
    max_pool_forward_k(p, x, y, argmax);
}

extern "C" __global__ void max_pool_backward_f16(MaxPoolParams p, const hr_half* __restrict__ g,
                                                 const u32* __restrict__ argmax,
                                                 hr_half* __restrict__ dx) {
    max_pool_backward_k(p, g, argmax, dx);
}

extern "C" __global__ void max_pool_backward_f32(MaxPoolParams p, const float* __restrict__ g,
                                                 const u32* __restrict__ argmax,
                                                 float* __restrict__ dx) {
    max_pool_backward_k(p, g, argmax, dx);
}
