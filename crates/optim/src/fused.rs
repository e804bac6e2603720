//! The fused AdamW step on the GPU, over headroom-model's `ParamGroup`s
//! (f32 masters, gradients and moments, f16 compute copies in mixed
//! precision; two groups, decay and no decay, cover a network).
//!
//! A `ParamGroup` holds, for a contiguous run of parameters that share their
//! weight-decay setting, the f32 master weights, the f32 gradients (kept
//! multiplied by the loss scale, as backward produces them), the f32 moments
//! and, in mixed precision, the f16 compute copy the forward and backward
//! read (f32 training reads the masters). A layer's
//! parameter is a range of a group (`CudaSlice::slice`). Two groups (decay,
//! no decay) cover a network.
//!
//! `FusedAdamW::enqueue` queues, with no host synchronisation:
//! `grad_sumsq` per group (partial sums of squares) → `step_finalize` (the
//! verdict on the gradients: inf/NaN flag, global norm of the unscaled
//! gradients, clip factor; the step's AdamW factors; in a device
//! `StepState`) → `adamw_check` per group (read-only: would the update
//! leave a master weight, a moment or, in mixed precision, an f16 compute
//! copy that is not finite? then `update_overflow`; `adamw_check_f32`
//! without a copy) → `step_commit` (one thread: the step is skipped on
//! found_inf, schedule_missed or update_overflow; the dynamic loss scale's
//! update, halved only on found_inf; t advances on an applied step) →
//! `adamw_fused` per group (skips everything on a skipped step; else
//! unscale + clip, moments, master update, f16 write-back when the group
//! has a copy (`adamw_fused_f32` when it has none); optionally zeroes the
//! gradients). The arithmetic is headroom-optim's `AdamW::step_if_finite`,
//! `clip_grad_norm` and `LossScaler::update` (PyTorch semantics); the AdamW
//! factors are computed on the host in f64 by the same code
//! (`AdamWConfig::step_factors`). The check costs one more read-only pass
//! over masters, gradients and moments per step (optim.cu's header).
//!
//! Nothing a step needs comes from the host after it is queued, so the host
//! can queue step s+1 before it has read step s's verdict:
//! - The loss scale lives in device memory (`loss_scale`): the loss kernels
//!   read it, `step_commit` updates it.
//! - AdamW's t is the count of applied steps, kept in the `StepState`. The
//!   host gives, through `set_schedule` (a pinned copy on the compute
//!   stream), the learning-rate factors for every count the step may find
//!   (one more than the steps in flight); `step_finalize` picks.
//!
//! The launches are the same from step to step, so a training step can be
//! captured into a CUDA graph and replayed.

use cudarc::driver::{
    CudaEvent, CudaSlice, DriverError, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use headroom_model::cuda::kernels as k;
use headroom_model::cuda::params::{
    AdamWParams, AdamWScalars, FinalizeParams, StepSchedule, StepState, SumSqParams,
    SCHEDULE_CANDIDATES,
};
use headroom_model::cuda::{CudaBackend, CudaError, DeviceBuffer, ParamGroup};

use crate::{AdamWConfig, LossScalerConfig, LossScalerState, OptimError};

type Result<T> = std::result::Result<T, OptimError>;

/// Names the launch a driver error came from.
fn driver(op: &'static str) -> impl Fn(DriverError) -> OptimError {
    move |source| OptimError::from(CudaError::Driver { op, source })
}

/// Threads per block of grad_sumsq (the kernel's shared array has 256).
const SUMSQ_THREADS: u32 = 256;
/// Threads of step_finalize's one block (its shared array has 256).
const FINALIZE_THREADS: u32 = 256;
/// Upper bound on grad_sumsq blocks per group.
const SUMSQ_MAX_BLOCKS: usize = 1024;

fn sumsq_blocks(n: usize) -> usize {
    n.div_ceil(SUMSQ_THREADS as usize).min(SUMSQ_MAX_BLOCKS)
}

/// The device side of the optimizer step: scratch for the norm's partial
/// sums, the `StepState` the kernels share (verdict and loss scaler), the
/// loss scale, and the learning-rate candidates of the next step.
pub struct FusedAdamW {
    config: AdamWConfig,
    scaler: LossScalerConfig,
    partials: DeviceBuffer<f64>,
    state: DeviceBuffer<StepState>,
    loss_scale: DeviceBuffer<f32>,
    schedule: DeviceBuffer<StepSchedule>,
    schedule_host: PinnedHostSlice<StepSchedule>,
    /// Recorded after the copy of `schedule_host`: the host writes it again
    /// only once that copy has read it.
    schedule_copied: CudaEvent,
    /// grad_sumsq blocks of each group, in group order.
    blocks: Vec<usize>,
}

impl std::fmt::Debug for FusedAdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FusedAdamW")
            .field("config", &self.config)
            .field("scaler", &self.scaler)
            .field("blocks", &self.blocks)
            .finish_non_exhaustive()
    }
}

impl FusedAdamW {
    /// For exactly these groups (their lengths fix the scratch size), with
    /// the loss scaler at its initial scale and no step applied.
    pub fn new(
        be: &CudaBackend,
        config: AdamWConfig,
        scaler: LossScalerConfig,
        groups: &[ParamGroup],
    ) -> Result<Self> {
        config.validate()?;
        scaler.validate().map_err(OptimError::InvalidState)?;
        let blocks: Vec<usize> = groups.iter().map(|g| sumsq_blocks(g.len())).collect();
        let total: usize = blocks.iter().sum();
        let ctx = be.context();
        // SAFETY: written by set_schedule before every copy that reads it.
        let schedule_host =
            unsafe { ctx.alloc_pinned::<StepSchedule>(1) }.map_err(driver("cuMemHostAlloc"))?;
        let mut optimizer = Self {
            config,
            scaler,
            partials: be.alloc_zeros::<f64>(total.max(1))?,
            state: be.alloc_zeros::<StepState>(1)?,
            loss_scale: be.alloc_zeros::<f32>(1)?,
            schedule: be.alloc_zeros::<StepSchedule>(1)?,
            schedule_host,
            schedule_copied: ctx.new_event(None).map_err(driver("cuEventCreate"))?,
            blocks,
        };
        let start = LossScalerState {
            scale: scaler.init_scale,
            clean_steps: 0,
        };
        optimizer.load_state(be, start, 0)?;
        Ok(optimizer)
    }

    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    pub fn scaler_config(&self) -> &LossScalerConfig {
        &self.scaler
    }

    /// The loss scale the next step's gradients are to carry (one f32 in
    /// device memory), for the loss kernels.
    pub fn loss_scale(&self) -> &CudaSlice<f32> {
        &self.loss_scale.slice
    }

    /// Sets the loss scaler's state (`LossScalerConfig::admit`) and the
    /// count of applied steps, from a checkpoint, waiting for the copies;
    /// the state as admitted.
    pub fn load_state(
        &mut self,
        be: &CudaBackend,
        scaler: LossScalerState,
        applied: u64,
    ) -> Result<LossScalerState> {
        let admitted = self
            .scaler
            .admit(scaler)
            .map_err(OptimError::InvalidState)?;
        let state = StepState {
            next_scale: admitted.scale,
            clean_steps: admitted.clean_steps,
            applied,
            ..StepState::default()
        };
        let stream = be.compute_stream();
        stream
            .memcpy_htod(&[state], &mut self.state.slice)
            .map_err(driver("cuMemcpyHtoDAsync"))?;
        stream
            .memcpy_htod(&[admitted.scale], &mut self.loss_scale.slice)
            .map_err(driver("cuMemcpyHtoDAsync"))?;
        stream
            .synchronize()
            .map_err(driver("cuStreamSynchronize"))?;
        Ok(admitted)
    }

    /// Queues one optimizer step with one learning rate, `lr`, for a step
    /// queued with no other in flight: `applied` is the count of applied
    /// steps so far (the t of this step is applied + 1). `max_norm` is the
    /// global-norm clip (0 = off); with `zero_grad` the gradients are
    /// cleared afterwards, whether the step was applied or skipped.
    pub fn step(
        &mut self,
        be: &CudaBackend,
        groups: &mut [ParamGroup],
        applied: u64,
        lr: f32,
        max_norm: f32,
        zero_grad: bool,
    ) -> Result<()> {
        self.set_schedule(be, applied, &[lr])?;
        self.enqueue(be, groups, max_norm, zero_grad)
    }

    /// Copies the next step's learning-rate candidates to the device, on
    /// the compute stream: `lrs[j]` is its rate if it finds `first_applied
    /// + j` steps applied before it (its t then being first_applied + j +
    /// 1). With k steps in flight, pass the rates for the k + 1 counts it
    /// may find. The factors are the CPU AdamW's (`AdamWConfig::step_factors`).
    pub fn set_schedule(
        &mut self,
        be: &CudaBackend,
        first_applied: u64,
        lrs: &[f32],
    ) -> Result<()> {
        if lrs.is_empty() || lrs.len() > SCHEDULE_CANDIDATES {
            return Err(OptimError::from(CudaError::Unsupported {
                op: "FusedAdamW::set_schedule",
                reason: format!(
                    "needs 1 to {SCHEDULE_CANDIDATES} learning rates (steps in flight + 1); got {}",
                    lrs.len()
                ),
            }));
        }
        let mut schedule = StepSchedule {
            first_applied,
            candidates: lrs.len() as u32,
            ..StepSchedule::default()
        };
        for (j, (&lr, slot)) in lrs.iter().zip(schedule.at.iter_mut()).enumerate() {
            if !(lr.is_finite() && lr >= 0.0) {
                return Err(OptimError::from(CudaError::Unsupported {
                    op: "FusedAdamW::set_schedule",
                    reason: format!("needs finite learning rates ≥ 0; got {lr}"),
                }));
            }
            let f = self.config.step_factors(lr, first_applied + j as u64 + 1);
            *slot = AdamWScalars {
                decay_factor: f.decay_factor,
                neg_step_size: f.neg_step_size,
                bias_correction2_sqrt: f.bias_correction2_sqrt,
            };
        }
        let stream = be.compute_stream();
        self.schedule_copied
            .synchronize()
            .map_err(driver("cuEventSynchronize"))?;
        self.schedule_host
            .as_mut_slice()
            .map_err(driver("pinned buffer"))?[0] = schedule;
        stream
            .memcpy_htod(&self.schedule_host, &mut self.schedule.slice)
            .map_err(driver("cuMemcpyHtoDAsync"))?;
        self.schedule_copied
            .record(stream)
            .map_err(driver("cuEventRecord"))
    }

    /// Enqueues the kernels of one step (norm and verdict, the overflow
    /// check per group, loss scale and t, AdamW per group) on the compute stream, with the candidates last
    /// given to `set_schedule`. Only launches with arguments fixed for a
    /// run, and no host synchronisation: capturable.
    pub fn enqueue(
        &mut self,
        be: &CudaBackend,
        groups: &mut [ParamGroup],
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

        // 2. The verdict on the gradients (inf/NaN, norm, clip factor) and
        // the step's factors.
        let c = &self.scaler;
        let finalize = FinalizeParams {
            partials: offset as u32,
            max_norm: max_norm.max(0.0),
            growth_factor: c.growth_factor,
            backoff_factor: c.backoff_factor,
            growth_interval: c.growth_interval,
            min_scale: c.min_scale,
            max_scale: c.max_scale,
        };
        {
            let p = finalize;
            let f = be.function(&k::STEP_FINALIZE)?;
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (FINALIZE_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = stream.launch_builder(&f);
            b.arg(&p)
                .arg(&self.partials.slice)
                .arg(&self.schedule.slice)
                .arg(&self.loss_scale.slice)
                .arg(&mut self.state.slice);
            // SAFETY: step_finalize(FinalizeParams, const double* partials
            // [offset], const StepSchedule* [1], const float* loss_scale [1],
            // StepState* state [1]) with one block of 256 threads (its shared
            // array's size).
            unsafe { b.launch(cfg) }.map_err(driver("step_finalize"))?;
        }

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
        let group_launch = |group: &ParamGroup| {
            let n = group.len();
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
            (p, cfg)
        };

        // 3. Would the update overflow? Every group is checked before any is
        // updated (a step is applied or refused whole).
        for group in groups.iter().filter(|g| !g.is_empty()) {
            let (p, cfg) = group_launch(group);
            let sig = match group.compute {
                Some(_) => &k::ADAMW_CHECK,
                None => &k::ADAMW_CHECK_F32,
            };
            let check = be.function(sig)?;
            let mut b = stream.launch_builder(&check);
            b.arg(&p)
                .arg(&mut self.state.slice)
                .arg(&group.master.slice)
                .arg(&group.grad.slice)
                .arg(&group.first_moment.slice)
                .arg(&group.second_moment.slice);
            // SAFETY: adamw_check(AdamWParams, StepState* [1], const float*
            // master, const float* grad, const float* m, const float* v), or
            // adamw_check_f32 alike: reads the group's n elements
            // (ParamGroup allocates them together), writes only the state.
            unsafe { b.launch(cfg) }.map_err(driver(sig.name))?;
        }

        // 4. The verdict with the check folded in, the loss scaler and t.
        {
            let f = be.function(&k::STEP_COMMIT)?;
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (1, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = stream.launch_builder(&f);
            b.arg(&finalize)
                .arg(&mut self.loss_scale.slice)
                .arg(&mut self.state.slice);
            // SAFETY: step_commit(FinalizeParams, float* loss_scale [1],
            // StepState* state [1]) with one thread.
            unsafe { b.launch(cfg) }.map_err(driver("step_commit"))?;
        }

        // 5. AdamW per group, with the factors step_finalize picked, unless
        // the step is skipped.
        for group in groups.iter_mut() {
            if group.is_empty() {
                continue;
            }
            let (p, cfg) = group_launch(group);
            let ParamGroup {
                master,
                grad,
                first_moment,
                second_moment,
                compute,
                ..
            } = group;
            let sig = match compute {
                Some(_) => &k::ADAMW_FUSED,
                None => &k::ADAMW_FUSED_F32,
            };
            let adamw = be.function(sig)?;
            let mut b = stream.launch_builder(&adamw);
            b.arg(&p)
                .arg(&self.state.slice)
                .arg(&mut master.slice)
                .arg(&mut grad.slice)
                .arg(&mut first_moment.slice)
                .arg(&mut second_moment.slice);
            if let Some(copy) = compute {
                b.arg(&mut copy.slice);
            }
            // SAFETY: adamw_fused(AdamWParams, const StepState* [1], float*
            // master, float* grad, float* m, float* v, hr_half* compute), or
            // adamw_fused_f32 with the same arguments but the copy; all of
            // the group's n elements (ParamGroup allocates them together).
            unsafe { b.launch(cfg) }.map_err(driver(sig.name))?;
        }
        Ok(())
    }

    /// The device-side verdict of the last step.
    pub fn state(&self) -> &CudaSlice<StepState> {
        &self.state.slice
    }

    /// Downloads the verdict of the last enqueued step and the loss
    /// scaler's state after it (waits for it).
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
