// The fake CUDA driver library (built by build.rs as libcuda.so, SONAME
// libcuda.so) that lets the real Rust CUDA path of headroom-model run on the
// CPU in tests: cudarc dlopens the driver by bare name, and the emulator is
// loaded first with that name, so every driver call lands here.
//
// - Device memory is host memory: a CUdeviceptr is a host address. Each
//   allocation has guard bytes on both sides, checked after every kernel
//   launch and at free, so an out-of-bounds write fails the launch instead of
//   corrupting the test silently; fresh memory is filled with 0xff bytes (NaN
//   as f16 and f32) so a read of never-written memory shows up too.
// - Streams are lazy: async copies, memsets, kernels, frees, host functions
//   and graph launches are queued on their stream and run, in order, on the
//   thread that waits for them (stream, event or context synchronisation, a
//   copy to pageable host memory, a synchronous free). A stream that waits on
//   an event runs the recording stream up to that event first. So the host
//   sees a result only after it has waited for it, as on a GPU: reading
//   pinned memory before its copy's event, or rewriting a pinned buffer
//   before the copy that reads it has run, gives the wrong bits here too.
//   Launch arguments are copied at the launch; a kernel's out-of-bounds
//   write is reported by the call that runs it (a synchronisation).
// - Stream capture records instead of running: kernels (with copies of
//   their arguments), copies, memsets, stream-ordered allocations and host
//   functions become the nodes of a graph, which cuGraphLaunch replays in
//   order. What a real capture refuses is refused here too, and it
//   invalidates the capture (cuStreamEndCapture then fails): synchronising
//   the capturing stream or the context, waiting on an event recorded
//   outside the capture, copying to or from pageable host memory,
//   synchronous allocation, copies and module loads on the capturing thread,
//   freeing memory the capture did not allocate. Stricter than CUDA: memory
//   allocated during a capture must be freed in it, and every replay refills
//   the graph's allocations with 0xff, so work that relies on what a
//   previous replay left in graph memory shows up.
// - Every call but the device queries, the primary context's retain and
//   release, and getting or setting the current context needs a context
//   current on the calling thread (CUDA_ERROR_INVALID_CONTEXT otherwise),
//   as the driver does: a thread that reaches the driver without binding
//   one (cudarc's safe calls bind it; a raw call does not) fails here too.
// - Modules ignore their PTX/CUBIN image; functions are found by name among
//   the kernels compiled into this library (emu.h's registry).
// - A launch runs the blocks one after another on the calling thread; the
//   threads of a block are fibers (fiber.h; a thread that never parks
//   shares the stack of the ones before it: fiber_entry), so __syncthreads and warp
//   shuffles are real rendezvous and __shared__ is shared by exactly the
//   threads of one block; a shuffle from a lane past the block's end or one
//   that has exited reads all-ones bits, and so does __shared__ memory no
//   thread of the block has written yet (a GPU's values are undefined). A GPU
//   runs blocks, and threads between two barriers, in no fixed order; so that
//   a kernel that depends on one order (a block reading what another block
//   writes, a thread reading shared memory another writes without a barrier
//   between) fails here too, every other launch runs its blocks last to first
//   and the ready threads of a block last to first (HEADROOM_CUDA_EMU_ORDER =
//   forward | reverse | alternate, the default).
// Only what cudarc and headroom use is implemented; anything else is a
// missing symbol, which cudarc reports by name.

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <thread>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <new>
#include <string>
#include <vector>

#include "cuda_shim.h"
#include "device.h"
#include "emu.h"
#include "fiber.h"

#if defined(__x86_64__)
// See fiber.h for the frame layout this pushes and pops.
__asm__(R"(
    .text
    .globl hr_emu_switch
    .hidden hr_emu_switch
    .type hr_emu_switch,@function
hr_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size hr_emu_switch, .-hr_emu_switch
)");
#endif

#define EXPORT extern "C" __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

enum : int {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209,
    CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
    CUDA_ERROR_ILLEGAL_INSTRUCTION = 715,
    CUDA_ERROR_MISALIGNED_ADDRESS = 716,
    CUDA_ERROR_LAUNCH_FAILED = 719,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
    CUDA_ERROR_STREAM_CAPTURE_ISOLATION = 905,
    CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908,
    CUDA_ERROR_ILLEGAL_STATE = 401,
};

// ---------------------------------------------------------------------------
// Kernel registry

namespace hr_emu {
static std::map<std::string, KernelEntry>& registry() {
    // A function-local static: the kernel units register from their static
    // initialisers, whose order relative to this file's is unspecified.
    static std::map<std::string, KernelEntry> r;
    return r;
}

void register_kernel(const KernelEntry& entry) { registry()[entry.name] = entry; }
}  // namespace hr_emu

// ---------------------------------------------------------------------------
// Fibers and the block scheduler

namespace hr_emu {
thread_local hr_uint3 t_thread_idx;
thread_local bool t_half_bf16 = false;
thread_local hr_uint3 t_block_idx;
thread_local hr_uint3 t_block_dim;
thread_local hr_uint3 t_grid_dim;
}  // namespace hr_emu

namespace {

const std::size_t kStackBytes = 64 * 1024;
const unsigned int kMaxThreads = 1024;

// Fresh: not started yet (its stack and context are set up when it starts).
enum class FState { Fresh, Ready, Barrier, Warp, Done };

// The order of a launch's blocks and of a block's threads: first to last,
// or last to first.
enum class Order { Forward, Reverse };

struct Fiber {
    hr_emu::FiberCtx ctx;
    char* mapping = nullptr;  // guard page, then the stack
    char* stack = nullptr;
    hr_uint3 tid{0, 0, 0};
    unsigned int lane = 0;
    unsigned int warp = 0;
    FState state = FState::Done;
    // What this lane hands to its warp's rendezvous: up to kWarpWords values.
    unsigned long long warp_value[hr_emu::kWarpWords] = {};
    unsigned int warp_words = 0;
    // cp.async copies queued and not yet completed, with the group each is in.
    struct AsyncCopy {
        void* dst;
        const void* src;  // null: zeros
        unsigned long long group;
    };
    std::vector<AsyncCopy> copies;
    unsigned long long groups_closed = 0;
};

struct WarpSlot {
    // published[word][lane]
    unsigned long long published[hr_emu::kWarpWords][32];
    unsigned int live_mask;
    // Whether the lanes of the latest rendezvous have yet to fill scratch
    // (warp_scratch).
    bool scratch_stale;
    float scratch[hr_emu::kWarpScratchFloats];
};

// One per OS thread that launches kernels; reused across launches.
struct Scheduler {
    std::vector<Fiber> fibers;
    std::vector<WarpSlot> warps;
    hr_emu::FiberCtx home;
    Fiber* cur = nullptr;
    const hr_emu::KernelEntry* entry = nullptr;
    void** params = nullptr;
    // The running block: its threads, their order, how many have not
    // finished, and the position (in that order) after the thread the
    // first pass started last.
    unsigned int threads = 0;
    Order order = Order::Forward;
    unsigned int live = 0;
    unsigned int next_position = 0;

    Fiber& at_position(unsigned int k) {
        return fibers[order == Order::Forward ? k : threads - 1 - k];
    }

    ~Scheduler() {
        const long page = sysconf(_SC_PAGESIZE);
        for (Fiber& f : fibers) {
            if (f.mapping != nullptr) {
                munmap(f.mapping, kStackBytes + (std::size_t)page);
            }
        }
    }

    bool ensure(unsigned int n) {
        const long page = sysconf(_SC_PAGESIZE);
        if (fibers.size() < n) {
            fibers.resize(n);
        }
        for (unsigned int i = 0; i < n; ++i) {
            Fiber& f = fibers[i];
            if (f.mapping != nullptr) {
                continue;
            }
            void* m = mmap(nullptr, kStackBytes + (std::size_t)page, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (m == MAP_FAILED) {
                return false;
            }
            // A stack overflow faults on the guard page instead of silently
            // writing into the neighbouring fiber's stack.
            mprotect(m, (std::size_t)page, PROT_NONE);
            f.mapping = static_cast<char*>(m);
            f.stack = f.mapping + page;
        }
        return true;
    }
};

thread_local Scheduler t_sched;

// Runs the current thread, then, on the same stack, each fresh thread
// that the scheduler's first pass would start next, until one parks (its
// frames now on this stack, its context saved in its own Fiber) or the
// pass has none left. The threads run in exactly the order and stretches
// the scheduler would give them, without a switch and a new context for
// each thread that never parks. A thread that starts here finds the
// frames of the one before it below the stack pointer, which memcheck
// marked undefined when they returned, as it does for a fiber's stack
// reused by the next block (what `cargo xtask memcheck`'s control, a
// one-thread block launched twice, proves each run; no control has two
// threads of one block yet).
[[noreturn]] void fiber_entry() {
    Scheduler& s = t_sched;
    hr_uint3* thread_idx = &hr_emu::t_thread_idx;
    for (;;) {
        s.entry->invoke(s.entry->fn, s.params);
        s.cur->state = FState::Done;
        --s.live;
        if (s.next_position >= s.threads) {
            break;
        }
        Fiber& next = s.at_position(s.next_position);
        if (next.state != FState::Fresh) {
            break;
        }
        ++s.next_position;
        next.state = FState::Ready;
        s.cur = &next;
        *thread_idx = next.tid;
    }
    hr_emu::fiber_switch(&s.cur->ctx, &s.home);
    std::abort();  // a finished fiber is never resumed
}

void park(FState why) {
    Scheduler& s = t_sched;
    Fiber* f = s.cur;
    f->state = why;
    hr_emu::fiber_switch(&f->ctx, &s.home);
}

std::string dim_str(hr_uint3 d) {
    return "(" + std::to_string(d.x) + "," + std::to_string(d.y) + "," + std::to_string(d.z) + ")";
}

// HEADROOM_CUDA_EMU_ORDER: the order of every launch, or (unset or
// "alternate") forward and reverse in turn.
Order next_order() {
    static const int fixed = [] {
        const char* v = std::getenv("HEADROOM_CUDA_EMU_ORDER");
        if (v == nullptr || std::strcmp(v, "alternate") == 0) return -1;
        if (std::strcmp(v, "forward") == 0) return 0;
        if (std::strcmp(v, "reverse") == 0) return 1;
        std::fprintf(stderr,
                     "headroom CUDA emulator: HEADROOM_CUDA_EMU_ORDER=%s: expected forward, "
                     "reverse or alternate\n",
                     v);
        std::abort();
    }();
    // Per OS thread (queued work runs on the thread that waits for it), so
    // the turns of one test's launches do not depend on other tests' threads.
    static thread_local unsigned long long launches = 0;
    const bool reverse = fixed < 0 ? (launches++ & 1u) != 0 : fixed == 1;
    return reverse ? Order::Reverse : Order::Forward;
}

// Counts the blocks run on this OS thread; a __shared__ variable last filled
// in an earlier block is filled again by the first thread to declare it.
thread_local unsigned long long t_block_serial = 0;

// Runs one block to completion. Returns an empty string, or why it failed.
// Neither inlined into its caller nor cloned for it: there `s` is t_sched,
// whose address the compiler would look up again after every switch.
__attribute__((noinline, noclone)) std::string run_block(Scheduler& s, unsigned int n, Order order) {
    ++t_block_serial;
    const hr_uint3 bd = hr_emu::t_block_dim;
    const unsigned int nwarps = (n + 31) / 32;
    s.warps.resize(nwarps);
    for (unsigned int i = 0; i < n; ++i) {
        Fiber& f = s.fibers[i];
        f.tid = hr_uint3{i % bd.x, (i / bd.x) % bd.y, i / (bd.x * bd.y)};
        f.lane = i % 32;
        f.warp = i / 32;
        f.state = FState::Fresh;
        f.copies.clear();
        f.groups_closed = 0;
    }
    s.threads = n;
    s.order = order;
    s.live = n;
    s.next_position = 0;
    // Taken once: each lookup of a thread-local is a __tls_get_addr call
    // (this library's TLS block is dynamic: it is dlopen'ed, and its
    // __shared__ arrays are too large for the static block).
    hr_uint3* thread_idx = &hr_emu::t_thread_idx;
    // (The empty asm hides where the pointer came from: otherwise the
    // compiler recomputes it, a lookup per switch, to spare a register.)
    __asm__("" : "+r"(thread_idx));
    Fiber* const fibers = s.fibers.data();
    for (;;) {
        for (unsigned int k = 0; k < n; ++k) {
            Fiber& f = fibers[order == Order::Forward ? k : n - 1 - k];
            if (f.state == FState::Fresh) {
                hr_emu::fiber_make(&f.ctx, f.stack, kStackBytes, &fiber_entry);
                f.state = FState::Ready;
                s.next_position = k + 1;
            } else if (f.state != FState::Ready) {
                continue;
            }
            s.cur = &f;
            *thread_idx = f.tid;
            hr_emu::fiber_switch(&s.home, &f.ctx);
        }
        const unsigned int live = s.live;
        if (live == 0) {
            for (unsigned int i = 0; i < n; ++i) {
                if (!s.fibers[i].copies.empty()) {
                    return "block " + dim_str(hr_emu::t_block_idx) + " ended with " +
                           std::to_string(s.fibers[i].copies.size()) +
                           " cp.async copies never waited for";
                }
            }
            return std::string();
        }
        // Everyone is parked. A warp whose live lanes all wait in a shuffle
        // or vote goes on first (its lanes may be needed at a later barrier).
        bool released = false;
        for (unsigned int w = 0; w < nwarps; ++w) {
            const unsigned int lo = w * 32;
            const unsigned int hi = lo + 32 < n ? lo + 32 : n;
            unsigned int live_lanes = 0, waiting = 0, mask = 0, words = 0;
            for (unsigned int i = lo; i < hi; ++i) {
                const Fiber& f = s.fibers[i];
                if (f.state != FState::Done) {
                    ++live_lanes;
                    mask |= 1u << f.lane;
                }
                if (f.state == FState::Warp) {
                    ++waiting;
                    words = f.warp_words > words ? f.warp_words : words;
                }
            }
            if (waiting == 0 || waiting != live_lanes) {
                continue;
            }
            WarpSlot& slot = s.warps[w];
            // A lane that has exited or is past the block's end publishes
            // nothing: a shuffle reading it gets all-ones bits (NaN, or an
            // index far out of range), as a GPU gives an undefined value,
            // so a kernel that uses what it read shows up as wrong here.
            // (The words no lane handed over are never read.)
            std::memset(slot.published, 0xff, words * sizeof slot.published[0]);
            slot.live_mask = mask;
            slot.scratch_stale = true;
            for (unsigned int i = lo; i < hi; ++i) {
                Fiber& f = s.fibers[i];
                if (f.state == FState::Warp) {
                    for (unsigned int word = 0; word < f.warp_words; ++word) {
                        slot.published[word][f.lane] = f.warp_value[word];
                    }
                    f.state = FState::Ready;
                }
            }
            released = true;
        }
        if (released) {
            continue;
        }
        unsigned int at_barrier = 0;
        for (unsigned int i = 0; i < n; ++i) {
            if (s.fibers[i].state == FState::Barrier) {
                ++at_barrier;
            }
        }
        if (at_barrier == live) {
            for (unsigned int i = 0; i < n; ++i) {
                if (s.fibers[i].state == FState::Barrier) {
                    s.fibers[i].state = FState::Ready;
                }
            }
            continue;
        }
        // Some threads wait at __syncthreads while others of the block wait
        // in a warp operation their warp-mates never reach: on a GPU this
        // hangs or is undefined; here it is reported.
        return "deadlock in block " + dim_str(hr_emu::t_block_idx) + ": " +
               std::to_string(at_barrier) + " of " + std::to_string(live) +
               " live threads wait at __syncthreads, the rest in a warp shuffle/vote";
    }
}

}  // namespace

namespace hr_emu {
void syncthreads() { park(FState::Barrier); }

namespace {
// The __shared__ variables this OS thread's blocks have declared, and the
// block that last filled each: a handful per thread (one per declaration).
struct SharedVar {
    void* p;
    unsigned long long filled_in;
};
thread_local std::vector<SharedVar> t_shared;
}  // namespace

void shared_declared(void* p, std::size_t bytes) {
    SharedVar* var = nullptr;
    for (SharedVar& v : t_shared) {
        if (v.p == p) {
            var = &v;
            break;
        }
    }
    if (var == nullptr) {
        t_shared.push_back(SharedVar{p, 0});
        var = &t_shared.back();
    }
    if (var->filled_in != t_block_serial) {
        // What a GPU's shared memory holds at a block's start is undefined.
        std::memset(p, 0xff, bytes);
        var->filled_in = t_block_serial;
    }
}

// The first misaligned access of the launch running on this OS thread.
thread_local std::string t_misaligned;

void check_aligned(const void* p, unsigned int bytes) {
    if ((std::uintptr_t)p % bytes == 0 || !t_misaligned.empty()) {
        return;
    }
    const hr_uint3 b = t_block_idx, t = t_thread_idx;
    char what[160];
    std::snprintf(what, sizeof what, "a %u-byte access at %p, block (%u,%u,%u) thread (%u,%u,%u)",
                  bytes, p, b.x, b.y, b.z, t.x, t.y, t.z);
    t_misaligned = what;
}

void cp_async16(void* dst, const void* src) {
    require_arch(80, "cp.async");
    check_aligned(dst, 16);
    if (src != nullptr) {
        check_aligned(src, 16);
    }
    Fiber* f = t_sched.cur;
    f->copies.push_back(Fiber::AsyncCopy{dst, src, f->groups_closed});
}

void cp_async_commit() {
    require_arch(80, "cp.async.commit_group");
    ++t_sched.cur->groups_closed;
}

void cp_async_wait(unsigned int newest_pending) {
    require_arch(80, "cp.async.wait_group");
    Fiber* f = t_sched.cur;
    const unsigned long long done_below =
        f->groups_closed > newest_pending ? f->groups_closed - newest_pending : 0;
    std::size_t kept = 0;
    for (const Fiber::AsyncCopy& c : f->copies) {
        if (c.group < done_below) {
            if (c.src != nullptr) {
                std::memcpy(c.dst, c.src, 16);
            } else {
                std::memset(c.dst, 0, 16);
            }
        } else {
            f->copies[kept++] = c;
        }
    }
    f->copies.resize(kept);
}

unsigned int warp_exchange_words(const unsigned long long* mine, unsigned int words,
                                 const unsigned long long (**all)[32], unsigned int* lane) {
    Scheduler& s = t_sched;
    Fiber* f = s.cur;
    std::memcpy(f->warp_value, mine, words * sizeof *mine);
    f->warp_words = words;
    park(FState::Warp);
    const WarpSlot& slot = s.warps[f->warp];
    *all = slot.published;
    *lane = f->lane;
    return slot.live_mask;
}

float* warp_scratch(bool* fill) {
    Scheduler& s = t_sched;
    WarpSlot& slot = s.warps[s.cur->warp];
    *fill = slot.scratch_stale;
    slot.scratch_stale = false;
    return slot.scratch;
}

unsigned int warp_exchange(unsigned long long mine, const unsigned long long** all,
                           unsigned int* lane) {
    const unsigned long long(*words)[32] = nullptr;
    const unsigned int live = warp_exchange_words(&mine, 1, &words, lane);
    *all = words[0];
    return live;
}
}  // namespace hr_emu

// ---------------------------------------------------------------------------
// Device memory

namespace {

const std::size_t kGuard = 256;  // bytes each side; keeps 256-byte alignment
const unsigned char kGuardByte = 0xa5;

struct Allocation {
    char* base;  // kGuard bytes before the user pointer
    std::size_t bytes;
};

struct Memory {
    std::mutex lock;
    std::map<CUdeviceptr, Allocation> live;
    std::size_t used = 0;
    std::size_t total = 0;
};

Memory& memory() {
    static Memory m;
    return m;
}

std::size_t total_bytes() {
    // 4 GiB unless HEADROOM_CUDA_EMU_MEMORY says otherwise: a cap on what
    // the tests may take from the host, reported as the device's size.
    static const std::size_t total = [] {
        const char* v = std::getenv("HEADROOM_CUDA_EMU_MEMORY");
        if (v != nullptr) {
            char* end = nullptr;
            const unsigned long long b = std::strtoull(v, &end, 10);
            if (end != v && b > 0) {
                return (std::size_t)b;
            }
        }
        return (std::size_t)4 << 30;
    }();
    return total;
}

bool guards_intact(const Allocation& a) {
    const unsigned char* lo = reinterpret_cast<unsigned char*>(a.base);
    const unsigned char* hi = lo + kGuard + a.bytes;
    for (std::size_t i = 0; i < kGuard; ++i) {
        if (lo[i] != kGuardByte || hi[i] != kGuardByte) {
            return false;
        }
    }
    return true;
}

CUresult mem_alloc(CUdeviceptr* out, std::size_t bytes) {
    if (out == nullptr) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    Memory& m = memory();
    std::lock_guard<std::mutex> g(m.lock);
    if (bytes > total_bytes() - m.used) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    const std::size_t rounded = (bytes + 255) / 256 * 256;
    void* p = std::aligned_alloc(256, rounded + 2 * kGuard);
    if (p == nullptr) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    char* base = static_cast<char*>(p);
    std::memset(base, kGuardByte, kGuard);
    std::memset(base + kGuard, 0xff, bytes);
    std::memset(base + kGuard + bytes, kGuardByte, rounded - bytes + kGuard);
    const CUdeviceptr dptr = (CUdeviceptr)(base + kGuard);
    m.live[dptr] = Allocation{base, bytes};
    m.used += bytes;
    *out = dptr;
    return CUDA_SUCCESS;
}

CUresult mem_free(CUdeviceptr dptr) {
    if (dptr == 0) {
        return CUDA_SUCCESS;
    }
    Memory& m = memory();
    std::lock_guard<std::mutex> g(m.lock);
    auto it = m.live.find(dptr);
    if (it == m.live.end()) {
        std::fprintf(stderr, "headroom CUDA emulator: free of %#llx, which is not an allocation\n",
                     dptr);
        return CUDA_ERROR_INVALID_VALUE;
    }
    const bool intact = guards_intact(it->second);
    if (!intact) {
        std::fprintf(stderr,
                     "headroom CUDA emulator: the guard bytes around the %zu-byte allocation at "
                     "%#llx were overwritten (an out-of-bounds write)\n",
                     it->second.bytes, dptr);
    }
    m.used -= it->second.bytes;
    std::free(it->second.base);
    m.live.erase(it);
    return intact ? CUDA_SUCCESS : CUDA_ERROR_ILLEGAL_ADDRESS;
}

// Names the first allocation whose guards a launch overwrote, or "".
std::string check_all_guards() {
    Memory& m = memory();
    std::lock_guard<std::mutex> g(m.lock);
    for (const auto& kv : m.live) {
        if (!guards_intact(kv.second)) {
            char buf[160];
            std::snprintf(buf, sizeof buf, "wrote outside the %zu-byte allocation at %#llx",
                          kv.second.bytes, kv.first);
            // Repair, so that one bad launch is reported once.
            std::memset(kv.second.base, kGuardByte, kGuard);
            std::memset(kv.second.base + kGuard + kv.second.bytes, kGuardByte, kGuard);
            return buf;
        }
    }
    return std::string();
}

// The allocation holding [p, p + n), for copies: a copy that strays past an
// allocation is a bug in the caller, reported like the GPU's illegal address.
bool device_range_ok(CUdeviceptr p, std::size_t n) {
    Memory& m = memory();
    std::lock_guard<std::mutex> g(m.lock);
    auto it = m.live.upper_bound(p);
    if (it == m.live.begin()) {
        return false;
    }
    --it;
    return p >= it->first && p + n <= it->first + it->second.bytes;
}

}  // namespace

// ---------------------------------------------------------------------------
// Driver objects

namespace {
struct Context {
    int device;
};

// What a graph replays, in order, and the allocations its alloc nodes own
// (freed when the last graph or executable graph made from it is destroyed).
struct GraphData {
    std::vector<std::function<CUresult()>> nodes;
    std::vector<CUdeviceptr> owned;
    ~GraphData();
};

struct Capture {
    std::shared_ptr<GraphData> graph = std::make_shared<GraphData>();
    bool invalid = false;
    bool thread_checks = true;  // not in CU_STREAM_CAPTURE_MODE_RELAXED
    // Allocated during the capture and not (yet) freed in it.
    std::set<CUdeviceptr> live;
};

// A stream's queued work. Shared with the events recorded on it and the
// streams waiting on those, so that they outlive the stream's handle.
struct Queue {
    std::recursive_mutex lock;
    // Notified whenever an operation finishes.
    std::condition_variable_any progress;
    std::deque<std::function<CUresult()>> pending;
    unsigned long long enqueued = 0;  // operations ever queued
    unsigned long long done = 0;      // operations taken to run
    unsigned long long finished = 0;  // operations that have finished running
    // The thread running an operation of this queue now (none: default).
    std::thread::id runner;
};

struct Stream {
    unsigned int flags;
    Capture* capture = nullptr;
    std::shared_ptr<Queue> queue = std::make_shared<Queue>();
};
struct Event {
    // When the recorded point of its stream ran.
    std::shared_ptr<std::chrono::steady_clock::time_point> at =
        std::make_shared<std::chrono::steady_clock::time_point>(std::chrono::steady_clock::now());
    // The queue it was last recorded on and that record's position in it
    // (null: recorded on the legacy stream, complete).
    std::shared_ptr<Queue> queue;
    unsigned long long seq = 0;
    // The capture whose stream recorded it last, or null.
    const Capture* captured = nullptr;
};
struct Graph {
    std::shared_ptr<GraphData> data;
};
struct GraphExec {
    std::shared_ptr<GraphData> data;
};

// The stream this thread is capturing (thread-local and global modes).
thread_local Stream* t_capturing = nullptr;

bool capturing(const Stream* s) { return s != nullptr && s->capture != nullptr; }

// Marks the capture of `s` invalid, saying why, and returns `rc`.
CUresult invalidate(Stream* s, CUresult rc, const char* what) {
    std::fprintf(stderr, "headroom CUDA emulator: %s during stream capture (the capture is invalidated)\n",
                 what);
    s->capture->invalid = true;
    return rc;
}

// For a call that a capturing thread may not make (it could synchronise).
CUresult refuse_while_capturing(const char* what) {
    if (capturing(t_capturing) && t_capturing->capture->thread_checks) {
        return invalidate(t_capturing, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, what);
    }
    return CUDA_SUCCESS;
}

// Records `node` into the capture of `s`.
CUresult record(Stream* s, std::function<CUresult()> node) {
    s->capture->graph->nodes.push_back(std::move(node));
    return CUDA_SUCCESS;
}

// Runs the work of `q` up to its operation number `upto`, in order (or
// waits while another thread runs it); the first failure this call ran is
// returned once all of it has run.
//
// No lock is held while an operation runs. An operation may wait on
// another queue, so a thread that held its queue's lock through that wait
// could deadlock against a thread running the other queue and waiting,
// in turn, on work of the first that had long finished (one test's
// context synchronisation while another test's streams run, say), though
// the streams themselves, like a GPU's, would not.
CUresult run_until(Queue& q, unsigned long long upto) {
    const std::thread::id me = std::this_thread::get_id();
    std::unique_lock<std::recursive_mutex> g(q.lock);
    CUresult first = CUDA_SUCCESS;
    while (q.finished < upto) {
        if (q.runner == me) {
            // An operation of this queue waits on this queue: what it has
            // taken counts as done (anything later runs here, nested).
            if (q.done >= upto) break;
        } else if (q.runner != std::thread::id()) {
            q.progress.wait(g);
            continue;
        }
        if (q.pending.empty()) break;
        std::function<CUresult()> node = std::move(q.pending.front());
        q.pending.pop_front();
        ++q.done;
        const std::thread::id outer = q.runner;
        q.runner = me;
        g.unlock();
        const CUresult rc = node();
        g.lock();
        q.runner = outer;
        ++q.finished;
        q.progress.notify_all();
        if (first == CUDA_SUCCESS) first = rc;
    }
    return first;
}

CUresult run_all(Queue& q) {
    unsigned long long upto;
    {
        std::lock_guard<std::recursive_mutex> g(q.lock);
        upto = q.enqueued;
    }
    return run_until(q, upto);
}

// Every stream's queue (the context's work).
std::mutex g_queues_lock;
std::vector<std::weak_ptr<Queue>>& queues() {
    static std::vector<std::weak_ptr<Queue>> q;
    return q;
}

void register_queue(const std::shared_ptr<Queue>& q) {
    std::lock_guard<std::mutex> g(g_queues_lock);
    auto& all = queues();
    all.erase(std::remove_if(all.begin(), all.end(), [](const std::weak_ptr<Queue>& w) { return w.expired(); }),
              all.end());
    all.push_back(q);
}

// Runs the queued work of every stream (context synchronisation).
CUresult run_everything() {
    std::vector<std::shared_ptr<Queue>> live;
    {
        std::lock_guard<std::mutex> g(g_queues_lock);
        for (auto& w : queues()) {
            if (auto q = w.lock()) live.push_back(std::move(q));
        }
    }
    CUresult first = CUDA_SUCCESS;
    for (auto& q : live) {
        const CUresult rc = run_all(*q);
        if (first == CUDA_SUCCESS) first = rc;
    }
    return first;
}

// Queues `node` on `s`: recorded when `s` is capturing; run now, after all
// queued work, on the legacy stream (which synchronises with the others).
CUresult enqueue(Stream* s, std::function<CUresult()> node) {
    if (capturing(s)) return record(s, std::move(node));
    if (s == nullptr) {
        const CUresult rc = run_everything();
        return rc != CUDA_SUCCESS ? rc : node();
    }
    std::lock_guard<std::recursive_mutex> g(s->queue->lock);
    s->queue->pending.push_back(std::move(node));
    ++s->queue->enqueued;
    return CUDA_SUCCESS;
}
struct Module {
    // Its image was compiled for bf16 (it carries headroom_half_format_bf16).
    bool half_bf16;
};
struct MemPool {
    unsigned long long release_threshold;
};

Context g_primary{0};
int g_primary_refs = 0;
MemPool g_pool{0};
std::mutex g_objects;
thread_local Context* t_current = nullptr;

// For the entry points that need a current context (see the top of the file).
CUresult no_context(const char* what) {
    std::fprintf(stderr, "headroom CUDA emulator: %s on a thread with no current context\n", what);
    return CUDA_ERROR_INVALID_CONTEXT;
}
#define HR_NEED_CONTEXT(what) \
    do { \
        if (t_current == nullptr) return no_context(what); \
    } while (0)

const char kDeviceName[] = "headroom CPU emulator";
}  // namespace

// ---------------------------------------------------------------------------
// Entry points: initialisation and device

EXPORT CUresult cuInit(unsigned int) { return CUDA_SUCCESS; }

EXPORT CUresult cuDriverGetVersion(int* v) {
    if (v == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *v = hr_emu::driver_version();
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetCount(int* n) {
    if (n == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *n = 1;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    if (d == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
    *d = 0;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
    if (name == nullptr || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    std::snprintf(name, (std::size_t)len, "%s", kDeviceName);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetUuid(unsigned char* uuid, CUdevice d) {
    if (uuid == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    std::memset(uuid, 0, 16);
    std::memcpy(uuid, "hr-cuda-emu", 11);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetUuid_v2(unsigned char* uuid, CUdevice d) { return cuDeviceGetUuid(uuid, d); }

EXPORT CUresult cuDeviceGetAttribute(int* v, int attrib, CUdevice d) {
    if (v == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    switch (attrib) {
        case 1: *v = (int)kMaxThreads; break;    // MAX_THREADS_PER_BLOCK
        case 2: *v = (int)kMaxThreads; break;    // MAX_BLOCK_DIM_X
        case 3: *v = (int)kMaxThreads; break;    // MAX_BLOCK_DIM_Y
        case 4: *v = 64; break;                  // MAX_BLOCK_DIM_Z
        case 5: *v = 2147483647; break;          // MAX_GRID_DIM_X
        case 6: *v = 65535; break;               // MAX_GRID_DIM_Y
        case 7: *v = 65535; break;               // MAX_GRID_DIM_Z
        case 8: *v = 48 * 1024; break;           // MAX_SHARED_MEMORY_PER_BLOCK
        case 10: *v = 32; break;                 // WARP_SIZE
        case 16: *v = 1; break;                  // MULTIPROCESSOR_COUNT
        // Compute capability: 8.0 unless HEADROOM_CUDA_EMU_ARCH or
        // hr_emu_answer_as says otherwise (device.cpp); the backend
        // compiles every kernel with NVRTC for it and picks its paths by it.
        case 75: *v = (int)(hr_emu::device_arch() / 10); break;
        case 76: *v = (int)(hr_emu::device_arch() % 10); break;
        case 115: *v = 1; break;                 // MEMORY_POOLS_SUPPORTED
        default: *v = 0; break;
    }
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceTotalMem_v2(std::size_t* bytes, CUdevice d) {
    if (bytes == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = total_bytes();
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGetErrorString(CUresult e, const char** s) {
    if (s == nullptr) return CUDA_ERROR_INVALID_VALUE;
    switch (e) {
        case CUDA_SUCCESS: *s = "no error"; break;
        case CUDA_ERROR_INVALID_VALUE: *s = "invalid argument"; break;
        case CUDA_ERROR_OUT_OF_MEMORY: *s = "out of memory (headroom CPU emulator)"; break;
        case CUDA_ERROR_INVALID_DEVICE: *s = "invalid device ordinal"; break;
        case CUDA_ERROR_INVALID_CONTEXT: *s = "invalid device context"; break;
        case CUDA_ERROR_INVALID_HANDLE: *s = "invalid resource handle"; break;
        case CUDA_ERROR_NOT_FOUND: *s = "named symbol not found (no such kernel in the emulator)"; break;
        case CUDA_ERROR_ILLEGAL_ADDRESS: *s = "an illegal memory access was encountered (emulator guard bytes)"; break;
        case CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: *s = "too many resources requested for launch"; break;
        case CUDA_ERROR_INVALID_IMAGE: *s = "device kernel image is invalid (see the emulator's message on stderr)"; break;
        case CUDA_ERROR_NO_BINARY_FOR_GPU: *s = "no kernel image is available for execution on the device"; break;
        case CUDA_ERROR_UNSUPPORTED_PTX_VERSION: *s = "the provided PTX was compiled with an unsupported toolchain"; break;
        case CUDA_ERROR_ILLEGAL_INSTRUCTION: *s = "an illegal instruction was encountered"; break;
        case CUDA_ERROR_LAUNCH_FAILED: *s = "unspecified launch failure (see the emulator's message on stderr)"; break;
        case CUDA_ERROR_NOT_SUPPORTED: *s = "operation not supported by the headroom CPU emulator"; break;
        default: *s = "unknown error (headroom CPU emulator)"; break;
    }
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGetErrorName(CUresult e, const char** s) {
    if (s == nullptr) return CUDA_ERROR_INVALID_VALUE;
    switch (e) {
        case CUDA_SUCCESS: *s = "CUDA_SUCCESS"; break;
        case CUDA_ERROR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
        case CUDA_ERROR_OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
        case CUDA_ERROR_INVALID_DEVICE: *s = "CUDA_ERROR_INVALID_DEVICE"; break;
        case CUDA_ERROR_INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; break;
        case CUDA_ERROR_INVALID_HANDLE: *s = "CUDA_ERROR_INVALID_HANDLE"; break;
        case CUDA_ERROR_NOT_FOUND: *s = "CUDA_ERROR_NOT_FOUND"; break;
        case CUDA_ERROR_ILLEGAL_ADDRESS: *s = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
        case CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: *s = "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"; break;
        case CUDA_ERROR_LAUNCH_FAILED: *s = "CUDA_ERROR_LAUNCH_FAILED"; break;
        case CUDA_ERROR_INVALID_IMAGE: *s = "CUDA_ERROR_INVALID_IMAGE"; break;
        case CUDA_ERROR_NO_BINARY_FOR_GPU: *s = "CUDA_ERROR_NO_BINARY_FOR_GPU"; break;
        case CUDA_ERROR_UNSUPPORTED_PTX_VERSION: *s = "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"; break;
        case CUDA_ERROR_ILLEGAL_INSTRUCTION: *s = "CUDA_ERROR_ILLEGAL_INSTRUCTION"; break;
        case CUDA_ERROR_NOT_SUPPORTED: *s = "CUDA_ERROR_NOT_SUPPORTED"; break;
        default: *s = "CUDA_ERROR_UNKNOWN"; break;
    }
    return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------
// Contexts

EXPORT CUresult cuDevicePrimaryCtxRetain(Context** ctx, CUdevice d) {
    if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    std::lock_guard<std::mutex> g(g_objects);
    ++g_primary_refs;
    *ctx = &g_primary;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    std::lock_guard<std::mutex> g(g_objects);
    if (g_primary_refs > 0) --g_primary_refs;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetCurrent(Context** ctx) {
    if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *ctx = t_current;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSetCurrent(Context* ctx) {
    t_current = ctx;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSynchronize() {
    HR_NEED_CONTEXT("cuCtxSynchronize");
    const CUresult rc = refuse_while_capturing("cuCtxSynchronize");
    return rc != CUDA_SUCCESS ? rc : run_everything();
}
EXPORT CUresult cuCtxSetFlags(unsigned int) {
    HR_NEED_CONTEXT("cuCtxSetFlags");
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
    HR_NEED_CONTEXT("cuCtxGetStreamPriorityRange");
    if (least != nullptr) *least = 0;
    if (greatest != nullptr) *greatest = 0;
    return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------
// Streams and events (lazy: work runs when something waits for it)

EXPORT CUresult cuStreamCreate(Stream** s, unsigned int flags) {
    HR_NEED_CONTEXT("cuStreamCreate");
    if (s == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *s = new (std::nothrow) Stream{flags};
    if (*s == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
    register_queue((*s)->queue);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamCreateWithPriority(Stream** s, unsigned int flags, int) {
    HR_NEED_CONTEXT("cuStreamCreateWithPriority");
    return cuStreamCreate(s, flags);
}

// A destroyed stream's queued work still runs (as on a GPU): here, now.
EXPORT CUresult cuStreamDestroy_v2(Stream* s) {
    HR_NEED_CONTEXT("cuStreamDestroy_v2");
    if (capturing(s)) return CUDA_ERROR_ILLEGAL_STATE;
    const CUresult rc = s != nullptr ? run_all(*s->queue) : CUDA_SUCCESS;
    delete s;
    return rc;
}

EXPORT CUresult cuStreamSynchronize(Stream* s) {
    HR_NEED_CONTEXT("cuStreamSynchronize");
    if (capturing(s)) return invalidate(s, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "cuStreamSynchronize");
    return s != nullptr ? run_all(*s->queue) : run_everything();
}
// Done once asked: the queued work runs, rather than answering "not ready"
// to a host that may poll without ever synchronising.
EXPORT CUresult cuStreamQuery(Stream* s) {
    HR_NEED_CONTEXT("cuStreamQuery");
    if (capturing(s)) return invalidate(s, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "cuStreamQuery");
    return s != nullptr ? run_all(*s->queue) : run_everything();
}
EXPORT CUresult cuStreamWaitEvent(Stream* s, Event* e, unsigned int) {
    HR_NEED_CONTEXT("cuStreamWaitEvent");
    if (e == nullptr) return CUDA_ERROR_INVALID_HANDLE;
    if (capturing(s) && e->captured != s->capture) {
        return invalidate(s, CUDA_ERROR_STREAM_CAPTURE_ISOLATION,
                          "cuStreamWaitEvent on an event recorded outside the capture");
    }
    if (!capturing(s) && e->captured != nullptr) {
        std::fprintf(stderr,
                     "headroom CUDA emulator: a stream outside a capture waits on captured work "
                     "(not emulated)\n");
        return CUDA_ERROR_STREAM_CAPTURE_ISOLATION;
    }
    if (capturing(s) || e->queue == nullptr || (s != nullptr && e->queue == s->queue)) {
        return CUDA_SUCCESS;  // captured, complete, or in order already
    }
    // The recording stream's work up to the event runs before what `s`
    // queues next.
    std::shared_ptr<Queue> source = e->queue;
    const unsigned long long seq = e->seq;
    return enqueue(s, [source, seq] { return run_until(*source, seq); });
}

EXPORT CUresult cuStreamIsCapturing(Stream* s, int* status) {
    HR_NEED_CONTEXT("cuStreamIsCapturing");
    if (status == nullptr) return CUDA_ERROR_INVALID_VALUE;
    // CU_STREAM_CAPTURE_STATUS_NONE, _ACTIVE, _INVALIDATED
    *status = !capturing(s) ? 0 : s->capture->invalid ? 2 : 1;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamBeginCapture_v2(Stream* s, int mode) {
    HR_NEED_CONTEXT("cuStreamBeginCapture_v2");
    if (s == nullptr) return CUDA_ERROR_NOT_SUPPORTED;  // the legacy stream cannot capture
    if (capturing(s) || capturing(t_capturing)) return CUDA_ERROR_ILLEGAL_STATE;
    s->capture = new (std::nothrow) Capture();
    if (s->capture == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
    s->capture->thread_checks = mode != 2;  // CU_STREAM_CAPTURE_MODE_RELAXED
    t_capturing = s;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamBeginCapture(Stream* s, int mode) { return cuStreamBeginCapture_v2(s, mode); }

EXPORT CUresult cuStreamEndCapture(Stream* s, Graph** graph) {
    HR_NEED_CONTEXT("cuStreamEndCapture");
    if (graph == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *graph = nullptr;
    if (!capturing(s)) return CUDA_ERROR_ILLEGAL_STATE;
    if (t_capturing != s) return CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD;
    Capture* c = s->capture;
    s->capture = nullptr;
    t_capturing = nullptr;
    // Memory the capture allocated but did not free stays an ordinary
    // allocation (its owner frees it later); the graph does not own it.
    const bool leaked = !c->live.empty();
    if (leaked) {
        std::fprintf(stderr,
                     "headroom CUDA emulator: %zu allocation(s) made during the capture were not "
                     "freed in it (the emulator requires graph memory to stay inside the graph)\n",
                     c->live.size());
    }
    const bool ok = !c->invalid && !leaked;
    std::shared_ptr<GraphData> data = c->graph;
    delete c;
    if (!ok) return leaked ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    *graph = new (std::nothrow) Graph{data};
    return *graph != nullptr ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

EXPORT CUresult cuGraphInstantiateWithFlags(GraphExec** exec, Graph* graph, unsigned long long) {
    HR_NEED_CONTEXT("cuGraphInstantiateWithFlags");
    if (exec == nullptr || graph == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *exec = new (std::nothrow) GraphExec{graph->data};
    return *exec != nullptr ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

EXPORT CUresult cuGraphLaunch(GraphExec* exec, Stream* s) {
    HR_NEED_CONTEXT("cuGraphLaunch");
    if (exec == nullptr) return CUDA_ERROR_INVALID_HANDLE;
    if (capturing(s)) return invalidate(s, CUDA_ERROR_NOT_SUPPORTED, "a graph launch (child graphs are not emulated)");
    // The launch keeps the graph alive until it has run.
    std::shared_ptr<GraphData> data = exec->data;
    return enqueue(s, [data] {
        for (auto& node : data->nodes) {
            const CUresult rc = node();
            if (rc != CUDA_SUCCESS) return rc;
        }
        return (CUresult)CUDA_SUCCESS;
    });
}

EXPORT CUresult cuGraphUpload(GraphExec* exec, Stream*) {
    HR_NEED_CONTEXT("cuGraphUpload");
    return exec != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

EXPORT CUresult cuGraphExecDestroy(GraphExec* exec) {
    HR_NEED_CONTEXT("cuGraphExecDestroy");
    delete exec;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphDestroy(Graph* graph) {
    HR_NEED_CONTEXT("cuGraphDestroy");
    delete graph;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventCreate(Event** e, unsigned int) {
    HR_NEED_CONTEXT("cuEventCreate");
    if (e == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *e = new (std::nothrow) Event();
    return *e != nullptr ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

EXPORT CUresult cuEventDestroy_v2(Event* e) {
    HR_NEED_CONTEXT("cuEventDestroy_v2");
    delete e;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventRecord(Event* e, Stream* s) {
    HR_NEED_CONTEXT("cuEventRecord");
    if (e == nullptr) return CUDA_ERROR_INVALID_HANDLE;
    if (capturing(s)) {
        e->captured = s->capture;
        return CUDA_SUCCESS;
    }
    e->captured = nullptr;
    // A fresh time point: a record still queued under an earlier one keeps
    // its own.
    auto at = std::make_shared<std::chrono::steady_clock::time_point>();
    e->at = at;
    const CUresult rc = enqueue(s, [at] {
        *at = std::chrono::steady_clock::now();
        return (CUresult)CUDA_SUCCESS;
    });
    if (s == nullptr) {
        e->queue = nullptr;
    } else {
        std::lock_guard<std::recursive_mutex> g(s->queue->lock);
        e->queue = s->queue;
        e->seq = s->queue->enqueued;
    }
    return rc;
}

// Runs the recording stream up to the event.
CUresult reach(Event* e) {
    if (e == nullptr) return CUDA_ERROR_INVALID_HANDLE;
    if (e->captured != nullptr) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    return e->queue != nullptr ? run_until(*e->queue, e->seq) : CUDA_SUCCESS;
}

// As cuStreamQuery: complete once asked.
EXPORT CUresult cuEventQuery(Event* e) {
    HR_NEED_CONTEXT("cuEventQuery");
    return reach(e);
}
EXPORT CUresult cuEventSynchronize(Event* e) {
    HR_NEED_CONTEXT("cuEventSynchronize");
    return reach(e);
}

EXPORT CUresult cuEventElapsedTime(float* ms, Event* start, Event* end) {
    HR_NEED_CONTEXT("cuEventElapsedTime");
    if (ms == nullptr || start == nullptr || end == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *ms = std::chrono::duration<float, std::milli>(*end->at - *start->at).count();
    return CUDA_SUCCESS;
}

// New in CUDA 12.8: a driver answering as an older CUDA has no such entry
// point (a real one lacks the symbol; here the call is refused).
EXPORT CUresult cuEventElapsedTime_v2(float* ms, Event* start, Event* end) {
    HR_NEED_CONTEXT("cuEventElapsedTime_v2");
    if (hr_emu::driver_version() < 12080) {
        std::fprintf(stderr, "headroom CUDA emulator: cuEventElapsedTime_v2 called on a driver for CUDA %d.%d, "
                             "which has none (CUDA 12.8 added it)\n",
                     hr_emu::driver_version() / 1000, hr_emu::driver_version() % 1000 / 10);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    return cuEventElapsedTime(ms, start, end);
}

typedef void (*CUhostFn)(void*);

EXPORT CUresult cuLaunchHostFunc(Stream* s, CUhostFn fn, void* data) {
    HR_NEED_CONTEXT("cuLaunchHostFunc");
    if (fn == nullptr) return CUDA_ERROR_INVALID_VALUE;
    return enqueue(s, [fn, data] {
        fn(data);
        return (CUresult)CUDA_SUCCESS;
    });
}

// ---------------------------------------------------------------------------
// Memory

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr* p, std::size_t bytes) {
    HR_NEED_CONTEXT("cuMemAlloc_v2");
    const CUresult rc = refuse_while_capturing("cuMemAlloc");
    return rc != CUDA_SUCCESS ? rc : mem_alloc(p, bytes);
}
// Synchronous, as cuMemFree is: queued work that may use `p` runs first.
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
    HR_NEED_CONTEXT("cuMemFree_v2");
    CUresult rc = refuse_while_capturing("cuMemFree");
    if (rc == CUDA_SUCCESS) rc = run_everything();
    return rc != CUDA_SUCCESS ? rc : mem_free(p);
}
EXPORT CUresult cuMemAllocAsync(CUdeviceptr* p, std::size_t bytes, Stream* s) {
    HR_NEED_CONTEXT("cuMemAllocAsync");
    const CUresult rc = mem_alloc(p, bytes);
    if (rc != CUDA_SUCCESS || !capturing(s)) return rc;
    // An alloc node: the address is the graph's for its lifetime, and every
    // replay hands it out as fresh memory again.
    const CUdeviceptr ptr = *p;
    s->capture->live.insert(ptr);
    return record(s, [ptr, bytes] {
        if (bytes > 0) std::memset((void*)ptr, 0xff, bytes);
        return (CUresult)CUDA_SUCCESS;
    });
}
EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr* p, std::size_t bytes, MemPool*, Stream* s) {
    HR_NEED_CONTEXT("cuMemAllocFromPoolAsync");
    return cuMemAllocAsync(p, bytes, s);
}
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, Stream* s) {
    HR_NEED_CONTEXT("cuMemFreeAsync");
    if (!capturing(s)) return enqueue(s, [p] { return mem_free(p); });
    if (s->capture->live.erase(p) == 0) {
        return invalidate(s, CUDA_ERROR_INVALID_VALUE,
                          "cuMemFreeAsync of memory the capture did not allocate");
    }
    s->capture->graph->owned.push_back(p);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemGetInfo_v2(std::size_t* free_bytes, std::size_t* total) {
    HR_NEED_CONTEXT("cuMemGetInfo_v2");
    if (free_bytes == nullptr || total == nullptr) return CUDA_ERROR_INVALID_VALUE;
    Memory& m = memory();
    std::lock_guard<std::mutex> g(m.lock);
    *total = total_bytes();
    *free_bytes = total_bytes() - m.used;
    return CUDA_SUCCESS;
}

// Pinned host allocations (start → bytes): a captured copy must use them.
std::map<const char*, std::size_t>& pinned() {
    static std::map<const char*, std::size_t> p;
    return p;
}
std::mutex g_pinned_lock;

bool is_pinned(const void* ptr, std::size_t n) {
    const char* p = static_cast<const char*>(ptr);
    std::lock_guard<std::mutex> g(g_pinned_lock);
    auto it = pinned().upper_bound(p);
    if (it == pinned().begin()) return false;
    --it;
    return p >= it->first && p + n <= it->first + it->second;
}

EXPORT CUresult cuMemHostAlloc(void** p, std::size_t bytes, unsigned int) {
    HR_NEED_CONTEXT("cuMemHostAlloc");
    if (p == nullptr) return CUDA_ERROR_INVALID_VALUE;
    const CUresult rc = refuse_while_capturing("cuMemHostAlloc");
    if (rc != CUDA_SUCCESS) return rc;
    *p = std::aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
    if (*p == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
    std::lock_guard<std::mutex> g(g_pinned_lock);
    pinned()[static_cast<const char*>(*p)] = bytes;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemFreeHost(void* p) {
    HR_NEED_CONTEXT("cuMemFreeHost");
    CUresult rc = refuse_while_capturing("cuMemFreeHost");
    if (rc == CUDA_SUCCESS) rc = run_everything();  // synchronous, as in CUDA
    if (rc != CUDA_SUCCESS) return rc;
    {
        std::lock_guard<std::mutex> g(g_pinned_lock);
        pinned().erase(static_cast<const char*>(p));
    }
    std::free(p);
    return CUDA_SUCCESS;
}

static CUresult copy_checked(void* dst, const void* src, std::size_t n, bool dst_dev, bool src_dev) {
    if (n == 0) return CUDA_SUCCESS;
    if ((dst_dev && !device_range_ok((CUdeviceptr)dst, n)) ||
        (src_dev && !device_range_ok((CUdeviceptr)src, n))) {
        std::fprintf(stderr, "headroom CUDA emulator: a %zu-byte copy strays outside its device allocation\n", n);
        return CUDA_ERROR_INVALID_VALUE;
    }
    std::memmove(dst, src, n);
    return CUDA_SUCCESS;
}

// A copy on stream `s`: queued, or recorded when `s` is capturing (where
// host memory must be pinned, as CUDA requires of graph memcpy nodes). Pinned
// host memory is read or written when the copy runs. Pageable memory is
// handled as CUDA does: a copy to it returns once done; a copy from it has
// taken the bytes when it returns.
CUresult copy_on(Stream* s, void* dst, const void* src, std::size_t n, bool dst_dev, bool src_dev) {
    const bool dst_pageable = !dst_dev && !is_pinned(dst, n);
    const bool src_pageable = !src_dev && !is_pinned(src, n);
    if (capturing(s)) {
        if (dst_pageable || src_pageable) {
            return invalidate(s, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "a copy to or from pageable host memory");
        }
        return record(s, [=] { return copy_checked(dst, src, n, dst_dev, src_dev); });
    }
    if (dst_pageable) {
        const CUresult rc = s != nullptr ? run_all(*s->queue) : run_everything();
        return rc != CUDA_SUCCESS ? rc : copy_checked(dst, src, n, dst_dev, src_dev);
    }
    if (src_pageable) {
        auto bytes = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                         static_cast<const char*>(src) + n);
        return enqueue(s, [=] { return copy_checked(dst, bytes->data(), n, dst_dev, false); });
    }
    return enqueue(s, [=] { return copy_checked(dst, src, n, dst_dev, src_dev); });
}

// The synchronous copies: after all queued work (as the legacy stream).
CUresult copy_now(const char* what, void* dst, const void* src, std::size_t n, bool dst_dev, bool src_dev) {
    CUresult rc = refuse_while_capturing(what);
    if (rc == CUDA_SUCCESS) rc = run_everything();
    return rc != CUDA_SUCCESS ? rc : copy_checked(dst, src, n, dst_dev, src_dev);
}

EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, std::size_t n) {
    HR_NEED_CONTEXT("cuMemcpyHtoD_v2");
    return copy_now("cuMemcpyHtoD", (void*)dst, src, n, true, false);
}
EXPORT CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, std::size_t n) {
    HR_NEED_CONTEXT("cuMemcpyDtoH_v2");
    return copy_now("cuMemcpyDtoH", dst, (const void*)src, n, false, true);
}
EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, std::size_t n) {
    HR_NEED_CONTEXT("cuMemcpyDtoD_v2");
    return copy_now("cuMemcpyDtoD", (void*)dst, (const void*)src, n, true, true);
}
EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, std::size_t n, Stream* s) {
    HR_NEED_CONTEXT("cuMemcpyHtoDAsync_v2");
    return copy_on(s, (void*)dst, src, n, true, false);
}
EXPORT CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, std::size_t n, Stream* s) {
    HR_NEED_CONTEXT("cuMemcpyDtoHAsync_v2");
    return copy_on(s, dst, (const void*)src, n, false, true);
}
EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, std::size_t n, Stream* s) {
    HR_NEED_CONTEXT("cuMemcpyDtoDAsync_v2");
    return copy_on(s, (void*)dst, (const void*)src, n, true, true);
}

CUresult memset8(CUdeviceptr dst, unsigned char v, std::size_t n) {
    if (n == 0) return CUDA_SUCCESS;
    if (!device_range_ok(dst, n)) return CUDA_ERROR_INVALID_VALUE;
    std::memset((void*)dst, v, n);
    return CUDA_SUCCESS;
}
CUresult memset32(CUdeviceptr dst, unsigned int v, std::size_t n) {
    if (n == 0) return CUDA_SUCCESS;
    if (!device_range_ok(dst, n * 4)) return CUDA_ERROR_INVALID_VALUE;
    unsigned int* p = (unsigned int*)dst;
    for (std::size_t i = 0; i < n; ++i) p[i] = v;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, std::size_t n) {
    HR_NEED_CONTEXT("cuMemsetD8_v2");
    CUresult rc = refuse_while_capturing("cuMemsetD8");
    if (rc == CUDA_SUCCESS) rc = run_everything();
    return rc != CUDA_SUCCESS ? rc : memset8(dst, v, n);
}
EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, std::size_t n, Stream* s) {
    HR_NEED_CONTEXT("cuMemsetD8Async");
    return enqueue(s, [=] { return memset8(dst, v, n); });
}
EXPORT CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned int v, std::size_t n) {
    HR_NEED_CONTEXT("cuMemsetD32_v2");
    CUresult rc = refuse_while_capturing("cuMemsetD32");
    if (rc == CUDA_SUCCESS) rc = run_everything();
    return rc != CUDA_SUCCESS ? rc : memset32(dst, v, n);
}
EXPORT CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned int v, std::size_t n, Stream* s) {
    HR_NEED_CONTEXT("cuMemsetD32Async");
    return enqueue(s, [=] { return memset32(dst, v, n); });
}

// The stream-ordered pool: allocations are immediate, so nothing is cached;
// "reserved" is what is in use.
EXPORT CUresult cuDeviceGetDefaultMemPool(MemPool** pool, CUdevice d) {
    HR_NEED_CONTEXT("cuDeviceGetDefaultMemPool");
    if (pool == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    *pool = &g_pool;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetMemPool(MemPool** pool, CUdevice d) { return cuDeviceGetDefaultMemPool(pool, d); }

EXPORT CUresult cuMemPoolSetAttribute(MemPool* pool, int attr, void* value) {
    HR_NEED_CONTEXT("cuMemPoolSetAttribute");
    if (pool == nullptr || value == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (attr == 4) {  // RELEASE_THRESHOLD
        std::memcpy(&pool->release_threshold, value, 8);
    }
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemPoolGetAttribute(MemPool* pool, int attr, void* value) {
    HR_NEED_CONTEXT("cuMemPoolGetAttribute");
    if (pool == nullptr || value == nullptr) return CUDA_ERROR_INVALID_VALUE;
    unsigned long long v = 0;
    switch (attr) {
        case 4: v = pool->release_threshold; break;
        case 5:    // RESERVED_MEM_CURRENT
        case 7: {  // USED_MEM_CURRENT
            Memory& m = memory();
            std::lock_guard<std::mutex> g(m.lock);
            v = m.used;
            break;
        }
        default: v = 0; break;
    }
    std::memcpy(value, &v, 8);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemPoolTrimTo(MemPool*, std::size_t) {
    HR_NEED_CONTEXT("cuMemPoolTrimTo");
    return CUDA_SUCCESS;
}
// Graph memory is freed with its graph here; nothing is cached to trim.
EXPORT CUresult cuDeviceGraphMemTrim(CUdevice d) {
    HR_NEED_CONTEXT("cuDeviceGraphMemTrim");
    return d == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

// ---------------------------------------------------------------------------
// Modules and launches

EXPORT CUresult cuModuleLoadData(Module** m, const void* image) {
    HR_NEED_CONTEXT("cuModuleLoadData");
    if (m == nullptr || image == nullptr) return CUDA_ERROR_INVALID_VALUE;
    const CUresult rc = refuse_while_capturing("cuModuleLoadData");
    if (rc != CUDA_SUCCESS) return rc;
    // The image (PTX or CUBIN from NVRTC) only proves the source compiles
    // for the GPU; the host-compiled kernels of the same source run instead.
    // It must still be one this device and driver would load (device.cpp).
    std::string why;
    const CUresult loads = hr_emu::check_module_image(image, &why);
    if (loads != CUDA_SUCCESS) {
        std::fprintf(stderr, "headroom CUDA emulator: cuModuleLoadData refused %s\n", why.c_str());
        return loads;
    }
    *m = new (std::nothrow) Module{hr_emu::image_has_symbol(image, "headroom_half_format_bf16")};
    return *m != nullptr ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

EXPORT CUresult cuModuleUnload(Module* m) {
    HR_NEED_CONTEXT("cuModuleUnload");
    delete m;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuModuleGetFunction(const hr_emu::KernelEntry** f, Module* m, const char* name) {
    HR_NEED_CONTEXT("cuModuleGetFunction");
    if (f == nullptr || m == nullptr || name == nullptr) return CUDA_ERROR_INVALID_VALUE;
    auto& r = hr_emu::registry();
    auto it = r.find(name);
    if (it == r.end()) {
        std::fprintf(stderr, "headroom CUDA emulator: no kernel named %s was compiled in\n", name);
        return CUDA_ERROR_NOT_FOUND;
    }
    if (!m->half_bf16) {
        *f = &it->second;
        return CUDA_SUCCESS;
    }
    // The bf16 module's kernel: the same host code, run with bf16's
    // conversions. One copy per name, kept for the process (entries are
    // never freed, like the registry's).
    static std::mutex bf16_mutex;
    static std::map<std::string, hr_emu::KernelEntry> bf16_entries;
    std::lock_guard<std::mutex> lock(bf16_mutex);
    auto [copy, fresh] = bf16_entries.try_emplace(name, it->second);
    if (fresh) copy->second.half_bf16 = 1u;
    *f = &copy->second;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuFuncSetAttribute(const hr_emu::KernelEntry*, int, int) {
    HR_NEED_CONTEXT("cuFuncSetAttribute");
    return CUDA_SUCCESS;
}
EXPORT CUresult cuFuncSetCacheConfig(const hr_emu::KernelEntry*, int) {
    HR_NEED_CONTEXT("cuFuncSetCacheConfig");
    return CUDA_SUCCESS;
}

EXPORT CUresult cuFuncGetAttribute(int* v, int attrib, const hr_emu::KernelEntry*) {
    HR_NEED_CONTEXT("cuFuncGetAttribute");
    if (v == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *v = attrib == 0 ? (int)kMaxThreads : 0;  // MAX_THREADS_PER_BLOCK
    return CUDA_SUCCESS;
}

namespace {
// The widest block a launch may have: CUDA's 1024, or less where a test
// harness says its kernels were checked to fit only narrower blocks (a GPU
// refuses a launch whose block needs more registers than an SM has), or
// where HEADROOM_CUDA_EMU_WIDEST_BLOCK says so for a whole program (the GPU
// bundle's dry run, whose binaries load the emulator without a harness).
unsigned int widest_block_from_env() {
    const char* v = std::getenv("HEADROOM_CUDA_EMU_WIDEST_BLOCK");
    if (v == nullptr) return kMaxThreads;
    char* end = nullptr;
    const unsigned long n = std::strtoul(v, &end, 10);
    if (end == v || *end != '\0' || n < 1 || n > kMaxThreads) {
        std::fprintf(stderr,
                     "headroom CUDA emulator: HEADROOM_CUDA_EMU_WIDEST_BLOCK=%s: expected a "
                     "number of threads from 1 to %u\n",
                     v, kMaxThreads);
        std::abort();
    }
    return (unsigned int)n;
}
std::atomic<unsigned int> g_widest_block{widest_block_from_env()};

// How many times each kernel has run (directly or in a graph), for tests
// that must know which path an op took.
std::mutex g_runs_mutex;
std::map<std::string, unsigned long long> g_runs;

CUresult launch_now(const hr_emu::KernelEntry* f, unsigned int gx, unsigned int gy, unsigned int gz,
                    unsigned int bx, unsigned int by, unsigned int bz, void** params) {
    const unsigned long long threads = (unsigned long long)bx * by * bz;
    Scheduler& s = t_sched;
    if (s.entry != nullptr) {
        // A kernel launching a kernel (dynamic parallelism) is not emulated.
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    {
        std::lock_guard<std::mutex> lock(g_runs_mutex);
        ++g_runs[f->name];
    }
    if (!s.ensure((unsigned int)threads)) return CUDA_ERROR_OUT_OF_MEMORY;
    s.entry = f;
    s.params = params;
    hr_emu::t_half_bf16 = f->half_bf16 != 0u;
    hr_emu::t_grid_dim = hr_uint3{gx, gy, gz};
    hr_emu::t_block_dim = hr_uint3{bx, by, bz};
    std::string failure;
    const Order order = next_order();
    const unsigned long long blocks = (unsigned long long)gx * gy * gz;
    for (unsigned long long k = 0; k < blocks && failure.empty(); ++k) {
        const unsigned long long b = order == Order::Forward ? k : blocks - 1 - k;
        hr_emu::t_block_idx = hr_uint3{(unsigned int)(b % gx), (unsigned int)(b / gx % gy),
                                       (unsigned int)(b / gx / gy)};
        failure = run_block(s, (unsigned int)threads, order);
    }
    s.entry = nullptr;
    s.params = nullptr;
    s.cur = nullptr;
    hr_emu::t_half_bf16 = false;
    const std::string misaligned = std::move(hr_emu::t_misaligned);
    hr_emu::t_misaligned.clear();
    const std::string missing = hr_emu::take_missing_instruction();
    if (failure.empty() && !missing.empty()) {
        std::fprintf(stderr, "headroom CUDA emulator: kernel %s grid %s block %s: illegal instruction: %s\n",
                     f->name, dim_str(hr_uint3{gx, gy, gz}).c_str(),
                     dim_str(hr_uint3{bx, by, bz}).c_str(), missing.c_str());
        return CUDA_ERROR_ILLEGAL_INSTRUCTION;
    }
    if (failure.empty() && !misaligned.empty()) {
        std::fprintf(stderr, "headroom CUDA emulator: kernel %s grid %s block %s: misaligned: %s\n",
                     f->name, dim_str(hr_uint3{gx, gy, gz}).c_str(),
                     dim_str(hr_uint3{bx, by, bz}).c_str(), misaligned.c_str());
        return CUDA_ERROR_MISALIGNED_ADDRESS;
    }
    if (!failure.empty()) {
        std::fprintf(stderr, "headroom CUDA emulator: kernel %s grid %s block %s: %s\n", f->name,
                     dim_str(hr_uint3{gx, gy, gz}).c_str(), dim_str(hr_uint3{bx, by, bz}).c_str(),
                     failure.c_str());
        return CUDA_ERROR_LAUNCH_FAILED;
    }
    const std::string guards = check_all_guards();
    if (!guards.empty()) {
        std::fprintf(stderr, "headroom CUDA emulator: kernel %s grid %s block %s %s\n", f->name,
                     dim_str(hr_uint3{gx, gy, gz}).c_str(), dim_str(hr_uint3{bx, by, bz}).c_str(),
                     guards.c_str());
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    }
    return CUDA_SUCCESS;
}
}  // namespace

namespace {
// Two `__restrict__` pointer arguments with the same address, one of them
// written through: the compiler may keep a value in a register, or read it
// through the read-only cache, across the other's write, so the result on a
// GPU can differ from the one a CPU computes. Refused here, where the CPU
// would not show it. (The same address only: views of one allocation that
// overlap without starting together are not detected.)
const char* restrict_alias(const hr_emu::KernelEntry* f, void** params) {
    for (unsigned int i = 0; i < f->arity; ++i) {
        if (!(f->restrict_mask >> i & 1u) || f->arg_bytes[i] != sizeof(CUdeviceptr)) continue;
        for (unsigned int j = i + 1; j < f->arity; ++j) {
            if (!(f->restrict_mask >> j & 1u) || f->arg_bytes[j] != sizeof(CUdeviceptr)) continue;
            if (!((f->written_mask >> i | f->written_mask >> j) & 1u)) continue;
            CUdeviceptr a, b;
            std::memcpy(&a, params[i], sizeof a);
            std::memcpy(&b, params[j], sizeof b);
            if (a != 0 && a == b) {
                static thread_local char why[96];
                std::snprintf(why, sizeof why,
                              "__restrict__ arguments %u and %u are the same address, one written", i, j);
                return why;
            }
        }
    }
    return nullptr;
}
}  // namespace

EXPORT CUresult cuLaunchKernel(const hr_emu::KernelEntry* f, unsigned int gx, unsigned int gy,
                               unsigned int gz, unsigned int bx, unsigned int by, unsigned int bz,
                               unsigned int shared_bytes, Stream* stream, void** params, void** extra) {
    HR_NEED_CONTEXT("cuLaunchKernel");
    if (f == nullptr) return CUDA_ERROR_INVALID_HANDLE;
    if (extra != nullptr || (params == nullptr && f->arity > 0)) {
        std::fprintf(stderr, "headroom CUDA emulator: %s: only kernelParams are supported\n", f->name);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    const unsigned long long threads = (unsigned long long)bx * by * bz;
    if (gx == 0 || gy == 0 || gz == 0 || threads == 0) return CUDA_ERROR_INVALID_VALUE;
    // CUDA's limits on each dimension (cuDeviceGetAttribute's MAX_GRID_DIM_*
    // and MAX_BLOCK_DIM_*): a grid of more than 65535 in y or z is refused
    // on a GPU, so it is here.
    if (gx > 0x7fffffffu || gy > 65535 || gz > 65535 || bx > 1024 || by > 1024 || bz > 64) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (shared_bytes > 48 * 1024) return CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES;
    const unsigned int widest = g_widest_block.load();
    if (threads > widest) {
        std::fprintf(stderr,
                     "headroom CUDA emulator: %s: a block of %llu threads, more than the %u "
                     "this process allows\n",
                     f->name, threads, widest);
        return CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES;
    }
    if (const char* clash = restrict_alias(f, params)) {
        std::fprintf(stderr, "headroom CUDA emulator: %s: %s\n", f->name, clash);
        return CUDA_ERROR_INVALID_VALUE;
    }
    // Queued or captured work keeps copies of the argument values.
    auto args = std::make_shared<std::vector<std::vector<char>>>();
    for (unsigned int i = 0; i < f->arity; ++i) {
        const char* p = static_cast<const char*>(params[i]);
        args->emplace_back(p, p + f->arg_bytes[i]);
    }
    return enqueue(stream, [=] {
        std::vector<void*> ptrs;
        for (auto& a : *args) ptrs.push_back(a.data());
        return launch_now(f, gx, gy, gz, bx, by, bz, ptrs.data());
    });
}

// ---------------------------------------------------------------------------
// For the emulator's own tests (crates/cuda-emu/tests): the kernels' f16
// conversions (common.cuh, compiled here as the kernels see them).
namespace hr_conv {
#include "common.cuh"
}

EXPORT unsigned short hr_emu_f32_to_f16(float f) { return hr_conv::hr_f32_to_f16(f); }
EXPORT float hr_emu_f16_to_f32(unsigned short h) { return hr_conv::hr_f16_to_f32(h); }
EXPORT unsigned short hr_emu_f32_to_bf16(float f) { return hr_conv::hr_f32_to_bf16(f); }
EXPORT float hr_emu_bf16_to_f32(unsigned short h) { return hr_conv::hr_bf16_to_f32(h); }

// Launches with more than `threads` threads in a block (1 to 1024) fail from
// now on, as CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES.
EXPORT void hr_emu_limit_block_threads(unsigned int threads) {
    g_widest_block.store(std::min(std::max(threads, 1u), kMaxThreads));
}

// How many times kernel `name` has run in this process.
EXPORT unsigned long long hr_emu_kernel_runs(const char* name) {
    std::lock_guard<std::mutex> lock(g_runs_mutex);
    const auto it = g_runs.find(name);
    return it == g_runs.end() ? 0 : it->second;
}

// The names of every kernel compiled in, one per line (for a test that the
// registry is complete).
EXPORT const char* hr_emu_kernel_names() {
    static const std::string names = [] {
        std::string s;
        for (const auto& kv : hr_emu::registry()) {
            s += kv.first;
            s += '\n';
        }
        return s;
    }();
    return names.c_str();
}

// Defined here, after mem_free: a graph's alloc nodes' memory goes back when
// the last graph or executable made from it is destroyed.
GraphData::~GraphData() {
    for (CUdeviceptr p : owned) mem_free(p);
}
