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
//! Each layer is a `CudaLayer` (`cuda::layer`), a struct in its op
//! family's folder (`ops/<family>/layer.rs`) or a generic container
//! (`cuda::containers`); this module holds only what is network-wide: the
//! build from the spec (`build.rs`: parameter order, groups, the fusion
//! pass), the forward and backward walks (`forward.rs`, `backward.rs`) and
//! the state (`state.rs`), asking each layer through the trait.
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

use cudarc::driver::CudaSlice;

use super::backend::CudaBackend;
use super::layer::{
    fuse_tagged, Activation, CudaLayer, Groups, Input, ParamRef, Pass, Saved, StepBuffers, DECAY,
    FROZEN, NO_DECAY,
};
use super::ops::{self, ConvPlan};
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
pub use backward::{backward_list, backward_network, backward_network_with};
use build::*;
pub use forward::forward_list;
use state::*;

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

/// Where each group's parameters of a top-level layer and of every layer
/// after it begin (decay, no decay, frozen): once backward has passed a
/// layer, the gradients at and above its floor are final.
pub type Floor = [usize; 3];

pub struct CudaNetwork {
    spec: ModelSpec,
    layers: Vec<Box<dyn CudaLayer>>,
    /// One per top-level layer (`Floor`).
    floors: Vec<Floor>,
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
    /// `model.frames`: the batch is images, F a sample.
    frames: Option<usize>,
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

/// What a layer's `Layer::to_cuda` gets: the backend (to allocate its own
/// device buffers), its path, its input shape, and the places of its
/// parameters, handed out in the CPU network's order. A container converts
/// its layers through it (`convert_all`), so they take their places in
/// order.
pub struct CudaBuildContext<'a, 'c> {
    be: &'a CudaBackend,
    cursor: &'a mut ParamCursor<'c>,
    path: &'a str,
    /// The layer's per-sample input shape as the CPU network sees it.
    shape: &'a [usize],
}

impl CudaBuildContext<'_, '_> {
    pub fn backend(&self) -> &CudaBackend {
        self.be
    }

    /// Where the layer is in the spec (`model.layers[3]`), for errors.
    pub fn path(&self) -> &str {
        self.path
    }

    /// The per-sample input shape as the GPU network sees it: the CPU
    /// network's, except that in a frame model (`model.frames`) a sample's
    /// frames are images of the batch, so [t, h, w, c] is [h, w, c].
    pub fn input_shape(&self) -> &[usize] {
        match (self.cursor.frames, self.shape) {
            (Some(_), [_, frame @ ..]) if frame.len() == 3 => frame,
            (_, shape) => shape,
        }
    }

    /// The place of the layer's next parameter, of `len` values: call it
    /// once per parameter, in the order of the CPU layer's `params_mut`.
    /// Its values are the CPU layer's; a frozen one (fine-tuning) is in
    /// the frozen group (`ParamRef::trainable`).
    pub fn param(&mut self, len: usize) -> CudaResult<ParamRef> {
        self.cursor.take(self.path, len)
    }

    /// `param` for a layer that always computes its parameters' gradients
    /// (the image layers: fine-tuning freezes token models only): a frozen
    /// one is an error naming the layer.
    pub fn trainable_param(&mut self, len: usize) -> CudaResult<ParamRef> {
        self.cursor.take_trainable(self.path, len)
    }

    /// A parameter pair a layer trains together or not at all (a weight
    /// and its bias, γ and β): fine-tuning freezes both or neither.
    pub(crate) fn same_freezing(&self, a: &ParamRef, b: Option<&ParamRef>) -> CudaResult<()> {
        match b {
            Some(b) if b.trainable() != a.trainable() => {
                Err(self.unsupported("one of its parameters frozen and the other not"))
            }
            _ => Ok(()),
        }
    }

    /// The CPU network's per-sample input shape of the layer (frames kept).
    pub(crate) fn cpu_shape(&self) -> &[usize] {
        self.shape
    }

    /// `model.frames`: the frames of a sample, which the GPU batches as
    /// images.
    pub(crate) fn frames(&self) -> Option<usize> {
        self.cursor.frames
    }

    /// The next dropout layer's seed: the CPU network's, in its order, so
    /// both devices draw the same masks.
    pub(crate) fn dropout_seed(&mut self) -> CudaResult<u64> {
        self.cursor.dropout_seeds.next().ok_or_else(|| {
            build_error(
                format!("a dropout seed for {}", self.path),
                "none left in the CPU network".to_string(),
            )
        })
    }

    /// A shape error naming the layer: it needs `what`, it got `got`.
    pub(crate) fn shape_error(&self, what: &str, got: impl std::fmt::Debug) -> CudaError {
        build_error(format!("{}: {what}", self.path), format!("{got:?}"))
    }

    /// A refusal naming the layer: the GPU cannot run it, because `reason`.
    pub(crate) fn unsupported(&self, reason: impl std::fmt::Display) -> CudaError {
        CudaError::Unsupported {
            op: "CudaNetwork::build",
            reason: format!("{}: {reason}", self.path),
        }
    }

    /// The GPU forms of `layers`, a container's body, in order, from this
    /// layer's input shape; each takes its parameters' places in turn.
    pub fn convert_all(
        &mut self,
        layers: &[Box<dyn crate::Layer>],
    ) -> CudaResult<Vec<Box<dyn CudaLayer>>> {
        convert_all(self.be, self.cursor, self.path, self.shape, layers)
    }

    /// The GPU form of `layer`, which sees this layer's input shape (an
    /// attention's projection).
    pub fn convert(&mut self, layer: &dyn crate::Layer) -> CudaResult<Box<dyn CudaLayer>> {
        convert(self.be, self.cursor, self.path, self.shape, layer)
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
            frames: spec.frames,
            next: 0,
            offsets: [0; 3],
            slots: Vec::new(),
        };
        let groups = build_groups(be, cpu, &mut cursor)?;
        // A checkpointed segment's floor is its first layer's; an empty one
        // (no layers) finalises nothing.
        let layers = arrange(groups, spec.checkpoint, |members| {
            let floor = members.first().map_or([usize::MAX; 3], |m| m.0);
            (
                floor,
                checkpointed(members.into_iter().map(|m| m.1).collect()),
            )
        });
        let layers = if options.fuse {
            fuse_tagged(layers)
        } else {
            layers
        };
        let (floors, mut layers): (Vec<Floor>, Vec<Box<dyn CudaLayer>>) =
            layers.into_iter().unzip();
        layers
            .iter_mut()
            .for_each(|l| l.set_conv_plan(options.conv));
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
            floors,
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

    /// `backward`, calling `after_layer` once each top-level layer's
    /// backward is queued, with the lowest floor passed so far: every
    /// gradient at or above it (per group) is final, so a data-parallel
    /// rank can start reducing it while backward goes on.
    pub fn backward_with(
        &mut self,
        be: &CudaBackend,
        grad_logits: &CudaTensor,
        after_layer: &mut dyn FnMut(&mut Groups, &Floor) -> CudaResult<()>,
    ) -> CudaResult<()> {
        let mut saved = std::mem::take(&mut self.saved);
        let g = grad_logits.try_clone(be)?;
        let result = backward_network_with(
            be,
            &mut self.layers,
            &self.floors,
            &mut self.groups,
            &mut saved,
            g,
            after_layer,
        );
        self.saved.clear();
        result
    }

    /// Each top-level layer's floor, in order (`Floor`).
    pub fn floors(&self) -> &[Floor] {
        &self.floors
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
