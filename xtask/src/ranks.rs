//! The ranks of a data-parallel `cargo xtask train`: GPU ranks started by
//! `train --devices N` (`crate::devices`, over NCCL), or the MPI
//! launcher's: `mpirun -np N target/release/xtask train …` with a build
//! that has the `mpi` feature. Outside a launcher (or with a world of one
//! under mpirun) a run is alone, as always.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::Result;
use headroom_pipeline::ranks::Ranks;
use headroom_pipeline::ExperimentConfig;

/// This process's ranks, when a launcher started N > 1 of them; `stop` is
/// the signal handler's flag, which becomes this rank's stop request.
pub fn from_launcher(config: &ExperimentConfig, stop: Arc<AtomicBool>) -> Result<Option<Ranks>> {
    if crate::devices::is_rank() {
        return crate::devices::rank_from_env(config, stop);
    }
    from_mpi(config, stop)
}

#[cfg(feature = "mpi")]
fn from_mpi(config: &ExperimentConfig, stop: Arc<AtomicBool>) -> Result<Option<Ranks>> {
    use headroom_dist::mpi::MpiTransport;
    use headroom_dist::Transport;
    if headroom_dist::launcher::launcher_rank_world().is_none() {
        return Ok(None);
    }
    let transport = MpiTransport::init()?;
    if transport.world() <= 1 {
        return Ok(None);
    }
    let mut ranks = Ranks::new(
        Box::new(transport),
        config.distributed.bucket_bytes(),
        config.distributed.timeout(),
    );
    ranks.requested = stop;
    tracing::info!(
        "data parallel: {} ranks (MPI), {} samples per rank per step, {} in all",
        ranks.world,
        config.train.batch_size,
        config.train.batch_size * ranks.world
    );
    Ok(Some(ranks))
}

/// Without MPI in the build, N processes started by a launcher would be
/// N separate runs fighting over one directory: refused.
#[cfg(not(feature = "mpi"))]
fn from_mpi(_config: &ExperimentConfig, _stop: Arc<AtomicBool>) -> Result<Option<Ranks>> {
    match headroom_dist::launcher::launcher_rank_world() {
        Some((_, world)) if world > 1 => anyhow::bail!(
            "started as one of {world} MPI ranks, but this xtask was built without MPI: build it \
             with `cargo build --release -p xtask --features mpi` (needs an MPI library and \
             libclang) and launch target/release/xtask"
        ),
        _ => Ok(None),
    }
}

/// This process's rank as the launcher set it (0 outside one): the
/// followers log warnings and errors only, each line saying whose it is.
pub fn launcher_rank() -> usize {
    headroom_dist::launcher::launcher_rank_world().map_or(0, |(rank, _)| rank)
}

/// (rank, world) as the launcher set them.
pub fn launcher_rank_world() -> Option<(usize, usize)> {
    headroom_dist::launcher::launcher_rank_world()
}
