//! A residual connection: y = body(x) + x, where the body must keep the shape.
//!
//! The wrapper itself saves only the input's shape (to check the gradient and
//! to know a training forward happened); the body's layers save what they
//! need. Backward: g_in = body.backward(g) + g.

use super::activation::par_add_assign;
use crate::{Layer, Mode, ModelError, Param, Result, Tensor};

pub struct Residual {
    body: Vec<Box<dyn Layer>>,
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

/// "conv3x3/1 32->32" -> "conv", "bn 32" -> "bn": the leading name.
fn short_name(describe: &str) -> &str {
    let end = describe
        .find(|ch: char| !(ch.is_ascii_alphabetic() || ch == '_'))
        .unwrap_or(describe.len());
    if end == 0 {
        describe
    } else {
        &describe[..end]
    }
}

impl Layer for Residual {
    fn describe(&self) -> String {
        let names: Vec<String> = self
            .body
            .iter()
            .map(|l| short_name(&l.describe()).to_string())
            .collect();
        format!("residual[{}]", names.join(","))
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        let mut shape = input.to_vec();
        for layer in &self.body {
            shape = layer.output_shape(&shape)?;
        }
        if shape != input {
            return Err(ModelError::Shape {
                op: "residual",
                expected: format!("a body that keeps the shape {input:?}"),
                got: format!("a body that maps it to {shape:?}"),
            });
        }
        Ok(shape)
    }

    /// The body's multiply-adds; the addition counts 0 like other
    /// elementwise work.
    fn macs(&self, input: &[usize]) -> Result<u64> {
        self.output_shape(input)?;
        let mut shape = input.to_vec();
        let mut total = 0;
        for layer in &self.body {
            total += layer.macs(&shape)?;
            shape = layer.output_shape(&shape)?;
        }
        Ok(total)
    }

    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        self.saved_shape = None;
        let mut y = input.clone();
        for layer in &mut self.body {
            y = layer.forward(&y, mode)?;
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
            g = layer.backward(&g)?;
        }
        g.expect_shape("residual backward (body gradient)", &shape)?;
        par_add_assign(g.try_data_mut()?, grad_output.data());
        Ok(g)
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        self.body.iter_mut().flat_map(|l| l.params_mut()).collect()
    }

    fn buffers_mut(&mut self) -> Vec<&mut Tensor> {
        self.body.iter_mut().flat_map(|l| l.buffers_mut()).collect()
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
}
