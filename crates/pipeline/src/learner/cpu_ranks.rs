//! The CPU learner's part in a data-parallel run: which gradient tensors
//! go to the all-reduce and in what order, handing each layer's over as
//! backward finishes it, writing the sums back, and the buffers' mean.
//!
//! The plan's tensors are the trainable parameters in backward's order
//! (the last layer's first), so the first buckets are complete, and on
//! the wire, while backward still runs through the earlier layers.
//!
//! Sharded (`train.shard_optimizer`, ZeRO-1): each trainable tensor has
//! an owner rank (`BucketPlan::owners`), the buckets are reduce-scattered
//! so each rank gets only its own tensors' sums, each rank's AdamW keeps
//! moments for and updates only its own, and the new weights are then
//! gathered (`GradientReducer::gather_owned`). The clip needs the global
//! norm: each rank sums the squares of its own tensors (`global_norm`),
//! the per-parameter sums are gathered and added in parameter order, as
//! one process adds them, so the norm, the clip and every update are the
//! bits of the unsharded run. The update's finiteness check is agreed
//! before anyone applies (`ranks::agree_on_update`). For a checkpoint the leader
//! gathers the others' moments (`gather_moments`) and releases them after.
//!
//! Memory: the reducer's copy of every gradient (its buckets); the
//! buffers' mean needs one copy of the buffers (batch norm's statistics,
//! dropout's counters: small). Sharded, each rank's moments are about
//! 1/N of the model's two copies, the leader holding the whole state only
//! while it writes a checkpoint.

use std::time::Instant;

use headroom_dist::collective::{all_reduce_ordered, gather_to_root};
use headroom_dist::GradientReducer;
use headroom_model::{Network, Param};
use headroom_optim::{gradient_sums_of_squares, norm_of_sums, AdamW};

use crate::ranks::{Ranks, BUFFERS_TAG, MOMENTS_TAG, NORM_TAG};
use crate::{PipelineError, Result};

pub(crate) struct CpuRanks {
    pub ranks: Ranks,
    reducer: GradientReducer,
    /// Per top-level layer, per parameter: its tensor in the plan (None:
    /// frozen, never reduced).
    tensor_of: Vec<Vec<Option<usize>>>,
    /// Per plan tensor: its index in `Network::params_mut`.
    param_of: Vec<usize>,
    /// Per top-level layer: the index of its first parameter in
    /// `Network::params_mut`.
    first_param: Vec<usize>,
    /// Per parameter (by `Network::params_mut` index): its tensor in the
    /// plan (None: frozen).
    tensor_by_param: Vec<Option<usize>>,
    /// Sharded: per parameter, whether this rank updates it.
    owned: Option<Vec<bool>>,
}

impl CpuRanks {
    pub fn new(network: &mut Network, ranks: Ranks) -> Result<Self> {
        let layers = network.layer_params_mut();
        let mut first_param = Vec::with_capacity(layers.len());
        let mut next = 0;
        for params in &layers {
            first_param.push(next);
            next += params.len();
        }
        let mut tensor_of: Vec<Vec<Option<usize>>> =
            layers.iter().map(|p| vec![None; p.len()]).collect();
        let (mut lens, mut param_of) = (Vec::new(), Vec::new());
        for (layer, params) in layers.iter().enumerate().rev() {
            for (k, p) in params.iter().enumerate() {
                if !p.frozen {
                    tensor_of[layer][k] = Some(lens.len());
                    param_of.push(first_param[layer] + k);
                    lens.push(p.value.len());
                }
            }
        }
        let make = if ranks.shard_optimizer {
            GradientReducer::sharded
        } else {
            GradientReducer::new
        };
        let reducer = make(
            ranks.transport.clone(),
            &lens,
            ranks.bucket_values,
            ranks.timeout,
        )?;
        let mut tensor_by_param = vec![None; next];
        for (tensor, &param) in param_of.iter().enumerate() {
            tensor_by_param[param] = Some(tensor);
        }
        let owned = ranks.shard_optimizer.then(|| {
            tensor_by_param
                .iter()
                .map(|t| t.is_some_and(|t| reducer.owns(t)))
                .collect()
        });
        tracing::debug!(
            "rank {} of {}: {} gradient tensors in {} buckets",
            ranks.rank,
            ranks.world,
            lens.len(),
            reducer.plan().buckets()
        );
        Ok(Self {
            ranks,
            reducer,
            tensor_of,
            param_of,
            first_param,
            tensor_by_param,
            owned,
        })
    }

    /// Whether AdamW is sharded over the ranks (ZeRO-1).
    pub fn sharded(&self) -> bool {
        self.ranks.shard_optimizer
    }

    /// The parameters this rank's AdamW updates (by parameter index):
    /// None unsharded (all of them).
    pub fn owned_params(&self) -> Option<&[bool]> {
        self.owned.as_deref()
    }

    /// Sharded: the global gradient norm, the bits one process computes.
    /// Each rank sums the squares of the gradients it holds whole (its own
    /// tensors' sums; the frozen ones, local on every rank as unsharded),
    /// the sums are gathered and each parameter's taken from its owner,
    /// then added in parameter order.
    pub fn global_norm(&self, network: &mut Network) -> Result<f64> {
        let owned = self.owned_params().unwrap_or_default();
        let params = network.params_mut();
        let local: Vec<&Param> = params
            .iter()
            .enumerate()
            .filter(|(i, p)| p.frozen || owned.get(*i).copied().unwrap_or(false))
            .map(|(_, p)| &**p)
            .collect();
        let computed = gradient_sums_of_squares(&local);
        let mut mine = vec![0.0f64; params.len()];
        let mut next = computed.into_iter();
        for (i, p) in params.iter().enumerate() {
            if p.frozen || owned.get(i).copied().unwrap_or(false) {
                mine[i] = next.next().unwrap_or(0.0);
            }
        }
        let bytes: Vec<u8> = mine.iter().flat_map(|v| v.to_le_bytes()).collect();
        let all = self
            .ranks
            .gather(NORM_TAG, &bytes, "the gradient norm's terms")?;
        let mut sums = mine;
        for (i, sum) in sums.iter_mut().enumerate() {
            let Some(owner) = self.tensor_by_param[i].and_then(|t| self.reducer.owner(t)) else {
                continue;
            };
            let word = all
                .get(owner)
                .and_then(|r| r.get(i * 8..i * 8 + 8))
                .and_then(|w| <[u8; 8]>::try_from(w).ok())
                .ok_or_else(|| PipelineError::Stage {
                    stage: "ranks",
                    reason: format!("rank {owner} sent a malformed norm record"),
                })?;
            *sum = f64::from_le_bytes(word);
        }
        Ok(norm_of_sums(&sums))
    }

    /// Sharded: every rank's updated tensors to every rank.
    pub fn gather_weights(&mut self, network: &mut Network) -> Result<()> {
        let mut by_param: Vec<Option<&mut [f32]>> = network
            .params_mut()
            .into_iter()
            .map(|p| Some(p.value.data_mut()))
            .collect();
        let mut tensors: Vec<&mut [f32]> = Vec::with_capacity(self.param_of.len());
        for &param in &self.param_of {
            let values = by_param
                .get_mut(param)
                .and_then(Option::take)
                .ok_or_else(|| PipelineError::Stage {
                    stage: "ranks",
                    reason: format!("parameter {param} is twice in the plan"),
                })?;
            tensors.push(values);
        }
        self.reducer.gather_owned(&mut tensors)?;
        Ok(())
    }

    /// Sharded: the other ranks' moments to the leader, whose optimizer is
    /// then whole for a checkpoint (`AdamW::drop_unowned` releases them).
    /// Every rank calls it at the same step; before the first update there
    /// are no moments to gather.
    pub fn gather_moments(&self, optimizer: &mut AdamW, network: &mut Network) -> Result<()> {
        if !self.sharded() || optimizer.steps_taken() == 0 {
            return Ok(());
        }
        let world = self.ranks.world;
        let lens: Vec<usize> = network.params_mut().iter().map(|p| p.value.len()).collect();
        let owner_of =
            |param: usize| self.tensor_by_param[param].and_then(|t| self.reducer.owner(t));
        let mut sizes = vec![0usize; world];
        for (param, &len) in lens.iter().enumerate() {
            if let Some(owner) = owner_of(param) {
                sizes[owner.min(world - 1)] += 2 * 4 * len;
            }
        }
        let rank = self.ranks.rank;
        let mut mine = Vec::with_capacity(sizes[rank]);
        let [first, second] = optimizer.moments();
        for moments in [first, second] {
            for (param, m) in moments.iter().enumerate() {
                if owner_of(param) == Some(rank) {
                    m.iter()
                        .for_each(|v| mine.extend_from_slice(&v.to_le_bytes()));
                }
            }
        }
        let records = {
            let mut t = self.ranks.lock()?;
            gather_to_root(
                t.as_mut(),
                MOMENTS_TAG,
                0,
                &mine,
                &sizes,
                self.ranks.deadline(),
                "gathering the optimizer's moments for a checkpoint",
            )?
        };
        for (owner, record) in records.iter().enumerate().filter(|&(j, _)| j != rank) {
            let values: Vec<f32> = record
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let params: Vec<usize> = (0..lens.len())
                .filter(|&p| owner_of(p) == Some(owner))
                .collect();
            let half: usize = params.iter().map(|&p| lens[p]).sum();
            let (firsts, seconds) = values.split_at(half.min(values.len()));
            let mut at = 0;
            for &param in &params {
                let len = lens[param];
                let (Some(m), Some(v)) = (firsts.get(at..at + len), seconds.get(at..at + len))
                else {
                    return Err(PipelineError::Stage {
                        stage: "ranks",
                        reason: format!("rank {owner} sent too few moments"),
                    });
                };
                optimizer.fill_moments(param, m.to_vec(), v.to_vec())?;
                at += len;
            }
        }
        Ok(())
    }

    /// Layer `layer`'s gradients are complete: each trainable one, with
    /// the earlier micro-batches' sum added (`stash`, by parameter index),
    /// goes to its bucket.
    pub fn hand_over(
        &mut self,
        layer: usize,
        params: &mut [&mut Param],
        stash: &[Vec<f32>],
    ) -> Result<()> {
        let first = self.first_param.get(layer).copied().unwrap_or(0);
        for (k, p) in params.iter_mut().enumerate() {
            let Some(tensor) = self
                .tensor_of
                .get(layer)
                .and_then(|t| t.get(k))
                .copied()
                .flatten()
            else {
                continue;
            };
            if let Some(earlier) = stash.get(first + k) {
                add_earlier(earlier, p.grad.data_mut());
            }
            self.reducer.ready(tensor, p.grad.data())?;
        }
        Ok(())
    }

    /// Waits for the sums and writes them into the gradients. A step that
    /// failed part-way first sends zeros for the rest (`failed`), so that
    /// no peer waits for it.
    pub fn finish(&mut self, network: &mut Network, failed: bool) -> Result<()> {
        if failed {
            self.reducer.abort_step()?;
        }
        let mut params = network.params_mut();
        let param_of = &self.param_of;
        self.reducer.finish(|tensor, sum| {
            if let Some(p) = param_of.get(tensor).and_then(|&i| params.get_mut(i)) {
                p.grad.data_mut().copy_from_slice(sum);
            }
        })?;
        Ok(())
    }

    /// Every buffer becomes the ranks' mean (the same bits on each): batch
    /// norm's running statistics then follow every rank's batches, and the
    /// ranks' states stay equal.
    pub fn average_buffers(&mut self, network: &mut Network) -> Result<()> {
        let mut buffers = network.buffers_mut();
        let total: usize = buffers.iter().map(|b| b.len()).sum();
        if total == 0 {
            return Ok(());
        }
        let mut flat = Vec::with_capacity(total);
        for b in &buffers {
            flat.extend_from_slice(b.data());
        }
        let mut t = self
            .ranks
            .transport
            .lock()
            .map_err(|_| PipelineError::Stage {
                stage: "ranks",
                reason: "a thread panicked while it used the transport".into(),
            })?;
        all_reduce_ordered(
            t.as_mut(),
            BUFFERS_TAG,
            &mut flat,
            &mut Vec::new(),
            Instant::now() + self.ranks.timeout,
            "the mean of the buffers (running statistics)",
        )?;
        let world = self.ranks.world as f32;
        let mut at = 0;
        for b in buffers.iter_mut() {
            let len = b.len();
            for (v, &s) in b.data_mut().iter_mut().zip(&flat[at..at + len]) {
                *v = s / world;
            }
            at += len;
        }
        Ok(())
    }
}

/// `grad = earlier + grad`: the micro-batches' gradients summed in their
/// order, ((g0 + g1) + g2) …, which is also the order in which the ranks'
/// gradients are summed.
pub(crate) fn add_earlier(earlier: &[f32], grad: &mut [f32]) {
    for (g, &e) in grad.iter_mut().zip(earlier) {
        *g += e;
    }
}
