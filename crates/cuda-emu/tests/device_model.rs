//! The emulated device answers as the architecture and driver it is told
//! (`answer_as`, or HEADROOM_CUDA_EMU_ARCH / HEADROOM_CUDA_EMU_DRIVER), and
//! refuses what that GPU and driver would: an instruction the architecture
//! lacks fails its launch, and a module image the device or the driver
//! could not load is refused at cuModuleLoadData with the driver's error.
//! Its own test binary: the model is the whole process's, so its tests take
//! turns (one lock) and each sets the model it needs first.

mod common;

use std::sync::{Mutex, MutexGuard};

use cudarc::driver::{result, sys, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use headroom_cuda_emu::{answer_as, device_model, DeviceModel};

fn exclusive(arch: u32, driver: i32) -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::new(());
    let turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    answer_as(DeviceModel { arch, driver }).unwrap_or_else(|e| panic!("{e}"));
    turn
}

#[test]
fn the_device_answers_with_the_capability_and_driver_it_is_told() {
    let _turn = exclusive(75, 12040);
    assert_eq!(
        device_model().unwrap(),
        DeviceModel {
            arch: 75,
            driver: 12040
        }
    );
    result::init().unwrap();
    assert_eq!(driver_version(), Some(12040));
    let dev = result::device::get(0).unwrap();
    let attr = |a| {
        // SAFETY: `dev` came from cuDeviceGet.
        unsafe { result::device::get_attribute(dev, a) }.unwrap()
    };
    use sys::CUdevice_attribute::*;
    assert_eq!(attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR), 7);
    assert_eq!(attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR), 5);
    answer_as(DeviceModel {
        arch: 89,
        driver: 0,
    })
    .unwrap();
    assert_eq!(attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR), 8);
    assert_eq!(attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR), 9);
    assert_eq!(driver_version(), Some(12040), "0 keeps the driver");
}

/// cp.async below sm_80 fails the launch that reaches it, as the `trap`
/// compiled in its place does on such a GPU; from sm_80 it copies.
#[test]
fn cp_async_runs_from_sm80_and_fails_its_launch_below() {
    for (arch, runs) in [(75, false), (80, true), (86, true), (90, true)] {
        let _turn = exclusive(arch, 13000);
        let s = common::stream();
        let f = common::selftest(&s, "hr_emu_selftest_cp_async");
        let input: Vec<u32> = (0..128).map(|i| i * 3 + 1).collect();
        let dev_in = s.clone_htod(&input).unwrap();
        let mut out = s.alloc_zeros::<u32>(128).unwrap();
        let mut b = s.launch_builder(&f);
        b.arg(&dev_in).arg(&mut out);
        let cfg: LaunchConfig = common::one_block(32);
        // SAFETY: 32 threads copy 4 u32 each of the 128 in both buffers.
        let launched = unsafe { b.launch(cfg) }.and_then(|_| s.synchronize());
        if runs {
            launched.unwrap_or_else(|e| panic!("sm_{arch}: {e:?}"));
            assert_eq!(s.clone_dtoh(&out).unwrap(), input, "sm_{arch}");
        } else {
            let err = launched.expect_err("cp.async on sm_75");
            assert!(
                format!("{err:?}").contains("ILLEGAL_INSTRUCTION"),
                "sm_{arch}: {err:?}"
            );
        }
    }
}

fn ptx(version: &str, target: u32) -> Ptx {
    Ptx::from_src(format!(
        ".version {version}\n.target sm_{target}\n.address_size 64\n// emulated"
    ))
}

/// The first 64 bytes of an NVIDIA CUBIN as NVRTC 12 (ELF ABI version 7,
/// the SM in e_flags' low byte) or NVRTC 13 (ABI version 8, the SM in bits
/// 8..15) writes it for `sm`.
fn cubin(abi: u8, sm: u32) -> Ptx {
    let mut elf = vec![0u8; 64];
    elf[..4].copy_from_slice(b"\x7fELF");
    elf[4] = 2; // 64-bit
    elf[5] = 1; // little-endian
    elf[6] = 1;
    elf[7] = if abi >= 8 { 0x41 } else { 0x33 };
    elf[8] = abi;
    let flags: u32 = if abi >= 8 {
        0x0600_0004 | sm << 8
    } else {
        sm << 16 | 0x0500 | sm
    };
    elf[48..52].copy_from_slice(&flags.to_le_bytes());
    Ptx::from_binary(elf)
}

fn load(image: Ptx) -> Result<(), String> {
    let s = common::stream();
    s.context()
        .load_module(image)
        .map(|_| ())
        .map_err(|e| format!("{e:?}"))
}

#[test]
fn a_module_the_device_or_driver_could_not_load_is_refused() {
    {
        // A CUDA 12.4 driver's JIT reads PTX ISA 8.4 and older; NVRTC 13
        // writes ISA 9.x, NVRTC 12.9 ISA 8.8.
        let _turn = exclusive(86, 12040);
        load(ptx("8.4", 86)).unwrap();
        load(ptx("8.0", 75)).unwrap();
        let newer = load(ptx("8.8", 86)).expect_err("ISA 8.8 on 12.4");
        assert!(newer.contains("UNSUPPORTED_PTX_VERSION"), "{newer}");
        let thirteen = load(ptx("9.0", 86)).expect_err("ISA 9.0 on 12.4");
        assert!(thirteen.contains("UNSUPPORTED_PTX_VERSION"), "{thirteen}");
        // PTX runs on its target and newer.
        let target = load(ptx("8.0", 89)).expect_err("sm_89 PTX on sm_86");
        assert!(target.contains("NO_BINARY_FOR_GPU"), "{target}");
        // A CUBIN runs on its SM and newer minors of the same major.
        load(cubin(7, 86)).unwrap();
        load(cubin(7, 80)).unwrap();
        let minor = load(cubin(7, 89)).expect_err("sm_89 CUBIN on sm_86");
        assert!(minor.contains("NO_BINARY_FOR_GPU"), "{minor}");
        let major = load(cubin(7, 75)).expect_err("sm_75 CUBIN on sm_86");
        assert!(major.contains("NO_BINARY_FOR_GPU"), "{major}");
        // NVRTC 13's CUBIN format on a CUDA 12 driver.
        let format = load(cubin(8, 86)).expect_err("ABI 8 on 12.4");
        assert!(format.contains("INVALID_IMAGE"), "{format}");
    }
    {
        let _turn = exclusive(86, 12090);
        load(ptx("8.8", 86)).unwrap();
        assert!(load(ptx("9.0", 86)).is_err());
    }
    {
        let _turn = exclusive(90, 13000);
        load(ptx("9.0", 90)).unwrap();
        load(cubin(8, 90)).unwrap();
        load(cubin(7, 90)).unwrap();
        assert!(load(ptx("9.1", 90)).is_err(), "13.0 reads ISA 9.0");
    }
    let _turn = exclusive(80, 13000);
    let junk = load(Ptx::from_src("// not PTX")).expect_err("neither PTX nor a CUBIN");
    assert!(junk.contains("INVALID_IMAGE"), "{junk}");
}

fn driver_version() -> Option<i32> {
    let mut v = 0;
    // SAFETY: the call writes one int.
    unsafe { sys::cuDriverGetVersion(&mut v) }
        .result()
        .ok()
        .map(|_| v)
}
