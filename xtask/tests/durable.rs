//! Runs that are killed or interrupted lose nothing: SIGINT stops cleanly
//! with a checkpoint, and a run SIGKILLed at random points and resumed each
//! time ends with weights bit-identical to a run that was never stopped.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::*;
use headroom_pipeline::checkpoint;

fn args(list: &[String]) -> Vec<&str> {
    list.iter().map(String::as_str).collect()
}

fn durable_args(data: &Path, out: &Path, epochs: u64) -> Vec<String> {
    let mut list = smoke_args(data, out);
    for pair in [
        format!("train.epochs={epochs}"),
        "train.threads=2".into(),
        "checkpoint.every_steps=7".into(),
        "checkpoint.keep=2".into(),
    ] {
        list.extend(["--set".into(), pair]);
    }
    list
}

fn spawn(list: &[String]) -> Child {
    xtask(&args(list))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn signal(child: &Child, name: &str) {
    let status = std::process::Command::new("kill")
        .args([name, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

fn wait_for_checkpoint(dir: &Path, child: &mut Child) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while checkpoint::list(dir).unwrap().is_empty() {
        assert!(
            Instant::now() < deadline,
            "no checkpoint within two minutes"
        );
        if let Ok(Some(status)) = child.try_wait() {
            panic!("training ended early: {status}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn newest(dir: &Path) -> (PathBuf, checkpoint::Checkpoint) {
    let path = checkpoint::list(dir).unwrap().pop().unwrap();
    let saved = checkpoint::load(&path).unwrap();
    (path, saved)
}

#[test]
fn sigint_stops_after_the_step_with_a_checkpoint_and_resume_finishes() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 2048, 256);
    let out = tempfile::tempdir().unwrap();
    let run_dir = out.path().join("run");
    let list = durable_args(data.path(), &run_dir, 20);
    let mut child = spawn(&list);
    wait_for_checkpoint(&run_dir, &mut child);
    signal(&child, "-INT");
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        output.status.code(),
        Some(130),
        "a run stopped by SIGINT exits 130: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("--resume"), "{stdout}");
    let (_, saved) = newest(&run_dir);
    assert!(saved.meta.epoch < 20, "stopped before the end");

    let mut resume = list.clone();
    resume.push("--resume".into());
    let resumed = run(&args(&resume));
    let err = stderr(&resumed);
    assert!(resumed.status.success(), "{err}");
    assert!(err.contains("resuming from"), "{err}");
    assert!(err.contains("epoch 20/20 done"), "{err}");
}

#[test]
fn sigkill_at_random_points_then_resume_is_bit_identical() {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), 2048, 128);
    let out = tempfile::tempdir().unwrap();
    let (straight, killed) = (out.path().join("straight"), out.path().join("killed"));

    let reference = run(&args(&durable_args(data.path(), &straight, 12)));
    assert!(reference.status.success(), "{}", stderr(&reference));

    let list = durable_args(data.path(), &killed, 12);
    let mut resume = list.clone();
    resume.push("--resume".into());
    // Kill points spread over the run, from a fixed pseudo-random sequence.
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut kills = 0;
    for attempt in 0..4 {
        let mut child = spawn(if attempt == 0 { &list } else { &resume });
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let delay = Duration::from_millis(300 + state % 900);
        std::thread::sleep(delay);
        if child.try_wait().unwrap().is_none() {
            signal(&child, "-KILL");
            kills += 1;
        }
        child.wait().unwrap();
    }
    assert!(
        kills >= 2,
        "the run should have been killed mid-way at least twice"
    );
    let finished = run(&args(&resume));
    assert!(finished.status.success(), "{}", stderr(&finished));

    let (_, a) = newest(&straight);
    let (_, b) = newest(&killed);
    assert_eq!((a.meta.epoch, a.meta.step), (b.meta.epoch, b.meta.step));
    assert!(a.params == b.params, "weights differ after {kills} kills");
    assert!(a.buffers == b.buffers, "batch-norm statistics differ");
    assert!(a.optimizer == b.optimizer, "optimizer state differs");
    let (steps, epochs) = figures(&straight);
    let (killed_steps, killed_epochs) = figures(&killed);
    assert_eq!(steps.len() as u64, a.meta.step, "one record per step");
    let differ: Vec<u64> = (1..=a.meta.step)
        .filter(|step| steps.get(step) != killed_steps.get(step))
        .collect();
    assert!(
        differ.is_empty(),
        "the killed run's metrics lost or changed {} step records, from step {:?}",
        differ.len(),
        differ.first()
    );
    assert_eq!(epochs, killed_epochs, "epoch figures differ");
}

/// A run's step records (step: loss, gradient norm) and epoch figures.
type Figures = (BTreeMap<u64, (String, String)>, Vec<String>);

fn figures(run: &Path) -> Figures {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let (mut steps, mut epochs) = (BTreeMap::new(), Vec::new());
    for line in text.lines() {
        let record: serde_json::Value = serde_json::from_str(line).unwrap();
        let data = &record["data"];
        match record["kind"].as_str() {
            Some("step") => {
                let step = data["step"].as_u64().unwrap();
                let figures = (data["loss"].to_string(), data["grad_norm"].to_string());
                assert!(steps.insert(step, figures).is_none(), "step {step} twice");
            }
            Some("epoch") => {
                epochs.push(format!("{} {}", data["test_loss"], data["test_accuracy"]))
            }
            _ => {}
        }
    }
    (steps, epochs)
}
