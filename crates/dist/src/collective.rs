//! The collectives, each a few `exchange` calls: the ordered all-reduce
//! of f32 vectors (gradients) and the all-gather of small records.

use std::time::Instant;

use crate::{DistError, Result, Transport};

/// The bounds of rank `j`'s slice of a vector of `len` values in a world
/// of `world`: equal parts, the remainder spread over the first slices.
pub fn slice_of(len: usize, world: usize, j: usize) -> std::ops::Range<usize> {
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
    let (rank, world) = (transport.rank(), transport.world());
    if world <= 1 {
        return Ok(());
    }
    let len = data.len();
    let own = slice_of(len, world, rank);
    let part = own.len();
    scratch.clear();
    scratch.resize(part * world, 0.0);
    // Reduce-scatter: slice j to rank j; every rank's copy of ours into
    // scratch[k * part ..], ours included, so the sum can run in rank order.
    {
        let sends: Vec<(usize, &[u8])> = (0..world)
            .filter(|&j| j != rank)
            .map(|j| (j, bytemuck::cast_slice(&data[slice_of(len, world, j)])))
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
    let sum = &mut data[own.clone()];
    sum.copy_from_slice(&scratch[..part]);
    for k in 1..world {
        let copy = &scratch[k * part..(k + 1) * part];
        sum.iter_mut().zip(copy).for_each(|(s, &v)| *s += v);
    }
    // All-gather: our sum to every rank, theirs into their slices.
    let mut parts: Vec<&mut [f32]> = Vec::with_capacity(world);
    let mut rest = data;
    for j in 0..world {
        let take = slice_of(len, world, j).len();
        let (head, tail) = rest.split_at_mut(take);
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
