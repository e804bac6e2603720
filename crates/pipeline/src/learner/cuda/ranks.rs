//! The GPU learner's part in a data-parallel run: the ranks over NCCL.
//!
//! `NcclTransport` is one rank's link: a `headroom_dist::Transport` whose
//! host exchanges (the step records, the checks at start, the buffers'
//! mean) travel through small device buffers, and whose communicator the
//! learner also uses for the gradients, device to device.
//!
//! Per step, each trainable group's f32 gradients (kept multiplied by the
//! loss scale, which is the same on every rank) are summed over the ranks
//! on the device, in rank order, as the CPU's all-reduce sums them, in
//! buckets of `distributed.bucket_mb`: during the last micro-batch's
//! backward, each top-level layer that backward passes finalises the
//! gradients above its floor (`CudaNetwork::backward_with`), and every
//! bucket so finished is queued on the communication stream
//! (`NcclComm::reduce_bucket`: an event of the compute stream, a grouped
//! NCCL exchange of slices, our rank-ordered sum kernel, `ncclAllGather`)
//! while the compute stream goes on with backward. Every rank queues the
//! buckets in one order, the order in which a whole backward finishes
//! them (`schedule`), never the order of their timing, and a rank that
//! failed part-way queues the rest (zeros): NCCL pairs each rank's calls
//! in the order they were made. So the reduced gradients are the same bits
//! on every rank and in every run, whatever the bucket size; the fused
//! AdamW then checks for overflow and clips on the same values
//! everywhere, and every rank applies or skips the step alike.
//!
//! The step then waits for the reduction and the ranks exchange one
//! record each (`ranks::agree_on_step`: failure, out of memory, the loss
//! and correct count, a stop request) before the optimizer is queued, so
//! that a rank that failed part-way makes every rank undo the step, as on
//! the CPU. That wait, and the buffers' mean after each applied step, make
//! a ranked step synchronous: no CUDA graph, no step queued behind
//! another.
//!
//! Dropout: rank r draws its masks r·M forwards ahead of the counters
//! (M micro-batches a rank), and every rank's counters end the step
//! world·M on (`CudaNetwork::advance_dropout`), so N ranks draw one
//! process's masks, as on the CPU.
//!
//! Not yet: ZeRO-1 (refused at start for N > 1).
//!
//! Memory: two device copies of the trainable gradients (the padded
//! slices and the received copies of this rank's slice, per bucket), made
//! once.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use headroom_dist::collective::all_reduce_ordered;
use headroom_dist::{DistError, Transport};
use headroom_model::cuda::nccl::{NcclComm, NcclId, RankScratch};

use headroom_model::cuda::{CudaBackend, CudaError, CudaNetwork, Floor, ParamGroup};

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
    /// One per trainable group with values: (its index among the
    /// network's groups, its buckets' scratch).
    scratch: Vec<(usize, RankScratch)>,
    /// Every bucket, as (place in `scratch`, bucket), in the order all
    /// ranks reduce them: the order in which a whole backward finishes
    /// them (`schedule`), the same on every rank whatever the timing.
    order: Vec<(usize, usize)>,
    /// How many of `order` this step has queued.
    queued: usize,
    /// How many were queued before the latest `queue_final` call.
    before_latest: usize,
    /// The last step's (buckets queued while backward still had layers
    /// to run, buckets in all).
    pub last_step: (usize, usize),
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
        for (index, group) in network.groups().iter().enumerate() {
            if !group.grad.is_empty() {
                let buffers =
                    RankScratch::new(be, group.grad.len(), ranks.world, ranks.bucket_values);
                scratch.push((index, cuda(buffers)?));
            }
        }
        let starts: Vec<(usize, Vec<usize>)> = scratch
            .iter()
            .map(|(index, s)| (*index, s.buckets().iter().map(|b| b.start).collect()))
            .collect();
        let order = schedule(network.floors(), &starts);
        Ok(Self {
            ranks,
            comm,
            scratch,
            order,
            queued: 0,
            before_latest: 0,
            last_step: (0, 0),
        })
    }

    /// How many buckets each step reduces.
    pub fn bucket_count(&self) -> usize {
        self.order.len()
    }

    fn comm(&self) -> Result<MutexGuard<'_, NcclComm>> {
        Ok(lock(&self.comm)?)
    }

    /// Queues, in `order`, every bucket not yet queued this step that is
    /// final under `floor` (`CudaNetwork::backward_with`): reduced on the
    /// communication stream while backward goes on.
    pub fn queue_final(
        &mut self,
        be: &CudaBackend,
        groups: &mut [ParamGroup],
        floor: &Floor,
    ) -> headroom_model::cuda::CudaResult<()> {
        let mut comm = self.comm.lock().map_err(|_| CudaError::Nccl {
            op: "reduce_bucket",
            detail: "a thread panicked while it used NCCL".into(),
        })?;
        self.before_latest = self.queued;
        while let Some(&(place, k)) = self.order.get(self.queued) {
            let (index, scratch) = &mut self.scratch[place];
            if scratch.buckets()[k].start < floor[*index] {
                break;
            }
            comm.reduce_bucket(be, &mut groups[*index].grad.slice, scratch, k)?;
            self.queued += 1;
        }
        Ok(())
    }

    /// Queues every bucket this step has not (all of them, after a failed
    /// forward or backward: a peer waits for each), makes the compute
    /// stream wait for them, and starts the next step's count.
    pub fn queue_rest(&mut self, be: &CudaBackend, groups: &mut [ParamGroup]) -> Result<()> {
        // The backward's last call (its first layer's) finishes everything:
        // what was queued before it overlapped with backward.
        let early = self.before_latest.min(self.queued);
        cuda(self.queue_final(be, groups, &[0; 3]))?;
        self.last_step = (early, self.order.len());
        self.queued = 0;
        self.before_latest = 0;
        cuda(self.comm()?.join_compute(be))
    }

    /// The compute stream waits for the reductions queued so far (before
    /// it touches the gradients they read or write).
    pub fn join_compute(&self, be: &CudaBackend) -> Result<()> {
        cuda(self.comm()?.join_compute(be))
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
        use crate::ranks::{agree_on_step, StepRecord};
        let Some(ranks) = self.ranks.as_mut() else {
            return Err(PipelineError::Stage {
                stage: "ranks",
                reason: "a ranked step without ranks".into(),
            });
        };
        if local.is_err() {
            // The buckets queued before the failure still read and write
            // the gradients on the communication stream: they land first,
            // then the zeros, which the rest of the buckets send.
            self.network.clear_saved();
            ranks.join_compute(&self.be)?;
            cuda(self.network.zero_grad(&self.be))?;
        }
        ranks.queue_rest(&self.be, self.network.groups_mut())?;
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
        let (status, refusal) = StepRecord::status_of(&local, |_| loss.is_finite());
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

/// The order in which a whole backward finishes the buckets: after each
/// top-level layer, from the last, every bucket at or above the lowest
/// floor passed (`Floor`), group by group, each group's from its end;
/// then whatever is left. `groups`: (the group's index among the
/// network's, where each of its buckets starts); the result: (place in
/// `groups`, bucket).
fn schedule(floors: &[Floor], groups: &[(usize, Vec<usize>)]) -> Vec<(usize, usize)> {
    let mut next: Vec<Option<usize>> = groups
        .iter()
        .map(|(_, starts)| starts.len().checked_sub(1))
        .collect();
    let mut order = Vec::new();
    let mut take = |lowest: &Floor, order: &mut Vec<(usize, usize)>| {
        for (place, (index, starts)) in groups.iter().enumerate() {
            while let Some(k) = next[place] {
                if starts[k] < lowest[*index] {
                    break;
                }
                order.push((place, k));
                next[place] = k.checked_sub(1);
            }
        }
    };
    let mut lowest = [usize::MAX; 3];
    for floor in floors.iter().rev() {
        for (low, f) in lowest.iter_mut().zip(floor) {
            *low = (*low).min(*f);
        }
        take(&lowest, &mut order);
    }
    take(&[0; 3], &mut order);
    order
}

#[cfg(test)]
mod tests {
    use super::schedule;

    #[test]
    fn buckets_go_in_the_order_backward_finishes_them_each_once() {
        // Three layers: floors rise through both groups (decay 0, no decay 1).
        let floors = [[0, 0, 0], [100, 10, 0], [250, 30, 0]];
        let groups = vec![(0, vec![0, 64, 128, 192, 256]), (1, vec![0, 16, 32])];
        let order = schedule(&floors, &groups);
        // After the last layer: decay's 256, no decay's 32; after the
        // middle one: decay 192, 128 (at or above 100), no decay 16; after
        // the first: the rest.
        assert_eq!(
            order,
            vec![
                (0, 4),
                (1, 2),
                (0, 3),
                (0, 2),
                (1, 1),
                (0, 1),
                (0, 0),
                (1, 0)
            ]
        );
        // A network whose floors are all zero (one layer) still gets every
        // bucket, each once.
        let all = schedule(&[[0; 3]], &groups);
        assert_eq!(all.len(), 8);
        let mut sorted = all.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 8);
        assert!(schedule(&[], &groups).len() == 8);
    }
}
