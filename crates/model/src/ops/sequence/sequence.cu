// Token models (layers::Embedding, layers::CausalSelfAttention) on the
// GPU. A sequence batch [N, T, C] is stored as rows [N·T, C] (a token per
// row), so the linear layers, layer norms and activations around these
// kernels are the image path's own. f16 or f32 storage (T), f32 arithmetic.
//
//   embedding_forward      y[r] = table[id(r)] + pos[r % T], from the f32
//                          masters; an id outside 0..vocab gives NaN (the
//                          host checks ids before they come up, so this is
//                          a poison the loss reports, never a stray read)
//   embedding_grad_table   dtable[v, c] += Σ g[r, c] over the rows r whose
//                          id is v, in row order (the CPU layer's order),
//                          no atomics: a warp per (v, 32 columns) reads the
//                          ids 32 at a time, ballots the rows whose id is v
//                          and adds just those, lowest row first. The ids
//                          are read V·⌈D/32⌉ times, 32 lanes a load; each
//                          row of g once, by the warps of its own id
//   embedding_grad_positions  dpos[t, c] += Σ_n g[n·T + t, c], in n order
//
// Attention reads q, k and v where the qkv projection wrote them, [N·T, 3C]
// with q | k | v and the heads side by side in each, and writes the heads'
// outputs side by side, [N·T, C], the layout the output projection reads:
// no split or merge pass. No T×T matrix is ever stored (the CPU layer's
// `lean` mode, always): a warp per query row computes its scores twice
// (their max, then the exponentials, the sum and P·v together) and keeps
// the row's log-sum-exp for backward, which computes P again from it:
//
//   attention_forward        a warp per (n, head, query i): o_i, lse_i
//   attention_backward_query a warp per query row: D_i = dO_i·o_i (the
//                            rowsum(dP∘P) of the CPU layer's backward, equal
//                            since o_i = Σ_j P_ij v_j) and
//                            dq_i = Σ_{j<=i} dS_ij k_j with
//                            dS_ij = P_ij (dO_i·v_j − D_i)/√d
//   attention_backward_key   a warp per key row j: dk_j = Σ_{i>=j} dS_ij q_i,
//                            dv_j = Σ_{i>=j} P_ij dO_i
// Every sum is in a fixed order (no atomics): the same bits every run.
//
// LSTM (layers::Lstm, gates i, f, g, o): the input projection of every step
// is one GEMM before the time loop (f32 output) and h_{t-1}·Wh one GEMM a
// step; these kernels are the elementwise part of a step, a thread per
// (sample, unit):
//   lstm_cell_forward   pre = x·Wx + b + h·Wh; the activated gates and the
//                       cell state kept in f32, h_t stored as T
//   lstm_cell_backward  dh = g + dh_next; the pre-activation gradients
//                       (stored as T for the GEMMs) and dc carried to the
//                       step before, as the CPU layer's backward
// Block (32, 4): four rows a block. A row's own vectors (q_i and dO_i, or
// k_j and v_j) sit in shared memory, one slot per warp; each lane owns the
// output columns lane, lane + 32, ... (head size at most ATTN_MAX_D).
#include "common.cuh"

struct EmbedParams {
    u32 rows;
    u32 dim;
    u32 length;
    u32 vocab;
    u32 positions;
};
HR_CHECK_SIZE(EmbedParams, 20);

struct AttnParams {
    u32 n;
    u32 t;
    u32 heads;
    u32 d;
    float scale;
};
HR_CHECK_SIZE(AttnParams, 20);

struct LstmParams {
    u32 n;
    u32 t;
    u32 hidden;
    u32 step;
};
HR_CHECK_SIZE(LstmParams, 16);

#define ATTN_ROWS 4
#define ATTN_MAX_D 128
#define ATTN_PER_LANE (ATTN_MAX_D / 32)

__device__ __forceinline__ int token_id(float v, u32 vocab) {
    const float id = roundf(v);
    // NaN fails both comparisons.
    if (!(id >= 0.0f && id < (float)vocab)) {
        return -1;
    }
    return (int)id;
}

template <typename T>
__device__ void embedding_forward_k(EmbedParams p, const float* __restrict__ ids,
                                    const float* __restrict__ table,
                                    const float* __restrict__ pos, T* __restrict__ y) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < p.rows * p.dim;
         i += gridDim.x * blockDim.x) {
        const u32 row = i / p.dim;
        const u32 col = i - row * p.dim;
        const int id = token_id(ids[row], p.vocab);
        float v = id < 0 ? __int_as_float(0x7fc00000) : table[(u32)id * p.dim + col];
        if (p.positions) {
            v += pos[(row % p.length) * p.dim + col];
        }
        hr_st(&y[i], v);
    }
}

template <typename T>
__device__ void embedding_grad_table_k(EmbedParams p, const float* __restrict__ ids,
                                       const T* __restrict__ g, float* __restrict__ dtable) {
    const u32 lane = threadIdx.x;
    const u32 col_tiles = (p.dim + 31u) / 32u;
    const u32 warps = p.vocab * col_tiles;
    for (u32 w = blockIdx.x * blockDim.y + threadIdx.y; w < warps; w += gridDim.x * blockDim.y) {
        const int v = (int)(w / col_tiles);
        const u32 col = (w - (u32)v * col_tiles) * 32u + lane;
        const bool owns_col = col < p.dim;
        float acc = owns_col ? dtable[(u32)v * p.dim + col] : 0.0f;
        for (u32 r0 = 0; r0 < p.rows; r0 += 32u) {
            const u32 r = r0 + lane;
            const bool hit = r < p.rows && token_id(ids[r], p.vocab) == v;
            for (u32 mask = __ballot_sync(0xffffffffu, hit); mask != 0u; mask &= mask - 1u) {
                const u32 row = r0 + (u32)(__ffs((int)mask) - 1);
                if (owns_col) {
                    acc += hr_ld(g[row * p.dim + col]);
                }
            }
        }
        if (owns_col) {
            dtable[(u32)v * p.dim + col] = acc;
        }
    }
}

template <typename T>
__device__ void embedding_grad_positions_k(EmbedParams p, const T* __restrict__ g,
                                           float* __restrict__ dpos) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < p.length * p.dim;
         i += gridDim.x * blockDim.x) {
        const u32 t = i / p.dim;
        const u32 col = i - t * p.dim;
        float acc = dpos[i];
        for (u32 r = t; r < p.rows; r += p.length) {
            acc += hr_ld(g[r * p.dim + col]);
        }
        dpos[i] = acc;
    }
}

template <typename T>
__device__ void lstm_cell_forward_k(LstmParams p, const float* __restrict__ rec,
                                    const float* __restrict__ bias, float* __restrict__ gates,
                                    float* __restrict__ cells, T* __restrict__ hs) {
    const u32 h = p.hidden;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < p.n * h;
         i += gridDim.x * blockDim.x) {
        const u32 sample = i / h;
        const u32 j = i - sample * h;
        const u32 row = sample * p.t + p.step;
        float* gate = gates + row * 4u * h;
        float pre[4];
        for (u32 k = 0; k < 4; ++k) {
            pre[k] = gate[k * h + j] + bias[k * h + j];
            if (p.step > 0) {
                pre[k] += rec[sample * 4u * h + k * h + j];
            }
        }
        const float c_prev = p.step > 0 ? cells[(row - 1u) * h + j] : 0.0f;
        float act[4];
        const float c = hr_lstm_step(pre, c_prev, act);
        for (u32 k = 0; k < 4; ++k) {
            gate[k * h + j] = act[k];
        }
        cells[row * h + j] = c;
        hr_st(&hs[row * h + j], act[3] * tanhf(c));
    }
}

template <typename T>
__device__ void lstm_cell_backward_k(LstmParams p, const float* __restrict__ gates,
                                     const float* __restrict__ cells, const T* __restrict__ g,
                                     const float* __restrict__ dh_next,
                                     float* __restrict__ dc_carry, T* __restrict__ d_pre) {
    const u32 h = p.hidden;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < p.n * h;
         i += gridDim.x * blockDim.x) {
        const u32 sample = i / h;
        const u32 j = i - sample * h;
        const u32 row = sample * p.t + p.step;
        const float* gate = gates + row * 4u * h;
        const float act[4] = {gate[j], gate[h + j], gate[2u * h + j], gate[3u * h + j]};
        const float c_prev = p.step > 0 ? cells[(row - 1u) * h + j] : 0.0f;
        const float dh = hr_ld(g[row * h + j]) + dh_next[i];
        float d[4];
        dc_carry[i] = hr_lstm_step_backward(act, cells[row * h + j], c_prev, dh, dc_carry[i], d);
        T* out = d_pre + row * 4u * h;
        for (u32 k = 0; k < 4; ++k) {
            hr_st(&out[k * h + j], d[k]);
        }
    }
}

// Where a warp's row is: its sample, head and position.
struct AttnRow {
    u32 sample;
    u32 head;
    u32 pos;
    u32 index;  // (sample·heads + head)·t + pos, the row of lse and D
};

__device__ __forceinline__ bool attn_row(const AttnParams& p, AttnRow* r) {
    const u32 index = blockIdx.x * ATTN_ROWS + threadIdx.y;
    if (index >= p.n * p.heads * p.t) {
        return false;
    }
    r->index = index;
    r->pos = index % p.t;
    const u32 nh = index / p.t;
    r->head = nh % p.heads;
    r->sample = nh / p.heads;
    return true;
}

// Element 0 of q (which 0), k (1) or v (2) of `pos` in a sample's head,
// in the qkv projection's [N·T, 3C] output.
__device__ __forceinline__ u32 qkv_at(const AttnParams& p, u32 sample, u32 head, u32 pos,
                                      u32 which) {
    const u32 c = p.heads * p.d;
    return (sample * p.t + pos) * 3u * c + which * c + head * p.d;
}

// Element 0 of `pos` in a sample's head of an [N·T, C] tensor (o, dO).
__device__ __forceinline__ u32 merged_at(const AttnParams& p, u32 sample, u32 head, u32 pos) {
    return (sample * p.t + pos) * p.heads * p.d + head * p.d;
}

template <typename T>
__device__ __forceinline__ float dot_row(const float* a, const T* b, u32 d) {
    float s = 0.0f;
    for (u32 k = 0; k < d; ++k) {
        s += a[k] * hr_ld(b[k]);
    }
    return s;
}

// Copies d values of `src` into this warp's shared slot.
template <typename T>
__device__ __forceinline__ void load_slot(float* slot, const T* src, u32 d) {
    for (u32 k = threadIdx.x; k < d; k += 32) {
        slot[k] = hr_ld(src[k]);
    }
    __syncwarp();
}

template <typename T>
__device__ void attention_forward_k(AttnParams p, const T* __restrict__ qkv, T* __restrict__ o,
                                    float* __restrict__ lse) {
    __shared__ float s_q[ATTN_ROWS][ATTN_MAX_D];
    AttnRow r;
    if (!attn_row(p, &r)) {
        return;
    }
    float* q = s_q[threadIdx.y];
    load_slot(q, qkv + qkv_at(p, r.sample, r.head, r.pos, 0), p.d);
    const u32 lane = threadIdx.x;
    // Pass 1: the row's largest scaled score.
    float mx = hr_neg_inf();
    for (u32 j0 = 0; j0 <= r.pos; j0 += 32) {
        const u32 j = j0 + lane;
        if (j <= r.pos) {
            const float s = dot_row(q, qkv + qkv_at(p, r.sample, r.head, j, 1), p.d) * p.scale;
            mx = fmaxf(mx, s);
        }
    }
    mx = warp_max(mx);
    // Pass 2: exponentials, their sum, and Σ_j e_j v_j, each lane for its
    // own columns (e_j broadcast from the lane that computed it).
    float acc[ATTN_PER_LANE] = {0.0f, 0.0f, 0.0f, 0.0f};
    float sum = 0.0f;
    for (u32 j0 = 0; j0 <= r.pos; j0 += 32) {
        const u32 j = j0 + lane;
        float e = 0.0f;
        if (j <= r.pos) {
            const float s = dot_row(q, qkv + qkv_at(p, r.sample, r.head, j, 1), p.d) * p.scale;
            e = expf(s - mx);
        }
        sum += e;
        const u32 last = min(32u, r.pos + 1 - j0);
        for (u32 jj = 0; jj < 32; ++jj) {
            const float ej = __shfl_sync(0xffffffffu, e, jj);
            if (jj < last) {
                const T* v = qkv + qkv_at(p, r.sample, r.head, j0 + jj, 2);
                for (u32 u = 0; u < ATTN_PER_LANE; ++u) {
                    const u32 k = lane + 32u * u;
                    if (k < p.d) {
                        acc[u] += ej * hr_ld(v[k]);
                    }
                }
            }
        }
    }
    sum = warp_sum(sum);
    const float inv = 1.0f / sum;
    T* out = o + merged_at(p, r.sample, r.head, r.pos);
    for (u32 u = 0; u < ATTN_PER_LANE; ++u) {
        const u32 k = lane + 32u * u;
        if (k < p.d) {
            hr_st(&out[k], acc[u] * inv);
        }
    }
    if (lane == 0) {
        lse[r.index] = mx + logf(sum);
    }
}

template <typename T>
__device__ void attention_backward_query_k(AttnParams p, const T* __restrict__ qkv,
                                           const T* __restrict__ o, const T* __restrict__ d_o,
                                           const float* __restrict__ lse,
                                           float* __restrict__ drow, T* __restrict__ dqkv) {
    __shared__ float s_q[ATTN_ROWS][ATTN_MAX_D];
    __shared__ float s_do[ATTN_ROWS][ATTN_MAX_D];
    AttnRow r;
    if (!attn_row(p, &r)) {
        return;
    }
    const u32 lane = threadIdx.x;
    float* q = s_q[threadIdx.y];
    float* gd = s_do[threadIdx.y];
    load_slot(q, qkv + qkv_at(p, r.sample, r.head, r.pos, 0), p.d);
    const u32 at = merged_at(p, r.sample, r.head, r.pos);
    load_slot(gd, d_o + at, p.d);
    float dd = 0.0f;
    for (u32 k = lane; k < p.d; k += 32) {
        dd += gd[k] * hr_ld(o[at + k]);
    }
    dd = warp_sum(dd);
    if (lane == 0) {
        drow[r.index] = dd;
    }
    const float l = lse[r.index];
    float acc[ATTN_PER_LANE] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (u32 j0 = 0; j0 <= r.pos; j0 += 32) {
        const u32 j = j0 + lane;
        float ds = 0.0f;
        if (j <= r.pos) {
            const float s = dot_row(q, qkv + qkv_at(p, r.sample, r.head, j, 1), p.d) * p.scale;
            const float prob = expf(s - l);
            const float dp = dot_row(gd, qkv + qkv_at(p, r.sample, r.head, j, 2), p.d);
            ds = prob * (dp - dd) * p.scale;
        }
        const u32 last = min(32u, r.pos + 1 - j0);
        for (u32 jj = 0; jj < 32; ++jj) {
            const float dsj = __shfl_sync(0xffffffffu, ds, jj);
            if (jj < last) {
                const T* kr = qkv + qkv_at(p, r.sample, r.head, j0 + jj, 1);
                for (u32 u = 0; u < ATTN_PER_LANE; ++u) {
                    const u32 k = lane + 32u * u;
                    if (k < p.d) {
                        acc[u] += dsj * hr_ld(kr[k]);
                    }
                }
            }
        }
    }
    T* dq = dqkv + qkv_at(p, r.sample, r.head, r.pos, 0);
    for (u32 u = 0; u < ATTN_PER_LANE; ++u) {
        const u32 k = lane + 32u * u;
        if (k < p.d) {
            hr_st(&dq[k], acc[u]);
        }
    }
}

template <typename T>
__device__ void attention_backward_key_k(AttnParams p, const T* __restrict__ qkv,
                                         const T* __restrict__ d_o,
                                         const float* __restrict__ lse,
                                         const float* __restrict__ drow, T* __restrict__ dqkv) {
    __shared__ float s_k[ATTN_ROWS][ATTN_MAX_D];
    __shared__ float s_v[ATTN_ROWS][ATTN_MAX_D];
    AttnRow r;
    if (!attn_row(p, &r)) {
        return;
    }
    const u32 lane = threadIdx.x;
    float* kj = s_k[threadIdx.y];
    float* vj = s_v[threadIdx.y];
    load_slot(kj, qkv + qkv_at(p, r.sample, r.head, r.pos, 1), p.d);
    load_slot(vj, qkv + qkv_at(p, r.sample, r.head, r.pos, 2), p.d);
    const u32 base = r.index - r.pos;  // row of lse and D at position 0
    float dk[ATTN_PER_LANE] = {0.0f, 0.0f, 0.0f, 0.0f};
    float dv[ATTN_PER_LANE] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (u32 i0 = r.pos; i0 < p.t; i0 += 32) {
        const u32 i = i0 + lane;
        float prob = 0.0f, ds = 0.0f;
        if (i < p.t) {
            const float s = dot_row(kj, qkv + qkv_at(p, r.sample, r.head, i, 0), p.d) * p.scale;
            prob = expf(s - lse[base + i]);
            const float dp = dot_row(vj, d_o + merged_at(p, r.sample, r.head, i), p.d);
            ds = prob * (dp - drow[base + i]) * p.scale;
        }
        const u32 last = min(32u, p.t - i0);
        for (u32 ii = 0; ii < 32; ++ii) {
            const float pi = __shfl_sync(0xffffffffu, prob, ii);
            const float dsi = __shfl_sync(0xffffffffu, ds, ii);
            if (ii < last) {
                const T* qi = qkv + qkv_at(p, r.sample, r.head, i0 + ii, 0);
                const T* gi = d_o + merged_at(p, r.sample, r.head, i0 + ii);
                for (u32 u = 0; u < ATTN_PER_LANE; ++u) {
                    const u32 k = lane + 32u * u;
                    if (k < p.d) {
                        dk[u] += dsi * hr_ld(qi[k]);
                        dv[u] += pi * hr_ld(gi[k]);
                    }
                }
            }
        }
    }
    T* dkr = dqkv + qkv_at(p, r.sample, r.head, r.pos, 1);
    T* dvr = dqkv + qkv_at(p, r.sample, r.head, r.pos, 2);
    for (u32 u = 0; u < ATTN_PER_LANE; ++u) {
        const u32 k = lane + 32u * u;
        if (k < p.d) {
            hr_st(&dkr[k], dk[u]);
            hr_st(&dvr[k], dv[u]);
        }
    }
}

// Entry points, one per storage type (written out: the emulator's build
// finds them by their text).
extern "C" __global__ void embedding_forward_f16(
        EmbedParams p, const float* __restrict__ ids, const float* __restrict__ table,
        const float* __restrict__ pos, hr_half* __restrict__ y) {
    embedding_forward_k<hr_half>(p, ids, table, pos, y);
}

extern "C" __global__ void embedding_forward_f32(
        EmbedParams p, const float* __restrict__ ids, const float* __restrict__ table,
        const float* __restrict__ pos, float* __restrict__ y) {
    embedding_forward_k<float>(p, ids, table, pos, y);
}

extern "C" __global__ void embedding_grad_table_f16(
        EmbedParams p, const float* __restrict__ ids, const hr_half* __restrict__ g,
        float* __restrict__ dtable) {
    embedding_grad_table_k<hr_half>(p, ids, g, dtable);
}

extern "C" __global__ void embedding_grad_table_f32(
        EmbedParams p, const float* __restrict__ ids, const float* __restrict__ g,
        float* __restrict__ dtable) {
    embedding_grad_table_k<float>(p, ids, g, dtable);
}

extern "C" __global__ void embedding_grad_positions_f16(
        EmbedParams p, const hr_half* __restrict__ g, float* __restrict__ dpos) {
    embedding_grad_positions_k<hr_half>(p, g, dpos);
}

extern "C" __global__ void embedding_grad_positions_f32(
        EmbedParams p, const float* __restrict__ g, float* __restrict__ dpos) {
    embedding_grad_positions_k<float>(p, g, dpos);
}

extern "C" __global__ void attention_forward_f16(
        AttnParams p, const hr_half* __restrict__ qkv, hr_half* __restrict__ o,
        float* __restrict__ lse) {
    attention_forward_k<hr_half>(p, qkv, o, lse);
}

extern "C" __global__ void attention_forward_f32(
        AttnParams p, const float* __restrict__ qkv, float* __restrict__ o,
        float* __restrict__ lse) {
    attention_forward_k<float>(p, qkv, o, lse);
}

extern "C" __global__ void attention_backward_query_f16(
        AttnParams p, const hr_half* __restrict__ qkv, const hr_half* __restrict__ o,
        const hr_half* __restrict__ d_o, const float* __restrict__ lse, float* __restrict__ drow,
        hr_half* __restrict__ dqkv) {
    attention_backward_query_k<hr_half>(p, qkv, o, d_o, lse, drow, dqkv);
}

extern "C" __global__ void attention_backward_query_f32(
        AttnParams p, const float* __restrict__ qkv, const float* __restrict__ o,
        const float* __restrict__ d_o, const float* __restrict__ lse, float* __restrict__ drow,
        float* __restrict__ dqkv) {
    attention_backward_query_k<float>(p, qkv, o, d_o, lse, drow, dqkv);
}

extern "C" __global__ void attention_backward_key_f16(
        AttnParams p, const hr_half* __restrict__ qkv, const hr_half* __restrict__ d_o,
        const float* __restrict__ lse, const float* __restrict__ drow,
        hr_half* __restrict__ dqkv) {
    attention_backward_key_k<hr_half>(p, qkv, d_o, lse, drow, dqkv);
}

extern "C" __global__ void attention_backward_key_f32(
        AttnParams p, const float* __restrict__ qkv, const float* __restrict__ d_o,
        const float* __restrict__ lse, const float* __restrict__ drow, float* __restrict__ dqkv) {
    attention_backward_key_k<float>(p, qkv, d_o, lse, drow, dqkv);
}

extern "C" __global__ void lstm_cell_forward_f16(
        LstmParams p, const float* __restrict__ rec, const float* __restrict__ bias,
        float* __restrict__ gates, float* __restrict__ cells, hr_half* __restrict__ hs) {
    lstm_cell_forward_k<hr_half>(p, rec, bias, gates, cells, hs);
}

extern "C" __global__ void lstm_cell_forward_f32(
        LstmParams p, const float* __restrict__ rec, const float* __restrict__ bias,
        float* __restrict__ gates, float* __restrict__ cells, float* __restrict__ hs) {
    lstm_cell_forward_k<float>(p, rec, bias, gates, cells, hs);
}

extern "C" __global__ void lstm_cell_backward_f16(
        LstmParams p, const float* __restrict__ gates, const float* __restrict__ cells,
        const hr_half* __restrict__ g, const float* __restrict__ dh_next,
        float* __restrict__ dc_carry, hr_half* __restrict__ d_pre) {
    lstm_cell_backward_k<hr_half>(p, gates, cells, g, dh_next, dc_carry, d_pre);
}

extern "C" __global__ void lstm_cell_backward_f32(
        LstmParams p, const float* __restrict__ gates, const float* __restrict__ cells,
        const float* __restrict__ g, const float* __restrict__ dh_next,
        float* __restrict__ dc_carry, float* __restrict__ d_pre) {
    lstm_cell_backward_k<float>(p, gates, cells, g, dh_next, dc_carry, d_pre);
}
