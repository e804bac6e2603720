//! `CudaNetwork`: the network of a `ModelSpec` on the GPU, built from the
//! same spec as the CPU's `Network` and initialised from it, so both start
//! from the same weights and list their parameters and buffers in the same
//! order (a checkpoint moves between CPU and GPU runs).
//!
//! Storage: activations are NHWC `CudaTensor`s, f16 in mixed precision and
//! f32 in f32 training (`CudaBuildOptions::activations`); parameters live in
//! two `ParamGroup`s (weight decay on, off), each holding f32 masters, f32
//! gradients (carrying the loss scale), f32 moments and, in mixed precision,
//! the f16 compute copy the convolutions and linear layers read (in f32
//! training they read the masters); batch norm reads its f32 gamma and beta
//! from the masters. A layer's parameter is a range of a group.
//!
//! What a training forward saves for backward (a stack, popped in reverse):
//! a convolution (depthwise too) or linear layer its input; batch norm its input and its
//! batch statistics (fused with the ReLU after it, the ReLU's mask comes
//! from those, and its output is kept only as the next layer's input); a standalone
//! ReLU its output; global pooling its input's shape; a fused residual block
//! (below) its body's entries, its last batch norm's input and statistics,
//! and the block's output (the ReLU's mask, which is also that batch
//! norm's); max pooling one u32 argmax per output, and its input's shape.
//! Entries are references (`Shared`), never copies: a batch norm's
//! output and the next convolution's input are one buffer, as are a block's
//! input and its first convolution's. With `CudaBuildOptions::recompute` a
//! fused batch norm + ReLU's output and a fused residual's output are not
//! kept but computed again in backward (`Recomputable`), so that in the
//! reference model only the convolutions' outputs stay through the forward.
//!
//! Fusion (`CudaBuildOptions::fuse`, on by default) changes the kernels,
//! not the bits: batch norm followed by ReLU runs as one kernel, and a
//! residual whose body ends in a batch norm followed by a ReLU (a
//! `basic_block`) as one kernel for that batch norm's normalisation, the
//! sum and the ReLU (`bn_apply_add`, which rounds where the three unfused
//! kernels do). In its backward the batch norm's first kernel masks the
//! output gradient in place (`bn_backward_partial_mask`), which is then the
//! gradient of both the skip input and the batch norm's output, and is
//! added to the body's input gradient in place: no separate ReLU pass, no
//! masked copy and no copy of it for the body.
//!
//! Activation recomputation (`model.checkpoint`) uses the CPU network's
//! segmentation: a checkpointed segment keeps only its input after forward
//! and runs again in backward (batch norm on the same batch statistics,
//! running statistics untouched), so gradients are bit for bit those of a
//! run without it.
//!
//! Token models (`model.tokens`): the input is the ids [n, t] as f32 (the
//! CPU network's input), and a sequence [n, t, c] is stored as rows
//! [n·t, c], so linear layers, layer norms, activations and residual sums
//! are the image path's own; the logits are [n·t, vocab], a row per token.
//! The embedding keeps the ids; attention keeps its qkv projection's output,
//! the heads' output (the output projection's input, one buffer) and each
//! row's log-sum-exp, never a T×T matrix (`ops::attention_forward`); a LoRA
//! layer keeps its input and u = s·x·Aᵀ.
//!
//! Frozen parameters (a LoRA base; with `finetune.train = "lora"` all but
//! the adapters) live in a third group that holds masters and the compute
//! copy only: no gradient, no moments, and the optimizer never sees it, so
//! fine-tuning a frozen model costs no optimizer memory for it. Layers
//! compute no gradient for a frozen parameter.
//!
//! An LSTM keeps its input, its output, and its activated gates and cell
//! states in f32 (`ops::lstm_forward`).
//!
//! Frame models (`model.frames`): a batch of sequences [n, f, h, w, c] is
//! images [n·f, h, w, c] (sample s's frames at s·f ..), so the per-frame
//! layers are the image layers; a ConvLSTM keeps its input, output, and
//! every step's cells in f32, and its gates too unless `model.checkpoint`
//! is on: then backward reruns each step's gates' convolution, as the CPU
//! layer does (`ops::conv_lstm_forward`). (The
//! CPU builder already refuses a frame model whose layers would mix a
//! sample's frames: it must end in per-frame predictions.)

use std::sync::{Arc, Mutex};

use cudarc::driver::CudaSlice;

use super::backend::{CudaBackend, DeviceBuffer};
use super::ops::{self, BatchNormSaved, ConvPlan};
use super::param_group::ParamGroup;
use super::params::StepState;
use super::tensor::{CudaTensor, DType};
use super::{CudaError, CudaResult};
use crate::memory::MemoryPool;
use crate::network::arrange;
use crate::{Device, ModelSpec, Network};

mod backward;
mod build;
mod forward;
mod state;
use backward::*;
use build::*;
use forward::*;
use state::*;

/// Where one parameter lives: a range of the decay or the no-decay group.
#[derive(Clone, Copy, Debug)]
struct ParamRef {
    group: usize,
    offset: usize,
    len: usize,
}

impl ParamRef {
    fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.len
    }
}

const DECAY: usize = 0;
const NO_DECAY: usize = 1;
/// Frozen parameters: masters and compute copies only, never stepped.
const FROZEN: usize = 2;

/// The three groups: decay, no decay, frozen.
type Groups = [ParamGroup; 3];

impl ParamRef {
    fn trainable(&self) -> bool {
        self.group != FROZEN
    }
}

#[derive(Debug)]
struct RunningStats {
    mean: DeviceBuffer<f32>,
    var: DeviceBuffer<f32>,
    /// Copies taken before a step, put back if the step is not applied.
    saved_mean: DeviceBuffer<f32>,
    saved_var: DeviceBuffer<f32>,
}

/// A dropout layer's mask and its counter of training forwards (the CPU's
/// buffer: four 16-bit limbs in f32), with the copy taken before a step.
#[derive(Debug)]
struct DropoutLayer {
    mask: ops::DropoutMask,
    counter: DeviceBuffer<f32>,
    saved: DeviceBuffer<f32>,
}

/// What a step changes besides the parameters, put back if the step is
/// not applied and kept in checkpoints, in the CPU's order of buffers.
enum StepBuffers<'a> {
    Running(&'a mut RunningStats),
    Dropout(&'a mut DropoutLayer),
}

/// A batch norm's parameters, running statistics and settings.
#[derive(Debug)]
struct BatchNormLayer {
    gamma: ParamRef,
    beta: ParamRef,
    running: Box<RunningStats>,
    momentum: f32,
    eps: f32,
}

#[derive(Debug)]
enum GpuLayer {
    Conv {
        weight: ParamRef,
        bias: Option<ParamRef>,
        kernel: usize,
        stride: usize,
        pad: usize,
        cout: usize,
        /// Its algorithm and im2col workspace (`CudaBuildOptions`).
        plan: ConvPlan,
    },
    /// Depthwise convolution (direct kernels); keeps its input.
    DepthwiseConv {
        weight: ParamRef,
        bias: Option<ParamRef>,
        shape: ops::DepthwiseShape,
    },
    BatchNorm {
        bn: BatchNormLayer,
        /// Fused with the ReLU that followed it in the spec.
        relu: bool,
    },
    Relu,
    Residual(Vec<GpuLayer>),
    /// A `Residual` whose body ended in a plain batch norm, and the ReLU
    /// after it: y = relu(tail(body(x)) + x), the tail's normalisation, the
    /// sum and the ReLU in one kernel (`bn_apply_add`).
    FusedResidual {
        body: Vec<GpuLayer>,
        tail: BatchNormLayer,
    },
    /// A segment whose activations are dropped after forward and
    /// recomputed in backward (`model.checkpoint`): it keeps only its input.
    Checkpointed(Vec<GpuLayer>),
    GlobalAvgPool,
    /// Max pooling, no padding; a training forward keeps each output's
    /// argmax (u32) and the input's shape, not the input.
    MaxPool {
        kernel: usize,
        stride: usize,
    },
    Linear {
        weight: ParamRef,
        bias: Option<ParamRef>,
        out: usize,
    },
    /// [n, h, w, c] -> [n, h·w·c]: the same bytes (NHWC is the CPU's
    /// order), so no kernel; a copy only where its input is still held.
    Flatten,
    /// SiLU or GELU; keeps its input for backward.
    Smooth(ops::Smooth),
    /// Keeps nothing: backward draws the mask again.
    Dropout(Box<DropoutLayer>),
    /// Nearest-neighbour ×2; keeps the input's shape.
    Upsample2x,
    /// concat_c(x, body(x)); `channels` is x's. Keeps nothing of its own.
    UnetSkip {
        body: Vec<GpuLayer>,
        channels: usize,
    },
    /// Keeps its input, and each row's mean and rstd, for backward.
    LayerNorm {
        gamma: ParamRef,
        beta: ParamRef,
        eps: f32,
    },
    /// Token ids [n, t] (f32) -> rows [n·t, dim]; keeps the ids.
    Embedding {
        table: ParamRef,
        positions: Option<ParamRef>,
        shape: ops::EmbeddingShape,
    },
    /// Causal self-attention between its projections (each one `Linear` or
    /// `Lora` layer) over sequences of `length` tokens.
    Attention {
        qkv: Vec<GpuLayer>,
        proj: Vec<GpuLayer>,
        length: usize,
        heads: usize,
    },
    /// A linear layer with a frozen base and a trainable LoRA adapter.
    Lora(Box<LoraLayer>),
    /// A ConvLSTM over each sample's frames (images s·F .. s·F + F − 1 of
    /// the batch); keeps its input, its output, every step's cell state
    /// and, without `step_recompute` (on under `model.checkpoint`, as on
    /// the CPU), every step's activated gates.
    ConvLstm {
        weight: ParamRef,
        bias: ParamRef,
        shape: ops::ConvLstmShape,
        plan: ConvPlan,
        step_recompute: bool,
    },
    /// An LSTM over sequences of `length` tokens; keeps its input, its
    /// output, the activated gates and the cell states.
    Lstm {
        wx: ParamRef,
        wh: ParamRef,
        bias: ParamRef,
        length: usize,
    },
}

/// y = x·W + b + s·(x·Aᵀ)·Bᵀ with W and b frozen.
#[derive(Debug)]
struct LoraLayer {
    weight: ParamRef,
    bias: Option<ParamRef>,
    a: ParamRef,
    b: ParamRef,
    rank: usize,
    scale: f32,
    out: usize,
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

/// What attention keeps besides its projections' own entries.
#[derive(Debug)]
struct SavedAttention {
    qkv: Shared,
    heads_out: Shared,
    stats: ops::AttentionSaved,
}

/// A batch norm's input and statistics: all its backward reads (the fused
/// ReLU's mask too, from the input).
#[derive(Debug)]
struct SavedBatchNorm {
    input: Shared,
    stats: Arc<BatchNormSaved>,
}

/// An activation kept for backward by every layer that needs it: a batch
/// norm's output and the next convolution's input are one buffer, not two.
type Shared = Arc<CudaTensor>;

/// An activation backward needs: kept since the forward, or computed again.
#[derive(Debug)]
enum Activation {
    Kept(Shared),
    Recomputed(Arc<Recomputable>),
}

/// How deep a chain of recomputations may go: a block's output is computed
/// again only from a block input that is kept or itself a batch norm +
/// ReLU's output computed again from what is kept. In a stack of blocks
/// every third block's output is kept, so recomputing one never
/// recomputes (and holds) the whole stack's.
const MAX_RECOMPUTE_DEPTH: u8 = 2;

impl Activation {
    /// How many recomputations deep this is: 0 for a kept tensor.
    fn depth(&self) -> u8 {
        match self {
            Activation::Kept(_) => 0,
            Activation::Recomputed(r) => r.depth,
        }
    }

    /// The tensor, letting go of this hold on it (so that dropping the
    /// result frees it if nothing else holds it).
    fn take(self, be: &CudaBackend) -> CudaResult<Shared> {
        match self {
            Activation::Kept(t) => Ok(t),
            Activation::Recomputed(r) => r.get(be),
        }
    }
}

/// The output of a training batch norm + ReLU, or of a fused residual
/// block (batch norm, the skip input added, ReLU), not kept after the
/// forward (`CudaBuildOptions::recompute`) but computed again in backward
/// from the batch norm's input and statistics, which backward keeps anyway
/// (and the skip input, itself perhaps computed again). The layer that asks
/// (the next convolution's weight gradient) computes it, and it is freed
/// with that layer's backward: the batch norm's own backward takes the
/// ReLU's mask from its input. A fused block's output is asked for twice
/// (the next convolution, then the block's ReLU mask), and held between.
#[derive(Debug)]
struct Recomputable {
    input: Shared,
    stats: Arc<BatchNormSaved>,
    skip: Option<Activation>,
    /// 1 + the skip input's depth.
    depth: u8,
    value: Mutex<Option<Shared>>,
}

impl Recomputable {
    fn new(input: Shared, stats: Arc<BatchNormSaved>, skip: Option<Activation>) -> Arc<Self> {
        let depth = 1 + skip.as_ref().map_or(0, Activation::depth);
        Arc::new(Self {
            input,
            stats,
            skip,
            depth,
            value: Mutex::new(None),
        })
    }

    /// The output, computed on first use and held while this is.
    fn get(&self, be: &CudaBackend) -> CudaResult<Shared> {
        let mut value = self.lock();
        if let Some(y) = value.as_ref() {
            return Ok(Arc::clone(y));
        }
        let y = Arc::new(self.compute(be)?);
        *value = Some(Arc::clone(&y));
        Ok(y)
    }

    /// The output, computed for the caller alone unless already held.
    fn get_once(&self, be: &CudaBackend) -> CudaResult<Shared> {
        if let Some(y) = self.lock().as_ref() {
            return Ok(Arc::clone(y));
        }
        self.compute(be).map(Arc::new)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Shared>> {
        // A poisoned lock only means another thread panicked while holding
        // it; the cached value is still either absent or whole.
        self.value.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Computes the output; under `--profile` its time is a segment of its
    /// own (a layer's backward asks before it launches anything, so the
    /// segment holds the recomputation alone).
    fn compute(&self, be: &CudaBackend) -> CudaResult<CudaTensor> {
        let y = self.compute_unmarked(be)?;
        be.profile_mark(|| {
            let what = match self.skip {
                None => "batch_norm+relu",
                Some(_) => "residual batch_norm+add+relu",
            };
            format!("recompute {what} out {}", dims(&y))
        })?;
        Ok(y)
    }

    fn compute_unmarked(&self, be: &CudaBackend) -> CudaResult<CudaTensor> {
        match &self.skip {
            None => ops::batch_norm_relu_recompute(be, &self.input, None, &self.stats),
            Some(skip) => {
                // The block's input only for this sum: not held beside the
                // output (the block's first convolution computes it again),
                // so that a block's backward starts with one more activation
                // alive, not two.
                let skip = match skip {
                    Activation::Kept(t) => Arc::clone(t),
                    Activation::Recomputed(r) => r.get_once(be)?,
                };
                ops::batch_norm_relu_recompute(be, &self.input, Some(&skip), &self.stats)
            }
        }
    }
}

/// What a training forward left for backward, one entry per layer run.
#[derive(Debug)]
enum Saved {
    Input(Activation),
    /// A layer norm's input and row statistics.
    LayerNorm(Activation, ops::LayerNormSaved),
    /// A LoRA layer's input and u = s·x·Aᵀ.
    Lora(Activation, Shared),
    Attention(Box<SavedAttention>),
    /// An LSTM's input, output, gates and cells.
    Lstm(Activation, Shared, Box<ops::LstmSaved>),
    /// A ConvLSTM's input, output, gates and cells.
    ConvLstm(Activation, Shared, Box<ops::ConvLstmSaved>),
    /// A checkpointed segment's input, and how its forward ran.
    Segment(Activation, Pass),
    BatchNorm(Box<SavedBatchNorm>),
    Output(Activation),
    Shape(Vec<usize>),
    /// Max pooling's argmax per output and its input's shape.
    MaxPool(Box<ops::MaxPoolSaved>),
    Nothing,
}

/// How the network computes.
#[derive(Clone, Copy, Debug)]
pub struct CudaBuildOptions {
    /// Fuse batch norm with the ReLU after it, and a residual block's last
    /// batch norm with the block's sum and the ReLU after the block (other
    /// kernels, the same bits).
    pub fuse: bool,
    /// Storage of activations and compute weights: F16 (mixed precision,
    /// the default) or F32 (f32 training, `device.amp = false`).
    pub activations: DType,
    /// Keep a batch norm + ReLU's input, not also its output, for backward,
    /// which computes the output again where the next layer's gradient
    /// needs it (the ReLU's mask comes from the input), and a fused
    /// residual's output likewise
    /// (`device.recompute`, `Recomputable`): the same bits, one activation
    /// fewer per such layer, an elementwise pass or two more each.
    pub recompute: bool,
    /// How convolutions run: `device.conv_algorithm` (im2col + cuBLAS, or
    /// the implicit-GEMM kernel) and the bytes an im2col matrix may take at
    /// a time (`device.conv_workspace`): the batch goes through it in
    /// groups of whole images (at least one), so less memory means more,
    /// smaller matrix products.
    pub conv: ConvPlan,
}

impl Default for CudaBuildOptions {
    fn default() -> Self {
        Self {
            fuse: true,
            activations: DType::F16,
            recompute: true,
            conv: ConvPlan::default(),
        }
    }
}

/// One parameter's name and place, in the CPU network's order.
#[derive(Clone, Debug)]
struct ParamSlot {
    name: String,
    at: ParamRef,
}

/// The four lists of a checkpoint's state, for `CudaNetwork::stream_state`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateList {
    Params,
    Buffers,
    FirstMoments,
    SecondMoments,
}

/// What `CudaNetwork::stream_state` hands on, in order.
#[derive(Debug)]
pub enum StatePiece<'a> {
    List(usize),
    Tensor(usize),
    Values(&'a [f32]),
}

pub struct CudaNetwork {
    spec: ModelSpec,
    layers: Vec<GpuLayer>,
    groups: Groups,
    params: Vec<ParamSlot>,
    classes: usize,
    macs_per_sample: u64,
    activations: DType,
    recompute: bool,
    saved: Vec<Saved>,
}

impl std::fmt::Debug for CudaNetwork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaNetwork")
            .field("params", &self.params.len())
            .field("classes", &self.classes)
            .finish_non_exhaustive()
    }
}

/// Hands out parameter ranges in the CPU network's parameter order.
struct ParamCursor<'a> {
    cpu: &'a [CpuParam],
    /// The CPU network's dropout seeds, taken in order as the parameters.
    dropout_seeds: std::vec::IntoIter<u64>,
    /// `model.tokens.vocab`, for embeddings.
    vocab: Option<usize>,
    /// `model.frames`: the batch is images, F a sample.
    frames: Option<usize>,
    /// `model.checkpoint` is on: a ConvLSTM keeps its cells only.
    step_recompute: bool,
    next: usize,
    offsets: [usize; 3],
    slots: Vec<ParamSlot>,
}

/// Every parameter starts at a multiple of this many elements of its group
/// (16 bytes of the f16 compute copy, 32 of the f32 arrays), so kernels may
/// read weights 8 at a time (conv_mma.cu's 16-byte copies). The gaps are
/// zeros with zero gradients, which AdamW, clipping and the loss scaler's
/// check leave as they are; checkpoints hold each parameter's own range.
const PARAM_ALIGN: usize = 8;

/// A CPU parameter's name, length, and whether weight decay applies and
/// whether it is frozen.
struct CpuParam {
    name: String,
    len: usize,
    decay: bool,
    frozen: bool,
}

impl ParamCursor<'_> {
    /// The next parameter, for a layer that computes no gradient for it
    /// when it is frozen.
    fn take(&mut self, path: &str, len: usize) -> CudaResult<ParamRef> {
        let Some(CpuParam {
            name,
            len: cpu_len,
            decay,
            frozen,
        }) = self.cpu.get(self.next)
        else {
            return Err(CudaError::shape(
                "CudaNetwork::build",
                format!("a parameter for {path}"),
                "none left in the CPU network".to_string(),
            ));
        };
        if *cpu_len != len || !name.starts_with(path) {
            return Err(CudaError::shape(
                "CudaNetwork::build",
                format!("{path}: a parameter of {len} values"),
                format!("{name} of {cpu_len}"),
            ));
        }
        let group = match (*frozen, *decay) {
            (true, _) => FROZEN,
            (false, true) => DECAY,
            (false, false) => NO_DECAY,
        };
        let at = ParamRef {
            group,
            offset: self.offsets[group].next_multiple_of(PARAM_ALIGN),
            len,
        };
        self.offsets[group] = at.offset + len;
        self.next += 1;
        self.slots.push(ParamSlot {
            name: name.clone(),
            at,
        });
        Ok(at)
    }

    /// The next parameter, for a layer that cannot leave it out of its
    /// gradients (the image layers: fine-tuning freezes token models only).
    fn take_trainable(&mut self, path: &str, len: usize) -> CudaResult<ParamRef> {
        let at = self.take(path, len)?;
        if !at.trainable() {
            return Err(CudaError::Unsupported {
                op: "CudaNetwork::build",
                reason: format!("{path}: a frozen parameter in a layer that trains all of its own"),
            });
        }
        Ok(at)
    }
}

impl CudaNetwork {
    /// Builds the network of `spec` on the GPU with the weights the CPU's
    /// `Network::build(spec, seed)` starts from.
    pub fn build(
        be: &CudaBackend,
        spec: &ModelSpec,
        seed: u64,
        options: CudaBuildOptions,
    ) -> crate::Result<Self> {
        // The CPU network is the reference for initial values and order; it
        // is built in a private pool so it never counts against a budget.
        let mut cpu = MemoryPool::new(Device::Cpu).scope(|| Network::build(spec, seed))?;
        Self::from_cpu(be, &mut cpu, options)
    }

    /// The GPU network of a CPU network: its spec, its current weights,
    /// buffers and frozen parameters (a fine-tuning base loaded into it).
    pub fn from_cpu(
        be: &CudaBackend,
        cpu: &mut Network,
        options: CudaBuildOptions,
    ) -> crate::Result<Self> {
        let spec = cpu.spec().clone();
        let classes = cpu.num_classes();
        let macs_per_sample = cpu.macs_per_sample()?;
        let cpu_params: Vec<CpuParam> = cpu
            .params_mut()
            .iter()
            .map(|p| CpuParam {
                name: p.name.clone(),
                len: p.value.len(),
                decay: p.decay,
                frozen: p.frozen,
            })
            .collect();
        let mut cursor = ParamCursor {
            cpu: &cpu_params,
            dropout_seeds: cpu.dropout_seeds().into_iter(),
            vocab: spec.tokens.map(|t| t.vocab),
            frames: spec.frames,
            step_recompute: !spec.checkpoint.is_none(),
            next: 0,
            offsets: [0; 3],
            slots: Vec::new(),
        };
        let mut shape = match spec.tokens {
            Some(tokens) => vec![tokens.length],
            None => spec.input.to_vec(),
        };
        let groups = build_groups(be, &spec.layers, "model.layers", &mut shape, &mut cursor)?;
        let layers = arrange(groups, spec.checkpoint, GpuLayer::Checkpointed);
        let mut layers = if options.fuse { fuse(layers) } else { layers };
        set_conv_plan(&mut layers, options.conv);
        if cursor.next != cpu_params.len() {
            return Err(CudaError::shape(
                "CudaNetwork::build",
                format!("{} parameters", cpu_params.len()),
                format!("{} placed", cursor.next),
            )
            .into());
        }
        let slots = cursor.slots;
        let mut host = cursor.offsets.map(|len| vec![0.0f32; len]);
        for (slot, param) in slots.iter().zip(cpu.params_mut()) {
            host[slot.at.group][slot.at.range()].copy_from_slice(param.value.data());
        }
        let [decay, no_decay, frozen] = host;
        let groups = [
            group_from_host(be, true, decay, options.activations)?,
            group_from_host(be, false, no_decay, options.activations)?,
            ParamGroup::frozen_from_host(be, &frozen, options.activations)?,
        ];
        let mut network = Self {
            spec,
            layers,
            groups,
            params: slots,
            classes,
            macs_per_sample,
            activations: options.activations,
            recompute: options.recompute,
            saved: Vec::new(),
        };
        network.set_buffers(be, &cpu.buffer_values())?;
        Ok(network)
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    pub fn num_classes(&self) -> usize {
        self.classes
    }

    /// Multiply-adds of one sample's forward.
    pub fn macs_per_sample(&self) -> u64 {
        self.macs_per_sample
    }

    pub fn num_params(&self) -> usize {
        self.params.iter().map(|p| p.at.len).sum()
    }

    /// Parameters the optimizer updates (not in the frozen group).
    pub fn num_trainable_params(&self) -> usize {
        let trainable = self.params.iter().filter(|p| p.at.trainable());
        trainable.map(|p| p.at.len).sum()
    }

    /// The trainable parameter groups (decay, no decay), for the
    /// optimizer; the frozen group is not among them.
    pub fn groups_mut(&mut self) -> &mut [ParamGroup] {
        &mut self.groups[..FROZEN]
    }

    pub fn groups(&self) -> &[ParamGroup] {
        &self.groups[..FROZEN]
    }

    /// Values in the frozen group (none unless fine-tuning).
    pub fn num_frozen(&self) -> usize {
        let frozen = self.params.iter().filter(|p| !p.at.trainable());
        frozen.map(|p| p.at.len).sum()
    }

    /// The storage of activations and compute weights (F16: mixed
    /// precision; F32: f32 training).
    pub fn activations(&self) -> DType {
        self.activations
    }

    /// A zero batch of the network's input (dry runs): [n, h, w, c],
    /// frames [n·f, h, w, c], or token ids [n, t] (all id 0).
    pub fn zeros_input(&self, be: &CudaBackend, n: usize) -> CudaResult<CudaTensor> {
        if let Some(tokens) = self.spec.tokens {
            return CudaTensor::zeros(be, &[n, tokens.length], DType::F32);
        }
        let [h, w, c] = self.spec.input;
        let images = n * self.spec.frames.unwrap_or(1);
        CudaTensor::zeros(be, &[images, h, w, c], self.activations)
    }

    /// The storage of the input: f32 token ids, or images as the
    /// activations.
    pub fn input_dtype(&self) -> DType {
        match self.spec.tokens {
            Some(_) => DType::F32,
            None => self.activations,
        }
    }

    fn expect_input(&self, x: &CudaTensor) -> CudaResult<()> {
        if x.dtype() != self.input_dtype() {
            return Err(CudaError::Unsupported {
                op: "CudaNetwork::forward",
                reason: format!(
                    "an input stored as {:?} for a network computing in {:?}",
                    x.dtype(),
                    self.input_dtype()
                ),
            });
        }
        Ok(())
    }

    /// Training forward of a normalised batch: logits [n, classes], and
    /// what backward needs saved. Updates the batch-norm running statistics.
    pub fn forward_train(&mut self, be: &CudaBackend, x: &CudaTensor) -> CudaResult<CudaTensor> {
        self.expect_input(x)?;
        self.saved.clear();
        let mut saved = std::mem::take(&mut self.saved);
        let train = Pass::Train {
            update_running: true,
            recompute: self.recompute,
        };
        let result = forward_list(
            be,
            &mut self.layers,
            &self.groups,
            Input::Lent(x),
            train,
            Some(&mut saved),
        );
        self.saved = saved;
        result
    }

    /// Inference forward: running statistics, nothing saved.
    pub fn forward_eval(&mut self, be: &CudaBackend, x: &CudaTensor) -> CudaResult<CudaTensor> {
        self.expect_input(x)?;
        forward_list(
            be,
            &mut self.layers,
            &self.groups,
            Input::Lent(x),
            Pass::Eval,
            None,
        )
    }

    /// Backward from the logits' gradient: parameter gradients are
    /// accumulated (+=) into the groups' f32 gradients. No gradient is
    /// wanted for the network's input: the layers before the first with
    /// parameters are not run backward, and a first convolution or linear
    /// layer makes its parameters' gradients only (as the CPU network).
    pub fn backward(&mut self, be: &CudaBackend, grad_logits: &CudaTensor) -> CudaResult<()> {
        let mut saved = std::mem::take(&mut self.saved);
        let g = grad_logits.try_clone(be)?;
        let result = backward_network(be, &mut self.layers, &mut self.groups, &mut saved, g);
        self.saved.clear();
        result
    }

    /// Drops whatever a failed step left saved.
    pub fn clear_saved(&mut self) {
        self.saved.clear();
    }

    pub fn zero_grad(&mut self, be: &CudaBackend) -> CudaResult<()> {
        for group in &mut self.groups {
            group.zero_grad(be)?;
        }
        Ok(())
    }

    /// Copies the running statistics and dropout counters aside (before a
    /// step).
    pub fn save_step_buffers(&mut self, be: &CudaBackend) -> CudaResult<()> {
        for_each_step_buffers(&mut self.layers, &mut |buffers| match buffers {
            StepBuffers::Running(r) => {
                be.copy_device(&r.mean, &mut r.saved_mean)?;
                be.copy_device(&r.var, &mut r.saved_var)
            }
            StepBuffers::Dropout(d) => be.copy_device(&d.counter, &mut d.saved),
        })
    }

    /// Puts back the copies `save_step_buffers` took when the optimizer's
    /// `verdict` (on the device) says the step was skipped.
    pub fn restore_step_buffers_if_skipped(
        &mut self,
        be: &CudaBackend,
        verdict: &CudaSlice<StepState>,
    ) -> CudaResult<()> {
        for_each_step_buffers(&mut self.layers, &mut |buffers| match buffers {
            StepBuffers::Running(r) => ops::batch_norm_restore_if_skipped(
                be,
                verdict,
                (&r.saved_mean.slice, &r.saved_var.slice),
                &mut r.mean.slice,
                &mut r.var.slice,
            ),
            StepBuffers::Dropout(d) => ops::dropout_restore_if_skipped(
                be,
                d.mask,
                verdict,
                &d.saved.slice,
                &mut d.counter.slice,
            ),
        })
    }

    /// Puts back the copies `save_step_buffers` took (a step that failed
    /// part-way, or a dry run).
    pub fn restore_step_buffers(&mut self, be: &CudaBackend) -> CudaResult<()> {
        for_each_step_buffers(&mut self.layers, &mut |buffers| match buffers {
            StepBuffers::Running(r) => {
                be.copy_device(&r.saved_mean, &mut r.mean)?;
                be.copy_device(&r.saved_var, &mut r.var)
            }
            StepBuffers::Dropout(d) => be.copy_device(&d.saved, &mut d.counter),
        })
    }
}
