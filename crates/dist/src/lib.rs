//! Beyond one device: the ranks of a data-parallel run and what they say to
//! one another.
//!
//! A [`Transport`] is one rank's view of the world: its rank, the world's
//! size, and one primitive, [`Transport::exchange`] (point-to-point sends
//! and receives that all complete, or fail at a deadline naming the ranks
//! that did not answer). Everything else is built on it here, once:
//!
//! - [`collective::all_reduce_ordered`]: the sum of every rank's vector,
//!   the same bits on every rank and in every run. Each rank owns a slice,
//!   receives every rank's copy of it and adds them in rank order
//!   (`((r0 + r1) + r2) + …`), then the sums are gathered. The order never
//!   depends on which message arrived first, so the result is a function
//!   of the world size and the data only; and it is the order in which one
//!   process adds its micro-batches' gradients (`train.accumulate`), so N
//!   ranks of one micro-batch each give the bits of one process
//!   accumulating N. Each rank sends and receives (N-1)/N of the vector
//!   twice, as a ring all-reduce does.
//! - [`collective::all_gather`]: small per-rank records (a step's status,
//!   loss and flags, a fingerprint at start), in rank order.
//! - [`GradientReducer`]: gradients in buckets of a configurable size,
//!   reduced on a communication thread as backward hands them over, so the
//!   communication of the last layers overlaps the backward of the first.
//!
//! Transports: [`Solo`] (world 1: nothing to say), [`threads::group`]
//! (ranks as threads of one process, over channels: the tests, and
//! data-parallel logic without MPI) and, with the `mpi` feature,
//! `mpi::MpiTransport` (processes started by `mpirun`, on one machine or
//! several). NCCL for GPUs plugs in at the same trait.
//!
//! Memory: a reducer holds one copy of the gradients (its buckets) and one
//! bucket's worth of receive space; the all-gather holds N small records.

pub mod collective;
mod error;
pub mod launcher;
#[cfg(feature = "mpi")]
pub mod mpi;
mod reducer;
pub mod threads;
mod transport;

pub use error::{DistError, Result};
pub use reducer::{BucketPlan, GradientReducer, FIRST_CONTROL_TAG};
pub use transport::{SharedTransport, Solo, Transport};
