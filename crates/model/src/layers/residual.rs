//! A residual connection: y = body(x) + x, where the body must keep the shape.
//!
//! The wrapper itself saves only the input's shape (to check the gradient and
//! to know a training forward happened); the body's layers save what they
//! need. Backward: g_in = body.backward(g) + g.

use super::BatchNorm2d;
use crate::ops::activation::relu::{par_add_assign, relu_backward};
use crate::profile;
use crate::{Layer, Mode, ModelError, Param, Result, Tensor};

pub struct Residual {
    pub(crate) body: Vec<Box<dyn Layer>>,
    saved_shape: Option<Vec<usize>>,
}

impl Residual {
    pub fn new(body: Vec<Box<dyn Layer>>) -> Self {
        Self {
            body,
            saved_shape: None,
        }
    }
}

/// "conv3x3/1 32->32" -> "conv", "bn+relu 32" -> "bn+relu": the leading name.
fn short_name(describe: &str) -> &str {
    let end = describe
        .find(|ch: char| !(ch.is_ascii_alphabetic() || ch == '_' || ch == '+'))
        .unwrap_or(describe.len());
    if end == 0 {
        describe
    } else {
        &describe[..end]
    }
}

/// The shape `body` maps `input` to.
fn body_shape(body: &[Box<dyn Layer>], input: &[usize]) -> Result<Vec<usize>> {
    let mut shape = input.to_vec();
    for layer in body {
        shape = layer.output_shape(&shape)?;
    }
    Ok(shape)
}

/// `shape`, if it is the block's `input` shape (a residual must keep it).
fn kept_shape(input: &[usize], shape: Vec<usize>) -> Result<Vec<usize>> {
    if shape != input {
        return Err(ModelError::Shape {
            op: "residual",
            expected: format!("a body that keeps the shape {input:?}"),
            got: format!("a body that maps it to {shape:?}"),
        });
    }
    Ok(shape)
}

fn body_macs(body: &[Box<dyn Layer>], input: &[usize]) -> Result<u64> {
    let mut shape = input.to_vec();
    let mut total = 0;
    for layer in body {
        total += layer.macs(&shape)?;
        shape = layer.output_shape(&shape)?;
    }
    Ok(total)
}

impl Layer for Residual {
    cuda_form!(crate::cuda::containers::ResidualLayer::from_cpu);

    fn sublayers(&self) -> Vec<&dyn Layer> {
        self.body.iter().map(|l| l.as_ref()).collect()
    }

    fn describe(&self) -> String {
        let names: Vec<String> = self
            .body
            .iter()
            .map(|l| short_name(&l.describe()).to_string())
            .collect();
        format!("residual[{}]", names.join(","))
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        kept_shape(input, body_shape(&self.body, input)?)
    }

    /// The body's multiply-adds; the addition counts 0 like other
    /// elementwise work.
    fn macs(&self, input: &[usize]) -> Result<u64> {
        self.output_shape(input)?;
        body_macs(&self.body, input)
    }

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        self.saved_shape = None;
        let mut y = input.clone();
        for layer in &mut self.body {
            let next = layer.forward(&y, mode)?;
            profile::mark_layer("fwd", layer.as_ref(), "in", y.shape());
            y = next;
        }
        if y.shape() != input.shape() {
            return Err(ModelError::Shape {
                op: "residual",
                expected: format!("a body output of the input's shape {:?}", input.shape()),
                got: format!("{:?}", y.shape()),
            });
        }
        // The body's output is usually ours alone (a batch norm does not keep
        // it), so the sum is formed in place without a copy (an empty body
        // returns the input itself: then the sum is a copy from the pool).
        par_add_assign(y.try_data_mut()?, input.data());
        profile::mark(|| format!("fwd residual add in {}", profile::dims(input.shape())));
        if mode == Mode::Train {
            self.saved_shape = Some(input.shape().to_vec());
        }
        Ok(y)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let shape = self
            .saved_shape
            .take()
            .ok_or(ModelError::NoSavedActivation { op: "residual" })?;
        grad_output.expect_shape("residual backward", &shape)?;
        let mut g = grad_output.clone();
        for layer in self.body.iter_mut().rev() {
            let next = layer.backward(&g)?;
            profile::mark_layer("bwd", layer.as_ref(), "out", g.shape());
            g = next;
        }
        g.expect_shape("residual backward (body gradient)", &shape)?;
        par_add_assign(g.try_data_mut()?, grad_output.data());
        profile::mark(|| format!("bwd residual add out {}", profile::dims(&shape)));
        Ok(g)
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
        self.saved_shape = None;
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

/// A residual block that ends in a batch norm and a ReLU,
/// y = relu(tail(body(x)) + x), with the tail's normalisation, the add and
/// the ReLU in one pass over the activation (`device.fusion`). The unfused
/// form is `Residual` (body, tail) then `Relu`: same parameters in the same
/// order, bit-identical results.
///
/// Saves the block's output (the next layer usually keeps the same buffer)
/// for the ReLU's mask; the body and the tail save what they need.
/// Backward: gm = g·`[y > 0]`; g_in = body.backward(tail.backward(gm)) + gm.
pub struct FusedResidual {
    body: Vec<Box<dyn Layer>>,
    tail: BatchNorm2d,
    saved_output: Option<Tensor>,
}

impl FusedResidual {
    pub fn new(body: Vec<Box<dyn Layer>>, tail: BatchNorm2d) -> Self {
        Self {
            body,
            tail,
            saved_output: None,
        }
    }
}

impl Layer for FusedResidual {
    fn sublayers(&self) -> Vec<&dyn Layer> {
        self.body.iter().map(|l| l.as_ref()).collect()
    }

    fn describe(&self) -> String {
        let names: Vec<String> = self
            .body
            .iter()
            .map(|l| short_name(&l.describe()).to_string())
            .collect();
        format!("residual[{},bn+add+relu]", names.join(","))
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        let body = body_shape(&self.body, input)?;
        kept_shape(input, self.tail.output_shape(&body)?)
    }

    /// The body's multiply-adds (the tail's work is elementwise: 0).
    fn macs(&self, input: &[usize]) -> Result<u64> {
        self.output_shape(input)?;
        body_macs(&self.body, input)
    }

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        self.saved_output = None;
        let mut z = input.clone();
        for layer in &mut self.body {
            let next = layer.forward(&z, mode)?;
            profile::mark_layer("fwd", layer.as_ref(), "in", z.shape());
            z = next;
        }
        let y = self.tail.forward_add_relu(&z, input, mode)?;
        profile::mark(|| {
            format!(
                "fwd residual {}+add+relu in {}",
                self.tail.describe(),
                profile::dims(z.shape())
            )
        });
        if mode == Mode::Train {
            self.saved_output = Some(y.clone());
        }
        Ok(y)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let out = self
            .saved_output
            .take()
            .ok_or(ModelError::NoSavedActivation { op: "residual" })?;
        grad_output.expect_shape("residual backward", out.shape())?;
        let masked = relu_backward(grad_output, &out)?;
        drop(out);
        let mut g = self.tail.backward(&masked)?;
        profile::mark(|| {
            format!(
                "bwd residual {}+add+relu out {}",
                self.tail.describe(),
                profile::dims(masked.shape())
            )
        });
        for layer in self.body.iter_mut().rev() {
            let next = layer.backward(&g)?;
            profile::mark_layer("bwd", layer.as_ref(), "out", g.shape());
            g = next;
        }
        g.expect_shape("residual backward (body gradient)", masked.shape())?;
        par_add_assign(g.try_data_mut()?, masked.data());
        profile::mark(|| format!("bwd residual add out {}", profile::dims(masked.shape())));
        Ok(g)
    }

    fn marks_its_parts(&self) -> bool {
        true
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut params: Vec<&mut Param> =
            self.body.iter_mut().flat_map(|l| l.params_mut()).collect();
        params.extend(self.tail.params_mut());
        params
    }

    fn buffers_mut(&mut self) -> Vec<&mut Tensor> {
        let mut buffers: Vec<&mut Tensor> =
            self.body.iter_mut().flat_map(|l| l.buffers_mut()).collect();
        buffers.extend(self.tail.buffers_mut());
        buffers
    }

    fn dropout_seeds(&self) -> Vec<u64> {
        let mut seeds: Vec<u64> = self.body.iter().flat_map(|l| l.dropout_seeds()).collect();
        seeds.extend(self.tail.dropout_seeds());
        seeds
    }

    fn shift_dropout(&mut self, offset: u64, advance: u64) {
        self.body
            .iter_mut()
            .for_each(|l| l.shift_dropout(offset, advance));
        self.tail.shift_dropout(offset, advance);
    }

    fn clear_saved(&mut self) {
        self.saved_output = None;
        for layer in &mut self.body {
            layer.clear_saved();
        }
        self.tail.clear_saved();
    }

    fn set_recompute(&mut self, on: bool) {
        for layer in &mut self.body {
            layer.set_recompute(on);
        }
        self.tail.set_recompute(on);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::check_layer;
    use crate::gradcheck::random_tensor as random;
    use crate::init::InitRng;
    use crate::layers::{BatchNorm2d, GlobalAvgPool, Linear, Relu};

    #[test]
    fn forward_adds_the_input_to_the_body() {
        let mut rng = InitRng::new(1);
        let mut lin = Linear::new("fc", 4, 4, true, &mut rng);
        let x = random(&[3, 4], 2);
        let body_out = lin.forward(&x, Mode::Eval).unwrap();
        let mut res = Residual::new(vec![Box::new(Linear::new(
            "fc",
            4,
            4,
            true,
            &mut InitRng::new(1),
        ))]);
        let y = res.forward(&x, Mode::Eval).unwrap();
        for ((&a, &b), &c) in y.data().iter().zip(body_out.data()).zip(x.data()) {
            assert_eq!(a, b + c);
        }
        // An empty body doubles.
        let y = Residual::new(Vec::new()).forward(&x, Mode::Eval).unwrap();
        for (&a, &c) in y.data().iter().zip(x.data()) {
            assert_eq!(a, 2.0 * c);
        }
    }

    #[test]
    fn gradient_matches_finite_differences_around_a_linear() {
        let mut rng = InitRng::new(3);
        let mut res = Residual::new(vec![
            Box::new(Linear::new("a", 5, 5, true, &mut rng)),
            Box::new(Linear::new("b", 5, 5, false, &mut rng)),
        ]);
        let x = random(&[4, 5], 4);
        let report = check_layer(&mut res, &x, 1e-2, 1e-3);
        assert!(report.is_ok(), "{}", report.unwrap_err());
    }

    #[test]
    fn gradient_matches_finite_differences_around_a_batch_norm() {
        let mut res = Residual::new(vec![Box::new(BatchNorm2d::new("bn", 3, 0.1, 1e-5))]);
        for (i, p) in res.params_mut().into_iter().enumerate() {
            for (j, v) in p.value.data_mut().iter_mut().enumerate() {
                *v = 0.7 + 0.3 * (i + j) as f32;
            }
        }
        let x = random(&[4, 3, 3, 3], 5);
        let report = check_layer(&mut res, &x, 1e-2, 1e-2);
        assert!(report.is_ok(), "{}", report.unwrap_err());
    }

    #[test]
    fn delegates_params_buffers_and_describe() {
        let mut rng = InitRng::new(1);
        let mut res = Residual::new(vec![
            Box::new(BatchNorm2d::new("x.bn1", 2, 0.1, 1e-5)),
            Box::new(Relu::new()),
            Box::new(BatchNorm2d::new("x.bn2", 2, 0.1, 1e-5)),
        ]);
        assert_eq!(res.describe(), "residual[bn,relu,bn]");
        let names: Vec<String> = res.params_mut().iter().map(|p| p.name.clone()).collect();
        assert_eq!(
            names,
            ["x.bn1.gamma", "x.bn1.beta", "x.bn2.gamma", "x.bn2.beta"]
        );
        assert_eq!(res.buffers_mut().len(), 4);
        assert_eq!(res.output_shape(&[5, 5, 2]).unwrap(), vec![5, 5, 2]);
        assert_eq!(res.macs(&[5, 5, 2]).unwrap(), 0);
        let lin = Residual::new(vec![Box::new(Linear::new("fc", 3, 3, true, &mut rng))]);
        assert_eq!(lin.describe(), "residual[linear]");
        assert_eq!(lin.macs(&[3]).unwrap(), 9);
    }

    #[test]
    fn a_body_that_changes_the_shape_is_an_error() {
        let mut rng = InitRng::new(1);
        let mut res = Residual::new(vec![Box::new(Linear::new("fc", 4, 3, true, &mut rng))]);
        let err = res.output_shape(&[4]).unwrap_err();
        assert!(err.to_string().contains("residual"), "{err}");
        let err = res.forward(&random(&[2, 4], 1), Mode::Train).unwrap_err();
        assert!(err.to_string().contains("residual"), "{err}");
        let mut pool = Residual::new(vec![Box::new(GlobalAvgPool::new())]);
        let err = pool
            .forward(&random(&[2, 3, 3, 4], 1), Mode::Train)
            .unwrap_err();
        assert!(err.to_string().contains("residual"), "{err}");
    }

    #[test]
    fn backward_needs_a_training_forward_and_clear_saved_drops_it() {
        let mut rng = InitRng::new(1);
        let mut res = Residual::new(vec![Box::new(Linear::new("fc", 3, 3, true, &mut rng))]);
        let x = random(&[2, 3], 1);
        assert!(matches!(
            res.backward(&x),
            Err(ModelError::NoSavedActivation { op: "residual" })
        ));
        res.forward(&x, Mode::Eval).unwrap();
        assert!(matches!(
            res.backward(&x),
            Err(ModelError::NoSavedActivation { .. })
        ));
        res.forward(&x, Mode::Train).unwrap();
        res.clear_saved();
        assert!(matches!(
            res.backward(&x),
            Err(ModelError::NoSavedActivation { .. })
        ));
        res.forward(&x, Mode::Train).unwrap();
        let err = res.backward(&random(&[2, 4], 2)).unwrap_err();
        assert!(err.to_string().contains("residual backward"), "{err}");
    }

    /// The body and tail a basic block has: conv, bn(+relu), conv; bn.
    fn block(fuse: bool) -> (Vec<Box<dyn Layer>>, BatchNorm2d) {
        let mut rng = InitRng::new(11);
        let conv = |name: &str, rng: &mut InitRng| {
            Box::new(crate::layers::Conv2d::new(name, 20, 20, 3, 1, 1, false, rng).unwrap())
        };
        let mut body: Vec<Box<dyn Layer>> = vec![conv("c1", &mut rng)];
        let bn = BatchNorm2d::new("bn1", 20, 0.1, 1e-5);
        if fuse {
            body.push(Box::new(bn.with_relu()));
        } else {
            body.push(Box::new(bn));
            body.push(Box::new(Relu::new()));
        }
        body.push(conv("c2", &mut rng));
        (body, BatchNorm2d::new("bn2", 20, 0.1, 1e-5))
    }

    #[test]
    fn fused_block_matches_residual_then_relu_bit_for_bit() {
        let x = random(&[2, 6, 5, 20], 21);
        let g = random(&[2, 6, 5, 20], 22);
        let (body, tail) = block(false);
        let mut body = body;
        body.push(Box::new(tail));
        let mut plain: Vec<Box<dyn Layer>> =
            vec![Box::new(Residual::new(body)), Box::new(Relu::new())];
        let (body, tail) = block(true);
        let mut fused = FusedResidual::new(body, tail);
        let bits = |t: &Tensor| t.data().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for mode in [Mode::Train, Mode::Eval] {
            let mut want = x.clone();
            for layer in &mut plain {
                want = layer.forward(&want, mode).unwrap();
            }
            let got = fused.forward(&x, mode).unwrap();
            assert_eq!(bits(&want), bits(&got), "{mode:?} forward");
            if mode == Mode::Train {
                let mut want = g.clone();
                for layer in plain.iter_mut().rev() {
                    want = layer.backward(&want).unwrap();
                }
                let got = fused.backward(&g).unwrap();
                assert_eq!(bits(&want), bits(&got), "input gradient");
                let plain_params: Vec<(String, Vec<u32>)> = plain
                    .iter_mut()
                    .flat_map(|l| l.params_mut())
                    .map(|p| (p.name.clone(), bits(&p.grad)))
                    .collect();
                let fused_params: Vec<(String, Vec<u32>)> = fused
                    .params_mut()
                    .into_iter()
                    .map(|p| (p.name.clone(), bits(&p.grad)))
                    .collect();
                assert_eq!(plain_params, fused_params, "parameter gradients");
            }
        }
        assert_eq!(fused.describe(), "residual[conv,bn+relu,conv,bn+add+relu]");
        assert_eq!(fused.buffers_mut().len(), 4);
    }

    #[test]
    fn fused_block_gradient_matches_finite_differences() {
        // y = relu(bn(x) + x): the tail alone.
        let body: Vec<Box<dyn Layer>> = Vec::new();
        let mut tail = BatchNorm2d::new("bn", 3, 0.1, 1e-5);
        for (i, p) in tail.params_mut().into_iter().enumerate() {
            for (j, v) in p.value.data_mut().iter_mut().enumerate() {
                *v = [0.5, 0.3][i] + 0.1 * j as f32;
            }
        }
        let mut fused = FusedResidual::new(body, tail);
        // Values near ±1 keep relu(bn(x) + x) far from the kink.
        let x = crate::gradcheck::bimodal(&[4, 3, 3, 3], 5);
        let report = check_layer(&mut fused, &x, 1e-2, 1e-2);
        assert!(report.is_ok(), "{}", report.unwrap_err());
        // Backward needs a training forward.
        fused.clear_saved();
        assert!(matches!(
            fused.backward(&x),
            Err(ModelError::NoSavedActivation { op: "residual" })
        ));
    }
}
