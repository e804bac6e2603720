//! `cargo lab gpu-bundle`: everything a GPU machine without a Rust
//! toolchain needs to prove and time the CUDA path, built here: the
//! stripped release `xtask` and CUDA test binaries (gzipped), the
//! experiments, the PyTorch scripts (bench/torch/), optionally the four Fashion-MNIST files, and
//! `run.sh`, which runs the CUDA tests with skipping turned into failure,
//! trains the default experiment on the GPU, checks the OOM policy and
//! bit-exact resume there, runs `bench --device cuda --compare-torch`, and
//! more, most needed first, within one call of the device tool; after each
//! step it writes `report.json`, `summary.txt` and `logs.tar.gz` into `$OUT`
//! (or `./out`), which the device tool brings back.
//!
//! `--dry-run` then runs that script here, on the CPU emulator of the driver
//! and cuBLAS (`crates/cuda-emu`, preloaded so that the bundle's own release
//! binary loads it in place of `libcuda.so`), with every job shrunk to the
//! smoke model and a few hundred samples, its convolutions through im2col
//! unless a step names another algorithm: a GPU session's minutes are not
//! spent finding a broken step, a wrong path or a report that does not parse.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::cargo::cargo_messages;
use flate2::{write::GzEncoder, Compression};

/// The bundle without the dataset must stay under this: the device tool
/// carries 64 MiB in all, the repository's files included (about 8 MiB
/// with the language-model fixtures and the measurement records), and
/// Fashion-MNIST's four files are about 30 MB (28.6 MiB): 26 MiB leaves
/// about 1 MiB to spare, so a bundle that grows past it needs slimming
/// (its largest parts are the gzipped test binaries, stripped of their
/// symbols too: a failing test's message and panic location need none;
/// xtask keeps its symbols, for readable backtraces of a run).
pub const MAX_BUNDLE_BYTES: u64 = 26 << 20;

/// (package, test target) of every test binary that checks the CUDA path.
const CUDA_TESTS: [(&str, &str); 8] = [
    ("headroom-model", "cuda_ptx"),
    ("headroom-model", "cuda_custom_layer"),
    ("headroom-model", "cuda_probe"),
    ("headroom-model", "cuda_parity"),
    ("headroom-pipeline", "cuda_learner"),
    ("headroom-pipeline", "cuda_rgb"),
    ("headroom-tests", "cuda_training"),
    ("headroom-tests", "memory_release"),
];

const FASHION_MNIST_FILES: [&str; 4] = [
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
];

pub struct BundleArgs {
    pub output: PathBuf,
    /// Fashion-MNIST's directory, to copy its four files into `data/`.
    pub data: Option<PathBuf>,
    /// An earlier build, to carry as bin/baseline-xtask.gz.
    pub baseline: Option<Baseline>,
}

/// Where the A of an A/B comes from.
pub enum Baseline {
    /// An earlier bundle's bin/xtask.gz.
    Packed(PathBuf),
    /// A git revision of this repository, built here in a worktree of its
    /// own (target/baseline-src, its build in target/baseline-target).
    Revision(String),
}

pub fn build(args: &BundleArgs) -> Result<()> {
    let out = &args.output;
    if out.exists() {
        fs::remove_dir_all(out).with_context(|| format!("removing the old {}", out.display()))?;
    }
    fs::create_dir_all(out.join("bin/tests"))
        .with_context(|| format!("creating {}", out.display()))?;
    pack_program(&xtask_binary()?, &out.join("bin/xtask"), Strip::Debug)?;
    for test in test_binaries()? {
        let name = test
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.rsplit_once('-').map(|(stem, _)| stem.to_string()))
            .with_context(|| format!("an unexpected test binary name {}", test.display()))?;
        pack_program(&test, &out.join("bin/tests").join(name), Strip::All)?;
    }
    copy_dir(Path::new("experiments"), &out.join("experiments"))?;
    // Where the repository has them: `xtask bench --compare-torch` runs
    // bench/torch/torch_step.py from the bundle's root, as from the repository's.
    fs::create_dir_all(out.join("bench/torch"))?;
    for script in ["torch_models.py", "torch_step.py", "torch_fashion_mnist.py"] {
        let from = Path::new("bench/torch").join(script);
        fs::copy(&from, out.join("bench/torch").join(script))
            .with_context(|| format!("copying {}", from.display()))?;
    }
    write_executable(&out.join("run.sh"), RUN_SH)?;
    match &args.baseline {
        Some(Baseline::Packed(packed)) => {
            fs::copy(packed, out.join("bin/baseline-xtask.gz"))
                .with_context(|| format!("copying the baseline {}", packed.display()))?;
        }
        Some(Baseline::Revision(rev)) => build_baseline(rev, &out.join("bin/baseline-xtask"))?,
        None => {}
    }
    let size = dir_bytes(out)?;
    if size > MAX_BUNDLE_BYTES {
        bail!(
            "the bundle is {:.1} MiB, over its {} MiB limit",
            mib(size),
            MAX_BUNDLE_BYTES >> 20
        );
    }
    if let Some(dir) = &args.data {
        fs::create_dir_all(out.join("data"))?;
        for file in FASHION_MNIST_FILES {
            fs::copy(dir.join(file), out.join("data").join(file))
                .with_context(|| format!("copying {}", dir.join(file).display()))?;
        }
    }
    println!(
        "{}: {:.1} MiB of programs and scripts (limit {} MiB), {:.1} MiB in all",
        out.display(),
        mib(size),
        MAX_BUNDLE_BYTES >> 20,
        mib(dir_bytes(out)?)
    );
    println!(
        "on the GPU machine: bash {}/run.sh (report.json, summary.txt, logs.tar.gz into $OUT or ./out)",
        out.display()
    );
    Ok(())
}

/// Builds revision `rev`'s release xtask in a worktree of its own and packs
/// it as `to`.gz. The worktree is made afresh and removed after; its build
/// directory is kept, so a second bundle of the same baseline is quick.
fn build_baseline(rev: &str, to: &Path) -> Result<()> {
    let source = Path::new("target/baseline-src");
    let target =
        std::path::absolute("target/baseline-target").context("locating target/baseline-target")?;
    if source.exists() {
        git(&["worktree", "remove", "--force", &source.to_string_lossy()])?;
    }
    git(&[
        "worktree",
        "add",
        "--detach",
        &source.to_string_lossy(),
        rev,
    ])
    .with_context(|| format!("checking out the baseline revision {rev}"))?;
    println!(
        "building the baseline {rev} (release xtask) in {}",
        source.display()
    );
    let built = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["build", "--release", "--quiet", "--package", "xtask"])
        .current_dir(source)
        .env("CARGO_TARGET_DIR", &target)
        .status()
        .context("running cargo for the baseline")?;
    let removed = git(&["worktree", "remove", "--force", &source.to_string_lossy()]);
    if !built.success() {
        bail!("building the baseline revision {rev} failed");
    }
    removed?;
    pack_program(&target.join("release/xtask"), to, Strip::Debug)
}

fn git(args: &[&str]) -> Result<()> {
    let output = Command::new("git")
        .args(args)
        .output()
        .with_context(|| format!("running git {}", args.join(" ")))?;
    if !output.status.success() {
        bail!(
            "git {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

/// Builds the release `xtask` (as `cargo xtask` does: same profile and
/// features, so the build is shared) and returns its path. The lab is
/// another program: the bundle carries xtask, not the lab.
fn xtask_binary() -> Result<PathBuf> {
    let args = [
        "build",
        "--release",
        "--package",
        "xtask",
        "--message-format=json-render-diagnostics",
    ];
    cargo_messages(&args, "the release xtask")?
        .into_iter()
        .filter(|m| m["target"]["name"] == "xtask")
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .context("cargo did not report the xtask binary it built")
}

/// Builds the CUDA test binaries in release and returns their paths.
fn test_binaries() -> Result<Vec<PathBuf>> {
    let mut args = vec![
        "test",
        "--release",
        "--no-run",
        "--message-format=json-render-diagnostics",
    ];
    for (package, test) in CUDA_TESTS {
        args.extend(["-p", package, "--test", test]);
    }
    // xtask in the set (none of its targets is built) gives the headroom
    // crates xtask's features, so the release build `cargo xtask` made is
    // reused instead of compiled again without them.
    args.extend(["-p", "xtask"]);
    let mut found = Vec::new();
    for message in cargo_messages(&args, "the CUDA test binaries")? {
        let is_wanted = message["target"]["name"]
            .as_str()
            .is_some_and(|name| CUDA_TESTS.iter().any(|(_, test)| *test == name));
        if let (true, Some(path)) = (is_wanted, message["executable"].as_str()) {
            found.push(PathBuf::from(path));
        }
    }
    if found.len() != CUDA_TESTS.len() {
        bail!(
            "expected {} CUDA test binaries, cargo reported {found:?}",
            CUDA_TESTS.len()
        );
    }
    Ok(found)
}

/// Writes `from` to `to` + `.gz`, without its debug information (`strip
/// --strip-debug`; with it, and a warning, where `strip` is missing) and
/// gzipped: the programs travel at a third of their size, and run.sh
/// unpacks them.
/// What `strip` takes out of a packed program.
#[derive(Clone, Copy)]
enum Strip {
    /// The debug information only (symbols stay, for backtraces).
    Debug,
    /// The symbols too.
    All,
}

fn pack_program(from: &Path, to: &Path, strip: Strip) -> Result<()> {
    let stripped = Command::new("strip")
        .arg(match strip {
            Strip::Debug => "--strip-debug",
            Strip::All => "--strip-all",
        })
        .arg("-o")
        .arg(to)
        .arg(from)
        .status();
    if !matches!(stripped, Ok(status) if status.success()) {
        eprintln!(
            "warning: strip failed or is missing; packing {} with its debug information",
            from.display()
        );
        fs::copy(from, to).with_context(|| format!("copying {}", from.display()))?;
    }
    let program = fs::read(to).with_context(|| format!("reading {}", to.display()))?;
    let packed = with_suffix(to, ".gz");
    let file =
        fs::File::create(&packed).with_context(|| format!("creating {}", packed.display()))?;
    let mut encoder = GzEncoder::new(file, Compression::best());
    encoder
        .write_all(&program)
        .and_then(|()| encoder.finish().map(drop))
        .with_context(|| format!("writing {}", packed.display()))?;
    fs::remove_file(to).with_context(|| format!("removing {}", to.display()))
}

/// `path` with `suffix` appended to its last component.
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// Copies `from` into `to`, subdirectories included (the profiles live in
/// experiments/profiles/).
fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    for entry in fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let entry = entry?;
        let kind = entry.file_type()?;
        if kind.is_dir() {
            copy_dir(&entry.path(), &to.join(entry.file_name()))?;
        } else if kind.is_file() {
            fs::copy(entry.path(), to.join(entry.file_name()))
                .with_context(|| format!("copying {}", entry.path().display()))?;
        }
    }
    Ok(())
}

fn write_executable(path: &Path, text: &str) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o755))
        .with_context(|| format!("making {} executable", path.display()))
}

fn dir_bytes(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() {
            dir_bytes(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}

/// The steps a dry run takes: the CUDA tests need a real GPU
/// (`HEADROOM_REQUIRE_GPU=1`) and already run on the emulator in
/// `cargo test`; the sanitize steps are recorded as skipped where there is
/// no compute-sanitizer, and the profile step where there is no ncu.
const DRY_RUN_STEPS: [&str; 7] = [
    "train", "oom", "resume", "small", "bench", "sanitize", "profile",
];

/// The device tool brings back at most 8 files of `$OUT`, each at most
/// this size and named in letters, digits, `.`, `_` and `-`.
const MAX_RETURNED_FILE_BYTES: u64 = 16 << 20;

/// Runs the bundle in `bundle` on the CPU emulator with small jobs; fails
/// unless every step passed or was skipped (those that need PyTorch with
/// CUDA), and unless what run.sh leaves in `$OUT` is what the device tool
/// can bring back. Then runs it again with no time left, which must record
/// every step as out of time and still write its report.
pub fn dry_run(bundle: &Path) -> Result<()> {
    let emulator = emulator_dir()?;
    // run.sh changes to its own directory: WORK and OUT must not be relative.
    let bundle = &std::path::absolute(bundle)
        .with_context(|| format!("the absolute path of {}", bundle.display()))?;
    // Beside the bundle, not in it: the bundle is what a GPU session
    // carries, and a dry run leaves about 90 MiB of runs.
    let dir = with_suffix(bundle, "-dry-run");
    if dir.exists() {
        fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    println!(
        "dry run of {}/run.sh on the CPU emulator; logs in {}",
        bundle.display(),
        dir.display()
    );
    let (work, out) = (dir.join("work"), dir.join("out"));
    let status = emulated_run(bundle, &emulator, &work, &out, "3000")?;
    let results = step_results(&work, status)?;
    let failed: Vec<&str> = results
        .iter()
        .filter(|(_, exit)| exit != "0" && exit != "skip")
        .map(|(name, _)| name.as_str())
        .collect();
    if results.is_empty() || !failed.is_empty() || !status.success() {
        bail!(
            "the dry run failed: {} of {} steps ({}); run.sh exited with {status}; see {}/<step>.log",
            failed.len(),
            results.len(),
            failed.join(", "),
            work.display()
        );
    }
    check_returnable(&out)?;
    let (late_work, late_out) = (dir.join("late-work"), dir.join("late-out"));
    let status = emulated_run(bundle, &emulator, &late_work, &late_out, "0")?;
    let late = step_results(&late_work, status)?;
    if late.len() != results.len() || late.iter().any(|(_, exit)| exit != "skip") {
        bail!(
            "with DEADLINE=0 run.sh should record all {} steps as out of time, it recorded {late:?}",
            results.len()
        );
    }
    check_returnable(&late_out)?;
    println!(
        "dry run: all {} steps passed or were skipped (summary in {}); with no time left all were recorded as out of time",
        results.len(),
        out.join("summary.txt").display()
    );
    Ok(())
}

/// Runs `bundle`'s run.sh on the emulator, shrunk, with `deadline` seconds.
fn emulated_run(
    bundle: &Path,
    emulator: &Path,
    work: &Path,
    out: &Path,
    deadline: &str,
) -> Result<std::process::ExitStatus> {
    let mut run = Command::new("bash");
    // The tests compiled these kernels with NVRTC into the default cache
    // (same sources, options and emulated sm_80): read them from there
    // rather than compiling every module again in the first step.
    if let Some(cache) = headroom_model::cuda::kernels::kernel_cache_dir() {
        run.env("HEADROOM_KERNEL_CACHE", cache);
    }
    run.arg(bundle.join("run.sh"))
        .args(DRY_RUN_STEPS)
        .env("WORK", work)
        .env("OUT", out)
        .env("DEADLINE", deadline)
        .env("LD_PRELOAD", emulator.join("libcuda.so"))
        .env("LD_LIBRARY_PATH", emulator)
        // A launch wider than the kernels were checked for fails here as
        // it would on the GPU.
        .env(
            "HEADROOM_CUDA_EMU_WIDEST_BLOCK",
            headroom_model::cuda::MAX_BLOCK_THREADS.to_string(),
        )
        // The emulator runs the tensor-core convolution (every lane's MMA
        // fragments exchanged across its warp) far slower than im2col +
        // cuBLAS (docs/cuda.md): a job that leaves device.conv_algorithm at its
        // default takes im2col here (the environment is below --set), and
        // the steps that name implicit_gemm, tune or auto still run them.
        // The parity tests prove each algorithm's kernels; this run proves
        // each step's plumbing.
        .env("HEADROOM__DEVICE__CONV_ALGORITHM", "im2col")
        .env("EXPERIMENT", "experiments/smoke.toml")
        .env(
            "HEADROOM_SETS",
            "--set data.train_samples=128 --set data.test_samples=32 --set checkpoint.every_steps=2",
        )
        // The emulator runs the transformer and the UNet-ConvLSTM at a
        // sample or a few a second at their experiments' sizes: 16-token
        // windows and 32-pixel frames keep each of those jobs to seconds
        // (the same layers and kernels, fewer positions).
        .env(
            "GPT_SETS",
            "--set data.train_samples=32 --set data.test_samples=8 --set text.sample_bytes=16 --set model.tokens.length=16",
        )
        .env(
            "FRAMES_SETS",
            "--set model.frames=4 --set frames.train_sequences=16 --set frames.test_sequences=8 --set frames.size=32 --set model.input=[32,32,1]",
        )
        .env("OOM_BUDGET", "6MiB")
        .env("BENCH_ARGS", "--batch 8,16 --warmup 1 --steps 1")
        .env("MODEL_BENCH_ARGS", "--batch 1 --warmup 1 --steps 1")
        .env("STEP_TIMEOUT", "300")
        .status()
        .context("running bash run.sh")
}

/// The (step, exit) pairs of run.sh's `results.tsv` in `work`.
fn step_results(work: &Path, status: std::process::ExitStatus) -> Result<Vec<(String, String)>> {
    let path = work.join("results.tsv");
    let text = fs::read_to_string(&path)
        .with_context(|| format!("reading {} (run.sh exited with {status})", path.display()))?;
    text.lines()
        .map(|line| {
            let mut fields = line.split('\t');
            match (fields.next(), fields.next()) {
                (Some(name), Some(exit)) => Ok((name.to_string(), exit.to_string())),
                _ => bail!(
                    "{}: a line that is no step result: {line:?}",
                    path.display()
                ),
            }
        })
        .collect()
}

/// Fails unless `out` holds the report, the summary and the logs, as
/// plain files that the device tool brings back whole.
fn check_returnable(out: &Path) -> Result<()> {
    let mut names = Vec::new();
    for entry in fs::read_dir(out).with_context(|| format!("reading {}", out.display()))? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let meta = entry.metadata()?;
        let plain_name = name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
        if !meta.is_file() || !plain_name || meta.len() > MAX_RETURNED_FILE_BYTES {
            bail!(
                "{}: {name} would not come back from a GPU machine (a plain file, a plain name, at most {} MiB)",
                out.display(),
                MAX_RETURNED_FILE_BYTES >> 20
            );
        }
        names.push(name);
    }
    names.sort();
    if names != ["logs.tar.gz", "report.json", "summary.txt"] {
        bail!(
            "{}: run.sh left {names:?}; it should leave report.json, summary.txt and logs.tar.gz",
            out.display()
        );
    }
    let listing = Command::new("tar")
        .arg("tzf")
        .arg(out.join("logs.tar.gz"))
        .output()
        .context("listing logs.tar.gz with tar")?;
    let listing = String::from_utf8_lossy(&listing.stdout);
    if !listing.lines().any(|l| l.ends_with("results.tsv")) {
        bail!("{}/logs.tar.gz lacks results.tsv", out.display());
    }
    Ok(())
}

/// The emulator's fake `libcuda.so` and `libcublas.so`, built in release.
fn emulator_dir() -> Result<PathBuf> {
    let args = [
        "build",
        "--release",
        "-p",
        "headroom-cuda-emu",
        "--message-format=json",
    ];
    let dir = cargo_messages(&args, "the CUDA emulator")?
        .into_iter()
        .filter(|m| m["reason"] == "build-script-executed")
        .filter(|m| {
            m["package_id"]
                .as_str()
                .is_some_and(|id| id.contains("headroom-cuda-emu"))
        })
        .find_map(|m| m["out_dir"].as_str().map(PathBuf::from))
        .context("cargo did not report the CUDA emulator's build directory")?;
    if !dir.join("libcuda.so").is_file() {
        bail!(
            "the CUDA emulator was not built in {} (it needs g++ or $CXX)",
            dir.display()
        );
    }
    Ok(dir)
}

/// The script that runs on the GPU machine.
const RUN_SH: &str = include_str!("gpu_bundle_run.sh");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_baseline_revision_that_does_not_exist_is_named_in_the_error() {
        let to = std::env::temp_dir().join(format!("baseline-test-{}", std::process::id()));
        let err = build_baseline("no-such-revision-0000", &to).unwrap_err();
        let message = format!("{err:#}");
        assert!(
            message.contains("checking out the baseline revision no-such-revision-0000"),
            "{message}"
        );
        assert!(!to.with_extension("gz").exists());
    }
}
