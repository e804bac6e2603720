//! `cargo lab`: the GPU bundle's command keeps the flags it had in xtask,
//! and xtask no longer has it.

use std::process::Command;

fn help(program: &str, args: &[&str]) -> String {
    let output = Command::new(program).args(args).output().unwrap();
    assert!(output.status.success(), "{program} {args:?}");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn gpu_bundle_has_its_flags() {
    let text = help(env!("CARGO_BIN_EXE_lab"), &["gpu-bundle", "--help"]);
    for flag in [
        "--output",
        "--with-data",
        "--baseline",
        "--baseline-rev",
        "--dry-run",
    ] {
        assert!(text.contains(flag), "{flag} missing from:\n{text}");
    }
    assert!(text.contains("[default: target/gpu-bundle]"), "{text}");
}

#[test]
fn a_baseline_and_a_baseline_revision_conflict() {
    let output = Command::new(env!("CARGO_BIN_EXE_lab"))
        .args(["gpu-bundle", "--baseline", "a.gz", "--baseline-rev", "HEAD"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(err.contains("cannot be used with"), "{err}");
}
