//! Helpers for the CLI tests: running the binary from the repository root.

pub use headroom_tests::write_synthetic_fashion_mnist;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `cargo xtask <args>` as a subprocess, from the repository root.
pub fn xtask(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_xtask"));
    command
        .args(args)
        .current_dir(repo_root())
        .env_remove("FASHION_MNIST_DIR");
    command
}

#[allow(dead_code)]
pub fn run(args: &[&str]) -> Output {
    xtask(args).output().expect("run xtask")
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Smoke-experiment arguments pointed at `data` and `out`.
pub fn smoke_args(data: &Path, out: &Path) -> Vec<String> {
    vec![
        "train".into(),
        "--config".into(),
        "experiments/smoke.toml".into(),
        "--no-install".into(),
        "--set".into(),
        format!("data.dir={}", data.display()),
        "--set".into(),
        format!("run.output_dir={}", out.display()),
    ]
}

/// Runs xtask with `args` until its log shows `marker`, sends it SIGTERM,
/// and returns its output with the whole log (standard error). Only the
/// fine-tuning commands' tests use it.
#[allow(dead_code)]
pub fn sigterm_after(args: &[&str], marker: &str) -> (Output, String) {
    use std::io::{BufRead, BufReader, Read};
    use std::process::Stdio;
    let mut child = xtask(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut err = BufReader::new(child.stderr.take().expect("stderr"));
    let mut log = String::new();
    let mut line = String::new();
    loop {
        line.clear();
        let read = err.read_line(&mut line).expect("read");
        assert!(read > 0, "the run ended before {marker:?}: {log}");
        log.push_str(&line);
        if line.contains(marker) {
            break;
        }
    }
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let mut rest = String::new();
    err.read_to_string(&mut rest).expect("read");
    log.push_str(&rest);
    (child.wait_with_output().expect("wait"), log)
}
