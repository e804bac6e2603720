//! A custom layer with a CUDA form, for the tests that train one on the
//! GPU: `Mix` (y = x·W, no bias) and its GPU form `MixGpu` (the linear
//! layer's cuBLAS launches), registered as "mix" (with its CUDA form,
//! `register_with_cuda`) and "mix_cpu_only" (the same layer, none).
//! Included by `crates/model/tests/cuda_custom_layer.rs` and
//! `crates/pipeline/tests/cuda_learner.rs`.

#![allow(dead_code)]

use headroom_model::cuda::layer::{
    compute, missing, with_grads, CudaBuildContext, CudaLayer, Groups, Input, Keep, ParamRef, Pass,
    Saved,
};
use headroom_model::cuda::{ops, CudaBackend, CudaResult, CudaTensor};
use std::collections::BTreeMap;

use headroom_model::{
    CheckpointPolicy, CustomLayerArgs, Layer, LayerRegistry, LayerSpec, Mode, ModelSpec, Param,
    Tensor,
};

/// y[n, out] = x[n, in] · W[in, out], no bias: the custom layer's CPU form.
pub struct Mix {
    weight: Param,
    out: usize,
    saved: Option<Tensor>,
    /// Whether it brings its CUDA form.
    cuda: bool,
}

impl Mix {
    fn input_features(&self) -> usize {
        self.weight.value.shape()[0]
    }
}

impl Layer for Mix {
    fn describe(&self) -> String {
        format!("mix to {}", self.out)
    }

    fn output_shape(&self, input: &[usize]) -> headroom_model::Result<Vec<usize>> {
        assert_eq!(input, [self.input_features()]);
        Ok(vec![self.out])
    }

    fn macs(&self, _input: &[usize]) -> headroom_model::Result<u64> {
        Ok((self.input_features() * self.out) as u64)
    }

    fn forward(&mut self, x: &Tensor, mode: Mode) -> headroom_model::Result<Tensor> {
        let (n, inf, out) = (x.shape()[0], self.input_features(), self.out);
        let w = self.weight.value.data();
        let y = Tensor::try_from_fn(&[n, out], |i| {
            let (row, o) = (i / out, i % out);
            (0..inf)
                .map(|k| x.data()[row * inf + k] * w[k * out + o])
                .sum()
        })?;
        if mode == Mode::Train {
            self.saved = Some(x.clone());
        }
        Ok(y)
    }

    fn backward(&mut self, g: &Tensor) -> headroom_model::Result<Tensor> {
        let x = self.saved.take().expect("a training forward first");
        let (n, inf, out) = (x.shape()[0], self.input_features(), self.out);
        let grad = self.weight.grad.data_mut();
        for k in 0..inf {
            for o in 0..out {
                grad[k * out + o] += (0..n)
                    .map(|row| x.data()[row * inf + k] * g.data()[row * out + o])
                    .sum::<f32>();
            }
        }
        let w = self.weight.value.data();
        Tensor::try_from_fn(&[n, inf], |i| {
            let (row, k) = (i / inf, i % inf);
            (0..out)
                .map(|o| g.data()[row * out + o] * w[k * out + o])
                .sum()
        })
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        vec![&mut self.weight]
    }

    fn clear_saved(&mut self) {
        self.saved = None;
    }

    fn to_cuda(
        &self,
        ctx: &mut CudaBuildContext<'_, '_>,
    ) -> Option<CudaResult<Box<dyn CudaLayer>>> {
        if !self.cuda {
            return None;
        }
        let out = self.out;
        Some(
            ctx.param(self.weight.value.len())
                .map(|weight| Box::new(MixGpu { weight, out }) as Box<dyn CudaLayer>),
        )
    }
}

/// The GPU form: the linear layer's cuBLAS launches, no bias.
#[derive(Debug)]
pub struct MixGpu {
    weight: ParamRef,
    out: usize,
}

impl CudaLayer for MixGpu {
    fn describe(&self) -> String {
        format!("mix to {}", self.out)
    }

    fn forward(
        &mut self,
        be: &CudaBackend,
        groups: &Groups,
        input: &Input<'_>,
        _pass: Pass,
        _saved: Option<&mut Vec<Saved>>,
    ) -> CudaResult<(CudaTensor, Keep)> {
        let w = compute(groups, &self.weight);
        let y = ops::linear_forward(be, input.tensor(), &w, None, self.out)?;
        Ok((y, Keep::Input))
    }

    fn backward(
        &mut self,
        be: &CudaBackend,
        groups: &mut Groups,
        saved: &mut Vec<Saved>,
        g: CudaTensor,
    ) -> CudaResult<CudaTensor> {
        let Some(Saved::Input(x)) = saved.pop() else {
            return Err(missing());
        };
        let x = x.take(be)?;
        with_grads(groups, &self.weight, None, |mut v| {
            ops::linear_backward(be, &x, &g, &v.compute, &mut v.grad, None)
        })
    }
}

pub fn registry() -> LayerRegistry {
    let make = |cuda: bool| {
        move |args: &mut CustomLayerArgs<'_>| -> headroom_model::Result<Box<dyn Layer>> {
            let inf = args.input_shape.iter().product::<usize>();
            let out = args.option_or("out", 4.0) as usize;
            let scale = (1.0 / inf as f64).sqrt();
            let rng = &mut *args.rng;
            let weight = Tensor::try_from_fn(&[inf, out], |_| (scale * rng.normal()) as f32)?;
            Ok(Box::new(Mix {
                weight: Param::new(format!("{}.weight", args.path), weight, true),
                out,
                saved: None,
                cuda,
            }))
        }
    };
    LayerRegistry::new()
        .register_with_cuda("mix", make(true))
        .register("mix_cpu_only", make(false))
}

/// conv, relu, flatten, then the custom layer (6·6·3 → 4 scores).
pub fn spec(custom: &str, checkpoint: CheckpointPolicy) -> ModelSpec {
    ModelSpec {
        input: [6, 6, 2],
        mean: 0.0,
        std: 1.0,
        layers: vec![
            LayerSpec::Conv {
                out: 3,
                kernel: 3,
                stride: 1,
                padding: None,
                bias: true,
            },
            LayerSpec::Relu,
            LayerSpec::Flatten,
            LayerSpec::Custom {
                name: custom.into(),
                options: BTreeMap::from([("out".to_string(), 4.0)]),
            },
        ],
        checkpoint,
        tokens: None,
        frames: None,
    }
}
