//! Issue 14, "trust": resume never trains the wrong thing, no progress is
//! lost to a signal, real memory limits meet the OOM policy instead of an
//! abort, absurd sizes and bad data are named before any training.

mod common;

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;
use headroom_pipeline::checkpoint;
use headroom_tests::gzip_to;

// The last test binary of `cargo test --workspace`: it ends with the count
// of tests that did not run for want of NVRTC, if any.
headroom_tests::report_nvrtc_workspace_at_exit!(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));

fn args(list: &[String]) -> Vec<&str> {
    list.iter().map(String::as_str).collect()
}

fn with_sets(mut list: Vec<String>, pairs: &[&str]) -> Vec<String> {
    for pair in pairs {
        list.extend(["--set".into(), (*pair).into()]);
    }
    list
}

fn synthetic_data(train: usize, test: usize) -> tempfile::TempDir {
    let data = tempfile::tempdir().unwrap();
    write_synthetic_fashion_mnist(data.path(), train, test);
    data
}

fn spawn(list: &[String]) -> Child {
    xtask(&args(list))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn wait_for_checkpoint(dir: &Path, child: &mut Child) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while checkpoint::list(dir).unwrap_or_default().is_empty() {
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

fn kill(child: &Child, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr(output),
    )
}

/// The command the run printed after "continue with: ", as arguments.
fn continue_command(stdout: &str) -> Vec<String> {
    let line = stdout
        .lines()
        .find_map(|l| l.split_once("continue with: cargo xtask ").map(|(_, c)| c))
        .unwrap_or_else(|| panic!("no continue command in {stdout}"));
    line.split_whitespace().map(String::from).collect()
}

/// Every metrics line parses, and no (epoch, batch) step appears twice.
fn assert_metrics_clean(dir: &Path) {
    let metrics = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let mut positions = Vec::new();
    for line in metrics.lines() {
        let value: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("torn line {line:?}: {e}"));
        if value["kind"] == "step" {
            positions.push((
                value["data"]["epoch"].as_u64(),
                value["data"]["batch"].as_u64(),
            ));
        }
    }
    let count = positions.len();
    positions.sort();
    positions.dedup();
    assert_eq!(positions.len(), count, "duplicated steps in metrics.jsonl");
}

#[test]
fn the_printed_continue_command_resumes_exactly_the_stopped_run() {
    let data = synthetic_data(1024, 128);
    let runs = tempfile::tempdir().unwrap();
    // A finished run of the same experiment, newer-looking, must not be picked.
    let base = with_sets(
        smoke_args(data.path(), &runs.path().join("stopped")),
        &[
            "train.epochs=30",
            "checkpoint.every_steps=5",
            "train.threads=1",
        ],
    );
    let mut child = spawn(&base);
    let run_dir = runs.path().join("stopped");
    wait_for_checkpoint(&run_dir, &mut child);
    let config_before = std::fs::read(run_dir.join("config.toml")).unwrap();
    kill(&child, "-TERM");
    let stopped = child.wait_with_output().unwrap();
    let (stdout, err) = text(&stopped);
    assert_eq!(stopped.status.code(), Some(143), "SIGTERM exits 143: {err}");
    let command = continue_command(&stdout);
    assert_eq!(
        command,
        ["train", "--resume", &run_dir.display().to_string()]
    );

    let finished = with_sets(
        smoke_args(data.path(), &runs.path().join("finished")),
        &["train.epochs=1"],
    );
    assert!(run(&args(&finished)).status.success());

    let resumed = run(&args(&command));
    let (_, err) = text(&resumed);
    assert!(resumed.status.success(), "{err}");
    assert!(
        err.contains(&format!("resuming from {}", run_dir.display())),
        "{err}"
    );
    assert!(
        err.contains("epoch 30/30 done"),
        "the run's own 30 epochs: {err}"
    );
    assert_eq!(
        std::fs::read(run_dir.join("config.toml")).unwrap(),
        config_before
    );
    assert_metrics_clean(&run_dir);
}

#[test]
fn resume_refuses_another_seed_or_other_data_and_allows_the_advised_lr() {
    let data = synthetic_data(512, 64);
    let runs = tempfile::tempdir().unwrap();
    let run_dir = runs.path().join("run");
    let first = with_sets(smoke_args(data.path(), &run_dir), &["train.epochs=1"]);
    assert!(run(&args(&first)).status.success());
    let config_before = std::fs::read(run_dir.join("config.toml")).unwrap();
    let resume = |sets: &[&str]| {
        let list = with_sets(
            vec![
                "train".into(),
                "--resume".into(),
                run_dir.display().to_string(),
            ],
            sets,
        );
        run(&args(&list))
    };

    let seed = resume(&["run.seed=7"]);
    assert!(!seed.status.success());
    assert!(
        stderr(&seed).contains("run.seed was 0, now 7"),
        "{}",
        stderr(&seed)
    );

    let other = synthetic_data(512, 80);
    let moved = resume(&[&format!("data.dir={}", other.path().display())]);
    assert!(!moved.status.success());
    assert!(stderr(&moved).contains("data.dir"), "{}", stderr(&moved));
    assert!(stderr(&moved).contains("differs from the data this run started with"));
    assert_eq!(
        std::fs::read(run_dir.join("config.toml")).unwrap(),
        config_before
    );

    let advised = resume(&[
        "optimizer.lr=0.001",
        "train.clip_norm=0.5",
        "train.epochs=2",
    ]);
    let err = stderr(&advised);
    assert!(advised.status.success(), "{err}");
    assert!(err.contains("optimizer.lr changed on resume"), "{err}");
    assert!(err.contains("train.clip_norm changed on resume"), "{err}");
    assert!(err.contains("epoch 2/2 done"), "{err}");
    assert_metrics_clean(&run_dir);
}

#[test]
fn a_second_sigterm_within_the_grace_period_still_writes_the_checkpoint() {
    let data = synthetic_data(2048, 128);
    let out = tempfile::tempdir().unwrap();
    let run_dir = out.path().join("run");
    let list = with_sets(
        smoke_args(data.path(), &run_dir),
        &[
            "train.epochs=30",
            "checkpoint.every_steps=5",
            "train.threads=1",
        ],
    );
    let mut child = spawn(&list);
    wait_for_checkpoint(&run_dir, &mut child);
    kill(&child, "-TERM");
    // Close enough to be "a moment", apart enough not to be merged into one
    // delivery (a merged pair is one request, which is fine too).
    std::thread::sleep(Duration::from_millis(5));
    kill(&child, "-TERM");
    let output = child.wait_with_output().unwrap();
    let (stdout, err) = text(&output);
    assert_eq!(output.status.code(), Some(143), "{err}");
    assert!(stdout.contains("continue with"), "{stdout}");
    let after_signal = &err[err.find("stopping after this step").unwrap()..];
    assert!(
        after_signal.contains(" written in "),
        "no stop checkpoint: {err}"
    );
}

#[test]
fn a_run_under_an_address_space_limit_adapts_and_never_aborts() {
    let data = synthetic_data(256, 64);
    let out = tempfile::tempdir().unwrap();
    let list = with_sets(
        vec![
            "train".into(),
            "--no-install".into(),
            "--set".into(),
            format!("data.dir={}", data.path().display()),
            "--set".into(),
            format!("run.output_dir={}", out.path().join("run").display()),
        ],
        &["train.epochs=1", "run.profile=none", "data.test_samples=64"],
    );
    let output = under_address_space_limit(&list, 200_000_000);
    let (stdout, err) = text(&output);
    assert_eq!(
        output.status.signal(),
        None,
        "killed by a signal (abort): {err}"
    );
    assert!(
        err.contains("under RLIMIT_AS"),
        "the budget comes from the rlimit: {err}"
    );
    // Adapting means finishing: a stop, even a clean one that names its
    // checkpoint, is the outcome this test exists to rule out.
    assert!(
        output.status.success(),
        "the run stopped instead of adapting to the limit ({}):\n{stdout}\n{err}",
        output.status
    );
    assert!(stdout.contains("test accuracy"), "{stdout}");
    let saved = checkpoint::list(&out.path().join("run")).unwrap();
    let last = checkpoint::load(saved.last().expect("a checkpoint of the finished run")).unwrap();
    assert_eq!(
        last.meta.step, 4,
        "the one epoch trained to its end: 256 samples in batches of 64"
    );
}

/// The output of xtask run with `list` under `RLIMIT_AS` = `bytes`.
fn under_address_space_limit(list: &[String], bytes: u64) -> Output {
    let mut command = xtask(&args(list));
    // SAFETY: setrlimit is async-signal-safe and touches only this child.
    unsafe {
        command.pre_exec(move || {
            let limit = libc::rlimit {
                rlim_cur: bytes,
                rlim_max: bytes,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    command.output().unwrap()
}

/// trust-3 class 4: a block the operating system refuses under a budget
/// far above the process's real limit is reported as the system's refusal,
/// never as over the budget, and the stop's advice is not to raise the
/// budget. The smoke model at a batch of 4096 asks for more than 400 MB of
/// address space holds, while `device.memory_limit` says 20 GiB.
#[test]
fn a_block_the_system_refuses_is_reported_and_advised_as_the_systems() {
    let data = synthetic_data(8192, 256);
    let out = tempfile::tempdir().unwrap();
    let run = |policy: &str, name: &str| {
        let list = with_sets(
            vec![
                "train".into(),
                "--no-install".into(),
                "--config".into(),
                repo_root()
                    .join("experiments/smoke.toml")
                    .display()
                    .to_string(),
                "--set".into(),
                format!("data.dir={}", data.path().display()),
                "--set".into(),
                format!("run.output_dir={}", out.path().join(name).display()),
            ],
            &[
                "train.epochs=1",
                "run.profile=none",
                "train.batch_size=4096",
                "data.train_samples=8192",
                "data.test_samples=256",
                "device.memory_limit=20GiB",
                // Few batches held outside the tensor pool: what no policy
                // sees must not be what the limit refuses first.
                "data.prefetch=1",
                "data.workers=1",
                &format!("memory.oom_policy={policy}"),
            ],
        );
        let output = under_address_space_limit(&list, 400_000_000);
        let (_, err) = text(&output);
        assert_eq!(output.status.signal(), None, "killed by a signal: {err}");
        assert!(
            err.contains("refused by the system, not by the budget"),
            "the refusal is the system's: {err}"
        );
        assert!(
            !err.contains("over the 20.00 GiB budget"),
            "called the budget's: {err}"
        );
        (output, err)
    };
    // Adapting: the cache released, then the batch split until it fits.
    let (adapted, err) = run("adapt", "adapt");
    assert!(adapted.status.success(), "{err}");
    assert!(err.contains("splitting the batch of 4096"), "{err}");
    // Stopping: a checkpoint, and advice that does not send the user to a
    // budget that was never the limit.
    let (stopped, err) = run("stop", "stop");
    assert!(!stopped.status.success(), "{err}");
    assert!(
        err.contains("raising device.memory_limit would not help"),
        "{err}"
    );
    assert!(!err.contains("; raise device.memory_limit"), "{err}");
    assert!(
        !checkpoint::list(&out.path().join("stop"))
            .unwrap()
            .is_empty(),
        "the stop wrote no checkpoint: {err}"
    );
}

/// The smoke experiment with `model.layers` replaced, written to `dir`.
fn experiment_with_layers(dir: &Path, name: &str, layers: &str) -> PathBuf {
    let smoke = std::fs::read_to_string(repo_root().join("experiments/smoke.toml")).unwrap();
    let start = smoke.find("layers = [").unwrap();
    let end = start + smoke[start..].find("\n]").unwrap() + 2;
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(
        &path,
        format!("{}layers = {layers}{}", &smoke[..start], &smoke[end..]),
    )
    .unwrap();
    path
}

#[test]
fn absurd_sizes_fail_fast_naming_the_key() {
    let data = synthetic_data(64, 16);
    let out = tempfile::tempdir().unwrap();
    let run_dir = out.path().join("run");
    let base = smoke_args(data.path(), &run_dir);
    // 10^8 channels: the linear layer after them is the largest (10^9 weights).
    let huge_conv =
        "[{type=\"conv\",out=100000000},{type=\"global_avg_pool\"},{type=\"linear\",out=10}]";
    let wide_padding =
        "[{type=\"conv\",out=8,padding=100000},{type=\"global_avg_pool\"},{type=\"linear\",out=10}]";
    let cases = [
        (base.clone(), "train.threads=100000", "train.threads"),
        (base.clone(), "run.name=../../escaped", "run.name"),
        (
            with_config(
                &base,
                &experiment_with_layers(out.path(), "huge", huge_conv),
            ),
            "run.profile=none",
            "model.layers[2]",
        ),
        (
            with_config(
                &base,
                &experiment_with_layers(out.path(), "padded", wide_padding),
            ),
            "run.profile=none",
            "model.layers[0].padding",
        ),
    ];
    for (list, set, key) in cases {
        let started = Instant::now();
        let output = run(&args(&with_sets(list, &[set])));
        let err = stderr(&output);
        assert!(!output.status.success(), "{set} {key} accepted");
        assert!(err.contains(&format!("`{key}`")), "{key}: {err}");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{key} took {:?}",
            started.elapsed()
        );
    }
    assert!(!run_dir.exists(), "a refused start made its directory");
}

fn with_config(list: &[String], config: &Path) -> Vec<String> {
    let mut list = list.to_vec();
    let at = list
        .iter()
        .position(|a| a == "experiments/smoke.toml")
        .unwrap();
    list[at] = config.display().to_string();
    list
}

#[test]
fn a_bad_test_label_is_named_before_the_first_epoch() {
    let data = synthetic_data(256, 32);
    let mut labels = vec![0, 0, 8, 1];
    labels.extend_from_slice(&32u32.to_be_bytes());
    labels.extend((0..32u8).map(|i| if i == 17 { 200 } else { i % 10 }));
    gzip_to(&data.path().join("t10k-labels-idx1-ubyte.gz"), &labels);
    let runs = tempfile::tempdir().unwrap();
    let list = with_sets(
        smoke_args(data.path(), &runs.path().join("run")),
        &["train.epochs=1"],
    );
    let output = run(&args(&list));
    let err = stderr(&output);
    assert!(!output.status.success());
    assert!(err.contains("t10k-labels-idx1-ubyte"), "{err}");
    assert!(err.contains("sample 17 has label 200"), "{err}");
    assert!(
        !err.contains("epoch 1/1"),
        "found only after training: {err}"
    );
    assert!(!err.contains("model.layers"), "blames the model: {err}");
    assert!(
        !runs.path().join("run").exists(),
        "a failed start left its directory"
    );
}

#[test]
fn a_full_disk_names_the_file_and_the_cause() {
    let data = synthetic_data(256, 32);
    let out = tempfile::tempdir().unwrap();
    let run_dir = out.path().join("run");
    std::fs::create_dir(&run_dir).unwrap();
    std::os::unix::fs::symlink("/dev/full", run_dir.join("metrics.jsonl")).unwrap();
    let list = with_sets(smoke_args(data.path(), &run_dir), &["train.epochs=1"]);
    let output = run(&args(&list));
    let err = stderr(&output);
    assert!(!output.status.success());
    assert!(err.contains("No space left on device"), "{err}");
    assert!(err.contains("metrics.jsonl"), "{err}");
}

#[test]
fn a_failed_start_leaves_no_run_directory() {
    let runs = tempfile::tempdir().unwrap();
    let list = vec![
        "train".into(),
        "--config".into(),
        "experiments/smoke.toml".into(),
        "--no-install".into(),
        "--set".into(),
        format!("data.dir={}", runs.path().join("no-data").display()),
        "--set".into(),
        format!("run.runs_dir={}", runs.path().join("runs").display()),
    ];
    let output = run(&args(&list));
    assert!(!output.status.success());
    let left: Vec<PathBuf> = std::fs::read_dir(runs.path().join("runs"))
        .map(|entries| entries.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// A finished smoke run of `epochs` on synthetic data: the data and output
/// directories (kept alive by the caller) and the run directory.
fn trained_smoke_run(epochs: u64) -> (tempfile::TempDir, tempfile::TempDir, PathBuf) {
    let data = synthetic_data(256, 32);
    let out = tempfile::tempdir().unwrap();
    let run_dir = out.path().join("run");
    let epochs = format!("train.epochs={epochs}");
    let list = with_sets(smoke_args(data.path(), &run_dir), &[&epochs]);
    assert!(run(&args(&list)).status.success());
    (data, out, run_dir)
}

#[test]
fn export_writes_safetensors_with_the_model_names_and_layouts() {
    let (_data, out, run_dir) = trained_smoke_run(1);
    let ckpt = checkpoint::list(&run_dir).unwrap().pop().unwrap();
    let file = out.path().join("weights.safetensors");
    let ckpt_arg = ckpt.display().to_string();
    let file_arg = file.display().to_string();
    let exported = run(&[
        "export",
        "--checkpoint",
        &ckpt_arg,
        "--format",
        "safetensors",
        "--output",
        &file_arg,
    ]);
    assert!(exported.status.success(), "{}", stderr(&exported));

    let bytes = std::fs::read(&file).unwrap();
    let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let layout = metadata.metadata().as_ref().unwrap()["layout"].clone();
    assert!(
        layout.contains("HWIO") && layout.contains("NHWC"),
        "{layout}"
    );
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let saved = checkpoint::load(&ckpt).unwrap();
    assert_eq!(tensors.len(), saved.params.len() + saved.buffers.len());
    let (name, first) = tensors
        .tensors()
        .into_iter()
        .find(|(name, _)| {
            name.ends_with(".weight") && tensors.tensor(name).unwrap().shape().len() == 4
        })
        .expect("a convolution weight");
    assert_eq!(first.shape()[..2], [3, 3], "{name}: HWIO, kernel first");
    assert!(tensors.names().iter().any(|n| n.ends_with(".running_mean")));
}

/// `xtask` with the umask set, for the permissions of what it writes.
fn run_with_umask(list: &[&str], mask: libc::mode_t) -> Output {
    let mut command = xtask(list);
    // SAFETY: umask is async-signal-safe and touches only this child.
    unsafe {
        command.pre_exec(move || {
            libc::umask(mask);
            Ok(())
        });
    }
    command.output().unwrap()
}

#[test]
fn eval_and_export_take_a_run_directory_and_name_what_they_cannot_use() {
    use std::os::unix::fs::PermissionsExt;
    let (_data, out, run_dir) = trained_smoke_run(2);
    let newest = checkpoint::list(&run_dir).unwrap().pop().unwrap();
    let (dir_arg, newest_arg) = (run_dir.display().to_string(), newest.display().to_string());

    // A run directory is its newest checkpoint, for eval as for export.
    let by_file = run(&["eval", "--checkpoint", &newest_arg]);
    let by_dir = run(&["eval", "--checkpoint", &dir_arg]);
    assert!(by_dir.status.success(), "{}", stderr(&by_dir));
    assert_eq!(text(&by_dir).0, text(&by_file).0);
    assert!(text(&by_dir).0.contains(&newest_arg), "{}", text(&by_dir).0);
    let explicit = out.path().join("explicit.safetensors");
    let explicit_arg = explicit.display().to_string();
    let exported = run(&[
        "export",
        "--checkpoint",
        &newest_arg,
        "--output",
        &explicit_arg,
    ]);
    assert!(exported.status.success(), "{}", stderr(&exported));
    let exported = run_with_umask(&["export", "--checkpoint", &dir_arg], 0o022);
    assert!(exported.status.success(), "{}", stderr(&exported));
    // The same bytes each time: the header is in name order.
    let beside = newest.with_extension("safetensors");
    assert_eq!(
        std::fs::read(&beside).unwrap(),
        std::fs::read(&explicit).unwrap()
    );
    // Readable by others, as any file made under umask 022 (the
    // safetensors crate's writer made it 0600).
    let mode = std::fs::metadata(&beside).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o644, "{mode:o}");

    // A corrupt newer checkpoint is named and passed over.
    let corrupt = run_dir.join("checkpoint-step9999999999.ckpt");
    std::fs::write(&corrupt, b"not a checkpoint").unwrap();
    let past_corrupt = run(&["eval", "--checkpoint", &dir_arg]);
    assert!(past_corrupt.status.success(), "{}", stderr(&past_corrupt));
    assert_eq!(text(&past_corrupt).0, text(&by_file).0);
    assert!(
        stderr(&past_corrupt).contains("skipped checkpoint"),
        "{}",
        stderr(&past_corrupt)
    );
    assert!(stderr(&past_corrupt).contains(&corrupt.display().to_string()));

    // What cannot be used is named, and nothing is written.
    let empty = out.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let missing_dir = out.path().join("no/such/dir/w.safetensors");
    let refusals = [
        (
            vec!["eval", "--checkpoint", "/no/such/run"],
            "no such checkpoint file or run directory",
        ),
        (
            vec!["export", "--checkpoint", empty.to_str().unwrap()],
            "a directory with no checkpoint-*.ckpt",
        ),
        (
            vec![
                "export",
                "--checkpoint",
                &dir_arg,
                "--output",
                missing_dir.to_str().unwrap(),
            ],
            "does not exist",
        ),
        (
            vec![
                "export",
                "--checkpoint",
                &dir_arg,
                "--output",
                empty.to_str().unwrap(),
            ],
            "is a directory",
        ),
    ];
    for (list, reason) in refusals {
        let refused = run(&list);
        assert!(!refused.status.success(), "{list:?}");
        assert!(
            stderr(&refused).contains(reason),
            "{list:?}: {}",
            stderr(&refused)
        );
    }
    assert!(!out.path().join("no").exists());
    assert_eq!(std::fs::read_dir(&empty).unwrap().count(), 0);
}

#[test]
fn doctor_shows_the_limit_it_found_and_where_from() {
    let mut command = xtask(&["doctor"]);
    // SAFETY: setrlimit is async-signal-safe and touches only this child.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 1 << 30,
                rlim_max: 1 << 30,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let output = command.output().unwrap();
    let (stdout, err) = text(&output);
    assert!(output.status.success(), "{err}");
    assert!(stdout.contains("of 1.0 GiB under RLIMIT_AS"), "{stdout}");
    assert!(stdout.contains("budget"), "{stdout}");
}
