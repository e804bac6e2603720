//! The network: a sequence of layers built from the experiment's `[model]`
//! table, so an architecture changes without code. A forward runs the layers
//! in order; backward runs them in reverse, each adding into its parameters'
//! gradients.
//!
//! `model.checkpoint` chooses activation checkpointing (see
//! `layers::Checkpointed`): results are bitwise the same whatever it is; only
//! the memory a training step holds and its time change. So does fusion
//! (`BuildOptions::fuse`): a batch norm followed by a ReLU becomes one layer,
//! and a `basic_block` a `FusedResidual`, on images (not frame sequences).

use crate::custom::{CustomEntry, CustomLayerArgs, LayerRegistry};
use crate::init::InitRng;
use crate::layers::{
    backward_params_only_through, BatchNorm2d, CausalSelfAttention, Checkpointed, Conv2d, ConvLstm,
    DepthwiseConv2d, Dropout, Embedding, Flatten, FusedResidual, Gelu, GlobalAvgPool, LayerNorm,
    Linear, LoraConfig, LoraLinear, Lstm, MaxPool2d, PerFrame, PerPosition, Relu, Residual, Silu,
    UnetSkip, Upsample2x,
};
use crate::profile::{self, ProfileSegment};
use crate::{Device, Layer, MemoryPool, Mode, ModelError, Param, PoolStats, Result, Tensor};

pub(crate) use crate::spec::{default_eps, default_momentum, MAX_VOCAB};
pub use crate::spec::{CheckpointPolicy, LayerSpec, ModelSpec, TokenInput};

pub struct Network {
    spec: ModelSpec,
    layers: Vec<Box<dyn Layer>>,
    output_shape: Vec<usize>,
    /// The factories of its `custom` entries, for the GPU builder, which
    /// declares the layers again (`for_each_declared_entry`).
    registry: LayerRegistry,
}

impl Network {
    /// Builds and initialises the network, fused; errors name the layer
    /// (`model.layers[3]`) and what does not fit.
    pub fn build(spec: &ModelSpec, seed: u64) -> Result<Self> {
        Self::build_with(spec, seed, BuildOptions::default())
    }

    /// `build` with the fusion `options` asks for.
    pub fn build_with(spec: &ModelSpec, seed: u64, options: BuildOptions) -> Result<Self> {
        Self::build_with_layers(spec, seed, options, &LayerRegistry::default())
    }

    /// `build_with`, the `custom` entries of the spec made by `layers`.
    pub fn build_with_layers(
        spec: &ModelSpec,
        seed: u64,
        options: BuildOptions,
        layers_registry: &LayerRegistry,
    ) -> Result<Self> {
        match &spec.tokens {
            None => check_pixel_input(spec)?,
            Some(tokens) => check_token_input(spec, tokens)?,
        }
        check_frame_input(spec)?;
        let mut ctx = BuildContext {
            rng: InitRng::new(seed),
            vocab: spec.tokens.map(|t| t.vocab),
            checkpoint: spec.checkpoint,
            fuse: options.fuse,
            custom: layers_registry,
        };
        let mut shape = input_shape(spec);
        let groups = build_groups(&spec.layers, "model.layers", &mut shape, &mut ctx)?;
        let layers = arrange(groups, spec.checkpoint, checkpointed);
        if spec.frames.is_some() {
            check_frame_output(spec, &shape)?;
            return Ok(Self {
                spec: spec.clone(),
                layers,
                output_shape: shape,
                registry: layers_registry.clone(),
            });
        }
        let per_token_scores = spec
            .tokens
            .is_some_and(|t| shape.len() == 2 && shape[0] == t.length);
        if shape.len() != 1 && !per_token_scores {
            let expected = match spec.tokens {
                None => "class scores [classes]".to_string(),
                Some(t) => format!(
                    "class scores [classes] or per-token scores [{}, classes]",
                    t.length
                ),
            };
            return Err(ModelError::Spec {
                path: "model.layers".into(),
                reason: format!("the network must end in {expected}, it ends in {shape:?}"),
            });
        }
        Ok(Self {
            spec: spec.clone(),
            layers,
            output_shape: shape,
            registry: layers_registry.clone(),
        })
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The custom layers its spec may name.
    pub(crate) fn registry(&self) -> &LayerRegistry {
        &self.registry
    }

    /// Classes scored: the last dimension of the output (`[classes]`, or
    /// [length, classes] for per-token scores).
    pub fn num_classes(&self) -> usize {
        self.output_shape.last().copied().unwrap_or(0)
    }

    /// The per-sample output shape.
    pub fn output_shape(&self) -> &[usize] {
        &self.output_shape
    }

    /// The per-sample input shape: `[h, w, c]` for pixels, `[length]` for tokens.
    pub fn input_shape(&self) -> Vec<usize> {
        input_shape(&self.spec)
    }

    /// Converts a u8 NHWC batch (frame model: [N, frames, h, w, c]) into
    /// the normalised input tensor.
    pub fn input_from_u8(&self, batch: usize, pixels: &[u8]) -> Result<Tensor> {
        if self.spec.tokens.is_some() {
            return Err(ModelError::State(
                "this model reads token ids (model.tokens): use input_from_tokens".into(),
            ));
        }
        let shape = [vec![batch], self.input_shape()].concat();
        Tensor::from_u8_normalized(&shape, pixels, self.spec.mean, self.spec.std)
    }

    /// A batch of f32 features (NHWC, already scaled as the model takes
    /// them: a table's standardised columns) as the input tensor; the
    /// model's `mean` and `std`, which normalise u8 pixels, do not apply.
    pub fn input_from_f32(&self, batch: usize, features: &[f32]) -> Result<Tensor> {
        if self.spec.tokens.is_some() {
            return Err(ModelError::State(
                "this model reads token ids (model.tokens), not features".into(),
            ));
        }
        let shape = [vec![batch], self.input_shape()].concat();
        let expected: usize = shape.iter().product();
        if features.len() != expected {
            return Err(ModelError::Shape {
                op: "input_from_f32",
                expected: format!("{expected} features ({shape:?})"),
                got: format!("{}", features.len()),
            });
        }
        Tensor::from_vec(&shape, features.to_vec())
    }

    /// Converts `batch` sequences of token ids (row-major [batch, length])
    /// into the network's input, [batch, length] ids as f32 (exact: the
    /// vocabulary is below 2^24). Ids outside the vocabulary are an error.
    pub fn input_from_tokens(&self, batch: usize, ids: &[u32]) -> Result<Tensor> {
        let Some(tokens) = self.spec.tokens else {
            return Err(ModelError::State(
                "this model reads pixels: set model.tokens to feed token ids".into(),
            ));
        };
        Tensor::from_vec(&[batch, tokens.length], tokens.id_values(ids)?)
    }

    /// Returns the logits, [N, classes].
    ///
    /// A failed forward (out of memory included) has no effect: the saved
    /// activations are dropped and batch-norm running statistics are put
    /// back as they were, so the step can be retried (with a smaller batch).
    /// If the step fails after a successful training forward (in the loss),
    /// call `clear_saved` to free the activations the forward saved.
    pub fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        let expected = [vec![input.batch()], self.input_shape()].concat();
        input.expect_shape("network input", &expected)?;
        let before = (mode == Mode::Train).then(|| self.buffer_values());
        let mut x = input.clone();
        for i in 0..self.layers.len() {
            match self.layers[i].forward(&x, mode) {
                Ok(y) => {
                    profile::mark_layer("fwd", self.layers[i].as_ref(), "in", x.shape());
                    x = y;
                }
                Err(e) => {
                    self.clear_saved();
                    if let Some(before) = before {
                        self.restore_buffer_values(&before)?;
                    }
                    return Err(e);
                }
            }
        }
        Ok(x)
    }

    /// Adds parameter gradients for `grad_logits` = dLoss/dlogits. On error
    /// (out of memory included) the saved activations are dropped; the
    /// gradients may hold part of this backward's contribution, so zero them
    /// before retrying the step (and restore the running statistics saved
    /// with `buffer_values` before the step's forward, which updated them).
    ///
    /// No gradient flows into the layers before the first trainable
    /// parameter: that layer computes its parameters' gradients only (the
    /// first convolution's or linear layer's input gradient, as large a
    /// product as its weight gradient, is never made), and the layers
    /// before it are not run backward, their saved activations dropped.
    pub fn backward(&mut self, grad_logits: &Tensor) -> Result<()> {
        let result = backward_params_only_through(&mut self.layers, grad_logits.clone());
        if result.is_err() {
            self.clear_saved();
        }
        result
    }

    /// Starts timing every layer's forward and backward on this thread
    /// (`profile_mark` adds the caller's own segments, the loss and the
    /// optimizer), until `profile_finish`.
    pub fn profile_start(&mut self) {
        profile::start();
    }

    /// Ends a segment labelled `label` here, while a profile runs.
    pub fn profile_mark(&mut self, label: impl FnOnce() -> String) {
        profile::mark(label);
    }

    /// The segments since `profile_start` (none if no profile ran), summed
    /// by label; profiling stops.
    pub fn profile_finish(&mut self) -> Vec<ProfileSegment> {
        profile::finish()
    }

    /// A copy of the non-trainable state (batch-norm running statistics), to
    /// undo a step's updates with `restore_buffer_values`.
    pub fn buffer_values(&mut self) -> Vec<Vec<f32>> {
        self.buffers_mut()
            .iter()
            .map(|b| b.data().to_vec())
            .collect()
    }

    /// Puts back values taken by `buffer_values`.
    pub fn restore_buffer_values(&mut self, values: &[Vec<f32>]) -> Result<()> {
        let mut buffers = self.buffers_mut();
        if buffers.len() != values.len()
            || buffers.iter().zip(values).any(|(b, v)| b.len() != v.len())
        {
            return Err(ModelError::State(
                "buffer values do not match the model's buffers".into(),
            ));
        }
        for (b, v) in buffers.iter_mut().zip(values) {
            b.data_mut().copy_from_slice(v);
        }
        Ok(())
    }

    /// `backward`, calling `done(index)` after each top-level layer's
    /// backward (then its parameters' gradients are complete for this
    /// micro-batch), in backward's order, the last layer first; the layers
    /// before the first trainable one, which backward does not run, after
    /// it, in the same order. `index` is the layer's place in
    /// [`Network::layer_params_mut`]. What a data-parallel learner hands
    /// to its all-reduce as backward goes.
    pub fn backward_with(
        &mut self,
        grad_logits: &Tensor,
        done: &mut dyn FnMut(usize, &mut [&mut Param]) -> Result<()>,
    ) -> Result<()> {
        let result = crate::layers::backward_params_only_each(
            &mut self.layers,
            grad_logits.clone(),
            &mut |index, layer| done(index, &mut layer.params_mut()),
        );
        if result.is_err() {
            self.clear_saved();
        }
        result
    }

    /// Each top-level layer's parameters (its nested layers' included),
    /// in order: `params_mut` grouped by layer.
    pub fn layer_params_mut(&mut self) -> Vec<Vec<&mut Param>> {
        self.layers.iter_mut().map(|l| l.params_mut()).collect()
    }

    pub fn params_mut(&mut self) -> Vec<&mut Param> {
        self.layers
            .iter_mut()
            .flat_map(|l| l.params_mut())
            .collect()
    }

    pub fn buffers_mut(&mut self) -> Vec<&mut Tensor> {
        self.layers
            .iter_mut()
            .flat_map(|l| l.buffers_mut())
            .collect()
    }

    /// The dropout layers' seeds, in the order of their counters among
    /// `buffers_mut`.
    pub fn dropout_seeds(&self) -> Vec<u64> {
        self.layers.iter().flat_map(|l| l.dropout_seeds()).collect()
    }

    /// Data parallel: every dropout layer draws its masks `offset`
    /// forwards ahead of its counter, and its counter moves on by
    /// `advance`. Rank r of N, taking M micro-batches a step, draws at
    /// offset r·M and moves on by (N−1)·M after its M forwards, so that
    /// its micro-batches draw the masks one process accumulating N·M
    /// draws for the same samples, and every rank's counter stays the same.
    pub fn shift_dropout(&mut self, offset: u64, advance: u64) {
        self.layers
            .iter_mut()
            .for_each(|l| l.shift_dropout(offset, advance));
    }

    pub fn zero_grad(&mut self) {
        for p in self.params_mut() {
            p.zero_grad();
        }
    }

    pub fn clear_saved(&mut self) {
        for layer in &mut self.layers {
            layer.clear_saved();
        }
    }

    fn set_recompute(&mut self, on: bool) {
        for layer in &mut self.layers {
            layer.set_recompute(on);
        }
    }

    /// Dry run of one training step at `batch` samples: a training forward
    /// on zeros, then a backward from a zero gradient of the logits (what a
    /// step allocates: the input, the activations, the logits, the loss
    /// gradient, the backward's gradients). Everything it allocates comes
    /// from a private pool whose statistics are returned: `peak_in_use_bytes`
    /// is the step's peak on top of what the network already holds, and
    /// `peak_reserved_bytes` what a fresh cache would reserve for it.
    ///
    /// The model is left as it was, except for the gradients, which are
    /// zeroed (call it before a step, not between micro-batches): batch norm
    /// runs in recompute mode, so its running statistics are untouched, and
    /// saved activations are cleared. If the current pool has a budget, the
    /// private pool gets what the budget leaves beside the bytes in use, so
    /// a batch that cannot fit fails with `ModelError::OutOfMemory`.
    pub fn measure_step(&mut self, batch: usize) -> Result<PoolStats> {
        let device = Device::Cpu;
        let outer = crate::memory::current(device);
        let pool = MemoryPool::new(device);
        if let Some(limit) = outer.limit() {
            pool.set_limit(Some(limit.saturating_sub(outer.stats().in_use_bytes)));
        }
        let input_shape = [vec![batch], self.input_shape()].concat();
        self.clear_saved();
        self.set_recompute(true);
        let result = pool.scope(|| -> Result<()> {
            let x = Tensor::try_zeros(&input_shape)?;
            let logits = self.forward(&x, Mode::Train)?;
            let grad = Tensor::try_zeros(logits.shape())?;
            self.backward(&grad)
        });
        self.set_recompute(false);
        self.clear_saved();
        self.zero_grad();
        result?;
        Ok(pool.stats())
    }

    pub fn num_params(&mut self) -> usize {
        self.params_mut().iter().map(|p| p.value.len()).sum()
    }

    /// Parameters the optimizer updates (not frozen).
    pub fn num_trainable_params(&mut self) -> usize {
        let params = self.params_mut();
        params
            .iter()
            .filter(|p| !p.frozen)
            .map(|p| p.value.len())
            .sum()
    }

    /// Multiply-adds of one sample's forward.
    pub fn macs_per_sample(&self) -> Result<u64> {
        let mut shape = self.input_shape();
        let mut total = 0;
        for layer in &self.layers {
            total += layer.macs(&shape)?;
            shape = layer.output_shape(&shape)?;
        }
        Ok(total)
    }

    /// One line per layer: what it is and its output shape.
    pub fn summary(&self) -> Result<Vec<String>> {
        let mut shape = self.input_shape();
        let mut lines = Vec::new();
        for layer in &self.layers {
            shape = layer.output_shape(&shape)?;
            lines.push(format!("{:<28} -> {:?}", layer.describe(), shape));
        }
        Ok(lines)
    }
}

/// `measure_step`'s peak in-use bytes: what one training step at `batch`
/// samples needs on top of what the network already holds (for choosing a
/// micro-batch that fits a budget). Zeroes the gradients.
pub fn measure_step_peak(network: &mut Network, batch: usize) -> Result<u64> {
    Ok(network.measure_step(batch)?.peak_in_use_bytes)
}

fn input_shape(spec: &ModelSpec) -> Vec<usize> {
    match (spec.tokens, spec.frames) {
        (Some(tokens), _) => vec![tokens.length],
        (None, Some(frames)) => [vec![frames], spec.input.to_vec()].concat(),
        (None, None) => spec.input.to_vec(),
    }
}

fn check_frame_input(spec: &ModelSpec) -> Result<()> {
    match (spec.frames, spec.tokens) {
        (Some(0), _) => Err(spec_error("model.frames", "must be positive")),
        (Some(_), Some(_)) => Err(spec_error(
            "model.frames",
            "a model reads either frames or token ids (model.tokens), not both",
        )),
        _ => Ok(()),
    }
}

/// A frame model predicts a frame like its input at every step.
fn check_frame_output(spec: &ModelSpec, shape: &[usize]) -> Result<()> {
    let expected = input_shape(spec);
    if shape != expected {
        return Err(spec_error(
            "model.layers",
            format!(
                "a frame model (model.frames) must end in next-frame predictions {expected:?}, \
                 it ends in {shape:?}"
            ),
        ));
    }
    Ok(())
}

fn check_pixel_input(spec: &ModelSpec) -> Result<()> {
    if spec.input.contains(&0) {
        return Err(spec_error(
            "model.input",
            format!(
                "every dimension must be positive, got {:?} (model.input is required \
                 unless model.tokens is set)",
                spec.input
            ),
        ));
    }
    if !(spec.std.is_finite() && spec.std > 0.0 && spec.mean.is_finite()) {
        return Err(spec_error(
            "model.std",
            format!(
                "need a finite mean and a positive std, got mean {} std {}",
                spec.mean, spec.std
            ),
        ));
    }
    Ok(())
}

fn check_token_input(spec: &ModelSpec, tokens: &TokenInput) -> Result<()> {
    if tokens.length == 0 {
        return Err(spec_error("model.tokens.length", "must be positive"));
    }
    if tokens.vocab == 0 || tokens.vocab > MAX_VOCAB {
        return Err(spec_error(
            "model.tokens.vocab",
            format!("must be in 1..={MAX_VOCAB}, got {}", tokens.vocab),
        ));
    }
    for (key, set) in [
        ("model.input", spec.input != [0; 3]),
        ("model.mean", spec.mean != 0.0),
        ("model.std", spec.std != 0.0),
    ] {
        if set {
            return Err(spec_error(
                key,
                "pixel settings do not apply to a token model (model.tokens); remove it",
            ));
        }
    }
    Ok(())
}

/// How the CPU network is put together; the arithmetic is the same either
/// way, bit for bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BuildOptions {
    /// Fuse each batch norm with the ReLU after it (and a `basic_block`'s
    /// last batch norm with its add and ReLU): fewer passes over memory.
    pub fuse: bool,
}

impl Default for BuildOptions {
    fn default() -> Self {
        Self { fuse: true }
    }
}

/// What building a layer may need besides its spec and input shape.
struct BuildContext<'a> {
    rng: InitRng,
    /// The factories of `custom` entries.
    custom: &'a LayerRegistry,
    /// `model.tokens.vocab`, for embeddings.
    vocab: Option<usize>,
    /// `model.checkpoint`, for the layers that recompute within themselves.
    checkpoint: CheckpointPolicy,
    fuse: bool,
}

/// The layers one spec entry built, and whether it is a residual block
/// (what `model.checkpoint = "blocks"` recomputes). Generic so that the CPU
/// and the GPU networks share one arrangement.
pub(crate) struct Group<L> {
    pub block: bool,
    pub layers: Vec<L>,
}

/// Whether a spec entry is a block for checkpointing.
pub(crate) fn is_block(spec: &LayerSpec) -> bool {
    matches!(
        spec,
        LayerSpec::Residual { .. } | LayerSpec::BasicBlock | LayerSpec::TransformerBlock { .. }
    )
}

fn build_groups(
    specs: &[LayerSpec],
    path: &str,
    shape: &mut Vec<usize>,
    ctx: &mut BuildContext<'_>,
) -> Result<Vec<Group<Box<dyn Layer>>>> {
    let mut groups = Vec::new();
    let mut fused_relu = false;
    for (i, spec) in specs.iter().enumerate() {
        if std::mem::take(&mut fused_relu) {
            continue;
        }
        let here = format!("{path}[{i}]");
        let mut layers = Vec::new();
        let built = match (spec, specs.get(i + 1)) {
            (LayerSpec::BatchNorm { momentum, eps }, Some(LayerSpec::Relu))
                if ctx.fuse && shape.len() == 3 =>
            {
                fused_relu = true;
                let bn = batch_norm(&here, shape, *momentum, *eps)?.with_relu();
                vec![Box::new(bn) as Box<dyn Layer>]
            }
            _ => build_one(spec, &here, shape, ctx)?,
        };
        for layer in built {
            *shape = layer.output_shape(shape).map_err(|e| ModelError::Spec {
                path: here.clone(),
                reason: e.to_string(),
            })?;
            layers.push(layer);
        }
        groups.push(Group {
            block: is_block(spec),
            layers,
        });
    }
    Ok(groups)
}

fn build_layers(
    specs: &[LayerSpec],
    path: &str,
    shape: &mut Vec<usize>,
    ctx: &mut BuildContext<'_>,
) -> Result<Vec<Box<dyn Layer>>> {
    let groups = build_groups(specs, path, shape, ctx)?;
    Ok(arrange(groups, CheckpointPolicy::None, checkpointed))
}

/// Each top-level entry of `spec` declared as the CPU layers it builds,
/// unfused, with the per-sample input shape it takes: `visit` gets the
/// entry, its path, that shape and the layers, in order (the GPU builder
/// converts them, `Layer::to_cuda`). The initialisation is a throwaway
/// one (the values are not the network's; dropout seeds are not its own
/// either); `layers` makes the `custom` entries.
pub(crate) fn for_each_declared_entry(
    spec: &ModelSpec,
    layers: &LayerRegistry,
    mut visit: impl FnMut(&LayerSpec, &str, &[usize], Vec<Box<dyn Layer>>) -> Result<()>,
) -> Result<()> {
    let mut ctx = BuildContext {
        rng: InitRng::new(0),
        vocab: spec.tokens.map(|t| t.vocab),
        checkpoint: spec.checkpoint,
        fuse: false,
        custom: layers,
    };
    let mut shape = input_shape(spec);
    for (i, entry) in spec.layers.iter().enumerate() {
        let path = format!("model.layers[{i}]");
        let input = shape.clone();
        let built = build_one(entry, &path, &shape, &mut ctx)?;
        for layer in &built {
            shape = layer.output_shape(&shape).map_err(|e| ModelError::Spec {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        }
        visit(entry, &path, &input, built)?;
    }
    Ok(())
}

fn checkpointed(layers: Vec<Box<dyn Layer>>) -> Box<dyn Layer> {
    Box::new(Checkpointed::new(layers))
}

/// The top-level layer list for a checkpointing policy: `segment` wraps the
/// layers of one recomputed segment.
pub(crate) fn arrange<L>(
    groups: Vec<Group<L>>,
    policy: CheckpointPolicy,
    segment: impl Fn(Vec<L>) -> L,
) -> Vec<L> {
    let segment =
        |groups: Vec<Group<L>>| segment(groups.into_iter().flat_map(|g| g.layers).collect());
    let mut out: Vec<L> = Vec::new();
    let mut run: Vec<Group<L>> = Vec::new();
    let flush = |run: &mut Vec<Group<L>>, out: &mut Vec<L>| {
        // ⌊√L⌋ segments of near-equal length (the first ones one longer).
        let len = run.len();
        if len == 0 {
            return;
        }
        let count = (1..=len).take_while(|s| s * s <= len).last().unwrap_or(1);
        let mut rest = std::mem::take(run).into_iter();
        for i in 0..count {
            let size = len / count + usize::from(i < len % count);
            out.push(segment(rest.by_ref().take(size).collect()));
        }
    };
    for group in groups {
        match policy {
            CheckpointPolicy::None => out.extend(group.layers),
            CheckpointPolicy::Blocks if group.block => out.push(segment(vec![group])),
            CheckpointPolicy::Blocks => out.extend(group.layers),
            CheckpointPolicy::All if group.block => {
                flush(&mut run, &mut out);
                out.push(segment(vec![group]));
            }
            CheckpointPolicy::All => run.push(group),
        }
    }
    flush(&mut run, &mut out);
    out
}

fn spec_error(path: &str, reason: impl Into<String>) -> ModelError {
    ModelError::Spec {
        path: path.to_string(),
        reason: reason.into(),
    }
}

fn image_channels(path: &str, shape: &[usize]) -> Result<usize> {
    match shape {
        [_, _, c] => Ok(*c),
        _ => Err(spec_error(
            path,
            format!("needs an image input [h, w, c], got {shape:?}"),
        )),
    }
}

/// A linear layer [rows, in] -> [rows, out], with a LoRA adapter when
/// `lora` is given (errors name `key_path.r` / `key_path.alpha`).
fn lora_linear(
    key_path: &str,
    name: &str,
    in_features: usize,
    out_features: usize,
    bias: bool,
    lora: &LoraConfig,
    ctx: &mut BuildContext<'_>,
) -> Result<Box<dyn Layer>> {
    lora.validate(key_path, in_features, out_features)?;
    let base = Linear::new(name, in_features, out_features, bias, &mut ctx.rng);
    Ok(Box::new(
        LoraLinear::new(name, base, *lora, &mut ctx.rng)
            .map_err(|e| spec_error(key_path, e.to_string()))?,
    ))
}

fn build_attention(
    path: &str,
    shape: &[usize],
    heads: usize,
    lean: bool,
    lora: Option<&LoraConfig>,
    ctx: &mut BuildContext<'_>,
) -> Result<Box<dyn Layer>> {
    let [_, width] = *shape else {
        return Err(spec_error(
            path,
            format!("attention needs a sequence [t, c], got {shape:?}"),
        ));
    };
    if heads == 0 || !width.is_multiple_of(heads) {
        return Err(spec_error(
            &format!("{path}.heads"),
            format!("must be positive and divide the width {width}, got {heads}"),
        ));
    }
    let projection = |name: String, out: usize, ctx: &mut BuildContext| match lora {
        Some(lora) => lora_linear(&format!("{path}.lora"), &name, width, out, true, lora, ctx),
        None => Ok(Box::new(Linear::new(&name, width, out, true, &mut ctx.rng)) as Box<dyn Layer>),
    };
    let qkv = projection(format!("{path}.qkv"), 3 * width, ctx)?;
    let proj = projection(format!("{path}.proj"), width, ctx)?;
    Ok(Box::new(CausalSelfAttention::new(
        width, heads, qkv, proj, lean,
    )?))
}

#[allow(clippy::too_many_arguments)]
fn build_transformer_block(
    path: &str,
    shape: &[usize],
    heads: usize,
    mlp_ratio: usize,
    dropout: f32,
    lean: bool,
    lora: Option<&LoraConfig>,
    ctx: &mut BuildContext<'_>,
) -> Result<Vec<Box<dyn Layer>>> {
    let [_, width] = *shape else {
        return Err(spec_error(
            path,
            format!("transformer_block needs a sequence [t, c], got {shape:?}"),
        ));
    };
    if mlp_ratio == 0 {
        return Err(spec_error(&format!("{path}.mlp_ratio"), "must be positive"));
    }
    if !(0.0..1.0).contains(&dropout) {
        return Err(spec_error(
            &format!("{path}.dropout"),
            format!("must be in [0, 1), got {dropout}"),
        ));
    }
    let dropout_layer = |ctx: &mut BuildContext| -> Result<Option<Box<dyn Layer>>> {
        if dropout > 0.0 {
            Ok(Some(Box::new(Dropout::new(dropout, ctx.rng.next_u64())?)))
        } else {
            Ok(None)
        }
    };
    let mut attention: Vec<Box<dyn Layer>> = vec![
        Box::new(LayerNorm::new(&format!("{path}.ln1"), width, default_eps())),
        build_attention(&format!("{path}.attn"), shape, heads, lean, lora, ctx)?,
    ];
    attention.extend(dropout_layer(ctx)?);
    let hidden = width * mlp_ratio;
    let mut mlp: Vec<Box<dyn Layer>> = vec![
        Box::new(LayerNorm::new(&format!("{path}.ln2"), width, default_eps())),
        Box::new(PerPosition::new(Box::new(Linear::new(
            &format!("{path}.fc"),
            width,
            hidden,
            true,
            &mut ctx.rng,
        )))),
        Box::new(Gelu::new()),
        Box::new(PerPosition::new(Box::new(Linear::new(
            &format!("{path}.fc_out"),
            hidden,
            width,
            true,
            &mut ctx.rng,
        )))),
    ];
    mlp.extend(dropout_layer(ctx)?);
    Ok(vec![
        Box::new(Residual::new(attention)),
        Box::new(Residual::new(mlp)),
    ])
}

/// The body of `basic_block` on `channels` channels: conv3x3+BN+ReLU,
/// conv3x3+BN (the block adds its input, then a ReLU). One definition for
/// the CPU and the GPU builders.
pub(crate) fn basic_block_body(channels: usize) -> Vec<LayerSpec> {
    let conv = LayerSpec::Conv {
        out: channels,
        kernel: 3,
        stride: 1,
        padding: None,
        bias: false,
    };
    let bn = LayerSpec::BatchNorm {
        momentum: default_momentum(),
        eps: default_eps(),
    };
    vec![conv.clone(), bn.clone(), LayerSpec::Relu, conv, bn]
}

/// Image layers that act on every frame of [t, h, w, c] (`PerFrame`).
fn is_per_frame(spec: &LayerSpec) -> bool {
    matches!(
        spec,
        LayerSpec::Conv { .. }
            | LayerSpec::BatchNorm { .. }
            | LayerSpec::Upsample2x
            | LayerSpec::MaxPool { .. }
            | LayerSpec::DepthwiseConv { .. }
    )
}

fn batch_norm(path: &str, shape: &[usize], momentum: f32, eps: f32) -> Result<BatchNorm2d> {
    let c = image_channels(path, shape)?;
    if !(0.0..=1.0).contains(&momentum) || eps.is_nan() || eps <= 0.0 {
        return Err(spec_error(
            path,
            "momentum must be in [0, 1] and eps positive",
        ));
    }
    Ok(BatchNorm2d::new(path, c, momentum, eps))
}

fn build_one(
    spec: &LayerSpec,
    path: &str,
    shape: &[usize],
    ctx: &mut BuildContext<'_>,
) -> Result<Vec<Box<dyn Layer>>> {
    if let ([_, frame @ ..], true) = (shape, shape.len() == 4 && is_per_frame(spec)) {
        let inner = build_one(spec, path, frame, ctx)?;
        return Ok(inner
            .into_iter()
            .map(|layer| Box::new(PerFrame::new(layer)) as Box<dyn Layer>)
            .collect());
    }
    let built: Vec<Box<dyn Layer>> = match spec {
        LayerSpec::Conv {
            out,
            kernel,
            stride,
            padding,
            bias,
        } => {
            let cin = image_channels(path, shape)?;
            if *out == 0 || *kernel == 0 || *stride == 0 {
                return Err(spec_error(path, "out, kernel and stride must be positive"));
            }
            let pad = padding.unwrap_or(kernel / 2);
            vec![Box::new(Conv2d::new(
                path,
                cin,
                *out,
                *kernel,
                *stride,
                pad,
                *bias,
                &mut ctx.rng,
            )?)]
        }
        LayerSpec::DepthwiseConv {
            kernel,
            stride,
            padding,
            bias,
            multiplier,
        } => {
            let channels = image_channels(path, shape)?;
            if *kernel == 0 || *stride == 0 || *multiplier == 0 {
                return Err(spec_error(
                    path,
                    "kernel, stride and multiplier must be positive",
                ));
            }
            vec![Box::new(DepthwiseConv2d::new(
                path,
                channels,
                *multiplier,
                *kernel,
                *stride,
                padding.unwrap_or(kernel / 2),
                *bias,
                &mut ctx.rng,
            )?)]
        }
        LayerSpec::BatchNorm { momentum, eps } => {
            vec![Box::new(batch_norm(path, shape, *momentum, *eps)?)]
        }
        LayerSpec::Relu => vec![Box::new(Relu::new())],
        LayerSpec::Custom { name, options } => {
            let Some(factory) = ctx.custom.get(name) else {
                return Err(spec_error(
                    path,
                    format!(
                        "no custom layer \"{name}\" is registered (registered: {:?}); \
                         register it in the LayerRegistry the network is built with",
                        ctx.custom.names()
                    ),
                ));
            };
            let mut args = CustomLayerArgs {
                path,
                input_shape: shape,
                options,
                rng: &mut ctx.rng,
            };
            vec![Box::new(CustomEntry::new(name, factory(&mut args)?))]
        }
        LayerSpec::GlobalAvgPool => {
            image_channels(path, shape)?;
            vec![Box::new(GlobalAvgPool::new())]
        }
        LayerSpec::MaxPool { kernel, stride } => {
            let stride = stride.unwrap_or(*kernel);
            if *kernel == 0 || stride == 0 {
                return Err(spec_error(path, "kernel and stride must be positive"));
            }
            let &[h, w, _] = shape else {
                return Err(spec_error(
                    path,
                    format!("max_pool needs an image input [h, w, c], got {shape:?}"),
                ));
            };
            if *kernel > h || *kernel > w {
                return Err(spec_error(
                    path,
                    format!(
                        "max_pool's {kernel}x{kernel} kernel does not fit the {h}x{w} image                          (no padding)"
                    ),
                ));
            }
            vec![Box::new(MaxPool2d::new(*kernel, stride))]
        }
        LayerSpec::Linear { out, bias } => {
            if *out == 0 {
                return Err(spec_error(path, "out must be positive"));
            }
            match *shape {
                [features] => vec![Box::new(Linear::new(
                    path,
                    features,
                    *out,
                    *bias,
                    &mut ctx.rng,
                ))],
                [_, features] => vec![Box::new(PerPosition::new(Box::new(Linear::new(
                    path,
                    features,
                    *out,
                    *bias,
                    &mut ctx.rng,
                ))))],
                _ => {
                    return Err(spec_error(
                        path,
                        format!(
                            "linear needs a feature vector [c] or a sequence [t, c], got \
                             {shape:?}; add a global_avg_pool or a flatten"
                        ),
                    ))
                }
            }
        }
        LayerSpec::Flatten => vec![Box::new(Flatten::new())],
        LayerSpec::Silu => vec![Box::new(Silu::new())],
        LayerSpec::Gelu => vec![Box::new(Gelu::new())],
        LayerSpec::LayerNorm { eps } => {
            let Some(&features) = shape.last() else {
                return Err(spec_error(path, "layer_norm needs a non-scalar input"));
            };
            if !(eps.is_finite() && *eps > 0.0) {
                return Err(spec_error(
                    &format!("{path}.eps"),
                    format!("must be positive, got {eps}"),
                ));
            }
            vec![Box::new(LayerNorm::new(path, features, *eps))]
        }
        LayerSpec::Embedding { dim, positions } => {
            let Some(vocab) = ctx.vocab else {
                return Err(spec_error(
                    path,
                    "embedding reads token ids: set model.tokens = { length, vocab }",
                ));
            };
            let [length] = *shape else {
                return Err(spec_error(
                    path,
                    format!("embedding needs token ids [t], got {shape:?}"),
                ));
            };
            if *dim == 0 {
                return Err(spec_error(&format!("{path}.dim"), "must be positive"));
            }
            let max_positions = positions.then_some(length);
            vec![Box::new(Embedding::new(
                path,
                vocab,
                *dim,
                max_positions,
                &mut ctx.rng,
            ))]
        }
        LayerSpec::Dropout { p } => {
            if !(0.0..1.0).contains(p) {
                return Err(spec_error(
                    &format!("{path}.p"),
                    format!("must be in [0, 1), got {p}"),
                ));
            }
            vec![Box::new(Dropout::new(*p, ctx.rng.next_u64())?)]
        }
        LayerSpec::CausalSelfAttention { heads, lean, lora } => {
            vec![build_attention(
                path,
                shape,
                *heads,
                *lean,
                lora.as_ref(),
                ctx,
            )?]
        }
        LayerSpec::LoraLinear { out, bias, lora } => {
            let (features, per_position) = match *shape {
                [features] => (features, false),
                [_, features] => (features, true),
                _ => {
                    return Err(spec_error(
                        path,
                        format!("lora_linear needs [c] or a sequence [t, c], got {shape:?}"),
                    ))
                }
            };
            if *out == 0 {
                return Err(spec_error(&format!("{path}.out"), "must be positive"));
            }
            let layer = lora_linear(
                &format!("{path}.lora"),
                path,
                features,
                *out,
                *bias,
                lora,
                ctx,
            )?;
            if per_position {
                vec![Box::new(PerPosition::new(layer))]
            } else {
                vec![layer]
            }
        }
        LayerSpec::Lstm { hidden } => {
            let [_, features] = *shape else {
                return Err(spec_error(
                    path,
                    format!("lstm needs a sequence [t, c], got {shape:?}"),
                ));
            };
            if *hidden == 0 {
                return Err(spec_error(&format!("{path}.hidden"), "must be positive"));
            }
            vec![Box::new(Lstm::new(path, features, *hidden, &mut ctx.rng))]
        }
        LayerSpec::Upsample2x => {
            image_channels(path, shape)?;
            vec![Box::new(Upsample2x::new())]
        }
        LayerSpec::UnetSkip { layers } => {
            if !(3..=4).contains(&shape.len()) {
                return Err(spec_error(
                    path,
                    format!(
                        "unet_skip needs an image [h, w, c] or frames [t, h, w, c], got {shape:?}"
                    ),
                ));
            }
            let mut inner = shape.to_vec();
            let body = build_layers(layers, &format!("{path}.layers"), &mut inner, ctx)?;
            let lead = shape.len() - 1;
            if inner.len() != shape.len() || inner[..lead] != shape[..lead] {
                return Err(spec_error(
                    path,
                    format!("unet_skip body maps {shape:?} to {inner:?}; it must keep the height and width"),
                ));
            }
            vec![Box::new(UnetSkip::new(body))]
        }
        LayerSpec::ConvLstm { hidden, kernel } => {
            let [_, _, _, channels] = *shape else {
                return Err(spec_error(
                    path,
                    format!("conv_lstm needs frames [t, h, w, c], got {shape:?}"),
                ));
            };
            if *hidden == 0 {
                return Err(spec_error(&format!("{path}.hidden"), "must be positive"));
            }
            if *kernel == 0 || kernel.is_multiple_of(2) {
                return Err(spec_error(
                    &format!("{path}.kernel"),
                    format!("must be odd, got {kernel}"),
                ));
            }
            let layer = ConvLstm::new(path, channels, *hidden, *kernel, &mut ctx.rng)?;
            vec![Box::new(
                layer.with_step_recompute(!ctx.checkpoint.is_none()),
            )]
        }
        LayerSpec::TransformerBlock {
            heads,
            mlp_ratio,
            dropout,
            lean,
            lora,
        } => build_transformer_block(
            path,
            shape,
            *heads,
            *mlp_ratio,
            *dropout,
            *lean,
            lora.as_ref(),
            ctx,
        )?,
        LayerSpec::Residual { layers } => {
            let mut inner = shape.to_vec();
            let body = build_layers(layers, &format!("{path}.layers"), &mut inner, ctx)?;
            if inner != shape {
                return Err(spec_error(
                    path,
                    format!("residual body maps {shape:?} to {inner:?}; it must keep the shape"),
                ));
            }
            vec![Box::new(Residual::new(body))]
        }
        LayerSpec::BasicBlock if ctx.fuse && shape.len() == 3 => {
            let mut body = basic_block_body(image_channels(path, shape)?);
            let Some(LayerSpec::BatchNorm { momentum, eps }) = body.pop() else {
                unreachable!("a basic block's body ends in a batch norm");
            };
            let here = format!("{path}.layers");
            let mut inner = shape.to_vec();
            let body = build_layers(&body, &here, &mut inner, ctx)?;
            let tail = batch_norm(&format!("{here}[4]"), &inner, momentum, eps)?;
            vec![Box::new(FusedResidual::new(body, tail))]
        }
        LayerSpec::BasicBlock => {
            let body = basic_block_body(image_channels(path, shape)?);
            let mut built = build_one(&LayerSpec::Residual { layers: body }, path, shape, ctx)?;
            built.push(Box::new(Relu::new()));
            built
        }
    };
    Ok(built)
}
