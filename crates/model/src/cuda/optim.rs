//! Parameters on the GPU and the fused AdamW step.
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
//! in f64 exactly as there.
//!
//! The host's part: it passes `t` (the index of this step among APPLIED
//! steps, from 1) and the learning rate of that step, and reads the
//! `StepState` afterwards (`read_state`, or a copy into pinned memory) to
//! feed the `LossScaler` and advance its step counter and schedule only on
//! applied steps. Reading it for step s just before enqueuing the optimizer
//! of step s+1 (after s+1's forward and backward are queued) keeps the GPU
//! busy while the host waits.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use half::f16;

use super::backend::{CudaBackend, DeviceBuffer};
use super::error::Context;
use super::kernels as k;
use super::ops::cast_f32_to_f16_into;
use super::params::{AdamWParams, FinalizeParams, StepState, SumSqParams};
use super::tensor::MAX_ELEMENTS;
use super::{CudaError, CudaResult};

/// One group of parameters sharing a weight-decay setting.
#[derive(Debug)]
pub struct ParamGroup {
    pub decay: bool,
    pub master: DeviceBuffer<f32>,
    pub grad: DeviceBuffer<f32>,
    pub first_moment: DeviceBuffer<f32>,
    pub second_moment: DeviceBuffer<f32>,
    pub compute: DeviceBuffer<f16>,
}

impl ParamGroup {
    /// Uploads master weights; gradients and moments start at zero and the
    /// f16 compute copy is cast from the masters.
    pub fn from_host(be: &CudaBackend, decay: bool, values: &[f32]) -> CudaResult<Self> {
        if values.len() > MAX_ELEMENTS {
            return Err(CudaError::Unsupported {
                op: "ParamGroup",
                reason: format!("{} parameters exceed {MAX_ELEMENTS}", values.len()),
            });
        }
        let master = be.upload(values)?;
        let mut compute = be.alloc::<f16>(values.len())?;
        cast_f32_to_f16_into(
            be,
            &master.slice.as_view(),
            &mut compute.slice.as_view_mut(),
        )?;
        Ok(Self {
            decay,
            master,
            grad: be.alloc_zeros(values.len())?,
            first_moment: be.alloc_zeros(values.len())?,
            second_moment: be.alloc_zeros(values.len())?,
            compute,
        })
    }

    pub fn len(&self) -> usize {
        self.master.len()
    }

    pub fn is_empty(&self) -> bool {
        self.master.is_empty()
    }

    /// Sets the gradients to zero (compute stream).
    pub fn zero_grad(&mut self, be: &CudaBackend) -> CudaResult<()> {
        if !self.grad.is_empty() {
            be.compute_stream()
                .memset_zeros(&mut self.grad.slice)
                .during("cuMemsetD8Async")?;
        }
        Ok(())
    }

    /// Master weights, downloaded (for checkpoints and tests).
    pub fn read_master(&self, be: &CudaBackend) -> CudaResult<Vec<f32>> {
        be.download(&self.master.slice)
    }

    /// (first, second) moments, downloaded.
    pub fn read_moments(&self, be: &CudaBackend) -> CudaResult<(Vec<f32>, Vec<f32>)> {
        Ok((
            be.download(&self.first_moment.slice)?,
            be.download(&self.second_moment.slice)?,
        ))
    }

    /// The f16 compute copy, downloaded as f32.
    pub fn read_compute(&self, be: &CudaBackend) -> CudaResult<Vec<f32>> {
        Ok(be
            .download(&self.compute.slice)?
            .into_iter()
            .map(f16::to_f32)
            .collect())
    }
}

/// AdamW hyper-parameters (the learning rate is passed per step). The same
/// meaning and defaults as headroom-optim's `AdamWConfig`, which this crate
/// cannot name (headroom-optim depends on it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWHyper {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

impl Default for AdamWHyper {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// Threads per block of grad_sumsq (the kernel's shared array has 256).
const SUMSQ_THREADS: u32 = 256;
/// Upper bound on grad_sumsq blocks per group.
const SUMSQ_MAX_BLOCKS: usize = 1024;

fn sumsq_blocks(n: usize) -> usize {
    n.div_ceil(SUMSQ_THREADS as usize).min(SUMSQ_MAX_BLOCKS)
}

/// The device side of the optimizer step: scratch for the norm's partial
/// sums and the `StepState` the kernels share.
#[derive(Debug)]
pub struct FusedAdamW {
    hyper: AdamWHyper,
    partials: DeviceBuffer<f64>,
    state: DeviceBuffer<StepState>,
    /// grad_sumsq blocks of each group, in group order.
    blocks: Vec<usize>,
}

impl FusedAdamW {
    /// For exactly these groups (their lengths fix the scratch size).
    pub fn new(be: &CudaBackend, hyper: AdamWHyper, groups: &[ParamGroup]) -> CudaResult<Self> {
        let blocks: Vec<usize> = groups.iter().map(|g| sumsq_blocks(g.len())).collect();
        let total: usize = blocks.iter().sum();
        Ok(Self {
            hyper,
            partials: be.alloc_zeros::<f64>(total.max(1))?,
            state: be.alloc_zeros::<StepState>(1)?,
            blocks,
        })
    }

    pub fn hyper(&self) -> &AdamWHyper {
        &self.hyper
    }

    /// Enqueues one optimizer step. `t` is this step's index among applied
    /// steps (1 for the first), `lr` its learning rate, `loss_scale` the
    /// scale the gradients carry, `max_norm` the global-norm clip (0 = off).
    /// With `zero_grad` the gradients are cleared afterwards, whether the
    /// step was applied or skipped.
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
    ) -> CudaResult<()> {
        let lens: Vec<usize> = groups.iter().map(ParamGroup::len).collect();
        let expected: Vec<usize> = lens.iter().map(|&n| sumsq_blocks(n)).collect();
        if expected != self.blocks {
            return Err(CudaError::shape(
                "FusedAdamW::step",
                format!("the {} groups it was made for", self.blocks.len()),
                format!("groups of lengths {lens:?}"),
            ));
        }
        if !(lr.is_finite() && lr >= 0.0 && loss_scale.is_finite() && loss_scale > 0.0 && t >= 1) {
            return Err(CudaError::Unsupported {
                op: "FusedAdamW::step",
                reason: format!(
                    "needs lr ≥ 0, loss_scale > 0 (finite) and t ≥ 1; got {lr}, {loss_scale}, {t}"
                ),
            });
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
            unsafe { b.launch(cfg) }.during("grad_sumsq")?;
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
            unsafe { b.launch(cfg) }.during("step_finalize")?;
        }

        // 3. AdamW per group (PyTorch's factors, computed as in adamw.rs).
        let h = &self.hyper;
        let tf = t as f64;
        let bias_correction1 = 1.0 - (h.beta1 as f64).powf(tf);
        let bias_correction2 = 1.0 - (h.beta2 as f64).powf(tf);
        let decay_factor = (1.0 - lr as f64 * h.weight_decay as f64) as f32;
        let base = AdamWParams {
            n: 0,
            zero_grad: zero_grad as u32,
            beta1_complement: 1.0 - h.beta1,
            beta2: h.beta2,
            beta2_complement: 1.0 - h.beta2,
            eps: h.eps,
            decay_factor: 1.0,
            neg_step_size: (-(lr as f64) / bias_correction1) as f32,
            bias_correction2_sqrt: bias_correction2.sqrt() as f32,
        };
        let adamw = be.function(&k::ADAMW_FUSED)?;
        for group in groups.iter_mut() {
            let n = group.len();
            if n == 0 {
                continue;
            }
            let p = AdamWParams {
                n: n as u32,
                decay_factor: if group.decay { decay_factor } else { 1.0 },
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
                .arg(&self.state.slice)
                .arg(&mut master.slice)
                .arg(&mut grad.slice)
                .arg(&mut first_moment.slice)
                .arg(&mut second_moment.slice)
                .arg(&mut compute.slice);
            // SAFETY: adamw_fused(AdamWParams, const StepState*, float*
            // master, float* grad, float* m, float* v, hr_half* compute), all
            // of the group's n elements (ParamGroup allocates them together).
            unsafe { b.launch(cfg) }.during("adamw_fused")?;
        }
        Ok(())
    }

    /// The device-side verdict of the last step.
    pub fn state(&self) -> &CudaSlice<StepState> {
        &self.state.slice
    }

    /// Downloads the verdict of the last enqueued step (waits for it).
    pub fn read_state(&self, be: &CudaBackend) -> CudaResult<StepState> {
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
