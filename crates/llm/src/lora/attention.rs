//! Causal attention over whole sequences for the gradient pass, tiled as
//! FlashAttention is: queries go in blocks of `BLOCK` rows, each against
//! the keys it may see (those up to its last row, and within the sliding
//! window), so the score tile of a block stays in the core's cache and the
//! masked upper triangle is mostly never computed. The forward keeps only
//! each row's log-sum-exp; the backward recomputes a block's probabilities
//! from it. Scores, weighted values and every gradient are matrix products
//! on head views (strided, never copied).
//!
//! Work is split into independent tasks (forward: row, head, query block;
//! backward: row, head) whose results are added in a fixed order (the
//! heads sharing a kv head under grouped-query attention add their key and
//! value gradients head by head), so the result does not depend on the
//! thread count. Memory: the log-sum-exps (batch · heads · T), a task's
//! score tiles (BLOCK · T), and in the backward each head's key and value
//! gradients until they are summed (2 · batch · heads · T · head_dim).

use rayon::prelude::*;

use crate::math::{gemm_into, View};

/// Query rows per tile.
const BLOCK: usize = 128;

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

    fn blocks(&self) -> usize {
        self.t.div_ceil(BLOCK)
    }
}

/// One query block of one head of one row: its rows [i0, i1) and the keys
/// [j0, i1) they may see.
#[derive(Clone, Copy)]
struct Tile {
    r: usize,
    head: usize,
    i0: usize,
    i1: usize,
    j0: usize,
}

impl Tile {
    fn new(s: &Shape, r: usize, head: usize, block: usize) -> Self {
        let i0 = block * BLOCK;
        let i1 = (i0 + BLOCK).min(s.t);
        Self {
            r,
            head,
            i0,
            i1,
            j0: s.first_seen(i0),
        }
    }

    fn rows(&self) -> usize {
        self.i1 - self.i0
    }

    fn keys(&self) -> usize {
        self.i1 - self.j0
    }
}

/// The tile's scaled, masked scores q·kᵀ into `scores` [rows, keys] (a
/// masked entry is −∞).
fn scores(s: &Shape, tile: Tile, q: &[f32], k: &[f32], out: &mut [f32]) {
    let (t, hd) = (s.t, s.head_dim);
    let g = tile.head / s.group();
    let queries = View::columns(
        q,
        tile.r * t + tile.i0,
        tile.rows(),
        tile.head * hd,
        hd,
        s.qd(),
    );
    let keys = View::columns(k, tile.r * t + tile.j0, tile.keys(), g * hd, hd, s.kvd());
    gemm_into(out, queries, keys.t(), false, false);
    let scale = s.scale();
    for (row, i) in out.chunks_exact_mut(tile.keys()).zip(tile.i0..) {
        let first = s.first_seen(i) - tile.j0;
        let last = i - tile.j0;
        row[..first].fill(f32::NEG_INFINITY);
        row[last + 1..].fill(f32::NEG_INFINITY);
        row[first..=last].iter_mut().for_each(|x| *x *= scale);
    }
}

/// softmax(q·kᵀ · scale, causal) · v: the output [b·t, heads·hd] and each
/// row's log-sum-exp [b][heads][t].
pub(crate) fn forward(s: Shape, q: &[f32], k: &[f32], v: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (t, hd, qd) = (s.t, s.head_dim, s.qd());
    let tiles: Vec<Tile> = (0..s.batch)
        .flat_map(|r| (0..s.heads).flat_map(move |h| (0..s.blocks()).map(move |b| (r, h, b))))
        .map(|(r, h, b)| Tile::new(&s, r, h, b))
        .collect();
    let outs: Vec<(Vec<f32>, Vec<f32>)> = tiles
        .par_iter()
        .map(|&tile| {
            let mut p = vec![0.0f32; tile.rows() * tile.keys()];
            scores(&s, tile, q, k, &mut p);
            let mut lse = Vec::with_capacity(tile.rows());
            for row in p.chunks_exact_mut(tile.keys()) {
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0f32;
                for x in row.iter_mut() {
                    *x = (*x - max).exp();
                    sum += *x;
                }
                let inv = 1.0 / sum;
                row.iter_mut().for_each(|x| *x *= inv);
                lse.push(max + sum.ln());
            }
            let g = tile.head / s.group();
            let values = View::columns(v, tile.r * t + tile.j0, tile.keys(), g * hd, hd, s.kvd());
            let mut o = vec![0.0f32; tile.rows() * hd];
            gemm_into(
                &mut o,
                View::new(&p, tile.rows(), tile.keys()),
                values,
                false,
                false,
            );
            (o, lse)
        })
        .collect();
    let mut attn = vec![0.0f32; s.batch * t * qd];
    let mut lse = vec![0.0f32; s.batch * s.heads * t];
    for (tile, (o, l)) in tiles.iter().zip(outs) {
        for (src, i) in o.chunks_exact(hd).zip(tile.i0..) {
            let at = (tile.r * t + i) * qd + tile.head * hd;
            attn[at..at + hd].copy_from_slice(src);
        }
        let at = (tile.r * s.heads + tile.head) * t + tile.i0;
        lse[at..at + tile.rows()].copy_from_slice(&l);
    }
    (attn, lse)
}

/// The gradients (dq, dk, dv) of the attention from d(output) `dout`, the
/// queries and keys it saw (after RoPE), its values, its output and the
/// rows' log-sum-exps.
pub(crate) fn backward(
    s: Shape,
    dout: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &[f32],
    lse: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (t, hd, qd, kvd) = (s.t, s.head_dim, s.qd(), s.kvd());
    let scale = s.scale();
    // Per (row, head): dq [t, hd] and this head's dk, dv [t, hd].
    let parts: Vec<[Vec<f32>; 3]> = (0..s.batch * s.heads)
        .into_par_iter()
        .map(|task| {
            let (r, head) = (task / s.heads, task % s.heads);
            let g = head / s.group();
            let mut dq = vec![0.0f32; t * hd];
            let mut dk = vec![0.0f32; t * hd];
            let mut dv = vec![0.0f32; t * hd];
            let mut p = Vec::new();
            let mut ds = Vec::new();
            for block in 0..s.blocks() {
                let tile = Tile::new(&s, r, head, block);
                let (rows, keys) = (tile.rows(), tile.keys());
                p.resize(rows * keys, 0.0);
                ds.resize(rows * keys, 0.0);
                scores(&s, tile, q, k, &mut p);
                let row_lse = &lse[(r * s.heads + head) * t + tile.i0..][..rows];
                for (row, &l) in p.chunks_exact_mut(keys).zip(row_lse) {
                    row.iter_mut().for_each(|x| *x = (*x - l).exp());
                }
                let d_out = View::columns(dout, r * t + tile.i0, rows, head * hd, hd, qd);
                let values = View::columns(v, r * t + tile.j0, keys, g * hd, hd, kvd);
                let keys_view = View::columns(k, r * t + tile.j0, keys, g * hd, hd, kvd);
                let queries = View::columns(q, r * t + tile.i0, rows, head * hd, hd, qd);
                let pv = View::new(&p, rows, keys);
                // dv[j0..i1] += pᵀ · dout; dp = dout · vᵀ.
                gemm_into(
                    &mut dv[tile.j0 * hd..tile.i1 * hd],
                    pv.t(),
                    d_out,
                    true,
                    false,
                );
                gemm_into(&mut ds, d_out, values.t(), false, false);
                // ds = p ⊙ (dp − D) · scale, D = Σ dout ⊙ out of the row.
                for (i, (prow, drow)) in
                    (tile.i0..).zip(p.chunks_exact(keys).zip(ds.chunks_exact_mut(keys)))
                {
                    let at = (r * t + i) * qd + head * hd;
                    let d: f32 = dout[at..at + hd]
                        .iter()
                        .zip(&out[at..at + hd])
                        .map(|(a, b)| a * b)
                        .sum();
                    for (x, &pv) in drow.iter_mut().zip(prow) {
                        *x = pv * (*x - d) * scale;
                    }
                }
                let dsv = View::new(&ds, rows, keys);
                gemm_into(
                    &mut dq[tile.i0 * hd..tile.i1 * hd],
                    dsv,
                    keys_view,
                    false,
                    false,
                );
                gemm_into(
                    &mut dk[tile.j0 * hd..tile.i1 * hd],
                    dsv.t(),
                    queries,
                    true,
                    false,
                );
            }
            [dq, dk, dv]
        })
        .collect();
    let mut dq = vec![0.0f32; s.batch * t * qd];
    let mut dk = vec![0.0f32; s.batch * t * kvd];
    let mut dv = vec![0.0f32; s.batch * t * kvd];
    // Heads in order, so a kv head's sum is always taken the same way.
    for (task, [hq, hk, hv]) in parts.iter().enumerate() {
        let (r, head) = (task / s.heads, task % s.heads);
        let g = head / s.group();
        for i in 0..t {
            let at = (r * t + i) * qd + head * hd;
            dq[at..at + hd].copy_from_slice(&hq[i * hd..(i + 1) * hd]);
            let at = (r * t + i) * kvd + g * hd;
            for (d, x) in dk[at..at + hd].iter_mut().zip(&hk[i * hd..(i + 1) * hd]) {
                *d += x;
            }
            for (d, x) in dv[at..at + hd].iter_mut().zip(&hv[i * hd..(i + 1) * hd]) {
                *d += x;
            }
        }
    }
    (dq, dk, dv)
}
