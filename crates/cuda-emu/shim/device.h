// What the emulated device is: its compute capability, the CUDA version
// its driver answers with, and what each implies (device.cpp). Shared by
// driver.cpp (device queries, module loads, launches) and the kernels'
// emulated instructions (cuda_shim.h's require_arch).
#pragma once

#include <string>

namespace hr_emu {

// Compute capability x10 + minor (80 for 8.0): HEADROOM_CUDA_EMU_ARCH, else
// 80, or what hr_emu_answer_as set last.
unsigned int device_arch();
// cuDriverGetVersion's answer (13000 for CUDA 13.0):
// HEADROOM_CUDA_EMU_DRIVER, else 13000, or what hr_emu_answer_as set last.
int driver_version();
// The newest PTX ISA the driver's JIT accepts, x10 (84 for 8.4).
int max_ptx_isa(int driver);
// Whether a module image (PTX text or a CUBIN) loads on this device and
// driver: CUDA_SUCCESS (0), or the driver's error with the reason in `why`.
int check_module_image(const void* image, std::string* why);
// Whether a module image (a CUBIN, or PTX text) defines the symbol `name`:
// how a module's 2-byte format is known (common.cuh's marker).
bool image_has_symbol(const void* image, const char* name);
// The first instruction of the launch running on this OS thread that the
// device lacks, taken (and cleared) by the launch; empty if none.
std::string take_missing_instruction();

}  // namespace hr_emu
