//! Ranks as threads of one process, linked by channels: what the tests
//! use to run N ranks without MPI, with the same collectives and the same
//! protocol as the MPI transport.
//!
//! Memory: a message is copied into the channel (one copy per send).

use std::time::Instant;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use crate::{DistError, Result, Transport};

type Message = (u16, Vec<u8>);

/// One rank of a [`group`].
pub struct ThreadTransport {
    rank: usize,
    /// `to[r]`: the channel to rank r (none to itself).
    to: Vec<Option<Sender<Message>>>,
    /// `from[r]`: the channel from rank r.
    from: Vec<Option<Receiver<Message>>>,
}

/// `world` linked transports, one per rank, in rank order: hand each to
/// its own thread.
pub fn group(world: usize) -> Vec<ThreadTransport> {
    let mut to: Vec<Vec<Option<Sender<Message>>>> = (0..world).map(|_| vec![None; world]).collect();
    let mut from: Vec<Vec<Option<Receiver<Message>>>> = (0..world)
        .map(|_| (0..world).map(|_| None).collect())
        .collect();
    for a in 0..world {
        for b in 0..world {
            if a != b {
                let (tx, rx) = crossbeam_channel::unbounded();
                to[a][b] = Some(tx);
                from[b][a] = Some(rx);
            }
        }
    }
    to.into_iter()
        .zip(from)
        .enumerate()
        .map(|(rank, (to, from))| ThreadTransport { rank, to, from })
        .collect()
}

impl ThreadTransport {
    fn gone(&self, peer: usize, during: &str) -> DistError {
        DistError::PeerGone {
            rank: self.rank,
            peer,
            during: during.to_string(),
        }
    }
}

impl Transport for ThreadTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.to.len()
    }

    fn exchange(
        &mut self,
        tag: u16,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
        deadline: Instant,
        during: &str,
    ) -> Result<()> {
        for &(peer, bytes) in sends {
            let tx = self
                .to
                .get(peer)
                .and_then(Option::as_ref)
                .ok_or_else(|| self.gone(peer, during))?;
            tx.send((tag, bytes.to_vec()))
                .map_err(|_| self.gone(peer, during))?;
        }
        let start = Instant::now();
        for (peer, buf) in recvs.iter_mut() {
            let peer = *peer;
            let rx = self
                .from
                .get(peer)
                .and_then(Option::as_ref)
                .ok_or_else(|| self.gone(peer, during))?;
            let (got_tag, bytes) = match rx.recv_deadline(deadline) {
                Ok(message) => message,
                Err(RecvTimeoutError::Timeout) => {
                    return Err(DistError::Timeout {
                        rank: self.rank,
                        // Receives are taken in order: the later ones
                        // were not reached, so only this peer is known late.
                        missing: vec![peer],
                        during: during.to_string(),
                        waited_s: start.elapsed().as_secs_f64(),
                    });
                }
                Err(RecvTimeoutError::Disconnected) => return Err(self.gone(peer, during)),
            };
            if got_tag != tag || bytes.len() != buf.len() {
                return Err(DistError::Protocol {
                    rank: self.rank,
                    from: peer,
                    what: format!(
                        "{} bytes tagged {got_tag} where {} bytes tagged {tag} were expected ({during})",
                        bytes.len(),
                        buf.len()
                    ),
                });
            }
            buf.copy_from_slice(&bytes);
        }
        Ok(())
    }
}
