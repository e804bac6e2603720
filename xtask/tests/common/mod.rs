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
