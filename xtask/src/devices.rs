//! `cargo xtask train --devices N`: data parallel over the GPUs of this
//! machine, one process per GPU, linked by NCCL (no MPI: NCCL's own
//! bootstrap, over the unique id rank 0 makes, suffices on one machine).
//!
//! The launcher (this process) starts N copies of itself with the same
//! arguments, each told its rank, the world's size, the file where rank 0
//! leaves the NCCL id, and its GPU (`CUDA_VISIBLE_DEVICES`: the r-th of
//! the launcher's own list, or GPU r), and, where NCCL is a pip wheel's
//! `libnccl.so.2` (a name cudarc never asks for), a library path with a
//! `libnccl.so` beside it. It forwards SIGINT/SIGTERM to every rank (each
//! checkpoints and stops after the same step, as under mpirun), and when a
//! rank fails it gives the others `distributed.timeout_s` to stop on their
//! own (they notice the silent peer), then ends them, naming the rank.
//! Rank 0 logs and prints the summary; the others log warnings and errors
//! only, each error line saying whose it is.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use headroom_model::cuda::libs;
use headroom_model::cuda::nccl::NcclId;
use headroom_pipeline::device::{gpu_memory, DeviceKind};
use headroom_pipeline::learner::NcclTransport;
use headroom_pipeline::ranks::Ranks;
use headroom_pipeline::ExperimentConfig;

/// What the launcher tells each rank.
const RANK_ENV: &str = "HEADROOM_RANK";
const WORLD_ENV: &str = "HEADROOM_WORLD";
const ID_FILE_ENV: &str = "HEADROOM_NCCL_ID_FILE";

/// Refuses `--devices N` where it cannot train: N = 0, or an experiment
/// that trains on the CPU here (device.kind = cpu, or no usable GPU).
pub fn check_device(config: &ExperimentConfig, devices: usize) -> Result<()> {
    if devices == 0 {
        bail!("--devices 0: give the number of GPUs to train on (1 or more)");
    }
    let kind = config.learner_device();
    if kind == DeviceKind::Cpu || gpu_memory(kind).is_none() {
        bail!(
            "--devices trains on GPUs, but this experiment trains on the CPU here (device.kind \
             = {}{}); CPU ranks start with `mpirun -np N cargo xtask train` (docs/data-parallel.md)",
            kind.as_str(),
            match std::env::var("CUDA_VISIBLE_DEVICES") {
                Ok(list) => format!(", CUDA_VISIBLE_DEVICES={list}"),
                Err(_) => String::new(),
            }
        );
    }
    Ok(())
}

/// Whether this process is a rank that `--devices` started.
pub fn is_rank() -> bool {
    std::env::var_os(ID_FILE_ENV).is_some()
}

/// Starts `devices` ranks of this command and waits for them: the exit
/// status is the first failing rank's, else the ranks' own (130/143 after
/// a signal).
pub fn launch(devices: usize, timeout: Duration) -> Result<ExitCode> {
    let exe = std::env::current_exe().context("finding this program to start its ranks")?;
    let args = without_devices(std::env::args_os().skip(1));
    let dir = std::env::temp_dir().join(format!("headroom-devices-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let _cleanup = RemoveOnDrop(dir.clone());
    let id_file = dir.join("nccl-id");
    let library_dir = nccl_library_dir(&dir)?;
    let gpus = gpu_list(devices)?;
    let forwarded = Arc::new(AtomicI32::new(0));
    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
    ])
    .context("installing the signal handlers")?;
    let mut children = Vec::with_capacity(devices);
    for (rank, gpu) in gpus.iter().enumerate() {
        let mut command = Command::new(&exe);
        command
            .args(&args)
            .env(RANK_ENV, rank.to_string())
            .env(WORLD_ENV, devices.to_string())
            .env(ID_FILE_ENV, &id_file)
            .env("CUDA_VISIBLE_DEVICES", gpu)
            .stdin(Stdio::null());
        if let Some(lib) = &library_dir {
            let mut paths = vec![lib.clone()];
            if let Some(existing) = std::env::var_os("LD_LIBRARY_PATH") {
                paths.extend(std::env::split_paths(&existing));
            }
            command.env(
                "LD_LIBRARY_PATH",
                std::env::join_paths(paths).context("joining LD_LIBRARY_PATH")?,
            );
        }
        match command.spawn() {
            Ok(child) => children.push(Some(child)),
            Err(e) => {
                end_all(&mut children);
                return Err(e).with_context(|| format!("starting rank {rank} ({})", exe.display()));
            }
        }
    }
    let outcome = supervise(&mut children, &mut signals, &forwarded, timeout);
    end_all(&mut children);
    outcome
}

/// Waits for every rank; forwards signals; after a rank fails, ends the
/// rest once `timeout` has passed.
fn supervise(
    children: &mut [Option<Child>],
    signals: &mut signal_hook::iterator::Signals,
    forwarded: &AtomicI32,
    timeout: Duration,
) -> Result<ExitCode> {
    let world = children.len();
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; world];
    let mut first_failure: Option<(usize, ExitStatus, Instant)> = None;
    loop {
        for signal in signals.pending() {
            forwarded.store(signal, Ordering::SeqCst);
            for child in children.iter().flatten() {
                // SAFETY: kill(2) with a live child's pid and a signal number.
                unsafe { libc::kill(child.id() as libc::pid_t, signal) };
            }
        }
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            if let Some(status) = child.try_wait().context("waiting for a rank")? {
                statuses[rank] = Some(status);
                *slot = None;
                if !status.success() && first_failure.is_none() {
                    first_failure = Some((rank, status, Instant::now()));
                }
            }
        }
        if children.iter().all(Option::is_none) {
            break;
        }
        if let Some((rank, status, at)) = first_failure {
            if at.elapsed() > timeout {
                eprintln!(
                    "error: rank {rank} of {world} ended ({status}); the other ranks did not stop \
                     within {} s (distributed.timeout_s): ending them",
                    timeout.as_secs()
                );
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    match first_failure {
        None => Ok(ExitCode::SUCCESS),
        Some((rank, status, _)) => {
            let signal = forwarded.load(Ordering::SeqCst);
            let stopped = signal != 0 && status.code() == Some(128 + signal);
            if !stopped {
                eprintln!("error: rank {rank} of {world} ended ({status}); every rank stopped");
            }
            Ok(ExitCode::from(
                status
                    .code()
                    .and_then(|c| u8::try_from(c).ok())
                    .unwrap_or(1),
            ))
        }
    }
}

fn end_all(children: &mut [Option<Child>]) {
    for child in children.iter_mut().flatten() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// The command line without `--devices N` (or `--devices=N`).
fn without_devices(args: impl Iterator<Item = OsString>) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut skip_next = false;
    for arg in args {
        if skip_next {
            skip_next = false;
            continue;
        }
        match arg.to_str() {
            Some("--devices") => skip_next = true,
            Some(a) if a.starts_with("--devices=") => {}
            _ => out.push(arg),
        }
    }
    out
}

/// Each rank's `CUDA_VISIBLE_DEVICES`: the r-th entry of the launcher's
/// own, or r.
fn gpu_list(devices: usize) -> Result<Vec<String>> {
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(list) if !list.trim().is_empty() => {
            let visible: Vec<String> = list.split(',').map(|s| s.trim().to_string()).collect();
            if visible.len() < devices {
                bail!(
                    "--devices {devices}: CUDA_VISIBLE_DEVICES={list} names {} GPU(s)",
                    visible.len()
                );
            }
            Ok(visible.into_iter().take(devices).collect())
        }
        _ => Ok((0..devices).map(|r| r.to_string()).collect()),
    }
}

/// A directory to put first on the ranks' library path, when NCCL is not
/// on it already: one holding `libnccl.so`, a link to the NCCL found.
fn nccl_library_dir(dir: &Path) -> Result<Option<PathBuf>> {
    if libs::nccl_present() {
        return Ok(None);
    }
    let Some(found) = libs::nccl_library() else {
        bail!(
            "--devices trains over NCCL, which was not found: {}",
            libs::NCCL_INSTALL_HINT
        );
    };
    let lib = dir.join("lib");
    std::fs::create_dir_all(&lib).with_context(|| format!("creating {}", lib.display()))?;
    std::os::unix::fs::symlink(&found, lib.join("libnccl.so"))
        .with_context(|| format!("linking {} into {}", found.display(), lib.display()))?;
    tracing::info!("NCCL: {}", found.display());
    Ok(Some(lib))
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// This rank's place among the `--devices` ranks (None when this process
/// is not one): rank 0 makes the NCCL id and leaves it in the launcher's
/// file, the others wait for it (at most `distributed.timeout_s`); then
/// every rank joins. `stop` becomes this rank's stop request.
pub fn rank_from_env(
    config: &ExperimentConfig,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> Result<Option<Ranks>> {
    let Some(id_file) = std::env::var_os(ID_FILE_ENV).map(PathBuf::from) else {
        return Ok(None);
    };
    let read = |key: &str| -> Result<usize> {
        std::env::var(key)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .with_context(|| format!("{key} is not set to a number (set by train --devices)"))
    };
    let (rank, world) = (read(RANK_ENV)?, read(WORLD_ENV)?);
    check_device(config, world)?;
    let timeout = config.distributed.timeout();
    let id = if rank == 0 {
        let id = NcclId::new()?;
        let partial = id_file.with_extension("partial");
        std::fs::write(&partial, id.to_hex())
            .with_context(|| format!("writing {}", partial.display()))?;
        std::fs::rename(&partial, &id_file)
            .with_context(|| format!("renaming {} into place", partial.display()))?;
        id
    } else {
        let deadline = Instant::now() + timeout;
        loop {
            match std::fs::read_to_string(&id_file) {
                Ok(text) => break NcclId::from_hex(&text)?,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => {
                    return Err(e).with_context(|| {
                        format!(
                            "rank {rank} waited {} s for rank 0's NCCL id in {}",
                            timeout.as_secs(),
                            id_file.display()
                        )
                    })
                }
            }
        }
    };
    let transport = NcclTransport::join(0, rank, world, &id)
        .with_context(|| format!("rank {rank} of {world} joining the NCCL ranks"))?;
    let mut ranks = Ranks::new(
        Box::new(transport),
        config.distributed.bucket_bytes(),
        timeout,
    );
    ranks.requested = stop;
    ranks.at_world_one = true;
    tracing::info!(
        "data parallel: {world} GPU rank(s) (NCCL), {} samples per rank per step, {} in all",
        config.train.batch_size,
        config.train.batch_size * world
    );
    Ok(Some(ranks))
}

/// The command that continues a stopped `--devices` run.
pub fn resume_command(world: usize) -> String {
    format!("cargo xtask train --devices {world}")
}
