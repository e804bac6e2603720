//! Issue trust-3: a resumed run's recorded settings are its real settings.
//! Overrides a resume accepts are recorded in the run's `config.toml`, so
//! the printed continue command goes on with them; `--resume D` with a
//! `run.output_dir` elsewhere is refused; printed commands paste into a
//! shell whatever the path holds. (The newest run by creation, not by
//! name, is `rundir.rs`'s unit tests; quoting itself is `shell.rs`'s.)

mod common;

use std::path::Path;
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;
use headroom_pipeline::{checkpoint, ExperimentConfig, Overrides};

fn args(list: &[String]) -> Vec<&str> {
    list.iter().map(String::as_str).collect()
}

fn with_sets(mut list: Vec<String>, pairs: &[&str]) -> Vec<String> {
    for pair in pairs {
        list.extend(["--set".into(), (*pair).into()]);
    }
    list
}

fn resume_args(dir: &Path, pairs: &[&str]) -> Vec<String> {
    with_sets(
        vec!["train".into(), "--resume".into(), dir.display().to_string()],
        pairs,
    )
}

fn synthetic_data(train: usize, test: usize) -> tempfile::TempDir {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), train, test);
    data
}

fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr(output),
    )
}

/// A finished one-epoch smoke run in `dir`.
fn one_epoch_run(data: &Path, dir: &Path) {
    let first = with_sets(
        smoke_args(data, dir),
        &["train.epochs=1", "train.threads=1"],
    );
    let output = run(&args(&first));
    assert!(output.status.success(), "{}", stderr(&output));
}

/// The run's recorded settings, as `--resume` reads them.
fn recorded(dir: &Path) -> ExperimentConfig {
    ExperimentConfig::load_resolved(&dir.join("config.toml"), &Overrides::default()).unwrap()
}

fn newest_step(dir: &Path) -> u64 {
    checkpoint::newest_valid(dir)
        .unwrap()
        .0
        .map_or(0, |(_, saved)| saved.meta.step)
}

fn kill_term(child: &Child) {
    let status = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// Runs `line` (a printed command, after `cargo xtask `) in `sh`, with the
/// xtask binary in the place of `cargo xtask`, as a user pasting it would.
fn run_in_shell(line: &str) -> Output {
    std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("exec \"$0\" {line}"))
        .arg(env!("CARGO_BIN_EXE_xtask"))
        .current_dir(repo_root())
        .env_remove("FASHION_MNIST_DIR")
        .output()
        .unwrap()
}

#[test]
fn overrides_accepted_on_resume_are_what_the_next_resume_continues_with() {
    let data = synthetic_data(256, 64);
    let runs = tempfile::tempdir().unwrap();
    let dir = runs.path().join("run");
    one_epoch_run(data.path(), &dir);

    let changed = resume_args(
        &dir,
        &[
            "optimizer.lr=0.001",
            "train.clip_norm=0.5",
            "train.epochs=2",
        ],
    );
    let output = run(&args(&changed));
    let (_, err) = text(&output);
    assert!(output.status.success(), "{err}");
    assert!(err.contains("optimizer.lr changed on resume"), "{err}");
    let settings = recorded(&dir);
    assert_eq!(settings.optimizer.lr, 0.001);
    assert_eq!(settings.train.clip_norm, 0.5);
    assert_eq!(settings.train.epochs, 2);
    assert!(!dir.join(".config.toml.tmp").exists());

    // The plain resume goes on with the settings it was last given: none
    // "changes" back to the first run's.
    let plain = run(&args(&resume_args(&dir, &[])));
    let (_, err) = text(&plain);
    assert!(plain.status.success(), "{err}");
    assert!(!err.contains("changed on resume"), "{err}");
    assert!(!err.contains("train.epochs changed"), "{err}");
}

#[test]
fn the_printed_command_pastes_and_continues_with_the_resumes_settings() {
    let data = synthetic_data(256, 64);
    let runs = tempfile::tempdir().unwrap();
    // Everything a shell would otherwise take apart or expand.
    let dir = runs.path().join("it's a $HOME `run` ü *");
    one_epoch_run(data.path(), &dir);
    let first_step = newest_step(&dir);

    let changed = resume_args(
        &dir,
        &[
            "optimizer.lr=0.001",
            "train.epochs=20",
            "checkpoint.every_steps=2",
        ],
    );
    let mut child: Child = xtask(&args(&changed))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while newest_step(&dir) <= first_step {
        assert!(
            Instant::now() < deadline,
            "no new checkpoint in two minutes"
        );
        if let Ok(Some(status)) = child.try_wait() {
            panic!("training ended early: {status}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    kill_term(&child);
    let stopped = child.wait_with_output().unwrap();
    let (stdout, err) = text(&stopped);
    assert_eq!(stopped.status.code(), Some(143), "SIGTERM exits 143: {err}");
    let line = stdout
        .lines()
        .find_map(|l| l.split_once("continue with: cargo xtask ").map(|(_, c)| c))
        .unwrap_or_else(|| panic!("no continue command in {stdout}"));

    let resumed = run_in_shell(line);
    let (_, err) = text(&resumed);
    assert!(resumed.status.success(), "`{line}`: {err}");
    assert_eq!(recorded(&dir).train.epochs, 20);
    assert_eq!(recorded(&dir).optimizer.lr, 0.001);
    assert!(
        err.contains(&format!("resuming from {}", dir.display())),
        "{err}"
    );
    assert!(!err.contains("changed on resume"), "{err}");
    assert!(err.contains("epoch 20/20 done"), "{err}");
}

#[test]
fn resume_into_another_output_dir_is_refused_and_a_copy_can_go_on_there() {
    let data = synthetic_data(256, 64);
    let runs = tempfile::tempdir().unwrap();
    let dir = runs.path().join("run");
    one_epoch_run(data.path(), &dir);
    let config_before = std::fs::read(dir.join("config.toml")).unwrap();
    let checkpoints_before = checkpoint::list(&dir).unwrap();
    let new = runs.path().join("new");

    let refused_set = run(&args(&resume_args(
        &dir,
        &[&format!("run.output_dir={}", new.display())],
    )));
    let by_env = xtask(&args(&resume_args(&dir, &[])))
        .env("HEADROOM__RUN__OUTPUT_DIR", &new)
        .output()
        .unwrap();
    let experiment = smoke_args(data.path(), &new);
    let mut with_config: Vec<String> = experiment.clone();
    with_config.extend(["--resume".into(), dir.display().to_string()]);
    let by_config_file = run(&args(&with_config));
    for refused in [&refused_set, &by_env, &by_config_file] {
        let err = stderr(refused);
        assert!(!refused.status.success(), "{err}");
        assert!(err.contains("run.output_dir"), "{err}");
        assert!(err.contains("cp -r"), "{err}");
    }
    assert!(!new.exists(), "{} was made", new.display());
    assert_eq!(
        std::fs::read(dir.join("config.toml")).unwrap(),
        config_before
    );
    assert_eq!(checkpoint::list(&dir).unwrap(), checkpoints_before);

    // Naming the run's own directory is no change.
    let same = run(&args(&resume_args(
        &dir,
        &[&format!("run.output_dir={}", dir.display())],
    )));
    assert!(same.status.success(), "{}", stderr(&same));

    // The advice: a copy resumes in its own place, the original untouched.
    let copied = std::process::Command::new("cp")
        .arg("-r")
        .args([&dir, &new])
        .status()
        .unwrap();
    assert!(copied.success());
    let config_before = std::fs::read(dir.join("config.toml")).unwrap();
    let fork = run(&args(&resume_args(&new, &["train.epochs=2"])));
    assert!(fork.status.success(), "{}", stderr(&fork));
    assert_eq!(recorded(&new).run.output_dir, Some(new.clone()));
    assert_eq!(recorded(&new).train.epochs, 2);
    assert_eq!(
        std::fs::read(dir.join("config.toml")).unwrap(),
        config_before
    );
    assert_eq!(checkpoint::list(&dir).unwrap(), checkpoints_before);
    assert!(
        newest_step(&new) > newest_step(&dir),
        "the copy did not go on"
    );
}
