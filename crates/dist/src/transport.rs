//! One rank's view of the world, and the world of one.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::{DistError, Result};

/// A rank's link to the others. Every collective of this crate is made of
/// `exchange` calls, so a transport implements only this.
pub trait Transport: Send {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;

    /// Sends each `sends[i].1` to rank `sends[i].0` and fills each
    /// `recvs[j].1` with the message of exactly that length from rank
    /// `recvs[j].0`, all tagged `tag`; returns when every one completed.
    /// Messages between two ranks with the same tag arrive in the order
    /// they were sent. At `deadline` it fails with
    /// [`DistError::Timeout`] naming the ranks whose messages were not
    /// received (`during` says what the rank was doing).
    fn exchange(
        &mut self,
        tag: u16,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
        deadline: Instant,
        during: &str,
    ) -> Result<()>;

    /// The transport itself, for a learner that works through its device
    /// side (the GPU ranks' NCCL communicator moves gradients between
    /// device buffers, beside the host records of `exchange`). None: a
    /// host-only transport.
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        None
    }
}

/// A transport shared by the trainer's thread and the reducer's
/// communication thread: calls are serialised by the lock (what MPI's
/// `MPI_THREAD_SERIALIZED` level asks).
pub type SharedTransport = Arc<Mutex<Box<dyn Transport>>>;

/// Locks a shared transport; a poisoned lock (a thread panicked inside a
/// call) is an error, never a second panic.
pub(crate) fn lock(
    transport: &SharedTransport,
) -> Result<std::sync::MutexGuard<'_, Box<dyn Transport>>> {
    transport
        .lock()
        .map_err(|_| DistError::Thread("a thread panicked while it used the transport".into()))
}

/// World size 1: no peer, so every exchange is empty.
#[derive(Clone, Copy, Debug, Default)]
pub struct Solo;

impl Transport for Solo {
    fn rank(&self) -> usize {
        0
    }

    fn world(&self) -> usize {
        1
    }

    fn exchange(
        &mut self,
        _tag: u16,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
        _deadline: Instant,
        during: &str,
    ) -> Result<()> {
        let peer = sends
            .iter()
            .map(|s| s.0)
            .chain(recvs.iter().map(|r| r.0))
            .next();
        match peer {
            None => Ok(()),
            Some(peer) => Err(DistError::PeerGone {
                rank: 0,
                peer,
                during: format!("{during}: a world of one rank has no rank {peer}"),
            }),
        }
    }
}
