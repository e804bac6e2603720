//! Multi-head causal self-attention over a sequence [N, T, C], C = heads·d:
//! qkv = x·Wqkv (one C -> 3C projection), per head S = q·kᵀ/√d with the
//! future masked out, P = softmax(S) by rows, o = P·v, heads concatenated,
//! y = o·Wproj. The projections are layers of their own (a linear, or a
//! LoRA linear with the base frozen), applied to the batch as [N·T, C].
//!
//! Saves for backward: q, k and v split by head ([N, heads, T, d], contiguous
//! per head, 3·N·T·C floats), and P ([N, heads, T, T]) unless `lean` is on;
//! the projections save their own inputs (x, and the concatenated heads).
//! With `lean` no T×T matrix outlives its head: backward recomputes each
//! head's P from q and k with the same function the forward used, so the
//! gradients are bitwise those of the path that keeps P, for one more
//! q·kᵀ product per head.
//!
//! Backward per head, with dO the gradient of o: dP = dO·vᵀ,
//! dS = P ∘ (dP − rowsum(dP ∘ P)) / √d, dq = dS·k, dk = dSᵀ·q, dv = Pᵀ·dO.
//! Heads run in parallel, each with one or two T×T scratch blocks from the
//! pool.

use rayon::prelude::*;

use super::activation::gather_rows;
use super::head_products::{self, TiledHead};
use super::matmul::{matmul, View};
use super::vector_math::{self, lane_sum, wide};
use crate::profile;
use crate::{Layer, Mode, ModelError, Param, Result, Tensor};

pub struct CausalSelfAttention {
    width: usize,
    heads: usize,
    qkv: Box<dyn Layer>,
    proj: Box<dyn Layer>,
    lean: bool,
    saved: Option<Saved>,
}

struct Saved {
    n: usize,
    t: usize,
    /// [N, heads, T, d] each.
    q: Tensor,
    k: Tensor,
    v: Tensor,
    /// [N, heads, T, T], unless lean.
    probs: Option<Tensor>,
}

/// One head's operands, row-major: q, k, v [T, d].
struct Head<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
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
            t: self.t,
            d: self.d,
        })
    }

    /// P = causal softmax(q·kᵀ/√d) into `p` [T, T] (zeros above the
    /// diagonal). The forward and the lean backward both call this, so P is
    /// bitwise the same in both.
    fn probabilities(&self, p: &mut [f32]) {
        let (t, d) = (self.t, self.d);
        match self.tiled() {
            Some(head) => head.scores(p),
            None => matmul(p, t, t, d, View::rm(self.q, d), View::cm(self.k, d), false),
        }
        causal_softmax(p, t, self.scale());
    }

    /// o = P·v into `o` [T, d].
    fn output(&self, p: &[f32], o: &mut [f32]) {
        let (t, d) = (self.t, self.d);
        match self.tiled() {
            Some(head) => head.output(p, o),
            None => matmul(o, t, d, t, View::rm(p, t), View::rm(self.v, d), false),
        }
    }

    /// dq, dk, dv from dO and P; `dp` is T×T scratch.
    fn backward(&self, p: &[f32], d_out: &[f32], dp: &mut [f32], grads: [&mut [f32]; 3]) {
        let (t, d) = (self.t, self.d);
        let tiled = self.tiled();
        match &tiled {
            Some(head) => head.d_probabilities(d_out, dp),
            None => matmul(dp, t, t, d, View::rm(d_out, d), View::cm(self.v, d), false),
        }
        d_scores(dp, p, t, self.scale());
        let ds = &*dp;
        if let Some(head) = tiled {
            return head.gradients(p, ds, d_out, grads);
        }
        let [dq, dk, dv] = grads;
        matmul(dq, t, d, t, View::rm(ds, t), View::rm(self.k, d), false);
        matmul(dk, t, d, t, View::cm(ds, t), View::rm(self.q, d), false);
        matmul(dv, t, d, t, View::cm(p, t), View::rm(d_out, d), false);
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
                let (visible, future) = row.split_at_mut(i + 1);
                // Rounding is monotonic and scale > 0: the max of the
                // scaled values is the scaled max.
                let max = lane_max(visible) * scale;
                for s in visible.iter_mut() {
                    *s = vector_math::exp(*s * scale - max);
                }
                let inv = 1.0 / lane_sum(visible, visible, |s, _| s);
                visible.iter_mut().for_each(|s| *s *= inv);
                future.fill(0.0);
            }
        },
    );
}

/// dP [T, T] -> dS = P ∘ (dP − rowsum(dP ∘ P))·scale over the visible
/// columns; the future (where P is 0) zeroed.
fn d_scores(dp: &mut [f32], p: &[f32], t: usize, scale: f32) {
    wide(
        #[inline(always)]
        || {
            let rows = dp.chunks_exact_mut(t).zip(p.chunks_exact(t));
            for (i, (dp_row, p_row)) in rows.enumerate() {
                let (visible, future) = dp_row.split_at_mut(i + 1);
                let p_visible = &p_row[..=i];
                let dot = lane_sum(visible, p_visible, |g, p| g * p);
                for (g, &pv) in visible.iter_mut().zip(p_visible) {
                    *g = pv * (*g - dot) * scale;
                }
                future.fill(0.0);
            }
        },
    );
}

/// The largest of `values` (−∞ for none), eight lanes wide.
#[inline(always)]
fn lane_max(values: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = values.chunks_exact(8);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane = lane.max(v);
        }
    }
    lanes
        .into_iter()
        .chain(tail.iter().copied())
        .fold(f32::NEG_INFINITY, f32::max)
}

/// Head `index` (sample-major, head-minor) of q, k, v [N, heads, T, d].
fn head_at<'a>(
    q: &'a Tensor,
    k: &'a Tensor,
    v: &'a Tensor,
    index: usize,
    t: usize,
    d: usize,
) -> Head<'a> {
    let range = index * t * d..(index + 1) * t * d;
    Head {
        q: &q.data()[range.clone()],
        k: &k.data()[range.clone()],
        v: &v.data()[range],
        t,
        d,
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

    /// [N·T, 3C] (q | k | v, heads side by side) -> three [N, heads, T, d].
    fn split_heads(&self, qkv: &Tensor, n: usize, t: usize) -> Result<[Tensor; 3]> {
        let (c, h, d) = (self.width, self.heads, self.head_dim());
        let src = qkv.data();
        let part = |which: usize| {
            gather_rows(&[n, h, t, d], d, |k| {
                let (pos, rest) = (k % t, k / t);
                let (head, sample) = (rest % h, rest / h);
                let at = (sample * t + pos) * 3 * c + which * c + head * d;
                &src[at..at + d]
            })
        };
        Ok([part(0)?, part(1)?, part(2)?])
    }

    /// [N, heads, T, d] -> [N·T, C] with the heads side by side.
    fn merge_heads(&self, per_head: &Tensor, n: usize, t: usize) -> Result<Tensor> {
        let (c, h, d) = (self.width, self.heads, self.head_dim());
        let src = per_head.data();
        gather_rows(&[n * t, c], d, |k| {
            let (head, row) = (k % h, k / h);
            let (sample, pos) = (row / t, row % t);
            let at = ((sample * h + head) * t + pos) * d;
            &src[at..at + d]
        })
    }
}

impl Layer for CausalSelfAttention {
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
        let (h, d) = (self.heads, self.head_dim());
        let rows = input.clone().reshape(&[n * t, self.width])?;
        let qkv = self.qkv.forward(&rows, mode)?;
        profile::mark_layer("fwd", self.qkv.as_ref(), "in", rows.shape());
        qkv.expect_shape("causal_self_attention qkv", &[n * t, 3 * self.width])?;
        let [q, k, v] = self.split_heads(&qkv, n, t)?;
        drop(qkv);
        let keep_probs = mode == Mode::Train && !self.lean;
        let mut probs = if keep_probs {
            Some(Tensor::try_zeros(&[n, h, t, t])?)
        } else {
            None
        };
        let mut heads_out = Tensor::try_zeros(&[n, h, t, d])?;
        let out_chunks = heads_out.try_data_mut()?.par_chunks_mut((t * d).max(1));
        match probs.as_mut() {
            Some(p) => out_chunks
                .zip(p.try_data_mut()?.par_chunks_mut((t * t).max(1)))
                .enumerate()
                .for_each(|(i, (o, p))| {
                    let head = head_at(&q, &k, &v, i, t, d);
                    head.probabilities(p);
                    head.output(p, o);
                }),
            None => out_chunks
                .enumerate()
                .try_for_each(|(i, o)| -> Result<()> {
                    let head = head_at(&q, &k, &v, i, t, d);
                    let mut p = scratch(t)?;
                    head.probabilities(p.try_data_mut()?);
                    head.output(p.data(), o);
                    Ok(())
                })?,
        }
        let merged = self.merge_heads(&heads_out, n, t)?;
        drop(heads_out);
        profile::mark(|| {
            format!("fwd attention heads {h}x{t}x{t} (split, softmax(q·kᵀ)·v, merge)")
        });
        let y = self.proj.forward(&merged, mode)?;
        profile::mark_layer("fwd", self.proj.as_ref(), "in", merged.shape());
        if mode == Mode::Train {
            self.saved = Some(Saved {
                n,
                t,
                q,
                k,
                v,
                probs,
            });
        }
        y.reshape(&[n, t, self.width])
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
        // dO by head, the layout the per-head products want.
        let d_heads = self.split_merged(&d_merged, n, t)?;
        drop(d_merged);
        let mut dq = Tensor::try_zeros(&[n, h, t, d])?;
        let mut dk = Tensor::try_zeros(&[n, h, t, d])?;
        let mut dv = Tensor::try_zeros(&[n, h, t, d])?;
        let chunk = (t * d).max(1);
        dq.try_data_mut()?
            .par_chunks_mut(chunk)
            .zip(dk.try_data_mut()?.par_chunks_mut(chunk))
            .zip(dv.try_data_mut()?.par_chunks_mut(chunk))
            .enumerate()
            .try_for_each(|(i, ((dq, dk), dv))| -> Result<()> {
                let head = head_at(&saved.q, &saved.k, &saved.v, i, t, d);
                let d_out = &d_heads.data()[i * t * d..(i + 1) * t * d];
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
                head.backward(p, d_out, dp.try_data_mut()?, [dq, dk, dv]);
                Ok(())
            })?;
        drop(saved);
        let d_qkv = self.join_qkv([&dq, &dk, &dv], n, t)?;
        drop((dq, dk, dv));
        profile::mark(|| format!("bwd attention heads {h}x{t}x{t} (split, dS, dq·dk·dv, join)"));
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

impl CausalSelfAttention {
    /// [N·T, C] -> [N, heads, T, d].
    fn split_merged(&self, merged: &Tensor, n: usize, t: usize) -> Result<Tensor> {
        let (c, h, d) = (self.width, self.heads, self.head_dim());
        let src = merged.data();
        gather_rows(&[n, h, t, d], d, |k| {
            let (pos, rest) = (k % t, k / t);
            let (head, sample) = (rest % h, rest / h);
            let at = (sample * t + pos) * c + head * d;
            &src[at..at + d]
        })
    }

    /// Three [N, heads, T, d] -> [N·T, 3C], the qkv projection's layout.
    fn join_qkv(&self, parts: [&Tensor; 3], n: usize, t: usize) -> Result<Tensor> {
        let (c, h, d) = (self.width, self.heads, self.head_dim());
        gather_rows(&[n * t, 3 * c], d, |k| {
            let (head, rest) = (k % h, k / h);
            let (which, row) = (rest % 3, rest / 3);
            let (sample, pos) = (row / t, row % t);
            let at = ((sample * h + head) * t + pos) * d;
            &parts[which].data()[at..at + d]
        })
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
            head.backward(&p, d_out.data(), &mut dp, [dq, dk, dv]);
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
