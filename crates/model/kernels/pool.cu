// Global average pooling, [N, H, W, C] -> [N, C] (the CPU's GlobalAvgPool):
// forward sums the H*W rows of each (sample, channel) in f32 and multiplies
// by 1/(H*W); backward spreads g[n, c] * 1/(H*W) over the H*W positions.
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
