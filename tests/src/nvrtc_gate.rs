//! The tests that need NVRTC, reported honestly.
//!
//! Each such test carries [`MARKER`]: built as ignored, with its reason,
//! when the build scripts (crates/model/build.rs) did not find NVRTC, so
//! `cargo test` counts it as ignored, not passed. Each CUDA test binary also
//! invokes [`report_nvrtc_tests!`](crate::report_nvrtc_tests), which adds a
//! test that always runs and, on Linux, a function run at the process's
//! exit, after libtest's `test result:` line: there, past the output
//! capture, it prints how many of the binary's tests did not run and why
//! (and, for the binary given the workspace root, how many in the whole
//! workspace), or that NVRTC is found now and the build is stale.
//!
//! Shared, unchanged, by headroom-tests (`pub mod nvrtc_gate`) and by the
//! CUDA test binaries of headroom-model and headroom-pipeline (`#[path]`),
//! so every binary reports alike; `cfg!(headroom_nvrtc)` is each package's
//! own build script's answer.
#![allow(dead_code)]

use std::io::Write as _;
use std::path::Path;
use std::sync::Mutex;

/// The attribute every test that needs NVRTC carries; libtest prints its
/// reason beside "ignored".
pub const MARKER: &str =
    "#[cfg_attr(not(headroom_nvrtc), ignore = \"NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc\")]";

/// What is counted: the marker's reason, on whatever line rustfmt puts it.
const REASON: &str = "ignore = \"NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc\"";

/// How to install NVRTC.
pub const INSTALL: &str = "python3 -m pip install nvidia-cuda-nvrtc";

/// Whether this package's tests that need NVRTC were built to run.
pub const BUILT_TO_RUN: bool = cfg!(headroom_nvrtc);

/// Variables that demand the tests run: a binary built without NVRTC fails
/// its always-run test under them (the build scripts do not read them, so
/// setting one rebuilds nothing).
const REQUIRE_VARS: [&str; 2] = ["HEADROOM_REQUIRE_NVRTC", "HEADROOM_REQUIRE_GPU"];

/// What the exit report prints, set by the always-run test.
static REPORT: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// The tests of a source file that carry [`MARKER`] (comment lines aside).
pub fn marked(source: &str) -> usize {
    source
        .lines()
        .map(str::trim_start)
        .filter(|line| !line.starts_with("//") && line.contains(REASON))
        .count()
}

/// The tests marked in the workspace at `root`: `tests/*.rs` of every
/// package directory (`root/*` and `root/crates/*` with a Cargo.toml).
pub fn marked_in_workspace(root: &Path) -> usize {
    let mut packages = Vec::new();
    for parent in [
        root.to_path_buf(),
        root.join("crates"),
        root.join("examples"),
    ] {
        let Ok(entries) = std::fs::read_dir(&parent) else {
            continue;
        };
        packages.extend(
            entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.join("Cargo.toml").is_file()),
        );
    }
    // A test binary is `tests/NAME.rs` or a folder `tests/NAME/` of
    // modules (`cuda_parity/`, one file per op family).
    let mut count = 0;
    let mut dirs: Vec<std::path::PathBuf> = packages.iter().map(|p| p.join("tests")).collect();
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for path in entries.filter_map(|e| e.ok().map(|e| e.path())) {
            if path.is_dir() && dir.file_name().is_some_and(|n| n == "tests") {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                count += std::fs::read_to_string(&path)
                    .map(|s| marked(&s))
                    .unwrap_or(0);
            }
        }
    }
    count
}

fn env_is_1(name: &str) -> bool {
    std::env::var(name).as_deref() == Ok("1")
}

/// The always-run test of `binary`, whose source is `source`: checks that
/// its NVRTC tests are marked, fails if they were built as ignored where a
/// run demands them, and leaves the exit report its lines. `workspace`: the
/// root, for the binary that also reports the workspace's count (the last
/// CUDA binary cargo runs).
pub fn check(binary: &str, source: &str, workspace: Option<&Path>) {
    let marked = marked(source);
    assert!(
        marked > 0,
        "{binary}: no test carries the NVRTC marker (`{MARKER}`), so nothing would be \
         reported as ignored without NVRTC"
    );
    if BUILT_TO_RUN {
        return;
    }
    // Built as ignored: that must not pass for a run that demands every
    // test.
    for var in REQUIRE_VARS {
        assert!(
            !env_is_1(var),
            "{var}=1 but {marked} tests of {binary} were built as ignored: NVRTC was not \
             found when it was built; install it (`{INSTALL}`), then touch \
             crates/model/build.rs and run again"
        );
    }
    let tests = if marked == 1 { "test" } else { "tests" };
    let now = headroom_model::cuda::libs::ensure_nvrtc();
    let mut lines = vec![match &now {
        Ok(at) => format!(
            "{binary}: {marked} {tests} NOT RUN (ignored): NVRTC was not found when this \
             binary was built, but it is found now{}; to run them: touch \
             crates/model/build.rs",
            at.as_ref()
                .map(|p| format!(" ({})", p.display()))
                .unwrap_or_default()
        ),
        Err(_) => format!(
            "{binary}: {marked} {tests} NOT RUN (ignored): NVRTC not found; install it with \
             `{INSTALL}` (HEADROOM_REQUIRE_NVRTC=1 makes this a failure)"
        ),
    }];
    if let Some(root) = workspace {
        lines.push(format!(
            "headroom: {} tests of the workspace that need NVRTC were NOT RUN (reported as \
             ignored, not passed): NVRTC {}",
            marked_in_workspace(root),
            if now.is_ok() {
                "was not found when they were built; touch crates/model/build.rs".to_string()
            } else {
                format!("not found; install it with `{INSTALL}`")
            }
        ));
    }
    if cfg!(target_os = "linux") {
        *REPORT.lock().unwrap_or_else(|p| p.into_inner()) = lines;
    } else {
        print_past_capture(&lines);
    }
}

/// Prints the lines `check` left, if any (at the process's exit).
pub fn report_at_exit() {
    let lines = std::mem::take(&mut *REPORT.lock().unwrap_or_else(|p| p.into_inner()));
    print_past_capture(&lines);
}

/// Straight to stderr: libtest captures `eprintln!`, not this.
pub fn print_past_capture(lines: &[String]) {
    let mut err = std::io::stderr().lock();
    for line in lines {
        let _ = writeln!(err, "{line}");
    }
}

/// The workspace's line alone, for the last test binary cargo runs
/// (`xtask/tests/trust.rs`: packages run in name order, xtask's last), so
/// that the test binaries of a plain `cargo test --workspace` end with it.
/// Only this package's build-time answer is known here: the three build
/// scripts share one lookup, so they agree.
pub fn report_workspace_at_exit(root: &Path) {
    if BUILT_TO_RUN {
        return;
    }
    print_past_capture(&[format!(
        "headroom: {} tests of the workspace that need NVRTC were NOT RUN (reported as \
         ignored, not passed): NVRTC was not found when they were built; install it with \
         `{INSTALL}` (then `touch crates/model/build.rs`)",
        marked_in_workspace(root)
    )]);
}

/// Registers [`report_workspace_at_exit`](crate::nvrtc_gate::report_workspace_at_exit) to run at the process's exit,
/// after libtest's summary (Linux; elsewhere it does nothing):
/// `report_nvrtc_workspace_at_exit!(ROOT)`, `ROOT` a `&str` path.
#[macro_export]
macro_rules! report_nvrtc_workspace_at_exit {
    ($root:expr) => {
        #[cfg(target_os = "linux")]
        #[used]
        #[link_section = ".fini_array"]
        static NVRTC_WORKSPACE_REPORT_AT_EXIT: extern "C" fn() = {
            extern "C" fn report() {
                $crate::nvrtc_gate::report_workspace_at_exit(::std::path::Path::new($root));
            }
            report
        };
    };
}

/// The always-run test and the exit report of a CUDA test binary:
/// `report_nvrtc_tests!("cuda_ptx", include_str!("cuda_ptx.rs"))`, with a
/// third argument, the workspace root (a `&Path`), for the binary that
/// reports the workspace's count.
#[macro_export]
macro_rules! report_nvrtc_tests {
    ($binary:literal, $source:expr) => {
        $crate::report_nvrtc_tests!($binary, $source, None);
    };
    ($binary:literal, $source:expr, $workspace:expr) => {
        /// Its tests that need NVRTC are marked; a run that demands them
        /// fails if they were built as ignored; else the exit report says
        /// how many did not run.
        #[test]
        fn tests_that_need_nvrtc_run_or_are_reported() {
            $crate::nvrtc_gate::check($binary, $source, $workspace);
        }

        /// Run by the C library at exit, after libtest's summary: the last
        /// thing the binary prints.
        #[cfg(target_os = "linux")]
        #[used]
        #[link_section = ".fini_array"]
        static NVRTC_REPORT_AT_EXIT: extern "C" fn() = {
            extern "C" fn report() {
                $crate::nvrtc_gate::report_at_exit();
            }
            report
        };
    };
}
