// Implicit-GEMM convolution on the tensor cores (`device.conv_algorithm =
// "implicit_gemm"`, and `auto` for stride-1 layers of up to 64 channels):
// the same product as im2col + GEMM (conv.cu), but the rows of the im2col
// matrix are gathered straight from the NHWC tensor into shared memory,
// tile by tile, so the matrix never exists in device memory. im2col writes
// and reads k*k times the input (9x for 3x3); this reads it about once per
// column block, and needs no workspace.
//
// One kernel does two products (B_KN below):
//   forward      y [M = n*oh*ow, cout] = A W,
//                A[(img, oy, ox), (ky, kx, ci)] = x[img, oy*s + ky - pad, ox*s + kx - pad, ci]
//   input grad   dx[M = n*h*w, cin]    = A' W',
//                A'[(img, iy, ix), (ky, kx, co)] = dy[img, (iy + pad - ky)/s, ...] where
//                the division is exact and in range (else 0),
//                W'[(ky, kx, co), ci] = W[ky, kx, ci, co]
// so the input gradient is one pass with one f32 sum per element and one
// rounding to f16 (im2col's dA = dY W^T is rounded to f16 before col2im
// sums it). With stride s it is s*s products, one per parity class (py,
// px) of dx's pixels (iy = s*y + py, ix = s*x + px): the taps that reach
// such a pixel are exactly ky = tap_y0 + s*j with tap_y0 = (py + pad) mod
// s (and likewise kx), so each product gathers only those (for 3x3 and
// stride 2, 1, 2, 2 or 4 of the 9) instead of multiplying the zeros of
// the taps the stride skips; a class no tap reaches (a 1x1 stride-2
// convolution's odd pixels) is a product of depth 0, which writes zeros.
// The weight gradient (wgrad_k, below) gathers A the same way and sums
// over the pixels in per-block partials.
//
// Tiles: a block of 128 threads (4 warps) computes 128 rows x BN columns
// (BN = 32 or 64) in steps of 32 along K, warp w owning rows 32w..32w+31
// (mma.sync m16n8k16, f16 or bf16 operands by the module's format, f32
// accumulators). The tiles of a step go from global to shared memory by cp.async (16 bytes a copy, zeros for
// padding and edges, no registers on the way) into one of three stages, so
// two steps' loads are in flight while the warps multiply a third; one
// barrier a step. The warps read their fragments with ldmatrix (one
// instruction for four 8x8 matrices; .trans where the tile in shared
// memory runs along the other dimension: W's forward tile [k][n], and both
// of the weight gradient's tiles, [pixel][k] and [pixel][co]). Shared rows
// are padded by 16 bytes, so the eight rows of an 8x8 matrix fall in eight
// different 16-byte bank groups. The output tile goes out through the
// stages' shared memory, a row at a time in 16-byte stores.
//
// Needs: 2-byte storage (f16 or bf16), channels of the gathered tensor
// % 8 == 0 (a vector stays in one tap), output columns % 8 == 0, whole tensors (256-byte aligned), and
// sm_80 or newer for mma.m16n8k16 and cp.async (the host checks all of
// these and uses im2col otherwise). Memory: at most 45 KiB of static shared
// memory per block (three stages); the only device memory besides the
// tensors is the weight gradient's f32 partials.
// Emulated on the CPU: the mma and ldmatrix through a warp exchange with
// the fragment layouts of the PTX ISA, cp.async as copies queued until the
// thread waits for their group (cuda-emu's cuda_shim.h); each fails the
// launch on an emulated device below sm_80, as the `trap` compiled in its
// place there does on a GPU. Which GPUs take these kernels:
// crates/model/src/cuda/arch.rs.
#include "common.cuh"

struct ImplicitConvParams {
    u32 rows;        // M: the product's rows (n * row_h * row_w)
    u32 cols;        // N: channels of the output tensor
    u32 depth;       // K: taps_y * taps_x * chans
    u32 chans;       // channels of the gathered tensor
    u32 src_h;       // spatial size of the gathered tensor
    u32 src_w;
    u32 row_h;       // the grid of the rows: the output's size (forward), or
    u32 row_w;       // one parity class's (input gradient, below)
    u32 out_h;       // spatial size of the output tensor
    u32 out_w;
    // Row (img, y, x) of the grid is pixel (y * step + row_y0, x * step +
    // row_x0) of the output, and tap j = (jy, jx) of the product is W's tap
    // (tap_y0 + step * jy, tap_x0 + step * jx): step 1 and offsets 0 in
    // the forward.
    u32 step;
    u32 row_y0;
    u32 row_x0;
    u32 tap_y0;
    u32 tap_x0;
    u32 taps_x;      // the product's taps along x: k in the forward
    u32 k;
    u32 stride;
    u32 pad;
    u32 transposed;  // 0: forward gather; 1: input-gradient gather
    // B[(tap, c), j] = w[(ky * k + kx) * chans * cols + c * b_chan_stride +
    // j * b_col_stride], (ky, kx) W's tap of the product's tap (weight_tap)
    u32 b_chan_stride;
    u32 b_col_stride;
    FastDiv by_row_pix;  // row_h * row_w
    FastDiv by_row_w;
    FastDiv by_chans;
    FastDiv by_taps_x;
    FastDiv by_stride;
};
HR_CHECK_SIZE(ImplicitConvParams, 128);

#define IC_BM 128
#define IC_BK 32
#define IC_LD (IC_BK + 8)
#define IC_THREADS 128
#define IC_STAGES 3

// One stage of the forward / input-gradient tiles. B is stored the way W
// runs in memory, so each 16-byte copy is 8 consecutive weights: [k][n]
// for the forward (W[tap, ci, co] runs along co), [n][k] for the input
// gradient (W'[(tap, co), ci] runs along co = k).
template <int BN, bool B_KN>
struct alignas(16) ImplicitStage {
    hr_half a[IC_BM][IC_LD];
    hr_half b[B_KN ? IC_BK : BN][B_KN ? BN + 8 : IC_LD];
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
#ifdef HR_BF16
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
#else
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
#endif
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
    ::hr_emu::require_arch(80, "mma.sync.m16n8k16 with f16 or bf16 operands");
    const u64 mine[3] = {(u64)a[0] | (u64)a[1] << 32, (u64)a[2] | (u64)a[3] << 32,
                         (u64)b[0] | (u64)b[1] << 32};
    const u64 (*lanes)[32] = nullptr;
    unsigned int lane = 0;
    ::hr_emu::warp_exchange_words(mine, 3, &lanes, &lane);
    const u64* a01 = lanes[0];
    const u64* a23 = lanes[1];
    const u64* bb = lanes[2];
    // The whole A (16 x 16) and B (16 x 8) as floats, converted once per
    // warp: A[row][kk] is in lane 4 (row % 8) + (kk % 8) / 2, register
    // (row >= 8) + 2 (kk >= 8); B[kk][col] in lane 4 col + (kk % 8) / 2,
    // register (kk >= 8). Held as A by rows and B by columns.
    bool fill = false;
    float* const a_rows = ::hr_emu::warp_scratch(&fill);
    float* const b_cols = a_rows + 16 * 16;
    if (fill) {
        for (u32 row = 0; row < 16; ++row) {
            for (u32 kk = 0; kk < 16; ++kk) {
                const u32 reg = (row >= 8 ? 1u : 0u) + (kk >= 8 ? 2u : 0u);
                const u32 from = 4u * (row & 7u) + ((kk & 7u) >> 1);
                a_rows[row * 16 + kk] = hr_fragment_half(reg < 2 ? a01 : a23, from, reg, kk & 1u);
            }
        }
        for (u32 col = 0; col < 8; ++col) {
            for (u32 kk = 0; kk < 16; ++kk) {
                const u32 from = 4u * col + ((kk & 7u) >> 1);
                b_cols[col * 16 + kk] = hr_fragment_half(bb, from, kk >= 8 ? 1u : 0u, kk & 1u);
            }
        }
    }
    // Output i is at row g + 8 (i >= 2), column 2t + (i % 2), summed in
    // k order onto what d held.
    const u32 g = lane >> 2;
    const u32 t = lane & 3u;
    for (u32 i = 0; i < 4; ++i) {
        const float* a_row = a_rows + (g + (i >= 2 ? 8u : 0u)) * 16;
        const float* b_col = b_cols + (2u * t + (i & 1u)) * 16;
        float acc = d[i];
        for (u32 kk = 0; kk < 16; ++kk) {
            acc += a_row[kk] * b_col[kk];
        }
        d[i] = acc;
    }
}
#endif


// The shared-space address of a pointer into shared memory (ldmatrix's
// and cp.async's operand).
#ifndef HR_EMULATE
__device__ __forceinline__ u32 hr_smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes from global to shared memory without registers; zeros when src
// is null (a source size of 0 reads nothing).
__device__ __forceinline__ void hr_cp_async16(hr_half* dst, const hr_half* src, const hr_half* any) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(hr_smem_addr(dst)),
                 "l"(src != nullptr ? src : any), "r"(src != nullptr ? 16 : 0)
                 : "memory");
#else
    asm volatile("trap;");
#endif
}
__device__ __forceinline__ void hr_cp_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
// Waits until at most `n` of this thread's newest committed groups are pending.
template <int N>
__device__ __forceinline__ void hr_cp_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// Four 8x8 matrices of halves from shared memory: lane 8i + r gives the
// address of row r of matrix i; register i of lane 4g + t gets matrix i's
// row g, columns 2t..2t+1 (or with TRANS its column g, rows 2t..2t+1).
template <bool TRANS>
__device__ __forceinline__ void hr_ldmatrix_x4(u32 r[4], const hr_half* row) {
#if __CUDA_ARCH__ >= 800
    if (TRANS) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(hr_smem_addr(row))
                     : "memory");
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(hr_smem_addr(row))
                     : "memory");
    }
#else
    asm volatile("trap;");
#endif
}
#else
__device__ __forceinline__ void hr_cp_async16(hr_half* dst, const hr_half* src, const hr_half*) {
    ::hr_emu::cp_async16(dst, src);
}
__device__ __forceinline__ void hr_cp_async_commit() { ::hr_emu::cp_async_commit(); }
template <int N>
__device__ __forceinline__ void hr_cp_async_wait() {
    ::hr_emu::cp_async_wait(N);
}

template <bool TRANS>
__device__ __forceinline__ void hr_ldmatrix_x4(u32 r[4], const hr_half* row) {
    // The PTX ISA has ldmatrix from sm_75, but this file compiles it for
    // sm_80 and newer only (a trap below, as for mma and cp.async).
    ::hr_emu::require_arch(80, "ldmatrix (compiled for sm_80 and newer in conv_mma.cu)");
    ::hr_emu::check_aligned(row, 16);
    const u64* rows = nullptr;
    unsigned int lane = 0;
    ::hr_emu::warp_exchange((u64)(std::uintptr_t)row, &rows, &lane);
    const u32 g = lane >> 2;
    const u32 t = lane & 3u;
    for (u32 i = 0; i < 4; ++i) {
        hr_half lo;
        hr_half hi;
        if (TRANS) {
            lo = reinterpret_cast<const hr_half*>(rows[8u * i + 2u * t])[g];
            hi = reinterpret_cast<const hr_half*>(rows[8u * i + 2u * t + 1u])[g];
        } else {
            const hr_half* mine = reinterpret_cast<const hr_half*>(rows[8u * i + g]);
            lo = mine[2u * t];
            hi = mine[2u * t + 1u];
        }
        r[i] = (u32)lo | (u32)hi << 16;
    }
}
#endif

// Fragments of one k16 slice, by the layouts of mma.m16n8k16 (above).
// A, 16 rows from `row0`, stored [m][k] (row-major).
__device__ __forceinline__ void hr_frag_a_mk(u32 a[4], const hr_half* tile, u32 ld, u32 row0, u32 k0, u32 lane) {
    hr_ldmatrix_x4<false>(a, tile + (row0 + (lane & 15u)) * ld + k0 + 8u * (lane >> 4));
}
// A, 16 rows from `row0`, stored [k][m] (column-major).
__device__ __forceinline__ void hr_frag_a_km(u32 a[4], const hr_half* tile, u32 ld, u32 row0, u32 k0, u32 lane) {
    hr_ldmatrix_x4<true>(a, tile + (k0 + (lane & 7u) + 8u * (lane >> 4)) * ld + row0 + 8u * ((lane >> 3) & 1u));
}
// B of two 8-column tiles from `col0` (b[0..1] the first, b[2..3] the
// second), stored [k][n] (row-major).
__device__ __forceinline__ void hr_frag_b_kn(u32 b[4], const hr_half* tile, u32 ld, u32 col0, u32 k0, u32 lane) {
    hr_ldmatrix_x4<true>(b, tile + (k0 + (lane & 15u)) * ld + col0 + 8u * (lane >> 4));
}
// The same, stored [n][k] (column-major).
__device__ __forceinline__ void hr_frag_b_nk(u32 b[4], const hr_half* tile, u32 ld, u32 col0, u32 k0, u32 lane) {
    hr_ldmatrix_x4<false>(b, tile + (col0 + (lane & 7u) + 8u * (lane >> 4)) * ld + k0 + 8u * ((lane >> 3) & 1u));
}

// The loop both kernels run: the copies of the first STAGES - 1 steps
// queued, then at each step wait for its own (each thread for its copies,
// the barrier for everyone's; after it every warp is also done with the
// stage multiplied a step ago), queue the copies STAGES - 1 steps ahead
// into that stage, and multiply this one. load(step, stage) queues the
// copies of `step`; multiply(stage) runs the mma over it.
template <u32 STAGES, typename Load, typename Multiply>
__device__ __forceinline__ void hr_multistage(u32 steps, Load load, Multiply multiply) {
    for (u32 s = 0; s + 1 < STAGES; ++s) {
        if (s < steps) {
            load(s, s);
        }
        hr_cp_async_commit();
    }
    for (u32 step = 0; step < steps; ++step) {
        hr_cp_async_wait<(int)STAGES - 2>();
        __syncthreads();
        const u32 ahead = step + STAGES - 1;
        if (ahead < steps) {
            load(ahead, ahead % STAGES);
        }
        hr_cp_async_commit();
        multiply(step % STAGES);
    }
}

// Where the 8 channels c..c+7 of the gathered tensor that output row
// (img, ry, rx) reads at tap (ky, kx) start, or null for zeros (padding, a
// stride the tap misses, a row past the end: img_row < 0).
__device__ __forceinline__ const hr_half* gather_at(const ImplicitConvParams& p, const hr_half* __restrict__ src,
                                                    int img_row, int ry, int rx, u32 ky, u32 kx, u32 c) {
    if (img_row < 0) {
        return nullptr;
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
            return nullptr;
        }
        sy = (int)hr_div(p.by_stride, (u32)ty);
        sx = (int)hr_div(p.by_stride, (u32)tx);
        if (sy * (int)p.stride != ty || sx * (int)p.stride != tx) {
            return nullptr;
        }
    }
    if (sy < 0 || sy >= (int)p.src_h || sx < 0 || sx >= (int)p.src_w) {
        return nullptr;
    }
    return src + (((u32)img_row + (u32)sy) * p.src_w + (u32)sx) * p.chans + c;
}

// W's tap (ky, kx) of the product's tap `tap` (ImplicitConvParams).
__device__ __forceinline__ void weight_tap(const ImplicitConvParams& p, u32 tap, u32* ky, u32* kx) {
    const u32 jy = hr_div(p.by_taps_x, tap);
    *ky = p.tap_y0 + p.step * jy;
    *kx = p.tap_x0 + p.step * (tap - jy * p.taps_x);
}

// The output tensor's pixel of row m: m itself where the grid is the
// output's (step 1).
__device__ __forceinline__ u32 output_pixel(const ImplicitConvParams& p, u32 m) {
    if (p.step == 1u) {
        return m;
    }
    const u32 img = hr_div(p.by_row_pix, m);
    const u32 pix = m - img * p.row_h * p.row_w;
    const u32 y = hr_div(p.by_row_w, pix);
    const u32 x = pix - y * p.row_w;
    return (img * p.out_h + y * p.step + p.row_y0) * p.out_w + x * p.step + p.row_x0;
}

template <int BN, bool B_KN>
__device__ void implicit_conv_k(ImplicitConvParams p, const hr_half* __restrict__ src,
                                const hr_half* __restrict__ w, hr_half* __restrict__ out) {
    constexpr int NT = BN / 8;
    constexpr int B_VECS = BN * IC_BK / 8 / IC_THREADS;
    constexpr u32 B_LD = B_KN ? BN + 8 : IC_LD;
    __shared__ ImplicitStage<BN, B_KN> stage[IC_STAGES];
    const u32 tid = threadIdx.x;
    const u32 warp = tid >> 5;
    const u32 lane = tid & 31u;
    const u32 g = lane >> 2;
    const u32 t = lane & 3u;
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
        ry[i] = (int)(y * p.step + p.row_y0);
        rx[i] = (int)((pix - y * p.row_w) * p.step + p.row_x0);
    }
    const u32 b_tap_stride = p.chans * p.cols;

    // Queues the copies of step `k_step` into stage `s`.
    auto load = [&](u32 k_step, u32 s) {
        ImplicitStage<BN, B_KN>& st = stage[s];
        const u32 ka = k_step * IC_BK + 8u * v;
        const u32 tap = hr_div(p.by_chans, ka);
        const u32 c = ka - tap * p.chans;
        u32 ky;
        u32 kx;
        weight_tap(p, tap, &ky, &kx);
        for (int i = 0; i < 4; ++i) {
            const int row = ka < p.depth ? img_row[i] : -1;
            hr_cp_async16(&st.a[r0 + 32u * (u32)i][8u * v], gather_at(p, src, row, ry[i], rx[i], ky, kx, c), src);
        }
        // B: vector e of the step's tile, 8 weights along W's contiguous
        // dimension (columns for the forward, K for the input gradient).
        for (int i = 0; i < B_VECS; ++i) {
            const u32 e = tid + IC_THREADS * (u32)i;
            const u32 kb = B_KN ? e / (BN / 8) : 8u * (e % (IC_BK / 8));
            const u32 j = B_KN ? 8u * (e % (BN / 8)) : e / (IC_BK / 8);
            const u32 kw = k_step * IC_BK + kb;
            const u32 col = n0 + j;
            const u32 wtap = hr_div(p.by_chans, kw);
            u32 ky;
            u32 kx;
            weight_tap(p, wtap, &ky, &kx);
            const u32 at = (ky * p.k + kx) * b_tap_stride + (kw - wtap * p.chans) * p.b_chan_stride +
                           col * p.b_col_stride;
            const hr_half* from = kw < p.depth && col < p.cols ? w + at : nullptr;
            hr_cp_async16(B_KN ? &st.b[kb][j] : &st.b[j][kb], from, w);
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
    auto multiply = [&](u32 s) {
        const ImplicitStage<BN, B_KN>& st = stage[s];
        for (u32 ks = 0; ks < IC_BK; ks += 16) {
            u32 af[2][4];
            for (int mt = 0; mt < 2; ++mt) {
                hr_frag_a_mk(af[mt], &st.a[0][0], IC_LD, warp * 32u + 16u * (u32)mt, ks, lane);
            }
            for (int np = 0; np < NT / 2; ++np) {
                u32 bf[4];
                if (B_KN) {
                    hr_frag_b_kn(bf, &st.b[0][0], B_LD, 16u * (u32)np, ks, lane);
                } else {
                    hr_frag_b_nk(bf, &st.b[0][0], B_LD, 16u * (u32)np, ks, lane);
                }
                for (int h = 0; h < 2; ++h) {
                    hr_mma_16816(acc[0][2 * np + h], af[0], bf + 2 * h);
                    hr_mma_16816(acc[1][2 * np + h], af[1], bf + 2 * h);
                }
            }
        }
    };
    hr_multistage<IC_STAGES>((p.depth + IC_BK - 1) / IC_BK, load, multiply);

    // The tile leaves through shared memory (the stages are free once every
    // warp is past its last fragment reads), so that each row goes out in
    // 16-byte stores rather than a lane's 4 bytes.
    constexpr u32 OUT_LD = BN + 8;
    static_assert(sizeof(stage) >= IC_BM * OUT_LD * sizeof(hr_half), "the output tile fits the stages");
    hr_half* staged = &stage[0].a[0][0];
    hr_cp_async_wait<0>();
    __syncthreads();
    for (int mt = 0; mt < 2; ++mt) {
        for (int half = 0; half < 2; ++half) {
            const u32 row = warp * 32u + 16u * (u32)mt + g + 8u * (u32)half;
            for (int nt = 0; nt < NT; ++nt) {
                const u32 lo = f2h(acc[mt][nt][2 * half]);
                const u32 hi = f2h(acc[mt][nt][2 * half + 1]);
                hr_st_pair(staged + row * OUT_LD + 8u * (u32)nt + 2u * t, lo | hi << 16);
            }
        }
    }
    __syncthreads();
    for (u32 e = tid; e < IC_BM * (BN / 8); e += IC_THREADS) {
        const u32 row = e / (BN / 8);
        const u32 col = 8u * (e % (BN / 8));
        if (m0 + row < p.rows && n0 + col < p.cols) {
            const u32 pixel = output_pixel(p, m0 + row);
            hr_st_vec8(out + pixel * p.cols + n0 + col, hr_ld_vec8(staged + row * OUT_LD + col));
        }
    }
}

// The weight gradient, dW[(ky, kx, ci), co] += sum over output pixels m of
// A[m, (ky, kx, ci)] dy[m, co], with A gathered from x as in the forward.
// The sum runs over n*oh*ow pixels into a small K x cout matrix, so the
// pixels are split among blocks (grid z): block z sums rows_per_split of
// them for a 64 x BN tile of dW and writes its f32 partial; wgrad_reduce (conv.cu)
// then adds the partials to dW in split order. No atomics: the same bits
// every run. Both tiles are stored as they run in memory ([pixel][k] and
// [pixel][co], 16-byte copies) and ldmatrix .trans turns them into the
// fragments, whose pairs run along the summed pixels.
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
#define WG_STAGES 3

template <int BN>
struct alignas(16) WgradStage {
    hr_half a[WG_BM][WG_BK + 8];  // [pixel][k]
    hr_half b[WG_BM][BN + 8];     // [pixel][co]
};

template <int BN>
__device__ void wgrad_k(WgradParams p, const hr_half* __restrict__ x, const hr_half* __restrict__ dy,
                        float* __restrict__ partial) {
    constexpr int NT = BN / 8;
    constexpr int B_VECS = BN / 32;  // 8-channel vectors of dy per thread and step
    __shared__ WgradStage<BN> stage[WG_STAGES];
    const u32 tid = threadIdx.x;
    const u32 warp = tid >> 5;
    const u32 lane = tid & 31u;
    const u32 g = lane >> 2;
    const u32 t = lane & 3u;
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

    // Queues the copies of step `step` (the pixels from m_begin + 32 step)
    // into stage `s`.
    auto load = [&](u32 step, u32 s) {
        WgradStage<BN>& st = stage[s];
        const u32 m = m_begin + step * WG_BM + pix;
        const bool live = m < m_end;
        const u32 img = hr_div(p.by_opix, m);
        const u32 rem = m - img * p.opix;
        const u32 oy = hr_div(p.by_ow, rem);
        const u32 ox = rem - oy * p.ow;
        for (int i = 0; i < 2; ++i) {
            const int iy = (int)(oy * p.stride + a_ky[i]) - (int)p.pad;
            const int ix = (int)(ox * p.stride + a_kx[i]) - (int)p.pad;
            const bool in = live && a_ok[i] && iy >= 0 && iy < (int)p.h && ix >= 0 && ix < (int)p.w;
            const hr_half* from = in ? x + (((img * p.h + (u32)iy) * p.w + (u32)ix) * p.cin + a_c[i]) : nullptr;
            hr_cp_async16(&st.a[pix][8u * (vec + 4u * (u32)i)], from, x);
        }
        for (int i = 0; i < B_VECS; ++i) {
            const u32 col = b_col + 32u * (u32)i;
            const hr_half* from = live && col < p.cout ? dy + m * p.cout + col : nullptr;
            hr_cp_async16(&st.b[pix][8u * vec + 32u * (u32)i], from, dy);
        }
    };

    float acc[NT][4];
    for (int nt = 0; nt < NT; ++nt) {
        for (int e = 0; e < 4; ++e) {
            acc[nt][e] = 0.0f;
        }
    }
    auto multiply = [&](u32 s) {
        const WgradStage<BN>& st = stage[s];
        for (u32 ks = 0; ks < WG_BM; ks += 16) {
            u32 af[4];
            hr_frag_a_km(af, &st.a[0][0], WG_BK + 8, warp * 16u, ks, lane);
            for (int np = 0; np < NT / 2; ++np) {
                u32 bf[4];
                hr_frag_b_kn(bf, &st.b[0][0], BN + 8, 16u * (u32)np, ks, lane);
                hr_mma_16816(acc[2 * np], af, bf);
                hr_mma_16816(acc[2 * np + 1], af, bf + 2);
            }
        }
    };
    const u32 steps = m_end > m_begin ? (m_end - m_begin + WG_BM - 1) / WG_BM : 0u;
    hr_multistage<WG_STAGES>(steps, load, multiply);

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

// Outputs in 128s: each step's tile of x then serves 128 columns of dW
// instead of 64 (a 64-column tile gathers it twice for 128 outputs), at 64
// accumulators a thread; 39 KiB of shared memory in three stages.
extern "C" __global__ void implicit_wgrad_n128_f16(WgradParams p, const hr_half* __restrict__ x,
                                                  const hr_half* __restrict__ dy, float* __restrict__ partial) {
    wgrad_k<128>(p, x, dy, partial);
}
// Entry points by column tile (32 for 32-channel outputs, 64 otherwise)
// and product: the forward (W's tile [k][n]) or the input gradient ([n][k]).
extern "C" __global__ void implicit_conv_n32_f16(ImplicitConvParams p, const hr_half* __restrict__ src,
                                                const hr_half* __restrict__ w, hr_half* __restrict__ out) {
    implicit_conv_k<32, true>(p, src, w, out);
}

extern "C" __global__ void implicit_conv_n64_f16(ImplicitConvParams p, const hr_half* __restrict__ src,
                                                const hr_half* __restrict__ w, hr_half* __restrict__ out) {
    implicit_conv_k<64, true>(p, src, w, out);
}

extern "C" __global__ void implicit_dgrad_n32_f16(ImplicitConvParams p, const hr_half* __restrict__ src,
                                                 const hr_half* __restrict__ w, hr_half* __restrict__ out) {
    implicit_conv_k<32, false>(p, src, w, out);
}

extern "C" __global__ void implicit_dgrad_n64_f16(ImplicitConvParams p, const hr_half* __restrict__ src,
                                                 const hr_half* __restrict__ w, hr_half* __restrict__ out) {
    implicit_conv_k<64, false>(p, src, w, out);
}
