//! One decoder block with its adapters, forward and back, for the gradient
//! pass. The forward keeps a tape of what its backward reads; the gradient
//! pass runs it twice per block (once to carry the residual stream on,
//! dropping the tape, once again just before that block's backward), so
//! only one block's tape is alive at a time. Dropout masks are drawn from
//! a stream whose state is saved at each block's start, so the second run
//! draws the same masks. Memory of a tape over n tokens: the normed inputs
//! and the residual midpoint (3 · n · hidden), q, k, v, the attention's
//! output and probabilities (batch · heads · T²), the MLP's
//! pre-activations and hidden (3 · n · intermediate on the Llama family,
//! 2 on GPT-2), and each adapter's x·Aᵀ (n · r) and dropout mask.
//!
//! The backward can also form the block's own weight gradients (a full
//! fine-tune, `full.rs`): given a [`BlockGrads`] sink it adds each
//! projection's dW (in the weight's layout) and db and each norm's weight
//! (and bias) gradient, one more [in, out] product per projection; without
//! one (LoRA) no weight gradient is formed.

use std::collections::{BTreeMap, HashMap};

use crate::config::Family;
use crate::lora::attention::{self, Shape};
use crate::lora::{Adapter, AdapterGrads, Adapters, Dropout};
use crate::math::{
    gelu_new, gelu_new_grad, gemm_into, layer_norm_backward, matmul, rms_norm_backward, silu,
    Layout, View,
};
use crate::model::{Block, Linear, Mlp, Model, Norm};
use crate::weight::matmul_weight;

/// A block's weights by role. GPT-2: q, k and v are the thirds of the fused
/// `c_attn`, `O` its `attn.c_proj`, `Gate` `mlp.c_fc`, `Down` `mlp.c_proj`
/// (no `Up`); `Norm1`/`Norm2` are `ln_1`/`ln_2` there, the input and
/// post-attention RMSNorms on the Llama family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Part {
    Norm1,
    Q,
    K,
    V,
    O,
    Norm2,
    Gate,
    Up,
    Down,
}

/// One weight's gradient, in the weight's shape and layout, and its bias's.
pub(crate) struct PartGrad {
    pub weight: Vec<f32>,
    pub bias: Option<Vec<f32>>,
}

/// A block's weight gradients by role.
pub(crate) type BlockGrads = BTreeMap<Part, PartGrad>;

/// Where a backward puts its gradients: the adapters', and the block's
/// weights' when `weights` is given.
pub(super) struct Sink<'s> {
    pub adapters: &'s mut AdapterGrads,
    pub weights: Option<&'s mut BlockGrads>,
}

/// What one adapter's backward reads.
struct AdapterTape {
    xa: Vec<f32>,
    mask: Option<Vec<f32>>,
}

/// What a block's backward reads (its input is the pass's checkpoint).
pub(super) struct Tape {
    n1: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// Each attention row's log-sum-exp.
    lse: Vec<f32>,
    attn: Vec<f32>,
    x_mid: Vec<f32>,
    n2: Vec<f32>,
    /// The gate's (Llama) or c_fc's (GPT-2) output.
    pre: Vec<f32>,
    /// The up projection's output (Llama only).
    up: Vec<f32>,
    hidden: Vec<f32>,
    adapters: HashMap<&'static str, AdapterTape>,
}

impl Tape {
    /// The bytes the tape holds.
    pub(super) fn bytes(&self) -> usize {
        let vectors = [
            &self.n1,
            &self.q,
            &self.k,
            &self.v,
            &self.lse,
            &self.attn,
            &self.x_mid,
            &self.n2,
            &self.pre,
            &self.up,
            &self.hidden,
        ];
        let adapters: usize = self
            .adapters
            .values()
            .map(|a| a.xa.len() + a.mask.as_ref().map_or(0, Vec::len))
            .sum();
        (vectors.iter().map(|v| v.len()).sum::<usize>() + adapters) * std::mem::size_of::<f32>()
    }
}

/// A block's context: the model, the adapters, the attention's shape and
/// n = batch · T rows.
pub(super) struct Ctx<'a> {
    pub model: &'a Model,
    pub adapters: &'a Adapters,
    pub shape: Shape,
    pub n: usize,
}

/// The module suffixes of a block, by role, for each family.
struct Names {
    q: &'static str,
    k: &'static str,
    v: &'static str,
    o: &'static str,
    gate: &'static str,
    up: &'static str,
    down: &'static str,
}

const LLAMA: Names = Names {
    q: "self_attn.q_proj",
    k: "self_attn.k_proj",
    v: "self_attn.v_proj",
    o: "self_attn.o_proj",
    gate: "mlp.gate_proj",
    up: "mlp.up_proj",
    down: "mlp.down_proj",
};

/// GPT-2: q, k and v share the fused `c_attn`; `gate` is c_fc, `down` the
/// MLP's c_proj (no up).
const GPT2: Names = Names {
    q: "attn.c_attn",
    k: "attn.c_attn",
    v: "attn.c_attn",
    o: "attn.c_proj",
    gate: "mlp.c_fc",
    up: "",
    down: "mlp.c_proj",
};

fn mul(x: &[f32], mask: &[f32]) -> Vec<f32> {
    x.iter().zip(mask).map(|(a, b)| a * b).collect()
}

fn add(into: &mut [f32], from: &[f32]) {
    into.iter_mut().zip(from).for_each(|(a, b)| *a += b);
}

/// extra = scale · (drop(x)·Aᵀ)·Bᵀ, [n, out].
fn adapter_forward(
    ad: &Adapter,
    x: &[f32],
    n: usize,
    inp: usize,
    out: usize,
    dropout: Option<&mut Dropout>,
) -> (Vec<f32>, AdapterTape) {
    let mask = match dropout {
        Some(d) if d.p > 0.0 => Some(d.mask(x.len())),
        _ => None,
    };
    let xa = match &mask {
        Some(m) => matmul(&mul(x, m), &ad.a, n, inp, ad.r, false, true),
        None => matmul(x, &ad.a, n, inp, ad.r, false, true),
    };
    let mut extra = matmul(&xa, &ad.b, n, ad.r, out, false, true);
    extra.iter_mut().for_each(|e| *e *= ad.scale);
    (extra, AdapterTape { xa, mask })
}

/// (dA, dB) and the adapter's share of dx, from dy = d(extra).
fn adapter_backward(
    ad: &Adapter,
    tape: &AdapterTape,
    x: &[f32],
    dy: &[f32],
    n: usize,
    inp: usize,
    out: usize,
) -> ((Vec<f32>, Vec<f32>), Vec<f32>) {
    let mut db = matmul(dy, &tape.xa, out, n, ad.r, true, false);
    db.iter_mut().for_each(|v| *v *= ad.scale);
    let mut dxa = matmul(dy, &ad.b, n, out, ad.r, false, false);
    dxa.iter_mut().for_each(|v| *v *= ad.scale);
    let da = match &tape.mask {
        Some(m) => matmul(&dxa, &mul(x, m), ad.r, n, inp, true, false),
        None => matmul(&dxa, x, ad.r, n, inp, true, false),
    };
    let mut dx = matmul(&dxa, &ad.a, n, ad.r, inp, false, false);
    if let Some(m) = &tape.mask {
        dx.iter_mut().zip(m).for_each(|(d, m)| *d *= m);
    }
    ((da, db), dx)
}

/// dx of a frozen projection: dy · W (W stored [out, in]) or dy · Wᵀ
/// (stored [in, out]).
fn linear_backward(lin: &Linear, dy: &[f32], n: usize) -> Vec<f32> {
    let w = match lin.layout {
        Layout::OutIn => lin.weight.operand(),
        Layout::InOut => lin.weight.operand().t(),
    };
    matmul_weight(dy, n, lin.out, false, w)
}

/// dW (as `lin` lays W out: dyᵀ·x for [out, in], xᵀ·dy for [in, out]) and
/// db (dy's column sums) of a projection from its input x and d(output).
fn linear_weight_grad(lin: &Linear, x: &[f32], dy: &[f32], n: usize) -> PartGrad {
    let mut weight = vec![0.0f32; lin.inp * lin.out];
    let xv = View::new(x, n, lin.inp);
    let dyv = View::new(dy, n, lin.out);
    match lin.layout {
        Layout::OutIn => gemm_into(&mut weight, dyv.t(), xv, false, true),
        Layout::InOut => gemm_into(&mut weight, xv.t(), dyv, false, true),
    }
    PartGrad {
        weight,
        bias: lin.bias.as_ref().map(|_| column_sums(dy, lin.out)),
    }
}

/// Σ over rows of a [rows, width] matrix.
fn column_sums(x: &[f32], width: usize) -> Vec<f32> {
    let mut sums = vec![0.0f32; width];
    for row in x.chunks_exact(width) {
        add(&mut sums, row);
    }
    sums
}

/// A norm's weight gradient (and LayerNorm's bias's) from its input x and
/// d(output): Σ_rows dy · x̂, x̂ = x / rms(x) (RMSNorm) or (x − mean) / σ
/// (LayerNorm, whose db is Σ_rows dy).
pub(super) fn norm_weight_grad(norm: &Norm, x: &[f32], dy: &[f32]) -> PartGrad {
    let (d, eps, layer) = match norm {
        Norm::Rms { weight, eps } => (weight.len(), *eps, false),
        Norm::Layer { weight, eps, .. } => (weight.len(), *eps, true),
    };
    let mut dw = vec![0.0f32; d];
    for (xr, dyr) in x.chunks_exact(d).zip(dy.chunks_exact(d)) {
        let (mean, inv) = if layer {
            let mean = xr.iter().sum::<f32>() / d as f32;
            let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
            (mean, 1.0 / (var + eps).sqrt())
        } else {
            let ms = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
            (0.0, 1.0 / (ms + eps).sqrt())
        };
        for ((g, &x), &dy) in dw.iter_mut().zip(xr).zip(dyr) {
            *g += dy * ((x - mean) * inv);
        }
    }
    PartGrad {
        weight: dw,
        bias: layer.then(|| column_sums(dy, d)),
    }
}

fn norm_forward(norm: &Norm, x: &[f32]) -> Vec<f32> {
    norm.forward(x)
}

pub(super) fn norm_backward(norm: &Norm, x: &[f32], dy: &[f32]) -> Vec<f32> {
    match norm {
        Norm::Rms { weight, eps } => rms_norm_backward(x, weight, *eps, dy),
        Norm::Layer { weight, eps, .. } => layer_norm_backward(x, weight, *eps, dy),
    }
}

/// Column block `[from, from + width)` of each row of a [n, total] matrix.
fn columns(x: &[f32], total: usize, from: usize, width: usize) -> Vec<f32> {
    x.chunks_exact(total)
        .flat_map(|row| row[from..from + width].iter().copied())
        .collect()
}

impl Ctx<'_> {
    fn names(&self) -> &'static Names {
        match self.model.config.family {
            Family::Llama => &LLAMA,
            Family::Gpt2 => &GPT2,
        }
    }

    fn key(&self, layer: usize, suffix: &str) -> String {
        match self.model.config.family {
            Family::Llama => format!("layers.{layer}.{suffix}"),
            Family::Gpt2 => format!("h.{layer}.{suffix}"),
        }
    }

    /// y = lin(x) with the adapter of `suffix`, if any, added.
    fn project(
        &self,
        layer: usize,
        lin: &Linear,
        suffix: &'static str,
        x: &[f32],
        tapes: &mut HashMap<&'static str, AdapterTape>,
        dropout: &mut Option<Dropout>,
    ) -> Vec<f32> {
        let mut y = lin.forward(x, self.n);
        if let Some(ad) = self.adapters.get(&self.key(layer, suffix)) {
            let (extra, tape) = adapter_forward(ad, x, self.n, lin.inp, lin.out, dropout.as_mut());
            add(&mut y, &extra);
            tapes.insert(suffix, tape);
        }
        y
    }

    /// dx of `lin` (the block's `part`) with its adapter, the adapter's
    /// gradients and the weight's into `sink`.
    #[allow(clippy::too_many_arguments)]
    fn project_back(
        &self,
        layer: usize,
        lin: &Linear,
        part: Part,
        suffix: &'static str,
        dy: &[f32],
        x: &[f32],
        tape: &Tape,
        sink: &mut Sink,
    ) -> Vec<f32> {
        let mut dx = linear_backward(lin, dy, self.n);
        if let Some(weights) = sink.weights.as_deref_mut() {
            weights.insert(part, linear_weight_grad(lin, x, dy, self.n));
        }
        let key = self.key(layer, suffix);
        if let (Some(ad), Some(t)) = (self.adapters.get(&key), tape.adapters.get(suffix)) {
            let (g, extra) = adapter_backward(ad, t, x, dy, self.n, lin.inp, lin.out);
            add(&mut dx, &extra);
            sink.adapters.insert(key, g);
        }
        dx
    }

    /// q, k and v of block `layer` from its normed input (before RoPE).
    fn qkv(
        &self,
        layer: usize,
        block: &Block,
        n1: &[f32],
        tapes: &mut HashMap<&'static str, AdapterTape>,
        dropout: &mut Option<Dropout>,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let names = self.names();
        match self.model.config.family {
            Family::Llama => {
                let q = self.project(layer, &block.q, names.q, n1, tapes, dropout);
                let k = self.project(layer, &block.k, names.k, n1, tapes, dropout);
                let v = self.project(layer, &block.v, names.v, n1, tapes, dropout);
                (q, k, v)
            }
            Family::Gpt2 => {
                let mut q = block.q.forward(n1, self.n);
                let mut k = block.k.forward(n1, self.n);
                let mut v = block.v.forward(n1, self.n);
                if let Some(ad) = self.adapters.get(&self.key(layer, names.q)) {
                    let (qo, ko, vo) = (block.q.out, block.k.out, block.v.out);
                    let total = qo + ko + vo;
                    let (extra, tape) =
                        adapter_forward(ad, n1, self.n, block.q.inp, total, dropout.as_mut());
                    add(&mut q, &columns(&extra, total, 0, qo));
                    add(&mut k, &columns(&extra, total, qo, ko));
                    add(&mut v, &columns(&extra, total, qo + ko, vo));
                    tapes.insert(names.q, tape);
                }
                (q, k, v)
            }
        }
    }

    /// Block `layer` on its input x: its output and its tape.
    pub(super) fn forward(
        &self,
        layer: usize,
        x: &[f32],
        dropout: &mut Option<Dropout>,
    ) -> (Vec<f32>, Tape) {
        let block = &self.model.blocks[layer];
        let names = self.names();
        let s = self.shape;
        let mut tapes = HashMap::new();
        let n1 = norm_forward(&block.norm1, x);
        let (mut q, mut k, v) = self.qkv(layer, block, &n1, &mut tapes, dropout);
        if !self.model.inv_freq.is_empty() {
            self.model.rope(&mut q, s.heads, s.t, 0);
            self.model.rope(&mut k, s.kv_heads, s.t, 0);
        }
        let (attn, lse) = attention::forward(s, &q, &k, &v);
        let out = self.project(layer, &block.o, names.o, &attn, &mut tapes, dropout);
        let mut x_mid = x.to_vec();
        add(&mut x_mid, &out);
        let n2 = norm_forward(&block.norm2, &x_mid);
        let (pre, up, hidden, out) = match &block.mlp {
            Mlp::SwiGlu { gate, up, down } => {
                let g = self.project(layer, gate, names.gate, &n2, &mut tapes, dropout);
                let u = self.project(layer, up, names.up, &n2, &mut tapes, dropout);
                let hidden: Vec<f32> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
                let out = self.project(layer, down, names.down, &hidden, &mut tapes, dropout);
                (g, u, hidden, out)
            }
            Mlp::Gelu { fc, proj } => {
                let a = self.project(layer, fc, names.gate, &n2, &mut tapes, dropout);
                let hidden: Vec<f32> = a.iter().map(|&a| gelu_new(a)).collect();
                let out = self.project(layer, proj, names.down, &hidden, &mut tapes, dropout);
                (a, Vec::new(), hidden, out)
            }
        };
        let mut x_out = x_mid.clone();
        add(&mut x_out, &out);
        let tape = Tape {
            n1,
            q,
            k,
            v,
            lse,
            attn,
            x_mid,
            n2,
            pre,
            up,
            hidden,
            adapters: tapes,
        };
        (x_out, tape)
    }

    /// d(input) of block `layer` from d(output), its input and tape; the
    /// adapters' gradients into `grads`.
    pub(super) fn backward(
        &self,
        layer: usize,
        x_in: &[f32],
        tape: &Tape,
        dx_out: &[f32],
        grads: &mut AdapterGrads,
    ) -> Vec<f32> {
        let mut sink = Sink {
            adapters: grads,
            weights: None,
        };
        self.backward_into(layer, x_in, tape, dx_out, &mut sink)
    }

    /// [`Ctx::backward`] with the gradients into `sink`: the adapters', and
    /// every weight's of the block when `sink.weights` is given.
    pub(super) fn backward_into(
        &self,
        layer: usize,
        x_in: &[f32],
        tape: &Tape,
        dx_out: &[f32],
        sink: &mut Sink,
    ) -> Vec<f32> {
        let block = &self.model.blocks[layer];
        let names = self.names();
        let s = self.shape;
        let n = self.n;
        let dn2 = match &block.mlp {
            Mlp::SwiGlu { gate, up, down } => {
                let dh = self.project_back(
                    layer,
                    down,
                    Part::Down,
                    names.down,
                    dx_out,
                    &tape.hidden,
                    tape,
                    sink,
                );
                let mut dg = vec![0.0f32; dh.len()];
                let mut du = vec![0.0f32; dh.len()];
                for (((dg, du), &dh), (&g, &u)) in dg
                    .iter_mut()
                    .zip(du.iter_mut())
                    .zip(&dh)
                    .zip(tape.pre.iter().zip(&tape.up))
                {
                    let sig = 1.0 / (1.0 + (-g).exp());
                    *du = dh * silu(g);
                    *dg = dh * u * sig * (1.0 + g * (1.0 - sig));
                }
                let mut dn2 = self.project_back(
                    layer,
                    gate,
                    Part::Gate,
                    names.gate,
                    &dg,
                    &tape.n2,
                    tape,
                    sink,
                );
                add(
                    &mut dn2,
                    &self.project_back(layer, up, Part::Up, names.up, &du, &tape.n2, tape, sink),
                );
                dn2
            }
            Mlp::Gelu { fc, proj } => {
                let mut da = self.project_back(
                    layer,
                    proj,
                    Part::Down,
                    names.down,
                    dx_out,
                    &tape.hidden,
                    tape,
                    sink,
                );
                da.iter_mut()
                    .zip(&tape.pre)
                    .for_each(|(d, &a)| *d *= gelu_new_grad(a));
                self.project_back(layer, fc, Part::Gate, names.gate, &da, &tape.n2, tape, sink)
            }
        };
        if let Some(weights) = sink.weights.as_deref_mut() {
            weights.insert(
                Part::Norm2,
                norm_weight_grad(&block.norm2, &tape.x_mid, &dn2),
            );
        }
        let mut dmid = dx_out.to_vec();
        add(&mut dmid, &norm_backward(&block.norm2, &tape.x_mid, &dn2));
        let dattn = self.project_back(
            layer,
            &block.o,
            Part::O,
            names.o,
            &dmid,
            &tape.attn,
            tape,
            sink,
        );
        let (mut dq, mut dk, dv) =
            attention::backward(s, &dattn, &tape.q, &tape.k, &tape.v, &tape.attn, &tape.lse);
        let dn1 = match self.model.config.family {
            Family::Llama => {
                rope_backward(self.model, &mut dq, s.heads, s.t);
                rope_backward(self.model, &mut dk, s.kv_heads, s.t);
                let mut dn1 =
                    self.project_back(layer, &block.q, Part::Q, names.q, &dq, &tape.n1, tape, sink);
                add(
                    &mut dn1,
                    &self.project_back(
                        layer,
                        &block.k,
                        Part::K,
                        names.k,
                        &dk,
                        &tape.n1,
                        tape,
                        sink,
                    ),
                );
                add(
                    &mut dn1,
                    &self.project_back(
                        layer,
                        &block.v,
                        Part::V,
                        names.v,
                        &dv,
                        &tape.n1,
                        tape,
                        sink,
                    ),
                );
                dn1
            }
            Family::Gpt2 => {
                let mut dn1 = linear_backward(&block.q, &dq, n);
                add(&mut dn1, &linear_backward(&block.k, &dk, n));
                add(&mut dn1, &linear_backward(&block.v, &dv, n));
                if let Some(weights) = sink.weights.as_deref_mut() {
                    weights.insert(Part::Q, linear_weight_grad(&block.q, &tape.n1, &dq, n));
                    weights.insert(Part::K, linear_weight_grad(&block.k, &tape.n1, &dk, n));
                    weights.insert(Part::V, linear_weight_grad(&block.v, &tape.n1, &dv, n));
                }
                let key = self.key(layer, names.q);
                if let (Some(ad), Some(t)) = (self.adapters.get(&key), tape.adapters.get(names.q)) {
                    let total = block.q.out + block.k.out + block.v.out;
                    let mut dy = Vec::with_capacity(n * total);
                    for ((q, k), v) in dq
                        .chunks_exact(block.q.out)
                        .zip(dk.chunks_exact(block.k.out))
                        .zip(dv.chunks_exact(block.v.out))
                    {
                        dy.extend_from_slice(q);
                        dy.extend_from_slice(k);
                        dy.extend_from_slice(v);
                    }
                    let (g, extra) = adapter_backward(ad, t, &tape.n1, &dy, n, block.q.inp, total);
                    add(&mut dn1, &extra);
                    sink.adapters.insert(key, g);
                }
                dn1
            }
        };
        if let Some(weights) = sink.weights.as_deref_mut() {
            weights.insert(Part::Norm1, norm_weight_grad(&block.norm1, x_in, &dn1));
        }
        let mut dx = dmid;
        add(&mut dx, &norm_backward(&block.norm1, x_in, &dn1));
        dx
    }
}

/// The transpose of RoPE (rotation by the negative angle), positions from 0.
fn rope_backward(model: &Model, x: &mut [f32], heads: usize, t: usize) {
    let hd = model.config.head_dim;
    let half = hd / 2;
    for (row_index, row) in x.chunks_exact_mut(heads * hd).enumerate() {
        let pos = (row_index % t) as f32;
        for head in row.chunks_exact_mut(hd) {
            for (i, &f) in model.inv_freq.iter().enumerate() {
                let (sin, cos) = (pos * f).sin_cos();
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * cos + b * sin;
                head[i + half] = b * cos - a * sin;
            }
        }
    }
}
