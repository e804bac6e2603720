// Elementwise layers and helpers, f16 storage with f32 arithmetic:
// ReLU forward/backward (the CPU's Relu: NaN propagates, backward masks by the
// saved OUTPUT), the residual addition (forward y = body + x, backward
// g_in = body_grad + g, both as an in-place accumulation), and the bias of
// convolutions and linear layers over [rows, cols] (channels last): bias add
// in forward, column sums accumulated into the f32 gradient in backward.
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

extern "C" __global__ void relu_forward(EwParams p, const hr_half* __restrict__ x,
                                        hr_half* __restrict__ y) {
    HR_FOR_EACH(i, p.n) { y[i] = f2h(hr_relu(h2f(x[i]))); }
}

// dx = y > 0 ? g : 0, where y is the forward's output.
extern "C" __global__ void relu_backward(EwParams p, const hr_half* __restrict__ g,
                                         const hr_half* __restrict__ y,
                                         hr_half* __restrict__ dx) {
    HR_FOR_EACH(i, p.n) { dx[i] = h2f(y[i]) > 0.0f ? g[i] : (hr_half)0; }
}

// acc += b (residual forward: acc is the body's output, b the block input;
// residual backward: acc is the body's input gradient, b the output gradient).
extern "C" __global__ void add_inplace(EwParams p, hr_half* __restrict__ acc,
                                       const hr_half* __restrict__ b) {
    HR_FOR_EACH(i, p.n) { acc[i] = f2h(h2f(acc[i]) + h2f(b[i])); }
}

// out = a + b.
extern "C" __global__ void add(EwParams p, const hr_half* __restrict__ a,
                               const hr_half* __restrict__ b, hr_half* __restrict__ out) {
    HR_FOR_EACH(i, p.n) { out[i] = f2h(h2f(a[i]) + h2f(b[i])); }
}

// y[r, c] += bias[c].
extern "C" __global__ void bias_add(RowsColsParams p, hr_half* __restrict__ y,
                                    const hr_half* __restrict__ bias) {
    const u32 n = p.rows * p.cols;
    HR_FOR_EACH(i, n) { y[i] = f2h(h2f(y[i]) + h2f(bias[i % p.cols])); }
}

// grad[c] += sum over r of g[r, c], in a fixed order (deterministic).
// Block (32, 8): 32 columns by 8 row lanes; grid.x = ceil(cols / 32).
extern "C" __global__ void bias_grad(RowsColsParams p, const hr_half* __restrict__ g,
                                     float* __restrict__ grad) {
    __shared__ float partial[8][32];
    const u32 c = blockIdx.x * 32 + threadIdx.x;
    float s = 0.0f;
    if (c < p.cols) {
        for (u32 r = threadIdx.y; r < p.rows; r += 8) {
            s += h2f(g[r * p.cols + c]);
        }
    }
    partial[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < p.cols) {
        float total = 0.0f;
        for (int l = 0; l < 8; ++l) {
            total += partial[l][threadIdx.x];
        }
        grad[c] += total;
    }
}
