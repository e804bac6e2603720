// The fake NCCL (built by build.rs as libnccl.so, SONAME libnccl.so) for the
// emulated CUDA backend: the calls crates/model/src/cuda/nccl.rs makes, so
// that the data-parallel ranks of GPUs run their real code path on the CPU,
// one process per rank, each with its own emulated device.
//
// - The unique id names a mailbox directory (made by ncclGetUniqueId under
//   $TMPDIR); every rank of the world reaches it through the id, as a real
//   NCCL reaches rank 0's bootstrap socket. ncclCommInitRank writes the
//   rank's join file and waits until every rank has joined.
// - A message is one file per (sender, receiver, sequence number), written
//   whole and renamed into place; its receiver reads and removes it.
//   Sequence numbers count each pair's calls in program order, which is how
//   NCCL matches a send with its receive.
// - The work is queued on the stream as a host function of the fake driver
//   (found by dlsym, as shim/cublas.cpp does), so it runs in stream order
//   with the kernels around it; the driver's streams are lazy, so it runs
//   on the thread that waits for the stream. A group (ncclGroupStart/End)
//   becomes one host function per stream, its sends first, so that two
//   ranks exchanging never deadlock.
// - A receive waits at most HEADROOM_NCCL_EMU_TIMEOUT_S seconds (default
//   60) for its message, then records an asynchronous error
//   (ncclCommGetAsyncError), as a real NCCL's watchdog would report a dead
//   peer; so does a message of the wrong length. An aborted communicator's
//   queued work does nothing.
// - The last rank to leave (ncclCommAbort/Destroy) removes the mailbox.
// - Ranks must be processes: the fake driver's context synchronisation
//   runs every stream of the process, so one thread could end up running
//   another rank's receive before its own send.
// - Collective calls other than ncclAllGather, and streams that are
//   capturing a graph, are refused (ncclInvalidUsage): headroom never
//   makes them.

#include <dirent.h>
#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#define EXPORT extern "C" __attribute__((visibility("default")))

typedef int ncclResult_t;
enum : int {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
};

namespace {

const char kMagic[8] = {'H', 'R', 'N', 'C', 'C', 'L', '1', 0};
constexpr std::size_t kIdBytes = 128;

struct UniqueId {
    char internal[kIdBytes];
};

std::size_t type_size(int type) {
    switch (type) {
        case 0:  // int8
        case 1:  // uint8
            return 1;
        case 6:  // float16
        case 9:  // bfloat16 (NCCL >= 2.10)
            return 2;
        case 2:  // int32
        case 3:  // uint32
        case 7:  // float32
            return 4;
        case 4:  // int64
        case 5:  // uint64
        case 8:  // float64
            return 8;
        default:
            return 0;
    }
}

double timeout_seconds() {
    const char* text = std::getenv("HEADROOM_NCCL_EMU_TIMEOUT_S");
    if (text == nullptr || *text == 0) return 60.0;
    char* end = nullptr;
    const double s = std::strtod(text, &end);
    return (end != nullptr && *end == 0 && s > 0) ? s : 60.0;
}

bool exists(const std::string& path) {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0;
}

// Writes `bytes` to `path` whole: a temporary file renamed into place, so a
// reader never sees part of it.
bool write_whole(const std::string& path, const void* bytes, std::size_t len) {
    const std::string tmp = path + ".partial";
    FILE* f = std::fopen(tmp.c_str(), "wb");
    if (f == nullptr) return false;
    const bool written = len == 0 || std::fwrite(bytes, 1, len, f) == len;
    const bool closed = std::fclose(f) == 0;
    if (!written || !closed) {
        ::unlink(tmp.c_str());
        return false;
    }
    return std::rename(tmp.c_str(), path.c_str()) == 0;
}

// The state of one rank's communicator, shared with its queued work (which
// may run after the handle is gone).
struct State {
    std::string dir;
    int rank = 0;
    int world = 0;
    double timeout = 60.0;
    std::atomic<bool> aborted{false};
    std::atomic<int> async_error{ncclSuccess};
    std::mutex lock;  // the sequence counters
    std::vector<unsigned long long> sent, received;

    void fail(int code, const std::string& why) {
        int expected = ncclSuccess;
        if (async_error.compare_exchange_strong(expected, code)) {
            std::fprintf(stderr, "headroom NCCL emulator: rank %d of %d: %s\n", rank, world, why.c_str());
        }
    }
    std::string message(int from, int to, unsigned long long seq) const {
        return dir + "/m-" + std::to_string(from) + "-" + std::to_string(to) + "-" + std::to_string(seq);
    }
};

struct Comm {
    std::shared_ptr<State> state;
};

// One point-to-point transfer, its sequence number fixed at the call.
struct Op {
    bool send;
    int peer;
    unsigned long long seq;
    void* buffer;
    std::size_t bytes;
};

struct Work {
    std::shared_ptr<State> state;
    void* stream;
    std::vector<Op> ops;  // sends before receives
    // A copy on this rank before the transfers (an all-gather that is not
    // in place).
    const void* copy_from = nullptr;
    void* copy_to = nullptr;
    std::size_t copy_bytes = 0;
};

void send_now(State& s, const Op& op) {
    if (!write_whole(s.message(s.rank, op.peer, op.seq), op.buffer, op.bytes)) {
        s.fail(ncclSystemError, "could not write a message for rank " + std::to_string(op.peer) + " in " + s.dir);
    }
}

void receive_now(State& s, const Op& op) {
    const std::string path = s.message(op.peer, s.rank, op.seq);
    const auto start = std::chrono::steady_clock::now();
    while (!exists(path)) {
        if (s.aborted.load()) return;
        const double waited =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (waited >= s.timeout) {
            s.fail(ncclRemoteError, "no message from rank " + std::to_string(op.peer) + " after " +
                                        std::to_string(static_cast<int>(waited)) +
                                        " s (HEADROOM_NCCL_EMU_TIMEOUT_S): the peer died or hangs");
            return;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    FILE* f = std::fopen(path.c_str(), "rb");
    if (f == nullptr) {
        s.fail(ncclSystemError, "could not open " + path);
        return;
    }
    std::vector<char> data(op.bytes + 1);
    const std::size_t got = std::fread(data.data(), 1, data.size(), f);
    std::fclose(f);
    ::unlink(path.c_str());
    if (got != op.bytes) {
        s.fail(ncclInvalidUsage, "rank " + std::to_string(op.peer) + " sent " + std::to_string(got) +
                                     " bytes where " + std::to_string(op.bytes) + " were expected");
        return;
    }
    if (op.bytes > 0) std::memcpy(op.buffer, data.data(), op.bytes);
}

void run_work(void* data) {
    std::unique_ptr<Work> work(static_cast<Work*>(data));
    State& s = *work->state;
    if (s.aborted.load()) return;
    if (work->copy_bytes > 0) std::memmove(work->copy_to, work->copy_from, work->copy_bytes);
    for (const Op& op : work->ops) {
        if (s.aborted.load() || s.async_error.load() != ncclSuccess) return;
        if (op.send) {
            send_now(s, op);
        } else {
            receive_now(s, op);
        }
    }
}

// Queues `work` on its stream as a host function of the fake driver.
ncclResult_t enqueue(Work* work) {
    typedef int (*IsCapturing)(void*, int*);
    typedef int (*HostFunc)(void*, void (*)(void*), void*);
    static const IsCapturing is_capturing =
        reinterpret_cast<IsCapturing>(dlsym(RTLD_DEFAULT, "cuStreamIsCapturing"));
    static const HostFunc host_func = reinterpret_cast<HostFunc>(dlsym(RTLD_DEFAULT, "cuLaunchHostFunc"));
    std::unique_ptr<Work> owned(work);
    int status = 0;
    if (is_capturing == nullptr || host_func == nullptr) return ncclUnhandledCudaError;
    if (is_capturing(work->stream, &status) != 0) return ncclUnhandledCudaError;
    if (status != 0) {
        std::fprintf(stderr, "headroom NCCL emulator: NCCL work on a capturing stream is not emulated\n");
        return ncclInvalidUsage;
    }
    if (host_func(work->stream, &run_work, work) != 0) return ncclUnhandledCudaError;
    owned.release();
    return ncclSuccess;
}

// The calls of the open group of this thread (depth > 0), in call order.
struct Pending {
    std::shared_ptr<State> state;
    void* stream;
    Op op;
};
thread_local int t_group_depth = 0;
thread_local std::vector<Pending> t_group;

Op make_op(State& s, bool send, int peer, void* buffer, std::size_t bytes) {
    std::lock_guard<std::mutex> g(s.lock);
    auto& counter = send ? s.sent : s.received;
    return Op{send, peer, counter[peer]++, buffer, bytes};
}

ncclResult_t point_to_point(bool send, void* buffer, std::size_t count, int type, int peer, Comm* comm,
                            void* stream) {
    if (comm == nullptr || comm->state == nullptr) return ncclInvalidArgument;
    State& s = *comm->state;
    const std::size_t size = type_size(type);
    if (size == 0 || peer < 0 || peer >= s.world || peer == s.rank || (buffer == nullptr && count > 0)) {
        return ncclInvalidArgument;
    }
    if (s.aborted.load()) return ncclInvalidUsage;
    const Op op = make_op(s, send, peer, buffer, count * size);
    if (t_group_depth > 0) {
        t_group.push_back(Pending{comm->state, stream, op});
        return ncclSuccess;
    }
    Work* work = new (std::nothrow) Work{comm->state, stream, {op}};
    return work == nullptr ? ncclSystemError : enqueue(work);
}

}  // namespace

EXPORT ncclResult_t ncclGetVersion(int* version) {
    if (version == nullptr) return ncclInvalidArgument;
    *version = 22605;  // as NCCL 2.26.5 reports itself
    return ncclSuccess;
}

EXPORT const char* ncclGetErrorString(ncclResult_t code) {
    switch (code) {
        case ncclSuccess: return "no error";
        case ncclUnhandledCudaError: return "unhandled cuda error (emulated)";
        case ncclSystemError: return "unhandled system error (emulated)";
        case ncclInternalError: return "internal error (emulated)";
        case ncclInvalidArgument: return "invalid argument (emulated)";
        case ncclInvalidUsage: return "invalid usage (emulated)";
        case ncclRemoteError: return "remote process exited or there was a network error (emulated)";
        case ncclInProgress: return "NCCL operation in progress";
        default: return "unknown result code";
    }
}

EXPORT const char* ncclGetLastError(void*) { return "see the headroom NCCL emulator's message on stderr"; }

EXPORT ncclResult_t ncclGetUniqueId(UniqueId* id) {
    if (id == nullptr) return ncclInvalidArgument;
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr && *tmp != 0 ? tmp : "/tmp") + "/headroom-nccl-XXXXXX";
    if (pattern.size() + 1 > kIdBytes - sizeof(kMagic)) {
        std::fprintf(stderr, "headroom NCCL emulator: TMPDIR is too long for an id (%zu bytes)\n", pattern.size());
        return ncclSystemError;
    }
    std::vector<char> path(pattern.begin(), pattern.end());
    path.push_back(0);
    if (::mkdtemp(path.data()) == nullptr) {
        std::fprintf(stderr, "headroom NCCL emulator: mkdtemp %s failed\n", pattern.c_str());
        return ncclSystemError;
    }
    std::memset(id->internal, 0, kIdBytes);
    std::memcpy(id->internal, kMagic, sizeof(kMagic));
    std::memcpy(id->internal + sizeof(kMagic), path.data(), path.size());
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommInitRank(Comm** comm, int world, UniqueId id, int rank) {
    if (comm == nullptr || world < 1 || rank < 0 || rank >= world) return ncclInvalidArgument;
    if (std::memcmp(id.internal, kMagic, sizeof(kMagic)) != 0 || id.internal[kIdBytes - 1] != 0) {
        std::fprintf(stderr, "headroom NCCL emulator: the unique id was not made by ncclGetUniqueId\n");
        return ncclInvalidArgument;
    }
    auto state = std::make_shared<State>();
    state->dir = std::string(id.internal + sizeof(kMagic));
    state->rank = rank;
    state->world = world;
    state->timeout = timeout_seconds();
    state->sent.assign(world, 0);
    state->received.assign(world, 0);
    const std::string joined = state->dir + "/join-" + std::to_string(rank);
    if (!write_whole(joined, "", 0)) {
        std::fprintf(stderr, "headroom NCCL emulator: cannot join through %s\n", state->dir.c_str());
        return ncclSystemError;
    }
    const auto start = std::chrono::steady_clock::now();
    for (int r = 0; r < world; ++r) {
        while (!exists(state->dir + "/join-" + std::to_string(r))) {
            if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >= state->timeout) {
                std::fprintf(stderr,
                             "headroom NCCL emulator: rank %d of %d: rank %d never joined (HEADROOM_NCCL_EMU_TIMEOUT_S)\n",
                             rank, world, r);
                return ncclRemoteError;
            }
            std::this_thread::sleep_for(std::chrono::microseconds(500));
        }
    }
    Comm* made = new (std::nothrow) Comm{state};
    if (made == nullptr) return ncclSystemError;
    *comm = made;
    return ncclSuccess;
}

// The last rank to leave removes the mailbox (a rank that was killed never
// leaves, and its world's mailbox stays behind in $TMPDIR).
static void leave(const State& s) {
    write_whole(s.dir + "/left-" + std::to_string(s.rank), "", 0);
    for (int r = 0; r < s.world; ++r) {
        if (!exists(s.dir + "/left-" + std::to_string(r))) return;
    }
    if (DIR* d = ::opendir(s.dir.c_str())) {
        std::vector<std::string> names;
        while (const dirent* e = ::readdir(d)) {
            const std::string name = e->d_name;
            if (name != "." && name != "..") names.push_back(name);
        }
        ::closedir(d);
        for (const std::string& name : names) ::unlink((s.dir + "/" + name).c_str());
    }
    ::rmdir(s.dir.c_str());
}

EXPORT ncclResult_t ncclCommAbort(Comm* comm) {
    if (comm == nullptr) return ncclInvalidArgument;
    comm->state->aborted.store(true);
    leave(*comm->state);
    delete comm;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommDestroy(Comm* comm) { return ncclCommAbort(comm); }

EXPORT ncclResult_t ncclCommFinalize(Comm* comm) { return comm == nullptr ? ncclInvalidArgument : ncclSuccess; }

EXPORT ncclResult_t ncclCommCount(const Comm* comm, int* count) {
    if (comm == nullptr || count == nullptr) return ncclInvalidArgument;
    *count = comm->state->world;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommUserRank(const Comm* comm, int* rank) {
    if (comm == nullptr || rank == nullptr) return ncclInvalidArgument;
    *rank = comm->state->rank;
    return ncclSuccess;
}

// The emulator has one device.
EXPORT ncclResult_t ncclCommCuDevice(const Comm* comm, int* device) {
    if (comm == nullptr || device == nullptr) return ncclInvalidArgument;
    *device = 0;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommGetAsyncError(Comm* comm, ncclResult_t* state) {
    if (comm == nullptr || state == nullptr) return ncclInvalidArgument;
    *state = comm->state->async_error.load();
    return ncclSuccess;
}

EXPORT ncclResult_t ncclGroupStart() {
    ++t_group_depth;
    return ncclSuccess;
}

// The outermost end queues the group: one host function per stream, in the
// order the streams first appear, each with its sends before its receives.
EXPORT ncclResult_t ncclGroupEnd() {
    if (t_group_depth == 0) return ncclInvalidUsage;
    if (--t_group_depth > 0) return ncclSuccess;
    std::vector<Pending> calls;
    calls.swap(t_group);
    std::vector<Work*> works;
    for (const Pending& p : calls) {
        Work* work = nullptr;
        for (Work* w : works) {
            if (w->stream == p.stream && w->state == p.state) work = w;
        }
        if (work == nullptr) {
            work = new (std::nothrow) Work{p.state, p.stream, {}};
            if (work == nullptr) {
                for (Work* w : works) delete w;
                return ncclSystemError;
            }
            works.push_back(work);
        }
        work->ops.push_back(p.op);
    }
    ncclResult_t first = ncclSuccess;
    for (Work* w : works) {
        std::stable_partition(w->ops.begin(), w->ops.end(), [](const Op& op) { return op.send; });
        const ncclResult_t rc = enqueue(w);
        if (first == ncclSuccess) first = rc;
    }
    return first;
}

EXPORT ncclResult_t ncclSend(const void* buffer, std::size_t count, int type, int peer, Comm* comm, void* stream) {
    return point_to_point(true, const_cast<void*>(buffer), count, type, peer, comm, stream);
}

EXPORT ncclResult_t ncclRecv(void* buffer, std::size_t count, int type, int peer, Comm* comm, void* stream) {
    return point_to_point(false, buffer, count, type, peer, comm, stream);
}

// Rank r's `count` values go to recv + r·count on every rank: a send of
// this rank's block to every peer and a receive of each peer's block, in one
// host function (in place when send == recv + rank·count).
EXPORT ncclResult_t ncclAllGather(const void* send, void* recv, std::size_t count, int type, Comm* comm,
                                  void* stream) {
    if (comm == nullptr || comm->state == nullptr) return ncclInvalidArgument;
    State& s = *comm->state;
    const std::size_t size = type_size(type);
    if (size == 0 || ((send == nullptr || recv == nullptr) && count > 0)) return ncclInvalidArgument;
    if (t_group_depth > 0) {
        std::fprintf(stderr, "headroom NCCL emulator: ncclAllGather inside a group is not emulated\n");
        return ncclInvalidUsage;
    }
    if (s.aborted.load()) return ncclInvalidUsage;
    const std::size_t bytes = count * size;
    char* out = static_cast<char*>(recv);
    char* own = out + static_cast<std::size_t>(s.rank) * bytes;
    Work* work = new (std::nothrow) Work{comm->state, stream, {}};
    if (work == nullptr) return ncclSystemError;
    // The own block moves into place first (its sends read it there).
    if (send != own) {
        work->copy_from = send;
        work->copy_to = own;
        work->copy_bytes = bytes;
    }
    for (int peer = 0; peer < s.world; ++peer) {
        if (peer != s.rank) work->ops.push_back(make_op(s, true, peer, own, bytes));
    }
    for (int peer = 0; peer < s.world; ++peer) {
        if (peer != s.rank) {
            work->ops.push_back(make_op(s, false, peer, out + static_cast<std::size_t>(peer) * bytes, bytes));
        }
    }
    return enqueue(work);
}
