//! Layers of your own in a network built from a spec: a `LayerSpec::Custom`
//! entry (`{ type = "custom", name = "gated_residual", options = { ... } }`
//! in TOML, or the same value in code) names a factory registered in a
//! [`LayerRegistry`], which makes the layer for the entry's input shape.
//!
//! A custom layer implements [`Layer`] (forward, backward, its parameters
//! and buffers): that is its CPU implementation, and it is checkpointed,
//! resumed and OOM-managed like a built-in one. It has no CUDA
//! implementation: a GPU network refuses it, naming it (and `device.kind =
//! "auto"` trains on the CPU, saying why).

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::init::InitRng;
use crate::{Layer, Result};

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
        self.factories.insert(name.into(), Arc::new(factory));
        self
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
