// Layer normalisation over the last axis (layers::LayerNorm), seen as
// [rows, cols] with cols = features: y = (x - mean)·rstd·γ + β per row,
// rstd = 1/sqrt(var + eps) with the biased variance. f16 or f32 storage (T),
// f32 arithmetic; γ and β are the f32 masters.
//
//   layer_norm_forward        a warp per row: the mean, then the variance
//                             from (x - mean)² (a second pass over the row
//                             rather than E[x²] - mean², which cancels), y,
//                             and [mean, rstd] of the row kept for backward
//   layer_norm_backward       a warp per row, with x̂ = (x - mean)·rstd and
//                             d = g·γ: dx = rstd·(d - mean(d) - x̂·mean(d·x̂))
//   layer_norm_grad_partial   Σ g·x̂ and Σ g of each column over chunks of
//                             rows, as batchnorm.cu's partial kernels
//   layer_norm_grad_finalize  each column's chunks added in a fixed order
//                             (8 lanes, every 8th chunk, then lane 0 in
//                             order), accumulated (+=) into dγ and dβ
// No atomics: the same bits every run.
//
// Block (32, 8) throughout: the row kernels give each of the 8 warps a row
// (grid ceil(rows/8)); the column kernels 32 columns by 8 row lanes.
#include "common.cuh"

struct LnParams {
    u32 rows;
    u32 cols;
    u32 rows_per_chunk;
    u32 chunks;
    float eps;
};
HR_CHECK_SIZE(LnParams, 20);

#define LN_LANES 8

template <typename T>
__device__ void layer_norm_forward_k(LnParams p, const T* __restrict__ x,
                                     const float* __restrict__ gamma,
                                     const float* __restrict__ beta, T* __restrict__ y,
                                     float* __restrict__ stats) {
    const u32 row = blockIdx.x * LN_LANES + threadIdx.y;
    // Whole warps leave together: warp_sum needs all 32 lanes.
    if (row >= p.rows) {
        return;
    }
    const T* xr = x + row * p.cols;
    float sum = 0.0f;
    for (u32 j = threadIdx.x; j < p.cols; j += 32) {
        sum += hr_ld(xr[j]);
    }
    const float mean = warp_sum(sum) / (float)p.cols;
    float sq = 0.0f;
    for (u32 j = threadIdx.x; j < p.cols; j += 32) {
        const float d = hr_ld(xr[j]) - mean;
        sq += d * d;
    }
    const float var = warp_sum(sq) / (float)p.cols;
    const float rstd = 1.0f / sqrtf(var + p.eps);
    T* yr = y + row * p.cols;
    for (u32 j = threadIdx.x; j < p.cols; j += 32) {
        hr_st(&yr[j], (hr_ld(xr[j]) - mean) * rstd * gamma[j] + beta[j]);
    }
    if (threadIdx.x == 0) {
        stats[2 * row] = mean;
        stats[2 * row + 1] = rstd;
    }
}

template <typename T>
__device__ void layer_norm_backward_k(LnParams p, const T* __restrict__ g,
                                      const T* __restrict__ x, const float* __restrict__ gamma,
                                      const float* __restrict__ stats, T* __restrict__ dx) {
    const u32 row = blockIdx.x * LN_LANES + threadIdx.y;
    if (row >= p.rows) {
        return;
    }
    const T* gr = g + row * p.cols;
    const T* xr = x + row * p.cols;
    const float mean = stats[2 * row];
    const float rstd = stats[2 * row + 1];
    float sum_d = 0.0f, sum_dx = 0.0f;
    for (u32 j = threadIdx.x; j < p.cols; j += 32) {
        const float d = hr_ld(gr[j]) * gamma[j];
        sum_d += d;
        sum_dx += d * ((hr_ld(xr[j]) - mean) * rstd);
    }
    const float mean_d = warp_sum(sum_d) / (float)p.cols;
    const float mean_dx = warp_sum(sum_dx) / (float)p.cols;
    T* out = dx + row * p.cols;
    for (u32 j = threadIdx.x; j < p.cols; j += 32) {
        const float d = hr_ld(gr[j]) * gamma[j];
        const float x_hat = (hr_ld(xr[j]) - mean) * rstd;
        hr_st(&out[j], rstd * (d - mean_d - x_hat * mean_dx));
    }
}

// part_gamma/part_beta [chunks, cols]: Σ g·x̂ and Σ g over the chunk's rows.
template <typename T>
__device__ void layer_norm_grad_partial_k(LnParams p, const T* __restrict__ g,
                                          const T* __restrict__ x,
                                          const float* __restrict__ stats,
                                          float* __restrict__ part_gamma,
                                          float* __restrict__ part_beta) {
    __shared__ float s_gamma[LN_LANES][32];
    __shared__ float s_beta[LN_LANES][32];
    const u32 c = blockIdx.x * 32 + threadIdx.x;
    const u32 chunk = blockIdx.y;
    const u32 r0 = chunk * p.rows_per_chunk;
    const u32 r1 = min(r0 + p.rows_per_chunk, p.rows);
    float dg = 0.0f, db = 0.0f;
    if (c < p.cols) {
        for (u32 r = r0 + threadIdx.y; r < r1; r += LN_LANES) {
            const float gv = hr_ld(g[r * p.cols + c]);
            const float x_hat = (hr_ld(x[r * p.cols + c]) - stats[2 * r]) * stats[2 * r + 1];
            dg += gv * x_hat;
            db += gv;
        }
    }
    s_gamma[threadIdx.y][threadIdx.x] = dg;
    s_beta[threadIdx.y][threadIdx.x] = db;
    __syncthreads();
    if (threadIdx.y == 0 && c < p.cols) {
        for (int l = 1; l < LN_LANES; ++l) {
            dg += s_gamma[l][threadIdx.x];
            db += s_beta[l][threadIdx.x];
        }
        part_gamma[chunk * p.cols + c] = dg;
        part_beta[chunk * p.cols + c] = db;
    }
}

extern "C" __global__ void layer_norm_grad_finalize(LnParams p,
                                                    const float* __restrict__ part_gamma,
                                                    const float* __restrict__ part_beta,
                                                    float* __restrict__ dgamma,
                                                    float* __restrict__ dbeta) {
    __shared__ float s_gamma[LN_LANES][32];
    __shared__ float s_beta[LN_LANES][32];
    const u32 c = blockIdx.x * 32 + threadIdx.x;
    float dg = 0.0f, db = 0.0f;
    if (c < p.cols) {
        for (u32 k = threadIdx.y; k < p.chunks; k += LN_LANES) {
            dg += part_gamma[k * p.cols + c];
            db += part_beta[k * p.cols + c];
        }
    }
    s_gamma[threadIdx.y][threadIdx.x] = dg;
    s_beta[threadIdx.y][threadIdx.x] = db;
    __syncthreads();
    if (threadIdx.y == 0 && c < p.cols) {
        for (int l = 1; l < LN_LANES; ++l) {
            dg += s_gamma[l][threadIdx.x];
            db += s_beta[l][threadIdx.x];
        }
        dgamma[c] += dg;
        dbeta[c] += db;
    }
}

// Entry points, one per storage type.
extern "C" __global__ void layer_norm_forward_f16(LnParams p, const hr_half* __restrict__ x,
                                                  const float* __restrict__ gamma,
                                                  const float* __restrict__ beta,
                                                  hr_half* __restrict__ y,
                                                  float* __restrict__ stats) {
    layer_norm_forward_k(p, x, gamma, beta, y, stats);
}

extern "C" __global__ void layer_norm_forward_f32(LnParams p, const float* __restrict__ x,
                                                  const float* __restrict__ gamma,
                                                  const float* __restrict__ beta,
                                                  float* __restrict__ y,
                                                  float* __restrict__ stats) {
    layer_norm_forward_k(p, x, gamma, beta, y, stats);
}

extern "C" __global__ void layer_norm_backward_f16(LnParams p, const hr_half* __restrict__ g,
                                                   const hr_half* __restrict__ x,
                                                   const float* __restrict__ gamma,
                                                   const float* __restrict__ stats,
                                                   hr_half* __restrict__ dx) {
    layer_norm_backward_k(p, g, x, gamma, stats, dx);
}

extern "C" __global__ void layer_norm_backward_f32(LnParams p, const float* __restrict__ g,
                                                   const float* __restrict__ x,
                                                   const float* __restrict__ gamma,
                                                   const float* __restrict__ stats,
                                                   float* __restrict__ dx) {
    layer_norm_backward_k(p, g, x, gamma, stats, dx);
}

extern "C" __global__ void layer_norm_grad_partial_f16(LnParams p, const hr_half* __restrict__ g,
                                                       const hr_half* __restrict__ x,
                                                       const float* __restrict__ stats,
                                                       float* __restrict__ part_gamma,
                                                       float* __restrict__ part_beta) {
    layer_norm_grad_partial_k(p, g, x, stats, part_gamma, part_beta);
}

extern "C" __global__ void layer_norm_grad_partial_f32(LnParams p, const float* __restrict__ g,
                                                       const float* __restrict__ x,
                                                       const float* __restrict__ stats,
                                                       float* __restrict__ part_gamma,
                                                       float* __restrict__ part_beta) {
    layer_norm_grad_partial_k(p, g, x, stats, part_gamma, part_beta);
}
