//! The CPU learner's part in a data-parallel run: which gradient tensors
//! go to the all-reduce and in what order, handing each layer's over as
//! backward finishes it, writing the sums back, and the buffers' mean.
//!
//! The plan's tensors are the trainable parameters in backward's order
//! (the last layer's first), so the first buckets are complete, and on
//! the wire, while backward still runs through the earlier layers.
//!
//! Memory: the reducer's copy of every gradient (its buckets); the
//! buffers' mean needs one copy of the buffers (batch norm's statistics,
//! dropout's counters: small).

use std::time::Instant;

use headroom_dist::collective::all_reduce_ordered;
use headroom_dist::GradientReducer;
use headroom_model::{Network, Param};

use crate::ranks::{Ranks, BUFFERS_TAG};
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
        let reducer = GradientReducer::new(
            ranks.transport.clone(),
            &lens,
            ranks.bucket_values,
            ranks.timeout,
        )?;
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
        })
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
