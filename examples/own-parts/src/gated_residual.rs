//! A gated residual layer over feature vectors `[c]`:
//! `y = x + σ(g) ⊙ (x·W + b)`, with `W` c×c, `b` and the gate `g` per
//! feature. The gate starts at `options.gate` (σ(0) = ½): the layer begins
//! half open and learns how much of its update to let through.
//!
//! Memory: the training forward keeps its input and `x·W + b` (2·n·c
//! floats) for backward; evaluation keeps nothing. Every tensor comes from
//! the run's memory pool (`Tensor::try_zeros`), so the budget counts it and
//! running out is an error the OOM policy handles, not a crash.
//!
//! CPU only: it has no CUDA implementation, so a run with `device.kind =
//! "cuda"` refuses it by name, and `"auto"` trains on the CPU.

use headroom_model::init::he_truncated;
use headroom_model::{CustomLayerArgs, Layer, Mode, ModelError, Param, Result, Tensor};

pub struct GatedResidual {
    features: usize,
    weight: Param,
    bias: Param,
    gate: Param,
    /// The training forward's input and `x·W + b`.
    saved: Option<(Tensor, Tensor)>,
}

/// The [`headroom_model::LayerRegistry`] factory: a gated residual as wide
/// as its input.
pub fn factory(args: &mut CustomLayerArgs<'_>) -> Result<Box<dyn Layer>> {
    let [features] = *args.input_shape else {
        return Err(ModelError::Spec {
            path: args.path.to_string(),
            reason: format!(
                "gated_residual needs a feature vector [c], got {:?}; add a flatten before it",
                args.input_shape
            ),
        });
    };
    let gate = args.option_or("gate", 0.0) as f32;
    Ok(Box::new(GatedResidual::new(features, gate, args)?))
}

impl GatedResidual {
    pub fn new(features: usize, gate: f32, args: &mut CustomLayerArgs<'_>) -> Result<Self> {
        // He initialisation scaled down: the residual branch starts small.
        let weight: Vec<f32> = he_truncated(args.rng, features, features * features)
            .into_iter()
            .map(|w| w * 0.5)
            .collect();
        Ok(Self {
            features,
            weight: Param::new(
                format!("{}.weight", args.path),
                Tensor::from_vec(&[features, features], weight)?,
                true,
            ),
            bias: Param::new(
                format!("{}.bias", args.path),
                Tensor::try_zeros(&[features])?,
                false,
            ),
            gate: Param::new(
                format!("{}.gate", args.path),
                Tensor::try_full(&[features], gate)?,
                false,
            ),
            saved: None,
        })
    }

    fn rows(&self, input: &[usize]) -> Result<usize> {
        match *input {
            [n, c] if c == self.features => Ok(n),
            _ => Err(ModelError::Shape {
                op: "gated_residual",
                expected: format!("[n, {}]", self.features),
                got: format!("{input:?}"),
            }),
        }
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

impl Layer for GatedResidual {
    fn describe(&self) -> String {
        format!("gated_residual {}", self.features)
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        match *input {
            [c] if c == self.features => Ok(vec![c]),
            _ => Err(ModelError::Shape {
                op: "gated_residual",
                expected: format!("[{}]", self.features),
                got: format!("{input:?}"),
            }),
        }
    }

    fn macs(&self, input: &[usize]) -> Result<u64> {
        self.output_shape(input)?;
        Ok((self.features * self.features) as u64)
    }

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        self.saved = None;
        let n = self.rows(input.shape())?;
        let c = self.features;
        let (x, w, b) = (
            input.data(),
            self.weight.value.data(),
            self.bias.value.data(),
        );
        let mut branch = Tensor::try_zeros(&[n, c])?;
        let h = branch.try_data_mut()?;
        for (row, x_row) in h.chunks_exact_mut(c).zip(x.chunks_exact(c)) {
            row.copy_from_slice(b);
            for (k, &xk) in x_row.iter().enumerate() {
                for (out, &wkj) in row.iter_mut().zip(&w[k * c..(k + 1) * c]) {
                    *out += xk * wkj;
                }
            }
        }
        let gates: Vec<f32> = self.gate.value.data().iter().map(|&g| sigmoid(g)).collect();
        let mut output = Tensor::try_zeros(&[n, c])?;
        let y = output.try_data_mut()?;
        for ((y_row, x_row), h_row) in y
            .chunks_exact_mut(c)
            .zip(x.chunks_exact(c))
            .zip(branch.data().chunks_exact(c))
        {
            for j in 0..c {
                y_row[j] = x_row[j] + gates[j] * h_row[j];
            }
        }
        if mode == Mode::Train {
            self.saved = Some((input.clone(), branch));
        }
        Ok(output)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let (input, branch) = self.saved.take().ok_or(ModelError::Shape {
            op: "gated_residual backward",
            expected: "a training forward first".into(),
            got: "no saved activations".into(),
        })?;
        let n = self.rows(grad_output.shape())?;
        let c = self.features;
        let dy = grad_output.data();
        let gates: Vec<f32> = self.gate.value.data().iter().map(|&g| sigmoid(g)).collect();
        // dh = dy ⊙ σ(g); dg = Σ_n dy ⊙ h ⊙ σ'(g).
        let mut dh = vec![0f32; n * c];
        {
            let dg = self.gate.grad.try_data_mut()?;
            for ((dh_row, dy_row), h_row) in dh
                .chunks_exact_mut(c)
                .zip(dy.chunks_exact(c))
                .zip(branch.data().chunks_exact(c))
            {
                for j in 0..c {
                    dh_row[j] = dy_row[j] * gates[j];
                    dg[j] += dy_row[j] * h_row[j] * gates[j] * (1.0 - gates[j]);
                }
            }
        }
        {
            let db = self.bias.grad.try_data_mut()?;
            for dh_row in dh.chunks_exact(c) {
                for (d, &g) in db.iter_mut().zip(dh_row) {
                    *d += g;
                }
            }
        }
        {
            // dW[k][j] += Σ_n x[n][k] · dh[n][j]
            let dw = self.weight.grad.try_data_mut()?;
            for (x_row, dh_row) in input.data().chunks_exact(c).zip(dh.chunks_exact(c)) {
                for (k, &xk) in x_row.iter().enumerate() {
                    for (d, &g) in dw[k * c..(k + 1) * c].iter_mut().zip(dh_row) {
                        *d += xk * g;
                    }
                }
            }
        }
        // dx = dy + dh · Wᵀ
        let w = self.weight.value.data();
        let mut grad_input = Tensor::try_from_slice(&[n, c], dy)?;
        let dx = grad_input.try_data_mut()?;
        for (dx_row, dh_row) in dx.chunks_exact_mut(c).zip(dh.chunks_exact(c)) {
            for (k, d) in dx_row.iter_mut().enumerate() {
                *d += w[k * c..(k + 1) * c]
                    .iter()
                    .zip(dh_row)
                    .map(|(&wkj, &g)| wkj * g)
                    .sum::<f32>();
            }
        }
        Ok(grad_input)
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        vec![&mut self.weight, &mut self.bias, &mut self.gate]
    }

    fn clear_saved(&mut self) {
        self.saved = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_model::gradcheck::{check_layer, random_tensor};
    use headroom_model::init::InitRng;

    fn layer(features: usize, gate: f32) -> GatedResidual {
        let mut rng = InitRng::new(3);
        let options = Default::default();
        let mut args = CustomLayerArgs {
            path: "model.layers[2]",
            input_shape: &[features],
            options: &options,
            rng: &mut rng,
        };
        GatedResidual::new(features, gate, &mut args).unwrap()
    }

    /// The hand-written backward matches finite differences, for the input
    /// and for every parameter (the gate's included).
    #[test]
    fn backward_matches_finite_differences() {
        let mut gated = layer(5, 0.3);
        let input = random_tensor(&[4, 5], 11);
        let report = check_layer(&mut gated, &input, 1e-2, 2e-2).unwrap();
        assert!(report.checked >= 4 * 5 + 25 + 5 + 5, "{report:?}");
    }

    /// A closed gate (σ(g) → 0) leaves the input through unchanged.
    #[test]
    fn a_closed_gate_is_the_identity() {
        let mut gated = layer(3, -40.0);
        let input = random_tensor(&[2, 3], 5);
        let output = gated.forward(&input, Mode::Eval).unwrap();
        assert_eq!(output.data(), input.data());
    }

    /// Sizes and names are checked where the layer is made.
    #[test]
    fn the_factory_names_an_entry_that_is_not_a_vector() {
        let mut rng = InitRng::new(1);
        let options = Default::default();
        let mut args = CustomLayerArgs {
            path: "model.layers[1]",
            input_shape: &[4, 4, 1],
            options: &options,
            rng: &mut rng,
        };
        let error = factory(&mut args).err().unwrap().to_string();
        assert!(
            error.contains("model.layers[1]") && error.contains("flatten"),
            "{error}"
        );
    }
}
