//! The forward pass, the causal-LM loss and the KV cache. A batch is rows of
//! equal length (no padding) that start at the same position; the cache
//! keeps every layer's keys and values of the positions seen so far, per
//! row, so a generation step runs only the new token. Memory: the cache
//! grows by 2 · layers · kv_heads · head_dim f32s per row and token; the
//! activations of one step are dropped as the next layer starts.

use rayon::prelude::*;

use crate::error::{LlmError, Result};
use crate::math::{gelu_new, silu, softmax, Layout};
use crate::model::{Mlp, Model};
use crate::weight::project;

/// Keys and values of the positions already run, per layer and row.
pub struct KvCache {
    /// [layer][row] → [position][kv_heads · head_dim].
    keys: Vec<Vec<Vec<f32>>>,
    values: Vec<Vec<Vec<f32>>>,
    len: usize,
}

impl KvCache {
    pub fn new(model: &Model, batch: usize) -> Self {
        let layers = model.config.num_layers;
        Self {
            keys: vec![vec![Vec::new(); batch]; layers],
            values: vec![vec![Vec::new(); batch]; layers],
            len: 0,
        }
    }

    /// How many positions the cache holds.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn batch(&self) -> usize {
        self.keys.first().map_or(0, Vec::len)
    }
}

/// Which positions' logits a forward returns.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Want {
    All,
    Last,
}

impl Model {
    /// Logits [batch, T, vocab] (row-major) of rows of equal length T.
    pub fn logits(&self, batch: &[Vec<u32>]) -> Result<Vec<f32>> {
        let mut cache = KvCache::new(self, batch.len());
        self.forward(batch, &mut cache, Want::All)
    }

    /// Runs `batch` (each row's next tokens) after the positions in
    /// `cache`, appending theirs; the logits of every new position, or of
    /// each row's last, [batch, T or 1, vocab].
    pub fn forward(&self, batch: &[Vec<u32>], cache: &mut KvCache, want: Want) -> Result<Vec<f32>> {
        let c = &self.config;
        let b = batch.len();
        let t = batch.first().map_or(0, Vec::len);
        if b == 0 || t == 0 {
            return Err(LlmError::Input("an empty batch or sequence".into()));
        }
        if batch.iter().any(|row| row.len() != t) {
            return Err(LlmError::Input(
                "the rows of a batch must have the same length (no padding yet)".into(),
            ));
        }
        if cache.batch() != b {
            return Err(LlmError::Input(format!(
                "the cache holds {} rows, the batch {b}",
                cache.batch()
            )));
        }
        let past = cache.len;
        if let Some(max) = c.max_positions {
            if past + t > max {
                return Err(LlmError::Input(format!(
                    "{} positions, but {} has {max} (n_positions)",
                    past + t,
                    self.dir.join("config.json").display()
                )));
            }
        }
        let h = c.hidden_size;
        let n = b * t;
        let mut x = vec![0.0f32; n * h];
        for (r, row) in batch.iter().enumerate() {
            for (i, &id) in row.iter().enumerate() {
                let id = id as usize;
                if id >= c.vocab_size {
                    return Err(LlmError::Input(format!(
                        "token id {id} is outside the vocabulary ({} ids)",
                        c.vocab_size
                    )));
                }
                let dst = &mut x[(r * t + i) * h..(r * t + i + 1) * h];
                self.embed.copy_row(id, dst);
                if let Some(pos) = &self.positions {
                    let p = past + i;
                    for (d, e) in dst.iter_mut().zip(&pos[p * h..(p + 1) * h]) {
                        *d += e;
                    }
                }
            }
        }
        for (layer, block) in self.blocks.iter().enumerate() {
            let normed = block.norm1.forward(&x);
            let mut q = block.q.forward(&normed, n);
            let mut k = block.k.forward(&normed, n);
            let v = block.v.forward(&normed, n);
            if !self.inv_freq.is_empty() {
                self.rope(&mut q, c.num_heads, t, past);
                self.rope(&mut k, c.num_kv_heads, t, past);
            }
            let kvd = c.num_kv_heads * c.head_dim;
            for r in 0..b {
                cache.keys[layer][r].extend_from_slice(&k[r * t * kvd..(r + 1) * t * kvd]);
                cache.values[layer][r].extend_from_slice(&v[r * t * kvd..(r + 1) * t * kvd]);
            }
            let attn = self.attend(&q, &cache.keys[layer], &cache.values[layer], b, t, past);
            let out = block.o.forward(&attn, n);
            for (xv, o) in x.iter_mut().zip(&out) {
                *xv += o;
            }
            let normed = block.norm2.forward(&x);
            let out = match &block.mlp {
                Mlp::SwiGlu { gate, up, down } => {
                    let mut g = gate.forward(&normed, n);
                    let u = up.forward(&normed, n);
                    for (gv, uv) in g.iter_mut().zip(&u) {
                        *gv = silu(*gv) * uv;
                    }
                    down.forward(&g, n)
                }
                Mlp::Gelu { fc, proj } => {
                    let mut a = fc.forward(&normed, n);
                    for v in a.iter_mut() {
                        *v = gelu_new(*v);
                    }
                    proj.forward(&a, n)
                }
            };
            for (xv, o) in x.iter_mut().zip(&out) {
                *xv += o;
            }
        }
        cache.len = past + t;
        let rows: Vec<f32> = match want {
            Want::All => x,
            Want::Last => (0..b)
                .flat_map(|r| x[((r + 1) * t - 1) * h..(r + 1) * t * h].iter().copied())
                .collect(),
        };
        let m = rows.len() / h;
        let normed = self.final_norm.forward(&rows);
        Ok(match &self.lm_head {
            Some(head) => head.forward(&normed, m),
            None => project(&normed, m, &self.embed, Layout::OutIn, None),
        })
    }

    /// Rotates each head of `x` ([b·t, heads·head_dim]) by its position
    /// (rotate-half convention, as transformers' Llama).
    pub(crate) fn rope(&self, x: &mut [f32], heads: usize, t: usize, past: usize) {
        let hd = self.config.head_dim;
        let half = hd / 2;
        for (row_index, row) in x.chunks_exact_mut(heads * hd).enumerate() {
            let pos = (past + row_index % t) as f32;
            for head in row.chunks_exact_mut(hd) {
                for (i, &f) in self.inv_freq.iter().enumerate() {
                    let angle = pos * f;
                    let (sin, cos) = angle.sin_cos();
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * cos - b * sin;
                    head[i + half] = b * cos + a * sin;
                }
            }
        }
    }

    /// Causal attention of the new queries over the cached keys and values;
    /// [b·t, heads·head_dim].
    fn attend(
        &self,
        q: &[f32],
        keys: &[Vec<f32>],
        values: &[Vec<f32>],
        b: usize,
        t: usize,
        past: usize,
    ) -> Vec<f32> {
        let c = &self.config;
        let (heads, hd) = (c.num_heads, c.head_dim);
        let group = heads / c.num_kv_heads;
        let kvd = c.num_kv_heads * hd;
        let scale = 1.0 / (hd as f32).sqrt();
        let qd = heads * hd;
        let mut out = vec![0.0f32; b * t * qd];
        // One task per (row, position): each writes its own output row.
        out.par_chunks_mut(qd).enumerate().for_each(|(index, dst)| {
            let (r, i) = (index / t, index % t);
            let p = past + i;
            let first = match c.sliding_window {
                Some(w) => (p + 1).saturating_sub(w),
                None => 0,
            };
            let mut scores = vec![0.0f32; p + 1 - first];
            for head in 0..heads {
                let g = head / group;
                let qv = &q[(r * t + i) * qd + head * hd..][..hd];
                for (s, j) in scores.iter_mut().zip(first..=p) {
                    let kv = &keys[r][j * kvd + g * hd..][..hd];
                    *s = qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f32>() * scale;
                }
                softmax(&mut scores);
                let o = &mut dst[head * hd..(head + 1) * hd];
                for (s, j) in scores.iter().zip(first..=p) {
                    let vv = &values[r][j * kvd + g * hd..][..hd];
                    for (ov, x) in o.iter_mut().zip(vv) {
                        *ov += s * x;
                    }
                }
            }
        });
        out
    }

    /// transformers' causal-LM loss: logits at position i predict label
    /// i + 1; labels of -100 are not counted; the mean over counted tokens
    /// (summed in f64). `labels` is `[batch][T]` like the batch.
    pub fn loss(&self, batch: &[Vec<u32>], labels: &[Vec<i64>]) -> Result<f32> {
        let logits = self.logits(batch)?;
        causal_lm_loss(&logits, labels, self.config.vocab_size)
    }
}

/// The shifted cross-entropy of `logits` [batch, T, vocab] against `labels`.
pub fn causal_lm_loss(logits: &[f32], labels: &[Vec<i64>], vocab: usize) -> Result<f32> {
    let t = labels.first().map_or(0, Vec::len);
    if labels.iter().any(|row| row.len() != t) || logits.len() != labels.len() * t * vocab {
        return Err(LlmError::Input(format!(
            "labels are not [batch, T] matching logits of {} values",
            logits.len()
        )));
    }
    let counted = counted_positions(labels, t, vocab)?;
    let mut total = 0.0f64;
    for &(pos, label) in &counted {
        let z = &logits[pos * vocab..(pos + 1) * vocab];
        let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let sum: f64 = z.iter().map(|&v| (v as f64 - max).exp()).sum();
        total += max + sum.ln() - z[label] as f64;
    }
    Ok((total / counted.len() as f64) as f32)
}

/// The (position, label) pairs the loss counts: logits at position i
/// predict label i + 1 of the row; -100 is not counted.
pub(crate) fn counted_positions(
    labels: &[Vec<i64>],
    t: usize,
    vocab: usize,
) -> Result<Vec<(usize, usize)>> {
    let mut counted = Vec::new();
    for (r, row) in labels.iter().enumerate() {
        if row.len() != t {
            return Err(LlmError::Input("labels are not [batch, T]".into()));
        }
        for (i, &label) in row.iter().enumerate().skip(1) {
            if label == -100 {
                continue;
            }
            let label = usize::try_from(label)
                .ok()
                .filter(|&l| l < vocab)
                .ok_or_else(|| {
                    LlmError::Input(format!(
                        "label {label} is outside the vocabulary ({vocab} ids)"
                    ))
                })?;
            counted.push((r * t + i - 1, label));
        }
    }
    if counted.is_empty() {
        return Err(LlmError::Input("no label is counted (all -100)".into()));
    }
    Ok(counted)
}

/// The (position, label) pairs a loss counts.
pub(crate) type Counted = Vec<(usize, usize)>;

/// A gradient pass's (rows, T, counted positions): the batch and labels
/// must be non-empty rows of one length, one label row per batch row.
pub(crate) fn batch_shape(
    batch: &[Vec<u32>],
    labels: &[Vec<i64>],
    vocab: usize,
) -> Result<(usize, usize, Counted)> {
    let b = batch.len();
    let t = batch.first().map_or(0, Vec::len);
    if b == 0 || t == 0 || batch.iter().any(|r| r.len() != t) || labels.len() != b {
        return Err(LlmError::Input(
            "batch and labels must be non-empty rows of one length".into(),
        ));
    }
    Ok((b, t, counted_positions(labels, t, vocab)?))
}
