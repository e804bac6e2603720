//! Builds the tests that need NVRTC (tests/cuda_*.rs) to run, or as
//! ignored where it is missing: crates/model/build.rs says how.

#[allow(dead_code)]
#[path = "../crates/model/build.rs"]
mod model_build;

fn main() {
    model_build::nvrtc_tests::configure();
}
