// Frame models (layers::ConvLstm, loss::pixel_mse) on the GPU. A batch of
// frame sequences [N, F, H, W, C] is stored as images [N·F, H, W, C] (frame
// f of sample s at image s·F + f), so the per-frame layers (convolution,
// batch norm, upsampling, the UNet skip) are the image path's own; these
// kernels are the ConvLSTM's steps and the loss. f16 or f32 storage (T),
// f32 arithmetic, grid-stride loops, no atomics.
//
// A ConvLSTM step's gates are one convolution of [x_t, h_{t-1}] side by
// side along channels (the image path's conv2d), gates i, f, g, o:
//   frames_step_concat      [x_t, h_{t-1}] of every sample, [N, H, W, C+Hc]
//                           (h_{-1} = 0), from the layer's input and output
//   conv_lstm_cell_forward  the activated gates and cell state (kept in f32
//                           for every step) and h_t into the output
//   conv_lstm_cell_forward_cells
//                           the same keeping the cell state only (per-step
//                           recompute: backward reruns the step's gates)
//   conv_lstm_cell_backward dh = g + dh_next: the pre-activation gradients
//                           [N, H, W, 4·Hc] (T, for the convolution's
//                           backward) and dc carried to the step before
//   conv_lstm_cell_backward_rerun
//                           the same from the step's recomputed
//                           pre-activations [N, H, W, 4·Hc] (T) instead of
//                           the kept gates: the same values, so the same bits
//   frames_step_split       the convolution's input gradient into dx_t and
//                           dh_next (f32) for the step before
// pixel_mse: a warp per frame, the mean of (y − t/255)² over its pixels
// and the gradient 2·(y − t/255)/pixels·scale, with the loss kernels'
// per-row loss and correct count (0: a regression counts none).
#include "common.cuh"

struct FramesParams {
    u32 n;
    u32 frames;
    u32 step;
    u32 pixels;
    u32 channels;
    u32 hidden;
};
HR_CHECK_SIZE(FramesParams, 24);

struct MseParams {
    u32 rows;
    u32 cols;
    float share;
};
HR_CHECK_SIZE(MseParams, 12);

#define GRID_STRIDE(i, total) \
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < (total); i += gridDim.x * blockDim.x)

template <typename T>
__device__ void frames_step_concat_k(FramesParams p, const T* __restrict__ x,
                                     const T* __restrict__ hs, T* __restrict__ xh) {
    const u32 width = p.channels + p.hidden;
    GRID_STRIDE(i, p.n * p.pixels * width) {
        const u32 ch = i % width;
        const u32 pix = i / width;
        const u32 s = pix / p.pixels;
        const u32 q = pix - s * p.pixels;
        float v = 0.0f;
        if (ch < p.channels) {
            v = hr_ld(x[((s * p.frames + p.step) * p.pixels + q) * p.channels + ch]);
        } else if (p.step > 0) {
            v = hr_ld(hs[((s * p.frames + p.step - 1u) * p.pixels + q) * p.hidden + ch - p.channels]);
        }
        hr_st(&xh[i], v);
    }
}

template <typename T>
__device__ void frames_step_split_k(FramesParams p, const T* __restrict__ dxh,
                                    T* __restrict__ dx, float* __restrict__ dh_next) {
    const u32 width = p.channels + p.hidden;
    GRID_STRIDE(i, p.n * p.pixels * width) {
        const u32 ch = i % width;
        const u32 pix = i / width;
        const u32 s = pix / p.pixels;
        const u32 q = pix - s * p.pixels;
        if (ch < p.channels) {
            dx[((s * p.frames + p.step) * p.pixels + q) * p.channels + ch] = dxh[i];
        } else {
            dh_next[pix * p.hidden + ch - p.channels] = hr_ld(dxh[i]);
        }
    }
}

// KEEP_GATES: write every step's activated gates for backward; without
// it only the cell state is kept and backward reruns the gates.
template <typename T, bool KEEP_GATES>
__device__ void conv_lstm_cell_forward_k(FramesParams p, const T* __restrict__ pre,
                                         float* __restrict__ gates, float* __restrict__ cells,
                                         T* __restrict__ hs) {
    const u32 hc = p.hidden;
    GRID_STRIDE(i, p.n * p.pixels * hc) {
        const u32 j = i % hc;
        const u32 pix = i / hc;
        const u32 s = pix / p.pixels;
        const u32 q = pix - s * p.pixels;
        const u32 at = (s * p.frames + p.step) * p.pixels + q;
        const T* pr = pre + pix * 4u * hc;
        float in[4];
        for (u32 k = 0; k < 4; ++k) {
            in[k] = hr_ld(pr[k * hc + j]);
        }
        const float c_prev = p.step > 0 ? cells[(at - p.pixels) * hc + j] : 0.0f;
        float act[4];
        const float c = hr_lstm_step(in, c_prev, act);
        if (KEEP_GATES) {
            float* gate = gates + at * 4u * hc;
            for (u32 k = 0; k < 4; ++k) {
                gate[k * hc + j] = act[k];
            }
        }
        cells[at * hc + j] = c;
        hr_st(&hs[at * hc + j], act[3] * tanhf(c));
    }
}

// One unit's backward at step p.step (index i of the step's n·h·w·hidden,
// `at` its row among every step's) from its activated gates.
template <typename T>
__device__ __forceinline__ void conv_lstm_unit_backward(
        FramesParams p, u32 i, u32 at, const float act[4], const float* __restrict__ cells,
        const T* __restrict__ g, const float* __restrict__ dh_next,
        float* __restrict__ dc_carry, T* __restrict__ d_pre) {
    const u32 hc = p.hidden;
    const u32 j = i % hc;
    const u32 pix = i / hc;
    const float c_prev = p.step > 0 ? cells[(at - p.pixels) * hc + j] : 0.0f;
    const float dh = hr_ld(g[at * hc + j]) + dh_next[i];
    float d[4];
    dc_carry[i] = hr_lstm_step_backward(act, cells[at * hc + j], c_prev, dh, dc_carry[i], d);
    T* out = d_pre + pix * 4u * hc;
    for (u32 k = 0; k < 4; ++k) {
        hr_st(&out[k * hc + j], d[k]);
    }
}

__device__ __forceinline__ u32 conv_lstm_row(FramesParams p, u32 pix) {
    const u32 s = pix / p.pixels;
    return (s * p.frames + p.step) * p.pixels + (pix - s * p.pixels);
}

template <typename T>
__device__ void conv_lstm_cell_backward_k(FramesParams p, const float* __restrict__ gates,
                                          const float* __restrict__ cells,
                                          const T* __restrict__ g,
                                          const float* __restrict__ dh_next,
                                          float* __restrict__ dc_carry, T* __restrict__ d_pre) {
    const u32 hc = p.hidden;
    GRID_STRIDE(i, p.n * p.pixels * hc) {
        const u32 j = i % hc;
        const u32 at = conv_lstm_row(p, i / hc);
        const float* gate = gates + at * 4u * hc;
        const float act[4] = {gate[j], gate[hc + j], gate[2u * hc + j], gate[3u * hc + j]};
        conv_lstm_unit_backward<T>(p, i, at, act, cells, g, dh_next, dc_carry, d_pre);
    }
}

// `pre` is the step's pre-activations [n, h, w, 4·hidden], computed again.
template <typename T>
__device__ void conv_lstm_cell_backward_rerun_k(FramesParams p, const T* __restrict__ pre,
                                                const float* __restrict__ cells,
                                                const T* __restrict__ g,
                                                const float* __restrict__ dh_next,
                                                float* __restrict__ dc_carry,
                                                T* __restrict__ d_pre) {
    const u32 hc = p.hidden;
    GRID_STRIDE(i, p.n * p.pixels * hc) {
        const u32 j = i % hc;
        const u32 pix = i / hc;
        const T* pr = pre + pix * 4u * hc;
        float in[4];
        for (u32 k = 0; k < 4; ++k) {
            in[k] = hr_ld(pr[k * hc + j]);
        }
        float act[4];
        hr_lstm_gates(in, act);
        conv_lstm_unit_backward<T>(p, i, conv_lstm_row(p, pix), act, cells, g, dh_next,
                                   dc_carry, d_pre);
    }
}

// A warp per row (frame), block (32, 8).
template <typename T>
__device__ void pixel_mse_k(MseParams p, const T* __restrict__ y, const unsigned char* __restrict__ target,
                            const float* __restrict__ loss_scale, T* __restrict__ grad,
                            float* __restrict__ row_loss, u32* __restrict__ row_correct) {
    const u32 row = blockIdx.x * 8u + threadIdx.y;
    if (row >= p.rows) {
        return;
    }
    const float scale = 2.0f / ((float)p.rows * (float)p.cols) * loss_scale[0] * p.share;
    float sum = 0.0f;
    for (u32 k = threadIdx.x; k < p.cols; k += 32) {
        const u32 i = row * p.cols + k;
        const float d = hr_ld(y[i]) - (float)target[i] / 255.0f;
        sum += d * d;
        hr_st(&grad[i], scale * d);
    }
    sum = warp_sum(sum);
    if (threadIdx.x == 0) {
        row_loss[row] = sum / (float)p.cols;
        row_correct[row] = 0;
    }
}

// Entry points, one per storage type (written out: the emulator's build
// finds them by their text).
extern "C" __global__ void frames_step_concat_f16(
        FramesParams p, const hr_half* __restrict__ x, const hr_half* __restrict__ hs,
        hr_half* __restrict__ xh) {
    frames_step_concat_k<hr_half>(p, x, hs, xh);
}

extern "C" __global__ void frames_step_concat_f32(
        FramesParams p, const float* __restrict__ x, const float* __restrict__ hs,
        float* __restrict__ xh) {
    frames_step_concat_k<float>(p, x, hs, xh);
}

extern "C" __global__ void frames_step_split_f16(
        FramesParams p, const hr_half* __restrict__ dxh, hr_half* __restrict__ dx,
        float* __restrict__ dh_next) {
    frames_step_split_k<hr_half>(p, dxh, dx, dh_next);
}

extern "C" __global__ void frames_step_split_f32(
        FramesParams p, const float* __restrict__ dxh, float* __restrict__ dx,
        float* __restrict__ dh_next) {
    frames_step_split_k<float>(p, dxh, dx, dh_next);
}

extern "C" __global__ void conv_lstm_cell_forward_f16(
        FramesParams p, const hr_half* __restrict__ pre, float* __restrict__ gates,
        float* __restrict__ cells, hr_half* __restrict__ hs) {
    conv_lstm_cell_forward_k<hr_half, true>(p, pre, gates, cells, hs);
}

extern "C" __global__ void conv_lstm_cell_forward_f32(
        FramesParams p, const float* __restrict__ pre, float* __restrict__ gates,
        float* __restrict__ cells, float* __restrict__ hs) {
    conv_lstm_cell_forward_k<float, true>(p, pre, gates, cells, hs);
}

extern "C" __global__ void conv_lstm_cell_forward_cells_f16(
        FramesParams p, const hr_half* __restrict__ pre, float* __restrict__ cells,
        hr_half* __restrict__ hs) {
    conv_lstm_cell_forward_k<hr_half, false>(p, pre, nullptr, cells, hs);
}

extern "C" __global__ void conv_lstm_cell_forward_cells_f32(
        FramesParams p, const float* __restrict__ pre, float* __restrict__ cells,
        float* __restrict__ hs) {
    conv_lstm_cell_forward_k<float, false>(p, pre, nullptr, cells, hs);
}

extern "C" __global__ void conv_lstm_cell_backward_f16(
        FramesParams p, const float* __restrict__ gates, const float* __restrict__ cells,
        const hr_half* __restrict__ g, const float* __restrict__ dh_next,
        float* __restrict__ dc_carry, hr_half* __restrict__ d_pre) {
    conv_lstm_cell_backward_k<hr_half>(p, gates, cells, g, dh_next, dc_carry, d_pre);
}

extern "C" __global__ void conv_lstm_cell_backward_f32(
        FramesParams p, const float* __restrict__ gates, const float* __restrict__ cells,
        const float* __restrict__ g, const float* __restrict__ dh_next,
        float* __restrict__ dc_carry, float* __restrict__ d_pre) {
    conv_lstm_cell_backward_k<float>(p, gates, cells, g, dh_next, dc_carry, d_pre);
}

extern "C" __global__ void conv_lstm_cell_backward_rerun_f16(
        FramesParams p, const hr_half* __restrict__ pre, const float* __restrict__ cells,
        const hr_half* __restrict__ g, const float* __restrict__ dh_next,
        float* __restrict__ dc_carry, hr_half* __restrict__ d_pre) {
    conv_lstm_cell_backward_rerun_k<hr_half>(p, pre, cells, g, dh_next, dc_carry, d_pre);
}

extern "C" __global__ void conv_lstm_cell_backward_rerun_f32(
        FramesParams p, const float* __restrict__ pre, const float* __restrict__ cells,
        const float* __restrict__ g, const float* __restrict__ dh_next,
        float* __restrict__ dc_carry, float* __restrict__ d_pre) {
    conv_lstm_cell_backward_rerun_k<float>(p, pre, cells, g, dh_next, dc_carry, d_pre);
}

extern "C" __global__ void pixel_mse_f16(
        MseParams p, const hr_half* __restrict__ y, const unsigned char* __restrict__ target,
        const float* __restrict__ loss_scale, hr_half* __restrict__ grad,
        float* __restrict__ row_loss, u32* __restrict__ row_correct) {
    pixel_mse_k<hr_half>(p, y, target, loss_scale, grad, row_loss, row_correct);
}

extern "C" __global__ void pixel_mse_f32(
        MseParams p, const float* __restrict__ y, const unsigned char* __restrict__ target,
        const float* __restrict__ loss_scale, float* __restrict__ grad,
        float* __restrict__ row_loss, u32* __restrict__ row_correct) {
    pixel_mse_k<float>(p, y, target, loss_scale, grad, row_loss, row_correct);
}
