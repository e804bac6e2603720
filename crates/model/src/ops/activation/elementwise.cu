// Elementwise layers and helpers, f16 or f32 storage (T) with f32 arithmetic:
// ReLU forward/backward (the CPU's Relu: NaN propagates, backward masks by the
// saved OUTPUT), the residual addition (forward y = body + x, backward
// g_in = body_grad + g, both as an in-place accumulation), and the bias of
// convolutions and linear layers over [rows, cols] (channels last): bias add
// in forward, column sums accumulated into the f32 gradient in backward.
// SiLU and GELU (tanh approximation) as `layers::smooth_activation` computes
// them: their derivative is not a function of the output, so backward reads
// the forward's INPUT and computes it again. Dropout as `layers::Dropout`
// draws it: element i is kept unless a hash of (seed, counter, i) falls
// under p, so no mask is stored; the counter lives on the device (the
// CPU's four 16-bit limbs in f32), so a captured graph draws new masks each
// replay: forward uses it and `dropout_count` advances it, backward and a
// recomputation use the one before.
#include "common.cuh"

struct EwParams {
    u32 n;
};
HR_CHECK_SIZE(EwParams, 4);

struct RowsColsParams {
    u32 rows;
    u32 cols;
};
HR_CHECK_SIZE(RowsColsParams, 8);

struct ColumnSumParams {
    u32 rows;
    u32 cols;
    u32 rows_per_chunk;
    u32 chunks;
};
HR_CHECK_SIZE(ColumnSumParams, 16);

template <typename T>
__device__ void relu_forward_k(EwParams p, const T* __restrict__ x, T* __restrict__ y) {
    HR_FOR_EACH(i, p.n) { hr_st(&y[i], hr_relu(hr_ld(x[i]))); }
}

// dx = y > 0 ? g : 0, where y is the forward's output.
template <typename T>
__device__ void relu_backward_k(EwParams p, const T* __restrict__ g, const T* __restrict__ y,
                                T* __restrict__ dx) {
    HR_FOR_EACH(i, p.n) { dx[i] = hr_ld(y[i]) > 0.0f ? g[i] : (T)0; }
}

// x·σ(x) and GELU's tanh approximation, with their derivatives, in the
// CPU layers' f32 arithmetic (expf and tanhf at full accuracy: no fast math).
enum SmoothKind { kSilu, kGelu };
constexpr float kGeluSqrt2OverPi = 0.7978846f;
constexpr float kGeluCubic = 0.044715f;

template <int Kind>
__device__ __forceinline__ float smooth_value(float x) {
    if constexpr (Kind == kSilu) {
        return x * hr_sigmoid(x);
    } else {
        const float u = kGeluSqrt2OverPi * (x + kGeluCubic * x * x * x);
        return 0.5f * x * (1.0f + tanhf(u));
    }
}

template <int Kind>
__device__ __forceinline__ float smooth_derivative(float x) {
    if constexpr (Kind == kSilu) {
        const float s = hr_sigmoid(x);
        return s * (1.0f + x * (1.0f - s));
    } else {
        const float u = kGeluSqrt2OverPi * (x + kGeluCubic * x * x * x);
        const float t = tanhf(u);
        const float du = kGeluSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
        return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
    }
}

template <int Kind, typename T>
__device__ void smooth_forward_k(EwParams p, const T* __restrict__ x, T* __restrict__ y) {
    HR_FOR_EACH(i, p.n) { hr_st(&y[i], smooth_value<Kind>(hr_ld(x[i]))); }
}

// dx = g · f'(x), where x is the forward's input.
template <int Kind, typename T>
__device__ void smooth_backward_k(EwParams p, const T* __restrict__ g, const T* __restrict__ x,
                                  T* __restrict__ dx) {
    HR_FOR_EACH(i, p.n) { hr_st(&dx[i], hr_ld(g[i]) * smooth_derivative<Kind>(hr_ld(x[i]))); }
}

struct DropoutParams {
    u32 n;
    float p;
    float scale;  // 1/(1 - p), as the CPU computes it
    u32 seed_lo;
    u32 seed_hi;
    u32 previous;  // 1: the counter's value before the last forward
};
HR_CHECK_SIZE(DropoutParams, 24);

__device__ __forceinline__ u64 hr_mix(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ u64 dropout_counter(const float* limbs, u32 previous) {
    u64 c = 0;
    for (int l = 3; l >= 0; --l) {
        c = c * 65536ull + (u64)limbs[l];
    }
    return previous && c > 0 ? c - 1 : c;
}

// y = x · (0 or 1/(1 - p)); the same for a gradient, with the same mask.
template <typename T>
__device__ void dropout_apply_k(DropoutParams p, const float* __restrict__ counter,
                                const T* __restrict__ x, T* __restrict__ y) {
    const u64 seed = ((u64)p.seed_hi << 32) | p.seed_lo;
    const u64 c = dropout_counter(counter, p.previous);
    const u64 stream = hr_mix(seed ^ hr_mix(c + 0x9E3779B97F4A7C15ull));
    HR_FOR_EACH(i, p.n) {
        const u64 bits = hr_mix(stream ^ ((u64)i * 0xD6E8FEB86659FD93ull));
        const float u = (float)(bits >> 40) / 16777216.0f;
        hr_st(&y[i], hr_ld(x[i]) * (u < p.p ? 0.0f : p.scale));
    }
}

// One thread: counter += 1, in its limbs.
extern "C" __global__ void dropout_count(DropoutParams p, float* __restrict__ counter) {
    if (blockIdx.x != 0 || threadIdx.x != 0) {
        return;
    }
    u64 c = dropout_counter(counter, 0) + 1;
    for (int l = 0; l < 4; ++l) {
        counter[l] = (float)(c % 65536ull);
        c /= 65536ull;
    }
}

// After the optimizer: the counter as before the step, if it was skipped
// (the CPU puts every buffer back then).
extern "C" __global__ void dropout_counter_restore(DropoutParams p,
                                                   const StepState* __restrict__ state,
                                                   const float* __restrict__ saved,
                                                   float* __restrict__ counter) {
    if (!state->skipped || blockIdx.x != 0 || threadIdx.x >= 4) {
        return;
    }
    counter[threadIdx.x] = saved[threadIdx.x];
}

// acc += b (residual forward: acc is the body's output, b the block input;
// residual backward: acc is the body's input gradient, b the output gradient).
template <typename T>
__device__ void add_inplace_k(EwParams p, T* __restrict__ acc, const T* __restrict__ b) {
    HR_FOR_EACH(i, p.n) { hr_st(&acc[i], hr_ld(acc[i]) + hr_ld(b[i])); }
}

// out = a + b.
template <typename T>
__device__ void add_k(EwParams p, const T* __restrict__ a, const T* __restrict__ b,
                      T* __restrict__ out) {
    HR_FOR_EACH(i, p.n) { hr_st(&out[i], hr_ld(a[i]) + hr_ld(b[i])); }
}

// y[r, c] += bias[c].
template <typename T>
__device__ void bias_add_k(RowsColsParams p, T* __restrict__ y, const T* __restrict__ bias) {
    const u32 n = p.rows * p.cols;
    HR_FOR_EACH(i, n) { hr_st(&y[i], hr_ld(y[i]) + hr_ld(bias[i % p.cols])); }
}

// Column sums of g [rows, cols] over chunks of rows_per_chunk rows, a
// block per (32 columns, chunk): with one chunk, out[c] += Σ_r g[r, c];
// with more, out[chunk, c] = the chunk's sum, and the caller sums those
// [chunks, cols] partials with this kernel again (f32, one chunk). Before
// chunks, a block per 32 columns read every row: 4 blocks for 128
// columns, each looping over rows/8 rows (4096 for 32768 tokens).
// Block (32, 8): 32 columns by 8 row lanes, added in lane order: the
// same bits every run.
template <typename T>
__device__ void bias_grad_k(ColumnSumParams p, const T* __restrict__ g, float* __restrict__ out) {
    __shared__ float partial[8][32];
    const u32 c = blockIdx.x * 32 + threadIdx.x;
    const u32 chunk = blockIdx.y;
    const u32 r0 = chunk * p.rows_per_chunk;
    const u32 r1 = min(r0 + p.rows_per_chunk, p.rows);
    float s = 0.0f;
    if (c < p.cols) {
        for (u32 r = r0 + threadIdx.y; r < r1; r += 8) {
            s += hr_ld(g[r * p.cols + c]);
        }
    }
    partial[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < p.cols) {
        float total = 0.0f;
        for (int l = 0; l < 8; ++l) {
            total += partial[l][threadIdx.x];
        }
        if (p.chunks == 1) {
            out[c] += total;
        } else {
            out[chunk * p.cols + c] = total;
        }
    }
}

// Entry points, one per storage type.
extern "C" __global__ void relu_forward_f16(EwParams p, const hr_half* __restrict__ x,
                                            hr_half* __restrict__ y) {
    relu_forward_k(p, x, y);
}

extern "C" __global__ void relu_forward_f32(EwParams p, const float* __restrict__ x,
                                            float* __restrict__ y) {
    relu_forward_k(p, x, y);
}

extern "C" __global__ void relu_backward_f16(EwParams p, const hr_half* __restrict__ g,
                                             const hr_half* __restrict__ y,
                                             hr_half* __restrict__ dx) {
    relu_backward_k(p, g, y, dx);
}

extern "C" __global__ void relu_backward_f32(EwParams p, const float* __restrict__ g,
                                             const float* __restrict__ y, float* __restrict__ dx) {
    relu_backward_k(p, g, y, dx);
}

extern "C" __global__ void silu_forward_f16(EwParams p, const hr_half* __restrict__ x,
                                            hr_half* __restrict__ y) {
    smooth_forward_k<kSilu>(p, x, y);
}

extern "C" __global__ void silu_forward_f32(EwParams p, const float* __restrict__ x,
                                            float* __restrict__ y) {
    smooth_forward_k<kSilu>(p, x, y);
}

extern "C" __global__ void silu_backward_f16(EwParams p, const hr_half* __restrict__ g,
                                             const hr_half* __restrict__ x, hr_half* __restrict__ dx) {
    smooth_backward_k<kSilu>(p, g, x, dx);
}

extern "C" __global__ void silu_backward_f32(EwParams p, const float* __restrict__ g,
                                             const float* __restrict__ x, float* __restrict__ dx) {
    smooth_backward_k<kSilu>(p, g, x, dx);
}

extern "C" __global__ void gelu_forward_f16(EwParams p, const hr_half* __restrict__ x,
                                            hr_half* __restrict__ y) {
    smooth_forward_k<kGelu>(p, x, y);
}

extern "C" __global__ void gelu_forward_f32(EwParams p, const float* __restrict__ x,
                                            float* __restrict__ y) {
    smooth_forward_k<kGelu>(p, x, y);
}

extern "C" __global__ void gelu_backward_f16(EwParams p, const hr_half* __restrict__ g,
                                             const hr_half* __restrict__ x, hr_half* __restrict__ dx) {
    smooth_backward_k<kGelu>(p, g, x, dx);
}

extern "C" __global__ void gelu_backward_f32(EwParams p, const float* __restrict__ g,
                                             const float* __restrict__ x, float* __restrict__ dx) {
    smooth_backward_k<kGelu>(p, g, x, dx);
}

extern "C" __global__ void dropout_apply_f16(DropoutParams p, const float* __restrict__ counter,
                                             const hr_half* __restrict__ x,
                                             hr_half* __restrict__ y) {
    dropout_apply_k(p, counter, x, y);
}

extern "C" __global__ void dropout_apply_f32(DropoutParams p, const float* __restrict__ counter,
                                             const float* __restrict__ x, float* __restrict__ y) {
    dropout_apply_k(p, counter, x, y);
}

extern "C" __global__ void add_inplace_f16(EwParams p, hr_half* __restrict__ acc,
                                           const hr_half* __restrict__ b) {
    add_inplace_k(p, acc, b);
}

extern "C" __global__ void add_inplace_f32(EwParams p, float* __restrict__ acc,
                                           const float* __restrict__ b) {
    add_inplace_k(p, acc, b);
}

extern "C" __global__ void add_f16(EwParams p, const hr_half* __restrict__ a,
                                   const hr_half* __restrict__ b, hr_half* __restrict__ out) {
    add_k(p, a, b, out);
}

extern "C" __global__ void add_f32(EwParams p, const float* __restrict__ a,
                                   const float* __restrict__ b, float* __restrict__ out) {
    add_k(p, a, b, out);
}

extern "C" __global__ void bias_add_f16(RowsColsParams p, hr_half* __restrict__ y,
                                        const hr_half* __restrict__ bias) {
    bias_add_k(p, y, bias);
}

extern "C" __global__ void bias_add_f32(RowsColsParams p, float* __restrict__ y,
                                        const float* __restrict__ bias) {
    bias_add_k(p, y, bias);
}

extern "C" __global__ void bias_grad_f16(ColumnSumParams p, const hr_half* __restrict__ g,
                                         float* __restrict__ grad) {
    bias_grad_k(p, g, grad);
}

extern "C" __global__ void bias_grad_f32(ColumnSumParams p, const float* __restrict__ g,
                                         float* __restrict__ grad) {
    bias_grad_k(p, g, grad);
}
