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

/// Reading an experiment asks nothing of the GPU: `load` judges
/// `run.profile = "auto"` as for the CPU, and `load_for_device` asks its
/// probe only for a kind that may use a GPU, and only when no
/// `device.memory_limit` decides.
#[test]
fn loading_an_experiment_asks_the_gpu_only_through_the_probe_it_is_given() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments/smoke.toml");
    let small_gpu = 2u64 << 30;
    let load = |sets: &[&str]| {
        let asked = std::cell::Cell::new(Vec::new());
        let pairs: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let config =
            ExperimentConfig::load_for_device(&path, &Overrides::parse(&pairs).unwrap(), |kind| {
                let mut seen = asked.take();
                seen.push(kind);
                asked.set(seen);
                Some(small_gpu)
            })
            .unwrap();
        // low_memory.toml sets the GPU's convolution workspace to 4 MiB.
        let low_memory = config.device.conv_workspace.as_deref() == Some("4MiB");
        (low_memory, asked.take())
    };
    use headroom_pipeline::device::DeviceKind;
    assert_eq!(
        load(&["device.kind=cuda"]),
        (true, vec![DeviceKind::Cuda]),
        "a 2 GiB GPU takes the low-memory profile"
    );
    assert_eq!(load(&["device.kind=auto"]), (true, vec![DeviceKind::Auto]));
    // The CPU's own memory decides for a CPU run (more than 4 GiB on any
    // machine these tests run on), and a set limit decides alone.
    assert_eq!(load(&["device.kind=cpu"]), (false, vec![]));
    assert_eq!(
        load(&["device.kind=cuda", "device.memory_limit=8GiB"]),
        (false, vec![])
    );
    assert_eq!(
        load(&["device.kind=cuda", "run.profile=none"]),
        (false, vec![])
    );
    // `load` is `load_for_device` with no GPU at all.
    let plain = ExperimentConfig::load(
        &path,
        &Overrides::parse(&["device.kind=cuda".to_string()]).unwrap(),
    )
    .unwrap();
    assert_eq!(plain.device.kind, DeviceKind::Cuda);
    assert_eq!(plain.device.conv_workspace, None);
}
