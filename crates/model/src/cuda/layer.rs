//! One GPU layer: the `CudaLayer` trait every layer of a `CudaNetwork`
//! implements, and what its forward and backward pass between them.
//!
//! Design: a CPU `Layer` is the declaration of a layer; its GPU form (if it
//! has one) is a `Box<dyn CudaLayer>` that lives in its op family's folder
//! (`crate::ops::<family>::layer`), beside the launches it makes. The
//! network (`cuda::network`) only walks a list of them: forward in order,
//! backward in reverse, and its state code asks each for its step buffers
//! (batch norm's running statistics, dropout's counters). Containers
//! (residual, checkpointed segment, UNet skip, attention) hold
//! `Vec<Box<dyn CudaLayer>>` and walk it with `forward_list` /
//! `backward_list`. Fusions are asked of the layers (`absorb_relu`,
//! `into_batch_norm`), never matched on a closed list.
//!
//! Memory: a layer owns its settings and its own device buffers (running
//! statistics, counters); its parameters are ranges (`ParamRef`) of the
//! network's groups (`Groups`), which it reads through `compute`/`master`
//! and writes gradients into through `with_grads`. What a training forward
//! keeps for backward is one `Saved` entry per layer on the network's
//! stack, a reference (`Shared`) to the activation, never a copy.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaView, CudaViewMut};

use super::backend::{CudaBackend, DeviceBuffer};
use super::ops::{self, BatchNormSaved, ConvPlan, ConvShape};
use super::param_group::ParamGroup;
use super::tensor::{AnyView, CudaTensor, DType};
use super::{CudaError, CudaResult};
use crate::profile;

pub use crate::ops::batch_norm::layer::{BatchNormLayer, RunningStats};
pub use crate::ops::sequence::layer::SavedAttention;

/// A layer of a `CudaNetwork`. Implement it (and `Layer::to_cuda` on the
/// CPU layer) to give a layer of your own a GPU form; every method but
/// `describe`, `forward` and `backward` has a default for a layer with no
/// buffers, no fusions and no nested layers.
pub trait CudaLayer: std::fmt::Debug + Send + Sync {
    /// What the layer is, for profile labels.
    fn describe(&self) -> String;

    /// Its output for `input`, and what backward needs kept (`Keep`). In
    /// training (`Pass::Train`) `saved` is the stack the walk pushes `Keep`
    /// onto; a layer pushes its own entries there only when it nests
    /// layers. `saved` is None in inference and in a checkpointed
    /// segment's first pass: then keep nothing (`Keep::Other(Saved::Nothing)`).
    fn forward(
        &mut self,
        be: &CudaBackend,
        groups: &Groups,
        input: &Input<'_>,
        pass: Pass,
        saved: Option<&mut Vec<Saved>>,
    ) -> CudaResult<(CudaTensor, Keep)>;

    /// The input gradient for the output gradient `g`; pops what its
    /// forward pushed (one entry, unless it nests layers) and ACCUMULATES
    /// (+=) its parameters' gradients into `groups`.
    fn backward(
        &mut self,
        be: &CudaBackend,
        groups: &mut Groups,
        saved: &mut Vec<Saved>,
        g: CudaTensor,
    ) -> CudaResult<CudaTensor>;

    /// Backward of the network's first layer with parameters: the
    /// parameters' gradients only (a layer may skip its input gradient).
    fn backward_params_only(
        &mut self,
        be: &CudaBackend,
        groups: &mut Groups,
        saved: &mut Vec<Saved>,
        g: CudaTensor,
    ) -> CudaResult<()> {
        self.backward(be, groups, saved, g).map(drop)
    }

    /// Whether its backward may make parameter gradients (a container is
    /// taken to).
    fn may_have_params(&self) -> bool {
        true
    }

    /// The identity in inference (dropout): the walk skips it.
    fn eval_identity(&self) -> bool {
        false
    }

    /// [n, ...] -> [n, features] of the same bytes (flatten): the walk
    /// reshapes its input itself, with no kernel, keeping the shape.
    fn flattens(&self) -> bool {
        false
    }

    /// A standalone ReLU, which the fusion folds into the layer before it.
    fn is_relu(&self) -> bool {
        false
    }

    /// Takes in the ReLU that follows it: `InPlace` (batch norm now ends in
    /// a ReLU), `Replace` (a residual whose body ends in a plain batch norm
    /// becomes a fused one), or `No`.
    fn absorb_relu(&mut self) -> Absorbed {
        Absorbed::No
    }

    /// A batch norm with no ReLU fused in, which a residual's fusion takes
    /// as its tail (`into_batch_norm`).
    fn is_plain_batch_norm(&self) -> bool {
        false
    }

    /// This layer as a plain batch norm, when `is_plain_batch_norm`.
    fn into_batch_norm(self: Box<Self>) -> Option<BatchNormLayer> {
        None
    }

    /// Fuses the layers it nests (`fuse`).
    fn fuse_within(&mut self) {}

    /// Sets how its convolutions run (its nested layers' too).
    fn set_conv_plan(&mut self, _plan: ConvPlan) {}

    /// Hands `f` what a step changes besides the parameters, in the CPU's
    /// order of buffers (its nested layers' in order).
    fn step_buffers(
        &mut self,
        _f: &mut dyn FnMut(StepBuffers<'_>) -> CudaResult<()>,
    ) -> CudaResult<()> {
        Ok(())
    }

    /// The buffers a checkpoint keeps, in the CPU's order.
    fn checkpointed_buffers<'a>(&'a self, _out: &mut Vec<&'a DeviceBuffer<f32>>) {}
}

/// What `CudaLayer::absorb_relu` did.
pub enum Absorbed {
    No,
    InPlace,
    Replace(Box<dyn CudaLayer>),
}

/// Folds each ReLU that directly follows a batch norm into it (one fused
/// kernel instead of two passes over the activations), and each ReLU that
/// follows a residual whose body ends in a batch norm into that batch norm,
/// with the residual's sum (a `basic_block`'s end: one kernel instead of
/// three), inside residual bodies and checkpointed segments too. A
/// checkpointed segment is fused within, so a ReLU outside a block's
/// segment stays a layer of its own.
pub(crate) fn fuse(layers: Vec<Box<dyn CudaLayer>>) -> Vec<Box<dyn CudaLayer>> {
    let tagged = layers.into_iter().map(|layer| ((), layer)).collect();
    fuse_tagged(tagged)
        .into_iter()
        .map(|(_, layer)| layer)
        .collect()
}

/// `fuse` over layers that carry a tag each: a ReLU folded into the layer
/// before it leaves that layer's tag (a ReLU has no parameters).
pub(crate) fn fuse_tagged<T>(layers: Vec<(T, Box<dyn CudaLayer>)>) -> Vec<(T, Box<dyn CudaLayer>)> {
    let mut out: Vec<(T, Box<dyn CudaLayer>)> = Vec::with_capacity(layers.len());
    for (tag, mut layer) in layers {
        layer.fuse_within();
        if layer.is_relu() {
            if let Some((_, last)) = out.last_mut() {
                match last.absorb_relu() {
                    Absorbed::InPlace => continue,
                    Absorbed::Replace(fused) => {
                        *last = fused;
                        continue;
                    }
                    Absorbed::No => {}
                }
            }
        }
        out.push((tag, layer));
    }
    out
}

/// Where one parameter lives: a range of the decay, no-decay or frozen
/// group.
#[derive(Clone, Copy, Debug)]
pub struct ParamRef {
    pub(crate) group: usize,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

impl ParamRef {
    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.len
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the optimizer updates it (it is not in the frozen group).
    pub fn trainable(&self) -> bool {
        self.group != FROZEN
    }
}

pub(crate) const DECAY: usize = 0;
pub(crate) const NO_DECAY: usize = 1;
/// Frozen parameters: masters and compute copies only, never stepped.
pub(crate) const FROZEN: usize = 2;

/// The three groups: decay, no decay, frozen.
pub type Groups = [ParamGroup; 3];

/// A dropout layer's mask and its counter of training forwards (the CPU's
/// buffer: four 16-bit limbs in f32), with the copy taken before a step.
#[derive(Debug)]
pub struct DropoutLayer {
    pub(crate) mask: ops::DropoutMask,
    pub(crate) counter: DeviceBuffer<f32>,
    pub(crate) saved: DeviceBuffer<f32>,
}

/// What a step changes besides the parameters, put back if the step is
/// not applied and kept in checkpoints, in the CPU's order of buffers.
pub enum StepBuffers<'a> {
    Running(&'a mut RunningStats),
    Dropout(&'a mut DropoutLayer),
}

/// A batch norm's input and statistics: all its backward reads (the fused
/// ReLU's mask too, from the input).
#[derive(Debug)]
pub struct SavedBatchNorm {
    pub input: Shared,
    pub stats: Arc<BatchNormSaved>,
}

/// An activation kept for backward by every layer that needs it: a batch
/// norm's output and the next convolution's input are one buffer, not two.
pub type Shared = Arc<CudaTensor>;

/// An activation backward needs: kept since the forward, or computed again.
#[derive(Debug)]
pub enum Activation {
    Kept(Shared),
    Recomputed(Arc<Recomputable>),
}

/// How deep a chain of recomputations may go: a block's output is computed
/// again only from a block input that is kept or itself a batch norm +
/// ReLU's output computed again from what is kept. In a stack of blocks
/// every third block's output is kept, so recomputing one never
/// recomputes (and holds) the whole stack's.
pub(crate) const MAX_RECOMPUTE_DEPTH: u8 = 2;

impl Activation {
    /// How many recomputations deep this is: 0 for a kept tensor.
    pub(crate) fn depth(&self) -> u8 {
        match self {
            Activation::Kept(_) => 0,
            Activation::Recomputed(r) => r.depth,
        }
    }

    /// The tensor, letting go of this hold on it (so that dropping the
    /// result frees it if nothing else holds it).
    pub fn take(self, be: &CudaBackend) -> CudaResult<Shared> {
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
pub struct Recomputable {
    input: Shared,
    stats: Arc<BatchNormSaved>,
    skip: Option<Activation>,
    /// 1 + the skip input's depth.
    depth: u8,
    value: Mutex<Option<Shared>>,
}

impl Recomputable {
    pub(crate) fn new(
        input: Shared,
        stats: Arc<BatchNormSaved>,
        skip: Option<Activation>,
    ) -> Arc<Self> {
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
pub enum Saved {
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
    /// Whatever a layer of your own keeps (downcast it in its backward).
    Custom(Box<dyn std::any::Any + Send + Sync>),
    Nothing,
}

/// A list's input: lent by the caller (copied if a layer keeps it), or
/// shared (kept by reference, never copied), and then perhaps the output
/// of a batch norm + ReLU that backward can compute again instead.
pub enum Input<'a> {
    Lent(&'a CudaTensor),
    Shared(Shared, Option<Arc<Recomputable>>),
}

impl Input<'_> {
    pub fn tensor(&self) -> &CudaTensor {
        match self {
            Input::Lent(t) => t,
            Input::Shared(t, _) => t,
        }
    }

    /// The same input for a nested list (a block's body).
    pub fn lend(&self) -> Input<'_> {
        match self {
            Input::Lent(t) => Input::Lent(t),
            Input::Shared(t, r) => Input::Shared(Arc::clone(t), r.clone()),
        }
    }

    /// A reference to the tensor itself, to keep for backward (a copy only
    /// of a lent tensor).
    pub(crate) fn share(&mut self, be: &CudaBackend) -> CudaResult<Shared> {
        let shared = match self {
            Input::Lent(t) => Arc::new(t.try_clone(be)?),
            Input::Shared(t, _) => return Ok(Arc::clone(t)),
        };
        *self = Input::Shared(Arc::clone(&shared), None);
        Ok(shared)
    }

    /// What backward needs of this input, as `for_backward`, but copying a
    /// lent tensor every time.
    pub fn activation(&self, be: &CudaBackend) -> CudaResult<Activation> {
        Ok(match self {
            Input::Lent(t) => Activation::Kept(Arc::new(t.try_clone(be)?)),
            Input::Shared(t, None) => Activation::Kept(Arc::clone(t)),
            Input::Shared(_, Some(r)) => Activation::Recomputed(Arc::clone(r)),
        })
    }

    /// What backward needs of this input: the way to compute it again if
    /// there is one, else the tensor.
    pub(crate) fn for_backward(&mut self, be: &CudaBackend) -> CudaResult<Activation> {
        match self {
            Input::Shared(_, Some(r)) => Ok(Activation::Recomputed(Arc::clone(r))),
            _ => self.share(be).map(Activation::Kept),
        }
    }

    /// The input as [n, features]: the same buffer when nothing else holds
    /// it, else a copy (a lent tensor, or an output kept for backward).
    pub(crate) fn flattened(self, be: &CudaBackend) -> CudaResult<Input<'static>> {
        let shape = self.tensor().shape();
        let features = shape.iter().skip(1).product();
        let flat = [shape.first().copied().unwrap_or(0), features];
        let owned = self.into_owned(be)?.reshape(&flat)?;
        Ok(Input::Shared(Arc::new(owned), None))
    }

    /// The tensor itself, copied only if something else still holds it.
    pub(crate) fn into_owned(self, be: &CudaBackend) -> CudaResult<CudaTensor> {
        match self {
            Input::Lent(t) => t.try_clone(be),
            Input::Shared(t, _) => Arc::try_unwrap(t).or_else(|t| t.try_clone(be)),
        }
    }
}

/// What one layer's forward keeps: a reference to its input or its output
/// (the caller's, shared with the layers around it), or something of its
/// own. The walk pushes it onto the stack as one `Saved` entry.
pub enum Keep {
    /// `Saved::Input`.
    Input,
    /// The input, and a layer norm's row statistics.
    InputAnd(ops::LayerNormSaved),
    /// A checkpointed segment's input.
    Segment,
    /// `Saved::Output`.
    Output,
    /// The output, to be computed again in backward.
    Recomputed(Arc<Recomputable>),
    BatchNorm {
        /// With the ReLU fused, in a pass that keeps activations: the output
        /// (the next layer's input) can be computed again from the input.
        fused_relu: bool,
        stats: Arc<BatchNormSaved>,
    },
    /// This entry as it is.
    Other(Saved),
    /// The input and output, and an LSTM's gates and cells.
    Lstm(Box<ops::LstmSaved>),
    ConvLstm(Box<ops::ConvLstmSaved>),
}

/// How a forward runs: inference (running statistics), or training (batch
/// statistics; the running ones updated unless this is the recomputation
/// of a checkpointed segment, which must leave them as the first pass did).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Pass {
    Eval,
    Train {
        update_running: bool,
        /// `CudaBuildOptions::recompute`.
        recompute: bool,
    },
}

/// The error of a backward whose forward did not keep what it needs.
pub fn missing() -> CudaError {
    CudaError::Unsupported {
        op: "CudaNetwork::backward",
        reason: "backward without a training forward before it".into(),
    }
}

/// A tensor's dimensions after the batch, for profile labels: "28x28x32".
pub(crate) fn dims(t: &CudaTensor) -> String {
    profile::dims(t.shape())
}

/// The storage of activations, as the groups' compute copies say.
pub fn activations_of(groups: &Groups) -> DType {
    match groups[DECAY].compute {
        Some(_) => DType::F16,
        None => DType::F32,
    }
}

/// The weights a layer computes with (the f16 copy, or the f32 masters).
pub fn compute<'a>(groups: &'a Groups, p: &ParamRef) -> AnyView<'a> {
    groups[p.group].weights(p.range())
}

/// The f32 master of a parameter (batch norm reads gamma and beta in f32).
pub fn master<'a>(groups: &'a Groups, p: &ParamRef) -> CudaView<'a, f32> {
    groups[p.group].master.slice.slice(p.range())
}

pub(crate) fn conv_shape(
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

/// Views of parameter `a` (the weights it computes with, its f32 master and
/// f32 gradient) and the weights and gradient of `b`, lent together to `f`
/// even when both live in one group.
pub struct Views<'a> {
    pub compute: AnyView<'a>,
    pub master: CudaView<'a, f32>,
    pub grad: CudaViewMut<'a, f32>,
    pub other: Option<(AnyView<'a>, CudaViewMut<'a, f32>)>,
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

/// Lends `f` the views of trainable parameters `a` and `b` (`Views`).
pub fn with_grads<R>(
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

pub use super::network::{backward_list, backward_network, forward_list, CudaBuildContext};
