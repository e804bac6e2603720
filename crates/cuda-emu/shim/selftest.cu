// Kernels that test the emulator itself (tests/scheduler.rs): barriers and
// shared memory, every warp shuffle and vote, atomics, and a deadlock that
// must be reported rather than hang. Written in the same CUDA C++ as the
// real kernels; the `hr_emu_selftest_` prefix keeps them out of the list of
// headroom's kernels.
#include "common.cuh"

// out[i] = in[n - 1 - i] within one block, through shared memory.
extern "C" __global__ void hr_emu_selftest_reverse(u32 n, const u32* in, u32* out) {
    __shared__ u32 s[1024];
    const u32 t = threadIdx.x + threadIdx.y * blockDim.x;
    const u32 base = blockIdx.x * n;
    s[t] = in[base + t];
    __syncthreads();
    // A second phase that reads what other threads wrote before the barrier.
    const u32 v = s[n - 1 - t];
    __syncthreads();
    s[t] = v * 2u;
    __syncthreads();
    out[base + t] = s[t] / 2u;
}

// Per thread, 8 results: xor 5, down 3, up 7, idx 9, width-8 xor 1,
// ballot(odd), any(v == 100), all(v < 1000).
extern "C" __global__ void hr_emu_selftest_warp(const u32* in, u32* out) {
    const u32 t = blockIdx.x * blockDim.x + threadIdx.x;
    const u32 v = in[t];
    u32* o = out + t * 8;
    o[0] = __shfl_xor_sync(0xffffffffu, v, 5);
    o[1] = __shfl_down_sync(0xffffffffu, v, 3);
    o[2] = __shfl_up_sync(0xffffffffu, v, 7);
    o[3] = __shfl_sync(0xffffffffu, v, 9);
    o[4] = __shfl_xor_sync(0xffffffffu, v, 1, 8);
    o[5] = __ballot_sync(0xffffffffu, v & 1u);
    o[6] = (u32)__any_sync(0xffffffffu, v == 100u);
    o[7] = (u32)__all_sync(0xffffffffu, v < 1000u);
}

// The common.cuh reductions the loss kernel uses, over one warp.
extern "C" __global__ void hr_emu_selftest_warp_reduce(const float* in, float* out) {
    const float v = in[threadIdx.x];
    out[threadIdx.x * 2] = warp_sum(v);
    out[threadIdx.x * 2 + 1] = warp_max(v);
}

extern "C" __global__ void hr_emu_selftest_atomics(u32* counter, float* sum, u32* max_seen) {
    const u32 t = blockIdx.x * blockDim.x + threadIdx.x;
    atomicAdd(counter, 1u);
    atomicAdd(sum, 0.5f);
    atomicMax(max_seen, t);
}

// Half the warp waits at __syncthreads, the other half in a shuffle: a hang
// on a GPU, a reported launch failure in the emulator.
extern "C" __global__ void hr_emu_selftest_deadlock(u32* out) {
    if (threadIdx.x < 16) {
        __syncthreads();
    } else {
        out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, threadIdx.x, 1);
    }
}

// Writes one element past its buffer: the guard bytes must catch it.
extern "C" __global__ void hr_emu_selftest_overrun(u32 n, u32* out) {
    const u32 t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t <= n) {
        out[t] = t;
    }
}

// Copies 8 halves from `in + offset` with one 16-byte load: an offset that
// is not a multiple of 8 halves must fail the launch, as on the GPU.
extern "C" __global__ void hr_emu_selftest_vec8(u32 offset, const hr_half* in, hr_half* out) {
    hr_st_vec8(out, hr_ld_vec8(in + offset));
}

// Block b > 0 reads what block b - 1 wrote, with nothing to order them:
// wrong on a GPU, and it must give different answers here in the two
// orders the emulator runs blocks in.
extern "C" __global__ void hr_emu_selftest_block_order(u32* out) {
    if (threadIdx.x == 0) {
        out[blockIdx.x] = blockIdx.x == 0 ? 1u : out[blockIdx.x - 1] + 1u;
    }
}

// Thread t > 0 reads the shared value thread t - 1 wrote, without a
// barrier: the same race within a block.
extern "C" __global__ void hr_emu_selftest_thread_order(u32* out) {
    __shared__ u32 s[32];
    s[threadIdx.x] = 0u;
    __syncthreads();
    s[threadIdx.x] = threadIdx.x == 0 ? 1u : s[threadIdx.x - 1] + 1u;
    out[threadIdx.x] = s[threadIdx.x];
}

// out = a + b through __restrict__ pointers: a and b may be one buffer
// (both only read), out may be neither.
extern "C" __global__ void hr_emu_selftest_restrict(u32 n, const u32* __restrict__ a,
                                                    const u32* __restrict__ b,
                                                    u32* __restrict__ out) {
    const u32 t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n) {
        out[t] = a[t] + b[t];
    }
}

// Block 0 writes all 64 shared words, every later block only the first 32,
// then each thread reads its own word back: the 32 no thread of the block
// wrote must read all-ones bits, whichever block ran before.
extern "C" __global__ void hr_emu_selftest_unwritten_shared(u32* out) {
    __shared__ u32 s[64];
    const u32 written = blockIdx.x == 0 ? 64u : 32u;
    if (threadIdx.x < written) {
        s[threadIdx.x] = blockIdx.x + 1u;
    }
    __syncthreads();
    out[blockIdx.x * 64u + threadIdx.x] = s[threadIdx.x];
}

// Each thread writes only the first `written` of its four local words, then
// stores all four: the words past `written` were never written, a read that
// the compiler cannot see at build time. valgrind's memcheck must report it
// (`cargo xtask memcheck` checks that it does before it trusts a clean run).
extern "C" __global__ void hr_emu_selftest_uninitialised_local(u32 written, u32* out) {
    u32 v[4];
    for (u32 i = 0; i < written && i < 4u; ++i) {
        v[i] = i + 1u;
    }
    for (u32 i = 0; i < 4u; ++i) {
        out[threadIdx.x * 4u + i] = v[i];
    }
}

// 16 bytes a thread from global to shared memory by cp.async, then out:
// runs on an emulated sm_80 or newer, and fails its launch below sm_80,
// where the GPU has no cp.async (tests/device_model.rs).
struct alignas(16) HrSelftestQuad {
    u32 v[4];
};
extern "C" __global__ void hr_emu_selftest_cp_async(const u32* in, u32* out) {
    __shared__ HrSelftestQuad tile[32];
    const u32 t = threadIdx.x;
    ::hr_emu::cp_async16(&tile[t], in + 4u * t);
    ::hr_emu::cp_async_commit();
    ::hr_emu::cp_async_wait(0);
    for (u32 i = 0; i < 4u; ++i) {
        out[4u * t + i] = tile[t].v[i];
    }
}
