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

use rayon::prelude::*;

use crate::init::InitRng;
use crate::layers::vector_math;
use crate::ops::activation::relu::{gather_rows, par_rows};
use crate::ops::conv::cpu::Conv2d;
use crate::ops::sequence::lstm::{activate_gates, cell_backward, cell_forward, CellSaved};
use crate::{Layer, Mode, ModelError, Param, Result, Tensor};

pub struct ConvLstm {
    channels: usize,
    pub(crate) hidden: usize,
    pub(crate) conv: Conv2d,
    /// Keep only c_t per step and rerun the gates in backward.
    pub(crate) step_recompute: bool,
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

/// Pixels per parallel task of the cell's loops.
const PIXELS_PER_TASK: usize = 64;

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
        gather_rows(&[n, h, w, hc], frame, |sample| {
            let at = (sample * steps + t) * frame;
            &o[at..at + frame]
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
        let (hc, width, pixels) = (self.hidden, c + self.hidden, h * w);
        let xd = x.data();
        // SAFETY: each row gets its c input channels, then its hc state
        // channels: all `width` written.
        unsafe {
            par_rows(&[n, h, w, width], width, |pixel, row| {
                let (sample, p) = (pixel / pixels, pixel % pixels);
                let at = ((sample * steps + t) * pixels + p) * c;
                let (xs, hs) = row.split_at_mut(c);
                for (o, &v) in xs.iter_mut().zip(&xd[at..at + c]) {
                    o.write(v);
                }
                match h_prev {
                    Some(hp) => {
                        let src = &hp.data()[pixel * hc..(pixel + 1) * hc];
                        for (o, &v) in hs.iter_mut().zip(src) {
                            o.write(v);
                        }
                    }
                    None => hs.iter_mut().for_each(|o| {
                        o.write(0.0);
                    }),
                }
            })
        }
    }

    /// Activated gates of one step from the convolution.
    fn gates(&mut self, conv_input: &Tensor, mode: Mode) -> Result<Tensor> {
        let mut pre = self.conv.forward(conv_input, mode)?;
        let row = 4 * self.hidden;
        pre.try_data_mut()?
            .par_chunks_mut(PIXELS_PER_TASK * row)
            .for_each(|chunk| {
                vector_math::wide(
                    #[inline(always)]
                    || chunk.chunks_exact_mut(row).for_each(activate_gates),
                )
            });
        Ok(pre)
    }

    /// One step's cell over every pixel: activates the convolution's
    /// output `pre` [N, H, W, 4·Hc] in place and returns c_t and h_t.
    fn step(&self, pre: &mut Tensor, c_prev: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        let shape = [pre.shape()[..3].to_vec(), vec![self.hidden]].concat();
        let hc = self.hidden;
        let mut cell = Tensor::try_zeros(&shape)?;
        let mut hidden = Tensor::try_zeros(&shape)?;
        let zeros = vec![0.0; PIXELS_PER_TASK * hc];
        let c_prev = c_prev.map(|t| t.data());
        pre.try_data_mut()?
            .par_chunks_mut(PIXELS_PER_TASK * 4 * hc)
            .zip(cell.try_data_mut()?.par_chunks_mut(PIXELS_PER_TASK * hc))
            .zip(hidden.try_data_mut()?.par_chunks_mut(PIXELS_PER_TASK * hc))
            .enumerate()
            .for_each(|(task, ((pre, cell), hidden))| {
                let at = task * PIXELS_PER_TASK * hc;
                let before = c_prev.map_or(&zeros[..cell.len()], |cp| &cp[at..at + cell.len()]);
                vector_math::wide(
                    #[inline(always)]
                    || {
                        let rows = pre.chunks_exact_mut(4 * hc).zip(cell.chunks_exact_mut(hc));
                        let rows = rows
                            .zip(hidden.chunks_exact_mut(hc))
                            .zip(before.chunks_exact(hc));
                        for (((pre, cell), hidden), before) in rows {
                            cell_forward(pre, None, before, cell, hidden);
                        }
                    },
                );
            });
        Ok((cell, hidden))
    }
}

impl Layer for ConvLstm {
    cuda_form!(crate::ops::frames::layer::ConvLstmLayer::from_cpu);

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
            let mut gates = self.conv.forward(&xh, Mode::Eval)?;
            let (cell, hidden) = self.step(&mut gates, c_prev.as_ref())?;
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
        let g_out = grad_output.data();
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
            let zeros = vec![0.0; PIXELS_PER_TASK * hc];
            let (pixels, units) = (h * w, PIXELS_PER_TASK * hc);
            d_pre
                .try_data_mut()?
                .par_chunks_mut(PIXELS_PER_TASK * 4 * hc)
                .zip(dc_next.try_data_mut()?.par_chunks_mut(units))
                .enumerate()
                .for_each(|(task, (d, dc))| {
                    let first = task * PIXELS_PER_TASK;
                    let at = first * hc;
                    let range = at..at + dc.len();
                    let before = c_prev.map_or(&zeros[..dc.len()], |cp| &cp[range.clone()]);
                    vector_math::wide(
                        #[inline(always)]
                        || {
                            for (k, (d, dc)) in d
                                .chunks_exact_mut(4 * hc)
                                .zip(dc.chunks_exact_mut(hc))
                                .enumerate()
                            {
                                let pixel = first + k;
                                let (sample, p) = (pixel / pixels, pixel % pixels);
                                let out_at = ((sample * steps + t) * pixels + p) * hc;
                                let unit = pixel * hc..(pixel + 1) * hc;
                                let local = k * hc..(k + 1) * hc;
                                cell_backward(
                                    CellSaved {
                                        gates: &g[pixel * 4 * hc..(pixel + 1) * 4 * hc],
                                        cell: &cell[unit.clone()],
                                        c_prev: &before[local],
                                    },
                                    &g_out[out_at..out_at + hc],
                                    &dh_next.data()[unit],
                                    dc,
                                    d,
                                );
                            }
                        },
                    );
                });
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
