//! A convolutional LSTM over frames [N, T, H, W, C] -> hidden states
//! [N, T, H, W, Hc], from zero state. The gates of step t are one
//! convolution (the existing `Conv2d`, "same" padding, bias) of the input
//! frame and the previous hidden state side by side along channels:
//! pre = conv([x_t, h_{t−1}]) with 4·Hc outputs in the order i, f, g, o;
//! c_t = σ(f)·c_{t−1} + σ(i)·tanh(g); h_t = σ(o)·tanh(c_t).
//!
//! What a training forward keeps for backward, per step, by mode:
//! - default: the convolution's input [x_t, h_{t−1}] (C + Hc per pixel),
//!   the activated gates (4·Hc) and the cell state c_t (Hc). Backward uses
//!   them as they are: the one `Conv2d` shared by every step is handed the
//!   step's input (`Conv2d::arm`) before its backward, no forward reruns.
//! - per-step recompute (`with_step_recompute`, on under `model.checkpoint`
//!   = "blocks" or "all"): the cell state c_t only (Hc per pixel), plus two
//!   reference-counted handles, no copies: the layer's input (x_t) and its
//!   output (h_t, which the next layer holds anyway). Backward rebuilds
//!   [x_t, h_{t−1}] and reruns the step's convolution for its gates. That
//!   is the time-step analogue of `Checkpointed`: one more convolution per
//!   step, (C + 5·Hc)/Hc times less kept per step; the gradients are the
//!   same bit for bit (the rerun computes the same values).
//!
//! Backward goes from the last step, carrying dh and dc as the LSTM does;
//! the convolution's input gradient splits into dx_t and dh_{t−1}. Each
//! step's saved tensors are dropped as soon as its backward is done.

use super::conv::Conv2d;
use crate::init::InitRng;
use crate::{Layer, Mode, ModelError, Param, Result, Tensor};

pub struct ConvLstm {
    channels: usize,
    hidden: usize,
    conv: Conv2d,
    /// Keep only c_t per step and rerun the gates in backward.
    step_recompute: bool,
    saved: Option<Saved>,
}

struct Saved {
    /// [N, T, H, W, C] of the forward, for the shapes.
    shape: Vec<usize>,
    /// Per step: c_t [N, H, W, Hc].
    cells: Vec<Tensor>,
    kept: Kept,
}

/// What else backward reads, by mode (see the file's header).
enum Kept {
    /// Per step: the convolution's input [N, H, W, C + Hc] and the
    /// activated gates [N, H, W, 4·Hc].
    Gates {
        conv_inputs: Vec<Tensor>,
        gates: Vec<Tensor>,
    },
    /// The layer's input and output (shared handles).
    Recompute { input: Tensor, output: Tensor },
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The activated gates of one pixel's pre-activations, in place.
fn activate(pre: &mut [f32], hidden: usize) {
    for (k, v) in pre.iter_mut().enumerate() {
        *v = if k / hidden == 2 {
            v.tanh()
        } else {
            sigmoid(*v)
        };
    }
}

/// Dimensions of a frame sequence: (n, t, h, w, c).
fn frame_dims(shape: &[usize]) -> Result<[usize; 5]> {
    match *shape {
        [n, t, h, w, c] => Ok([n, t, h, w, c]),
        _ => Err(ModelError::Shape {
            op: "conv_lstm",
            expected: "frames [n, t, h, w, c]".into(),
            got: format!("{shape:?}"),
        }),
    }
}

impl ConvLstm {
    pub fn new(
        name: &str,
        channels: usize,
        hidden: usize,
        kernel: usize,
        rng: &mut InitRng,
    ) -> Result<Self> {
        let mut conv = Conv2d::new(
            &format!("{name}.gates"),
            channels + hidden,
            4 * hidden,
            kernel,
            1,
            kernel / 2,
            true,
            rng,
        )?;
        // Forget-gate bias 1, as for the LSTM.
        if let Some(bias) = conv.params_mut().get_mut(1) {
            for (k, b) in bias.value.data_mut().iter_mut().enumerate() {
                *b = if k / hidden == 1 { 1.0 } else { 0.0 };
            }
        }
        Ok(Self {
            channels,
            hidden,
            conv,
            step_recompute: false,
            saved: None,
        })
    }

    /// Per-step recompute on or off (see the file's header).
    pub fn with_step_recompute(mut self, on: bool) -> Self {
        self.step_recompute = on;
        self
    }

    /// h_t of every sample, [N, H, W, Hc], out of the output [N, T, H, W, Hc].
    fn hidden_at(output: &Tensor, t: usize) -> Result<Tensor> {
        let [n, steps, h, w, hc] = frame_dims(output.shape())?;
        let (o, frame) = (output.data(), h * w * hc);
        Tensor::try_from_fn(&[n, h, w, hc], |i| {
            let (sample, within) = (i / frame, i % frame);
            o[(sample * steps + t) * frame + within]
        })
    }

    /// The gates of step t in backward, with the convolution armed with
    /// the step's input: taken from what the forward kept, or recomputed.
    fn step_gates(&mut self, kept: &mut Kept, t: usize) -> Result<Tensor> {
        match kept {
            Kept::Gates { conv_inputs, gates } => {
                // Steps run backwards, so the last kept is step t's.
                let (Some(xh), Some(g)) = (conv_inputs.pop(), gates.pop()) else {
                    return Err(ModelError::NoSavedActivation { op: "conv_lstm" });
                };
                self.conv.arm(xh);
                Ok(g)
            }
            Kept::Recompute { input, output } => {
                let h_prev = match t {
                    0 => None,
                    _ => Some(Self::hidden_at(output, t - 1)?),
                };
                let xh = self.conv_input(input, t, h_prev.as_ref())?;
                self.gates(&xh, Mode::Train)
            }
        }
    }

    /// [x_t, h_prev] along channels, [N, H, W, C + Hc].
    fn conv_input(&self, x: &Tensor, t: usize, h_prev: Option<&Tensor>) -> Result<Tensor> {
        let [n, steps, h, w, c] = frame_dims(x.shape())?;
        let (hc, width) = (self.hidden, c + self.hidden);
        let (xd, pixels) = (x.data(), h * w);
        Tensor::try_from_fn(&[n, h, w, width], |i| {
            let (ch, pixel) = (i % width, i / width);
            let (sample, p) = (pixel / pixels, pixel % pixels);
            if ch < c {
                xd[((sample * steps + t) * pixels + p) * c + ch]
            } else {
                h_prev.map_or(0.0, |hp| hp.data()[pixel * hc + ch - c])
            }
        })
    }

    /// Activated gates of one step from the convolution.
    fn gates(&mut self, conv_input: &Tensor, mode: Mode) -> Result<Tensor> {
        let mut pre = self.conv.forward(conv_input, mode)?;
        let hidden = self.hidden;
        pre.try_data_mut()?
            .chunks_exact_mut(4 * hidden)
            .for_each(|p| activate(p, hidden));
        Ok(pre)
    }
}

impl Layer for ConvLstm {
    fn describe(&self) -> String {
        format!("conv_lstm {}->{}", self.channels, self.hidden)
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        match *input {
            [t, h, w, c] if c == self.channels => Ok(vec![t, h, w, self.hidden]),
            _ => Err(ModelError::Shape {
                op: "conv_lstm",
                expected: format!("frames [t, h, w, {}]", self.channels),
                got: format!("{input:?}"),
            }),
        }
    }

    fn macs(&self, input: &[usize]) -> Result<u64> {
        self.output_shape(input)?;
        let frame = [input[1], input[2], self.channels + self.hidden];
        Ok(input[0] as u64 * self.conv.macs(&frame)?)
    }

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        self.saved = None;
        let [n, steps, h, w, c] = frame_dims(input.shape())?;
        self.output_shape(&input.shape()[1..])?;
        let hc = self.hidden;
        let mut out = Tensor::try_zeros(&[n, steps, h, w, hc])?;
        let train = mode == Mode::Train;
        let keep_gates = train && !self.step_recompute;
        let (mut conv_inputs, mut kept_gates, mut cells) = (Vec::new(), Vec::new(), Vec::new());
        let (mut h_prev, mut c_prev): (Option<Tensor>, Option<Tensor>) = (None, None);
        for t in 0..steps {
            let xh = self.conv_input(input, t, h_prev.as_ref())?;
            // Eval: the convolution need not keep its input; backward arms it.
            let gates = self.gates(&xh, Mode::Eval)?;
            let g = gates.data();
            let cell = Tensor::try_from_fn(&[n, h, w, hc], |i| {
                let (pixel, j) = (i / hc, i % hc);
                let gate = &g[pixel * 4 * hc..(pixel + 1) * 4 * hc];
                let before = c_prev.as_ref().map_or(0.0, |cp| cp.data()[i]);
                gate[hc + j] * before + gate[j] * gate[2 * hc + j]
            })?;
            let hidden = Tensor::try_from_fn(&[n, h, w, hc], |i| {
                let (pixel, j) = (i / hc, i % hc);
                g[pixel * 4 * hc + 3 * hc + j] * cell.data()[i].tanh()
            })?;
            let frame = h * w * hc;
            let o = out.try_data_mut()?;
            for sample in 0..n {
                o[(sample * steps + t) * frame..(sample * steps + t + 1) * frame]
                    .copy_from_slice(&hidden.data()[sample * frame..(sample + 1) * frame]);
            }
            if keep_gates {
                conv_inputs.push(xh);
                kept_gates.push(gates.clone());
            }
            if train {
                cells.push(cell.clone());
            }
            h_prev = Some(hidden);
            c_prev = Some(cell);
        }
        if train {
            let kept = match keep_gates {
                true => Kept::Gates {
                    conv_inputs,
                    gates: kept_gates,
                },
                false => Kept::Recompute {
                    input: input.clone(),
                    output: out.clone(),
                },
            };
            self.saved = Some(Saved {
                shape: vec![n, steps, h, w, c],
                cells,
                kept,
            });
        }
        Ok(out)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let mut saved = self
            .saved
            .take()
            .ok_or(ModelError::NoSavedActivation { op: "conv_lstm" })?;
        let [n, steps, h, w, c] = frame_dims(&saved.shape)?;
        let hc = self.hidden;
        grad_output.expect_shape("conv_lstm backward", &[n, steps, h, w, hc])?;
        let (g_out, frame) = (grad_output.data(), h * w * hc);
        let mut dx = Tensor::try_zeros(&saved.shape)?;
        let mut dh_next = Tensor::try_zeros(&[n, h, w, hc])?;
        let mut dc_next = Tensor::try_zeros(&[n, h, w, hc])?;
        for t in (0..steps).rev() {
            let gates = self.step_gates(&mut saved.kept, t)?;
            let cell_t = saved
                .cells
                .pop()
                .ok_or(ModelError::NoSavedActivation { op: "conv_lstm" })?;
            let (g, cell) = (gates.data(), cell_t.data());
            let c_prev = saved.cells.last().map(|cp| cp.data());
            let mut d_pre = Tensor::try_zeros(&[n, h, w, 4 * hc])?;
            let (d, dh_carry, dc_carry) = (
                d_pre.try_data_mut()?,
                dh_next.data(),
                dc_next.try_data_mut()?,
            );
            for i in 0..n * h * w * hc {
                let (pixel, j) = (i / hc, i % hc);
                let (sample, within) = (i / frame, i % frame);
                let gate = &g[pixel * 4 * hc..(pixel + 1) * 4 * hc];
                let (ig, fg, gg, og) = (gate[j], gate[hc + j], gate[2 * hc + j], gate[3 * hc + j]);
                let tc = cell[i].tanh();
                let dh = g_out[(sample * steps + t) * frame + within] + dh_carry[i];
                let dc = dh * og * (1.0 - tc * tc) + dc_carry[i];
                dc_carry[i] = dc * fg;
                let before = c_prev.map_or(0.0, |cp: &[f32]| cp[i]);
                let dp = &mut d[pixel * 4 * hc..(pixel + 1) * 4 * hc];
                dp[j] = dc * gg * ig * (1.0 - ig);
                dp[hc + j] = dc * before * fg * (1.0 - fg);
                dp[2 * hc + j] = dc * ig * (1.0 - gg * gg);
                dp[3 * hc + j] = dh * tc * og * (1.0 - og);
            }
            drop((gates, cell_t));
            let d_conv_input = self.conv.backward(&d_pre)?;
            let (dxh, width) = (d_conv_input.data(), c + hc);
            let dx_data = dx.try_data_mut()?;
            let dh_data = dh_next.try_data_mut()?;
            for pixel in 0..n * h * w {
                let (sample, p) = (pixel / (h * w), pixel % (h * w));
                let src = &dxh[pixel * width..(pixel + 1) * width];
                let at = ((sample * steps + t) * h * w + p) * c;
                dx_data[at..at + c].copy_from_slice(&src[..c]);
                dh_data[pixel * hc..(pixel + 1) * hc].copy_from_slice(&src[c..]);
            }
        }
        Ok(dx)
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        self.conv.params_mut()
    }

    fn clear_saved(&mut self) {
        self.saved = None;
        self.conv.clear_saved();
    }

    fn set_recompute(&mut self, on: bool) {
        self.conv.set_recompute(on);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_layer, random_tensor};
    use crate::layers::Checkpointed;

    #[test]
    fn gradient_matches_finite_differences_through_time() {
        let mut cell = ConvLstm::new("clstm", 2, 3, 3, &mut InitRng::new(1)).unwrap();
        let report = check_layer(&mut cell, &random_tensor(&[2, 3, 4, 4, 2], 2), 1e-2, 3e-3);
        assert!(report.is_ok(), "{}", report.unwrap_err());
    }

    #[test]
    fn inside_a_checkpoint_it_gives_the_same_gradients() {
        let x = random_tensor(&[2, 3, 3, 3, 1], 3);
        let g = random_tensor(&[2, 3, 3, 3, 2], 4);
        let mut plain = ConvLstm::new("c", 1, 2, 3, &mut InitRng::new(5)).unwrap();
        let inner = ConvLstm::new("c", 1, 2, 3, &mut InitRng::new(5)).unwrap();
        let mut ck = Checkpointed::new(vec![Box::new(inner)]);
        let y = plain.forward(&x, Mode::Train).unwrap();
        assert_eq!(y.data(), ck.forward(&x, Mode::Train).unwrap().data());
        assert_eq!(
            plain.backward(&g).unwrap().data(),
            ck.backward(&g).unwrap().data()
        );
        let grads = |ps: Vec<&mut Param>| -> Vec<Vec<f32>> {
            ps.iter().map(|p| p.grad.data().to_vec()).collect()
        };
        assert_eq!(grads(plain.params_mut()), grads(ck.params_mut()));
    }

    /// Parameter gradients of a layer.
    fn grads(layer: &mut ConvLstm) -> Vec<Vec<f32>> {
        let params = layer.params_mut();
        params.iter().map(|p| p.grad.data().to_vec()).collect()
    }

    #[test]
    fn per_step_recompute_gives_the_same_gradients_and_keeps_less() {
        let x = random_tensor(&[2, 4, 3, 3, 2], 8);
        let g = random_tensor(&[2, 4, 3, 3, 3], 9);
        let mut keep = ConvLstm::new("c", 2, 3, 3, &mut InitRng::new(10)).unwrap();
        let mut lean = ConvLstm::new("c", 2, 3, 3, &mut InitRng::new(10))
            .unwrap()
            .with_step_recompute(true);
        for _ in 0..2 {
            let y = keep.forward(&x, Mode::Train).unwrap();
            assert_eq!(y.data(), lean.forward(&x, Mode::Train).unwrap().data());
            let kept = |l: &ConvLstm| match &l.saved.as_ref().unwrap().kept {
                Kept::Gates { gates, .. } => gates.len(),
                Kept::Recompute { .. } => 0,
            };
            assert_eq!((kept(&keep), kept(&lean)), (4, 0));
            assert_eq!(
                keep.backward(&g).unwrap().data(),
                lean.backward(&g).unwrap().data()
            );
            assert_eq!(grads(&mut keep), grads(&mut lean));
        }
        let report = check_layer(&mut lean, &random_tensor(&[1, 3, 3, 3, 2], 11), 1e-2, 3e-3);
        assert!(report.is_ok(), "{}", report.unwrap_err());
    }

    #[test]
    fn a_frame_does_not_see_later_frames() {
        let mut cell = ConvLstm::new("c", 1, 2, 3, &mut InitRng::new(6)).unwrap();
        let x = random_tensor(&[1, 3, 3, 3, 1], 7);
        let y = cell.forward(&x, Mode::Eval).unwrap();
        let mut changed = x.clone();
        changed.data_mut()[2 * 9] += 1.0; // first pixel of frame 2
        let y2 = cell.forward(&changed, Mode::Eval).unwrap();
        assert_eq!(&y.data()[..2 * 18], &y2.data()[..2 * 18]);
        assert_ne!(&y.data()[2 * 18..], &y2.data()[2 * 18..]);
    }
}
