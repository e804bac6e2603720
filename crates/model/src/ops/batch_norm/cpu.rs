//! Batch normalisation over N, H and W for each channel of an NHWC batch.
//!
//! Train mode normalises with the batch statistics (biased variance) and
//! updates the running statistics with PyTorch's rule,
//! `running = (1 - momentum) * running + momentum * batch`, using the
//! UNBIASED batch variance for `running_var`. Eval mode uses the running
//! statistics and saves nothing.
//!
//! A training forward saves its input (a reference-counted handle, no copy),
//! the per-channel batch mean and 1/sqrt(var + eps): x̂ is recomputed in
//! backward from those, which costs one subtraction per element and no
//! separate x̂ buffer.
//!
//! Fusion (`device.fusion`, on by default): `with_relu` makes the layer
//! apply the ReLU that follows it in the same pass that normalises, and
//! `forward_add_relu` adds a residual block's input before that ReLU, so an
//! activation is written once instead of two or three times. The fused
//! backward recomputes the ReLU mask from the saved input (the normalised
//! value is one multiply-add away) instead of reading a saved output or a
//! masked gradient. Fused and unfused layers compute the same expressions in
//! the same order, so their results are bit-identical.
//!
//! Speed and determinism: channels are the fastest axis, so the data is a
//! sequence of rows of C contiguous channels. Reductions cut the rows into
//! blocks whose boundaries depend only on the shape; each block is reduced
//! (in f32, vectorised over C, at most `MAX_BLOCK_ROWS` rows) by whichever
//! thread rayon picks, and the per-block results are combined in f64 in block
//! order. The result is therefore bit-identical for the same input however
//! the work is scheduled, and accurate over 100k+ elements per channel.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::ops::activation::relu::{par_build, relu};
use crate::{Layer, Mode, ModelError, Param, Result, Tensor};

/// Target elements per reduction block (16 KiB of f32: stays in L1 for the
/// block's second pass).
const BLOCK_ELEMS: usize = 4096;
/// f32 partial sums never run over more rows than this.
const MAX_BLOCK_ROWS: usize = 256;
/// Target elements per task of the elementwise passes.
const MAP_ELEMS: usize = 1 << 14;
/// Channels reduced together with their accumulators in registers. The
/// obvious row loop `acc[ch] += x[row, ch]` keeps `acc` in memory (C is a
/// runtime value) and stalls on store-to-load forwarding every row.
const LANES: usize = 16;

fn block_rows(c: usize) -> usize {
    (BLOCK_ELEMS / c.max(1)).clamp(1, MAX_BLOCK_ROWS)
}

fn map_rows(c: usize) -> usize {
    (MAP_ELEMS / c.max(1)).max(1)
}

/// Mean and M2 of channels lo..lo+w (w ≤ LANES) of one block [r, c], around
/// the block's f32 mean m: d1 = Σ(x - m), d2 = Σ(x - m)² (the corrected
/// two-pass algorithm), so mean = m + d1/r and M2 = d2 - d1²/r.
#[inline(always)]
fn block_stats_group(blk: &[f32], c: usize, lo: usize, w: usize, pm: &mut [f64], pm2: &mut [f64]) {
    let r = blk.len() / c;
    let mut m = [0.0f32; LANES];
    for row in blk.chunks_exact(c) {
        for (a, &v) in m[..w].iter_mut().zip(&row[lo..lo + w]) {
            *a += v;
        }
    }
    let inv_r = 1.0 / r as f32;
    for a in m[..w].iter_mut() {
        *a *= inv_r;
    }
    let mut d1 = [0.0f32; LANES];
    let mut d2 = [0.0f32; LANES];
    for row in blk.chunks_exact(c) {
        for (((a1, a2), &v), &mu) in d1[..w]
            .iter_mut()
            .zip(d2[..w].iter_mut())
            .zip(&row[lo..lo + w])
            .zip(&m[..w])
        {
            let d = v - mu;
            *a1 += d;
            *a2 += d * d;
        }
    }
    let r = r as f64;
    for i in 0..w {
        let d1 = d1[i] as f64;
        pm[lo + i] = m[i] as f64 + d1 / r;
        pm2[lo + i] = (d2[i] as f64 - d1 * d1 / r).max(0.0);
    }
}

/// Per-channel mean and M2 = Σ(x - mean)² over the rows of `x` ([rows, c]):
/// per-block statistics (in parallel, fixed block boundaries) merged with
/// Chan's formula in f64, in block order.
fn channel_mean_m2(x: &[f32], c: usize) -> (Vec<f64>, Vec<f64>) {
    let rows = x.len() / c;
    let rpb = block_rows(c);
    let nblocks = rows.div_ceil(rpb);
    // Per block: [mean; c] then [m2; c].
    let mut partial = vec![0.0f64; nblocks * 2 * c];
    partial
        .par_chunks_mut(2 * c)
        .zip(x.par_chunks(rpb * c))
        .for_each(|(p, blk)| {
            let (pm, pm2) = p.split_at_mut(c);
            let mut lo = 0;
            while lo + LANES <= c {
                block_stats_group(blk, c, lo, LANES, pm, pm2);
                lo += LANES;
            }
            if lo < c {
                block_stats_group(blk, c, lo, c - lo, pm, pm2);
            }
        });
    let mut mean = vec![0.0f64; c];
    let mut m2 = vec![0.0f64; c];
    let mut count = 0.0f64;
    for (b, p) in partial.chunks_exact(2 * c).enumerate() {
        let r = (rows - b * rpb).min(rpb) as f64;
        let (pm, pm2) = p.split_at(c);
        let total = count + r;
        for ch in 0..c {
            let delta = pm[ch] - mean[ch];
            mean[ch] += delta * r / total;
            m2[ch] += pm2[ch] + delta * delta * count * r / total;
        }
        count = total;
    }
    (mean, m2)
}

/// The scale and bias a training forward normalised with, kept when a ReLU
/// was fused: the ReLU passed the gradient where (x - mean)·scale + bias > 0.
struct ReluMask<'a> {
    scale: &'a [f32],
    bias: &'a [f32],
}

/// Σg and Σg·(x - mean) of channels lo..lo+w (w ≤ LANES) of one block; with
/// `RELU`, g is first zeroed where the fused ReLU was off.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn block_grad_group<const RELU: bool>(
    gb: &[f32],
    xb: &[f32],
    mean: &[f32],
    mask: &ReluMask,
    c: usize,
    lo: usize,
    w: usize,
    sg: &mut [f64],
    sgx: &mut [f64],
) {
    let mut mu = [0.0f32; LANES];
    mu[..w].copy_from_slice(&mean[lo..lo + w]);
    let mut scale = [0.0f32; LANES];
    let mut bias = [0.0f32; LANES];
    if RELU {
        scale[..w].copy_from_slice(&mask.scale[lo..lo + w]);
        bias[..w].copy_from_slice(&mask.bias[lo..lo + w]);
    }
    let mut a = [0.0f32; LANES];
    let mut b = [0.0f32; LANES];
    for (grow, xrow) in gb.chunks_exact(c).zip(xb.chunks_exact(c)) {
        for (((((a, b), &gv), &xv), &mu), (&s, &beta)) in a[..w]
            .iter_mut()
            .zip(b[..w].iter_mut())
            .zip(&grow[lo..lo + w])
            .zip(&xrow[lo..lo + w])
            .zip(&mu[..w])
            .zip(scale[..w].iter().zip(&bias[..w]))
        {
            let d = xv - mu;
            // The forward's expression, so the mask is the unfused ReLU's.
            let gv = if !RELU || d * s + beta > 0.0 { gv } else { 0.0 };
            *a += gv;
            *b += gv * d;
        }
    }
    for i in 0..w {
        sg[lo + i] = a[i] as f64;
        sgx[lo + i] = b[i] as f64;
    }
}

/// Per-channel Σg and Σg·(x - mean) over the rows of `g` and `x` (g masked
/// by the fused ReLU when there is one), blocked and combined in block order
/// like `channel_mean_m2`.
fn channel_grad_sums(
    g: &[f32],
    x: &[f32],
    mean: &[f32],
    mask: Option<&ReluMask>,
    c: usize,
) -> (Vec<f64>, Vec<f64>) {
    let rows = x.len() / c;
    let rpb = block_rows(c);
    let nblocks = rows.div_ceil(rpb);
    let none = ReluMask {
        scale: &[],
        bias: &[],
    };
    let mut partial = vec![0.0f64; nblocks * 2 * c];
    partial
        .par_chunks_mut(2 * c)
        .zip(g.par_chunks(rpb * c).zip(x.par_chunks(rpb * c)))
        .for_each(|(p, (gb, xb))| {
            let (sg, sgx) = p.split_at_mut(c);
            let group = |lo: usize, w: usize, sg: &mut [f64], sgx: &mut [f64]| match mask {
                Some(m) => block_grad_group::<true>(gb, xb, mean, m, c, lo, w, sg, sgx),
                None => block_grad_group::<false>(gb, xb, mean, &none, c, lo, w, sg, sgx),
            };
            let mut lo = 0;
            while lo + LANES <= c {
                group(lo, LANES, sg, sgx);
                lo += LANES;
            }
            if lo < c {
                group(lo, c - lo, sg, sgx);
            }
        });
    let mut sum_g = vec![0.0f64; c];
    let mut sum_gx = vec![0.0f64; c];
    for p in partial.chunks_exact(2 * c) {
        let (a, b) = p.split_at(c);
        for ch in 0..c {
            sum_g[ch] += a[ch];
            sum_gx[ch] += b[ch];
        }
    }
    (sum_g, sum_gx)
}

/// What the normalising pass does to (x - shift)·scale + bias before it
/// writes it: nothing, a ReLU, or add a residual block's input then a ReLU.
#[derive(Clone, Copy)]
enum Epilogue<'a> {
    None,
    Relu,
    AddRelu(&'a [f32]),
}

/// out[r, ch] = epilogue((x[r, ch] - shift[ch]) * scale[ch] + bias[ch]).
// `usize::is_multiple_of` needs Rust 1.87; the workspace supports 1.85.
#[allow(clippy::manual_is_multiple_of)]
fn affine(
    shape: &[usize],
    x: &[f32],
    c: usize,
    [shift, scale, bias]: [&[f32]; 3],
    epilogue: Epilogue,
) -> Result<Tensor> {
    assert!(
        x.len() % c == 0 && shift.len() == c && scale.len() == c && bias.len() == c,
        "batch_norm affine: inconsistent lengths"
    );
    if let Epilogue::AddRelu(skip) = epilogue {
        assert_eq!(skip.len(), x.len(), "batch_norm affine: skip length");
    }
    // One row loop per epilogue, so that each stays a straight vector loop.
    // SAFETY: chunks are whole rows (the chunk size and x.len() are multiples
    // of c, chunk offsets too), each row of `out` is zipped with a row of x and
    // parameter slices of exactly c elements, so every element is written.
    unsafe {
        par_build(shape, map_rows(c) * c, |offset, out| {
            let x = &x[offset..offset + out.len()];
            match epilogue {
                Epilogue::None => normalise_rows(out, x, c, [shift, scale, bias], |t| t),
                Epilogue::Relu => normalise_rows(out, x, c, [shift, scale, bias], relu),
                Epilogue::AddRelu(skip) => {
                    let skip = &skip[offset..offset + out.len()];
                    normalise_rows_with(out, x, skip, c, [shift, scale, bias])
                }
            }
        })
    }
}

/// The rows of `affine` for an elementwise epilogue `f(t, _)`.
#[inline(always)]
fn normalise_rows(
    out: &mut [MaybeUninit<f32>],
    x: &[f32],
    c: usize,
    [shift, scale, bias]: [&[f32]; 3],
    f: impl Fn(f32) -> f32,
) {
    for (orow, xrow) in out.chunks_exact_mut(c).zip(x.chunks_exact(c)) {
        for ((((y, &v), &m), &s), &b) in orow.iter_mut().zip(xrow).zip(shift).zip(scale).zip(bias) {
            y.write(f((v - m) * s + b));
        }
    }
}

/// The rows of `affine` for the residual tail: relu(t + skip).
#[inline(always)]
fn normalise_rows_with(
    out: &mut [MaybeUninit<f32>],
    x: &[f32],
    skip: &[f32],
    c: usize,
    [shift, scale, bias]: [&[f32]; 3],
) {
    for ((orow, xrow), srow) in out
        .chunks_exact_mut(c)
        .zip(x.chunks_exact(c))
        .zip(skip.chunks_exact(c))
    {
        for (((((y, &v), &k), &m), &s), &b) in orow
            .iter_mut()
            .zip(xrow)
            .zip(srow)
            .zip(shift)
            .zip(scale)
            .zip(bias)
        {
            y.write(relu((v - m) * s + b + k));
        }
    }
}

/// dx[r, ch] = k[ch]·g + b[ch]·(x - mean[ch]) + d[ch], with g zeroed where
/// the fused ReLU (if any) was off.
#[allow(clippy::manual_is_multiple_of, clippy::too_many_arguments)]
fn input_grad(
    shape: &[usize],
    g: &[f32],
    x: &[f32],
    c: usize,
    mean: &[f32],
    mask: Option<&ReluMask>,
    [k, b, d]: [&[f32]; 3],
) -> Result<Tensor> {
    assert!(
        x.len() % c == 0 && g.len() == x.len() && [mean, k, b, d].iter().all(|p| p.len() == c),
        "batch_norm backward: inconsistent lengths"
    );
    if let Some(m) = mask {
        assert!(
            m.scale.len() == c && m.bias.len() == c,
            "batch_norm backward: mask"
        );
    }
    // SAFETY: as in `affine`: whole rows, every zip has exactly c elements.
    unsafe {
        par_build(shape, map_rows(c) * c, |offset, out| {
            let x = &x[offset..offset + out.len()];
            let g = &g[offset..offset + out.len()];
            match mask {
                None => input_grad_rows::<false>(out, g, x, c, mean, (&[], &[]), [k, b, d]),
                Some(m) => {
                    input_grad_rows::<true>(out, g, x, c, mean, (m.scale, m.bias), [k, b, d])
                }
            }
        })
    }
}

#[inline(always)]
fn input_grad_rows<const RELU: bool>(
    out: &mut [MaybeUninit<f32>],
    g: &[f32],
    x: &[f32],
    c: usize,
    mean: &[f32],
    (scale, bias): (&[f32], &[f32]),
    [k, b, d]: [&[f32]; 3],
) {
    for ((orow, grow), xrow) in out
        .chunks_exact_mut(c)
        .zip(g.chunks_exact(c))
        .zip(x.chunks_exact(c))
    {
        // Two loops rather than one with an unread mask: the unfused path
        // keeps its original six-way zip.
        if RELU {
            for (((((((o, &gv), &xv), &mu), &kk), &bb), &dd), (&s, &beta)) in orow
                .iter_mut()
                .zip(grow)
                .zip(xrow)
                .zip(mean)
                .zip(k)
                .zip(b)
                .zip(d)
                .zip(scale.iter().zip(bias))
            {
                let diff = xv - mu;
                let gv = if diff * s + beta > 0.0 { gv } else { 0.0 };
                o.write(kk * gv + bb * diff + dd);
            }
        } else {
            for ((((((o, &gv), &xv), &mu), &kk), &bb), &dd) in orow
                .iter_mut()
                .zip(grow)
                .zip(xrow)
                .zip(mean)
                .zip(k)
                .zip(b)
                .zip(d)
            {
                o.write(kk * gv + bb * (xv - mu) + dd);
            }
        }
    }
}

struct Saved {
    input: Tensor,
    mean: Vec<f32>,
    inv_std: Vec<f32>,
    /// With a fused ReLU: the forward's scale and bias, for its mask.
    relu: Option<(Vec<f32>, Vec<f32>)>,
}

pub struct BatchNorm2d {
    pub(crate) channels: usize,
    pub(crate) momentum: f32,
    pub(crate) eps: f32,
    gamma: Param,
    beta: Param,
    running_mean: Tensor,
    running_var: Tensor,
    saved: Option<Saved>,
    /// Recompute mode: training forwards leave the running statistics alone.
    recompute: bool,
    /// A ReLU fused into this layer (`with_relu`).
    pub(crate) relu: bool,
}

impl BatchNorm2d {
    pub fn new(name: &str, channels: usize, momentum: f32, eps: f32) -> Self {
        // γ and the running variance start equal but are separate buffers
        // (a shared one would be copied on the first update, mid-step).
        let ones = || Tensor::from_vec_unbudgeted(&[channels], vec![1.0; channels]);
        Self {
            channels,
            momentum,
            eps,
            gamma: Param::new(format!("{name}.gamma"), ones(), false),
            beta: Param::new(format!("{name}.beta"), Tensor::zeros(&[channels]), false),
            running_mean: Tensor::zeros(&[channels]),
            running_var: ones(),
            saved: None,
            recompute: false,
            relu: false,
        }
    }

    /// The same layer followed by a ReLU, in one pass (see the module notes).
    pub fn with_relu(mut self) -> Self {
        self.relu = true;
        self
    }

    /// relu(bn(input) + skip) in one pass: the tail of a residual block.
    /// The caller masks the gradient with the output before `backward`,
    /// which then sees a plain batch norm. Needs a layer without `with_relu`.
    pub fn forward_add_relu(
        &mut self,
        input: &Tensor,
        skip: &Tensor,
        mode: Mode,
    ) -> Result<Tensor> {
        if self.relu {
            return Err(ModelError::State(
                "batch_norm: forward_add_relu on a layer that already ends in a ReLU".into(),
            ));
        }
        skip.expect_shape("batch_norm residual add", input.shape())?;
        self.forward_with(input, Epilogue::AddRelu(skip.data()), mode)
    }

    fn forward_with(&mut self, input: &Tensor, epilogue: Epilogue, mode: Mode) -> Result<Tensor> {
        self.saved = None;
        let rows = self.rows(input.shape())?;
        self.check_state()?;
        if self.channels == 0 {
            return Ok(input.clone());
        }
        match mode {
            Mode::Train => self.forward_train(input, rows, epilogue),
            Mode::Eval => self.forward_eval(input, epilogue),
        }
    }

    /// Checks an NHWC batch with our channel count; returns the row count
    /// N·H·W.
    fn rows(&self, shape: &[usize]) -> Result<usize> {
        match *shape {
            [n, h, w, c] if c == self.channels => Ok(n * h * w),
            _ => Err(ModelError::Shape {
                op: "batch_norm",
                expected: format!("[n, h, w, {}]", self.channels),
                got: format!("{shape:?}"),
            }),
        }
    }

    /// Parameters and buffers are replaced wholesale by checkpoint loading;
    /// a mismatch is an error here rather than a panic in a kernel.
    fn check_state(&self) -> Result<()> {
        let c = self.channels;
        let tensors = [
            (&self.gamma.value, "gamma"),
            (&self.gamma.grad, "gamma gradient"),
            (&self.beta.value, "beta"),
            (&self.beta.grad, "beta gradient"),
            (&self.running_mean, "running_mean"),
            (&self.running_var, "running_var"),
        ];
        for (t, what) in tensors {
            if t.shape() != [c] {
                return Err(ModelError::State(format!(
                    "batch_norm {what} has shape {:?}, expected [{c}]",
                    t.shape()
                )));
            }
        }
        Ok(())
    }

    fn forward_train(&mut self, input: &Tensor, rows: usize, epilogue: Epilogue) -> Result<Tensor> {
        let c = self.channels;
        if rows < 2 {
            return Err(ModelError::Shape {
                op: "batch_norm",
                expected: "more than one value per channel in training (n·h·w ≥ 2)".into(),
                got: format!("{:?}", input.shape()),
            });
        }
        let x = input.data();
        let (mean, m2) = channel_mean_m2(x, c);
        let count = rows as f64;
        let eps = self.eps as f64;
        let inv_std: Vec<f32> = m2
            .iter()
            .map(|&m2| (1.0 / (m2 / count + eps).sqrt()) as f32)
            .collect();
        let mean32: Vec<f32> = mean.iter().map(|&m| m as f32).collect();
        let scale: Vec<f32> = inv_std
            .iter()
            .zip(self.gamma.value.data())
            .map(|(&s, &g)| s * g)
            .collect();
        let beta = self.beta.value.data();
        let out = affine(input.shape(), x, c, [&mean32, &scale, beta], epilogue)?;
        let relu = matches!(epilogue, Epilogue::Relu).then(|| (scale, beta.to_vec()));

        if !self.recompute {
            let mom = self.momentum as f64;
            for (r, &m) in self.running_mean.data_mut().iter_mut().zip(&mean) {
                *r = ((1.0 - mom) * *r as f64 + mom * m) as f32;
            }
            for (r, &m2) in self.running_var.data_mut().iter_mut().zip(&m2) {
                let unbiased = m2 / (count - 1.0);
                *r = ((1.0 - mom) * *r as f64 + mom * unbiased) as f32;
            }
        }
        self.saved = Some(Saved {
            input: input.clone(),
            mean: mean32,
            inv_std,
            relu,
        });
        Ok(out)
    }

    fn forward_eval(&mut self, input: &Tensor, epilogue: Epilogue) -> Result<Tensor> {
        let eps = self.eps as f64;
        let scale: Vec<f32> = self
            .running_var
            .data()
            .iter()
            .zip(self.gamma.value.data())
            .map(|(&v, &g)| (g as f64 / (v as f64 + eps).sqrt()) as f32)
            .collect();
        self.saved = None;
        affine(
            input.shape(),
            input.data(),
            self.channels,
            [self.running_mean.data(), &scale, self.beta.value.data()],
            epilogue,
        )
    }
}

impl Layer for BatchNorm2d {
    cuda_form!(crate::ops::batch_norm::layer::BatchNormGpu::from_cpu);

    fn describe(&self) -> String {
        let relu = if self.relu { "+relu" } else { "" };
        format!("bn{relu} {}", self.channels)
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        match *input {
            [_, _, c] if c == self.channels => Ok(input.to_vec()),
            _ => Err(ModelError::Shape {
                op: "batch_norm",
                expected: format!("an image [h, w, {}]", self.channels),
                got: format!("{input:?}"),
            }),
        }
    }

    /// Elementwise: counts 0, like the other non-GEMM layers.
    fn macs(&self, input: &[usize]) -> Result<u64> {
        self.output_shape(input)?;
        Ok(0)
    }

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        let epilogue = if self.relu {
            Epilogue::Relu
        } else {
            Epilogue::None
        };
        self.forward_with(input, epilogue, mode)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let Saved {
            input,
            mean,
            inv_std,
            relu,
        } = self
            .saved
            .take()
            .ok_or(ModelError::NoSavedActivation { op: "batch_norm" })?;
        grad_output.expect_shape("batch_norm backward", input.shape())?;
        self.check_state()?;
        let c = self.channels;
        let rows = input.len() / c;
        let x = input.data();
        let g = grad_output.data();
        let mask = relu.as_ref().map(|(scale, bias)| ReluMask { scale, bias });
        let (sum_g, sum_gx) = channel_grad_sums(g, x, &mean, mask.as_ref(), c);

        // dβ = Σg, dγ = Σg·x̂ = inv_std·Σg·(x - mean)
        // dx = γ·inv_std/M · (M·g - dβ - x̂·dγ)
        //    = k·g + b·(x - mean) + d with k = γ·inv_std,
        //      b = -k·inv_std·dγ/M, d = -k·dβ/M.
        let m = rows as f64;
        let mut k = vec![0.0f32; c];
        let mut b = vec![0.0f32; c];
        let mut d = vec![0.0f32; c];
        {
            let gamma = self.gamma.value.data();
            let dgamma_acc = self.gamma.grad.data_mut();
            for ch in 0..c {
                let s = inv_std[ch] as f64;
                let dgamma = s * sum_gx[ch];
                let dbeta = sum_g[ch];
                let kk = gamma[ch] as f64 * s;
                k[ch] = kk as f32;
                b[ch] = (-kk * s * dgamma / m) as f32;
                d[ch] = (-kk * dbeta / m) as f32;
                dgamma_acc[ch] += dgamma as f32;
            }
        }
        for (acc, &s) in self.beta.grad.data_mut().iter_mut().zip(&sum_g) {
            *acc += s as f32;
        }

        input_grad(input.shape(), g, x, c, &mean, mask.as_ref(), [&k, &b, &d])
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        vec![&mut self.gamma, &mut self.beta]
    }

    fn buffers_mut(&mut self) -> Vec<&mut Tensor> {
        vec![&mut self.running_mean, &mut self.running_var]
    }

    fn clear_saved(&mut self) {
        self.saved = None;
    }

    fn set_recompute(&mut self, on: bool) {
        self.recompute = on;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::check_layer;
    use crate::init::InitRng;

    /// Channel ch has mean `offset * (ch + 1)` and std `spread * (1 + ch/2)`.
    fn random(shape: &[usize], seed: u64, offset: f32, spread: f32) -> Tensor {
        let mut rng = InitRng::new(seed);
        let c = *shape.last().unwrap();
        let len: usize = shape.iter().product();
        let data = (0..len)
            .map(|i| {
                let ch = (i % c) as f32;
                offset * (ch + 1.0) + spread * (1.0 + ch / 2.0) * rng.normal() as f32
            })
            .collect();
        Tensor::from_vec(shape, data).unwrap()
    }

    /// Per-channel mean and biased variance in f64, the obvious way.
    fn reference_stats(x: &Tensor) -> (Vec<f64>, Vec<f64>) {
        let c = *x.shape().last().unwrap();
        let rows = x.len() / c;
        let mut mean = vec![0.0; c];
        for (i, &v) in x.data().iter().enumerate() {
            mean[i % c] += v as f64 / rows as f64;
        }
        let mut var = vec![0.0; c];
        for (i, &v) in x.data().iter().enumerate() {
            var[i % c] += (v as f64 - mean[i % c]).powi(2) / rows as f64;
        }
        (mean, var)
    }

    fn set_affine(bn: &mut BatchNorm2d, seed: u64) {
        let mut rng = InitRng::new(seed);
        for v in bn.gamma.value.data_mut() {
            *v = 0.5 + rng.uniform() as f32;
        }
        for v in bn.beta.value.data_mut() {
            *v = rng.normal() as f32;
        }
    }

    #[test]
    fn params_and_buffers_are_named_and_initialised() {
        let mut bn = BatchNorm2d::new("model.layers[1]", 3, 0.1, 1e-5);
        assert_eq!(bn.describe(), "bn 3");
        let params = bn.params_mut();
        assert_eq!(params[0].name, "model.layers[1].gamma");
        assert_eq!(params[1].name, "model.layers[1].beta");
        assert!(params.iter().all(|p| !p.decay));
        assert_eq!(params[0].value.data(), &[1.0, 1.0, 1.0]);
        assert_eq!(params[1].value.data(), &[0.0, 0.0, 0.0]);
        let buffers = bn.buffers_mut();
        assert_eq!(buffers.len(), 2);
        assert_eq!(buffers[0].data(), &[0.0, 0.0, 0.0]);
        assert_eq!(buffers[1].data(), &[1.0, 1.0, 1.0]);
    }

    #[test]
    fn gradient_matches_finite_differences_in_train_mode() {
        let mut bn = BatchNorm2d::new("bn", 3, 0.1, 1e-5);
        set_affine(&mut bn, 5);
        let x = random(&[4, 3, 3, 3], 1, 0.5, 1.0);
        let report = check_layer(&mut bn, &x, 1e-2, 1e-2);
        assert!(report.is_ok(), "{}", report.unwrap_err());
    }

    #[test]
    fn gradient_matches_finite_differences_with_many_blocks() {
        // 600 rows of 4 channels: three reduction blocks, the last partial.
        // The loss sums 2400 f32 outputs, so a larger step keeps its
        // rounding noise (~1e-6 / eps) well below the tolerance; BN is
        // smooth enough at this spread for the truncation error to stay tiny.
        let mut bn = BatchNorm2d::new("bn", 4, 0.1, 1e-5);
        set_affine(&mut bn, 6);
        let x = random(&[6, 10, 10, 4], 2, 1.0, 2.0);
        assert!(600 > 2 * block_rows(4));
        let report = check_layer(&mut bn, &x, 5e-2, 1e-2);
        assert!(report.is_ok(), "{}", report.unwrap_err());
    }

    #[test]
    fn train_output_is_normalised_per_channel() {
        // Large offsets relative to the spread: naive E[x²] - E[x]² in f32
        // would lose most digits here.
        let mut bn = BatchNorm2d::new("bn", 8, 0.1, 1e-5);
        let x = random(&[16, 28, 28, 8], 3, 100.0, 2.0);
        let y = bn.forward(&x, Mode::Train).unwrap();
        let (mean, var) = reference_stats(&y);
        for ch in 0..8 {
            assert!(mean[ch].abs() < 1e-4, "channel {ch} mean {}", mean[ch]);
            assert!((var[ch] - 1.0).abs() < 1e-3, "channel {ch} var {}", var[ch]);
        }
    }

    #[test]
    fn train_forward_matches_a_reference_with_gamma_and_beta() {
        let mut bn = BatchNorm2d::new("bn", 5, 0.1, 1e-3);
        set_affine(&mut bn, 9);
        let x = random(&[3, 17, 19, 5], 4, -3.0, 0.7);
        let y = bn.forward(&x, Mode::Train).unwrap();
        let (mean, var) = reference_stats(&x);
        let gamma = bn.gamma.value.data().to_vec();
        let beta = bn.beta.value.data().to_vec();
        for (i, (&xv, &yv)) in x.data().iter().zip(y.data()).enumerate() {
            let ch = i % 5;
            let expected = (xv as f64 - mean[ch]) / (var[ch] + 1e-3).sqrt() * gamma[ch] as f64
                + beta[ch] as f64;
            assert!(
                (yv as f64 - expected).abs() < 1e-4,
                "{yv} vs {expected} at {i}"
            );
        }
    }

    #[test]
    fn running_stats_follow_the_pytorch_rule() {
        let momentum = 0.3;
        let mut bn = BatchNorm2d::new("bn", 3, momentum, 1e-5);
        let x = random(&[4, 5, 5, 3], 7, 2.0, 1.5);
        bn.forward(&x, Mode::Train).unwrap();
        let (mean, var) = reference_stats(&x);
        let m = x.len() as f64 / 3.0;
        let rm = bn.running_mean.data().to_vec();
        let rv = bn.running_var.data().to_vec();
        for ch in 0..3 {
            let expected_mean = (1.0 - momentum as f64) * 0.0 + momentum as f64 * mean[ch];
            let unbiased = var[ch] * m / (m - 1.0);
            let expected_var = (1.0 - momentum as f64) * 1.0 + momentum as f64 * unbiased;
            assert!(
                (rm[ch] as f64 - expected_mean).abs() < 1e-5,
                "{} vs {expected_mean}",
                rm[ch]
            );
            assert!(
                (rv[ch] as f64 - expected_var).abs() < 1e-5,
                "{} vs {expected_var}",
                rv[ch]
            );
        }
        // A second step blends again from the updated values.
        let x2 = random(&[4, 5, 5, 3], 8, -1.0, 0.5);
        bn.forward(&x2, Mode::Train).unwrap();
        let (mean2, var2) = reference_stats(&x2);
        for ch in 0..3 {
            let expected = 0.7 * rm[ch] as f64 + 0.3 * mean2[ch];
            assert!((bn.running_mean.data()[ch] as f64 - expected).abs() < 1e-5);
            let expected = 0.7 * rv[ch] as f64 + 0.3 * var2[ch] * m / (m - 1.0);
            assert!((bn.running_var.data()[ch] as f64 - expected).abs() < 1e-5);
        }
    }

    #[test]
    fn eval_uses_running_stats_and_saves_nothing() {
        let mut bn = BatchNorm2d::new("bn", 2, 0.1, 1e-5);
        bn.running_mean = Tensor::from_vec(&[2], vec![1.0, -2.0]).unwrap();
        bn.running_var = Tensor::from_vec(&[2], vec![4.0, 0.25]).unwrap();
        bn.gamma.value = Tensor::from_vec(&[2], vec![2.0, 1.0]).unwrap();
        bn.beta.value = Tensor::from_vec(&[2], vec![0.5, 0.0]).unwrap();
        let x = Tensor::from_vec(&[1, 1, 2, 2], vec![3.0, -2.0, 1.0, -1.0]).unwrap();
        let y = bn.forward(&x, Mode::Eval).unwrap();
        let expected = [
            (3.0 - 1.0) / (4.0f64 + 1e-5).sqrt() * 2.0 + 0.5,
            0.0,
            0.5,
            1.0 / (0.25f64 + 1e-5).sqrt(),
        ];
        for (a, e) in y.data().iter().zip(expected) {
            assert!((*a as f64 - e).abs() < 1e-5, "{a} vs {e}");
        }
        // Running stats untouched, nothing saved.
        assert_eq!(bn.running_mean.data(), &[1.0, -2.0]);
        assert_eq!(bn.running_var.data(), &[4.0, 0.25]);
        let err = bn.backward(&y).unwrap_err();
        assert!(matches!(
            err,
            ModelError::NoSavedActivation { op: "batch_norm" }
        ));
    }

    #[test]
    fn backward_matches_a_reference_and_accumulates() {
        let mut bn = BatchNorm2d::new("bn", 6, 0.1, 1e-5);
        set_affine(&mut bn, 10);
        let x = random(&[5, 9, 11, 6], 11, 0.3, 1.2);
        let g = random(&[5, 9, 11, 6], 12, 0.1, 1.0);
        bn.forward(&x, Mode::Train).unwrap();
        let dx = bn.backward(&g).unwrap();

        let (mean, var) = reference_stats(&x);
        let c = 6;
        let m = (x.len() / c) as f64;
        let inv: Vec<f64> = var.iter().map(|v| 1.0 / (v + 1e-5).sqrt()).collect();
        let mut dbeta = vec![0.0f64; c];
        let mut dgamma = vec![0.0f64; c];
        for (i, (&gv, &xv)) in g.data().iter().zip(x.data()).enumerate() {
            let ch = i % c;
            dbeta[ch] += gv as f64;
            dgamma[ch] += gv as f64 * (xv as f64 - mean[ch]) * inv[ch];
        }
        let gamma = bn.gamma.value.data().to_vec();
        for (i, ((&gv, &xv), &got)) in g.data().iter().zip(x.data()).zip(dx.data()).enumerate() {
            let ch = i % c;
            let xhat = (xv as f64 - mean[ch]) * inv[ch];
            let expected =
                gamma[ch] as f64 * inv[ch] / m * (m * gv as f64 - dbeta[ch] - xhat * dgamma[ch]);
            assert!(
                (got as f64 - expected).abs() < 1e-4,
                "{got} vs {expected} at {i}"
            );
        }
        for ch in 0..c {
            assert!((bn.gamma.grad.data()[ch] as f64 - dgamma[ch]).abs() < 1e-3);
            assert!((bn.beta.grad.data()[ch] as f64 - dbeta[ch]).abs() < 1e-3);
        }
        // A second backward adds to the parameter gradients.
        bn.forward(&x, Mode::Train).unwrap();
        bn.backward(&g).unwrap();
        for ch in 0..c {
            assert!((bn.gamma.grad.data()[ch] as f64 - 2.0 * dgamma[ch]).abs() < 2e-3);
            assert!((bn.beta.grad.data()[ch] as f64 - 2.0 * dbeta[ch]).abs() < 2e-3);
        }
    }

    #[test]
    fn results_are_bit_identical_whatever_the_thread_count() {
        let x = random(&[32, 28, 28, 32], 13, 0.5, 1.0);
        let g = random(&[32, 28, 28, 32], 14, 0.0, 1.0);
        let run = || {
            let mut bn = BatchNorm2d::new("bn", 32, 0.1, 1e-5);
            let y = bn.forward(&x, Mode::Train).unwrap();
            let dx = bn.backward(&g).unwrap();
            let grads: Vec<Vec<f32>> = bn
                .params_mut()
                .iter()
                .map(|p| p.grad.data().to_vec())
                .collect();
            let bufs: Vec<Vec<f32>> = bn.buffers_mut().iter().map(|b| b.data().to_vec()).collect();
            (y.into_vec(), dx.into_vec(), grads, bufs)
        };
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap()
            .install(run);
        let three = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap()
            .install(run);
        let default = run();
        assert!(
            one == three && one == default,
            "results depend on scheduling"
        );
    }

    #[test]
    fn mismatched_loaded_state_is_an_error_not_a_panic() {
        let mut bn = BatchNorm2d::new("bn", 4, 0.1, 1e-5);
        *bn.buffers_mut()[1] = Tensor::zeros(&[3]);
        let x = random(&[2, 3, 3, 4], 1, 0.0, 1.0);
        let err = bn.forward(&x, Mode::Eval).unwrap_err();
        assert!(matches!(err, ModelError::State(_)), "{err}");
        assert!(err.to_string().contains("running_var"), "{err}");
    }

    #[test]
    fn shape_errors_name_the_op() {
        let mut bn = BatchNorm2d::new("bn", 4, 0.1, 1e-5);
        let err = bn.output_shape(&[8, 8, 3]).unwrap_err();
        assert!(err.to_string().contains("batch_norm"), "{err}");
        let err = bn.output_shape(&[4]).unwrap_err();
        assert!(err.to_string().contains("batch_norm"), "{err}");
        assert_eq!(bn.output_shape(&[8, 8, 4]).unwrap(), vec![8, 8, 4]);
        let err = bn
            .forward(&Tensor::zeros(&[2, 4]), Mode::Train)
            .unwrap_err();
        assert!(err.to_string().contains("batch_norm"), "{err}");
        let err = bn
            .forward(&Tensor::zeros(&[2, 3, 3, 5]), Mode::Eval)
            .unwrap_err();
        assert!(err.to_string().contains("batch_norm"), "{err}");
        // One value per channel has no variance to normalise by.
        let err = bn
            .forward(&Tensor::zeros(&[1, 1, 1, 4]), Mode::Train)
            .unwrap_err();
        assert!(err.to_string().contains("more than one value"), "{err}");
        let err = bn.backward(&Tensor::zeros(&[2, 3, 3, 4])).unwrap_err();
        assert!(matches!(err, ModelError::NoSavedActivation { .. }));
        bn.forward(&random(&[2, 3, 3, 4], 1, 0.0, 1.0), Mode::Train)
            .unwrap();
        let err = bn.backward(&Tensor::zeros(&[2, 3, 3, 5])).unwrap_err();
        assert!(err.to_string().contains("batch_norm backward"), "{err}");
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.data().iter().map(|v| v.to_bits()).collect()
    }

    /// 20 channels: one full group of LANES and a partial one.
    #[test]
    fn fused_relu_matches_batch_norm_then_relu_bit_for_bit() {
        let shape = [3, 7, 9, 20];
        let x = random(&shape, 4, 0.2, 1.0);
        let g = random(&shape, 5, 0.0, 1.0);
        let mut plain = BatchNorm2d::new("bn", 20, 0.1, 1e-5);
        let mut fused = BatchNorm2d::new("bn", 20, 0.1, 1e-5).with_relu();
        set_affine(&mut plain, 3);
        set_affine(&mut fused, 3);
        let mut relu = crate::layers::Relu::new();
        for mode in [Mode::Train, Mode::Eval] {
            let want = relu
                .forward(&plain.forward(&x, mode).unwrap(), mode)
                .unwrap();
            let got = fused.forward(&x, mode).unwrap();
            assert_eq!(bits(&want), bits(&got), "{mode:?} forward");
            assert!(got.data().contains(&0.0) && got.data().iter().any(|&v| v > 0.0));
            if mode == Mode::Train {
                let want = plain.backward(&relu.backward(&g).unwrap()).unwrap();
                let got = fused.backward(&g).unwrap();
                assert_eq!(bits(&want), bits(&got), "input gradient");
                assert_eq!(bits(&plain.gamma.grad), bits(&fused.gamma.grad));
                assert_eq!(bits(&plain.beta.grad), bits(&fused.beta.grad));
            }
            assert_eq!(bits(&plain.running_mean), bits(&fused.running_mean));
            assert_eq!(bits(&plain.running_var), bits(&fused.running_var));
        }
        assert_eq!(fused.describe(), "bn+relu 20");
    }

    #[test]
    fn fused_relu_gradient_matches_finite_differences() {
        // Values near ±1 keep every output far from the ReLU's kink, where a
        // finite difference would straddle it; both sides occur.
        let mut bn = BatchNorm2d::new("bn", 3, 0.1, 1e-5).with_relu();
        for (i, p) in bn.params_mut().into_iter().enumerate() {
            for (j, v) in p.value.data_mut().iter_mut().enumerate() {
                *v = [0.8, 0.1][i] + 0.2 * j as f32;
            }
        }
        let x = crate::gradcheck::bimodal(&[4, 3, 3, 3], 8);
        let report = check_layer(&mut bn, &x, 1e-2, 1e-2);
        assert!(report.is_ok(), "{}", report.unwrap_err());
    }

    #[test]
    fn add_relu_matches_batch_norm_add_relu_bit_for_bit() {
        let shape = [2, 5, 6, 20];
        let x = random(&shape, 14, 0.1, 1.0);
        let skip = random(&shape, 15, 0.0, 1.0);
        let mut plain = BatchNorm2d::new("bn", 20, 0.1, 1e-5);
        let mut fused = BatchNorm2d::new("bn", 20, 0.1, 1e-5);
        set_affine(&mut plain, 9);
        set_affine(&mut fused, 9);
        for mode in [Mode::Train, Mode::Eval] {
            let mut want = plain.forward(&x, mode).unwrap();
            for (w, &s) in want.data_mut().iter_mut().zip(skip.data()) {
                *w = crate::ops::activation::relu::relu(*w + s);
            }
            let got = fused.forward_add_relu(&x, &skip, mode).unwrap();
            assert_eq!(bits(&want), bits(&got), "{mode:?}");
        }
        // The skip must have the input's shape; a ReLU cannot be fused twice.
        let err = fused
            .forward_add_relu(&x, &random(&[2, 5, 5, 20], 1, 0.0, 1.0), Mode::Train)
            .unwrap_err();
        assert!(err.to_string().contains("residual add"), "{err}");
        let mut twice = BatchNorm2d::new("bn", 20, 0.1, 1e-5).with_relu();
        assert!(twice.forward_add_relu(&x, &skip, Mode::Train).is_err());
    }
}
