//! Layers that only change how a tensor's elements are grouped.
//!
//! `Flatten`: NHWC [N, H, W, C] -> [N, H·W·C]. The data is already in that
//! order, so forward and backward share the buffer (a reference-counted
//! handle) and change the shape; it saves the input shape only.
//!
//! `PerPosition`: applies a layer made for feature vectors [N, C] (linear,
//! LoRA linear) at every position of a sequence [N, T, C], by viewing the
//! batch as [N·T, C]. It saves the sequence shape; the inner layer saves
//! what it needs (for a linear: its input, the same buffer, no copy).
//!
//! `PerFrame`: applies an image layer [N, H, W, C] (conv, batch norm,
//! upsample2x) to every frame of a sequence [N, T, H, W, C] by viewing it as
//! N·T images: frames are contiguous, so the view is a reshape of the same
//! buffer. It saves the (n, t) pair; the inner layer saves what it needs.
//! Batch norm inside it takes its statistics over every frame of the batch.

use crate::{Layer, Mode, ModelError, Param, Result, Tensor};

/// [N, d1, d2, ...] -> [N, d1·d2·...].
#[derive(Default)]
pub struct Flatten {
    saved_shape: Option<Vec<usize>>,
}

impl Flatten {
    pub fn new() -> Self {
        Self { saved_shape: None }
    }
}

impl Layer for Flatten {
    cuda_form!(value crate::ops::pool::layer::FlattenLayer);

    fn describe(&self) -> String {
        "flatten".into()
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        Ok(vec![input.iter().product()])
    }

    fn macs(&self, _input: &[usize]) -> Result<u64> {
        Ok(0)
    }

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        let n = input.batch();
        let features = input.shape().iter().skip(1).product();
        self.saved_shape = (mode == Mode::Train).then(|| input.shape().to_vec());
        input.clone().reshape(&[n, features])
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let shape = self
            .saved_shape
            .take()
            .ok_or(ModelError::NoSavedActivation { op: "flatten" })?;
        let n = shape.first().copied().unwrap_or(0);
        let features = shape.iter().skip(1).product();
        grad_output.expect_shape("flatten backward", &[n, features])?;
        grad_output.clone().reshape(&shape)
    }

    fn clear_saved(&mut self) {
        self.saved_shape = None;
    }
}

/// A feature-vector layer applied at every position of [N, T, C].
pub struct PerPosition {
    inner: Box<dyn Layer>,
    saved_positions: Option<(usize, usize)>,
}

impl PerPosition {
    pub fn new(inner: Box<dyn Layer>) -> Self {
        Self {
            inner,
            saved_positions: None,
        }
    }

    /// The wrapped layer (for LoRA merging and tests).
    pub fn inner_mut(&mut self) -> &mut dyn Layer {
        self.inner.as_mut()
    }
}

fn sequence_dims(op: &'static str, shape: &[usize]) -> Result<(usize, usize, usize)> {
    match *shape {
        [n, t, c] => Ok((n, t, c)),
        _ => Err(ModelError::Shape {
            op,
            expected: "a sequence [n, t, c]".into(),
            got: format!("{shape:?}"),
        }),
    }
}

impl Layer for PerPosition {
    fn to_cuda(
        &self,
        ctx: &mut crate::cuda::layer::CudaBuildContext<'_, '_>,
    ) -> Option<crate::cuda::CudaResult<Box<dyn crate::cuda::layer::CudaLayer>>> {
        self.inner.to_cuda(ctx)
    }

    fn describe(&self) -> String {
        format!("{} (per position)", self.inner.describe())
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        let [t, c] = *input else {
            return Err(ModelError::Shape {
                op: "per-position layer",
                expected: "a sequence [t, c]".into(),
                got: format!("{input:?}"),
            });
        };
        let out = self.inner.output_shape(&[c])?;
        Ok([vec![t], out].concat())
    }

    fn macs(&self, input: &[usize]) -> Result<u64> {
        self.output_shape(input)?;
        Ok(input[0] as u64 * self.inner.macs(&input[1..])?)
    }

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        self.saved_positions = None;
        let (n, t, c) = sequence_dims("per-position layer", input.shape())?;
        let rows = input.clone().reshape(&[n * t, c])?;
        let out = self.inner.forward(&rows, mode)?;
        let features = out.shape().get(1).copied().unwrap_or(0);
        self.saved_positions = (mode == Mode::Train).then_some((n, t));
        out.reshape(&[n, t, features])
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let (n, t) = self
            .saved_positions
            .take()
            .ok_or(ModelError::NoSavedActivation {
                op: "per-position layer",
            })?;
        let (gn, gt, features) = sequence_dims("per-position backward", grad_output.shape())?;
        if (gn, gt) != (n, t) {
            return Err(ModelError::Shape {
                op: "per-position backward",
                expected: format!("[{n}, {t}, _]"),
                got: format!("{:?}", grad_output.shape()),
            });
        }
        let g = grad_output.clone().reshape(&[n * t, features])?;
        let gi = self.inner.backward(&g)?;
        let c = gi.shape().get(1).copied().unwrap_or(0);
        gi.reshape(&[n, t, c])
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
        self.saved_positions = None;
        self.inner.clear_saved();
    }

    fn set_recompute(&mut self, on: bool) {
        self.inner.set_recompute(on);
    }
}

/// An image layer applied to every frame of [N, T, H, W, C].
pub struct PerFrame {
    inner: Box<dyn Layer>,
    saved_frames: Option<(usize, usize)>,
}

impl PerFrame {
    pub fn new(inner: Box<dyn Layer>) -> Self {
        Self {
            inner,
            saved_frames: None,
        }
    }

    /// The frames' gradient as the inner layer's images [N·T, ...], with
    /// N and T of the training forward (taken).
    fn images_gradient(&mut self, grad_output: &Tensor) -> Result<(usize, usize, Tensor)> {
        let (n, t) = self
            .saved_frames
            .take()
            .ok_or(ModelError::NoSavedActivation {
                op: "per-frame layer",
            })?;
        let [gn, gt, h, w, c] = frames_dims("per-frame backward", grad_output.shape())?;
        if (gn, gt) != (n, t) {
            return Err(ModelError::Shape {
                op: "per-frame backward",
                expected: format!("[{n}, {t}, _, _, _]"),
                got: format!("{:?}", grad_output.shape()),
            });
        }
        Ok((n, t, grad_output.clone().reshape(&[n * t, h, w, c])?))
    }
}

fn frames_dims(op: &'static str, shape: &[usize]) -> Result<[usize; 5]> {
    match *shape {
        [n, t, h, w, c] => Ok([n, t, h, w, c]),
        _ => Err(ModelError::Shape {
            op,
            expected: "frames [n, t, h, w, c]".into(),
            got: format!("{shape:?}"),
        }),
    }
}

/// [N·T, ...] -> [N, T, ...].
fn unfold_frames(x: Tensor, n: usize, t: usize) -> Result<Tensor> {
    let rest = x.shape().get(1..).unwrap_or(&[]).to_vec();
    x.reshape(&[vec![n, t], rest].concat())
}

impl Layer for PerFrame {
    fn to_cuda(
        &self,
        ctx: &mut crate::cuda::layer::CudaBuildContext<'_, '_>,
    ) -> Option<crate::cuda::CudaResult<Box<dyn crate::cuda::layer::CudaLayer>>> {
        self.inner.to_cuda(ctx)
    }

    fn describe(&self) -> String {
        format!("{} (per frame)", self.inner.describe())
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        let [t, h, w, c] = *input else {
            return Err(ModelError::Shape {
                op: "per-frame layer",
                expected: "frames [t, h, w, c]".into(),
                got: format!("{input:?}"),
            });
        };
        let out = self.inner.output_shape(&[h, w, c])?;
        Ok([vec![t], out].concat())
    }

    fn macs(&self, input: &[usize]) -> Result<u64> {
        self.output_shape(input)?;
        Ok(input[0] as u64 * self.inner.macs(&input[1..])?)
    }

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        self.saved_frames = None;
        let [n, t, h, w, c] = frames_dims("per-frame layer", input.shape())?;
        let images = input.clone().reshape(&[n * t, h, w, c])?;
        let out = self.inner.forward(&images, mode)?;
        self.saved_frames = (mode == Mode::Train).then_some((n, t));
        unfold_frames(out, n, t)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let (n, t, g) = self.images_gradient(grad_output)?;
        unfold_frames(self.inner.backward(&g)?, n, t)
    }

    fn backward_params_only(&mut self, grad_output: &Tensor) -> Result<()> {
        let (_, _, g) = self.images_gradient(grad_output)?;
        self.inner.backward_params_only(&g)
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
        self.saved_frames = None;
        self.inner.clear_saved();
    }

    fn is_upsample2x(&self) -> bool {
        self.inner.is_upsample2x()
    }

    fn set_recompute(&mut self, on: bool) {
        self.inner.set_recompute(on);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_layer, random_tensor};
    use crate::init::InitRng;
    use crate::layers::{Conv2d, Linear};

    #[test]
    fn flatten_keeps_the_order_and_shares_the_buffer() {
        let x = random_tensor(&[2, 3, 2, 4], 1);
        let mut flatten = Flatten::new();
        let y = flatten.forward(&x, Mode::Train).unwrap();
        assert_eq!(y.shape(), &[2, 24]);
        assert_eq!(y.data().as_ptr(), x.data().as_ptr());
        let g = flatten.backward(&y).unwrap();
        assert_eq!(g.shape(), x.shape());
        assert_eq!(g.data(), x.data());
        assert!(flatten.backward(&y).is_err());
    }

    #[test]
    fn flatten_gradient_matches_finite_differences() {
        let report = check_layer(
            &mut Flatten::new(),
            &random_tensor(&[2, 2, 3, 2], 2),
            1e-2,
            1e-3,
        );
        assert!(report.is_ok(), "{}", report.unwrap_err());
    }

    #[test]
    fn per_position_linear_equals_the_linear_on_each_row() {
        let mut rng = InitRng::new(4);
        let mut seq = PerPosition::new(Box::new(Linear::new(
            "fc",
            5,
            3,
            true,
            &mut InitRng::new(4),
        )));
        let mut plain = Linear::new("fc", 5, 3, true, &mut rng);
        let x = random_tensor(&[2, 4, 5], 3);
        let y = seq.forward(&x, Mode::Eval).unwrap();
        assert_eq!(y.shape(), &[2, 4, 3]);
        let rows = plain
            .forward(&x.clone().reshape(&[8, 5]).unwrap(), Mode::Eval)
            .unwrap();
        assert_eq!(y.data(), rows.data());
        assert_eq!(seq.output_shape(&[4, 5]).unwrap(), vec![4, 3]);
        assert_eq!(seq.macs(&[4, 5]).unwrap(), 4 * 15);
    }

    #[test]
    fn per_position_gradient_matches_finite_differences() {
        let mut seq = PerPosition::new(Box::new(Linear::new(
            "fc",
            4,
            3,
            true,
            &mut InitRng::new(5),
        )));
        let report = check_layer(&mut seq, &random_tensor(&[2, 3, 4], 6), 1e-2, 1e-3);
        assert!(report.is_ok(), "{}", report.unwrap_err());
    }

    fn per_frame_conv(seed: u64) -> PerFrame {
        let conv = Conv2d::new("c", 2, 3, 3, 2, 1, true, &mut InitRng::new(seed)).unwrap();
        PerFrame::new(Box::new(conv))
    }

    #[test]
    fn per_frame_conv_equals_the_conv_on_each_frame() {
        let mut frames = per_frame_conv(7);
        let mut plain = Conv2d::new("c", 2, 3, 3, 2, 1, true, &mut InitRng::new(7)).unwrap();
        let x = random_tensor(&[2, 3, 4, 4, 2], 8);
        let y = frames.forward(&x, Mode::Eval).unwrap();
        assert_eq!(y.shape(), &[2, 3, 2, 2, 3]);
        assert_eq!(
            frames.output_shape(&[3, 4, 4, 2]).unwrap(),
            vec![3, 2, 2, 3]
        );
        // Frame (sample 1, step 2) is image 5 of the folded batch.
        let frame = Tensor::from_vec(&[1, 4, 4, 2], x.data()[5 * 32..6 * 32].to_vec()).unwrap();
        let alone = plain.forward(&frame, Mode::Eval).unwrap();
        assert_eq!(&y.data()[5 * 12..6 * 12], alone.data());
    }

    #[test]
    fn per_frame_backward_params_only_adds_the_parameter_gradients_of_backward() {
        let x = random_tensor(&[2, 3, 5, 4, 2], 7);
        let (mut full, mut params_only) = (per_frame_conv(1), per_frame_conv(1));
        let y = full.forward(&x, Mode::Train).unwrap();
        params_only.forward(&x, Mode::Train).unwrap();
        let g = random_tensor(y.shape(), 8);
        full.backward(&g).unwrap();
        params_only.backward_params_only(&g).unwrap();
        for (a, b) in full.params_mut().into_iter().zip(params_only.params_mut()) {
            assert!(a.grad.data() == b.grad.data(), "{}", a.name);
        }
        assert!(params_only.backward_params_only(&g).is_err(), "used up");
    }

    #[test]
    fn per_frame_gradient_matches_finite_differences() {
        let report = check_layer(
            &mut per_frame_conv(9),
            &random_tensor(&[2, 2, 4, 4, 2], 10),
            1e-2,
            2e-3,
        );
        assert!(report.is_ok(), "{}", report.unwrap_err());
    }
}
