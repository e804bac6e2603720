//! Multi-head causal self-attention over a sequence [N, T, C], C = heads·d:
//! qkv = x·Wqkv (one C -> 3C projection), per head S = q·kᵀ/√d with the
//! future masked out, P = softmax(S) by rows, o = P·v, heads concatenated,
//! y = o·Wproj. The projections are layers of their own (a linear, or a
//! LoRA linear with the base frozen), applied to the batch as [N·T, C].
//!
//! Saves for backward: the qkv projection's output as it is ([N·T, 3C],
//! which the heads read in place, rows 3C floats apart), and P
//! ([N, heads, T, T]) unless `lean` is on; the projections save their own
//! inputs (x, and the concatenated heads).
//! With `lean` no T×T matrix outlives its head: backward recomputes each
//! head's P from q and k with the same function the forward used, so the
//! gradients are bitwise those of the path that keeps P, for one more
//! q·kᵀ product per head.
//!
//! Backward per head, with dO the gradient of o: dP = dO·vᵀ,
//! dS = P ∘ (dP − rowsum(dP ∘ P)) / √d, dq = dS·k, dk = dSᵀ·q, dv = Pᵀ·dO.
//! Heads run in parallel, each with one or two T×T scratch blocks from the
//! pool and its outputs in [T, d] blocks of its own, copied into the
//! concatenated heads (forward) or dqkv (backward): no tensor is split
//! into heads or merged back.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::head_products::{self, TiledHead};
use crate::layers::matmul::{matmul, View};
use crate::layers::vector_math::{self, lane_max, lane_sum, wide};
use crate::profile;
use crate::{Layer, Mode, ModelError, Param, Result, Tensor};

pub struct CausalSelfAttention {
    width: usize,
    pub(crate) heads: usize,
    pub(crate) qkv: Box<dyn Layer>,
    pub(crate) proj: Box<dyn Layer>,
    lean: bool,
    saved: Option<Saved>,
}

struct Saved {
    n: usize,
    t: usize,
    /// [N·T, 3C]: q | k | v, heads side by side.
    qkv: Tensor,
    /// [N, heads, T, T], unless lean.
    probs: Option<Tensor>,
}

/// One head's operands read in place: q, k, v [T, d] with rows `stride`
/// floats apart, each slice from the operand's first element.
struct Head<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    stride: usize,
    t: usize,
    d: usize,
}

impl Head<'_> {
    fn scale(&self) -> f32 {
        1.0 / (self.d as f32).sqrt()
    }

    /// The direct tiles' form of this head, where they run.
    fn tiled(&self) -> Option<TiledHead<'_>> {
        head_products::supported(self.t, self.d).then_some(TiledHead {
            q: self.q,
            k: self.k,
            v: self.v,
            stride: self.stride,
            t: self.t,
            d: self.d,
        })
    }

    /// One of the operands as a [T, d] view for the `gemm` crate.
    fn rows<'b>(&self, m: &'b [f32]) -> View<'b> {
        View {
            data: m,
            row_stride: self.stride,
            col_stride: 1,
        }
    }

    /// Its transpose [d, T].
    fn columns<'b>(&self, m: &'b [f32]) -> View<'b> {
        View {
            data: m,
            row_stride: 1,
            col_stride: self.stride,
        }
    }

    /// P = causal softmax(q·kᵀ/√d) into `p` [T, T] (zeros above the
    /// diagonal). The forward and the lean backward both call this, so P is
    /// bitwise the same in both.
    fn probabilities(&self, p: &mut [f32]) {
        let (t, d) = (self.t, self.d);
        match self.tiled() {
            Some(head) => head.scores(p),
            None => matmul(p, t, t, d, self.rows(self.q), self.columns(self.k), false),
        }
        causal_softmax(p, t, self.scale());
    }

    /// o = P·v into `o` [T, d].
    fn output(&self, p: &[f32], o: &mut [f32]) {
        let (t, d) = (self.t, self.d);
        match self.tiled() {
            Some(head) => head.output(p, o),
            None => matmul(o, t, d, t, View::rm(p, t), self.rows(self.v), false),
        }
    }

    /// dq, dk, dv [T, d] from P and dO (rows `d_out_stride` apart);
    /// `dp` is T×T scratch.
    fn backward(
        &self,
        p: &[f32],
        (d_out, d_out_stride): (&[f32], usize),
        dp: &mut [f32],
        grads: [&mut [f32]; 3],
    ) {
        let (t, d) = (self.t, self.d);
        let d_out_rows = View {
            data: d_out,
            row_stride: d_out_stride,
            col_stride: 1,
        };
        let tiled = self.tiled();
        match &tiled {
            Some(head) => head.d_probabilities((d_out, d_out_stride), dp),
            None => matmul(dp, t, t, d, d_out_rows, self.columns(self.v), false),
        }
        d_scores(dp, p, t, self.scale());
        let ds = &*dp;
        if let Some(head) = tiled {
            return head.gradients(p, ds, (d_out, d_out_stride), grads);
        }
        let [dq, dk, dv] = grads;
        matmul(dq, t, d, t, View::rm(ds, t), self.rows(self.k), false);
        matmul(dk, t, d, t, View::cm(ds, t), self.rows(self.q), false);
        matmul(dv, t, d, t, View::cm(p, t), d_out_rows, false);
    }
}

/// Columns a row's vector loops cover: whole chunks of 16.
const CHUNK: usize = 16;

/// The columns row i works on: its visible ones, padded to whole chunks
/// (within T), so that no row ends in a scalar loop (row lengths vary
/// from 1 to T; scalar tails were most of the softmax's time). The
/// padding is masked, whatever it held.
fn padded(i: usize, t: usize) -> usize {
    (i + 1).next_multiple_of(CHUNK).min(t)
}

/// `row[j] = f(row[j])`, in whole chunks of 16 (one AVX-512 or two AVX2
/// vectors each), then any tail.
#[inline(always)]
fn map_chunked(row: &mut [f32], f: impl Fn(f32) -> f32) {
    let mut chunks = row.chunks_exact_mut(CHUNK);
    for chunk in &mut chunks {
        for v in chunk.iter_mut() {
            *v = f(*v);
        }
    }
    for v in chunks.into_remainder() {
        *v = f(*v);
    }
}

/// Rows of S [T, T] -> P: row i is softmax(S[i, ..=i]·scale), the future
/// zeroed (whatever S held there). Lane-wise max and sum, so the rows
/// vectorise.
fn causal_softmax(p: &mut [f32], t: usize, scale: f32) {
    wide(
        #[inline(always)]
        || {
            for (i, row) in p.chunks_exact_mut(t).enumerate() {
                // Rounding is monotonic and scale > 0: the max of the
                // scaled values is the scaled max.
                let max = lane_max(&row[..=i]) * scale;
                let (work, rest) = row.split_at_mut(padded(i, t));
                // The padding's values are discarded just after.
                map_chunked(
                    work,
                    #[inline(always)]
                    |s| vector_math::exp(s * scale - max),
                );
                work[i + 1..].fill(0.0);
                let inv = 1.0
                    / lane_sum(
                        work,
                        work,
                        #[inline(always)]
                        |s, _| s,
                    );
                map_chunked(
                    work,
                    #[inline(always)]
                    |s| s * inv,
                );
                rest.fill(0.0);
            }
        },
    );
}

/// dP [T, T] -> dS = P ∘ (dP − rowsum(dP ∘ P))·scale over the visible
/// columns; the future (where P is 0) zeroed, whatever dP held there.
fn d_scores(dp: &mut [f32], p: &[f32], t: usize, scale: f32) {
    wide(
        #[inline(always)]
        || {
            let rows = dp.chunks_exact_mut(t).zip(p.chunks_exact(t));
            for (i, (dp_row, p_row)) in rows.enumerate() {
                dp_row[i + 1..].fill(0.0);
                let work = &mut dp_row[..padded(i, t)];
                let p_work = &p_row[..work.len()];
                let dot = lane_sum(
                    work,
                    p_work,
                    #[inline(always)]
                    |g, p| g * p,
                );
                for (g, &p) in work.iter_mut().zip(p_work) {
                    *g = p * (*g - dot) * scale;
                }
            }
        },
    );
}

/// Head `index` (sample-major, head-minor) of qkv [N·T, 3C], in place.
fn head_at(qkv: &[f32], index: usize, heads: usize, t: usize, d: usize) -> Head<'_> {
    let (sample, head) = (index / heads, index % heads);
    let c = heads * d;
    let first = sample * t * 3 * c + head * d;
    Head {
        q: &qkv[first..],
        k: &qkv[first + c..],
        v: &qkv[first + 2 * c..],
        stride: 3 * c,
        t,
        d,
    }
}

/// A row-major matrix, `stride` floats a row, that parallel tasks fill in
/// disjoint blocks (each head its columns of its sample's rows).
struct SharedRows {
    data: *mut f32,
    len: usize,
    stride: usize,
}

// SAFETY: tasks write disjoint elements through it (`write_block`'s
// contract), and the call that made it waits for them all.
unsafe impl Send for SharedRows {}
unsafe impl Sync for SharedRows {}

impl SharedRows {
    fn new(out: &mut [MaybeUninit<f32>], stride: usize) -> Self {
        Self {
            data: out.as_mut_ptr().cast(),
            len: out.len(),
            stride,
        }
    }

    /// Rows `first`.. and columns `col`..`col + width` from `block`
    /// ([rows × width], contiguous).
    ///
    /// # Safety
    /// No other task reads or writes those elements meanwhile.
    unsafe fn write_block(&self, first: usize, col: usize, width: usize, block: &[f32]) {
        assert!(col + width <= self.stride, "write_block: columns");
        for (r, row) in block.chunks_exact(width.max(1)).enumerate() {
            let at = (first + r) * self.stride + col;
            assert!(at + width <= self.len, "write_block: rows");
            // SAFETY: inside the buffer (asserted); the elements are this
            // task's alone (our caller's contract), and `block` is a
            // separate allocation.
            unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), self.data.add(at), width) };
        }
    }
}

/// A T×T block from the pool for one head's scratch.
fn scratch(t: usize) -> Result<Tensor> {
    Tensor::try_zeros(&[t, t])
}

impl CausalSelfAttention {
    /// `qkv` maps [rows, width] to [rows, 3·width], `proj` [rows, width] to
    /// itself. `width` must be a multiple of `heads` (the builder checks it
    /// and names the key).
    pub fn new(
        width: usize,
        heads: usize,
        qkv: Box<dyn Layer>,
        proj: Box<dyn Layer>,
        lean: bool,
    ) -> Result<Self> {
        if heads == 0 || !width.is_multiple_of(heads) {
            return Err(ModelError::Spec {
                path: "causal_self_attention".into(),
                reason: format!("heads ({heads}) must divide the width ({width})"),
            });
        }
        Ok(Self {
            width,
            heads,
            qkv,
            proj,
            lean,
            saved: None,
        })
    }

    fn head_dim(&self) -> usize {
        self.width / self.heads
    }

    /// The projections, for LoRA merging.
    pub fn projections_mut(&mut self) -> [&mut dyn Layer; 2] {
        [self.qkv.as_mut(), self.proj.as_mut()]
    }

    fn dims(&self, shape: &[usize]) -> Result<(usize, usize)> {
        match *shape {
            [n, t, c] if c == self.width => Ok((n, t)),
            _ => Err(ModelError::Shape {
                op: "causal_self_attention",
                expected: format!("[n, t, {}]", self.width),
                got: format!("{shape:?}"),
            }),
        }
    }
}

impl Layer for CausalSelfAttention {
    cuda_form!(crate::ops::sequence::layer::AttentionLayer::from_cpu);

    fn describe(&self) -> String {
        let lean = if self.lean { ", lean" } else { "" };
        format!(
            "causal_self_attention {} heads {}{lean}",
            self.width, self.heads
        )
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        match *input {
            [_, c] if c == self.width => Ok(input.to_vec()),
            _ => Err(ModelError::Shape {
                op: "causal_self_attention",
                expected: format!("a sequence [t, {}]", self.width),
                got: format!("{input:?}"),
            }),
        }
    }

    fn macs(&self, input: &[usize]) -> Result<u64> {
        self.output_shape(input)?;
        let (t, c) = (input[0] as u64, self.width as u64);
        Ok(4 * t * c * c + 2 * t * t * c)
    }

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        self.saved = None;
        let (n, t) = self.dims(input.shape())?;
        let (c, h, d) = (self.width, self.heads, self.head_dim());
        let rows = input.clone().reshape(&[n * t, c])?;
        let qkv = self.qkv.forward(&rows, mode)?;
        profile::mark_layer("fwd", self.qkv.as_ref(), "in", rows.shape());
        qkv.expect_shape("causal_self_attention qkv", &[n * t, 3 * c])?;
        let keep_probs = mode == Mode::Train && !self.lean;
        let mut probs = match keep_probs {
            true => Some(Tensor::try_zeros(&[n, h, t, t])?),
            false => None,
        };
        let mut status: Result<()> = Ok(());
        let fill = |out: &mut [MaybeUninit<f32>]| {
            let out = SharedRows::new(out, c);
            let run = |i: usize, p: &mut [f32]| {
                let head = head_at(qkv.data(), i, h, t, d);
                head.probabilities(p);
                let mut o = vec![0.0; t * d];
                head.output(p, &mut o);
                // SAFETY: these rows and columns are head i's alone.
                unsafe { out.write_block(i / h * t, i % h * d, d, &o) };
            };
            status = match probs.as_mut() {
                Some(p) => p.try_data_mut().map(|p| {
                    p.par_chunks_mut((t * t).max(1))
                        .enumerate()
                        .for_each(|(i, p)| run(i, p))
                }),
                None => (0..n * h).into_par_iter().try_for_each(|i| {
                    let mut p = scratch(t)?;
                    run(i, p.try_data_mut()?);
                    Ok(())
                }),
            };
        };
        // SAFETY: head i writes its d columns of its sample's T rows, and
        // the heads together write every element; on an error the tensor
        // is dropped unread.
        let merged = unsafe { Tensor::try_init_with(&[n * t, c], fill)? };
        status?;
        profile::mark(|| format!("fwd attention heads {h}x{t}x{t} (softmax(q·kᵀ)·v)"));
        let y = self.proj.forward(&merged, mode)?;
        profile::mark_layer("fwd", self.proj.as_ref(), "in", merged.shape());
        if mode == Mode::Train {
            self.saved = Some(Saved { n, t, qkv, probs });
        }
        y.reshape(&[n, t, c])
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let saved = self.saved.take().ok_or(ModelError::NoSavedActivation {
            op: "causal_self_attention",
        })?;
        let (n, t, c) = (saved.n, saved.t, self.width);
        let (h, d) = (self.heads, self.head_dim());
        grad_output.expect_shape("causal_self_attention backward", &[n, t, c])?;
        let d_merged = self
            .proj
            .backward(&grad_output.clone().reshape(&[n * t, c])?)?;
        profile::mark_layer("bwd", self.proj.as_ref(), "out", d_merged.shape());
        d_merged.expect_shape("causal_self_attention backward", &[n * t, c])?;
        let mut status: Result<()> = Ok(());
        let fill = |out: &mut [MaybeUninit<f32>]| {
            let out = SharedRows::new(out, 3 * c);
            status = (0..n * h).into_par_iter().try_for_each(|i| {
                let head = head_at(saved.qkv.data(), i, h, t, d);
                let (sample, column) = (i / h, i % h * d);
                let d_out = &d_merged.data()[sample * t * c + column..];
                let mut dp = scratch(t)?;
                let recomputed;
                let p = match &saved.probs {
                    Some(p) => &p.data()[i * t * t..(i + 1) * t * t],
                    None => {
                        let mut p = scratch(t)?;
                        head.probabilities(p.try_data_mut()?);
                        recomputed = p;
                        recomputed.data()
                    }
                };
                let mut grads = [(); 3].map(|_| vec![0.0; t * d]);
                let [dq, dk, dv] = &mut grads;
                head.backward(p, (d_out, c), dp.try_data_mut()?, [dq, dk, dv]);
                for (which, grad) in grads.iter().enumerate() {
                    // SAFETY: these rows and columns are head i's alone.
                    unsafe { out.write_block(sample * t, which * c + column, d, grad) };
                }
                Ok(())
            });
        };
        // SAFETY: head i writes its d columns of q, k and v in its
        // sample's T rows, and the heads together write every element; on
        // an error the tensor is dropped unread.
        let d_qkv = unsafe { Tensor::try_init_with(&[n * t, 3 * c], fill)? };
        status?;
        drop((saved, d_merged));
        profile::mark(|| format!("bwd attention heads {h}x{t}x{t} (dS, dq·dk·dv)"));
        let dx = self.qkv.backward(&d_qkv)?;
        profile::mark_layer("bwd", self.qkv.as_ref(), "out", d_qkv.shape());
        dx.reshape(&[n, t, c])
    }

    fn marks_its_parts(&self) -> bool {
        true
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut params = self.qkv.params_mut();
        params.extend(self.proj.params_mut());
        params
    }

    fn clear_saved(&mut self) {
        self.saved = None;
        self.qkv.clear_saved();
        self.proj.clear_saved();
    }

    fn set_recompute(&mut self, on: bool) {
        self.qkv.set_recompute(on);
        self.proj.set_recompute(on);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_layer, random_tensor};
    use crate::init::InitRng;
    use crate::layers::Linear;

    fn attention(width: usize, heads: usize, lean: bool, seed: u64) -> CausalSelfAttention {
        let mut rng = InitRng::new(seed);
        let qkv = Box::new(Linear::new("qkv", width, 3 * width, true, &mut rng));
        let proj = Box::new(Linear::new("proj", width, width, true, &mut rng));
        CausalSelfAttention::new(width, heads, qkv, proj, lean).unwrap()
    }

    #[test]
    fn gradient_matches_finite_differences() {
        for lean in [false, true] {
            let mut attn = attention(6, 2, lean, 1);
            let report = check_layer(&mut attn, &random_tensor(&[2, 4, 6], 2), 1e-2, 2e-3);
            assert!(report.is_ok(), "lean {lean}: {}", report.unwrap_err());
        }
    }

    /// Heads of width 16 and length 16 run on the tiles (where the CPU
    /// has AVX2+FMA), reading q, k, v and dO in place from the
    /// projections' rows; lean recomputes P bit for bit.
    #[test]
    fn tiled_heads_in_place_have_true_gradients_and_lean_changes_no_bit() {
        let mut attn = attention(32, 2, false, 6);
        let small = random_tensor(&[1, 16, 32], 5);
        let report = check_layer(&mut attn, &small, 2e-2, 5e-3);
        assert!(report.is_ok(), "{}", report.unwrap_err());
        let x = random_tensor(&[2, 16, 32], 5);
        let g = random_tensor(&[2, 16, 32], 7);
        let bits = |lean: bool| {
            let mut attn = attention(32, 2, lean, 6);
            let y = attn.forward(&x, Mode::Train).unwrap();
            let dx = attn.backward(&g).unwrap();
            let mut bits: Vec<u32> = y
                .data()
                .iter()
                .chain(dx.data())
                .map(|v| v.to_bits())
                .collect();
            for p in attn.params_mut() {
                bits.extend(p.grad.data().iter().map(|v| v.to_bits()));
            }
            bits
        };
        assert_eq!(bits(false), bits(true));
    }

    #[test]
    fn the_future_does_not_change_the_past() {
        let mut attn = attention(4, 2, false, 3);
        let x = random_tensor(&[1, 5, 4], 4);
        let y = attn.forward(&x, Mode::Eval).unwrap();
        let mut later_changed = x.clone();
        for v in &mut later_changed.data_mut()[3 * 4..] {
            *v += 1.0;
        }
        let y2 = attn.forward(&later_changed, Mode::Eval).unwrap();
        assert_eq!(&y.data()[..3 * 4], &y2.data()[..3 * 4]);
        assert_ne!(&y.data()[3 * 4..], &y2.data()[3 * 4..]);
    }

    /// One head in f64: P, o, dq, dk, dv.
    fn reference_head(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        d_out: &[f32],
        t: usize,
        d: usize,
    ) -> [Vec<f64>; 5] {
        let at = |m: &[f32], i: usize, c: usize| m[i * d + c] as f64;
        let scale = 1.0 / (d as f64).sqrt();
        let mut p = vec![0.0; t * t];
        for i in 0..t {
            let s: Vec<f64> = (0..=i)
                .map(|j| (0..d).map(|c| at(q, i, c) * at(k, j, c)).sum::<f64>() * scale)
                .collect();
            let max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let total: f64 = s.iter().map(|x| (x - max).exp()).sum();
            for j in 0..=i {
                p[i * t + j] = (s[j] - max).exp() / total;
            }
        }
        let mut o = vec![0.0; t * d];
        let (mut dq, mut dk, mut dv) = (vec![0.0; t * d], vec![0.0; t * d], vec![0.0; t * d]);
        for i in 0..t {
            let dp: Vec<f64> = (0..t)
                .map(|j| (0..d).map(|c| at(d_out, i, c) * at(v, j, c)).sum())
                .collect();
            let dot: f64 = (0..t).map(|j| dp[j] * p[i * t + j]).sum();
            for j in 0..t {
                let ds = p[i * t + j] * (dp[j] - dot) * scale;
                for c in 0..d {
                    o[i * d + c] += p[i * t + j] * at(v, j, c);
                    dq[i * d + c] += ds * at(k, j, c);
                    dk[j * d + c] += ds * at(q, i, c);
                    dv[j * d + c] += p[i * t + j] * at(d_out, i, c);
                }
            }
        }
        [p, o, dq, dk, dv]
    }

    /// Heads the direct tiles take (T and d multiples of 16: 32- and
    /// 16-column tiles, causal blocks skipped) and one they do not, against
    /// the f64 reference.
    #[test]
    fn heads_match_an_f64_reference_on_the_tiles_and_off_them() {
        for (t, d) in [(64, 32), (48, 16), (32, 48), (10, 6)] {
            let [q, k, v, d_out] = [1, 2, 3, 4].map(|seed| random_tensor(&[t, d], seed));
            let head = Head {
                q: q.data(),
                k: k.data(),
                v: v.data(),
                stride: d,
                t,
                d,
            };
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                assert_eq!(head.tiled().is_some(), d != 6, "{t}x{d}");
            }
            let mut p = vec![f32::NAN; t * t];
            head.probabilities(&mut p);
            let mut o = vec![f32::NAN; t * d];
            head.output(&p, &mut o);
            let mut dp = vec![f32::NAN; t * t];
            let mut grads = [0, 1, 2].map(|_| vec![f32::NAN; t * d]);
            let [dq, dk, dv] = &mut grads;
            head.backward(&p, (d_out.data(), d), &mut dp, [dq, dk, dv]);
            let want = reference_head(q.data(), k.data(), v.data(), d_out.data(), t, d);
            let got = [&p, &o, &grads[0], &grads[1], &grads[2]];
            for (name, (got, want)) in ["P", "o", "dq", "dk", "dv"]
                .iter()
                .zip(got.iter().zip(&want))
            {
                for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
                    assert!(
                        (a as f64 - b).abs() <= 2e-5 * (1.0 + b.abs()),
                        "{t}x{d} {name}[{i}]: {a} against {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn heads_must_divide_the_width() {
        let mut rng = InitRng::new(1);
        let qkv = Box::new(Linear::new("qkv", 6, 18, true, &mut rng));
        let proj = Box::new(Linear::new("proj", 6, 6, true, &mut rng));
        let err = CausalSelfAttention::new(6, 4, qkv, proj, false)
            .err()
            .unwrap();
        assert!(
            err.to_string()
                .contains("heads (4) must divide the width (6)"),
            "{err}"
        );
    }
}
