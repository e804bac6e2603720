// The optimizer step on the device, with no host synchronisation:
//
//   grad_sumsq      sum of squares of a range of f32 gradients (still
//                   multiplied by the loss scale), one f64 partial per block
//                   into partials[offset + blockIdx.x]
//   step_finalize   one block: the verdict on the gradients and the step's
//                   factors, into the StepState (common.cuh):
//                   - sums the partials in a fixed order (f64, 256 threads
//                     then a tree); found_inf if the sum
//                     is not finite; the global norm of the UNSCALED
//                     gradients; the clip factor (PyTorch's clip_grad_norm_:
//                     max_norm / (norm + 1e-6) when norm > max_norm, as in
//                     headroom-optim's clip.rs) and the factor that turns a
//                     stored gradient into the clipped, unscaled one;
//                   - picks the AdamW factors of this step's t from the
//                     host's StepSchedule: the host queues a step before it
//                     knows whether the steps still in flight were applied,
//                     so it gives one candidate per possible count of applied
//                     steps, and the device, which knows the count, picks;
//                   - clears update_overflow.
//   adamw_check     per parameter group, read-only, unless the step is
//                   skipped already: computes exactly what adamw_fused would
//                   write (the same inline adamw_element, so the same float
//                   operations in the same order: a value is judged by the
//                   bits it would have) and, if a master weight or a moment
//                   would not be finite, stores 1 into the StepState's
//                   update_overflow (a plain store: any order of threads,
//                   blocks and groups gives the same flag). In mixed
//                   precision (adamw_check, not adamw_check_f32) a finite
//                   master that would round to an infinite f16 compute copy
//                   counts too: the layers would compute with inf. The CPU's
//                   AdamW::step_if_finite (headroom-optim) checks the f32
//                   weights and moments the same way; it has no f16 copy.
//   step_commit     one thread: folds update_overflow into `skipped`, then
//                   updates the dynamic loss scale as headroom-optim's
//                   LossScaler::update does (halve on inf/NaN, grow after
//                   growth_interval clean steps), in the StepState and in the
//                   scale the next step's loss kernel reads, and counts an
//                   applied step (AdamW's t). A step skipped for
//                   update_overflow (or schedule_missed) is not the scale's
//                   fault: the scale and the clean-step count stay as they
//                   were, and t does not advance.
//   adamw_fused     per parameter group (a contiguous range of master
//                   weights, gradients and moments): on a skipped step it
//                   changes nothing; else g = grad * factor, AdamW exactly as
//                   headroom-optim's adamw.rs (PyTorch semantics), the f32
//                   master update and the f16 write-back of the compute copy.
//                   With zero_grad it also clears the gradients (skipped step
//                   or not) for the next accumulation.
//
// The cost of refusing an overflowing update: one more read-only pass per
// step over every group's master weights, gradients and both moments (16
// bytes read per parameter; nothing written but the flag), and one
// adamw_check launch per group plus step_commit. No memory: the flag is a
// field of the StepState. A step is refused or applied whole, as on the
// CPU, so every group is checked before any is updated; hence a pass of its
// own rather than a test inside adamw_fused.
//
// The host reads the StepState (the verdict, the norm and the scale for the
// logs) whenever it likes, one step late or more; the weights never depend
// on that read.
#include "common.cuh"

struct SumSqParams {
    u32 n;
    u32 offset;
};
HR_CHECK_SIZE(SumSqParams, 8);

// Fixed for a run: the clip norm and the loss scaler's settings.
struct FinalizeParams {
    u32 partials;
    float max_norm;
    float growth_factor;
    float backoff_factor;
    u32 growth_interval;
    float min_scale;
    float max_scale;
};
HR_CHECK_SIZE(FinalizeParams, 28);

struct AdamWParams {
    u32 n;
    u32 zero_grad;
    u32 decay;               // 1: apply the weight decay (a decay group)
    float beta1_complement;  // 1 - beta1
    float beta2;
    float beta2_complement;  // 1 - beta2
    float eps;
};
HR_CHECK_SIZE(AdamWParams, 28);

// The factors of one learning rate at one t.
struct AdamWScalars {
    float decay_factor;           // 1 - lr * weight_decay
    float neg_step_size;          // -lr / (1 - beta1^t)
    float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
};
HR_CHECK_SIZE(AdamWScalars, 12);

// Written by the host before each step (a pinned copy on the stream): the
// step that finds `applied` steps applied before it uses
// at[applied - first_applied], its t being applied + 1.
#define HR_SCHEDULE_CANDIDATES 4
struct StepSchedule {
    u64 first_applied;
    u32 candidates;
    u32 unused;
    AdamWScalars at[HR_SCHEDULE_CANDIDATES];
};
HR_CHECK_SIZE(StepSchedule, 64);

// The sum of one value per thread of a block of 256, by a tree in shared
// memory (a fixed order); every thread returns it.
__device__ double block_sum_256(double v) {
    __shared__ double s[256];
    s[threadIdx.x] = v;
    __syncthreads();
    for (u32 stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            s[threadIdx.x] += s[threadIdx.x + stride];
        }
        __syncthreads();
    }
    return s[0];
}

// Launch with 256 threads per block.
extern "C" __global__ void grad_sumsq(SumSqParams p, const float* __restrict__ g,
                                      double* __restrict__ partials) {
    double acc = 0.0;
    HR_FOR_EACH(i, p.n) {
        const double v = (double)g[i];
        acc += v * v;
    }
    const double sum = block_sum_256(acc);
    if (threadIdx.x == 0) {
        partials[p.offset + blockIdx.x] = sum;
    }
}

// The sum of the partials (one per grad_sumsq block, a thousand or more):
// thread t adds every 256th from t, then the block's tree; a fixed order,
// and no thread walks them all. Every thread of the block returns it.
__device__ double sum_partials(u32 n, const double* __restrict__ partials) {
    double acc = 0.0;
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) {
        acc += partials[i];
    }
    return block_sum_256(acc);
}

// Launch with one block of 256 threads; thread 0 does all but the sum.
// `loss_scale` is the scale this step's gradients carry (step_commit leaves
// it holding the next step's).
extern "C" __global__ void step_finalize(FinalizeParams p, const double* __restrict__ partials,
                                         const StepSchedule* __restrict__ schedule,
                                         const float* __restrict__ loss_scale,
                                         StepState* __restrict__ state) {
    const double sumsq = sum_partials(p.partials, partials);
    if (threadIdx.x != 0) {
        return;
    }
    const StepState prev = *state;
    const float scale = *loss_scale;
    const float inv_loss_scale = 1.0f / scale;
    StepState out = prev;
    const double norm = sqrt(sumsq) * (double)inv_loss_scale;
    out.found_inf = hr_isfinite_d(sumsq) && hr_isfinite((float)norm) ? 0u : 1u;
    out.grad_norm = (float)norm;
    double clip = 1.0;
    if (!out.found_inf && p.max_norm > 0.0f && norm > (double)p.max_norm) {
        clip = (double)p.max_norm / (norm + 1e-6);
    }
    out.clip_factor = (float)clip;
    out.grad_factor = (float)(clip * (double)inv_loss_scale);

    const u64 j = prev.applied - schedule->first_applied;
    out.schedule_missed =
        prev.applied < schedule->first_applied || j >= (u64)schedule->candidates ? 1u : 0u;
    if (!out.schedule_missed) {
        const AdamWScalars f = schedule->at[j];
        out.decay_factor = f.decay_factor;
        out.neg_step_size = f.neg_step_size;
        out.bias_correction2_sqrt = f.bias_correction2_sqrt;
    }
    out.skipped = out.found_inf | out.schedule_missed;
    // Set by adamw_check if the update would overflow; step_commit folds it
    // in. The scaler and the count of applied steps are step_commit's too.
    out.update_overflow = 0u;
    *state = out;
}

// Launch with one thread, after adamw_check over every group and before
// adamw_fused. `loss_scale` is the scale this step's gradients carry; it is
// left holding the next step's.
extern "C" __global__ void step_commit(FinalizeParams p, float* __restrict__ loss_scale,
                                       StepState* __restrict__ state) {
    if (blockIdx.x != 0 || threadIdx.x != 0) {
        return;
    }
    StepState out = *state;
    out.skipped = out.found_inf | out.schedule_missed | out.update_overflow;
    const float scale = *loss_scale;
    float next = scale;
    if (out.schedule_missed) {
        // A host bug, reported by the host; the scaler stays as it was.
    } else if (out.found_inf) {
        next = fmaxf(scale * p.backoff_factor, p.min_scale);
        out.clean_steps = 0u;
    } else if (out.update_overflow) {
        // The gradients were fine at this scale: the learning rate (or a
        // gradient's square) overflows the update. The scaler stays as it
        // was; the host reports the skip.
    } else {
        out.applied = out.applied + 1ull;
        out.clean_steps = out.clean_steps + 1u;
        if (out.clean_steps >= p.growth_interval) {
            next = fminf(scale * p.growth_factor, p.max_scale);
            out.clean_steps = 0u;
        }
    }
    out.next_scale = next;
    *loss_scale = next;
    *state = out;
}

// The factors of one step for a group, from the StepState.
struct AdamWStep {
    float factor;  // grad_factor: a stored gradient to the clipped, unscaled one
    float decay_factor;
    float neg_step_size;
    float bias_correction2_sqrt;
};

__device__ __forceinline__ AdamWStep adamw_step_of(AdamWParams p, const StepState* state) {
    AdamWStep s;
    s.factor = state->grad_factor;
    s.decay_factor = p.decay ? state->decay_factor : 1.0f;
    s.neg_step_size = state->neg_step_size;
    s.bias_correction2_sqrt = state->bias_correction2_sqrt;
    return s;
}

// The new master weight and moments of one element: what adamw_fused writes
// and adamw_check judges. One function for both, so both make the same float
// operations in the same order (tests/cuda_ptx.rs checks that their PTX has
// the same f32 arithmetic).
struct AdamWElement {
    float m;
    float v;
    float w;
};

__device__ __forceinline__ AdamWElement adamw_element(AdamWParams p, AdamWStep s, float grad,
                                                      float master, float m, float v) {
    const float g = grad * s.factor;
    float mi = m;
    float vi = v;
    mi += p.beta1_complement * (g - mi);
    vi = p.beta2 * vi + p.beta2_complement * g * g;
    const float denom = sqrtf(vi) / s.bias_correction2_sqrt + p.eps;
    AdamWElement e;
    e.m = mi;
    e.v = vi;
    e.w = master * s.decay_factor + s.neg_step_size * (mi / denom);
    return e;
}

// With kCopy (mixed precision) a finite new master that rounds to an
// infinite f16 compute copy also counts: the layers would compute with inf.
// Launch over the group like adamw_fused; `state` is read (skipped, the
// factors) and, on overflow, its update_overflow set to 1.
template <bool kCopy>
__device__ void adamw_check_k(AdamWParams p, StepState* state, const float* __restrict__ master,
                              const float* __restrict__ grad, const float* __restrict__ m,
                              const float* __restrict__ v) {
    if (state->skipped != 0u) {
        return;
    }
    const AdamWStep s = adamw_step_of(p, state);
    bool finite = true;
    HR_FOR_EACH(i, p.n) {
        const AdamWElement e = adamw_element(p, s, grad[i], master[i], m[i], v[i]);
        // Branch-free, as on the CPU.
        finite &= hr_isfinite(e.m) & hr_isfinite(e.v) & hr_isfinite(e.w);
        if (kCopy) {
            finite &= (f2h(e.w) & HR_HALF_EXPONENT) != HR_HALF_EXPONENT;
        }
    }
    if (!finite) {
        state->update_overflow = 1u;
    }
}

extern "C" __global__ void adamw_check(AdamWParams p, StepState* state,
                                       const float* __restrict__ master,
                                       const float* __restrict__ grad,
                                       const float* __restrict__ m,
                                       const float* __restrict__ v) {
    adamw_check_k<true>(p, state, master, grad, m, v);
}

extern "C" __global__ void adamw_check_f32(AdamWParams p, StepState* state,
                                           const float* __restrict__ master,
                                           const float* __restrict__ grad,
                                           const float* __restrict__ m,
                                           const float* __restrict__ v) {
    adamw_check_k<false>(p, state, master, grad, m, v);
}

// With a compute copy (mixed precision) the new master weight is also
// written to it in f16; without one (f32 training) the layers read the
// masters themselves.
template <bool kCopy>
__device__ void adamw_fused_k(AdamWParams p, const StepState* __restrict__ state,
                              float* __restrict__ master, float* __restrict__ grad,
                              float* __restrict__ m, float* __restrict__ v,
                              hr_half* __restrict__ compute_copy) {
    const bool skip = state->skipped != 0u;
    const AdamWStep s = adamw_step_of(p, state);
    HR_FOR_EACH(i, p.n) {
        if (!skip) {
            const AdamWElement e = adamw_element(p, s, grad[i], master[i], m[i], v[i]);
            m[i] = e.m;
            v[i] = e.v;
            master[i] = e.w;
            if (kCopy) {
                compute_copy[i] = f2h(e.w);
            }
        }
        if (p.zero_grad) {
            grad[i] = 0.0f;
        }
    }
}

extern "C" __global__ void adamw_fused(AdamWParams p, const StepState* __restrict__ state,
                                       float* __restrict__ master, float* __restrict__ grad,
                                       float* __restrict__ m, float* __restrict__ v,
                                       hr_half* __restrict__ compute_copy) {
    adamw_fused_k<true>(p, state, master, grad, m, v, compute_copy);
}

extern "C" __global__ void adamw_fused_f32(AdamWParams p, const StepState* __restrict__ state,
                                           float* __restrict__ master, float* __restrict__ grad,
                                           float* __restrict__ m, float* __restrict__ v) {
    adamw_fused_k<false>(p, state, master, grad, m, v, nullptr);
}
