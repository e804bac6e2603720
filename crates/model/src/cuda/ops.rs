//! The operations of the reference ResNet on the GPU, forward and backward,
//! each a thin wrapper that checks shapes, allocates outputs and launches the
//! kernels of `crates/model/kernels/*.cu` (or cuBLAS) on the compute stream.
//! Activations are `CudaTensor`s (NHWC) stored as f16 (mixed precision) or
//! f32 (f32 training); each op takes the storage type T of its inputs and
//! launches that instantiation of its kernel (`KernelPair::of`), and a
//! mix of types is an error. Parameters are views of the same type into
//! the groups' compute weights (see `ParamGroup`); parameter gradients are
//! f32 and ACCUMULATED (`+=`), like the CPU layers'. In the SAFETY notes,
//! `T*` is `hr_half*` or `float*` as the launched instantiation says.
//!
//! Each wrapper mirrors a CPU reference, which `tests/cuda_parity.rs`
//! compares it with:
//!
//! | wrapper | CPU reference |
//! |---|---|
//! | `cast_f32_to_f16`, `cast_f16_to_f32` | `half` conversions |
//! | `normalize_u8` | `Tensor::from_u8_normalized` |
//! | `conv2d_forward` / `conv2d_backward` | `layers::Conv2d` |
//! | `batch_norm_forward_train` / `_eval` / `batch_norm_backward` | `layers::BatchNorm2d` (+ `Relu` when fused) |
//! | `batch_norm_add_forward_train` / `_eval` / `batch_norm_add_relu_backward` | `layers::FusedResidual`'s tail (`BatchNorm2d::forward_add_relu`) |
//! | `relu_forward` / `relu_backward` | `layers::Relu` |
//! | `smooth_forward` / `smooth_backward` | `layers::Silu`, `layers::Gelu` |
//! | `dropout_apply`, `dropout_count`, `dropout_restore_if_skipped` | `layers::Dropout` |
//! | `add_inplace`, `add` | `layers::Residual`'s sums |
//! | `global_avg_pool_forward` / `_backward` | `layers::GlobalAvgPool` |
//! | `layer_norm_forward` / `layer_norm_backward` | `layers::LayerNorm` |
//! | `upsample2x_forward` / `_backward`, `channels_concat` / `_split` | `layers::Upsample2x`, `layers::UnetSkip` |
//! | `linear_forward` / `linear_backward`, `bias_add`, `bias_grad` | `layers::Linear` |
//! | `softmax_cross_entropy`, `XentOutput::summary` | `loss::softmax_cross_entropy` |
//! | `soft_cross_entropy` | `loss::soft_cross_entropy` |
//! | `focal_loss`, `soft_focal_loss` | `loss::focal_loss`, `loss::soft_focal_loss` |
//! | the frame models' ops (`frames.rs`) | `layers::ConvLstm`, `loss::pixel_mse` |
//! | the token models' ops (`sequence.rs`) | `layers::Embedding`, `layers::CausalSelfAttention`, `layers::LoraLinear` |
//!
//! Every launch is asynchronous; nothing here waits for the GPU except the
//! explicit downloads.

use cudarc::driver::{CudaFunction, CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};
use half::f16;

use super::backend::{CudaBackend, DeviceBuffer};
use super::error::Context;
use super::gemm::{gemm, Operand};
use super::kernels::{self as k, KernelPair, KernelSig};
use super::params::*;
use super::tensor::{
    checked_len, same_dtype, AnyView, AnyViewMut, CudaTensor, DType, MAX_ELEMENTS,
};
use super::{CudaError, CudaResult};

mod conv_narrow;
mod conv_tune;
mod frames;
mod sequence;
use conv_narrow::{direct_forward, direct_kind, direct_wgrad, narrow_grad_input};
use conv_tune::choose_path;
pub use conv_tune::{ConvPath, ConvProduct, TunedConv};
pub use frames::*;
pub use sequence::*;

/// The most threads any launch of the backend puts in one block. cuda_ptx
/// checks that every kernel's registers and shared memory fit a block this
/// wide on an SM (wider, a GPU refuses the launch for want of resources),
/// and the tests have the emulator refuse any wider launch.
pub const MAX_BLOCK_THREADS: u32 = 256;
/// Threads per block of the elementwise kernels.
const BLOCK: u32 = MAX_BLOCK_THREADS;
/// Grid-stride kernels never need more blocks than this.
const MAX_BLOCKS: usize = 1 << 16;

/// One thread per element (grid-stride past MAX_BLOCKS·BLOCK).
fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, MAX_BLOCKS) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One thread per channel.
fn per_channel(c: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (c.div_ceil(128).max(1) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// 8 channels by 32 lanes a block (batchnorm.cu's finalize kernels).
fn bn_finalize_lanes(c: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (c.div_ceil(8).max(1) as u32, 1, 1),
        block_dim: (8, 32, 1),
        shared_mem_bytes: 0,
    }
}

/// 32 channels by 8 lanes a block (layernorm.cu's finalize kernel).
fn per_channel_lanes(c: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (c.div_ceil(32).max(1) as u32, 1, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    }
}

fn u32_of(op: &'static str, v: usize) -> CudaResult<u32> {
    if v > MAX_ELEMENTS {
        return Err(CudaError::Unsupported {
            op,
            reason: format!("{v} exceeds the kernels' limit of {MAX_ELEMENTS} elements"),
        });
    }
    Ok(v as u32)
}

/// (rows, columns) of a matrix [rows, cols]; anything else is an error
/// saying what `op` expected.
fn matrix_dims(op: &'static str, expected: &str, t: &CudaTensor) -> CudaResult<(usize, usize)> {
    match *t.shape() {
        [rows, cols] => Ok((rows, cols)),
        _ => Err(CudaError::shape(op, expected, format!("{:?}", t.shape()))),
    }
}

fn same_len(op: &'static str, what: &str, expected: usize, got: usize) -> CudaResult<()> {
    if expected != got {
        return Err(CudaError::shape(
            op,
            format!("{what} of {expected} elements"),
            format!("{got}"),
        ));
    }
    Ok(())
}

fn nhwc(op: &'static str, shape: &[usize]) -> CudaResult<[usize; 4]> {
    match *shape {
        [n, h, w, c] => Ok([n, h, w, c]),
        _ => Err(CudaError::shape(
            op,
            "an NHWC batch [n, h, w, c]",
            format!("{shape:?}"),
        )),
    }
}

// ---------------------------------------------------------------------------
// Casts and input normalisation

/// f32 → f16 between views of equal length.
pub fn cast_f32_to_f16_into(
    be: &CudaBackend,
    x: &CudaView<'_, f32>,
    y: &mut CudaViewMut<'_, f16>,
) -> CudaResult<()> {
    same_len("cast_f32_to_f16", "output", x.len(), y.len())?;
    let n = x.len();
    if n == 0 {
        return Ok(());
    }
    let p = CastParams {
        n: u32_of("cast_f32_to_f16", n)?,
    };
    let f = be.function(&k::CAST_F32_TO_F16)?;
    let mut b = be.compute_stream().launch_builder(&f);
    b.arg(&p).arg(x).arg(y);
    // SAFETY: cast_f32_to_f16(CastParams, const float*, hr_half*); x and y
    // hold n elements each.
    unsafe { b.launch(elementwise(n)) }.during("cast_f32_to_f16")?;
    Ok(())
}

/// f16 → f32 between views of equal length.
pub fn cast_f16_to_f32_into(
    be: &CudaBackend,
    x: &CudaView<'_, f16>,
    y: &mut CudaViewMut<'_, f32>,
) -> CudaResult<()> {
    same_len("cast_f16_to_f32", "output", x.len(), y.len())?;
    let n = x.len();
    if n == 0 {
        return Ok(());
    }
    let p = CastParams {
        n: u32_of("cast_f16_to_f32", n)?,
    };
    let f = be.function(&k::CAST_F16_TO_F32)?;
    let mut b = be.compute_stream().launch_builder(&f);
    b.arg(&p).arg(x).arg(y);
    // SAFETY: cast_f16_to_f32(CastParams, const hr_half*, float*); x and y
    // hold n elements each.
    unsafe { b.launch(elementwise(n)) }.during("cast_f16_to_f32")?;
    Ok(())
}

pub fn cast_f32_to_f16(be: &CudaBackend, x: &CudaTensor) -> CudaResult<CudaTensor> {
    let mut y = CudaTensor::uninit(be, x.shape(), DType::F16)?;
    cast_f32_to_f16_into(be, &x.f32_view()?, &mut y.f16_view_mut()?)?;
    Ok(y)
}

pub fn cast_f16_to_f32(be: &CudaBackend, x: &CudaTensor) -> CudaResult<CudaTensor> {
    let mut y = CudaTensor::uninit(be, x.shape(), DType::F32)?;
    cast_f16_to_f32_into(be, &x.f16_view()?, &mut y.f32_view_mut()?)?;
    Ok(y)
}

/// How u8 pixels become a network input: (x/255 - mean)/std, stored as
/// `dtype` (the network's activations).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Normalization {
    pub mean: f32,
    pub std: f32,
    pub dtype: DType,
}

/// u8 pixels (already on the device) → the network's input, computed as
/// the CPU's `Tensor::from_u8_normalized` does: x·(1/(255·std)) - mean/std.
pub fn normalize_u8(
    be: &CudaBackend,
    pixels: &CudaView<'_, u8>,
    shape: &[usize],
    norm: Normalization,
) -> CudaResult<CudaTensor> {
    let n = checked_len("normalize_u8", shape)?;
    same_len("normalize_u8", "pixels", n, pixels.len())?;
    let mut y = CudaTensor::uninit(be, shape, norm.dtype)?;
    if n == 0 {
        return Ok(y);
    }
    let p = NormalizeParams {
        n: n as u32,
        scale: 1.0 / (255.0 * norm.std),
        shift: norm.mean / norm.std,
    };
    let f = be.function(k::NORMALIZE_U8.of(norm.dtype))?;
    {
        let mut b = be.compute_stream().launch_builder(&f);
        b.arg(&p).arg(pixels).arg(&mut y);
        // SAFETY: normalize_u8_T(NormalizeParams, const u8*, T*); pixels and
        // y hold n elements each.
        unsafe { b.launch(elementwise(n)) }.during("normalize_u8")?;
    }
    Ok(y)
}

/// A batch of `n` samples made on the device from a resident u8 NHWC set
/// of `samples` images of `[h, w, c]`: crop, flip and normalisation by
/// `recipes` (two words per sample, the loader's `SampleRecipe::packed`),
/// bit for bit what `normalize_u8` gives for the same batch made on the
/// host. The caller has checked every recipe against the set
/// (`staging::check_recipes`).
#[allow(clippy::too_many_arguments)]
pub fn gather_crop_flip(
    be: &CudaBackend,
    images: &CudaView<'_, u8>,
    recipes: &CudaView<'_, u32>,
    n: usize,
    [h, w, c]: [usize; 3],
    norm: Normalization,
) -> CudaResult<CudaTensor> {
    let shape = [n, h, w, c];
    let len = checked_len("gather_crop_flip", &shape)?;
    same_len("gather_crop_flip", "recipes", 2 * n, recipes.len())?;
    if !images.len().is_multiple_of((h * w * c).max(1)) {
        return Err(CudaError::shape(
            "gather_crop_flip",
            format!("whole images of {h} x {w} x {c}"),
            format!("{} bytes", images.len()),
        ));
    }
    let mut y = CudaTensor::uninit(be, &shape, norm.dtype)?;
    if len == 0 {
        return Ok(y);
    }
    let p = GatherParams {
        n: n as u32,
        h: h as u32,
        w: w as u32,
        c: c as u32,
        scale: 1.0 / (255.0 * norm.std),
        shift: norm.mean / norm.std,
    };
    let f = be.function(k::GATHER_CROP_FLIP.of(norm.dtype))?;
    {
        let mut b = be.compute_stream().launch_builder(&f);
        b.arg(&p).arg(images).arg(recipes).arg(&mut y);
        // SAFETY: gather_crop_flip_u8_T(GatherParams, const u8* images,
        // const u32* recipes [2n], T* y [n*h*w*c]); every recipe's id
        // is below the set's size and its crop inside the padding (checked
        // by the caller), so every read of `images` is in bounds.
        unsafe { b.launch(elementwise(len)) }.during("gather_crop_flip_u8")?;
    }
    Ok(y)
}

// ---------------------------------------------------------------------------
// Elementwise layers

/// ReLU forward (NaN propagates). The output is what backward needs.
pub fn relu_forward(be: &CudaBackend, x: &CudaTensor) -> CudaResult<CudaTensor> {
    let n = x.len();
    let mut y = CudaTensor::uninit(be, x.shape(), x.dtype())?;
    if n > 0 {
        let p = EwParams { n: n as u32 };
        let f = be.function(k::RELU_FORWARD.of(x.dtype()))?;
        let mut b = be.compute_stream().launch_builder(&f);
        b.arg(&p).arg(x).arg(&mut y);
        // SAFETY: relu_forward_T(EwParams, const T*, T*); x and y
        // hold n elements.
        unsafe { b.launch(elementwise(n)) }.during("relu_forward")?;
    }
    Ok(y)
}

/// ReLU backward: dx = y > 0 ? g : 0 with y the forward's output.
pub fn relu_backward(be: &CudaBackend, g: &CudaTensor, y: &CudaTensor) -> CudaResult<CudaTensor> {
    g.expect_shape("relu backward", y.shape())?;
    same_dtype("relu backward", g.dtype(), &[y.dtype()])?;
    let n = g.len();
    let mut dx = CudaTensor::uninit(be, g.shape(), g.dtype())?;
    if n > 0 {
        let p = EwParams { n: n as u32 };
        let f = be.function(k::RELU_BACKWARD.of(g.dtype()))?;
        let mut b = be.compute_stream().launch_builder(&f);
        b.arg(&p).arg(g).arg(y).arg(&mut dx);
        // SAFETY: relu_backward_T(EwParams, const T* g, const T* y, T* dx);
        // all hold n elements.
        unsafe { b.launch(elementwise(n)) }.during("relu_backward")?;
    }
    Ok(dx)
}

/// A smooth activation: its derivative needs the forward's input, which
/// backward reads (`layers::smooth_activation`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Smooth {
    /// x·σ(x).
    Silu,
    /// GELU, tanh approximation.
    Gelu,
}

impl Smooth {
    /// The forward and backward kernels, with their names for errors.
    fn kernels(self) -> [(KernelPair, &'static str); 2] {
        match self {
            Smooth::Silu => [
                (k::SILU_FORWARD, "silu_forward"),
                (k::SILU_BACKWARD, "silu_backward"),
            ],
            Smooth::Gelu => [
                (k::GELU_FORWARD, "gelu_forward"),
                (k::GELU_BACKWARD, "gelu_backward"),
            ],
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Smooth::Silu => "silu",
            Smooth::Gelu => "gelu",
        }
    }
}

/// SiLU or GELU forward; backward needs `x`.
pub fn smooth_forward(be: &CudaBackend, kind: Smooth, x: &CudaTensor) -> CudaResult<CudaTensor> {
    let n = x.len();
    let mut y = CudaTensor::uninit(be, x.shape(), x.dtype())?;
    if n > 0 {
        let p = EwParams { n: n as u32 };
        let [(kernel, op), _] = kind.kernels();
        let f = be.function(kernel.of(x.dtype()))?;
        let mut b = be.compute_stream().launch_builder(&f);
        b.arg(&p).arg(x).arg(&mut y);
        // SAFETY: silu_forward_T / gelu_forward_T(EwParams, const T* x,
        // T* y); x and y hold n elements.
        unsafe { b.launch(elementwise(n)) }.during(op)?;
    }
    Ok(y)
}

/// SiLU or GELU backward: dx = g · f'(x), x the forward's input.
pub fn smooth_backward(
    be: &CudaBackend,
    kind: Smooth,
    g: &CudaTensor,
    x: &CudaTensor,
) -> CudaResult<CudaTensor> {
    g.expect_shape("smooth activation backward", x.shape())?;
    same_dtype("smooth activation backward", g.dtype(), &[x.dtype()])?;
    let n = g.len();
    let mut dx = CudaTensor::uninit(be, g.shape(), g.dtype())?;
    if n > 0 {
        let p = EwParams { n: n as u32 };
        let [_, (kernel, op)] = kind.kernels();
        let f = be.function(kernel.of(g.dtype()))?;
        let mut b = be.compute_stream().launch_builder(&f);
        b.arg(&p).arg(g).arg(x).arg(&mut dx);
        // SAFETY: silu_backward_T / gelu_backward_T(EwParams, const T* g,
        // const T* x, T* dx); all hold n elements.
        unsafe { b.launch(elementwise(n)) }.during(op)?;
    }
    Ok(dx)
}

/// A dropout layer's mask: zero with probability `p`, else 1/(1 − p), by
/// a hash of (`seed`, the counter on the device, the index).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DropoutMask {
    pub p: f32,
    pub seed: u64,
}

impl DropoutMask {
    fn params(&self, op: &'static str, n: usize, previous: bool) -> CudaResult<DropoutParams> {
        Ok(DropoutParams {
            n: u32_of(op, n)?,
            p: self.p,
            scale: 1.0 / (1.0 - self.p),
            seed_lo: self.seed as u32,
            seed_hi: (self.seed >> 32) as u32,
            previous: previous as u32,
        })
    }
}

/// One block of one warp (the counter's kernels).
fn one_warp() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn expect_counter(op: &'static str, counter: &CudaSlice<f32>) -> CudaResult<()> {
    same_len(op, "counter limbs", 4, counter.len())
}

/// `x` times the mask of `counter` (forward), or of the counter before the
/// last forward (`previous`: backward, or a recomputed forward).
pub fn dropout_apply(
    be: &CudaBackend,
    mask: DropoutMask,
    counter: &CudaSlice<f32>,
    previous: bool,
    x: &CudaTensor,
) -> CudaResult<CudaTensor> {
    expect_counter("dropout", counter)?;
    let n = x.len();
    let p = mask.params("dropout", n, previous)?;
    let mut y = CudaTensor::uninit(be, x.shape(), x.dtype())?;
    if n > 0 {
        let f = be.function(k::DROPOUT_APPLY.of(x.dtype()))?;
        let mut b = be.compute_stream().launch_builder(&f);
        b.arg(&p).arg(counter).arg(x).arg(&mut y);
        // SAFETY: dropout_apply_T(DropoutParams, const float* counter [4],
        // const T* x, T* y); x and y hold n elements.
        unsafe { b.launch(elementwise(n)) }.during("dropout_apply")?;
    }
    Ok(y)
}

/// Advances the counter by one (after a training forward).
pub fn dropout_count(
    be: &CudaBackend,
    mask: DropoutMask,
    counter: &mut CudaSlice<f32>,
) -> CudaResult<()> {
    expect_counter("dropout_count", counter)?;
    let p = mask.params("dropout_count", 0, false)?;
    let f = be.function(&k::DROPOUT_COUNT)?;
    let mut b = be.compute_stream().launch_builder(&f);
    b.arg(&p).arg(counter);
    // SAFETY: dropout_count(DropoutParams, float* counter [4]): one thread.
    unsafe { b.launch(one_warp()) }.during("dropout_count")?;
    Ok(())
}

/// Puts back the counter saved before the step if `verdict` says the step
/// was skipped.
pub fn dropout_restore_if_skipped(
    be: &CudaBackend,
    mask: DropoutMask,
    verdict: &CudaSlice<StepState>,
    saved: &CudaSlice<f32>,
    counter: &mut CudaSlice<f32>,
) -> CudaResult<()> {
    expect_counter("dropout_restore_if_skipped", saved)?;
    expect_counter("dropout_restore_if_skipped", counter)?;
    let p = mask.params("dropout_restore_if_skipped", 0, false)?;
    let f = be.function(&k::DROPOUT_COUNTER_RESTORE)?;
    let mut b = be.compute_stream().launch_builder(&f);
    b.arg(&p).arg(verdict).arg(saved).arg(counter);
    // SAFETY: dropout_counter_restore(DropoutParams, const StepState* [1],
    // const float* saved [4], float* counter [4]): threads 0..4 copy.
    unsafe { b.launch(one_warp()) }.during("dropout_counter_restore")?;
    Ok(())
}

/// acc += b (the residual sum in forward and in backward).
pub fn add_inplace(be: &CudaBackend, acc: &mut CudaTensor, b_in: &CudaTensor) -> CudaResult<()> {
    b_in.expect_shape("residual add", acc.shape())?;
    same_dtype("residual add", acc.dtype(), &[b_in.dtype()])?;
    let n = acc.len();
    if n == 0 {
        return Ok(());
    }
    let p = EwParams { n: n as u32 };
    let f = be.function(k::ADD_INPLACE.of(acc.dtype()))?;
    let mut b = be.compute_stream().launch_builder(&f);
    b.arg(&p).arg(acc).arg(b_in);
    // SAFETY: add_inplace_T(EwParams, T* acc, const T* b); both
    // hold n elements and are distinct tensors (the borrow checker
    // guarantees acc is not b_in).
    unsafe { b.launch(elementwise(n)) }.during("add_inplace")?;
    Ok(())
}

/// out = a + b.
pub fn add(be: &CudaBackend, a: &CudaTensor, b_in: &CudaTensor) -> CudaResult<CudaTensor> {
    b_in.expect_shape("add", a.shape())?;
    same_dtype("add", a.dtype(), &[b_in.dtype()])?;
    let n = a.len();
    let mut out = CudaTensor::uninit(be, a.shape(), a.dtype())?;
    if n > 0 {
        let p = EwParams { n: n as u32 };
        let f = be.function(k::ADD.of(a.dtype()))?;
        let mut b = be.compute_stream().launch_builder(&f);
        b.arg(&p).arg(a).arg(b_in).arg(&mut out);
        // SAFETY: add_T(EwParams, const T*, const T*, T*);
        // all hold n elements.
        unsafe { b.launch(elementwise(n)) }.during("add")?;
    }
    Ok(out)
}

/// `y[r, c] += bias[c]` for y viewed as [rows, cols] with cols = bias.len().
pub fn bias_add(be: &CudaBackend, y: &mut AnyViewMut<'_>, bias: &AnyView<'_>) -> CudaResult<()> {
    same_dtype("bias_add", y.dtype(), &[bias.dtype()])?;
    let cols = bias.len();
    if cols == 0 || !y.len().is_multiple_of(cols) {
        return Err(CudaError::shape(
            "bias_add",
            format!("a multiple of the {cols} bias elements"),
            format!("{} elements", y.len()),
        ));
    }
    let rows = y.len() / cols;
    if rows == 0 {
        return Ok(());
    }
    let p = RowsColsParams {
        rows: u32_of("bias_add", rows)?,
        cols: cols as u32,
    };
    let f = be.function(k::BIAS_ADD.of(y.dtype()))?;
    let mut b = be.compute_stream().launch_builder(&f);
    b.arg(&p).arg(y).arg(bias);
    // SAFETY: bias_add_T(RowsColsParams, T* y, const T* bias); y
    // holds rows·cols elements, bias cols.
    unsafe { b.launch(elementwise(rows * cols)) }.during("bias_add")?;
    Ok(())
}

/// `grad[c] += Σ_r g[r, c]` for g viewed as [rows, cols], cols = grad.len():
/// per chunk of rows (`bn_chunking`, a rule of the row count alone), then
/// the chunks' partials in order, so the bits do not vary between runs.
pub fn bias_grad(
    be: &CudaBackend,
    g: &AnyView<'_>,
    grad: &mut CudaViewMut<'_, f32>,
) -> CudaResult<()> {
    let cols = grad.len();
    if cols == 0 || !g.len().is_multiple_of(cols) {
        return Err(CudaError::shape(
            "bias_grad",
            format!("a multiple of the {cols} bias elements"),
            format!("{} elements", g.len()),
        ));
    }
    let rows = g.len() / cols;
    let (rows_per_chunk, chunks) = bn_chunking(rows);
    if chunks == 1 {
        return column_sums(be, g, rows, cols, rows_per_chunk, 1, grad);
    }
    let mut partials = be.alloc::<f32>(chunks * cols)?;
    column_sums(
        be,
        g,
        rows,
        cols,
        rows_per_chunk,
        chunks,
        &mut partials.slice.as_view_mut(),
    )?;
    let partials = AnyView::F32(partials.slice.as_view());
    column_sums(be, &partials, chunks, cols, chunks, 1, grad)
}

/// One `bias_grad_T` launch: `out` += the column sums (one chunk), or
/// `out` [chunks, cols] = each chunk's.
fn column_sums(
    be: &CudaBackend,
    g: &AnyView<'_>,
    rows: usize,
    cols: usize,
    rows_per_chunk: usize,
    chunks: usize,
    out: &mut CudaViewMut<'_, f32>,
) -> CudaResult<()> {
    same_len("bias_grad", "column sums", chunks * cols, out.len())?;
    let p = ColumnSumParams {
        rows: u32_of("bias_grad", rows)?,
        cols: u32_of("bias_grad", cols)?,
        rows_per_chunk: u32_of("bias_grad", rows_per_chunk)?,
        chunks: u32_of("bias_grad", chunks)?,
    };
    let f = be.function(k::BIAS_GRAD.of(g.dtype()))?;
    let cfg = LaunchConfig {
        grid_dim: (cols.div_ceil(32) as u32, chunks as u32, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    let mut b = be.compute_stream().launch_builder(&f);
    b.arg(&p).arg(g).arg(out);
    // SAFETY: bias_grad_T(ColumnSumParams, const T* g [rows, cols], float*
    // out [chunks, cols]) with block (32, 8) and grid (⌈cols/32⌉, chunks),
    // as its shared array and chunk index require; lengths checked above.
    unsafe { b.launch(cfg) }.during("bias_grad")?;
    Ok(())
}

// ---------------------------------------------------------------------------
// UNet pieces

fn image_dims(op: &'static str, shape: &[usize]) -> CudaResult<UpsampleParams> {
    match *shape {
        [n, h, w, c] => Ok(UpsampleParams {
            n: u32_of(op, n)?,
            h: u32_of(op, h)?,
            w: u32_of(op, w)?,
            c: u32_of(op, c)?,
        }),
        _ => Err(CudaError::shape(
            op,
            "an image batch [n, h, w, c]",
            format!("{shape:?}"),
        )),
    }
}

/// Nearest-neighbour ×2: [n, h, w, c] -> [n, 2h, 2w, c].
pub fn upsample2x_forward(be: &CudaBackend, x: &CudaTensor) -> CudaResult<CudaTensor> {
    let p = image_dims("upsample2x", x.shape())?;
    let (n, h, w, c) = (x.shape()[0], x.shape()[1], x.shape()[2], x.shape()[3]);
    let mut y = CudaTensor::uninit(be, &[n, 2 * h, 2 * w, c], x.dtype())?;
    if !y.is_empty() {
        let cfg = elementwise(y.len());
        let f = be.function(k::UPSAMPLE2X_FORWARD.of(x.dtype()))?;
        let mut b = be.compute_stream().launch_builder(&f);
        b.arg(&p).arg(x).arg(&mut y);
        // SAFETY: upsample2x_forward_T(UpsampleParams of x, const T* x
        // [n, h, w, c], T* y [n, 2h, 2w, c]).
        unsafe { b.launch(cfg) }.during("upsample2x_forward")?;
    }
    Ok(y)
}

/// Upsample2x backward: each element of `input_shape` the sum of its 2×2
/// block of `g`.
pub fn upsample2x_backward(
    be: &CudaBackend,
    g: &CudaTensor,
    input_shape: &[usize],
) -> CudaResult<CudaTensor> {
    let p = image_dims("upsample2x backward", input_shape)?;
    let [n, h, w, c] = *input_shape else {
        return Err(CudaError::shape(
            "upsample2x backward",
            "[n, h, w, c]",
            format!("{input_shape:?}"),
        ));
    };
    g.expect_shape("upsample2x backward", &[n, 2 * h, 2 * w, c])?;
    let mut dx = CudaTensor::uninit(be, input_shape, g.dtype())?;
    if !dx.is_empty() {
        let cfg = elementwise(dx.len());
        let f = be.function(k::UPSAMPLE2X_BACKWARD.of(g.dtype()))?;
        let mut b = be.compute_stream().launch_builder(&f);
        b.arg(&p).arg(g).arg(&mut dx);
        // SAFETY: upsample2x_backward_T(UpsampleParams of dx, const T* g
        // [n, 2h, 2w, c], T* dx [n, h, w, c]) (shapes checked above).
        unsafe { b.launch(cfg) }.during("upsample2x_backward")?;
    }
    Ok(dx)
}

/// Every index but the channels' (rows), and the channels, of `t`.
fn rows_and_channels(op: &'static str, t: &CudaTensor) -> CudaResult<(Vec<usize>, usize)> {
    match t.shape() {
        [lead @ .., c] if !lead.is_empty() => Ok((lead.to_vec(), *c)),
        shape => Err(CudaError::shape(op, "[n, ..., c]", format!("{shape:?}"))),
    }
}

/// `a` and `b` side by side along the channels (unet_skip's output); every
/// other axis must agree.
pub fn channels_concat(
    be: &CudaBackend,
    a: &CudaTensor,
    b_in: &CudaTensor,
) -> CudaResult<CudaTensor> {
    let (lead, c1) = rows_and_channels("channels_concat", a)?;
    let (lead_b, c2) = rows_and_channels("channels_concat", b_in)?;
    if lead != lead_b {
        return Err(CudaError::shape(
            "channels_concat",
            format!("{lead:?} and any channels"),
            format!("{:?}", b_in.shape()),
        ));
    }
    same_dtype("channels_concat", a.dtype(), &[b_in.dtype()])?;
    let rows: usize = lead.iter().product();
    let p = ConcatParams {
        rows: u32_of("channels_concat", rows)?,
        c1: u32_of("channels_concat", c1)?,
        c2: u32_of("channels_concat", c2)?,
    };
    let mut shape = lead;
    shape.push(c1 + c2);
    let mut y = CudaTensor::uninit(be, &shape, a.dtype())?;
    if !y.is_empty() {
        let cfg = elementwise(y.len());
        let f = be.function(k::CHANNELS_CONCAT.of(a.dtype()))?;
        let mut b = be.compute_stream().launch_builder(&f);
        b.arg(&p).arg(a).arg(b_in).arg(&mut y);
        // SAFETY: channels_concat_T(ConcatParams, const T* a [rows, c1],
        // const T* b [rows, c2], T* y [rows, c1 + c2]).
        unsafe { b.launch(cfg) }.during("channels_concat")?;
    }
    Ok(y)
}

/// `g` split along the channels into its first `c1` and the rest.
pub fn channels_split(
    be: &CudaBackend,
    g: &CudaTensor,
    c1: usize,
) -> CudaResult<(CudaTensor, CudaTensor)> {
    let (lead, c) = rows_and_channels("channels_split", g)?;
    if c1 > c {
        return Err(CudaError::shape(
            "channels_split",
            format!("at least {c1} channels"),
            format!("{:?}", g.shape()),
        ));
    }
    let rows: usize = lead.iter().product();
    let p = ConcatParams {
        rows: u32_of("channels_split", rows)?,
        c1: c1 as u32,
        c2: (c - c1) as u32,
    };
    let shape_of = |channels: usize| {
        let mut s = lead.clone();
        s.push(channels);
        s
    };
    let mut ga = CudaTensor::uninit(be, &shape_of(c1), g.dtype())?;
    let mut gb = CudaTensor::uninit(be, &shape_of(c - c1), g.dtype())?;
    if !g.is_empty() {
        let f = be.function(k::CHANNELS_SPLIT.of(g.dtype()))?;
        let mut b = be.compute_stream().launch_builder(&f);
        b.arg(&p).arg(g).arg(&mut ga).arg(&mut gb);
        // SAFETY: channels_split_T(ConcatParams, const T* g [rows, c1 + c2],
        // T* ga [rows, c1], T* gb [rows, c2]).
        unsafe { b.launch(elementwise(g.len())) }.during("channels_split")?;
    }
    Ok((ga, gb))
}

// ---------------------------------------------------------------------------
// Layer normalisation

/// What a training forward of `layer_norm_forward` keeps for backward,
/// besides its input: [mean, rstd] of each row.
#[derive(Debug)]
pub struct LayerNormSaved {
    stats: DeviceBuffer<f32>,
    eps: f32,
}

/// Rows and columns of `x` normalised over its last axis by γ and β.
fn ln_dims(
    x: &CudaTensor,
    gamma: &CudaView<'_, f32>,
    beta: &CudaView<'_, f32>,
) -> CudaResult<(usize, usize)> {
    let cols = gamma.len();
    if x.shape().len() < 2 || x.shape().last() != Some(&cols) || beta.len() != cols {
        return Err(CudaError::shape(
            "layer_norm",
            format!("[n, ..., {cols}] with γ and β of {cols}"),
            format!("{:?}, β of {}", x.shape(), beta.len()),
        ));
    }
    Ok((x.len() / cols.max(1), cols))
}

fn ln_params(op: &'static str, rows: usize, cols: usize, eps: f32) -> CudaResult<LnParams> {
    let (rpc, chunks) = bn_chunking(rows);
    Ok(LnParams {
        rows: u32_of(op, rows)?,
        cols: u32_of(op, cols)?,
        rows_per_chunk: rpc as u32,
        chunks: chunks as u32,
        eps,
    })
}

/// A warp per row, 8 rows a block.
fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(8).max(1) as u32, 1, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    }
}

/// Layer norm over the last axis with the f32 γ and β: the output, and
/// what backward needs besides the input.
pub fn layer_norm_forward(
    be: &CudaBackend,
    x: &CudaTensor,
    gamma: &CudaView<'_, f32>,
    beta: &CudaView<'_, f32>,
    eps: f32,
) -> CudaResult<(CudaTensor, LayerNormSaved)> {
    let (rows, cols) = ln_dims(x, gamma, beta)?;
    let p = ln_params("layer_norm", rows, cols, eps)?;
    let mut y = CudaTensor::uninit(be, x.shape(), x.dtype())?;
    let mut stats = be.alloc::<f32>(2 * rows)?;
    if !y.is_empty() {
        let f = be.function(k::LAYER_NORM_FORWARD.of(x.dtype()))?;
        let mut b = be.compute_stream().launch_builder(&f);
        b.arg(&p)
            .arg(x)
            .arg(gamma)
            .arg(beta)
            .arg(&mut y)
            .arg(&mut stats.slice);
        // SAFETY: layer_norm_forward_T(LnParams, const T* x [rows, cols],
        // γ, β [cols], T* y [rows, cols], float* stats [rows, 2]) with block
        // (32, 8) and a row per warp, as the kernel requires.
        unsafe { b.launch(per_row(rows)) }.during("layer_norm_forward")?;
    }
    Ok((y, LayerNormSaved { stats, eps }))
}

/// Layer norm backward: dx, with dγ += Σ g·x̂ and dβ += Σ g.
pub fn layer_norm_backward(
    be: &CudaBackend,
    g: &CudaTensor,
    x: &CudaTensor,
    saved: &LayerNormSaved,
    gamma: &CudaView<'_, f32>,
    gamma_grad: &mut CudaViewMut<'_, f32>,
    beta_grad: &mut CudaViewMut<'_, f32>,
) -> CudaResult<CudaTensor> {
    let dx = layer_norm_backward_input(be, g, x, saved, gamma)?;
    let (rows, cols) = ln_dims(x, gamma, &gamma_grad.as_view())?;
    same_len("layer_norm backward", "dβ", cols, beta_grad.len())?;
    if dx.is_empty() {
        return Ok(dx);
    }
    let p = ln_params("layer_norm backward", rows, cols, saved.eps)?;
    let stream = be.compute_stream();
    let chunks = p.chunks as usize;
    let mut part_gamma = be.alloc::<f32>(chunks * cols)?;
    let mut part_beta = be.alloc::<f32>(chunks * cols)?;
    {
        let f = be.function(k::LAYER_NORM_GRAD_PARTIAL.of(g.dtype()))?;
        let cfg = LaunchConfig {
            grid_dim: (cols.div_ceil(32) as u32, chunks as u32, 1),
            block_dim: (32, 8, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&f);
        b.arg(&p)
            .arg(g)
            .arg(x)
            .arg(&saved.stats.slice)
            .arg(&mut part_gamma.slice)
            .arg(&mut part_beta.slice);
        // SAFETY: layer_norm_grad_partial_T(LnParams, const T* g, const T* x
        // [rows, cols], stats [rows, 2], float* part_gamma, part_beta
        // [chunks, cols]) with block (32, 8) and grid (ceil(cols/32),
        // chunks), as its shared arrays require.
        unsafe { b.launch(cfg) }.during("layer_norm_grad_partial")?;
    }
    {
        let f = be.function(&k::LAYER_NORM_GRAD_FINALIZE)?;
        let mut b = stream.launch_builder(&f);
        b.arg(&p)
            .arg(&part_gamma.slice)
            .arg(&part_beta.slice)
            .arg(gamma_grad)
            .arg(beta_grad);
        // SAFETY: layer_norm_grad_finalize(LnParams, part_gamma, part_beta
        // [chunks, cols], float* dgamma, dbeta [cols]) with block (32, 8)
        // and grid ceil(cols/32), as its shared arrays require.
        unsafe { b.launch(per_channel_lanes(cols)) }.during("layer_norm_grad_finalize")?;
    }
    Ok(dx)
}

/// Layer norm backward's dx alone (a frozen γ and β get no gradient).
pub fn layer_norm_backward_input(
    be: &CudaBackend,
    g: &CudaTensor,
    x: &CudaTensor,
    saved: &LayerNormSaved,
    gamma: &CudaView<'_, f32>,
) -> CudaResult<CudaTensor> {
    g.expect_shape("layer_norm backward", x.shape())?;
    same_dtype("layer_norm backward", g.dtype(), &[x.dtype()])?;
    let (rows, cols) = ln_dims(x, gamma, gamma)?;
    same_len("layer_norm backward", "stats", 2 * rows, saved.stats.len())?;
    let p = ln_params("layer_norm backward", rows, cols, saved.eps)?;
    let mut dx = CudaTensor::uninit(be, g.shape(), g.dtype())?;
    if dx.is_empty() {
        return Ok(dx);
    }
    let f = be.function(k::LAYER_NORM_BACKWARD.of(g.dtype()))?;
    let mut b = be.compute_stream().launch_builder(&f);
    b.arg(&p)
        .arg(g)
        .arg(x)
        .arg(gamma)
        .arg(&saved.stats.slice)
        .arg(&mut dx);
    // SAFETY: layer_norm_backward_T(LnParams, const T* g, const T* x
    // [rows, cols], γ [cols], stats [rows, 2], T* dx [rows, cols]) with
    // block (32, 8) and a row per warp.
    unsafe { b.launch(per_row(rows)) }.during("layer_norm_backward")?;
    Ok(dx)
}

// ---------------------------------------------------------------------------
// Global average pooling

fn pool_params(n: usize, hw: usize, c: usize) -> CudaResult<PoolParams> {
    Ok(PoolParams {
        n: u32_of("global_avg_pool", n)?,
        hw: u32_of("global_avg_pool", hw)?,
        c: u32_of("global_avg_pool", c)?,
        inv_hw: 1.0 / hw.max(1) as f32,
    })
}

/// [n, h, w, c] → [n, c].
pub fn global_avg_pool_forward(be: &CudaBackend, x: &CudaTensor) -> CudaResult<CudaTensor> {
    let [n, h, w, c] = nhwc("global_avg_pool", x.shape())?;
    let mut y = CudaTensor::uninit(be, &[n, c], x.dtype())?;
    if n * c == 0 {
        return Ok(y);
    }
    let p = pool_params(n, h * w, c)?;
    let f = be.function(k::POOL_FORWARD.of(x.dtype()))?;
    {
        let mut b = be.compute_stream().launch_builder(&f);
        b.arg(&p).arg(x).arg(&mut y);
        // SAFETY: global_avg_pool_forward_T(PoolParams, const T* x
        // [n, hw, c], T* y [n, c]).
        unsafe { b.launch(elementwise(n * c)) }.during("global_avg_pool_forward")?;
    }
    Ok(y)
}

/// g [n, c] → dx [n, h, w, c] for the forward's input shape.
pub fn global_avg_pool_backward(
    be: &CudaBackend,
    g: &CudaTensor,
    input_shape: &[usize],
) -> CudaResult<CudaTensor> {
    let [n, h, w, c] = nhwc("global_avg_pool backward", input_shape)?;
    g.expect_shape("global_avg_pool backward", &[n, c])?;
    let mut dx = CudaTensor::uninit(be, input_shape, g.dtype())?;
    let total = dx.len();
    if total == 0 {
        return Ok(dx);
    }
    let p = pool_params(n, h * w, c)?;
    let f = be.function(k::POOL_BACKWARD.of(g.dtype()))?;
    {
        let mut b = be.compute_stream().launch_builder(&f);
        b.arg(&p).arg(g).arg(&mut dx);
        // SAFETY: global_avg_pool_backward_T(PoolParams, const T* g
        // [n, c], T* dx [n, hw, c]).
        unsafe { b.launch(elementwise(total)) }.during("global_avg_pool_backward")?;
    }
    Ok(dx)
}

// ---------------------------------------------------------------------------
// Batch normalisation (optionally fused with the ReLU after it, or with a
// residual block's sum and the ReLU after the block)

/// Settings of one batch-norm call.
#[derive(Clone, Copy, Debug)]
pub struct BatchNormConfig {
    pub momentum: f32,
    pub eps: f32,
    /// Fuse the following ReLU (forward applies it; backward masks by the
    /// saved output).
    pub relu: bool,
    /// Update the running statistics (false when recomputing for
    /// activation checkpointing).
    pub update_running: bool,
}

/// What a training forward saves for backward (besides its input, and its
/// output when the ReLU is fused).
#[derive(Debug)]
pub struct BatchNormSaved {
    pub mean: DeviceBuffer<f32>,
    pub inv_std: DeviceBuffer<f32>,
    /// The affine map the forward applied, y = x·scale + shift, kept so
    /// that backward can compute the output again instead of keeping it,
    /// and the fused ReLU's mask without it.
    pub scale: DeviceBuffer<f32>,
    pub shift: DeviceBuffer<f32>,
}

/// Rows per chunk of the per-channel reductions: 256, raised when the grid
/// would exceed 65535 chunks. Depends only on the row count.
fn bn_chunking(rows: usize) -> (usize, usize) {
    let mut rpc = 256usize;
    if rows.div_ceil(rpc) > 65_535 {
        rpc = rows.div_ceil(65_535).next_multiple_of(8);
    }
    (rpc, rows.div_ceil(rpc).max(1))
}

/// Rows per chunk of a batch norm's partial sums: 256, or more so that
/// there are at most 256 chunks (the finalize kernels then read little).
/// Depends only on the row count.
fn batch_norm_chunking(rows: usize) -> (usize, usize) {
    let rpc = rows.div_ceil(BN_MAX_CHUNKS).max(256);
    (rpc, rows.div_ceil(rpc).max(1))
}

const BN_MAX_CHUNKS: usize = 256;

/// A partial-sums pass over [rows, c] in `chunks`: the _v8 kernels' 256
/// threads a block where `by_eight`, else the scalar kernels' (32, 8).
fn bn_partial_launch(dtype: DType, c: usize, chunks: usize) -> LaunchConfig {
    if by_eight(dtype, c) {
        LaunchConfig {
            grid_dim: ((c / 8).div_ceil(32) as u32, chunks as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    } else {
        LaunchConfig {
            grid_dim: (c.div_ceil(32) as u32, chunks as u32, 1),
            block_dim: (32, 8, 1),
            shared_mem_bytes: 0,
        }
    }
}

fn bn_check(
    op: &'static str,
    x: &CudaTensor,
    gamma: &CudaView<'_, f32>,
    beta: &CudaView<'_, f32>,
) -> CudaResult<(usize, usize)> {
    let [n, h, w, c] = nhwc(op, x.shape())?;
    if c != gamma.len() || c != beta.len() || c == 0 {
        return Err(CudaError::shape(
            op,
            format!(
                "[n, h, w, {}] with gamma and beta of that length",
                gamma.len()
            ),
            format!("{:?} (beta {})", x.shape(), beta.len()),
        ));
    }
    Ok((u32_of(op, n * h * w)? as usize, c))
}

/// y = x·scale + shift (`bn_apply`), or with a skip input
/// relu(T(x·scale + shift) + skip) (`bn_apply_add`, the ReLU as `relu`
/// says).
#[allow(clippy::too_many_arguments)]
fn bn_apply(
    be: &CudaBackend,
    x: &CudaTensor,
    skip: Option<&CudaTensor>,
    rows: usize,
    c: usize,
    scale: &DeviceBuffer<f32>,
    shift: &DeviceBuffer<f32>,
    relu: bool,
) -> CudaResult<CudaTensor> {
    let dtype = x.dtype();
    let mut y = CudaTensor::uninit(be, x.shape(), dtype)?;
    let p = BnApplyParams {
        rows: rows as u32,
        channels: c as u32,
        relu: relu as u32,
        by_channels: FastDiv::new(c as u32),
    };
    let stream = be.compute_stream();
    match skip {
        None => {
            let (f, cfg) = bn_per_element(be, &k::BN_APPLY, &k::BN_APPLY_V8, dtype, rows, c)?;
            let mut b = stream.launch_builder(&f);
            b.arg(&p)
                .arg(x)
                .arg(&scale.slice)
                .arg(&shift.slice)
                .arg(&mut y);
            // SAFETY: bn_apply_T(BnApplyParams, const T* x, const float*
            // scale, const float* shift, T* y); x, y hold rows·c, scale
            // and shift c (bn_per_element: the v8 kernel's 16-byte
            // accesses are aligned in these whole tensors, and its grid
            // covers every row and channel group).
            unsafe { b.launch(cfg) }.during("bn_apply")?;
        }
        Some(skip) => {
            same_dtype("batch_norm residual add", dtype, &[skip.dtype()])?;
            let (f, cfg) =
                bn_per_element(be, &k::BN_APPLY_ADD, &k::BN_APPLY_ADD_V8, dtype, rows, c)?;
            let mut b = stream.launch_builder(&f);
            b.arg(&p)
                .arg(x)
                .arg(&scale.slice)
                .arg(&shift.slice)
                .arg(skip)
                .arg(&mut y);
            // SAFETY: bn_apply_add_T(BnApplyParams, const T* x, const float*
            // scale, const float* shift, const T* skip, T* y); x, skip (its shape checked by both callers) and y hold
            // rows·c, scale and shift c; y is freshly allocated, so it
            // aliases neither input.
            unsafe { b.launch(cfg) }.during("bn_apply_add")?;
        }
    }
    Ok(y)
}

/// Training forward: normalise with the batch statistics (biased variance),
/// update the running statistics (unbiased variance, PyTorch's momentum
/// rule) unless `cfg.update_running` is false. Returns the output and what
/// backward needs.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_forward_train(
    be: &CudaBackend,
    x: &CudaTensor,
    gamma: &CudaView<'_, f32>,
    beta: &CudaView<'_, f32>,
    running_mean: &mut CudaViewMut<'_, f32>,
    running_var: &mut CudaViewMut<'_, f32>,
    cfg: BatchNormConfig,
) -> CudaResult<(CudaTensor, BatchNormSaved)> {
    bn_forward_train(be, x, None, gamma, beta, running_mean, running_var, cfg)
}

/// `batch_norm_forward_train` closing a residual block: y = bn(x) + skip,
/// then the ReLU if `cfg.relu`, in one pass over the activations and with
/// the roundings of `batch_norm_forward_train`, `add_inplace` and
/// `relu_forward` run one after another. Backward (with the ReLU):
/// `batch_norm_add_relu_backward`.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_add_forward_train(
    be: &CudaBackend,
    x: &CudaTensor,
    skip: &CudaTensor,
    gamma: &CudaView<'_, f32>,
    beta: &CudaView<'_, f32>,
    running_mean: &mut CudaViewMut<'_, f32>,
    running_var: &mut CudaViewMut<'_, f32>,
    cfg: BatchNormConfig,
) -> CudaResult<(CudaTensor, BatchNormSaved)> {
    bn_forward_train(
        be,
        x,
        Some(skip),
        gamma,
        beta,
        running_mean,
        running_var,
        cfg,
    )
}

#[allow(clippy::too_many_arguments)]
fn bn_forward_train(
    be: &CudaBackend,
    x: &CudaTensor,
    skip: Option<&CudaTensor>,
    gamma: &CudaView<'_, f32>,
    beta: &CudaView<'_, f32>,
    running_mean: &mut CudaViewMut<'_, f32>,
    running_var: &mut CudaViewMut<'_, f32>,
    cfg: BatchNormConfig,
) -> CudaResult<(CudaTensor, BatchNormSaved)> {
    let (rows, c) = bn_check("batch_norm", x, gamma, beta)?;
    same_len("batch_norm", "running_mean", c, running_mean.len())?;
    same_len("batch_norm", "running_var", c, running_var.len())?;
    // Before the running statistics change: a refused call leaves them be.
    if let Some(skip) = skip {
        skip.expect_shape("batch_norm residual add", x.shape())?;
    }
    if rows < 2 {
        return Err(CudaError::shape(
            "batch_norm",
            "more than one value per channel in training (n·h·w ≥ 2)",
            format!("{:?}", x.shape()),
        ));
    }
    let (rpc, chunks) = batch_norm_chunking(rows);
    let mut part_mean = be.alloc::<f32>(chunks * c)?;
    let mut part_m2 = be.alloc::<f32>(chunks * c)?;
    let dims = BnDims {
        rows: rows as u32,
        channels: c as u32,
        rows_per_chunk: rpc as u32,
        chunks: chunks as u32,
    };
    let stream = be.compute_stream();
    {
        let f = if by_eight(x.dtype(), c) {
            be.function(&k::BN_STATS_PARTIAL_V8)?
        } else {
            be.function(k::BN_STATS_PARTIAL.of(x.dtype()))?
        };
        let cfg_partial = bn_partial_launch(x.dtype(), c, chunks);
        let mut b = stream.launch_builder(&f);
        b.arg(&dims)
            .arg(x)
            .arg(&mut part_mean.slice)
            .arg(&mut part_m2.slice);
        // SAFETY: bn_stats_partial_T / _v8_f16 (BnDims, const T* x [rows, c],
        // float* part_mean, float* part_m2 [chunks, c]) with the block and
        // grid bn_partial_launch gives each (its shared arrays are sized by
        // the block); x is a whole tensor, so the v8 loads are aligned.
        unsafe { b.launch(cfg_partial) }.during("bn_stats_partial")?;
    }
    let mut mean = be.alloc::<f32>(c)?;
    let mut inv_std = be.alloc::<f32>(c)?;
    let mut scale = be.alloc::<f32>(c)?;
    let mut shift = be.alloc::<f32>(c)?;
    {
        let p = BnFinalizeParams {
            rows: rows as u32,
            channels: c as u32,
            rows_per_chunk: rpc as u32,
            chunks: chunks as u32,
            eps: cfg.eps,
            momentum: cfg.momentum,
            update_running: cfg.update_running as u32,
        };
        let f = be.function(&k::BN_STATS_FINALIZE)?;
        let mut b = stream.launch_builder(&f);
        b.arg(&p)
            .arg(&part_mean.slice)
            .arg(&part_m2.slice)
            .arg(gamma)
            .arg(beta)
            .arg(&mut mean.slice)
            .arg(&mut inv_std.slice)
            .arg(&mut scale.slice)
            .arg(&mut shift.slice)
            .arg(running_mean)
            .arg(running_var);
        // SAFETY: bn_stats_finalize(BnFinalizeParams, part_mean, part_m2
        // [chunks, c], gamma, beta, mean, inv_std, scale, shift, running_mean,
        // running_var [c]) with block (8, 32) and grid ceil(c/8), as its
        // shared arrays require.
        unsafe { b.launch(bn_finalize_lanes(c)) }.during("bn_stats_finalize")?;
    }
    let y = bn_apply(be, x, skip, rows, c, &scale, &shift, cfg.relu)?;
    let saved = BatchNormSaved {
        mean,
        inv_std,
        scale,
        shift,
    };
    Ok((y, saved))
}

/// The output of `batch_norm_forward_train` with the fused ReLU (or of
/// `batch_norm_add_forward_train` with the ReLU, a residual block's, when
/// `skip` is the block's input), computed again from its input `x` and what
/// that forward saved: the forward's bits (the same kernel on the same
/// values), for a backward that recomputes the output instead of keeping it.
pub fn batch_norm_relu_recompute(
    be: &CudaBackend,
    x: &CudaTensor,
    skip: Option<&CudaTensor>,
    saved: &BatchNormSaved,
) -> CudaResult<CudaTensor> {
    if let Some(skip) = skip {
        skip.expect_shape("batch_norm recompute (residual input)", x.shape())?;
    }
    let [n, h, w, c] = nhwc("batch_norm recompute", x.shape())?;
    for (what, len) in [
        ("saved scale", saved.scale.len()),
        ("saved shift", saved.shift.len()),
    ] {
        same_len("batch_norm recompute", what, c, len)?;
    }
    let rows = u32_of("batch_norm recompute", n * h * w)? as usize;
    bn_apply(be, x, skip, rows, c, &saved.scale, &saved.shift, true)
}

/// Eval forward: normalise with the running statistics; saves nothing.
pub fn batch_norm_forward_eval(
    be: &CudaBackend,
    x: &CudaTensor,
    gamma: &CudaView<'_, f32>,
    beta: &CudaView<'_, f32>,
    running_mean: &CudaView<'_, f32>,
    running_var: &CudaView<'_, f32>,
    cfg: BatchNormConfig,
) -> CudaResult<CudaTensor> {
    bn_forward_eval(be, x, None, gamma, beta, running_mean, running_var, cfg)
}

/// `batch_norm_forward_eval` closing a residual block: y = bn(x) + skip,
/// then the ReLU if `cfg.relu` (see `batch_norm_add_forward_train`).
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_add_forward_eval(
    be: &CudaBackend,
    x: &CudaTensor,
    skip: &CudaTensor,
    gamma: &CudaView<'_, f32>,
    beta: &CudaView<'_, f32>,
    running_mean: &CudaView<'_, f32>,
    running_var: &CudaView<'_, f32>,
    cfg: BatchNormConfig,
) -> CudaResult<CudaTensor> {
    bn_forward_eval(
        be,
        x,
        Some(skip),
        gamma,
        beta,
        running_mean,
        running_var,
        cfg,
    )
}

#[allow(clippy::too_many_arguments)]
fn bn_forward_eval(
    be: &CudaBackend,
    x: &CudaTensor,
    skip: Option<&CudaTensor>,
    gamma: &CudaView<'_, f32>,
    beta: &CudaView<'_, f32>,
    running_mean: &CudaView<'_, f32>,
    running_var: &CudaView<'_, f32>,
    cfg: BatchNormConfig,
) -> CudaResult<CudaTensor> {
    let (rows, c) = bn_check("batch_norm", x, gamma, beta)?;
    same_len("batch_norm", "running_mean", c, running_mean.len())?;
    same_len("batch_norm", "running_var", c, running_var.len())?;
    if let Some(skip) = skip {
        skip.expect_shape("batch_norm residual add", x.shape())?;
    }
    let mut scale = be.alloc::<f32>(c)?;
    let mut shift = be.alloc::<f32>(c)?;
    {
        let p = BnEvalParams {
            channels: c as u32,
            eps: cfg.eps,
        };
        let f = be.function(&k::BN_EVAL_PREPARE)?;
        let mut b = be.compute_stream().launch_builder(&f);
        b.arg(&p)
            .arg(gamma)
            .arg(beta)
            .arg(running_mean)
            .arg(running_var)
            .arg(&mut scale.slice)
            .arg(&mut shift.slice);
        // SAFETY: bn_eval_prepare(BnEvalParams, gamma, beta, running_mean,
        // running_var, scale, shift), all of c floats; one thread per channel.
        unsafe { b.launch(per_channel(c)) }.during("bn_eval_prepare")?;
    }
    if rows == 0 {
        return CudaTensor::uninit(be, x.shape(), x.dtype());
    }
    bn_apply(be, x, skip, rows, c, &scale, &shift, cfg.relu)
}

/// Puts the running statistics saved before a step back over `mean`/`var`
/// when that step was skipped (`verdict.skipped`, decided on the device by
/// the optimizer): a skipped step leaves no trace, and the host need not
/// know the verdict before it queues the next step.
pub fn batch_norm_restore_if_skipped(
    be: &CudaBackend,
    verdict: &CudaSlice<StepState>,
    saved: (&CudaSlice<f32>, &CudaSlice<f32>),
    mean: &mut CudaSlice<f32>,
    var: &mut CudaSlice<f32>,
) -> CudaResult<()> {
    let c = mean.len();
    for (name, len) in [
        ("saved mean", saved.0.len()),
        ("saved var", saved.1.len()),
        ("var", var.len()),
    ] {
        same_len("batch_norm_restore_if_skipped", name, c, len)?;
    }
    let p = BnRestoreParams {
        channels: u32_of("batch_norm_restore_if_skipped", c)?,
    };
    let f = be.function(&k::BN_RUNNING_RESTORE)?;
    let mut b = be.compute_stream().launch_builder(&f);
    b.arg(&p)
        .arg(verdict)
        .arg(saved.0)
        .arg(saved.1)
        .arg(mean)
        .arg(var);
    // SAFETY: bn_running_restore(BnRestoreParams, const StepState* [1],
    // const float* saved_mean, const float* saved_var, float* mean, float*
    // var), each of `channels` elements (checked above).
    unsafe { b.launch(per_channel(c)) }.during("bn_running_restore")?;
    Ok(())
}

/// Backward of a training forward: accumulates dγ and dβ into the f32
/// gradients and returns dx. With the ReLU fused (`relu = true`) its mask
/// comes from `x` and the forward's scale and shift, computed as the
/// forward computed its output (so exactly where that output is > 0): the
/// output itself is not read, so backward need not keep or recompute it.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_backward(
    be: &CudaBackend,
    g: &CudaTensor,
    x: &CudaTensor,
    saved: &BatchNormSaved,
    gamma: &CudaView<'_, f32>,
    gamma_grad: &mut CudaViewMut<'_, f32>,
    beta_grad: &mut CudaViewMut<'_, f32>,
    relu: bool,
) -> CudaResult<CudaTensor> {
    bn_backward(
        be,
        BnGrad::Read(g),
        x,
        saved,
        gamma,
        gamma_grad,
        beta_grad,
        relu,
    )
}

/// Backward of `batch_norm_add_forward_train` with the ReLU, `output` the
/// block's output: masks `g` in place (it then holds the gradient of the
/// skip input, and of the batch norm's output), accumulates dγ and dβ and
/// returns the batch norm's dx. The bits of `relu_backward` followed by
/// `batch_norm_backward` without the ReLU, in three kernels instead of four,
/// and no tensor for the masked gradient.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_add_relu_backward(
    be: &CudaBackend,
    g: &mut CudaTensor,
    x: &CudaTensor,
    output: &CudaTensor,
    saved: &BatchNormSaved,
    gamma: &CudaView<'_, f32>,
    gamma_grad: &mut CudaViewMut<'_, f32>,
    beta_grad: &mut CudaViewMut<'_, f32>,
) -> CudaResult<CudaTensor> {
    bn_backward(
        be,
        BnGrad::MaskInPlace(g, output),
        x,
        saved,
        gamma,
        gamma_grad,
        beta_grad,
        true,
    )
}

/// The output gradient a batch-norm backward reads: as it is (masked by
/// the fused ReLU, if any, as it is read), or masked in place by the
/// block's ReLU first, by the block's output (and left masked).
enum BnGrad<'a> {
    Read(&'a CudaTensor),
    MaskInPlace(&'a mut CudaTensor, &'a CudaTensor),
}

#[allow(clippy::too_many_arguments)]
fn bn_backward(
    be: &CudaBackend,
    mut g: BnGrad<'_>,
    x: &CudaTensor,
    saved: &BatchNormSaved,
    gamma: &CudaView<'_, f32>,
    gamma_grad: &mut CudaViewMut<'_, f32>,
    beta_grad: &mut CudaViewMut<'_, f32>,
    relu: bool,
) -> CudaResult<CudaTensor> {
    let (g_shape, dtype) = match &g {
        BnGrad::Read(g) => (g.shape(), g.dtype()),
        BnGrad::MaskInPlace(g, y) => {
            same_dtype("batch_norm backward", g.dtype(), &[y.dtype()])?;
            y.expect_shape("batch_norm backward (saved output)", x.shape())?;
            (g.shape(), g.dtype())
        }
    };
    same_dtype("batch_norm backward", dtype, &[x.dtype()])?;
    if g_shape != x.shape() {
        return Err(CudaError::shape(
            "batch_norm backward",
            format!("{:?}", x.shape()),
            format!("{g_shape:?}"),
        ));
    }
    let [n, h, w, c] = nhwc("batch_norm backward", x.shape())?;
    let rows = u32_of("batch_norm backward", n * h * w)? as usize;
    for (what, len) in [
        ("gamma", gamma.len()),
        ("gamma gradient", gamma_grad.len()),
        ("beta gradient", beta_grad.len()),
        ("saved mean", saved.mean.len()),
        ("saved inv_std", saved.inv_std.len()),
    ] {
        same_len("batch_norm backward", what, c, len)?;
    }
    let (rpc, chunks) = batch_norm_chunking(rows);
    let p = BnBackwardParams {
        rows: rows as u32,
        channels: c as u32,
        rows_per_chunk: rpc as u32,
        chunks: chunks as u32,
        relu: relu as u32,
        by_channels: FastDiv::new(c as u32),
    };
    let stream = be.compute_stream();
    let mut part_g = be.alloc::<f32>(chunks * c)?;
    let mut part_gx = be.alloc::<f32>(chunks * c)?;
    let partial = bn_partial_launch(dtype, c, chunks);
    let eight = by_eight(dtype, c);
    match &mut g {
        BnGrad::Read(g) => {
            let f = if eight {
                be.function(&k::BN_BACKWARD_PARTIAL_V8)?
            } else {
                be.function(k::BN_BACKWARD_PARTIAL.of(dtype))?
            };
            let mut b = stream.launch_builder(&f);
            b.arg(&p)
                .arg(*g)
                .arg(x)
                .arg(&saved.scale.slice)
                .arg(&saved.shift.slice)
                .arg(&saved.mean.slice)
                .arg(&mut part_g.slice)
                .arg(&mut part_gx.slice);
            // SAFETY: bn_backward_partial_T / _v8_f16 (BnBackwardParams, g,
            // x [rows, c] T, scale, shift, mean [c], part_sum_g, part_sum_gx
            // [chunks, c]) with bn_partial_launch's block and grid; whole
            // tensors, so the v8 loads are aligned.
            unsafe { b.launch(partial) }.during("bn_backward_partial")?;
        }
        BnGrad::MaskInPlace(g, y) => {
            let f = if eight {
                be.function(&k::BN_BACKWARD_PARTIAL_MASK_V8)?
            } else {
                be.function(k::BN_BACKWARD_PARTIAL_MASK.of(dtype))?
            };
            let mut b = stream.launch_builder(&f);
            b.arg(&p)
                .arg(&mut **g)
                .arg(x)
                .arg(*y)
                .arg(&saved.mean.slice)
                .arg(&mut part_g.slice)
                .arg(&mut part_gx.slice);
            // SAFETY: bn_backward_partial_mask_T / _v8_f16 (BnBackwardParams,
            // T* g, const x, y [rows, c] T, mean [c], part_sum_g, part_sum_gx
            // [chunks, c]) with bn_partial_launch's block and grid; g,
            // borrowed mutably, is neither x nor y.
            unsafe { b.launch(partial) }.during("bn_backward_partial_mask")?;
        }
    }
    // A gradient masked in place is read as it now is.
    let (g, p) = match g {
        BnGrad::Read(g) => (g, p),
        BnGrad::MaskInPlace(g, _) => (&*g, BnBackwardParams { relu: 0, ..p }),
    };
    let mut coef_k = be.alloc::<f32>(c)?;
    let mut coef_b = be.alloc::<f32>(c)?;
    let mut coef_d = be.alloc::<f32>(c)?;
    {
        let f = be.function(&k::BN_BACKWARD_FINALIZE)?;
        let mut b = stream.launch_builder(&f);
        b.arg(&p)
            .arg(&part_g.slice)
            .arg(&part_gx.slice)
            .arg(gamma)
            .arg(&saved.inv_std.slice)
            .arg(gamma_grad)
            .arg(beta_grad)
            .arg(&mut coef_k.slice)
            .arg(&mut coef_b.slice)
            .arg(&mut coef_d.slice);
        // SAFETY: bn_backward_finalize(BnBackwardParams, part_sum_g,
        // part_sum_gx [chunks, c], gamma, inv_std, gamma_grad, beta_grad,
        // coef_k, coef_b, coef_d [c]) with block (8, 32) and grid
        // ceil(c/8), as its shared arrays require.
        unsafe { b.launch(bn_finalize_lanes(c)) }.during("bn_backward_finalize")?;
    }
    let mut dx = CudaTensor::uninit(be, x.shape(), dtype)?;
    if rows * c > 0 {
        let (f, cfg) = bn_per_element(
            be,
            &k::BN_BACKWARD_APPLY,
            &k::BN_BACKWARD_APPLY_V8,
            dtype,
            rows,
            c,
        )?;
        let mut b = stream.launch_builder(&f);
        b.arg(&p)
            .arg(g)
            .arg(x)
            .arg(&saved.scale.slice)
            .arg(&saved.shift.slice)
            .arg(&saved.mean.slice)
            .arg(&coef_k.slice)
            .arg(&coef_b.slice)
            .arg(&coef_d.slice)
            .arg(&mut dx);
        // SAFETY: bn_backward_apply_T(BnBackwardParams, g, x [rows, c],
        // scale, shift, mean, coef_k, coef_b, coef_d [c], dx [rows, c]),
        // whole tensors.
        unsafe { b.launch(cfg) }.during("bn_backward_apply")?;
    }
    Ok(dx)
}

// ---------------------------------------------------------------------------
// Convolution (im2col + cuBLAS) and the fully connected layer

/// Shapes of one convolution; the weight is [k, k, cin, cout] = W[K, cout]
/// with K = k·k·cin, as in the CPU's `Conv2d`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct ConvShape {
    pub n: usize,
    pub h: usize,
    pub w: usize,
    pub cin: usize,
    pub cout: usize,
    pub k: usize,
    pub stride: usize,
    pub pad: usize,
}

impl ConvShape {
    /// (oh, ow), or an error if the kernel does not fit the padded input.
    pub fn out_hw(&self) -> CudaResult<(usize, usize)> {
        let dim = |size: usize| -> Option<usize> {
            let padded = size.checked_add(self.pad.checked_mul(2)?)?;
            let span = padded.checked_sub(self.k)?;
            Some(span / self.stride + 1)
        };
        match (self.stride > 0 && self.k > 0, dim(self.h), dim(self.w)) {
            (true, Some(oh), Some(ow)) if self.h > 0 && self.w > 0 => Ok((oh, ow)),
            _ => Err(CudaError::shape(
                "conv2d",
                "a kernel that fits the padded input, stride ≥ 1",
                format!("{self:?}"),
            )),
        }
    }

    /// Columns of the im2col matrix: k·k·cin.
    pub fn kk(&self) -> usize {
        self.k * self.k * self.cin
    }

    /// A 1×1 convolution with stride 1 and no padding: one matrix product,
    /// no im2col.
    pub fn is_pointwise(&self) -> bool {
        self.k == 1 && self.stride == 1 && self.pad == 0
    }

    /// The kernels' parameters; `check` has made every product here fit
    /// in 32 bits.
    fn params(&self, oh: usize, ow: usize, n0: usize, images: usize) -> ConvParams {
        let by = |d: usize| FastDiv::new(d as u32);
        ConvParams {
            h: self.h as u32,
            w: self.w as u32,
            cin: self.cin as u32,
            oh: oh as u32,
            ow: ow as u32,
            k: self.k as u32,
            stride: self.stride as u32,
            pad: self.pad as u32,
            n0: n0 as u32,
            images: images as u32,
            by_kk: by(self.kk()),
            by_opix: by(oh * ow),
            by_ow: by(ow),
            by_kcin: by(self.k * self.cin),
            by_cin: by(self.cin),
            by_image: by(self.h * self.w * self.cin),
            by_wcin: by(self.w * self.cin),
            by_stride: by(self.stride),
        }
    }

    fn check(&self, x: &CudaTensor, weight_len: usize) -> CudaResult<(usize, usize)> {
        x.expect_shape("conv2d input", &[self.n, self.h, self.w, self.cin])?;
        same_len(
            "conv2d",
            "weight [k, k, cin, cout]",
            self.kk() * self.cout,
            weight_len,
        )?;
        let (oh, ow) = self.out_hw()?;
        // Every index the kernels form must fit in 32 bits.
        checked_len("conv2d", &[self.n, oh, ow, self.kk().max(self.cout)])?;
        Ok((oh, ow))
    }
}

/// Default budget for the im2col scratch matrix: the batch is processed in
/// groups of whole images whose A fits in it (at least one image). On the
/// emulator, going from 64 MiB to 16 took the reference model's step peak
/// from 101 to 69 MiB at batch 128 and from 250 to 211 MiB at batch 512.
pub const CONV_SCRATCH_BYTES: usize = 16 << 20;

fn images_per_chunk(s: &ConvShape, opix: usize, scratch_bytes: usize, dtype: DType) -> usize {
    let per_image = (opix * s.kk() * dtype.size()).max(1);
    (scratch_bytes / per_image).clamp(1, s.n.max(1))
}

fn im2col(
    be: &CudaBackend,
    x: &CudaTensor,
    p: &ConvParams,
    a: &mut CudaTensor,
    total: usize,
) -> CudaResult<()> {
    let (f, cfg) = per_element(
        be,
        &k::IM2COL,
        &k::IM2COL_V8,
        x.dtype(),
        p.cin as usize,
        total,
    )?;
    let mut b = be.compute_stream().launch_builder(&f);
    b.arg(p).arg(x).arg(a);
    // SAFETY: im2col_T(ConvParams, const T* x [n, h, w, cin], T* a), a made
    // with x's type, writes images·oh·ow·kk = total ≤ a.len() elements and
    // reads only images n0..n0+images of x, which the caller checked against
    // x's shape. im2col_v8_f16 does the same 8 at a time: f16, cin % 8 == 0
    // (by_eight), x and a whole tensors, so its 16-byte accesses are aligned.
    unsafe { b.launch(cfg) }.during("im2col")?;
    Ok(())
}

/// Whether a kernel over rows of `channels` may go 8 channels at a time
/// (its `*_v8_f16` entry point): f16, and no 8-channel run crosses a row
/// (or an im2col tap). Its 16-byte accesses are aligned in whole tensors.
fn by_eight(dtype: DType, channels: usize) -> bool {
    dtype == DType::F16 && channels.is_multiple_of(8)
}

/// Rows each thread of a `_v8` apply kernel takes, their loads issued
/// together (batchnorm.cu `BN_V8_ROWS`).
const BN_V8_ROWS: usize = 4;

/// A batch norm's per-element pass over [rows, c] (apply, apply + add, the
/// input gradient): the `_v8` kernel where `by_eight` allows, on the
/// partial kernels' lanes (256 threads a block, min(c/8, 32) groups of 8
/// channels across, row lanes down, `BN_V8_ROWS` rows a thread; grid.x
/// the row blocks, grid.y the channel blocks), else the scalar one for
/// `dtype`, a thread per element.
fn bn_per_element(
    be: &CudaBackend,
    scalar: &KernelPair,
    eight: &KernelSig,
    dtype: DType,
    rows: usize,
    c: usize,
) -> CudaResult<(CudaFunction, LaunchConfig)> {
    if !by_eight(dtype, c) {
        return Ok((be.function(scalar.of(dtype))?, elementwise(rows * c)));
    }
    let groups = c / 8;
    let lanes = 256 / groups.min(32);
    let cfg = LaunchConfig {
        grid_dim: (
            u32_of("batch norm", rows.div_ceil(lanes * BN_V8_ROWS).max(1))?,
            u32_of("batch norm", groups.div_ceil(32))?,
            1,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    Ok((be.function(eight)?, cfg))
}

/// A per-element kernel over `n` elements in rows of `c` channels: the
/// 8-at-a-time entry point where `by_eight` allows, else the scalar one for
/// `dtype`, with its launch.
fn per_element(
    be: &CudaBackend,
    scalar: &KernelPair,
    eight: &KernelSig,
    dtype: DType,
    c: usize,
    n: usize,
) -> CudaResult<(CudaFunction, LaunchConfig)> {
    if by_eight(dtype, c) {
        Ok((be.function(eight)?, elementwise(n / 8)))
    } else {
        Ok((be.function(scalar.of(dtype))?, elementwise(n)))
    }
}

/// How the GPU runs a convolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvPlan {
    /// `device.conv_algorithm`.
    pub algorithm: ConvAlgorithm,
    /// `device.conv_workspace`: the most an im2col matrix may take (the
    /// batch goes through it in groups of whole images).
    pub workspace: usize,
}

/// The library's default is the plain im2col path, which every GPU and
/// shape takes; a training run's default is `device.conv_algorithm`'s
/// (`auto`, in the pipeline's config).
impl Default for ConvPlan {
    fn default() -> Self {
        ConvPlan {
            algorithm: ConvAlgorithm::Im2col,
            workspace: CONV_SCRATCH_BYTES,
        }
    }
}

/// How the products of a convolution run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvAlgorithm {
    /// An im2col matrix in a workspace, multiplied by cuBLAS.
    Im2col,
    /// conv_mma.cu: the matrix gathered tile by tile into shared memory and
    /// multiplied on the tensor cores, where the shape allows it (f16,
    /// channels in and out multiples of 8, sm_80 or newer; otherwise
    /// im2col), for the forward and both gradients.
    ImplicitGemm,
    /// Each convolution by its shape: implicit GEMM where it was the faster
    /// of the two on an H100 (stride 1, at most `AUTO_IMPLICIT_CHANNELS`
    /// channels in and out), direct kernels for fewer than 8 output channels
    /// and, in f16, from input channels not a multiple of 8 to a multiple
    /// of 8 outputs (`conv_narrow.cu`: a first layer), im2col + cuBLAS
    /// elsewhere. A rule, not a timing: every run of a model picks the
    /// same, so its bits (and a resumed run's) do not depend on how a
    /// timing fell.
    Auto,
    /// `Auto`'s direct kernels, and for the rest each product timed both
    /// ways (implicit GEMM and im2col) on this GPU the first time its shape
    /// runs, the faster kept (`conv_tune.rs`). Two runs may choose, and so
    /// compute, differently; a resumed run keeps its checkpoint's choices.
    Tune,
}

impl ConvAlgorithm {
    /// Whether the algorithm picks kernels by the convolution's shape
    /// (`Auto`, `Tune`), which takes the direct kernels where they apply.
    fn by_shape(self) -> bool {
        matches!(self, ConvAlgorithm::Auto | ConvAlgorithm::Tune)
    }
}

/// `ConvAlgorithm::Auto` takes the implicit kernel up to this many channels.
/// On an H100 (docs/measurements/nvidia-h100.md) it took a 3×3
/// stride-1 convolution's step from 1.10 to 0.52 ms at 32 channels (batch
/// 512) and from 0.54 to 0.43 at 64, but from 0.30 to 0.49 at 128 (not
/// profiled further: its 64-column tiles gather each input tile twice
/// there, and cuBLAS's GEMM is wider); with stride 2 im2col was faster at
/// 64 and 128 channels (measured before the input gradient gathered only
/// the taps that reach each parity class: `implicit_products`).
const AUTO_IMPLICIT_CHANNELS: usize = 64;

/// Rows of the implicit kernel's block tile (conv_mma.cu `IC_BM`).
const IMPLICIT_ROWS: usize = 128;

/// Whether conv_mma.cu's kernels take convolution `s` (forward and both
/// gradients): 8-channel vectors of its input, of its output gradient and
/// of its weight must each lie in one tap and be 16-byte aligned (a
/// network's parameters start at multiples of 8 elements of their group,
/// `network.rs::PARAM_ALIGN`), and `mma.m16n8k16` and `cp.async` need
/// sm_80.
fn implicit_takes(be: &CudaBackend, dtype: DType, s: &ConvShape, weight: &AnyView<'_>) -> bool {
    dtype == DType::F16
        && s.cin.is_multiple_of(8)
        && s.cout.is_multiple_of(8)
        && be.info().arch() >= 80
        && weight.is_aligned_to(be.compute_stream(), 16)
}

/// The rows and taps of one launch of the implicit kernel: the output's
/// pixels and every tap (the forward), or one parity class (py, px) of
/// dx's pixels, (s·y + py, s·x + px), and the taps that reach them,
/// tap_y0 + s·j (the input gradient; conv_mma.cu's header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ImplicitProduct {
    /// The grid of the rows, and where its (0, 0) lies in the output.
    row_h: usize,
    row_w: usize,
    row_y0: usize,
    row_x0: usize,
    /// W's first tap along y and x, and how many (a step apart).
    tap_y0: usize,
    tap_x0: usize,
    taps_y: usize,
    taps_x: usize,
}

/// The products of a forward (one) or of an input gradient (one per
/// parity class with pixels: stride² of them, fewer where dx is smaller
/// than the stride).
fn implicit_products(
    s: &ConvShape,
    (oh, ow): (usize, usize),
    transposed: bool,
) -> Vec<ImplicitProduct> {
    if !transposed {
        return vec![ImplicitProduct {
            row_h: oh,
            row_w: ow,
            row_y0: 0,
            row_x0: 0,
            tap_y0: 0,
            tap_x0: 0,
            taps_y: s.k,
            taps_x: s.k,
        }];
    }
    let st = s.stride;
    // (pixels of the class along a side, its first tap, its taps)
    let class = |size: usize, p: usize| {
        let first = (p + s.pad) % st;
        (
            size.saturating_sub(p).div_ceil(st),
            first,
            s.k.saturating_sub(first).div_ceil(st),
        )
    };
    let mut products = Vec::with_capacity(st * st);
    for py in 0..st {
        for px in 0..st {
            let ((row_h, tap_y0, taps_y), (row_w, tap_x0, taps_x)) =
                (class(s.h, py), class(s.w, px));
            if row_h * row_w > 0 {
                products.push(ImplicitProduct {
                    row_h,
                    row_w,
                    row_y0: py,
                    row_x0: px,
                    tap_y0,
                    tap_x0,
                    taps_y,
                    taps_x,
                });
            }
        }
    }
    products
}

/// The implicit kernel's product `out = gather(src) · B(weight)`, forward
/// (`transposed` false: src is x, out is y) or for the input gradient
/// (src is dy, out is dx, a launch per parity class of its pixels).
fn implicit_conv(
    be: &CudaBackend,
    src: &CudaTensor,
    weight: &AnyView<'_>,
    out: &mut CudaTensor,
    s: &ConvShape,
    (oh, ow): (usize, usize),
    transposed: bool,
) -> CudaResult<()> {
    // (gathered channels, its size, output channels, output size)
    let (chans, (src_h, src_w), cols, (out_h, out_w)) = if transposed {
        (s.cout, (oh, ow), s.cin, (s.h, s.w))
    } else {
        (s.cin, (s.h, s.w), s.cout, (oh, ow))
    };
    // Forward B[(tap, ci), co] = W[tap, ci, co]; transposed B[(tap, co), ci]
    // = W[tap, ci, co].
    let (b_chan_stride, b_col_stride) = if transposed { (1, s.cout) } else { (s.cout, 1) };
    let (sig, tile_cols) = match (transposed, cols <= 32) {
        (false, true) => (&k::IMPLICIT_CONV_N32, 32),
        (false, false) => (&k::IMPLICIT_CONV_N64, 64),
        (true, true) => (&k::IMPLICIT_DGRAD_N32, 32),
        (true, false) => (&k::IMPLICIT_DGRAD_N64, 64),
    };
    let f = be.function(sig)?;
    let by = |d: usize| FastDiv::new(d.max(1) as u32);
    for c in implicit_products(s, (oh, ow), transposed) {
        let rows = s.n * c.row_h * c.row_w;
        let p = ImplicitConvParams {
            rows: rows as u32,
            cols: cols as u32,
            depth: (c.taps_y * c.taps_x * chans) as u32,
            chans: chans as u32,
            src_h: src_h as u32,
            src_w: src_w as u32,
            row_h: c.row_h as u32,
            row_w: c.row_w as u32,
            out_h: out_h as u32,
            out_w: out_w as u32,
            step: if transposed { s.stride as u32 } else { 1 },
            row_y0: c.row_y0 as u32,
            row_x0: c.row_x0 as u32,
            tap_y0: c.tap_y0 as u32,
            tap_x0: c.tap_x0 as u32,
            taps_x: c.taps_x as u32,
            k: s.k as u32,
            stride: s.stride as u32,
            pad: s.pad as u32,
            transposed: transposed as u32,
            b_chan_stride: b_chan_stride as u32,
            b_col_stride: b_col_stride as u32,
            by_row_pix: by(c.row_h * c.row_w),
            by_row_w: by(c.row_w),
            by_chans: by(chans),
            by_taps_x: by(c.taps_x),
            by_stride: by(s.stride),
        };
        let cfg = LaunchConfig {
            grid_dim: (
                u32_of("implicit conv", rows.div_ceil(IMPLICIT_ROWS))?,
                u32_of("implicit conv", cols.div_ceil(tile_cols))?,
                1,
            ),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = be.compute_stream().launch_builder(&f);
        b.arg(&p).arg(src).arg(weight).arg(&mut *out);
        // SAFETY: implicit_conv_nBN_f16 / implicit_dgrad_nBN_f16
        // (ImplicitConvParams, const half* src, const half* w, half* out):
        // src is a whole f16 tensor (256-byte aligned, as the kernel's
        // 16-byte gathers need) of n·src_h·src_w·chans elements, w holds
        // k·k·cin·cout, out is a whole tensor of n·out_h·out_w·cols; the
        // rows of a product are pixels of out and its taps taps of W, so the
        // kernel reads and writes only inside those (the caller checked the
        // shapes, and implicit_takes the channel multiples of 8 and the
        // architecture).
        unsafe { b.launch(cfg) }.during("implicit conv")?;
    }
    Ok(())
}

/// Blocks the implicit weight gradient aims for: the pixels are split until
/// its grid has about this many (a constant, not the GPU's SM count, so
/// the sum's order and bits do not depend on the GPU).
const WGRAD_TARGET_BLOCKS: usize = 512;
/// Pixels the weight-gradient kernel sums per step (conv_mma.cu `WG_BM`),
/// and the rows of dW in its block tile (`WG_BK`).
const WGRAD_STEP: usize = 32;
const WGRAD_ROWS: usize = 64;

/// dW += Aᵀ·dY by conv_mma.cu's kernel: `splits` blocks along the pixels
/// each write an f32 partial of dW (at most `workspace` bytes of them,
/// at least one split), which `wgrad_reduce` adds to dW in split order.
fn implicit_wgrad(
    be: &CudaBackend,
    x: &CudaTensor,
    dy: &CudaTensor,
    weight_grad: &mut CudaViewMut<'_, f32>,
    s: &ConvShape,
    (oh, ow): (usize, usize),
    workspace: usize,
) -> CudaResult<()> {
    let by = |d: usize| FastDiv::new(d as u32);
    let rows = s.n * oh * ow;
    let depth = s.kk();
    let dw_len = depth * s.cout;
    let (sig, tile_cols) = if s.cout <= 32 {
        (&k::IMPLICIT_WGRAD_N32, 32)
    } else if s.cout.is_multiple_of(128) {
        (&k::IMPLICIT_WGRAD_N128, 128)
    } else {
        (&k::IMPLICIT_WGRAD_N64, 64)
    };
    let tiles = depth.div_ceil(WGRAD_ROWS) * s.cout.div_ceil(tile_cols);
    let steps = rows.div_ceil(WGRAD_STEP);
    let room = (workspace / (dw_len * 4)).max(1);
    let wanted = WGRAD_TARGET_BLOCKS
        .div_ceil(tiles)
        .clamp(1, steps)
        .min(room);
    let rows_per_split = steps.div_ceil(wanted) * WGRAD_STEP;
    let splits = rows.div_ceil(rows_per_split);
    checked_len("implicit weight gradient", &[splits, dw_len])?;
    let mut partial = CudaTensor::uninit(be, &[splits * dw_len], DType::F32)?;
    let p = WgradParams {
        rows: rows as u32,
        depth: depth as u32,
        cout: s.cout as u32,
        cin: s.cin as u32,
        h: s.h as u32,
        w: s.w as u32,
        opix: (oh * ow) as u32,
        ow: ow as u32,
        k: s.k as u32,
        stride: s.stride as u32,
        pad: s.pad as u32,
        rows_per_split: rows_per_split as u32,
        by_opix: by(oh * ow),
        by_ow: by(ow),
        by_cin: by(s.cin),
        by_k: by(s.k),
    };
    let f = be.function(sig)?;
    let cfg = LaunchConfig {
        grid_dim: (
            depth.div_ceil(WGRAD_ROWS) as u32,
            s.cout.div_ceil(tile_cols) as u32,
            splits as u32,
        ),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = be.compute_stream().launch_builder(&f);
    b.arg(&p).arg(x).arg(dy).arg(&mut partial);
    // SAFETY: implicit_wgrad_nBN_f16(WgradParams, const half* x, const half*
    // dy, float* partial): x [n, h, w, cin] and dy [n, oh, ow, cout] are
    // whole f16 tensors (256-byte aligned for the 16-byte loads; the caller
    // checked their shapes, implicit_takes the multiples of 8), and block z
    // writes only its depth·cout slice of partial, which holds splits of them.
    unsafe { b.launch(cfg) }.during("implicit weight gradient")?;
    add_weight_partials(be, &partial, weight_grad, splits)
}

/// dW += the weight gradient's partial sums `partial` [splits, dW's
/// length], added in split order (conv.cu's wgrad_reduce): the same
/// bits every run, where atomics would add in whatever order blocks end.
fn add_weight_partials(
    be: &CudaBackend,
    partial: &CudaTensor,
    weight_grad: &mut CudaViewMut<'_, f32>,
    splits: usize,
) -> CudaResult<()> {
    let n = weight_grad.len();
    same_len(
        "weight gradient reduce",
        "partial sums",
        splits * n,
        partial.len(),
    )?;
    let reduce = be.function(&k::WGRAD_REDUCE)?;
    let rp = WgradReduceParams {
        n: n as u32,
        splits: splits as u32,
    };
    let mut b = be.compute_stream().launch_builder(&reduce);
    b.arg(&rp).arg(partial).arg(weight_grad);
    // SAFETY: wgrad_reduce(WgradReduceParams, const float* partial [splits,
    // n], float* dw [n]): both lengths checked above (the callers made
    // partial f32); its block of at most WGRAD_REDUCE_THREADS threads, its
    // lanes a power of two, as the kernel's shared tree needs.
    unsafe { b.launch(wgrad_reduce_launch(n)) }.during("weight gradient reduce")?;
    Ok(())
}

/// wgrad_reduce's blocks: 32 elements by 8 lanes of splits while that
/// fills the GPU, else (dW of a few thousand floats, whose splits are
/// many: a narrow or thin kernel's up to 1024) 8 elements by 32 lanes.
/// Chosen by dW's length alone, so the order of the sum, and its bits,
/// depend on the shape and not on the GPU.
fn wgrad_reduce_launch(n: usize) -> LaunchConfig {
    const WIDE_FROM: usize = 32 * 512;
    let (cols, lanes) = if n >= WIDE_FROM { (32, 8) } else { (8, 32) };
    LaunchConfig {
        grid_dim: (n.div_ceil(cols).max(1) as u32, 1, 1),
        block_dim: (cols as u32, lanes, 1),
        shared_mem_bytes: 0,
    }
}

/// y = conv(x, W) (+ bias), [n, oh, ow, cout] in x's type.
pub fn conv2d_forward(
    be: &CudaBackend,
    x: &CudaTensor,
    weight: &AnyView<'_>,
    bias: Option<&AnyView<'_>>,
    s: ConvShape,
    plan: ConvPlan,
) -> CudaResult<CudaTensor> {
    let (oh, ow) = s.check(x, weight.len())?;
    let dtype = x.dtype();
    same_dtype("conv2d", dtype, &[weight.dtype()])?;
    let opix = oh * ow;
    let mut y = CudaTensor::uninit(be, &[s.n, oh, ow, s.cout], dtype)?;
    if y.is_empty() {
        return Ok(y);
    }
    if s.is_pointwise() {
        gemm(
            be,
            s.n * opix,
            s.cout,
            s.cin,
            &x.view(),
            Operand {
                transpose: false,
                ld: s.cin,
            },
            weight,
            Operand {
                transpose: false,
                ld: s.cout,
            },
            &mut y.view_mut(),
            s.cout,
            1.0,
            0.0,
        )?;
    } else if let Some(kind) = direct_kind(be, plan, dtype, &s, weight) {
        direct_forward(be, x, weight, &mut y, &s, (oh, ow), kind)?;
    } else {
        let takes = implicit_takes(be, dtype, &s, weight);
        let run = |path| forward_by(be, path, x, weight, &mut y, &s, (oh, ow), plan.workspace);
        let path = choose_path(be, plan, takes, &s, ConvProduct::Forward, run)?;
        forward_by(be, path, x, weight, &mut y, &s, (oh, ow), plan.workspace)?;
    }
    if let Some(bias) = bias {
        same_len("conv2d", "bias", s.cout, bias.len())?;
        bias_add(be, &mut y.view_mut(), bias)?;
    }
    Ok(y)
}

/// y = conv(x, W) by `path`, the batch through an im2col workspace of at
/// most `workspace` bytes in groups of whole images.
#[allow(clippy::too_many_arguments)]
fn forward_by(
    be: &CudaBackend,
    path: ConvPath,
    x: &CudaTensor,
    weight: &AnyView<'_>,
    y: &mut CudaTensor,
    s: &ConvShape,
    (oh, ow): (usize, usize),
    workspace: usize,
) -> CudaResult<()> {
    if path == ConvPath::Implicit {
        return implicit_conv(be, x, weight, y, s, (oh, ow), false);
    }
    let (opix, kk, dtype) = (oh * ow, s.kk(), x.dtype());
    let ipc = images_per_chunk(s, opix, workspace, dtype);
    let mut a = CudaTensor::uninit(be, &[ipc * opix * kk], dtype)?;
    for n0 in (0..s.n).step_by(ipc) {
        let images = ipc.min(s.n - n0);
        let p = s.params(oh, ow, n0, images);
        im2col(be, x, &p, &mut a, images * opix * kk)?;
        let rows = images * opix;
        let mut y_all = y.view_mut();
        let mut yv = y_all.slice_mut(n0 * opix * s.cout..(n0 + images) * opix * s.cout);
        gemm(
            be,
            rows,
            s.cout,
            kk,
            &a.view().slice(0..rows * kk),
            Operand {
                transpose: false,
                ld: kk,
            },
            weight,
            Operand {
                transpose: false,
                ld: s.cout,
            },
            &mut yv,
            s.cout,
            1.0,
            0.0,
        )?;
    }
    Ok(())
}

/// Backward: dW += Aᵀ·dY (f32, accumulated), db += Σ dY, returns dX.
#[allow(clippy::too_many_arguments)]
pub fn conv2d_backward(
    be: &CudaBackend,
    x: &CudaTensor,
    dy: &CudaTensor,
    weight: &AnyView<'_>,
    weight_grad: &mut CudaViewMut<'_, f32>,
    bias_grad: Option<&mut CudaViewMut<'_, f32>>,
    s: ConvShape,
    plan: ConvPlan,
) -> CudaResult<CudaTensor> {
    let mut dx = CudaTensor::uninit(be, x.shape(), x.dtype())?;
    let dx_out = Some(&mut dx);
    conv2d_backward_into(be, x, dy, weight, weight_grad, bias_grad, dx_out, s, plan)?;
    Ok(dx)
}

/// Backward without dX: dW += Aᵀ·dY, db += Σ dY (a network's first layer,
/// whose input no gradient is wanted for).
#[allow(clippy::too_many_arguments)]
pub fn conv2d_backward_params(
    be: &CudaBackend,
    x: &CudaTensor,
    dy: &CudaTensor,
    weight: &AnyView<'_>,
    weight_grad: &mut CudaViewMut<'_, f32>,
    bias_grad: Option<&mut CudaViewMut<'_, f32>>,
    s: ConvShape,
    plan: ConvPlan,
) -> CudaResult<()> {
    conv2d_backward_into(be, x, dy, weight, weight_grad, bias_grad, None, s, plan)
}

/// dW and db accumulated, and dX overwritten when `input_grad` is given.
#[allow(clippy::too_many_arguments)]
fn conv2d_backward_into(
    be: &CudaBackend,
    x: &CudaTensor,
    dy: &CudaTensor,
    weight: &AnyView<'_>,
    weight_grad: &mut CudaViewMut<'_, f32>,
    bias_grad: Option<&mut CudaViewMut<'_, f32>>,
    mut input_grad: Option<&mut CudaTensor>,
    s: ConvShape,
    plan: ConvPlan,
) -> CudaResult<()> {
    let (oh, ow) = s.check(x, weight.len())?;
    let dtype = x.dtype();
    same_dtype("conv2d backward", dtype, &[dy.dtype(), weight.dtype()])?;
    dy.expect_shape("conv2d backward", &[s.n, oh, ow, s.cout])?;
    same_len(
        "conv2d backward",
        "weight gradient",
        weight.len(),
        weight_grad.len(),
    )?;
    let opix = oh * ow;
    if let Some(db) = bias_grad {
        same_len("conv2d backward", "bias gradient", s.cout, db.len())?;
        bias_grad_into(be, dy, db)?;
    }
    if dy.is_empty() {
        // No output pixels: the input gradient is zero.
        if let Some(dx) = input_grad {
            *dx = CudaTensor::zeros(be, x.shape(), dtype)?;
        }
        return Ok(());
    }
    let w_t = Operand {
        transpose: true,
        ld: s.cout,
    };
    if s.is_pointwise() {
        // dW[cin × cout] += xᵀ · dY
        gemm(
            be,
            s.cin,
            s.cout,
            s.n * opix,
            &x.view(),
            Operand {
                transpose: true,
                ld: s.cin,
            },
            &dy.view(),
            Operand {
                transpose: false,
                ld: s.cout,
            },
            &mut AnyViewMut::F32(weight_grad.slice_mut(..)),
            s.cout,
            1.0,
            1.0,
        )?;
        // dX[n·h·w × cin] = dY · Wᵀ
        if let Some(dx) = input_grad {
            gemm(
                be,
                s.n * opix,
                s.cin,
                s.cout,
                &dy.view(),
                Operand {
                    transpose: false,
                    ld: s.cout,
                },
                weight,
                w_t,
                &mut dx.view_mut(),
                s.cin,
                1.0,
                0.0,
            )?;
        }
        return Ok(());
    }
    if let Some(kind) = direct_kind(be, plan, dtype, &s, weight) {
        direct_wgrad(be, x, dy, weight_grad, &s, (oh, ow), plan.workspace, kind)?;
        // The narrow kernels' gather takes any cout: the thin shapes' too.
        if let Some(dx) = input_grad {
            narrow_grad_input(be, dy, weight, dx, &s, (oh, ow))?;
        }
        return Ok(());
    }
    let takes = implicit_takes(be, dtype, &s, weight);
    let out = (oh, ow);
    let wgrad_trial = |path| {
        // Timed into a scratch gradient: the product accumulates.
        let mut scratch = CudaTensor::zeros(be, &[weight_grad.len()], DType::F32)?;
        let mut dw = scratch.f32_mut()?.slice_mut(..);
        weight_grad_by(be, path, x, dy, weight, &mut dw, &s, out, plan.workspace)
    };
    let wgrad_path = choose_path(be, plan, takes, &s, ConvProduct::WeightGrad, wgrad_trial)?;
    let dgrad_path = match input_grad.as_deref_mut() {
        Some(dx) => {
            let trial = |path| input_grad_by(be, path, dy, weight, dx, &s, out, plan.workspace);
            Some(choose_path(
                be,
                plan,
                takes,
                &s,
                ConvProduct::InputGrad,
                trial,
            )?)
        }
        None => None,
    };
    let mut im2col_dw = None;
    match wgrad_path {
        ConvPath::Implicit => implicit_wgrad(be, x, dy, weight_grad, &s, out, plan.workspace)?,
        ConvPath::Im2col => im2col_dw = Some((x, weight_grad)),
    }
    let mut im2col_dx = None;
    if let Some(dx) = input_grad {
        match dgrad_path {
            Some(ConvPath::Implicit) => implicit_conv(be, dy, weight, dx, &s, out, true)?,
            _ => im2col_dx = Some(dx),
        }
    }
    // Both products by im2col share each group's matrix (as before tuning).
    im2col_backward(
        be,
        dy,
        weight,
        im2col_dw,
        im2col_dx,
        &s,
        out,
        plan.workspace,
    )
}

/// dW += Aᵀ·dY by `path`.
#[allow(clippy::too_many_arguments)]
fn weight_grad_by(
    be: &CudaBackend,
    path: ConvPath,
    x: &CudaTensor,
    dy: &CudaTensor,
    weight: &AnyView<'_>,
    weight_grad: &mut CudaViewMut<'_, f32>,
    s: &ConvShape,
    out: (usize, usize),
    workspace: usize,
) -> CudaResult<()> {
    match path {
        ConvPath::Implicit => implicit_wgrad(be, x, dy, weight_grad, s, out, workspace),
        ConvPath::Im2col => im2col_backward(
            be,
            dy,
            weight,
            Some((x, weight_grad)),
            None,
            s,
            out,
            workspace,
        ),
    }
}

/// dX = the input gradient by `path` (x is not read: its shape is dX's).
#[allow(clippy::too_many_arguments)]
fn input_grad_by(
    be: &CudaBackend,
    path: ConvPath,
    dy: &CudaTensor,
    weight: &AnyView<'_>,
    dx: &mut CudaTensor,
    s: &ConvShape,
    out: (usize, usize),
    workspace: usize,
) -> CudaResult<()> {
    match path {
        ConvPath::Implicit => implicit_conv(be, dy, weight, dx, s, out, true),
        ConvPath::Im2col => im2col_backward(be, dy, weight, None, Some(dx), s, out, workspace),
    }
}

/// The backward's products by im2col + cuBLAS, a group of whole images at
/// a time through a workspace of at most `workspace` bytes: dW += Aᵀ·dY
/// where `weight_grad` (x, dW) is given, dX = col2im(dY·Wᵀ) where `dx` is.
/// When both are, each group's matrix serves both (A, then dA in its place).
#[allow(clippy::too_many_arguments)]
fn im2col_backward(
    be: &CudaBackend,
    dy: &CudaTensor,
    weight: &AnyView<'_>,
    mut weight_grad: Option<(&CudaTensor, &mut CudaViewMut<'_, f32>)>,
    mut dx: Option<&mut CudaTensor>,
    s: &ConvShape,
    (oh, ow): (usize, usize),
    workspace: usize,
) -> CudaResult<()> {
    if weight_grad.is_none() && dx.is_none() {
        return Ok(());
    }
    let (opix, kk, dtype) = (oh * ow, s.kk(), dy.dtype());
    let ipc = images_per_chunk(s, opix, workspace, dtype);
    let mut a = CudaTensor::uninit(be, &[ipc * opix * kk], dtype)?;
    for n0 in (0..s.n).step_by(ipc) {
        let images = ipc.min(s.n - n0);
        let rows = images * opix;
        let p = s.params(oh, ow, n0, images);
        let dy_all = dy.view();
        let dy_rows = dy_all.slice(n0 * opix * s.cout..(n0 + images) * opix * s.cout);
        // dW[K × cout] += Aᵀ · dY for this group of images.
        if let Some((x, dw)) = weight_grad.as_mut() {
            im2col(be, x, &p, &mut a, rows * kk)?;
            gemm(
                be,
                kk,
                s.cout,
                rows,
                &a.view().slice(0..rows * kk),
                Operand {
                    transpose: true,
                    ld: kk,
                },
                &dy_rows,
                Operand {
                    transpose: false,
                    ld: s.cout,
                },
                &mut AnyViewMut::F32(dw.slice_mut(..)),
                s.cout,
                1.0,
                1.0,
            )?;
        }
        let Some(dx) = dx.as_deref_mut() else {
            continue;
        };
        // dA = dY · Wᵀ into the same scratch (stream order: after a dW
        // product has read A), then col2im into dX.
        {
            let mut a_all = a.view_mut();
            let mut av = a_all.slice_mut(0..rows * kk);
            gemm(
                be,
                rows,
                kk,
                s.cout,
                &dy_rows,
                Operand {
                    transpose: false,
                    ld: s.cout,
                },
                weight,
                Operand {
                    transpose: true,
                    ld: s.cout,
                },
                &mut av,
                kk,
                1.0,
                0.0,
            )?;
        }
        let total = images * s.h * s.w * s.cin;
        let (col2im, cfg) = per_element(be, &k::COL2IM, &k::COL2IM_V8, dtype, s.cin, total)?;
        let mut b = be.compute_stream().launch_builder(&col2im);
        b.arg(&p).arg(&a).arg(dx);
        // SAFETY: col2im_T(ConvParams, const T* da [rows, kk], T* dx
        // [n, h, w, cin]) reads rows·kk ≤ a.len() elements and writes the
        // `images` images from n0 of dx, inside its n images; col2im_v8_f16
        // the same 8 at a time (by_eight: aligned 16-byte accesses).
        unsafe { b.launch(cfg) }.during("col2im")?;
    }
    Ok(())
}

fn bias_grad_into(
    be: &CudaBackend,
    dy: &CudaTensor,
    db: &mut CudaViewMut<'_, f32>,
) -> CudaResult<()> {
    bias_grad(be, &dy.view(), db)
}

/// y[n, out] = x[n, in] · W[in, out] (+ bias).
pub fn linear_forward(
    be: &CudaBackend,
    x: &CudaTensor,
    weight: &AnyView<'_>,
    bias: Option<&AnyView<'_>>,
    out_features: usize,
) -> CudaResult<CudaTensor> {
    let (n, inf) = matrix_dims("linear", "features [n, in]", x)?;
    same_len(
        "linear",
        "weight [in, out]",
        inf * out_features,
        weight.len(),
    )?;
    same_dtype("linear", x.dtype(), &[weight.dtype()])?;
    let mut y = CudaTensor::uninit(be, &[n, out_features], x.dtype())?;
    if y.is_empty() {
        return Ok(y);
    }
    {
        gemm(
            be,
            n,
            out_features,
            inf,
            &x.view(),
            Operand {
                transpose: false,
                ld: inf,
            },
            weight,
            Operand {
                transpose: false,
                ld: out_features,
            },
            &mut y.view_mut(),
            out_features,
            1.0,
            0.0,
        )?;
    }
    if let Some(bias) = bias {
        same_len("linear", "bias", out_features, bias.len())?;
        bias_add(be, &mut y.view_mut(), bias)?;
    }
    Ok(y)
}

/// dW += xᵀ·g (f32), db += Σₙ g, returns dx = g·Wᵀ.
pub fn linear_backward(
    be: &CudaBackend,
    x: &CudaTensor,
    g: &CudaTensor,
    weight: &AnyView<'_>,
    weight_grad: &mut CudaViewMut<'_, f32>,
    bias_grad: Option<&mut CudaViewMut<'_, f32>>,
) -> CudaResult<CudaTensor> {
    linear_backward_params(be, x, g, weight, weight_grad, bias_grad)?;
    let inf = x.shape().get(1).copied().unwrap_or(0);
    linear_backward_input(be, g, weight, inf)
}

/// dW += xᵀ·g (f32) and db += Σ g, without dx (a network's first layer,
/// whose input no gradient is wanted for).
pub fn linear_backward_params(
    be: &CudaBackend,
    x: &CudaTensor,
    g: &CudaTensor,
    weight: &AnyView<'_>,
    weight_grad: &mut CudaViewMut<'_, f32>,
    bias_grad: Option<&mut CudaViewMut<'_, f32>>,
) -> CudaResult<()> {
    let (n, inf) = matrix_dims("linear backward", "features [n, in]", x)?;
    let out = weight.len().checked_div(inf).unwrap_or(0);
    same_len(
        "linear backward",
        "weight [in, out]",
        inf * out,
        weight.len(),
    )?;
    same_len(
        "linear backward",
        "weight gradient",
        weight.len(),
        weight_grad.len(),
    )?;
    g.expect_shape("linear backward", &[n, out])?;
    if let Some(db) = bias_grad {
        same_len("linear backward", "bias gradient", out, db.len())?;
        bias_grad_into(be, g, db)?;
    }
    same_dtype("linear backward", x.dtype(), &[g.dtype(), weight.dtype()])?;
    if n > 0 && inf > 0 && out > 0 {
        gemm(
            be,
            inf,
            out,
            n,
            &x.view(),
            Operand {
                transpose: true,
                ld: inf,
            },
            &g.view(),
            Operand {
                transpose: false,
                ld: out,
            },
            &mut AnyViewMut::F32(weight_grad.slice_mut(..)),
            out,
            1.0,
            1.0,
        )?;
    }
    Ok(())
}

/// dx = g·Wᵀ [n, in] for g [n, out] and W [in, out] (a frozen weight's
/// layer needs only this).
pub fn linear_backward_input(
    be: &CudaBackend,
    g: &CudaTensor,
    weight: &AnyView<'_>,
    inf: usize,
) -> CudaResult<CudaTensor> {
    let (n, out) = matrix_dims("linear backward", "gradient [n, out]", g)?;
    same_len(
        "linear backward",
        "weight [in, out]",
        inf * out,
        weight.len(),
    )?;
    let dtype = g.dtype();
    same_dtype("linear backward", dtype, &[weight.dtype()])?;
    if out == 0 {
        return CudaTensor::zeros(be, &[n, inf], dtype);
    }
    let mut dx = CudaTensor::uninit(be, &[n, inf], dtype)?;
    if n == 0 || inf == 0 {
        return Ok(dx);
    }
    gemm(
        be,
        n,
        inf,
        out,
        &g.view(),
        Operand {
            transpose: false,
            ld: out,
        },
        weight,
        Operand {
            transpose: true,
            ld: out,
        },
        &mut dx.view_mut(),
        inf,
        1.0,
        0.0,
    )?;
    Ok(dx)
}

// ---------------------------------------------------------------------------
// Loss

/// Per-row results of `softmax_cross_entropy`, all on the device.
#[derive(Debug)]
pub struct XentOutput {
    /// (softmax - target) · loss_scale / rows, [rows, classes] in the
    /// logits' type.
    pub grad: CudaTensor,
    pub row_loss: DeviceBuffer<f32>,
    pub row_correct: DeviceBuffer<u32>,
}

impl XentOutput {
    /// Mean loss and correct count, reduced on the device into one f32 and
    /// one u32 (no host synchronisation).
    pub fn summary(&self, be: &CudaBackend) -> CudaResult<(DeviceBuffer<f32>, DeviceBuffer<u32>)> {
        let mut loss = be.alloc::<f32>(1)?;
        let mut correct = be.alloc::<u32>(1)?;
        self.summary_into(
            be,
            &mut loss.slice.as_view_mut(),
            &mut correct.slice.as_view_mut(),
        )?;
        Ok((loss, correct))
    }

    /// `summary` into `loss[0]` and `correct[0]` (e.g. one micro-batch's
    /// entry of a step's record).
    pub fn summary_into(
        &self,
        be: &CudaBackend,
        loss: &mut CudaViewMut<'_, f32>,
        correct: &mut CudaViewMut<'_, u32>,
    ) -> CudaResult<()> {
        if loss.is_empty() || correct.is_empty() {
            return Err(CudaError::shape(
                "xent_reduce",
                "one f32 and one u32 to write",
                format!("{} and {}", loss.len(), correct.len()),
            ));
        }
        let rows = self.row_loss.len();
        let p = XentReduceParams {
            rows: u32_of("xent_reduce", rows)?,
        };
        let f = be.function(&k::XENT_REDUCE)?;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = be.compute_stream().launch_builder(&f);
        b.arg(&p)
            .arg(&self.row_loss.slice)
            .arg(&self.row_correct.slice)
            .arg(loss)
            .arg(correct);
        // SAFETY: xent_reduce(XentReduceParams, const float* row_loss,
        // const u32* row_correct [rows], float* out_loss, u32*
        // out_correct [1]) with exactly one block of 256 threads, as the
        // kernel requires; both outputs hold at least one element.
        unsafe { b.launch(cfg) }.during("xent_reduce")?;
        Ok(())
    }

    /// `summary`, downloaded (waits for the compute stream): (mean loss,
    /// correct count).
    pub fn read_summary(&self, be: &CudaBackend) -> CudaResult<(f32, u32)> {
        let (loss, correct) = self.summary(be)?;
        let loss = be.download(&loss.slice)?;
        let correct = be.download(&correct.slice)?;
        Ok((loss[0], correct[0]))
    }
}

/// What a loss kernel multiplies its gradient by, besides 1 / rows: the
/// dynamic loss scale, read from device memory when the kernel runs (the
/// optimizer keeps it there, so a step never waits for the host to learn
/// it), and this micro-batch's share of the batch.
#[derive(Clone, Copy, Debug)]
pub struct GradScale<'a> {
    /// One f32.
    pub loss_scale: &'a CudaSlice<f32>,
    pub share: f32,
}

impl GradScale<'_> {
    /// The loss kernels read one f32 of scale.
    fn check(&self, op: &'static str) -> CudaResult<()> {
        match self.loss_scale.len() {
            1 => Ok(()),
            len => Err(CudaError::shape(
                op,
                "a loss scale of one f32",
                format!("{len} values"),
            )),
        }
    }
}

/// Softmax cross-entropy with label smoothing, forward and gradient in one
/// kernel. `labels` are class indices on the device (use
/// `upload_labels`, which validates them); the gradient is multiplied by
/// `scale` (dynamic loss scaling) and divided by the batch size.
pub fn softmax_cross_entropy(
    be: &CudaBackend,
    logits: &CudaTensor,
    labels: &CudaView<'_, u32>,
    smoothing: f32,
    scale: GradScale<'_>,
) -> CudaResult<XentOutput> {
    let (n, _) = xent_shape(logits)?;
    same_len("cross_entropy", "labels", n, labels.len())?;
    if !(0.0..1.0).contains(&smoothing) {
        return Err(CudaError::shape(
            "cross_entropy",
            "label smoothing in [0, 1)",
            format!("{smoothing}"),
        ));
    }
    xent_launch(
        be,
        logits,
        XentTarget::Labels(labels),
        smoothing,
        None,
        scale,
    )
}

/// Focal loss with label smoothing (`loss::focal_loss`): the targets of
/// `softmax_cross_entropy`, each class's log-probability weighted by
/// (1 − p)^gamma; the gradient scaled as there. gamma = 0 is the
/// cross-entropy.
pub fn focal_loss(
    be: &CudaBackend,
    logits: &CudaTensor,
    labels: &CudaView<'_, u32>,
    smoothing: f32,
    gamma: f32,
    scale: GradScale<'_>,
) -> CudaResult<XentOutput> {
    let (n, _) = xent_shape(logits)?;
    same_len("focal_loss", "labels", n, labels.len())?;
    if !(0.0..1.0).contains(&smoothing) {
        return Err(CudaError::shape(
            "focal_loss",
            "label smoothing in [0, 1)",
            format!("{smoothing}"),
        ));
    }
    let gamma = focal_gamma(gamma)?;
    xent_launch(
        be,
        logits,
        XentTarget::Labels(labels),
        smoothing,
        Some(gamma),
        scale,
    )
}

/// Focal loss against soft targets (`loss::soft_focal_loss`), `targets`
/// as in `soft_cross_entropy`.
pub fn soft_focal_loss(
    be: &CudaBackend,
    logits: &CudaTensor,
    targets: &CudaView<'_, f32>,
    gamma: f32,
    scale: GradScale<'_>,
) -> CudaResult<XentOutput> {
    let (n, classes) = xent_shape(logits)?;
    same_len("soft_focal_loss", "targets", n * classes, targets.len())?;
    let gamma = focal_gamma(gamma)?;
    xent_launch(
        be,
        logits,
        XentTarget::Soft(targets),
        0.0,
        Some(gamma),
        scale,
    )
}

fn focal_gamma(gamma: f32) -> CudaResult<f32> {
    if gamma >= 0.0 && gamma.is_finite() {
        Ok(gamma)
    } else {
        Err(CudaError::shape(
            "focal_loss",
            "gamma finite and >= 0",
            format!("{gamma}"),
        ))
    }
}

/// Cross-entropy against soft targets (Mixup, CutMix): `targets` [n, k]
/// f32 on the device, smoothing already applied; the CPU's
/// `loss::soft_cross_entropy`. The gradient is scaled as in
/// `softmax_cross_entropy`.
pub fn soft_cross_entropy(
    be: &CudaBackend,
    logits: &CudaTensor,
    targets: &CudaView<'_, f32>,
    scale: GradScale<'_>,
) -> CudaResult<XentOutput> {
    let (n, classes) = xent_shape(logits)?;
    same_len("soft_cross_entropy", "targets", n * classes, targets.len())?;
    xent_launch(be, logits, XentTarget::Soft(targets), 0.0, None, scale)
}

fn xent_shape(logits: &CudaTensor) -> CudaResult<(usize, usize)> {
    match *logits.shape() {
        [n, k] if n > 0 && k > 0 => Ok((n, k)),
        _ => Err(CudaError::shape(
            "cross_entropy",
            "logits [n, classes] with n ≥ 1 and classes ≥ 1",
            format!("{:?}", logits.shape()),
        )),
    }
}

/// What the cross-entropy is taken against.
enum XentTarget<'a, 'v> {
    Labels(&'a CudaView<'v, u32>),
    Soft(&'a CudaView<'v, f32>),
}

/// Launches one of the cross-entropy kernels, or with `focal` (its γ) one
/// of the focal-loss kernels: (params, loss scale, logits, labels or soft
/// targets, row_loss, row_correct, grad). One warp per row, 8 rows per
/// block.
fn xent_launch(
    be: &CudaBackend,
    logits: &CudaTensor,
    target: XentTarget<'_, '_>,
    smoothing: f32,
    focal: Option<f32>,
    scale: GradScale<'_>,
) -> CudaResult<XentOutput> {
    scale.check("cross_entropy")?;
    let pair = match (&target, focal) {
        (XentTarget::Labels(_), None) => k::SOFTMAX_XENT,
        (XentTarget::Soft(_), None) => k::SOFTMAX_XENT_SOFT,
        (XentTarget::Labels(_), Some(_)) => k::SOFTMAX_FOCAL,
        (XentTarget::Soft(_), Some(_)) => k::SOFTMAX_FOCAL_SOFT,
    };
    let sig = pair.of(logits.dtype());
    let (n, classes) = xent_shape(logits)?;
    let mut grad = CudaTensor::uninit(be, logits.shape(), logits.dtype())?;
    let mut row_loss = be.alloc::<f32>(n)?;
    let mut row_correct = be.alloc::<u32>(n)?;
    let p = XentParams {
        rows: u32_of("cross_entropy", n)?,
        classes: u32_of("cross_entropy", classes)?,
        smoothing,
        share: scale.share,
    };
    let focal_params = focal.map(|gamma| FocalParams {
        rows: p.rows,
        classes: p.classes,
        smoothing,
        share: scale.share,
        gamma,
    });
    let threads = u32_of("cross_entropy", n * 32)? as usize;
    let cfg = LaunchConfig {
        grid_dim: (threads.div_ceil(BLOCK as usize) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    {
        let f = be.function(sig)?;
        let mut b = be.compute_stream().launch_builder(&f);
        match &focal_params {
            Some(focal) => b.arg(focal),
            None => b.arg(&p),
        };
        b.arg(scale.loss_scale).arg(logits);
        match target {
            XentTarget::Labels(labels) => b.arg(labels),
            XentTarget::Soft(targets) => b.arg(targets),
        };
        b.arg(&mut row_loss.slice)
            .arg(&mut row_correct.slice)
            .arg(&mut grad);
        // SAFETY: softmax_xent_T(XentParams, const float* loss_scale [1],
        // const T* logits [n, k], const u32* labels [n], ...) and
        // softmax_xent_soft_T(..., const float* targets [n, k], ...), then
        // float* row_loss [n], u32* row_correct [n], T* grad [n, k]; the
        // focal kernels alike with FocalParams; the callers checked the
        // target's length.
        unsafe { b.launch(cfg) }.during(sig.name)?;
    }
    Ok(XentOutput {
        grad,
        row_loss,
        row_correct,
    })
}

/// Uploads class labels after checking each is below `classes`.
pub fn upload_labels(
    be: &CudaBackend,
    labels: &[u32],
    classes: usize,
) -> CudaResult<DeviceBuffer<u32>> {
    if let Some((i, &bad)) = labels
        .iter()
        .enumerate()
        .find(|(_, &l)| l as usize >= classes)
    {
        return Err(CudaError::shape(
            "cross_entropy",
            format!("labels below the class count {classes}"),
            format!("label {bad} at sample {i}"),
        ));
    }
    be.upload(labels)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_shapes() {
        let c = elementwise(1);
        assert_eq!((c.grid_dim.0, c.block_dim.0), (1, 256));
        assert_eq!(elementwise(257).grid_dim.0, 2);
        assert_eq!(elementwise(usize::MAX / 2).grid_dim.0 as usize, MAX_BLOCKS);
        assert_eq!(per_channel(129).grid_dim.0, 2);
    }

    #[test]
    fn batch_norm_chunks_are_few_and_cover_the_rows() {
        assert_eq!(batch_norm_chunking(2), (256, 1));
        assert_eq!(batch_norm_chunking(64 * 28 * 28), (256, 196));
        assert_eq!(batch_norm_chunking(512 * 28 * 28), (1568, 256));
        for rows in [1usize, 255, 256, 257, 65_536, 65_537, 1 << 31] {
            let (rpc, chunks) = batch_norm_chunking(rows);
            assert!(chunks <= BN_MAX_CHUNKS && rpc * chunks >= rows, "{rows}");
            assert!(
                rpc * (chunks - 1) < rows.max(1),
                "no empty chunk for {rows}"
            );
        }
    }

    #[test]
    fn bn_chunks_cover_the_rows_within_the_grid_limit() {
        assert_eq!(bn_chunking(2), (256, 1));
        assert_eq!(bn_chunking(128 * 28 * 28), (256, 392));
        for rows in [
            1usize,
            255,
            256,
            257,
            65_535 * 256,
            65_535 * 256 + 1,
            1 << 31,
        ] {
            let (rpc, chunks) = bn_chunking(rows);
            assert!(chunks <= 65_535 && rpc * chunks >= rows, "{rows}");
            assert!(
                rpc * (chunks - 1) < rows.max(1),
                "no empty chunk for {rows}"
            );
        }
    }

    #[test]
    fn conv_shapes_and_chunking() {
        let s = ConvShape {
            n: 128,
            h: 28,
            w: 28,
            cin: 32,
            cout: 64,
            k: 3,
            stride: 2,
            pad: 1,
        };
        assert_eq!(s.out_hw().unwrap(), (14, 14));
        assert_eq!(s.kk(), 288);
        // 196 pixels × 288 columns × 2 B = 112,896 B per image in f16,
        // twice that in f32.
        assert_eq!(
            images_per_chunk(&s, 196, CONV_SCRATCH_BYTES, DType::F16),
            128
        );
        assert_eq!(images_per_chunk(&s, 196, 1_000_000, DType::F16), 8);
        assert_eq!(images_per_chunk(&s, 196, 1_000_000, DType::F32), 4);
        assert_eq!(images_per_chunk(&s, 196, 1, DType::F16), 1);
        let bad = ConvShape { k: 40, ..s };
        assert!(bad.out_hw().is_err());
    }

    /// The input gradient's parity classes: every pixel of dx in exactly
    /// one, and a class's taps exactly those that reach its pixels, those
    /// (ky, kx) with iy + pad − ky and ix + pad − kx multiples of the
    /// stride (the kernel still checks that the dy position is inside).
    #[test]
    fn input_gradient_classes_take_every_tap_that_reaches_a_pixel() {
        for (h, w, k, stride, pad) in [
            (28, 28, 3, 2, 1),
            (5, 7, 3, 2, 1),
            (8, 8, 3, 3, 2),
            (7, 6, 1, 2, 0),
            (6, 6, 2, 2, 0),
            (1, 5, 3, 2, 1),
            (9, 9, 5, 1, 0),
            (10, 11, 5, 3, 2),
        ] {
            let s = ConvShape {
                n: 1,
                h,
                w,
                cin: 8,
                cout: 8,
                k,
                stride,
                pad,
            };
            let out = s.out_hw().unwrap();
            let mut seen = vec![0; h * w];
            for c in implicit_products(&s, out, true) {
                let taps = |first: usize, count: usize| -> Vec<usize> {
                    (0..count).map(|j| first + stride * j).collect()
                };
                let (tys, txs) = (taps(c.tap_y0, c.taps_y), taps(c.tap_x0, c.taps_x));
                for y in 0..c.row_h {
                    for x in 0..c.row_w {
                        let (iy, ix) = (c.row_y0 + stride * y, c.row_x0 + stride * x);
                        seen[iy * w + ix] += 1;
                        let reach = |i: usize| -> Vec<usize> {
                            (0..k)
                                .filter(|kk| (i + pad).abs_diff(*kk) % stride == 0)
                                .collect()
                        };
                        assert_eq!(tys, reach(iy), "{s:?}: taps of row {iy}");
                        assert_eq!(txs, reach(ix), "{s:?}: taps of column {ix}");
                    }
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "{s:?}: {seen:?}");
        }
        let forward = implicit_products(
            &ConvShape {
                n: 2,
                h: 9,
                w: 9,
                cin: 8,
                cout: 8,
                k: 3,
                stride: 2,
                pad: 1,
            },
            (5, 5),
            false,
        );
        assert_eq!(forward.len(), 1);
        assert_eq!((forward[0].taps_y, forward[0].taps_x), (3, 3));
    }
}
