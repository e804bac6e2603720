//! The gradient of the causal-LM loss with respect to every base weight (a
//! full fine-tune's backward), named and laid out as the checkpoint stores
//! the tensors, so an optimizer can update them and a writer can save them
//! under the same names. It is the LoRA pass of `gradients.rs` with the
//! weights' gradients switched on: the same per-block checkpointed forward,
//! the same recompute of each block just before its backward
//! (`Ctx::backward_into` with a [`BlockGrads`] sink), and the same chunked
//! loss over the vocabulary, whose head weight gradient is accumulated
//! chunk by chunk (dW += dlogitsᵀ · rows), so all logits never exist at
//! once. The embedding's gradient is the scatter-add of the first block's
//! input gradient at the ids, plus the head's when the head is tied to it;
//! GPT-2's positions get the same rows added by position.
//!
//! Memory: the gradients are one f32 copy of the weights (the model's own
//! size again in f32, twice a bf16 base's as held: GPT-2's `c_attn` is fused from its q, k and v thirds as each
//! block finishes, a block's worth of transient copies); on top, the LoRA
//! pass's activations: every block's input (layers · n · hidden f32s, n =
//! batch · T), one block's tape at a time, and at most `HEAD_CHUNK_VALUES`
//! logits with their gradient in place. No optimizer state is kept here.

use std::collections::BTreeMap;

use crate::config::Family;
use crate::error::{LlmError, Result};
use crate::forward::batch_shape;
use crate::lora::attention::Shape;
use crate::lora::block::{norm_backward, norm_weight_grad, BlockGrads, Ctx, Part, PartGrad, Sink};
use crate::lora::gradients::HEAD_CHUNK_VALUES;
use crate::lora::{AdapterGrads, Adapters};
use crate::math::Layout;
use crate::model::{Linear, Mlp, Model, Norm};
use crate::weight::Weight;

/// One tensor's gradient: its checkpoint shape and values in its layout
/// (row-major over `shape`).
#[derive(Clone, Debug, PartialEq)]
pub struct Grad {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// Gradients by the checkpoint's tensor name (`model.layers.0.self_attn.q_proj.weight`,
/// `transformer.h.0.attn.c_attn.bias`, `lm_head.weight` when untied …), in
/// name order.
pub type WeightGrads = BTreeMap<String, Grad>;

/// Where a named tensor lives in a [`Model`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Embed,
    Positions,
    LmHead,
    FinalNorm {
        bias: bool,
    },
    Block {
        layer: usize,
        part: Part,
        bias: bool,
    },
    /// GPT-2's fused q|k|v of a layer.
    CAttn {
        layer: usize,
        bias: bool,
    },
}

impl Model {
    /// The causal-LM loss of `batch` against `labels` (as
    /// [`Model::loss`]: the mean over the counted labels, -100 skipped) and
    /// its gradient with respect to every weight of the model, by the
    /// checkpoint's tensor names (see [`Model::weight_names`]); a tied head's
    /// gradient is added into the embedding's.
    pub fn full_gradients(
        &self,
        batch: &[Vec<u32>],
        labels: &[Vec<i64>],
    ) -> Result<(f32, WeightGrads)> {
        let chunk = (HEAD_CHUNK_VALUES / self.config.vocab_size.max(1)).max(1);
        self.full_gradients_chunked(batch, labels, chunk)
    }

    /// [`Model::full_gradients`] with the loss's logits `chunk` positions
    /// at a time.
    fn full_gradients_chunked(
        &self,
        batch: &[Vec<u32>],
        labels: &[Vec<i64>],
        chunk: usize,
    ) -> Result<(f32, WeightGrads)> {
        let c = &self.config;
        let (b, t, counted) = batch_shape(batch, labels, c.vocab_size)?;
        let (h, n) = (c.hidden_size, b * t);
        let mut x = self.embed_rows(batch, t)?;
        let no_adapters = Adapters::new();
        let ctx = Ctx {
            model: self,
            adapters: &no_adapters,
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
        let layers = self.blocks.len();
        let mut inputs = Vec::with_capacity(layers);
        for layer in 0..layers {
            let (next, _tape) = ctx.forward(layer, &x, &mut None);
            inputs.push(std::mem::replace(&mut x, next));
        }
        let nf = self.final_norm.forward(&x);
        let head = self.head_weight()?;
        let mut head_grad = vec![0.0f32; head.len()];
        let (loss, dnf) = self.head_loss(head, &nf, &counted, chunk, h, Some(&mut head_grad));
        drop(nf);
        let mut grads = WeightGrads::new();
        let final_grad = norm_weight_grad(&self.final_norm, &x, &dnf);
        self.put_norm(&mut grads, self.final_name(), final_grad);
        let mut dx = norm_backward(&self.final_norm, &x, &dnf);
        drop((dnf, x));
        let mut unused = AdapterGrads::new();
        for layer in (0..layers).rev() {
            let x_in = inputs.pop().ok_or_else(|| {
                LlmError::Input("internal: a block's checkpoint is missing".into())
            })?;
            let (_, tape) = ctx.forward(layer, &x_in, &mut None);
            let mut block = BlockGrads::new();
            let mut sink = Sink {
                adapters: &mut unused,
                weights: Some(&mut block),
            };
            dx = ctx.backward_into(layer, &x_in, &tape, &dx, &mut sink);
            self.put_block(&mut grads, layer, block)?;
        }
        // The embedding: the head's share when tied, then every input row's.
        let mut embed = match self.lm_head {
            None => std::mem::take(&mut head_grad),
            Some(_) => {
                grads.insert(
                    "lm_head.weight".into(),
                    Grad {
                        shape: vec![c.vocab_size, h],
                        data: std::mem::take(&mut head_grad),
                    },
                );
                vec![0.0f32; self.embed.len()]
            }
        };
        for (&id, row) in batch.iter().flatten().zip(dx.chunks_exact(h)) {
            let id = id as usize;
            add(&mut embed[id * h..(id + 1) * h], row);
        }
        grads.insert(
            self.embed_name(),
            Grad {
                shape: vec![c.vocab_size, h],
                data: embed,
            },
        );
        if let Some(pos) = &self.positions {
            let mut dp = vec![0.0f32; pos.len()];
            for (i, row) in dx.chunks_exact(h).enumerate() {
                let p = i % t;
                add(&mut dp[p * h..(p + 1) * h], row);
            }
            grads.insert(
                format!("{}wpe.weight", self.prefix),
                Grad {
                    shape: vec![pos.len() / h, h],
                    data: dp,
                },
            );
        }
        Ok((loss, grads))
    }

    /// Every weight tensor's checkpoint name with its shape, in name order:
    /// the names [`Model::full_gradients`] returns (a tied head has none of
    /// its own).
    pub fn weight_names(&self) -> Vec<(String, Vec<usize>)> {
        let mut names: Vec<(String, Vec<usize>)> = self
            .slots()
            .into_iter()
            .map(|(name, slot)| {
                let shape = self.slot_shape(slot);
                (name, shape)
            })
            .collect();
        names.sort();
        names
    }

    /// The values of weight tensor `name` in its checkpoint shape and
    /// layout (GPT-2's `c_attn` fused again from q, k and v).
    pub fn weight(&self, name: &str) -> Result<Grad> {
        let slot = self.slot(name)?;
        let data = match slot {
            Slot::CAttn { layer, bias } => {
                let bl = &self.blocks[layer];
                let thirds = [&bl.q, &bl.k, &bl.v].map(|l| {
                    if bias {
                        l.bias.clone().unwrap_or_default()
                    } else {
                        l.weight.to_f32()
                    }
                });
                fuse_qkv(
                    [0, 1, 2].map(|i| &thirds[i][..]),
                    if bias { 1 } else { bl.q.inp },
                )
            }
            _ => match self.slot_weight(slot) {
                Some(w) => w.to_f32(),
                None => self.slot_values(slot).to_vec(),
            },
        };
        Ok(Grad {
            shape: self.slot_shape(slot),
            data,
        })
    }

    /// Adds `delta` (in the tensor's checkpoint shape and layout) into
    /// weight tensor `name`; the cached forward and `generate` then run the
    /// changed model.
    pub fn add_to_weight(&mut self, name: &str, delta: &[f32]) -> Result<()> {
        self.apply_to_weight(name, delta, add)
    }

    /// Sets weight tensor `name` to `values` (in its checkpoint shape and
    /// layout, as [`Model::weight`] reads it): an optimizer's new weights.
    pub fn set_weight(&mut self, name: &str, values: &[f32]) -> Result<()> {
        self.apply_to_weight(name, values, |dst, src| dst.copy_from_slice(src))
    }

    /// `op(stored, given)` over tensor `name`, GPT-2's fused `c_attn` split
    /// back into its q, k and v thirds.
    fn apply_to_weight(
        &mut self,
        name: &str,
        delta: &[f32],
        op: impl Fn(&mut [f32], &[f32]),
    ) -> Result<()> {
        let slot = self.slot(name)?;
        let expected: usize = self.slot_shape(slot).iter().product();
        if delta.len() != expected {
            return Err(LlmError::Input(format!(
                "weight `{name}`: {} values given, the tensor has {expected} ({:?})",
                delta.len(),
                self.slot_shape(slot)
            )));
        }
        if let Slot::CAttn { layer, bias } = slot {
            let bl = &mut self.blocks[layer];
            let width = bl.q.out;
            let rows = if bias { 1 } else { bl.q.inp };
            for (p, lin) in [&mut bl.q, &mut bl.k, &mut bl.v].into_iter().enumerate() {
                let dst: &mut [f32] = if bias {
                    lin.bias.as_deref_mut().unwrap_or(&mut [])
                } else {
                    lin.weight.f32_mut()
                };
                for r in 0..rows {
                    let src = &delta[r * 3 * width + p * width..][..width];
                    op(&mut dst[r * width..(r + 1) * width], src);
                }
            }
        } else {
            op(self.slot_values_mut(slot), delta);
        }
        Ok(())
    }

    /// w += scale · g for every tensor of `grads` (an SGD step with scale
    /// −lr, or an optimizer's update with scale 1). Every name and shape is
    /// checked before anything changes.
    pub fn add_scaled(&mut self, grads: &WeightGrads, scale: f32) -> Result<()> {
        for (name, g) in grads {
            let slot = self.slot(name)?;
            let shape = self.slot_shape(slot);
            if g.shape != shape || g.data.len() != shape.iter().product::<usize>() {
                return Err(LlmError::Input(format!(
                    "weight `{name}` is {shape:?}, the update is {:?} with {} values",
                    g.shape,
                    g.data.len()
                )));
            }
        }
        for (name, g) in grads {
            let delta: Vec<f32> = g.data.iter().map(|v| v * scale).collect();
            self.add_to_weight(name, &delta)?;
        }
        Ok(())
    }

    fn embed_name(&self) -> String {
        match self.config.family {
            Family::Llama => format!("{}embed_tokens.weight", self.prefix),
            Family::Gpt2 => format!("{}wte.weight", self.prefix),
        }
    }

    /// The final norm's name without `.weight`.
    fn final_name(&self) -> String {
        match self.config.family {
            Family::Llama => format!("{}norm", self.prefix),
            Family::Gpt2 => format!("{}ln_f", self.prefix),
        }
    }

    /// The module name of a block's part (GPT-2's q, k, v: `c_attn`).
    fn part_name(&self, layer: usize, part: Part) -> String {
        let p = self.prefix;
        let module = match (self.config.family, part) {
            (Family::Llama, Part::Norm1) => "input_layernorm",
            (Family::Llama, Part::Q) => "self_attn.q_proj",
            (Family::Llama, Part::K) => "self_attn.k_proj",
            (Family::Llama, Part::V) => "self_attn.v_proj",
            (Family::Llama, Part::O) => "self_attn.o_proj",
            (Family::Llama, Part::Norm2) => "post_attention_layernorm",
            (Family::Llama, Part::Gate) => "mlp.gate_proj",
            (Family::Llama, Part::Up) => "mlp.up_proj",
            (Family::Llama, Part::Down) => "mlp.down_proj",
            (Family::Gpt2, Part::Norm1) => "ln_1",
            (Family::Gpt2, Part::Q | Part::K | Part::V) => "attn.c_attn",
            (Family::Gpt2, Part::O) => "attn.c_proj",
            (Family::Gpt2, Part::Norm2) => "ln_2",
            (Family::Gpt2, Part::Gate) => "mlp.c_fc",
            (Family::Gpt2, Part::Up) => "mlp.up",
            (Family::Gpt2, Part::Down) => "mlp.c_proj",
        };
        match self.config.family {
            Family::Llama => format!("{p}layers.{layer}.{module}"),
            Family::Gpt2 => format!("{p}h.{layer}.{module}"),
        }
    }

    /// Every named tensor and where it lives.
    fn slots(&self) -> Vec<(String, Slot)> {
        let mut slots = vec![(self.embed_name(), Slot::Embed)];
        if self.positions.is_some() {
            slots.push((format!("{}wpe.weight", self.prefix), Slot::Positions));
        }
        if self.lm_head.is_some() {
            slots.push(("lm_head.weight".into(), Slot::LmHead));
        }
        let fin = self.final_name();
        slots.push((format!("{fin}.weight"), Slot::FinalNorm { bias: false }));
        if matches!(self.final_norm, Norm::Layer { .. }) {
            slots.push((format!("{fin}.bias"), Slot::FinalNorm { bias: true }));
        }
        for (layer, bl) in self.blocks.iter().enumerate() {
            for part in [Part::Norm1, Part::Norm2] {
                let norm = if part == Part::Norm1 {
                    &bl.norm1
                } else {
                    &bl.norm2
                };
                let name = self.part_name(layer, part);
                slots.push((
                    format!("{name}.weight"),
                    Slot::Block {
                        layer,
                        part,
                        bias: false,
                    },
                ));
                if matches!(norm, Norm::Layer { .. }) {
                    slots.push((
                        format!("{name}.bias"),
                        Slot::Block {
                            layer,
                            part,
                            bias: true,
                        },
                    ));
                }
            }
            let mut linears: Vec<(Part, &Linear)> = Vec::new();
            if self.config.family == Family::Gpt2 {
                let name = self.part_name(layer, Part::Q);
                slots.push((format!("{name}.weight"), Slot::CAttn { layer, bias: false }));
                if bl.q.bias.is_some() {
                    slots.push((format!("{name}.bias"), Slot::CAttn { layer, bias: true }));
                }
            } else {
                linears.extend([(Part::Q, &bl.q), (Part::K, &bl.k), (Part::V, &bl.v)]);
            }
            linears.push((Part::O, &bl.o));
            match &bl.mlp {
                Mlp::SwiGlu { gate, up, down } => {
                    linears.extend([(Part::Gate, gate), (Part::Up, up), (Part::Down, down)])
                }
                Mlp::Gelu { fc, proj } => linears.extend([(Part::Gate, fc), (Part::Down, proj)]),
            }
            for (part, lin) in linears {
                let name = self.part_name(layer, part);
                slots.push((
                    format!("{name}.weight"),
                    Slot::Block {
                        layer,
                        part,
                        bias: false,
                    },
                ));
                if lin.bias.is_some() {
                    slots.push((
                        format!("{name}.bias"),
                        Slot::Block {
                            layer,
                            part,
                            bias: true,
                        },
                    ));
                }
            }
        }
        slots
    }

    fn slot(&self, name: &str) -> Result<Slot> {
        self.slots()
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, s)| s)
            .ok_or_else(|| {
                LlmError::Input(format!(
                    "`{name}` is not a weight of {} (its names begin `{}`; see Model::weight_names)",
                    self.config.architecture,
                    self.embed_name()
                ))
            })
    }

    fn slot_shape(&self, slot: Slot) -> Vec<usize> {
        let c = &self.config;
        let h = c.hidden_size;
        match slot {
            Slot::Embed | Slot::LmHead => vec![c.vocab_size, h],
            Slot::Positions => vec![self.positions.as_ref().map_or(0, |p| p.len() / h), h],
            Slot::CAttn { bias: false, .. } => vec![h, 3 * h],
            Slot::CAttn { bias: true, .. } => vec![3 * h],
            _ => match (self.slot_linear(slot), slot) {
                (Some(lin), Slot::Block { bias: false, .. }) => match lin.layout {
                    Layout::OutIn => vec![lin.out, lin.inp],
                    Layout::InOut => vec![lin.inp, lin.out],
                },
                _ => vec![self.slot_values(slot).len()],
            },
        }
    }

    /// The projection a block slot names (none for norms and the rest).
    fn slot_linear(&self, slot: Slot) -> Option<&Linear> {
        let Slot::Block { layer, part, .. } = slot else {
            return None;
        };
        let bl = &self.blocks[layer];
        Some(match (part, &bl.mlp) {
            (Part::Q, _) => &bl.q,
            (Part::K, _) => &bl.k,
            (Part::V, _) => &bl.v,
            (Part::O, _) => &bl.o,
            (Part::Gate, Mlp::SwiGlu { gate, .. }) => gate,
            (Part::Up, Mlp::SwiGlu { up, .. }) => up,
            (Part::Down, Mlp::SwiGlu { down, .. }) => down,
            (Part::Gate, Mlp::Gelu { fc, .. }) => fc,
            (Part::Down, Mlp::Gelu { proj, .. }) => proj,
            _ => return None,
        })
    }

    /// The matrix a slot names (the embedding, the head, a projection's
    /// weight), none for the vectors.
    fn slot_weight(&self, slot: Slot) -> Option<&Weight> {
        match slot {
            Slot::Embed => Some(&self.embed),
            Slot::LmHead => self.lm_head.as_ref().map(|l| &l.weight),
            Slot::Block { bias: false, .. } => self.slot_linear(slot).map(|l| &l.weight),
            _ => None,
        }
    }

    /// A vector slot's values (a norm's, a bias, the positions); empty for
    /// a matrix ([`Model::slot_weight`]).
    fn slot_values(&self, slot: Slot) -> &[f32] {
        fn norm_part(norm: &Norm, bias: bool) -> &[f32] {
            match (norm, bias) {
                (Norm::Rms { weight, .. } | Norm::Layer { weight, .. }, false) => weight,
                (Norm::Layer { bias, .. }, true) => bias,
                (Norm::Rms { .. }, true) => &[],
            }
        }
        match slot {
            Slot::Positions => self.positions.as_deref().unwrap_or(&[]),
            Slot::Embed | Slot::LmHead | Slot::CAttn { .. } => &[],
            Slot::FinalNorm { bias } => norm_part(&self.final_norm, bias),
            Slot::Block { layer, part, bias } => match part {
                Part::Norm1 => norm_part(&self.blocks[layer].norm1, bias),
                Part::Norm2 => norm_part(&self.blocks[layer].norm2, bias),
                _ => match self.slot_linear(slot) {
                    Some(lin) if bias => lin.bias.as_deref().unwrap_or(&[]),
                    _ => &[],
                },
            },
        }
    }

    fn slot_values_mut(&mut self, slot: Slot) -> &mut [f32] {
        fn norm_part(norm: &mut Norm, bias: bool) -> &mut [f32] {
            match (norm, bias) {
                (Norm::Rms { weight, .. } | Norm::Layer { weight, .. }, false) => weight,
                (Norm::Layer { bias, .. }, true) => bias,
                (Norm::Rms { .. }, true) => &mut [],
            }
        }
        fn lin_part(lin: &mut Linear, bias: bool) -> &mut [f32] {
            if bias {
                lin.bias.as_deref_mut().unwrap_or(&mut [])
            } else {
                lin.weight.f32_mut()
            }
        }
        // A half-precision matrix changed here is held in f32 from then on
        // (`Weight::f32_mut`).
        match slot {
            Slot::Embed => self.embed.f32_mut(),
            Slot::Positions => self.positions.as_deref_mut().unwrap_or(&mut []),
            Slot::LmHead => self
                .lm_head
                .as_mut()
                .map_or(&mut [][..], |l| l.weight.f32_mut()),
            Slot::FinalNorm { bias } => norm_part(&mut self.final_norm, bias),
            Slot::CAttn { .. } => &mut [],
            Slot::Block { layer, part, bias } => {
                let bl = &mut self.blocks[layer];
                match (part, &mut bl.mlp) {
                    (Part::Norm1, _) => norm_part(&mut bl.norm1, bias),
                    (Part::Norm2, _) => norm_part(&mut bl.norm2, bias),
                    (Part::Q, _) => lin_part(&mut bl.q, bias),
                    (Part::K, _) => lin_part(&mut bl.k, bias),
                    (Part::V, _) => lin_part(&mut bl.v, bias),
                    (Part::O, _) => lin_part(&mut bl.o, bias),
                    (Part::Gate, Mlp::SwiGlu { gate, .. }) => lin_part(gate, bias),
                    (Part::Up, Mlp::SwiGlu { up, .. }) => lin_part(up, bias),
                    (Part::Down, Mlp::SwiGlu { down, .. }) => lin_part(down, bias),
                    (Part::Gate, Mlp::Gelu { fc, .. }) => lin_part(fc, bias),
                    (Part::Down, Mlp::Gelu { proj, .. }) => lin_part(proj, bias),
                    _ => &mut [],
                }
            }
        }
    }

    /// The head's weight, [vocab, hidden] (the embedding when tied).
    fn head_weight(&self) -> Result<&Weight> {
        match &self.lm_head {
            None => Ok(&self.embed),
            Some(head) if head.layout == Layout::OutIn => Ok(&head.weight),
            Some(_) => Err(LlmError::Input(
                "lm_head stored [in, out]: not supported by full_gradients".into(),
            )),
        }
    }

    /// A norm's gradients under `{module}.weight` (and `.bias`).
    fn put_norm(&self, grads: &mut WeightGrads, module: String, g: PartGrad) {
        let d = g.weight.len();
        grads.insert(
            format!("{module}.weight"),
            Grad {
                shape: vec![d],
                data: g.weight,
            },
        );
        if let Some(bias) = g.bias {
            grads.insert(
                format!("{module}.bias"),
                Grad {
                    shape: vec![d],
                    data: bias,
                },
            );
        }
    }

    /// One block's gradients under their checkpoint names (GPT-2's q, k
    /// and v fused into `c_attn` [in, 3·h]).
    fn put_block(&self, grads: &mut WeightGrads, layer: usize, mut g: BlockGrads) -> Result<()> {
        let missing = |part: Part| {
            LlmError::Input(format!(
                "internal: layer {layer}'s backward formed no gradient for {part:?}"
            ))
        };
        if self.config.family == Family::Gpt2 {
            let mut thirds = Vec::with_capacity(3);
            for part in [Part::Q, Part::K, Part::V] {
                thirds.push(g.remove(&part).ok_or_else(|| missing(part))?);
            }
            let bl = &self.blocks[layer];
            let name = self.part_name(layer, Part::Q);
            let h = bl.q.out;
            grads.insert(
                format!("{name}.weight"),
                Grad {
                    shape: vec![bl.q.inp, 3 * h],
                    data: fuse_qkv([0, 1, 2].map(|i| &thirds[i].weight[..]), bl.q.inp),
                },
            );
            if thirds.iter().all(|t| t.bias.is_some()) {
                let biases = [0, 1, 2].map(|i| thirds[i].bias.as_deref().unwrap_or(&[]));
                grads.insert(
                    format!("{name}.bias"),
                    Grad {
                        shape: vec![3 * h],
                        data: fuse_qkv(biases, 1),
                    },
                );
            }
        }
        for (part, pg) in g {
            let name = self.part_name(layer, part);
            match part {
                Part::Norm1 | Part::Norm2 => self.put_norm(grads, name, pg),
                _ => {
                    let slot = Slot::Block {
                        layer,
                        part,
                        bias: false,
                    };
                    let shape = self.slot_shape(slot);
                    if let Some(bias) = pg.bias {
                        grads.insert(
                            format!("{name}.bias"),
                            Grad {
                                shape: vec![bias.len()],
                                data: bias,
                            },
                        );
                    }
                    grads.insert(
                        format!("{name}.weight"),
                        Grad {
                            shape,
                            data: pg.weight,
                        },
                    );
                }
            }
        }
        Ok(())
    }
}

/// Three [rows, w] matrices side by side as one [rows, 3·w] (GPT-2's
/// q|k|v columns of `c_attn`).
fn fuse_qkv(parts: [&[f32]; 3], rows: usize) -> Vec<f32> {
    let w = parts[0].len() / rows.max(1);
    let mut fused = Vec::with_capacity(3 * rows * w);
    for r in 0..rows {
        for p in parts {
            fused.extend_from_slice(&p[r * w..(r + 1) * w]);
        }
    }
    fused
}

fn add(into: &mut [f32], from: &[f32]) {
    into.iter_mut().zip(from).for_each(|(a, b)| *a += b);
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::Model;

    /// The head's weight gradient summed over chunks of 3 positions equals
    /// the one-chunk pass's (the fixtures' vocabulary fits one chunk, so
    /// the public path never splits there).
    #[test]
    fn chunked_head_matches_one_chunk() {
        for name in ["llama", "gpt2"] {
            let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("fixtures")
                .join(name);
            let model = Model::load(&dir).expect("loads");
            let batch = vec![(0..12u32).map(|i| (i * 37) % 300).collect::<Vec<_>>(); 2];
            let labels: Vec<Vec<i64>> = batch
                .iter()
                .map(|r| r.iter().map(|&i| i as i64).collect())
                .collect();
            let (l1, g1) = model
                .full_gradients_chunked(&batch, &labels, 1 << 20)
                .expect("one chunk");
            let (l3, g3) = model
                .full_gradients_chunked(&batch, &labels, 3)
                .expect("chunks of 3");
            assert!((l1 - l3).abs() < 1e-6, "{name}: loss {l1} vs {l3}");
            assert_eq!(g1.len(), g3.len());
            for (key, a) in &g1 {
                let b = &g3[key];
                let diff = a
                    .data
                    .iter()
                    .zip(&b.data)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0f32, f32::max);
                assert!(
                    diff < 1e-6,
                    "{name}: {key} differs by {diff} across chunkings"
                );
            }
        }
    }
}
