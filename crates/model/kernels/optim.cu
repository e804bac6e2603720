// The optimizer step on the device, with no host synchronisation:
//
//   grad_sumsq      sum of squares of a range of f32 gradients (still
//                   multiplied by the loss scale), one f64 partial per block
//                   into partials[offset + blockIdx.x]
//   step_finalize   one thread: sums the partials in order (f64), sets
//                   found_inf if the sum is not finite, the global norm of the
//                   UNSCALED gradients, the clip factor (PyTorch's
//                   clip_grad_norm_: max_norm / (norm + 1e-6) when
//                   norm > max_norm, as in headroom-optim's clip.rs) and the
//                   factor that turns a stored gradient into the clipped,
//                   unscaled one; writes them into a StepState in device memory
//   adamw_fused     per parameter group (a contiguous range of master
//                   weights, gradients and moments): reads the StepState and
//                   the step's AdamWScalars (lr and t, from the host); on
//                   found_inf it changes nothing (the step is skipped); else
//                   g = grad * factor, AdamW exactly as headroom-optim's
//                   adamw.rs (PyTorch semantics), the f32 master update and the
//                   f16 write-back of the compute copy. With zero_grad it also
//                   clears the gradients (skipped step or not) for the next
//                   accumulation.
//
// The host reads the 16-byte StepState (the loss scaler's flag and the norm
// for the logs) whenever it likes; the weights never depend on that read.
#include "common.cuh"

struct StepState {
    u32 found_inf;
    float grad_norm;
    float clip_factor;
    float grad_factor;
};
HR_CHECK_SIZE(StepState, 16);

struct SumSqParams {
    u32 n;
    u32 offset;
};
HR_CHECK_SIZE(SumSqParams, 8);

struct FinalizeParams {
    u32 partials;
    float inv_loss_scale;
    float max_norm;
};
HR_CHECK_SIZE(FinalizeParams, 12);

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

// What changes from step to step (the learning rate and t), in device
// memory, written by the host before each step: a step captured into a CUDA
// graph then replays with the values of the step it is launched for.
struct AdamWScalars {
    float decay_factor;           // 1 - lr * weight_decay
    float neg_step_size;          // -lr / (1 - beta1^t)
    float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
};
HR_CHECK_SIZE(AdamWScalars, 12);

// Launch with 256 threads per block.
extern "C" __global__ void grad_sumsq(SumSqParams p, const float* __restrict__ g,
                                      double* __restrict__ partials) {
    __shared__ double s[256];
    double acc = 0.0;
    HR_FOR_EACH(i, p.n) {
        const double v = (double)g[i];
        acc += v * v;
    }
    s[threadIdx.x] = acc;
    __syncthreads();
    for (u32 stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            s[threadIdx.x] += s[threadIdx.x + stride];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        partials[p.offset + blockIdx.x] = s[0];
    }
}

// Launch with one thread.
extern "C" __global__ void step_finalize(FinalizeParams p, const double* __restrict__ partials,
                                         StepState* __restrict__ state) {
    if (blockIdx.x != 0 || threadIdx.x != 0) {
        return;
    }
    double sumsq = 0.0;
    for (u32 i = 0; i < p.partials; ++i) {
        sumsq += partials[i];
    }
    StepState out;
    const double norm = sqrt(sumsq) * (double)p.inv_loss_scale;
    out.found_inf = hr_isfinite_d(sumsq) && hr_isfinite((float)norm) ? 0u : 1u;
    out.grad_norm = (float)norm;
    double clip = 1.0;
    if (!out.found_inf && p.max_norm > 0.0f && norm > (double)p.max_norm) {
        clip = (double)p.max_norm / (norm + 1e-6);
    }
    out.clip_factor = (float)clip;
    out.grad_factor = (float)(clip * (double)p.inv_loss_scale);
    *state = out;
}

extern "C" __global__ void adamw_fused(AdamWParams p, const AdamWScalars* __restrict__ scalars,
                                       const StepState* __restrict__ state,
                                       float* __restrict__ master, float* __restrict__ grad,
                                       float* __restrict__ m, float* __restrict__ v,
                                       hr_half* __restrict__ compute_copy) {
    const bool skip = state->found_inf != 0u;
    const float factor = state->grad_factor;
    const float decay_factor = p.decay ? scalars->decay_factor : 1.0f;
    const float neg_step_size = scalars->neg_step_size;
    const float bias_correction2_sqrt = scalars->bias_correction2_sqrt;
    HR_FOR_EACH(i, p.n) {
        if (!skip) {
            const float g = grad[i] * factor;
            float mi = m[i];
            float vi = v[i];
            mi += p.beta1_complement * (g - mi);
            vi = p.beta2 * vi + p.beta2_complement * g * g;
            const float denom = sqrtf(vi) / bias_correction2_sqrt + p.eps;
            const float w = master[i] * decay_factor + neg_step_size * (mi / denom);
            m[i] = mi;
            v[i] = vi;
            master[i] = w;
            compute_copy[i] = f2h(w);
        }
        if (p.zero_grad) {
            grad[i] = 0.0f;
        }
    }
}
