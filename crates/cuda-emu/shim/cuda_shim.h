// Host C++ stand-ins for the CUDA C++ that crates/model/src/**/*.cu use, so
// that build.rs can compile every kernel with the system C++ compiler into
// the fake driver library (driver.cpp) and run it on the CPU.
//
// Force-included (-include) ahead of each kernel file, with -DHR_EMULATE
// (which common.cuh tests to swap its inline-PTX f16 conversions for exact
// host versions). The execution model lives in driver.cpp: one OS thread runs
// a block's threads as fibers, so
//   - threadIdx/blockIdx/blockDim/gridDim are per-fiber values the scheduler
//     swaps in at every switch;
//   - __shared__ is `static thread_local`: one copy per OS thread, which the
//     fibers of the block running on it share, exactly the CUDA scope; build.rs
//     follows each declaration with HR_SHARED_FRESH, so that every block
//     finds it filled with 0xff bytes (NaN, or an all-ones integer), not the
//     zeros or the last block's values a kernel could wrongly rely on;
//   - __syncthreads() parks the fiber until every live thread of the block
//     has arrived (a real barrier, not a no-op);
//   - warp shuffles and votes park the fiber until every live lane of its
//     warp has arrived, then each lane reads the snapshot of all 32 values.
// Everything here is deliberately small: a kernel that needs more CUDA than
// this fails to compile in build.rs, which names the missing piece.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
// Standard headers driver.cpp needs, included before the macros below
// (libstdc++ spells attributes like __noinline__ too).
#include <functional>
#include <memory>
#include <set>

#define __global__
#define __device__ static
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __shared__ static thread_local
#define __constant__ static
#define __launch_bounds__(...)

struct hr_uint3 {
    unsigned int x, y, z;
};
typedef hr_uint3 uint3;

namespace hr_emu {
// The 2-byte format of the running launch (common.cuh's h2f and f2h): bf16
// for a kernel of a module whose image carries headroom_half_format_bf16
// (its file compiled with HR_BF16), else f16. Set by the launch.
extern thread_local bool t_half_bf16;
inline bool half_is_bf16() { return t_half_bf16; }

// Set by the scheduler for the fiber it is about to run.
extern thread_local hr_uint3 t_thread_idx;
extern thread_local hr_uint3 t_block_idx;
extern thread_local hr_uint3 t_block_dim;
extern thread_local hr_uint3 t_grid_dim;

// Block-wide barrier among the live threads of the current block.
void syncthreads();
// Passed by every thread at each __shared__ declaration it reaches: the
// first thread of a block to pass it fills the `bytes` at p with 0xff.
// Those after it in the same block leave what the first may have written.
void shared_declared(void* p, std::size_t bytes);
// A vector access of `bytes` at p: the GPU faults (CUDA_ERROR_MISALIGNED_ADDRESS)
// unless p is a multiple of `bytes`, where a CPU would not notice, so the
// emulator records the first such access of a launch and fails the launch.
void check_aligned(const void* p, unsigned int bytes);
// Warp rendezvous: contributes `mine`, waits for every live lane of the
// warp, then points `all` at the 32 lanes' published values (valid until
// the caller's next warp operation: its warp publishes again only once
// every live lane, the caller among them, has arrived there) and returns
// the mask of live lanes. The lane of the caller is returned through `lane`.
unsigned int warp_exchange(unsigned long long mine, const unsigned long long** all,
                           unsigned int* lane);
// The most values one lane hands to a single rendezvous.
constexpr unsigned int kWarpWords = 3;
// The same rendezvous with `words` (at most kWarpWords) values from each
// lane: (*all)[w][l] is lane l's value w (all-ones bits where lane l gave
// none). One rendezvous instead of `words`: an emulated mma.sync hands over
// its A and B fragments at once.
unsigned int warp_exchange_words(const unsigned long long* mine, unsigned int words,
                                 const unsigned long long (**all)[32], unsigned int* lane);
// The floats of a warp's latest rendezvous that every lane reads: the
// first lane to ask after it (*fill true) fills them, the others find
// them filled, so work common to the warp is done once, not once a lane.
// (Lanes run one at a time and none switches between the rendezvous and
// its reads.) An emulated mma.sync converts its A and B fragments there.
constexpr unsigned int kWarpScratchFloats = 16 * 16 + 16 * 8;
float* warp_scratch(bool* fill);
// cp.async as the GPU may run it: a 16-byte copy (zeros when src is null)
// is only queued, in the calling thread's current group; commit closes the
// group, and wait(n) completes every copy but those of the newest n
// closed groups (and of the open one). A kernel that reads shared memory
// before waiting for the copy into it reads what was there before (0xff
// bytes at a block's start), and a block that ends with copies never
// waited for fails its launch.
// An instruction that needs compute capability `needed` (x10 + minor): on
// an emulated device below it (device.cpp) the launch fails, as the `trap`
// compiled in the instruction's place does on such a GPU.
void require_arch(unsigned int needed, const char* instruction);
void cp_async16(void* dst, const void* src);
void cp_async_commit();
void cp_async_wait(unsigned int newest_pending);

template <typename T>
inline unsigned long long to_bits(T v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a large type");
    unsigned long long b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}

template <typename T>
inline T from_bits(unsigned long long b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}

// The lane `src` reads from, or the caller's own lane when out of its
// segment (CUDA's rule for shfl_up/down and width-segmented shuffles).
template <typename T>
inline T shuffle(T v, int mode, int arg, int width) {
    const unsigned long long* all = nullptr;
    unsigned int lane = 0;
    warp_exchange(to_bits(v), &all, &lane);
    const int w = (width <= 0 || width > 32) ? 32 : width;
    const int seg = (int)lane / w * w;
    const int in_seg = (int)lane - seg;
    int src;
    switch (mode) {
        case 0:  // idx
            src = seg + ((arg % w) + w) % w;
            break;
        case 1:  // up
            src = in_seg - arg >= 0 ? (int)lane - arg : (int)lane;
            break;
        case 2:  // down
            src = in_seg + arg < w ? (int)lane + arg : (int)lane;
            break;
        default:  // xor
            src = ((int)lane ^ arg) < seg + w ? ((int)lane ^ arg) : (int)lane;
            break;
    }
    return from_bits<T>(all[src & 31]);
}
}  // namespace hr_emu

// Appended by build.rs after the `;` of each `__shared__` declaration.
#define HR_SHARED_FRESH(var) ::hr_emu::shared_declared(&(var), sizeof(var))

#define threadIdx (::hr_emu::t_thread_idx)
#define blockIdx (::hr_emu::t_block_idx)
#define blockDim (::hr_emu::t_block_dim)
#define gridDim (::hr_emu::t_grid_dim)
#define warpSize 32

static inline void __syncthreads() { ::hr_emu::syncthreads(); }
static inline void __syncwarp(unsigned int = 0xffffffffu) {
    const unsigned long long* all = nullptr;
    unsigned int lane;
    ::hr_emu::warp_exchange(0, &all, &lane);
}
// Fibers of one block share an OS thread; blocks run one after another.
static inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

template <typename T>
static inline T __shfl_sync(unsigned int, T v, int src, int width = 32) {
    return ::hr_emu::shuffle(v, 0, src, width);
}
template <typename T>
static inline T __shfl_up_sync(unsigned int, T v, unsigned int delta, int width = 32) {
    return ::hr_emu::shuffle(v, 1, (int)delta, width);
}
template <typename T>
static inline T __shfl_down_sync(unsigned int, T v, unsigned int delta, int width = 32) {
    return ::hr_emu::shuffle(v, 2, (int)delta, width);
}
template <typename T>
static inline T __shfl_xor_sync(unsigned int, T v, int lane_mask, int width = 32) {
    return ::hr_emu::shuffle(v, 3, lane_mask, width);
}

static inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return (unsigned int)(((unsigned long long)a * b) >> 32);
}

static inline unsigned int __ballot_sync(unsigned int mask, int pred) {
    const unsigned long long* all = nullptr;
    unsigned int lane;
    const unsigned int live = ::hr_emu::warp_exchange(pred != 0, &all, &lane);
    unsigned int out = 0;
    for (int l = 0; l < 32; ++l) {
        if ((live >> l & 1u) && all[l]) {
            out |= 1u << l;
        }
    }
    return out & mask;
}
static inline int __any_sync(unsigned int mask, int pred) { return __ballot_sync(mask, pred) != 0; }
static inline int __all_sync(unsigned int mask, int pred) {
    const unsigned long long* all = nullptr;
    unsigned int lane;
    const unsigned int live = ::hr_emu::warp_exchange(pred != 0, &all, &lane) & mask;
    for (int l = 0; l < 32; ++l) {
        if ((live >> l & 1u) && !all[l]) {
            return 0;
        }
    }
    return 1;
}
static inline unsigned int __activemask() {
    const unsigned long long* all = nullptr;
    unsigned int lane;
    return ::hr_emu::warp_exchange(0, &all, &lane);
}

// Bit casts and integer intrinsics.
static inline unsigned int __float_as_uint(float x) { return ::hr_emu::from_bits<unsigned int>(::hr_emu::to_bits(x)); }
static inline int __float_as_int(float x) { return ::hr_emu::from_bits<int>(::hr_emu::to_bits(x)); }
static inline float __uint_as_float(unsigned int x) { return ::hr_emu::from_bits<float>(::hr_emu::to_bits(x)); }
static inline float __int_as_float(int x) { return ::hr_emu::from_bits<float>(::hr_emu::to_bits(x)); }
static inline long long __double_as_longlong(double x) { return ::hr_emu::from_bits<long long>(::hr_emu::to_bits(x)); }
static inline double __longlong_as_double(long long x) { return ::hr_emu::from_bits<double>(::hr_emu::to_bits(x)); }
static inline int __popc(unsigned int x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned int)x); }
static inline int __ffs(int x) { return __builtin_ffs(x); }

// min/max as CUDA overloads them for mixed integer and float arguments.
template <typename A, typename B>
static inline typename std::common_type<A, B>::type min(A a, B b) {
    typedef typename std::common_type<A, B>::type C;
    return (C)b < (C)a ? (C)b : (C)a;
}
template <typename A, typename B>
static inline typename std::common_type<A, B>::type max(A a, B b) {
    typedef typename std::common_type<A, B>::type C;
    return (C)a < (C)b ? (C)b : (C)a;
}
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
// __expf and __logf: glibc declares them with the same meaning.
static inline float __fdividef(float a, float b) { return a / b; }
static inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }

// Atomics: blocks run one after another today, but these stay correct if
// they are spread over OS threads.
template <typename T>
static inline T hr_atomic_update(T* addr, T (*f)(T, T), T v) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "atomic of an odd size");
    typedef typename std::conditional<sizeof(T) == 4, unsigned int, unsigned long long>::type Bits;
    Bits* p = reinterpret_cast<Bits*>(addr);
    Bits old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    for (;;) {
        const Bits next = ::hr_emu::from_bits<Bits>(::hr_emu::to_bits(f(::hr_emu::from_bits<T>(old), v)));
        if (__atomic_compare_exchange_n(p, &old, next, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
            return ::hr_emu::from_bits<T>(old);
        }
    }
}
template <typename T>
static inline T atomicAdd(T* addr, T v) {
    return hr_atomic_update<T>(addr, [](T a, T b) { return (T)(a + b); }, v);
}
template <typename T>
static inline T atomicSub(T* addr, T v) {
    return hr_atomic_update<T>(addr, [](T a, T b) { return (T)(a - b); }, v);
}
template <typename T>
static inline T atomicMax(T* addr, T v) {
    return hr_atomic_update<T>(addr, [](T a, T b) { return a < b ? b : a; }, v);
}
template <typename T>
static inline T atomicMin(T* addr, T v) {
    return hr_atomic_update<T>(addr, [](T a, T b) { return b < a ? b : a; }, v);
}
template <typename T>
static inline T atomicExch(T* addr, T v) {
    return hr_atomic_update<T>(addr, [](T, T b) { return b; }, v);
}
template <typename T>
static inline T atomicOr(T* addr, T v) {
    return hr_atomic_update<T>(addr, [](T a, T b) { return (T)(a | b); }, v);
}
template <typename T>
static inline T atomicAnd(T* addr, T v) {
    return hr_atomic_update<T>(addr, [](T a, T b) { return (T)(a & b); }, v);
}
template <typename T>
static inline T atomicCAS(T* addr, T compare, T v) {
    __atomic_compare_exchange_n(addr, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return compare;
}
