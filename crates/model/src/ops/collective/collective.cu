// The data-parallel ranks' sum: out[i] = ((parts[0][i] + parts[1][i]) +
// parts[2][i]) + ..., the rows of `parts` being the ranks' copies of one
// slice in rank order (row r at r * stride). The adds are rounded one at a
// time in that order (a compiler neither reorders float adds nor contracts
// an add with no multiply), so the sum is the bits headroom_dist's CPU
// reduction gives: the same on every rank and in every run, whatever order
// the copies arrived in.
// Elementwise; `out` may not alias `parts`.
#include "common.cuh"

struct RankSumParams {
    u32 n;       // values in the slice
    u32 world;   // rows (ranks)
    u32 stride;  // values between two rows
};
HR_CHECK_SIZE(RankSumParams, 12);

extern "C" __global__ void rank_sum_f32(RankSumParams p, const float* __restrict__ parts,
                                        float* __restrict__ out) {
    HR_FOR_EACH(i, p.n) {
        float sum = parts[i];
        for (u32 r = 1; r < p.world; ++r) {
            sum = sum + parts[(u64)r * p.stride + i];
        }
        out[i] = sum;
    }
}
