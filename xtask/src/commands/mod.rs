//! One module per command of `cargo xtask` (the command line itself is in
//! main.rs).

pub mod bench;
pub mod doctor;
pub mod eval;
pub mod export;
pub mod finetune_llm;
pub mod generate;
pub mod gpu_check;
pub mod job_bench;
pub mod llm_bench;
pub mod llm_data;
pub mod loader_bench;
pub mod lora_llm;
pub mod lora_llm_config;
pub mod lora_merge;
pub mod memcheck;
pub mod predict;
pub mod preprocess;
pub mod preprocess_bench;
pub mod train;

/// An experiment for a command that trains or times it: `run.profile =
/// "auto"` judged by the GPU the run will use (probed only for a
/// `device.kind` that may use one), where `ExperimentConfig::load` touches
/// no device.
pub fn load_experiment(
    path: &std::path::Path,
    overrides: &headroom_pipeline::Overrides,
) -> headroom_pipeline::Result<headroom_pipeline::ExperimentConfig> {
    headroom_pipeline::ExperimentConfig::load_for_device(
        path,
        overrides,
        headroom_pipeline::device::gpu_memory,
    )
}
