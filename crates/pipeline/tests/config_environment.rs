//! An environment variable's bad value is blamed on the variable. Its own
//! test binary: the variable it sets would leak into tests running beside it.

use std::path::Path;

use headroom_pipeline::{ExperimentConfig, Overrides};

#[test]
fn a_bad_environment_value_names_the_variable() {
    let smoke = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments/smoke.toml");
    std::env::set_var("HEADROOM__RUN__LOG_EVERY", "often");
    let err = ExperimentConfig::load(&smoke, &Overrides::default())
        .unwrap_err()
        .to_string();
    std::env::remove_var("HEADROOM__RUN__LOG_EVERY");
    assert!(
        err.contains("environment variable HEADROOM__RUN__LOG_EVERY"),
        "{err}"
    );
    assert!(!err.contains("smoke.toml"), "{err}");
}
