//! Depthwise 2-D convolution in NHWC: each input channel is convolved with
//! its own `multiplier` k×k filters, never mixed with the other channels.
//!
//! Shapes: input x [N, H, W, C], weight [K, K, C·M] (M = `multiplier`):
//! output channel o = c·M + m reads input channel c = o / M with the filter
//! w[·, ·, o]; optional bias [C·M]; output y [N, OH, OW, C·M] with
//! OH = ⌊(H + 2·pad − K)/stride⌋ + 1 (OW alike), zero padding.
//! Initialisation: He (truncated normal, fan-in K·K: one input channel per
//! output) from the network's `InitRng` stream, bias zero.
//!
//! Arithmetic (the CUDA kernels, `depthwise.cu`, do exactly the
//! same, so f32 results are bit-identical): every sum starts at 0 and
//! accumulates with fused multiply-adds (`f32::mul_add`, CUDA's `fmaf`) in a
//! fixed order set by the shape, never by the threads:
//! - forward: taps (ky, then kx) inside the image, then + bias;
//! - input gradient: a gather per input pixel over taps (ky, then kx) that
//!   reach it from an output pixel, then the channel's M outputs in order;
//! - weight (and bias) gradient: per image, the output pixels in row-major
//!   order (a partial per image, tap and channel), then the images'
//!   partials added in image order and that sum added (+=) to the gradient.
//!
//! Memory: a training forward keeps its input (a reference-counted handle,
//! no copy). Backward makes N·(K·K + bias)·C·M floats of per-image partials.

use rayon::prelude::*;

use crate::init::InitRng;
use crate::memory::try_zeroed;
use crate::{Layer, Mode, ModelError, Param, Result, Tensor};

/// The shape of one depthwise convolution over a batch.
#[derive(Clone, Copy, Debug)]
struct Geom {
    n: usize,
    h: usize,
    w: usize,
    c: usize,
    m: usize,
    oh: usize,
    ow: usize,
    k: usize,
    stride: usize,
    pad: usize,
}

impl Geom {
    fn cout(&self) -> usize {
        self.c * self.m
    }

    /// Input row and column of output (oy, ox)'s tap (ky, kx), if inside.
    fn input_at(&self, oy: usize, ox: usize, ky: usize, kx: usize) -> Option<(usize, usize)> {
        let iy = (oy * self.stride + ky).checked_sub(self.pad)?;
        let ix = (ox * self.stride + kx).checked_sub(self.pad)?;
        (iy < self.h && ix < self.w).then_some((iy, ix))
    }

    /// Output index along one axis whose tap `t` reaches input `i`, if any.
    fn output_of(&self, i: usize, t: usize, out: usize) -> Option<usize> {
        let o = (i + self.pad).checked_sub(t)?;
        (o % self.stride == 0 && o / self.stride < out).then_some(o / self.stride)
    }
}

/// Output side of a depthwise convolution, or None when nothing fits.
pub fn depthwise_out_side(side: usize, kernel: usize, stride: usize, pad: usize) -> Option<usize> {
    if side == 0 || stride == 0 {
        return None;
    }
    let span = side.checked_add(pad.checked_mul(2)?)?.checked_sub(kernel)?;
    Some(span / stride + 1)
}

pub struct DepthwiseConv2d {
    name: String,
    pub(crate) c: usize,
    pub(crate) m: usize,
    pub(crate) k: usize,
    pub(crate) stride: usize,
    pub(crate) pad: usize,
    weight: Param,
    pub(crate) bias: Option<Param>,
    saved_input: Option<Tensor>,
}

impl DepthwiseConv2d {
    /// `channels` input channels, `multiplier` filters each; the weight
    /// [kernel, kernel, channels·multiplier] drawn from `rng`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        name: &str,
        channels: usize,
        multiplier: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
        bias: bool,
        rng: &mut InitRng,
    ) -> Result<Self> {
        let spec = |reason: String| ModelError::Spec {
            path: name.to_string(),
            reason,
        };
        if channels == 0 || multiplier == 0 || kernel == 0 || stride == 0 {
            return Err(spec(format!(
                "depthwise_conv needs positive channels, multiplier, kernel and stride, got \
                 {channels} channels, multiplier {multiplier}, kernel {kernel}, stride {stride}"
            )));
        }
        let kk = kernel
            .checked_mul(kernel)
            .ok_or_else(|| spec("kernel too large".into()))?;
        let len = channels
            .checked_mul(multiplier)
            .and_then(|cm| cm.checked_mul(kk))
            .ok_or_else(|| spec("weight too large".into()))?;
        let w = crate::init::he_truncated(rng, kk, len);
        let cout = channels * multiplier;
        let weight = Param::new(
            format!("{name}.weight"),
            Tensor::from_vec(&[kernel, kernel, cout], w)?,
            true,
        );
        let bias = bias.then(|| Param::new(format!("{name}.bias"), Tensor::zeros(&[cout]), false));
        Ok(Self {
            name: name.to_string(),
            c: channels,
            m: multiplier,
            k: kernel,
            stride,
            pad: padding,
            weight,
            bias,
            saved_input: None,
        })
    }

    fn shape_error(&self, expected: &str, got: &[usize]) -> ModelError {
        ModelError::Shape {
            op: "depthwise_conv",
            expected: format!("{expected} for {} ({})", self.name, self.describe()),
            got: format!("{got:?}"),
        }
    }

    fn geom(&self, input: &[usize]) -> Result<Geom> {
        let &[n, h, w, _] = input else {
            return Err(self.shape_error("[n, h, w, c]", input));
        };
        let out = self.output_shape(&input[1..])?;
        Ok(Geom {
            n,
            h,
            w,
            c: self.c,
            m: self.m,
            oh: out[0],
            ow: out[1],
            k: self.k,
            stride: self.stride,
            pad: self.pad,
        })
    }
}

/// y for x, w and bias (see the module's order of sums).
fn forward_into(g: &Geom, x: &[f32], w: &[f32], bias: Option<&[f32]>, y: &mut [f32]) {
    let cout = g.cout();
    let row = g.ow * cout;
    // One output row (image, oy) per task.
    y.par_chunks_mut(row).enumerate().for_each(|(r, yr)| {
        let (b, oy) = (r / g.oh, r % g.oh);
        let image = &x[b * g.h * g.w * g.c..(b + 1) * g.h * g.w * g.c];
        for ox in 0..g.ow {
            for o in 0..cout {
                let ci = o / g.m;
                let mut acc = 0.0f32;
                for ky in 0..g.k {
                    for kx in 0..g.k {
                        if let Some((iy, ix)) = g.input_at(oy, ox, ky, kx) {
                            let xv = image[(iy * g.w + ix) * g.c + ci];
                            acc = xv.mul_add(w[(ky * g.k + kx) * cout + o], acc);
                        }
                    }
                }
                if let Some(bias) = bias {
                    acc += bias[o];
                }
                yr[ox * cout + o] = acc;
            }
        }
    });
}

/// dx for dy and w: a gather per input pixel.
fn input_grad_into(g: &Geom, dy: &[f32], w: &[f32], dx: &mut [f32]) {
    let cout = g.cout();
    let row = g.w * g.c;
    dx.par_chunks_mut(row).enumerate().for_each(|(r, dr)| {
        let (b, iy) = (r / g.h, r % g.h);
        let grads = &dy[b * g.oh * g.ow * cout..(b + 1) * g.oh * g.ow * cout];
        for ix in 0..g.w {
            for ci in 0..g.c {
                let mut acc = 0.0f32;
                for ky in 0..g.k {
                    let Some(oy) = g.output_of(iy, ky, g.oh) else {
                        continue;
                    };
                    for kx in 0..g.k {
                        let Some(ox) = g.output_of(ix, kx, g.ow) else {
                            continue;
                        };
                        for mi in 0..g.m {
                            let o = ci * g.m + mi;
                            let gv = grads[(oy * g.ow + ox) * cout + o];
                            acc = gv.mul_add(w[(ky * g.k + kx) * cout + o], acc);
                        }
                    }
                }
                dr[ix * g.c + ci] = acc;
            }
        }
    });
}

/// Per-image partials [n, kk + bias, cout] of the weight (and bias)
/// gradient, then their sum in image order added to `dw` (and `db`).
fn param_grads(
    g: &Geom,
    x: &[f32],
    dy: &[f32],
    dw: &mut [f32],
    db: Option<&mut [f32]>,
) -> Result<()> {
    let cout = g.cout();
    let kk = g.k * g.k;
    let slots = kk + usize::from(db.is_some());
    let per_image = slots * cout;
    let mut partials = try_zeroed(g.n * per_image)?;
    partials
        .par_chunks_mut(per_image)
        .enumerate()
        .for_each(|(b, part)| {
            let image = &x[b * g.h * g.w * g.c..(b + 1) * g.h * g.w * g.c];
            let grads = &dy[b * g.oh * g.ow * cout..(b + 1) * g.oh * g.ow * cout];
            for (slot, ps) in part.chunks_exact_mut(cout).enumerate() {
                let (ky, kx) = (slot / g.k, slot % g.k);
                for (o, p) in ps.iter_mut().enumerate() {
                    let ci = o / g.m;
                    let mut acc = 0.0f32;
                    for oy in 0..g.oh {
                        for ox in 0..g.ow {
                            let gv = grads[(oy * g.ow + ox) * cout + o];
                            if slot == kk {
                                acc += gv;
                            } else if let Some((iy, ix)) = g.input_at(oy, ox, ky, kx) {
                                acc = image[(iy * g.w + ix) * g.c + ci].mul_add(gv, acc);
                            }
                        }
                    }
                    *p = acc;
                }
            }
        });
    let reduce = |out: &mut [f32], offset: usize| {
        out.par_iter_mut().enumerate().for_each(|(j, d)| {
            let mut acc = 0.0f32;
            for b in 0..g.n {
                acc += partials[b * per_image + offset + j];
            }
            *d += acc;
        });
    };
    reduce(dw, 0);
    if let Some(db) = db {
        reduce(db, kk * cout);
    }
    Ok(())
}

impl DepthwiseConv2d {
    fn take_saved(&mut self, grad_output: &Tensor) -> Result<(Geom, Tensor)> {
        let input = self
            .saved_input
            .take()
            .ok_or(ModelError::NoSavedActivation {
                op: "depthwise_conv",
            })?;
        let g = self.geom(input.shape())?;
        grad_output.expect_shape("depthwise_conv backward", &[g.n, g.oh, g.ow, g.cout()])?;
        Ok((g, input))
    }

    fn add_param_grads(&mut self, g: &Geom, input: &Tensor, dy: &Tensor) -> Result<()> {
        if g.n == 0 || g.oh * g.ow == 0 {
            return Ok(());
        }
        let db = self.bias.as_mut().map(|b| b.grad.data_mut());
        param_grads(g, input.data(), dy.data(), self.weight.grad.data_mut(), db)
    }
}

impl Layer for DepthwiseConv2d {
    cuda_form!(crate::ops::conv::layer::DepthwiseConvLayer::from_cpu);

    fn describe(&self) -> String {
        let channels = format!("{}x{}", self.c, self.m);
        super::cpu::describe_window("depthwise_conv", self.k, self.stride, self.pad, &channels)
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        let &[h, w, c] = input else {
            return Err(self.shape_error("[h, w, c]", input));
        };
        if c != self.c {
            return Err(self.shape_error(&format!("{} input channels", self.c), input));
        }
        let side = |d| depthwise_out_side(d, self.k, self.stride, self.pad);
        match (side(h), side(w)) {
            (Some(oh), Some(ow)) => Ok(vec![oh, ow, self.c * self.m]),
            _ => Err(self.shape_error(
                &format!(
                    "an input of at least {k}x{k} after padding {p}",
                    k = self.k,
                    p = self.pad
                ),
                input,
            )),
        }
    }

    fn macs(&self, input: &[usize]) -> Result<u64> {
        let out = self.output_shape(input)?;
        Ok((out[0] * out[1] * out[2] * self.k * self.k) as u64)
    }

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        self.saved_input = None;
        let g = self.geom(input.shape())?;
        let mut y = Tensor::try_zeros(&[g.n, g.oh, g.ow, g.cout()])?;
        if !y.is_empty() {
            let bias = self.bias.as_ref().map(|b| b.value.data());
            forward_into(
                &g,
                input.data(),
                self.weight.value.data(),
                bias,
                y.try_data_mut()?,
            );
        }
        if mode == Mode::Train {
            self.saved_input = Some(input.clone());
        }
        Ok(y)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let (g, input) = self.take_saved(grad_output)?;
        let mut dx = Tensor::try_zeros(input.shape())?;
        if !dx.is_empty() && g.oh * g.ow > 0 {
            input_grad_into(
                &g,
                grad_output.data(),
                self.weight.value.data(),
                dx.try_data_mut()?,
            );
        }
        self.add_param_grads(&g, &input, grad_output)?;
        Ok(dx)
    }

    fn backward_params_only(&mut self, grad_output: &Tensor) -> Result<()> {
        let (g, input) = self.take_saved(grad_output)?;
        self.add_param_grads(&g, &input, grad_output)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::check_layer;
    use crate::gradcheck::random_tensor as random;

    fn layer(
        c: usize,
        m: usize,
        k: usize,
        stride: usize,
        pad: usize,
        bias: bool,
    ) -> DepthwiseConv2d {
        let mut rng = InitRng::new(5);
        let mut l = DepthwiseConv2d::new("dw", c, m, k, stride, pad, bias, &mut rng).unwrap();
        if let Some(b) = l.bias.as_mut() {
            b.value = random(&[c * m], 6);
        }
        l
    }

    /// A direct evaluation of the definition, in f64.
    fn reference(l: &DepthwiseConv2d, x: &Tensor) -> Vec<f64> {
        let g = l.geom(x.shape()).unwrap();
        let (w, cout) = (l.weight.value.data(), g.cout());
        let mut y = Vec::new();
        for b in 0..g.n {
            for oy in 0..g.oh {
                for ox in 0..g.ow {
                    for o in 0..cout {
                        let mut acc = l.bias.as_ref().map_or(0.0, |p| p.value.data()[o] as f64);
                        for ky in 0..g.k {
                            for kx in 0..g.k {
                                let iy = (oy * g.stride + ky) as isize - g.pad as isize;
                                let ix = (ox * g.stride + kx) as isize - g.pad as isize;
                                if iy < 0 || ix < 0 || iy >= g.h as isize || ix >= g.w as isize {
                                    continue;
                                }
                                let xi =
                                    ((b * g.h + iy as usize) * g.w + ix as usize) * g.c + o / g.m;
                                acc += x.data()[xi] as f64 * w[(ky * g.k + kx) * cout + o] as f64;
                            }
                        }
                        y.push(acc);
                    }
                }
            }
        }
        y
    }

    #[test]
    fn forward_is_the_definition() {
        for (m, k, s, p, bias) in [(1, 3, 1, 1, false), (2, 3, 2, 1, true), (3, 2, 1, 0, true)] {
            let mut l = layer(4, m, k, s, p, bias);
            let x = random(&[2, 5, 6, 4], 7);
            let y = l.forward(&x, Mode::Eval).unwrap();
            let g = l.geom(x.shape()).unwrap();
            assert_eq!(y.shape(), &[g.n, g.oh, g.ow, g.cout()]);
            for (a, b) in y.data().iter().zip(reference(&l, &x)) {
                assert!((*a as f64 - b).abs() < 1e-5, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn the_weight_is_k_by_k_by_channels_times_multiplier_with_he_init() {
        let l = layer(3, 2, 3, 1, 1, true);
        assert_eq!(l.weight.value.shape(), &[3, 3, 6]);
        assert_eq!(l.bias.as_ref().unwrap().value.shape(), &[6]);
        // He: the same draws as he_truncated with fan-in k·k.
        let mut rng = InitRng::new(5);
        let want = crate::init::he_truncated(&mut rng, 9, 54);
        assert_eq!(l.weight.value.data(), &want[..]);
    }

    #[test]
    fn shapes_are_checked() {
        let l = layer(4, 2, 3, 2, 1, false);
        assert_eq!(l.output_shape(&[7, 8, 4]).unwrap(), vec![4, 4, 8]);
        let err = l.output_shape(&[7, 8, 5]).unwrap_err();
        assert!(err.to_string().contains("4 input channels"), "{err}");
        let err = layer(2, 1, 5, 1, 0, false)
            .output_shape(&[3, 9, 2])
            .unwrap_err();
        assert!(err.to_string().contains("depthwise_conv"), "{err}");
        let mut l = layer(2, 1, 3, 1, 1, false);
        assert!(matches!(
            l.backward(&Tensor::zeros(&[1, 2, 2, 2])),
            Err(ModelError::NoSavedActivation { .. })
        ));
        l.forward(&Tensor::zeros(&[1, 4, 4, 2]), Mode::Train)
            .unwrap();
        let err = l.backward(&Tensor::zeros(&[1, 3, 3, 2])).unwrap_err();
        assert!(err.to_string().contains("depthwise_conv backward"), "{err}");
        let mut rng = InitRng::new(1);
        assert!(DepthwiseConv2d::new("dw", 2, 0, 3, 1, 1, false, &mut rng).is_err());
    }

    #[test]
    fn gradients_accumulate() {
        let mut l = layer(3, 2, 3, 1, 1, true);
        let x = random(&[2, 4, 4, 3], 8);
        let g = random(&[2, 4, 4, 6], 9);
        l.forward(&x, Mode::Train).unwrap();
        l.backward(&g).unwrap();
        let once: Vec<Vec<f32>> = l
            .params_mut()
            .iter()
            .map(|p| p.grad.data().to_vec())
            .collect();
        l.forward(&x, Mode::Train).unwrap();
        l.backward_params_only(&g).unwrap();
        for (p, once) in l.params_mut().iter().zip(&once) {
            for (a, b) in p.grad.data().iter().zip(once) {
                assert_eq!(*a, 2.0 * b);
            }
        }
    }

    /// Output, dx, dW and db bit for bit the same on 1, 2 and 3 threads.
    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let x = random(&[5, 9, 8, 4], 11);
        let g = random(&[5, 5, 4, 8], 12);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let mut l = layer(4, 2, 3, 2, 1, true);
                let y = l.forward(&x, Mode::Train).unwrap();
                let dx = l.backward(&g).unwrap();
                let mut bits: Vec<u32> = y.data().iter().map(|v| v.to_bits()).collect();
                bits.extend(dx.data().iter().map(|v| v.to_bits()));
                for p in l.params_mut() {
                    bits.extend(p.grad.data().iter().map(|v| v.to_bits()));
                }
                bits
            })
        };
        let one = run(1);
        assert_eq!(one, run(2));
        assert_eq!(one, run(3));
    }

    #[test]
    fn gradient_matches_finite_differences() {
        for (m, k, s, p, bias) in [
            (1, 3, 1, 1, false),
            (2, 3, 2, 1, true),
            (1, 5, 1, 2, true),
            (3, 2, 2, 0, false),
        ] {
            let mut l = layer(3, m, k, s, p, bias);
            let x = random(&[2, 6, 5, 3], 10);
            let report = check_layer(&mut l, &x, 1e-2, 1e-2);
            assert!(report.is_ok(), "m {m} k {k} s {s}: {}", report.unwrap_err());
        }
    }
}
