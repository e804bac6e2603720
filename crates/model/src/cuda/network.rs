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
//! a convolution or linear layer its input; batch norm its input and its
//! batch statistics (fused with the ReLU after it, the ReLU's mask comes
//! from those, and its output is kept only as the next layer's input); a standalone
//! ReLU its output; global pooling its input's shape; a fused residual block
//! (below) its body's entries, its last batch norm's input and statistics,
//! and the block's output (the ReLU's mask, which is also that batch
//! norm's). Entries are references (`Shared`), never copies: a batch norm's
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

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};

use super::backend::{CudaBackend, DeviceBuffer};
use super::error::Context;
use super::ops::{self, BatchNormConfig, BatchNormSaved, ConvPlan, ConvShape};
use super::param_group::ParamGroup;
use super::params::StepState;
use super::tensor::{AnyView, CudaTensor, DType};
use super::{CudaError, CudaResult};
use crate::layers::LoraConfig;
use crate::memory::MemoryPool;
use crate::network::{arrange, is_block, Group};
use crate::profile;
use crate::{Device, LayerSpec, ModelSpec, Network};

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

    /// Every parameter's f32 master values, in the CPU network's order.
    pub fn read_params(&self, be: &CudaBackend) -> CudaResult<Vec<Vec<f32>>> {
        let masters = [
            be.download(&self.groups[0].master.slice)?,
            be.download(&self.groups[1].master.slice)?,
            be.download(&self.groups[FROZEN].master.slice)?,
        ];
        Ok(self.split(&masters, true))
    }

    /// Every parameter's f32 gradient (times the loss scale backward was
    /// given), in the CPU network's order.
    /// A frozen parameter's is empty, as on the CPU.
    pub fn read_grads(&self, be: &CudaBackend) -> CudaResult<Vec<Vec<f32>>> {
        let grads = [
            be.download(&self.groups[0].grad.slice)?,
            be.download(&self.groups[1].grad.slice)?,
            Vec::new(),
        ];
        Ok(self.split(&grads, false))
    }

    /// One of the four lists a checkpoint holds, in the CPU network's
    /// order (a frozen parameter's moments empty, as on the CPU),
    /// downloaded tensor by tensor through `staging`, whose length sets the
    /// piece: no copy of the list is made. `visit` gets `List(count)`,
    /// then per tensor `Tensor(len)` and its values in `Values` pieces.
    pub fn stream_state<E: From<CudaError>>(
        &self,
        be: &CudaBackend,
        list: StateList,
        staging: &mut [f32],
        visit: &mut dyn FnMut(StatePiece<'_>) -> Result<(), E>,
    ) -> Result<(), E> {
        if staging.is_empty() {
            return Err(
                CudaError::shape("stream_state", "a staging buffer", "an empty one").into(),
            );
        }
        let mut tensors: Vec<CudaView<'_, f32>> = Vec::new();
        match list {
            StateList::Buffers => {
                let mut buffers = Vec::new();
                checkpointed_buffers(&self.layers, &mut buffers);
                tensors.extend(buffers.iter().map(|b| b.slice.as_view()));
            }
            StateList::Params | StateList::FirstMoments | StateList::SecondMoments => {
                for p in &self.params {
                    let group = &self.groups[p.at.group];
                    let array = match list {
                        StateList::FirstMoments => &group.first_moment.slice,
                        StateList::SecondMoments => &group.second_moment.slice,
                        _ => &group.master.slice,
                    };
                    let held = list == StateList::Params || p.at.trainable();
                    let range = if held { p.at.range() } else { 0..0 };
                    tensors.push(array.slice(range));
                }
            }
        }
        visit(StatePiece::List(tensors.len()))?;
        for tensor in &tensors {
            visit(StatePiece::Tensor(tensor.len()))?;
            let mut start = 0;
            while start < tensor.len() {
                let piece = (tensor.len() - start).min(staging.len());
                let host = &mut staging[..piece];
                be.download_into(&tensor.slice(start..start + piece), host)?;
                visit(StatePiece::Values(host))?;
                start += piece;
            }
        }
        Ok(())
    }

    /// Per-parameter values out of per-group ones; frozen parameters get
    /// theirs only when `frozen` says the frozen group has values.
    fn split(&self, groups: &[Vec<f32>; 3], frozen: bool) -> Vec<Vec<f32>> {
        self.params
            .iter()
            .map(|p| match p.at.trainable() || frozen {
                true => groups[p.at.group][p.at.range()].to_vec(),
                false => Vec::new(),
            })
            .collect()
    }

    /// Per-group values out of per-parameter ones, in the CPU's order. A
    /// frozen parameter's moments are empty (or anything: they are not
    /// used); its values are required.
    fn join(&self, what: &str, values: &[Vec<f32>]) -> Result<[Vec<f32>; 3], String> {
        if values.len() != self.params.len() {
            return Err(format!(
                "{} {what}, the model has {}",
                values.len(),
                self.params.len()
            ));
        }
        let moments = what.starts_with("moment");
        let mut host = [0, 1, FROZEN].map(|g| vec![0.0f32; self.groups[g].len()]);
        for (slot, v) in self.params.iter().zip(values) {
            if moments && !slot.at.trainable() {
                continue;
            }
            if v.len() != slot.at.len {
                return Err(format!(
                    "{} has {} values, the model expects {}",
                    slot.name,
                    v.len(),
                    slot.at.len
                ));
            }
            host[slot.at.group][slot.at.range()].copy_from_slice(v);
        }
        Ok(host)
    }

    /// The buffers a checkpoint keeps, in the CPU network's order: batch
    /// norm's running statistics (mean, var per layer) and dropout's
    /// counters.
    pub fn read_buffers(&self, be: &CudaBackend) -> CudaResult<Vec<Vec<f32>>> {
        let mut buffers = Vec::new();
        checkpointed_buffers(&self.layers, &mut buffers);
        buffers.into_iter().map(|b| be.download(&b.slice)).collect()
    }

    fn set_buffers(&mut self, be: &CudaBackend, values: &[Vec<f32>]) -> CudaResult<()> {
        let mut it = values.iter();
        let mut next = || {
            it.next().ok_or_else(|| {
                CudaError::shape("buffers", "one per statistic and counter", "too few")
            })
        };
        for_each_step_buffers(&mut self.layers, &mut |buffers| match buffers {
            StepBuffers::Running(r) => {
                copy_host(be, next()?, &mut r.mean)?;
                copy_host(be, next()?, &mut r.var)
            }
            StepBuffers::Dropout(d) => copy_host(be, next()?, &mut d.counter),
        })
    }

    /// Checks a state's shapes against the model without changing anything.
    pub fn check_state(
        &self,
        params: &[Vec<f32>],
        buffers: &[Vec<f32>],
        moments: &[Vec<f32>],
    ) -> Result<(), String> {
        self.join("parameter tensors", params)?;
        self.join("moment tensors", moments)?;
        let mut model_buffers = Vec::new();
        checkpointed_buffers(&self.layers, &mut model_buffers);
        let lens: Vec<usize> = model_buffers.iter().map(|b| b.len()).collect();
        if lens.len() != buffers.len() {
            return Err(format!(
                "{} buffers, the model has {}",
                buffers.len(),
                lens.len()
            ));
        }
        match lens.iter().zip(buffers).position(|(l, b)| *l != b.len()) {
            Some(i) => Err(format!(
                "buffer {i} has {} values, the model expects {}",
                buffers[i].len(),
                lens[i]
            )),
            None => Ok(()),
        }
    }

    /// Replaces masters (and any f16 copies), moments and running
    /// statistics; gradients are zeroed. Call `check_state` first.
    pub fn load_state(
        &mut self,
        be: &CudaBackend,
        params: &[Vec<f32>],
        buffers: &[Vec<f32>],
        moments: (&[Vec<f32>], &[Vec<f32>]),
    ) -> crate::Result<()> {
        let refuse = |reason: String| crate::ModelError::State(reason);
        let masters = self.join("parameter tensors", params).map_err(refuse)?;
        let first = self.join("moment tensors", moments.0).map_err(refuse)?;
        let second = self.join("moment tensors", moments.1).map_err(refuse)?;
        for (i, group) in self.groups.iter_mut().enumerate() {
            copy_host(be, &masters[i], &mut group.master)?;
            group.refresh_compute(be)?;
            if i != FROZEN {
                copy_host(be, &first[i], &mut group.first_moment)?;
                copy_host(be, &second[i], &mut group.second_moment)?;
                group.zero_grad(be)?;
            }
        }
        self.set_buffers(be, buffers)?;
        Ok(())
    }
}

/// A group of the given values; an empty group holds one unused zero, so
/// every group has device buffers (the optimizer leaves a zero with a zero
/// gradient at zero).
fn group_from_host(
    be: &CudaBackend,
    decay: bool,
    values: Vec<f32>,
    compute: DType,
) -> CudaResult<ParamGroup> {
    if values.is_empty() {
        return ParamGroup::from_host(be, decay, &[0.0], compute);
    }
    ParamGroup::from_host(be, decay, &values, compute)
}

fn copy_host(be: &CudaBackend, host: &[f32], dev: &mut DeviceBuffer<f32>) -> CudaResult<()> {
    if host.len() > dev.len() {
        return Err(CudaError::shape(
            "copy to device",
            format!("at most {} values", dev.len()),
            host.len().to_string(),
        ));
    }
    if host.is_empty() {
        return Ok(());
    }
    be.compute_stream()
        .memcpy_htod(host, &mut dev.slice.slice_mut(..host.len()))
        .during("cuMemcpyHtoDAsync")
}

fn for_each_step_buffers(
    layers: &mut [GpuLayer],
    f: &mut dyn FnMut(StepBuffers<'_>) -> CudaResult<()>,
) -> CudaResult<()> {
    for layer in layers {
        match layer {
            GpuLayer::BatchNorm { bn, .. } => f(StepBuffers::Running(&mut bn.running))?,
            GpuLayer::Dropout(d) => f(StepBuffers::Dropout(d))?,
            GpuLayer::Residual(body)
            | GpuLayer::Checkpointed(body)
            | GpuLayer::UnetSkip { body, .. } => for_each_step_buffers(body, f)?,
            // The body's statistics come first, as in the CPU's order.
            GpuLayer::FusedResidual { body, tail } => {
                for_each_step_buffers(body, f)?;
                f(StepBuffers::Running(&mut tail.running))?
            }
            _ => {}
        }
    }
    Ok(())
}

/// The buffers a checkpoint keeps, in the CPU's order: each batch norm's
/// running mean and variance, each dropout's counter.
fn checkpointed_buffers<'a>(layers: &'a [GpuLayer], out: &mut Vec<&'a DeviceBuffer<f32>>) {
    for layer in layers {
        match layer {
            GpuLayer::BatchNorm { bn, .. } => out.extend([&bn.running.mean, &bn.running.var]),
            GpuLayer::Dropout(d) => out.push(&d.counter),
            GpuLayer::Residual(body)
            | GpuLayer::Checkpointed(body)
            | GpuLayer::UnetSkip { body, .. } => checkpointed_buffers(body, out),
            GpuLayer::FusedResidual { body, tail } => {
                checkpointed_buffers(body, out);
                out.extend([&tail.running.mean, &tail.running.var]);
            }
            _ => {}
        }
    }
}

fn channels(path: &str, shape: &[usize]) -> CudaResult<usize> {
    match shape {
        [_, _, c] => Ok(*c),
        _ => Err(CudaError::shape(
            "CudaNetwork::build",
            format!("{path}: an image input [h, w, c]"),
            format!("{shape:?}"),
        )),
    }
}

/// One group per spec entry, in order (unfused).
fn build_groups(
    be: &CudaBackend,
    specs: &[LayerSpec],
    path: &str,
    shape: &mut Vec<usize>,
    cursor: &mut ParamCursor<'_>,
) -> CudaResult<Vec<Group<GpuLayer>>> {
    let mut groups = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        let layers = build_one(be, spec, &format!("{path}[{i}]"), shape, cursor)?;
        groups.push(Group {
            block: is_block(spec),
            layers,
        });
    }
    Ok(groups)
}

/// Folds each ReLU that directly follows a batch norm into it (one fused
/// kernel instead of two passes over the activations), and each ReLU that
/// follows a residual whose body ends in a batch norm into that batch norm,
/// with the residual's sum (a `basic_block`'s end: one kernel instead of
/// three), inside residual bodies and checkpointed segments too. A
/// checkpointed segment is fused within, so a ReLU outside a block's
/// segment stays a layer of its own.
fn fuse(layers: Vec<GpuLayer>) -> Vec<GpuLayer> {
    let mut out: Vec<GpuLayer> = Vec::with_capacity(layers.len());
    for layer in layers {
        let layer = match layer {
            GpuLayer::Residual(body) => GpuLayer::Residual(fuse(body)),
            GpuLayer::UnetSkip { body, channels } => GpuLayer::UnetSkip {
                body: fuse(body),
                channels,
            },
            GpuLayer::Checkpointed(body) => GpuLayer::Checkpointed(fuse(body)),
            GpuLayer::Relu => match out.pop() {
                Some(GpuLayer::BatchNorm { bn, relu: false }) => {
                    GpuLayer::BatchNorm { bn, relu: true }
                }
                Some(GpuLayer::Residual(mut body)) => match body.pop() {
                    Some(GpuLayer::BatchNorm { bn, relu: false }) => {
                        GpuLayer::FusedResidual { body, tail: bn }
                    }
                    last => {
                        body.extend(last);
                        out.push(GpuLayer::Residual(body));
                        GpuLayer::Relu
                    }
                },
                last => {
                    out.extend(last);
                    GpuLayer::Relu
                }
            },
            other => other,
        };
        out.push(layer);
    }
    out
}

fn set_conv_plan(layers: &mut [GpuLayer], conv: ConvPlan) {
    for layer in layers {
        match layer {
            GpuLayer::Conv { plan, .. } | GpuLayer::ConvLstm { plan, .. } => *plan = conv,
            GpuLayer::Residual(body)
            | GpuLayer::Checkpointed(body)
            | GpuLayer::UnetSkip { body, .. }
            | GpuLayer::FusedResidual { body, .. } => set_conv_plan(body, conv),
            _ => {}
        }
    }
}

fn build_one(
    be: &CudaBackend,
    spec: &LayerSpec,
    path: &str,
    shape: &mut Vec<usize>,
    cursor: &mut ParamCursor<'_>,
) -> CudaResult<Vec<GpuLayer>> {
    Ok(match spec {
        LayerSpec::Custom { name, .. } => {
            return Err(CudaError::Unsupported {
                op: "CudaNetwork::build",
                reason: format!(
                    "{path}: the custom layer \"{name}\" has no CUDA implementation; \
                     train it with device.kind = \"cpu\""
                ),
            })
        }
        LayerSpec::Conv {
            out,
            kernel,
            stride,
            padding,
            bias,
        } => {
            let cin = channels(path, shape)?;
            let pad = padding.unwrap_or(kernel / 2);
            let weight = cursor.take_trainable(path, kernel * kernel * cin * out)?;
            let bias = bias
                .then(|| cursor.take_trainable(path, *out))
                .transpose()?;
            let probe = ConvShape {
                n: 1,
                h: shape[0],
                w: shape[1],
                cin,
                cout: *out,
                k: *kernel,
                stride: *stride,
                pad,
            };
            let (oh, ow) = probe.out_hw()?;
            *shape = vec![oh, ow, *out];
            vec![GpuLayer::Conv {
                weight,
                bias,
                kernel: *kernel,
                stride: *stride,
                pad,
                cout: *out,
                plan: ConvPlan::default(),
            }]
        }
        LayerSpec::BatchNorm { momentum, eps } => {
            let c = channels(path, shape)?;
            let gamma = cursor.take_trainable(path, c)?;
            let beta = cursor.take_trainable(path, c)?;
            vec![GpuLayer::BatchNorm {
                bn: BatchNormLayer {
                    gamma,
                    beta,
                    running: Box::new(RunningStats {
                        mean: be.alloc_zeros(c)?,
                        var: be.alloc_zeros(c)?,
                        saved_mean: be.alloc_zeros(c)?,
                        saved_var: be.alloc_zeros(c)?,
                    }),
                    momentum: *momentum,
                    eps: *eps,
                },
                relu: false,
            }]
        }
        LayerSpec::Relu => vec![GpuLayer::Relu],
        LayerSpec::GlobalAvgPool => {
            let c = channels(path, shape)?;
            *shape = vec![c];
            vec![GpuLayer::GlobalAvgPool]
        }
        LayerSpec::Linear { out, bias } => {
            let features = features(path, shape)?;
            let layer = linear_layer(path, features, *out, *bias, cursor)?;
            set_features(shape, *out);
            vec![layer]
        }
        LayerSpec::LoraLinear { out, bias, lora } => {
            let features = features(path, shape)?;
            let layer = lora_layer(path, features, *out, *bias, lora, cursor)?;
            set_features(shape, *out);
            vec![layer]
        }
        LayerSpec::Embedding { dim, positions } => {
            vec![embedding_layer(path, shape, *dim, *positions, cursor)?]
        }
        LayerSpec::CausalSelfAttention { heads, lora, .. } => {
            vec![attention_layer(path, shape, *heads, lora.as_ref(), cursor)?]
        }
        LayerSpec::ConvLstm { hidden, kernel } => {
            let (Some(frames), &[h, w, channels]) = (cursor.frames, shape.as_slice()) else {
                return Err(build_error(
                    format!("{path}: frames of [h, w, c] images (model.frames)"),
                    format!("{shape:?}"),
                ));
            };
            let weight =
                cursor.take_trainable(path, kernel * kernel * (channels + hidden) * 4 * hidden)?;
            let bias = cursor.take_trainable(path, 4 * hidden)?;
            *shape = vec![h, w, *hidden];
            vec![GpuLayer::ConvLstm {
                weight,
                bias,
                shape: ops::ConvLstmShape {
                    frames,
                    h,
                    w,
                    channels,
                    hidden: *hidden,
                    kernel: *kernel,
                },
                plan: ConvPlan::default(),
                step_recompute: cursor.step_recompute,
            }]
        }
        LayerSpec::Lstm { hidden } => {
            let [length, features] = shape[..] else {
                return Err(build_error(
                    format!("{path}: a sequence [t, c]"),
                    format!("{shape:?}"),
                ));
            };
            let wx = cursor.take_trainable(path, features * 4 * hidden)?;
            let wh = cursor.take_trainable(path, hidden * 4 * hidden)?;
            let bias = cursor.take_trainable(path, 4 * hidden)?;
            *shape = vec![length, *hidden];
            vec![GpuLayer::Lstm {
                wx,
                wh,
                bias,
                length,
            }]
        }
        LayerSpec::TransformerBlock {
            heads,
            mlp_ratio,
            dropout,
            lora,
            ..
        } => transformer_block(
            be,
            path,
            shape,
            *heads,
            *mlp_ratio,
            *dropout,
            lora.as_ref(),
            cursor,
        )?,
        LayerSpec::Flatten => {
            *shape = vec![shape.iter().product()];
            vec![GpuLayer::Flatten]
        }
        LayerSpec::LayerNorm { eps } => {
            let Some(&features) = shape.last() else {
                return Err(CudaError::shape(
                    "CudaNetwork::build",
                    format!("{path}: a non-scalar input"),
                    format!("{shape:?}"),
                ));
            };
            vec![layer_norm_layer(path, features, *eps, cursor)?]
        }
        LayerSpec::Dropout { p } => vec![dropout_layer(be, path, *p, cursor)?],
        LayerSpec::Upsample2x => {
            let c = channels(path, shape)?;
            *shape = vec![2 * shape[0], 2 * shape[1], c];
            vec![GpuLayer::Upsample2x]
        }
        LayerSpec::UnetSkip { layers } => {
            let c = channels(path, shape)?;
            let mut inner = shape.clone();
            let groups = build_groups(be, layers, &format!("{path}.layers"), &mut inner, cursor)?;
            let body = groups.into_iter().flat_map(|g| g.layers).collect();
            let body_c = channels(path, &inner)?;
            if inner[..2] != shape[..2] {
                return Err(CudaError::shape(
                    "CudaNetwork::build",
                    format!(
                        "{path}: a body output of {:?} and any channels",
                        &shape[..2]
                    ),
                    format!("{inner:?}"),
                ));
            }
            *shape = vec![shape[0], shape[1], c + body_c];
            vec![GpuLayer::UnetSkip { body, channels: c }]
        }
        LayerSpec::Silu => vec![GpuLayer::Smooth(ops::Smooth::Silu)],
        LayerSpec::Gelu => vec![GpuLayer::Smooth(ops::Smooth::Gelu)],
        LayerSpec::Residual { layers } => {
            let mut inner = shape.clone();
            let groups = build_groups(be, layers, &format!("{path}.layers"), &mut inner, cursor)?;
            let body = groups.into_iter().flat_map(|g| g.layers).collect();
            vec![GpuLayer::Residual(body)]
        }
        LayerSpec::BasicBlock => {
            let body = crate::network::basic_block_body(channels(path, shape)?);
            let mut built = build_one(
                be,
                &LayerSpec::Residual { layers: body },
                path,
                shape,
                cursor,
            )?;
            built.push(GpuLayer::Relu);
            built
        }
    })
}

fn build_error(what: String, got: String) -> CudaError {
    CudaError::shape("CudaNetwork::build", what, got)
}

/// The features of a vector [c] or of each position of a sequence [t, c].
fn features(path: &str, shape: &[usize]) -> CudaResult<usize> {
    match *shape {
        [c] | [_, c] => Ok(c),
        _ => Err(build_error(
            format!("{path}: a feature vector [c] or a sequence [t, c]"),
            format!("{shape:?}"),
        )),
    }
}

fn set_features(shape: &mut [usize], out: usize) {
    if let Some(last) = shape.last_mut() {
        *last = out;
    }
}

/// A parameter pair a layer trains together or not at all (a weight and
/// its bias, γ and β): fine-tuning freezes both or neither.
fn same_freezing(path: &str, a: &ParamRef, b: Option<&ParamRef>) -> CudaResult<()> {
    match b {
        Some(b) if b.trainable() != a.trainable() => Err(CudaError::Unsupported {
            op: "CudaNetwork::build",
            reason: format!("{path}: one of its parameters frozen and the other not"),
        }),
        _ => Ok(()),
    }
}

fn linear_layer(
    path: &str,
    features: usize,
    out: usize,
    bias: bool,
    cursor: &mut ParamCursor<'_>,
) -> CudaResult<GpuLayer> {
    let weight = cursor.take(path, features * out)?;
    let bias = bias.then(|| cursor.take(path, out)).transpose()?;
    same_freezing(path, &weight, bias.as_ref())?;
    Ok(GpuLayer::Linear { weight, bias, out })
}

fn lora_layer(
    path: &str,
    features: usize,
    out: usize,
    bias: bool,
    lora: &LoraConfig,
    cursor: &mut ParamCursor<'_>,
) -> CudaResult<GpuLayer> {
    let scale = lora
        .validate(&format!("{path}.lora"), features, out)
        .map_err(|e| CudaError::Unsupported {
            op: "CudaNetwork::build",
            reason: e.to_string(),
        })?;
    let weight = cursor.take(path, features * out)?;
    let bias = bias.then(|| cursor.take(path, out)).transpose()?;
    let a = cursor.take_trainable(path, lora.r * features)?;
    let b = cursor.take_trainable(path, out * lora.r)?;
    Ok(GpuLayer::Lora(Box::new(LoraLayer {
        weight,
        bias,
        a,
        b,
        rank: lora.r,
        scale,
        out,
    })))
}

fn layer_norm_layer(
    path: &str,
    features: usize,
    eps: f32,
    cursor: &mut ParamCursor<'_>,
) -> CudaResult<GpuLayer> {
    let gamma = cursor.take(path, features)?;
    let beta = cursor.take(path, features)?;
    same_freezing(path, &gamma, Some(&beta))?;
    Ok(GpuLayer::LayerNorm { gamma, beta, eps })
}

fn dropout_layer(
    be: &CudaBackend,
    path: &str,
    p: f32,
    cursor: &mut ParamCursor<'_>,
) -> CudaResult<GpuLayer> {
    let Some(seed) = cursor.dropout_seeds.next() else {
        return Err(build_error(
            format!("a dropout seed for {path}"),
            "none left in the CPU network".to_string(),
        ));
    };
    Ok(GpuLayer::Dropout(Box::new(DropoutLayer {
        mask: ops::DropoutMask { p, seed },
        counter: be.alloc_zeros(4)?,
        saved: be.alloc_zeros(4)?,
    })))
}

fn embedding_layer(
    path: &str,
    shape: &mut Vec<usize>,
    dim: usize,
    positions: bool,
    cursor: &mut ParamCursor<'_>,
) -> CudaResult<GpuLayer> {
    let (Some(vocab), &[length]) = (cursor.vocab, shape.as_slice()) else {
        return Err(build_error(
            format!("{path}: token ids [t] (model.tokens)"),
            format!("{shape:?}"),
        ));
    };
    let table = cursor.take(path, vocab * dim)?;
    let positions_at = positions
        .then(|| cursor.take(path, length * dim))
        .transpose()?;
    *shape = vec![length, dim];
    Ok(GpuLayer::Embedding {
        table,
        positions: positions_at,
        shape: ops::EmbeddingShape {
            vocab,
            dim,
            length,
            positions,
        },
    })
}

/// A projection of attention: linear, or LoRA when the spec adapts it.
fn projection(
    path: &str,
    features: usize,
    out: usize,
    lora: Option<&LoraConfig>,
    cursor: &mut ParamCursor<'_>,
) -> CudaResult<GpuLayer> {
    match lora {
        Some(lora) => lora_layer(path, features, out, true, lora, cursor),
        None => linear_layer(path, features, out, true, cursor),
    }
}

fn attention_layer(
    path: &str,
    shape: &[usize],
    heads: usize,
    lora: Option<&LoraConfig>,
    cursor: &mut ParamCursor<'_>,
) -> CudaResult<GpuLayer> {
    let [length, width] = *shape else {
        return Err(build_error(
            format!("{path}: a sequence [t, c]"),
            format!("{shape:?}"),
        ));
    };
    if heads == 0 || !width.is_multiple_of(heads) {
        return Err(build_error(
            format!("{path}.heads: a divisor of the width {width}"),
            heads.to_string(),
        ));
    }
    if width / heads > ops::ATTENTION_MAX_HEAD {
        return Err(CudaError::Unsupported {
            op: "CudaNetwork::build",
            reason: format!(
                "{path}.heads: heads of {} values; the GPU's attention kernels take at most {} \
                 (use at least {} heads, or device.kind = \"cpu\")",
                width / heads,
                ops::ATTENTION_MAX_HEAD,
                width.div_ceil(ops::ATTENTION_MAX_HEAD)
            ),
        });
    }
    let qkv = projection(&format!("{path}.qkv"), width, 3 * width, lora, cursor)?;
    let proj = projection(&format!("{path}.proj"), width, width, lora, cursor)?;
    Ok(GpuLayer::Attention {
        qkv: vec![qkv],
        proj: vec![proj],
        length,
        heads,
    })
}

/// The CPU's pre-norm GPT block (`network::build_transformer_block`):
/// x + drop(attn(ln1(x))), then x + drop(fc_out(gelu(fc(ln2(x))))).
#[allow(clippy::too_many_arguments)]
fn transformer_block(
    be: &CudaBackend,
    path: &str,
    shape: &[usize],
    heads: usize,
    mlp_ratio: usize,
    dropout: f32,
    lora: Option<&LoraConfig>,
    cursor: &mut ParamCursor<'_>,
) -> CudaResult<Vec<GpuLayer>> {
    let width = match *shape {
        [_, width] => width,
        _ => {
            return Err(build_error(
                format!("{path}: a sequence [t, c]"),
                format!("{shape:?}"),
            ))
        }
    };
    let eps = crate::network::default_eps();
    let mut attention = vec![
        layer_norm_layer(&format!("{path}.ln1"), width, eps, cursor)?,
        attention_layer(&format!("{path}.attn"), shape, heads, lora, cursor)?,
    ];
    if dropout > 0.0 {
        attention.push(dropout_layer(be, path, dropout, cursor)?);
    }
    let hidden = width * mlp_ratio;
    let mut mlp = vec![
        layer_norm_layer(&format!("{path}.ln2"), width, eps, cursor)?,
        linear_layer(&format!("{path}.fc"), width, hidden, true, cursor)?,
        GpuLayer::Smooth(ops::Smooth::Gelu),
        linear_layer(&format!("{path}.fc_out"), hidden, width, true, cursor)?,
    ];
    if dropout > 0.0 {
        mlp.push(dropout_layer(be, path, dropout, cursor)?);
    }
    Ok(vec![GpuLayer::Residual(attention), GpuLayer::Residual(mlp)])
}

/// The storage of activations, as the groups' compute copies say.
fn activations_of(groups: &Groups) -> DType {
    match groups[DECAY].compute {
        Some(_) => DType::F16,
        None => DType::F32,
    }
}

/// The weights a layer computes with (the f16 copy, or the f32 masters).
fn compute<'a>(groups: &'a Groups, p: &ParamRef) -> AnyView<'a> {
    groups[p.group].weights(p.range())
}

/// The f32 master of a parameter (batch norm reads gamma and beta in f32).
fn master<'a>(groups: &'a Groups, p: &ParamRef) -> CudaView<'a, f32> {
    groups[p.group].master.slice.slice(p.range())
}

fn conv_shape(
    x: &CudaTensor,
    kernel: usize,
    stride: usize,
    pad: usize,
    cout: usize,
) -> CudaResult<ConvShape> {
    match *x.shape() {
        [n, h, w, cin] => Ok(ConvShape {
            n,
            h,
            w,
            cin,
            cout,
            k: kernel,
            stride,
            pad,
        }),
        _ => Err(CudaError::shape(
            "conv2d",
            "[n, h, w, c]",
            format!("{:?}", x.shape()),
        )),
    }
}

/// A list's input: lent by the caller (copied if a layer keeps it), or
/// shared (kept by reference, never copied), and then perhaps the output
/// of a batch norm + ReLU that backward can compute again instead.
enum Input<'a> {
    Lent(&'a CudaTensor),
    Shared(Shared, Option<Arc<Recomputable>>),
}

impl Input<'_> {
    fn tensor(&self) -> &CudaTensor {
        match self {
            Input::Lent(t) => t,
            Input::Shared(t, _) => t,
        }
    }

    /// The same input for a nested list (a block's body).
    fn lend(&self) -> Input<'_> {
        match self {
            Input::Lent(t) => Input::Lent(t),
            Input::Shared(t, r) => Input::Shared(Arc::clone(t), r.clone()),
        }
    }

    /// A reference to the tensor itself, to keep for backward (a copy only
    /// of a lent tensor).
    fn share(&mut self, be: &CudaBackend) -> CudaResult<Shared> {
        let shared = match self {
            Input::Lent(t) => Arc::new(t.try_clone(be)?),
            Input::Shared(t, _) => return Ok(Arc::clone(t)),
        };
        *self = Input::Shared(Arc::clone(&shared), None);
        Ok(shared)
    }

    /// What backward needs of this input, as `for_backward`, but copying a
    /// lent tensor every time.
    fn activation(&self, be: &CudaBackend) -> CudaResult<Activation> {
        Ok(match self {
            Input::Lent(t) => Activation::Kept(Arc::new(t.try_clone(be)?)),
            Input::Shared(t, None) => Activation::Kept(Arc::clone(t)),
            Input::Shared(_, Some(r)) => Activation::Recomputed(Arc::clone(r)),
        })
    }

    /// What backward needs of this input: the way to compute it again if
    /// there is one, else the tensor.
    fn for_backward(&mut self, be: &CudaBackend) -> CudaResult<Activation> {
        match self {
            Input::Shared(_, Some(r)) => Ok(Activation::Recomputed(Arc::clone(r))),
            _ => self.share(be).map(Activation::Kept),
        }
    }

    /// The input as [n, features]: the same buffer when nothing else holds
    /// it, else a copy (a lent tensor, or an output kept for backward).
    fn flattened(self, be: &CudaBackend) -> CudaResult<Input<'static>> {
        let shape = self.tensor().shape();
        let features = shape.iter().skip(1).product();
        let flat = [shape.first().copied().unwrap_or(0), features];
        let owned = self.into_owned(be)?.reshape(&flat)?;
        Ok(Input::Shared(Arc::new(owned), None))
    }

    /// The tensor itself, copied only if something else still holds it.
    fn into_owned(self, be: &CudaBackend) -> CudaResult<CudaTensor> {
        match self {
            Input::Lent(t) => t.try_clone(be),
            Input::Shared(t, _) => Arc::try_unwrap(t).or_else(|t| t.try_clone(be)),
        }
    }
}

fn forward_list(
    be: &CudaBackend,
    layers: &mut [GpuLayer],
    groups: &Groups,
    x: Input<'_>,
    pass: Pass,
    mut saved: Option<&mut Vec<Saved>>,
) -> CudaResult<CudaTensor> {
    let mut current = x;
    for layer in layers.iter_mut() {
        if let (GpuLayer::Dropout(_), Pass::Eval) = (&*layer, pass) {
            // The identity in evaluation: the input itself.
            continue;
        }
        if let GpuLayer::Flatten = layer {
            let shape = current.tensor().shape().to_vec();
            if let Some(list) = saved.as_deref_mut() {
                list.push(Saved::Shape(shape.clone()));
            }
            current = current.flattened(be)?;
            be.profile_mark(|| format!("fwd flatten in {}", profile::dims(&shape)))?;
            continue;
        }
        let (y, keep) = forward_one(be, layer, groups, &current, pass, saved.as_deref_mut())?;
        be.profile_mark(|| format!("fwd {} in {}", layer.describe(), dims(current.tensor())))?;
        let y = Arc::new(y);
        let mut recomputable = None;
        if let Some(list) = saved.as_deref_mut() {
            list.push(match keep {
                Keep::Input => Saved::Input(current.for_backward(be)?),
                Keep::InputAnd(stats) => Saved::LayerNorm(current.for_backward(be)?, stats),
                Keep::Segment => Saved::Segment(current.for_backward(be)?, pass),
                Keep::Output => Saved::Output(Activation::Kept(Arc::clone(&y))),
                Keep::Recomputed(r) => {
                    recomputable = Some(Arc::clone(&r));
                    Saved::Output(Activation::Recomputed(r))
                }
                Keep::BatchNorm { fused_relu, stats } => {
                    let input = current.share(be)?;
                    // The next layer's input, if it keeps it: computed again
                    // from this one's input where recomputing.
                    if let (
                        true,
                        Pass::Train {
                            recompute: true, ..
                        },
                    ) = (fused_relu, pass)
                    {
                        recomputable = Some(Recomputable::new(
                            Arc::clone(&input),
                            Arc::clone(&stats),
                            None,
                        ));
                    }
                    Saved::BatchNorm(Box::new(SavedBatchNorm { input, stats }))
                }
                Keep::Other(s) => s,
                Keep::Lstm(kept) => Saved::Lstm(current.for_backward(be)?, Arc::clone(&y), kept),
                Keep::ConvLstm(kept) => {
                    Saved::ConvLstm(current.for_backward(be)?, Arc::clone(&y), kept)
                }
            });
        }
        current = Input::Shared(y, recomputable);
    }
    current.into_owned(be)
}

/// What one layer's forward keeps: a reference to its input or its output
/// (the caller's, shared with the layers around it), or something of its
/// own.
enum Keep {
    Input,
    /// The input, and a layer norm's row statistics.
    InputAnd(ops::LayerNormSaved),
    /// A checkpointed segment's input.
    Segment,
    Output,
    /// The output, to be computed again in backward.
    Recomputed(Arc<Recomputable>),
    BatchNorm {
        /// With the ReLU fused, in a pass that keeps activations: the output
        /// (the next layer's input) can be computed again from the input.
        fused_relu: bool,
        stats: Arc<BatchNormSaved>,
    },
    Other(Saved),
    /// The input and output, and an LSTM's gates and cells.
    Lstm(Box<ops::LstmSaved>),
    ConvLstm(Box<ops::ConvLstmSaved>),
}

/// How a forward runs: inference (running statistics), or training (batch
/// statistics; the running ones updated unless this is the recomputation
/// of a checkpointed segment, which must leave them as the first pass did).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Pass {
    Eval,
    Train {
        update_running: bool,
        /// `CudaBuildOptions::recompute`.
        recompute: bool,
    },
}

fn forward_one(
    be: &CudaBackend,
    layer: &mut GpuLayer,
    groups: &Groups,
    input: &Input<'_>,
    pass: Pass,
    mut saved: Option<&mut Vec<Saved>>,
) -> CudaResult<(CudaTensor, Keep)> {
    let x = input.tensor();
    // Inside a checkpointed segment's first pass a training forward keeps
    // nothing: `saved` is None.
    let keeping = saved.is_some();
    Ok(match layer {
        GpuLayer::Conv {
            weight,
            bias,
            kernel,
            stride,
            pad,
            cout,
            plan,
        } => {
            let s = conv_shape(x, *kernel, *stride, *pad, *cout)?;
            let b = bias.as_ref().map(|b| compute(groups, b));
            let y = ops::conv2d_forward(be, x, &compute(groups, weight), b.as_ref(), s, *plan)?;
            (y, Keep::Input)
        }
        GpuLayer::BatchNorm { bn, relu } => {
            let (y, stats) = batch_norm_forward(be, bn, groups, x, None, *relu, pass)?;
            let Some(stats) = stats else {
                return Ok((y, Keep::Other(Saved::Nothing)));
            };
            let fused_relu = *relu && keeping;
            let stats = Arc::new(stats);
            (y, Keep::BatchNorm { fused_relu, stats })
        }
        GpuLayer::Relu => {
            let y = ops::relu_forward(be, x)?;
            (
                y,
                if keeping {
                    Keep::Output
                } else {
                    Keep::Other(Saved::Nothing)
                },
            )
        }
        GpuLayer::Residual(body) => {
            let body_input = input.lend();
            let mut y = forward_list(be, body, groups, body_input, pass, saved)?;
            ops::add_inplace(be, &mut y, x)?;
            (y, Keep::Other(Saved::Nothing))
        }
        GpuLayer::FusedResidual { body, tail } => {
            let body_input = input.lend();
            let z = forward_list(be, body, groups, body_input, pass, saved.as_deref_mut())?;
            let (y, stats) = batch_norm_forward(be, tail, groups, &z, Some(x), true, pass)?;
            // The tail's entry goes on the stack above the body's, and the
            // block's own (its output, the ReLU's mask) above that.
            let keep = match (saved, stats) {
                (Some(list), Some(stats)) => {
                    let (z, stats) = (Arc::new(z), Arc::new(stats));
                    list.push(Saved::BatchNorm(Box::new(SavedBatchNorm {
                        input: Arc::clone(&z),
                        stats: Arc::clone(&stats),
                    })));
                    let skip = match pass {
                        Pass::Train {
                            recompute: true, ..
                        } => Some(input.activation(be)?),
                        _ => None,
                    };
                    match skip {
                        Some(skip) if skip.depth() < MAX_RECOMPUTE_DEPTH => {
                            Keep::Recomputed(Recomputable::new(z, stats, Some(skip)))
                        }
                        _ => Keep::Output,
                    }
                }
                _ => Keep::Other(Saved::Nothing),
            };
            (y, keep)
        }
        GpuLayer::Checkpointed(body) => {
            let body_input = input.lend();
            let y = forward_list(be, body, groups, body_input, pass, None)?;
            (y, Keep::Segment)
        }
        GpuLayer::GlobalAvgPool => {
            let y = ops::global_avg_pool_forward(be, x)?;
            (y, Keep::Other(Saved::Shape(x.shape().to_vec())))
        }
        GpuLayer::Linear { weight, bias, out } => {
            let b = bias.as_ref().map(|b| compute(groups, b));
            let y = ops::linear_forward(be, x, &compute(groups, weight), b.as_ref(), *out)?;
            (y, Keep::Input)
        }
        GpuLayer::Smooth(kind) => (ops::smooth_forward(be, *kind, x)?, Keep::Input),
        GpuLayer::Upsample2x => (
            ops::upsample2x_forward(be, x)?,
            Keep::Other(Saved::Shape(x.shape().to_vec())),
        ),
        GpuLayer::UnetSkip { body, .. } => {
            let body_input = input.lend();
            let z = forward_list(be, body, groups, body_input, pass, saved)?;
            (
                ops::channels_concat(be, x, &z)?,
                Keep::Other(Saved::Nothing),
            )
        }
        GpuLayer::Dropout(d) => {
            // A recomputation draws the first pass's mask and counts nothing
            // (evaluation skips the layer in `forward_list`).
            let first_pass = matches!(
                pass,
                Pass::Train {
                    update_running: true,
                    ..
                }
            );
            let y = ops::dropout_apply(be, d.mask, &d.counter.slice, !first_pass, x)?;
            if first_pass {
                ops::dropout_count(be, d.mask, &mut d.counter.slice)?;
            }
            (y, Keep::Other(Saved::Nothing))
        }
        GpuLayer::LayerNorm { gamma, beta, eps } => {
            let (g, b) = (master(groups, gamma), master(groups, beta));
            let (y, stats) = ops::layer_norm_forward(be, x, &g, &b, *eps)?;
            (y, Keep::InputAnd(stats))
        }
        GpuLayer::Embedding {
            table,
            positions,
            shape,
        } => {
            let table = master(groups, table);
            let positions = positions.as_ref().map(|p| master(groups, p));
            let dtype = activations_of(groups);
            let y = ops::embedding_forward(be, x, &table, positions.as_ref(), *shape, dtype)?;
            (y, Keep::Input)
        }
        GpuLayer::ConvLstm {
            weight,
            bias,
            shape,
            plan,
            step_recompute,
        } => {
            let (w, b) = (compute(groups, weight), compute(groups, bias));
            let (y, kept) = ops::conv_lstm_forward(be, x, &w, &b, *shape, *plan, *step_recompute)?;
            (y, Keep::ConvLstm(Box::new(kept)))
        }
        GpuLayer::Lstm {
            wx,
            wh,
            bias,
            length,
        } => {
            let (wx, wh) = (compute(groups, wx), compute(groups, wh));
            let (y, kept) = ops::lstm_forward(be, x, &wx, &wh, &master(groups, bias), *length)?;
            (y, Keep::Lstm(Box::new(kept)))
        }
        GpuLayer::Lora(lora) => {
            let (y, u) = ops::lora_forward(be, x, &lora.weights(groups), lora.out)?;
            let keep = match keeping {
                true => Saved::Lora(input.activation(be)?, Arc::new(u)),
                false => Saved::Nothing,
            };
            (y, Keep::Other(keep))
        }
        GpuLayer::Attention {
            qkv,
            proj,
            length,
            heads,
        } => {
            // The projections' entries go on the stack below attention's own.
            let qkv_out = forward_list(be, qkv, groups, input.lend(), pass, saved.as_deref_mut())?;
            let (heads_out, stats) = ops::attention_forward(be, &qkv_out, *length, *heads)?;
            let heads_out = Arc::new(heads_out);
            let o = Input::Shared(Arc::clone(&heads_out), None);
            let y = forward_list(be, proj, groups, o, pass, saved)?;
            let keep = match keeping {
                true => Saved::Attention(Box::new(SavedAttention {
                    qkv: Arc::new(qkv_out),
                    heads_out,
                    stats,
                })),
                false => Saved::Nothing,
            };
            (y, Keep::Other(keep))
        }
        // A reshape of the input itself, which `forward_list` does.
        GpuLayer::Flatten => {
            return Err(CudaError::Unsupported {
                op: "CudaNetwork::forward",
                reason: "flatten outside forward_list".into(),
            })
        }
    })
}

/// A batch norm's forward, `skip` added before the ReLU when given: the
/// output, and in training the batch statistics backward needs.
#[allow(clippy::too_many_arguments)]
fn batch_norm_forward(
    be: &CudaBackend,
    bn: &mut BatchNormLayer,
    groups: &Groups,
    x: &CudaTensor,
    skip: Option<&CudaTensor>,
    relu: bool,
    pass: Pass,
) -> CudaResult<(CudaTensor, Option<BatchNormSaved>)> {
    let (g, b) = (master(groups, &bn.gamma), master(groups, &bn.beta));
    let Pass::Train { update_running, .. } = pass else {
        let cfg = BatchNormConfig {
            momentum: bn.momentum,
            eps: bn.eps,
            relu,
            update_running: false,
        };
        let mean = bn.running.mean.slice.as_view();
        let var = bn.running.var.slice.as_view();
        let y = match skip {
            None => ops::batch_norm_forward_eval(be, x, &g, &b, &mean, &var, cfg)?,
            Some(skip) => ops::batch_norm_add_forward_eval(be, x, skip, &g, &b, &mean, &var, cfg)?,
        };
        return Ok((y, None));
    };
    let cfg = BatchNormConfig {
        momentum: bn.momentum,
        eps: bn.eps,
        relu,
        update_running,
    };
    let RunningStats { mean, var, .. } = &mut *bn.running;
    let (mut mean, mut var) = (mean.slice.as_view_mut(), var.slice.as_view_mut());
    let (y, stats) = match skip {
        None => ops::batch_norm_forward_train(be, x, &g, &b, &mut mean, &mut var, cfg)?,
        Some(skip) => {
            ops::batch_norm_add_forward_train(be, x, skip, &g, &b, &mut mean, &mut var, cfg)?
        }
    };
    Ok((y, Some(stats)))
}

fn backward_list(
    be: &CudaBackend,
    layers: &mut [GpuLayer],
    groups: &mut Groups,
    saved: &mut Vec<Saved>,
    mut g: CudaTensor,
) -> CudaResult<CudaTensor> {
    for layer in layers.iter_mut().rev() {
        let out = dims(&g);
        g = backward_one(be, layer, groups, saved, g)?;
        be.profile_mark(|| format!("bwd {} out {out}", layer.describe()))?;
    }
    Ok(g)
}

/// The network's backward, down to its first layer with parameters (what
/// the layers before it saved is dropped unused).
fn backward_network(
    be: &CudaBackend,
    layers: &mut [GpuLayer],
    groups: &mut Groups,
    saved: &mut Vec<Saved>,
    mut g: CudaTensor,
) -> CudaResult<()> {
    let Some(first) = layers.iter().position(GpuLayer::may_have_params) else {
        return Ok(());
    };
    let Some((first, after)) = layers[first..].split_first_mut() else {
        return Ok(());
    };
    g = backward_list(be, after, groups, saved, g)?;
    let out = dims(&g);
    backward_params_only(be, first, groups, saved, g)?;
    be.profile_mark(|| format!("bwd {} out {out}", first.describe()))
}

/// `layer`'s parameter gradients for `g`: a convolution or linear layer
/// skips its input gradient, a UNet skip its add (and its body's first
/// input gradient), any other layer computes and drops it.
fn backward_params_only(
    be: &CudaBackend,
    layer: &mut GpuLayer,
    groups: &mut Groups,
    saved: &mut Vec<Saved>,
    g: CudaTensor,
) -> CudaResult<()> {
    match layer {
        GpuLayer::Conv {
            weight,
            bias,
            kernel,
            stride,
            pad,
            cout,
            plan,
        } if weight.trainable() => {
            let Some(Saved::Input(x)) = saved.pop() else {
                return Err(missing());
            };
            let x = x.take(be)?;
            let s = conv_shape(&x, *kernel, *stride, *pad, *cout)?;
            with_grads(groups, weight, bias.as_ref(), |mut v| {
                let bias_grad = v.other.as_mut().map(|(_, grad)| grad);
                ops::conv2d_backward_params(
                    be,
                    &x,
                    &g,
                    &v.compute,
                    &mut v.grad,
                    bias_grad,
                    s,
                    *plan,
                )
            })
        }
        GpuLayer::Linear { weight, bias, .. } if weight.trainable() => {
            let Some(Saved::Input(x)) = saved.pop() else {
                return Err(missing());
            };
            let x = x.take(be)?;
            with_grads(groups, weight, bias.as_ref(), |mut v| {
                let bias_grad = v.other.as_mut().map(|(_, grad)| grad);
                ops::linear_backward_params(be, &x, &g, &v.compute, &mut v.grad, bias_grad)
            })
        }
        // The skip's share of the gradient goes nowhere; the body is first
        // in the network too.
        GpuLayer::UnetSkip { body, channels } => {
            let _ = saved.pop().ok_or_else(missing)?;
            let (_, g_body) = ops::channels_split(be, &g, *channels)?;
            drop(g);
            backward_network(be, body, groups, saved, g_body)
        }
        _ => backward_one(be, layer, groups, saved, g).map(drop),
    }
}

/// A tensor's dimensions after the batch, for profile labels: "28x28x32".
fn dims(t: &CudaTensor) -> String {
    profile::dims(t.shape())
}

impl GpuLayer {
    /// Whether its backward may make parameter gradients (a container is
    /// taken to).
    fn may_have_params(&self) -> bool {
        !matches!(
            self,
            GpuLayer::Relu
                | GpuLayer::GlobalAvgPool
                | GpuLayer::Flatten
                | GpuLayer::Smooth(_)
                | GpuLayer::Dropout(_)
                | GpuLayer::Upsample2x
        )
    }

    /// What the layer is, for profile labels.
    fn describe(&self) -> String {
        match self {
            GpuLayer::Conv {
                kernel,
                stride,
                cout,
                ..
            } => format!("conv {kernel}x{kernel}/{stride} to {cout}"),
            GpuLayer::BatchNorm { relu: true, .. } => "batch_norm+relu".into(),
            GpuLayer::BatchNorm { relu: false, .. } => "batch_norm".into(),
            GpuLayer::Relu => "relu".into(),
            GpuLayer::Residual(_) => "residual add".into(),
            GpuLayer::FusedResidual { .. } => "residual batch_norm+add+relu".into(),
            GpuLayer::Checkpointed(_) => "checkpointed segment (its own layers apart)".into(),
            GpuLayer::GlobalAvgPool => "global_avg_pool".into(),
            GpuLayer::Linear { out, .. } => format!("linear to {out}"),
            GpuLayer::Flatten => "flatten".into(),
            GpuLayer::Smooth(kind) => kind.name().into(),
            GpuLayer::LayerNorm { .. } => "layer_norm".into(),
            GpuLayer::Dropout(d) => format!("dropout {}", d.mask.p),
            GpuLayer::Upsample2x => "upsample2x".into(),
            GpuLayer::UnetSkip { .. } => "unet_skip concat".into(),
            GpuLayer::Embedding { shape, .. } => {
                format!("embedding {}x{}", shape.vocab, shape.dim)
            }
            GpuLayer::Lora(lora) => format!("lora to {} (r {})", lora.out, lora.rank),
            GpuLayer::Lstm { bias, .. } => format!("lstm {}", bias.len / 4),
            GpuLayer::ConvLstm { shape, .. } => format!("conv_lstm {}", shape.hidden),
            GpuLayer::Attention { heads, .. } => format!("causal attention {heads} heads"),
        }
    }
}

fn missing() -> CudaError {
    CudaError::Unsupported {
        op: "CudaNetwork::backward",
        reason: "backward without a training forward before it".into(),
    }
}

/// Views of parameter `a` (the weights it computes with, its f32 master and
/// f32 gradient) and the weights and gradient of `b`, lent together to `f`
/// even when both live in one group.
struct Views<'a> {
    compute: AnyView<'a>,
    master: CudaView<'a, f32>,
    grad: CudaViewMut<'a, f32>,
    other: Option<(AnyView<'a>, CudaViewMut<'a, f32>)>,
}

/// The weights a layer computes with, from a group's fields (so that its
/// gradient can be lent mutably beside them).
fn compute_view<'a>(
    copy: &'a Option<DeviceBuffer<half::f16>>,
    master: &'a DeviceBuffer<f32>,
    range: std::ops::Range<usize>,
) -> AnyView<'a> {
    match copy {
        Some(copy) => AnyView::F16(copy.slice.slice(range)),
        None => AnyView::F32(master.slice.slice(range)),
    }
}

fn with_grads<R>(
    groups: &mut Groups,
    a: &ParamRef,
    b: Option<&ParamRef>,
    f: impl FnOnce(Views<'_>) -> R,
) -> R {
    let [first, second, _] = groups;
    let (ga, gb) = if a.group == DECAY {
        (first, second)
    } else {
        (second, first)
    };
    let compute = compute_view(&ga.compute, &ga.master, a.range());
    let master = ga.master.slice.slice(a.range());
    match b {
        Some(b) if b.group == a.group => {
            // Two disjoint ranges of one buffer: split it between them.
            let (mut low, mut high) = ga.grad.slice.split_at_mut(a.offset.max(b.offset));
            let (grad, other) = if a.offset < b.offset {
                (low.slice_mut(a.range()), high.slice_mut(0..b.len))
            } else {
                (high.slice_mut(0..a.len), low.slice_mut(b.range()))
            };
            let other_compute = compute_view(&ga.compute, &ga.master, b.range());
            f(Views {
                compute,
                master,
                grad,
                other: Some((other_compute, other)),
            })
        }
        Some(b) => f(Views {
            compute,
            master,
            grad: ga.grad.slice.slice_mut(a.range()),
            other: Some((
                compute_view(&gb.compute, &gb.master, b.range()),
                gb.grad.slice.slice_mut(b.range()),
            )),
        }),
        None => f(Views {
            compute,
            master,
            grad: ga.grad.slice.slice_mut(a.range()),
            other: None,
        }),
    }
}

fn backward_one(
    be: &CudaBackend,
    layer: &mut GpuLayer,
    groups: &mut Groups,
    saved: &mut Vec<Saved>,
    g: CudaTensor,
) -> CudaResult<CudaTensor> {
    match layer {
        GpuLayer::Residual(body) => {
            let _ = saved.pop().ok_or_else(missing)?;
            let dx = backward_list(be, body, groups, saved, g.try_clone(be)?)?;
            ops::add(be, &dx, &g)
        }
        GpuLayer::UnetSkip { body, channels } => {
            let _ = saved.pop().ok_or_else(missing)?;
            let (mut dx, g_body) = ops::channels_split(be, &g, *channels)?;
            drop(g);
            let dx_body = backward_list(be, body, groups, saved, g_body)?;
            ops::add_inplace(be, &mut dx, &dx_body)?;
            Ok(dx)
        }
        GpuLayer::FusedResidual { body, tail } => {
            let Some(Saved::Output(y)) = saved.pop() else {
                return Err(missing());
            };
            let y = y.take(be)?;
            let Some(Saved::BatchNorm(tail_saved)) = saved.pop() else {
                return Err(missing());
            };
            // The tail's backward masks g in place: g is then the gradient
            // of the skip input as well as of the tail's output.
            let SavedBatchNorm { input, stats, .. } = *tail_saved;
            let mut g = g;
            let dz = with_bn_grads(groups, tail, |gamma, gamma_grad, beta_grad| {
                ops::batch_norm_add_relu_backward(
                    be, &mut g, &input, &y, &stats, gamma, gamma_grad, beta_grad,
                )
            })?;
            // Freed before the body's backward, as the unfused path frees
            // them.
            drop((input, stats, y));
            let mut dx = backward_list(be, body, groups, saved, dz)?;
            ops::add_inplace(be, &mut dx, &g)?;
            Ok(dx)
        }
        GpuLayer::Attention {
            qkv,
            proj,
            length,
            heads,
        } => {
            let Some(Saved::Attention(kept)) = saved.pop() else {
                return Err(missing());
            };
            let d_heads = backward_list(be, proj, groups, saved, g)?;
            let SavedAttention {
                qkv: qkv_out,
                heads_out,
                stats,
            } = *kept;
            let d_qkv = ops::attention_backward(
                be, &qkv_out, &heads_out, &d_heads, &stats, *length, *heads,
            )?;
            drop((qkv_out, heads_out, stats, d_heads));
            backward_list(be, qkv, groups, saved, d_qkv)
        }
        GpuLayer::Checkpointed(body) => {
            let Some(Saved::Segment(x, Pass::Train { recompute, .. })) = saved.pop() else {
                return Err(missing());
            };
            // Recompute the segment, keeping what its backward needs this
            // time; the running statistics stay as the first pass left them.
            let mut inner = Vec::new();
            let again = Pass::Train {
                update_running: false,
                recompute,
            };
            drop(forward_list(
                be,
                body,
                groups,
                Input::Shared(x.take(be)?, None),
                again,
                Some(&mut inner),
            )?);
            backward_list(be, body, groups, &mut inner, g)
        }
        _ => {
            let entry = saved.pop().ok_or_else(missing)?;
            backward_leaf(be, layer, groups, entry, g)
        }
    }
}

fn backward_leaf(
    be: &CudaBackend,
    layer: &GpuLayer,
    groups: &mut Groups,
    entry: Saved,
    g: CudaTensor,
) -> CudaResult<CudaTensor> {
    match (layer, entry) {
        (
            GpuLayer::Conv {
                weight,
                bias,
                kernel,
                stride,
                pad,
                cout,
                plan,
            },
            Saved::Input(x),
        ) => {
            let x = x.take(be)?;
            let s = conv_shape(&x, *kernel, *stride, *pad, *cout)?;
            with_grads(groups, weight, bias.as_ref(), |mut v| {
                let bias_grad = v.other.as_mut().map(|(_, grad)| grad);
                ops::conv2d_backward(be, &x, &g, &v.compute, &mut v.grad, bias_grad, s, *plan)
            })
        }
        (GpuLayer::Linear { weight, .. }, Saved::Input(x)) if !weight.trainable() => {
            // Its bias is frozen too (`same_freezing`).
            let inf = x.take(be)?.shape().get(1).copied().unwrap_or(0);
            ops::linear_backward_input(be, &g, &compute(groups, weight), inf)
        }
        (GpuLayer::Linear { weight, bias, .. }, Saved::Input(x)) => {
            let x = x.take(be)?;
            with_grads(groups, weight, bias.as_ref(), |mut v| {
                let bias_grad = v.other.as_mut().map(|(_, grad)| grad);
                ops::linear_backward(be, &x, &g, &v.compute, &mut v.grad, bias_grad)
            })
        }
        (GpuLayer::BatchNorm { bn, relu }, Saved::BatchNorm(saved)) => {
            let SavedBatchNorm { input, stats } = *saved;
            with_bn_grads(groups, bn, |gamma, gamma_grad, beta_grad| {
                ops::batch_norm_backward(
                    be, &g, &input, &stats, gamma, gamma_grad, beta_grad, *relu,
                )
            })
        }
        (GpuLayer::Relu, Saved::Output(y)) => {
            let y = y.take(be)?;
            ops::relu_backward(be, &g, &y)
        }
        (GpuLayer::Smooth(kind), Saved::Input(x)) => {
            let x = x.take(be)?;
            ops::smooth_backward(be, *kind, &g, &x)
        }
        (GpuLayer::Flatten, Saved::Shape(shape)) => g.reshape(&shape),
        (GpuLayer::Upsample2x, Saved::Shape(shape)) => ops::upsample2x_backward(be, &g, &shape),
        (GpuLayer::Dropout(d), Saved::Nothing) => {
            ops::dropout_apply(be, d.mask, &d.counter.slice, true, &g)
        }
        (GpuLayer::LayerNorm { gamma, .. }, Saved::LayerNorm(x, stats)) if !gamma.trainable() => {
            let x = x.take(be)?;
            ops::layer_norm_backward_input(be, &g, &x, &stats, &master(groups, gamma))
        }
        (GpuLayer::LayerNorm { gamma, beta, .. }, Saved::LayerNorm(x, stats)) => {
            let x = x.take(be)?;
            with_grads(groups, gamma, Some(beta), |mut v| {
                let Some(beta_grad) = v.other.as_mut().map(|(_, grad)| grad) else {
                    return Err(missing());
                };
                ops::layer_norm_backward(be, &g, &x, &stats, &v.master, &mut v.grad, beta_grad)
            })
        }
        (GpuLayer::GlobalAvgPool, Saved::Shape(shape)) => {
            ops::global_avg_pool_backward(be, &g, &shape)
        }
        (
            GpuLayer::Lstm {
                wx,
                wh,
                bias,
                length,
            },
            Saved::Lstm(x, y, kept),
        ) => {
            let d_pre = with_grads(groups, wh, None, |mut v| {
                ops::lstm_backward_steps(be, &y, &g, &kept, &v.compute, &mut v.grad, *length)
            })?;
            drop((y, kept));
            let x = x.take(be)?;
            with_grads(groups, wx, Some(bias), |mut v| {
                let bias_grad = v.other.as_mut().map(|(_, grad)| grad);
                ops::linear_backward(be, &x, &d_pre, &v.compute, &mut v.grad, bias_grad)
            })
        }
        (
            GpuLayer::ConvLstm {
                weight,
                bias,
                shape,
                plan,
                ..
            },
            Saved::ConvLstm(x, y, kept),
        ) => {
            let x = x.take(be)?;
            with_grads(groups, weight, Some(bias), |mut v| {
                let Some((bias, bias_grad)) = v.other.as_mut() else {
                    return Err(missing());
                };
                ops::conv_lstm_backward(
                    be,
                    &x,
                    &y,
                    &g,
                    &kept,
                    &v.compute,
                    bias,
                    &mut v.grad,
                    bias_grad,
                    *shape,
                    *plan,
                )
            })
        }
        (GpuLayer::Lora(lora), Saved::Lora(x, u)) => {
            let x = x.take(be)?;
            let inf = x.shape().get(1).copied().unwrap_or(0);
            let (dx, du) = ops::lora_backward_input(be, &g, &lora.weights(groups), inf)?;
            with_grads(groups, &lora.a, Some(&lora.b), |mut v| {
                let Some(b_grad) = v.other.as_mut().map(|(_, grad)| grad) else {
                    return Err(missing());
                };
                ops::lora_grads(be, &x, &u, &g, &du, &mut v.grad, b_grad)
            })?;
            Ok(dx)
        }
        (
            GpuLayer::Embedding {
                table,
                positions,
                shape,
            },
            Saved::Input(ids),
        ) => {
            let ids = ids.take(be)?;
            embedding_grads(be, groups, &ids, &g, *table, *positions, *shape)?;
            // Ids have no gradient.
            CudaTensor::zeros(be, ids.shape(), ids.dtype())
        }
        _ => Err(missing()),
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

/// Lends a batch norm's f32 gamma and the f32 gradients of gamma and beta
/// to `f`.
fn with_bn_grads<R>(
    groups: &mut Groups,
    bn: &BatchNormLayer,
    f: impl FnOnce(
        &CudaView<'_, f32>,
        &mut CudaViewMut<'_, f32>,
        &mut CudaViewMut<'_, f32>,
    ) -> CudaResult<R>,
) -> CudaResult<R> {
    with_grads(groups, &bn.gamma, Some(&bn.beta), |mut v| {
        let Some(beta_grad) = v.other.as_mut().map(|(_, grad)| grad) else {
            return Err(missing());
        };
        f(&v.master, &mut v.grad, beta_grad)
    })
}
