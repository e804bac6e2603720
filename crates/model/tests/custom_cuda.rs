//! A layer of your own with a CUDA implementation trains in a GPU network:
//! a `custom` entry whose CPU layer (`Layer`) returns a `CudaLayer` from
//! `to_cuda` is built into `CudaNetwork::from_cpu` at its place, with its
//! parameters in the CPU network's order, and its forward and gradients
//! match the CPU network's; one without a CUDA implementation is refused,
//! naming it. On a machine without a GPU this runs on the CPU emulator of
//! CUDA (`headroom-cuda-emu`), as the parity tests do.

use std::collections::BTreeMap;

use headroom_model::cuda::layer::{
    compute, missing, with_grads, CudaBuildContext, CudaLayer, Groups, Input, Keep, ParamRef, Pass,
    Saved,
};
use headroom_model::cuda::{
    ops, CudaBackend, CudaBuildOptions, CudaNetwork, CudaResult, CudaTensor, DType,
    MAX_BLOCK_THREADS,
};
use headroom_model::init::InitRng;
use headroom_model::{
    BuildOptions, CheckpointPolicy, CustomLayerArgs, Layer, LayerRegistry, LayerSpec, Mode,
    ModelSpec, Network, Param, Tensor,
};

#[path = "../../../tests/src/nvrtc_gate.rs"]
#[macro_use]
mod nvrtc_gate;

report_nvrtc_tests!("custom_cuda", include_str!("custom_cuda.rs"));

/// y[n, out] = x[n, in] · W[in, out], no bias: the custom layer's CPU form.
struct Mix {
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
struct MixGpu {
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

fn registry() -> LayerRegistry {
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
        .register("mix", make(true))
        .register("mix_cpu_only", make(false))
}

/// conv, relu, flatten, then the custom layer (6·6·3 → 4 scores).
fn spec(custom: &str, checkpoint: CheckpointPolicy) -> ModelSpec {
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

fn cpu_network(custom: &str, checkpoint: CheckpointPolicy) -> Network {
    let spec = spec(custom, checkpoint);
    Network::build_with_layers(&spec, 9, BuildOptions::default(), &registry()).unwrap()
}

fn random(shape: &[usize], seed: u64) -> Tensor {
    let mut rng = InitRng::new(seed);
    Tensor::try_from_fn(shape, |_| rng.normal() as f32).unwrap()
}

/// The emulator's backend (or a real GPU's), None where neither can run;
/// under `HEADROOM_REQUIRE_NVRTC=1` (CI) that is a failure, not a skip.
fn backend() -> Option<CudaBackend> {
    let required = std::env::var("HEADROOM_REQUIRE_NVRTC").as_deref() == Ok("1");
    let skip = |why: String| {
        assert!(!required, "HEADROOM_REQUIRE_NVRTC=1 but {why}");
        eprintln!("SKIPPED: {why}");
        None
    };
    let real = headroom_cuda_emu::real_gpu_present()
        && std::env::var("HEADROOM_CUDA_EMULATE").as_deref() != Ok("1");
    if !real {
        if let Err(e) = headroom_cuda_emu::install_with_widest_block(MAX_BLOCK_THREADS) {
            return skip(format!("the CPU emulator of CUDA is unavailable: {e}"));
        }
    }
    match CudaBackend::probe() {
        Ok(Some(info)) => match CudaBackend::new(0) {
            Ok(be) => {
                eprintln!("running on {info}");
                Some(be)
            }
            Err(e) => skip(format!("the CUDA backend did not open: {e}")),
        },
        other => skip(format!("no CUDA device ({other:?})")),
    }
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let max = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-4 * w.abs() + 1e-5 * max,
            "{what}[{i}]: GPU {g}, CPU {w}"
        );
    }
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_custom_layer_with_a_cuda_form_trains_in_a_gpu_network_as_on_the_cpu() {
    let Some(be) = backend() else { return };
    let batches: Vec<Tensor> = (0..2).map(|i| random(&[5, 6, 6, 2], 20 + i)).collect();
    let grad = random(&[5, 4], 30);
    for checkpoint in [CheckpointPolicy::None, CheckpointPolicy::All] {
        let mut cpu = cpu_network("mix", checkpoint);
        let options = CudaBuildOptions {
            activations: DType::F32,
            ..CudaBuildOptions::default()
        };
        let mut gpu = CudaNetwork::from_cpu(&be, &mut cpu_network("mix", checkpoint), options)
            .expect("a custom layer with a CUDA form builds");
        let g = CudaTensor::from_tensor(&be, &grad, DType::F32).unwrap();
        for x in &batches {
            let want = cpu.forward(x, Mode::Train).unwrap();
            cpu.backward(&grad).unwrap();
            let xd = CudaTensor::from_tensor(&be, x, DType::F32).unwrap();
            let got = gpu.forward_train(&be, &xd).unwrap().to_host(&be).unwrap();
            gpu.backward(&be, &g).unwrap();
            assert_close("logits", &got, want.data());
        }
        let grads = gpu.read_grads(&be).unwrap();
        let cpu_grads: Vec<Vec<f32>> = cpu
            .params_mut()
            .iter()
            .map(|p| p.grad.data().to_vec())
            .collect();
        assert_eq!(grads.len(), 3, "conv weight and bias, the custom weight");
        assert!(
            grads[2].iter().any(|v| *v != 0.0),
            "the custom layer learns"
        );
        for (i, (g, c)) in grads.iter().zip(&cpu_grads).enumerate() {
            assert_close(&format!("gradient {i}"), g, c);
        }
        let xd = CudaTensor::from_tensor(&be, &batches[0], DType::F32).unwrap();
        let got = gpu.forward_eval(&be, &xd).unwrap().to_host(&be).unwrap();
        let want = cpu.forward(&batches[0], Mode::Eval).unwrap();
        assert_close("eval logits", &got, want.data());
    }
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_custom_layer_without_a_cuda_form_is_refused_by_name() {
    let Some(be) = backend() else { return };
    let mut cpu = cpu_network("mix_cpu_only", CheckpointPolicy::None);
    let err = CudaNetwork::from_cpu(&be, &mut cpu, CudaBuildOptions::default())
        .expect_err("no CUDA form")
        .to_string();
    assert!(
        err.contains(
            "model.layers[3]: the custom layer \"mix_cpu_only\" has no CUDA implementation"
        ),
        "{err}"
    );
}
