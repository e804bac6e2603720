//! The pieces of a UNet decoder, NHWC.
//!
//! `Upsample2x`: nearest neighbour, [N, H, W, C] -> [N, 2H, 2W, C]; backward
//! sums each 2×2 block of the gradient (the skip's fused concat and split,
//! below, with no other channels). Saves the input shape only.
//!
//! `UnetSkip`: a container like `residual` whose output is its input and its
//! body's output side by side along channels: y = concat_c(x, body(x)); the
//! body (e.g. down-sample, inner layers, `upsample2x`) must give back the
//! input's height and width. Saves the shapes; the body saves what it needs.
//! Backward splits the gradient by channels: dx = g_x + body.backward(g_body).
//! It takes images [N, H, W, C] or frame sequences [N, T, H, W, C] (a body
//! holding a `conv_lstm` and per-frame layers): every axis but the channels
//! must come back unchanged. Where the body ends in `upsample2x` (alone or
//! per frame), the skip does the upsample in its concat and the
//! upsample's backward (2×2 sums) in its split, the same copies and sums:
//! the full-size body output and its gradient are never made.

use crate::layers::backward_params_only_through;
use crate::ops::activation::relu::{gather_rows, par_rows};
use crate::profile;
use crate::{Layer, Mode, ModelError, Param, Result, Tensor};

fn image_dims(op: &'static str, shape: &[usize]) -> Result<(usize, usize, usize, usize)> {
    match *shape {
        [n, h, w, c] => Ok((n, h, w, c)),
        _ => Err(ModelError::Shape {
            op,
            expected: "an image batch [n, h, w, c]".into(),
            got: format!("{shape:?}"),
        }),
    }
}

#[derive(Default)]
pub struct Upsample2x {
    saved_shape: Option<Vec<usize>>,
}

impl Upsample2x {
    pub fn new() -> Self {
        Self { saved_shape: None }
    }
}

impl Layer for Upsample2x {
    cuda_form!(value crate::ops::pool::layer::Upsample2xLayer);

    fn describe(&self) -> String {
        "upsample2x".into()
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        match *input {
            [h, w, c] => Ok(vec![2 * h, 2 * w, c]),
            _ => Err(ModelError::Shape {
                op: "upsample2x",
                expected: "an image [h, w, c]".into(),
                got: format!("{input:?}"),
            }),
        }
    }

    fn macs(&self, _input: &[usize]) -> Result<u64> {
        Ok(0)
    }

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        self.saved_shape = None;
        let (n, h, w, c) = image_dims("upsample2x", input.shape())?;
        // The skip's concat with nothing beside it: one code for both.
        let out = interleave_upsampled(&[], 0, input.data(), c, &[n, 2 * h, 2 * w])?;
        self.saved_shape = (mode == Mode::Train).then(|| input.shape().to_vec());
        Ok(out)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let shape = self
            .saved_shape
            .take()
            .ok_or(ModelError::NoSavedActivation { op: "upsample2x" })?;
        let (n, h, w, c) = image_dims("upsample2x", &shape)?;
        grad_output.expect_shape("upsample2x backward", &[n, 2 * h, 2 * w, c])?;
        // The skip's split of all the channels: one code for both.
        split_block_sums(grad_output.data(), c, 0, c, &[n, 2 * h, 2 * w])
    }

    fn clear_saved(&mut self) {
        self.saved_shape = None;
    }

    fn is_upsample2x(&self) -> bool {
        true
    }
}

/// (every axis but the last, the channels) of an image batch or a batch
/// of frame sequences.
fn split_channels(op: &'static str, shape: &[usize]) -> Result<(Vec<usize>, usize)> {
    match shape {
        [lead @ .., c] if (3..=4).contains(&lead.len()) => Ok((lead.to_vec(), *c)),
        _ => Err(ModelError::Shape {
            op,
            expected: "images [n, h, w, c] or frames [n, t, h, w, c]".into(),
            got: format!("{shape:?}"),
        }),
    }
}

/// `lead` with `c` channels appended.
fn with_channels(lead: &[usize], c: usize) -> Vec<usize> {
    [lead, &[c]].concat()
}

pub struct UnetSkip {
    pub(crate) body: Vec<Box<dyn Layer>>,
    /// Input channels and body output channels of the last training forward.
    saved_channels: Option<(usize, usize)>,
}

impl UnetSkip {
    pub fn new(body: Vec<Box<dyn Layer>>) -> Self {
        Self {
            body,
            saved_channels: None,
        }
    }

    /// Whether the body ends in a 2× upsample, which the concat does
    /// itself (and the split, backward, its 2×2 sums): the full-size body
    /// output and its gradient are never made (`conv_lstm`'s two skips:
    /// 2.5 ms of upsampling forward and a copy of 42 MB a step).
    fn fuses_upsample(&self) -> bool {
        self.body.last().is_some_and(|l| l.is_upsample2x())
    }

    /// The body's layers that run: all but a fused upsample.
    fn running_body(&mut self) -> &mut [Box<dyn Layer>] {
        let run = self.body.len() - usize::from(self.fuses_upsample());
        &mut self.body[..run]
    }

    /// The input channels (of the training forward, taken) and the body's
    /// share of `grad_output` (summed over 2×2 blocks where the upsample is
    /// fused: the gradient of the body's last running layer).
    fn body_gradient(&mut self, grad_output: &Tensor) -> Result<(usize, Tensor)> {
        let (c, bc) = self
            .saved_channels
            .take()
            .ok_or(ModelError::NoSavedActivation { op: "unet_skip" })?;
        let (lead, total) = split_channels("unet_skip backward", grad_output.shape())?;
        if total != c + bc {
            return Err(ModelError::Shape {
                op: "unet_skip backward",
                expected: format!("{} channels", c + bc),
                got: format!("{:?}", grad_output.shape()),
            });
        }
        let g = grad_output.data();
        if self.fuses_upsample() {
            let g_body = split_block_sums(g, total, c, bc, &lead)?;
            profile::mark(|| {
                format!(
                    "bwd unet_skip split {c}+{bc} + upsample2x of {}",
                    profile::dims(grad_output.shape())
                )
            });
            return Ok((c, g_body));
        }
        let g_body = channel_slice(g, total, c, bc, &with_channels(&lead, bc))?;
        profile::mark(|| {
            format!(
                "bwd unet_skip split {c}+{bc} of {}",
                profile::dims(grad_output.shape())
            )
        });
        Ok((c, g_body))
    }

    fn body_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        let mut shape = input.to_vec();
        for layer in &self.body {
            shape = layer.output_shape(&shape)?;
        }
        Ok(shape)
    }
}

/// [rows, a] and [rows, b] -> [rows, a + b], or back.
fn interleave(x: &[f32], a: usize, y: &[f32], b: usize, shape: &[usize]) -> Result<Tensor> {
    // SAFETY: each row's a + b values are written by the two zips.
    unsafe {
        par_rows(shape, a + b, |row, out| {
            let (first, second) = out.split_at_mut(a);
            for (o, &v) in first.iter_mut().zip(&x[row * a..(row + 1) * a]) {
                o.write(v);
            }
            for (o, &v) in second.iter_mut().zip(&y[row * b..(row + 1) * b]) {
                o.write(v);
            }
        })
    }
}

/// `lead` ([.., h, w], every axis but the channels) with h and w halved,
/// and h and w.
fn halved(lead: &[usize]) -> (Vec<usize>, usize, usize) {
    let images = &lead[..lead.len().saturating_sub(2)];
    let (h, w) = match *lead {
        [.., h, w] => (h, w),
        _ => (0, 0),
    };
    ([images, &[h / 2, w / 2]].concat(), h, w)
}

/// [rows, a] and the 2× nearest upsample of `low` ([images, h/2, w/2, b])
/// -> [rows, a + b], rows being the pixels of `lead` ([.., h, w]): the
/// concat of `x` and `Upsample2x` of `low`, without the upsampled tensor.
fn interleave_upsampled(
    x: &[f32],
    a: usize,
    low: &[f32],
    b: usize,
    lead: &[usize],
) -> Result<Tensor> {
    let (_, h, w) = halved(lead);
    let (lh, lw) = (h / 2, w / 2);
    // SAFETY: each row's a + b values are written by the two zips.
    unsafe {
        par_rows(&with_channels(lead, a + b), a + b, |row, out| {
            let (col, rest) = (row % w, row / w);
            let (y, image) = (rest % h, rest / h);
            let at = ((image * lh + y / 2) * lw + col / 2) * b;
            let (first, second) = out.split_at_mut(a);
            for (o, &v) in first.iter_mut().zip(&x[row * a..(row + 1) * a]) {
                o.write(v);
            }
            for (o, &v) in second.iter_mut().zip(&low[at..at + b]) {
                o.write(v);
            }
        })
    }
}

/// Channels from..from + len of `g` ([lead, total], lead = [.., h, w])
/// summed over each 2×2 block of pixels, as `Upsample2x`'s backward sums
/// its gradient: [.., h/2, w/2, len].
fn split_block_sums(
    g: &[f32],
    total: usize,
    from: usize,
    len: usize,
    lead: &[usize],
) -> Result<Tensor> {
    let (low, h, w) = halved(lead);
    let (lh, lw) = (h / 2, w / 2);
    // SAFETY: each pixel's row of len channels is written whole.
    unsafe {
        par_rows(&with_channels(&low, len), len, |pixel, out| {
            let (col, rest) = (pixel % lw, pixel / lw);
            let (row, image) = (rest % lh, rest / lh);
            let at = |dr: usize, dc: usize| {
                let p = (image * h + 2 * row + dr) * w + 2 * col + dc;
                &g[p * total + from..][..len]
            };
            let (a, b, d, e) = (at(0, 0), at(0, 1), at(1, 0), at(1, 1));
            for (k, o) in out.iter_mut().enumerate() {
                o.write(a[k] + b[k] + d[k] + e[k]);
            }
        })
    }
}

fn channel_slice(
    g: &[f32],
    total: usize,
    from: usize,
    len: usize,
    shape: &[usize],
) -> Result<Tensor> {
    gather_rows(shape, len, |row| {
        let at = row * total + from;
        &g[at..at + len]
    })
}

impl Layer for UnetSkip {
    cuda_form!(crate::ops::pool::layer::UnetSkipLayer::from_cpu);

    fn sublayers(&self) -> Vec<&dyn Layer> {
        self.body.iter().map(|l| l.as_ref()).collect()
    }

    fn describe(&self) -> String {
        let names: Vec<String> = self.body.iter().map(|l| l.describe()).collect();
        format!("unet_skip[{}]", names.join(", "))
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        let inner = self.body_shape(input)?;
        match (input, inner.as_slice()) {
            ([lead @ .., c], [body_lead @ .., bc])
                if (2..=3).contains(&lead.len()) && lead == body_lead =>
            {
                Ok(with_channels(lead, c + bc))
            }
            _ => Err(ModelError::Shape {
                op: "unet_skip",
                expected: format!("a body that keeps the height and width of {input:?}"),
                got: format!("{inner:?}"),
            }),
        }
    }

    fn macs(&self, input: &[usize]) -> Result<u64> {
        let mut shape = input.to_vec();
        let mut total = 0;
        for layer in &self.body {
            total += layer.macs(&shape)?;
            shape = layer.output_shape(&shape)?;
        }
        Ok(total)
    }

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        self.saved_channels = None;
        let (lead, c) = split_channels("unet_skip", input.shape())?;
        let fused = self.fuses_upsample();
        let mut y = input.clone();
        for layer in self.running_body() {
            let next = layer.forward(&y, mode)?;
            profile::mark_layer("fwd", layer.as_ref(), "in", y.shape());
            y = next;
        }
        let (body_lead, bc) = split_channels("unet_skip body", y.shape())?;
        // The body's output size; where the upsample is fused, the running
        // layers' output is half of it.
        let full = match (fused, body_lead.as_slice()) {
            (true, [images @ .., h, w]) => [images, &[2 * h, 2 * w]].concat(),
            _ => body_lead,
        };
        if full != lead {
            return Err(ModelError::Shape {
                op: "unet_skip",
                expected: format!("a body output of {lead:?} and any channels"),
                got: format!("{:?}", with_channels(&full, bc)),
            });
        }
        let out = if fused {
            interleave_upsampled(input.data(), c, y.data(), bc, &lead)?
        } else {
            interleave(input.data(), c, y.data(), bc, &with_channels(&lead, c + bc))?
        };
        profile::mark(|| {
            let up = if fused { "upsample2x + " } else { "" };
            format!(
                "fwd unet_skip {up}concat {c}+{bc} out {}",
                profile::dims(out.shape())
            )
        });
        self.saved_channels = (mode == Mode::Train).then_some((c, bc));
        Ok(out)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let (c, mut g_body) = self.body_gradient(grad_output)?;
        for layer in self.running_body().iter_mut().rev() {
            let next = layer.backward(&g_body)?;
            profile::mark_layer("bwd", layer.as_ref(), "out", g_body.shape());
            g_body = next;
        }
        let (lead, total) = split_channels("unet_skip backward", grad_output.shape())?;
        let shape = with_channels(&lead, c);
        g_body.expect_shape("unet_skip backward", &shape)?;
        let (g, gb) = (grad_output.data(), g_body.data());
        // dx = the skip's share + the body's, in one pass (a slice copied,
        // then added to, went over dx twice).
        // SAFETY: each row's c values are written by the zip.
        let dx = unsafe {
            par_rows(&shape, c, |row, out| {
                let skip = &g[row * total..][..c];
                let body = &gb[row * c..][..c];
                for ((o, &a), &b) in out.iter_mut().zip(skip).zip(body) {
                    o.write(a + b);
                }
            })
        }?;
        profile::mark(|| format!("bwd unet_skip add out {}", profile::dims(dx.shape())));
        Ok(dx)
    }

    /// First in a network: the skip's share of the gradient goes nowhere,
    /// and the body needs no input gradient either.
    fn backward_params_only(&mut self, grad_output: &Tensor) -> Result<()> {
        let (_, g_body) = self.body_gradient(grad_output)?;
        backward_params_only_through(self.running_body(), g_body)
    }

    fn marks_its_parts(&self) -> bool {
        true
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        self.body.iter_mut().flat_map(|l| l.params_mut()).collect()
    }

    fn buffers_mut(&mut self) -> Vec<&mut Tensor> {
        self.body.iter_mut().flat_map(|l| l.buffers_mut()).collect()
    }

    fn dropout_seeds(&self) -> Vec<u64> {
        self.body.iter().flat_map(|l| l.dropout_seeds()).collect()
    }

    fn shift_dropout(&mut self, offset: u64, advance: u64) {
        self.body
            .iter_mut()
            .for_each(|l| l.shift_dropout(offset, advance));
    }

    fn clear_saved(&mut self) {
        self.saved_channels = None;
        for layer in &mut self.body {
            layer.clear_saved();
        }
    }

    fn set_recompute(&mut self, on: bool) {
        for layer in &mut self.body {
            layer.set_recompute(on);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_layer, random_tensor};
    use crate::init::InitRng;
    use crate::layers::Conv2d;

    /// `--profile` sees the body's layers, the concat and the add, not
    /// the block whole.
    #[test]
    fn the_profile_opens_the_body_and_marks_the_concat_and_the_add() {
        let mut rng = InitRng::new(1);
        let conv = Conv2d::new("c", 2, 3, 3, 1, 1, true, &mut rng).unwrap();
        let mut skip = UnetSkip::new(vec![Box::new(conv)]);
        let x = random_tensor(&[2, 4, 4, 2], 1);
        crate::profile::start();
        let y = skip.forward(&x, Mode::Train).unwrap();
        skip.backward(&y).unwrap();
        let labels: Vec<String> = crate::profile::finish()
            .into_iter()
            .map(|s| s.label)
            .collect();
        assert_eq!(
            labels,
            [
                "fwd conv3x3 2->3 in 4x4x2",
                "fwd unet_skip concat 2+3 out 4x4x5",
                "bwd unet_skip split 2+3 of 4x4x5",
                "bwd conv3x3 2->3 out 4x4x3",
                "bwd unet_skip add out 4x4x2",
            ]
        );
    }

    #[test]
    fn upsample_repeats_pixels_and_its_gradient_checks() {
        let x = Tensor::from_vec(&[1, 1, 2, 1], vec![1.0, 2.0]).unwrap();
        let y = Upsample2x::new().forward(&x, Mode::Eval).unwrap();
        assert_eq!(y.shape(), &[1, 2, 4, 1]);
        assert_eq!(y.data(), &[1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0]);
        let report = check_layer(
            &mut Upsample2x::new(),
            &random_tensor(&[2, 2, 3, 2], 1),
            1e-2,
            1e-3,
        );
        assert!(report.is_ok(), "{}", report.unwrap_err());
    }

    /// Down by a stride-2 convolution, back up by upsampling.
    fn skip(seed: u64) -> UnetSkip {
        let mut rng = InitRng::new(seed);
        let down = Conv2d::new("down", 2, 3, 3, 2, 1, true, &mut rng).unwrap();
        UnetSkip::new(vec![Box::new(down), Box::new(Upsample2x::new())])
    }

    /// First in a network, a skip makes its body's parameter gradients
    /// only: those of its whole backward, bit for bit, without the add
    /// (nor the body's first input gradient).
    #[test]
    fn backward_params_only_adds_the_parameter_gradients_of_backward() {
        let x = random_tensor(&[2, 4, 6, 2], 3);
        let (mut full, mut params_only) = (skip(1), skip(1));
        let y = full.forward(&x, Mode::Train).unwrap();
        params_only.forward(&x, Mode::Train).unwrap();
        let g = random_tensor(y.shape(), 4);
        crate::profile::start();
        full.backward(&g).unwrap();
        params_only.backward_params_only(&g).unwrap();
        let labels: Vec<String> = crate::profile::finish()
            .into_iter()
            .map(|s| s.label)
            .collect();
        for (a, b) in full.params_mut().into_iter().zip(params_only.params_mut()) {
            assert!(a.grad.data() == b.grad.data(), "{}", a.name);
        }
        assert_eq!(
            labels
                .iter()
                .filter(|l| l.contains("unet_skip add"))
                .count(),
            1
        );
        assert!(params_only.backward_params_only(&g).is_err(), "used up");
    }

    /// A layer as it is, except that a skip cannot see it is an upsample:
    /// the skip runs it as a layer of its body.
    struct Unfused(Box<dyn Layer>);

    impl Layer for Unfused {
        fn describe(&self) -> String {
            self.0.describe()
        }
        fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
            self.0.output_shape(input)
        }
        fn macs(&self, input: &[usize]) -> Result<u64> {
            self.0.macs(input)
        }
        fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
            self.0.forward(input, mode)
        }
        fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
            self.0.backward(grad_output)
        }
    }

    /// A skip over [conv/2, upsample], images or (`frames`) every layer
    /// per frame; `fused` false hides the upsample from the skip.
    fn down_up(frames: bool, fused: bool) -> UnetSkip {
        use crate::layers::PerFrame;
        let mut rng = InitRng::new(5);
        let down: Box<dyn Layer> =
            Box::new(Conv2d::new("down", 2, 3, 3, 2, 1, true, &mut rng).unwrap());
        let up: Box<dyn Layer> = Box::new(Upsample2x::new());
        let (down, up) = match frames {
            true => (
                Box::new(PerFrame::new(down)) as Box<dyn Layer>,
                Box::new(PerFrame::new(up)) as Box<dyn Layer>,
            ),
            false => (down, up),
        };
        let up = if fused { up } else { Box::new(Unfused(up)) };
        UnetSkip::new(vec![down, up])
    }

    /// The upsample done inside the concat and the split gives the bits of
    /// the upsample run as a layer: output, input gradient and parameter
    /// gradients, over images and over frames; and it is what ran (the
    /// profile shows no upsample layer).
    #[test]
    fn a_fused_upsample_gives_the_bits_of_the_layer() {
        for (frames, shape) in [(false, vec![2, 4, 6, 2]), (true, vec![2, 3, 4, 6, 2])] {
            let x = random_tensor(&shape, 6);
            let (mut fused, mut plain) = (down_up(frames, true), down_up(frames, false));
            assert!(fused.fuses_upsample() && !plain.fuses_upsample());
            crate::profile::start();
            let y = fused.forward(&x, Mode::Train).unwrap();
            let g = random_tensor(y.shape(), 7);
            let dx = fused.backward(&g).unwrap();
            let labels: Vec<String> = crate::profile::finish()
                .into_iter()
                .map(|s| s.label)
                .collect();
            assert!(
                labels
                    .iter()
                    .all(|l| !l.starts_with("fwd upsample") && !l.starts_with("bwd upsample")),
                "{labels:?}"
            );
            let y_plain = plain.forward(&x, Mode::Train).unwrap();
            let dx_plain = plain.backward(&g).unwrap();
            let bits = |t: &Tensor| t.data().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(y.shape(), y_plain.shape());
            assert_eq!(bits(&y), bits(&y_plain), "output, frames: {frames}");
            assert_eq!(
                bits(&dx),
                bits(&dx_plain),
                "input gradient, frames: {frames}"
            );
            for (a, b) in fused.params_mut().into_iter().zip(plain.params_mut()) {
                assert_eq!(bits(&a.grad), bits(&b.grad), "{}, frames: {frames}", a.name);
            }
        }
    }

    #[test]
    fn skip_concatenates_input_and_body() {
        let mut s = skip(1);
        assert_eq!(s.output_shape(&[4, 6, 2]).unwrap(), vec![4, 6, 5]);
        let x = random_tensor(&[1, 4, 6, 2], 2);
        let y = s.forward(&x, Mode::Eval).unwrap();
        for (pixel, out) in x.data().chunks(2).zip(y.data().chunks(5)) {
            assert_eq!(&out[..2], pixel);
        }
        assert!(
            s.output_shape(&[5, 6, 2]).is_err(),
            "odd height does not come back"
        );
    }

    #[test]
    fn skip_gradient_matches_finite_differences() {
        let report = check_layer(&mut skip(3), &random_tensor(&[2, 4, 4, 2], 4), 1e-2, 2e-3);
        assert!(report.is_ok(), "{}", report.unwrap_err());
    }

    #[test]
    fn skip_over_frames_concatenates_and_its_gradient_checks() {
        use crate::layers::ConvLstm;
        let cell = ConvLstm::new("cl", 2, 2, 3, &mut InitRng::new(11)).unwrap();
        let mut s = UnetSkip::new(vec![Box::new(cell)]);
        assert_eq!(s.output_shape(&[3, 4, 4, 2]).unwrap(), vec![3, 4, 4, 4]);
        let x = random_tensor(&[2, 3, 4, 4, 2], 12);
        let y = s.forward(&x, Mode::Eval).unwrap();
        assert_eq!(y.shape(), &[2, 3, 4, 4, 4]);
        for (pixel, out) in x.data().chunks(2).zip(y.data().chunks(4)) {
            assert_eq!(&out[..2], pixel);
        }
        let report = check_layer(&mut s, &random_tensor(&[1, 2, 3, 3, 2], 13), 1e-2, 3e-3);
        assert!(report.is_ok(), "{}", report.unwrap_err());
    }
}
