//! 2-D convolution in NHWC, as im2col + GEMM on the CPU.
//!
//! Shapes: input x [N, H, W, Cin], weight [KH, KW, Cin, Cout], optional bias
//! [Cout], output y [N, OH, OW, Cout]. With K = KH·KW·Cin, one im2col row (the
//! receptive field of one output pixel, in (ky, kx, ci) order) is K floats and
//! is contiguous runs of the NHWC input, and row·W is one NHWC output pixel:
//! the convolution is Y[N·OH·OW × Cout] = A[N·OH·OW × K] · W[K × Cout].
//!
//! Memory (what llm.c would write in its header):
//! - saved for backward: the input tensor only — a reference-counted handle,
//!   so no copy (the previous layer's output buffer stays alive). The im2col
//!   matrix A is never materialised for the batch: it is K/Cin times the
//!   input (128·784·288·4 B = 116 MB for a 32->32 layer at 28×28). Instead A
//!   is built block by block (BLOCK_BYTES, ~L2-sized, in a thread-local
//!   scratch buffer) in forward, and rebuilt in backward.
//! - backward scratch: per group of images one partial weight gradient
//!   [K × Cout] (+ Cout for the bias), kept in the layer and reused across
//!   steps: GROUPS·K·Cout floats (16·1152·128·4 B = 9.4 MB for 128->128).
//! - thread-local scratch: one block of A, ≤ BLOCK_BYTES per thread.
//!
//! Parallelism (rayon's global pool; every GEMM runs single-threaded inside
//! a task):
//! - forward: output pixels in fixed blocks of R rows (R·K·4 ≈ BLOCK_BYTES);
//!   each task builds its block of A and does one GEMM into its output rows.
//! - backward: the batch is cut into at most GROUPS fixed groups of whole
//!   images. A group owns its images' input gradient (no write races in the
//!   col2im scatter-add) and its own partial dW; per block of R rows it does
//!   dA = dY·Wᵀ, col2im(dA) += into dX, then rebuilds A in the same buffer and
//!   accumulates dW_g += Aᵀ·dY. The partials are summed in group order, so
//!   the gradients are bit-identical whatever the thread count.
//! - 1×1 / stride 1 / padding 0: A is the input itself; no im2col, no col2im.

use std::cell::RefCell;
use std::mem::{ManuallyDrop, MaybeUninit};

use gemm::{gemm, Parallelism};
use rayon::prelude::*;

use crate::init::InitRng;
use crate::{Layer, Mode, ModelError, Param, Result, Tensor};

/// Target size of one block of the im2col matrix. Measured on the 2-core
/// Zen4 (1 MiB L2 per core): single-threaded `gemm` runs these products at
/// ~110 GFLOP/s (94% of the 117 GFLOP/s FMA peak of one core) from 128 rows
/// up, so the block only has to be tall enough for that and small enough to
/// stay in L2 together with W and the packing buffers.
const BLOCK_BYTES: usize = 256 * 1024;
const MIN_BLOCK_ROWS: usize = 32;
const MAX_BLOCK_ROWS: usize = 1024;

/// Upper bound on the number of image groups in backward (and so on the
/// partial weight gradients kept). Fixed, not the thread count, so results do
/// not depend on the pool size.
const GROUPS: usize = 16;

thread_local! {
    /// One block of the im2col matrix (or of its gradient), reused by every
    /// convolution that runs on this thread.
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
        let out = forward(&g, input.data(), self.weight.value.data(), bias);
        self.saved_input = match mode {
            Mode::Train => Some(input.clone()),
            Mode::Eval => None,
        };
        Tensor::from_vec(&[g.n, g.oh, g.ow, g.cout], out)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let Some(input) = self.saved_input.as_ref() else {
            return Err(ModelError::NoSavedActivation { op: "Conv2d" });
        };
        let g = self.geom(input.shape())?;
        grad_output.expect_shape("Conv2d backward", &[g.n, g.oh, g.ow, g.cout])?;
        let Some(input) = self.saved_input.take() else {
            return Err(ModelError::NoSavedActivation { op: "Conv2d" });
        };
        let dy = grad_output.data();
        let grad_in = grad_input(&g, dy, self.weight.value.data());
        if g.n > 0 {
            let groups = Groups::new(g.n);
            let stride = g.kk * g.cout + g.cout;
            self.partials.resize(groups.count * stride, 0.0);
            grad_params(&g, &groups, input.data(), dy, &mut self.partials);
            let partials = &self.partials;
            reduce_partials(self.weight.grad.data_mut(), partials, 0, stride);
            if let Some(b) = self.bias.as_mut() {
                reduce_partials(b.grad.data_mut(), partials, g.kk * g.cout, stride);
            }
        }
        Tensor::from_vec(&[g.n, g.h, g.w, g.cin], grad_in)
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
    const CHUNK: usize = 4096;
    let count = partials.len() / stride;
    grad.par_chunks_mut(CHUNK).enumerate().for_each(|(c, dst)| {
        let base = offset + c * CHUNK;
        for (i, d) in dst.iter_mut().enumerate() {
            let mut s = 0.0f32;
            for p in 0..count {
                s += partials[p * stride + base + i];
            }
            *d += s;
        }
    });
}

// ---------------------------------------------------------------------------
// Dispatch: direct kernels where they apply, im2col + gemm elsewhere.

/// Images per task for the direct forward and input gradient: enough that
/// the padded images fill ~CHUNK_BYTES (small images share tiles), few
/// enough that every thread gets several tasks.
fn images_per_task(n: usize, padded_image_floats: usize) -> usize {
    let by_cache = direct::CHUNK_BYTES / (4 * padded_image_floats).max(1);
    let by_balance = n.div_ceil(8 * rayon::current_num_threads());
    by_cache.min(by_balance).max(1)
}

/// y = conv(x, w) + bias, [n·oh·ow × cout].
fn forward(g: &Geom, x: &[f32], w: &[f32], bias: Option<&[f32]>) -> Vec<f32> {
    let len = g.n * g.opix() * g.cout;
    if len == 0 {
        return Vec::new();
    }
    if direct::supports(g.cout) {
        let (hp, wp) = g.padded();
        let per_task = images_per_task(g.n, hp * wp * g.cin);
        let taps = direct::forward_taps(g);
        // SAFETY: `direct::forward` writes every element of its chunk.
        unsafe {
            par_build(len, per_task * g.opix() * g.cout, |t, out| {
                let imgs = out.len() / (g.opix() * g.cout);
                let x_t = &x[t * per_task * g.in_image()..][..imgs * g.in_image()];
                direct::forward(g, x_t, imgs, w, bias, &taps, out);
            })
        }
    } else {
        let mut out = vec![0.0f32; len];
        forward_gemm(g, x, w, bias, &mut out);
        out
    }
}

/// dX, [n·h·w × cin].
fn grad_input(g: &Geom, dy: &[f32], w: &[f32]) -> Vec<f32> {
    let len = g.n * g.in_image();
    if len == 0 {
        return Vec::new();
    }
    if direct::supports(g.cin) {
        let plan = direct::GradInputPlan::new(g);
        let per_task = images_per_task(g.n, plan.padded_image() * g.cout);
        // Wᵀ per tap: [k·k, cout, cin], so 16 input channels are contiguous.
        let mut wt = vec![0.0f32; w.len()];
        for (src, dst) in w
            .chunks_exact(g.cin * g.cout)
            .zip(wt.chunks_exact_mut(g.cin * g.cout))
        {
            for (ci, row) in src.chunks_exact(g.cout).enumerate() {
                for (co, &v) in row.iter().enumerate() {
                    dst[co * g.cin + ci] = v;
                }
            }
        }
        let out_image = g.opix() * g.cout;
        // SAFETY: `direct::grad_input` writes every element of its chunk.
        unsafe {
            par_build(len, per_task * g.in_image(), |t, dx| {
                let imgs = dx.len() / g.in_image();
                let dy_t = &dy[t * per_task * out_image..][..imgs * out_image];
                direct::grad_input(g, &plan, dy_t, imgs, &wt, dx);
            })
        }
    } else {
        let mut dx = vec![0.0f32; len];
        grad_input_gemm(g, dy, w, &mut dx);
        dx
    }
}

/// Per-group partial gradients: `partials` is groups × [kk·cout weight, cout bias].
fn grad_params(g: &Geom, groups: &Groups, x: &[f32], dy: &[f32], partials: &mut [f32]) {
    let stride = g.kk * g.cout + g.cout;
    let direct = direct::supports(g.cout);
    partials
        .par_chunks_mut(stride)
        .enumerate()
        .for_each(|(gi, part)| {
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
            if direct {
                dw.fill(0.0);
                direct::grad_weight(g, x_g, dy_g, imgs, dw);
            } else {
                grad_weight_gemm(g, x_g, dy_g, imgs, dw);
            }
        });
}

/// Allocates `len` floats and runs `fill(i, chunk)` on chunks of `chunk`
/// elements in parallel (the last may be shorter). Skips the zeroing pass a
/// `vec![0.0; len]` would make on one thread (3% of a step, measured).
///
/// # Safety
/// `fill` must write every element of the chunk it is given.
unsafe fn par_build(
    len: usize,
    chunk: usize,
    fill: impl Fn(usize, &mut [MaybeUninit<f32>]) + Sync,
) -> Vec<f32> {
    let mut v: Vec<MaybeUninit<f32>> = Vec::with_capacity(len);
    // SAFETY: MaybeUninit needs no initialisation; capacity is len.
    unsafe { v.set_len(len) };
    v.par_chunks_mut(chunk.max(1))
        .enumerate()
        .for_each(|(i, c)| fill(i, c));
    let mut v = ManuallyDrop::new(v);
    // SAFETY: every element was written (the caller's contract); f32 and
    // MaybeUninit<f32> have the same layout, and we take over the allocation.
    unsafe { Vec::from_raw_parts(v.as_mut_ptr().cast::<f32>(), v.len(), v.capacity()) }
}

/// A zero border around an image: rows above and below, columns left and right.
#[derive(Clone, Copy, Debug)]
struct Border {
    top: usize,
    bottom: usize,
    left: usize,
    right: usize,
}

/// Copies one [h, w, c] image into `dst` ([top+h+bottom, left+w+right, c])
/// inside a zero border.
fn pad_into(src: &[f32], h: usize, w: usize, c: usize, b: Border, dst: &mut [f32]) {
    let wp = b.left + w + b.right;
    let hp = b.top + h + b.bottom;
    for (y, row) in dst.chunks_exact_mut(wp * c).take(hp).enumerate() {
        if y < b.top || y >= b.top + h {
            row.fill(0.0);
        } else {
            let y = y - b.top;
            row[..b.left * c].fill(0.0);
            row[b.left * c..(b.left + w) * c].copy_from_slice(&src[y * w * c..(y + 1) * w * c]);
            row[(b.left + w) * c..].fill(0.0);
        }
    }
}

/// Direct convolution kernels: no im2col matrix, no packing.
///
/// One tile is MR rows × NR columns of a product accumulated in registers
/// (12 ymm accumulators: the 6×16 shape of the classic AVX2 SGEMM kernel).
/// Each of the MR rows walks memory through its own pointer (a pixel's
/// receptive field in a zero-padded image, or one tap and input channel
/// across all pixels), so a tile can gather rows from anywhere — across
/// output rows and images — and the NR columns are a contiguous 16-float
/// slice (16 output channels of W, or of dY). On the 2-core Zen4 AVX2 FMA
/// runs at the same 32 FLOP/cycle as AVX-512 (measured, 117 GFLOP/s per
/// core), and its intrinsics are stable at our MSRV.
mod direct {
    use super::{pad_into, with_scratch, Border, Geom};
    use std::mem::MaybeUninit;

    pub const MR: usize = 6;
    pub const NR: usize = 16;

    /// Padded images per task, at most about this many bytes (L2 is 1 MiB
    /// per Zen4 core; W, dY and the output share it).
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

    /// Runs tiles over `rows`: row r reads from a + rows[r].0 and writes 16
    /// floats at dst + rows[r].1.
    ///
    /// # Safety
    /// `supports` returned true; for every row, every address the walk forms
    /// from a + rows[r].0 and from b is inside one allocation, and the 16
    /// floats at dst + rows[r].1 are writable, distinct between rows, and
    /// overlap nothing that is read.
    unsafe fn tiles(
        rows: &[(usize, usize)],
        a: *const f32,
        b: *const f32,
        st: &Steps,
        dst: *mut f32,
        init: Init,
    ) {
        for t in rows.chunks(MR) {
            // SAFETY: forwarded from the caller.
            unsafe {
                let ap = |r: usize| a.add(t[r.min(t.len() - 1)].0);
                let dp = |r: usize| dst.add(t[r.min(t.len() - 1)].1);
                match t.len() {
                    6 => simd::tile::<6>(
                        std::array::from_fn(ap),
                        b,
                        st,
                        std::array::from_fn(dp),
                        init,
                    ),
                    5 => simd::tile::<5>(
                        std::array::from_fn(ap),
                        b,
                        st,
                        std::array::from_fn(dp),
                        init,
                    ),
                    4 => simd::tile::<4>(
                        std::array::from_fn(ap),
                        b,
                        st,
                        std::array::from_fn(dp),
                        init,
                    ),
                    3 => simd::tile::<3>(
                        std::array::from_fn(ap),
                        b,
                        st,
                        std::array::from_fn(dp),
                        init,
                    ),
                    2 => simd::tile::<2>(
                        std::array::from_fn(ap),
                        b,
                        st,
                        std::array::from_fn(dp),
                        init,
                    ),
                    _ => simd::tile::<1>(
                        std::array::from_fn(ap),
                        b,
                        st,
                        std::array::from_fn(dp),
                        init,
                    ),
                }
            }
        }
    }

    /// Forward segments, one per tap: (offset in the padded image, offset in W).
    pub fn forward_taps(g: &Geom) -> Vec<(isize, isize)> {
        let (_, wp) = g.padded();
        let mut taps = Vec::with_capacity(g.k * g.k);
        for ky in 0..g.k {
            for kx in 0..g.k {
                let a = (ky * wp + kx) * g.cin;
                let b = (ky * g.k + kx) * g.cin * g.cout;
                taps.push((a as isize, b as isize));
            }
        }
        taps
    }

    /// The forward of `imgs` images: writes all of `out` ([imgs·oh·ow × cout]).
    /// Rows are output pixels (each reading its receptive field in the
    /// padded images), columns output channels; the walk is taps × input
    /// channels, along W's rows.
    pub fn forward(
        g: &Geom,
        x: &[f32],
        imgs: usize,
        w: &[f32],
        bias: Option<&[f32]>,
        taps: &[(isize, isize)],
        out: &mut [MaybeUninit<f32>],
    ) {
        let (hp, wp) = g.padded();
        let pimg = hp * wp * g.cin;
        let opix = g.opix();
        assert!(out.len() == imgs * opix * g.cout && x.len() == imgs * g.in_image());
        assert!(w.len() == g.kk * g.cout && g.cout % NR == 0);
        assert!(bias.is_none_or(|b| b.len() == g.cout));
        let steps = Steps {
            segs: taps,
            len: g.cin,
            a_step: 1,
            b_step: g.cout as isize,
        };
        // Pixel (oy, ox) reads padded rows oy·s .. oy·s+k-1 and columns
        // ox·s .. ox·s+k-1: inside [hp, wp] by the definition of (oh, ow).
        let mut rows: Vec<(usize, usize)> = Vec::with_capacity(imgs * opix);
        for i in 0..imgs {
            for oy in 0..g.oh {
                for ox in 0..g.ow {
                    let a = i * pimg + (oy * g.stride * wp + ox * g.stride) * g.cin;
                    debug_assert!(a + ((g.k - 1) * wp + g.k) * g.cin <= (i + 1) * pimg);
                    rows.push((a, ((i * g.oh + oy) * g.ow + ox) * g.cout));
                }
            }
        }
        let border = Border {
            top: g.pad,
            bottom: g.pad,
            left: g.pad,
            right: g.pad,
        };
        with_scratch(imgs * pimg, |xpad| {
            for (src, dst) in x
                .chunks_exact(g.in_image())
                .zip(xpad.chunks_exact_mut(pimg))
            {
                pad_into(src, g.h, g.w, g.cin, border, dst);
            }
            let out = out.as_mut_ptr().cast::<f32>();
            for co0 in (0..g.cout).step_by(NR) {
                let init = match bias {
                    // SAFETY: co0 + 16 <= cout = bias.len().
                    Some(b) => Init::Bias(unsafe { b.as_ptr().add(co0) }),
                    None => Init::Zero,
                };
                // SAFETY: reads as argued above, W rows are kk × cout with
                // co0 + 16 <= cout; each pixel's 16 outputs are its own.
                unsafe {
                    tiles(
                        &rows,
                        xpad.as_ptr(),
                        w.as_ptr().add(co0),
                        &steps,
                        out.add(co0),
                        init,
                    );
                }
            }
        });
    }

    /// The input gradient's geometry: dY is padded so that every tap of every
    /// input pixel lands inside it, and input pixels fall into stride²
    /// classes by which taps reach them.
    pub struct GradInputPlan {
        border: Border,
        hq: usize,
        wq: usize,
        /// Per class (ry, rx): segments (offset in padded dY, offset in Wᵀ).
        classes: Vec<Vec<(isize, isize)>>,
    }

    impl GradInputPlan {
        pub fn new(g: &Geom) -> Self {
            let s = g.stride;
            // oy = (iy + p - ky) / s ranges over
            // [-ceil((k-1-p)/s), floor((h-1+p)/s)].
            let top = (g.k - 1).saturating_sub(g.pad).div_ceil(s);
            let bottom = ((g.h - 1 + g.pad) / s + 1).saturating_sub(g.oh);
            let left = (g.k - 1).saturating_sub(g.pad).div_ceil(s);
            let right = ((g.w - 1 + g.pad) / s + 1).saturating_sub(g.ow);
            let border = Border {
                top,
                bottom,
                left,
                right,
            };
            let (hq, wq) = (top + g.oh + bottom, left + g.ow + right);
            let mut classes = Vec::with_capacity(s * s);
            for ry in 0..s {
                for rx in 0..s {
                    let mut segs = Vec::new();
                    for (ty, ky) in (ry..g.k).step_by(s).enumerate() {
                        for (tx, kx) in (rx..g.k).step_by(s).enumerate() {
                            // Relative to the pixel's reference (the tap ry, rx).
                            let a = -(((ty * wq + tx) * g.cout) as isize);
                            let b = ((ky * g.k + kx) * g.cout * g.cin) as isize;
                            segs.push((a, b));
                        }
                    }
                    classes.push(segs);
                }
            }
            Self {
                border,
                hq,
                wq,
                classes,
            }
        }

        /// Floats of one padded dY image.
        pub fn padded_image(&self) -> usize {
            self.hq * self.wq
        }
    }

    /// dX of `imgs` images: writes all of `dx` ([imgs·h·w × cin]).
    /// dX[iy, ix, ci] = Σ dY[oy, ox, co]·W[ky, kx, ci, co] over
    /// oy·s + ky - p = iy, ox·s + kx - p = ix. Rows are input pixels of one
    /// class (the same taps reach them), columns input channels; the walk is
    /// taps × output channels, along Wᵀ's rows (`wt`: [k·k, cout, cin]).
    pub fn grad_input(
        g: &Geom,
        plan: &GradInputPlan,
        dy: &[f32],
        imgs: usize,
        wt: &[f32],
        dx: &mut [MaybeUninit<f32>],
    ) {
        let s = g.stride;
        let pimg = plan.padded_image() * g.cout;
        assert!(dx.len() == imgs * g.in_image() && dy.len() == imgs * g.opix() * g.cout);
        assert!(wt.len() == g.kk * g.cout && g.cin % NR == 0);
        let (top, left) = (plan.border.top, plan.border.left);
        with_scratch(imgs * pimg, |dypad| {
            for (src, dst) in dy
                .chunks_exact(g.opix() * g.cout)
                .zip(dypad.chunks_exact_mut(pimg))
            {
                pad_into(src, g.oh, g.ow, g.cout, plan.border, dst);
            }
            let dx = dx.as_mut_ptr().cast::<f32>();
            let mut rows: Vec<(usize, usize)> = Vec::with_capacity(imgs * g.h * g.w);
            for (class, segs) in plan.classes.iter().enumerate() {
                let (ry, rx) = (class / s, class % s);
                // The reference tap (ry, rx) of pixel (iy, ix) reads dY at
                // ((iy + p - ry)/s, (ix + p - rx)/s); tap (ry + s·ty, rx + s·tx)
                // reads ty rows and tx columns before it, never past the
                // padding (see `GradInputPlan::new`).
                rows.clear();
                for i in 0..imgs {
                    for iy in (0..g.h).filter(|iy| (iy + g.pad) % s == ry) {
                        let qy = top + (iy + g.pad - ry) / s;
                        for ix in (0..g.w).filter(|ix| (ix + g.pad) % s == rx) {
                            let qx = left + (ix + g.pad - rx) / s;
                            let a = i * pimg + (qy * plan.wq + qx) * g.cout;
                            rows.push((a, ((i * g.h + iy) * g.w + ix) * g.cin));
                        }
                    }
                }
                let steps = Steps {
                    segs,
                    len: g.cout,
                    a_step: 1,
                    b_step: g.cin as isize,
                };
                for ci0 in (0..g.cin).step_by(NR) {
                    // SAFETY: reads as argued above (dY padded per the plan;
                    // Wᵀ rows are k·k·cout × cin with ci0 + 16 <= cin); each
                    // input pixel's 16 outputs are its own. A class with no
                    // taps writes zeros.
                    unsafe {
                        tiles(
                            &rows,
                            dypad.as_ptr(),
                            wt.as_ptr().add(ci0),
                            &steps,
                            dx.add(ci0),
                            Init::Zero,
                        );
                    }
                }
            }
        });
    }

    /// Adds the weight gradient of `imgs` images into `dw` ([kk × cout]).
    /// Rows are dW rows ((tap, input channel) pairs, each a pointer into the
    /// padded images at that tap's offset), columns output channels; the walk
    /// is over every output pixel of a chunk of images (one segment per
    /// output row), along dY's rows.
    pub fn grad_weight(g: &Geom, x_g: &[f32], dy_g: &[f32], imgs: usize, dw: &mut [f32]) {
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
        let border = Border {
            top: g.pad,
            bottom: g.pad,
            left: g.pad,
            right: g.pad,
        };
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
                a_step: (g.cin) as isize,
                b_step: g.cout as isize,
            };
            with_scratch(cc * pimg, |xpad| {
                for (src, dst) in x_c
                    .chunks_exact(g.in_image())
                    .zip(xpad.chunks_exact_mut(pimg))
                {
                    pad_into(src, g.h, g.w, g.cin, border, dst);
                }
                // The last segment of image cc-1 starts at padded row
                // (oh-1)·s and steps to column (ow-1)·s; a row's offset adds
                // at most k-1 rows, k-1 columns and cin-1: inside cc padded
                // images. dY: cc·opix rows of cout, columns co0..co0+16.
                for co0 in (0..g.cout).step_by(NR) {
                    // SAFETY: as argued above; dW is read and written only
                    // through dst (Init::Accumulate), one row per tile row.
                    unsafe {
                        tiles(
                            &rows,
                            xpad.as_ptr(),
                            dy_c.as_ptr().add(co0),
                            &steps,
                            dw.as_mut_ptr().add(co0),
                            Init::Accumulate,
                        );
                    }
                }
            });
            c0 += cc;
        }
    }

    #[cfg(target_arch = "x86_64")]
    mod simd {
        use super::{Init, Steps};
        use std::arch::x86_64::*;

        pub fn available() -> bool {
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
        }

        /// dst[r][0..16] = init + Σ_segments Σ_i a[r][a_off + i·a_step] · b[b_off + i·b_step ..][..16]
        ///
        /// # Safety
        /// AVX2 and FMA are available and every address is valid (see `super::tiles`).
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn tile<const M: usize>(
            a: [*const f32; M],
            b: *const f32,
            st: &Steps,
            dst: [*mut f32; M],
            init: Init,
        ) {
            // SAFETY: the caller's contract covers every pointer used here.
            unsafe {
                let mut acc = [[_mm256_setzero_ps(); 2]; M];
                match init {
                    Init::Zero => {}
                    Init::Accumulate => {
                        for r in 0..M {
                            acc[r] = [_mm256_loadu_ps(dst[r]), _mm256_loadu_ps(dst[r].add(8))];
                        }
                    }
                    Init::Bias(p) => {
                        acc = [[_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))]; M];
                    }
                }
                for &(a_off, b_off) in st.segs {
                    let pa: [*const f32; M] = std::array::from_fn(|r| a[r].offset(a_off));
                    let pb = b.offset(b_off);
                    let (mut ia, mut ib) = (0isize, 0isize);
                    for _ in 0..st.len {
                        let b0 = _mm256_loadu_ps(pb.offset(ib));
                        let b1 = _mm256_loadu_ps(pb.offset(ib + 8));
                        for r in 0..M {
                            let av = _mm256_broadcast_ss(&*pa[r].offset(ia));
                            acc[r][0] = _mm256_fmadd_ps(av, b0, acc[r][0]);
                            acc[r][1] = _mm256_fmadd_ps(av, b1, acc[r][1]);
                        }
                        ia += st.a_step;
                        ib += st.b_step;
                    }
                }
                for r in 0..M {
                    _mm256_storeu_ps(dst[r], acc[r][0]);
                    _mm256_storeu_ps(dst[r].add(8), acc[r][1]);
                }
            }
        }
    }

    /// Elsewhere the im2col + gemm path runs; this only keeps the build whole.
    #[cfg(not(target_arch = "x86_64"))]
    mod simd {
        use super::{Init, Steps};

        pub fn available() -> bool {
            false
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
fn forward_gemm(g: &Geom, x: &[f32], w: &[f32], bias: Option<&[f32]>, out: &mut [f32]) {
    let r = g.block_rows();
    out.par_chunks_mut(r * g.cout)
        .enumerate()
        .for_each(|(b, dst)| {
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
                return;
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
            });
        });
}

/// dX (zeroed on entry) += col2im(dY·Wᵀ), in groups of whole images so that
/// the scatter-adds of different tasks never meet.
fn grad_input_gemm(g: &Geom, dy: &[f32], w: &[f32], dx: &mut [f32]) {
    let groups = Groups::new(g.n);
    let r = g.block_rows();
    let wt = View::cm(w, g.cout); // Wᵀ: [cout × kk]
    dx.par_chunks_mut(groups.images * g.in_image())
        .enumerate()
        .for_each(|(gi, dx_g)| {
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
                    });
                }
                r0 += rows;
            }
        });
}

/// dw = Σ over the group's rows of im2col(x)ᵀ·dY (overwrites `dw`).
fn grad_weight_gemm(g: &Geom, x_g: &[f32], dy_g: &[f32], imgs: usize, dw: &mut [f32]) {
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
            });
        }
        r0 += rows;
    }
}

/// Runs `f` on this thread's scratch buffer, grown to at least `len`.
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    SCRATCH.with(|cell| {
        let mut buf = cell.borrow_mut();
        if buf.len() < len {
            buf.resize(len, 0.0);
        }
        f(&mut buf[..len])
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

/// A strided matrix view: element (i, j) is data[i·row_stride + j·col_stride].
#[derive(Clone, Copy)]
struct View<'a> {
    data: &'a [f32],
    row_stride: usize,
    col_stride: usize,
}

impl<'a> View<'a> {
    /// Row-major with `cols` columns.
    fn rm(data: &'a [f32], cols: usize) -> Self {
        Self {
            data,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The transpose of a row-major matrix with `cols` columns.
    fn cm(data: &'a [f32], cols: usize) -> Self {
        Self {
            data,
            row_stride: 1,
            col_stride: cols,
        }
    }
}

/// dst[m×n] (row-major, contiguous) = (accumulate ? dst : 0) + lhs[m×k]·rhs[k×n],
/// single-threaded (callers parallelise over blocks).
fn matmul(dst: &mut [f32], m: usize, n: usize, k: usize, lhs: View, rhs: View, accumulate: bool) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst.fill(0.0);
        }
        return;
    }
    let last =
        |v: &View, rows: usize, cols: usize| (rows - 1) * v.row_stride + (cols - 1) * v.col_stride;
    // Internal invariants (all extents come from a validated Geom), checked
    // because the call below is unsafe.
    assert!(dst.len() >= m * n, "conv: dst too small");
    assert!(
        last(&lhs, m, k) < lhs.data.len(),
        "conv: lhs view out of bounds"
    );
    assert!(
        last(&rhs, k, n) < rhs.data.len(),
        "conv: rhs view out of bounds"
    );
    // SAFETY: the asserts keep every element gemm reads inside `lhs` and `rhs`
    // and every element it writes inside `dst`, which we hold mutably and
    // which aliases neither input.
    unsafe {
        gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.col_stride as isize,
            lhs.row_stride as isize,
            rhs.data.as_ptr(),
            rhs.col_stride as isize,
            rhs.row_stride as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::check_layer;
    use std::cell::Cell;

    thread_local! {
        /// Makes this thread's convolutions take the im2col + gemm path.
        pub(super) static FORCE_GEMM: Cell<bool> = const { Cell::new(false) };
    }

    /// Runs `f` once per implementation: direct kernels (where this CPU has
    /// them) and im2col + gemm.
    fn both_paths(f: impl Fn(&str)) {
        for force in [false, true] {
            FORCE_GEMM.set(force);
            f(if force { "gemm" } else { "direct" });
        }
        FORCE_GEMM.set(false);
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

    fn assert_close(what: &str, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            let tol = 1e-4 * (1.0 + b.abs());
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
        });
    }

    #[test]
    fn conv_gradients_match_finite_differences() {
        both_paths(|path| {
            for &case in CASES {
                let mut l = layer(case, 5);
                let x = input(case, 6);
                let report = check_layer(&mut l, &x, 1e-2, 1e-2);
                assert!(report.is_ok(), "{path} {case:?}: {}", report.unwrap_err());
            }
            // Batch larger than the group count, blocks straddling images.
            for case in [
                (20, 5, 5, 64, 3, 3, 1, 1, true),
                (20, 5, 5, 16, 16, 3, 1, 1, true),
            ] {
                let report = check_layer(&mut layer(case, 7), &input(case, 8), 1e-2, 1e-2);
                assert!(report.is_ok(), "{path} {case:?}: {}", report.unwrap_err());
            }
        });
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
    fn conv_gradients_accumulate() {
        let case = (3, 6, 6, 3, 4, 3, 2, 1, true);
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
        assert!(once[0].iter().any(|&v| v != 0.0));
        l.forward(&x, Mode::Train).unwrap();
        l.backward(&dy).unwrap();
        for (p, first) in l.params_mut().into_iter().zip(&once) {
            for (a, b) in p.grad.data().iter().zip(first) {
                assert_eq!(*a, 2.0 * b, "{}", p.name);
            }
        }
    }

    #[test]
    fn conv_results_do_not_depend_on_thread_count() {
        let case = (37, 7, 7, 16, 8, 3, 1, 1, true);
        let x = input(case, 2);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let mut l = layer(case, 1);
                let y = l.forward(&x, Mode::Train).unwrap();
                let dy = Tensor::from_vec(y.shape(), y.data().iter().map(|v| v.sin()).collect())
                    .unwrap();
                let dx = l.backward(&dy).unwrap();
                let grads: Vec<Vec<f32>> = l
                    .params_mut()
                    .iter()
                    .map(|p| p.grad.data().to_vec())
                    .collect();
                (y.data().to_vec(), dx.data().to_vec(), grads)
            })
        };
        let one = run(1);
        assert!(one == run(3), "results differ between 1 and 3 threads");
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
