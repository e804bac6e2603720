//! One module per command of `cargo xtask` (the command line itself is in
//! main.rs).

pub mod bench;
pub mod doctor;
pub mod eval;
pub mod export;
pub mod gpu_check;
pub mod loader_bench;
pub mod lora_merge;
pub mod memcheck;
pub mod preprocess;
pub mod train;
