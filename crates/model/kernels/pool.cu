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
extern "C" __global__ void global_avg_pool_forward(PoolParams p, const hr_half* __restrict__ x,
                                                   hr_half* __restrict__ y) {
    const u32 total = p.n * p.c;
    HR_FOR_EACH(i, total) {
        const u32 s = i / p.c;
        const u32 ch = i % p.c;
        const hr_half* base = x + s * p.hw * p.c + ch;
        float acc = 0.0f;
        for (u32 q = 0; q < p.hw; ++q) {
            acc += h2f(base[q * p.c]);
        }
        y[i] = f2h(acc * p.inv_hw);
    }
}

extern "C" __global__ void global_avg_pool_backward(PoolParams p, const hr_half* __restrict__ g,
                                                    hr_half* __restrict__ dx) {
    const u32 total = p.n * p.hw * p.c;
    HR_FOR_EACH(i, total) {
        const u32 s = i / (p.hw * p.c);
        const u32 ch = i % p.c;
        dx[i] = f2h(h2f(g[s * p.c + ch]) * p.inv_hw);
    }
}
