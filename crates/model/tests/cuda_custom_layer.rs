//! A layer of your own with a CUDA implementation trains in a GPU network:
//! a `custom` entry whose CPU layer (`Layer`) returns a `CudaLayer` from
//! `to_cuda` is built into `CudaNetwork::from_cpu` at its place, with its
//! parameters in the CPU network's order, and its forward and gradients
//! match the CPU network's; one without a CUDA implementation is refused,
//! naming it. On a machine without a GPU this runs on the CPU emulator of
//! CUDA (`headroom-cuda-emu`), as the parity tests do.

use headroom_model::cuda::{
    CudaBackend, CudaBuildOptions, CudaNetwork, CudaTensor, DType, MAX_BLOCK_THREADS,
};
use headroom_model::init::InitRng;
use headroom_model::{BuildOptions, CheckpointPolicy, Mode, Network, Tensor};

#[path = "../../../tests/src/nvrtc_gate.rs"]
#[macro_use]
mod nvrtc_gate;

report_nvrtc_tests!("cuda_custom_layer", include_str!("cuda_custom_layer.rs"));

#[path = "common/mix_layer.rs"]
mod mix_layer;
use mix_layer::{registry, spec};

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
