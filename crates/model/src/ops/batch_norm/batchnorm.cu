// Batch normalisation over N, H and W of each channel of an NHWC batch, seen
// as [rows, channels] with rows = N*H*W: the CPU's BatchNorm2d (biased
// variance for normalising, unbiased for running_var, PyTorch's momentum
// rule), with an optional fused ReLU, or (closing a residual block) the
// addition of the block's input and then the ReLU.
//
// Training forward:
//   bn_stats_partial   Welford (count, mean, M2) per channel over fixed
//                      chunks of rows, f32 -> part_mean/part_m2 [chunks, C]
//   bn_stats_finalize  per channel, 32 lanes sum the chunks (f64, in a fixed
//                      order): the mean from the chunks' sums, then M2 from
//                      each chunk's M2 and its mean's distance to the
//                      mean; then inv_std, the affine
//                      scale = gamma*inv_std and shift = beta - mean*scale,
//                      and the running statistics (unless recomputing)
//   bn_apply           y = x*scale + shift (then ReLU if fused)
//   bn_apply_add       y = relu(T(x*scale + shift) + skip): a residual
//                      block's last batch norm, its sum and the ReLU after it
// After the optimizer: bn_running_restore puts back the running statistics
// saved before the step when the step was skipped (StepState::skipped).
// Eval forward: bn_eval_prepare (scale/shift from the running statistics),
// then bn_apply or bn_apply_add.
// Backward (g is dL/dy; with the fused ReLU, g' = y > 0 ? g : 0, where
// y > 0 is decided from x, scale and shift as bn_apply computed y
// (bn_relu_passed: y itself is not read), or, after bn_apply_add, from the
// block's saved output; without it g' = g):
//   bn_backward_partial   sum g' and sum g'*(x - mean) per channel and chunk
//   bn_backward_partial_mask  the same, and g' written over g (after
//                         bn_apply_add: g' is also the gradient of the skip
//                         input, and the rest reads it with relu = 0)
//   bn_backward_finalize  dgamma = inv_std*sum g'(x-mean), dbeta = sum g',
//                         accumulated (+=) into the f32 gradients, and the
//                         coefficients of dx = k*g' + b*(x - mean) + d
//   bn_backward_apply     dx
// Chunk boundaries depend only on the shape and every merge runs in a fixed
// order, so results are deterministic run to run.
//
// Chunks: at most 256 (ops.rs's bn_chunking), so that the finalize kernels
// read little. The scalar partial kernels run with block (32, 8): 32
// consecutive channels by 8 row lanes; grid (ceil(C/32), chunks); the _v8
// ones (f16, C % 8 == 0) 8 channels a thread (below). The finalize kernels
// run 8 channels by 32 lanes, grid ceil(C/8): the lanes of a channel take
// every 32nd chunk, then lane 0 adds them in order. (With 8 lanes and 1568
// chunks, each lane's chain of dependent loads made the forward's finalize
// 43 us, ahead of the partial pass itself, on an H100.)
#include "common.cuh"

struct BnDims {
    u32 rows;
    u32 channels;
    u32 rows_per_chunk;
    u32 chunks;
};
HR_CHECK_SIZE(BnDims, 16);

struct BnFinalizeParams {
    u32 rows;
    u32 channels;
    u32 rows_per_chunk;
    u32 chunks;
    float eps;
    float momentum;
    u32 update_running;
};
HR_CHECK_SIZE(BnFinalizeParams, 28);

struct BnEvalParams {
    u32 channels;
    float eps;
};
HR_CHECK_SIZE(BnEvalParams, 8);

// by_channels: the channel of a flat NHWC index without a division
// instruction (hr_div), in the kernels that touch every element.
struct BnApplyParams {
    u32 rows;
    u32 channels;
    u32 relu;
    FastDiv by_channels;
};
HR_CHECK_SIZE(BnApplyParams, 20);

struct BnBackwardParams {
    u32 rows;
    u32 channels;
    u32 rows_per_chunk;
    u32 chunks;
    u32 relu;
    FastDiv by_channels;
};
HR_CHECK_SIZE(BnBackwardParams, 28);

__device__ __forceinline__ u32 bn_channel(FastDiv by_channels, u32 channels, u32 i) {
    return i - hr_div(by_channels, i) * channels;
}

#define BN_LANES 8
// The finalize kernels' blocks: 8 channels by 32 lanes, each lane a strided
// share of the chunks (256 threads, the widest block our kernels launch).
#define BN_FIN_CHANNELS 8
#define BN_FIN_LANES 32

template <typename T>
__device__ void bn_stats_partial_k(BnDims d, const T* __restrict__ x,
                                            float* __restrict__ part_mean,
                                            float* __restrict__ part_m2) {
    __shared__ float s_count[BN_LANES][32];
    __shared__ float s_mean[BN_LANES][32];
    __shared__ float s_m2[BN_LANES][32];
    const u32 c = blockIdx.x * 32 + threadIdx.x;
    const u32 chunk = blockIdx.y;
    const u32 r0 = chunk * d.rows_per_chunk;
    const u32 r1 = min(r0 + d.rows_per_chunk, d.rows);
    float count = 0.0f, mean = 0.0f, m2 = 0.0f;
    if (c < d.channels) {
        for (u32 r = r0 + threadIdx.y; r < r1; r += BN_LANES) {
            const float v = hr_ld(x[r * d.channels + c]);
            count += 1.0f;
            const float delta = v - mean;
            mean += delta / count;
            m2 += delta * (v - mean);
        }
    }
    s_count[threadIdx.y][threadIdx.x] = count;
    s_mean[threadIdx.y][threadIdx.x] = mean;
    s_m2[threadIdx.y][threadIdx.x] = m2;
    __syncthreads();
    if (threadIdx.y == 0 && c < d.channels) {
        for (int l = 1; l < BN_LANES; ++l) {
            const float nb = s_count[l][threadIdx.x];
            if (nb == 0.0f) {
                continue;
            }
            const float delta = s_mean[l][threadIdx.x] - mean;
            const float total = count + nb;
            mean += delta * (nb / total);
            m2 += s_m2[l][threadIdx.x] + delta * delta * (count * nb / total);
            count = total;
        }
        part_mean[chunk * d.channels + c] = mean;
        part_m2[chunk * d.channels + c] = m2;
    }
}

// The rows of chunk k: rows_per_chunk, or what is left for the last.
template <typename P>
__device__ __forceinline__ double bn_chunk_rows(const P& p, u32 k) {
    return (double)min(p.rows_per_chunk, p.rows - k * p.rows_per_chunk);
}

extern "C" __global__ void bn_stats_finalize(
    BnFinalizeParams p, const float* __restrict__ part_mean, const float* __restrict__ part_m2,
    const float* __restrict__ gamma, const float* __restrict__ beta, float* __restrict__ mean_out,
    float* __restrict__ inv_std_out, float* __restrict__ scale_out, float* __restrict__ shift_out,
    float* __restrict__ running_mean, float* __restrict__ running_var) {
    __shared__ double s_part[BN_FIN_LANES][BN_FIN_CHANNELS];
    __shared__ double s_mean[BN_FIN_CHANNELS];
    const u32 c = blockIdx.x * BN_FIN_CHANNELS + threadIdx.x;
    const bool live = c < p.channels;
    // Two passes over the chunks, each split over the lanes: the mean from
    // the chunks' sums, then M2 = sum of M2_k + n_k (mean_k - mean)^2. Every
    // step is an f64 add (no division), and the chain one thread waits on
    // is chunks / BN_FIN_LANES + BN_FIN_LANES long rather than chunks.
    double sum = 0.0;
    if (live) {
        for (u32 k = threadIdx.y; k < p.chunks; k += BN_FIN_LANES) {
            sum += bn_chunk_rows(p, k) * (double)part_mean[k * p.channels + c];
        }
    }
    s_part[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.y == 0) {
        double total = 0.0;
        for (int l = 0; l < BN_FIN_LANES; ++l) {
            total += s_part[l][threadIdx.x];
        }
        s_mean[threadIdx.x] = total / (double)p.rows;
    }
    __syncthreads();
    const double mean = s_mean[threadIdx.x];
    double m2 = 0.0;
    if (live) {
        for (u32 k = threadIdx.y; k < p.chunks; k += BN_FIN_LANES) {
            const double d = (double)part_mean[k * p.channels + c] - mean;
            m2 += (double)part_m2[k * p.channels + c] + bn_chunk_rows(p, k) * d * d;
        }
    }
    s_part[threadIdx.y][threadIdx.x] = m2;
    __syncthreads();
    if (threadIdx.y != 0 || !live) {
        return;
    }
    m2 = 0.0;
    for (int l = 0; l < BN_FIN_LANES; ++l) {
        m2 += s_part[l][threadIdx.x];
    }
    const double count = (double)p.rows;
    if (m2 < 0.0) {
        m2 = 0.0;
    }
    const double inv_std = 1.0 / sqrt(m2 / count + (double)p.eps);
    const float inv_std32 = (float)inv_std;
    const float mean32 = (float)mean;
    const float scale = inv_std32 * gamma[c];
    mean_out[c] = mean32;
    inv_std_out[c] = inv_std32;
    scale_out[c] = scale;
    shift_out[c] = beta[c] - mean32 * scale;
    if (p.update_running) {
        const double mom = (double)p.momentum;
        const double unbiased = m2 / (count - 1.0);
        running_mean[c] = (float)((1.0 - mom) * (double)running_mean[c] + mom * mean);
        running_var[c] = (float)((1.0 - mom) * (double)running_var[c] + mom * unbiased);
    }
}

extern "C" __global__ void bn_eval_prepare(BnEvalParams p, const float* __restrict__ gamma,
                                           const float* __restrict__ beta,
                                           const float* __restrict__ running_mean,
                                           const float* __restrict__ running_var,
                                           float* __restrict__ scale_out,
                                           float* __restrict__ shift_out) {
    const u32 c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= p.channels) {
        return;
    }
    const float scale =
        (float)((double)gamma[c] / sqrt((double)running_var[c] + (double)p.eps));
    scale_out[c] = scale;
    shift_out[c] = beta[c] - running_mean[c] * scale;
}

template <typename T>
__device__ void bn_apply_k(BnApplyParams p, const T* __restrict__ x,
                                    const float* __restrict__ scale,
                                    const float* __restrict__ shift, T* __restrict__ y) {
    const u32 n = p.rows * p.channels;
    HR_FOR_EACH(i, n) {
        const u32 c = bn_channel(p.by_channels, p.channels, i);
        float v = fmaf(hr_ld(x[i]), scale[c], shift[c]);
        if (p.relu) {
            v = hr_relu(v);
        }
        hr_st(&y[i], v);
    }
}

// The unfused block runs bn_apply, add_inplace and relu_forward, each
// rounding its result to the storage T; this rounds at the same three points, so the
// fused and unfused networks compute the same bits. p.relu = 0 leaves the
// sum (not used by the network, but defined).
template <typename T>
__device__ void bn_apply_add_k(BnApplyParams p, const T* __restrict__ x,
                                        const float* __restrict__ scale,
                                        const float* __restrict__ shift,
                                        const T* __restrict__ skip,
                                        T* __restrict__ y) {
    const u32 n = p.rows * p.channels;
    HR_FOR_EACH(i, n) {
        const u32 c = bn_channel(p.by_channels, p.channels, i);
        const float v = hr_round<T>(fmaf(hr_ld(x[i]), scale[c], shift[c]));
        float s = hr_round<T>(v + hr_ld(skip[i]));
        if (p.relu) {
            s = hr_relu(s);
        }
        hr_st(&y[i], s);
    }
}

// Whether the fused ReLU passed x's element of channel c: bn_apply's own
// arithmetic and rounding to T, so exactly where its output y is > 0
// (NaN included: not passed), without reading y.
template <typename T>
__device__ __forceinline__ bool bn_relu_passed(float xv, float scale, float shift) {
    return hr_round<T>(hr_relu(fmaf(xv, scale, shift))) > 0.0f;
}

// dx of one element: k*g' + b*(x - mean) + d, its products fused as
// written (not as the compiler might choose, differently per kernel).
__device__ __forceinline__ float bn_dx(float k, float g, float b, float centred, float d) {
    return fmaf(k, g, fmaf(b, centred, d));
}

// The body of both partial kernels. With p.relu the ReLU's mask applies:
// from the block's output y where y is given (the masking kernel, after
// bn_apply_add), else from x and the forward's scale and shift
// (bn_relu_passed). With g_out (then g itself), a masked element of g is
// overwritten with +0: the bits relu_backward would store.
template <typename T>
__device__ __forceinline__ void bn_backward_sums(const BnBackwardParams& p, const T* g,
                                                 const T* x, const T* y, const float* scale,
                                                 const float* shift, const float* mean,
                                                 float* part_sum_g, float* part_sum_gx,
                                                 T* g_out) {
    __shared__ float s_g[BN_LANES][32];
    __shared__ float s_gx[BN_LANES][32];
    const u32 c = blockIdx.x * 32 + threadIdx.x;
    const u32 chunk = blockIdx.y;
    const u32 r0 = chunk * p.rows_per_chunk;
    const u32 r1 = min(r0 + p.rows_per_chunk, p.rows);
    float sg = 0.0f, sgx = 0.0f;
    if (c < p.channels) {
        const float mu = mean[c];
        const float sc = y == nullptr ? scale[c] : 0.0f;
        const float sh = y == nullptr ? shift[c] : 0.0f;
        for (u32 r = r0 + threadIdx.y; r < r1; r += BN_LANES) {
            const u32 i = r * p.channels + c;
            float gv = hr_ld(g[i]);
            const float xv = hr_ld(x[i]);
            const bool passed =
                y != nullptr ? hr_ld(y[i]) > 0.0f : bn_relu_passed<T>(xv, sc, sh);
            if (p.relu && !passed) {
                gv = 0.0f;
                if (g_out != nullptr) {
                    g_out[i] = (T)0;
                }
            }
            sg += gv;
            // fmaf, not a product and a sum the compiler may or may not
            // contract: it contracted in one of the two kernels and not in
            // the other on an H100, so masked in place or before, the sums
            // differed in their last bits.
            sgx = fmaf(gv, xv - mu, sgx);
        }
    }
    s_g[threadIdx.y][threadIdx.x] = sg;
    s_gx[threadIdx.y][threadIdx.x] = sgx;
    __syncthreads();
    if (threadIdx.y == 0 && c < p.channels) {
        for (int l = 1; l < BN_LANES; ++l) {
            sg += s_g[l][threadIdx.x];
            sgx += s_gx[l][threadIdx.x];
        }
        part_sum_g[chunk * p.channels + c] = sg;
        part_sum_gx[chunk * p.channels + c] = sgx;
    }
}

// With p.relu, the mask from x, scale and shift (bn_relu_passed).
template <typename T>
__device__ void bn_backward_partial_k(BnBackwardParams p, const T* __restrict__ g,
                                               const T* __restrict__ x,
                                               const float* __restrict__ scale,
                                               const float* __restrict__ shift,
                                               const float* __restrict__ mean,
                                               float* __restrict__ part_sum_g,
                                               float* __restrict__ part_sum_gx) {
    bn_backward_sums<T>(p, g, x, nullptr, scale, shift, mean, part_sum_g, part_sum_gx, nullptr);
}

// Each element of g is read, then written, by the one thread that sums it,
// so masking in place races with nothing.
template <typename T>
__device__ void bn_backward_partial_mask_k(BnBackwardParams p, T* __restrict__ g,
                                                    const T* __restrict__ x,
                                                    const T* __restrict__ y,
                                                    const float* __restrict__ mean,
                                                    float* __restrict__ part_sum_g,
                                                    float* __restrict__ part_sum_gx) {
    bn_backward_sums<T>(p, g, x, y, nullptr, nullptr, mean, part_sum_g, part_sum_gx, g);
}

extern "C" __global__ void bn_backward_finalize(
    BnBackwardParams p, const float* __restrict__ part_sum_g, const float* __restrict__ part_sum_gx,
    const float* __restrict__ gamma, const float* __restrict__ inv_std,
    float* __restrict__ gamma_grad, float* __restrict__ beta_grad, float* __restrict__ coef_k,
    float* __restrict__ coef_b, float* __restrict__ coef_d) {
    __shared__ double s_g[BN_FIN_LANES][BN_FIN_CHANNELS];
    __shared__ double s_gx[BN_FIN_LANES][BN_FIN_CHANNELS];
    const u32 c = blockIdx.x * BN_FIN_CHANNELS + threadIdx.x;
    const bool live = c < p.channels;
    // The chunks split over the lanes, then the lanes' sums in lane order.
    double sum_g = 0.0, sum_gx = 0.0;
    if (live) {
        for (u32 k = threadIdx.y; k < p.chunks; k += BN_FIN_LANES) {
            sum_g += (double)part_sum_g[k * p.channels + c];
            sum_gx += (double)part_sum_gx[k * p.channels + c];
        }
    }
    s_g[threadIdx.y][threadIdx.x] = sum_g;
    s_gx[threadIdx.y][threadIdx.x] = sum_gx;
    __syncthreads();
    if (threadIdx.y != 0 || !live) {
        return;
    }
    sum_g = 0.0;
    sum_gx = 0.0;
    for (int l = 0; l < BN_FIN_LANES; ++l) {
        sum_g += s_g[l][threadIdx.x];
        sum_gx += s_gx[l][threadIdx.x];
    }
    const double m = (double)p.rows;
    const double s = (double)inv_std[c];
    const double dgamma = s * sum_gx;
    const double dbeta = sum_g;
    const double k = (double)gamma[c] * s;
    coef_k[c] = (float)k;
    coef_b[c] = (float)(-k * s * dgamma / m);
    coef_d[c] = (float)(-k * dbeta / m);
    gamma_grad[c] += (float)dgamma;
    beta_grad[c] += (float)dbeta;
}

// With p.relu, g masked by bn_relu_passed (x, scale, shift).
template <typename T>
__device__ void bn_backward_apply_k(BnBackwardParams p, const T* __restrict__ g,
                                             const T* __restrict__ x,
                                             const float* __restrict__ scale,
                                             const float* __restrict__ shift,
                                             const float* __restrict__ mean,
                                             const float* __restrict__ coef_k,
                                             const float* __restrict__ coef_b,
                                             const float* __restrict__ coef_d,
                                             T* __restrict__ dx) {
    const u32 n = p.rows * p.channels;
    HR_FOR_EACH(i, n) {
        const u32 c = bn_channel(p.by_channels, p.channels, i);
        const float xv = hr_ld(x[i]);
        float gv = hr_ld(g[i]);
        if (p.relu && !bn_relu_passed<T>(xv, scale[c], shift[c])) {
            gv = 0.0f;
        }
        hr_st(&dx[i], bn_dx(coef_k[c], gv, coef_b[c], xv - mean[c], coef_d[c]));
    }
}

// The partial sums 8 channels at a time (f16, channels % 8 == 0): one
// 16-byte load per thread and row instead of 8 two-byte loads, which left
// the scalar kernels at under a fifth of the memory bandwidth on an H100.
// A block of BN_V8_THREADS threads: min(C/8, 32) groups of 8 channels
// across by as many row lanes down as fit; grid (ceil(C/8 / 32), chunks).
// Lanes merge in a fixed tree over ty, so the bits depend only on the
// shape.
#define BN_V8_THREADS 256u
// Rows whose 16-byte loads a thread issues together before it does any
// arithmetic on them (one load in flight a thread left the partial
// kernels, a few blocks an SM, well short of the memory's bandwidth).
#define BN_V8_ROWS 4u

struct BnV8Lane {
    u32 ty;      // row lane
    u32 lanes;   // row lanes in the block
    u32 across;  // threads a row lane spans (groups of 8 channels)
    u32 c0;      // first of this thread's 8 channels
    bool live;   // a real lane with real channels
};

// A thread's lane in channel block `channel_block` (32 groups a block).
__device__ __forceinline__ BnV8Lane bn_v8_lane(u32 channels, u32 channel_block) {
    const u32 groups = channels / 8u;
    BnV8Lane l;
    l.across = min(groups, 32u);
    l.lanes = BN_V8_THREADS / l.across;
    l.ty = threadIdx.x / l.across;
    const u32 group = channel_block * l.across + threadIdx.x % l.across;
    l.c0 = 8u * group;
    l.live = l.ty < l.lanes && group < groups;
    return l;
}

// The tree's first stride: the largest power of two below `lanes`.
__device__ __forceinline__ u32 bn_v8_first_stride(u32 lanes) {
    u32 s = 1u;
    while (2u * s < lanes) {
        s *= 2u;
    }
    return s;
}

// The fixed tree over a block's row lanes: merge(t, o), for each stride
// halving from bn_v8_first_stride, folds thread o (lane ty + stride) into
// thread t (lane ty); every thread reaches each barrier.
template <typename Merge>
__device__ __forceinline__ void bn_v8_tree(const BnV8Lane& l, Merge merge) {
    for (u32 stride = bn_v8_first_stride(l.lanes); stride > 0u; stride /= 2u) {
        if (l.live && l.ty < stride && l.ty + stride < l.lanes) {
            merge(threadIdx.x, threadIdx.x + stride * l.across);
        }
        __syncthreads();
    }
}

// bn_apply, bn_apply_add and bn_backward_apply 8 channels at a time, for
// f16 with channels % 8 == 0: 16-byte accesses, and the lanes of the
// partial kernels (bn_v8_lane), so that a thread keeps its 8 channels for
// every row it touches and reads their per-channel factors once, not once
// per 16 bytes. (One vector a thread with those factors reread each time
// made a warp's 16 scattered 4-byte loads per 512 bytes of x the bulk of
// the L1's work, and the apply kernels ran at a third of an H100's
// bandwidth.) A block's rows are BN_V8_ROWS spans of its row lanes,
// whose loads are all issued before any arithmetic; grid (row blocks,
// ceil(C/8 / 32)). Each element's arithmetic and roundings are the scalar
// kernel's, so the same bits.

// The BN_V8_ROWS rows of this thread in row block blockIdx.x: load(j, i)
// for each (i: the offset of its 8 channels in row j), then finish(j, i)
// for each, so that all of the loads are in flight before the arithmetic.
template <typename Load, typename Finish>
__device__ __forceinline__ void bn_apply_rows(const BnV8Lane& l, u32 rows, u32 channels, Load load,
                                              Finish finish) {
    for (u32 j = 0; j < BN_V8_ROWS; ++j) {
        const u32 r = (blockIdx.x * BN_V8_ROWS + j) * l.lanes + l.ty;
        if (r < rows) {
            load(j, r * channels + l.c0);
        }
    }
    for (u32 j = 0; j < BN_V8_ROWS; ++j) {
        const u32 r = (blockIdx.x * BN_V8_ROWS + j) * l.lanes + l.ty;
        if (r < rows) {
            finish(j, r * channels + l.c0);
        }
    }
}

__device__ __forceinline__ void bn_load8(float out[8], const float* __restrict__ v, u32 c0) {
    for (u32 e = 0; e < 8; ++e) {
        out[e] = v[c0 + e];
    }
}

extern "C" __global__ void bn_apply_v8_f16(BnApplyParams p, const hr_half* __restrict__ x,
                                           const float* __restrict__ scale,
                                           const float* __restrict__ shift, hr_half* __restrict__ y) {
    const BnV8Lane l = bn_v8_lane(p.channels, blockIdx.y);
    if (!l.live) {
        return;
    }
    float sc[8], sh[8];
    bn_load8(sc, scale, l.c0);
    bn_load8(sh, shift, l.c0);
    HalfVec8 xv[BN_V8_ROWS] = {};
    bn_apply_rows(
        l, p.rows, p.channels, [&](u32 j, u32 i) { xv[j] = hr_ld_vec8(x + i); },
        [&](u32 j, u32 i) {
            float out[8];
            for (u32 e = 0; e < 8; ++e) {
                float v = fmaf(hr_vec8_at(xv[j], e), sc[e], sh[e]);
                if (p.relu) {
                    v = hr_relu(v);
                }
                out[e] = v;
            }
            hr_st_vec8(y + i, hr_vec8_of(out));
        });
}

extern "C" __global__ void bn_apply_add_v8_f16(BnApplyParams p, const hr_half* __restrict__ x,
                                               const float* __restrict__ scale,
                                               const float* __restrict__ shift,
                                               const hr_half* __restrict__ skip,
                                               hr_half* __restrict__ y) {
    const BnV8Lane l = bn_v8_lane(p.channels, blockIdx.y);
    if (!l.live) {
        return;
    }
    float sc[8], sh[8];
    bn_load8(sc, scale, l.c0);
    bn_load8(sh, shift, l.c0);
    HalfVec8 xv[BN_V8_ROWS] = {};
    HalfVec8 sv[BN_V8_ROWS] = {};
    bn_apply_rows(
        l, p.rows, p.channels,
        [&](u32 j, u32 i) {
            xv[j] = hr_ld_vec8(x + i);
            sv[j] = hr_ld_vec8(skip + i);
        },
        [&](u32 j, u32 i) {
            float out[8];
            for (u32 e = 0; e < 8; ++e) {
                const float v = hr_round<hr_half>(fmaf(hr_vec8_at(xv[j], e), sc[e], sh[e]));
                float s = hr_round<hr_half>(v + hr_vec8_at(sv[j], e));
                if (p.relu) {
                    s = hr_relu(s);
                }
                out[e] = s;
            }
            hr_st_vec8(y + i, hr_vec8_of(out));
        });
}

// As bn_backward_apply_k (the mask from x, scale and shift).
extern "C" __global__ void bn_backward_apply_v8_f16(
    BnBackwardParams p, const hr_half* __restrict__ g, const hr_half* __restrict__ x,
    const float* __restrict__ scale, const float* __restrict__ shift,
    const float* __restrict__ mean, const float* __restrict__ coef_k,
    const float* __restrict__ coef_b, const float* __restrict__ coef_d, hr_half* __restrict__ dx) {
    const BnV8Lane l = bn_v8_lane(p.channels, blockIdx.y);
    if (!l.live) {
        return;
    }
    float sc[8], sh[8], mu[8], ck[8], cb[8], cd[8];
    bn_load8(sc, scale, l.c0);
    bn_load8(sh, shift, l.c0);
    bn_load8(mu, mean, l.c0);
    bn_load8(ck, coef_k, l.c0);
    bn_load8(cb, coef_b, l.c0);
    bn_load8(cd, coef_d, l.c0);
    HalfVec8 gv[BN_V8_ROWS] = {};
    HalfVec8 xv[BN_V8_ROWS] = {};
    bn_apply_rows(
        l, p.rows, p.channels,
        [&](u32 j, u32 i) {
            gv[j] = hr_ld_vec8(g + i);
            xv[j] = hr_ld_vec8(x + i);
        },
        [&](u32 j, u32 i) {
            float out[8];
            for (u32 e = 0; e < 8; ++e) {
                const float xe = hr_vec8_at(xv[j], e);
                float ge = hr_vec8_at(gv[j], e);
                if (p.relu && !bn_relu_passed<hr_half>(xe, sc[e], sh[e])) {
                    ge = 0.0f;
                }
                out[e] = bn_dx(ck[e], ge, cb[e], xe - mu[e], cd[e]);
            }
            hr_st_vec8(dx + i, hr_vec8_of(out));
        });
}

extern "C" __global__ void bn_stats_partial_v8_f16(BnDims d, const hr_half* __restrict__ x,
                                                   float* __restrict__ part_mean,
                                                   float* __restrict__ part_m2) {
    __shared__ float s_count[BN_V8_THREADS];
    __shared__ float s_mean[BN_V8_THREADS][8];
    __shared__ float s_m2[BN_V8_THREADS][8];
    const BnV8Lane l = bn_v8_lane(d.channels, blockIdx.x);
    const u32 chunk = blockIdx.y;
    const u32 r0 = chunk * d.rows_per_chunk;
    const u32 r1 = min(r0 + d.rows_per_chunk, d.rows);
    float count = 0.0f, mean[8], m2[8];
    for (u32 e = 0; e < 8; ++e) {
        mean[e] = 0.0f;
        m2[e] = 0.0f;
    }
    if (l.live) {
        // Rows r0 + ty, then every lanes-th: BN_V8_ROWS of them loaded
        // at once, then taken in that order.
        for (u32 base = r0 + l.ty; base < r1; base += BN_V8_ROWS * l.lanes) {
            HalfVec8 v[BN_V8_ROWS] = {};
            for (u32 j = 0; j < BN_V8_ROWS; ++j) {
                const u32 r = base + j * l.lanes;
                if (r < r1) {
                    v[j] = hr_ld_vec8(x + r * d.channels + l.c0);
                }
            }
            for (u32 j = 0; j < BN_V8_ROWS && base + j * l.lanes < r1; ++j) {
                count += 1.0f;
                // One reciprocal for the 8 channels' Welford updates.
                const float inv = 1.0f / count;
                for (u32 e = 0; e < 8; ++e) {
                    const float ve = hr_vec8_at(v[j], e);
                    const float delta = ve - mean[e];
                    mean[e] += delta * inv;
                    m2[e] += delta * (ve - mean[e]);
                }
            }
        }
    }
    const u32 t = threadIdx.x;
    s_count[t] = count;
    for (u32 e = 0; e < 8; ++e) {
        s_mean[t][e] = mean[e];
        s_m2[t][e] = m2[e];
    }
    __syncthreads();
    // Chan et al.'s merge of two lanes' (count, mean, M2).
    bn_v8_tree(l, [&](u32 t, u32 o) {
        const float nb = s_count[o];
        if (nb > 0.0f) {
            const float na = s_count[t];
            const float total = na + nb;
            for (u32 e = 0; e < 8; ++e) {
                const float delta = s_mean[o][e] - s_mean[t][e];
                s_mean[t][e] += delta * (nb / total);
                s_m2[t][e] += s_m2[o][e] + delta * delta * (na * nb / total);
            }
            s_count[t] = total;
        }
    });
    if (l.live && l.ty == 0u) {
        for (u32 e = 0; e < 8; ++e) {
            part_mean[chunk * d.channels + l.c0 + e] = s_mean[t][e];
            part_m2[chunk * d.channels + l.c0 + e] = s_m2[t][e];
        }
    }
}

// One row's 8 channels of bn_backward_sums_v8: g' (g masked by the ReLU,
// from y, or from x, scale and shift) added to sg, g'(x - mean) to sgx;
// with g_out, written back there when an element was masked (unmasked
// elements keep their bits).
__device__ __forceinline__ void bn_backward_row_v8(u32 relu, bool from_x, HalfVec8 gv8, HalfVec8 xv,
                                                   HalfVec8 yv, const float sc[8], const float sh[8],
                                                   const float mu[8], float sg[8], float sgx[8],
                                                   hr_half* g_out) {
    HalfVec8 kept = gv8;  // g with its masked elements +0
    bool masked = false;
    for (u32 e = 0; e < 8; ++e) {
        const float xe = hr_vec8_at(xv, e);
        float gv = hr_vec8_at(gv8, e);
        const bool passed = from_x ? bn_relu_passed<hr_half>(xe, sc[e], sh[e]) : hr_vec8_at(yv, e) > 0.0f;
        if (relu && !passed) {
            gv = 0.0f;
            masked = true;
            kept.w[e >> 1] &= ~(0xffffu << (16u * (e & 1u)));
        }
        sg[e] += gv;
        sgx[e] = fmaf(gv, xe - mu[e], sgx[e]);  // as bn_backward_sums
    }
    if (g_out != nullptr && masked) {
        hr_st_vec8(g_out, kept);
    }
}

// bn_backward_sums 8 channels at a time (its mask from y, or from x, scale
// and shift); with g_out (then g itself) a vector with a masked element is
// written back with those elements +0.
__device__ __forceinline__ void bn_backward_sums_v8(const BnBackwardParams& p, const hr_half* g,
                                                    const hr_half* x, const hr_half* y,
                                                    const float* scale, const float* shift,
                                                    const float* mean, float* part_sum_g,
                                                    float* part_sum_gx, hr_half* g_out) {
    __shared__ float s_g[BN_V8_THREADS][8];
    __shared__ float s_gx[BN_V8_THREADS][8];
    const BnV8Lane l = bn_v8_lane(p.channels, blockIdx.x);
    const u32 chunk = blockIdx.y;
    const u32 r0 = chunk * p.rows_per_chunk;
    const u32 r1 = min(r0 + p.rows_per_chunk, p.rows);
    const bool from_x = y == nullptr;
    float sg[8], sgx[8], mu[8], sc[8], sh[8];
    for (u32 e = 0; e < 8; ++e) {
        sg[e] = 0.0f;
        sgx[e] = 0.0f;
        mu[e] = l.live ? mean[l.c0 + e] : 0.0f;
        sc[e] = l.live && from_x ? scale[l.c0 + e] : 0.0f;
        sh[e] = l.live && from_x ? shift[l.c0 + e] : 0.0f;
    }
    if (l.live) {
        // As bn_stats_partial_v8_f16: BN_V8_ROWS rows loaded at once.
        for (u32 base = r0 + l.ty; base < r1; base += BN_V8_ROWS * l.lanes) {
            HalfVec8 gs[BN_V8_ROWS] = {};
            HalfVec8 xs[BN_V8_ROWS] = {};
            HalfVec8 ys[BN_V8_ROWS] = {};
            for (u32 j = 0; j < BN_V8_ROWS; ++j) {
                const u32 r = base + j * l.lanes;
                if (r < r1) {
                    const u32 i = r * p.channels + l.c0;
                    gs[j] = hr_ld_vec8(g + i);
                    xs[j] = hr_ld_vec8(x + i);
                    if (p.relu && !from_x) {
                        ys[j] = hr_ld_vec8(y + i);
                    }
                }
            }
            for (u32 j = 0; j < BN_V8_ROWS && base + j * l.lanes < r1; ++j) {
                hr_half* out = g_out != nullptr ? g_out + (base + j * l.lanes) * p.channels + l.c0 : nullptr;
                bn_backward_row_v8(p.relu, from_x, gs[j], xs[j], ys[j], sc, sh, mu, sg, sgx, out);
            }
        }
    }
    const u32 t = threadIdx.x;
    for (u32 e = 0; e < 8; ++e) {
        s_g[t][e] = sg[e];
        s_gx[t][e] = sgx[e];
    }
    __syncthreads();
    bn_v8_tree(l, [&](u32 t, u32 o) {
        for (u32 e = 0; e < 8; ++e) {
            s_g[t][e] += s_g[o][e];
            s_gx[t][e] += s_gx[o][e];
        }
    });
    if (l.live && l.ty == 0u) {
        for (u32 e = 0; e < 8; ++e) {
            part_sum_g[chunk * p.channels + l.c0 + e] = s_g[t][e];
            part_sum_gx[chunk * p.channels + l.c0 + e] = s_gx[t][e];
        }
    }
}

// With p.relu, the mask from x, scale and shift (bn_relu_passed).
extern "C" __global__ void bn_backward_partial_v8_f16(BnBackwardParams p,
                                                      const hr_half* __restrict__ g,
                                                      const hr_half* __restrict__ x,
                                                      const float* __restrict__ scale,
                                                      const float* __restrict__ shift,
                                                      const float* __restrict__ mean,
                                                      float* __restrict__ part_sum_g,
                                                      float* __restrict__ part_sum_gx) {
    bn_backward_sums_v8(p, g, x, nullptr, scale, shift, mean, part_sum_g, part_sum_gx, nullptr);
}

// Each vector of g is read, then written, by the one thread that sums it.
extern "C" __global__ void bn_backward_partial_mask_v8_f16(BnBackwardParams p,
                                                           hr_half* __restrict__ g,
                                                           const hr_half* __restrict__ x,
                                                           const hr_half* __restrict__ y,
                                                           const float* __restrict__ mean,
                                                           float* __restrict__ part_sum_g,
                                                           float* __restrict__ part_sum_gx) {
    bn_backward_sums_v8(p, g, x, y, nullptr, nullptr, mean, part_sum_g, part_sum_gx, g);
}

struct BnRestoreParams {
    u32 channels;
};
HR_CHECK_SIZE(BnRestoreParams, 4);

extern "C" __global__ void bn_running_restore(BnRestoreParams p, const StepState* __restrict__ state,
                                              const float* __restrict__ saved_mean,
                                              const float* __restrict__ saved_var,
                                              float* __restrict__ running_mean,
                                              float* __restrict__ running_var) {
    if (!state->skipped) {
        return;
    }
    HR_FOR_EACH(c, p.channels) {
        running_mean[c] = saved_mean[c];
        running_var[c] = saved_var[c];
    }
}

// Entry points, one per storage type.
extern "C" __global__ void bn_stats_partial_f16(BnDims p, const hr_half* __restrict__ x,
                                                float* __restrict__ part_mean,
                                                float* __restrict__ part_m2) {
    bn_stats_partial_k(p, x, part_mean, part_m2);
}

extern "C" __global__ void bn_stats_partial_f32(BnDims p, const float* __restrict__ x,
                                                float* __restrict__ part_mean,
                                                float* __restrict__ part_m2) {
    bn_stats_partial_k(p, x, part_mean, part_m2);
}

extern "C" __global__ void bn_apply_f16(BnApplyParams p, const hr_half* __restrict__ x,
                                        const float* __restrict__ scale,
                                        const float* __restrict__ shift, hr_half* __restrict__ y) {
    bn_apply_k(p, x, scale, shift, y);
}

extern "C" __global__ void bn_apply_f32(BnApplyParams p, const float* __restrict__ x,
                                        const float* __restrict__ scale,
                                        const float* __restrict__ shift, float* __restrict__ y) {
    bn_apply_k(p, x, scale, shift, y);
}

extern "C" __global__ void bn_apply_add_f16(BnApplyParams p, const hr_half* __restrict__ x,
                                            const float* __restrict__ scale,
                                            const float* __restrict__ shift,
                                            const hr_half* __restrict__ skip,
                                            hr_half* __restrict__ y) {
    bn_apply_add_k(p, x, scale, shift, skip, y);
}

extern "C" __global__ void bn_apply_add_f32(BnApplyParams p, const float* __restrict__ x,
                                            const float* __restrict__ scale,
                                            const float* __restrict__ shift,
                                            const float* __restrict__ skip, float* __restrict__ y) {
    bn_apply_add_k(p, x, scale, shift, skip, y);
}

extern "C" __global__ void bn_backward_partial_f16(BnBackwardParams p,
                                                   const hr_half* __restrict__ g,
                                                   const hr_half* __restrict__ x,
                                                   const float* __restrict__ scale,
                                                   const float* __restrict__ shift,
                                                   const float* __restrict__ mean,
                                                   float* __restrict__ part_sum_g,
                                                   float* __restrict__ part_sum_gx) {
    bn_backward_partial_k(p, g, x, scale, shift, mean, part_sum_g, part_sum_gx);
}

extern "C" __global__ void bn_backward_partial_f32(BnBackwardParams p,
                                                   const float* __restrict__ g,
                                                   const float* __restrict__ x,
                                                   const float* __restrict__ scale,
                                                   const float* __restrict__ shift,
                                                   const float* __restrict__ mean,
                                                   float* __restrict__ part_sum_g,
                                                   float* __restrict__ part_sum_gx) {
    bn_backward_partial_k(p, g, x, scale, shift, mean, part_sum_g, part_sum_gx);
}

extern "C" __global__ void bn_backward_partial_mask_f16(BnBackwardParams p, hr_half* __restrict__ g,
                                                        const hr_half* __restrict__ x,
                                                        const hr_half* __restrict__ y,
                                                        const float* __restrict__ mean,
                                                        float* __restrict__ part_sum_g,
                                                        float* __restrict__ part_sum_gx) {
    bn_backward_partial_mask_k(p, g, x, y, mean, part_sum_g, part_sum_gx);
}

extern "C" __global__ void bn_backward_partial_mask_f32(BnBackwardParams p, float* __restrict__ g,
                                                        const float* __restrict__ x,
                                                        const float* __restrict__ y,
                                                        const float* __restrict__ mean,
                                                        float* __restrict__ part_sum_g,
                                                        float* __restrict__ part_sum_gx) {
    bn_backward_partial_mask_k(p, g, x, y, mean, part_sum_g, part_sum_gx);
}

extern "C" __global__ void bn_backward_apply_f16(BnBackwardParams p, const hr_half* __restrict__ g,
                                                 const hr_half* __restrict__ x,
                                                 const float* __restrict__ scale,
                                                 const float* __restrict__ shift,
                                                 const float* __restrict__ mean,
                                                 const float* __restrict__ coef_k,
                                                 const float* __restrict__ coef_b,
                                                 const float* __restrict__ coef_d,
                                                 hr_half* __restrict__ dx) {
    bn_backward_apply_k(p, g, x, scale, shift, mean, coef_k, coef_b, coef_d, dx);
}

extern "C" __global__ void bn_backward_apply_f32(BnBackwardParams p, const float* __restrict__ g,
                                                 const float* __restrict__ x,
                                                 const float* __restrict__ scale,
                                                 const float* __restrict__ shift,
                                                 const float* __restrict__ mean,
                                                 const float* __restrict__ coef_k,
                                                 const float* __restrict__ coef_b,
                                                 const float* __restrict__ coef_d,
                                                 float* __restrict__ dx) {
    bn_backward_apply_k(p, g, x, scale, shift, mean, coef_k, coef_b, coef_d, dx);
}
