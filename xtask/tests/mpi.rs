//! Data-parallel training over MPI: `mpirun -np 2` of the xtask binary
//! (built with the `mpi` feature; CI installs Open MPI and runs these).
//! Two ranks of 32 samples end in the weights of one process of 64 in
//! two micro-batches, bit for bit (and so do two ranks with ZeRO-1); a
//! rank killed mid-run stops the other within a bound, and the leader's
//! checkpoint resumes to the weights of a run never stopped.
#![cfg(feature = "mpi")]

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use headroom_pipeline::checkpoint;

fn mpirun(ranks: usize, args: &[String]) -> Command {
    let mut command = Command::new("mpirun");
    command
        .args(["--oversubscribe", "-np", &ranks.to_string()])
        .arg(env!("CARGO_BIN_EXE_xtask"))
        .args(args)
        .current_dir(repo_root())
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env_remove("FASHION_MNIST_DIR");
    command
}

fn args(data: &Path, out: &Path, sets: &[&str]) -> Vec<String> {
    let mut all = smoke_args(data, out);
    for set in [
        "data.train_samples=512",
        "data.test_samples=128",
        "train.threads=1",
    ]
    .iter()
    .chain(sets)
    {
        all.push("--set".into());
        all.push((*set).to_string());
    }
    all
}

fn weights(dir: &Path) -> Vec<Vec<f32>> {
    let (found, _) = checkpoint::newest_valid(dir).expect("listing");
    let (path, _) = found.unwrap_or_else(|| panic!("no checkpoint in {}", dir.display()));
    checkpoint::load(&path).expect("loads").params
}

fn same_bits(a: &[Vec<f32>], b: &[Vec<f32>]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.iter()
                .map(|v| v.to_bits())
                .eq(y.iter().map(|v| v.to_bits()))
        })
}

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("headroom-mpi-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A directory of synthetic Fashion-MNIST files.
fn synthetic(name: &str) -> PathBuf {
    let dir = temp(name);
    std::fs::create_dir_all(&dir).expect("data dir");
    write_synthetic_fashion_mnist(&dir, 512, 128);
    dir
}

#[test]
fn two_mpi_ranks_train_the_weights_of_one_process_accumulating_two() {
    let data = synthetic("data");
    let (one, two) = (temp("one"), temp("two"));
    let alone = xtask(
        &args(&data, &one, &["train.batch_size=64", "train.accumulate=2"])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    )
    .output()
    .expect("one process");
    assert!(alone.status.success(), "{}", stderr(&alone));
    let ranked = mpirun(2, &args(&data, &two, &["train.batch_size=32"]))
        .output()
        .expect("mpirun");
    let log = stderr(&ranked);
    assert!(ranked.status.success(), "{log}");
    assert!(log.contains("data parallel: 2 ranks (MPI)"), "{log}");
    // The summary comes from the leader alone.
    let out = String::from_utf8_lossy(&ranked.stdout);
    assert_eq!(out.matches("== smoke ==").count(), 1, "{out}");
    assert!(same_bits(&weights(&one), &weights(&two)));
    // ZeRO-1 over MPI: the same weights again.
    let zero = temp("zero");
    let sharded = mpirun(
        2,
        &args(
            &data,
            &zero,
            &["train.batch_size=32", "train.shard_optimizer=true"],
        ),
    )
    .output()
    .expect("mpirun");
    assert!(sharded.status.success(), "{}", stderr(&sharded));
    assert!(same_bits(&weights(&one), &weights(&zero)));
    for dir in [data, one, two, zero] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// The pid of the process of MPI rank `rank` among `parent`'s children.
fn rank_pid(parent: u32, rank: usize) -> Option<u32> {
    let wanted = format!("OMPI_COMM_WORLD_RANK={rank}");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let ppid: u32 = stat
            .rsplit(')')
            .next()?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        let ours = environ.split(|&b| b == 0).any(|v| v == wanted.as_bytes());
        (ppid == parent && ours).then_some(pid)
    })
}

#[test]
fn a_killed_rank_stops_the_other_in_bounded_time_and_the_run_resumes_exactly() {
    let data = synthetic("kdata");
    let (whole, parts) = (temp("whole"), temp("parts"));
    let sets = [
        "train.epochs=4",
        "checkpoint.every_steps=4",
        "distributed.timeout_s=20",
    ];
    let uninterrupted = mpirun(2, &args(&data, &whole, &sets))
        .output()
        .expect("mpirun");
    assert!(uninterrupted.status.success(), "{}", stderr(&uninterrupted));

    let mut child = mpirun(2, &args(&data, &parts, &sets))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun");
    let mut log = String::new();
    let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
    for line in lines.by_ref() {
        let line = line.expect("log line");
        log.push_str(&line);
        log.push('\n');
        if line.contains("checkpoint") && line.contains("written") {
            break;
        }
    }
    let victim = rank_pid(child.id(), 1).unwrap_or_else(|| panic!("no rank 1 process: {log}"));
    let killed = Instant::now();
    assert!(Command::new("kill")
        .args(["-KILL", &victim.to_string()])
        .status()
        .expect("kill")
        .success());
    for line in lines {
        log.push_str(&line.unwrap_or_default());
        log.push('\n');
    }
    let status = child.wait().expect("wait");
    let took = killed.elapsed();
    assert!(!status.success(), "the run went on without rank 1: {log}");
    assert!(took < Duration::from_secs(60), "{took:?} to stop: {log}");
    assert!(
        log.contains("rank 1") || log.contains("rank [[") || log.contains("signal 9"),
        "{log}"
    );

    let resumed = mpirun(
        2,
        &[
            "train".into(),
            "--resume".into(),
            parts.display().to_string(),
            "--no-install".into(),
        ],
    )
    .output()
    .expect("mpirun");
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    assert!(
        same_bits(&weights(&whole), &weights(&parts)),
        "resumed to other weights"
    );
    for dir in [data, whole, parts] {
        let _ = std::fs::remove_dir_all(dir);
    }
}
