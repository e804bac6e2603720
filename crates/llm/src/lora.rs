//! LoRA adapters on a loaded Llama-family model and the gradients of the
//! causal-LM loss with respect to the adapters only (the base is frozen: no
//! weight gradient is formed). The forward here is the full sequence, no
//! cache, keeping what the backward reads (per layer: the block's input,
//! normed inputs, q/k/v after RoPE, the attention probabilities, the MLP's
//! pre-activations, each adapter's x·Aᵀ, and with dropout its mask and
//! dropped input); memory grows with layers ·
//! heads · T² for the probabilities. The products are plain loops:
//! correctness first, checked against peft (tests/lora.rs).

use std::collections::HashMap;

use crate::config::Family;
use crate::error::{LlmError, Result};
use crate::math::{silu, softmax};
use crate::model::{Linear, Mlp, Model, Norm};

/// One adapter: y += scale · (x·Aᵀ)·Bᵀ, A [r, in], B [out, r].
#[derive(Clone, Debug)]
pub struct Adapter {
    pub a: Vec<f32>,
    pub b: Vec<f32>,
    pub r: usize,
    pub scale: f32,
}

/// Adapters by module key, `layers.N.self_attn.q_proj` … `layers.N.mlp.down_proj`.
pub type Adapters = HashMap<String, Adapter>;

/// Gradients (dA, dB) by module key.
pub type AdapterGrads = HashMap<String, (Vec<f32>, Vec<f32>)>;

/// The module names (Hugging Face's) an adapter can target on the Llama
/// family.
pub const TARGETS: &[&str] = &[
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// GPT-2's: the fused q/k/v `c_attn`, `c_proj` (both the attention's and
/// the MLP's, as peft matches the name) and `c_fc`.
pub const GPT2_TARGETS: &[&str] = &["c_attn", "c_proj", "c_fc"];

/// The target module names of `family`.
pub fn targets(family: Family) -> &'static [&'static str] {
    match family {
        Family::Llama => TARGETS,
        Family::Gpt2 => GPT2_TARGETS,
    }
}

/// The adapter keys of layer `layer`'s modules called `target` on
/// `family` (module paths under the model, without peft's prefix):
/// `layers.N.self_attn.q_proj` … `layers.N.mlp.down_proj` on the Llama
/// family; `h.N.attn.c_attn`, `h.N.attn.c_proj`, `h.N.mlp.c_fc` and
/// `h.N.mlp.c_proj` on GPT-2 (`c_proj` names two modules). Empty for a name
/// that is not a target.
pub fn module_keys(family: Family, layer: usize, target: &str) -> Vec<String> {
    match (family, target) {
        (Family::Llama, "q_proj" | "k_proj" | "v_proj" | "o_proj") => {
            vec![format!("layers.{layer}.self_attn.{target}")]
        }
        (Family::Llama, "gate_proj" | "up_proj" | "down_proj") => {
            vec![format!("layers.{layer}.mlp.{target}")]
        }
        (Family::Gpt2, "c_attn") => vec![format!("h.{layer}.attn.c_attn")],
        (Family::Gpt2, "c_proj") => vec![
            format!("h.{layer}.attn.c_proj"),
            format!("h.{layer}.mlp.c_proj"),
        ],
        (Family::Gpt2, "c_fc") => vec![format!("h.{layer}.mlp.c_fc")],
        _ => Vec::new(),
    }
}

/// Adapters on every layer's `target_modules` (Hugging Face names, see
/// [`TARGETS`]): A drawn uniformly in ±1/√in (peft's Kaiming-uniform bound
/// with a = √5) from `seed`, B zero (so the model starts unchanged), scale
/// alpha / r.
pub fn new_adapters(
    model: &Model,
    r: usize,
    alpha: f32,
    target_modules: &[&str],
    seed: u64,
) -> Result<Adapters> {
    let c = &model.config;
    if c.family != Family::Llama {
        return Err(LlmError::Unsupported {
            path: model.dir.join("config.json"),
            what: format!("LoRA on {}", c.architecture),
        });
    }
    if r == 0 {
        return Err(LlmError::Input("LoRA rank r must be at least 1".into()));
    }
    let mut state = seed;
    let mut uniform = || {
        // splitmix64, as generate.rs draws.
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut adapters = Adapters::new();
    for target in target_modules {
        if !TARGETS.contains(target) {
            return Err(LlmError::Input(format!(
                "LoRA target_modules: `{target}` is not a module of {}; the modules are {}",
                c.architecture,
                TARGETS.join(", ")
            )));
        }
        for (layer, block) in model.blocks.iter().enumerate() {
            let (prefix, lin) = match *target {
                "q_proj" => ("self_attn", &block.q),
                "k_proj" => ("self_attn", &block.k),
                "v_proj" => ("self_attn", &block.v),
                "o_proj" => ("self_attn", &block.o),
                other => match (&block.mlp, other) {
                    (Mlp::SwiGlu { gate, .. }, "gate_proj") => ("mlp", gate),
                    (Mlp::SwiGlu { up, .. }, "up_proj") => ("mlp", up),
                    (Mlp::SwiGlu { down, .. }, _) => ("mlp", down),
                    (Mlp::Gelu { .. }, _) => unreachable!("the Llama family has SwiGLU only"),
                },
            };
            let bound = 1.0 / (lin.inp as f64).sqrt();
            let a = (0..r * lin.inp)
                .map(|_| ((uniform() * 2.0 - 1.0) * bound) as f32)
                .collect();
            adapters.insert(
                format!("layers.{layer}.{prefix}.{target}"),
                Adapter {
                    a,
                    b: vec![0.0; lin.out * r],
                    r,
                    scale: alpha / r as f32,
                },
            );
        }
    }
    Ok(adapters)
}

/// c[m, n] = op(a) · op(b), op(a) [m, k] (a stored [k, m] when `ta`),
/// op(b) [k, n] (b stored [n, k] when `tb`).
fn mm(a: &[f32], b: &[f32], m: usize, k: usize, n: usize, ta: bool, tb: bool) -> Vec<f32> {
    let mut c = vec![0.0f32; m * n];
    for i in 0..m {
        for p in 0..k {
            let av = if ta { a[p * m + i] } else { a[i * k + p] };
            if av == 0.0 {
                continue;
            }
            let row = &mut c[i * n..(i + 1) * n];
            for (j, cv) in row.iter_mut().enumerate() {
                let bv = if tb { b[j * k + p] } else { b[p * n + j] };
                *cv += av * bv;
            }
        }
    }
    c
}

fn add(into: &mut [f32], from: &[f32]) {
    for (a, b) in into.iter_mut().zip(from) {
        *a += b;
    }
}

/// Dropout on the adapters' input (peft's `lora_dropout`): each element
/// kept with probability 1 − p and scaled by 1 / (1 − p), drawn from a
/// splitmix64 stream, so a seed fixes every mask of a pass.
pub struct Dropout {
    pub p: f32,
    pub state: u64,
}

impl Dropout {
    /// The kept elements' factor (0 or 1 / (1 − p)) for `n` inputs.
    fn mask(&mut self, n: usize) -> Vec<f32> {
        let keep = 1.0 / (1.0 - self.p);
        (0..n)
            .map(|_| {
                self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = self.state;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^= z >> 31;
                let u = (z >> 40) as f32 / (1u64 << 24) as f32;
                if u < self.p {
                    0.0
                } else {
                    keep
                }
            })
            .collect()
    }
}

/// What an adapter's backward reads: x·Aᵀ, and with dropout the mask and
/// the dropped input (the adapter saw x · mask, not x).
#[derive(Default)]
struct AdapterSaved {
    xa: Vec<f32>,
    mask: Option<Vec<f32>>,
    dropped: Vec<f32>,
}

/// A projection with its adapter, if any: y and what the backward needs.
fn project(
    lin: &Linear,
    x: &[f32],
    n: usize,
    adapter: Option<&Adapter>,
    dropout: Option<&mut Dropout>,
) -> (Vec<f32>, AdapterSaved) {
    let mut y = lin.forward(x, n);
    let Some(ad) = adapter else {
        return (y, AdapterSaved::default());
    };
    let (mask, dropped) = match dropout {
        Some(d) if d.p > 0.0 => {
            let mask = d.mask(x.len());
            let dropped = x.iter().zip(&mask).map(|(x, m)| x * m).collect();
            (Some(mask), dropped)
        }
        _ => (None, Vec::new()),
    };
    let input = if mask.is_some() { &dropped[..] } else { x };
    let xa = mm(input, &ad.a, n, lin.inp, ad.r, false, true);
    let extra = mm(&xa, &ad.b, n, ad.r, lin.out, false, true);
    for (v, e) in y.iter_mut().zip(&extra) {
        *v += ad.scale * e;
    }
    (y, AdapterSaved { xa, mask, dropped })
}

/// dx of a projection (and its adapter's gradients into `grads`).
#[allow(clippy::too_many_arguments)]
fn project_back(
    lin: &Linear,
    key: &str,
    dy: &[f32],
    x: &[f32],
    saved: &AdapterSaved,
    n: usize,
    adapters: &Adapters,
    grads: &mut AdapterGrads,
) -> Vec<f32> {
    // Llama-family weights are [out, in]: dx = dy · W.
    let mut dx = mm(dy, &lin.weight, n, lin.out, lin.inp, false, false);
    if let Some(ad) = adapters.get(key) {
        let xa = &saved.xa;
        let x = if saved.mask.is_some() {
            &saved.dropped[..]
        } else {
            x
        };
        let dyb = mm(dy, &ad.b, n, lin.out, ad.r, false, false);
        let mut db = mm(dy, xa, lin.out, n, ad.r, true, false);
        let mut da = mm(&dyb, x, ad.r, n, lin.inp, true, false);
        db.iter_mut()
            .chain(da.iter_mut())
            .for_each(|v| *v *= ad.scale);
        let mut back = mm(&dyb, &ad.a, n, ad.r, lin.inp, false, false);
        if let Some(mask) = &saved.mask {
            back.iter_mut().zip(mask).for_each(|(b, m)| *b *= m);
        }
        for (d, b) in dx.iter_mut().zip(&back) {
            *d += ad.scale * b;
        }
        grads.insert(key.to_string(), (da, db));
    }
    dx
}

/// RMSNorm's dx from dy, its input x and weight.
fn rms_back(x: &[f32], norm: &Norm, dy: &[f32]) -> Vec<f32> {
    let Norm::Rms { weight, eps } = norm else {
        unreachable!("the Llama family has RMSNorm only")
    };
    let d = weight.len();
    let mut dx = vec![0.0f32; x.len()];
    for ((xr, dyr), dxr) in x
        .chunks_exact(d)
        .zip(dy.chunks_exact(d))
        .zip(dx.chunks_exact_mut(d))
    {
        let mean = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let r = 1.0 / (mean + eps).sqrt();
        let gx: f32 = xr
            .iter()
            .zip(dyr)
            .zip(weight)
            .map(|((x, dy), w)| w * dy * x)
            .sum();
        for (((o, x), dy), w) in dxr.iter_mut().zip(xr).zip(dyr).zip(weight) {
            *o = r * w * dy - x * r * r * r * gx / d as f32;
        }
    }
    dx
}

struct Saved {
    x_in: Vec<f32>,
    n1: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    probs: Vec<f32>,
    attn: Vec<f32>,
    x_mid: Vec<f32>,
    n2: Vec<f32>,
    g: Vec<f32>,
    u: Vec<f32>,
    h: Vec<f32>,
    xa: HashMap<&'static str, AdapterSaved>,
}

impl Model {
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
    /// (a fresh mask per module and pass, drawn from `dropout`'s stream).
    pub fn lora_gradients_with(
        &self,
        adapters: &Adapters,
        batch: &[Vec<u32>],
        labels: &[Vec<i64>],
        mut dropout: Option<&mut Dropout>,
    ) -> Result<(f32, AdapterGrads)> {
        if let Some(d) = &dropout {
            if !(0.0..1.0).contains(&d.p) {
                return Err(LlmError::Input(format!(
                    "LoRA dropout {} must be in [0, 1)",
                    d.p
                )));
            }
        }
        let c = &self.config;
        if c.family != Family::Llama {
            return Err(LlmError::Unsupported {
                path: self.dir.join("config.json"),
                what: format!("LoRA gradients on {}", c.architecture),
            });
        }
        let b = batch.len();
        let t = batch.first().map_or(0, Vec::len);
        if b == 0 || t == 0 || batch.iter().any(|r| r.len() != t) || labels.len() != b {
            return Err(LlmError::Input(
                "batch and labels must be non-empty rows of one length".into(),
            ));
        }
        let (h, v, hd) = (c.hidden_size, c.vocab_size, c.head_dim);
        let (heads, group) = (c.num_heads, c.num_heads / c.num_kv_heads);
        let (qd, kvd) = (heads * hd, c.num_kv_heads * hd);
        let n = b * t;
        let scale = 1.0 / (hd as f32).sqrt();
        let mut x = vec![0.0f32; n * h];
        for (i, &id) in batch.iter().flatten().enumerate() {
            let id = id as usize;
            if id >= v {
                return Err(LlmError::Input(format!(
                    "token id {id} is outside the vocabulary ({v} ids)"
                )));
            }
            x[i * h..(i + 1) * h].copy_from_slice(&self.embed[id * h..(id + 1) * h]);
        }
        let mut saved = Vec::with_capacity(self.blocks.len());
        for (layer, block) in self.blocks.iter().enumerate() {
            let key = |m: &str| format!("layers.{layer}.{m}");
            let mut xa = HashMap::new();
            let n1 = block.norm1.forward(&x);
            let mut run = |lin: &Linear, m: &'static str, input: &[f32]| {
                let (y, a) = project(lin, input, n, adapters.get(&key(m)), dropout.as_deref_mut());
                xa.insert(m, a);
                y
            };
            let mut q = run(&block.q, "self_attn.q_proj", &n1);
            let mut k = run(&block.k, "self_attn.k_proj", &n1);
            let vv = run(&block.v, "self_attn.v_proj", &n1);
            self.rope(&mut q, heads, t, 0);
            self.rope(&mut k, c.num_kv_heads, t, 0);
            let mut probs = vec![0.0f32; b * heads * t * t];
            let mut attn = vec![0.0f32; n * qd];
            for r in 0..b {
                for head in 0..heads {
                    let g = head / group;
                    for i in 0..t {
                        let p = &mut probs[((r * heads + head) * t + i) * t..][..i + 1];
                        let qv = &q[(r * t + i) * qd + head * hd..][..hd];
                        for (j, s) in p.iter_mut().enumerate() {
                            let kv = &k[(r * t + j) * kvd + g * hd..][..hd];
                            *s = qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f32>() * scale;
                        }
                        softmax(p);
                        let o = &mut attn[(r * t + i) * qd + head * hd..][..hd];
                        for (j, s) in p.iter().enumerate() {
                            let val = &vv[(r * t + j) * kvd + g * hd..][..hd];
                            for (ov, x) in o.iter_mut().zip(val) {
                                *ov += s * x;
                            }
                        }
                    }
                }
            }
            let out = run(&block.o, "self_attn.o_proj", &attn);
            let x_in = x.clone();
            add(&mut x, &out);
            let x_mid = x.clone();
            let n2 = block.norm2.forward(&x);
            let Mlp::SwiGlu { gate, up, down } = &block.mlp else {
                unreachable!("the Llama family has SwiGLU only")
            };
            let g = run(gate, "mlp.gate_proj", &n2);
            let u = run(up, "mlp.up_proj", &n2);
            let hidden: Vec<f32> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
            let out = run(down, "mlp.down_proj", &hidden);
            add(&mut x, &out);
            saved.push(Saved {
                x_in,
                n1,
                q,
                k,
                v: vv,
                probs,
                attn,
                x_mid,
                n2,
                g,
                u,
                h: hidden,
                xa,
            });
        }
        let nf = self.final_norm.forward(&x);
        let head_w: &[f32] = match &self.lm_head {
            Some(l) => &l.weight,
            None => &self.embed,
        };
        let logits = mm(&nf, head_w, n, h, v, false, true);
        // Loss and dlogits: (softmax − one-hot) / counted, at counted positions.
        let mut dlogits = vec![0.0f32; n * v];
        let mut total = 0.0f64;
        let mut counted = Vec::new();
        for (r, row) in labels.iter().enumerate() {
            if row.len() != t {
                return Err(LlmError::Input("labels are not [batch, T]".into()));
            }
            for i in 0..t - 1 {
                let label = row[i + 1];
                if label == -100 {
                    continue;
                }
                let label = usize::try_from(label)
                    .ok()
                    .filter(|&l| l < v)
                    .ok_or_else(|| {
                        LlmError::Input(format!(
                            "label {label} is outside the vocabulary ({v} ids)"
                        ))
                    })?;
                counted.push((r * t + i, label));
            }
        }
        if counted.is_empty() {
            return Err(LlmError::Input("no label is counted (all -100)".into()));
        }
        let count = counted.len() as f32;
        for &(pos, label) in &counted {
            let z = &logits[pos * v..(pos + 1) * v];
            let mut p = z.to_vec();
            softmax(&mut p);
            total -= (p[label] as f64).ln();
            p[label] -= 1.0;
            for (d, pv) in dlogits[pos * v..(pos + 1) * v].iter_mut().zip(&p) {
                *d = pv / count;
            }
        }
        let loss = (total / counted.len() as f64) as f32;
        let dnf = mm(&dlogits, head_w, n, v, h, false, false);
        let mut dx = rms_back(&x, &self.final_norm, &dnf);
        let mut grads = AdapterGrads::new();
        for (layer, (block, s)) in self.blocks.iter().zip(&saved).enumerate().rev() {
            let key = |m: &str| format!("layers.{layer}.{m}");
            let Mlp::SwiGlu { gate, up, down } = &block.mlp else {
                unreachable!("the Llama family has SwiGLU only")
            };
            let mut back = |lin: &Linear, m: &'static str, dy: &[f32], input: &[f32]| {
                project_back(lin, &key(m), dy, input, &s.xa[m], n, adapters, &mut grads)
            };
            let dh = back(down, "mlp.down_proj", &dx, &s.h);
            let mut dg = vec![0.0f32; dh.len()];
            let mut du = vec![0.0f32; dh.len()];
            for i in 0..dh.len() {
                let sig = 1.0 / (1.0 + (-s.g[i]).exp());
                du[i] = dh[i] * silu(s.g[i]);
                dg[i] = dh[i] * s.u[i] * sig * (1.0 + s.g[i] * (1.0 - sig));
            }
            let mut dn2 = back(gate, "mlp.gate_proj", &dg, &s.n2);
            add(&mut dn2, &back(up, "mlp.up_proj", &du, &s.n2));
            let mut dmid = dx.clone();
            add(&mut dmid, &rms_back(&s.x_mid, &block.norm2, &dn2));
            let dattn = back(&block.o, "self_attn.o_proj", &dmid, &s.attn);
            let mut dq = vec![0.0f32; n * qd];
            let mut dk = vec![0.0f32; n * kvd];
            let mut dv = vec![0.0f32; n * kvd];
            for r in 0..b {
                for head in 0..heads {
                    let g = head / group;
                    for i in 0..t {
                        let p = &s.probs[((r * heads + head) * t + i) * t..][..i + 1];
                        let dout = &dattn[(r * t + i) * qd + head * hd..][..hd];
                        let dp: Vec<f32> = (0..=i)
                            .map(|j| {
                                let val = &s.v[(r * t + j) * kvd + g * hd..][..hd];
                                dout.iter().zip(val).map(|(a, b)| a * b).sum()
                            })
                            .collect();
                        let dot: f32 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                        let qi = (r * t + i) * qd + head * hd;
                        for j in 0..=i {
                            let ds = p[j] * (dp[j] - dot) * scale;
                            let kj = (r * t + j) * kvd + g * hd;
                            for d in 0..hd {
                                dq[qi + d] += ds * s.k[kj + d];
                                dk[kj + d] += ds * s.q[qi + d];
                                dv[kj + d] += p[j] * dout[d];
                            }
                        }
                    }
                }
            }
            self.rope_back(&mut dq, heads, t);
            self.rope_back(&mut dk, c.num_kv_heads, t);
            let mut dn1 = back(&block.q, "self_attn.q_proj", &dq, &s.n1);
            add(&mut dn1, &back(&block.k, "self_attn.k_proj", &dk, &s.n1));
            add(&mut dn1, &back(&block.v, "self_attn.v_proj", &dv, &s.n1));
            dx = dmid;
            add(&mut dx, &rms_back(&s.x_in, &block.norm1, &dn1));
        }
        Ok((loss, grads))
    }

    /// The transpose of `rope` (rotation by the negative angle).
    fn rope_back(&self, x: &mut [f32], heads: usize, t: usize) {
        let hd = self.config.head_dim;
        let half = hd / 2;
        for (row_index, row) in x.chunks_exact_mut(heads * hd).enumerate() {
            let pos = (row_index % t) as f32;
            for head in row.chunks_exact_mut(hd) {
                for (i, &f) in self.inv_freq.iter().enumerate() {
                    let (sin, cos) = (pos * f).sin_cos();
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * cos + b * sin;
                    head[i + half] = b * cos - a * sin;
                }
            }
        }
    }
}
