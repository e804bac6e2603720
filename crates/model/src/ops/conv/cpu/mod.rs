//! 2-D convolution in NHWC on the CPU, forward and hand-written backward.
//!
//! Shapes: input x [N, H, W, Cin], weight [KH, KW, Cin, Cout] (an NHWC
//! receptive field, in (ky, kx, ci) order, times W is one NHWC output pixel),
//! optional bias [Cout], output y [N, OH, OW, Cout]; K = KH·KW·Cin.
//!
//! Memory (llm.c style):
//! - saved for backward: the input tensor only, as a reference-counted
//!   handle (no copy; the previous layer's output stays alive). No im2col
//!   matrix is ever built for the batch: it would be K/Cin = 9 times the
//!   input (116 MB for a 32->32 layer at 28x28, batch 128).
//! - kept in the layer: one partial weight gradient per backward group,
//!   GROUPS·(K·Cout + Cout) floats, reused across steps (8·1152·128·4 B =
//!   4.7 MB for 128->128; 15 MB for all convolutions of the reference ResNet).
//! - per thread, reused by every convolution: a copy of one task's images
//!   (≈ CHUNK_BYTES = 256 KiB, or one image if larger), or one im2col block
//!   (BLOCK_BYTES) on the general path.
//! - per backward call: Wᵀ, K·Cout floats.
//!
//! Two implementations:
//! - `direct` (x86-64 with AVX2+FMA, when the output columns come in 16s:
//!   Cout for forward and dW, Cin for dX; all of the reference ResNet except
//!   the stem's dX): register-tiled kernels that walk the input in place.
//!   A tile is 6 rows × 16 columns accumulated in 12 ymm registers; each row
//!   has its own pointer, so rows gather pixels from anywhere, and taps that
//!   fall in the zero padding are skipped instead of multiplied (5-18% of
//!   the work on 28x28..7x7 images). Forward: rows are output pixels, the
//!   walk is (valid taps × Cin) along W. dX: rows are input pixels, the walk
//!   is (taps that reach the pixel × Cout) along Wᵀ — a gather, so no
//!   scatter-add and no zeroing, for every stride. dW: rows are the input
//!   channels of one tap, the walk is every output pixel that tap reaches,
//!   along dY.
//! - general (any shape, any CPU): im2col + `gemm` in L2-sized blocks, and
//!   dX = col2im(dY·Wᵀ). 1x1 / stride 1 / pad 0 skips im2col.
//! - `narrow` (Cout below 16, any CPU): forward and dW on the contiguous
//!   runs a kernel row reads in NHWC, dX (where Cin is not in 16s) a gather
//!   per input pixel: no product with a handful of columns, no im2col copy,
//!   no scatter.
//!
//! Parallelism (rayon's global pool; no nested parallelism):
//! - forward, dX: tasks of whole images (several small ones per task, see
//!   `images_per_task`); every output element is summed in one fixed order
//!   whatever the split, so results do not depend on the thread count.
//! - dW, db: the batch is cut into at most GROUPS fixed groups of images,
//!   each accumulating its own partial; the partials are summed in group
//!   order. Gradients are bit-identical for any thread count.
//!
//! Measured on the 2-core Zen4 (FMA peak 117 GFLOP/s per core, 234 for
//! both): the reference ResNet's convolutions, forward + backward of one
//! batch of 128, run at ~100 GFLOP/s per core (nominal FLOPs, counting the
//! skipped padding taps) and scale to both cores; the im2col + gemm path
//! ran at ~66 per core (im2col, col2im and packing cost 20%).

// `usize::is_multiple_of` needs Rust 1.87; the workspace supports 1.85.
#![allow(clippy::manual_is_multiple_of)]

use std::cell::RefCell;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::layers::matmul::{matmul, View};
use crate::layers::vector_math::{cpu_kernels, CpuKernels};
use rayon::prelude::*;

use crate::init::InitRng;
use crate::memory::{try_scratch, try_zeroed};
use crate::{Layer, Mode, ModelError, Param, Result, Tensor};

mod narrow;
mod winograd;

use winograd::Tile;

/// Which kernels run the 3×3, stride-1, padding-1 convolutions (the others
/// always take the direct kernels or im2col + gemm).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvAlgorithm {
    /// Winograd F(4×4, 3×3) where `winograd_pays` says it is faster, else
    /// the direct kernels.
    Auto,
    /// Always the direct kernels (as before Winograd existed).
    Direct,
    /// Winograd F(2×2, 3×3) wherever the shape allows (channels in 16s).
    Winograd,
    /// Winograd F(4×4, 3×3) wherever the shape allows.
    Winograd4,
}

/// 0 = not yet read from the environment, then 1 + the algorithm's index.
static ALGORITHM: AtomicU8 = AtomicU8::new(0);

const ALGORITHMS: [ConvAlgorithm; 4] = [
    ConvAlgorithm::Auto,
    ConvAlgorithm::Direct,
    ConvAlgorithm::Winograd,
    ConvAlgorithm::Winograd4,
];

/// Chooses the algorithm for every convolution of this process from now on
/// (benchmarks compare them side by side this way).
pub fn set_conv_algorithm(algorithm: ConvAlgorithm) {
    let index = ALGORITHMS.iter().position(|&a| a == algorithm).unwrap_or(0);
    ALGORITHM.store(index as u8 + 1, Ordering::Relaxed);
}

/// The algorithm in force: set by `set_conv_algorithm`, else by the
/// environment variable HEADROOM_CONV_ALGORITHM (`auto`, `direct` or
/// `winograd` or `winograd4`, so that a benchmark's child processes can be steered), else
/// `Auto`. An unknown value means `Auto`.
pub fn conv_algorithm() -> ConvAlgorithm {
    #[cfg(test)]
    if let Some(forced) = tests::FORCE_ALGORITHM.get() {
        return forced;
    }
    let stored = ALGORITHM.load(Ordering::Relaxed);
    if stored > 0 {
        return ALGORITHMS[(stored as usize - 1).min(ALGORITHMS.len() - 1)];
    }
    let from_env = match std::env::var("HEADROOM_CONV_ALGORITHM").as_deref() {
        Ok("direct") => ConvAlgorithm::Direct,
        Ok("winograd") => ConvAlgorithm::Winograd,
        Ok("winograd4") => ConvAlgorithm::Winograd4,
        _ => ConvAlgorithm::Auto,
    };
    set_conv_algorithm(from_env);
    from_env
}

/// Which Winograd algorithm, if any, computes this convolution's forward,
/// input gradient and weight gradient: a fixed rule, not a timing at
/// start, because the algorithms round differently and a choice by timing
/// would make a run's numbers depend on the machine's load.
fn winograd_tile(g: &Geom) -> Option<Tile> {
    if !(winograd::shape_fits(g) && direct::supports(g.cout) && direct::supports(g.cin)) {
        return None;
    }
    match conv_algorithm() {
        ConvAlgorithm::Direct => None,
        ConvAlgorithm::Winograd => Some(Tile::F2),
        ConvAlgorithm::Winograd4 => Some(Tile::F4),
        ConvAlgorithm::Auto => winograd_pays(g).then_some(Tile::F4),
    }
}

/// The measured rule for `Auto` (docs/measurements/cpu-epyc-avx512.md: `conv_bench` on a
/// 2-core AMD EPYC with AVX-512, `direct,winograd,winograd4` side by side,
/// ms a layer at batch 128, forward / backward): F(4×4, 3×3) is the
/// fastest of the three on the reference ResNet's stride-1 layers, 28×28×32
/// 5.3 / 11.2 (direct 8.9 / 17.7), 14×14×64 5.0 / 12.0 (8.0 / 16.2) and
/// even 7×7×128, where 15 of 64 tile pixels lie outside the image, 5.0 /
/// 12.7 (7.2 / 14.9); and from 16 channels on maps of 16 pixels a side or
/// more (16×16×16 0.72 / 1.53 against 0.80 / 1.68; conv_lstm's 32×32×48→16
/// 5.9 / 13.3 against 8.9 / 19.4). Direct wins below: at 14×14×16 and
/// 7×7×16 the transforms weigh more against the products, and on maps
/// under 7 pixels a side most of a tile is padding (5×5×64 0.91 / 1.99
/// direct against 1.44 / 3.62).
fn winograd_pays(g: &Geom) -> bool {
    let side = g.h.min(g.w);
    if g.cin >= 32 && g.cout >= 32 {
        side >= 7
    } else {
        side >= 16
    }
}

/// General path: target size of one block of the im2col matrix. Measured
/// on the 2-core Zen4 (1 MiB L2 per core): single-threaded `gemm` runs these
/// products at ~110 GFLOP/s (94% of the 117 GFLOP/s FMA peak of one core)
/// from 128 rows up, so the block only has to be tall enough for that and
/// small enough to stay in L2 together with W and the packing buffers.
const BLOCK_BYTES: usize = 256 * 1024;
const MIN_BLOCK_ROWS: usize = 32;
const MAX_BLOCK_ROWS: usize = 1024;

/// Upper bound on the number of image groups in backward (and so on the
/// partial weight gradients kept). Fixed, not the thread count, so results do
/// not depend on the pool size. 8 keeps 2-4 threads busy (4 equal tasks per
/// thread on 2 cores) while the partials and their reduction stay small.
const GROUPS: usize = 8;

thread_local! {
    /// A task's copy of its images, or one block of the im2col matrix (or of
    /// its gradient), reused by every convolution that runs on this thread.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

pub struct Conv2d {
    name: String,
    pub(crate) cin: usize,
    pub(crate) cout: usize,
    pub(crate) k: usize,
    pub(crate) stride: usize,
    pub(crate) pad: usize,
    weight: Param,
    pub(crate) bias: Option<Param>,
    saved_input: Option<Tensor>,
    /// Per-group partial gradients for backward, reused across steps.
    partials: Vec<f32>,
}

/// Everything about one call's shapes, derived once from the input shape.
#[derive(Clone, Copy, Debug)]
struct Geom {
    n: usize,
    h: usize,
    w: usize,
    cin: usize,
    oh: usize,
    ow: usize,
    cout: usize,
    k: usize,
    stride: usize,
    pad: usize,
    /// Columns of im2col: k·k·cin.
    kk: usize,
}

impl Geom {
    /// Output pixels per image.
    fn opix(&self) -> usize {
        self.oh * self.ow
    }

    fn in_image(&self) -> usize {
        self.h * self.w * self.cin
    }

    /// The zero-padded input image: [h + 2·pad, w + 2·pad].
    fn padded(&self) -> (usize, usize) {
        (self.h + 2 * self.pad, self.w + 2 * self.pad)
    }

    fn is_pointwise(&self) -> bool {
        self.k == 1 && self.stride == 1 && self.pad == 0
    }

    /// Rows of A per block.
    fn block_rows(&self) -> usize {
        (BLOCK_BYTES / (4 * self.kk)).clamp(MIN_BLOCK_ROWS, MAX_BLOCK_ROWS)
    }
}

impl Conv2d {
    /// The saved input (taken: backward runs once per forward) and the
    /// geometry, with `grad_output`'s shape checked against it.
    fn take_saved(&mut self, grad_output: &Tensor) -> Result<(Geom, Tensor)> {
        let Some(input) = self.saved_input.as_ref() else {
            return Err(ModelError::NoSavedActivation { op: "Conv2d" });
        };
        let g = self.geom(input.shape())?;
        grad_output.expect_shape("Conv2d backward", &[g.n, g.oh, g.ow, g.cout])?;
        let Some(input) = self.saved_input.take() else {
            return Err(ModelError::NoSavedActivation { op: "Conv2d" });
        };
        Ok((g, input))
    }

    /// dW (and db) of `dy` for `input`, added to the gradients.
    fn add_param_grads(&mut self, g: &Geom, input: &Tensor, dy: &[f32]) -> Result<()> {
        if g.n == 0 {
            return Ok(());
        }
        let groups = Groups::new(g.n);
        let stride = g.kk * g.cout + g.cout;
        let wanted = groups.count * stride;
        if wanted > self.partials.len() {
            let mut grown = try_zeroed(wanted)?;
            grown[..self.partials.len()].copy_from_slice(&self.partials);
            self.partials = grown;
        }
        self.partials.truncate(wanted);
        grad_params(g, &groups, input.data(), dy, &mut self.partials)?;
        let partials = &self.partials;
        reduce_partials(self.weight.grad.data_mut(), partials, 0, stride);
        if let Some(b) = self.bias.as_mut() {
            reduce_partials(b.grad.data_mut(), partials, g.kk * g.cout, stride);
        }
        Ok(())
    }

    /// Keeps `input` as a training forward on it would, without computing
    /// the output: for a layer that runs one convolution at many steps
    /// (`conv_lstm`), keeps each step's input itself and hands it back
    /// before that step's backward. The shape is checked by `backward`.
    pub fn arm(&mut self, input: Tensor) {
        self.saved_input = Some(input);
    }

    #[allow(clippy::too_many_arguments)]
    pub fn new(
        name: &str,
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
        bias: bool,
        rng: &mut InitRng,
    ) -> Result<Self> {
        if in_channels == 0 || out_channels == 0 || kernel == 0 || stride == 0 {
            return Err(ModelError::Spec {
                path: name.to_string(),
                reason: format!(
                    "convolution needs positive channels, kernel and stride, got \
                     {in_channels}->{out_channels} kernel {kernel} stride {stride}"
                ),
            });
        }
        let fan_in = kernel
            .checked_mul(kernel)
            .and_then(|v| v.checked_mul(in_channels))
            .ok_or_else(|| ModelError::Spec {
                path: name.to_string(),
                reason: "kernel too large".into(),
            })?;
        let len = fan_in
            .checked_mul(out_channels)
            .ok_or_else(|| ModelError::Spec {
                path: name.to_string(),
                reason: "weight too large".into(),
            })?;
        let w = crate::init::he_truncated(rng, fan_in, len);
        let weight = Param::new(
            format!("{name}.weight"),
            Tensor::from_vec(&[kernel, kernel, in_channels, out_channels], w)?,
            true,
        );
        let bias = bias.then(|| {
            Param::new(
                format!("{name}.bias"),
                Tensor::zeros(&[out_channels]),
                false,
            )
        });
        Ok(Self {
            name: name.to_string(),
            cin: in_channels,
            cout: out_channels,
            k: kernel,
            stride,
            pad: padding,
            weight,
            bias,
            saved_input: None,
            partials: Vec::new(),
        })
    }

    fn geom(&self, input: &[usize]) -> Result<Geom> {
        let [n, rest @ ..] = input else {
            return Err(self.shape_error("[n, h, w, c]", input));
        };
        let out = self.output_shape(rest)?;
        Ok(Geom {
            n: *n,
            h: rest[0],
            w: rest[1],
            cin: self.cin,
            oh: out[0],
            ow: out[1],
            cout: self.cout,
            k: self.k,
            stride: self.stride,
            pad: self.pad,
            kk: self.k * self.k * self.cin,
        })
    }

    fn shape_error(&self, expected: &str, got: &[usize]) -> ModelError {
        ModelError::Shape {
            op: "Conv2d",
            expected: format!("{expected} for {} ({})", self.name, self.describe()),
            got: format!("{got:?}"),
        }
    }
}

/// How a windowed layer describes itself (in the model summary and the
/// description a checkpoint records): `conv3x3`, then `/stride` unless 1,
/// ` pad P` unless the "same" padding k/2, then its channels.
pub(crate) fn describe_window(
    op: &str,
    k: usize,
    stride: usize,
    pad: usize,
    channels: &str,
) -> String {
    let mut s = format!("{op}{k}x{k}");
    if stride != 1 {
        s += &format!("/{stride}");
    }
    if pad != k / 2 {
        s += &format!(" pad {pad}");
    }
    s += &format!(" {channels}");
    s
}

impl Layer for Conv2d {
    cuda_form!(crate::ops::conv::layer::ConvLayer::from_cpu);

    fn describe(&self) -> String {
        let channels = format!("{}->{}", self.cin, self.cout);
        describe_window("conv", self.k, self.stride, self.pad, &channels)
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        let &[h, w, c] = input else {
            return Err(self.shape_error("[h, w, c]", input));
        };
        if c != self.cin {
            return Err(self.shape_error(&format!("{} input channels", self.cin), input));
        }
        let out_dim = |size: usize| -> Option<usize> {
            let padded = size.checked_add(self.pad.checked_mul(2)?)?;
            let span = padded.checked_sub(self.k)?;
            Some(span / self.stride + 1)
        };
        match (out_dim(h), out_dim(w)) {
            (Some(oh), Some(ow)) if h > 0 && w > 0 => Ok(vec![oh, ow, self.cout]),
            _ => Err(self.shape_error(
                &format!(
                    "an input of at least {k}x{k} after padding {p} (non-empty output)",
                    k = self.k,
                    p = self.pad
                ),
                input,
            )),
        }
    }

    fn macs(&self, input: &[usize]) -> Result<u64> {
        let out = self.output_shape(input)?;
        Ok((out[0] * out[1] * self.cout) as u64 * (self.k * self.k * self.cin) as u64)
    }

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        let g = self.geom(input.shape())?;
        let bias = self.bias.as_ref().map(|b| b.value.data());
        let out = forward(&g, input.data(), self.weight.value.data(), bias)?;
        self.saved_input = match mode {
            Mode::Train => Some(input.clone()),
            Mode::Eval => None,
        };
        Ok(out)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let (g, input) = self.take_saved(grad_output)?;
        let dy = grad_output.data();
        let grad_in = grad_input(&g, dy, self.weight.value.data())?;
        self.add_param_grads(&g, &input, dy)?;
        Ok(grad_in)
    }

    fn backward_params_only(&mut self, grad_output: &Tensor) -> Result<()> {
        let (g, input) = self.take_saved(grad_output)?;
        self.add_param_grads(&g, &input, grad_output.data())
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut v = vec![&mut self.weight];
        if let Some(b) = self.bias.as_mut() {
            v.push(b);
        }
        v
    }

    fn clear_saved(&mut self) {
        self.saved_input = None;
    }
}

/// The fixed split of a batch into groups of whole images for backward.
struct Groups {
    count: usize,
    images: usize,
}

impl Groups {
    fn new(n: usize) -> Self {
        let images = n.div_ceil(GROUPS.min(n).max(1));
        Self {
            count: n.div_ceil(images),
            images,
        }
    }
}

/// grad[i] += Σ_g partials[g·stride + offset + i], summed in group order.
fn reduce_partials(grad: &mut [f32], partials: &[f32], offset: usize, stride: usize) {
    const CHUNK: usize = 2048;
    let count = partials.len() / stride;
    grad.par_chunks_mut(CHUNK).enumerate().for_each(|(c, dst)| {
        let at = |p: usize| &partials[p * stride + offset + c * CHUNK..][..dst.len()];
        // Whole rows at a time, so the adds vectorise (1.5-2x faster than
        // summing each element across the groups, measured).
        let mut sum = [0.0f32; CHUNK];
        let sum = &mut sum[..dst.len()];
        for p in 0..count {
            for (s, v) in sum.iter_mut().zip(at(p)) {
                *s += v;
            }
        }
        for (d, s) in dst.iter_mut().zip(sum.iter()) {
            *d += s;
        }
    });
}

// ---------------------------------------------------------------------------
// Dispatch: direct kernels where they apply, im2col + gemm elsewhere.

/// Images per task for the direct forward and input gradient: enough that
/// small images share tiles (the corner pixels of one 7x7 image do not fill
/// one), few enough that every thread gets several tasks.
fn images_per_task(n: usize, image_floats: usize) -> usize {
    let by_cache = direct::CHUNK_BYTES / (4 * image_floats).max(1);
    let by_balance = n.div_ceil(8 * rayon::current_num_threads());
    by_cache.min(by_balance).max(1)
}

/// y = conv(x, w) + bias, [n, oh, ow, cout].
fn forward(g: &Geom, x: &[f32], w: &[f32], bias: Option<&[f32]>) -> Result<Tensor> {
    let shape = [g.n, g.oh, g.ow, g.cout];
    if g.n * g.opix() * g.cout == 0 {
        return Tensor::try_zeros(&shape);
    }
    if let Some(tile) = winograd_tile(g) {
        return winograd::forward(tile, g, x, w, bias);
    }
    if direct::supports(g.cout) {
        let per_task = images_per_task(g.n, g.in_image());
        // SAFETY: `direct::forward` writes every element of its chunk.
        unsafe {
            par_build(&shape, per_task * g.opix() * g.cout, |t, out| {
                let imgs = out.len() / (g.opix() * g.cout);
                let x_t = &x[t * per_task * g.in_image()..][..imgs * g.in_image()];
                direct::forward(g, x_t, imgs, w, bias, out)
            })
        }
    } else if narrow::takes(g) {
        let per_task = images_per_task(g.n, g.in_image());
        let w_by_out = narrow::by_output(g, w)?;
        // SAFETY: `narrow::forward` writes every element of its chunk.
        unsafe {
            par_build(&shape, per_task * g.opix() * g.cout, |t, out| {
                let imgs = out.len() / (g.opix() * g.cout);
                let x_t = &x[t * per_task * g.in_image()..][..imgs * g.in_image()];
                narrow::forward(g, x_t, imgs, &w_by_out, bias, out)
            })
        }
    } else {
        let mut out = Tensor::try_zeros(&shape)?;
        forward_gemm(g, x, w, bias, out.try_data_mut()?)?;
        Ok(out)
    }
}

/// Wᵀ per tap, [k·k, cout, cin], for dX: the input channels of a (tap,
/// output channel) pair are contiguous.
fn transposed_per_tap(g: &Geom, w: &[f32]) -> Result<Vec<f32>> {
    let mut wt = try_zeroed(w.len())?;
    wt.par_chunks_mut(g.cin * g.cout)
        .zip(w.par_chunks(g.cin * g.cout))
        .for_each(|(dst, src)| {
            for (ci, row) in src.chunks_exact(g.cout).enumerate() {
                for (co, &v) in row.iter().enumerate() {
                    dst[co * g.cin + ci] = v;
                }
            }
        });
    Ok(wt)
}

/// dX, [n, h, w, cin].
fn grad_input(g: &Geom, dy: &[f32], w: &[f32]) -> Result<Tensor> {
    let shape = [g.n, g.h, g.w, g.cin];
    if g.n * g.in_image() == 0 {
        return Tensor::try_zeros(&shape);
    }
    if let Some(tile) = winograd_tile(g) {
        return winograd::grad_input(tile, g, dy, &transposed_per_tap(g, w)?);
    }
    // Both gather kernels read Wᵀ per tap and write whole images of dX.
    let gather: PerImageGradInput = if direct::supports(g.cin) {
        direct::grad_input
    } else if narrow::takes_grad_input(g) {
        narrow::grad_input
    } else {
        let mut dx = Tensor::try_zeros(&shape)?;
        grad_input_gemm(g, dy, w, dx.try_data_mut()?)?;
        return Ok(dx);
    };
    let out_image = g.opix() * g.cout;
    let per_task = images_per_task(g.n, out_image);
    let wt = transposed_per_tap(g, w)?;
    // SAFETY: both gather kernels write every element of their chunk.
    unsafe {
        par_build(&shape, per_task * g.in_image(), |t, dx| {
            let imgs = dx.len() / g.in_image();
            let dy_t = &dy[t * per_task * out_image..][..imgs * out_image];
            gather(g, dy_t, imgs, &wt, dx)
        })
    }
}

/// dX of `imgs` whole images from their dY and Wᵀ per tap.
type PerImageGradInput = fn(&Geom, &[f32], usize, &[f32], &mut [MaybeUninit<f32>]) -> Result<()>;

/// Per-group partial gradients: `partials` is groups × [kk·cout weight, cout bias].
fn grad_params(
    g: &Geom,
    groups: &Groups,
    x: &[f32],
    dy: &[f32],
    partials: &mut [f32],
) -> Result<()> {
    let stride = g.kk * g.cout + g.cout;
    let direct = direct::supports(g.cout);
    let narrow = narrow::takes(g);
    let winograd = winograd_tile(g);
    partials
        .par_chunks_mut(stride)
        .enumerate()
        .try_for_each(|(gi, part)| {
            let img0 = gi * groups.images;
            let imgs = groups.images.min(g.n - img0);
            let x_g = &x[img0 * g.in_image()..(img0 + imgs) * g.in_image()];
            let out_image = g.opix() * g.cout;
            let dy_g = &dy[img0 * out_image..(img0 + imgs) * out_image];
            let (dw, db) = part.split_at_mut(g.kk * g.cout);
            db.fill(0.0);
            for row in dy_g.chunks_exact(g.cout) {
                for (s, v) in db.iter_mut().zip(row) {
                    *s += v;
                }
            }
            if let Some(tile) = winograd {
                winograd::grad_weight(tile, g, x_g, dy_g, imgs, dw)
            } else if direct {
                dw.fill(0.0);
                if g.cin >= direct::MR {
                    direct::grad_weight(g, x_g, dy_g, imgs, dw)
                } else {
                    direct::grad_weight_padded(g, x_g, dy_g, imgs, dw)
                }
            } else if narrow {
                narrow::grad_weight(g, x_g, dy_g, imgs, dw)
            } else {
                grad_weight_gemm(g, x_g, dy_g, imgs, dw)
            }
        })
}

/// A pool tensor of `shape` whose elements `fill(i, chunk)` writes, chunk
/// i of `chunk` elements at a time in parallel (the last may be shorter).
/// From the pool, not a fresh `Vec`: a large output taken from the OS on
/// every call is faulted in page by page on every step (the 45 MB dX of
/// `conv_lstm`'s head cost several ms of page faults a step), and there is
/// no zeroing pass.
///
/// The first error of any `fill` is returned (the tensor, zeroed so that
/// no element is left unwritten, dropped).
///
/// # Safety
/// `fill` must write every element of the chunk it is given when it
/// returns Ok.
unsafe fn par_build(
    shape: &[usize],
    chunk: usize,
    fill: impl Fn(usize, &mut [MaybeUninit<f32>]) -> Result<()> + Sync,
) -> Result<Tensor> {
    let chunk = chunk.max(1);
    let mut filled = Ok(());
    // SAFETY: every chunk is handed to `fill`, which writes it when it
    // succeeds (our caller's contract); after a failure all is zeroed.
    let tensor = unsafe {
        Tensor::try_init_with(shape, |out| {
            filled = out
                .par_chunks_mut(chunk)
                .enumerate()
                .try_for_each(|(i, c)| fill(i, c));
            if filled.is_err() {
                out.fill(MaybeUninit::new(0.0));
            }
        })?
    };
    filled.map(|()| tensor)
}

/// Copies one [h, w, c] image into `dst` ([h+2p, w+2p, c]) inside a zero
/// border of width p.
fn pad_into(src: &[f32], h: usize, w: usize, c: usize, p: usize, dst: &mut [f32]) {
    let wp = w + 2 * p;
    for (y, row) in dst.chunks_exact_mut(wp * c).take(h + 2 * p).enumerate() {
        if y < p || y >= p + h {
            row.fill(0.0);
        } else {
            let y = y - p;
            row[..p * c].fill(0.0);
            row[p * c..(p + w) * c].copy_from_slice(&src[y * w * c..(y + 1) * w * c]);
            row[(p + w) * c..].fill(0.0);
        }
    }
}

/// The direct kernels' tile engine, for the other layers' small products
/// against a packed weight (`panel_product`): the same tiles, the same
/// bits at either vector width.
pub(crate) mod direct_tiles {
    pub(crate) use super::direct::{supports, tile_rows, tile_width, tiles, Init, Steps, WIDE};
}

/// Direct convolution kernels: no im2col matrix, no packing.
///
/// One tile is MR rows × NR columns of a product accumulated in registers
/// (12 ymm accumulators: the 6×16 shape of the classic AVX2 SGEMM kernel).
/// Each of the MR rows walks memory through its own pointer (from a pixel's
/// first valid tap, or one input channel of one tap across pixels), so a
/// tile can gather rows from anywhere — across output rows and images — and
/// the NR columns are a contiguous 16-float slice (of W, Wᵀ or dY). On the
/// 2-core Zen4, AVX2 FMA runs at the same 32 FLOP/cycle as AVX-512
/// (measured: 117 GFLOP/s per core either way), and its intrinsics are
/// stable at our MSRV (AVX-512's need Rust 1.89).
mod direct;

// ---------------------------------------------------------------------------
// The general path: im2col + gemm (any channel counts, any stride).

/// y = conv(x, w) + bias into `out` ([n·oh·ow × cout]).
fn forward_gemm(
    g: &Geom,
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Result<()> {
    let r = g.block_rows();
    out.par_chunks_mut(r * g.cout)
        .enumerate()
        .try_for_each(|(b, dst)| {
            let r0 = b * r;
            let rows = dst.len() / g.cout;
            if let Some(bias) = bias {
                for row in dst.chunks_exact_mut(g.cout) {
                    row.copy_from_slice(bias);
                }
            }
            let acc = bias.is_some();
            if g.is_pointwise() {
                let a = &x[r0 * g.kk..(r0 + rows) * g.kk];
                matmul(
                    dst,
                    rows,
                    g.cout,
                    g.kk,
                    View::rm(a, g.kk),
                    View::rm(w, g.cout),
                    acc,
                );
                return Ok(());
            }
            with_scratch(rows * g.kk, |a| {
                im2col(g, x, r0, rows, a);
                matmul(
                    dst,
                    rows,
                    g.cout,
                    g.kk,
                    View::rm(a, g.kk),
                    View::rm(w, g.cout),
                    acc,
                );
            })
        })
}

/// dX (zeroed on entry) += col2im(dY·Wᵀ), in groups of whole images so that
/// the scatter-adds of different tasks never meet.
fn grad_input_gemm(g: &Geom, dy: &[f32], w: &[f32], dx: &mut [f32]) -> Result<()> {
    let groups = Groups::new(g.n);
    let r = g.block_rows();
    let wt = View::cm(w, g.cout); // Wᵀ: [cout × kk]
    dx.par_chunks_mut(groups.images * g.in_image())
        .enumerate()
        .try_for_each(|(gi, dx_g)| {
            let img0 = gi * groups.images;
            let rows_g = dx_g.len() / g.in_image() * g.opix();
            let dy_g = &dy[img0 * g.opix() * g.cout..][..rows_g * g.cout];
            let mut r0 = 0;
            while r0 < rows_g {
                let rows = r.min(rows_g - r0);
                let dy_b = View::rm(&dy_g[r0 * g.cout..(r0 + rows) * g.cout], g.cout);
                if g.is_pointwise() {
                    let dx_b = &mut dx_g[r0 * g.kk..(r0 + rows) * g.kk];
                    matmul(dx_b, rows, g.kk, g.cout, dy_b, wt, false);
                } else {
                    with_scratch(rows * g.kk, |buf| {
                        matmul(buf, rows, g.kk, g.cout, dy_b, wt, false);
                        col2im(g, buf, r0, rows, dx_g);
                    })?;
                }
                r0 += rows;
            }
            Ok(())
        })
}

/// dw = Σ over the group's rows of im2col(x)ᵀ·dY (overwrites `dw`).
fn grad_weight_gemm(
    g: &Geom,
    x_g: &[f32],
    dy_g: &[f32],
    imgs: usize,
    dw: &mut [f32],
) -> Result<()> {
    let r = g.block_rows();
    let rows_g = imgs * g.opix();
    let mut r0 = 0;
    while r0 < rows_g {
        let rows = r.min(rows_g - r0);
        let dy_b = View::rm(&dy_g[r0 * g.cout..(r0 + rows) * g.cout], g.cout);
        let first = r0 == 0;
        if g.is_pointwise() {
            let a = View::cm(&x_g[r0 * g.kk..(r0 + rows) * g.kk], g.kk);
            matmul(dw, g.kk, g.cout, rows, a, dy_b, !first);
        } else {
            with_scratch(rows * g.kk, |buf| {
                im2col(g, x_g, r0, rows, buf);
                matmul(dw, g.kk, g.cout, rows, View::cm(buf, g.kk), dy_b, !first);
            })?;
        }
        r0 += rows;
    }
    Ok(())
}

/// Runs `f` on this thread's scratch buffer, grown to at least `len`;
/// `ModelError::OutOfMemory` if the OS refuses the growth (see
/// `memory::try_scratch`), the buffer then left as it was.
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> Result<R> {
    SCRATCH.with(|cell| {
        let mut buf = cell.borrow_mut();
        if buf.len() < len {
            let mut grown = try_scratch(len)?;
            grown.resize(len, 0.0);
            *buf = grown;
        }
        Ok(f(&mut buf[..len]))
    })
}

/// Writes rows [r0, r0+rows) of the im2col matrix of `x` (whose image 0 is
/// the image of row 0) into `a` ([rows × kk]). Padding reads as zero.
fn im2col(g: &Geom, x: &[f32], r0: usize, rows: usize, a: &mut [f32]) {
    let mut cursor = PixelCursor::new(g, r0);
    let kc = g.k * g.cin;
    for row in a.chunks_exact_mut(g.kk).take(rows) {
        let img = &x[cursor.n * g.in_image()..(cursor.n + 1) * g.in_image()];
        let taps = cursor.taps(g);
        for (ky, dst) in row.chunks_exact_mut(kc).enumerate() {
            match taps.src(g, ky) {
                None => dst.fill(0.0),
                Some(src) => {
                    let (lo, hi) = (taps.kx_lo * g.cin, taps.kx_hi * g.cin);
                    dst[..lo].fill(0.0);
                    copy(&mut dst[lo..hi], &img[src..src + hi - lo]);
                    dst[hi..].fill(0.0);
                }
            }
        }
        cursor.advance(g);
    }
}

/// The adjoint of `im2col`: adds rows [r0, r0+rows) of `a` into `dx`.
fn col2im(g: &Geom, a: &[f32], r0: usize, rows: usize, dx: &mut [f32]) {
    let mut cursor = PixelCursor::new(g, r0);
    let kc = g.k * g.cin;
    let in_image = g.in_image();
    for row in a.chunks_exact(g.kk).take(rows) {
        let img = &mut dx[cursor.n * in_image..(cursor.n + 1) * in_image];
        let taps = cursor.taps(g);
        for (ky, src) in row.chunks_exact(kc).enumerate() {
            if let Some(at) = taps.src(g, ky) {
                let (lo, hi) = (taps.kx_lo * g.cin, taps.kx_hi * g.cin);
                add(&mut img[at..at + hi - lo], &src[lo..hi]);
            }
        }
        cursor.advance(g);
    }
}

#[inline]
fn copy(dst: &mut [f32], src: &[f32]) {
    // A plain loop: for the first layer (cin = 1) the runs are 3 floats, where
    // a memcpy call costs more than the copy.
    for (d, s) in dst.iter_mut().zip(src) {
        *d = *s;
    }
}

#[inline]
fn add(dst: &mut [f32], src: &[f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d += *s;
    }
}

/// Walks output pixels (n, oy, ox) in row order.
struct PixelCursor {
    n: usize,
    oy: usize,
    ox: usize,
}

/// Where one output pixel's receptive field lies in its input image.
struct Taps {
    /// Top-left input coordinates (may be negative: padding).
    iy0: isize,
    ix0: isize,
    /// Valid kx range: the taps that land inside the image horizontally.
    kx_lo: usize,
    kx_hi: usize,
}

impl Taps {
    /// Offset in the image of the first valid tap of kernel row `ky`, or
    /// None when that row (or every tap of it) falls in the padding.
    #[inline]
    fn src(&self, g: &Geom, ky: usize) -> Option<usize> {
        let iy = self.iy0 + ky as isize;
        if iy < 0 || iy >= g.h as isize || self.kx_lo >= self.kx_hi {
            return None;
        }
        let ix = (self.ix0 + self.kx_lo as isize) as usize;
        Some((iy as usize * g.w + ix) * g.cin)
    }
}

impl PixelCursor {
    fn new(g: &Geom, r0: usize) -> Self {
        let p = g.opix();
        Self {
            n: r0 / p,
            oy: (r0 % p) / g.ow,
            ox: r0 % g.ow,
        }
    }

    #[inline]
    fn taps(&self, g: &Geom) -> Taps {
        let iy0 = (self.oy * g.stride) as isize - g.pad as isize;
        let ix0 = (self.ox * g.stride) as isize - g.pad as isize;
        let k = g.k as isize;
        let kx_lo = (-ix0).clamp(0, k) as usize;
        let kx_hi = (g.w as isize - ix0).clamp(0, k) as usize;
        Taps {
            iy0,
            ix0,
            kx_lo,
            kx_hi: kx_hi.max(kx_lo),
        }
    }

    #[inline]
    fn advance(&mut self, g: &Geom) {
        self.ox += 1;
        if self.ox == g.ow {
            self.ox = 0;
            self.oy += 1;
            if self.oy == g.oh {
                self.oy = 0;
                self.n += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests;
