//! Dynamic loss scaling: the rule, in pure Rust.
//!
//! f16 gradients underflow for small losses; the loss (in practice its
//! gradient, in the loss kernel) is multiplied by a scale S before backward
//! and the gradients are divided by S in the optimizer kernel. S starts at
//! 2^16; after `growth_interval` (2000) consecutive clean steps it doubles;
//! a step whose gradients hold inf or NaN is skipped (the optimizer kernel
//! already left the weights alone) and S halves, never below `min_scale`.
//! Only applied steps advance the step counter and the learning-rate
//! schedule: `update` says which happened.
//!
//! On the GPU the scaler runs on the device, in the optimizer's
//! `step_commit` kernel, so that no step waits for the host to learn the
//! verdict (a step whose update would overflow with finite gradients is
//! skipped there with the scale kept, as `schedule_missed` is); its state reaches the host with each step's record. `LossScaler`
//! here is the reference that kernel is checked against, and
//! `LossScalerConfig`/`LossScalerState` are its settings and its
//! checkpointed state.

/// Settings of the loss scaler.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScalerConfig {
    pub init_scale: f32,
    pub growth_factor: f32,
    pub backoff_factor: f32,
    /// Clean steps in a row before the scale grows.
    pub growth_interval: u32,
    /// The floor: backing off never goes below it.
    pub min_scale: f32,
    /// The ceiling: growth never goes above it.
    pub max_scale: f32,
}

impl Default for LossScalerConfig {
    fn default() -> Self {
        Self {
            init_scale: 65_536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            min_scale: 1.0,
            max_scale: 16_777_216.0, // 2^24
        }
    }
}

impl LossScalerConfig {
    /// No loss scaling (f32 training): the scale stays 1, and a step whose
    /// gradients hold inf or NaN is still skipped, as on the CPU.
    pub fn unit() -> Self {
        Self {
            init_scale: 1.0,
            min_scale: 1.0,
            max_scale: 1.0,
            growth_interval: u32::MAX,
            ..Self::default()
        }
    }

    /// Names the first bad field.
    pub fn validate(&self) -> Result<(), String> {
        let c = self;
        let checks = [
            ("min_scale", c.min_scale > 0.0 && c.min_scale.is_finite()),
            (
                "max_scale",
                c.max_scale >= c.min_scale && c.max_scale.is_finite(),
            ),
            (
                "init_scale",
                c.init_scale >= c.min_scale && c.init_scale <= c.max_scale,
            ),
            (
                "growth_factor",
                c.growth_factor > 1.0 && c.growth_factor.is_finite(),
            ),
            (
                "backoff_factor",
                c.backoff_factor > 0.0 && c.backoff_factor < 1.0,
            ),
            ("growth_interval", c.growth_interval > 0),
        ];
        match checks.iter().find(|(_, ok)| !ok) {
            Some((field, _)) => Err(format!("loss scaler: invalid {field} in {c:?}")),
            None => Ok(()),
        }
    }
}

impl LossScalerConfig {
    /// A checkpointed state as this configuration continues it: the scale
    /// clamped into [min_scale, max_scale], the clean-step count below the
    /// growth interval; a scale that is not finite and positive is refused.
    pub fn admit(&self, state: LossScalerState) -> Result<LossScalerState, String> {
        if !(state.scale.is_finite() && state.scale > 0.0) {
            return Err(format!(
                "loss scaler: invalid scale {} in checkpoint",
                state.scale
            ));
        }
        Ok(LossScalerState {
            scale: state.scale.clamp(self.min_scale, self.max_scale),
            clean_steps: state.clean_steps.min(self.growth_interval - 1),
        })
    }
}

/// What happened to one optimizer step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepOutcome {
    /// The update was applied: advance the step counter and the schedule.
    Applied,
    /// Gradients held inf or NaN: nothing changed; do not advance.
    Skipped,
}

/// The scaler's resumable state (for checkpoints).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScalerState {
    pub scale: f32,
    pub clean_steps: u32,
}

#[derive(Clone, Debug)]
pub struct LossScaler {
    config: LossScalerConfig,
    scale: f32,
    /// Clean steps since the last growth or overflow.
    clean_steps: u32,
    consecutive_skips: u32,
    applied: u64,
    skipped: u64,
}

impl LossScaler {
    pub fn new(config: LossScalerConfig) -> Result<Self, String> {
        config.validate()?;
        Ok(Self {
            scale: config.init_scale,
            config,
            clean_steps: 0,
            consecutive_skips: 0,
            applied: 0,
            skipped: 0,
        })
    }

    pub fn config(&self) -> &LossScalerConfig {
        &self.config
    }

    /// The scale to run the next step with.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Records the verdict of one step that ran at `scale()`, in step order,
    /// once per step.
    pub fn update(&mut self, found_inf: bool) -> StepOutcome {
        if found_inf {
            self.skipped += 1;
            self.consecutive_skips += 1;
            self.clean_steps = 0;
            self.scale = (self.scale * self.config.backoff_factor).max(self.config.min_scale);
            StepOutcome::Skipped
        } else {
            self.applied += 1;
            self.consecutive_skips = 0;
            self.clean_steps += 1;
            if self.clean_steps >= self.config.growth_interval {
                self.scale = (self.scale * self.config.growth_factor).min(self.config.max_scale);
                self.clean_steps = 0;
            }
            StepOutcome::Applied
        }
    }

    /// Skipped steps in a row (a run stuck at the floor with overflowing
    /// gradients is diverging; the training loop decides when to stop).
    pub fn consecutive_skips(&self) -> u32 {
        self.consecutive_skips
    }

    pub fn applied_steps(&self) -> u64 {
        self.applied
    }

    pub fn skipped_steps(&self) -> u64 {
        self.skipped
    }

    pub fn state(&self) -> LossScalerState {
        LossScalerState {
            scale: self.scale,
            clean_steps: self.clean_steps,
        }
    }

    /// Restores a checkpointed state (`LossScalerConfig::admit`).
    pub fn load_state(&mut self, state: LossScalerState) -> Result<(), String> {
        let state = self.config.admit(state)?;
        self.scale = state.scale;
        self.clean_steps = state.clean_steps;
        self.consecutive_skips = 0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scaler(interval: u32, min_scale: f32) -> LossScaler {
        LossScaler::new(LossScalerConfig {
            growth_interval: interval,
            min_scale,
            ..LossScalerConfig::default()
        })
        .unwrap()
    }

    /// Runs one step at the current scale with the given verdict.
    fn step(s: &mut LossScaler, found_inf: bool) -> StepOutcome {
        s.update(found_inf)
    }

    #[test]
    fn defaults_are_the_design() {
        let s = LossScaler::new(LossScalerConfig::default()).unwrap();
        assert_eq!(s.scale(), 65_536.0);
        assert_eq!(s.config().growth_interval, 2000);
        assert_eq!(s.config().growth_factor, 2.0);
        assert_eq!(s.config().backoff_factor, 0.5);
    }

    #[test]
    fn grows_after_exactly_the_interval_of_clean_steps() {
        let mut s = LossScaler::new(LossScalerConfig::default()).unwrap();
        for i in 1..2000 {
            assert_eq!(step(&mut s, false), StepOutcome::Applied);
            assert_eq!(s.scale(), 65_536.0, "no growth after {i} clean steps");
        }
        step(&mut s, false);
        assert_eq!(s.scale(), 131_072.0, "grows on the 2000th clean step");
        for _ in 0..1999 {
            step(&mut s, false);
        }
        assert_eq!(s.scale(), 131_072.0);
        step(&mut s, false);
        assert_eq!(s.scale(), 262_144.0, "the count restarts after growth");
        assert_eq!(s.applied_steps(), 4000);
        assert_eq!(s.skipped_steps(), 0);
    }

    #[test]
    fn overflow_skips_halves_and_restarts_the_count() {
        let mut s = scaler(3, 1.0);
        step(&mut s, false);
        step(&mut s, false);
        assert_eq!(step(&mut s, true), StepOutcome::Skipped);
        assert_eq!(s.scale(), 32_768.0);
        assert_eq!(s.consecutive_skips(), 1);
        // Two clean steps are not enough after the overflow reset the count.
        step(&mut s, false);
        step(&mut s, false);
        assert_eq!(s.scale(), 32_768.0);
        assert_eq!(s.consecutive_skips(), 0);
        step(&mut s, false);
        assert_eq!(s.scale(), 65_536.0);
        assert_eq!((s.applied_steps(), s.skipped_steps()), (5, 1));
    }

    #[test]
    fn backoff_stops_at_the_floor_and_keeps_skipping() {
        let mut s = scaler(2000, 1024.0);
        for _ in 0..6 {
            assert_eq!(step(&mut s, true), StepOutcome::Skipped);
        }
        // 65536 → 32768 → 16384 → 8192 → 4096 → 2048 → 1024.
        assert_eq!(s.scale(), 1024.0);
        for _ in 0..10 {
            assert_eq!(step(&mut s, true), StepOutcome::Skipped);
            assert_eq!(s.scale(), 1024.0, "never below the floor");
        }
        assert_eq!(s.consecutive_skips(), 16);
        assert_eq!(step(&mut s, false), StepOutcome::Applied);
        assert_eq!(s.consecutive_skips(), 0);
    }

    #[test]
    fn growth_stops_at_the_ceiling() {
        let mut s = LossScaler::new(LossScalerConfig {
            growth_interval: 1,
            max_scale: 262_144.0,
            ..LossScalerConfig::default()
        })
        .unwrap();
        for _ in 0..10 {
            step(&mut s, false);
        }
        assert_eq!(s.scale(), 262_144.0);
    }

    #[test]
    fn state_round_trips_and_is_validated() {
        let mut s = scaler(10, 1.0);
        for _ in 0..7 {
            step(&mut s, false);
        }
        step(&mut s, true);
        step(&mut s, false);
        let st = s.state();
        assert_eq!(
            st,
            LossScalerState {
                scale: 32_768.0,
                clean_steps: 1
            }
        );
        let mut t = scaler(10, 1.0);
        t.load_state(st).unwrap();
        assert_eq!(t.state(), st);
        assert!(t
            .load_state(LossScalerState {
                scale: f32::NAN,
                clean_steps: 0
            })
            .is_err());
        t.load_state(LossScalerState {
            scale: 1e30,
            clean_steps: 99,
        })
        .unwrap();
        assert_eq!(t.scale(), t.config().max_scale);
        assert_eq!(t.state().clean_steps, 9);
    }

    #[test]
    fn bad_configs_name_the_field() {
        let bad = |c: LossScalerConfig, field: &str| {
            let err = LossScaler::new(c).unwrap_err();
            assert!(err.contains(field), "{err}");
        };
        let d = LossScalerConfig::default();
        bad(
            LossScalerConfig {
                min_scale: 0.0,
                ..d
            },
            "min_scale",
        );
        bad(
            LossScalerConfig {
                backoff_factor: 1.0,
                ..d
            },
            "backoff_factor",
        );
        bad(
            LossScalerConfig {
                growth_factor: 1.0,
                ..d
            },
            "growth_factor",
        );
        bad(
            LossScalerConfig {
                growth_interval: 0,
                ..d
            },
            "growth_interval",
        );
        bad(
            LossScalerConfig {
                init_scale: 0.5,
                ..d
            },
            "init_scale",
        );
        bad(
            LossScalerConfig {
                max_scale: f32::INFINITY,
                ..d
            },
            "max_scale",
        );
    }
}
