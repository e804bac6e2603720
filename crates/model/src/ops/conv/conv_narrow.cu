// Convolutions with fewer than 8 output channels (a frame predictor's last
// layer to one channel, an RGB head), direct, in NHWC, under
// device.conv_algorithm = "auto". Through im2col + cuBLAS each pass of such
// a layer is a matrix product one to seven columns wide behind an im2col
// copy of k*k*Cin values per pixel: conv_lstm's 17 -> 1 head over 320
// frames of 64x64 makes 400 MB of im2col matrix per pass, 25 image groups
// of a 16 MiB workspace, each an im2col and a thin GEMM (and a col2im for
// dX). Here nothing the size of im2col is made:
//   narrow_forward       y[pixel, co] = sum over (ky, kx, ci) of
//                        x[tap] * W[ky, kx, ci, co]: a thread per output
//                        pixel, all its (at most 7) outputs in registers,
//                        summed in f32 in (ky, kx, ci) order, rounded once
//   narrow_grad_input    dx[pixel, ci] = sum over the taps that reach it of
//                        dy[out, co] * W[ky, kx, ci, co]: a thread per
//                        input element, gathering (no atomics)
//   narrow_wgrad         dW[ky, kx, ci, co] over the pixels of one split:
//                        a thread per weight, its f32 partial written for
//                        conv.cu's wgrad_reduce to add in split order
// Splits are fixed by the shape (host side), so the bits do not depend on
// the GPU or the run. Run on GPUs: cuda_parity's narrow tests passed on an
// H100 (bundle of e66ba44) and an H200 (bundles of a350b0d and 1597ca2).
//
// The other thin case: few input channels (cin not a multiple of 8, so no
// implicit GEMM) into a multiple of 8 outputs, in f16 (a network's first
// convolution, 1 -> 32 on Fashion-MNIST, 3 -> 64 on RGB). Through im2col
// its product is k*k*cin deep (9 for one channel), which cuBLAS multiplies
// with kernels for unaligned operands. Here:
//   thin_forward_f16     y[pixel, 8g..8g+7]: a thread per output pixel and
//                        group of 8 outputs, summed in f32 in (ky, kx, ci)
//                        order from 16-byte rows of W, one 16-byte store
//   thin_wgrad_f16       dW over the pixels of one split: a thread per
//                        (tap, ci, group of 8 outputs) and row lane, 16-byte
//                        loads of dy, the lanes then added in a fixed order;
//                        f32 partials for wgrad_reduce, as narrow_wgrad's
// and the input gradient, where one is wanted (not for a first layer),
// narrow_grad_input's gather, which takes any cout.
#include "common.cuh"

#define NARROW_COUT 7

struct NarrowParams {
    u32 n;
    u32 h;
    u32 w;
    u32 cin;
    u32 cout;
    u32 oh;
    u32 ow;
    u32 k;
    u32 stride;
    u32 pad;
    u32 rows_per_split;  // narrow_wgrad: output pixels a split sums
    FastDiv by_opix;     // oh * ow
    FastDiv by_ow;
    FastDiv by_hw;       // h * w
    FastDiv by_w;
    FastDiv by_cin;
    FastDiv by_cout;
    FastDiv by_stride;
};
HR_CHECK_SIZE(NarrowParams, 100);

// The forward's taps of output pixel `row`, in (ky, kx) order, those
// inside the input: body(xs, tap), xs the input's channels at the tap.
template <typename T, typename Body>
__device__ __forceinline__ void narrow_taps(const NarrowParams& p, const T* x, u32 row, Body body) {
    const u32 opix = p.oh * p.ow;
    const u32 img = hr_div(p.by_opix, row);
    const u32 pix = row - img * opix;
    const u32 oy = hr_div(p.by_ow, pix);
    const u32 ox = pix - oy * p.ow;
    for (u32 ky = 0; ky < p.k; ++ky) {
        const int iy = (int)(oy * p.stride + ky) - (int)p.pad;
        if (iy < 0 || iy >= (int)p.h) {
            continue;
        }
        for (u32 kx = 0; kx < p.k; ++kx) {
            const int ix = (int)(ox * p.stride + kx) - (int)p.pad;
            if (ix < 0 || ix >= (int)p.w) {
                continue;
            }
            body(x + ((img * p.h + (u32)iy) * p.w + (u32)ix) * p.cin, ky * p.k + kx);
        }
    }
}

// The element of x that weight (ky, kx, ci) multiplies for output pixel
// `row`, or null where the tap falls in the padding.
template <typename T>
__device__ __forceinline__ const T* narrow_tap_input(const NarrowParams& p, const T* x, u32 row, u32 ky,
                                                     u32 kx, u32 ci) {
    const u32 opix = p.oh * p.ow;
    const u32 img = hr_div(p.by_opix, row);
    const u32 pix = row - img * opix;
    const u32 oy = hr_div(p.by_ow, pix);
    const u32 ox = pix - oy * p.ow;
    const int iy = (int)(oy * p.stride + ky) - (int)p.pad;
    const int ix = (int)(ox * p.stride + kx) - (int)p.pad;
    if (iy < 0 || iy >= (int)p.h || ix < 0 || ix >= (int)p.w) {
        return nullptr;
    }
    return x + ((img * p.h + (u32)iy) * p.w + (u32)ix) * p.cin + ci;
}

template <typename T>
__device__ void narrow_forward_k(NarrowParams p, const T* __restrict__ x,
                                 const T* __restrict__ wt, T* __restrict__ y) {
    HR_FOR_EACH(row, p.n * p.oh * p.ow) {
        float acc[NARROW_COUT] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        narrow_taps(p, x, row, [&](const T* xs, u32 tap) {
            const T* ws = wt + tap * p.cin * p.cout;
            for (u32 ci = 0; ci < p.cin; ++ci) {
                const float v = hr_ld(xs[ci]);
#pragma unroll
                for (u32 co = 0; co < NARROW_COUT; ++co) {
                    if (co < p.cout) {
                        acc[co] += v * hr_ld(ws[ci * p.cout + co]);
                    }
                }
            }
        });
#pragma unroll
        for (u32 co = 0; co < NARROW_COUT; ++co) {
            if (co < p.cout) {
                hr_st(y + row * p.cout + co, acc[co]);
            }
        }
    }
}

template <typename T>
__device__ void narrow_grad_input_k(NarrowParams p, const T* __restrict__ dy,
                                    const T* __restrict__ wt, T* __restrict__ dx) {
    const u32 hw = p.h * p.w;
    HR_FOR_EACH(e, p.n * hw * p.cin) {
        const u32 in_pix = hr_div(p.by_cin, e);
        const u32 ci = e - in_pix * p.cin;
        const u32 img = hr_div(p.by_hw, in_pix);
        const u32 rem = in_pix - img * hw;
        const u32 iy = hr_div(p.by_w, rem);
        const u32 ix = rem - iy * p.w;
        float acc = 0.0f;
        for (u32 ky = 0; ky < p.k; ++ky) {
            u32 oy = 0;
            if (!hr_tap_source(iy, ky, p.pad, p.stride, p.by_stride, p.oh, &oy)) {
                continue;
            }
            for (u32 kx = 0; kx < p.k; ++kx) {
                u32 ox = 0;
                if (!hr_tap_source(ix, kx, p.pad, p.stride, p.by_stride, p.ow, &ox)) {
                    continue;
                }
                const T* g = dy + ((img * p.oh + oy) * p.ow + ox) * p.cout;
                const T* ws = wt + ((ky * p.k + kx) * p.cin + ci) * p.cout;
                for (u32 co = 0; co < p.cout; ++co) {
                    acc += hr_ld(g[co]) * hr_ld(ws[co]);
                }
            }
        }
        hr_st(dx + e, acc);
    }
}

// Block (256) x split: thread j of the block row holds weight element j of
// [k, k, cin, cout] and sums x * dy over the split's output pixels.
template <typename T>
__device__ void narrow_wgrad_k(NarrowParams p, const T* __restrict__ x,
                               const T* __restrict__ dy, float* __restrict__ partial) {
    const u32 n_w = p.k * p.k * p.cin * p.cout;
    const u32 j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n_w) {
        return;
    }
    const u32 tap_ci = hr_div(p.by_cout, j);
    const u32 co = j - tap_ci * p.cout;
    const u32 tap = hr_div(p.by_cin, tap_ci);
    const u32 ci = tap_ci - tap * p.cin;
    const u32 ky = tap / p.k;
    const u32 kx = tap - ky * p.k;
    const u32 rows = p.n * p.oh * p.ow;
    const u32 r0 = blockIdx.y * p.rows_per_split;
    const u32 r1 = min(r0 + p.rows_per_split, rows);
    float acc = 0.0f;
    for (u32 row = r0; row < r1; ++row) {
        const T* xe = narrow_tap_input(p, x, row, ky, kx, ci);
        if (xe != nullptr) {
            acc += hr_ld(*xe) * hr_ld(dy[row * p.cout + co]);
        }
    }
    partial[blockIdx.y * n_w + j] = acc;
}

// Thread e: output pixel 8e / cout, outputs 8e mod cout .. + 7.
extern "C" __global__ void thin_forward_f16(NarrowParams p, const hr_half* __restrict__ x,
                                            const hr_half* __restrict__ wt, hr_half* __restrict__ y) {
    HR_FOR_EACH(e, p.n * p.oh * p.ow * (p.cout / 8u)) {
        const u32 row = hr_div(p.by_cout, 8u * e);
        const u32 co = 8u * e - row * p.cout;
        float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        narrow_taps(p, x, row, [&](const hr_half* xs, u32 tap) {
            const hr_half* ws = wt + tap * p.cin * p.cout + co;
            for (u32 ci = 0; ci < p.cin; ++ci) {
                const float v = hr_ld(xs[ci]);
                const HalfVec8 w8 = hr_ld_vec8(ws + ci * p.cout);
                for (u32 j = 0; j < 8; ++j) {
                    acc[j] = fmaf(v, hr_vec8_at(w8, j), acc[j]);
                }
            }
        });
        hr_st_vec8(y + row * p.cout + co, hr_vec8_of(acc));
    }
}

// Block (256) per split: thread t holds outputs 8g..8g+7 of weight row
// (tap, ci) for kg = t mod (k*k*cin * cout/8) = (tap*cin + ci)*cout/8 + g,
// and row lane t / that (lanes of the block: 256 / it, at least 1, host
// checked); a lane sums every lanes-th pixel of the split, then the lanes'
// sums are added in lane order.
#define THIN_THREADS 256u
extern "C" __global__ void thin_wgrad_f16(NarrowParams p, const hr_half* __restrict__ x,
                                          const hr_half* __restrict__ dy, float* __restrict__ partial) {
    __shared__ float sums[THIN_THREADS * 8u];
    const u32 groups = p.cout / 8u;
    const u32 n_kg = p.k * p.k * p.cin * groups;
    const u32 lanes = THIN_THREADS / n_kg;
    const u32 kg = threadIdx.x % n_kg;
    const u32 lane = threadIdx.x / n_kg;
    const u32 tap_ci = kg / groups;
    const u32 co = 8u * (kg - tap_ci * groups);
    const u32 tap = tap_ci / p.cin;
    const u32 ci = tap_ci - tap * p.cin;
    const u32 ky = tap / p.k;
    const u32 kx = tap - ky * p.k;
    const u32 rows = p.n * p.oh * p.ow;
    const u32 r0 = blockIdx.x * p.rows_per_split;
    const u32 r1 = min(r0 + p.rows_per_split, rows);
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (lane < lanes) {
        for (u32 row = r0 + lane; row < r1; row += lanes) {
            const hr_half* xe = narrow_tap_input(p, x, row, ky, kx, ci);
            if (xe == nullptr) {
                continue;
            }
            const float v = hr_ld(*xe);
            const HalfVec8 g8 = hr_ld_vec8(dy + row * p.cout + co);
            for (u32 j = 0; j < 8; ++j) {
                acc[j] = fmaf(v, hr_vec8_at(g8, j), acc[j]);
            }
        }
    }
    for (u32 j = 0; j < 8; ++j) {
        sums[threadIdx.x * 8u + j] = acc[j];
    }
    __syncthreads();
    // Element i = 8 kg + j of the partial is weight (tap*cin + ci)*cout + co + j.
    for (u32 i = threadIdx.x; i < 8u * n_kg; i += THIN_THREADS) {
        float total = 0.0f;
        for (u32 l = 0; l < lanes; ++l) {
            total += sums[l * n_kg * 8u + i];
        }
        partial[blockIdx.x * 8u * n_kg + i] = total;
    }
}

// Entry points, one per storage type.
extern "C" __global__ void narrow_forward_f16(NarrowParams p, const hr_half* __restrict__ x,
                                              const hr_half* __restrict__ wt,
                                              hr_half* __restrict__ y) {
    narrow_forward_k(p, x, wt, y);
}

extern "C" __global__ void narrow_forward_f32(NarrowParams p, const float* __restrict__ x,
                                              const float* __restrict__ wt,
                                              float* __restrict__ y) {
    narrow_forward_k(p, x, wt, y);
}

extern "C" __global__ void narrow_grad_input_f16(NarrowParams p, const hr_half* __restrict__ dy,
                                                 const hr_half* __restrict__ wt,
                                                 hr_half* __restrict__ dx) {
    narrow_grad_input_k(p, dy, wt, dx);
}

extern "C" __global__ void narrow_grad_input_f32(NarrowParams p, const float* __restrict__ dy,
                                                 const float* __restrict__ wt,
                                                 float* __restrict__ dx) {
    narrow_grad_input_k(p, dy, wt, dx);
}

extern "C" __global__ void narrow_wgrad_f16(NarrowParams p, const hr_half* __restrict__ x,
                                            const hr_half* __restrict__ dy,
                                            float* __restrict__ partial) {
    narrow_wgrad_k(p, x, dy, partial);
}

extern "C" __global__ void narrow_wgrad_f32(NarrowParams p, const float* __restrict__ x,
                                            const float* __restrict__ dy,
                                            float* __restrict__ partial) {
    narrow_wgrad_k(p, x, dy, partial);
}
