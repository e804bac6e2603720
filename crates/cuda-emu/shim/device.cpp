// The emulated device's identity, so that one build of the emulator answers
// as the GPUs headroom's users have: a compute capability (sm_75 to sm_90
// and beyond) and a driver's CUDA version (12.x or 13.x). Both come from
// the environment (HEADROOM_CUDA_EMU_ARCH, HEADROOM_CUDA_EMU_DRIVER) or from
// hr_emu_answer_as, and what follows from them is refused as the real
// device and driver refuse it:
// - an instruction the architecture lacks (cp.async and mma.m16n8k16 with
//   f16 operands below sm_80, per the PTX ISA's target notes; conv_mma.cu
//   also compiles ldmatrix only from sm_80) fails the launch that reaches
//   it, as the `trap` that conv_mma.cu compiles in its place would on such
//   a GPU;
// - a module image for another architecture (a CUBIN of another major or a
//   newer minor, PTX whose .target is newer than the device) is
//   CUDA_ERROR_NO_BINARY_FOR_GPU; PTX of an ISA newer than the driver's JIT
//   knows is CUDA_ERROR_UNSUPPORTED_PTX_VERSION; a CUBIN in the ELF format
//   NVRTC 13 writes (ELF ABI version 8) on a CUDA 12 driver, which reads
//   only the earlier format (ABI version 7), is CUDA_ERROR_INVALID_IMAGE.
// The last is the emulator's model of what a 12.x driver does with NVRTC
// 13's output, from the ELF headers the two NVRTCs write; it was not
// checked on a 12.x driver. Memory: two integers, and per OS thread the
// first missing instruction of the running launch.

#include "device.h"

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cuda_shim.h"

namespace hr_emu {
namespace {

[[noreturn]] void bad_env(const char* name, const char* value, const char* expected) {
    std::fprintf(stderr, "headroom CUDA emulator: %s=%s: expected %s\n", name, value, expected);
    std::abort();
}

// "75", "7.5" or "sm_75".
unsigned int arch_from_env() {
    const char* v = std::getenv("HEADROOM_CUDA_EMU_ARCH");
    if (v == nullptr || *v == '\0') return 80;
    const char* s = std::strncmp(v, "sm_", 3) == 0 ? v + 3 : v;
    char* end = nullptr;
    const unsigned long a = std::strtoul(s, &end, 10);
    unsigned long arch = a;
    if (end != s && *end == '.') {
        char* end2 = nullptr;
        const unsigned long minor = std::strtoul(end + 1, &end2, 10);
        if (end2 == end + 1 || minor > 9) bad_env("HEADROOM_CUDA_EMU_ARCH", v, "a compute capability such as 75, 7.5 or sm_75");
        arch = a * 10 + minor;
        end = end2;
    }
    if (end == s || *end != '\0' || arch < 50 || arch > 199) {
        bad_env("HEADROOM_CUDA_EMU_ARCH", v, "a compute capability such as 75, 7.5 or sm_75");
    }
    return (unsigned int)arch;
}

// "12040" (cuDriverGetVersion's form) or "12.4".
int driver_from_env() {
    const char* v = std::getenv("HEADROOM_CUDA_EMU_DRIVER");
    if (v == nullptr || *v == '\0') return 13000;
    char* end = nullptr;
    const long major = std::strtol(v, &end, 10);
    long version = major;
    if (end != v && *end == '.') {
        char* end2 = nullptr;
        const long minor = std::strtol(end + 1, &end2, 10);
        if (end2 == end + 1 || minor < 0 || minor > 99) bad_env("HEADROOM_CUDA_EMU_DRIVER", v, "a CUDA version such as 12.4 or 12040");
        version = major * 1000 + minor * 10;
        end = end2;
    }
    if (end == v || *end != '\0' || version < 9000 || version > 99000) {
        bad_env("HEADROOM_CUDA_EMU_DRIVER", v, "a CUDA version such as 12.4 or 12040");
    }
    return (int)version;
}

std::atomic<unsigned int> g_arch{arch_from_env()};
std::atomic<int> g_driver{driver_from_env()};

thread_local std::string t_missing;

enum : int {
    kSuccess = 0,
    kInvalidImage = 200,
    kNoBinaryForGpu = 209,
    kUnsupportedPtxVersion = 222,
};

std::string arch_name(unsigned int arch) { return "sm_" + std::to_string(arch); }

std::string driver_name(int v) {
    return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
}

// `key` followed by a number with one dot ("9.0") in the PTX text: x10.
int ptx_number_after(const char* ptx, const char* key, bool dotted) {
    const char* at = std::strstr(ptx, key);
    if (at == nullptr) return -1;
    at += std::strlen(key);
    char* end = nullptr;
    const long whole = std::strtol(at, &end, 10);
    if (end == at) return -1;
    if (!dotted) return (int)whole;
    if (*end != '.') return -1;
    const long tenth = std::strtol(end + 1, nullptr, 10);
    return (int)(whole * 10 + tenth);
}
}  // namespace

unsigned int device_arch() { return g_arch.load(); }
int driver_version() { return g_driver.load(); }

int max_ptx_isa(int driver) {
    const int major = driver / 1000;
    const int minor = driver % 1000 / 10;
    if (major >= 13) return 90 + minor;  // 13.0: ISA 9.0, 13.1: 9.1, ...
    if (major == 12) {
        // 12.0 to 12.5: ISA 8.0 to 8.5; 12.6: 8.5; 12.8: 8.7; 12.9: 8.8.
        if (minor <= 5) return 80 + minor;
        if (minor <= 7) return 85;
        return 79 + minor;
    }
    return 78;  // 11.8 and older: at most ISA 7.8
}

bool image_has_symbol(const void* image, const char* name) {
    const unsigned char* bytes = static_cast<const unsigned char*>(image);
    const std::size_t name_len = std::strlen(name);
    if (std::memcmp(bytes, "\x7f" "ELF", 4) == 0) {
        // A 64-bit ELF ends with its section headers: e_shoff, then
        // e_shnum entries of e_shentsize bytes. The name is in .strtab.
        std::uint64_t shoff = 0;
        std::uint16_t shentsize = 0, shnum = 0;
        std::memcpy(&shoff, bytes + 40, 8);
        std::memcpy(&shentsize, bytes + 58, 2);
        std::memcpy(&shnum, bytes + 60, 2);
        const std::size_t size = (std::size_t)shoff + (std::size_t)shentsize * shnum;
        for (std::size_t i = 0; i + name_len < size; ++i) {
            if (std::memcmp(bytes + i, name, name_len) == 0 && bytes[i + name_len] == 0) {
                return true;
            }
        }
        return false;
    }
    // PTX: the declaration `.global .align 4 .b32 NAME;`.
    const char* ptx = static_cast<const char*>(image);
    for (const char* at = std::strstr(ptx, name); at != nullptr; at = std::strstr(at + 1, name)) {
        const char after = at[name_len];
        if (at > ptx && at[-1] == ' ' && (after == ';' || after == '[' || after == ' ')) {
            return true;
        }
    }
    return false;
}

int check_module_image(const void* image, std::string* why) {
    const unsigned char* bytes = static_cast<const unsigned char*>(image);
    const unsigned int arch = device_arch();
    const int driver = driver_version();
    if (std::memcmp(bytes, "\x7f" "ELF", 4) == 0) {
        // NVIDIA's CUBIN: e_ident[EI_ABIVERSION] 7 (CUDA 12 and older, the
        // SM in the low byte of e_flags) or 8 (CUDA 13: the SM in bits 8..15).
        const unsigned int abi = bytes[8];
        std::uint32_t flags = 0;
        std::memcpy(&flags, bytes + 48, 4);
        if (abi >= 8 && driver < 13000) {
            *why = "a CUBIN in the CUDA 13 format (ELF ABI version " + std::to_string(abi) +
                   ", as NVRTC 13 writes) on a driver for CUDA " + driver_name(driver) +
                   ", which reads ABI version 7";
            return kInvalidImage;
        }
        const unsigned int sm = abi >= 8 ? (flags >> 8) & 0xffu : flags & 0xffu;
        if (sm / 10 != arch / 10 || sm % 10 > arch % 10) {
            *why = "a CUBIN for " + arch_name(sm) + " on an " + arch_name(arch) + " device";
            return kNoBinaryForGpu;
        }
        return kSuccess;
    }
    const char* ptx = static_cast<const char*>(image);
    const int isa = ptx_number_after(ptx, ".version ", true);
    const int target = ptx_number_after(ptx, ".target sm_", false);
    if (isa < 0 || target < 0) {
        *why = "neither a CUBIN nor PTX with .version and .target";
        return kInvalidImage;
    }
    if (isa > max_ptx_isa(driver)) {
        *why = "PTX ISA " + std::to_string(isa / 10) + "." + std::to_string(isa % 10) +
               " on a driver for CUDA " + driver_name(driver) + ", whose JIT reads ISA " +
               std::to_string(max_ptx_isa(driver) / 10) + "." + std::to_string(max_ptx_isa(driver) % 10) +
               " and older";
        return kUnsupportedPtxVersion;
    }
    if ((unsigned int)target > arch) {
        *why = "PTX for " + arch_name((unsigned int)target) + " on an " + arch_name(arch) + " device";
        return kNoBinaryForGpu;
    }
    return kSuccess;
}

void require_arch(unsigned int needed, const char* instruction) {
    const unsigned int arch = device_arch();
    if (arch >= needed || !t_missing.empty()) return;
    t_missing = std::string(instruction) + " needs " + arch_name(needed) + "; the device is " + arch_name(arch);
}

std::string take_missing_instruction() {
    std::string missing = std::move(t_missing);
    t_missing.clear();
    return missing;
}

}  // namespace hr_emu

#define EXPORT extern "C" __attribute__((visibility("default")))

// From now on the device answers as compute capability `arch` (x10 +
// minor) with a driver for CUDA `driver` (cuDriverGetVersion's form); 0
// leaves either as it is. For tests: the whole process's.
EXPORT void hr_emu_answer_as(unsigned int arch, int driver) {
    if (arch != 0) hr_emu::g_arch.store(arch);
    if (driver != 0) hr_emu::g_driver.store(driver);
}

EXPORT unsigned int hr_emu_device_arch() { return hr_emu::device_arch(); }
EXPORT int hr_emu_driver_version() { return hr_emu::driver_version(); }
