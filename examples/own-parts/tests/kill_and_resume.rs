//! Each example program, SIGKILLed after its first checkpoint and resumed,
//! ends bit for bit where an uninterrupted run ends: the same weights,
//! optimizer state and position, the same metrics, and (the CSV sink) the
//! same CSV files. And a custom layer on CUDA is refused by name.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use headroom_pipeline::checkpoint;

/// Enough work that the first checkpoint (step 50) comes well before the
/// end (about 560 steps).
const ARGS: [&str; 6] = ["--epochs", "3", "--samples", "6000", "--width", "384"];

fn run(program: &str, out: &Path, extra: &[&str]) {
    let output = Command::new(program)
        .args(["--out", out.to_str().unwrap()])
        .args(ARGS)
        .args(extra)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{program} {extra:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Starts a run, SIGKILLs it once its first checkpoint is on disk, and
/// checks it had not finished by then.
fn kill_after_first_checkpoint(program: &str, out: &Path) {
    let mut child = Command::new(program)
        .args(["--out", out.to_str().unwrap()])
        .args(ARGS)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while !out.is_dir() || checkpoint::list(out).unwrap().is_empty() {
        assert!(
            Instant::now() < deadline,
            "no checkpoint within two minutes"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "{program} ended before its first checkpoint"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        child.try_wait().unwrap().is_none(),
        "{program} finished before it could be killed: give it more work"
    );
    child.kill().unwrap();
    child.wait().unwrap();
}

fn last_checkpoint(dir: &Path) -> checkpoint::Checkpoint {
    let (found, _) = checkpoint::newest_valid(dir).unwrap();
    found.expect("a checkpoint").1
}

/// The metrics' step and epoch records without their timings.
fn figures(dir: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|line| {
            let mut value: serde_json::Value = serde_json::from_str(line).unwrap();
            for timing in [
                "samples_per_sec",
                "train_seconds",
                "train_samples_per_sec",
                "memory_bytes",
            ] {
                if let Some(data) = value["data"].as_object_mut() {
                    data.remove(timing);
                }
            }
            value.to_string()
        })
        .collect()
}

fn killed_and_resumed_equals_uninterrupted(program: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let (straight, killed) = (dir.path().join("straight"), dir.path().join("killed"));
    run(program, &straight, &[]);
    kill_after_first_checkpoint(program, &killed);
    run(program, &killed, &["--resume"]);
    let (a, b) = (last_checkpoint(&straight), last_checkpoint(&killed));
    assert_eq!((a.meta.epoch, a.meta.step), (3, b.meta.step));
    assert_eq!(b.meta.epoch, 3);
    assert!(a.params == b.params, "weights differ after the kill");
    assert!(a.buffers == b.buffers, "buffers differ after the kill");
    assert!(
        a.optimizer == b.optimizer,
        "optimizer state differs after the kill"
    );
    assert_eq!(figures(&straight), figures(&killed), "metrics differ");
    dir
}

#[test]
fn a_custom_dataset_resumes_bit_for_bit() {
    killed_and_resumed_equals_uninterrupted(env!("CARGO_BIN_EXE_custom_dataset"));
}

#[test]
fn a_custom_layer_resumes_bit_for_bit() {
    killed_and_resumed_equals_uninterrupted(env!("CARGO_BIN_EXE_custom_layer"));
}

#[test]
fn a_custom_sink_resumes_bit_for_bit_and_so_do_its_files() {
    let dir = killed_and_resumed_equals_uninterrupted(env!("CARGO_BIN_EXE_custom_sink"));
    for file in ["steps.csv", "epochs.csv"] {
        let straight = std::fs::read(dir.path().join("straight").join(file)).unwrap();
        let killed = std::fs::read(dir.path().join("killed").join(file)).unwrap();
        assert!(straight.len() > 100, "{file} is nearly empty");
        assert!(straight == killed, "{file} differs after the kill");
    }
    let steps = std::fs::read_to_string(dir.path().join("straight/steps.csv")).unwrap();
    // A header and one row per step of 3 epochs of 6000/32 batches.
    assert_eq!(steps.lines().count(), 1 + 3 * (6000 / 32));
}

#[test]
fn a_custom_layer_on_cuda_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_custom_layer"))
        .args([
            "--out",
            dir.path().join("run").to_str().unwrap(),
            "--device",
            "cuda",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("model.layers[3]") && stderr.contains("gated_residual"),
        "{stderr}"
    );
    assert!(stderr.contains("no CUDA implementation"), "{stderr}");
}
