//! Issue #55, class 3: no crash and no hang at start. Under a limit on the
//! address space, on the data segment or on threads, `cargo xtask train`
//! either trains or exits with an error that names the limit: never
//! SIGABRT (a refused allocation, a panic whose backtrace deadlocks in std)
//! and never a hang.
//!
//! The limits are set with `prlimit` (util-linux); where it is absent the
//! tests say so and do nothing.

#[allow(dead_code)]
mod common;

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// A start that has not ended by then hangs.
const TIMEOUT: Duration = Duration::from_secs(120);
/// The uid a thread limit is tried under when the tests run as root: root
/// is exempt from RLIMIT_NPROC.
const NOBODY: u32 = 65_534;

/// `prlimit`, or None after saying why the test does nothing.
fn prlimit(test: &str) -> Option<Command> {
    match Command::new("prlimit").arg("--version").output() {
        Ok(out) if out.status.success() => Some(Command::new("prlimit")),
        _ => {
            eprintln!("{test}: skipped, no `prlimit` on this machine (util-linux)");
            None
        }
    }
}

/// The smoke experiment on `data`, one epoch, into a fresh directory.
fn train_args(data: &Path, out: &Path) -> Vec<String> {
    let mut list = smoke_args(data, &out.join("run"));
    for set in ["train.epochs=1", "data.test_samples=64"] {
        list.extend(["--set".to_string(), set.to_string()]);
    }
    list
}

/// Runs `command` to its end, killed after [`TIMEOUT`] (a hang fails).
fn run_bounded(mut command: Command) -> Output {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start prlimit");
    let started = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("collect the output");
        }
        if started.elapsed() > TIMEOUT {
            let _ = child.kill();
            let out = child.wait_with_output().expect("collect the output");
            panic!(
                "still running after {} s (a hang):\n{}",
                TIMEOUT.as_secs(),
                stderr(&out)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Trained, or refused with an error naming the limit (`names`, any of):
/// never killed by a signal (134 is SIGABRT), never a panic.
fn assert_trains_or_names_the_limit(out: &Output, limit: &str, names: &[&str]) {
    let err = stderr(out);
    assert_eq!(
        out.status.signal(),
        None,
        "{limit}: killed by a signal:\n{err}"
    );
    assert!(!err.contains("panicked"), "{limit}: a panic:\n{err}");
    assert!(
        !err.contains("memory allocation of"),
        "{limit}: an allocation aborted:\n{err}"
    );
    if out.status.success() {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("test accuracy"), "{limit}: {stdout}");
        return;
    }
    let line = err
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_else(|| panic!("{limit}: no error line:\n{err}"));
    assert!(
        names.iter().any(|name| line.contains(name)),
        "{limit}: the error does not name the limit ({names:?}): {line}"
    );
}

/// The smallest address-space limit, in MiB, under which the binary starts
/// at all (`--help`). Below it the dynamic loader cannot map the
/// binary and its libraries, before any code of ours runs; it grows with
/// the binary (about 21 MiB for a debug build at the end of 2026), so the
/// rungs below are set from it rather than fixed.
fn loader_floor_mib(test: &str) -> u64 {
    for megabytes in 8..=256u64 {
        let status = prlimit(test)
            .expect("prlimit")
            .arg(format!("--as={}", megabytes << 20))
            .arg(env!("CARGO_BIN_EXE_xtask"))
            .arg("--help")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("run prlimit");
        if status.success() {
            return megabytes;
        }
    }
    panic!("the binary does not start even under a 256 MiB address-space limit");
}

/// Limits on the address space from too small to start a thread up to
/// enough to train: each start trains or names the limit. The lowest rung
/// is 2 MiB above the loader's floor (`loader_floor_mib`).
#[test]
fn under_an_address_space_limit_a_start_trains_or_names_the_limit() {
    let test = "address space";
    let Some(_) = prlimit(test) else { return };
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 256, 64);
    let floor = loader_floor_mib(test);
    let mut refused = 0;
    for megabytes in [floor + 2, floor + 10, floor + 30, floor + 180] {
        let out = tempfile::tempdir().unwrap();
        let mut command = prlimit(test).unwrap();
        command
            .arg(format!("--as={}", megabytes << 20))
            .arg(env!("CARGO_BIN_EXE_xtask"))
            .args(train_args(data.path(), out.path()))
            .current_dir(repo_root())
            .env_remove("FASHION_MNIST_DIR");
        let output = run_bounded(command);
        let limit = format!("--as={megabytes}MiB");
        assert_trains_or_names_the_limit(&output, &limit, &["ulimit -v", "RLIMIT_AS", "memory"]);
        refused += usize::from(!output.status.success());
    }
    assert!(refused > 0, "no limit was tight enough to refuse a start");
}

/// The data segment (heap) limited: a thread's stack or a buffer refused
/// is an error naming the limit, not a panic that hangs.
#[test]
fn under_a_data_segment_limit_a_start_trains_or_names_the_limit() {
    let test = "data segment";
    let Some(_) = prlimit(test) else { return };
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 256, 64);
    let mut refused = 0;
    for megabytes in [4u64, 10, 15, 25, 60] {
        let out = tempfile::tempdir().unwrap();
        let mut command = prlimit(test).unwrap();
        command
            .arg(format!("--data={}", megabytes << 20))
            .arg(env!("CARGO_BIN_EXE_xtask"))
            .args(train_args(data.path(), out.path()))
            .current_dir(repo_root())
            .env_remove("FASHION_MNIST_DIR")
            // A panic's backtrace under a refused allocation is where std
            // deadlocked: the start must not panic, whatever this says.
            .env("RUST_BACKTRACE", "1");
        let output = run_bounded(command);
        let limit = format!("--data={megabytes}MiB");
        assert_trains_or_names_the_limit(&output, &limit, &["ulimit -d", "RLIMIT_DATA", "memory"]);
        refused += usize::from(!output.status.success());
    }
    assert!(refused > 0, "no limit was tight enough to refuse a start");
}

/// Threads limited to 1 .. 12 in all: each thread the run starts (signal
/// watcher, compute pool, loader workers, the sink) either starts or its
/// refusal is an error naming the limit.
#[test]
fn under_a_thread_limit_a_start_trains_or_names_the_limit() {
    let test = "threads";
    let Some(_) = prlimit(test) else { return };
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 256, 64);
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if root {
        // The run goes on as nobody, who must read the data.
        open_to_all(data.path());
    }
    let mut refused = 0;
    for threads in 1..=12 {
        let out = tempfile::tempdir().unwrap();
        if root {
            open_to_all(out.path());
        }
        let mut command = prlimit(test).unwrap();
        command
            .arg(format!("--nproc={threads}"))
            .arg(env!("CARGO_BIN_EXE_xtask"))
            .args(train_args(data.path(), out.path()))
            .arg("--set")
            .arg("train.threads=2")
            .current_dir(repo_root())
            .env_remove("FASHION_MNIST_DIR")
            .env("RUST_BACKTRACE", "1");
        if root {
            // SAFETY: setgid and setuid are async-signal-safe and change
            // only the child, before it runs prlimit.
            unsafe {
                command.pre_exec(|| {
                    if libc::setgid(NOBODY) != 0 || libc::setuid(NOBODY) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let output = run_bounded(command);
        let limit = format!("--nproc={threads}");
        assert_trains_or_names_the_limit(&output, &limit, &["ulimit -u"]);
        refused += usize::from(!output.status.success());
    }
    assert!(refused > 0, "no limit was tight enough to refuse a start");
}

fn open_to_all(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
}
