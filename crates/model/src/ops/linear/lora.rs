//! LoRA: a linear layer whose base weight W [in, out] (and bias) is frozen,
//! plus a trainable low-rank update: y = x·W + b + s·(x·Aᵀ)·Bᵀ with
//! A [r, in] (small random), B [out, r] (zeros, so a fresh adapter is the
//! base layer exactly) and s = alpha / r.
//!
//! Saves for backward: the input x (a reference-counted handle) and
//! u = s·x·Aᵀ [N, r] (r floats per row). Backward adds nothing into the
//! frozen W and b (their gradients stay zero, and the optimizer skips them):
//! dB += gᵀ·u, du = s·g·B, dA += duᵀ·x, dx = g·Wᵀ + du·A.
//!
//! `merge` folds s·Aᵀ·Bᵀ into W for export and zeroes B, so the layer's
//! outputs are unchanged (up to rounding) and it becomes the base layer.

use gemm::Parallelism;
use serde::{Deserialize, Serialize};

use super::cpu::Linear;
use crate::init::InitRng;
use crate::layers::matmul::{matmul_with, View};
use crate::{Layer, Mode, ModelError, Param, Result, Tensor};

/// `lora = { r, alpha }` in a layer spec.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LoraConfig {
    /// Rank of the update.
    pub r: usize,
    /// The update is scaled by alpha / r; defaults to r (scale 1).
    #[serde(default)]
    pub alpha: Option<f32>,
}

impl LoraConfig {
    /// Errors name `path.r` / `path.alpha`.
    pub fn validate(&self, path: &str, in_features: usize, out_features: usize) -> Result<f32> {
        let max_rank = in_features.min(out_features);
        if self.r == 0 || self.r > max_rank {
            return Err(ModelError::Spec {
                path: format!("{path}.r"),
                reason: format!(
                    "the rank must be in 1..={max_rank} (min of {in_features} inputs and \
                     {out_features} outputs), got {}",
                    self.r
                ),
            });
        }
        let alpha = self.alpha.unwrap_or(self.r as f32);
        if !(alpha.is_finite() && alpha > 0.0) {
            return Err(ModelError::Spec {
                path: format!("{path}.alpha"),
                reason: format!("must be positive, got {alpha}"),
            });
        }
        Ok(alpha / self.r as f32)
    }
}

/// Products of small layers are faster on one thread (as in `linear`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn product(
    dst: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    lhs: View,
    rhs: View,
    accumulate: bool,
) {
    let parallelism = if m * n * k >= 1 << 20 {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    };
    matmul_with(dst, m, n, k, lhs, rhs, accumulate, parallelism);
}

pub struct LoraLinear {
    pub(crate) in_features: usize,
    pub(crate) out_features: usize,
    pub(crate) rank: usize,
    pub(crate) scale: f32,
    weight: Param,
    pub(crate) bias: Option<Param>,
    a: Param,
    b: Param,
    /// x and u = s·x·Aᵀ of the last training forward.
    saved: Option<(Tensor, Tensor)>,
}

impl LoraLinear {
    /// Freezes `base` and puts an adapter of `config` beside it.
    pub fn new(
        name: &str,
        mut base: Linear,
        config: LoraConfig,
        rng: &mut InitRng,
    ) -> Result<Self> {
        let mut params = base.params_mut().into_iter();
        let weight = params
            .next()
            .ok_or_else(|| ModelError::State(format!("{name}: linear without a weight")))?
            .clone();
        let bias = params.next().cloned();
        let [in_features, out_features] = *weight.value.shape() else {
            return Err(ModelError::State(format!(
                "{name}: linear weight of shape {:?}",
                weight.value.shape()
            )));
        };
        let scale = config.validate(name, in_features, out_features)?;
        let r = config.r;
        // Kaiming-uniform bound for fan-in `in`, as the LoRA paper's code.
        let bound = 1.0 / (in_features as f64).sqrt();
        let a = (0..r * in_features)
            .map(|_| ((2.0 * rng.uniform() - 1.0) * bound) as f32)
            .collect();
        Ok(Self {
            in_features,
            out_features,
            rank: r,
            scale,
            weight: weight.frozen(),
            bias: bias.map(Param::frozen),
            a: Param::new(
                format!("{name}.lora_a"),
                Tensor::from_vec_unbudgeted(&[r, in_features], a),
                true,
            ),
            b: Param::new(
                format!("{name}.lora_b"),
                Tensor::zeros(&[out_features, r]),
                true,
            ),
            saved: None,
        })
    }

    /// Folds the update into the base weight and zeroes B: the outputs stay
    /// the same (up to rounding) and the adapter no longer contributes.
    pub fn merge(&mut self) -> Result<()> {
        self.check_state()?;
        let (i, o, r) = (self.in_features, self.out_features, self.rank);
        let scaled_b = Tensor::try_from_fn(&[o, r], |k| self.b.value.data()[k] * self.scale)?;
        let w = self.weight.value.try_data_mut()?;
        // W[in×out] += Aᵀ[in×r] · (s·B)ᵀ[r×out]
        product(
            w,
            i,
            o,
            r,
            View::cm(self.a.value.data(), i),
            View::cm(scaled_b.data(), r),
            true,
        );
        self.b.value.try_data_mut()?.fill(0.0);
        Ok(())
    }

    /// The base linear layer with the update folded in, for export.
    pub fn into_merged_linear(mut self, name: &str) -> Result<Linear> {
        self.merge()?;
        let mut linear = Linear::new(
            name,
            self.in_features,
            self.out_features,
            self.bias.is_some(),
            &mut InitRng::new(0),
        );
        let mut sources = vec![self.weight];
        sources.extend(self.bias);
        for (param, source) in linear.params_mut().into_iter().zip(sources) {
            param.value = source.value;
        }
        Ok(linear)
    }

    fn check_state(&self) -> Result<()> {
        let (i, o, r) = (self.in_features, self.out_features, self.rank);
        let mut expected = vec![
            (&self.weight, vec![i, o]),
            (&self.a, vec![r, i]),
            (&self.b, vec![o, r]),
        ];
        if let Some(b) = &self.bias {
            expected.push((b, vec![o]));
        }
        for (p, shape) in expected {
            if p.value.shape() != shape || !p.grad_fits() {
                return Err(ModelError::State(format!(
                    "{} has shape {:?}, expected {shape:?}",
                    p.name,
                    p.value.shape()
                )));
            }
        }
        Ok(())
    }
}

impl Layer for LoraLinear {
    cuda_form!(crate::ops::sequence::layer::LoraLayer::from_cpu);

    fn describe(&self) -> String {
        format!(
            "lora_linear {}->{} r {}",
            self.in_features, self.out_features, self.rank
        )
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        match *input {
            [f] if f == self.in_features => Ok(vec![self.out_features]),
            _ => Err(ModelError::Shape {
                op: "lora_linear",
                expected: format!("[{}]", self.in_features),
                got: format!("{input:?}"),
            }),
        }
    }

    fn macs(&self, input: &[usize]) -> Result<u64> {
        self.output_shape(input)?;
        let (i, o, r) = (self.in_features, self.out_features, self.rank);
        Ok((i * o + r * (i + o)) as u64)
    }

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        self.saved = None;
        let (i, o, r) = (self.in_features, self.out_features, self.rank);
        let n = match *input.shape() {
            [n, f] if f == i => n,
            _ => {
                return Err(ModelError::Shape {
                    op: "lora_linear",
                    expected: format!("features [n, {i}]"),
                    got: format!("{:?}", input.shape()),
                })
            }
        };
        self.check_state()?;
        let x = View::rm(input.data(), i);
        let mut u = Tensor::try_zeros(&[n, r])?;
        product(
            u.try_data_mut()?,
            n,
            r,
            i,
            x,
            View::cm(self.a.value.data(), i),
            false,
        );
        u.try_data_mut()?.iter_mut().for_each(|v| *v *= self.scale);

        let mut y = Tensor::try_zeros(&[n, o])?;
        let out = y.try_data_mut()?;
        if let Some(b) = &self.bias {
            for row in out.chunks_exact_mut(o.max(1)) {
                row.copy_from_slice(b.value.data());
            }
        }
        product(out, n, o, i, x, View::rm(self.weight.value.data(), o), true);
        product(
            out,
            n,
            o,
            r,
            View::rm(u.data(), r),
            View::cm(self.b.value.data(), r),
            true,
        );
        if mode == Mode::Train {
            self.saved = Some((input.clone(), u));
        }
        Ok(y)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let (x, u) = self
            .saved
            .take()
            .ok_or(ModelError::NoSavedActivation { op: "lora_linear" })?;
        let (i, o, r) = (self.in_features, self.out_features, self.rank);
        let n = x.batch();
        grad_output.expect_shape("lora_linear backward", &[n, o])?;
        self.check_state()?;
        let g = View::rm(grad_output.data(), o);

        // dB[o×r] += gᵀ·u
        let g_t = View::cm(grad_output.data(), o);
        product(
            self.b.grad.data_mut(),
            o,
            r,
            n,
            g_t,
            View::rm(u.data(), r),
            true,
        );
        // du[n×r] = s·g·B
        let mut du = Tensor::try_zeros(&[n, r])?;
        product(
            du.try_data_mut()?,
            n,
            r,
            o,
            g,
            View::rm(self.b.value.data(), r),
            false,
        );
        du.try_data_mut()?.iter_mut().for_each(|v| *v *= self.scale);
        // dA[r×i] += duᵀ·x
        let x_view = View::rm(x.data(), i);
        product(
            self.a.grad.data_mut(),
            r,
            i,
            n,
            View::cm(du.data(), r),
            x_view,
            true,
        );
        // dx = g·Wᵀ + du·A
        let mut dx = Tensor::try_zeros(&[n, i])?;
        let dx_data = dx.try_data_mut()?;
        product(
            dx_data,
            n,
            i,
            o,
            g,
            View::cm(self.weight.value.data(), o),
            false,
        );
        product(
            dx_data,
            n,
            i,
            r,
            View::rm(du.data(), r),
            View::rm(self.a.value.data(), i),
            true,
        );
        Ok(dx)
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut params = vec![&mut self.weight];
        if let Some(b) = &mut self.bias {
            params.push(b);
        }
        params.push(&mut self.a);
        params.push(&mut self.b);
        params
    }

    fn clear_saved(&mut self) {
        self.saved = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_layer, random_tensor};

    fn lora(seed: u64, r: usize) -> (Linear, LoraLinear) {
        let base = Linear::new("fc", 6, 5, true, &mut InitRng::new(seed));
        let same = Linear::new("fc", 6, 5, true, &mut InitRng::new(seed));
        let config = LoraConfig {
            r,
            alpha: Some(2.0 * r as f32),
        };
        (
            base,
            LoraLinear::new("fc", same, config, &mut InitRng::new(seed + 1)).unwrap(),
        )
    }

    fn randomise_b(layer: &mut LoraLinear, seed: u64) {
        layer.b.value = random_tensor(layer.b.value.shape(), seed);
    }

    #[test]
    fn a_fresh_adapter_is_the_base_layer() {
        let (mut base, mut adapted) = lora(1, 2);
        let x = random_tensor(&[4, 6], 2);
        let expected = base.forward(&x, Mode::Eval).unwrap();
        let y = adapted.forward(&x, Mode::Eval).unwrap();
        assert_eq!(y.data(), expected.data());
    }

    #[test]
    fn gradient_matches_finite_differences_and_spares_the_base() {
        let (_, mut adapted) = lora(3, 2);
        randomise_b(&mut adapted, 4);
        let report = check_layer(&mut adapted, &random_tensor(&[4, 6], 5), 1e-2, 2e-3);
        assert!(report.is_ok(), "{}", report.unwrap_err());
        for p in adapted.params_mut() {
            if p.frozen {
                assert!(p.grad.data().iter().all(|&g| g == 0.0), "{}", p.name);
            }
        }
    }

    #[test]
    fn merging_keeps_the_outputs() {
        let (_, mut adapted) = lora(6, 3);
        randomise_b(&mut adapted, 7);
        let x = random_tensor(&[5, 6], 8);
        let before = adapted.forward(&x, Mode::Eval).unwrap();
        adapted.merge().unwrap();
        assert!(adapted.b.value.data().iter().all(|&v| v == 0.0));
        let after = adapted.forward(&x, Mode::Eval).unwrap();
        let mut exported = adapted.into_merged_linear("fc").unwrap();
        let linear = exported.forward(&x, Mode::Eval).unwrap();
        for ((&a, &b), &c) in before.data().iter().zip(after.data()).zip(linear.data()) {
            assert!((a - b).abs() < 1e-5 && (a - c).abs() < 1e-5, "{a} {b} {c}");
        }
    }

    #[test]
    fn bad_ranks_and_alphas_name_the_key() {
        let base = || Linear::new("fc", 6, 5, true, &mut InitRng::new(1));
        let mut rng = InitRng::new(2);
        for (config, key) in [
            (LoraConfig { r: 0, alpha: None }, "fc.r"),
            (LoraConfig { r: 6, alpha: None }, "fc.r"),
            (
                LoraConfig {
                    r: 2,
                    alpha: Some(0.0),
                },
                "fc.alpha",
            ),
        ] {
            let err = LoraLinear::new("fc", base(), config, &mut rng)
                .err()
                .unwrap();
            assert!(err.to_string().contains(key), "{err}");
        }
    }
}
