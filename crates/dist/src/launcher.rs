//! What the launcher tells a process before MPI is initialised: its rank
//! and the world's size, from the environment `mpirun` (Open MPI,
//! MPICH/Hydra), Slurm's PMI or headroom's own `train --devices N`
//! (`HEADROOM_RANK`, `HEADROOM_WORLD`) set. Read without MPI, so that a build
//! without the `mpi` feature can refuse to run as N separate trainers,
//! and logging can be quiet on the followers from the first line.

/// (rank, world) as the launcher set them; None outside a launcher.
pub fn launcher_rank_world() -> Option<(usize, usize)> {
    let read = |key: &str| std::env::var(key).ok()?.trim().parse::<usize>().ok();
    [
        ("HEADROOM_RANK", "HEADROOM_WORLD"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("PMI_RANK", "PMI_SIZE"),
        ("PMIX_RANK", "PMIX_SIZE"),
    ]
    .iter()
    .find_map(|(rank, size)| Some((read(rank)?, read(size)?)))
}
