//! A loaded model: the f32 weights of every block, laid out as the
//! checkpoint stores them (a Linear's [out, in], a Conv1D's [in, out]; the
//! product reads either through strides). GPT-2's fused `c_attn` is split
//! into q, k and v once, here, so both families share one attention. Memory:
//! one f32 copy of the weights; a tied head reads the embedding.

use std::path::{Path, PathBuf};

use crate::config::{Family, ModelConfig, RopeScaling};
use crate::error::Result;
use crate::math::{project, Layout};
use crate::weights::WeightStore;

/// A projection: weight, its layout, optional bias.
pub struct Linear {
    pub weight: Vec<f32>,
    pub inp: usize,
    pub out: usize,
    pub layout: Layout,
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    pub fn forward(&self, x: &[f32], n: usize) -> Vec<f32> {
        project(
            x,
            n,
            &self.weight,
            self.inp,
            self.out,
            self.layout,
            self.bias.as_deref(),
        )
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
    pub embed: Vec<f32>,
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

    fn linear(&self, name: &str, inp: usize, out: usize, bias: bool) -> Result<Linear> {
        Ok(Linear {
            weight: self.tensor(&format!("{name}.weight"), &[out, inp])?,
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
            weight: self.tensor(&format!("{name}.weight"), &[inp, out])?,
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
                    embed: r.tensor("embed_tokens.weight", &[v, h])?,
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
                    embed: r.tensor("wte.weight", &[v, h])?,
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

/// GPT-2's fused [in, 3·h] `c_attn` as three [in, h] projections.
fn split_columns(fused: &Linear, h: usize) -> [Linear; 3] {
    let inp = fused.inp;
    let part = |p: usize| {
        let mut weight = Vec::with_capacity(inp * h);
        for row in fused.weight.chunks_exact(3 * h) {
            weight.extend_from_slice(&row[p * h..(p + 1) * h]);
        }
        Linear {
            weight,
            inp,
            out: h,
            layout: Layout::InOut,
            bias: fused.bias.as_ref().map(|b| b[p * h..(p + 1) * h].to_vec()),
        }
    };
    [part(0), part(1), part(2)]
}
