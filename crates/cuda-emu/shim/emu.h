// What driver.cpp and the generated kernel translation units share: the
// registry of host-compiled kernels. Each generated unit (build.rs writes one
// per .cu file of crates/model/src) registers its `extern "C" __global__`
// entry points by name at load time; cuModuleGetFunction looks them up there,
// so a kernel added to a .cu file is emulated without any list to update.
#pragma once

#include <cstddef>
#include <type_traits>
#include <utility>

namespace hr_emu {

// Calls kernel `fn` for the current emulated thread with the arguments in
// `params` (cuLaunchKernel's kernelParams: one pointer per argument).
typedef void (*Invoker)(void* fn, void** params);

// The most arguments a kernel may take (a captured launch copies each one).
const unsigned int kMaxKernelArgs = 16;

struct KernelEntry {
    const char* name;
    void* fn;
    Invoker invoke;
    unsigned int arity;
    // The byte size of each argument: a launch captured into a graph copies
    // the argument values, as cuStreamBeginCapture's kernel nodes do.
    std::size_t arg_bytes[kMaxKernelArgs];
    // Bit i: parameter i is a `__restrict__` pointer; and one the kernel
    // may write through (not const). build.rs reads them from the source.
    unsigned int restrict_mask;
    unsigned int written_mask;
    // 1: the kernel as a module compiled for bf16 has it (cuModuleGetFunction
    // hands out a copy of the registered entry with this set).
    unsigned int half_bf16;
};

void register_kernel(const KernelEntry& entry);

}  // namespace hr_emu

namespace {
// Internal linkage: a parameter struct of the same name in two kernel files
// must not make two instantiations collide at link time.
template <typename T>
struct hr_arg {
    typedef typename std::remove_cv<typename std::remove_reference<T>::type>::type type;
};

template <typename... A, std::size_t... I>
inline void hr_call(void (*fn)(A...), void** params, std::index_sequence<I...>) {
    // Each argument is copied from where kernelParams points, as the GPU
    // copies parameters into each thread's view; a pointer argument is the
    // fake device pointer, which is a host address.
    fn(*static_cast<typename hr_arg<A>::type*>(params[I])...);
}

template <typename... A>
void hr_invoke(void* fn, void** params) {
    hr_call(reinterpret_cast<void (*)(A...)>(fn), params, std::index_sequence_for<A...>{});
}

template <typename... A>
hr_emu::KernelEntry hr_entry(const char* name, void (*fn)(A...), unsigned int restrict_mask,
                             unsigned int written_mask) {
    static_assert(sizeof...(A) <= hr_emu::kMaxKernelArgs, "too many kernel arguments to emulate");
    return hr_emu::KernelEntry{name,
                               reinterpret_cast<void*>(fn),
                               &hr_invoke<A...>,
                               (unsigned int)sizeof...(A),
                               {sizeof(typename hr_arg<A>::type)...},
                               restrict_mask,
                               written_mask,
                               0u};
}

struct hr_registrar {
    explicit hr_registrar(const hr_emu::KernelEntry& e) { hr_emu::register_kernel(e); }
};
}  // namespace
