//! Builds the tests that need NVRTC (tests/cuda_learner.rs) to run, or as
//! ignored where it is missing: crates/model/build.rs says how.

#[allow(dead_code)]
#[path = "../model/build.rs"]
mod model_build;

fn main() {
    model_build::nvrtc_tests::configure();
}
