//! Inverted dropout, any shape: in training each element is zeroed with
//! probability p and the rest scaled by 1/(1 − p); evaluation is the
//! identity (the input's buffer, shared).
//!
//! The randomness is counter-based: whether element i is kept is a hash of
//! (the layer's seed, the forward counter, i), so no mask is stored: backward
//! regenerates it, and a run resumed from a checkpoint draws the same masks.
//! The counter counts training forwards; it is a buffer (saved in
//! checkpoints, and put back by `Network::forward` when a step fails).
//! A forward in recompute mode (checkpointing, dry runs) reuses the last
//! counter and leaves it alone, so a recomputed segment drops the same
//! elements as its first forward.
//!
//! Saves for backward: the shape and the counter it used (no tensor).

use super::relu::{par_build, PAR_CHUNK};
use crate::{Layer, Mode, ModelError, Result, Tensor};

/// The counter is kept as four exact 16-bit limbs in an f32 buffer.
const LIMBS: usize = 4;
const LIMB: u64 = 1 << 16;

pub struct Dropout {
    pub(crate) p: f32,
    seed: u64,
    counter: Tensor,
    /// Data parallel: masks are drawn this many forwards ahead of the
    /// counter (`Layer::shift_dropout`); 0 alone.
    offset: u64,
    recompute: bool,
    saved: Option<(Vec<usize>, u64)>,
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Uniform in [0, 1) from (seed, counter, index).
fn uniform(seed: u64, counter: u64, index: usize) -> f32 {
    let stream = mix(seed ^ mix(counter.wrapping_add(0x9E37_79B9_7F4A_7C15)));
    let bits = mix(stream ^ (index as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93));
    (bits >> 40) as f32 / (1u64 << 24) as f32
}

/// A counter from its limbs (16 bits each in an f32, lowest first: exact
/// in f32, so that the buffer survives checkpoints and the ranks' mean).
pub(crate) fn counter_of_limbs(limbs: &[f32]) -> u64 {
    limbs
        .iter()
        .rev()
        .fold(0u64, |acc, &limb| acc * LIMB + limb as u64)
}

/// `value` written into `limbs` as `counter_of_limbs` reads it.
pub(crate) fn limbs_of_counter(mut value: u64, limbs: &mut [f32]) {
    for limb in limbs {
        *limb = (value % LIMB) as f32;
        value /= LIMB;
    }
}

impl Dropout {
    /// `p` in [0, 1); the builder checks it and names the key.
    pub fn new(p: f32, seed: u64) -> Result<Self> {
        if !(0.0..1.0).contains(&p) {
            return Err(ModelError::Spec {
                path: "dropout.p".into(),
                reason: format!("must be in [0, 1), got {p}"),
            });
        }
        Ok(Self {
            p,
            seed,
            counter: Tensor::zeros(&[LIMBS]),
            offset: 0,
            recompute: false,
            saved: None,
        })
    }

    /// Training forwards so far (not counting recomputations).
    pub fn counter(&self) -> u64 {
        counter_of_limbs(self.counter.data())
    }

    fn set_counter(&mut self, value: u64) {
        limbs_of_counter(value, self.counter.data_mut());
    }

    /// The factor element i is multiplied by at `counter`: 0 or 1/(1 − p).
    fn factor(&self, counter: u64, index: usize) -> f32 {
        if uniform(self.seed, counter, index) < self.p {
            0.0
        } else {
            1.0 / (1.0 - self.p)
        }
    }

    fn apply(&self, counter: u64, x: &Tensor) -> Result<Tensor> {
        let data = x.data();
        // SAFETY: each chunk is zipped with the equally long slice of `data`.
        unsafe {
            par_build(x.shape(), PAR_CHUNK, |offset, out| {
                for (i, o) in out.iter_mut().enumerate() {
                    o.write(data[offset + i] * self.factor(counter, offset + i));
                }
            })
        }
    }
}

impl Layer for Dropout {
    cuda_form!(crate::ops::activation::layer::DropoutGpu::from_cpu);

    fn describe(&self) -> String {
        format!("dropout {}", self.p)
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        Ok(input.to_vec())
    }

    fn macs(&self, _input: &[usize]) -> Result<u64> {
        Ok(0)
    }

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        self.saved = None;
        if mode == Mode::Eval {
            return Ok(input.clone());
        }
        let counter = if self.recompute {
            self.counter().saturating_sub(1)
        } else {
            self.counter()
        };
        let drawn = counter.wrapping_add(self.offset);
        let out = self.apply(drawn, input)?;
        if !self.recompute {
            self.set_counter(counter + 1);
        }
        self.saved = Some((input.shape().to_vec(), drawn));
        Ok(out)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let (shape, counter) = self
            .saved
            .take()
            .ok_or(ModelError::NoSavedActivation { op: "dropout" })?;
        grad_output.expect_shape("dropout backward", &shape)?;
        self.apply(counter, grad_output)
    }

    fn buffers_mut(&mut self) -> Vec<&mut Tensor> {
        vec![&mut self.counter]
    }

    fn dropout_seeds(&self) -> Vec<u64> {
        vec![self.seed]
    }

    fn clear_saved(&mut self) {
        self.saved = None;
    }

    fn set_recompute(&mut self, on: bool) {
        self.recompute = on;
    }

    fn shift_dropout(&mut self, offset: u64, advance: u64) {
        self.offset = offset;
        if advance > 0 {
            self.set_counter(self.counter().wrapping_add(advance));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_layer, random_tensor};

    #[test]
    fn same_seed_and_counter_give_the_same_mask() {
        let x = random_tensor(&[4, 50], 1);
        let mut a = Dropout::new(0.3, 7).unwrap();
        let mut b = Dropout::new(0.3, 7).unwrap();
        let first = a.forward(&x, Mode::Train).unwrap();
        assert_eq!(first.data(), b.forward(&x, Mode::Train).unwrap().data());
        // The next call draws a new mask; a resumed layer with the counter
        // restored draws it again.
        let second = a.forward(&x, Mode::Train).unwrap();
        assert_ne!(first.data(), second.data());
        let mut resumed = Dropout::new(0.3, 7).unwrap();
        resumed.set_counter(1);
        assert_eq!(
            resumed.forward(&x, Mode::Train).unwrap().data(),
            second.data()
        );
        // Another seed, another mask.
        let mut other = Dropout::new(0.3, 8).unwrap();
        assert_ne!(other.forward(&x, Mode::Train).unwrap().data(), first.data());
    }

    #[test]
    fn drops_about_p_and_keeps_the_mean() {
        let x = Tensor::try_full(&[100_000], 1.0).unwrap();
        let y = Dropout::new(0.25, 1)
            .unwrap()
            .forward(&x, Mode::Train)
            .unwrap();
        let dropped = y.data().iter().filter(|&&v| v == 0.0).count() as f64 / 1e5;
        let mean = y.data().iter().map(|&v| v as f64).sum::<f64>() / 1e5;
        assert!((dropped - 0.25).abs() < 0.01, "dropped {dropped}");
        assert!((mean - 1.0).abs() < 0.02, "mean {mean}");
    }

    #[test]
    fn eval_is_the_identity_and_counts_nothing() {
        let mut d = Dropout::new(0.5, 3).unwrap();
        let x = random_tensor(&[3, 7], 2);
        let y = d.forward(&x, Mode::Eval).unwrap();
        assert_eq!(y.data(), x.data());
        assert_eq!(d.counter(), 0);
        assert!(d.backward(&x).is_err());
    }

    #[test]
    fn recompute_reuses_the_last_mask_without_counting() {
        let mut d = Dropout::new(0.5, 4).unwrap();
        let x = random_tensor(&[2, 30], 3);
        let first = d.forward(&x, Mode::Train).unwrap();
        d.set_recompute(true);
        assert_eq!(d.forward(&x, Mode::Train).unwrap().data(), first.data());
        assert_eq!(d.counter(), 1);
    }

    #[test]
    fn counter_survives_large_values() {
        let mut d = Dropout::new(0.1, 1).unwrap();
        d.set_counter(0x1234_5678_9ABC);
        assert_eq!(d.counter(), 0x1234_5678_9ABC);
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let mut d = Dropout::new(0.4, 5).unwrap();
        // The finite differences need the same mask in every forward.
        d.set_recompute(true);
        let report = check_layer(&mut d, &random_tensor(&[3, 20], 6), 1e-2, 1e-3);
        assert!(report.is_ok(), "{}", report.unwrap_err());
    }

    #[test]
    fn p_outside_zero_one_is_an_error() {
        for p in [-0.1, 1.0, f32::NAN] {
            assert!(Dropout::new(p, 0).is_err(), "{p}");
        }
    }
}
