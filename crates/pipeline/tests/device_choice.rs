//! Choosing the device on a machine without a GPU: "cuda" is an error that
//! names the key and what is missing; "auto" trains on the CPU. (This test
//! binary never installs the CUDA emulator.)

use std::path::Path;

use headroom_model::cuda::CudaBackend;
use headroom_model::memory::MemoryPool;
use headroom_model::Device;
use headroom_pipeline::learner::CudaOptions;
use headroom_pipeline::{ExperimentConfig, Overrides};

fn smoke(kind: &str) -> ExperimentConfig {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments/smoke.toml");
    let overrides = Overrides::parse(&[format!("device.kind={kind}")]).unwrap();
    ExperimentConfig::load(&path, &overrides).unwrap()
}

fn open(kind: &str) -> Result<String, String> {
    let pool = MemoryPool::new(Device::Cpu);
    headroom_pipeline::train::open(&smoke(kind), pool, CudaOptions::default())
        .map(|l| l.device_name())
        .map_err(|e| e.to_string())
}

#[test]
fn without_a_gpu_cuda_is_a_named_error_and_auto_is_the_cpu() {
    if let Ok(Some(info)) = CudaBackend::probe() {
        eprintln!("device_choice: skipped, this machine has a GPU ({info})");
        return;
    }
    let err = open("cuda").unwrap_err();
    assert!(
        err.contains("device.kind") && err.contains("cannot be used"),
        "{err}"
    );
    assert_eq!(open("auto").unwrap(), "cpu");
    assert_eq!(open("cpu").unwrap(), "cpu");
}
