//! Learning-rate schedules, indexed by the number of applied optimizer steps
//! (step 0 is the first update). Every `lr_at` is a pure function of the step,
//! so a resumed run gets the same rates as an uninterrupted one; steps at or
//! past `total_steps` get the last step's rate.

use std::f64::consts::PI;

use serde::{Deserialize, Serialize};

use crate::{check, OptimError};

/// PyTorch's `OneCycleLR` with `anneal_strategy="cos"`, `three_phase=False`.
///
/// With `initial = max_lr / div_factor` and `min = initial / final_div_factor`,
/// and PyTorch's phase boundaries (floats, as in PyTorch):
///
/// * warm-up, steps `0 ..= pct_start·total_steps − 1`: cosine from `initial`
///   (at step 0) up to `max_lr`, reached at step `pct_start·total_steps − 1`;
/// * annealing, up to step `total_steps − 1`: cosine from `max_lr` down to
///   `min`, reached exactly at the last step.
///
/// The cosine is PyTorch's `end + (start − end)/2 · (cos(π·pct) + 1)` with
/// `pct = (step − phase_start)/(phase_end − phase_start)`. So for
/// `total_steps = 100, pct_start = 0.3`, the peak is at step 29 and the
/// minimum at step 99; PyTorch raises past `total_steps`, we hold the last
/// rate. Where `pct_start·total_steps = 1` (a warm-up of one step, a division
/// by zero in PyTorch) step 0 gets `max_lr`.
///
/// The f32 `pct_start` is widened to f64 through its shortest decimal form,
/// so `0.3` in a config behaves as the Python float 0.3 does in PyTorch (the
/// phase boundary `0.3·100 − 1` is exactly 29, not 29.0000012).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OneCycle {
    pub max_lr: f32,
    pub total_steps: u64,
    /// Fraction of the steps spent warming up; PyTorch's default 0.3.
    #[serde(default = "default_pct_start")]
    pub pct_start: f32,
    /// `initial lr = max_lr / div_factor`; PyTorch's default 25.
    #[serde(default = "default_div_factor")]
    pub div_factor: f32,
    /// `min lr = initial lr / final_div_factor`; PyTorch's default 1e4.
    #[serde(default = "default_final_div_factor")]
    pub final_div_factor: f32,
}

fn default_pct_start() -> f32 {
    0.3
}
fn default_div_factor() -> f32 {
    25.0
}
fn default_final_div_factor() -> f32 {
    1e4
}

impl OneCycle {
    pub fn new(
        max_lr: f32,
        total_steps: u64,
        pct_start: f32,
        div_factor: f32,
        final_div_factor: f32,
    ) -> Result<Self, OptimError> {
        let s = Self {
            max_lr,
            total_steps,
            pct_start,
            div_factor,
            final_div_factor,
        };
        s.validate()?;
        Ok(s)
    }

    /// max_lr > 0, total_steps ≥ 1, pct_start in (0, 1), both divisors > 0;
    /// all finite.
    pub fn validate(&self) -> Result<(), OptimError> {
        check("max_lr", self.max_lr, self.max_lr > 0.0, "finite and > 0")?;
        check_steps(
            "total_steps",
            self.total_steps,
            self.total_steps >= 1,
            ">= 1",
        )?;
        let pct = self.pct_start;
        check("pct_start", pct, pct > 0.0 && pct < 1.0, "in (0, 1)")?;
        let div = self.div_factor;
        check("div_factor", div, div > 0.0, "finite and > 0")?;
        let fdiv = self.final_div_factor;
        check("final_div_factor", fdiv, fdiv > 0.0, "finite and > 0")
    }

    /// The rate of the step'th update (0-based).
    pub fn lr_at(&self, step: u64) -> f32 {
        let last = self.total_steps.saturating_sub(1) as f64;
        let step = (step as f64).min(last);
        let max = self.max_lr as f64;
        let initial = max / self.div_factor as f64;
        let min = initial / self.final_div_factor as f64;
        let warmup_end = decimal(self.pct_start) * self.total_steps as f64 - 1.0;
        let lr = if step <= warmup_end {
            cos_anneal(initial, max, phase_pct(step, 0.0, warmup_end))
        } else {
            cos_anneal(max, min, phase_pct(step, warmup_end, last))
        };
        lr as f32
    }
}

/// A learning-rate schedule as written in an experiment's config, e.g. in
/// TOML `{ kind = "one_cycle", max_lr = 0.01, total_steps = 1000 }`,
/// `{ kind = "constant", lr = 1e-3 }` or `{ kind = "warmup_cosine", max_lr =
/// 1e-3, warmup_steps = 100, total_steps = 1000, min_lr = 0.0 }`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Schedule {
    /// The same rate at every step.
    Constant { lr: f32 },
    /// See [`OneCycle`].
    OneCycle(OneCycle),
    /// Linear warm-up `max_lr·(step + 1)/warmup_steps` for steps
    /// `0 .. warmup_steps` (so step `warmup_steps − 1` is at `max_lr`; no
    /// update is wasted at lr 0), then a cosine from `max_lr` down to `min_lr`
    /// reached at the last step, `total_steps − 1`. With `warmup_steps = 0`
    /// step 0 is at `max_lr`.
    WarmupCosine {
        max_lr: f32,
        warmup_steps: u64,
        total_steps: u64,
        min_lr: f32,
    },
}

impl Schedule {
    pub fn validate(&self) -> Result<(), OptimError> {
        match self {
            Schedule::Constant { lr } => check("lr", *lr, *lr >= 0.0, "finite and >= 0"),
            Schedule::OneCycle(one_cycle) => one_cycle.validate(),
            Schedule::WarmupCosine {
                max_lr,
                warmup_steps,
                total_steps,
                min_lr,
            } => {
                check("max_lr", *max_lr, *max_lr > 0.0, "finite and > 0")?;
                check(
                    "min_lr",
                    *min_lr,
                    *min_lr >= 0.0 && min_lr <= max_lr,
                    "finite, >= 0 and <= max_lr",
                )?;
                check_steps("total_steps", *total_steps, *total_steps >= 1, ">= 1")?;
                check_steps(
                    "warmup_steps",
                    *warmup_steps,
                    warmup_steps <= total_steps,
                    "<= total_steps",
                )
            }
        }
    }

    /// The rate of the step'th update (0-based).
    pub fn lr_at(&self, step: u64) -> f32 {
        match self {
            Schedule::Constant { lr } => *lr,
            Schedule::OneCycle(one_cycle) => one_cycle.lr_at(step),
            Schedule::WarmupCosine {
                max_lr,
                warmup_steps,
                total_steps,
                min_lr,
            } => {
                let (max, min) = (*max_lr as f64, *min_lr as f64);
                let last = total_steps.saturating_sub(1);
                let step = step.min(last);
                if step < *warmup_steps {
                    return (max * (step + 1) as f64 / *warmup_steps as f64) as f32;
                }
                let peak = warmup_steps.saturating_sub(1);
                let pct = phase_pct(step as f64, peak as f64, last as f64);
                cos_anneal(max, min, pct) as f32
            }
        }
    }
}

/// PyTorch's `_annealing_cos`.
fn cos_anneal(start: f64, end: f64, pct: f64) -> f64 {
    end + (start - end) / 2.0 * ((PI * pct).cos() + 1.0)
}

/// Progress through a phase; an empty phase counts as finished.
fn phase_pct(step: f64, start: f64, end: f64) -> f64 {
    if end > start {
        (step - start) / (end - start)
    } else {
        1.0
    }
}

/// Widens through the shortest decimal that round-trips the f32.
fn decimal(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

fn check_steps(
    field: &'static str,
    value: u64,
    ok: bool,
    requirement: &'static str,
) -> Result<(), OptimError> {
    if ok {
        Ok(())
    } else {
        Err(OptimError::InvalidValue {
            field,
            value: value.to_string(),
            requirement,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimal_widening_matches_the_written_literal() {
        assert_eq!(decimal(0.3), 0.3f64);
        assert_eq!(decimal(0.7), 0.7f64);
        assert_eq!(decimal(0.25), 0.25f64);
        assert_eq!(decimal(1e-10), 1e-10f64);
    }
}
