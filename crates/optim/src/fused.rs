//! The fused AdamW step on the GPU, over headroom-model's `ParamGroup`s
//! (f32 masters, gradients and moments, f16 compute copies; two groups,
//! decay and no decay, cover a network).
//!
//! A `ParamGroup` holds, for a contiguous run of parameters that share their
//! weight-decay setting, the f32 master weights, the f32 gradients (kept
//! multiplied by the loss scale, as backward produces them), the f32 moments
//! and the f16 compute copy the forward and backward read. A layer's
//! parameter is a range of a group (`CudaSlice::slice`). Two groups (decay,
//! no decay) cover a network.
//!
//! `FusedAdamW::step` enqueues, with no host synchronisation:
//! `grad_sumsq` per group (partial sums of squares) → `step_finalize` (inf/NaN
//! flag, global norm of the unscaled gradients, clip factor, into a device
//! `StepState`) → `adamw_fused` per group (skips everything on inf/NaN; else
//! unscale + clip, moments, master update, f16 write-back; optionally zeroes
//! the gradients). The arithmetic is headroom-optim's `AdamW::step` and
//! `clip_grad_norm` (PyTorch semantics); the scalar factors are computed here
//! in f64 by the same code (`AdamWConfig::step_factors`).
//!
//! The learning rate and `t` (the index of this step among APPLIED steps,
//! from 1) reach the kernel through device memory (`set_schedule`, a pinned
//! copy on the compute stream), not as launch arguments: the launches
//! `enqueue` makes are the same from step to step, so a training step can
//! be captured into a CUDA graph and replayed. The host reads the
//! `StepState` afterwards (`read_state`, or a copy into pinned memory) to
//! feed the `LossScaler` and advance its step counter and schedule only on
//! applied steps. Reading it for step s just before enqueuing the optimizer
//! of step s+1 (after s+1's forward and backward are queued) keeps the GPU
//! busy while the host waits.

use cudarc::driver::{
    CudaEvent, CudaSlice, DriverError, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use headroom_model::cuda::kernels as k;
use headroom_model::cuda::params::{
    AdamWParams, AdamWScalars, FinalizeParams, StepState, SumSqParams,
};
use headroom_model::cuda::{CudaBackend, CudaError, DeviceBuffer, ParamGroup};

use crate::{AdamWConfig, OptimError};

type Result<T> = std::result::Result<T, OptimError>;

/// Names the launch a driver error came from.
fn driver(op: &'static str) -> impl Fn(DriverError) -> OptimError {
    move |source| OptimError::from(CudaError::Driver { op, source })
}

/// Threads per block of grad_sumsq (the kernel's shared array has 256).
const SUMSQ_THREADS: u32 = 256;
/// Upper bound on grad_sumsq blocks per group.
const SUMSQ_MAX_BLOCKS: usize = 1024;

fn sumsq_blocks(n: usize) -> usize {
    n.div_ceil(SUMSQ_THREADS as usize).min(SUMSQ_MAX_BLOCKS)
}

/// The device side of the optimizer step: scratch for the norm's partial
/// sums, the `StepState` the kernels share, and the step's learning-rate
/// factors in device memory.
pub struct FusedAdamW {
    config: AdamWConfig,
    partials: DeviceBuffer<f64>,
    state: DeviceBuffer<StepState>,
    scalars: DeviceBuffer<AdamWScalars>,
    scalars_host: PinnedHostSlice<AdamWScalars>,
    /// Recorded after the copy of `scalars_host`: the host writes it again
    /// only once that copy has read it.
    scalars_copied: CudaEvent,
    /// grad_sumsq blocks of each group, in group order.
    blocks: Vec<usize>,
}

impl std::fmt::Debug for FusedAdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FusedAdamW")
            .field("config", &self.config)
            .field("blocks", &self.blocks)
            .finish_non_exhaustive()
    }
}

impl FusedAdamW {
    /// For exactly these groups (their lengths fix the scratch size).
    pub fn new(be: &CudaBackend, config: AdamWConfig, groups: &[ParamGroup]) -> Result<Self> {
        config.validate()?;
        let blocks: Vec<usize> = groups.iter().map(|g| sumsq_blocks(g.len())).collect();
        let total: usize = blocks.iter().sum();
        let ctx = be.context();
        // SAFETY: written by set_schedule before every copy that reads it.
        let scalars_host =
            unsafe { ctx.alloc_pinned::<AdamWScalars>(1) }.map_err(driver("cuMemHostAlloc"))?;
        Ok(Self {
            config,
            partials: be.alloc_zeros::<f64>(total.max(1))?,
            state: be.alloc_zeros::<StepState>(1)?,
            scalars: be.alloc_zeros::<AdamWScalars>(1)?,
            scalars_host,
            scalars_copied: ctx.new_event(None).map_err(driver("cuEventCreate"))?,
            blocks,
        })
    }

    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// Enqueues one optimizer step: `set_schedule(lr, t)`, then `enqueue`.
    /// `t` is this step's index among applied steps (1 for the first), `lr`
    /// its learning rate, `loss_scale` the scale the gradients carry,
    /// `max_norm` the global-norm clip (0 = off). With `zero_grad` the
    /// gradients are cleared afterwards, whether the step was applied or
    /// skipped.
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
        be: &CudaBackend,
        groups: &mut [ParamGroup],
        lr: f32,
        t: u64,
        loss_scale: f32,
        max_norm: f32,
        zero_grad: bool,
    ) -> Result<()> {
        self.set_schedule(be, lr, t)?;
        self.enqueue(be, groups, loss_scale, max_norm, zero_grad)
    }

    /// Copies the factors of learning rate `lr` at applied step `t` (from 1)
    /// to the device, on the compute stream, for the next step's kernels
    /// (queued by `enqueue`, or replayed by a captured graph). The factors
    /// are the CPU AdamW's (`AdamWConfig::step_factors`).
    pub fn set_schedule(&mut self, be: &CudaBackend, lr: f32, t: u64) -> Result<()> {
        if !(lr.is_finite() && lr >= 0.0 && t >= 1) {
            return Err(OptimError::from(CudaError::Unsupported {
                op: "FusedAdamW::set_schedule",
                reason: format!("needs a finite lr ≥ 0 and t ≥ 1; got {lr}, {t}"),
            }));
        }
        let f = self.config.step_factors(lr, t);
        let scalars = AdamWScalars {
            decay_factor: f.decay_factor,
            neg_step_size: f.neg_step_size,
            bias_correction2_sqrt: f.bias_correction2_sqrt,
        };
        let stream = be.compute_stream();
        self.scalars_copied
            .synchronize()
            .map_err(driver("cuEventSynchronize"))?;
        self.scalars_host
            .as_mut_slice()
            .map_err(driver("pinned buffer"))?[0] = scalars;
        stream
            .memcpy_htod(&self.scalars_host, &mut self.scalars.slice)
            .map_err(driver("cuMemcpyHtoDAsync"))?;
        self.scalars_copied
            .record(stream)
            .map_err(driver("cuEventRecord"))
    }

    /// Enqueues the kernels of one step (norm, verdict, AdamW per group) on
    /// the compute stream, with the learning rate and t last given to
    /// `set_schedule`. Only launches with arguments fixed for a run (the
    /// loss scale aside), and no host synchronisation: capturable.
    pub fn enqueue(
        &mut self,
        be: &CudaBackend,
        groups: &mut [ParamGroup],
        loss_scale: f32,
        max_norm: f32,
        zero_grad: bool,
    ) -> Result<()> {
        let lens: Vec<usize> = groups.iter().map(ParamGroup::len).collect();
        let expected: Vec<usize> = lens.iter().map(|&n| sumsq_blocks(n)).collect();
        if expected != self.blocks {
            return Err(OptimError::from(CudaError::shape(
                "FusedAdamW::step",
                format!("the {} groups it was made for", self.blocks.len()),
                format!("groups of lengths {lens:?}"),
            )));
        }
        if !(loss_scale.is_finite() && loss_scale > 0.0) {
            return Err(OptimError::from(CudaError::Unsupported {
                op: "FusedAdamW::enqueue",
                reason: format!("needs a finite loss_scale > 0; got {loss_scale}"),
            }));
        }
        let stream = be.compute_stream();

        // 1. Partial sums of squares of every group.
        let sumsq = be.function(&k::GRAD_SUMSQ)?;
        let mut offset = 0usize;
        for (group, &blocks) in groups.iter().zip(&self.blocks) {
            if blocks == 0 {
                continue;
            }
            let p = SumSqParams {
                n: group.len() as u32,
                offset: offset as u32,
            };
            let cfg = LaunchConfig {
                grid_dim: (blocks as u32, 1, 1),
                block_dim: (SUMSQ_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = stream.launch_builder(&sumsq);
            b.arg(&p)
                .arg(&group.grad.slice)
                .arg(&mut self.partials.slice);
            // SAFETY: grad_sumsq(SumSqParams, const float* g [n], double*
            // partials) with 256 threads per block (its shared array) writes
            // partials[offset .. offset + blocks], inside the buffer (sized
            // for the sum of all groups' blocks).
            unsafe { b.launch(cfg) }.map_err(driver("grad_sumsq"))?;
            offset += blocks;
        }

        // 2. The verdict: inf/NaN, norm, clip factor.
        {
            let p = FinalizeParams {
                partials: offset as u32,
                inv_loss_scale: 1.0 / loss_scale,
                max_norm: max_norm.max(0.0),
            };
            let f = be.function(&k::STEP_FINALIZE)?;
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (1, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = stream.launch_builder(&f);
            b.arg(&p)
                .arg(&self.partials.slice)
                .arg(&mut self.state.slice);
            // SAFETY: step_finalize(FinalizeParams, const double* partials
            // [offset], StepState* state [1]) with one thread.
            unsafe { b.launch(cfg) }.map_err(driver("step_finalize"))?;
        }

        // 3. AdamW per group, with set_schedule's factors.
        let h = &self.config;
        let base = AdamWParams {
            n: 0,
            zero_grad: zero_grad as u32,
            decay: 0,
            beta1_complement: 1.0 - h.beta1,
            beta2: h.beta2,
            beta2_complement: 1.0 - h.beta2,
            eps: h.eps,
        };
        let adamw = be.function(&k::ADAMW_FUSED)?;
        for group in groups.iter_mut() {
            let n = group.len();
            if n == 0 {
                continue;
            }
            let p = AdamWParams {
                n: n as u32,
                decay: group.decay as u32,
                ..base
            };
            let blocks = n.div_ceil(256).min(1 << 16) as u32;
            let cfg = LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let ParamGroup {
                master,
                grad,
                first_moment,
                second_moment,
                compute,
                ..
            } = group;
            let mut b = stream.launch_builder(&adamw);
            b.arg(&p)
                .arg(&self.scalars.slice)
                .arg(&self.state.slice)
                .arg(&mut master.slice)
                .arg(&mut grad.slice)
                .arg(&mut first_moment.slice)
                .arg(&mut second_moment.slice)
                .arg(&mut compute.slice);
            // SAFETY: adamw_fused(AdamWParams, const AdamWScalars* [1], const
            // StepState* [1], float* master, float* grad, float* m, float* v,
            // hr_half* compute), all of the group's n elements (ParamGroup
            // allocates them together).
            unsafe { b.launch(cfg) }.map_err(driver("adamw_fused"))?;
        }
        Ok(())
    }

    /// The device-side verdict of the last step.
    pub fn state(&self) -> &CudaSlice<StepState> {
        &self.state.slice
    }

    /// Downloads the verdict of the last enqueued step (waits for it).
    pub fn read_state(&self, be: &CudaBackend) -> Result<StepState> {
        let v = be.download(&self.state.slice)?;
        Ok(v[0])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sumsq_blocks_are_bounded() {
        assert_eq!(sumsq_blocks(0), 0);
        assert_eq!(sumsq_blocks(1), 1);
        assert_eq!(sumsq_blocks(257), 2);
        assert_eq!(sumsq_blocks(10_000_000), SUMSQ_MAX_BLOCKS);
    }
}
