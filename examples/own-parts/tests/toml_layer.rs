//! A TOML experiment naming a custom layer, trained through
//! `headroom_pipeline::train` with the layer registered
//! (`TrainOptions::layers`): it learns, survives a SIGKILL bit for bit,
//! and `eval`/`predict` score it through the same registry, while without
//! the registry they refuse it by name.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use headroom_pipeline::{checkpoint, eval, predict};

const PROGRAM: &str = env!("CARGO_BIN_EXE_toml_layer");
const ARGS: [&str; 4] = ["--epochs", "3", "--samples", "6000"];

fn run(out: &Path, extra: &[&str]) -> String {
    let output = Command::new(PROGRAM)
        .args(["--out", out.to_str().unwrap()])
        .args(ARGS)
        .args(extra)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "toml_layer {extra:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// The percentage after `label` in the program's output.
fn accuracy(stdout: &str, label: &str) -> f64 {
    let line = stdout
        .lines()
        .find(|line| line.starts_with(label))
        .unwrap_or_else(|| panic!("no {label} line in {stdout}"));
    let (_, rest) = line.split_once("test accuracy ").unwrap();
    rest.split('%').next().unwrap().parse().unwrap()
}

#[test]
fn a_toml_experiment_with_a_custom_layer_trains_and_is_scored_through_the_registry() {
    let dir = tempfile::tempdir().unwrap();
    let stdout = run(dir.path(), &[]);
    let trained = accuracy(&stdout, "trained:");
    assert!(trained > 95.0, "{stdout}");
    // eval reads the newest checkpoint, the one the summary scored.
    assert_eq!(accuracy(&stdout, "eval:"), trained, "{stdout}");
    let predictions = std::fs::read_to_string(dir.path().join("predictions.csv")).unwrap();
    let mut lines = predictions.lines();
    assert_eq!(lines.next(), Some("input,class,p_0,p_1,p_2"));
    assert_eq!(lines.count(), 1200);

    // The run's spec names the custom layer: without its factory, eval and
    // predict say which one is missing, instead of guessing.
    let run_dir = dir.path().join("run");
    let refused = match eval::evaluate_checkpoint(&run_dir, None, 256, None) {
        Ok(_) => panic!("eval without the registry scored the run"),
        Err(e) => e.to_string(),
    };
    assert!(
        refused.contains("no custom layer \"gated_residual\" is registered"),
        "{refused}"
    );
    let refused = match predict::predict(&run_dir, &dir.path().join("data/test.csv"), 256) {
        Ok(_) => panic!("predict without the registry scored the run"),
        Err(e) => e.to_string(),
    };
    assert!(refused.contains("gated_residual"), "{refused}");
}

#[test]
fn a_toml_experiment_with_a_custom_layer_resumes_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let (straight, killed) = (dir.path().join("straight"), dir.path().join("killed"));
    run(&straight, &[]);
    let mut child = Command::new(PROGRAM)
        .args(["--out", killed.to_str().unwrap()])
        .args(ARGS)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let run_dir = killed.join("run");
    let deadline = Instant::now() + Duration::from_secs(120);
    while !run_dir.is_dir() || checkpoint::list(&run_dir).unwrap().is_empty() {
        assert!(
            Instant::now() < deadline,
            "no checkpoint within two minutes"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "toml_layer ended before its first checkpoint"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(
        child.try_wait().unwrap().is_none(),
        "toml_layer finished before it could be killed: give it more work"
    );
    child.kill().unwrap();
    child.wait().unwrap();
    run(&killed, &["--resume"]);
    let last = |out: &Path| {
        let (found, _) = checkpoint::newest_valid(&out.join("run")).unwrap();
        found.expect("a checkpoint").1
    };
    let (a, b) = (last(&straight), last(&killed));
    assert_eq!((a.meta.epoch, a.meta.step), (b.meta.epoch, b.meta.step));
    assert_eq!(a.meta.epoch, 3);
    assert!(a.params == b.params, "weights differ after the kill");
    assert!(a.buffers == b.buffers, "buffers differ after the kill");
    assert!(
        a.optimizer == b.optimizer,
        "optimizer state differs after the kill"
    );
}
