//! The crate's one error type.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum DistError {
    /// A peer did not send or take a message before the deadline: it died,
    /// hangs, or runs another program.
    #[error(
        "rank {rank} waited {waited_s:.0} s for rank(s) {missing:?} during {during}; they died, \
         hang or run a different step (see their own output); every rank stops"
    )]
    Timeout {
        rank: usize,
        missing: Vec<usize>,
        during: String,
        waited_s: f64,
    },
    /// A message of another length or tag than the protocol expects: the
    /// ranks run different programs or settings.
    #[error(
        "rank {rank} received from rank {from} {what}; the ranks disagree (config, model or code)"
    )]
    Protocol {
        rank: usize,
        from: usize,
        what: String,
    },
    /// A peer is gone (its channel closed; a thread rank that returned).
    #[error("rank {rank}: rank {peer} is gone ({during})")]
    PeerGone {
        rank: usize,
        peer: usize,
        during: String,
    },
    #[error("the communication thread: {0}")]
    Thread(String),
    #[error("MPI: {0}")]
    Mpi(String),
    /// The device transport (NCCL) failed.
    #[error("{0}")]
    Device(String),
}

pub type Result<T> = std::result::Result<T, DistError>;
