//! The token models' GPU layers (`CudaLayer`): the embedding (keeps the
//! ids), causal self-attention between its projections (keeps its qkv
//! projection's output, the heads' output and each row's log-sum-exp,
//! never a T×T matrix), a LoRA linear layer (keeps its input and
//! u = s·x·Aᵀ) and the LSTM (keeps its input, its output, the activated
//! gates and the cell states, in f32). A sequence [n, t, c] is rows
//! [n·t, c].

use std::sync::Arc;

use crate::cuda::backend::CudaBackend;
use crate::cuda::layer::{
    activations_of, backward_list, compute, forward_list, master, missing, with_grads, CudaLayer,
    Groups, Input, Keep, ParamRef, Pass, Saved, Shared,
};
use crate::cuda::ops;
use crate::cuda::tensor::CudaTensor;
use crate::cuda::CudaResult;

/// What attention keeps besides its projections' own entries.
#[derive(Debug)]
pub struct SavedAttention {
    qkv: Shared,
    heads_out: Shared,
    stats: ops::AttentionSaved,
}

/// Token ids [n, t] (f32) -> rows [n·t, dim]; keeps the ids.
#[derive(Debug)]
pub(crate) struct EmbeddingLayer {
    pub table: ParamRef,
    pub positions: Option<ParamRef>,
    pub shape: ops::EmbeddingShape,
}

impl CudaLayer for EmbeddingLayer {
    fn describe(&self) -> String {
        format!("embedding {}x{}", self.shape.vocab, self.shape.dim)
    }

    fn forward(
        &mut self,
        be: &CudaBackend,
        groups: &Groups,
        input: &Input<'_>,
        _pass: Pass,
        _saved: Option<&mut Vec<Saved>>,
    ) -> CudaResult<(CudaTensor, Keep)> {
        let table = master(groups, &self.table);
        let positions = self.positions.as_ref().map(|p| master(groups, p));
        let dtype = activations_of(groups);
        let x = input.tensor();
        let y = ops::embedding_forward(be, x, &table, positions.as_ref(), self.shape, dtype)?;
        Ok((y, Keep::Input))
    }

    fn backward(
        &mut self,
        be: &CudaBackend,
        groups: &mut Groups,
        saved: &mut Vec<Saved>,
        g: CudaTensor,
    ) -> CudaResult<CudaTensor> {
        let Some(Saved::Input(ids)) = saved.pop() else {
            return Err(missing());
        };
        let ids = ids.take(be)?;
        embedding_grads(be, groups, &ids, &g, self.table, self.positions, self.shape)?;
        // Ids have no gradient.
        CudaTensor::zeros(be, ids.shape(), ids.dtype())
    }
}

/// An embedding's gradients into whichever of its table and positions
/// are trainable.
fn embedding_grads(
    be: &CudaBackend,
    groups: &mut Groups,
    ids: &CudaTensor,
    g: &CudaTensor,
    table: ParamRef,
    positions: Option<ParamRef>,
    shape: ops::EmbeddingShape,
) -> CudaResult<()> {
    let positions = positions.filter(ParamRef::trainable);
    match (table.trainable(), positions) {
        (true, positions) => with_grads(groups, &table, positions.as_ref(), |mut v| {
            ops::embedding_backward(
                be,
                ids,
                g,
                shape,
                Some(&mut v.grad),
                v.other.as_mut().map(|(_, grad)| grad),
            )
        }),
        (false, Some(positions)) => with_grads(groups, &positions, None, |mut v| {
            ops::embedding_backward(be, ids, g, shape, None, Some(&mut v.grad))
        }),
        (false, None) => Ok(()),
    }
}

/// Causal self-attention between its projections (each one linear or LoRA
/// layer) over sequences of `length` tokens.
#[derive(Debug)]
pub(crate) struct AttentionLayer {
    pub qkv: Vec<Box<dyn CudaLayer>>,
    pub proj: Vec<Box<dyn CudaLayer>>,
    pub length: usize,
    pub heads: usize,
}

impl CudaLayer for AttentionLayer {
    fn describe(&self) -> String {
        format!("causal attention {} heads", self.heads)
    }

    fn forward(
        &mut self,
        be: &CudaBackend,
        groups: &Groups,
        input: &Input<'_>,
        pass: Pass,
        mut saved: Option<&mut Vec<Saved>>,
    ) -> CudaResult<(CudaTensor, Keep)> {
        let keeping = saved.is_some();
        // The projections' entries go on the stack below attention's own.
        let qkv_out = forward_list(
            be,
            &mut self.qkv,
            groups,
            input.lend(),
            pass,
            saved.as_deref_mut(),
        )?;
        let (heads_out, stats) = ops::attention_forward(be, &qkv_out, self.length, self.heads)?;
        let heads_out = Arc::new(heads_out);
        let o = Input::Shared(Arc::clone(&heads_out), None);
        let y = forward_list(be, &mut self.proj, groups, o, pass, saved)?;
        let keep = match keeping {
            true => Saved::Attention(Box::new(SavedAttention {
                qkv: Arc::new(qkv_out),
                heads_out,
                stats,
            })),
            false => Saved::Nothing,
        };
        Ok((y, Keep::Other(keep)))
    }

    fn backward(
        &mut self,
        be: &CudaBackend,
        groups: &mut Groups,
        saved: &mut Vec<Saved>,
        g: CudaTensor,
    ) -> CudaResult<CudaTensor> {
        let Some(Saved::Attention(kept)) = saved.pop() else {
            return Err(missing());
        };
        let d_heads = backward_list(be, &mut self.proj, groups, saved, g)?;
        let SavedAttention {
            qkv: qkv_out,
            heads_out,
            stats,
        } = *kept;
        let d_qkv = ops::attention_backward(
            be,
            &qkv_out,
            &heads_out,
            &d_heads,
            &stats,
            self.length,
            self.heads,
        )?;
        drop((qkv_out, heads_out, stats, d_heads));
        backward_list(be, &mut self.qkv, groups, saved, d_qkv)
    }
}

/// A linear layer with a frozen base and a trainable LoRA adapter:
/// y = x·W + b + s·(x·Aᵀ)·Bᵀ with W and b frozen.
#[derive(Debug)]
pub(crate) struct LoraLayer {
    pub weight: ParamRef,
    pub bias: Option<ParamRef>,
    pub a: ParamRef,
    pub b: ParamRef,
    pub rank: usize,
    pub scale: f32,
    pub out: usize,
}

impl LoraLayer {
    fn weights<'a>(&self, groups: &'a Groups) -> ops::LoraWeights<'a> {
        ops::LoraWeights {
            weight: compute(groups, &self.weight),
            bias: self.bias.as_ref().map(|b| compute(groups, b)),
            a: compute(groups, &self.a),
            b: compute(groups, &self.b),
            rank: self.rank,
            scale: self.scale,
        }
    }
}

impl CudaLayer for LoraLayer {
    fn describe(&self) -> String {
        format!("lora to {} (r {})", self.out, self.rank)
    }

    fn forward(
        &mut self,
        be: &CudaBackend,
        groups: &Groups,
        input: &Input<'_>,
        _pass: Pass,
        saved: Option<&mut Vec<Saved>>,
    ) -> CudaResult<(CudaTensor, Keep)> {
        let (y, u) = ops::lora_forward(be, input.tensor(), &self.weights(groups), self.out)?;
        let keep = match saved.is_some() {
            true => Saved::Lora(input.activation(be)?, Arc::new(u)),
            false => Saved::Nothing,
        };
        Ok((y, Keep::Other(keep)))
    }

    fn backward(
        &mut self,
        be: &CudaBackend,
        groups: &mut Groups,
        saved: &mut Vec<Saved>,
        g: CudaTensor,
    ) -> CudaResult<CudaTensor> {
        let Some(Saved::Lora(x, u)) = saved.pop() else {
            return Err(missing());
        };
        let x = x.take(be)?;
        let inf = x.shape().get(1).copied().unwrap_or(0);
        let (dx, du) = ops::lora_backward_input(be, &g, &self.weights(groups), inf)?;
        with_grads(groups, &self.a, Some(&self.b), |mut v| {
            let Some(b_grad) = v.other.as_mut().map(|(_, grad)| grad) else {
                return Err(missing());
            };
            ops::lora_grads(be, &x, &u, &g, &du, &mut v.grad, b_grad)
        })?;
        Ok(dx)
    }
}

/// An LSTM over sequences of `length` tokens.
#[derive(Debug)]
pub(crate) struct LstmLayer {
    pub wx: ParamRef,
    pub wh: ParamRef,
    pub bias: ParamRef,
    pub length: usize,
}

impl CudaLayer for LstmLayer {
    fn describe(&self) -> String {
        format!("lstm {}", self.bias.len() / 4)
    }

    fn forward(
        &mut self,
        be: &CudaBackend,
        groups: &Groups,
        input: &Input<'_>,
        _pass: Pass,
        _saved: Option<&mut Vec<Saved>>,
    ) -> CudaResult<(CudaTensor, Keep)> {
        let (wx, wh) = (compute(groups, &self.wx), compute(groups, &self.wh));
        let bias = master(groups, &self.bias);
        let (y, kept) = ops::lstm_forward(be, input.tensor(), &wx, &wh, &bias, self.length)?;
        Ok((y, Keep::Lstm(Box::new(kept))))
    }

    fn backward(
        &mut self,
        be: &CudaBackend,
        groups: &mut Groups,
        saved: &mut Vec<Saved>,
        g: CudaTensor,
    ) -> CudaResult<CudaTensor> {
        let Some(Saved::Lstm(x, y, kept)) = saved.pop() else {
            return Err(missing());
        };
        let length = self.length;
        let d_pre = with_grads(groups, &self.wh, None, |mut v| {
            ops::lstm_backward_steps(be, &y, &g, &kept, &v.compute, &mut v.grad, length)
        })?;
        drop((y, kept));
        let x = x.take(be)?;
        with_grads(groups, &self.wx, Some(&self.bias), |mut v| {
            let bias_grad = v.other.as_mut().map(|(_, grad)| grad);
            ops::linear_backward(be, &x, &d_pre, &v.compute, &mut v.grad, bias_grad)
        })
    }
}

// The GPU forms of this family's CPU layers (`Layer::to_cuda`): each takes
// its parameters' places in the order of the CPU layer's `params_mut`.

impl EmbeddingLayer {
    pub(crate) fn from_cpu(
        cpu: &crate::layers::Embedding,
        ctx: &mut crate::cuda::layer::CudaBuildContext<'_, '_>,
    ) -> CudaResult<Box<dyn CudaLayer>> {
        let &[length] = ctx.cpu_shape() else {
            return Err(ctx.shape_error("token ids [t] (model.tokens)", ctx.cpu_shape()));
        };
        let (vocab, dim) = (cpu.vocab, cpu.dim);
        let table = ctx.param(vocab * dim)?;
        let positions = cpu
            .positions
            .is_some()
            .then(|| ctx.param(length * dim))
            .transpose()?;
        Ok(Box::new(EmbeddingLayer {
            table,
            shape: ops::EmbeddingShape {
                vocab,
                dim,
                length,
                positions: positions.is_some(),
            },
            positions,
        }))
    }
}

impl AttentionLayer {
    pub(crate) fn from_cpu(
        cpu: &crate::layers::CausalSelfAttention,
        ctx: &mut crate::cuda::layer::CudaBuildContext<'_, '_>,
    ) -> CudaResult<Box<dyn CudaLayer>> {
        let &[length, width] = ctx.cpu_shape() else {
            return Err(ctx.shape_error("a sequence [t, c]", ctx.cpu_shape()));
        };
        let heads = cpu.heads;
        if width / heads > ops::ATTENTION_MAX_HEAD {
            return Err(ctx.unsupported(format!(
                "heads of {} values; the GPU's attention kernels take at most {} \
                 (use at least {} heads in its .heads, or device.kind = \"cpu\")",
                width / heads,
                ops::ATTENTION_MAX_HEAD,
                width.div_ceil(ops::ATTENTION_MAX_HEAD)
            )));
        }
        let qkv = ctx.convert(cpu.qkv.as_ref())?;
        let proj = ctx.convert(cpu.proj.as_ref())?;
        Ok(Box::new(AttentionLayer {
            qkv: vec![qkv],
            proj: vec![proj],
            length,
            heads,
        }))
    }
}

impl LoraLayer {
    /// The base weight and bias may be frozen (a fine-tuning base); the
    /// adapters always train.
    pub(crate) fn from_cpu(
        cpu: &crate::layers::LoraLinear,
        ctx: &mut crate::cuda::layer::CudaBuildContext<'_, '_>,
    ) -> CudaResult<Box<dyn CudaLayer>> {
        let (features, out, rank) = (cpu.in_features, cpu.out_features, cpu.rank);
        let weight = ctx.param(features * out)?;
        let bias = cpu.bias.is_some().then(|| ctx.param(out)).transpose()?;
        let a = ctx.trainable_param(rank * features)?;
        let b = ctx.trainable_param(out * rank)?;
        Ok(Box::new(LoraLayer {
            weight,
            bias,
            a,
            b,
            rank,
            scale: cpu.scale,
            out,
        }))
    }
}

impl LstmLayer {
    pub(crate) fn from_cpu(
        cpu: &crate::layers::Lstm,
        ctx: &mut crate::cuda::layer::CudaBuildContext<'_, '_>,
    ) -> CudaResult<Box<dyn CudaLayer>> {
        let &[length, features] = ctx.cpu_shape() else {
            return Err(ctx.shape_error("a sequence [t, c]", ctx.cpu_shape()));
        };
        let hidden = cpu.hidden;
        let wx = ctx.trainable_param(features * 4 * hidden)?;
        let wh = ctx.trainable_param(hidden * 4 * hidden)?;
        let bias = ctx.trainable_param(4 * hidden)?;
        Ok(Box::new(LstmLayer {
            wx,
            wh,
            bias,
            length,
        }))
    }
}
