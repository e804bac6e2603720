//! AdamW (Loshchilov & Hutter), with PyTorch's `torch.optim.AdamW` semantics
//! (single-tensor path, `amsgrad=False`, `maximize=False`). For step `t`
//! (counted from 1) and learning rate `lr`, element-wise:
//!
//! ```text
//! p  ← p · (1 − lr·wd)                      only where Param::decay is true
//! m  ← m + (1 − β1)·(g − m)                 (= β1·m + (1 − β1)·g, PyTorch's lerp)
//! v  ← β2·v + (1 − β2)·g²
//! p  ← p − (lr / (1 − β1ᵗ)) · m / (√v / √(1 − β2ᵗ) + ε)
//! ```
//!
//! The scalar factors are computed in f64 (PyTorch computes them as Python
//! floats), the element-wise work in f32. Master weights and moments are f32.

use headroom_model::{wide, Param};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::{check, OptimError};

/// Elements per parallel task of the update.
const CHUNK: usize = 1 << 14;

/// What [`AdamW::step_if_finite`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UpdateOutcome {
    Applied,
    /// Nothing changed: the update would have left a value that is not
    /// finite in parameter `index` (`name`) or in its moments.
    NonFinite {
        index: usize,
        name: String,
    },
}

/// The scalars of one update, element by element (see the module's
/// formulas).
#[derive(Clone, Copy)]
struct ElementFactors {
    decay_factor: f32,
    neg_step_size: f32,
    bias_correction2_sqrt: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    eps: f32,
}

impl ElementFactors {
    /// Whether the update of `param` (moments `m`, `v`) leaves every value
    /// finite: the same operations as the update, nothing written.
    fn stays_finite(&self, param: &Param, m: &[f32], v: &[f32]) -> bool {
        let decay = if param.decay { self.decay_factor } else { 1.0 };
        let f = *self;
        param
            .value
            .data()
            .par_chunks(CHUNK)
            .zip(param.grad.data().par_chunks(CHUNK))
            .zip(m.par_chunks(CHUNK))
            .zip(v.par_chunks(CHUNK))
            .all(|(((p, g), m), v)| {
                let mut finite = true;
                wide(
                    #[inline(always)]
                    || {
                        let moments = m.iter().zip(v);
                        for ((&p, &g), (&m, &v)) in p.iter().zip(g).zip(moments) {
                            let m = m + f.one_minus_beta1 * (g - m);
                            let v = f.beta2 * v + f.one_minus_beta2 * g * g;
                            let denom = v.sqrt() / f.bias_correction2_sqrt + f.eps;
                            let p = p * decay + f.neg_step_size * (m / denom);
                            // Branch-free, so the loop stays vectorised.
                            finite &= m.is_finite() & v.is_finite() & p.is_finite();
                        }
                    },
                );
                finite
            })
    }
}

/// Hyper-parameters of AdamW. The learning rate is not one of them: it is
/// passed to every [`AdamW::step`], since it comes from a schedule.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AdamWConfig {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Decoupled weight decay; the update multiplies decayed parameters by
    /// `1 - lr * weight_decay` (PyTorch convention: scaled by the current lr).
    pub weight_decay: f32,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// The per-step factors of AdamW at learning rate `lr` and applied step `t`
/// (PyTorch's, computed in f64): the CPU step and the fused GPU kernel use
/// the same ones.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct StepFactors {
    /// 1 - lr · weight_decay (for parameters that decay).
    pub decay_factor: f32,
    /// -lr / (1 - β1^t).
    pub neg_step_size: f32,
    /// √(1 - β2^t).
    pub bias_correction2_sqrt: f32,
}

impl AdamWConfig {
    pub(crate) fn step_factors(&self, lr: f32, t: u64) -> StepFactors {
        let t = t as f64;
        let bias_correction1 = 1.0 - (self.beta1 as f64).powf(t);
        let bias_correction2 = 1.0 - (self.beta2 as f64).powf(t);
        StepFactors {
            decay_factor: (1.0 - lr as f64 * self.weight_decay as f64) as f32,
            neg_step_size: (-(lr as f64) / bias_correction1) as f32,
            bias_correction2_sqrt: bias_correction2.sqrt() as f32,
        }
    }

    /// β1, β2 in [0, 1); ε > 0; weight_decay ≥ 0; all finite.
    pub fn validate(&self) -> Result<(), OptimError> {
        let b1 = self.beta1;
        let b2 = self.beta2;
        check("beta1", b1, (0.0..1.0).contains(&b1), "in [0, 1)")?;
        check("beta2", b2, (0.0..1.0).contains(&b2), "in [0, 1)")?;
        check("eps", self.eps, self.eps > 0.0, "finite and > 0")?;
        check(
            "weight_decay",
            self.weight_decay,
            self.weight_decay >= 0.0,
            "finite and >= 0",
        )
    }
}

/// The optimizer's resumable state, for checkpoints: the number of steps taken
/// and both moments of every parameter, in the network's parameter order.
/// A fresh optimizer's state is `step = 0` with no moments.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct AdamWState {
    pub step: u64,
    pub first_moment: Vec<Vec<f32>>,
    pub second_moment: Vec<Vec<f32>>,
}

/// AdamW over a fixed, ordered list of parameters.
#[derive(Clone, Debug)]
pub struct AdamW {
    config: AdamWConfig,
    step: u64,
    /// `None` until the first step (or a `load_state` with moments).
    moments: Option<Moments>,
    /// Sharded (ZeRO-1): the parameters this optimizer updates and keeps
    /// moments for, by index; the others' moments are empty and their
    /// updates are another rank's. None: every parameter.
    owned: Option<Vec<bool>>,
}

/// How `update` goes about the finiteness check.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Apply,
    CheckThenApply,
    CheckOnly,
}

#[derive(Clone, Debug)]
struct Moments {
    first: Vec<Vec<f32>>,
    second: Vec<Vec<f32>>,
    /// Parameter shapes the moments belong to; `None` right after
    /// `load_state` (a state holds only lengths), filled by the next step.
    shapes: Option<Vec<Vec<usize>>>,
}

impl AdamW {
    pub fn new(config: AdamWConfig) -> Result<Self, OptimError> {
        config.validate()?;
        Ok(Self {
            config,
            step: 0,
            moments: None,
            owned: None,
        })
    }

    /// From now on only the parameters marked in `owned` (by index) are
    /// updated and keep moments; the others' moments are dropped (a
    /// sharded optimizer, ZeRO-1: another rank owns them). None: all
    /// again (their dropped moments are not brought back; see
    /// [`Self::fill_moments`]).
    pub fn shard(&mut self, owned: Option<Vec<bool>>) {
        self.owned = owned;
        self.drop_unowned();
    }

    /// Releases the moments of the parameters this optimizer does not own
    /// (after [`Self::fill_moments`] completed them for a checkpoint).
    pub fn drop_unowned(&mut self) {
        let (Some(owned), Some(moments)) = (&self.owned, self.moments.as_mut()) else {
            return;
        };
        for (index, own) in owned.iter().enumerate() {
            if !own {
                for moment in [&mut moments.first, &mut moments.second] {
                    if let Some(m) = moment.get_mut(index) {
                        *m = Vec::new();
                    }
                }
            }
        }
        moments.shapes = None;
    }

    /// Sets parameter `index`'s moments (another rank's, gathered so that
    /// the state is whole for a checkpoint). Fails before the first step,
    /// or when the index or the lengths do not fit.
    pub fn fill_moments(
        &mut self,
        index: usize,
        first: Vec<f32>,
        second: Vec<f32>,
    ) -> Result<(), OptimError> {
        let moments = self
            .moments
            .as_mut()
            .ok_or_else(|| OptimError::InvalidState("no moments before the first step".into()))?;
        if index >= moments.first.len() || first.len() != second.len() {
            return Err(OptimError::InvalidState(format!(
                "moments of parameter {index}: {} and {} values for {} parameters",
                first.len(),
                second.len(),
                moments.first.len()
            )));
        }
        moments.first[index] = first;
        moments.second[index] = second;
        moments.shapes = None;
        Ok(())
    }

    /// After a [`Self::check_step`] whose update was not applied: before
    /// the first step there are no moments (a state at step 0 has none).
    pub fn forget_unapplied(&mut self) {
        if self.step == 0 {
            self.moments = None;
        }
    }

    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// One update with learning rate `lr` for `params` in a fixed order (the
    /// network's). Weight decay applies only where `Param::decay` is true.
    ///
    /// The first step creates the moments (zeros) for exactly these
    /// parameters; a later step whose parameter count or shapes differ fails
    /// with an error naming the parameter, as does a gradient whose shape is
    /// not its value's or a negative or non-finite `lr`. A failed step changes
    /// nothing: neither the parameters nor the optimizer's state.
    pub fn step(&mut self, params: &mut [&mut Param], lr: f32) -> Result<(), OptimError> {
        self.update(params, lr, Mode::Apply).map(drop)
    }

    /// What [`Self::step_if_finite`] would do, with nothing changed but
    /// the first step's moments, made here (so that a refusal of their
    /// memory comes before anything is applied): the ranks of a
    /// data-parallel run each check their part, agree, and then all
    /// [`Self::step`] or none (a skip calls [`Self::forget_unapplied`]).
    pub fn check_step(
        &mut self,
        params: &mut [&mut Param],
        lr: f32,
    ) -> Result<UpdateOutcome, OptimError> {
        self.update(params, lr, Mode::CheckOnly)
    }

    /// [`Self::step`], unless the update would leave a value that is not
    /// finite in a parameter or in a moment (finite gradients and a finite
    /// learning rate can still overflow: a learning rate of 1e35, a
    /// gradient whose square is beyond f32). Then nothing changes, neither
    /// the parameters nor the optimizer's state (its step count included),
    /// and the first such parameter is named. The check is a read-only pass
    /// computing the same values the update writes, so an applied step is
    /// bit for bit the one `step` makes, and it costs no memory.
    pub fn step_if_finite(
        &mut self,
        params: &mut [&mut Param],
        lr: f32,
    ) -> Result<UpdateOutcome, OptimError> {
        self.update(params, lr, Mode::CheckThenApply)
    }

    fn update(
        &mut self,
        params: &mut [&mut Param],
        lr: f32,
        mode: Mode,
    ) -> Result<UpdateOutcome, OptimError> {
        if let Some(owned) = &self.owned {
            if owned.len() != params.len() {
                return Err(OptimError::ParamCount {
                    expected: owned.len(),
                    got: params.len(),
                });
            }
        }
        check("lr", lr, lr >= 0.0, "finite and >= 0")?;
        for (index, p) in params.iter().enumerate() {
            if !p.grad_fits() {
                return Err(OptimError::GradShape {
                    index,
                    name: p.name.clone(),
                    grad: p.grad.shape().to_vec(),
                    value: p.value.shape().to_vec(),
                });
            }
        }
        let created = self.moments.is_none();
        match &mut self.moments {
            None => {
                let owned = self.owned.as_deref();
                self.moments = Some(Moments {
                    first: zeroed_like(params, owned)?,
                    second: zeroed_like(params, owned)?,
                    shapes: Some(params.iter().map(|p| p.value.shape().to_vec()).collect()),
                });
            }
            Some(moments) => moments.check(params, self.owned.as_deref())?,
        }
        let owned = self.owned.as_deref();
        let updated = |index: usize, param: &Param| {
            !param.frozen && owned.is_none_or(|o| o.get(index).copied().unwrap_or(false))
        };
        let Some(moments) = self.moments.as_mut() else {
            unreachable!("moments were created above")
        };

        let c = &self.config;
        let StepFactors {
            decay_factor,
            neg_step_size,
            bias_correction2_sqrt,
        } = c.step_factors(lr, self.step + 1);
        let one_minus_beta1 = 1.0 - c.beta1;
        let (beta2, one_minus_beta2, eps) = (c.beta2, 1.0 - c.beta2, c.eps);
        let factors = ElementFactors {
            decay_factor,
            neg_step_size,
            bias_correction2_sqrt,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            eps,
        };
        if mode != Mode::Apply {
            let found = params
                .iter()
                .zip(&moments.first)
                .zip(&moments.second)
                .enumerate()
                .position(|(index, ((param, m), v))| {
                    updated(index, param) && !factors.stays_finite(param, m, v)
                });
            if let Some(index) = found {
                if created {
                    self.moments = None;
                }
                return Ok(UpdateOutcome::NonFinite {
                    index,
                    name: params[index].name.clone(),
                });
            }
            if mode == Mode::CheckOnly {
                // The moments made here are the ones the step will use
                // (the refusal of their memory came now, before any rank
                // applied); a skip drops them (`forget_unapplied`).
                return Ok(UpdateOutcome::Applied);
            }
        }
        self.step += 1;

        for (index, ((param, m), v)) in params
            .iter_mut()
            .zip(&mut moments.first)
            .zip(&mut moments.second)
            .enumerate()
        {
            // A frozen parameter (a LoRA base weight) is not trained, not
            // even decayed; another rank's (sharded) is that rank's work.
            if !updated(index, param) {
                continue;
            }
            let decay = if param.decay { decay_factor } else { 1.0 };
            let Param { value, grad, .. } = &mut **param;
            let p = value.data_mut();
            let g = grad.data();
            // Elementwise, so chunks in parallel give the same bits; each
            // compiled for the CPU's widest vectors (IEEE operations only,
            // so the width does not change them either).
            p.par_chunks_mut(CHUNK)
                .zip(g.par_chunks(CHUNK))
                .zip(m.par_chunks_mut(CHUNK))
                .zip(v.par_chunks_mut(CHUNK))
                .for_each(|(((p, g), m), v)| {
                    wide(
                        #[inline(always)]
                        || {
                            // Equal-length chunks (lengths were checked
                            // above): the zip runs without bounds checks.
                            let moments = m.iter_mut().zip(v.iter_mut());
                            for ((p, &g), (m, v)) in p.iter_mut().zip(g).zip(moments) {
                                *m += one_minus_beta1 * (g - *m);
                                *v = beta2 * *v + one_minus_beta2 * g * g;
                                let denom = v.sqrt() / bias_correction2_sqrt + eps;
                                *p = *p * decay + neg_step_size * (*m / denom);
                            }
                        },
                    )
                });
        }
        Ok(UpdateOutcome::Applied)
    }

    /// Number of applied steps (also the `t` of the bias correction).
    pub fn steps_taken(&self) -> u64 {
        self.step
    }

    /// The first and second moments of every parameter, borrowed: what
    /// `state` copies, for a checkpoint written with no copy. Empty before
    /// the first step.
    pub fn moments(&self) -> [&[Vec<f32>]; 2] {
        match &self.moments {
            Some(m) => [&m.first, &m.second],
            None => [&[], &[]],
        }
    }

    /// A copy of the state, for checkpoints.
    pub fn state(&self) -> Result<AdamWState, OptimError> {
        Ok(match &self.moments {
            None => AdamWState {
                step: self.step,
                ..AdamWState::default()
            },
            Some(m) => AdamWState {
                step: self.step,
                first_moment: copy_fallibly(&m.first)?,
                second_moment: copy_fallibly(&m.second)?,
            },
        })
    }

    /// Replaces the state (resume from a checkpoint). The state is checked for
    /// consistency here (matching moment lengths, finite values, second
    /// moments ≥ 0, no moments at step 0 and vice versa); whether it fits the
    /// network is checked by the next [`AdamW::step`], which fails naming the
    /// first parameter whose length differs. On error the optimizer is
    /// unchanged.
    pub fn load_state(&mut self, state: AdamWState) -> Result<(), OptimError> {
        let AdamWState {
            step,
            first_moment,
            second_moment,
        } = state;
        if first_moment.len() != second_moment.len() {
            return Err(OptimError::InvalidState(format!(
                "{} first moments but {} second moments",
                first_moment.len(),
                second_moment.len()
            )));
        }
        if step == 0 {
            if !first_moment.is_empty() {
                return Err(OptimError::InvalidState(
                    "step is 0 but moments are present".into(),
                ));
            }
            self.step = 0;
            self.moments = None;
            return Ok(());
        }
        for (index, (m, v)) in first_moment.iter().zip(&second_moment).enumerate() {
            if m.len() != v.len() {
                return Err(OptimError::InvalidState(format!(
                    "parameter {index}: first moment has {} elements, second moment {}",
                    m.len(),
                    v.len()
                )));
            }
            if !m.iter().all(|x| x.is_finite()) {
                return Err(OptimError::InvalidState(format!(
                    "parameter {index}: first moment is not finite"
                )));
            }
            // `!(x >= 0)` also catches NaN.
            if !v.iter().all(|&x| x.is_finite() && x >= 0.0) {
                return Err(OptimError::InvalidState(format!(
                    "parameter {index}: second moment is negative or not finite"
                )));
            }
        }
        self.step = step;
        self.moments = Some(Moments {
            first: first_moment,
            second: second_moment,
            shapes: None,
        });
        // A whole state (a checkpoint's) into a sharded optimizer: it keeps
        // its own parameters' moments.
        self.drop_unowned();
        Ok(())
    }
}

/// A copy of per-parameter vectors, allocated fallibly (a checkpoint's
/// snapshot must not abort the process when memory is short).
fn copy_fallibly(vectors: &[Vec<f32>]) -> Result<Vec<Vec<f32>>, OptimError> {
    vectors
        .iter()
        .map(|v| {
            let mut copy = headroom_model::memory::try_scratch(v.len())?;
            copy.extend_from_slice(v);
            Ok(copy)
        })
        .collect()
}

/// One zero vector per parameter, allocated fallibly: the moments double
/// the model's memory, so a refusal must reach the memory policy as an
/// out-of-memory value, not abort the process. A frozen parameter is never
/// updated, so its moments are empty: a LoRA run keeps state for its
/// adapters only.
fn zeroed_like(params: &[&mut Param], owned: Option<&[bool]>) -> Result<Vec<Vec<f32>>, OptimError> {
    params
        .iter()
        .enumerate()
        .map(|(index, p)| {
            let len = if is_owned(owned, index) {
                moment_len(p)
            } else {
                0
            };
            headroom_model::memory::try_zeroed(len).map_err(OptimError::from)
        })
        .collect()
}

fn is_owned(owned: Option<&[bool]>, index: usize) -> bool {
    owned.is_none_or(|o| o.get(index).copied().unwrap_or(false))
}

/// Elements of each moment of `param`: none when it is frozen.
fn moment_len(param: &Param) -> usize {
    if param.frozen {
        0
    } else {
        param.value.len()
    }
}

/// Bytes the optimizer state of `params` takes (two f32 moments for every
/// trainable element), for reports and memory plans before the first step.
pub fn state_bytes(params: &[&mut Param]) -> u64 {
    params.iter().map(|p| 2 * 4 * moment_len(p) as u64).sum()
}

impl Moments {
    /// Checks `params` against the parameters the moments were made for and,
    /// after a `load_state`, records their shapes.
    fn check(&mut self, params: &[&mut Param], owned: Option<&[bool]>) -> Result<(), OptimError> {
        if params.len() != self.first.len() {
            return Err(OptimError::ParamCount {
                expected: self.first.len(),
                got: params.len(),
            });
        }
        match &self.shapes {
            Some(shapes) => {
                for (index, (p, shape)) in params.iter().zip(shapes).enumerate() {
                    if p.value.shape() != shape.as_slice() {
                        return Err(OptimError::ParamShape {
                            index,
                            name: p.name.clone(),
                            expected: format!("shape {shape:?}"),
                            got: format!("shape {:?}", p.value.shape()),
                        });
                    }
                }
            }
            None => {
                for (index, (p, m)) in params.iter().zip(&self.first).enumerate() {
                    let len = if is_owned(owned, index) {
                        moment_len(p)
                    } else {
                        0
                    };
                    if len != m.len() {
                        return Err(OptimError::ParamShape {
                            index,
                            name: p.name.clone(),
                            expected: format!("{} elements", m.len()),
                            got: format!(
                                "{} elements (shape {:?})",
                                p.value.len(),
                                p.value.shape()
                            ),
                        });
                    }
                }
                self.shapes = Some(params.iter().map(|p| p.value.shape().to_vec()).collect());
            }
        }
        Ok(())
    }
}
