//! The collectives, each a few `exchange` calls: the ordered all-reduce
//! of f32 vectors (gradients) and the all-gather of small records.

use std::ops::Range;
use std::time::Instant;

use crate::{DistError, Result, Transport};

/// The bounds of rank `j`'s slice of a vector of `len` values in a world
/// of `world`: equal parts, the remainder spread over the first slices.
pub fn slice_of(len: usize, world: usize, j: usize) -> Range<usize> {
    let bound = |k: usize| ((len as u128 * k as u128) / world.max(1) as u128) as usize;
    bound(j)..bound(j + 1)
}

/// `data` becomes the sum over the ranks of their `data`, the same bits on
/// every rank: rank r receives every rank's copy of its slice and adds
/// them in rank order, starting from rank 0's; then every rank gathers the
/// sums. `scratch` is reused between calls (it grows to one slice per
/// rank). Every rank must call it with a vector of the same length.
pub fn all_reduce_ordered(
    transport: &mut dyn Transport,
    tag: u16,
    data: &mut [f32],
    scratch: &mut Vec<f32>,
    deadline: Instant,
    during: &str,
) -> Result<()> {
    let world = transport.world();
    if world <= 1 {
        return Ok(());
    }
    let bounds: Vec<Range<usize>> = (0..world).map(|j| slice_of(data.len(), world, j)).collect();
    reduce_scatter_ordered(transport, tag, data, &bounds, scratch, deadline, during)?;
    all_gather_slices(transport, tag, data, &bounds, deadline, during)
}

/// Rank r's slice of `data` (`bounds[r]`; the slices are consecutive and
/// cover `data`) becomes the sum over the ranks of their copies of it,
/// added in rank order as [`all_reduce_ordered`] adds them; the rest of
/// `data` is left as it was. The half of the all-reduce that a sharded
/// optimizer (ZeRO-1) needs: each rank updates only the weights of its
/// slice.
pub fn reduce_scatter_ordered(
    transport: &mut dyn Transport,
    tag: u16,
    data: &mut [f32],
    bounds: &[Range<usize>],
    scratch: &mut Vec<f32>,
    deadline: Instant,
    during: &str,
) -> Result<()> {
    let (rank, world) = (transport.rank(), transport.world());
    if world <= 1 {
        return Ok(());
    }
    check_bounds(rank, data.len(), bounds, world)?;
    let own = bounds[rank].clone();
    let part = own.len();
    scratch.clear();
    scratch.resize(part * world, 0.0);
    // Slice j to rank j; every rank's copy of ours into scratch[k * part ..],
    // ours included, so the sum can run in rank order.
    {
        let sends: Vec<(usize, &[u8])> = (0..world)
            .filter(|&j| j != rank)
            .map(|j| (j, bytemuck::cast_slice(&data[bounds[j].clone()])))
            .collect();
        let mut copies: Vec<&mut [f32]> = scratch.chunks_mut(part.max(1)).collect();
        copies.resize_with(world, || &mut []);
        if part > 0 {
            copies[rank].copy_from_slice(&data[own.clone()]);
        }
        let mut recvs: Vec<(usize, &mut [u8])> = copies
            .into_iter()
            .enumerate()
            .filter(|&(k, _)| k != rank)
            .map(|(k, copy)| (k, bytemuck::cast_slice_mut(copy)))
            .collect();
        transport.exchange(tag, &sends, &mut recvs, deadline, during)?;
    }
    let sum = &mut data[own];
    sum.copy_from_slice(&scratch[..part]);
    for k in 1..world {
        let copy = &scratch[k * part..(k + 1) * part];
        sum.iter_mut().zip(copy).for_each(|(s, &v)| *s += v);
    }
    Ok(())
}

/// Every rank's slice of `data` (`bounds[j]`, consecutive, covering
/// `data`) to every rank: our slice is sent, the others' are received
/// into theirs.
pub fn all_gather_slices(
    transport: &mut dyn Transport,
    tag: u16,
    data: &mut [f32],
    bounds: &[Range<usize>],
    deadline: Instant,
    during: &str,
) -> Result<()> {
    let (rank, world) = (transport.rank(), transport.world());
    if world <= 1 {
        return Ok(());
    }
    check_bounds(rank, data.len(), bounds, world)?;
    let mut parts: Vec<&mut [f32]> = Vec::with_capacity(world);
    let mut rest = data;
    for b in bounds {
        let (head, tail) = rest.split_at_mut(b.len());
        parts.push(head);
        rest = tail;
    }
    let mut mine: &[f32] = &[];
    let mut recvs: Vec<(usize, &mut [u8])> = Vec::with_capacity(world - 1);
    for (j, p) in parts.into_iter().enumerate() {
        if j == rank {
            mine = p;
        } else {
            recvs.push((j, bytemuck::cast_slice_mut(p)));
        }
    }
    let sends: Vec<(usize, &[u8])> = (0..world)
        .filter(|&j| j != rank)
        .map(|j| (j, bytemuck::cast_slice(mine)))
        .collect();
    transport.exchange(tag, &sends, &mut recvs, deadline, during)
}

/// Slices that are not one per rank, consecutive from 0 and covering the
/// vector are a caller's bug, reported rather than sliced out of bounds.
fn check_bounds(rank: usize, len: usize, bounds: &[Range<usize>], world: usize) -> Result<()> {
    let consecutive = bounds.windows(2).all(|w| w[0].end == w[1].start);
    let covers =
        bounds.first().is_some_and(|b| b.start == 0) && bounds.last().is_some_and(|b| b.end == len);
    if bounds.len() == world && consecutive && covers {
        return Ok(());
    }
    Err(DistError::Protocol {
        rank,
        from: rank,
        what: format!("slices {bounds:?} that do not cover a vector of {len} in {world} parts"),
    })
}

/// Rank `root` receives every rank's `mine` (rank j's of `lens[j]` bytes;
/// its own copied), in rank order; the other ranks send theirs and get an
/// empty list. A sharded optimizer's moments brought to the rank that
/// writes the checkpoint.
pub fn gather_to_root(
    transport: &mut dyn Transport,
    tag: u16,
    root: usize,
    mine: &[u8],
    lens: &[usize],
    deadline: Instant,
    during: &str,
) -> Result<Vec<Vec<u8>>> {
    let (rank, world) = (transport.rank(), transport.world());
    if lens.len() != world || lens.get(rank) != Some(&mine.len()) {
        return Err(DistError::Protocol {
            rank,
            from: rank,
            what: format!(
                "a gather of {} bytes where {lens:?} were agreed",
                mine.len()
            ),
        });
    }
    if rank != root {
        transport.exchange(tag, &[(root, mine)], &mut [], deadline, during)?;
        return Ok(Vec::new());
    }
    let mut records: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0u8; n]).collect();
    records[rank].copy_from_slice(mine);
    let mut recvs: Vec<(usize, &mut [u8])> = records
        .iter_mut()
        .enumerate()
        .filter(|&(k, _)| k != rank)
        .map(|(k, r)| (k, r.as_mut_slice()))
        .collect();
    transport.exchange(tag, &[], &mut recvs, deadline, during)?;
    Ok(records)
}

/// Every rank's `mine`, in rank order (ours included). Every rank sends a
/// record of the same length; another length is a protocol error naming
/// the rank.
pub fn all_gather(
    transport: &mut dyn Transport,
    tag: u16,
    mine: &[u8],
    deadline: Instant,
    during: &str,
) -> Result<Vec<Vec<u8>>> {
    let (rank, world) = (transport.rank(), transport.world());
    let mut records: Vec<Vec<u8>> = (0..world).map(|_| vec![0u8; mine.len()]).collect();
    records[rank].copy_from_slice(mine);
    let sends: Vec<(usize, &[u8])> = (0..world)
        .filter(|&j| j != rank)
        .map(|j| (j, mine))
        .collect();
    let mut recvs: Vec<(usize, &mut [u8])> = records
        .iter_mut()
        .enumerate()
        .filter(|&(k, _)| k != rank)
        .map(|(k, r)| (k, r.as_mut_slice()))
        .collect();
    transport.exchange(tag, &sends, &mut recvs, deadline, during)?;
    Ok(records)
}

/// Fails unless every rank gave the same record: the check at start that
/// the ranks run the same config, model and data (their fingerprints).
pub fn require_equal(
    transport: &mut dyn Transport,
    tag: u16,
    what: &str,
    mine: &[u8],
    deadline: Instant,
) -> Result<()> {
    let rank = transport.rank();
    // Records of different lengths would fail the exchange itself: send a
    // fixed-length digest instead of the record.
    let digest = fnv1a(mine).to_le_bytes();
    let all = all_gather(transport, tag, &digest, deadline, what)?;
    match all.iter().position(|d| d != &all[0]) {
        None => Ok(()),
        Some(k) => Err(DistError::Protocol {
            rank,
            from: k,
            what: format!("a {what} that differs from rank 0's"),
        }),
    }
}

/// FNV-1a, 64 bits: a fingerprint's digest (not a security boundary).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
