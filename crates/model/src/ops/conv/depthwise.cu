// Depthwise convolution, NHWC (the CPU's DepthwiseConv2d): x [N, H, W, C],
// weight [K, K, C·M] (output channel o = c·M + m reads input channel o / M),
// optional bias [C·M], y [N, OH, OW, C·M], zero padding. Every sum starts at
// 0 and accumulates with fmaf in the CPU layer's order (f32::mul_add there),
// so f32 gives the CPU's bits:
// - forward: taps (ky, then kx) inside the image, then + bias;
// - input gradient: per input pixel, the taps (ky, then kx) that reach it
//   from an output pixel, then the channel's M outputs in order;
// - weight gradient: a partial per (image, tap or bias slot, channel) over
//   the output pixels in row-major order (depthwise_wgrad_partial), then the
//   partials summed in image order and added to the f32 gradient
//   (depthwise_wgrad_reduce). Split by shape, never by thread.
#include "common.cuh"

struct DepthwiseParams {
    u32 n;
    u32 h;
    u32 w;
    u32 c;
    u32 m;
    u32 oh;
    u32 ow;
    u32 kernel;
    u32 stride;
    u32 pad;
    // 1 if there is a bias (forward: add it; partials: one more slot).
    u32 bias;
};
HR_CHECK_SIZE(DepthwiseParams, 44);

struct DepthwiseReduceParams {
    u32 images;
    // Elements to reduce, where they start in an image's partials, and an
    // image's partials' length.
    u32 len;
    u32 offset;
    u32 row;
};
HR_CHECK_SIZE(DepthwiseReduceParams, 16);

// One thread per output element.
template <typename T>
__device__ void depthwise_forward_k(DepthwiseParams p, const T* __restrict__ x,
                                    const T* __restrict__ w, const T* __restrict__ bias,
                                    T* __restrict__ y) {
    const u32 cout = p.c * p.m;
    const u32 total = p.n * p.oh * p.ow * cout;
    HR_FOR_EACH(i, total) {
        const u32 o = i % cout;
        const u32 ox = (i / cout) % p.ow;
        const u32 oy = (i / (cout * p.ow)) % p.oh;
        const u32 s = i / (cout * p.ow * p.oh);
        const u32 ci = o / p.m;
        float acc = 0.0f;
        for (u32 ky = 0; ky < p.kernel; ++ky) {
            const u32 iy = oy * p.stride + ky;
            if (iy < p.pad || iy - p.pad >= p.h) {
                continue;
            }
            for (u32 kx = 0; kx < p.kernel; ++kx) {
                const u32 ix = ox * p.stride + kx;
                if (ix < p.pad || ix - p.pad >= p.w) {
                    continue;
                }
                const float xv = hr_ld(x[((s * p.h + iy - p.pad) * p.w + ix - p.pad) * p.c + ci]);
                acc = fmaf(xv, hr_ld(w[(ky * p.kernel + kx) * cout + o]), acc);
            }
        }
        if (p.bias != 0) {
            acc = acc + hr_ld(bias[o]);
        }
        hr_st(&y[i], acc);
    }
}

// One thread per input element: a gather over the outputs whose taps
// reach it.
template <typename T>
__device__ void depthwise_backward_input_k(DepthwiseParams p, const T* __restrict__ g,
                                           const T* __restrict__ w, T* __restrict__ dx) {
    const u32 cout = p.c * p.m;
    const u32 total = p.n * p.h * p.w * p.c;
    HR_FOR_EACH(i, total) {
        const u32 ci = i % p.c;
        const u32 ix = (i / p.c) % p.w;
        const u32 iy = (i / (p.c * p.w)) % p.h;
        const u32 s = i / (p.c * p.w * p.h);
        float acc = 0.0f;
        for (u32 ky = 0; ky < p.kernel; ++ky) {
            if (iy + p.pad < ky) {
                continue;
            }
            const u32 ty = iy + p.pad - ky;
            if (ty % p.stride != 0 || ty / p.stride >= p.oh) {
                continue;
            }
            const u32 oy = ty / p.stride;
            for (u32 kx = 0; kx < p.kernel; ++kx) {
                if (ix + p.pad < kx) {
                    continue;
                }
                const u32 tx = ix + p.pad - kx;
                if (tx % p.stride != 0 || tx / p.stride >= p.ow) {
                    continue;
                }
                const u32 ox = tx / p.stride;
                for (u32 mi = 0; mi < p.m; ++mi) {
                    const u32 o = ci * p.m + mi;
                    const float gv = hr_ld(g[((s * p.oh + oy) * p.ow + ox) * cout + o]);
                    acc = fmaf(gv, hr_ld(w[(ky * p.kernel + kx) * cout + o]), acc);
                }
            }
        }
        hr_st(&dx[i], acc);
    }
}

// One thread per (image, slot, output channel): slot < K·K a tap's
// partial Σ x·g, slot K·K (with a bias) Σ g, over the image's output
// pixels in row-major order. partial [n, K·K + bias, C·M] f32.
template <typename T>
__device__ void depthwise_wgrad_partial_k(DepthwiseParams p, const T* __restrict__ x,
                                          const T* __restrict__ g,
                                          float* __restrict__ partial) {
    const u32 cout = p.c * p.m;
    const u32 kk = p.kernel * p.kernel;
    const u32 slots = kk + p.bias;
    const u32 total = p.n * slots * cout;
    HR_FOR_EACH(i, total) {
        const u32 o = i % cout;
        const u32 slot = (i / cout) % slots;
        const u32 s = i / (cout * slots);
        const u32 ci = o / p.m;
        const u32 ky = slot / p.kernel;
        const u32 kx = slot % p.kernel;
        const T* gs = g + s * p.oh * p.ow * cout + o;
        float acc = 0.0f;
        for (u32 oy = 0; oy < p.oh; ++oy) {
            const u32 iy = oy * p.stride + ky;
            const bool row_in = slot < kk && iy >= p.pad && iy - p.pad < p.h;
            for (u32 ox = 0; ox < p.ow; ++ox) {
                const float gv = hr_ld(gs[(oy * p.ow + ox) * cout]);
                if (slot == kk) {
                    acc = acc + gv;
                    continue;
                }
                const u32 ix = ox * p.stride + kx;
                if (!row_in || ix < p.pad || ix - p.pad >= p.w) {
                    continue;
                }
                const float xv = hr_ld(x[((s * p.h + iy - p.pad) * p.w + ix - p.pad) * p.c + ci]);
                acc = fmaf(xv, gv, acc);
            }
        }
        partial[i] = acc;
    }
}

// grad[j] += Σ over images, in order, of partial[image·row + offset + j].
extern "C" __global__ void depthwise_wgrad_reduce(DepthwiseReduceParams p,
                                                  const float* __restrict__ partial,
                                                  float* __restrict__ grad) {
    HR_FOR_EACH(j, p.len) {
        float acc = 0.0f;
        for (u32 s = 0; s < p.images; ++s) {
            acc = acc + partial[s * p.row + p.offset + j];
        }
        grad[j] = grad[j] + acc;
    }
}

// Entry points, one per storage type.
extern "C" __global__ void depthwise_forward_f16(DepthwiseParams p, const hr_half* __restrict__ x,
                                                 const hr_half* __restrict__ w,
                                                 const hr_half* __restrict__ bias,
                                                 hr_half* __restrict__ y) {
    depthwise_forward_k(p, x, w, bias, y);
}

extern "C" __global__ void depthwise_forward_f32(DepthwiseParams p, const float* __restrict__ x,
                                                 const float* __restrict__ w,
                                                 const float* __restrict__ bias,
                                                 float* __restrict__ y) {
    depthwise_forward_k(p, x, w, bias, y);
}

extern "C" __global__ void depthwise_backward_input_f16(DepthwiseParams p,
                                                        const hr_half* __restrict__ g,
                                                        const hr_half* __restrict__ w,
                                                        hr_half* __restrict__ dx) {
    depthwise_backward_input_k(p, g, w, dx);
}

extern "C" __global__ void depthwise_backward_input_f32(DepthwiseParams p,
                                                        const float* __restrict__ g,
                                                        const float* __restrict__ w,
                                                        float* __restrict__ dx) {
    depthwise_backward_input_k(p, g, w, dx);
}

extern "C" __global__ void depthwise_wgrad_partial_f16(DepthwiseParams p,
                                                       const hr_half* __restrict__ x,
                                                       const hr_half* __restrict__ g,
                                                       float* __restrict__ partial) {
    depthwise_wgrad_partial_k(p, x, g, partial);
}

extern "C" __global__ void depthwise_wgrad_partial_f32(DepthwiseParams p,
                                                       const float* __restrict__ x,
                                                       const float* __restrict__ g,
                                                       float* __restrict__ partial) {
    depthwise_wgrad_partial_k(p, x, g, partial);
}
