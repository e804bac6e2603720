//! Layers of your own in a network built from a spec: a `LayerSpec::Custom`
//! entry (`{ type = "custom", name = "gated_residual", options = { ... } }`
//! in TOML, or the same value in code) names a factory registered in a
//! [`LayerRegistry`], which makes the layer for the entry's input shape.
//!
//! A custom layer implements [`Layer`] (forward, backward, its parameters
//! and buffers): that is its CPU implementation, and it is checkpointed,
//! resumed and OOM-managed like a built-in one. Its CUDA implementation is
//! optional: `Layer::to_cuda` returns its GPU form, a
//! [`CudaLayer`] (forward, backward, and its
//! parameters' places taken from the `CudaBuildContext` in the order of its
//! `params_mut`; it launches `crate::cuda::ops` or cuBLAS on the network's
//! tensors), exactly as every built-in layer does: `CudaNetwork::from_cpu`
//! declares each spec entry's layers again through the one builder (your
//! factory is called again there, with a throwaway initialisation: the
//! weights are the CPU network's) and asks each for its GPU form. A layer
//! that returns none (the default) is refused by a GPU network, naming it
//! (and the pipeline's `device.kind = "auto"` trains on the CPU, saying
//! why). The network wraps the factory's layer in a `CustomEntry`, which
//! adds only the name it was registered under (for that refusal) and
//! passes every call on: no copy, no other state.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::cuda::layer::{CudaBuildContext, CudaLayer};
use crate::cuda::CudaResult;
use crate::init::InitRng;
use crate::{Layer, Mode, Param, Result, Tensor};

/// What a factory gets to make its layer.
pub struct CustomLayerArgs<'a> {
    /// Where the entry is (`model.layers[2]`), for error messages.
    pub path: &'a str,
    /// The per-sample input shape (NHWC without N, `[c]`, or `[t, c]`).
    pub input_shape: &'a [usize],
    /// The entry's `options`.
    pub options: &'a BTreeMap<String, f64>,
    /// The network's initialisation stream, in layer order: drawing from it
    /// keeps every initialisation a function of the seed.
    pub rng: &'a mut InitRng,
}

impl CustomLayerArgs<'_> {
    /// The option `key`, or `default` when the entry does not set it.
    pub fn option_or(&self, key: &str, default: f64) -> f64 {
        self.options.get(key).copied().unwrap_or(default)
    }
}

/// Makes a custom layer for one spec entry; errors name the entry.
pub type LayerFactory =
    Arc<dyn Fn(&mut CustomLayerArgs<'_>) -> Result<Box<dyn Layer>> + Send + Sync>;

/// The custom layers a network may name, by name.
#[derive(Clone, Default)]
pub struct LayerRegistry {
    factories: BTreeMap<String, LayerFactory>,
    /// The names whose layers bring a CUDA form (`register_with_cuda`).
    with_cuda: std::collections::BTreeSet<String>,
}

impl LayerRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `factory` as `name` (replacing one of the same name).
    pub fn register(
        mut self,
        name: impl Into<String>,
        factory: impl Fn(&mut CustomLayerArgs<'_>) -> Result<Box<dyn Layer>> + Send + Sync + 'static,
    ) -> Self {
        let name = name.into();
        self.with_cuda.remove(&name);
        self.factories.insert(name, Arc::new(factory));
        self
    }

    /// Registers `factory` as `name`, whose layers bring a CUDA form
    /// (`Layer::to_cuda`): a run on `device.kind = "cuda"` builds them
    /// into the GPU network instead of refusing them before the GPU is
    /// touched (a layer that then returns no CUDA form is still refused,
    /// naming it, when the GPU network is built).
    pub fn register_with_cuda(
        self,
        name: impl Into<String>,
        factory: impl Fn(&mut CustomLayerArgs<'_>) -> Result<Box<dyn Layer>> + Send + Sync + 'static,
    ) -> Self {
        let name = name.into();
        let mut registry = self.register(name.clone(), factory);
        registry.with_cuda.insert(name);
        registry
    }

    /// Whether `name` was registered with a CUDA form.
    pub fn brings_cuda(&self, name: &str) -> bool {
        self.with_cuda.contains(name)
    }

    pub fn get(&self, name: &str) -> Option<&LayerFactory> {
        self.factories.get(name)
    }

    /// The registered names, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.factories.keys().map(String::as_str).collect()
    }
}

impl std::fmt::Debug for LayerRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerRegistry")
            .field("names", &self.names())
            .finish()
    }
}

/// A `custom` entry's layer in a network: the factory's layer, and the
/// name it was registered under, by which a GPU network refuses it when it
/// brings no CUDA form. Everything else is the layer's own.
pub(crate) struct CustomEntry {
    name: String,
    inner: Box<dyn Layer>,
}

impl CustomEntry {
    pub(crate) fn new(name: &str, inner: Box<dyn Layer>) -> Self {
        Self {
            name: name.to_string(),
            inner,
        }
    }
}

impl Layer for CustomEntry {
    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        self.inner.output_shape(input)
    }

    fn macs(&self, input: &[usize]) -> Result<u64> {
        self.inner.macs(input)
    }

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        self.inner.forward(input, mode)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        self.inner.backward(grad_output)
    }

    fn backward_params_only(&mut self, grad_output: &Tensor) -> Result<()> {
        self.inner.backward_params_only(grad_output)
    }

    fn has_trainable_params(&mut self) -> bool {
        self.inner.has_trainable_params()
    }

    fn marks_its_parts(&self) -> bool {
        self.inner.marks_its_parts()
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        self.inner.params_mut()
    }

    fn buffers_mut(&mut self) -> Vec<&mut Tensor> {
        self.inner.buffers_mut()
    }

    fn dropout_seeds(&self) -> Vec<u64> {
        self.inner.dropout_seeds()
    }

    fn shift_dropout(&mut self, offset: u64, advance: u64) {
        self.inner.shift_dropout(offset, advance);
    }

    fn clear_saved(&mut self) {
        self.inner.clear_saved()
    }

    fn is_upsample2x(&self) -> bool {
        self.inner.is_upsample2x()
    }

    fn set_recompute(&mut self, on: bool) {
        self.inner.set_recompute(on)
    }

    fn to_cuda(
        &self,
        ctx: &mut CudaBuildContext<'_, '_>,
    ) -> Option<CudaResult<Box<dyn CudaLayer>>> {
        Some(self.inner.to_cuda(ctx).unwrap_or_else(|| {
            Err(ctx.unsupported(format!(
                "the custom layer \"{}\" has no CUDA implementation; \
                 train it with device.kind = \"cpu\"",
                self.name
            )))
        }))
    }

    fn sublayers(&self) -> Vec<&dyn Layer> {
        self.inner.sublayers()
    }
}
