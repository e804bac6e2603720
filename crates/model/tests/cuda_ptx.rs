//! Every CUDA kernel compiles with NVRTC, for every architecture headroom
//! serves (`arch::TESTED_ARCHS`: sm_75, sm_80, sm_86, sm_89, sm_90), to
//! PTX and to CUBIN, and every entry point takes exactly the parameters its Rust
//! wrapper passes (a struct of `size_of` the Rust mirror, then N pointers),
//! without spilling registers and within the resources of the widest block
//! the backend launches (`MAX_BLOCK_THREADS`, 256 threads).
//! No GPU is needed, only libnvrtc: this is what makes a kernel that does
//! not compile fail CI.
//!
//! Without NVRTC (a fresh machine with only Rust) these tests are built as
//! ignored (crates/model/build.rs), and the binary ends with a line saying
//! how many did not run and how to install NVRTC; one built to run that
//! finds no NVRTC at run time skips, with one line past the output capture.
//! `HEADROOM_REQUIRE_NVRTC=1` (set by `.ci/run`) makes either a failure, so
//! CI always compiles every kernel.
//!
//! The NVRTC found first is the CUDA 13 one where both are installed (no
//! driver here asks for 12). Where NVRTC 12 is installed too
//! (`python3 -m pip install nvidia-cuda-nvrtc-cu12`, found when the crate
//! was built), the compile tests run again in a child process with
//! `HEADROOM_NVRTC` naming it, for CUDA 12 drivers; without it that test
//! is built as ignored, with the install command as its reason.

use std::io::Write as _;
use std::sync::{Once, OnceLock};

use headroom_model::cuda::kernels::{self, KernelFile, KernelSig, Target};
use headroom_model::cuda::{arch, libs, HalfFormat, MAX_BLOCK_THREADS};

#[path = "../../../tests/src/nvrtc_gate.rs"]
#[macro_use]
mod nvrtc_gate;

report_nvrtc_tests!("cuda_ptx", include_str!("cuda_ptx.rs"));

const ARCHS: [u32; 5] = arch::TESTED_ARCHS;

/// Set by the NVRTC 12 test for its child process: the NVRTC major
/// version the child must have loaded (it names the library in
/// HEADROOM_NVRTC).
const EXPECT_NVRTC_MAJOR: &str = "HEADROOM_TEST_EXPECT_NVRTC_MAJOR";

/// NVRTC's version, or None (skip) when NVRTC is missing and
/// HEADROOM_REQUIRE_NVRTC is not 1.
fn nvrtc() -> Option<(i32, i32)> {
    match kernels::nvrtc_version() {
        Ok(v) => {
            if let Ok(major) = std::env::var(EXPECT_NVRTC_MAJOR) {
                assert_eq!(
                    v.0.to_string(),
                    major,
                    "{} should have loaded NVRTC {major}, not {}.{}",
                    libs::NVRTC_ENV,
                    v.0,
                    v.1
                );
            }
            Some(v)
        }
        Err(e) => {
            assert!(
                std::env::var("HEADROOM_REQUIRE_NVRTC").as_deref() != Ok("1"),
                "HEADROOM_REQUIRE_NVRTC=1 but {e}\nSearched: {:?}",
                libs::search_dirs()
            );
            static SKIP: Once = Once::new();
            // Straight to stderr, past libtest's capture: seen in a plain
            // `cargo test`, once.
            SKIP.call_once(|| {
                let _ = writeln!(
                    std::io::stderr(),
                    "cuda_ptx: SKIPPED, every test (kernel compilation with NVRTC): {e} \
                     (this binary was built expecting NVRTC; HEADROOM_REQUIRE_NVRTC=1 \
                     makes this a failure)"
                );
            });
            None
        }
    }
}

/// One `.entry` of a PTX module: its name and parameter declarations.
#[derive(Debug)]
struct Entry {
    name: String,
    params: Vec<String>,
}

fn entries(ptx: &str) -> Vec<Entry> {
    let mut out = Vec::new();
    let mut lines = ptx.lines();
    while let Some(line) = lines.next() {
        let line = line.trim();
        let Some(rest) = line.strip_prefix(".visible .entry ") else {
            continue;
        };
        let name = rest
            .split('(')
            .next()
            .unwrap_or_default()
            .trim()
            .to_string();
        let mut params = Vec::new();
        if !rest.trim_end().ends_with("()") {
            for p in lines.by_ref() {
                let p = p.trim();
                if p.starts_with(')') {
                    break;
                }
                params.push(p.trim_end_matches(',').to_string());
            }
        }
        out.push(Entry { name, params });
    }
    out
}

/// Byte size of a by-value struct parameter: `.param .align 4 .b8 name[N]`.
fn struct_bytes(param: &str) -> Option<usize> {
    let (_, rest) = param.split_once(".b8 ")?;
    let open = rest.find('[')?;
    rest[open + 1..].trim_end_matches(']').parse().ok()
}

fn check_signatures(file: &KernelFile, ptx: &str, arch: u32) {
    let found = entries(ptx);
    for entry in &found {
        assert!(
            file.kernels.iter().any(|k| k.name == entry.name),
            "{}.cu defines entry {} that has no KernelSig in kernels.rs",
            file.name,
            entry.name
        );
    }
    for sig in file.kernels {
        let KernelSig {
            name,
            params_bytes,
            buffers,
            ..
        } = *sig;
        let entry = found.iter().find(|e| e.name == name).unwrap_or_else(|| {
            panic!(
                "{}.cu (sm_{arch}): no entry point {name} in the PTX",
                file.name
            )
        });
        assert_eq!(
            entry.params.len(),
            1 + buffers,
            "{name}: PTX parameters {:?}, expected a struct and {buffers} pointers",
            entry.params
        );
        assert_eq!(
            struct_bytes(&entry.params[0]),
            Some(params_bytes),
            "{name}: the parameter struct in the .cu file ({}) differs from its Rust mirror ({params_bytes} bytes)",
            entry.params[0]
        );
        for p in &entry.params[1..] {
            assert!(
                p.starts_with(".param .u64"),
                "{name}: expected a pointer, got {p}"
            );
        }
    }
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn every_kernel_compiles_to_ptx_for_each_architecture_with_matching_signatures() {
    let Some((major, minor)) = nvrtc() else {
        return;
    };
    eprintln!("NVRTC {major}.{minor}");
    let mut count = 0;
    for file in kernels::FILES {
        for arch in ARCHS {
            let ptx = kernels::compile(file, Target::Ptx(arch)).unwrap_or_else(|e| panic!("{e}"));
            let ptx = String::from_utf8(ptx).expect("PTX is text");
            assert!(
                ptx.contains(&format!(".target sm_{arch}")),
                "{}.cu: PTX for compute_{arch} has no .target sm_{arch}",
                file.name
            );
            check_signatures(file, &ptx, arch);
            count += file.kernels.len();
        }
    }
    eprintln!(
        "{count} entry points checked ({} files × {ARCHS:?})",
        kernels::FILES.len()
    );
    assert!(
        count >= ARCHS.len() * 25,
        "every kernel of the reference ResNet is listed"
    );
}

/// bf16 (`HalfFormat::Bf16`, every file compiled with `HR_BF16`): every
/// kernel file compiles to a CUBIN for sm_80, the oldest GPU with bf16
/// (sm_86, 89 and 90 have its instructions; the parity binary's bf16 tests
/// compile the files they use for sm_90 when CI runs it as sm_90), that
/// carries the format's marker symbol, which the f16 build lacks; the convolutions' tensor-core product is the
/// bf16 `mma` and the conversions are bf16's `cvt`, f16's in the f16 build.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn every_kernel_compiles_for_bf16_on_sm_80_and_newer_with_bf16_instructions() {
    if nvrtc().is_none() {
        return;
    }
    let marker: &[u8] = b"headroom_half_format_bf16";
    let has = |image: &[u8]| image.windows(marker.len()).any(|w| w == marker);
    for file in kernels::FILES {
        let cubin = kernels::compile_half(file, Target::Cubin(80), HalfFormat::Bf16)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(cubin_sm(&cubin), Some(80), "{}.cu bf16", file.name);
        assert!(
            has(&cubin),
            "{}.cu: the bf16 CUBIN lacks its marker",
            file.name
        );
    }
    let f16 = kernels::compile(file_named("cast"), Target::Cubin(80)).unwrap();
    assert!(!has(&f16), "the f16 CUBIN carries bf16's marker");
    let ptx = |name: &str, half: HalfFormat| {
        let ptx = kernels::compile_half(file_named(name), Target::Ptx(80), half).unwrap();
        String::from_utf8(ptx).expect("PTX is text")
    };
    let mma = "mma.sync.aligned.m16n8k16.row.col.f32";
    assert!(ptx("conv_mma", HalfFormat::Bf16).contains(&format!("{mma}.bf16.bf16.f32")));
    assert!(ptx("conv_mma", HalfFormat::F16).contains(&format!("{mma}.f16.f16.f32")));
    assert!(!ptx("conv_mma", HalfFormat::Bf16).contains(&format!("{mma}.f16.f16.f32")));
    assert!(ptx("cast", HalfFormat::Bf16).contains("cvt.rn.bf16.f32"));
    assert!(!ptx("cast", HalfFormat::Bf16).contains("cvt.rn.f16.f32"));
    assert!(ptx("cast", HalfFormat::F16).contains("cvt.rn.f16.f32"));
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn every_kernel_compiles_to_cubin_for_each_architecture() {
    if nvrtc().is_none() {
        return;
    }
    for (file, arch, (cubin, _)) in cubin_reports() {
        assert!(
            cubin.starts_with(b"\x7fELF"),
            "{}.cu: the CUBIN for sm_{arch} is not an ELF image",
            file.name
        );
        assert_eq!(
            cubin_sm(cubin),
            Some(*arch),
            "{}.cu: the CUBIN's ELF header names another architecture",
            file.name
        );
    }
}

/// A kernel file, an architecture, and its CUBIN with ptxas's log.
type CubinReport = (&'static KernelFile, u32, (Vec<u8>, String));

/// Every kernel file compiled to a CUBIN for each architecture, with
/// ptxas's report (`kernels::cubin_with_report`, a fresh compile each), once
/// per process: the CUBIN test and the spill test read the same compiles
/// (each sweep is about a minute on two cores).
fn cubin_reports() -> &'static [CubinReport] {
    static REPORTS: OnceLock<Vec<CubinReport>> = OnceLock::new();
    REPORTS.get_or_init(|| {
        let mut reports = Vec::new();
        for file in kernels::FILES {
            for arch in ARCHS {
                let report =
                    kernels::cubin_with_report(file, arch).unwrap_or_else(|e| panic!("{e}"));
                reports.push((file, arch, report));
            }
        }
        reports
    })
}

/// The kernel file `name`.cu.
fn file_named(name: &str) -> &'static KernelFile {
    kernels::FILES
        .iter()
        .find(|f| f.name == name)
        .unwrap_or_else(|| panic!("no kernel file {name}.cu"))
}

fn cubin_sm(cubin: &[u8]) -> Option<u32> {
    let flags = u32::from_le_bytes(cubin.get(48..52)?.try_into().ok()?);
    match cubin.get(8)? {
        7 => Some(flags & 0xff),
        8.. => Some(flags >> 8 & 0xff),
        _ => None,
    }
}

/// The compile tests again, in a child process of this binary with NVRTC
/// 12 loaded (`HEADROOM_NVRTC`): what the drivers of CUDA 12 need, since
/// NVRTC 13's PTX and CUBINs are CUDA 13's. Built as ignored where the
/// crate's build found no `libnvrtc.so.12`.
#[test]
#[cfg_attr(
    not(headroom_nvrtc12),
    ignore = "NVRTC 12 not found: python3 -m pip install nvidia-cuda-nvrtc-cu12"
)]
fn every_kernel_compiles_with_nvrtc_12_for_each_architecture() {
    let found = libs::search_dirs()
        .into_iter()
        .map(|dir| dir.join("libnvrtc.so.12"))
        .find(|path| path.is_file());
    let Some(nvrtc12) = found else {
        panic!(
            "this binary was built with NVRTC 12 found, but no libnvrtc.so.12 is in {:?} now",
            libs::search_dirs()
        );
    };
    let tests = [
        "every_kernel_compiles_to_ptx_for_each_architecture_with_matching_signatures",
        "every_kernel_compiles_to_cubin_for_each_architecture",
        "nvrtc_targets_the_reference_gpus",
    ];
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = std::process::Command::new(exe)
        .args(tests)
        // Two at once: this test ends last in its binary, alone.
        .args(["--exact", "--nocapture", "--test-threads", "2"])
        .env(libs::NVRTC_ENV, &nvrtc12)
        .env(EXPECT_NVRTC_MAJOR, "12")
        .env("HEADROOM_REQUIRE_NVRTC", "1")
        .output()
        .expect("the test binary runs again");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "with {}:\n{text}", nvrtc12.display());
    assert!(
        text.contains(&format!("{} passed", tests.len())) && text.contains("NVRTC 12."),
        "with {}, not every test ran:\n{text}",
        nvrtc12.display()
    );
}

/// Per entry point in a ptxas `-v` log: (name, registers, spill bytes
/// stored and loaded, shared bytes).
fn ptxas_usage(log: &str) -> Vec<(String, u32, u32, u32)> {
    let number_before = |line: &str, unit: &str| -> u32 {
        line.split(',')
            .find_map(|part| {
                part.trim()
                    .strip_suffix(unit)?
                    .trim()
                    .rsplit(' ')
                    .next()?
                    .parse()
                    .ok()
            })
            .unwrap_or(0)
    };
    let mut out: Vec<(String, u32, u32, u32)> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_string();
            out.push((name, 0, 0, 0));
        } else if let Some(last) = out.last_mut() {
            if line.contains("spill stores") {
                last.2 = number_before(line, "bytes spill stores")
                    + number_before(line, "bytes spill loads");
            } else if line.contains("Used") {
                last.1 = number_before(line, "registers");
                last.3 = number_before(line, "bytes smem");
            }
        }
    }
    out
}

/// No kernel spills registers to local memory (slow, and a sign the kernel
/// outgrew its design) and every one fits a block of MAX_BLOCK_THREADS, the
/// widest the backend launches (the emulator refuses a wider one in the
/// tests), in the 64K registers of an SM.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn no_kernel_spills_registers_and_each_fits_the_widest_block() {
    if nvrtc().is_none() {
        return;
    }
    for (file, arch, (_, log)) in cubin_reports() {
        let usage = ptxas_usage(log);
        assert_eq!(
            usage.len(),
            file.kernels.len(),
            "{}.cu sm_{arch}: ptxas reported {} entry points, kernels.rs lists {}:\n{log}",
            file.name,
            usage.len(),
            file.kernels.len()
        );
        for (name, registers, spilled, shared) in usage {
            eprintln!("sm_{arch} {name}: {registers} registers, {shared} B shared");
            assert!(registers > 0, "{name}: no register count in\n{log}");
            assert_eq!(spilled, 0, "{name} (sm_{arch}) spills registers:\n{log}");
            assert!(
                registers * MAX_BLOCK_THREADS <= 65_536 && shared <= 48 * 1024,
                "{name} (sm_{arch}): {registers} registers, {shared} B shared"
            );
        }
    }
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_second_report_of_a_kernel_file_lists_every_entry_point_again() {
    // NVRTC 13.0 on an H200 served a second, identical compile from its
    // own cache and ptxas wrote no report ("0 entry points"): every report
    // must compile afresh, in one process as across processes.
    if nvrtc().is_none() {
        return;
    }
    let file = kernels::FILES
        .iter()
        .min_by_key(|f| f.kernels.len())
        .expect("kernel files");
    for round in 0..2 {
        let log = kernels::ptxas_report(file, 80).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            ptxas_usage(&log).len(),
            file.kernels.len(),
            "{}.cu, report {round}:\n{log}",
            file.name
        );
    }
}

#[test]
fn ptxas_usage_reads_registers_spills_and_shared_memory() {
    let log = "ptxas info    : Compiling entry function 'a' for 'sm_90'\n\
               ptxas info    : Function properties for a\n\
               \x20   8 bytes stack frame, 4 bytes spill stores, 6 bytes spill loads\n\
               ptxas info    : Used 214 registers, used 1 barriers, 15360 bytes smem, 384 bytes cmem[0]\n\
               ptxas info    : Compiling entry function 'b' for 'sm_90'\n\
               ptxas info    : Used 12 registers, used 0 barriers, 380 bytes cmem[0]\n";
    assert_eq!(
        ptxas_usage(log),
        vec![
            ("a".to_string(), 214, 10, 15360),
            ("b".to_string(), 12, 0, 0)
        ]
    );
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn nvrtc_targets_the_reference_gpus() {
    if nvrtc().is_none() {
        return;
    }
    let archs = kernels::supported_archs().unwrap();
    for arch in ARCHS {
        assert!(
            archs.contains(&arch),
            "NVRTC supports {archs:?}, not sm_{arch}"
        );
        assert_eq!(kernels::target_for(arch).unwrap(), Target::Cubin(arch));
    }
    // A GPU newer than NVRTC knows gets PTX for the newest architecture, JIT
    // compiled by the driver.
    let newest = *archs.iter().max().unwrap();
    assert_eq!(
        kernels::target_for(newest + 1).unwrap(),
        Target::Ptx(newest)
    );
    assert!(
        kernels::target_for(10).is_err(),
        "older than every supported architecture"
    );
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_kernel_that_does_not_compile_is_an_error_with_the_log() {
    if nvrtc().is_none() {
        return;
    }
    static BROKEN: KernelFile = KernelFile {
        name: "broken",
        source:
            "#include \"common.cuh\"\nextern \"C\" __global__ void oops(u32 n) { undeclared(n); }\n",
        kernels: &[],
    };
    let err = kernels::compile(&BROKEN, Target::Ptx(80)).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("broken.cu") && text.contains("undeclared"),
        "{text}"
    );
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn compiled_kernels_are_cached_on_disk() {
    if nvrtc().is_none() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("headroom-kernel-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // Only this test reads the variable (the others call `compile`).
    std::env::set_var("HEADROOM_KERNEL_CACHE", &dir);
    let file = &kernels::FILES[0];
    let first = kernels::load_or_compile(file, Target::Ptx(80), HalfFormat::F16).unwrap();
    let key = kernels::cache_key(file, Target::Ptx(80), HalfFormat::F16).unwrap();
    let cached = dir.join(&key);
    assert_eq!(std::fs::read(&cached).unwrap(), first, "{key} written");
    // A second call reads the file: prove it by planting a marker.
    std::fs::write(&cached, b"marker").unwrap();
    assert_eq!(
        kernels::load_or_compile(file, Target::Ptx(80), HalfFormat::F16).unwrap(),
        b"marker"
    );
    // Another target is another entry.
    assert_ne!(
        key,
        kernels::cache_key(file, Target::Cubin(80), HalfFormat::F16).unwrap()
    );
    // The bf16 build of the same file is another cache entry.
    assert_ne!(
        key,
        kernels::cache_key(file, Target::Ptx(80), HalfFormat::Bf16).unwrap()
    );
    std::env::remove_var("HEADROOM_KERNEL_CACHE");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The body of entry `name` in `ptx`: from its `.entry` line to the next.
fn entry_body<'a>(ptx: &'a str, name: &str) -> &'a str {
    let start = ptx
        .find(&format!(".entry {name}("))
        .unwrap_or_else(|| panic!("no entry {name} in the PTX"));
    let rest = &ptx[start + 1..];
    let end = rest.find(".entry ").map_or(ptx.len(), |e| start + 1 + e);
    &ptx[start..end]
}

/// How many of each f32 multiply, add and fused multiply-add `body` has.
fn f32_arithmetic(body: &str) -> [usize; 3] {
    let count = |op: &str| {
        body.lines()
            .filter(|l| l.split_whitespace().any(|w| w == op))
            .count()
    };
    [count("mul.f32"), count("add.f32"), count("fma.rn.f32")]
}

/// Kernel pairs whose results the tests hold bit for bit equal (the batch
/// norm backward's partial sums, masking g in place or reading it masked)
/// must multiply with fused multiply-adds in both: the compiler contracted
/// `sgx += g * (x - mean)` in one of the two _v8 kernels and not in the other,
/// and their sums differed in the last bits on an H100. Here, without a GPU.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn twin_batch_norm_kernels_multiply_alike() {
    if nvrtc().is_none() {
        return;
    }
    let file = kernels::FILES
        .iter()
        .find(|f| f.name == "batchnorm")
        .expect("batchnorm.cu is listed");
    let ptx = kernels::compile(file, Target::Ptx(90)).unwrap_or_else(|e| panic!("{e}"));
    let ptx = String::from_utf8(ptx).expect("PTX is text");
    for (plain, masking) in [
        (
            "bn_backward_partial_v8_f16",
            "bn_backward_partial_mask_v8_f16",
        ),
        ("bn_backward_partial_f16", "bn_backward_partial_mask_f16"),
        ("bn_backward_partial_f32", "bn_backward_partial_mask_f32"),
    ] {
        let [plain_mul, _, plain_fma] = f32_arithmetic(entry_body(&ptx, plain));
        let [masking_mul, _, masking_fma] = f32_arithmetic(entry_body(&ptx, masking));
        assert_eq!(
            (plain_mul, masking_mul),
            (0, 0),
            "{plain} / {masking}: an f32 product not fused into its sum"
        );
        assert!(
            plain_fma > 0 && masking_fma > 0,
            "{plain}: {plain_fma} fma, {masking}: {masking_fma}"
        );
    }
}

/// adamw_check judges the values adamw_fused writes only if both compute
/// them with the same operations: one inline function (adamw_element)
/// gives both the same source, but the compiler contracts and schedules
/// each kernel on its own (see above), so their PTX must hold the same f32
/// multiplies, adds, fused multiply-adds, divisions and square roots.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn the_overflow_check_computes_the_update_as_adamw_fused_does() {
    if nvrtc().is_none() {
        return;
    }
    let file = kernels::FILES
        .iter()
        .find(|f| f.name == "optim")
        .expect("optim.cu is listed");
    for arch in ARCHS {
        let ptx = kernels::compile(file, Target::Ptx(arch)).unwrap_or_else(|e| panic!("{e}"));
        let ptx = String::from_utf8(ptx).expect("PTX is text");
        let ops = |name: &str| {
            let body = entry_body(&ptx, name);
            let count = |prefix: &str| {
                body.lines()
                    .filter(|l| l.split_whitespace().any(|w| w.starts_with(prefix)))
                    .count()
            };
            let [mul, add, fma] = f32_arithmetic(body);
            [mul, add, fma, count("div.rn.f32"), count("sqrt.rn.f32")]
        };
        for (check, fused) in [
            ("adamw_check", "adamw_fused"),
            ("adamw_check_f32", "adamw_fused_f32"),
        ] {
            let (c, f) = (ops(check), ops(fused));
            assert_eq!(
                c, f,
                "sm_{arch}: {check} vs {fused} [mul, add, fma, div, sqrt]"
            );
            assert!(c[3] > 0 && c[4] > 0, "sm_{arch}: {check} computes {c:?}");
        }
    }
}
