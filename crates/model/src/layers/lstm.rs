//! One LSTM layer over a sequence [N, T, C] -> all hidden states [N, T, H],
//! starting from zero state. Gates in the order i, f, g, o:
//! pre_t = x_t·Wx + h_{t−1}·Wh + b; i, f, o = σ(·), g = tanh(·);
//! c_t = f·c_{t−1} + i·g; h_t = o·tanh(c_t). The forget-gate bias starts at
//! 1 so that early training does not forget everything.
//!
//! The input projection of every step is one GEMM before the time loop;
//! only h_{t−1}·Wh is sequential.
//!
//! Saves for backward: the input and the output (reference-counted handles),
//! the activated gates [N, T, 4H] and the cell states [N, T, H]. Backward
//! through time, from the last step, carrying dh and dc:
//! dh = g_t + dh_next; do = dh·tanh(c); dc = dh·o·(1 − tanh²c) + dc_next;
//! di = dc·g, dg = dc·i, df = dc·c_{t−1}, dc_next = dc·f; the pre-activation
//! gradients d_pre feed dWh += h_{t−1}ᵀ·d_pre and dh_next = d_pre·Whᵀ; after
//! the loop dWx += xᵀ·d_pre(all steps), db += Σ d_pre, dx = d_pre·Wxᵀ.

use super::lora::product;
use super::matmul::View;
use crate::init::InitRng;
use crate::{Layer, Mode, ModelError, Param, Result, Tensor};

pub struct Lstm {
    input: usize,
    hidden: usize,
    wx: Param,
    wh: Param,
    bias: Param,
    saved: Option<Saved>,
}

struct Saved {
    x: Tensor,
    h: Tensor,
    gates: Tensor,
    cells: Tensor,
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Uniform in ±1/√H, as PyTorch initialises its LSTM.
fn uniform_weights(rng: &mut InitRng, hidden: usize, len: usize) -> Vec<f32> {
    let bound = 1.0 / (hidden as f64).sqrt();
    (0..len)
        .map(|_| ((2.0 * rng.uniform() - 1.0) * bound) as f32)
        .collect()
}

/// Rows of step `t` in a [N, T, width] tensor, as a matrix view.
fn step_view(data: &[f32], t: usize, steps: usize, width: usize) -> View<'_> {
    View {
        data: &data[t * width..],
        row_stride: steps * width,
        col_stride: 1,
    }
}

impl Lstm {
    pub fn new(name: &str, input: usize, hidden: usize, rng: &mut InitRng) -> Self {
        let wx = uniform_weights(rng, hidden, input * 4 * hidden);
        let wh = uniform_weights(rng, hidden, hidden * 4 * hidden);
        let bias = (0..4 * hidden)
            .map(|j| if j / hidden == 1 { 1.0 } else { 0.0 })
            .collect();
        Self {
            input,
            hidden,
            wx: Param::new(
                format!("{name}.wx"),
                Tensor::from_vec_unbudgeted(&[input, 4 * hidden], wx),
                true,
            ),
            wh: Param::new(
                format!("{name}.wh"),
                Tensor::from_vec_unbudgeted(&[hidden, 4 * hidden], wh),
                true,
            ),
            bias: Param::new(
                format!("{name}.bias"),
                Tensor::from_vec_unbudgeted(&[4 * hidden], bias),
                false,
            ),
            saved: None,
        }
    }

    fn dims(&self, shape: &[usize]) -> Result<(usize, usize)> {
        match *shape {
            [n, t, c] if c == self.input => Ok((n, t)),
            _ => Err(ModelError::Shape {
                op: "lstm",
                expected: format!("[n, t, {}]", self.input),
                got: format!("{shape:?}"),
            }),
        }
    }

    fn check_state(&self) -> Result<()> {
        let (c, h) = (self.input, self.hidden);
        for (p, shape) in [
            (&self.wx, vec![c, 4 * h]),
            (&self.wh, vec![h, 4 * h]),
            (&self.bias, vec![4 * h]),
        ] {
            if p.value.shape() != shape || p.grad.shape() != shape {
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

impl Layer for Lstm {
    fn describe(&self) -> String {
        format!("lstm {}->{}", self.input, self.hidden)
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        match *input {
            [t, c] if c == self.input => Ok(vec![t, self.hidden]),
            _ => Err(ModelError::Shape {
                op: "lstm",
                expected: format!("a sequence [t, {}]", self.input),
                got: format!("{input:?}"),
            }),
        }
    }

    fn macs(&self, input: &[usize]) -> Result<u64> {
        self.output_shape(input)?;
        Ok((input[0] * (self.input + self.hidden) * 4 * self.hidden) as u64)
    }

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        self.saved = None;
        let (n, steps) = self.dims(input.shape())?;
        self.check_state()?;
        let (c, h) = (self.input, self.hidden);
        let g4 = 4 * h;
        // Input projections of every step, bias included: [N·T, 4H].
        let bias = self.bias.value.data();
        let mut gates = Tensor::try_from_fn(&[n, steps, g4], |i| bias[i % g4])?;
        let wx = View::rm(self.wx.value.data(), g4);
        product(
            gates.try_data_mut()?,
            n * steps,
            g4,
            c,
            View::rm(input.data(), c),
            wx,
            true,
        );
        let mut hs = Tensor::try_zeros(&[n, steps, h])?;
        let mut cells = Tensor::try_zeros(&[n, steps, h])?;
        let mut recurrent = Tensor::try_zeros(&[n, g4])?;
        let wh = View::rm(self.wh.value.data(), g4);
        for t in 0..steps {
            let rec = recurrent.try_data_mut()?;
            if t > 0 {
                product(
                    rec,
                    n,
                    g4,
                    h,
                    step_view(hs.data(), t - 1, steps, h),
                    wh,
                    false,
                );
            }
            let (gate_data, cell_data, h_data) = (
                gates.try_data_mut()?,
                cells.try_data_mut()?,
                hs.try_data_mut()?,
            );
            for sample in 0..n {
                let row = sample * steps + t;
                let pre = &mut gate_data[row * g4..(row + 1) * g4];
                for (p, &r) in pre.iter_mut().zip(&rec[sample * g4..(sample + 1) * g4]) {
                    *p += if t > 0 { r } else { 0.0 };
                }
                for j in 0..h {
                    let (i, f, g, o) = (
                        sigmoid(pre[j]),
                        sigmoid(pre[h + j]),
                        pre[2 * h + j].tanh(),
                        sigmoid(pre[3 * h + j]),
                    );
                    pre[j] = i;
                    pre[h + j] = f;
                    pre[2 * h + j] = g;
                    pre[3 * h + j] = o;
                    let c_prev = if t > 0 {
                        cell_data[(row - 1) * h + j]
                    } else {
                        0.0
                    };
                    let cell = f * c_prev + i * g;
                    cell_data[row * h + j] = cell;
                    h_data[row * h + j] = o * cell.tanh();
                }
            }
        }
        if mode == Mode::Train {
            self.saved = Some(Saved {
                x: input.clone(),
                h: hs.clone(),
                gates,
                cells,
            });
        }
        Ok(hs)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let saved = self
            .saved
            .take()
            .ok_or(ModelError::NoSavedActivation { op: "lstm" })?;
        let (n, steps) = self.dims(saved.x.shape())?;
        let (c, h) = (self.input, self.hidden);
        let g4 = 4 * h;
        grad_output.expect_shape("lstm backward", &[n, steps, h])?;
        self.check_state()?;
        let (gates, cells, g) = (saved.gates.data(), saved.cells.data(), grad_output.data());
        let mut d_pre = Tensor::try_zeros(&[n, steps, g4])?;
        let mut dh_next = Tensor::try_zeros(&[n, h])?;
        let mut dc_next = Tensor::try_zeros(&[n, h])?;
        let mut step_grad = Tensor::try_zeros(&[n, g4])?;
        for t in (0..steps).rev() {
            let (dh_carry, dc_carry) = (dh_next.try_data_mut()?, dc_next.try_data_mut()?);
            let dstep = step_grad.try_data_mut()?;
            for sample in 0..n {
                let row = sample * steps + t;
                let gate = &gates[row * g4..(row + 1) * g4];
                for j in 0..h {
                    let (i, f, gg, o) = (gate[j], gate[h + j], gate[2 * h + j], gate[3 * h + j]);
                    let cell = cells[row * h + j];
                    let c_prev = if t > 0 { cells[(row - 1) * h + j] } else { 0.0 };
                    let tc = cell.tanh();
                    let at = sample * h + j;
                    let dh = g[row * h + j] + dh_carry[at];
                    let d_o = dh * tc;
                    let dc = dh * o * (1.0 - tc * tc) + dc_carry[at];
                    dc_carry[at] = dc * f;
                    let d = &mut dstep[sample * g4..(sample + 1) * g4];
                    d[j] = dc * gg * i * (1.0 - i);
                    d[h + j] = dc * c_prev * f * (1.0 - f);
                    d[2 * h + j] = dc * i * (1.0 - gg * gg);
                    d[3 * h + j] = d_o * o * (1.0 - o);
                }
            }
            let dstep = step_grad.data();
            let d_all = d_pre.try_data_mut()?;
            for sample in 0..n {
                let row = sample * steps + t;
                d_all[row * g4..(row + 1) * g4]
                    .copy_from_slice(&dstep[sample * g4..(sample + 1) * g4]);
            }
            let dstep_view = View::rm(dstep, g4);
            if t > 0 {
                let h_prev = step_view(saved.h.data(), t - 1, steps, h);
                let h_prev_t = View {
                    data: h_prev.data,
                    row_stride: 1,
                    col_stride: steps * h,
                };
                product(
                    self.wh.grad.data_mut(),
                    h,
                    g4,
                    n,
                    h_prev_t,
                    dstep_view,
                    true,
                );
            }
            let wh_t = View::cm(self.wh.value.data(), g4);
            product(dh_next.try_data_mut()?, n, h, g4, dstep_view, wh_t, false);
        }
        let d_all = View::rm(d_pre.data(), g4);
        let x_t = View::cm(saved.x.data(), c);
        product(self.wx.grad.data_mut(), c, g4, n * steps, x_t, d_all, true);
        for row in d_pre.data().chunks_exact(g4.max(1)) {
            for (b, &d) in self.bias.grad.data_mut().iter_mut().zip(row) {
                *b += d;
            }
        }
        let mut dx = Tensor::try_zeros(&[n, steps, c])?;
        let wx_t = View::cm(self.wx.value.data(), g4);
        product(dx.try_data_mut()?, n * steps, c, g4, d_all, wx_t, false);
        Ok(dx)
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        vec![&mut self.wx, &mut self.wh, &mut self.bias]
    }

    fn clear_saved(&mut self) {
        self.saved = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_layer, random_tensor};

    #[test]
    fn gradient_matches_finite_differences_through_time() {
        let mut lstm = Lstm::new("lstm", 3, 4, &mut InitRng::new(1));
        lstm.bias.value = random_tensor(&[16], 3);
        let report = check_layer(&mut lstm, &random_tensor(&[2, 5, 3], 2), 1e-2, 2e-3);
        assert!(report.is_ok(), "{}", report.unwrap_err());
    }

    #[test]
    fn a_step_does_not_see_the_future() {
        let mut lstm = Lstm::new("lstm", 2, 3, &mut InitRng::new(4));
        let x = random_tensor(&[1, 4, 2], 5);
        let y = lstm.forward(&x, Mode::Eval).unwrap();
        let mut changed = x.clone();
        changed.data_mut()[6] += 1.0; // t = 3
        let y2 = lstm.forward(&changed, Mode::Eval).unwrap();
        assert_eq!(&y.data()[..9], &y2.data()[..9]);
        assert_ne!(&y.data()[9..], &y2.data()[9..]);
    }

    #[test]
    fn wrong_width_is_a_named_error() {
        let mut lstm = Lstm::new("lstm", 2, 3, &mut InitRng::new(4));
        let err = lstm
            .forward(&random_tensor(&[1, 4, 3], 1), Mode::Train)
            .unwrap_err();
        assert!(err.to_string().contains("lstm"), "{err}");
        assert!(lstm.backward(&random_tensor(&[1, 4, 3], 1)).is_err());
    }
}
