//! Builds the emulator's two shared libraries into OUT_DIR with the system
//! C++ compiler (`$CXX`, else `c++`):
//!
//! - `libcuda.so` (SONAME `libcuda.so`): the fake driver (shim/driver.cpp;
//!   shim/device.cpp: the architecture and driver version it answers as)
//!   and every kernel of headroom-model's `.cu` files (each beside its
//!   launches: `crates/model/src/ops/<family>/*.cu`, `src/cuda/optim.cu`,
//!   found by walking `crates/model/src`) compiled as host C++
//!   with shim/cuda_shim.h force-included and `HR_EMULATE` defined. Each
//!   `.cu` file gets a generated unit that holds a copy of it inside a
//!   namespace of its own and registers every `extern "C" __global__ void
//!   NAME(` it finds, so a kernel added later is emulated without a list to
//!   update, with which of its parameters are `__restrict__` pointers, and
//!   which of those are not `const` (the driver refuses a launch that
//!   aliases them). The copy has a call after each `__shared__`
//!   declaration, which fills the variable with 0xff bytes at each block's
//!   start.
//!   shim/selftest.cu (the emulator's own test kernels) is built likewise.
//! - `libcublas.so` (SONAME `libcublas.so`): the fake cuBLAS (shim/cublas.cpp).
//! - `libnccl.so` (SONAME `libnccl.so`): the fake NCCL (shim/nccl.cpp).
//!
//! The SONAMEs are cudarc's first bare-name candidates, so once
//! `headroom_cuda_emu::install` has loaded these files, cudarc binds to them
//! even on a machine that also has a real driver library.
//!
//! Without a C++ compiler the libraries are not built and `install` says so
//! (the tests then skip, or fail where CI requires them); a kernel that does
//! not compile as host C++ fails the build with the compiler's message.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"),
    );
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let shim = manifest.join("shim");
    let model_src = manifest.join("../model/src");
    // common.cuh, which every kernel file includes.
    let include_dir = model_src.join("ops");
    println!("cargo:rerun-if-changed={}", shim.display());
    // The kernel files, each beside its launches. Not the whole source
    // directory, whose every Rust edit would rebuild the emulator: each
    // `.cu` file, common.cuh, and kernels.rs, which a new kernel file is
    // listed in (its `include_str!`), so that adding one reruns this script.
    let mut files = Vec::new();
    cu_files(&model_src, &mut files);
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
    }
    println!(
        "cargo:rerun-if-changed={}",
        include_dir.join("common.cuh").display()
    );
    println!(
        "cargo:rerun-if-changed={}",
        model_src.join("cuda/kernels.rs").display()
    );
    println!("cargo:rerun-if-env-changed=CXX");
    println!(
        "cargo:rustc-env=HEADROOM_CUDA_EMU_LIB_DIR={}",
        out.display()
    );

    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    if Command::new(&cxx).arg("--version").output().is_err() {
        let why = format!("no C++ compiler (`{cxx}`) was found when headroom-cuda-emu was built");
        println!("cargo:warning=headroom-cuda-emu: {why}; the CUDA emulator is not built");
        println!("cargo:rustc-env=HEADROOM_CUDA_EMU_MISSING={why}");
        return;
    }
    println!("cargo:rustc-env=HEADROOM_CUDA_EMU_MISSING=");

    let gen = out.join("gen");
    std::fs::create_dir_all(&gen).expect("create OUT_DIR/gen");
    let mut units = vec![shim.join("driver.cpp"), shim.join("device.cpp")];
    // The emulator's own test kernels, built the same way.
    files.push(shim.join("selftest.cu"));
    files.sort();
    // A unit is named after its file's stem.
    let mut stems: Vec<_> = files.iter().filter_map(|f| f.file_stem()).collect();
    stems.sort();
    if let Some(w) = stems.windows(2).find(|w| w[0] == w[1]) {
        panic!("headroom-cuda-emu: two kernel files are named {:?}", w[0]);
    }
    for file in &files {
        units.push(generate_unit(file, &gen));
    }

    let common = |cmd: &mut Command| {
        cmd.args([
            "-std=c++17",
            "-O2",
            "-fPIC",
            "-fvisibility=hidden",
            "-pthread",
        ])
        // The GPU contracts a*b+c into an FMA where NVRTC likes; the host
        // build rounds every operation, which the tolerances cover.
        .arg("-ffp-contract=off")
        .args(["-Wall", "-Wno-unused-function", "-Wno-unused-variable"])
        // A GPU gives an uninitialised register whatever it held; the host
        // compiler can see some such reads, and a kernel with one must not
        // build.
        .args(["-Werror=uninitialized", "-Werror=maybe-uninitialized"])
        .arg("-DHR_EMULATE")
        .arg("-include")
        .arg(shim.join("cuda_shim.h"))
        .arg("-I")
        .arg(&shim)
        .arg("-I")
        .arg(&include_dir);
    };

    // Compile the units in parallel, then link.
    let mut jobs = Vec::new();
    for unit in &units {
        let obj = gen.join(format!(
            "{}.o",
            unit.file_stem().and_then(|s| s.to_str()).unwrap_or("unit")
        ));
        let mut cmd = Command::new(&cxx);
        common(&mut cmd);
        cmd.arg("-c").arg(unit).arg("-o").arg(&obj);
        let child = cmd.spawn().unwrap_or_else(|e| panic!("run {cxx}: {e}"));
        jobs.push((unit.clone(), obj, child));
    }
    let mut objects = Vec::new();
    for (unit, obj, child) in jobs {
        let out = child.wait_with_output().expect("wait for the C++ compiler");
        assert!(
            out.status.success(),
            "headroom-cuda-emu: compiling {} as host C++ failed (see the compiler output above)",
            unit.display()
        );
        objects.push(obj);
    }
    link(&cxx, &out.join("libcuda.so"), "libcuda.so", &objects);

    let blas_obj = gen.join("cublas.o");
    let mut cmd = Command::new(&cxx);
    common(&mut cmd);
    run(
        cmd.arg("-c")
            .arg(shim.join("cublas.cpp"))
            .arg("-o")
            .arg(&blas_obj),
        "cublas.cpp",
    );
    link(&cxx, &out.join("libcublas.so"), "libcublas.so", &[blas_obj]);

    let nccl_obj = gen.join("nccl.o");
    let mut cmd = Command::new(&cxx);
    common(&mut cmd);
    run(
        cmd.arg("-c")
            .arg(shim.join("nccl.cpp"))
            .arg("-o")
            .arg(&nccl_obj),
        "nccl.cpp",
    );
    link(&cxx, &out.join("libnccl.so"), "libnccl.so", &[nccl_obj]);
}

/// Every `.cu` file under `dir`, recursively.
fn cu_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display()));
    for entry in entries {
        let path = entry
            .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
            .path();
        if path.is_dir() {
            cu_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "cu") {
            out.push(path);
        }
    }
}

fn run(cmd: &mut Command, what: &str) {
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("run the C++ compiler for {what}: {e}"));
    assert!(
        status.success(),
        "headroom-cuda-emu: building {what} failed (see the compiler output above)"
    );
}

fn link(cxx: &str, lib: &Path, soname: &str, objects: &[PathBuf]) {
    let mut cmd = Command::new(cxx);
    cmd.args(["-shared", "-pthread"])
        .arg(format!("-Wl,-soname,{soname}"))
        .arg("-Wl,--no-undefined")
        .args(objects)
        .arg("-o")
        .arg(lib);
    run(&mut cmd, soname);
}

/// An entry point of a kernel source: its name and, as bit masks over its
/// parameters, which are `__restrict__` pointers and which of those it may
/// write (not `const`).
struct Kernel {
    name: String,
    restrict_mask: u32,
    written_mask: u32,
}

/// The `extern "C" __global__ void NAME(...)` entry points of a kernel
/// source, comments ignored.
fn kernels(source: &str) -> Vec<Kernel> {
    let code = strip_comments(source);
    let flat: String = code.split_whitespace().collect::<Vec<_>>().join(" ");
    let marker = "extern \"C\" __global__ void ";
    let mut names = Vec::new();
    let mut rest = flat.as_str();
    while let Some(at) = rest.find(marker) {
        rest = &rest[at + marker.len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let after = rest[name.len()..].trim_start();
        if name.is_empty() || !after.starts_with('(') {
            continue;
        }
        let params = after[1..].split(')').next().unwrap_or("");
        let (mut restrict_mask, mut written_mask) = (0u32, 0u32);
        for (i, param) in params.split(',').enumerate().take(32) {
            if param.contains("__restrict__") {
                restrict_mask |= 1 << i;
                if !param.trim_start().starts_with("const ") {
                    written_mask |= 1 << i;
                }
            }
        }
        names.push(Kernel {
            name,
            restrict_mask,
            written_mask,
        });
    }
    names
}

fn strip_comments(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '/' && chars.peek() == Some(&'/') {
            for c in chars.by_ref() {
                if c == '\n' {
                    out.push('\n');
                    break;
                }
            }
        } else if c == '/' && chars.peek() == Some(&'*') {
            chars.next();
            let mut prev = ' ';
            for c in chars.by_ref() {
                if prev == '*' && c == '/' {
                    break;
                }
                prev = c;
            }
            out.push(' ');
        } else {
            out.push(c);
        }
    }
    out
}

/// Writes the unit that compiles `file` and registers its kernels.
fn generate_unit(file: &Path, gen: &Path) -> PathBuf {
    let source =
        std::fs::read_to_string(file).unwrap_or_else(|e| panic!("read {}: {e}", file.display()));
    let stem = file
        .file_stem()
        .and_then(|s| s.to_str())
        .expect("kernel file names are UTF-8");
    let ident: String = stem
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let ns = format!("hr_kernels_{ident}");
    // The source is copied in, not included, to follow each __shared__
    // declaration with HR_SHARED_FRESH; #line keeps the compiler's messages
    // on the kernel file's own lines.
    let mut text = format!(
        "// Generated by crates/cuda-emu/build.rs from {path}: do not edit.\n\
         #include \"emu.h\"\n\
         namespace {ns} {{\n\
         #line 1 \"{path}\"\n\
         {body}\n\
         }}\n",
        path = file.display(),
        body = mark_shared_declarations(&source, file),
    );
    for k in kernels(&source) {
        text.push_str(&format!(
            "static hr_registrar hr_reg_{name}(hr_entry(\"{name}\", &{ns}::{name}, {r:#x}u, {w:#x}u));\n",
            name = k.name,
            r = k.restrict_mask,
            w = k.written_mask,
        ));
    }
    let unit = gen.join(format!("kernels_{ident}.cpp"));
    // Rewriting an unchanged file would only cost a recompile.
    if std::fs::read_to_string(&unit).ok().as_deref() != Some(text.as_str()) {
        std::fs::write(&unit, text).unwrap_or_else(|e| panic!("write {}: {e}", unit.display()));
    }
    unit
}

/// `source` with `HR_SHARED_FRESH(name);` after every `__shared__`
/// declaration, on the same line (so line numbers stay). A declaration must
/// be in a function body (CUDA also allows file scope; the emulator does
/// not), start its line and end on it; one that does not end there fails
/// the build, since the emulator would otherwise leave its memory unfilled.
fn mark_shared_declarations(source: &str, file: &Path) -> String {
    let mut out = String::with_capacity(source.len() + 1024);
    for (number, line) in source.lines().enumerate() {
        out.push_str(line);
        if let Some(declaration) = line.trim_start().strip_prefix("__shared__ ") {
            let Some((declarators, _)) = declaration.split_once(';') else {
                panic!(
                    "{}:{}: a __shared__ declaration must end on the line it starts on \
                     (the CUDA emulator marks each one)",
                    file.display(),
                    number + 1
                );
            };
            for name in declared_names(declarators) {
                out.push_str(&format!(" HR_SHARED_FRESH({name});"));
            }
        }
        out.push('\n');
    }
    out
}

/// The names a declaration's declarators introduce: `float a[4], b[2]` gives
/// `a` and `b`; `Tiles<64, 32> tile` gives `tile`.
fn declared_names(declarators: &str) -> Vec<String> {
    let mut pieces = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in declarators.char_indices() {
        match c {
            '<' | '(' | '[' => depth += 1,
            '>' | ')' | ']' => depth -= 1,
            ',' if depth == 0 => {
                pieces.push(&declarators[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    pieces.push(&declarators[start..]);
    pieces
        .into_iter()
        .map(|piece| {
            let head = piece.split('[').next().unwrap_or(piece).trim_end();
            let tail = head.len()
                - head
                    .chars()
                    .rev()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .count();
            head[tail..].to_string()
        })
        .filter(|name| !name.is_empty())
        .collect()
}
