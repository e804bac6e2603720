//! The GPU learner's part in a data-parallel run: the ranks over NCCL.
//!
//! `NcclTransport` is one rank's link: a `headroom_dist::Transport` whose
//! host exchanges (the step records, the checks at start, the buffers'
//! mean) travel through small device buffers, and whose communicator the
//! learner also uses for the gradients, device to device.
//!
//! Per step (`CudaRanks::reduce`), each trainable group's f32 gradients
//! (kept multiplied by the loss scale, which is the same on every rank)
//! are summed over the ranks on the device, in rank order, as the CPU's
//! all-reduce sums them (`NcclComm::reduce_in_rank_order`: a grouped NCCL
//! exchange of slices on the communication stream, our rank-ordered sum
//! kernel on the compute stream, `ncclAllGather`, events between the two
//! streams). So the reduced gradients are the same bits on every rank and
//! in every run;
//! the fused AdamW then checks for overflow and clips on the same values
//! everywhere, and every rank applies or skips the step alike.
//!
//! The step then waits for the reduction and the ranks exchange one
//! record each (`ranks::agree_on_step`: failure, out of memory, the loss
//! and correct count, a stop request) before the optimizer is queued, so
//! that a rank that failed part-way (it sends zeros, never leaving a peer
//! waiting) makes every rank undo the step, as on the CPU. That wait, and
//! the buffers' mean after each applied step, make a ranked step
//! synchronous: no CUDA graph, no step queued behind another.
//!
//! Not yet: the buckets overlapped with backward (the whole reduction
//! follows backward), ZeRO-1, dropout (each rank would draw the same
//! masks; refused at start for N > 1).
//!
//! Memory: two device copies of the trainable gradients (the padded
//! slices and the received copies of this rank's slice), made once.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use headroom_dist::collective::all_reduce_ordered;
use headroom_dist::{DistError, Transport};
use headroom_model::cuda::nccl::{NcclComm, NcclId, RankScratch};
use headroom_model::cuda::{CudaBackend, CudaNetwork, ParamGroup};

use super::cuda;
use crate::ranks::{Ranks, BUFFERS_TAG};
use crate::{PipelineError, Result};

/// One rank's NCCL link, shared by the host exchanges and the learner.
pub struct NcclTransport {
    comm: Arc<Mutex<NcclComm>>,
    rank: usize,
    world: usize,
}

impl NcclTransport {
    /// Joins `world` ranks as `rank` on GPU `ordinal` with the id rank 0
    /// made (`NcclId::new`); blocks until every rank has joined.
    pub fn join(ordinal: usize, rank: usize, world: usize, id: &NcclId) -> Result<Self> {
        let comm = cuda(NcclComm::init(ordinal, rank, world, id))?;
        Ok(Self {
            comm: Arc::new(Mutex::new(comm)),
            rank,
            world,
        })
    }

    fn comm(&self) -> Arc<Mutex<NcclComm>> {
        Arc::clone(&self.comm)
    }
}

fn lock(comm: &Mutex<NcclComm>) -> std::result::Result<MutexGuard<'_, NcclComm>, DistError> {
    comm.lock()
        .map_err(|_| DistError::Thread("a thread panicked while it used NCCL".into()))
}

impl Transport for NcclTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    /// NCCL delivers the messages between two ranks in the order they
    /// were queued, and the protocol never has two exchanges in flight, so
    /// the tag is not needed on the wire.
    fn exchange(
        &mut self,
        _tag: u16,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
        deadline: Instant,
        during: &str,
    ) -> headroom_dist::Result<()> {
        let started = Instant::now();
        let missing: Vec<usize> = recvs.iter().map(|r| r.0).collect();
        let mut comm = lock(&self.comm)?;
        comm.exchange_host(sends, recvs, deadline).map_err(|e| {
            if Instant::now() >= deadline {
                DistError::Timeout {
                    rank: self.rank,
                    missing,
                    during: during.to_string(),
                    waited_s: started.elapsed().as_secs_f64(),
                }
            } else {
                DistError::Device(format!("rank {} during {during}: {e}", self.rank))
            }
        })
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
}

pub(crate) struct CudaRanks {
    pub ranks: Ranks,
    comm: Arc<Mutex<NcclComm>>,
    /// One per trainable group with values (decay, no decay).
    scratch: Vec<RankScratch>,
}

impl CudaRanks {
    /// The ranks of `ranks`, whose transport must be NCCL's, for
    /// `network`'s trainable groups.
    pub fn new(be: &CudaBackend, network: &mut CudaNetwork, ranks: Ranks) -> Result<Self> {
        let refuse = |reason: String| PipelineError::Stage {
            stage: "ranks",
            reason,
        };
        if ranks.shard_optimizer && ranks.world > 1 {
            return Err(refuse(
                "train.shard_optimizer (ZeRO-1) is not built for GPU ranks yet; leave it off"
                    .into(),
            ));
        }
        if ranks.world > 1 && network.has_dropout() {
            return Err(refuse(
                "a model with dropout cannot train on several GPU ranks yet (each rank would \
                 draw the same masks); remove the dropout layers or train on one GPU"
                    .into(),
            ));
        }
        let comm =
            {
                let mut transport = ranks.lock()?;
                match transport
                    .as_any_mut()
                    .and_then(|any| any.downcast_mut::<NcclTransport>())
                {
                    Some(nccl) => nccl.comm(),
                    None => return Err(refuse(
                        "GPU ranks talk over NCCL: start them with `cargo xtask train --devices \
                         N` (ranks over MPI train on CPUs)"
                            .into(),
                    )),
                }
            };
        let mut scratch = Vec::new();
        for group in network.groups().iter().filter(|g| !g.grad.is_empty()) {
            scratch.push(cuda(RankScratch::new(be, group.grad.len(), ranks.world))?);
        }
        Ok(Self {
            ranks,
            comm,
            scratch,
        })
    }

    fn comm(&self) -> Result<MutexGuard<'_, NcclComm>> {
        Ok(lock(&self.comm)?)
    }

    /// Queues the rank-ordered sum of every group's gradients over the
    /// ranks, written back into the gradients; `wait` for it.
    pub fn reduce(&mut self, be: &CudaBackend, groups: &mut [ParamGroup]) -> Result<()> {
        let mut comm = lock(&self.comm)?;
        let mut scratch = self.scratch.iter_mut();
        for group in groups.iter_mut().filter(|g| !g.grad.is_empty()) {
            let Some(scratch) = scratch.next() else {
                return Err(PipelineError::Stage {
                    stage: "ranks",
                    reason: "the model has more trainable groups than when the ranks joined".into(),
                });
            };
            cuda(comm.reduce_in_rank_order(be, &mut group.grad.slice, scratch))?;
        }
        Ok(())
    }

    /// Waits for the communication queued so far (bounded by the ranks'
    /// timeout: a silent peer is an error, never a hang).
    pub fn wait(&self) -> Result<()> {
        let deadline = self.ranks.deadline();
        cuda(self.comm()?.wait(deadline, "the gradients' reduction"))
    }

    /// Every buffer (batch norm's running statistics) becomes the ranks'
    /// mean, the same bits on every rank: the CPU ranks' arithmetic, on
    /// the host.
    pub fn average_buffers(&self, be: &CudaBackend, network: &mut CudaNetwork) -> Result<()> {
        let buffers = cuda(network.read_buffers(be))?;
        let total: usize = buffers.iter().map(Vec::len).sum();
        if total == 0 || self.ranks.world == 1 {
            return Ok(());
        }
        let mut flat = Vec::with_capacity(total);
        for b in &buffers {
            flat.extend_from_slice(b);
        }
        {
            let mut t = self.ranks.lock()?;
            all_reduce_ordered(
                t.as_mut(),
                BUFFERS_TAG,
                &mut flat,
                &mut Vec::new(),
                self.ranks.deadline(),
                "the mean of the buffers (running statistics)",
            )?;
        }
        let world = self.ranks.world as f32;
        let mut at = 0;
        let mut means = Vec::with_capacity(buffers.len());
        for b in &buffers {
            means.push(flat[at..at + b.len()].iter().map(|s| s / world).collect());
            at += b.len();
        }
        cuda(network.write_buffers(be, &means))
    }
}

impl super::CudaLearner {
    /// A ranked step's outcome as every rank agrees on it, before the
    /// optimizer is queued: the gradients summed over the ranks, then one
    /// record each. A rank whose forward or backward failed sends zeros
    /// (no peer waits for it) and every rank then fails the step alike: an
    /// error naming the rank, or the first rank's out-of-memory refusal,
    /// which every rank's memory policy then follows. Returns the shares
    /// and the global batch's loss and correct count.
    pub(super) fn agree_with_ranks(
        &mut self,
        local: Result<Vec<f32>>,
    ) -> Result<(Vec<f32>, (f64, u64))> {
        use crate::ranks::{agree_on_step, Refusal, StepRecord};
        if local.is_err() {
            self.network.clear_saved();
            cuda(self.network.zero_grad(&self.be))?;
        }
        let Some(ranks) = self.ranks.as_mut() else {
            return Err(PipelineError::Stage {
                stage: "ranks",
                reason: "a ranked step without ranks".into(),
            });
        };
        ranks.reduce(&self.be, self.network.groups_mut())?;
        ranks.wait()?;
        cuda(self.be.synchronize())?;
        let (loss, correct) = match &local {
            Ok(shares) => {
                let losses = cuda(self.be.download(&self.records.losses.slice))?;
                let corrects = cuda(self.be.download(&self.records.corrects.slice))?;
                let loss: f64 = losses
                    .iter()
                    .zip(shares)
                    .map(|(&l, &s)| l as f64 * s as f64)
                    .sum();
                let correct = corrects.iter().take(shares.len()).map(|&c| c as u64).sum();
                (loss, correct)
            }
            Err(_) => (0.0, 0),
        };
        let (status, refusal) = match &local {
            Ok(_) if loss.is_finite() => (StepRecord::OK, None),
            Ok(_) => (StepRecord::NON_FINITE, None),
            Err(e) => match Refusal::of(e) {
                Some(r) => (StepRecord::OUT_OF_MEMORY, Some(r)),
                None => (StepRecord::FAILED, None),
            },
        };
        let agreed = agree_on_step(
            &ranks.ranks,
            StepRecord {
                status,
                stop: ranks.ranks.stop_requested(),
                loss: if loss.is_finite() { loss } else { 0.0 },
                correct,
                refusal,
            },
        )?;
        let rank = ranks.ranks.rank;
        if let Some(k) = agreed.failed {
            return Err(super::super::cpu::failure_of_a_rank(
                k,
                local.err(),
                "this step",
            ));
        }
        if let Some((k, refusal)) = agreed.out_of_memory {
            if k != rank {
                tracing::warn!("rank {k} ran out of memory in this step; every rank follows it");
            }
            return Err(refusal.error(&super::super::Learner::memory_stats(self)));
        }
        // A loss that is not finite on a rank leaves gradients that are not
        // either, in the sum every rank holds: the fused AdamW skips the step
        // on every rank alike.
        Ok((local?, (agreed.loss, agreed.correct)))
    }
}
