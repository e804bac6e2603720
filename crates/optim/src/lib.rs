//! headroom-optim: AdamW with decoupled weight decay, global-norm gradient
//! clipping and learning-rate schedules (constant, one-cycle, warmup+cosine),
//! on the CPU and, fused into one kernel pass per parameter group, on the
//! GPU (`FusedAdamW`, with dynamic loss scaling: `LossScaler`).
//!
//! Everything follows PyTorch's semantics (`torch.optim.AdamW`,
//! `torch.nn.utils.clip_grad_norm_`, `torch.optim.lr_scheduler.OneCycleLR`) so
//! that recipes carry over; where we deviate, the item's documentation says so.
//!
//! Parameters are passed as `&mut [&mut Param]` in the network's fixed order
//! (what `Layer::params_mut` returns); the optimizer keeps its moments in that
//! order and refuses a step whose parameter list changed shape.
//!
//! One AdamW step on a parameter, under a one-cycle schedule:
//!
//! ```
//! use headroom_model::{Param, Tensor};
//! use headroom_optim::{AdamW, AdamWConfig, OneCycle, Schedule};
//!
//! let mut weight = Param::new("w", Tensor::from_vec(&[2], vec![1.0, -1.0]).unwrap(), true);
//! weight.grad = Tensor::from_vec(&[2], vec![0.5, -0.5]).unwrap();
//! let schedule = Schedule::OneCycle(OneCycle::new(1e-2, 100, 0.3, 25.0, 1e4)?);
//! let mut adamw = AdamW::new(AdamWConfig::default())?;
//! adamw.step(&mut [&mut weight], schedule.lr_at(0))?;
//! let w = weight.value.data();
//! assert!(w[0] < 1.0 && w[1] > -1.0, "each moved against its gradient: {w:?}");
//! assert_eq!(adamw.steps_taken(), 1);
//! # Ok::<(), headroom_optim::OptimError>(())
//! ```

mod adamw;
mod clip;
mod error;
mod fused;
mod loss_scale;
mod schedule;

pub use adamw::{state_bytes as adamw_state_bytes, AdamW, AdamWConfig, AdamWState, UpdateOutcome};
pub use clip::{clip_grad_norm, clip_to_norm, grad_norm, gradient_sums_of_squares, norm_of_sums};
pub use error::OptimError;
pub use fused::FusedAdamW;
pub use loss_scale::{LossScaler, LossScalerConfig, LossScalerState, StepOutcome};
pub use schedule::{OneCycle, Schedule};

/// Checks that a value is finite and inside a range, naming the field.
pub(crate) fn check(
    field: &'static str,
    value: f32,
    ok: bool,
    requirement: &'static str,
) -> Result<(), OptimError> {
    if value.is_finite() && ok {
        Ok(())
    } else {
        Err(OptimError::InvalidValue {
            field,
            value: value.to_string(),
            requirement,
        })
    }
}
