//! The causal-LM loss with adapters applied and its gradients with respect
//! to the adapters alone. The forward runs block by block keeping only each
//! block's input (the per-block checkpoint); the loss is taken over the
//! counted positions a chunk at a time, so no more than `HEAD_CHUNK_VALUES`
//! logits exist at once, however long the sequence or wide the vocabulary;
//! the backward recomputes each block from its checkpoint, with the same
//! dropout masks, just before running back through it, unless the caller
//! gave room to keep that block's activations from the forward.

use rayon::prelude::*;

use crate::error::{LlmError, Result};
use crate::forward::batch_shape;
use crate::lora::attention::Shape;
use crate::lora::block::{norm_backward, Ctx};
use crate::lora::{module_dims, AdapterGrads, Adapters, Dropout};
use crate::math::{gemm_into, View};
use crate::model::Model;
use crate::weight::{gemm_weight_lhs, matmul_weight, Weight};

/// The most logits held at once by the loss (64 MiB of f32): a few hundred
/// positions of a large vocabulary, enough rows that each pass over the
/// head's weights does a worthwhile amount of work.
pub(super) const HEAD_CHUNK_VALUES: usize = 1 << 24;

/// What a LoRA gradient pass holds beyond the model and the adapters, in
/// bytes, by part: sized from the shapes before anything is allocated, so
/// a run that cannot fit is refused before its first step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PassMemory {
    /// Each block's input, kept across the forward (layers · n · hidden).
    pub checkpoints: usize,
    /// One block's activations while it is run back (or every kept one).
    pub block: usize,
    /// The loss's chunk of logits and the gradient of the normed rows.
    pub head: usize,
    /// The adapters' gradients.
    pub gradients: usize,
    /// The matrix product's packing buffers, bounded by the caches
    /// (`PRODUCT_WORKSPACE` per compute thread), and the calling thread's
    /// scratch that a bf16/f16 weight is converted to f32 in, panel by
    /// panel (`Model::scratch_values`; none for an f32 model), each kept by
    /// its thread after its first product.
    pub workspace: usize,
}

/// The most a compute thread's matrix products hold for packing (the gemm
/// crate sizes its buffers by the L2 and L3 caches).
const PRODUCT_WORKSPACE: usize = 4 << 20;

impl PassMemory {
    /// Everything but the product workspace: what a pass allocates anew
    /// each time.
    pub fn per_pass(&self) -> usize {
        self.checkpoints + self.block + self.head + self.gradients
    }

    pub fn total(&self) -> usize {
        self.per_pass() + self.workspace
    }
}

impl Model {
    /// The memory of [`Model::lora_gradients`] on `rows` rows of `t`
    /// tokens with adapters of `adapter_values` values in all, `rank` r
    /// on `adapted` modules per block (an upper bound: every tape vector at
    /// its largest, both temporaries of a product).
    pub fn lora_pass_memory(
        &self,
        rows: usize,
        t: usize,
        adapter_values: usize,
        rank: usize,
        adapted: usize,
    ) -> PassMemory {
        let c = &self.config;
        let f = std::mem::size_of::<f32>();
        let n = rows * t;
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        let (qd, kvd) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        // n1, x_mid, n2, q, k, v, attn; gate, up, hidden; lse; each
        // adapter's x·Aᵀ and dropout mask (at most the widest input).
        let tape = n * (3 * h + 2 * qd + 2 * kvd + 3 * inter)
            + rows * c.num_heads * t
            + adapted * n * (rank + h.max(inter));
        // The backward's transient products: a block's output gradient,
        // the MLP's three input gradients, attention's per-head parts.
        let transient = n * (2 * h + 3 * inter) + 2 * n * c.num_heads * c.head_dim;
        let chunk = (HEAD_CHUNK_VALUES / c.vocab_size).max(1).min(n);
        PassMemory {
            checkpoints: (c.num_layers + 1) * n * h * f,
            block: (tape + transient) * f,
            head: (chunk * c.vocab_size + 2 * n * h) * f,
            gradients: adapter_values * f,
            workspace: rayon::current_num_threads() * PRODUCT_WORKSPACE + self.scratch_values() * f,
        }
    }

    /// The causal-LM loss of `batch` against `labels` (as [`Model::loss`])
    /// with `adapters` applied, and each adapter's (dA, dB).
    pub fn lora_gradients(
        &self,
        adapters: &Adapters,
        batch: &[Vec<u32>],
        labels: &[Vec<i64>],
    ) -> Result<(f32, AdapterGrads)> {
        self.lora_gradients_with(adapters, batch, labels, None)
    }

    /// [`Model::lora_gradients`] with dropout on every adapter's input
    /// (a fresh mask per module and pass, drawn from `dropout`'s stream,
    /// which is left where the pass's last mask left it).
    pub fn lora_gradients_with(
        &self,
        adapters: &Adapters,
        batch: &[Vec<u32>],
        labels: &[Vec<i64>],
        dropout: Option<&mut Dropout>,
    ) -> Result<(f32, AdapterGrads)> {
        self.lora_gradients_kept(adapters, batch, labels, dropout, 0)
    }

    /// [`Model::lora_gradients_with`] keeping blocks' activations from the
    /// forward for the backward while they fit in `keep_bytes` (from the
    /// first block on), recomputing only the others: each block kept saves
    /// one block's forward. 0 recomputes every block (the leanest pass);
    /// the result is the same bits either way.
    pub fn lora_gradients_kept(
        &self,
        adapters: &Adapters,
        batch: &[Vec<u32>],
        labels: &[Vec<i64>],
        dropout: Option<&mut Dropout>,
        keep_bytes: usize,
    ) -> Result<(f32, AdapterGrads)> {
        if let Some(d) = &dropout {
            if !(0.0..1.0).contains(&d.p) {
                return Err(LlmError::Input(format!(
                    "LoRA dropout {} must be in [0, 1)",
                    d.p
                )));
            }
        }
        self.check_adapters(adapters)?;
        let c = &self.config;
        let (b, t, counted) = batch_shape(batch, labels, c.vocab_size)?;
        let h = c.hidden_size;
        let n = b * t;
        let mut x = self.embed_rows(batch, t)?;
        let ctx = Ctx {
            model: self,
            adapters,
            shape: Shape {
                batch: b,
                t,
                heads: c.num_heads,
                kv_heads: c.num_kv_heads,
                head_dim: c.head_dim,
                window: c.sliding_window,
            },
            n,
        };
        let mut stream = dropout.as_deref().cloned();
        let layers = self.blocks.len();
        let mut inputs = Vec::with_capacity(layers);
        let mut streams = Vec::with_capacity(layers);
        let mut kept = Vec::with_capacity(layers);
        let mut kept_bytes = 0usize;
        for layer in 0..layers {
            streams.push(stream.clone());
            let (next, tape) = ctx.forward(layer, &x, &mut stream);
            let fits = kept_bytes + tape.bytes() <= keep_bytes;
            kept_bytes += if fits { tape.bytes() } else { 0 };
            kept.push(fits.then_some(tape));
            inputs.push(std::mem::replace(&mut x, next));
        }
        if let (Some(d), Some(s)) = (dropout, stream) {
            *d = s;
        }
        let nf = self.final_norm.forward(&x);
        let head = match &self.lm_head {
            Some(head) => &head.weight,
            None => &self.embed,
        };
        let chunk = HEAD_CHUNK_VALUES / c.vocab_size;
        let (loss, dnf) = self.head_loss(head, &nf, &counted, chunk, h, None);
        let mut dx = norm_backward(&self.final_norm, &x, &dnf);
        drop((nf, dnf, x));
        let mut grads = AdapterGrads::new();
        for layer in (0..layers).rev() {
            let x_in = inputs.pop().ok_or_else(|| {
                LlmError::Input("internal: a block's checkpoint is missing".into())
            })?;
            let tape = match kept.pop().flatten() {
                Some(tape) => tape,
                None => {
                    let mut replay = streams[layer].clone();
                    ctx.forward(layer, &x_in, &mut replay).1
                }
            };
            dx = ctx.backward(layer, &x_in, &tape, &dx, &mut grads);
        }
        Ok((loss, grads))
    }

    /// Every adapter names one of this model's modules and fits it.
    fn check_adapters(&self, adapters: &Adapters) -> Result<()> {
        for (key, ad) in adapters {
            let (inp, out) = module_dims(&self.config, key).ok_or_else(|| {
                LlmError::Input(format!(
                    "adapter `{key}` names no module of {}",
                    self.config.architecture
                ))
            })?;
            if ad.r == 0 || ad.a.len() != ad.r * inp || ad.b.len() != out * ad.r {
                return Err(LlmError::Input(format!(
                    "adapter `{key}`: A has {} values and B {}, but r {} on a {inp} → {out} \
                     module needs A [{}, {inp}] and B [{out}, {}]",
                    ad.a.len(),
                    ad.b.len(),
                    ad.r,
                    ad.r,
                    ad.r
                )));
            }
        }
        Ok(())
    }

    /// The rows' embeddings (and GPT-2's positions), [b·t, hidden].
    pub(super) fn embed_rows(&self, batch: &[Vec<u32>], t: usize) -> Result<Vec<f32>> {
        let c = &self.config;
        let h = c.hidden_size;
        if let Some(max) = c.max_positions {
            if t > max {
                return Err(LlmError::Input(format!(
                    "{t} positions, but {} has {max} (n_positions)",
                    self.dir.join("config.json").display()
                )));
            }
        }
        let mut x = vec![0.0f32; batch.len() * t * h];
        for (i, (&id, dst)) in batch
            .iter()
            .flatten()
            .zip(x.chunks_exact_mut(h))
            .enumerate()
        {
            let id = id as usize;
            if id >= c.vocab_size {
                return Err(LlmError::Input(format!(
                    "token id {id} is outside the vocabulary ({} ids)",
                    c.vocab_size
                )));
            }
            self.embed.copy_row(id, dst);
            if let Some(pos) = &self.positions {
                let p = i % t;
                add(dst, &pos[p * h..(p + 1) * h]);
            }
        }
        Ok(x)
    }

    /// The mean cross-entropy over `counted` (position, label) pairs of the
    /// final normed rows `nf` [n, h] against the head `weight` [V, h], and
    /// d(loss)/d(nf), `chunk` positions at a time; with `weight_grad`,
    /// d(loss)/d(weight) is added into it chunk by chunk too.
    pub(super) fn head_loss(
        &self,
        weight: &Weight,
        nf: &[f32],
        counted: &[(usize, usize)],
        chunk: usize,
        h: usize,
        mut weight_grad: Option<&mut [f32]>,
    ) -> (f32, Vec<f32>) {
        let v = self.config.vocab_size;
        let count = counted.len() as f32;
        let mut dnf = vec![0.0f32; nf.len()];
        let mut total = 0.0f64;
        for part in counted.chunks(chunk.max(1)) {
            let rows = part.len();
            let mut xs = Vec::with_capacity(rows * h);
            for &(pos, _) in part {
                xs.extend_from_slice(&nf[pos * h..(pos + 1) * h]);
            }
            // [rows, V] row-major, computed as (W · xsᵀ)ᵀ: the vocabulary
            // runs down the product's long side, which packs better.
            let mut logits = vec![0.0f32; rows * v];
            gemm_weight_lhs(
                &mut logits,
                1,
                v,
                weight.operand(),
                View::new(&xs, rows, h).t(),
                false,
                true,
            );
            let losses: Vec<f64> = logits
                .par_chunks_mut(v)
                .zip(part.par_iter())
                .map(|(z, &(_, label))| {
                    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let picked = z[label];
                    let mut sum = 0.0f64;
                    for x in z.iter_mut() {
                        *x = (*x - max).exp();
                        sum += *x as f64;
                    }
                    // d(loss)/d(logit) = (softmax − one-hot) / count.
                    let factor = (1.0 / (sum * count as f64)) as f32;
                    z.iter_mut().for_each(|x| *x *= factor);
                    z[label] -= 1.0 / count;
                    max as f64 + sum.ln() - picked as f64
                })
                .collect();
            total += losses.iter().sum::<f64>();
            if let Some(grad) = weight_grad.as_deref_mut() {
                // dW [V, h] += dlogitsᵀ · xs.
                gemm_into(
                    grad,
                    View::new(&logits, rows, v).t(),
                    View::new(&xs, rows, h),
                    true,
                    true,
                );
            }
            let dxs = matmul_weight(&logits, rows, v, false, weight.operand());
            for (&(pos, _), src) in part.iter().zip(dxs.chunks_exact(h)) {
                dnf[pos * h..(pos + 1) * h].copy_from_slice(src);
            }
        }
        ((total / counted.len() as f64) as f32, dnf)
    }
}

fn add(into: &mut [f32], from: &[f32]) {
    into.iter_mut().zip(from).for_each(|(a, b)| *a += b);
}
