//! Activation checkpointing: a segment of layers that keeps only its own
//! input through a training step and recomputes the rest during backward.
//!
//! Training forward: each inner layer runs its training forward (so batch
//! norm normalises with the batch statistics and updates its running
//! statistics, once) and its saved activations are dropped as soon as it
//! returns; the segment saves its input only (a reference-counted handle, no
//! copy). Memory between forward and backward: one tensor per segment instead
//! of every inner activation.
//!
//! Backward: the inner layers are put in recompute mode (`Layer::set_recompute`:
//! batch norm leaves its running statistics alone), the training forward is
//! run again from the saved input to re-save the activations, recompute mode
//! is switched back off, and backward runs through the layers as usual.
//! Every layer's forward is a deterministic function of its input and
//! parameters (batch-norm statistics are recomputed from the same input), so
//! outputs, gradients and running statistics are bitwise identical to a
//! network without checkpointing; the cost is one more forward of the
//! segment per step. Peak memory during the backward of a segment is the
//! segment's own activations, held only while it runs.
//!
//! Eval forward: the inner layers' eval forward; nothing saved.

use crate::profile;
use crate::{Layer, Mode, ModelError, Param, Result, Tensor};

pub struct Checkpointed {
    layers: Vec<Box<dyn Layer>>,
    /// The input of the last training forward.
    saved_input: Option<Tensor>,
    /// Recompute mode set from outside (a checkpointed segment inside
    /// another, or a dry run); restored after our own recomputation.
    recompute: bool,
}

impl Checkpointed {
    pub fn new(layers: Vec<Box<dyn Layer>>) -> Self {
        Self {
            layers,
            saved_input: None,
            recompute: false,
        }
    }

    /// The wrapped layers, in order.
    pub fn layers(&self) -> &[Box<dyn Layer>] {
        &self.layers
    }

    fn set_inner_recompute(&mut self, on: bool) {
        for layer in &mut self.layers {
            layer.set_recompute(on);
        }
    }

    fn clear_inner(&mut self) {
        for layer in &mut self.layers {
            layer.clear_saved();
        }
    }

    /// Training forward through the inner layers; with `keep`, each layer
    /// keeps what its backward needs, else it is dropped at once.
    fn run_train(&mut self, input: &Tensor, keep: bool) -> Result<Tensor> {
        let mut x = input.clone();
        for layer in &mut self.layers {
            let y = layer.forward(&x, Mode::Train);
            if !keep {
                layer.clear_saved();
            }
            x = y?;
        }
        Ok(x)
    }

    fn forward_group(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        self.saved_input = None;
        match mode {
            Mode::Eval => {
                let mut x = input.clone();
                for layer in &mut self.layers {
                    x = layer.forward(&x, Mode::Eval)?;
                }
                Ok(x)
            }
            Mode::Train => {
                let out = self.run_train(input, false);
                if out.is_ok() {
                    self.saved_input = Some(input.clone());
                }
                out
            }
        }
    }

    fn backward_group(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let input = self
            .saved_input
            .take()
            .ok_or(ModelError::NoSavedActivation { op: "checkpoint" })?;
        self.set_inner_recompute(true);
        let recomputed = self.run_train(&input, true);
        self.set_inner_recompute(self.recompute);
        drop(input);
        let out = match recomputed {
            Ok(out) => out,
            Err(e) => {
                self.clear_inner();
                return Err(e);
            }
        };
        if let Err(e) = grad_output.expect_shape("checkpoint backward", out.shape()) {
            self.clear_inner();
            return Err(e);
        }
        // The recomputed output is not needed: only what the layers saved.
        drop(out);
        let mut g = grad_output.clone();
        for i in (0..self.layers.len()).rev() {
            match self.layers[i].backward(&g) {
                Ok(next) => g = next,
                Err(e) => {
                    self.clear_inner();
                    return Err(e);
                }
            }
        }
        Ok(g)
    }
}

impl Layer for Checkpointed {
    fn sublayers(&self) -> Vec<&dyn Layer> {
        self.layers.iter().map(|l| l.as_ref()).collect()
    }

    fn describe(&self) -> String {
        let names: Vec<String> = self.layers.iter().map(|l| l.describe()).collect();
        format!("checkpoint[{}]", names.join(", "))
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        let mut shape = input.to_vec();
        for layer in &self.layers {
            shape = layer.output_shape(&shape)?;
        }
        Ok(shape)
    }

    fn macs(&self, input: &[usize]) -> Result<u64> {
        let mut shape = input.to_vec();
        let mut total = 0;
        for layer in &self.layers {
            total += layer.macs(&shape)?;
            shape = layer.output_shape(&shape)?;
        }
        Ok(total)
    }

    /// A running profile sees the group whole (its parts' marks paused):
    /// the recompute in backward would read as a second forward.
    fn forward(&mut self, input: &Tensor, mode: Mode) -> Result<Tensor> {
        profile::paused(|| self.forward_group(input, mode))
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        profile::paused(|| self.backward_group(grad_output))
    }
    fn params_mut(&mut self) -> Vec<&mut Param> {
        self.layers
            .iter_mut()
            .flat_map(|l| l.params_mut())
            .collect()
    }

    fn buffers_mut(&mut self) -> Vec<&mut Tensor> {
        self.layers
            .iter_mut()
            .flat_map(|l| l.buffers_mut())
            .collect()
    }

    fn dropout_seeds(&self) -> Vec<u64> {
        self.layers.iter().flat_map(|l| l.dropout_seeds()).collect()
    }

    fn shift_dropout(&mut self, offset: u64, advance: u64) {
        self.layers
            .iter_mut()
            .for_each(|l| l.shift_dropout(offset, advance));
    }

    fn clear_saved(&mut self) {
        self.saved_input = None;
        self.clear_inner();
    }

    fn set_recompute(&mut self, on: bool) {
        self.recompute = on;
        self.set_inner_recompute(on);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::check_layer;
    use crate::gradcheck::random_tensor as random;
    use crate::init::InitRng;
    use crate::layers::{BatchNorm2d, Linear, Relu, Residual};

    /// bn, relu, residual[bn, relu], pool, linear; without the ReLUs (whose
    /// kinks a finite difference can straddle) for the gradient check.
    fn layers(seed: u64, relu: bool) -> Vec<Box<dyn Layer>> {
        let mut rng = InitRng::new(seed);
        let mut inner: Vec<Box<dyn Layer>> =
            vec![Box::new(BatchNorm2d::new("res.bn", 3, 0.1, 1e-5))];
        let mut out: Vec<Box<dyn Layer>> = vec![Box::new(BatchNorm2d::new("bn", 3, 0.1, 1e-5))];
        if relu {
            inner.push(Box::new(Relu::new()));
            out.push(Box::new(Relu::new()));
        }
        out.push(Box::new(Residual::new(inner)));
        out.push(Box::new(crate::layers::GlobalAvgPool::new()));
        out.push(Box::new(Linear::new("fc", 3, 2, true, &mut rng)));
        out
    }

    fn body(seed: u64) -> Vec<Box<dyn Layer>> {
        layers(seed, true)
    }

    /// Parameter gradients, then buffers.
    fn state<'a>(layers: impl Iterator<Item = &'a mut Box<dyn Layer>>) -> Vec<Vec<f32>> {
        let mut grads = Vec::new();
        let mut buffers = Vec::new();
        for l in layers {
            grads.extend(l.params_mut().iter().map(|p| p.grad.data().to_vec()));
            buffers.extend(l.buffers_mut().iter().map(|b| b.data().to_vec()));
        }
        grads.extend(buffers);
        grads
    }

    #[test]
    fn matches_the_plain_layers_bit_for_bit() {
        let x = random(&[4, 3, 3, 3], 1);
        let g = random(&[4, 2], 2);
        // Compare a Checkpointed with the same layers run one by one.
        let mut layers = body(7);
        let mut ck = Checkpointed::new(body(7));
        for _ in 0..2 {
            let mut y = x.clone();
            for l in &mut layers {
                y = l.forward(&y, Mode::Train).unwrap();
            }
            let yc = ck.forward(&x, Mode::Train).unwrap();
            assert_eq!(y.data(), yc.data());
            let mut gi = g.clone();
            for l in layers.iter_mut().rev() {
                gi = l.backward(&gi).unwrap();
            }
            let gc = ck.backward(&g).unwrap();
            assert_eq!(gi.data(), gc.data());
            assert_eq!(
                state(layers.iter_mut()),
                state(ck.layers.iter_mut()),
                "grads and running stats"
            );
        }
        // Eval agrees too, and saves nothing.
        let mut y = x.clone();
        for l in &mut layers {
            y = l.forward(&y, Mode::Eval).unwrap();
        }
        assert_eq!(y.data(), ck.forward(&x, Mode::Eval).unwrap().data());
        assert!(matches!(
            ck.backward(&g),
            Err(ModelError::NoSavedActivation { op: "checkpoint" })
        ));
    }

    #[test]
    fn keeps_only_its_input_between_forward_and_backward() {
        let x = random(&[4, 3, 3, 3], 3);
        let mut ck = Checkpointed::new(body(1));
        ck.forward(&x, Mode::Train).unwrap();
        let saved = ck.saved_input.as_ref().unwrap();
        assert_eq!(saved.data().as_ptr(), x.data().as_ptr());
        // No inner layer holds anything: their backward fails.
        for l in ck.layers.iter_mut() {
            assert!(l.backward(&x).is_err());
        }
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let mut ck = Checkpointed::new(layers(5, false));
        let x = random(&[4, 3, 3, 3], 4);
        let report = check_layer(&mut ck, &x, 1e-2, 1e-2);
        assert!(report.is_ok(), "{}", report.unwrap_err());
    }

    #[test]
    fn describes_its_layers_and_errors_leave_nothing_saved() {
        let mut ck = Checkpointed::new(body(1));
        assert!(ck.describe().starts_with("checkpoint[bn 3, relu, residual"));
        assert_eq!(ck.output_shape(&[3, 3, 3]).unwrap(), vec![2]);
        assert_eq!(ck.macs(&[3, 3, 3]).unwrap(), 6);
        let x = random(&[4, 3, 3, 3], 1);
        ck.forward(&x, Mode::Train).unwrap();
        let err = ck.backward(&random(&[4, 3], 2)).unwrap_err();
        assert!(err.to_string().contains("checkpoint backward"), "{err}");
        for l in ck.layers.iter_mut() {
            assert!(l.backward(&x).is_err());
        }
    }
}
