//! The layer contract. A layer's training forward saves what its backward
//! needs (documented in each file's header); backward consumes it, adds the
//! parameter gradients into `Param::grad` (so gradient accumulation is a
//! matter of not zeroing) and returns the gradient of its input.
//!
//! Every tensor a forward or backward makes comes from the memory pool
//! through the fallible constructors, so running out of memory inside a layer
//! is `Err(ModelError::OutOfMemory)` from `forward`/`backward`, never a panic.
//!
//! The layers themselves live with their op family (`crate::ops::<family>`:
//! CPU layer, CUDA launches, `.cu` kernels and GPU layer in one folder) and
//! are re-exported here; this module keeps the contract, the containers
//! (`Residual`, `Checkpointed`) and the helpers several families share
//! (`vector_math`, `matmul`, `panel_product`).

mod checkpointed;
pub(crate) mod matmul;
pub(crate) mod panel_product;
mod residual;
pub(crate) mod vector_math;

pub use checkpointed::Checkpointed;
pub use residual::{FusedResidual, Residual};
pub use vector_math::{cpu_kernels, set_cpu_kernels, CpuKernels};

pub use crate::ops::activation::dropout::Dropout;
pub use crate::ops::activation::relu::Relu;
pub use crate::ops::activation::smooth::{Gelu, Silu};
pub use crate::ops::batch_norm::cpu::BatchNorm2d;
pub use crate::ops::conv::cpu::{conv_algorithm, set_conv_algorithm, Conv2d, ConvAlgorithm};
pub use crate::ops::conv::depthwise_conv::{depthwise_out_side, DepthwiseConv2d};
pub use crate::ops::frames::conv_lstm::ConvLstm;
pub use crate::ops::layer_norm::cpu::LayerNorm;
pub use crate::ops::linear::cpu::Linear;
pub use crate::ops::linear::lora::{LoraConfig, LoraLinear};
pub use crate::ops::pool::global_avg_pool::GlobalAvgPool;
pub use crate::ops::pool::max_pool::{max_pool_out_side, MaxPool2d};
pub use crate::ops::pool::reshape::{Flatten, PerFrame, PerPosition};
pub use crate::ops::pool::unet::{UnetSkip, Upsample2x};
pub use crate::ops::sequence::attention::CausalSelfAttention;
pub use crate::ops::sequence::embedding::Embedding;
pub use crate::ops::sequence::lstm::Lstm;

use crate::cuda::layer::{CudaBuildContext, CudaLayer};
use crate::cuda::CudaResult;
use crate::profile;
use crate::{Result, Tensor};

/// Training saves activations and updates batch-norm running statistics;
/// evaluation does neither.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Train,
    Eval,
}

/// A trainable tensor, its gradient, and whether weight decay applies
/// (it does not on biases and normalisation parameters).
///
/// A `frozen` parameter (the base weight under a LoRA adapter) is part of
/// the model and of its checkpoints, but the optimizer leaves it alone and
/// layers compute no gradient for it: its gradient is an empty tensor, so a
/// frozen model holds no gradient memory for it.
#[derive(Clone, Debug)]
pub struct Param {
    pub name: String,
    pub value: Tensor,
    pub grad: Tensor,
    pub decay: bool,
    pub frozen: bool,
}

impl Param {
    pub fn new(name: impl Into<String>, value: Tensor, decay: bool) -> Self {
        let grad = Tensor::zeros(value.shape());
        Self {
            name: name.into(),
            value,
            grad,
            decay,
            frozen: false,
        }
    }

    /// Marks the parameter frozen (see the type's documentation).
    pub fn frozen(mut self) -> Self {
        self.freeze();
        self
    }

    /// Freezes in place and releases the gradient buffer.
    pub fn freeze(&mut self) {
        self.frozen = true;
        self.grad = Tensor::zeros(&[0]);
    }

    /// Whether the gradient has the shape layers write into: the value's,
    /// or, for a frozen parameter, also none at all.
    pub fn grad_fits(&self) -> bool {
        self.grad.shape() == self.value.shape() || (self.frozen && self.grad.is_empty())
    }

    pub fn zero_grad(&mut self) {
        self.grad.data_mut().fill(0.0);
    }
}

pub trait Layer: Send {
    /// Short name for logs and error messages ("conv3x3/2 32->64").
    fn describe(&self) -> String;

    /// Per-sample output shape for a per-sample input shape (NHWC without N,
    /// or `[C]` for feature vectors). Errors name the mismatch.
    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>>;

    /// Multiply-adds per sample of one forward, for the summary and the bench.
    fn macs(&self, input: &[usize]) -> Result<u64>;

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor>;

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor>;

    /// `backward` for a layer whose input no gradient is wanted for (no
    /// trainable parameter before it): only its parameters' gradients. The
    /// layers whose input gradient costs as much as those (convolution,
    /// linear) skip computing it; the rest compute it and drop it.
    fn backward_params_only(&mut self, grad_output: &Tensor) -> Result<()> {
        self.backward(grad_output).map(drop)
    }

    /// Whether any parameter of this layer is trained (not frozen).
    fn has_trainable_params(&mut self) -> bool {
        self.params_mut().iter().any(|p| !p.frozen)
    }

    /// Whether this layer marks a running profile itself, part by part (a
    /// container): then whoever runs it does not mark it whole.
    fn marks_its_parts(&self) -> bool {
        false
    }

    /// Trainable parameters, in a fixed order (checkpoints rely on it).
    fn params_mut(&mut self) -> Vec<&mut Param> {
        Vec::new()
    }

    /// Non-trainable state that a checkpoint must keep (running statistics).
    fn buffers_mut(&mut self) -> Vec<&mut Tensor> {
        Vec::new()
    }

    /// The seeds of the dropout layers within, in the order of
    /// `buffers_mut` (the GPU network draws the same masks with them).
    fn dropout_seeds(&self) -> Vec<u64> {
        Vec::new()
    }

    /// Data parallel: every dropout layer within draws its masks `offset`
    /// forwards ahead of its counter, and its counter moves on by
    /// `advance`, so that rank r's micro-batches draw the masks one
    /// process would for the same samples (see `Network::shift_dropout`).
    fn shift_dropout(&mut self, _offset: u64, _advance: u64) {}

    /// Drops saved activations (after an aborted step, or before evaluation).
    fn clear_saved(&mut self) {}

    /// Whether this layer is a 2× nearest-neighbour upsample (alone or per
    /// frame): a UNet skip whose body ends in one does the upsample in its
    /// concat, and the upsample's backward in its split.
    fn is_upsample2x(&self) -> bool {
        false
    }

    /// While on, a training forward is a recomputation (activation
    /// checkpointing) or a dry run: it must compute and save exactly what a
    /// training forward does, but change no other state — batch norm
    /// normalises with the batch statistics and leaves its running
    /// statistics alone. Containers pass it on to their layers.
    fn set_recompute(&mut self, _on: bool) {}

    /// This layer's GPU form, for `CudaNetwork::from_cpu`: None when it
    /// has no CUDA implementation (the default; a GPU network then refuses
    /// it, naming it). A layer of your own brings one by implementing
    /// `CudaLayer` and returning it here; `ctx` hands out its parameters'
    /// places, in the order of `params_mut`, and says its input shape.
    fn to_cuda(
        &self,
        _ctx: &mut CudaBuildContext<'_, '_>,
    ) -> Option<CudaResult<Box<dyn CudaLayer>>> {
        None
    }

    /// The layers this one holds, in order (a container's), for walks
    /// over a network.
    fn sublayers(&self) -> Vec<&dyn Layer> {
        Vec::new()
    }
}

/// The backward of a sequence of layers whose input no gradient is wanted
/// for (a network's, or a container's that is first in one): down to the
/// first layer with a trained parameter, which makes its parameters'
/// gradients only (`Layer::backward_params_only`); the layers before it are
/// not run backward, and their saved activations are dropped.
pub(crate) fn backward_params_only_through(
    layers: &mut [Box<dyn Layer>],
    grad_output: Tensor,
) -> Result<()> {
    backward_params_only_each(layers, grad_output, &mut |_, _| Ok(()))
}

/// `backward_params_only_through`, calling `done(index, layer)` after each
/// layer's backward, the last first, then for the layers before the first
/// trainable one (not run backward), in the same order.
pub(crate) fn backward_params_only_each(
    layers: &mut [Box<dyn Layer>],
    grad_output: Tensor,
    done: &mut dyn FnMut(usize, &mut dyn Layer) -> Result<()>,
) -> Result<()> {
    let first = layers.iter_mut().position(|l| l.has_trainable_params());
    let Some(first) = first else {
        layers.iter_mut().for_each(|l| l.clear_saved());
        for (index, layer) in layers.iter_mut().enumerate().rev() {
            done(index, layer.as_mut())?;
        }
        return Ok(());
    };
    let mut g = grad_output;
    for (index, layer) in layers.iter_mut().enumerate().skip(first + 1).rev() {
        let next = layer.backward(&g)?;
        profile::mark_layer("bwd", layer.as_ref(), "out", g.shape());
        g = next;
        done(index, layer.as_mut())?;
    }
    let layer = &mut layers[first];
    layer.backward_params_only(&g)?;
    profile::mark_layer("bwd", layer.as_ref(), "out", g.shape());
    done(first, layer.as_mut())?;
    for (index, layer) in layers[..first].iter_mut().enumerate().rev() {
        layer.clear_saved();
        done(index, layer.as_mut())?;
    }
    Ok(())
}
