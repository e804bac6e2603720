// Softmax cross-entropy with label smoothing (the CPU's
// loss::softmax_cross_entropy, PyTorch semantics: target = (1-s)*onehot + s/k),
// forward and gradient in one pass, one warp per row.
//
// Per row: row_loss = logsumexp(x) - sum_j t_j x_j (f32), row_correct = 1 if
// the first maximum's index is the label (NaN never wins, as on the CPU), and
// grad = (softmax(x) - t) * grad_scale in the logits' storage T, with grad_scale =
// loss_scale * share / rows: the mean over the batch, times the dynamic loss
// scale (read from device memory, where the optimizer's step_finalize keeps
// it), times this micro-batch's share of the batch. A non-finite logit gives
// a non-finite loss and gradient, which the optimizer's inf/NaN check then
// sees. xent_reduce turns the per-row values
// into the batch mean and the correct count (one block, fixed order).
//
// Focal loss (the CPU's loss::focal_loss and soft_focal_loss, train.loss =
// "focal"): the same targets, each class's log-probability weighted by
// q^γ with q = 1 - p, in f32 where the CPU sums in f64. q is computed from
// the other classes' exponentials, not as 1 - p, so that a confident row's
// small weights stay exact, as on the CPU.
#include "common.cuh"

struct XentParams {
    u32 rows;
    u32 classes;
    float smoothing;
    float share;
};
HR_CHECK_SIZE(XentParams, 16);

struct FocalParams {
    u32 rows;
    u32 classes;
    float smoothing;
    float share;
    float gamma;
};
HR_CHECK_SIZE(FocalParams, 20);

struct XentReduceParams {
    u32 rows;
};
HR_CHECK_SIZE(XentReduceParams, 4);

__device__ __forceinline__ float xent_grad_scale(const XentParams& p, const float* loss_scale) {
    return (float)((double)(*loss_scale * p.share) / (double)p.rows);
}

// log(sum_j exp(x_j)) over one row of k values, by the 32 lanes of a
// warp (each lane's partial sums in index order, then the warp reduction):
// every lane gets the result.
template <typename T>
__device__ __forceinline__ float row_logsumexp(const T* x, u32 k, u32 lane) {
    float mx = hr_neg_inf();
    for (u32 j = lane; j < k; j += 32) {
        mx = fmaxf(mx, hr_ld(x[j]));
    }
    mx = warp_max(mx);
    float sum = 0.0f;
    for (u32 j = lane; j < k; j += 32) {
        sum += expf(hr_ld(x[j]) - mx);
    }
    return mx + logf(warp_sum(sum));
}

template <typename T>
__device__ void softmax_xent_k(XentParams p, const float* __restrict__ loss_scale,
                                        const T* __restrict__ logits,
                                        const u32* __restrict__ labels,
                                        float* __restrict__ row_loss,
                                        u32* __restrict__ row_correct,
                                        T* __restrict__ grad) {
    const u32 row = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const u32 lane = threadIdx.x % 32;
    if (row >= p.rows) {
        return;  // whole warps leave together: rows are warp-aligned
    }
    const u32 k = p.classes;
    const float grad_scale = xent_grad_scale(p, loss_scale);
    const T* x = logits + row * k;
    const u32 label = labels[row];
    const float off = p.smoothing / (float)k;
    const float on = 1.0f - p.smoothing + off;

    const float lse = row_logsumexp(x, k, lane);
    float dot = 0.0f;
    for (u32 j = lane; j < k; j += 32) {
        dot += (j == label ? on : off) * hr_ld(x[j]);
    }
    dot = warp_sum(dot);
    // An out-of-range label (the host validates labels it uploads) poisons
    // the row instead of reading out of bounds.
    const bool valid = label < k;

    for (u32 j = lane; j < k; j += 32) {
        const float prob = expf(hr_ld(x[j]) - lse);
        const float t = j == label ? on : off;
        hr_st(&grad[row * k + j], valid ? (prob - t) * grad_scale : __int_as_float(0x7fc00000));
    }
    if (lane == 0) {
        row_loss[row] = valid ? lse - dot : __int_as_float(0x7fc00000);
        // First maximum, scanning in order like the CPU's argmax.
        u32 best = 0;
        float best_v = hr_ld(x[0]);
        for (u32 j = 1; j < k; ++j) {
            const float v = hr_ld(x[j]);
            if (v > best_v) {
                best = j;
                best_v = v;
            }
        }
        row_correct[row] = (valid && best == label) ? 1u : 0u;
    }
}

// Soft targets (Mixup, CutMix; the CPU's loss::soft_cross_entropy): targets
// [rows, k] f32 as given (the host has already applied any label smoothing),
// row_loss = sum_j t_j (lse - x_j), grad = (mass * softmax(x) - t) *
// grad_scale with mass = sum_j t_j, and row_correct = 1 where the first
// maximum of the logits is the first maximum of the targets.
template <typename T>
__device__ void softmax_xent_soft_k(XentParams p, const float* __restrict__ loss_scale,
                                             const T* __restrict__ logits,
                                             const float* __restrict__ targets,
                                             float* __restrict__ row_loss,
                                             u32* __restrict__ row_correct,
                                             T* __restrict__ grad) {
    const u32 row = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const u32 lane = threadIdx.x % 32;
    if (row >= p.rows) {
        return;  // whole warps leave together: rows are warp-aligned
    }
    const u32 k = p.classes;
    const float grad_scale = xent_grad_scale(p, loss_scale);
    const T* x = logits + row * k;
    const float* t = targets + row * k;

    const float lse = row_logsumexp(x, k, lane);
    float dot = 0.0f, mass = 0.0f;
    for (u32 j = lane; j < k; j += 32) {
        dot += t[j] * hr_ld(x[j]);
        mass += t[j];
    }
    dot = warp_sum(dot);
    mass = warp_sum(mass);

    for (u32 j = lane; j < k; j += 32) {
        const float prob = expf(hr_ld(x[j]) - lse);
        hr_st(&grad[row * k + j], (mass * prob - t[j]) * grad_scale);
    }
    if (lane == 0) {
        row_loss[row] = mass * lse - dot;
        u32 best_x = 0, best_t = 0;
        float vx = hr_ld(x[0]), vt = t[0];
        for (u32 j = 1; j < k; ++j) {
            const float a = hr_ld(x[j]);
            if (a > vx) {
                best_x = j;
                vx = a;
            }
            if (t[j] > vt) {
                best_t = j;
                vt = t[j];
            }
        }
        row_correct[row] = best_x == best_t ? 1u : 0u;
    }
}

// p_j, q_j = 1 - p_j and log p_j of a row whose first maximum, at `top`, is
// mx, with others = sum of exp(x_i - mx) over i != top.
struct FocalTerms {
    float p, q, log_p;
};

__device__ __forceinline__ FocalTerms focal_terms(float x, bool is_top, float mx, float others) {
    const float sum = 1.0f + others;
    if (is_top) {
        return {1.0f / sum, others / sum, -log1pf(others)};
    }
    const float e = expf(x - mx);
    return {e / sum, (sum - e) / sum, x - mx - logf(sum)};
}

// c_j = q^γ - γ·p·log p·q^(γ-1), its limit 0 at q = 0 for the second term;
// q^γ into q_gamma.
__device__ __forceinline__ float focal_c(FocalTerms f, float gamma, float* q_gamma) {
    *q_gamma = powf(f.q, gamma);
    const float log_p_q = f.q > 0.0f ? f.log_p * *q_gamma / f.q : 0.0f;
    return *q_gamma - gamma * f.p * log_p_q;
}

// Focal loss of one row per warp against labels (smoothed as in
// softmax_xent) or soft targets [rows, k] (exactly one of the two is
// given): row_loss = -Σ t_j·q_j^γ·log p_j, grad = (p·Σ_j t_j·c_j - t·c) ·
// grad_scale, row_correct as in the cross-entropy kernels. A non-finite
// logit makes the row's loss NaN.
template <typename T>
__device__ void softmax_focal_k(FocalParams p, const float* __restrict__ loss_scale,
                                const T* __restrict__ logits, const u32* __restrict__ labels,
                                const float* __restrict__ targets, float* __restrict__ row_loss,
                                u32* __restrict__ row_correct, T* __restrict__ grad) {
    const u32 row = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const u32 lane = threadIdx.x % 32;
    if (row >= p.rows) {
        return;  // whole warps leave together: rows are warp-aligned
    }
    const u32 k = p.classes;
    const float grad_scale = (float)((double)(*loss_scale * p.share) / (double)p.rows);
    const T* x = logits + row * k;
    const float* t_row = targets ? targets + row * k : nullptr;
    const u32 label = labels ? labels[row] : 0;
    const bool valid = t_row || label < k;
    const float off = p.smoothing / (float)k;
    const float on = 1.0f - p.smoothing + off;
    // The first maximum (every lane scans the row: k is a class count).
    u32 top = 0;
    float mx = hr_ld(x[0]);
    bool finite = hr_isfinite(mx);
    for (u32 j = 1; j < k; ++j) {
        const float v = hr_ld(x[j]);
        finite = finite && hr_isfinite(v);
        if (v > mx) {
            top = j;
            mx = v;
        }
    }
    float others = 0.0f;
    for (u32 j = lane; j < k; j += 32) {
        if (j != top) {
            others += expf(hr_ld(x[j]) - mx);
        }
    }
    others = warp_sum(others);
    float loss = 0.0f, weighted = 0.0f;
    for (u32 j = lane; j < k; j += 32) {
        const float t = t_row ? t_row[j] : (j == label ? on : off);
        const FocalTerms f = focal_terms(hr_ld(x[j]), j == top, mx, others);
        float q_gamma;
        const float c = focal_c(f, p.gamma, &q_gamma);
        loss -= t * q_gamma * f.log_p;
        weighted += t * c;
    }
    loss = warp_sum(loss);
    weighted = warp_sum(weighted);
    for (u32 j = lane; j < k; j += 32) {
        const float t = t_row ? t_row[j] : (j == label ? on : off);
        const FocalTerms f = focal_terms(hr_ld(x[j]), j == top, mx, others);
        float q_gamma;
        const float c = focal_c(f, p.gamma, &q_gamma);
        hr_st(&grad[row * k + j],
              valid ? (f.p * weighted - t * c) * grad_scale : __int_as_float(0x7fc00000));
    }
    if (lane == 0) {
        row_loss[row] = valid && finite ? loss : __int_as_float(0x7fc00000);
        u32 want = label;
        if (t_row) {
            float best = t_row[0];
            want = 0;
            for (u32 j = 1; j < k; ++j) {
                if (t_row[j] > best) {
                    want = j;
                    best = t_row[j];
                }
            }
        }
        row_correct[row] = (valid && top == want) ? 1u : 0u;
    }
}

// Entry points, one per storage type.
extern "C" __global__ void softmax_xent_f16(XentParams p, const float* __restrict__ loss_scale,
                                            const hr_half* __restrict__ logits,
                                            const u32* __restrict__ labels,
                                            float* __restrict__ row_loss,
                                            u32* __restrict__ row_correct,
                                            hr_half* __restrict__ grad) {
    softmax_xent_k(p, loss_scale, logits, labels, row_loss, row_correct, grad);
}

extern "C" __global__ void softmax_xent_f32(XentParams p, const float* __restrict__ loss_scale,
                                            const float* __restrict__ logits,
                                            const u32* __restrict__ labels,
                                            float* __restrict__ row_loss,
                                            u32* __restrict__ row_correct,
                                            float* __restrict__ grad) {
    softmax_xent_k(p, loss_scale, logits, labels, row_loss, row_correct, grad);
}

extern "C" __global__ void softmax_xent_soft_f16(XentParams p, const float* __restrict__ loss_scale,
                                                 const hr_half* __restrict__ logits,
                                                 const float* __restrict__ targets,
                                                 float* __restrict__ row_loss,
                                                 u32* __restrict__ row_correct,
                                                 hr_half* __restrict__ grad) {
    softmax_xent_soft_k(p, loss_scale, logits, targets, row_loss, row_correct, grad);
}

extern "C" __global__ void softmax_xent_soft_f32(XentParams p, const float* __restrict__ loss_scale,
                                                 const float* __restrict__ logits,
                                                 const float* __restrict__ targets,
                                                 float* __restrict__ row_loss,
                                                 u32* __restrict__ row_correct,
                                                 float* __restrict__ grad) {
    softmax_xent_soft_k(p, loss_scale, logits, targets, row_loss, row_correct, grad);
}

extern "C" __global__ void softmax_focal_f16(FocalParams p, const float* __restrict__ loss_scale,
                                             const hr_half* __restrict__ logits,
                                             const u32* __restrict__ labels,
                                             float* __restrict__ row_loss,
                                             u32* __restrict__ row_correct,
                                             hr_half* __restrict__ grad) {
    softmax_focal_k(p, loss_scale, logits, labels, nullptr, row_loss, row_correct, grad);
}

extern "C" __global__ void softmax_focal_f32(FocalParams p, const float* __restrict__ loss_scale,
                                             const float* __restrict__ logits,
                                             const u32* __restrict__ labels,
                                             float* __restrict__ row_loss,
                                             u32* __restrict__ row_correct,
                                             float* __restrict__ grad) {
    softmax_focal_k(p, loss_scale, logits, labels, nullptr, row_loss, row_correct, grad);
}

extern "C" __global__ void softmax_focal_soft_f16(FocalParams p,
                                                  const float* __restrict__ loss_scale,
                                                  const hr_half* __restrict__ logits,
                                                  const float* __restrict__ targets,
                                                  float* __restrict__ row_loss,
                                                  u32* __restrict__ row_correct,
                                                  hr_half* __restrict__ grad) {
    softmax_focal_k(p, loss_scale, logits, nullptr, targets, row_loss, row_correct, grad);
}

extern "C" __global__ void softmax_focal_soft_f32(FocalParams p,
                                                  const float* __restrict__ loss_scale,
                                                  const float* __restrict__ logits,
                                                  const float* __restrict__ targets,
                                                  float* __restrict__ row_loss,
                                                  u32* __restrict__ row_correct,
                                                  float* __restrict__ grad) {
    softmax_focal_k(p, loss_scale, logits, nullptr, targets, row_loss, row_correct, grad);
}

// out_loss[0] = mean of row_loss, out_correct[0] = sum of row_correct.
// Launch with exactly one block of 256 threads.
extern "C" __global__ void xent_reduce(XentReduceParams p, const float* __restrict__ row_loss,
                                       const u32* __restrict__ row_correct,
                                       float* __restrict__ out_loss,
                                       u32* __restrict__ out_correct) {
    __shared__ double s_loss[256];
    __shared__ u32 s_correct[256];
    double loss = 0.0;
    u32 correct = 0;
    for (u32 r = threadIdx.x; r < p.rows; r += blockDim.x) {
        loss += (double)row_loss[r];
        correct += row_correct[r];
    }
    s_loss[threadIdx.x] = loss;
    s_correct[threadIdx.x] = correct;
    __syncthreads();
    for (u32 stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            s_loss[threadIdx.x] += s_loss[threadIdx.x + stride];
            s_correct[threadIdx.x] += s_correct[threadIdx.x + stride];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        out_loss[0] = (float)(s_loss[0] / (double)p.rows);
        out_correct[0] = s_correct[0];
    }
}
