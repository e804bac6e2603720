//! The token models' operations on the GPU (`sequence.cu`, and
//! cuBLAS for LoRA's low-rank products). A sequence batch [N, T, C] is an
//! [N·T, C] tensor here: a token per row.
//!
//! | wrapper | CPU reference |
//! |---|---|
//! | `embedding_forward` / `embedding_backward` | `layers::Embedding` |
//! | `attention_forward` / `attention_backward` | `layers::CausalSelfAttention` between its projections (`lean`) |
//! | `lstm_forward` / `lstm_backward_steps` + `linear_backward` | `layers::Lstm` |
//! | `lora_forward` / `lora_backward_input` + `lora_grads` | `layers::LoraLinear` |

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

use crate::cuda::backend::{CudaBackend, DeviceBuffer};
use crate::cuda::gemm::{gemm, Operand};
use crate::cuda::kernels as k;
use crate::cuda::launch::{elementwise, launch, matrix_dims, same_len, u32_of};
use crate::cuda::params::{AttnParams, EmbedParams, LstmParams};
use crate::cuda::tensor::{same_dtype, AnyView, AnyViewMut, CudaTensor, DType};
use crate::cuda::{CudaError, CudaResult};
use crate::ops::linear::cuda::{linear_backward_input, linear_forward};

/// The head size the attention kernels hold in registers and shared
/// memory (`ATTN_MAX_D` in sequence.cu).
pub const ATTENTION_MAX_HEAD: usize = 128;
/// Query or key rows per block (`ATTN_ROWS`), a warp each.
const ATTENTION_ROWS: usize = 4;

/// What an embedding looks up: `vocab` rows of `dim` in its f32 table, and
/// `length` rows of learned positions when it has them.
#[derive(Clone, Copy, Debug)]
pub struct EmbeddingShape {
    pub vocab: usize,
    pub dim: usize,
    pub length: usize,
    pub positions: bool,
}

fn embed_params(op: &'static str, ids: &CudaTensor, s: EmbeddingShape) -> CudaResult<EmbedParams> {
    if ids.dtype() != DType::F32 || ids.shape().len() != 2 || ids.shape()[1] != s.length {
        return Err(CudaError::shape(
            op,
            format!("f32 token ids [n, {}]", s.length),
            format!("{:?} {:?}", ids.dtype(), ids.shape()),
        ));
    }
    Ok(EmbedParams {
        rows: u32_of(op, ids.len())?,
        dim: u32_of(op, s.dim)?,
        length: u32_of(op, s.length)?,
        vocab: u32_of(op, s.vocab)?,
        positions: u32::from(s.positions),
    })
}

/// Token ids [n, t] (f32, as the CPU network's input) -> [n·t, dim] in
/// `dtype`: the table's row plus the position's. An id outside 0..vocab
/// gives NaN in its row (the caller checks ids on the host first).
pub fn embedding_forward(
    be: &CudaBackend,
    ids: &CudaTensor,
    table: &CudaView<'_, f32>,
    positions: Option<&CudaView<'_, f32>>,
    shape: EmbeddingShape,
    dtype: DType,
) -> CudaResult<CudaTensor> {
    let p = embed_params("embedding", ids, shape)?;
    same_len("embedding", "table", shape.vocab * shape.dim, table.len())?;
    let rows = ids.len();
    let mut y = CudaTensor::uninit(be, &[rows, shape.dim], dtype)?;
    if y.is_empty() {
        return Ok(y);
    }
    // Without positions the kernel never reads them: any f32 view will do.
    let pos = match positions {
        Some(pos) => {
            same_len(
                "embedding",
                "positions",
                shape.length * shape.dim,
                pos.len(),
            )?;
            pos
        }
        None => table,
    };
    let cfg = elementwise(y.len());
    let f = be.function(k::EMBEDDING_FORWARD.of(dtype))?;
    // SAFETY: embedding_forward_T(EmbedParams, const float* ids [rows],
    // const float* table [vocab, dim], const float* pos [length, dim], T* y
    // [rows, dim]); lengths checked above, grid-stride over rows·dim.
    unsafe {
        launch(be.compute_stream(), &f, cfg, "embedding_forward", |b| {
            b.arg(&p).arg(ids).arg(table).arg(pos).arg(&mut y);
        })
    }?;
    Ok(y)
}

/// Embedding backward: dtable += g by id and dpos += Σₙ g, each only when
/// given (a frozen table gets nothing). Ids have no gradient.
pub fn embedding_backward(
    be: &CudaBackend,
    ids: &CudaTensor,
    g: &CudaTensor,
    shape: EmbeddingShape,
    table_grad: Option<&mut CudaViewMut<'_, f32>>,
    positions_grad: Option<&mut CudaViewMut<'_, f32>>,
) -> CudaResult<()> {
    let p = embed_params("embedding backward", ids, shape)?;
    g.expect_shape("embedding backward", &[ids.len(), shape.dim])?;
    if g.is_empty() {
        return Ok(());
    }
    let stream = be.compute_stream();
    if let Some(dtable) = table_grad {
        same_len(
            "embedding backward",
            "table gradient",
            shape.vocab * shape.dim,
            dtable.len(),
        )?;
        let f = be.function(k::EMBEDDING_GRAD_TABLE.of(g.dtype()))?;
        // SAFETY: embedding_grad_table_T(EmbedParams, const float* ids
        // [rows], const T* g [rows, dim], float* dtable [vocab, dim]) with
        // the whole warps of block (32, 4) its ballot needs; warp-stride
        // over (id, 32 columns), each element read and written by one lane.
        unsafe {
            launch(
                stream,
                &f,
                warp_per_id_tile(shape),
                "embedding_grad_table",
                |b| {
                    b.arg(&p).arg(ids).arg(g).arg(dtable);
                },
            )
        }?;
    }
    if let Some(dpos) = positions_grad {
        same_len(
            "embedding backward",
            "positions gradient",
            shape.length * shape.dim,
            dpos.len(),
        )?;
        let f = be.function(k::EMBEDDING_GRAD_POSITIONS.of(g.dtype()))?;
        // SAFETY: embedding_grad_positions_T(EmbedParams, const T* g [rows,
        // dim], float* dpos [length, dim]); grid-stride over length·dim.
        unsafe {
            launch(
                stream,
                &f,
                elementwise(shape.length * shape.dim),
                "embedding_grad_positions",
                |b| {
                    b.arg(&p).arg(g).arg(dpos);
                },
            )
        }?;
    }
    Ok(())
}

/// A warp per (id, 32 columns) of the table, four warps a block.
fn warp_per_id_tile(s: EmbeddingShape) -> LaunchConfig {
    const WARPS_PER_BLOCK: usize = 4;
    let warps = s.vocab * s.dim.div_ceil(32);
    LaunchConfig {
        grid_dim: (
            warps.div_ceil(WARPS_PER_BLOCK).clamp(1, 65_535) as u32,
            1,
            1,
        ),
        block_dim: (32, WARPS_PER_BLOCK as u32, 1),
        shared_mem_bytes: 0,
    }
}

/// What attention's backward needs besides q, k, v (the qkv projection's
/// output) and o (the output projection's input): each row's log-sum-exp,
/// [n, heads, t].
#[derive(Debug)]
pub struct AttentionSaved {
    pub lse: DeviceBuffer<f32>,
}

fn attention_params(
    op: &'static str,
    qkv: &CudaTensor,
    t: usize,
    heads: usize,
) -> CudaResult<AttnParams> {
    let (rows, width3) = matrix_dims(op, "qkv [n·t, 3c]", qkv)?;
    let c = width3 / 3;
    let ok = t > 0 && heads > 0 && width3 == 3 * c && rows.is_multiple_of(t) && c % heads == 0;
    if !ok {
        return Err(CudaError::shape(
            op,
            format!("qkv [n·{t}, 3c] with c a multiple of {heads} heads"),
            format!("{:?}", qkv.shape()),
        ));
    }
    let d = c / heads;
    if d > ATTENTION_MAX_HEAD {
        return Err(CudaError::Unsupported {
            op,
            reason: format!(
                "a head of {d} values; the GPU kernels take at most {ATTENTION_MAX_HEAD} (use more heads)"
            ),
        });
    }
    Ok(AttnParams {
        n: u32_of(op, rows / t)?,
        t: u32_of(op, t)?,
        heads: u32_of(op, heads)?,
        d: u32_of(op, d)?,
        scale: 1.0 / (d as f32).sqrt(),
    })
}

/// A warp per (sample, head, position) row.
fn per_attention_row(p: &AttnParams) -> LaunchConfig {
    let rows = (p.n * p.heads * p.t) as usize;
    LaunchConfig {
        grid_dim: (rows.div_ceil(ATTENTION_ROWS).max(1) as u32, 1, 1),
        block_dim: (32, ATTENTION_ROWS as u32, 1),
        shared_mem_bytes: 0,
    }
}

/// Causal self-attention of the heads in `qkv` [n·t, 3c] (q | k | v, heads
/// side by side): the heads' outputs side by side [n·t, c], and each row's
/// log-sum-exp for backward.
pub fn attention_forward(
    be: &CudaBackend,
    qkv: &CudaTensor,
    t: usize,
    heads: usize,
) -> CudaResult<(CudaTensor, AttentionSaved)> {
    let p = attention_params("attention", qkv, t, heads)?;
    let rows = qkv.shape()[0];
    let c = qkv.shape()[1] / 3;
    let mut o = CudaTensor::uninit(be, &[rows, c], qkv.dtype())?;
    let mut lse = be.alloc::<f32>(rows * heads)?;
    if !o.is_empty() {
        let f = be.function(k::ATTENTION_FORWARD.of(qkv.dtype()))?;
        // SAFETY: attention_forward_T(AttnParams, const T* qkv [n·t, 3c], T* o
        // [n·t, c], float* lse [n·heads·t]) with block (32, 4), a warp per
        // row; d ≤ ATTN_MAX_D and the shapes were checked above.
        unsafe {
            launch(
                be.compute_stream(),
                &f,
                per_attention_row(&p),
                "attention_forward",
                |b| {
                    b.arg(&p).arg(qkv).arg(&mut o).arg(&mut lse.slice);
                },
            )
        }?;
    }
    Ok((o, AttentionSaved { lse }))
}

/// Attention backward from dO [n·t, c] (the output projection's input
/// gradient): dqkv [n·t, 3c].
pub fn attention_backward(
    be: &CudaBackend,
    qkv: &CudaTensor,
    o: &CudaTensor,
    d_o: &CudaTensor,
    saved: &AttentionSaved,
    t: usize,
    heads: usize,
) -> CudaResult<CudaTensor> {
    let op = "attention backward";
    let p = attention_params(op, qkv, t, heads)?;
    let (rows, c) = (qkv.shape()[0], qkv.shape()[1] / 3);
    o.expect_shape(op, &[rows, c])?;
    d_o.expect_shape(op, &[rows, c])?;
    same_dtype(op, qkv.dtype(), &[o.dtype(), d_o.dtype()])?;
    same_len(op, "row log-sum-exps", rows * heads, saved.lse.len())?;
    let mut dqkv = CudaTensor::uninit(be, qkv.shape(), qkv.dtype())?;
    if dqkv.is_empty() {
        return Ok(dqkv);
    }
    let mut drow = be.alloc::<f32>(rows * heads)?;
    let stream = be.compute_stream();
    let cfg = per_attention_row(&p);
    {
        let f = be.function(k::ATTENTION_BACKWARD_QUERY.of(qkv.dtype()))?;
        // SAFETY: attention_backward_query_T(AttnParams, const T* qkv, const
        // T* o, const T* dO, const float* lse, float* D [n·heads·t], T* dqkv
        // [n·t, 3c]) with block (32, 4); it writes D and the q part of dqkv.
        unsafe {
            launch(stream, &f, cfg, "attention_backward_query", |b| {
                b.arg(&p)
                    .arg(qkv)
                    .arg(o)
                    .arg(d_o)
                    .arg(&saved.lse.slice)
                    .arg(&mut drow.slice)
                    .arg(&mut dqkv);
            })
        }?;
    }
    {
        let f = be.function(k::ATTENTION_BACKWARD_KEY.of(qkv.dtype()))?;
        // SAFETY: attention_backward_key_T(AttnParams, const T* qkv, const T*
        // dO, const float* lse, const float* D, T* dqkv) with block (32, 4),
        // after the query kernel on the same stream wrote D; it writes the k
        // and v parts of dqkv.
        unsafe {
            launch(stream, &f, cfg, "attention_backward_key", |b| {
                b.arg(&p)
                    .arg(qkv)
                    .arg(d_o)
                    .arg(&saved.lse.slice)
                    .arg(&drow.slice)
                    .arg(&mut dqkv);
            })
        }?;
    }
    Ok(dqkv)
}

/// A LoRA layer's weights as the layers compute with them: the frozen base
/// W [in, out] and bias, the adapter's A [r, in] and B [out, r], and the
/// scale alpha / r.
pub struct LoraWeights<'a> {
    pub weight: AnyView<'a>,
    pub bias: Option<AnyView<'a>>,
    pub a: AnyView<'a>,
    pub b: AnyView<'a>,
    pub rank: usize,
    pub scale: f32,
}

fn operand(transpose: bool, ld: usize) -> Operand {
    Operand { transpose, ld }
}

/// y = x·W + b + s·(x·Aᵀ)·Bᵀ, and u = s·x·Aᵀ [rows, r] for backward.
pub fn lora_forward(
    be: &CudaBackend,
    x: &CudaTensor,
    w: &LoraWeights<'_>,
    out: usize,
) -> CudaResult<(CudaTensor, CudaTensor)> {
    let mut y = linear_forward(be, x, &w.weight, w.bias.as_ref(), out)?;
    let (rows, inf) = (x.shape()[0], x.shape()[1]);
    let r = w.rank;
    same_len("lora", "A [r, in]", r * inf, w.a.len())?;
    same_len("lora", "B [out, r]", out * r, w.b.len())?;
    same_dtype("lora", x.dtype(), &[w.a.dtype(), w.b.dtype()])?;
    let mut u = CudaTensor::uninit(be, &[rows, r], x.dtype())?;
    if rows == 0 || r == 0 || out == 0 {
        return Ok((y, u));
    }
    let xv = x.view();
    gemm(
        be,
        rows,
        r,
        inf,
        &xv,
        operand(false, inf),
        &w.a,
        operand(true, inf),
        &mut u.view_mut(),
        r,
        w.scale,
        0.0,
    )?;
    gemm(
        be,
        rows,
        out,
        r,
        &u.view(),
        operand(false, r),
        &w.b,
        operand(true, r),
        &mut y.view_mut(),
        out,
        1.0,
        1.0,
    )?;
    Ok((y, u))
}

/// LoRA backward's input side, which reads the weights: du = s·g·B
/// [rows, r] and dx = g·Wᵀ + du·A [rows, in].
pub fn lora_backward_input(
    be: &CudaBackend,
    g: &CudaTensor,
    w: &LoraWeights<'_>,
    inf: usize,
) -> CudaResult<(CudaTensor, CudaTensor)> {
    let rows = g.shape().first().copied().unwrap_or(0);
    let out = g.shape().get(1).copied().unwrap_or(0);
    let r = w.rank;
    same_len("lora backward", "A [r, in]", r * inf, w.a.len())?;
    same_len("lora backward", "B [out, r]", out * r, w.b.len())?;
    let mut dx = linear_backward_input(be, g, &w.weight, inf)?;
    let mut du = CudaTensor::zeros(be, &[rows, r], g.dtype())?;
    if rows == 0 || r == 0 || out == 0 || inf == 0 {
        return Ok((dx, du));
    }
    gemm(
        be,
        rows,
        r,
        out,
        &g.view(),
        operand(false, out),
        &w.b,
        operand(false, r),
        &mut du.view_mut(),
        r,
        w.scale,
        0.0,
    )?;
    gemm(
        be,
        rows,
        inf,
        r,
        &du.view(),
        operand(false, r),
        &w.a,
        operand(false, inf),
        &mut dx.view_mut(),
        inf,
        1.0,
        1.0,
    )?;
    Ok((dx, du))
}

/// LoRA backward's adapter gradients, from the forward's x and u and the
/// input side's du: dB += gᵀ·u and dA += duᵀ·x (f32; the frozen W and b
/// get none).
pub fn lora_grads(
    be: &CudaBackend,
    x: &CudaTensor,
    u: &CudaTensor,
    g: &CudaTensor,
    du: &CudaTensor,
    a_grad: &mut CudaViewMut<'_, f32>,
    b_grad: &mut CudaViewMut<'_, f32>,
) -> CudaResult<()> {
    let op = "lora backward";
    let (rows, inf) = matrix_dims(op, "x [rows, in]", x)?;
    let r = u.shape().get(1).copied().unwrap_or(0);
    let out = g.shape().get(1).copied().unwrap_or(0);
    g.expect_shape(op, &[rows, out])?;
    u.expect_shape(op, &[rows, r])?;
    du.expect_shape(op, &[rows, r])?;
    same_dtype(op, x.dtype(), &[u.dtype(), g.dtype(), du.dtype()])?;
    same_len(op, "dA", r * inf, a_grad.len())?;
    same_len(op, "dB", out * r, b_grad.len())?;
    if rows == 0 || r == 0 {
        return Ok(());
    }
    if out > 0 {
        gemm(
            be,
            out,
            r,
            rows,
            &g.view(),
            operand(true, out),
            &u.view(),
            operand(false, r),
            &mut AnyViewMut::F32(b_grad.slice_mut(..)),
            r,
            1.0,
            1.0,
        )?;
    }
    if inf > 0 {
        gemm(
            be,
            r,
            inf,
            rows,
            &du.view(),
            operand(true, r),
            &x.view(),
            operand(false, inf),
            &mut AnyViewMut::F32(a_grad.slice_mut(..)),
            inf,
            1.0,
            1.0,
        )?;
    }
    Ok(())
}

/// What an LSTM's backward needs besides its input and output: the
/// activated gates [n·t, 4H] and the cell states [n·t, H], in f32.
#[derive(Debug)]
pub struct LstmSaved {
    pub gates: DeviceBuffer<f32>,
    pub cells: DeviceBuffer<f32>,
}

fn lstm_params(n: usize, t: usize, hidden: usize, step: usize) -> CudaResult<LstmParams> {
    Ok(LstmParams {
        n: u32_of("lstm", n)?,
        t: u32_of("lstm", t)?,
        hidden: u32_of("lstm", hidden)?,
        step: u32_of("lstm", step)?,
    })
}

/// Sequences [n·t, C] -> every hidden state [n·t, H] of an LSTM with
/// weights Wx `[C, 4H]`, Wh `[H, 4H]` (compute copies) and the f32 bias `[4H]`,
/// from zero state.
pub fn lstm_forward(
    be: &CudaBackend,
    x: &CudaTensor,
    wx: &AnyView<'_>,
    wh: &AnyView<'_>,
    bias: &CudaView<'_, f32>,
    t: usize,
) -> CudaResult<(CudaTensor, LstmSaved)> {
    let (rows, c) = matrix_dims("lstm", "sequences [n·t, c]", x)?;
    let g4 = bias.len();
    let h = g4 / 4;
    if t == 0 || !rows.is_multiple_of(t) || g4 != 4 * h {
        return Err(CudaError::shape(
            "lstm",
            format!("[n·{t}, c] and a bias of 4·hidden"),
            format!("{:?} and {g4}", x.shape()),
        ));
    }
    same_len("lstm", "Wx [c, 4H]", c * g4, wx.len())?;
    same_len("lstm", "Wh [H, 4H]", h * g4, wh.len())?;
    same_dtype("lstm", x.dtype(), &[wx.dtype(), wh.dtype()])?;
    let n = rows / t;
    let mut gates = be.alloc::<f32>(rows * g4)?;
    let mut cells = be.alloc::<f32>(rows * h)?;
    let mut hs = CudaTensor::uninit(be, &[rows, h], x.dtype())?;
    if hs.is_empty() {
        return Ok((hs, LstmSaved { gates, cells }));
    }
    gemm(
        be,
        rows,
        g4,
        c,
        &x.view(),
        operand(false, c),
        wx,
        operand(false, g4),
        &mut AnyViewMut::F32(gates.slice.slice_mut(..)),
        g4,
        1.0,
        0.0,
    )?;
    let mut rec = be.alloc_zeros::<f32>(n * g4)?;
    let f = be.function(k::LSTM_CELL_FORWARD.of(x.dtype()))?;
    for step in 0..t {
        if step > 0 {
            // h_{step-1} of every sample: rows step-1, t+step-1, ...
            let previous = hs.view();
            let previous = previous.slice((step - 1) * h..previous.len());
            let mut out = AnyViewMut::F32(rec.slice.slice_mut(..));
            gemm(
                be,
                n,
                g4,
                h,
                &previous,
                operand(false, t * h),
                wh,
                operand(false, g4),
                &mut out,
                g4,
                1.0,
                0.0,
            )?;
        }
        let p = lstm_params(n, t, h, step)?;
        // SAFETY: lstm_cell_forward_T(LstmParams, const float* rec [n, 4H],
        // const float* bias [4H], float* gates [n·t, 4H], float* cells
        // [n·t, H], T* hs [n·t, H]); lengths checked above, grid-stride
        // over n·H, each thread its own unit's elements.
        unsafe {
            launch(
                be.compute_stream(),
                &f,
                elementwise(n * h),
                "lstm_cell_forward",
                |b| {
                    b.arg(&p)
                        .arg(&rec.slice)
                        .arg(bias)
                        .arg(&mut gates.slice)
                        .arg(&mut cells.slice)
                        .arg(&mut hs);
                },
            )
        }?;
    }
    Ok((hs, LstmSaved { gates, cells }))
}

/// LSTM backward through time from g [n·t, H]: dWh += Σ h_{t−1}ᵀ·d_pre_t
/// into `wh_grad`, and the pre-activation gradients d_pre [n·t, 4H] (in the
/// storage type), from which `linear_backward(x, d_pre, Wx, dWx, db)` gives
/// dWx, db and dx.
pub fn lstm_backward_steps(
    be: &CudaBackend,
    hs: &CudaTensor,
    g: &CudaTensor,
    saved: &LstmSaved,
    wh: &AnyView<'_>,
    wh_grad: &mut CudaViewMut<'_, f32>,
    t: usize,
) -> CudaResult<CudaTensor> {
    let op = "lstm backward";
    let (rows, h) = matrix_dims(op, "hidden states [n·t, H]", hs)?;
    g.expect_shape(op, &[rows, h])?;
    same_dtype(op, g.dtype(), &[hs.dtype(), wh.dtype()])?;
    let g4 = 4 * h;
    same_len(op, "Wh [H, 4H]", h * g4, wh.len())?;
    same_len(op, "dWh", h * g4, wh_grad.len())?;
    same_len(op, "gates", rows * g4, saved.gates.len())?;
    same_len(op, "cells", rows * h, saved.cells.len())?;
    if t == 0 || !rows.is_multiple_of(t) {
        return Err(CudaError::shape(
            op,
            format!("[n·{t}, H]"),
            format!("{:?}", hs.shape()),
        ));
    }
    let n = rows / t;
    let mut d_pre = CudaTensor::uninit(be, &[rows, g4], g.dtype())?;
    if d_pre.is_empty() {
        return Ok(d_pre);
    }
    let mut dh_next = be.alloc_zeros::<f32>(n * h)?;
    let mut dc_carry = be.alloc_zeros::<f32>(n * h)?;
    let f = be.function(k::LSTM_CELL_BACKWARD.of(g.dtype()))?;
    for step in (0..t).rev() {
        let p = lstm_params(n, t, h, step)?;
        {
            // SAFETY: lstm_cell_backward_T(LstmParams, const float* gates
            // [n·t, 4H], const float* cells [n·t, H], const T* g [n·t, H],
            // const float* dh_next [n, H], float* dc [n, H], T* d_pre
            // [n·t, 4H]); lengths checked above, grid-stride over n·H.
            unsafe {
                launch(
                    be.compute_stream(),
                    &f,
                    elementwise(n * h),
                    "lstm_cell_backward",
                    |b| {
                        b.arg(&p)
                            .arg(&saved.gates.slice)
                            .arg(&saved.cells.slice)
                            .arg(g)
                            .arg(&dh_next.slice)
                            .arg(&mut dc_carry.slice)
                            .arg(&mut d_pre);
                    },
                )
            }?;
        }
        if step == 0 {
            break;
        }
        // This step's rows of d_pre: step, t+step, ...
        let all = d_pre.view();
        let d_step = all.slice(step * g4..all.len());
        let previous = hs.view();
        let previous = previous.slice((step - 1) * h..previous.len());
        let mut dwh = AnyViewMut::F32(wh_grad.slice_mut(..));
        gemm(
            be,
            h,
            g4,
            n,
            &previous,
            operand(true, t * h),
            &d_step,
            operand(false, t * g4),
            &mut dwh,
            g4,
            1.0,
            1.0,
        )?;
        let mut carry = AnyViewMut::F32(dh_next.slice.slice_mut(..));
        gemm(
            be,
            n,
            h,
            g4,
            &d_step,
            operand(false, t * g4),
            wh,
            operand(true, g4),
            &mut carry,
            h,
            1.0,
            0.0,
        )?;
    }
    Ok(d_pre)
}
