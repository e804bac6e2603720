//! Causal attention over whole sequences for the gradient pass, one task
//! per (row, kv head) so that the heads sharing a kv head (grouped-query
//! attention) add their key and value gradients in one place, in a fixed
//! order: the result does not depend on the thread count. Scores, the
//! weighted values and every gradient are matrix products on head views
//! (strided, never copied). The full T × T score square is formed and its
//! upper triangle masked: twice the multiply-adds of the triangle, at the
//! matrix product's speed. Memory: the probabilities, batch · heads · T²,
//! kept for the backward; each task's outputs until they are scattered.

use rayon::prelude::*;

use crate::math::{gemm_into, softmax, View};

/// The attention's shape: rows of `t` positions, `heads` query heads over
/// `kv_heads`, `head_dim` each; keys at most `window` back when set.
#[derive(Clone, Copy)]
pub(crate) struct Shape {
    pub batch: usize,
    pub t: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub window: Option<usize>,
}

impl Shape {
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    fn qd(&self) -> usize {
        self.heads * self.head_dim
    }

    fn kvd(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }

    /// The first position that position i looks at (causal, and no more
    /// than `window` back).
    fn first_seen(&self, i: usize) -> usize {
        self.window.map_or(0, |w| (i + 1).saturating_sub(w))
    }
}

/// softmax(q·kᵀ · scale, causal) · v: the output [b·t, heads·hd] and the
/// probabilities [b][heads][t][t] (zero above the diagonal).
pub(crate) fn forward(s: Shape, q: &[f32], k: &[f32], v: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (t, hd, group) = (s.t, s.head_dim, s.group());
    let (qd, kvd) = (s.qd(), s.kvd());
    let mut probs = vec![0.0f32; s.batch * s.heads * t * t];
    let outs: Vec<Vec<f32>> = probs
        .par_chunks_mut(group * t * t)
        .enumerate()
        .map(|(task, p)| {
            let (r, g) = (task / s.kv_heads, task % s.kv_heads);
            let keys = View::columns(k, r * t, t, g * hd, hd, kvd);
            let values = View::columns(v, r * t, t, g * hd, hd, kvd);
            let mut out = vec![0.0f32; group * t * hd];
            for (j, (p, o)) in p
                .chunks_exact_mut(t * t)
                .zip(out.chunks_exact_mut(t * hd))
                .enumerate()
            {
                let head = g * group + j;
                let queries = View::columns(q, r * t, t, head * hd, hd, qd);
                gemm_into(p, queries, keys.t(), false, false);
                for (i, row) in p.chunks_exact_mut(t).enumerate() {
                    let first = s.first_seen(i);
                    row[..first].fill(0.0);
                    row[i + 1..].fill(0.0);
                    let seen = &mut row[first..=i];
                    seen.iter_mut().for_each(|x| *x *= s.scale());
                    softmax(seen);
                }
                gemm_into(o, View::new(p, t, t), values, false, false);
            }
            out
        })
        .collect();
    let mut attn = vec![0.0f32; s.batch * t * qd];
    scatter_heads(&mut attn, &outs, s, group, qd);
    (attn, probs)
}

/// Writes per-task head blocks ([heads of the task][t][hd]) into a
/// [b·t, width] matrix; task = r · kv_heads + g covers heads from g · per.
fn scatter_heads(dst: &mut [f32], blocks: &[Vec<f32>], s: Shape, per: usize, width: usize) {
    let (t, hd) = (s.t, s.head_dim);
    for (task, block) in blocks.iter().enumerate() {
        let (r, g) = (task / s.kv_heads, task % s.kv_heads);
        for (j, head) in block.chunks_exact(t * hd).enumerate() {
            let col = (g * per + j) * hd;
            for (i, src) in head.chunks_exact(hd).enumerate() {
                let row = (r * t + i) * width + col;
                dst[row..row + hd].copy_from_slice(src);
            }
        }
    }
}

/// The gradients (dq, dk, dv) of the attention from d(output) `dout`, the
/// queries and keys it saw (after RoPE), its values and probabilities.
pub(crate) fn backward(
    s: Shape,
    dout: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    probs: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (t, hd, group) = (s.t, s.head_dim, s.group());
    let (qd, kvd) = (s.qd(), s.kvd());
    let scale = s.scale();
    type Parts = (Vec<f32>, (Vec<f32>, Vec<f32>));
    let parts: Vec<Parts> = probs
        .par_chunks(group * t * t)
        .enumerate()
        .map(|(task, p)| {
            let (r, g) = (task / s.kv_heads, task % s.kv_heads);
            let keys = View::columns(k, r * t, t, g * hd, hd, kvd);
            let values = View::columns(v, r * t, t, g * hd, hd, kvd);
            let mut dq = vec![0.0f32; group * t * hd];
            let mut dk = vec![0.0f32; t * hd];
            let mut dv = vec![0.0f32; t * hd];
            let mut ds = vec![0.0f32; t * t];
            for (j, (p, dq)) in p
                .chunks_exact(t * t)
                .zip(dq.chunks_exact_mut(t * hd))
                .enumerate()
            {
                let head = g * group + j;
                let queries = View::columns(q, r * t, t, head * hd, hd, qd);
                let d_out = View::columns(dout, r * t, t, head * hd, hd, qd);
                let pv = View::new(p, t, t);
                // dv += pᵀ · dout; dp = dout · vᵀ.
                gemm_into(&mut dv, pv.t(), d_out, true, false);
                gemm_into(&mut ds, d_out, values.t(), false, false);
                // ds = p ⊙ (dp − Σ p ⊙ dp) · scale, row by row (zero where
                // p is: above the diagonal and outside the window).
                for (prow, drow) in p.chunks_exact(t).zip(ds.chunks_exact_mut(t)) {
                    let dot: f32 = prow.iter().zip(drow.iter()).map(|(a, b)| a * b).sum();
                    for (d, &pv) in drow.iter_mut().zip(prow) {
                        *d = pv * (*d - dot) * scale;
                    }
                }
                let dsv = View::new(&ds, t, t);
                gemm_into(dq, dsv, keys, false, false);
                gemm_into(&mut dk, dsv.t(), queries, true, false);
            }
            (dq, (dk, dv))
        })
        .collect();
    let (dqs, dkvs): (Vec<Vec<f32>>, Vec<_>) = parts.into_iter().unzip();
    let (dks, dvs): (Vec<Vec<f32>>, Vec<Vec<f32>>) = dkvs.into_iter().unzip();
    let mut dq = vec![0.0f32; s.batch * t * qd];
    let mut dk = vec![0.0f32; s.batch * t * kvd];
    let mut dv = vec![0.0f32; s.batch * t * kvd];
    scatter_heads(&mut dq, &dqs, s, group, qd);
    scatter_heads(&mut dk, &dks, s, 1, kvd);
    scatter_heads(&mut dv, &dvs, s, 1, kvd);
    (dq, dk, dv)
}
