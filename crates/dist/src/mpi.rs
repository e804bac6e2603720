//! Ranks as MPI processes (`mpirun -np N …`, on one machine or several):
//! the rendezvous (rank and world size) and the point-to-point messages
//! the collectives are made of, non-blocking, tested in a loop against
//! the deadline.
//!
//! MPI is initialised at `MPI_THREAD_SERIALIZED`: the trainer's thread and
//! the reducer's communication thread both call MPI, never at once (the
//! `SharedTransport` lock). A peer that misses the deadline cannot be
//! recovered from (its requests stay posted, and MPI has no way to cancel
//! a send portably), so the transport prints the error naming it and
//! calls `MPI_Abort`, which ends every rank: a bounded stop with a message,
//! never a hang. Checkpoints are written atomically, so nothing is left
//! half-written.

use std::time::Instant;

use mpi::datatype::Equivalence;
use mpi::environment::Universe;
use mpi::point_to_point::{Destination, Source};
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::Threading;

use crate::{DistError, Result, Transport};

/// The exit code of every rank after a peer missed a deadline.
pub const PEER_LOST_EXIT: i32 = 75;

/// One MPI process's link to the others.
pub struct MpiTransport {
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    // Finalises MPI when dropped, after the communicator.
    _universe: Universe,
}

// SAFETY: MPI handles are plain integers or pointers owned by the MPI
// library; at MPI_THREAD_SERIALIZED any thread may make MPI calls as long
// as no two do at once, which the `SharedTransport` mutex guarantees for
// every call made through this transport.
unsafe impl Send for MpiTransport {}

impl MpiTransport {
    /// Initialises MPI (once per process) and joins its world.
    pub fn init() -> Result<Self> {
        let (universe, level) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| DistError::Mpi("MPI was initialised already in this process".into()))?;
        if level < Threading::Serialized {
            return Err(DistError::Mpi(format!(
                "this MPI library offers thread level {level:?}; headroom needs Serialized \
                 (its all-reduce runs on its own thread)"
            )));
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        Ok(Self {
            world,
            rank,
            size,
            _universe: universe,
        })
    }

    /// Ends every rank after `error`, which is printed first.
    fn abort_with(&self, error: &DistError) -> ! {
        eprintln!("error: {error}");
        self.world.abort(PEER_LOST_EXIT)
    }
}

impl Transport for MpiTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.size
    }

    fn exchange(
        &mut self,
        tag: u16,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
        deadline: Instant,
        during: &str,
    ) -> Result<()> {
        let tag = i32::from(tag);
        let start = Instant::now();
        let peers: Vec<usize> = recvs.iter().map(|r| r.0).collect();
        let lens: Vec<usize> = recvs.iter().map(|r| r.1.len()).collect();
        for &peer in peers.iter().chain(sends.iter().map(|s| &s.0)) {
            if peer >= self.size || peer == self.rank {
                return Err(DistError::PeerGone {
                    rank: self.rank,
                    peer,
                    during: format!("{during}: no such peer in a world of {}", self.size),
                });
            }
        }
        let mut wrong: Option<(usize, i32)> = None;
        mpi::request::scope(|scope| {
            let mut pending_recv: Vec<Option<_>> = recvs
                .iter_mut()
                .map(|(peer, buf)| {
                    let process = self.world.process_at_rank(*peer as i32);
                    Some(process.immediate_receive_into_with_tag(scope, &mut **buf, tag))
                })
                .collect();
            let mut pending_send: Vec<Option<_>> = sends
                .iter()
                .map(|&(peer, bytes)| {
                    let process = self.world.process_at_rank(peer as i32);
                    Some(process.immediate_send_with_tag(scope, bytes, tag))
                })
                .collect();
            loop {
                let mut busy = false;
                for (k, slot) in pending_recv.iter_mut().enumerate() {
                    if let Some(request) = slot.take() {
                        match request.test() {
                            Ok(status) => {
                                let got = status.count(u8::equivalent_datatype());
                                if got as usize != lens[k] {
                                    wrong.get_or_insert((k, got));
                                }
                            }
                            Err(request) => {
                                *slot = Some(request);
                                busy = true;
                            }
                        }
                    }
                }
                for slot in pending_send.iter_mut() {
                    if let Some(request) = slot.take() {
                        if let Err(request) = request.test() {
                            *slot = Some(request);
                            busy = true;
                        }
                    }
                }
                if !busy {
                    return;
                }
                if Instant::now() >= deadline {
                    // Posted requests cannot be left behind (the scope
                    // would abort without a word): say who is missing,
                    // then end every rank.
                    let missing: Vec<usize> = pending_recv
                        .iter()
                        .enumerate()
                        .filter(|(_, r)| r.is_some())
                        .map(|(k, _)| peers[k])
                        .collect();
                    let error = DistError::Timeout {
                        rank: self.rank,
                        missing,
                        during: during.to_string(),
                        waited_s: start.elapsed().as_secs_f64(),
                    };
                    self.abort_with(&error);
                }
                std::thread::yield_now();
            }
        });
        if let Some((k, got)) = wrong {
            return Err(DistError::Protocol {
                rank: self.rank,
                from: peers[k],
                what: format!("{got} bytes where {} were expected ({during})", lens[k]),
            });
        }
        Ok(())
    }
}
