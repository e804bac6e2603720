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

use super::matmul::{matmul, View};
pub use super::vector_math::{cpu_kernels, set_cpu_kernels, CpuKernels};
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
    cin: usize,
    cout: usize,
    k: usize,
    stride: usize,
    pad: usize,
    weight: Param,
    bias: Option<Param>,
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

impl Layer for Conv2d {
    fn describe(&self) -> String {
        let mut s = format!("conv{}x{}", self.k, self.k);
        if self.stride != 1 {
            s += &format!("/{}", self.stride);
        }
        if self.pad != self.k / 2 {
            s += &format!(" pad {}", self.pad);
        }
        s += &format!(" {}->{}", self.cin, self.cout);
        s
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
pub(super) mod direct_tiles {
    pub(in crate::layers) use super::direct::{
        supports, tile_rows, tile_width, tiles, Init, Steps, WIDE,
    };
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
mod direct {
    use super::{pad_into, with_scratch, Geom};
    use crate::Result;
    use std::mem::MaybeUninit;

    pub const MR: usize = 6;
    pub const NR: usize = 16;
    /// The AVX-512 tile's columns, and its rows at most: 2·MR_WIDE of the
    /// 32 zmm registers accumulate.
    pub const WIDE: usize = 32;
    pub const MR_WIDE: usize = 12;

    /// Steps per pass over the rows (see `tiles`).
    const PASS_STEPS: usize = 768;

    /// A task's images (copied to the thread's scratch), at most about this
    /// many bytes unless one image is larger (L2 is 1 MiB per Zen4 core; W,
    /// dY and the output share it). 128-768 KiB measured: 256 is as good as
    /// any.
    pub const CHUNK_BYTES: usize = 256 * 1024;

    /// How a tile's accumulators start.
    #[derive(Clone, Copy)]
    pub enum Init {
        Zero,
        /// From the destination (+=).
        Accumulate,
        /// From 16 floats (the bias).
        Bias(*const f32),
    }

    /// The reduction walk of one tile: for each segment (a_off, b_off), `len`
    /// steps; step i of a segment reads row r's scalar at
    /// a[r] + a_off + i·a_step and the 16 columns at b + b_off + i·b_step.
    #[derive(Clone, Copy)]
    pub struct Steps<'a> {
        pub segs: &'a [(isize, isize)],
        pub len: usize,
        pub a_step: isize,
        pub b_step: isize,
    }

    /// Whether the direct kernels handle `columns` output columns here.
    pub fn supports(columns: usize) -> bool {
        #[cfg(test)]
        if super::tests::FORCE_GEMM.get() {
            return false;
        }
        columns % NR == 0 && simd::available()
    }

    /// The columns one tile writes for a product with `columns` columns
    /// (which `supports`): WIDE where the CPU has AVX-512 (two zmm
    /// registers per row; `super::cpu_kernels` can forbid it) and the
    /// columns come in 32s, else NR. Both kernels do the same fused
    /// multiply-adds in the same order per output, so they agree bit for bit.
    pub fn tile_width(columns: usize) -> usize {
        let wide = columns % WIDE == 0
            && super::cpu_kernels() == super::CpuKernels::Auto
            && simd::wide_available();
        if wide {
            WIDE
        } else {
            NR
        }
    }

    /// The rows of one tile `width` columns wide.
    pub fn tile_rows(width: usize) -> usize {
        match width == WIDE {
            true => MR_WIDE,
            false => MR,
        }
    }

    /// Runs tiles over `rows`: row r walks `a` from rows[r].0 and writes 16
    /// floats at dst + rows[r].1 (`dst_len` floats are valid from dst).
    ///
    /// # Safety
    /// `supports` returned true; for every row and segment the walk stays
    /// inside `a` and `b` (checked in debug builds), and the 16 floats at
    /// dst + rows[r].1 are inside dst_len, writable, distinct between rows,
    /// and overlap nothing that is read.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::layers) unsafe fn tiles(
        rows: &[(usize, usize)],
        a: &[f32],
        b: &[f32],
        st: &Steps,
        width: usize,
        dst: *mut f32,
        dst_len: usize,
        init: Init,
    ) {
        if cfg!(debug_assertions) {
            check_walk(rows, a.len(), b.len(), st, width, dst_len);
        }
        let (a, b) = (a.as_ptr(), b.as_ptr());
        // Segments run in passes of at most PASS_STEPS steps over all rows,
        // so that the part of b a pass reads (PASS_STEPS × 64 bytes) stays
        // close while every tile reuses it; later passes accumulate. The sums
        // keep their order (acc is stored and reloaded exactly), so passes
        // do not change results. Measured: a few % on the 7x7x128 layers
        // (W is 576 KB) over a single pass; 384-1536 steps do about as well.
        let per_pass = (PASS_STEPS / st.len.max(1)).max(1);
        let mut passes = st.segs.chunks(per_pass).peekable();
        let mut init = init;
        loop {
            let pass = Steps {
                segs: passes.next().unwrap_or(&[]),
                ..*st
            };
            let mut at = 0;
            let mr = tile_rows(width);
            // A block of at most one tile's rows (attention's heads call
            // per block) is that one tile, without a Vec.
            let (one, split);
            let tiles: &[usize] = match (1..=mr).contains(&rows.len()) {
                true => {
                    one = [rows.len()];
                    &one
                }
                false => {
                    split = split_rows(rows.len(), mr);
                    &split
                }
            };
            for &n in tiles {
                let t = &rows[at..at + n];
                at += n;
                // SAFETY: forwarded from the caller.
                unsafe {
                    let ap = |r: usize| a.add(t[r].0);
                    let dp = |r: usize| dst.add(t[r].1);
                    macro_rules! tile {
                        ($m:literal) => {
                            if width == WIDE {
                                simd::tile_wide::<$m>(
                                    std::array::from_fn(ap),
                                    b,
                                    &pass,
                                    std::array::from_fn(dp),
                                    init,
                                )
                            } else {
                                simd::tile::<$m>(
                                    std::array::from_fn(ap),
                                    b,
                                    &pass,
                                    std::array::from_fn(dp),
                                    init,
                                )
                            }
                        };
                    }
                    match t.len() {
                        12 => tile!(12),
                        11 => tile!(11),
                        10 => tile!(10),
                        9 => tile!(9),
                        8 => tile!(8),
                        7 => tile!(7),
                        6 => tile!(6),
                        5 => tile!(5),
                        4 => tile!(4),
                        3 => tile!(3),
                        2 => tile!(2),
                        _ => tile!(1),
                    }
                }
            }
            init = Init::Accumulate;
            if passes.peek().is_none() {
                break;
            }
        }
    }

    /// Debug builds (the tests) check every walk against its slices, so that
    /// a geometry bug fails loudly instead of reading out of bounds.
    fn check_walk(
        rows: &[(usize, usize)],
        a_len: usize,
        b_len: usize,
        st: &Steps,
        width: usize,
        dst_len: usize,
    ) {
        let span = |off: isize, step: isize| {
            let last = off + (st.len as isize - 1) * step;
            (off.min(last), off.max(last))
        };
        for &(a_off, b_off) in st.segs.iter().filter(|_| st.len > 0) {
            let (lo, hi) = span(b_off, st.b_step);
            assert!(
                lo >= 0 && hi + width as isize <= b_len as isize,
                "b walk out of bounds"
            );
            let (lo, hi) = span(a_off, st.a_step);
            for &(row, _) in rows {
                let row = row as isize;
                assert!(
                    row + lo >= 0 && row + hi < a_len as isize,
                    "a walk out of bounds"
                );
            }
        }
        assert!(
            rows.iter().all(|&(_, d)| d + width <= dst_len),
            "dst out of bounds"
        );
    }

    /// Pixels that see the same taps, with their tiles' walk.
    struct Class {
        /// (offset into the source, offset into the output) per pixel.
        rows: Vec<(usize, usize)>,
        segs: Vec<(isize, isize)>,
        len: usize,
    }

    /// Groups positions 0..n by `key`: the distinct keys in first-seen
    /// order, and each position's index among them.
    fn classify<K: PartialEq + Copy>(n: usize, key: impl Fn(usize) -> K) -> (Vec<K>, Vec<usize>) {
        let mut keys = Vec::new();
        let idx = (0..n)
            .map(|i| {
                let k = key(i);
                keys.iter().position(|&x| x == k).unwrap_or_else(|| {
                    keys.push(k);
                    keys.len() - 1
                })
            })
            .collect();
        (keys, idx)
    }

    /// The taps t of one axis with 0 <= o·s - p + t < size, as a range.
    fn valid_taps(o: usize, g: &Geom, size: usize) -> (usize, usize) {
        let start = (o * g.stride) as isize - g.pad as isize;
        let k = g.k as isize;
        let lo = (-start).clamp(0, k);
        let hi = (size as isize - start).clamp(lo, k);
        (lo as usize, hi as usize)
    }

    /// The forward of `imgs` images: writes all of `out` ([imgs·oh·ow × cout]).
    ///
    /// Rows are output pixels, columns output channels; the walk is the
    /// pixel's valid taps × input channels, along W's rows. Taps that fall in
    /// the padding are skipped, not multiplied by zeros: pixels are grouped by
    /// which taps are valid (interior, each edge, each corner) and a tile
    /// takes 6 pixels of one group, from anywhere in the task's images. That
    /// is 5% of the work at 28x28, 9% at 14x14, 18% at 7x7 (what oneDNN
    /// skips too), and no padded copy of the input is needed.
    pub fn forward(
        g: &Geom,
        x: &[f32],
        imgs: usize,
        w: &[f32],
        bias: Option<&[f32]>,
        out: &mut [MaybeUninit<f32>],
    ) -> Result<()> {
        let opix = g.opix();
        assert!(out.len() == imgs * opix * g.cout && x.len() == imgs * g.in_image());
        assert!(w.len() == g.kk * g.cout && g.cout % NR == 0);
        assert!(bias.is_none_or(|b| b.len() == g.cout));
        let (ykeys, ycls) = classify(g.oh, |oy| valid_taps(oy, g, g.h));
        let (xkeys, xcls) = classify(g.ow, |ox| valid_taps(ox, g, g.w));
        let mut classes: Vec<Class> = Vec::with_capacity(ykeys.len() * xkeys.len());
        for &(ky0, ky1) in &ykeys {
            for &(kx0, kx1) in &xkeys {
                let segs = if kx0 < kx1 {
                    (ky0..ky1)
                        .map(|ky| {
                            let a = (ky - ky0) * g.w * g.cin;
                            let b = (ky * g.k + kx0) * g.cin * g.cout;
                            (a as isize, b as isize)
                        })
                        .collect()
                } else {
                    Vec::new()
                };
                classes.push(Class {
                    rows: Vec::new(),
                    segs,
                    // The valid taps of a kernel row are consecutive pixels
                    // and consecutive rows of W: one segment of (kx1-kx0)·cin
                    // steps per kernel row.
                    len: (kx1 - kx0) * g.cin,
                });
            }
        }
        // A pixel's row starts at its first valid tap: (oy·s - p + ky0,
        // ox·s - p + kx0), inside the image; the segments walk the valid
        // taps only.
        for i in 0..imgs {
            for oy in 0..g.oh {
                let (ky0, ky1) = ykeys[ycls[oy]];
                for ox in 0..g.ow {
                    let (kx0, kx1) = xkeys[xcls[ox]];
                    let class = &mut classes[ycls[oy] * xkeys.len() + xcls[ox]];
                    let a = if ky0 < ky1 && kx0 < kx1 {
                        let iy = oy * g.stride + ky0 - g.pad;
                        let ix = ox * g.stride + kx0 - g.pad;
                        i * g.in_image() + (iy * g.w + ix) * g.cin
                    } else {
                        0
                    };
                    class.rows.push((a, ((i * g.oh + oy) * g.ow + ox) * g.cout));
                }
            }
        }
        let out_len = out.len();
        let out = out.as_mut_ptr().cast::<f32>();
        // Read from a copy: the tiles' scattered reads of the tensor itself
        // ran 10-20% slower (stride-2 layers); the copy streams into L2.
        with_scratch(x.len(), |xs| {
            xs.copy_from_slice(x);
            let x = &*xs;
            let width = tile_width(g.cout);
            for co0 in (0..g.cout).step_by(width) {
                let init = match bias {
                    // SAFETY: co0 + 16 <= cout = bias.len().
                    Some(b) => Init::Bias(unsafe { b.as_ptr().add(co0) }),
                    None => Init::Zero,
                };
                for class in &classes {
                    let steps = Steps {
                        segs: &class.segs,
                        len: class.len,
                        a_step: 1,
                        b_step: g.cout as isize,
                    };
                    // SAFETY: reads as argued above; W rows are kk × cout with
                    // co0 + 16 <= cout; each pixel's 16 outputs are its own.
                    unsafe {
                        tiles(
                            &class.rows,
                            x,
                            &w[co0..],
                            &steps,
                            width,
                            out.add(co0),
                            out_len - co0,
                            init,
                        );
                    }
                }
            }
        })
    }

    /// dX of `imgs` images: writes all of `dx` ([imgs·h·w × cin]).
    ///
    /// dX[iy, ix, ci] = Σ dY[oy, ox, co]·W[ky, kx, ci, co] over
    /// oy·s + ky - p = iy, ox·s + kx - p = ix, with (oy, ox) inside dY.
    /// Rows are input pixels, columns input channels; the walk is the taps
    /// that reach the pixel × output channels, along Wᵀ's rows (`wt`:
    /// [k·k, cout, cin]). Which taps reach a pixel depends on (iy + p) mod s
    /// and on the edges, so pixels are grouped by that, as in `forward`.
    pub fn grad_input(
        g: &Geom,
        dy: &[f32],
        imgs: usize,
        wt: &[f32],
        dx: &mut [MaybeUninit<f32>],
    ) -> Result<()> {
        let s = g.stride;
        assert!(dx.len() == imgs * g.in_image() && dy.len() == imgs * g.opix() * g.cout);
        assert!(wt.len() == g.kk * g.cout && g.cin % NR == 0);
        // Along one axis, input position i is reached by the taps
        // r + s·t (r = (i + p) mod s), which read dY at o_ref - t with
        // o_ref = (i + p - r)/s, for the t with 0 <= o_ref - t < out.
        let axis = |i: usize, out: usize| {
            let r = (i + g.pad) % s;
            let o_ref = (i + g.pad - r) / s;
            let taps = g.k.saturating_sub(r).div_ceil(s);
            let t0 = o_ref.saturating_sub(out - 1);
            let t1 = taps.min(o_ref + 1).max(t0);
            (r, t0, t1)
        };
        let (ykeys, ycls) = classify(g.h, |iy| axis(iy, g.oh));
        let (xkeys, xcls) = classify(g.w, |ix| axis(ix, g.ow));
        let mut classes: Vec<Class> = Vec::with_capacity(ykeys.len() * xkeys.len());
        for &(ry, ty0, ty1) in &ykeys {
            for &(rx, tx0, tx1) in &xkeys {
                let mut segs = Vec::new();
                for ty in ty0..ty1 {
                    for tx in tx0..tx1 {
                        // Relative to the pixel's first tap (ty0, tx0).
                        let a = -((((ty - ty0) * g.ow + tx - tx0) * g.cout) as isize);
                        let b = (((ry + s * ty) * g.k + rx + s * tx) * g.cout * g.cin) as isize;
                        segs.push((a, b));
                    }
                }
                classes.push(Class {
                    rows: Vec::new(),
                    segs,
                    len: g.cout,
                });
            }
        }
        // A pixel's row starts at dY[o_ref_y - ty0, o_ref_x - tx0] (inside
        // dY: see `axis`); its segments go back ty rows and tx columns from
        // there, to at most (o_ref - t1 + 1) >= 0.
        for i in 0..imgs {
            for iy in 0..g.h {
                let (ry, ty0, ty1) = ykeys[ycls[iy]];
                for ix in 0..g.w {
                    let (rx, tx0, tx1) = xkeys[xcls[ix]];
                    let class = &mut classes[ycls[iy] * xkeys.len() + xcls[ix]];
                    let a = if ty0 < ty1 && tx0 < tx1 {
                        let oy = (iy + g.pad - ry) / s - ty0;
                        let ox = (ix + g.pad - rx) / s - tx0;
                        ((i * g.oh + oy) * g.ow + ox) * g.cout
                    } else {
                        0
                    };
                    class.rows.push((a, ((i * g.h + iy) * g.w + ix) * g.cin));
                }
            }
        }
        let dx_len = dx.len();
        let dx = dx.as_mut_ptr().cast::<f32>();
        // Reads from a copy, as in `forward`.
        with_scratch(dy.len(), |dys| {
            dys.copy_from_slice(dy);
            let dy = &*dys;
            let width = tile_width(g.cin);
            for ci0 in (0..g.cin).step_by(width) {
                for class in &classes {
                    let steps = Steps {
                        segs: &class.segs,
                        len: class.len,
                        a_step: 1,
                        b_step: g.cin as isize,
                    };
                    // SAFETY: reads as argued above; Wᵀ rows are k·k·cout × cin
                    // with ci0 + 16 <= cin; each input pixel's 16 outputs are its
                    // own. A class no tap reaches gets zeros.
                    unsafe {
                        tiles(
                            &class.rows,
                            dy,
                            &wt[ci0..],
                            &steps,
                            width,
                            dx.add(ci0),
                            dx_len - ci0,
                            Init::Zero,
                        );
                    }
                }
            }
        })
    }

    /// Splits `n` rows into tiles of at most MR, none smaller than needed:
    /// a tile of 1-2 rows keeps too few accumulators in flight to hide the
    /// FMA latency, so 32 = 6+6+5+5+5+5, not 6·5+2.
    pub(super) fn split_rows(n: usize, mr: usize) -> Vec<usize> {
        // As many tiles of mr as leave a multiple of mr - 1 (10 accumulators
        // of 6 rows still cover the FMA latency); two halves of mr + r for
        // the few counts where that fails.
        let shorter = (mr - n % mr) % mr;
        if (mr - 1) * shorter <= n {
            let mut v = vec![mr; (n - (mr - 1) * shorter) / mr];
            v.extend(std::iter::repeat_n(mr - 1, shorter));
            v
        } else {
            let mut v = vec![mr; n / mr];
            let r = n % mr;
            if (1..=mr / 2).contains(&r) && v.pop().is_some() {
                v.push((mr + r).div_ceil(2));
                v.push((mr + r) / 2);
            } else if r > 0 {
                v.push(r);
            }
            v
        }
    }

    /// Adds the weight gradient of `imgs` images into `dw` ([kk × cout]),
    /// for cin >= MR.
    ///
    /// Rows are the input channels of one tap, columns output channels; the
    /// walk is over the output pixels that tap reaches inside the image (a
    /// rectangle: taps in the padding are skipped, as in `forward`), one
    /// segment per output row, along dY's rows and the input read in place.
    pub fn grad_weight(
        g: &Geom,
        x_g: &[f32],
        dy_g: &[f32],
        imgs: usize,
        dw: &mut [f32],
    ) -> Result<()> {
        let out_image = g.opix() * g.cout;
        assert!(x_g.len() == imgs * g.in_image() && dy_g.len() == imgs * out_image);
        assert!(dw.len() == g.kk * g.cout && g.cout % NR == 0 && g.cin >= MR);
        let chunk = (CHUNK_BYTES / (4 * g.in_image())).clamp(1, imgs.max(1));
        let mut segs = Vec::new();
        let mut rows = Vec::with_capacity(g.cin);
        let mut c0 = 0;
        while c0 < imgs {
            let cc = chunk.min(imgs - c0);
            let x_c = &x_g[c0 * g.in_image()..(c0 + cc) * g.in_image()];
            let dy_c = &dy_g[c0 * out_image..(c0 + cc) * out_image];
            with_scratch(x_c.len(), |xs| {
                // Read from a copy: the tiles' scattered reads of the tensor
                // itself ran 10-20% slower (stride-2 layers), the copy streams.
                xs.copy_from_slice(x_c);
                let x_c = &*xs;
                for ky in 0..g.k {
                    // Output rows whose tap row ky is inside the image.
                    let (oy0, oy1) = reach(ky, g.oh, g.h, g);
                    for kx in 0..g.k {
                        let (ox0, ox1) = reach(kx, g.ow, g.w, g);
                        if oy0 >= oy1 || ox0 >= ox1 {
                            continue;
                        }
                        // Segment (image i, output row oy) starts at input pixel
                        // (oy·s - p + ky, ox0·s - p + kx), inside the image, and
                        // steps ox1-ox0 pixels of stride s along the row, the
                        // last at ((ox1-1)·s - p + kx) < w.
                        segs.clear();
                        for i in 0..cc {
                            for oy in oy0..oy1 {
                                let (iy, ix) =
                                    (oy * g.stride + ky - g.pad, ox0 * g.stride + kx - g.pad);
                                let a = i * g.in_image() + (iy * g.w + ix) * g.cin;
                                let b = ((i * g.oh + oy) * g.ow + ox0) * g.cout;
                                segs.push((a as isize, b as isize));
                            }
                        }
                        let steps = Steps {
                            segs: &segs,
                            len: ox1 - ox0,
                            a_step: (g.stride * g.cin) as isize,
                            b_step: g.cout as isize,
                        };
                        let tap = ky * g.k + kx;
                        rows.clear();
                        rows.extend((0..g.cin).map(|ci| (ci, (tap * g.cin + ci) * g.cout)));
                        let width = tile_width(g.cout);
                        for co0 in (0..g.cout).step_by(width) {
                            // SAFETY: row ci reads x_c at a segment's pixel +
                            // ci < cin; dY columns co0..co0+16 of the segment's
                            // pixels; dW is read and written only through dst
                            // (Accumulate), one row per tile row.
                            unsafe {
                                tiles(
                                    &rows,
                                    x_c,
                                    &dy_c[co0..],
                                    &steps,
                                    width,
                                    dw.as_mut_ptr().add(co0),
                                    dw.len() - co0,
                                    Init::Accumulate,
                                );
                            }
                        }
                    }
                }
            })?;
            c0 += cc;
        }
        Ok(())
    }

    /// The output positions o in 0..out whose tap t lands inside 0..size:
    /// 0 <= o·s - p + t < size, as a range.
    fn reach(t: usize, out: usize, size: usize, g: &Geom) -> (usize, usize) {
        let lo = g.pad.saturating_sub(t).div_ceil(g.stride);
        // o·s < size + p - t
        let hi = (size + g.pad).saturating_sub(t).div_ceil(g.stride);
        (lo.min(out), hi.min(out).max(lo.min(out)))
    }

    /// The weight gradient for fewer than 6 input channels (the stem), on a
    /// zero-padded copy of the input, so that a tile's 6 rows can span taps
    /// (per-tap tiles of 1 channel would leave the FMAs latency-bound).
    /// Rows are dW rows ((tap, input channel) pairs, each a pointer into the
    /// padded images at that tap's offset), columns output channels; the walk
    /// is over every output pixel of a chunk of images (one segment per
    /// output row), along dY's rows.
    pub fn grad_weight_padded(
        g: &Geom,
        x_g: &[f32],
        dy_g: &[f32],
        imgs: usize,
        dw: &mut [f32],
    ) -> Result<()> {
        let (hp, wp) = g.padded();
        let pimg = hp * wp * g.cin;
        let out_image = g.opix() * g.cout;
        assert!(x_g.len() == imgs * g.in_image() && dy_g.len() == imgs * out_image);
        assert!(dw.len() == g.kk * g.cout && g.cout % NR == 0);
        let chunk = (CHUNK_BYTES / (4 * pimg)).clamp(1, imgs.max(1));
        // Row j = (ky, kx, ci) of dW reads the padded image at this offset
        // from each output pixel's corner.
        let rows: Vec<(usize, usize)> = (0..g.kk)
            .map(|j| {
                let (tap, ci) = (j / g.cin, j % g.cin);
                (((tap / g.k) * wp + tap % g.k) * g.cin + ci, j * g.cout)
            })
            .collect();
        let mut segs = Vec::with_capacity(chunk * g.oh);
        let mut c0 = 0;
        while c0 < imgs {
            let cc = chunk.min(imgs - c0);
            let x_c = &x_g[c0 * g.in_image()..(c0 + cc) * g.in_image()];
            let dy_c = &dy_g[c0 * out_image..(c0 + cc) * out_image];
            segs.clear();
            for i in 0..cc {
                for oy in 0..g.oh {
                    let a = (i * hp + oy * g.stride) * wp * g.cin;
                    let b = (i * g.oh + oy) * g.ow * g.cout;
                    segs.push((a as isize, b as isize));
                }
            }
            let steps = Steps {
                segs: &segs,
                len: g.ow,
                a_step: (g.stride * g.cin) as isize,
                b_step: g.cout as isize,
            };
            with_scratch(cc * pimg, |xpad| {
                for (src, dst) in x_c
                    .chunks_exact(g.in_image())
                    .zip(xpad.chunks_exact_mut(pimg))
                {
                    pad_into(src, g.h, g.w, g.cin, g.pad, dst);
                }
                // The last segment of image cc-1 starts at padded row
                // (oh-1)·s and steps to column (ow-1)·s; a row's offset adds
                // at most k-1 rows, k-1 columns and cin-1: inside cc padded
                // images. dY: cc·opix rows of cout, columns co0..co0+16.
                let width = tile_width(g.cout);
                for co0 in (0..g.cout).step_by(width) {
                    // SAFETY: as argued above; dW is read and written only
                    // through dst (Init::Accumulate), one row per tile row.
                    unsafe {
                        tiles(
                            &rows,
                            xpad,
                            &dy_c[co0..],
                            &steps,
                            width,
                            dw.as_mut_ptr().add(co0),
                            dw.len() - co0,
                            Init::Accumulate,
                        );
                    }
                }
            })?;
            c0 += cc;
        }
        Ok(())
    }

    #[cfg(target_arch = "x86_64")]
    mod simd {
        use super::{Init, Steps};
        use std::arch::x86_64::*;

        pub fn available() -> bool {
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
        }

        pub fn wide_available() -> bool {
            is_x86_feature_detected!("avx512f")
        }

        /// Defines `$name`, the tile kernel for one vector width: `dst[r]`
        /// (2·$lanes floats per row) = init + Σ_segments Σ_i
        /// a[r][a_off + i·a_step] · b[b_off + i·b_step ..][..2·$lanes].
        /// One macro for both widths, so that they do the same fused
        /// multiply-adds in the same order per output (bit-identical).
        macro_rules! tile_kernel {
            ($(#[$doc:meta])* $name:ident, $feature:literal, $lanes:literal,
             $setzero:ident, $loadu:ident, |$p:ident| $broadcast:expr, $fmadd:ident, $storeu:ident) => {
                $(#[$doc])*
                #[target_feature(enable = $feature)]
                pub unsafe fn $name<const M: usize>(
                    a: [*const f32; M],
                    b: *const f32,
                    st: &Steps,
                    dst: [*mut f32; M],
                    init: Init,
                ) {
                    // SAFETY: the caller's contract covers every pointer used here.
                    unsafe {
                        let mut acc = [[$setzero(); 2]; M];
                        match init {
                            Init::Zero => {}
                            Init::Accumulate => {
                                for r in 0..M {
                                    acc[r] = [$loadu(dst[r]), $loadu(dst[r].add($lanes))];
                                }
                            }
                            Init::Bias(p) => {
                                acc = [[$loadu(p), $loadu(p.add($lanes))]; M];
                            }
                        }
                        for &(a_off, b_off) in st.segs {
                            // Offsets, not per-segment pointers: the row pointers
                            // stay in registers, and a segment costs two moves
                            // (short segments: the 7-pixel rows of dW at 7x7).
                            // (A pointer for b and an index for a: as two indices
                            // LLVM packs them into one xmm register, and the
                            // extracts serialise the loop — 2x slower, measured.
                            // Unrolling by 2 by hand measured 3% slower.)
                            let mut ia = a_off;
                            let mut pb = b.offset(b_off);
                            for _ in 0..st.len {
                                let b0 = $loadu(pb);
                                let b1 = $loadu(pb.add($lanes));
                                for r in 0..M {
                                    let av = {
                                        let $p = a[r].offset(ia);
                                        $broadcast
                                    };
                                    acc[r][0] = $fmadd(av, b0, acc[r][0]);
                                    acc[r][1] = $fmadd(av, b1, acc[r][1]);
                                }
                                ia += st.a_step;
                                pb = pb.wrapping_offset(st.b_step);
                            }
                        }
                        for r in 0..M {
                            $storeu(dst[r], acc[r][0]);
                            $storeu(dst[r].add($lanes), acc[r][1]);
                        }
                    }
                }
            };
        }

        tile_kernel!(
            /// 16 columns in two ymm accumulators per row.
            ///
            /// # Safety
            /// AVX2 and FMA are available and every address is valid (see `super::tiles`).
            tile, "avx2,fma", 8,
            _mm256_setzero_ps, _mm256_loadu_ps, |p| _mm256_broadcast_ss(&*p), _mm256_fmadd_ps, _mm256_storeu_ps
        );

        tile_kernel!(
            /// 32 columns in two zmm accumulators per row.
            ///
            /// # Safety
            /// AVX-512F is available and every address is valid for 32
            /// columns (see `super::tiles`).
            tile_wide, "avx512f", 16,
            _mm512_setzero_ps, _mm512_loadu_ps, |p| _mm512_set1_ps(*p), _mm512_fmadd_ps, _mm512_storeu_ps
        );
    }

    /// Elsewhere the im2col + gemm path runs; this only keeps the build whole.
    #[cfg(not(target_arch = "x86_64"))]
    mod simd {
        use super::{Init, Steps};

        pub fn available() -> bool {
            false
        }

        pub fn wide_available() -> bool {
            false
        }

        /// Never chosen here (`wide_available`); two 16-column tiles.
        ///
        /// # Safety
        /// Every address is valid for 32 columns (see `super::tiles`).
        pub unsafe fn tile_wide<const M: usize>(
            a: [*const f32; M],
            b: *const f32,
            st: &Steps,
            dst: [*mut f32; M],
            init: Init,
        ) {
            let right = match init {
                // SAFETY: the bias has 32 floats here.
                Init::Bias(p) => Init::Bias(unsafe { p.add(16) }),
                other => other,
            };
            // SAFETY: forwarded from the caller; columns 16..32 are valid.
            unsafe {
                tile(a, b, st, dst, init);
                tile(a, b.add(16), st, dst.map(|d| d.add(16)), right);
            }
        }

        /// Portable reference of the x86 kernel.
        ///
        /// # Safety
        /// Every address is valid (see `super::tiles`).
        pub unsafe fn tile<const M: usize>(
            a: [*const f32; M],
            b: *const f32,
            st: &Steps,
            dst: [*mut f32; M],
            init: Init,
        ) {
            // SAFETY: the caller's contract covers every pointer used here.
            unsafe {
                let mut acc = [[0.0f32; 16]; M];
                match init {
                    Init::Zero => {}
                    Init::Accumulate => {
                        for r in 0..M {
                            for c in 0..16 {
                                acc[r][c] = *dst[r].add(c);
                            }
                        }
                    }
                    Init::Bias(p) => {
                        for row in acc.iter_mut() {
                            for (c, v) in row.iter_mut().enumerate() {
                                *v = *p.add(c);
                            }
                        }
                    }
                }
                for &(a_off, b_off) in st.segs {
                    for i in 0..st.len as isize {
                        let pb = b.offset(b_off + i * st.b_step);
                        for r in 0..M {
                            let av = *a[r].offset(a_off + i * st.a_step);
                            for c in 0..16 {
                                acc[r][c] += av * *pb.add(c);
                            }
                        }
                    }
                }
                for r in 0..M {
                    for c in 0..16 {
                        *dst[r].add(c) = acc[r][c];
                    }
                }
            }
        }
    }
}

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
mod tests {
    use super::*;
    use crate::gradcheck::check_layer;
    use std::cell::Cell;

    thread_local! {
        /// Makes this thread's convolutions take the im2col + gemm path
        /// (not the direct or the narrow kernels).
        pub(super) static FORCE_GEMM: Cell<bool> = const { Cell::new(false) };
        /// Overrides the process-wide algorithm on this thread only, so
        /// that tests running in parallel do not steer each other.
        pub(super) static FORCE_ALGORITHM: Cell<Option<ConvAlgorithm>> = const { Cell::new(None) };
    }

    /// Runs `f` once per implementation: Winograd (3×3 s1 p1 with channels
    /// in 16s), direct kernels (where this CPU has them; the narrow ones
    /// for fewer than 16 outputs) and im2col + gemm.
    fn both_paths(f: impl Fn(&str)) {
        for (algorithm, gemm, name) in [
            (ConvAlgorithm::Winograd, false, "winograd"),
            (ConvAlgorithm::Winograd4, false, "winograd4"),
            (ConvAlgorithm::Direct, false, "direct"),
            (ConvAlgorithm::Direct, true, "gemm"),
        ] {
            FORCE_ALGORITHM.set(Some(algorithm));
            FORCE_GEMM.set(gemm);
            f(name);
        }
        FORCE_GEMM.set(false);
        FORCE_ALGORITHM.set(None);
    }

    /// (n, h, w, cin, cout, k, stride, pad, bias)
    type Case = (usize, usize, usize, usize, usize, usize, usize, usize, bool);

    const CASES: &[Case] = &[
        (2, 6, 6, 3, 4, 3, 1, 1, false), // 3x3 s1 p1
        (2, 7, 7, 3, 5, 3, 2, 1, false), // 3x3 s2 p1
        (2, 5, 5, 4, 6, 1, 1, 0, false), // 1x1 s1 p0 (no im2col)
        (2, 6, 6, 3, 4, 3, 1, 1, true),  // with bias
        (3, 5, 7, 2, 3, 3, 1, 1, true),  // odd, non-square input
        (2, 8, 8, 1, 4, 3, 1, 1, false), // cin = 1 (the stem)
        (2, 6, 5, 3, 2, 3, 1, 0, false), // valid (no padding)
        (2, 7, 6, 2, 3, 1, 2, 0, true),  // 1x1 stride 2 (general path)
        (2, 8, 8, 2, 3, 2, 2, 0, false), // even kernel
        (1, 6, 7, 2, 3, 5, 2, 2, false), // 5x5 s2 p2, odd output
        // Channel counts that are multiples of 16 take the direct kernels.
        (2, 6, 6, 16, 16, 3, 1, 1, false), // 3x3 s1 p1
        (2, 7, 7, 16, 32, 3, 2, 1, false), // 3x3 s2 p1
        (2, 5, 5, 16, 32, 1, 1, 0, false), // 1x1 s1 p0
        (2, 6, 6, 3, 16, 3, 1, 1, true),   // bias, direct forward only
        (3, 5, 7, 16, 16, 3, 1, 1, true),  // odd sizes
        (2, 8, 8, 1, 16, 3, 1, 1, false),  // cin = 1 (the stem)
        (2, 6, 5, 16, 16, 3, 1, 0, false), // valid: dX pads by 2
        (2, 7, 6, 16, 16, 1, 2, 0, true),  // 1x1 stride 2
        (1, 6, 7, 16, 16, 5, 2, 2, false), // 5x5 s2 p2
        (1, 7, 7, 16, 16, 5, 1, 1, false), // 5x5 s1 p1
        (2, 6, 6, 7, 16, 3, 1, 1, false),  // dW tiles of 4 + 3 channels
        (2, 5, 5, 8, 16, 3, 2, 1, true),   // dW tiles of 4 + 4 channels
        (1, 5, 6, 16, 16, 3, 1, 3, false), // padding 3: pixels no tap reaches
        // Fewer than 16 outputs: dX through the narrow kernels (but in the
        // gemm run).
        (2, 9, 8, 17, 1, 3, 1, 1, true), // a frame head: 16 lanes + a tail
        (1, 7, 6, 33, 3, 3, 2, 1, false), // 3 outputs, stride 2
        (1, 5, 5, 40, 2, 5, 1, 2, false), // 5x5: 5 runs of up to 200 floats
        // Rows wide enough for whole 16 × 16 tiles of the planar input.
        (1, 3, 37, 17, 1, 3, 1, 1, true), // 16 + 16 + 5 columns, 16 + 1 channels
        (1, 4, 41, 33, 3, 3, 2, 1, false), // both phases, 16 + 5 columns each
        // dX of whole channel blocks only, 4 + 3 pixels a row; a forward
        // run of 96 floats, whole blocks only.
        (1, 4, 7, 32, 2, 3, 1, 1, true),
    ];

    fn random(rng: &mut InitRng, len: usize) -> Vec<f32> {
        (0..len).map(|_| rng.normal() as f32).collect()
    }

    fn layer(case: Case, seed: u64) -> Conv2d {
        let (_, _, _, cin, cout, k, s, p, bias) = case;
        let mut rng = InitRng::new(seed);
        let mut l = Conv2d::new("c", cin, cout, k, s, p, bias, &mut rng).unwrap();
        if let Some(b) = l.bias.as_mut() {
            let v = random(&mut rng, cout);
            b.value.data_mut().copy_from_slice(&v);
        }
        l
    }

    fn input(case: Case, seed: u64) -> Tensor {
        let (n, h, w, cin, ..) = case;
        let mut rng = InitRng::new(seed);
        Tensor::from_vec(&[n, h, w, cin], random(&mut rng, n * h * w * cin)).unwrap()
    }

    /// Direct convolution: the definition, index by index.
    fn naive_forward(case: Case, x: &[f32], wt: &[f32], bias: Option<&[f32]>) -> Vec<f32> {
        let (n, h, w, cin, cout, k, s, p, _) = case;
        let oh = (h + 2 * p - k) / s + 1;
        let ow = (w + 2 * p - k) / s + 1;
        let mut y = vec![0.0f32; n * oh * ow * cout];
        for b in 0..n {
            for oy in 0..oh {
                for ox in 0..ow {
                    for co in 0..cout {
                        let mut acc = bias.map_or(0.0, |bb| bb[co] as f64);
                        for ky in 0..k {
                            for kx in 0..k {
                                let iy = (oy * s + ky) as isize - p as isize;
                                let ix = (ox * s + kx) as isize - p as isize;
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                    continue;
                                }
                                let (iy, ix) = (iy as usize, ix as usize);
                                for ci in 0..cin {
                                    acc += x[((b * h + iy) * w + ix) * cin + ci] as f64
                                        * wt[((ky * k + kx) * cin + ci) * cout + co] as f64;
                                }
                            }
                        }
                        y[((b * oh + oy) * ow + ox) * cout + co] = acc as f32;
                    }
                }
            }
        }
        y
    }

    /// Direct backward: (dx, dw, db).
    fn naive_backward(
        case: Case,
        x: &[f32],
        wt: &[f32],
        dy: &[f32],
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (n, h, w, cin, cout, k, s, p, _) = case;
        let oh = (h + 2 * p - k) / s + 1;
        let ow = (w + 2 * p - k) / s + 1;
        let mut dx = vec![0.0f64; x.len()];
        let mut dw = vec![0.0f64; wt.len()];
        let mut db = vec![0.0f64; cout];
        for b in 0..n {
            for oy in 0..oh {
                for ox in 0..ow {
                    for co in 0..cout {
                        let g = dy[((b * oh + oy) * ow + ox) * cout + co] as f64;
                        db[co] += g;
                        for ky in 0..k {
                            for kx in 0..k {
                                let iy = (oy * s + ky) as isize - p as isize;
                                let ix = (ox * s + kx) as isize - p as isize;
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                    continue;
                                }
                                let (iy, ix) = (iy as usize, ix as usize);
                                for ci in 0..cin {
                                    let xi = ((b * h + iy) * w + ix) * cin + ci;
                                    let wi = ((ky * k + kx) * cin + ci) * cout + co;
                                    dx[xi] += g * wt[wi] as f64;
                                    dw[wi] += g * x[xi] as f64;
                                }
                            }
                        }
                    }
                }
            }
        }
        let f = |v: Vec<f64>| v.into_iter().map(|a| a as f32).collect();
        (f(dx), f(dw), f(db))
    }

    /// Element by element within 1e-4 (1 + |want|); F(4×4, 3×3)'s error
    /// grows with the terms summed rather than with each output (its
    /// transforms scale by up to 8 and 1/24), so its outputs may also be
    /// off by 1e-5 of the largest (it measures 1-6e-6 of it in
    /// `winograd_error_is_close_to_direct`).
    fn assert_close(what: &str, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        let largest = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let floor = if what.starts_with("winograd4") {
            1e-5 * largest
        } else {
            0.0
        };
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            let tol = 1e-4 * (1.0 + b.abs()) + floor;
            assert!((a - b).abs() <= tol, "{what}[{i}]: got {a}, want {b}");
        }
    }

    /// Checks forward and the full backward against the direct definitions.
    fn check_against_naive(case: Case, path: &str) {
        let mut l = layer(case, 1);
        let x = input(case, 2);
        let y = l.forward(&x, Mode::Train).unwrap();
        let wt = l.weight.value.data().to_vec();
        let bias = l.bias.as_ref().map(|b| b.value.data().to_vec());
        let want = naive_forward(case, x.data(), &wt, bias.as_deref());
        let (n, h, w, _, cout, k, s, p, _) = case;
        let oh = (h + 2 * p - k) / s + 1;
        let ow = (w + 2 * p - k) / s + 1;
        assert_eq!(y.shape(), &[n, oh, ow, cout]);
        assert_eq!(l.output_shape(&x.shape()[1..]).unwrap(), vec![oh, ow, cout]);
        assert_close(&format!("{path} {case:?} forward"), y.data(), &want);

        let mut rng = InitRng::new(3);
        let dy = Tensor::from_vec(y.shape(), random(&mut rng, y.len())).unwrap();
        let dx = l.backward(&dy).unwrap();
        let (want_dx, want_dw, want_db) = naive_backward(case, x.data(), &wt, dy.data());
        assert_eq!(dx.shape(), x.shape());
        assert_close(&format!("{path} {case:?} dx"), dx.data(), &want_dx);
        assert_close(
            &format!("{path} {case:?} dw"),
            l.weight.grad.data(),
            &want_dw,
        );
        if let Some(b) = l.bias.as_ref() {
            assert_close(&format!("{path} {case:?} db"), b.grad.data(), &want_db);
        }
    }

    #[test]
    fn conv_matches_direct_convolution() {
        both_paths(|path| {
            for &case in CASES {
                check_against_naive(case, path);
            }
        });
    }

    #[test]
    fn conv_matches_direct_convolution_across_blocks_and_groups() {
        both_paths(|path| {
            // More images than backward groups (so groups hold several
            // images), and more rows than one gemm block, with blocks
            // straddling images: kk = 9 gives 1024-row blocks over
            // 37·36 = 1332 rows ...
            check_against_naive((37, 6, 6, 1, 3, 3, 1, 1, true), path);
            // ... and kk = 576 gives 113-row blocks over 20·25 = 500 rows.
            check_against_naive((20, 5, 5, 64, 3, 3, 1, 1, false), path);
            check_against_naive((19, 7, 7, 64, 5, 3, 2, 1, false), path);
            // Pointwise, several blocks.
            check_against_naive((18, 9, 9, 8, 4, 1, 1, 0, true), path);
            // Direct kernels: several images per weight-gradient chunk
            // (small images) and one image per chunk (large ones).
            check_against_naive((37, 5, 5, 16, 32, 3, 1, 1, true), path);
            check_against_naive((17, 7, 7, 32, 16, 3, 2, 1, false), path);
            check_against_naive((3, 40, 36, 32, 16, 3, 1, 1, false), path);
            // Several passes over the rows (long reductions): 64 channels
            // in and out.
            check_against_naive((3, 6, 6, 64, 64, 3, 1, 1, true), path);
            check_against_naive((2, 7, 7, 64, 48, 3, 2, 1, false), path);
        });
    }

    #[test]
    fn conv_gradients_match_finite_differences() {
        both_paths(|path| {
            // The loss is linear in the input and in each weight, so central
            // differences are exact at any step but for rounding. F(4×4,
            // 3×3) rounds its forward ~10× coarser than the others (see
            // `winograd_error_is_close_to_direct`), which at a step of 1e-2
            // put 1.5% of noise into a difference quotient: it takes 0.25.
            let eps = if path == "winograd4" { 0.25 } else { 1e-2 };
            for &case in CASES {
                let mut l = layer(case, 5);
                let x = input(case, 6);
                let report = check_layer(&mut l, &x, eps, 1e-2);
                assert!(report.is_ok(), "{path} {case:?}: {}", report.unwrap_err());
            }
            // Batch larger than the group count, blocks straddling images.
            for case in [
                (20, 5, 5, 64, 3, 3, 1, 1, true),
                (20, 5, 5, 16, 16, 3, 1, 1, true),
            ] {
                let report = check_layer(&mut layer(case, 7), &input(case, 8), eps, 1e-2);
                assert!(report.is_ok(), "{path} {case:?}: {}", report.unwrap_err());
            }
        });
    }

    /// max |got - want| / max |want|: the error on the scale of the values.
    fn relative_error(got: &[f32], want: &[f32]) -> f64 {
        let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64));
        let err = got
            .iter()
            .zip(want)
            .fold(0.0f64, |m, (a, b)| m.max((a - b).abs() as f64));
        err / scale.max(f64::MIN_POSITIVE)
    }

    /// Winograd F(2×2, 3×3) on the reference ResNet's 3×3 s1 shapes against
    /// the float64 definition, beside the direct kernels' own error: the
    /// forward, dX and dW errors stay within WINOGRAD_TOLERANCE of the
    /// largest value (measured ~1e-7 to 4e-7) and within 8× the direct
    /// kernels' error.
    #[test]
    fn winograd_error_is_close_to_direct() {
        const WINOGRAD_TOLERANCE: f64 = 2e-6;
        const WINOGRAD4_TOLERANCE: f64 = 1e-5;
        for case in [
            (2, 28, 28, 32, 32, 3, 1, 1, false),
            (2, 14, 14, 64, 64, 3, 1, 1, true),
            (2, 7, 7, 128, 128, 3, 1, 1, false),
            // Two images a group, each a whole weight-gradient block: dU is
            // written by the first block and added to by the second.
            (16, 64, 64, 16, 16, 3, 1, 1, true),
        ] {
            let x = input(case, 2);
            let mut errors = Vec::new();
            for algorithm in [
                ConvAlgorithm::Winograd,
                ConvAlgorithm::Winograd4,
                ConvAlgorithm::Direct,
            ] {
                FORCE_ALGORITHM.set(Some(algorithm));
                let mut l = layer(case, 1);
                let wt = l.weight.value.data().to_vec();
                let bias = l.bias.as_ref().map(|b| b.value.data().to_vec());
                let y = l.forward(&x, Mode::Train).unwrap();
                let dy: Vec<f32> = y.data().iter().map(|v| (v * 0.37).sin()).collect();
                let dx = l
                    .backward(&Tensor::from_vec(y.shape(), dy.clone()).unwrap())
                    .unwrap();
                let want_y = naive_forward(case, x.data(), &wt, bias.as_deref());
                let (want_dx, want_dw, _) = naive_backward(case, x.data(), &wt, &dy);
                errors.push([
                    relative_error(y.data(), &want_y),
                    relative_error(dx.data(), &want_dx),
                    relative_error(l.weight.grad.data(), &want_dw),
                ]);
            }
            FORCE_ALGORITHM.set(None);
            let (wino, wino4, direct) = (errors[0], errors[1], errors[2]);
            eprintln!(
                "{case:?}: (y, dx, dw) winograd {wino:?}, winograd4 {wino4:?}, direct {direct:?}"
            );
            for (i, what) in ["forward", "dx", "dw"].iter().enumerate() {
                assert!(
                    wino[i] <= WINOGRAD_TOLERANCE && wino[i] <= 8.0 * direct[i] + 1e-7,
                    "{case:?} {what}: winograd error {:.2e}, direct {:.2e}",
                    wino[i],
                    direct[i]
                );
                assert!(
                    wino4[i] <= WINOGRAD4_TOLERANCE,
                    "{case:?} {what}: winograd4 error {:.2e}, direct {:.2e}",
                    wino4[i],
                    direct[i]
                );
            }
        }
    }

    /// A scratch growth the OS refuses is an out-of-memory error (which the
    /// run's policy handles), not an abort, and the buffer stays usable.
    #[test]
    fn scratch_the_os_refuses_is_an_error() {
        let err = with_scratch(usize::MAX / 8, |_| ()).unwrap_err();
        assert!(err.is_out_of_memory(), "{err}");
        assert_eq!(with_scratch(16, |buf| buf.len()).unwrap(), 16);
    }

    /// A kernel's error reaches the caller of `par_build`, whichever chunk
    /// it came from; every other chunk written is dropped with the tensor.
    #[test]
    fn par_build_returns_a_chunks_error() {
        for failing in [0, 3, 7] {
            // SAFETY: every chunk that returns Ok is written whole.
            let built = unsafe {
                par_build(&[8, 5], 5, |i, chunk| {
                    if i == failing {
                        return with_scratch(usize::MAX / 8, |_| ());
                    }
                    chunk.fill(MaybeUninit::new(i as f32));
                    Ok(())
                })
            };
            assert!(built.unwrap_err().is_out_of_memory(), "chunk {failing}");
        }
        // SAFETY: as above.
        let built = unsafe {
            par_build(&[8, 5], 5, |i, chunk| {
                chunk.fill(MaybeUninit::new(i as f32));
                Ok(())
            })
        };
        assert_eq!(built.unwrap().data()[5 * 7], 7.0);
    }

    #[test]
    fn conv_backward_without_forward_is_an_error() {
        let case = CASES[0];
        let mut l = layer(case, 1);
        let dy = Tensor::zeros(&[2, 6, 6, 4]);
        assert!(matches!(
            l.backward(&dy),
            Err(ModelError::NoSavedActivation { .. })
        ));
        // An eval forward saves nothing either.
        l.forward(&input(case, 2), Mode::Eval).unwrap();
        assert!(matches!(
            l.backward(&dy),
            Err(ModelError::NoSavedActivation { .. })
        ));
        // And backward consumes what a training forward saved.
        l.forward(&input(case, 2), Mode::Train).unwrap();
        l.backward(&dy).unwrap();
        assert!(l.backward(&dy).is_err());
    }

    #[test]
    fn backward_params_only_adds_the_parameter_gradients_of_backward() {
        both_paths(|path| {
            for &case in CASES {
                let x = input(case, 2);
                let (mut full, mut params_only) = (layer(case, 1), layer(case, 1));
                let y = full.forward(&x, Mode::Train).unwrap();
                params_only.forward(&x, Mode::Train).unwrap();
                let mut rng = InitRng::new(9);
                let dy = Tensor::from_vec(y.shape(), random(&mut rng, y.len())).unwrap();
                full.backward(&dy).unwrap();
                params_only.backward_params_only(&dy).unwrap();
                for (a, b) in full.params_mut().into_iter().zip(params_only.params_mut()) {
                    assert!(a.grad.data() == b.grad.data(), "{path} {case:?} {}", a.name);
                }
                // The saved input is used up, as by backward.
                assert!(params_only.backward_params_only(&dy).is_err());
            }
        });
    }

    #[test]
    fn conv_gradients_accumulate() {
        both_paths(|path| {
            for case in [
                (3, 6, 6, 3, 4, 3, 2, 1, true),
                (20, 6, 6, 16, 16, 3, 1, 1, true),
            ] {
                let mut l = layer(case, 1);
                let x = input(case, 2);
                let y = l.forward(&x, Mode::Train).unwrap();
                let mut rng = InitRng::new(9);
                let dy = Tensor::from_vec(y.shape(), random(&mut rng, y.len())).unwrap();
                l.backward(&dy).unwrap();
                let once: Vec<Vec<f32>> = l
                    .params_mut()
                    .iter()
                    .map(|p| p.grad.data().to_vec())
                    .collect();
                assert!(once.iter().all(|g| g.iter().any(|&v| v != 0.0)));
                l.forward(&x, Mode::Train).unwrap();
                l.backward(&dy).unwrap();
                for (p, first) in l.params_mut().into_iter().zip(&once) {
                    for (a, b) in p.grad.data().iter().zip(first) {
                        assert_eq!(*a, 2.0 * b, "{path} {case:?} {}", p.name);
                    }
                }
            }
        });
    }

    #[test]
    fn conv_results_do_not_depend_on_thread_count() {
        // 37 images: more than the backward groups, an uneven split.
        for case in [
            (37, 7, 7, 16, 32, 3, 1, 1, true),
            (37, 8, 8, 32, 16, 3, 2, 1, false),
            // Narrow: the column kernels at stride 1, the gather at 2.
            (37, 9, 8, 17, 1, 3, 1, 1, true),
            (37, 7, 7, 5, 3, 3, 2, 1, false),
        ] {
            let x = input(case, 2);
            for (force_gemm, algorithm) in [
                (false, ConvAlgorithm::Winograd),
                (false, ConvAlgorithm::Winograd4),
                (false, ConvAlgorithm::Direct),
                (true, ConvAlgorithm::Direct),
            ] {
                let run = |threads: usize| {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap();
                    pool.install(|| {
                        FORCE_GEMM.set(force_gemm);
                        FORCE_ALGORITHM.set(Some(algorithm));
                        let mut l = layer(case, 1);
                        let y = l.forward(&x, Mode::Train).unwrap();
                        let dy = y.data().iter().map(|v| v.sin()).collect();
                        let dy = Tensor::from_vec(y.shape(), dy).unwrap();
                        let dx = l.backward(&dy).unwrap();
                        let grads: Vec<Vec<f32>> = l
                            .params_mut()
                            .iter()
                            .map(|p| p.grad.data().to_vec())
                            .collect();
                        FORCE_GEMM.set(false);
                        FORCE_ALGORITHM.set(None);
                        (y.data().to_vec(), dx.data().to_vec(), grads)
                    })
                };
                let one = run(1);
                for threads in [2, 3] {
                    assert!(
                        one == run(threads),
                        "{case:?} gemm={force_gemm} {algorithm:?}: results differ \
                         between 1 and {threads} threads"
                    );
                }
            }
        }
    }

    #[test]
    fn conv_rejects_bad_shapes() {
        let mut rng = InitRng::new(1);
        let mut l = Conv2d::new("c", 3, 4, 3, 1, 0, false, &mut rng).unwrap();
        assert_eq!(l.params_mut()[0].name, "c.weight");
        assert_eq!(l.params_mut()[0].value.shape(), &[3, 3, 3, 4]);
        assert!(l.params_mut()[0].decay);
        assert_eq!(l.macs(&[5, 5, 3]).unwrap(), 3 * 3 * 4 * 27);
        // Wrong channel count, too small for the kernel, wrong rank.
        assert!(matches!(
            l.output_shape(&[5, 5, 2]),
            Err(ModelError::Shape { .. })
        ));
        assert!(matches!(
            l.output_shape(&[2, 5, 3]),
            Err(ModelError::Shape { .. })
        ));
        assert!(matches!(
            l.output_shape(&[5, 5]),
            Err(ModelError::Shape { .. })
        ));
        assert!(l
            .forward(&Tensor::zeros(&[1, 5, 5, 2]), Mode::Train)
            .is_err());
        assert!(l.forward(&Tensor::zeros(&[5, 5, 3]), Mode::Train).is_err());
        assert!(l
            .forward(&Tensor::zeros(&[1, 2, 2, 3]), Mode::Train)
            .is_err());
        // A gradient of the wrong shape is an error, not a panic.
        l.forward(&Tensor::zeros(&[1, 5, 5, 3]), Mode::Train)
            .unwrap();
        assert!(l.backward(&Tensor::zeros(&[1, 3, 3, 5])).is_err());
        // Zero-sized hyper-parameters are refused.
        assert!(Conv2d::new("c", 0, 4, 3, 1, 1, false, &mut rng).is_err());
        assert!(Conv2d::new("c", 3, 4, 3, 0, 1, false, &mut rng).is_err());
        // Bias: named, not decayed.
        let mut b = Conv2d::new("b", 3, 4, 3, 1, 1, true, &mut rng).unwrap();
        let params = b.params_mut();
        assert_eq!(params[1].name, "b.bias");
        assert!(!params[1].decay);
        assert_eq!(b.describe(), "conv3x3 3->4");
        assert_eq!(
            Conv2d::new("d", 32, 64, 3, 2, 1, false, &mut rng)
                .unwrap()
                .describe(),
            "conv3x3/2 32->64"
        );
    }

    #[test]
    fn conv_tiles_split_rows_without_tiny_tails() {
        for mr in [direct::MR, direct::MR_WIDE] {
            for n in 0..300 {
                let split = direct::split_rows(n, mr);
                assert_eq!(split.iter().sum::<usize>(), n, "{n}: {split:?}");
                assert!(
                    split.iter().all(|&t| (1..=mr).contains(&t)),
                    "{n}: {split:?}"
                );
                if n >= mr / 2 {
                    assert!(split.iter().all(|&t| t >= mr / 2), "{n}: {split:?}");
                }
            }
        }
        assert_eq!(direct::split_rows(32, direct::MR_WIDE), vec![12, 12, 8]);
        assert_eq!(direct::split_rows(32, direct::MR), vec![6, 6, 5, 5, 5, 5]);
    }

    #[test]
    fn conv_empty_batch() {
        let mut l = layer(CASES[0], 1);
        let y = l
            .forward(&Tensor::zeros(&[0, 6, 6, 3]), Mode::Train)
            .unwrap();
        assert_eq!(y.shape(), &[0, 6, 6, 4]);
        let dx = l.backward(&y).unwrap();
        assert_eq!(dx.shape(), &[0, 6, 6, 3]);
    }
}
