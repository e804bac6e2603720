//! One LSTM layer over a sequence [N, T, C] -> all hidden states [N, T, H],
//! starting from zero state. Gates in the order i, f, g, o:
//! pre_t = x_t·Wx + h_{t−1}·Wh + b; i, f, o = σ(·), g = tanh(·);
//! c_t = f·c_{t−1} + i·g; h_t = o·tanh(c_t). The forget-gate bias starts at
//! 1 so that early training does not forget everything.
//!
//! The input projection of every step is one GEMM before the time loop;
//! only h_{t−1}·Wh is sequential. Samples are independent through time,
//! so each thread takes its own block of samples through all T steps,
//! forward and backward: the sequential loop never waits on another
//! thread (a join per step was most of a small model's step). Those
//! per-step products read Wh (Whᵀ backward) packed once per pass
//! (`panel_product`): the `gemm` crate would repack it at every step.
//!
//! Saves for backward: the input and the output (reference-counted handles),
//! the activated gates [N, T, 4H] and the cell states [N, T, H]. Backward
//! through time, from the last step, carrying dh and dc:
//! dh = g_t + dh_next; do = dh·tanh(c); dc = dh·o·(1 − tanh²c) + dc_next;
//! di = dc·g, dg = dc·i, df = dc·c_{t−1}, dc_next = dc·f; the pre-activation
//! gradients d_pre feed dh_next = d_pre·Whᵀ; after the loop, one product
//! each over all steps: dWh += h_{t−1}ᵀ·d_pre (from a copy of the outputs
//! shifted by a step), dWx += xᵀ·d_pre, db += Σ d_pre, dx = d_pre·Wxᵀ.

use rayon::prelude::*;

use crate::init::InitRng;
use crate::layers::matmul::View;
use crate::layers::panel_product::RecurrentWeights;
use crate::layers::vector_math;
use crate::ops::activation::relu::gather_rows;
use crate::ops::linear::lora::product;
use crate::{Layer, Mode, ModelError, Param, Result, Tensor};

pub struct Lstm {
    input: usize,
    pub(crate) hidden: usize,
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

// The cell of one sample (or, for the ConvLSTM, one pixel): H units whose
// four gates lie side by side, [i (H), f (H), g (H), o (H)]. Lane-wise
// loops over the units, vectorised by the caller's `vector_math::wide`.

/// Activates one unit row's pre-activations [4H] in place: σ for i, f, o
/// and tanh for g.
#[inline(always)]
pub(crate) fn activate_gates(pre: &mut [f32]) {
    let h = pre.len() / 4;
    let (i_f, g_o) = pre.split_at_mut(2 * h);
    let (g, o) = g_o.split_at_mut(h);
    i_f.iter_mut().for_each(|v| *v = vector_math::sigmoid(*v));
    g.iter_mut().for_each(|v| *v = vector_math::tanh(*v));
    o.iter_mut().for_each(|v| *v = vector_math::sigmoid(*v));
}

/// One step: adds the recurrent product (if any) to the pre-activations
/// `pre` [4H], activates them in place and writes c_t and h_t.
#[inline(always)]
pub(crate) fn cell_forward(
    pre: &mut [f32],
    recurrent: Option<&[f32]>,
    c_prev: &[f32],
    cell: &mut [f32],
    h_out: &mut [f32],
) {
    if let Some(rec) = recurrent {
        for (p, &r) in pre.iter_mut().zip(rec) {
            *p += r;
        }
    }
    activate_gates(pre);
    let h = cell.len();
    let (i, rest) = pre.split_at(h);
    let (f, rest) = rest.split_at(h);
    let (g, o) = rest.split_at(h);
    let units = i.iter().zip(f).zip(g).zip(&o[..h]);
    let outs = cell.iter_mut().zip(h_out.iter_mut()).zip(c_prev);
    for ((((&i, &f), &g), &o), ((c, h), &c_prev)) in units.zip(outs) {
        *c = f * c_prev + i * g;
        *h = o * vector_math::tanh(*c);
    }
}

/// What one step kept: its activated gates [4H], c_t and c_{t−1}.
pub(crate) struct CellSaved<'a> {
    pub gates: &'a [f32],
    pub cell: &'a [f32],
    pub c_prev: &'a [f32],
}

/// Units `cell_backward` takes at once, through local arrays.
const CELL_LANES: usize = 16;

/// One step backward: from the output's gradient `g` and the carried
/// `dh_carry`, the pre-activation gradients into `d` [4H]; the carried
/// `dc` is updated in place to the step before's.
///
/// It runs CELL_LANES units at a time through local arrays. The same loop
/// zipped over the nine slices in place compiled to scalar code where the
/// ConvLSTM inlines it (seen in the disassembly; nine inputs and five
/// outputs the compiler could not prove apart), about 9 ms of a 137 ms
/// `conv_lstm` step. Each unit computes the same expressions either way,
/// so the bits do not change (`cell_backward_matches_the_unit_formula`).
#[inline(always)]
pub(crate) fn cell_backward(
    saved: CellSaved<'_>,
    g: &[f32],
    dh_carry: &[f32],
    dc: &mut [f32],
    d: &mut [f32],
) {
    let h = saved.cell.len();
    let gates = saved.gates;
    assert!(
        gates.len() == 4 * h
            && d.len() == 4 * h
            && [saved.c_prev.len(), g.len(), dh_carry.len(), dc.len()] == [h; 4],
        "cell_backward: lengths"
    );
    for u0 in (0..h).step_by(CELL_LANES) {
        let n = CELL_LANES.min(h - u0);
        // Inputs: i, f, g, o, c_t, c_{t−1}, the output's gradient, dh, dc.
        let mut input = [[0.0f32; CELL_LANES]; 9];
        let sources = [
            &gates[u0..],
            &gates[h + u0..],
            &gates[2 * h + u0..],
            &gates[3 * h + u0..],
            &saved.cell[u0..],
            &saved.c_prev[u0..],
            &g[u0..],
            &dh_carry[u0..],
            &dc[u0..],
        ];
        for (lane, src) in input.iter_mut().zip(sources) {
            lane[..n].copy_from_slice(&src[..n]);
        }
        let [i, f, gv, o, cell, c_prev, g, dh_in, dc_in] = input;
        // Outputs: dc_{t−1}, d_i, d_f, d_g, d_o.
        let mut output = [[0.0f32; CELL_LANES]; 5];
        for k in 0..CELL_LANES {
            let tc = vector_math::tanh(cell[k]);
            let dh = g[k] + dh_in[k];
            let dcell = dh * o[k] * (1.0 - tc * tc) + dc_in[k];
            output[0][k] = dcell * f[k];
            output[1][k] = dcell * gv[k] * i[k] * (1.0 - i[k]);
            output[2][k] = dcell * c_prev[k] * f[k] * (1.0 - f[k]);
            output[3][k] = dcell * i[k] * (1.0 - gv[k] * gv[k]);
            output[4][k] = dh * tc * o[k] * (1.0 - o[k]);
        }
        dc[u0..u0 + n].copy_from_slice(&output[0][..n]);
        for (gate, lane) in output[1..].iter().enumerate() {
            d[gate * h + u0..][..n].copy_from_slice(&lane[..n]);
        }
    }
}

/// Uniform in ±1/√H, as PyTorch initialises its LSTM.
fn uniform_weights(rng: &mut InitRng, hidden: usize, len: usize) -> Vec<f32> {
    let bound = 1.0 / (hidden as f64).sqrt();
    (0..len)
        .map(|_| ((2.0 * rng.uniform() - 1.0) * bound) as f32)
        .collect()
}

/// Samples per task of the time loop. Samples are independent through
/// time, so each task runs its own through every step: the T sequential
/// steps need no synchronisation between threads.
fn samples_per_task(n: usize) -> usize {
    n.div_ceil(rayon::current_num_threads()).max(1)
}

/// The recurrence of a block of S samples ([S, T, ·] slices): `gates`
/// holds x_t·Wx + b on entry and the activated gates on return; `rec`
/// [S, 4H] is scratch for h_{t−1}·Wh.
fn forward_through_time(
    gates: &mut [f32],
    cells: &mut [f32],
    hs: &mut [f32],
    rec: &mut [f32],
    steps: usize,
    wh: &RecurrentWeights,
) {
    let g4 = wh.cols();
    let h = g4 / 4;
    let samples = rec.len() / g4;
    let zeros = vec![0.0; h];
    for t in 0..steps {
        if t > 0 {
            wh.product(rec, samples, &hs[(t - 1) * h..], steps * h);
        }
        let rec = (t > 0).then_some(&*rec);
        let block = Block { steps, h, t };
        vector_math::wide(
            #[inline(always)]
            || cells_forward(block, &zeros, gates, cells, hs, rec),
        );
    }
}

/// Where a step lies in a block's [S, T, ·] slices.
#[derive(Clone, Copy)]
struct Block {
    steps: usize,
    h: usize,
    t: usize,
}

impl Block {
    fn row(self, sample: usize) -> usize {
        sample * self.steps + self.t
    }
}

/// Step t of every sample of a block. `#[inline(always)]` (as are the
/// cell's functions) so that it is compiled inside `vector_math::wide`'s
/// wide-vector function, not beside it.
#[inline(always)]
fn cells_forward(
    block: Block,
    zeros: &[f32],
    gates: &mut [f32],
    cells: &mut [f32],
    hs: &mut [f32],
    rec: Option<&[f32]>,
) {
    let h = block.h;
    let g4 = 4 * h;
    for sample in 0..cells.len() / (block.steps * h) {
        let row = block.row(sample);
        let (before, now) = cells.split_at_mut(row * h);
        let c_prev = match block.t {
            0 => zeros,
            _ => &before[(row - 1) * h..row * h],
        };
        cell_forward(
            &mut gates[row * g4..(row + 1) * g4],
            rec.map(|r| &r[sample * g4..(sample + 1) * g4]),
            c_prev,
            &mut now[..h],
            &mut hs[row * h..(row + 1) * h],
        );
    }
}

/// What the forward of a block of samples kept: gates [S, T, 4H], cells
/// [S, T, H].
struct SequenceSaved<'a> {
    gates: &'a [f32],
    cells: &'a [f32],
}

/// Backward through time of a block of S samples: from the outputs'
/// gradient `g` [S, T, H], every step's pre-activation gradient into
/// `d_pre` [S, T, 4H]; `dh` and `dc` [S, H] carry between steps and start
/// at zero.
fn backward_through_time(
    saved: SequenceSaved<'_>,
    g: &[f32],
    d_pre: &mut [f32],
    dh: &mut [f32],
    dc: &mut [f32],
    steps: usize,
    wh_t: &RecurrentWeights,
) {
    let h = wh_t.cols();
    let g4 = 4 * h;
    let samples = dh.len() / h;
    let zeros = vec![0.0; h];
    for t in (0..steps).rev() {
        let block = Block { steps, h, t };
        vector_math::wide(
            #[inline(always)]
            || cells_backward(block, &saved, g, &zeros, dh, dc, d_pre),
        );
        // dh_{t−1} = d_pre_t·Whᵀ, read from the rows just written.
        if t > 0 {
            wh_t.product(dh, samples, &d_pre[t * g4..], steps * g4);
        }
    }
}

/// Step t backward for every sample of a block (inlined into
/// `vector_math::wide`, as `cells_forward` is).
#[inline(always)]
fn cells_backward(
    block: Block,
    saved: &SequenceSaved<'_>,
    g: &[f32],
    zeros: &[f32],
    dh: &[f32],
    dc: &mut [f32],
    d_pre: &mut [f32],
) {
    let h = block.h;
    let g4 = 4 * h;
    let (gates, cells) = (saved.gates, saved.cells);
    for sample in 0..dh.len() / h {
        let (row, at) = (block.row(sample), sample * h);
        let c_prev = match block.t {
            0 => zeros,
            _ => &cells[(row - 1) * h..row * h],
        };
        cell_backward(
            CellSaved {
                gates: &gates[row * g4..(row + 1) * g4],
                cell: &cells[row * h..(row + 1) * h],
                c_prev,
            },
            &g[row * h..(row + 1) * h],
            &dh[at..at + h],
            &mut dc[at..at + h],
            &mut d_pre[row * g4..(row + 1) * g4],
        );
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
    cuda_form!(crate::ops::sequence::layer::LstmLayer::from_cpu);

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
        let mut gates = gather_rows(&[n, steps, g4], g4, |_| bias)?;
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
        let wh = RecurrentWeights::new(View::rm(self.wh.value.data(), g4), h, g4)?;
        let per_task = samples_per_task(n);
        let (gate_data, cell_data, h_data) = (
            gates.try_data_mut()?,
            cells.try_data_mut()?,
            hs.try_data_mut()?,
        );
        gate_data
            .par_chunks_mut(per_task * steps * g4)
            .zip(cell_data.par_chunks_mut(per_task * steps * h))
            .zip(h_data.par_chunks_mut(per_task * steps * h))
            .zip(recurrent.try_data_mut()?.par_chunks_mut(per_task * g4))
            .for_each(|(((gates, cells), hs), rec)| {
                forward_through_time(gates, cells, hs, rec, steps, &wh);
            });
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
        // Whᵀ [4H, H], packed or copied row-major once for the T steps.
        let wh_t = RecurrentWeights::new(View::cm(self.wh.value.data(), g4), g4, h)?;
        let per_task = samples_per_task(n);
        let (seq, carry) = (per_task * steps, per_task * h);
        d_pre
            .try_data_mut()?
            .par_chunks_mut(seq * g4)
            .zip(gates.par_chunks(seq * g4))
            .zip(cells.par_chunks(seq * h))
            .zip(g.par_chunks(seq * h))
            .zip(dh_next.try_data_mut()?.par_chunks_mut(carry))
            .zip(dc_next.try_data_mut()?.par_chunks_mut(carry))
            .for_each(|(((((d_pre, gates), cells), g), dh), dc)| {
                let saved = SequenceSaved { gates, cells };
                backward_through_time(saved, g, d_pre, dh, dc, steps, &wh_t);
            });
        let zeros = vec![0.0; h];
        let d_all = View::rm(d_pre.data(), g4);
        // dWh = Σ_t h_{t−1}ᵀ·d_pre_t as one product over every step: the
        // outputs shifted one step later (zero before the first), so that
        // row (sample, t) holds h_{t−1}.
        let h_data = saved.h.data();
        let h_prev = gather_rows(&[n, steps, h], h, |row| match row % steps {
            0 => &zeros[..],
            _ => &h_data[(row - 1) * h..row * h],
        })?;
        let h_prev_t = View::cm(h_prev.data(), h);
        product(
            self.wh.grad.data_mut(),
            h,
            g4,
            n * steps,
            h_prev_t,
            d_all,
            true,
        );
        drop(h_prev);
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

    /// The blocked cell backward gives, bit for bit, the unit formula
    /// written out one unit at a time, for whole blocks and a short tail.
    #[test]
    fn cell_backward_matches_the_unit_formula() {
        let h = 2 * CELL_LANES + 5;
        let mut rng = InitRng::new(3);
        let mut draw = |len: usize| -> Vec<f32> {
            (0..len).map(|_| rng.uniform() as f32 * 1.8 - 0.9).collect()
        };
        let (gates, cell, c_prev) = (draw(4 * h), draw(h), draw(h));
        let (g, dh_carry, dc_in) = (draw(h), draw(h), draw(h));
        let (mut dc, mut d) = (dc_in.clone(), vec![f32::NAN; 4 * h]);
        let saved = CellSaved {
            gates: &gates,
            cell: &cell,
            c_prev: &c_prev,
        };
        cell_backward(saved, &g, &dh_carry, &mut dc, &mut d);
        for k in 0..h {
            let [i, f, gv, o] = [0, 1, 2, 3].map(|gate| gates[gate * h + k]);
            let tc = vector_math::tanh(cell[k]);
            let dh = g[k] + dh_carry[k];
            let dcell = dh * o * (1.0 - tc * tc) + dc_in[k];
            let want = [
                dcell * f,
                dcell * gv * i * (1.0 - i),
                dcell * c_prev[k] * f * (1.0 - f),
                dcell * i * (1.0 - gv * gv),
                dh * tc * o * (1.0 - o),
            ];
            let got = [dc[k], d[k], d[h + k], d[2 * h + k], d[3 * h + k]];
            assert_eq!(got.map(f32::to_bits), want.map(f32::to_bits), "unit {k}");
        }
    }

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
