//! NCCL through cudarc's `nccl` module: one rank's communicator, on a
//! stream of its own (the communication stream), for the data-parallel
//! ranks of GPUs.
//!
//! Only point-to-point sends and receives in groups and the all-gather
//! are used, never NCCL's own reductions: NCCL does not promise the order
//! in which it adds the ranks' values, and the ranks' gradients must sum
//! to the same bits on every rank and in every run, in rank order, as on
//! the CPU (`headroom_dist::collective`). The reduce-scatter is therefore
//! a grouped exchange of slices followed by our own rank-ordered sum
//! kernel (`ops::collective`), and the gather is `ncclAllGather` (a copy,
//! exact whatever its order).
//!
//! A real NCCL waits forever for a peer that died; every wait here polls
//! an event until a deadline, then aborts the communicator and says so,
//! so a rank never hangs. The raw communicator is cudarc's
//! `nccl::result` layer (its safe `Comm` hides the handle that the
//! asynchronous-error query and the abort need).
//!
//! cudarc loads `libnccl.so` by bare name. NCCL's pip wheels (what
//! PyTorch installs) hold only `libnccl.so.2`, a name cudarc never asks
//! for: `libs::nccl_library` finds such a file so that the launcher of
//! `train --devices N` can put a `libnccl.so` beside it on its ranks'
//! library path.
//!
//! The gradients go bucket by bucket (`reduce_bucket`), each on the
//! communication stream after an event of the compute stream, so that a
//! bucket that backward has finished is reduced while backward goes on.
//!
//! Memory: the host exchange (small records) stages its messages through
//! device buffers allocated per exchange; the gradient path needs two
//! copies of what it reduces (`RankScratch`, padded to N slices per
//! bucket), made once by the caller.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{result, sys};

use super::backend::{CudaBackend, DeviceBuffer};
use super::error::Context;
use super::{libs, ops, CudaError, CudaResult};

/// The bytes of an NCCL unique id: rank 0 makes one, every rank joins
/// with it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId(pub [u8; 128]);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclId({}…)", &self.to_hex()[..16])
    }
}

impl NcclId {
    /// A fresh id from NCCL (`ncclGetUniqueId`; on a real NCCL this opens
    /// the bootstrap socket the other ranks connect to).
    pub fn new() -> CudaResult<Self> {
        libs::ensure_nccl()?;
        let id = result::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", e))?;
        let mut bytes = [0u8; 128];
        for (b, c) in bytes.iter_mut().zip(id.internal.iter()) {
            *b = *c as u8;
        }
        Ok(Self(bytes))
    }

    /// 256 hex digits, to pass through the environment or a file.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn from_hex(text: &str) -> CudaResult<Self> {
        let text = text.trim();
        let bad = || CudaError::Nccl {
            op: "the NCCL id",
            detail: format!(
                "expected 256 hex digits, got {} characters ({:?}…)",
                text.len(),
                text.chars().take(16).collect::<String>()
            ),
        };
        if text.len() != 256 || !text.is_ascii() {
            return Err(bad());
        }
        let mut bytes = [0u8; 128];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(Self(bytes))
    }
}

fn nccl_error(op: &'static str, e: result::NcclError) -> CudaError {
    CudaError::Nccl {
        op,
        detail: format!("{e:?}"),
    }
}

/// One rank's NCCL communicator and its stream.
pub struct NcclComm {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    comm: sys::ncclComm_t,
    rank: usize,
    world: usize,
    aborted: bool,
}

// SAFETY: an ncclComm_t may be used from any thread as long as calls on it
// are not concurrent; every call here takes `&mut self` or is a read of
// plain fields, and the pipeline holds the communicator behind a mutex.
unsafe impl Send for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclComm(rank {} of {})", self.rank, self.world)
    }
}

/// Sends and receives of one grouped exchange on the device: (peer,
/// device address, element count) of f32 values.
pub struct DeviceMessages<'a> {
    pub sends: &'a [(usize, u64, usize)],
    pub recvs: &'a [(usize, u64, usize)],
}

impl NcclComm {
    /// Joins the world of `world` ranks as `rank`, on GPU `ordinal`,
    /// blocking until every rank has joined (NCCL's own bootstrap over the
    /// id: no MPI needed on one machine).
    pub fn init(ordinal: usize, rank: usize, world: usize, id: &NcclId) -> CudaResult<Self> {
        if world == 0 || rank >= world {
            return Err(CudaError::Nccl {
                op: "ncclCommInitRank",
                detail: format!("rank {rank} of a world of {world}"),
            });
        }
        libs::ensure_nccl()?;
        let ctx = CudaContext::new(ordinal).during("cuDevicePrimaryCtxRetain (NCCL)")?;
        // SAFETY: set before any buffer of this context exists. The
        // backend orders its streams itself, with events where needed (as
        // `stream_waits` does here); cudarc's per-buffer events would also
        // make the compute stream wait on a reduction it need not.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().during("cuStreamCreate (communication)")?;
        let mut internal = [0 as std::ffi::c_char; 128];
        for (c, b) in internal.iter_mut().zip(id.0.iter()) {
            *c = *b as std::ffi::c_char;
        }
        let unique = sys::ncclUniqueId { internal };
        let mut comm = std::mem::MaybeUninit::<sys::ncclComm_t>::uninit();
        ctx.bind_to_thread().during("cuCtxSetCurrent (NCCL)")?;
        // SAFETY: `comm` is written by ncclCommInitRank before it is read;
        // rank < world was checked, both fit an i32 (a world of 2^31 GPUs
        // is refused by the conversion).
        let comm = unsafe {
            result::comm_init_rank(
                comm.as_mut_ptr(),
                i32::try_from(world).unwrap_or(i32::MAX),
                unique,
                i32::try_from(rank).unwrap_or(i32::MAX),
            )
            .map_err(|e| nccl_error("ncclCommInitRank", e))?;
            comm.assume_init()
        };
        Ok(Self {
            ctx,
            stream,
            comm,
            rank,
            world,
            aborted: false,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// The communication stream: every NCCL call of this rank runs on it.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn live(&self, op: &'static str) -> CudaResult<()> {
        if self.aborted {
            return Err(CudaError::Nccl {
                op,
                detail: "the communicator was aborted after an earlier failure".into(),
            });
        }
        self.ctx.bind_to_thread().during("cuCtxSetCurrent (NCCL)")
    }

    /// Queues one grouped exchange of f32 slices on the communication
    /// stream (all sends and receives complete together, so two ranks
    /// exchanging never deadlock). Returns at once; `wait` for it.
    ///
    /// # Safety
    /// Every address must hold its count of f32 values on this rank's
    /// device, and stay valid (and, for receives, unread and unwritten by
    /// other work) until the communication stream has passed the exchange.
    pub unsafe fn exchange_device(&mut self, messages: DeviceMessages<'_>) -> CudaResult<()> {
        self.live("ncclSend/ncclRecv")?;
        let stream = self.stream.cu_stream() as sys::cudaStream_t;
        result::group_start().map_err(|e| nccl_error("ncclGroupStart", e))?;
        let mut failed = None;
        for &(peer, at, count) in messages.sends {
            if failed.is_none() {
                // SAFETY: the caller's contract above; the peer is a rank of
                // this world (checked by NCCL, an error otherwise).
                failed = unsafe {
                    result::send(
                        at as *const std::ffi::c_void,
                        count,
                        sys::ncclDataType_t::ncclFloat32,
                        peer as i32,
                        self.comm,
                        stream,
                    )
                }
                .err()
                .map(|e| nccl_error("ncclSend", e));
            }
        }
        for &(peer, at, count) in messages.recvs {
            if failed.is_none() {
                // SAFETY: as for the sends.
                failed = unsafe {
                    result::recv(
                        at as *mut std::ffi::c_void,
                        count,
                        sys::ncclDataType_t::ncclFloat32,
                        peer as i32,
                        self.comm,
                        stream,
                    )
                }
                .err()
                .map(|e| nccl_error("ncclRecv", e));
            }
        }
        // The group is always closed, even after a failed call in it.
        let ended = result::group_end().map_err(|e| nccl_error("ncclGroupEnd", e));
        match (failed, ended) {
            (Some(e), _) | (None, Err(e)) => Err(e),
            (None, Ok(_)) => Ok(()),
        }
    }

    /// In place: rank r's `count` values at `buffer[r·count..]` go to
    /// every rank (`ncclAllGather`), queued on the communication stream.
    pub fn all_gather_in_place(
        &mut self,
        buffer: &mut CudaSlice<f32>,
        count: usize,
    ) -> CudaResult<()> {
        self.live("ncclAllGather")?;
        if buffer.len() < count * self.world {
            return Err(CudaError::shape(
                "ncclAllGather",
                format!("{} values ({count} per rank)", count * self.world),
                buffer.len().to_string(),
            ));
        }
        let stream = self.stream.clone();
        let (base, _sync) = buffer.device_ptr_mut(&stream);
        // SAFETY: the buffer holds world · count values (checked above) and
        // lives until the caller has waited for the stream.
        unsafe { self.all_gather_at(base, count) }
    }

    /// In place at `base`: rank r's `count` f32 values at `base + r·count`
    /// go to every rank, on the communication stream.
    ///
    /// # Safety
    /// `base` must hold `world · count` f32 values on this rank's device,
    /// valid until the communication stream has passed the gather.
    unsafe fn all_gather_at(&mut self, base: u64, count: usize) -> CudaResult<()> {
        self.live("ncclAllGather")?;
        let own = base + (self.rank * count * 4) as u64;
        // SAFETY: in place as NCCL defines it (sendbuff = recvbuff + rank ·
        // count), within the caller's buffer.
        unsafe {
            result::all_gather(
                own as *const std::ffi::c_void,
                base as *mut std::ffi::c_void,
                count,
                sys::ncclDataType_t::ncclFloat32,
                self.comm,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| nccl_error("ncclAllGather", e))?;
        Ok(())
    }

    /// Exchanges host bytes (the ranks' small records) through device
    /// buffers, and waits for them until `deadline`. Receives of a length
    /// other than the peer sent are a protocol error NCCL reports.
    pub fn exchange_host(
        &mut self,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
        deadline: Instant,
    ) -> CudaResult<()> {
        self.live("ncclSend/ncclRecv")?;
        let stream = self.stream.clone();
        // f32 words: NCCL counts elements, and every transfer here is f32.
        let words = |bytes: usize| bytes.div_ceil(4).max(1);
        let mut send_buffers = Vec::with_capacity(sends.len());
        for (_, bytes) in sends {
            let mut padded = vec![0u8; words(bytes.len()) * 4];
            padded[..bytes.len()].copy_from_slice(bytes);
            let values: Vec<f32> = padded
                .chunks_exact(4)
                .map(|w| f32::from_bits(u32::from_le_bytes([w[0], w[1], w[2], w[3]])))
                .collect();
            send_buffers.push(
                stream
                    .clone_htod(&values)
                    .during("cuMemcpyHtoDAsync (NCCL)")?,
            );
        }
        let mut recv_buffers = Vec::with_capacity(recvs.len());
        for (_, bytes) in recvs.iter() {
            recv_buffers.push(
                stream
                    .alloc_zeros::<f32>(words(bytes.len()))
                    .during("cuMemAllocAsync (NCCL)")?,
            );
        }
        let send_list: Vec<(usize, u64, usize)> = sends
            .iter()
            .zip(&send_buffers)
            .map(|((peer, _), buf)| (*peer, buf.device_ptr(&stream).0, buf.len()))
            .collect();
        let recv_list: Vec<(usize, u64, usize)> = recvs
            .iter()
            .zip(&mut recv_buffers)
            .map(|((peer, _), buf)| {
                let len = buf.len();
                (*peer, buf.device_ptr_mut(&stream).0, len)
            })
            .collect();
        // SAFETY: every address is a live buffer of this stream of exactly
        // its count of f32 values, kept until the wait below.
        unsafe {
            self.exchange_device(DeviceMessages {
                sends: &send_list,
                recvs: &recv_list,
            })
        }?;
        let mut host = Vec::with_capacity(recv_buffers.len());
        for buf in &recv_buffers {
            host.push(stream.clone_dtoh(buf).during("cuMemcpyDtoHAsync (NCCL)")?);
        }
        self.wait(deadline, "exchanging records")?;
        for ((_, out), values) in recvs.iter_mut().zip(&host) {
            let bytes: Vec<u8> = values
                .iter()
                .flat_map(|v| v.to_bits().to_le_bytes())
                .collect();
            let len = out.len();
            out.copy_from_slice(&bytes[..len]);
        }
        Ok(())
    }

    /// An event at the end of the communication stream's queued work.
    pub fn record(&self) -> CudaResult<CudaEvent> {
        self.stream
            .record_event(None)
            .during("cuEventRecord (communication)")
    }

    /// Waits until the communication stream has done its queued work, or
    /// fails at `deadline` (aborting the communicator, so that no kernel of
    /// it waits on), or at NCCL's first asynchronous error.
    pub fn wait(&mut self, deadline: Instant, during: &str) -> CudaResult<()> {
        let done = self.record()?;
        let started = Instant::now();
        loop {
            if done
                .try_is_complete()
                .during("cuEventQuery (communication)")?
            {
                return self.check_async(during);
            }
            self.check_async(during)?;
            if Instant::now() >= deadline {
                self.abort();
                return Err(CudaError::Nccl {
                    op: "waiting for the other ranks",
                    detail: format!(
                        "rank {} of {} waited {:.0} s during {during}: a peer died, hangs or runs \
                         a different step",
                        self.rank,
                        self.world,
                        started.elapsed().as_secs_f64()
                    ),
                });
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    fn check_async(&mut self, during: &str) -> CudaResult<()> {
        if self.aborted {
            return Ok(());
        }
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: the communicator is live (not aborted) and `state` is a
        // valid out-pointer.
        let rc = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
        let bad = [rc, state].into_iter().find(|r| {
            !matches!(
                r,
                sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
            )
        });
        match bad {
            None => Ok(()),
            Some(code) => {
                self.abort();
                Err(CudaError::Nccl {
                    op: "NCCL",
                    detail: format!(
                        "rank {} of {}: {code:?} during {during} (a peer failed or the ranks \
                         disagree)",
                        self.rank, self.world
                    ),
                })
            }
        }
    }

    /// Ends the communicator at once (a failure: pending work is dropped,
    /// nothing waits on a peer any more).
    pub fn abort(&mut self) {
        if self.aborted {
            return;
        }
        self.aborted = true;
        // SAFETY: the communicator is live and never used again (`aborted`).
        // An abort that fails leaves nothing to undo: the communicator is
        // given up either way, and the process reports the failure that
        // led here.
        let _ = unsafe { result::comm_abort(self.comm) };
    }
}

/// One bucket of a buffer reduced over the ranks: values `start ..
/// start + len`, cut into one slice of `slice` values per rank (the last
/// padded with zeros), at `at` in the scratch buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bucket {
    pub start: usize,
    pub len: usize,
    slice: usize,
    at: usize,
}

/// What reducing one buffer of `len` values over the ranks needs, bucket
/// by bucket: each bucket's values padded to N equal slices (the padding
/// stays zero) and every rank's copy of this rank's slice, in rank order.
pub struct RankScratch {
    len: usize,
    buckets: Vec<Bucket>,
    padded: DeviceBuffer<f32>,
    copies: DeviceBuffer<f32>,
}

impl RankScratch {
    /// Buckets of `bucket_values` values (the last shorter) over `world`
    /// ranks.
    pub fn new(
        be: &CudaBackend,
        len: usize,
        world: usize,
        bucket_values: usize,
    ) -> CudaResult<Self> {
        let (world, size) = (world.max(1), bucket_values.max(1));
        let mut buckets = Vec::new();
        let mut at = 0;
        let mut start = 0;
        while start < len {
            let n = size.min(len - start);
            let slice = n.div_ceil(world);
            buckets.push(Bucket {
                start,
                len: n,
                slice,
                at,
            });
            at += slice * world;
            start += n;
        }
        Ok(Self {
            len,
            buckets,
            padded: be.alloc_zeros::<f32>(at.max(1))?,
            copies: be.alloc_zeros::<f32>(at.max(1))?,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }
}

/// `later` waits for what `earlier` has queued so far.
pub fn stream_waits(earlier: &CudaStream, later: &CudaStream) -> CudaResult<()> {
    let event = earlier.record_event(None).during("cuEventRecord (ranks)")?;
    later.wait(&event).during("cuStreamWaitEvent (ranks)")
}

impl NcclComm {
    /// Queues, on the communication stream after what the compute stream
    /// has queued so far, the sum over the ranks of bucket `k` of
    /// `values`, in rank order, written back into `values`: the bucket is
    /// copied into its padded slices; a grouped exchange sends slice p to
    /// rank p and receives every peer's copy of this rank's slice;
    /// `ops::rank_sum_on` adds the copies in rank order ((r0 + r1) + r2) …;
    /// `ncclAllGather` gives every rank every sum; the sums are copied
    /// back. The same bits on every rank and in every run, whatever the
    /// buckets. Nothing on the compute stream waits for it until
    /// `join_compute`; what backward still writes must lie outside the
    /// bucket.
    pub fn reduce_bucket(
        &mut self,
        be: &CudaBackend,
        values: &mut CudaSlice<f32>,
        scratch: &mut RankScratch,
        k: usize,
    ) -> CudaResult<()> {
        let (rank, world) = (self.rank, self.world);
        let Some(&Bucket {
            start,
            len,
            slice,
            at,
        }) = scratch.buckets.get(k)
        else {
            return Err(CudaError::shape(
                "reduce_bucket",
                format!("a bucket below {}", scratch.buckets.len()),
                k.to_string(),
            ));
        };
        if values.len() != scratch.len {
            return Err(CudaError::shape(
                "reduce_bucket",
                format!("{} values", scratch.len),
                values.len().to_string(),
            ));
        }
        self.live("reduce_bucket")?;
        let comm = Arc::clone(&self.stream);
        stream_waits(be.compute_stream(), &comm)?;
        let own = at + rank * slice..at + (rank + 1) * slice;
        comm.memcpy_dtod(
            &values.slice(start..start + len),
            &mut scratch.padded.slice.slice_mut(at..at + len),
        )
        .during("cuMemcpyDtoDAsync (gradients)")?;
        comm.memcpy_dtod(
            &scratch.padded.slice.slice(own.clone()),
            &mut scratch.copies.slice.slice_mut(own.clone()),
        )
        .during("cuMemcpyDtoDAsync (own slice)")?;
        let padded_at = scratch.padded.slice.device_ptr(&comm).0;
        let copies_at = scratch.copies.slice.device_ptr_mut(&comm).0;
        let row = |base: u64, p: usize| base + ((at + p * slice) * 4) as u64;
        let peers: Vec<usize> = (0..world).filter(|&p| p != rank).collect();
        let sends: Vec<(usize, u64, usize)> = peers
            .iter()
            .map(|&p| (p, row(padded_at, p), slice))
            .collect();
        let recvs: Vec<(usize, u64, usize)> = peers
            .iter()
            .map(|&p| (p, row(copies_at, p), slice))
            .collect();
        // SAFETY: every address is a slice of `slice` values inside the
        // bucket's `slice · world` values of `padded` or `copies`, which the
        // caller keeps; everything that touches them is on this stream, in
        // order.
        unsafe {
            self.exchange_device(DeviceMessages {
                sends: &sends,
                recvs: &recvs,
            })
        }?;
        ops::rank_sum_on(
            be,
            &comm,
            &scratch.copies.slice.slice(at..at + slice * world),
            world,
            slice,
            &mut scratch.padded.slice.slice_mut(own),
        )?;
        // SAFETY: the bucket's padded values, `slice · world` of them from
        // `row(padded_at, 0)`, live in `scratch` as above.
        unsafe { self.all_gather_at(row(padded_at, 0), slice) }?;
        comm.memcpy_dtod(
            &scratch.padded.slice.slice(at..at + len),
            &mut values.slice_mut(start..start + len),
        )
        .during("cuMemcpyDtoDAsync (sums)")
    }

    /// The compute stream waits for every reduction queued so far.
    pub fn join_compute(&self, be: &CudaBackend) -> CudaResult<()> {
        stream_waits(&self.stream, be.compute_stream())
    }

    /// Every bucket of `values` reduced (`reduce_bucket`), and the compute
    /// stream made to wait for them.
    pub fn reduce_in_rank_order(
        &mut self,
        be: &CudaBackend,
        values: &mut CudaSlice<f32>,
        scratch: &mut RankScratch,
    ) -> CudaResult<()> {
        for k in 0..scratch.buckets.len() {
            self.reduce_bucket(be, values, scratch, k)?;
        }
        self.join_compute(be)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // Abort rather than destroy: destroy waits for pending work, which
        // after a peer's failure never ends; at a normal end nothing is
        // pending and the two are the same.
        self.abort();
    }
}
