// The fake cuBLAS (built by build.rs as libcublas.so, SONAME libcublas.so)
// for the emulated CUDA backend: the calls crates/model/src/cuda/gemm.rs
// makes, with a plain CPU GEMM behind cublasGemmEx, so that an emulated
// convolution or linear layer runs the real composition (im2col kernel +
// GEMM + epilogue kernels) end to end.
//
// Semantics follow cuBLAS: column-major operands, op(A) is m×k and op(B) is
// k×n with the given leading dimensions, C = alpha·op(A)·op(B) + beta·C, and
// C is not read when beta is 0 (it may hold garbage, even NaN). f16 and bf16
// operands are widened exactly, products are accumulated in f32 in order of
// k, and a 2-byte result is rounded to nearest even once at the end, like
// CUBLAS_COMPUTE_32F (whose tensor-core summation order differs from this
// one only within f32 rounding).

#include <dlfcn.h>

#include <cstddef>
#include <cstdio>
#include <cstring>
#include <new>
#include <vector>

#include "cuda_shim.h"

namespace hr_conv {
#include "common.cuh"
}

#define EXPORT extern "C" __attribute__((visibility("default")))

typedef int cublasStatus_t;

enum : int {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_ALLOC_FAILED = 3,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_NOT_SUPPORTED = 15,
};

enum : int { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14 };
enum : int { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2 };
enum : int { CUBLAS_COMPUTE_32F = 68, CUBLAS_COMPUTE_32F_FAST_16F = 74 };

namespace {
struct Handle {
    void* stream;
    int pointer_mode;  // 0 host, 1 device: both are host memory here
    int math_mode;
};

float load(const void* p, int type, std::size_t i) {
    if (type == CUDA_R_16F) {
        return hr_conv::hr_f16_to_f32(static_cast<const unsigned short*>(p)[i]);
    }
    if (type == CUDA_R_16BF) {
        return hr_conv::hr_bf16_to_f32(static_cast<const unsigned short*>(p)[i]);
    }
    return static_cast<const float*>(p)[i];
}

bool is_type(int type) { return type == CUDA_R_16F || type == CUDA_R_16BF || type == CUDA_R_32F; }
}  // namespace

EXPORT cublasStatus_t cublasCreate_v2(Handle** h) {
    if (h == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    *h = new (std::nothrow) Handle{nullptr, 0, 0};
    return *h != nullptr ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_ALLOC_FAILED;
}

EXPORT cublasStatus_t cublasDestroy_v2(Handle* h) {
    if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasSetStream_v2(Handle* h, void* stream) {
    if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    h->stream = stream;
    return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasGetStream_v2(Handle* h, void** stream) {
    if (h == nullptr || stream == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    *stream = h->stream;
    return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasSetPointerMode_v2(Handle* h, int mode) {
    if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    h->pointer_mode = mode;
    return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasGetPointerMode_v2(Handle* h, int* mode) {
    if (h == nullptr || mode == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    *mode = h->pointer_mode;
    return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasSetMathMode(Handle* h, int mode) {
    if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    h->math_mode = mode;
    return CUBLAS_STATUS_SUCCESS;
}

// The CPU GEMM needs no workspace; what cuBLAS demands of one is checked:
// 256-byte aligned, and present when it has a size.
EXPORT cublasStatus_t cublasSetWorkspace_v2(Handle* h, void* workspace, std::size_t bytes) {
    if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    if ((bytes > 0 && workspace == nullptr) || (std::uintptr_t)workspace % 256 != 0) {
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    return CUBLAS_STATUS_SUCCESS;
}


namespace {
// One cublasGemmEx call, its scalars already read.
struct Gemm {
    int transa, transb, m, n, k;
    float alpha;
    const void* a;
    int atype, lda;
    const void* b;
    int btype, ldb;
    float beta;
    void* c;
    int ctype, ldc;
};

void run_gemm(const Gemm& g) {
    // Widen op(A) once into a k-contiguous m×k buffer so the inner loop is a
    // plain dot product.
    std::vector<float> at((std::size_t)g.m * (std::size_t)g.k);
    for (int i = 0; i < g.m; ++i) {
        for (int l = 0; l < g.k; ++l) {
            const std::size_t idx = g.transa == CUBLAS_OP_N ? (std::size_t)i + (std::size_t)l * g.lda
                                                          : (std::size_t)l + (std::size_t)i * g.lda;
            at[(std::size_t)i * g.k + l] = load(g.a, g.atype, idx);
        }
    }
    std::vector<float> bcol((std::size_t)g.k);
    for (int j = 0; j < g.n; ++j) {
        for (int l = 0; l < g.k; ++l) {
            const std::size_t idx = g.transb == CUBLAS_OP_N ? (std::size_t)l + (std::size_t)j * g.ldb
                                                          : (std::size_t)j + (std::size_t)l * g.ldb;
            bcol[l] = load(g.b, g.btype, idx);
        }
        for (int i = 0; i < g.m; ++i) {
            float acc = 0.0f;
            const float* row = &at[(std::size_t)i * g.k];
            for (int l = 0; l < g.k; ++l) {
                acc += row[l] * bcol[l];
            }
            const std::size_t ci = (std::size_t)i + (std::size_t)j * g.ldc;
            float v = g.alpha * acc;
            if (g.beta != 0.0f) {
                v += g.beta * load(g.c, g.ctype, ci);
            }
            if (g.ctype == CUDA_R_16F) {
                static_cast<unsigned short*>(g.c)[ci] = hr_conv::hr_f32_to_f16(v);
            } else if (g.ctype == CUDA_R_16BF) {
                static_cast<unsigned short*>(g.c)[ci] = hr_conv::hr_f32_to_bf16(v);
            } else {
                static_cast<float*>(g.c)[ci] = v;
            }
        }
    }
}

void run_gemm_node(void* g) { run_gemm(*static_cast<const Gemm*>(g)); }

void run_gemm_once(void* g) {
    run_gemm(*static_cast<const Gemm*>(g));
    delete static_cast<Gemm*>(g);
}

// Queues `g` on `stream` as a host function of the fake driver, so that it
// runs in stream order with the kernels around it (the driver's streams are
// lazy); when `stream` is capturing, that host node is replayed with the
// graph.
cublasStatus_t enqueue(void* stream, const Gemm& g) {
    typedef int (*IsCapturing)(void*, int*);
    typedef int (*HostFunc)(void*, void (*)(void*), void*);
    static const IsCapturing is_capturing =
        reinterpret_cast<IsCapturing>(dlsym(RTLD_DEFAULT, "cuStreamIsCapturing"));
    static const HostFunc host_func = reinterpret_cast<HostFunc>(dlsym(RTLD_DEFAULT, "cuLaunchHostFunc"));
    int status = 0;
    if (is_capturing == nullptr || host_func == nullptr || is_capturing(stream, &status) != 0) {
        return CUBLAS_STATUS_NOT_INITIALIZED;
    }
    Gemm* node = new (std::nothrow) Gemm(g);
    if (node == nullptr) return CUBLAS_STATUS_ALLOC_FAILED;
    // A captured node is the graph's from here on; the emulator never frees
    // a graph's host nodes' data (tests capture a handful of graphs).
    void (*run)(void*) = status == 0 ? &run_gemm_once : &run_gemm_node;
    if (host_func(stream, run, node) == 0) return CUBLAS_STATUS_SUCCESS;
    if (status == 0) delete node;
    return CUBLAS_STATUS_NOT_SUPPORTED;
}
}  // namespace

EXPORT cublasStatus_t cublasGemmEx(Handle* h, int transa, int transb, int m, int n, int k,
                                   const void* alpha, const void* a, int atype, int lda,
                                   const void* b, int btype, int ldb, const void* beta, void* c,
                                   int ctype, int ldc, int compute, int /*algo*/) {
    if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (m < 0 || n < 0 || k < 0 || alpha == nullptr || beta == nullptr) {
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if ((transa != CUBLAS_OP_N && transa != CUBLAS_OP_T) ||
        (transb != CUBLAS_OP_N && transb != CUBLAS_OP_T)) {
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    // cuBLAS's own leading-dimension rules: the stored rows fit in ld.
    if (lda < (transa == CUBLAS_OP_N ? (m > 1 ? m : 1) : (k > 1 ? k : 1)) ||
        ldb < (transb == CUBLAS_OP_N ? (k > 1 ? k : 1) : (n > 1 ? n : 1)) || ldc < (m > 1 ? m : 1)) {
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    // A and B of one type, as cuBLAS's CUBLAS_COMPUTE_32F table has them.
    if (!is_type(atype) || btype != atype || !is_type(ctype) ||
        (compute != CUBLAS_COMPUTE_32F && compute != CUBLAS_COMPUTE_32F_FAST_16F)) {
        std::fprintf(stderr,
                     "headroom cuBLAS emulator: cublasGemmEx with types A %d B %d C %d compute %d "
                     "is not emulated\n",
                     atype, btype, ctype, compute);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
    // alpha and beta are read now (host pointer mode), as cuBLAS does.
    Gemm g{transa, transb, m, n, k, *static_cast<const float*>(alpha), a, atype, lda, b, btype, ldb,
           *static_cast<const float*>(beta), c, ctype, ldc};
    return enqueue(h->stream, g);
}
