//! `cargo xtask memcheck`: every CUDA parity test (with `--all`, every CUDA
//! test), on the CPU emulator of the driver, under valgrind's memcheck. It finds what neither the host
//! compiler's warnings nor the emulator's own checks see: a kernel that reads
//! a local it never wrote. On a GPU that read gives whatever the register
//! held; in the emulator the local is stack memory that memcheck marks
//! undefined, and the first comparison with the CPU layer that depends on it
//! is reported, with the emulated library as its origin.
//!
//! A clean run proves something only if memcheck would have seen such a
//! read, so the positive control (`crates/cuda-emu/tests/memcheck_control.rs`,
//! a kernel that stores two locals it never wrote) runs first and must be
//! reported. Then each audited test runs in a process of its own, as many at
//! once as there are cores (valgrind runs one thread at a time), with a log
//! each in `target/memcheck`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::cargo::cargo_messages;

/// The test target of the control, which memcheck must fault
/// (headroom-cuda-emu).
const CONTROL: &str = "memcheck_control";
/// The test target whose every test must run clean: every kernel against
/// its CPU layer (headroom-model).
const PARITY: &str = "cuda_parity";
/// With `--all`, these too: the learner's steps and whole training runs on
/// the emulated device (the loop, the staging ring, OOM and resume paths).
const WITH_ALL: [&str; 2] = ["cuda_learner", "cuda_training"];
/// The parity tests that take longest under memcheck, longest first
/// (together most of the run): they start first. A name that no longer
/// matches only loses its place in the order.
const LONGEST_FIRST: [&str; 7] = [
    "implicit_gemm_convolution_matches_the_cpu_layer",
    "bf16_networks_match_the_cpu_network_within_bf16_rounding",
    "token_networks_match_the_cpu_network",
    "fused_residual_networks_compute_the_bits_of_unfused_ones",
    "auto_picks_the_convolution_algorithm_by_shape",
    "convolution_matches_the_cpu_layer_for_the_reference_shapes",
    "an_f32_network_matches_the_cpu_network",
];
/// valgrind's exit status when memcheck found an error.
const ERROR_EXIT: i32 = 99;
/// memcheck's origin of a value a kernel never wrote: a stack frame, at a
/// function of the emulator's library (the next line names it).
const STACK_ORIGIN: &str = "Uninitialised value was created by a stack allocation";
const EMULATOR_LIBRARY: &str = "libcuda.so";

/// What memcheck reports that is not headroom's: see the file.
const SUPPRESSIONS: &str = include_str!("memcheck.supp");

/// One test's run under memcheck.
struct Outcome {
    test: String,
    passed: bool,
    memcheck_errors: bool,
    log: PathBuf,
}

/// One test to run under memcheck.
struct Job<'a> {
    valgrind: Valgrind<'a>,
    target: &'a str,
    test: String,
}

pub fn run(filter: Option<&str>, all: bool) -> Result<()> {
    let version = Command::new("valgrind").arg("--version").output();
    let Ok(version) = version.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned()) else {
        bail!("valgrind is not on PATH; install it (Debian: apt-get install valgrind)");
    };
    let logs = PathBuf::from("target/memcheck");
    fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    let suppressions = logs.join("memcheck.supp");
    fs::write(&suppressions, SUPPRESSIONS)
        .with_context(|| format!("writing {}", suppressions.display()))?;
    let mut targets = vec![PARITY];
    if all {
        targets.extend(WITH_ALL);
    }
    let (control, audited) = test_binaries(&targets)?;
    println!("{version}: the positive control first");
    check_control(&Valgrind::new(&control, &suppressions), &logs)?;

    let mut jobs = Vec::new();
    for (target, binary) in targets.iter().zip(&audited) {
        for test in list_tests(binary)? {
            if filter.is_none_or(|filter| test.contains(filter)) {
                let valgrind = Valgrind::new(binary, &suppressions);
                jobs.push(Job {
                    valgrind,
                    target,
                    test,
                });
            }
        }
    }
    if jobs.is_empty() {
        bail!("no test of {} matches {filter:?}", targets.join(", "));
    }
    // The longest first, so that one of them does not start last and
    // leave the other cores idle while it runs.
    jobs.sort_by_key(|job| {
        LONGEST_FIRST
            .iter()
            .position(|slow| job.test.ends_with(slow))
            .unwrap_or(LONGEST_FIRST.len())
    });
    let started = Instant::now();
    let outcomes = run_all(&jobs, &logs);
    let bad: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| !o.passed || o.memcheck_errors)
        .collect();
    println!(
        "{} tests of {} under memcheck in {:.0} s: {} clean, {} not",
        outcomes.len(),
        targets.join(", "),
        started.elapsed().as_secs_f64(),
        outcomes.len() - bad.len(),
        bad.len()
    );
    for outcome in &bad {
        let what = match (outcome.passed, outcome.memcheck_errors) {
            (false, true) => "failed, with memcheck errors",
            (false, false) => "failed",
            _ => "memcheck errors",
        };
        println!("  {}: {what}; see {}", outcome.test, outcome.log.display());
    }
    if !bad.is_empty() {
        bail!(
            "{} of {} tests are not clean under memcheck",
            bad.len(),
            outcomes.len()
        );
    }
    Ok(())
}

/// Builds the control and the audited `targets` in the dev profile (line
/// tables, so memcheck's reports name lines) and returns their paths, the
/// audited in the order given. `--workspace` resolves features as `cargo
/// test --workspace` does, so the binaries it built are reused, not built
/// again in another variant.
fn test_binaries(targets: &[&str]) -> Result<(PathBuf, Vec<PathBuf>)> {
    let mut args = vec![
        "test",
        "--workspace",
        "--no-run",
        "--message-format=json-render-diagnostics",
        "--test",
        CONTROL,
    ];
    for target in targets {
        args.extend(["--test", target]);
    }
    let messages = cargo_messages(&args, "the memcheck tests")?;
    let executable = |target: &str| {
        messages
            .iter()
            .filter(|message| message["target"]["name"].as_str() == Some(target))
            .find_map(|message| message["executable"].as_str().map(PathBuf::from))
            .with_context(|| format!("cargo reported no executable for the test {target}"))
    };
    let audited = targets.iter().map(|target| executable(target));
    Ok((executable(CONTROL)?, audited.collect::<Result<_>>()?))
}

/// Runs the control under memcheck: it must pass as a test and be reported,
/// with its origin in the emulator.
fn check_control(valgrind: &Valgrind, logs: &Path) -> Result<()> {
    let outcome = valgrind.run(None, Origins::Tracked, &logs.join("control.log"))?;
    let log = fs::read_to_string(&outcome.log).unwrap_or_default();
    if !outcome.passed {
        bail!("the control test failed; see {}", outcome.log.display());
    }
    let mut lines = log.lines();
    let origin_in_emulator = lines.by_ref().any(|line| line.contains(STACK_ORIGIN))
        && lines
            .next()
            .is_some_and(|line| line.contains(EMULATOR_LIBRARY));
    if !outcome.memcheck_errors || !origin_in_emulator {
        bail!(
            "memcheck did not report the control kernel's read of locals it never wrote, \
             so a clean run would prove nothing; see {}",
            outcome.log.display()
        );
    }
    println!("the control's unwritten locals were reported; now the audited tests");
    Ok(())
}

/// The names of `binary`'s tests.
fn list_tests(binary: &Path) -> Result<Vec<String>> {
    let output = Command::new(binary)
        .args(["--list", "--format=terse"])
        .output()
        .with_context(|| format!("listing the tests of {}", binary.display()))?;
    if !output.status.success() {
        bail!("{} --list failed", binary.display());
    }
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.strip_suffix(": test"))
        .map(str::to_owned)
        .collect())
}

/// Runs every job in a memcheck process of its own, as many at once as the
/// machine has cores, and prints each as it ends.
fn run_all(jobs: &[Job], logs: &Path) -> Vec<Outcome> {
    let next = AtomicUsize::new(0);
    let outcomes = Mutex::new(Vec::new());
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::thread::scope(|scope| {
        for _ in 0..workers.min(jobs.len()) {
            scope.spawn(|| {
                while let Some(job) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let started = Instant::now();
                    let name = format!("{}::{}", job.target, job.test);
                    let log = logs.join(job.target).join(format!("{}.log", job.test));
                    let outcome = match audit(&job.valgrind, &job.test, &log) {
                        Ok(outcome) => Outcome {
                            test: name,
                            ..outcome
                        },
                        Err(error) => Outcome {
                            test: name,
                            passed: false,
                            memcheck_errors: false,
                            log: PathBuf::from(format!("(not run: {error:#})")),
                        },
                    };
                    println!(
                        "  {:<88} {:>5.0} s  {}",
                        outcome.test,
                        started.elapsed().as_secs_f64(),
                        verdict(&outcome)
                    );
                    outcomes
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(outcome);
                }
            });
        }
    });
    outcomes.into_inner().unwrap_or_else(|e| e.into_inner())
}

/// One audited test under memcheck, fast (no origins); where memcheck
/// reports errors, again with their origins, for the log.
fn audit(valgrind: &Valgrind, test: &str, log: &Path) -> Result<Outcome> {
    let outcome = valgrind.run(Some(test), Origins::Untracked, log)?;
    match outcome.memcheck_errors {
        true => valgrind.run(Some(test), Origins::Tracked, log),
        false => Ok(outcome),
    }
}

fn verdict(outcome: &Outcome) -> &'static str {
    match (outcome.passed, outcome.memcheck_errors) {
        (true, false) => "clean",
        (true, true) => "MEMCHECK ERRORS",
        (false, _) => "FAILED",
    }
}

/// Whether memcheck records where each undefined value came from: twice the
/// time, and the only way a report names the kernel's library.
#[derive(Clone, Copy)]
enum Origins {
    Untracked,
    Tracked,
}

/// memcheck on one test binary, with headroom's suppressions.
#[derive(Clone, Copy)]
struct Valgrind<'a> {
    binary: &'a Path,
    suppressions: &'a Path,
}

impl<'a> Valgrind<'a> {
    fn new(binary: &'a Path, suppressions: &'a Path) -> Self {
        Self {
            binary,
            suppressions,
        }
    }

    /// Runs the binary (only `test`, where given) under memcheck, its
    /// output in `log`. The emulator must be there: HEADROOM_REQUIRE_NVRTC
    /// turns a skip into a failure.
    fn run(&self, test: Option<&str>, origins: Origins, log: &Path) -> Result<Outcome> {
        if let Some(dir) = log.parent() {
            fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let file = fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let mut cmd = Command::new("valgrind");
        cmd.args([
            "--tool=memcheck",
            "--num-callers=40",
            &format!("--error-exitcode={ERROR_EXIT}"),
        ])
        .arg(format!("--suppressions={}", self.suppressions.display()))
        .arg(match origins {
            Origins::Untracked => "--track-origins=no",
            Origins::Tracked => "--track-origins=yes",
        })
        .arg(self.binary)
        .args(["--test-threads=1", "--nocapture"]);
        if let Some(test) = test {
            cmd.args(["--exact", test]);
        }
        let status = cmd
            .env("HEADROOM_REQUIRE_NVRTC", "1")
            .stdout(file.try_clone()?)
            .stderr(file)
            .status()
            .with_context(|| format!("running valgrind on {}", self.binary.display()))?;
        let text = fs::read_to_string(log).unwrap_or_default();
        let memcheck_errors =
            status.code() == Some(ERROR_EXIT) || !text.contains("ERROR SUMMARY: 0 errors");
        // One test runs in each process; the control's binary has one test.
        let passed = text.contains("test result: ok. 1 passed;");
        Ok(Outcome {
            test: test.unwrap_or("control").to_owned(),
            passed,
            memcheck_errors,
            log: log.to_owned(),
        })
    }
}
