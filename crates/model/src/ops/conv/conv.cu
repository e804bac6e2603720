// im2col / col2im for 2-D convolution in NHWC (the CPU's Conv2d layout):
// input x [N, H, W, Cin], weight [KH, KW, Cin, Cout] = W[K, Cout] with
// K = KH*KW*Cin in (ky, kx, ci) order, output y [N, OH, OW, Cout]. One row of
// the im2col matrix A [N*OH*OW, K] is the receptive field of one output pixel,
// so the convolution is Y = A W, and the GEMMs go to cuBLAS (f16 or f32
// operands as the storage T, f32 accumulation):
//   forward   Y  = A W            (T out)
//   backward  dW += A^T dY        (f32 out, accumulated)
//             dA = dY W^T         (T out), then dX = col2im(dA)
// Both kernels work on a range of images [n0, n0 + images) so that A can be
// built for part of the batch at a time (the wrapper picks the range from a
// scratch budget); row 0 of A / dA is output pixel 0 of image n0.
// col2im gathers (each input element sums the taps that read it, in f32) so
// it needs no atomics and is deterministic. Both split flat indices with
// the host's FastDiv multipliers instead of division instructions: a
// division by a run-time value costs a GPU some twenty instructions, and
// these kernels took five or more per element (col2im two per tap).
// Compiled and emulated, not yet timed on a GPU.
#include "common.cuh"

struct ConvParams {
    u32 h;
    u32 w;
    u32 cin;
    u32 oh;
    u32 ow;
    u32 k;
    u32 stride;
    u32 pad;
    u32 n0;
    u32 images;
    // Divisors of the index math, each set up by the host (hr_div).
    FastDiv by_kk;     // k*k*cin
    FastDiv by_opix;   // oh*ow
    FastDiv by_ow;
    FastDiv by_kcin;   // k*cin
    FastDiv by_cin;
    FastDiv by_image;  // h*w*cin
    FastDiv by_wcin;   // w*cin
    FastDiv by_stride;
};
HR_CHECK_SIZE(ConvParams, 104);

// a[row, col] for row in this range's output pixels, col in [0, K).
template <typename T>
__device__ void im2col_k(ConvParams p, const T* __restrict__ x,
                                  T* __restrict__ a) {
    const u32 kk = p.k * p.k * p.cin;
    const u32 opix = p.oh * p.ow;
    const u32 total = p.images * opix * kk;
    const u32 kcin = p.k * p.cin;
    HR_FOR_EACH(i, total) {
        const u32 row = hr_div(p.by_kk, i);
        const u32 col = i - row * kk;
        const u32 img = hr_div(p.by_opix, row);
        const u32 pix = row - img * opix;
        const u32 oy = hr_div(p.by_ow, pix);
        const u32 ox = pix - oy * p.ow;
        const u32 ky = hr_div(p.by_kcin, col);
        const u32 rem = col - ky * kcin;
        const u32 kx = hr_div(p.by_cin, rem);
        const u32 ci = rem - kx * p.cin;
        // Signed: the padding reaches before row/column 0.
        const int iy = (int)(oy * p.stride + ky) - (int)p.pad;
        const int ix = (int)(ox * p.stride + kx) - (int)p.pad;
        T v = 0;
        if (iy >= 0 && iy < (int)p.h && ix >= 0 && ix < (int)p.w) {
            v = x[(((p.n0 + img) * p.h + (u32)iy) * p.w + (u32)ix) * p.cin + ci];
        }
        a[i] = v;
    }
}

// dx[n0 + img, iy, ix, ci] = sum over taps (ky, kx) with
// oy*stride + ky - pad == iy (and the same for x) of da[row(img, oy, ox), col].
// Writes every element of the images in range (zero where no tap reaches).
template <typename T>
__device__ void col2im_k(ConvParams p, const T* __restrict__ da,
                                  T* __restrict__ dx) {
    const u32 kk = p.k * p.k * p.cin;
    const u32 opix = p.oh * p.ow;
    const u32 image = p.h * p.w * p.cin;
    const u32 total = p.images * image;
    const u32 wcin = p.w * p.cin;
    HR_FOR_EACH(i, total) {
        const u32 img = hr_div(p.by_image, i);
        const u32 rem = i - img * image;
        const u32 iy = hr_div(p.by_wcin, rem);
        const u32 in_row = rem - iy * wcin;
        const u32 ix = hr_div(p.by_cin, in_row);
        const u32 ci = in_row - ix * p.cin;
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
                const u32 row = img * opix + oy * p.ow + ox;
                const u32 col = (ky * p.k + kx) * p.cin + ci;
                acc += hr_ld(da[row * kk + col]);
            }
        }
        hr_st(&dx[(p.n0 + img) * image + rem], acc);
    }
}

// The same two kernels 8 channels at a time, for f16 with cin % 8 == 0:
// one 16-byte load and store per 8 elements (an 8-channel run never leaves
// its tap), and the index math once per 8. A copy and the same per-channel
// f32 sums in the same tap order, so the same bits as the scalar kernels.
// i counts vectors; 8i < 2^31 since every buffer holds fewer elements.
extern "C" __global__ void im2col_v8_f16(ConvParams p, const hr_half* __restrict__ x,
                                         hr_half* __restrict__ a) {
    const u32 kk = p.k * p.k * p.cin;
    const u32 opix = p.oh * p.ow;
    const u32 kcin = p.k * p.cin;
    const u32 vectors = p.images * opix * kk / 8u;
    HR_FOR_EACH(i, vectors) {
        const u32 row = hr_div(p.by_kk, 8u * i);
        const u32 col = 8u * i - row * kk;
        const u32 img = hr_div(p.by_opix, row);
        const u32 pix = row - img * opix;
        const u32 oy = hr_div(p.by_ow, pix);
        const u32 ox = pix - oy * p.ow;
        const u32 ky = hr_div(p.by_kcin, col);
        const u32 rem = col - ky * kcin;
        const u32 kx = hr_div(p.by_cin, rem);
        const u32 ci = rem - kx * p.cin;
        const int iy = (int)(oy * p.stride + ky) - (int)p.pad;
        const int ix = (int)(ox * p.stride + kx) - (int)p.pad;
        HalfVec8 v = {{0u, 0u, 0u, 0u}};
        if (iy >= 0 && iy < (int)p.h && ix >= 0 && ix < (int)p.w) {
            v = hr_ld_vec8(x + (((p.n0 + img) * p.h + (u32)iy) * p.w + (u32)ix) * p.cin + ci);
        }
        hr_st_vec8(a + 8u * i, v);
    }
}

extern "C" __global__ void col2im_v8_f16(ConvParams p, const hr_half* __restrict__ da,
                                         hr_half* __restrict__ dx) {
    const u32 kk = p.k * p.k * p.cin;
    const u32 opix = p.oh * p.ow;
    const u32 image = p.h * p.w * p.cin;
    const u32 wcin = p.w * p.cin;
    const u32 vectors = p.images * image / 8u;
    HR_FOR_EACH(i, vectors) {
        const u32 e = 8u * i;
        const u32 img = hr_div(p.by_image, e);
        const u32 rem = e - img * image;
        const u32 iy = hr_div(p.by_wcin, rem);
        const u32 in_row = rem - iy * wcin;
        const u32 ix = hr_div(p.by_cin, in_row);
        const u32 ci = in_row - ix * p.cin;
        float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
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
                const u32 row = img * opix + oy * p.ow + ox;
                const HalfVec8 v = hr_ld_vec8(da + row * kk + (ky * p.k + kx) * p.cin + ci);
                for (u32 c = 0; c < 8; ++c) {
                    acc[c] += hr_vec8_at(v, c);
                }
            }
        }
        hr_st_vec8(dx + (p.n0 + img) * image + rem, hr_vec8_of(acc));
    }
}

// Entry points, one per storage type.
extern "C" __global__ void im2col_f16(ConvParams p, const hr_half* __restrict__ x,
                                      hr_half* __restrict__ a) {
    im2col_k(p, x, a);
}

extern "C" __global__ void im2col_f32(ConvParams p, const float* __restrict__ x,
                                      float* __restrict__ a) {
    im2col_k(p, x, a);
}

extern "C" __global__ void col2im_f16(ConvParams p, const hr_half* __restrict__ da,
                                      hr_half* __restrict__ dx) {
    col2im_k(p, da, dx);
}

extern "C" __global__ void col2im_f32(ConvParams p, const float* __restrict__ da,
                                      float* __restrict__ dx) {
    col2im_k(p, da, dx);
}

// The weight gradient of conv_mma.cu's implicit kernels and of
// conv_narrow.cu is summed over fixed splits of the pixels, each split
// writing an f32 partial of dW; this adds them. Here, in a file of plain
// kernels, so that the narrow kernels need no sm_80 (conv_mma.cu's mma).
struct WgradReduceParams {
    u32 n;       // dW's length
    u32 splits;
};
HR_CHECK_SIZE(WgradReduceParams, 8);

// dw[i] += the splits' partials of element i. A block is blockDim.x
// consecutive elements by blockDim.y lanes (a power of two, the block at
// most WGRAD_REDUCE_THREADS): lane l sums splits l, l + lanes, ... in that
// order, then the lanes are added in a fixed tree, so the bits depend on
// the shape and the launch alone. One thread an element walking every
// split in a chain (the first form) kept a few SMs busy: an H200's Nsight
// Compute timed it at 34 us a launch, 3% of the memory bandwidth.
#define WGRAD_REDUCE_THREADS 256
extern "C" __global__ void wgrad_reduce(WgradReduceParams p, const float* __restrict__ partial,
                                        float* __restrict__ dw) {
    __shared__ float s_sum[WGRAD_REDUCE_THREADS];
    const u32 cols = blockDim.x, lanes = blockDim.y;
    const u32 i = blockIdx.x * cols + threadIdx.x;
    const u32 slot = threadIdx.y * cols + threadIdx.x;
    float sum = 0.0f;
    if (i < p.n) {
#pragma unroll 4
        for (u32 z = threadIdx.y; z < p.splits; z += lanes) {
            sum += partial[z * p.n + i];
        }
    }
    s_sum[slot] = sum;
    __syncthreads();
    for (u32 half = lanes / 2; half > 0; half /= 2) {
        if (threadIdx.y < half) {
            s_sum[slot] += s_sum[slot + half * cols];
        }
        __syncthreads();
    }
    if (threadIdx.y == 0 && i < p.n) {
        dw[i] += s_sum[slot];
    }
}
