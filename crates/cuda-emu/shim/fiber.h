// Minimal fibers for the emulator: a stack, a saved context, and a switch.
// On x86-64 the switch is a dozen instructions (callee-saved registers,
// MXCSR and the x87 control word), far cheaper than swapcontext, which
// makes a signal-mask system call per switch; elsewhere ucontext is used.
#pragma once

#include <cstddef>

#if defined(__x86_64__)

namespace hr_emu {
struct FiberCtx {
    void* sp = nullptr;
};
}  // namespace hr_emu

extern "C" __attribute__((visibility("hidden"))) void hr_emu_switch(void** save_sp, void* to_sp);

namespace hr_emu {
inline void fiber_switch(FiberCtx* from, FiberCtx* to) { hr_emu_switch(&from->sp, to->sp); }

// Prepares `ctx` so that switching to it calls entry() on the given stack.
// entry must never return (it switches away for the last time instead).
inline void fiber_make(FiberCtx* ctx, char* stack, std::size_t size, void (*entry)()) {
    // The frame hr_emu_switch pops: FP control word slot, six callee-saved
    // registers, then the return address it `ret`s to. That address sits at
    // a 16-byte boundary so entry() starts with the ABI's stack alignment.
    unsigned long long top = ((unsigned long long)(stack + size)) & ~15ull;
    unsigned long long* a = (unsigned long long*)(top - 16);
    a[0] = (unsigned long long)entry;
    a[1] = 0;
    unsigned long long* frame = a - 7;
    unsigned int mxcsr;
    unsigned short fcw;
    __asm__ volatile("stmxcsr %0" : "=m"(mxcsr));
    __asm__ volatile("fnstcw %0" : "=m"(fcw));
    frame[0] = (unsigned long long)mxcsr | ((unsigned long long)fcw << 32);
    for (int i = 1; i < 7; ++i) {
        frame[i] = 0;
    }
    ctx->sp = frame;
}
}  // namespace hr_emu

#else

#include <ucontext.h>

namespace hr_emu {
struct FiberCtx {
    ucontext_t uc;
};
inline void fiber_switch(FiberCtx* from, FiberCtx* to) { swapcontext(&from->uc, &to->uc); }
inline void fiber_make(FiberCtx* ctx, char* stack, std::size_t size, void (*entry)()) {
    getcontext(&ctx->uc);
    ctx->uc.uc_stack.ss_sp = stack;
    ctx->uc.uc_stack.ss_size = size;
    ctx->uc.uc_link = nullptr;
    makecontext(&ctx->uc, entry, 0);
}
}  // namespace hr_emu

#endif
