//! A loaded model: the weights of every block, laid out as the checkpoint
//! stores them (a Linear's [out, in], a Conv1D's [in, out]; the product
//! reads either through strides). GPT-2's fused `c_attn` is split into q, k
//! and v once, here, so both families share one attention. Memory: the
//! matrices (projections, embedding, head) in the checkpoint's dtype
//! ([`Weight`]: bf16 and f16 read from the file's mapping, no copy; f32 one
//! copy), the norms, biases and GPT-2's positions in f32 (converted at
//! load: a few vectors per block); a tied head reads the embedding.

use std::path::{Path, PathBuf};

use crate::config::{Family, ModelConfig, RopeScaling};
use crate::error::Result;
use crate::math::Layout;
use crate::weight::{project, Weight};
use crate::weights::WeightStore;

/// A projection: weight, its layout, optional bias.
pub struct Linear {
    /// [out, in] (`Layout::OutIn`) or [in, out] (`Layout::InOut`).
    pub weight: Weight,
    pub inp: usize,
    pub out: usize,
    pub layout: Layout,
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    pub fn forward(&self, x: &[f32], n: usize) -> Vec<f32> {
        project(x, n, &self.weight, self.layout, self.bias.as_deref())
    }
}

pub enum Norm {
    Rms {
        weight: Vec<f32>,
        eps: f32,
    },
    Layer {
        weight: Vec<f32>,
        bias: Vec<f32>,
        eps: f32,
    },
}

impl Norm {
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        match self {
            Norm::Rms { weight, eps } => crate::math::rms_norm(x, weight, *eps),
            Norm::Layer { weight, bias, eps } => crate::math::layer_norm(x, weight, bias, *eps),
        }
    }
}

pub enum Mlp {
    /// down(silu(gate(x)) · up(x)).
    SwiGlu {
        gate: Linear,
        up: Linear,
        down: Linear,
    },
    /// proj(gelu_new(fc(x))).
    Gelu { fc: Linear, proj: Linear },
}

pub struct Block {
    pub norm1: Norm,
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub norm2: Norm,
    pub mlp: Mlp,
}

pub struct Model {
    pub config: ModelConfig,
    pub dir: PathBuf,
    /// [vocab, hidden].
    pub embed: Weight,
    /// GPT-2's learned positions, [n_positions, hidden].
    pub positions: Option<Vec<f32>>,
    pub blocks: Vec<Block>,
    pub final_norm: Norm,
    /// None: tied to `embed`.
    pub lm_head: Option<Linear>,
    /// RoPE's inverse frequencies (head_dim / 2), for the Llama family.
    pub inv_freq: Vec<f32>,
    /// The prefix of the checkpoint's tensor names before the blocks, the
    /// embeddings and the final norm: `model.` (Llama family),
    /// `transformer.` or nothing (GPT-2, as the checkpoint has it).
    /// `lm_head.weight` never has one.
    pub prefix: &'static str,
}

/// Names and shapes read through one store, with the family's prefix.
struct Reader<'a> {
    store: &'a WeightStore,
    prefix: &'a str,
}

impl Reader<'_> {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        Ok(self
            .store
            .take(&format!("{}{name}", self.prefix), shape)?
            .data)
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Weight> {
        self.store
            .take_weight(&format!("{}{name}", self.prefix), rows, cols)
    }

    fn linear(&self, name: &str, inp: usize, out: usize, bias: bool) -> Result<Linear> {
        Ok(Linear {
            weight: self.matrix(&format!("{name}.weight"), out, inp)?,
            inp,
            out,
            layout: Layout::OutIn,
            bias: if bias {
                Some(self.tensor(&format!("{name}.bias"), &[out])?)
            } else {
                None
            },
        })
    }

    fn conv1d(&self, name: &str, inp: usize, out: usize) -> Result<Linear> {
        Ok(Linear {
            weight: self.matrix(&format!("{name}.weight"), inp, out)?,
            inp,
            out,
            layout: Layout::InOut,
            bias: Some(self.tensor(&format!("{name}.bias"), &[out])?),
        })
    }
}

/// RoPE's inverse frequencies as transformers makes them (computed in f64
/// and rounded: transformers' f32 powers agree to the last bit or so).
pub fn inv_freq(config: &ModelConfig) -> Vec<f32> {
    let dim = config.head_dim;
    let base: Vec<f64> = (0..dim / 2)
        .map(|i| 1.0 / config.rope_theta.powf((2 * i) as f64 / dim as f64))
        .collect();
    let scaled = match config.rope_scaling {
        RopeScaling::None => base,
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old,
        } => {
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            base.into_iter()
                .map(|f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    };
    scaled.into_iter().map(|f| f as f32).collect()
}

impl Model {
    /// Loads `dir`: config.json and the safetensors weights.
    pub fn load(dir: &Path) -> Result<Self> {
        let config = ModelConfig::load(dir)?;
        let store = WeightStore::open(dir)?;
        let h = config.hidden_size;
        let v = config.vocab_size;
        let model = match config.family {
            Family::Llama => {
                let r = Reader {
                    store: &store,
                    prefix: "model.",
                };
                let hd = config.head_dim;
                let (qd, kvd, inter) = (
                    config.num_heads * hd,
                    config.num_kv_heads * hd,
                    config.intermediate_size,
                );
                let mut blocks = Vec::with_capacity(config.num_layers);
                for i in 0..config.num_layers {
                    let p = format!("layers.{i}");
                    let rms = |name: &str| -> Result<Norm> {
                        Ok(Norm::Rms {
                            weight: r.tensor(&format!("{p}.{name}.weight"), &[h])?,
                            eps: config.norm_eps,
                        })
                    };
                    let qkv_bias = config.attention_bias;
                    blocks.push(Block {
                        norm1: rms("input_layernorm")?,
                        q: r.linear(&format!("{p}.self_attn.q_proj"), h, qd, qkv_bias)?,
                        k: r.linear(&format!("{p}.self_attn.k_proj"), h, kvd, qkv_bias)?,
                        v: r.linear(&format!("{p}.self_attn.v_proj"), h, kvd, qkv_bias)?,
                        o: r.linear(&format!("{p}.self_attn.o_proj"), qd, h, config.o_bias)?,
                        norm2: rms("post_attention_layernorm")?,
                        mlp: Mlp::SwiGlu {
                            gate: r.linear(
                                &format!("{p}.mlp.gate_proj"),
                                h,
                                inter,
                                config.mlp_bias,
                            )?,
                            up: r.linear(&format!("{p}.mlp.up_proj"), h, inter, config.mlp_bias)?,
                            down: r.linear(
                                &format!("{p}.mlp.down_proj"),
                                inter,
                                h,
                                config.mlp_bias,
                            )?,
                        },
                    });
                }
                let lm_head = if config.tie_word_embeddings {
                    None
                } else {
                    Some(
                        Reader {
                            store: &store,
                            prefix: "",
                        }
                        .linear("lm_head", h, v, false)?,
                    )
                };
                Self {
                    embed: r.matrix("embed_tokens.weight", v, h)?,
                    positions: None,
                    blocks,
                    final_norm: Norm::Rms {
                        weight: r.tensor("norm.weight", &[h])?,
                        eps: config.norm_eps,
                    },
                    lm_head,
                    inv_freq: inv_freq(&config),
                    prefix: "model.",
                    dir: dir.to_path_buf(),
                    config,
                }
            }
            Family::Gpt2 => {
                // transformers writes `transformer.`-prefixed names; the
                // original checkpoints have none.
                let prefix = if store.contains("transformer.wte.weight") {
                    "transformer."
                } else {
                    ""
                };
                let r = Reader {
                    store: &store,
                    prefix,
                };
                let inter = config.intermediate_size;
                let ln = |name: &str| -> Result<Norm> {
                    Ok(Norm::Layer {
                        weight: r.tensor(&format!("{name}.weight"), &[h])?,
                        bias: r.tensor(&format!("{name}.bias"), &[h])?,
                        eps: config.norm_eps,
                    })
                };
                let mut blocks = Vec::with_capacity(config.num_layers);
                for i in 0..config.num_layers {
                    let p = format!("h.{i}");
                    let fused = r.conv1d(&format!("{p}.attn.c_attn"), h, 3 * h)?;
                    let [q, k, v] = split_columns(&fused, h);
                    blocks.push(Block {
                        norm1: ln(&format!("{p}.ln_1"))?,
                        q,
                        k,
                        v,
                        o: r.conv1d(&format!("{p}.attn.c_proj"), h, h)?,
                        norm2: ln(&format!("{p}.ln_2"))?,
                        mlp: Mlp::Gelu {
                            fc: r.conv1d(&format!("{p}.mlp.c_fc"), h, inter)?,
                            proj: r.conv1d(&format!("{p}.mlp.c_proj"), inter, h)?,
                        },
                    });
                }
                let max_positions = config.max_positions.unwrap_or(0);
                let lm_head = if config.tie_word_embeddings {
                    None
                } else {
                    Some(
                        Reader {
                            store: &store,
                            prefix: "",
                        }
                        .linear("lm_head", h, v, false)?,
                    )
                };
                Self {
                    embed: r.matrix("wte.weight", v, h)?,
                    positions: Some(r.tensor("wpe.weight", &[max_positions, h])?),
                    blocks,
                    final_norm: ln("ln_f")?,
                    lm_head,
                    inv_freq: Vec::new(),
                    prefix,
                    dir: dir.to_path_buf(),
                    config,
                }
            }
        };
        Ok(model)
    }
}

/// GPT-2's fused [in, 3·h] `c_attn` as three [in, h] projections (in the
/// fused weight's dtype).
fn split_columns(fused: &Linear, h: usize) -> [Linear; 3] {
    let part = |p: usize| Linear {
        weight: fused.weight.columns(p * h, h),
        inp: fused.inp,
        out: h,
        layout: Layout::InOut,
        bias: fused.bias.as_ref().map(|b| b[p * h..(p + 1) * h].to_vec()),
    };
    [part(0), part(1), part(2)]
}

impl Model {
    /// Every matrix the model holds: each block's projections, the
    /// embedding and an untied head.
    pub fn matrices(&self) -> Vec<&Weight> {
        let mut all = vec![&self.embed];
        for b in &self.blocks {
            all.extend([&b.q.weight, &b.k.weight, &b.v.weight, &b.o.weight]);
            match &b.mlp {
                Mlp::SwiGlu { gate, up, down } => {
                    all.extend([&gate.weight, &up.weight, &down.weight])
                }
                Mlp::Gelu { fc, proj } => all.extend([&fc.weight, &proj.weight]),
            }
        }
        all.extend(self.lm_head.as_ref().map(|l| &l.weight));
        all
    }

    /// Holds every matrix in f32 from now on: what loading did before the
    /// base was kept in its dtype (one f32 copy of the model; the results
    /// are the same bits either way, since bf16 and f16 convert to f32
    /// exactly). A full fine-tune's updates convert the tensors they change
    /// one by one without it.
    pub fn convert_to_f32(&mut self) {
        for b in &mut self.blocks {
            let mut linears = vec![&mut b.q, &mut b.k, &mut b.v, &mut b.o];
            match &mut b.mlp {
                Mlp::SwiGlu { gate, up, down } => linears.extend([gate, up, down]),
                Mlp::Gelu { fc, proj } => linears.extend([fc, proj]),
            }
            for l in linears {
                l.weight.f32_mut();
            }
        }
        self.embed.f32_mut();
        if let Some(head) = &mut self.lm_head {
            head.weight.f32_mut();
        }
    }

    /// The bytes the weights take as held: the matrices at their dtype's
    /// size (bf16 and f16 at 2 bytes, read from the file's pages), the
    /// norms, biases and positions at 4. What `lora-llm` counts the frozen
    /// base at.
    pub fn weight_bytes(&self) -> u64 {
        let f = std::mem::size_of::<f32>();
        let norm = |n: &Norm| match n {
            Norm::Rms { weight, .. } => weight.len(),
            Norm::Layer { weight, bias, .. } => weight.len() + bias.len(),
        };
        let linears = self.blocks.iter().flat_map(|b| {
            let mut l = vec![&b.q, &b.k, &b.v, &b.o];
            match &b.mlp {
                Mlp::SwiGlu { gate, up, down } => l.extend([gate, up, down]),
                Mlp::Gelu { fc, proj } => l.extend([fc, proj]),
            }
            l
        });
        let biases: usize = linears
            .chain(self.lm_head.as_ref())
            .map(|l| l.bias.as_ref().map_or(0, Vec::len))
            .sum();
        let vectors = biases
            + self
                .blocks
                .iter()
                .map(|b| norm(&b.norm1) + norm(&b.norm2))
                .sum::<usize>()
            + norm(&self.final_norm)
            + self.positions.as_ref().map_or(0, Vec::len);
        let matrices: usize = self.matrices().iter().map(|w| w.stored_bytes()).sum();
        (matrices + vectors * f) as u64
    }

    /// The most f32s one product converts at once from a half-precision
    /// weight of this model (its thread's scratch; 0 when every matrix is
    /// f32).
    pub fn scratch_values(&self) -> usize {
        self.matrices()
            .into_iter()
            .map(crate::weight::scratch_values)
            .max()
            .unwrap_or(0)
    }
}
