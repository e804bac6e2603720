// Implicit-GEMM convolution on the tensor cores (`device.conv_algorithm =
// "implicit_gemm"`): the same product as im2col + GEMM (conv.cu), but the
// rows of the im2col matrix are gathered straight from the NHWC tensor into
// shared memory, tile by tile, so the matrix never exists in device memory.
// im2col writes and reads k*k times the input (9x for 3x3); this reads it
// about once per column block, and needs no workspace.
//
// One kernel does two products (p.transposed):
//   forward      y [M = n*oh*ow, cout] = A W,
//                A[(img, oy, ox), (ky, kx, ci)] = x[img, oy*s + ky - pad, ox*s + kx - pad, ci]
//   input grad   dx[M = n*h*w, cin]    = A' W',
//                A'[(img, iy, ix), (ky, kx, co)] = dy[img, (iy + pad - ky)/s, ...] where
//                the division is exact and in range (else 0),
//                W'[(ky, kx, co), ci] = W[ky, kx, ci, co]
// so the input gradient is one pass with one f32 sum per element and one
// rounding to f16 (im2col's dA = dY W^T is rounded to f16 before col2im
// sums it). The weight gradient (wgrad_k, below) gathers A the same way and
// sums over the pixels in per-block partials.
//
// Tiles: a block of 128 threads (4 warps) computes 128 rows x BN columns
// (BN = 32 or 64) in steps of 32 along K. Each thread gathers one 8-channel
// vector (16 bytes) of 4 rows per step and 8 or 16 weights of B; while the warps
// multiply the tile in shared memory (mma.sync m16n8k16, f16 operands, f32
// accumulators, warp w owning rows 32w..32w+31), the next step's loads are
// in flight in registers. Shared rows are padded to 40 halves, so the
// fragment reads (row g, column 2t of a warp) hit 32 different banks.
//
// Needs: f16, channels of the gathered tensor % 8 == 0 (a vector stays in
// one tap), output columns % 8 == 0, whole tensors (256-byte aligned), and
// sm_80 or newer (the host checks all of these and uses im2col otherwise).
// Memory: at most 15 KiB of shared memory per block; the only device
// memory besides the tensors is the weight gradient's f32 partials.
// Emulated on the CPU (the mma through a warp exchange with the fragment
// layout of the PTX ISA); compiled, not yet run on a GPU.
#include "common.cuh"

struct ImplicitConvParams {
    u32 rows;        // M: pixels of the output tensor (n * row_h * row_w)
    u32 cols;        // N: channels of the output tensor
    u32 depth;       // K: k * k * chans
    u32 chans;       // channels of the gathered tensor
    u32 src_h;       // spatial size of the gathered tensor
    u32 src_w;
    u32 row_h;       // spatial size of the output tensor
    u32 row_w;
    u32 k;
    u32 stride;
    u32 pad;
    u32 transposed;  // 0: forward gather; 1: input-gradient gather
    // B[(tap, c), j] = w[tap * chans * cols + c * b_chan_stride + j * b_col_stride]
    u32 b_chan_stride;
    u32 b_col_stride;
    FastDiv by_row_pix;  // row_h * row_w
    FastDiv by_row_w;
    FastDiv by_chans;
    FastDiv by_k;
    FastDiv by_stride;
};
HR_CHECK_SIZE(ImplicitConvParams, 96);

#define IC_BM 128
#define IC_BK 32
#define IC_LD (IC_BK + 8)
#define IC_THREADS 128


template <int BN>
struct alignas(16) ImplicitTiles {
    hr_half a[IC_BM][IC_LD];
    hr_half b[BN][IC_LD];
};

// d += A B for one warp: A 16x16 (row-major fragments a), B 16x8
// (column-major fragments b), f32 accumulators d, in the fragment layout of
// the PTX ISA for mma.m16n8k16 (lane = 4 * group + t):
//   a[0] = A[g][2t..2t+1]   a[1] = A[g+8][2t..]   a[2] = A[g][2t+8..]   a[3] = A[g+8][2t+8..]
//   b[0] = B[2t..2t+1][g]   b[1] = B[2t+8..2t+9][g]
//   d[0..1] = D[g][2t..2t+1]   d[2..3] = D[g+8][2t..2t+1]
// with the lower-indexed half in the low 16 bits of each register.
#ifndef HR_EMULATE
__device__ __forceinline__ void hr_mma_16816(float d[4], const u32 a[4], const u32 b[2]) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    // The host never launches this below sm_80 (ops::implicit_conv_fits).
    asm volatile("trap;");
#endif
}
#else
// The emulator: every lane hands its fragments to the warp, rebuilds A and B
// from the 32 lanes by the layout above, and computes its own four outputs.
__device__ __forceinline__ float hr_fragment_half(const u64* regs, u32 lane, u32 reg, u32 high) {
    const u64 pair = regs[lane];
    const u32 word = (u32)(reg & 1u ? pair >> 32 : pair);
    return h2f((hr_half)(high ? word >> 16 : word & 0xffffu));
}

__device__ __forceinline__ void hr_mma_16816(float d[4], const u32 a[4], const u32 b[2]) {
    u64 a01[32], a23[32], bb[32];
    unsigned int lane = 0;
    ::hr_emu::warp_exchange((u64)a[0] | (u64)a[1] << 32, a01, &lane);
    ::hr_emu::warp_exchange((u64)a[2] | (u64)a[3] << 32, a23, &lane);
    ::hr_emu::warp_exchange((u64)b[0] | (u64)b[1] << 32, bb, &lane);
    const u32 g = lane >> 2;
    const u32 t = lane & 3u;
    for (u32 i = 0; i < 4; ++i) {
        const u32 row = g + (i >= 2 ? 8u : 0u);
        const u32 col = 2u * t + (i & 1u);
        float acc = d[i];
        for (u32 kk = 0; kk < 16; ++kk) {
            // A[row][kk]: lane 4 (row % 8) + (kk % 8) / 2, register
            // (row >= 8) + 2 (kk >= 8); B[kk][col]: lane 4 col + (kk % 8) / 2,
            // register (kk >= 8).
            const u32 a_lane = 4u * (row & 7u) + ((kk & 7u) >> 1);
            const u32 a_reg = (row >= 8 ? 1u : 0u) + (kk >= 8 ? 2u : 0u);
            const float av = hr_fragment_half(a_reg < 2 ? a01 : a23, a_lane, a_reg, kk & 1u);
            const float bv = hr_fragment_half(bb, 4u * col + ((kk & 7u) >> 1), kk >= 8 ? 1u : 0u, kk & 1u);
            acc += av * bv;
        }
        d[i] = acc;
    }
}
#endif


// The 8 channels c..c+7 of the gathered tensor that output row (img, ry, rx)
// reads at tap (ky, kx), or zeros (padding, a stride the tap misses, a row
// past the end: img_row < 0).
__device__ __forceinline__ HalfVec8 gather8(const ImplicitConvParams& p, const hr_half* __restrict__ src,
                                            int img_row, int ry, int rx, u32 ky, u32 kx, u32 c) {
    HalfVec8 zero = {{0u, 0u, 0u, 0u}};
    if (img_row < 0) {
        return zero;
    }
    int sy;
    int sx;
    if (!p.transposed) {
        sy = ry * (int)p.stride + (int)ky - (int)p.pad;
        sx = rx * (int)p.stride + (int)kx - (int)p.pad;
    } else {
        const int ty = ry + (int)p.pad - (int)ky;
        const int tx = rx + (int)p.pad - (int)kx;
        if (ty < 0 || tx < 0) {
            return zero;
        }
        sy = (int)hr_div(p.by_stride, (u32)ty);
        sx = (int)hr_div(p.by_stride, (u32)tx);
        if (sy * (int)p.stride != ty || sx * (int)p.stride != tx) {
            return zero;
        }
    }
    if (sy < 0 || sy >= (int)p.src_h || sx < 0 || sx >= (int)p.src_w) {
        return zero;
    }
    const u32 at = (((u32)img_row + (u32)sy) * p.src_w + (u32)sx) * p.chans + c;
    return hr_ld_vec8(src + at);
}

template <int BN>
__device__ void implicit_conv_k(ImplicitConvParams p, const hr_half* __restrict__ src,
                                const hr_half* __restrict__ w, hr_half* __restrict__ out) {
    constexpr int B_PER_THREAD = BN * IC_BK / IC_THREADS;
    constexpr int NT = BN / 8;
    __shared__ ImplicitTiles<BN> tile;
    const u32 tid = threadIdx.x;
    const u32 warp = tid >> 5;
    const u32 g = (tid & 31u) >> 2;
    const u32 t = tid & 3u;
    const u32 m0 = blockIdx.x * IC_BM;
    const u32 n0 = blockIdx.y * BN;

    // A: this thread gathers vector v (columns 8v..8v+7 of a step) of rows
    // r0 + 32i. Each row's image (as a row of src: img * src_h) and output
    // position, fixed for the whole K loop.
    const u32 v = tid & 3u;
    const u32 r0 = tid >> 2;
    int img_row[4];
    int ry[4];
    int rx[4];
    const u32 row_pix = p.row_h * p.row_w;
    for (int i = 0; i < 4; ++i) {
        const u32 m = m0 + r0 + 32u * (u32)i;
        const u32 img = hr_div(p.by_row_pix, m);
        const u32 pix = m - img * row_pix;
        const u32 y = hr_div(p.by_row_w, pix);
        img_row[i] = m < p.rows ? (int)(img * p.src_h) : -1;
        ry[i] = (int)y;
        rx[i] = (int)(pix - y * p.row_w);
    }
    // B: this thread loads elements tid + IC_THREADS i of each step's
    // IC_BK x BN tile, at (row, column) b_at(i). The input gradient's weight
    // is contiguous along K and the forward's along the columns: the faster
    // index follows it, so a warp's loads are contiguous either way.
    const bool k_fast = p.b_chan_stride == 1;
    auto b_at = [&](int i, u32& kb, u32& j) {
        const u32 e = tid + IC_THREADS * (u32)i;
        kb = k_fast ? e % IC_BK : e / BN;
        j = k_fast ? e / IC_BK : e % BN;
    };
    const u32 b_tap_stride = p.chans * p.cols;

    HalfVec8 a_next[4];
    hr_half b_next[B_PER_THREAD];
    auto load = [&](u32 k_step) {
        const u32 ka = k_step * IC_BK + 8u * v;
        const u32 tap = hr_div(p.by_chans, ka);
        const u32 c = ka - tap * p.chans;
        const u32 ky = hr_div(p.by_k, tap);
        const u32 kx = tap - ky * p.k;
        for (int i = 0; i < 4; ++i) {
            a_next[i] = gather8(p, src, ka < p.depth ? img_row[i] : -1, ry[i], rx[i], ky, kx, c);
        }
        for (int i = 0; i < B_PER_THREAD; ++i) {
            u32 kb;
            u32 j;
            b_at(i, kb, j);
            const u32 kw = k_step * IC_BK + kb;
            const u32 wtap = hr_div(p.by_chans, kw);
            const u32 at = wtap * b_tap_stride + (kw - wtap * p.chans) * p.b_chan_stride;
            const u32 col = n0 + j;
            b_next[i] = kw < p.depth && col < p.cols ? w[at + col * p.b_col_stride] : (hr_half)0;
        }
    };
    auto store = [&]() {
        for (int i = 0; i < 4; ++i) {
            hr_st_vec8(&tile.a[r0 + 32u * (u32)i][8u * v], a_next[i]);
        }
        for (int i = 0; i < B_PER_THREAD; ++i) {
            u32 kb;
            u32 j;
            b_at(i, kb, j);
            tile.b[j][kb] = b_next[i];
        }
    };

    float acc[2][NT][4];
    for (int mt = 0; mt < 2; ++mt) {
        for (int nt = 0; nt < NT; ++nt) {
            for (int e = 0; e < 4; ++e) {
                acc[mt][nt][e] = 0.0f;
            }
        }
    }
    const u32 steps = (p.depth + IC_BK - 1) / IC_BK;
    load(0);
    store();
    __syncthreads();
    for (u32 step = 0; step < steps; ++step) {
        if (step + 1 < steps) {
            load(step + 1);
        }
        for (u32 ks = 0; ks < IC_BK; ks += 16) {
            u32 af[2][4];
            for (int mt = 0; mt < 2; ++mt) {
                const u32 r = warp * 32u + 16u * (u32)mt + g;
                af[mt][0] = hr_ld_pair(&tile.a[r][ks + 2u * t]);
                af[mt][1] = hr_ld_pair(&tile.a[r + 8u][ks + 2u * t]);
                af[mt][2] = hr_ld_pair(&tile.a[r][ks + 2u * t + 8u]);
                af[mt][3] = hr_ld_pair(&tile.a[r + 8u][ks + 2u * t + 8u]);
            }
            for (int nt = 0; nt < NT; ++nt) {
                u32 bf[2];
                bf[0] = hr_ld_pair(&tile.b[8u * (u32)nt + g][ks + 2u * t]);
                bf[1] = hr_ld_pair(&tile.b[8u * (u32)nt + g][ks + 2u * t + 8u]);
                hr_mma_16816(acc[0][nt], af[0], bf);
                hr_mma_16816(acc[1][nt], af[1], bf);
            }
        }
        __syncthreads();
        if (step + 1 < steps) {
            store();
            __syncthreads();
        }
    }

    for (int mt = 0; mt < 2; ++mt) {
        for (int half = 0; half < 2; ++half) {
            const u32 row = m0 + warp * 32u + 16u * (u32)mt + g + 8u * (u32)half;
            if (row >= p.rows) {
                continue;
            }
            for (int nt = 0; nt < NT; ++nt) {
                const u32 col = n0 + 8u * (u32)nt + 2u * t;
                if (col < p.cols) {
                    const u32 lo = f2h(acc[mt][nt][2 * half]);
                    const u32 hi = f2h(acc[mt][nt][2 * half + 1]);
                    hr_st_pair(out + row * p.cols + col, lo | hi << 16);
                }
            }
        }
    }
}

// The weight gradient, dW[(ky, kx, ci), co] += sum over output pixels m of
// A[m, (ky, kx, ci)] dy[m, co], with A gathered from x as in the forward.
// The sum runs over n*oh*ow pixels into a small K x cout matrix, so the
// pixels are split among blocks (grid z): block z sums rows_per_split of
// them for a 64 x BN tile of dW and writes its f32 partial; wgrad_reduce (conv.cu)
// then adds the partials to dW in split order. No atomics: the same bits
// every run. Tiles are stored transposed in shared memory (K or cout rows,
// pixels along the row), so the mma's fragments, whose pairs run along the
// summed dimension, are single 32-bit reads.
struct WgradParams {
    u32 rows;            // n * oh * ow
    u32 depth;           // k * k * cin
    u32 cout;
    u32 cin;
    u32 h;
    u32 w;
    u32 opix;            // oh * ow
    u32 ow;
    u32 k;
    u32 stride;
    u32 pad;
    u32 rows_per_split;  // a multiple of WG_BM
    FastDiv by_opix;     // oh * ow
    FastDiv by_ow;
    FastDiv by_cin;
    FastDiv by_k;
};
HR_CHECK_SIZE(WgradParams, 80);

#define WG_BK 64
#define WG_BM 32
#define WG_LD (WG_BM + 8)

template <int BN>
struct alignas(16) WgradTiles {
    hr_half a[WG_BK][WG_LD];  // [k][pixel]
    hr_half b[BN][WG_LD];     // [co][pixel]
};

template <int BN>
__device__ void wgrad_k(WgradParams p, const hr_half* __restrict__ x, const hr_half* __restrict__ dy,
                        float* __restrict__ partial) {
    constexpr int NT = BN / 8;
    constexpr int B_VECS = BN / 32;  // 8-channel vectors of dy per thread and step
    __shared__ WgradTiles<BN> tile;
    const u32 tid = threadIdx.x;
    const u32 warp = tid >> 5;
    const u32 g = (tid & 31u) >> 2;
    const u32 t = tid & 3u;
    const u32 k0 = blockIdx.x * WG_BK;
    const u32 n0 = blockIdx.y * BN;
    const u32 m_begin = blockIdx.z * p.rows_per_split;
    const u32 m_end = min(p.rows, m_begin + p.rows_per_split);

    // Each thread loads pixel `pix` of every step: vectors 8j..8j+7 of the
    // block's K rows (j = vec + 4i, tap and channel fixed for the whole
    // loop) and of its dy columns.
    const u32 pix = tid & (WG_BM - 1);
    const u32 vec = tid / WG_BM;
    u32 a_ky[2];
    u32 a_kx[2];
    u32 a_c[2];
    bool a_ok[2];
    for (int i = 0; i < 2; ++i) {
        const u32 kv = k0 + 8u * (vec + 4u * (u32)i);
        const u32 tap = hr_div(p.by_cin, kv);
        a_c[i] = kv - tap * p.cin;
        a_ky[i] = hr_div(p.by_k, tap);
        a_kx[i] = tap - a_ky[i] * p.k;
        a_ok[i] = kv < p.depth;
    }
    const u32 b_col = n0 + 8u * vec;  // + 32 i for i < B_VECS

    HalfVec8 a_next[2];
    HalfVec8 b_next[B_VECS];
    auto load = [&](u32 m_step) {
        const u32 m = m_step + pix;
        const bool live = m < m_end;
        const u32 img = hr_div(p.by_opix, m);
        const u32 rem = m - img * p.opix;
        const u32 oy = hr_div(p.by_ow, rem);
        const u32 ox = rem - oy * p.ow;
        for (int i = 0; i < 2; ++i) {
            HalfVec8 v = {{0u, 0u, 0u, 0u}};
            const int iy = (int)(oy * p.stride + a_ky[i]) - (int)p.pad;
            const int ix = (int)(ox * p.stride + a_kx[i]) - (int)p.pad;
            if (live && a_ok[i] && iy >= 0 && iy < (int)p.h && ix >= 0 && ix < (int)p.w) {
                v = hr_ld_vec8(x + (((img * p.h + (u32)iy) * p.w + (u32)ix) * p.cin + a_c[i]));
            }
            a_next[i] = v;
        }
        for (int i = 0; i < B_VECS; ++i) {
            const u32 col = b_col + 32u * (u32)i;
            HalfVec8 v = {{0u, 0u, 0u, 0u}};
            if (live && col < p.cout) {
                v = hr_ld_vec8(dy + m * p.cout + col);
            }
            b_next[i] = v;
        }
    };
    // Transposed into the tiles: the 8 values of a vector go down a column.
    auto store = [&]() {
        for (int i = 0; i < 2; ++i) {
            const u32 row = 8u * (vec + 4u * (u32)i);
            for (u32 e = 0; e < 8; ++e) {
                tile.a[row + e][pix] = (hr_half)(a_next[i].w[e >> 1] >> (16u * (e & 1u)));
            }
        }
        for (int i = 0; i < B_VECS; ++i) {
            const u32 row = 8u * vec + 32u * (u32)i;
            for (u32 e = 0; e < 8; ++e) {
                tile.b[row + e][pix] = (hr_half)(b_next[i].w[e >> 1] >> (16u * (e & 1u)));
            }
        }
    };

    float acc[NT][4];
    for (int nt = 0; nt < NT; ++nt) {
        for (int e = 0; e < 4; ++e) {
            acc[nt][e] = 0.0f;
        }
    }
    load(m_begin);
    store();
    __syncthreads();
    for (u32 m_step = m_begin; m_step < m_end; m_step += WG_BM) {
        const bool more = m_step + WG_BM < m_end;
        if (more) {
            load(m_step + WG_BM);
        }
        for (u32 ks = 0; ks < WG_BM; ks += 16) {
            const u32 r = warp * 16u + g;
            u32 af[4];
            af[0] = hr_ld_pair(&tile.a[r][ks + 2u * t]);
            af[1] = hr_ld_pair(&tile.a[r + 8u][ks + 2u * t]);
            af[2] = hr_ld_pair(&tile.a[r][ks + 2u * t + 8u]);
            af[3] = hr_ld_pair(&tile.a[r + 8u][ks + 2u * t + 8u]);
            for (int nt = 0; nt < NT; ++nt) {
                u32 bf[2];
                bf[0] = hr_ld_pair(&tile.b[8u * (u32)nt + g][ks + 2u * t]);
                bf[1] = hr_ld_pair(&tile.b[8u * (u32)nt + g][ks + 2u * t + 8u]);
                hr_mma_16816(acc[nt], af, bf);
            }
        }
        __syncthreads();
        if (more) {
            store();
            __syncthreads();
        }
    }

    float* out = partial + (u64)blockIdx.z * p.depth * p.cout;
    for (int half = 0; half < 2; ++half) {
        const u32 row = k0 + warp * 16u + g + 8u * (u32)half;
        if (row >= p.depth) {
            continue;
        }
        for (int nt = 0; nt < NT; ++nt) {
            const u32 col = n0 + 8u * (u32)nt + 2u * t;
            if (col < p.cout) {
                out[row * p.cout + col] = acc[nt][2 * half];
                out[row * p.cout + col + 1u] = acc[nt][2 * half + 1];
            }
        }
    }
}

extern "C" __global__ void implicit_wgrad_n32_f16(WgradParams p, const hr_half* __restrict__ x,
                                                 const hr_half* __restrict__ dy, float* __restrict__ partial) {
    wgrad_k<32>(p, x, dy, partial);
}

extern "C" __global__ void implicit_wgrad_n64_f16(WgradParams p, const hr_half* __restrict__ x,
                                                 const hr_half* __restrict__ dy, float* __restrict__ partial) {
    wgrad_k<64>(p, x, dy, partial);
}
// Entry points by column tile: 32 for 32-channel outputs, 64 otherwise.
extern "C" __global__ void implicit_conv_n32_f16(ImplicitConvParams p, const hr_half* __restrict__ src,
                                                const hr_half* __restrict__ w, hr_half* __restrict__ out) {
    implicit_conv_k<32>(p, src, w, out);
}

extern "C" __global__ void implicit_conv_n64_f16(ImplicitConvParams p, const hr_half* __restrict__ src,
                                                const hr_half* __restrict__ w, hr_half* __restrict__ out) {
    implicit_conv_k<64>(p, src, w, out);
}
