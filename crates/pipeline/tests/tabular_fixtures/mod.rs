//! What the table tests share: experiments/tabular.toml with `--set`
//! overrides, and a deterministic stream of values to make tables from.

use std::path::{Path, PathBuf};

use headroom_pipeline::{ExperimentConfig, Overrides};

pub fn tabular() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments/tabular.toml")
}

pub fn load(sets: &[String]) -> Result<ExperimentConfig, String> {
    let overrides = Overrides::parse(sets).map_err(|e| e.to_string())?;
    ExperimentConfig::load(&tabular(), &overrides).map_err(|e| e.to_string())
}

/// A deterministic value in [-1, 1) from `i` (no RNG crate needed).
pub fn noise(i: usize) -> f64 {
    let x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11;
    (x as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
}
