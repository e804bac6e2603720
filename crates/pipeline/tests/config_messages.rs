//! Configuration errors say where the bad value came from and what was
//! expected, once; `--set` reads values the way the environment does.

use std::path::{Path, PathBuf};

use headroom_pipeline::config::{parse_bytes, ScheduleConfig};
use headroom_pipeline::{ExperimentConfig, Overrides};

fn smoke() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments/smoke.toml")
}

fn load(sets: &[&str]) -> Result<ExperimentConfig, String> {
    let pairs: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    ExperimentConfig::load(&smoke(), &Overrides::parse(&pairs).unwrap()).map_err(|e| e.to_string())
}

#[test]
fn set_reaches_tagged_tables_like_the_environment_does() {
    let config = load(&["schedule.pct_start=0.5"]).unwrap();
    let ScheduleConfig::OneCycle { pct_start, .. } = config.schedule else {
        panic!("smoke uses one_cycle");
    };
    assert_eq!(pct_start, 0.5);
}

#[test]
fn a_bad_set_value_blames_the_set_not_the_file() {
    let err = load(&["train.epochs=many"]).unwrap_err();
    assert!(err.contains("--set train.epochs"), "{err}");
    assert!(!err.contains("smoke.toml"), "{err}");
}

#[test]
fn an_unknown_set_key_blames_the_set_not_the_file() {
    for (set, key) in [
        ("loader.workers=4", "loader.workers"),
        ("trian.epochs=2", "trian.epochs"),
    ] {
        let err = load(&[set]).unwrap_err();
        assert!(err.contains(&format!("--set {key}:")), "{err}");
        assert!(err.contains("unknown field"), "{err}");
        assert!(!err.contains("smoke.toml"), "{err}");
    }
}

#[test]
fn byte_sizes_are_explained_as_byte_sizes() {
    assert_eq!(
        parse_bytes("device.memory_limit", "3.5GiB").unwrap(),
        3_758_096_384
    );
    assert_eq!(
        parse_bytes("device.memory_limit", "500MB").unwrap(),
        500_000_000
    );
    assert_eq!(parse_bytes("device.memory_limit", "4096").unwrap(), 4096);
    let err = parse_bytes("device.memory_limit", "lots")
        .unwrap_err()
        .to_string();
    assert!(err.contains("device.memory_limit"), "{err}");
    assert!(err.contains("byte size"), "{err}");
    assert!(!err.contains("shard"), "{err}");
}

#[test]
fn run_name_cannot_leave_the_runs_directory() {
    for name in ["../../x", "a/b", "..", "/etc"] {
        let err = load(&[&format!("run.name={name}")]).unwrap_err();
        assert!(err.contains("run.name"), "{name}: {err}");
    }
}

#[test]
fn test_time_augmentation_is_named_when_it_cannot_apply() {
    let err = load(&["eval.tta=rotate"]).unwrap_err();
    assert!(err.contains("eval.tta"), "{err}");
    let tiny_gpt = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments/tiny_gpt.toml");
    let flip = Overrides::parse(&["eval.tta=flip".to_string()]).unwrap();
    let err = ExperimentConfig::load(&tiny_gpt, &flip)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("eval.tta") && err.contains("model.tokens"),
        "{err}"
    );
    assert!(load(&["eval.tta=flip"]).is_ok());
}

#[test]
fn data_on_device_reads_true_false_and_auto_and_refuses_the_rest() {
    use headroom_pipeline::config::OnDevice;
    for (text, expected) in [
        ("true", OnDevice::Always),
        ("false", OnDevice::Never),
        ("auto", OnDevice::Auto),
    ] {
        let config = load(&[&format!("data.on_device={text}")]).unwrap();
        assert_eq!(config.data.on_device, expected, "{text}");
    }
    assert_eq!(load(&[]).unwrap().data.on_device, OnDevice::Auto);
    let err = load(&["data.on_device=gpu"]).unwrap_err();
    assert!(err.contains("data.on_device"), "{err}");
    assert!(err.contains("\"auto\""), "{err}");
}

#[test]
fn the_conv_workspace_is_a_positive_byte_size() {
    let default = load(&[]).unwrap().conv_workspace().unwrap();
    assert_eq!(default, headroom_model::cuda::ops::CONV_SCRATCH_BYTES);
    let set = load(&["device.conv_workspace=64MiB"]).unwrap();
    assert_eq!(set.conv_workspace().unwrap(), 64 << 20);
    for bad in ["0", "lots"] {
        let err = load(&[&format!("device.conv_workspace={bad}")]).unwrap_err();
        assert!(err.contains("device.conv_workspace"), "{bad}: {err}");
        assert!(err.contains(bad), "{bad}: {err}");
    }
}

#[test]
fn the_conv_algorithm_is_im2col_implicit_gemm_auto_or_tune() {
    use headroom_model::cuda::ops::{ConvAlgorithm, ConvPlan, CONV_SCRATCH_BYTES};
    assert_eq!(
        load(&[]).unwrap().conv_plan().unwrap(),
        ConvPlan {
            algorithm: ConvAlgorithm::Auto,
            workspace: CONV_SCRATCH_BYTES,
        },
        "auto by default"
    );
    let im2col = load(&["device.conv_algorithm=im2col"]).unwrap();
    assert_eq!(im2col.conv_plan().unwrap(), ConvPlan::default());
    let set = load(&[
        "device.conv_algorithm=implicit_gemm",
        "device.conv_workspace=4MiB",
    ])
    .unwrap();
    assert_eq!(
        set.conv_plan().unwrap(),
        ConvPlan {
            algorithm: ConvAlgorithm::ImplicitGemm,
            workspace: 4 << 20,
        }
    );
    let tune = load(&["device.conv_algorithm=tune"]).unwrap();
    assert_eq!(tune.conv_plan().unwrap().algorithm, ConvAlgorithm::Tune);
    let err = load(&["device.conv_algorithm=winograd"]).unwrap_err();
    assert!(err.contains("device.conv_algorithm"), "{err}");
    assert!(err.contains("\"auto\" or \"tune\""), "{err}");
    assert!(err.contains("winograd"), "{err}");
}

/// The word-valued settings are enums: a word they do not know is refused
/// while the experiment is read, naming the `--set`, the key and every word
/// they take; the known words read back as themselves.
#[test]
fn word_settings_name_the_key_and_every_word_they_take() {
    for (set, expected) in [
        (
            "device.kind=gpu",
            "\"auto\", \"cpu\" or \"cuda\", got \"gpu\"",
        ),
        (
            "data.format=parquet",
            "\"idx\", \"shards\", \"text\", \"moving_fashion_mnist\", \"image_folder\", \"csv\" or \"tensors\", got \"parquet\"",
        ),
        (
            "memory.oom_policy=retry",
            "\"adapt\" or \"stop\", got \"retry\"",
        ),
        (
            "device.conv_algorithm=winograd",
            "\"im2col\", \"implicit_gemm\", \"auto\" or \"tune\", got \"winograd\"",
        ),
    ] {
        let err = load(&[set]).unwrap_err();
        let key = set.split('=').next().unwrap();
        assert!(err.contains(&format!("--set {key}")), "{set}: {err}");
        assert!(err.contains(expected), "{set}: {err}");
    }
    let config = load(&[
        "device.kind=cpu",
        "memory.oom_policy=stop",
        "device.conv_algorithm=implicit_gemm",
    ])
    .unwrap();
    // Flattened (the run's recorded settings) as the strings were.
    let flat = config.flatten();
    assert_eq!(flat["device.kind"], "\"cpu\"");
    assert_eq!(flat["memory.oom_policy"], "\"stop\"");
    assert_eq!(flat["device.conv_algorithm"], "\"implicit_gemm\"");
    assert_eq!(flat["data.format"], "\"idx\"");
    assert_eq!(flat["run.profile"], "\"auto\"");
}

/// `device.precision` and `device.amp`: unset, `amp` decides (f16 or
/// f32); set, it wins, except that `amp = false` (`--no-amp`) accepts only
/// "f32"; an unknown word names the three; unset, it is not recorded.
#[test]
fn the_gpu_precision_follows_device_precision_then_amp() {
    use headroom_pipeline::device::Precision;
    let precision = |sets: &[&str]| load(sets).unwrap().device.precision();
    assert_eq!(precision(&[]).unwrap(), Precision::F16);
    assert_eq!(precision(&["device.amp=false"]).unwrap(), Precision::F32);
    assert_eq!(
        precision(&["device.precision=bf16"]).unwrap(),
        Precision::Bf16
    );
    assert_eq!(
        precision(&["device.precision=f32"]).unwrap(),
        Precision::F32
    );
    assert_eq!(
        precision(&["device.amp=false", "device.precision=f32"]).unwrap(),
        Precision::F32
    );
    let err = precision(&["device.amp=false", "device.precision=bf16"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("device.precision") && err.contains("device.amp = false"),
        "{err}"
    );
    let err = load(&["device.precision=f8"]).unwrap_err();
    assert!(err.contains("\"f16\", \"bf16\" or \"f32\""), "{err}");
    let recorded = toml::to_string(&load(&[]).unwrap()).unwrap();
    assert!(!recorded.contains("precision"), "{recorded}");
    let recorded = toml::to_string(&load(&["device.precision=bf16"]).unwrap()).unwrap();
    assert!(recorded.contains("precision = \"bf16\""), "{recorded}");
}
