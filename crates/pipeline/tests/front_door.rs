//! The pipeline's front door: profiles are overlays kept apart from
//! experiments, `--set` takes TOML lists, `schedule.kind = "warmup_cosine"`
//! is reachable and followed, a finished run leaves no `.lock`, and
//! `plots.svg` draws each task's own figures with round ticks.

use std::path::{Path, PathBuf};

use headroom_optim::Schedule;
use headroom_pipeline::config::ScheduleConfig;
use headroom_pipeline::plot::{self, Task};
use headroom_pipeline::{train, ExperimentConfig, Overrides, Resume, TrainOptions};

fn experiments() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments")
}

fn overrides(sets: &[&str]) -> Overrides {
    let pairs: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    Overrides::parse(&pairs).unwrap()
}

fn load(path: &Path, sets: &[&str]) -> Result<ExperimentConfig, String> {
    ExperimentConfig::load(path, &overrides(sets)).map_err(|e| e.to_string())
}

// ---- profiles ----

#[test]
fn the_profiles_live_in_experiments_profiles() {
    for name in ["low_memory", "max_speed", "cpu"] {
        assert!(
            experiments()
                .join("profiles")
                .join(format!("{name}.toml"))
                .is_file(),
            "experiments/profiles/{name}.toml"
        );
        assert!(
            !experiments().join(format!("{name}.toml")).exists(),
            "experiments/{name}.toml is still beside the experiments"
        );
    }
}

#[test]
fn a_profile_overlays_the_experiment() {
    let smoke = experiments().join("smoke.toml");
    let plain = load(&smoke, &["run.profile=none"]).unwrap();
    assert_eq!(plain.device.kind.as_str(), "auto");
    let cpu = load(&smoke, &["run.profile=cpu"]).unwrap();
    assert_eq!(cpu.device.kind.as_str(), "cpu");
    let low = load(&smoke, &["run.profile=low_memory"]).unwrap();
    assert_eq!(low.train.micro_batch.as_deref(), Some("auto"));
    assert_eq!(low.data.prefetch, 2);
    // The experiment's own keys stay: the profile only overlays.
    assert_eq!(low.train.batch_size, plain.train.batch_size);
}

#[test]
fn every_experiment_loads_under_every_profile() {
    // "auto" applies low_memory on a small GPU to whatever the user trains:
    // no pairing of experiment and profile may be refused for a setting
    // the user never wrote (LoRA's train.accumulate met low_memory's
    // train.micro_batch on a 4 GiB GPU).
    let mut experiments_seen = 0;
    for entry in std::fs::read_dir(experiments()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("toml") {
            continue;
        }
        experiments_seen += 1;
        for profile in ["low_memory", "max_speed", "cpu"] {
            let set = format!("run.profile={profile}");
            if let Err(e) = load(&path, &[set.as_str()]) {
                panic!("{} with {profile}: {e}", path.display());
            }
        }
    }
    assert!(experiments_seen >= 8, "{experiments_seen} experiments");
}

#[test]
fn an_experiment_that_accumulates_keeps_its_micro_batch_under_low_memory() {
    let lora = experiments().join("lora_finetune.toml");
    let plain = load(&lora, &["run.profile=none"]).unwrap();
    assert!(plain.train.accumulate > 1, "lora_finetune accumulates");
    let low = load(&lora, &["run.profile=low_memory"]).unwrap();
    assert_eq!(low.train.micro_batch, None);
    assert_eq!(low.train.accumulate, plain.train.accumulate);
    assert_eq!(low.micro_batch().unwrap(), plain.micro_batch().unwrap());
    // The rest of the profile still applies.
    assert_eq!(low.data.prefetch, 2);
    // Where the experiment does not accumulate, the profile picks the
    // micro-batch as before.
    let smoke = load(
        &experiments().join("smoke.toml"),
        &["run.profile=low_memory"],
    )
    .unwrap();
    assert_eq!(smoke.train.micro_batch.as_deref(), Some("auto"));
}

#[test]
fn a_profile_given_as_the_experiment_is_refused_naming_the_flag() {
    let profile = experiments().join("profiles/low_memory.toml");
    let err = load(&profile, &[]).unwrap_err();
    assert!(err.contains("is a profile, not an experiment"), "{err}");
    assert!(err.contains("--profile low_memory"), "{err}");
    assert!(err.contains("low_memory.toml"), "{err}");
    // Not the puzzling message it used to give.
    assert!(!err.contains("missing"), "{err}");
}

#[test]
fn an_unknown_profile_names_the_key_the_path_and_the_profiles() {
    let err = load(&experiments().join("smoke.toml"), &["run.profile=tiny"]).unwrap_err();
    assert!(err.contains("run.profile"), "{err}");
    assert!(err.contains("profiles/tiny.toml"), "{err}");
    assert!(err.contains("cpu, low_memory, max_speed"), "{err}");
    let err = load(&experiments().join("smoke.toml"), &["run.profile=../smoke"]).unwrap_err();
    assert!(err.contains("run.profile"), "{err}");
}

#[test]
fn a_profile_is_found_beside_an_experiment_anywhere() {
    let dir = tempfile::tempdir().unwrap();
    let experiment = dir.path().join("mine.toml");
    std::fs::copy(experiments().join("smoke.toml"), &experiment).unwrap();
    std::fs::create_dir(dir.path().join("profiles")).unwrap();
    std::fs::write(
        dir.path().join("profiles/slow.toml"),
        "[train]\nthreads = 3\n",
    )
    .unwrap();
    let config = load(&experiment, &["run.profile=slow"]).unwrap();
    assert_eq!(config.train.threads, 3);
    // A file of that name beside the experiment is not a profile.
    std::fs::write(dir.path().join("other.toml"), "[train]\nthreads = 5\n").unwrap();
    assert!(load(&experiment, &["run.profile=other"]).is_err());
}

// ---- --set lists ----

#[test]
fn set_takes_a_toml_list() {
    let lora = experiments().join("lora_finetune.toml");
    let config = load(&lora, &[r#"text.corpus=["a.txt","b.txt"]"#]).unwrap();
    let corpus = &config.text.as_ref().unwrap().corpus;
    assert_eq!(corpus, &[PathBuf::from("a.txt"), PathBuf::from("b.txt")]);
}

#[test]
fn a_malformed_list_names_the_key_and_the_value() {
    let lora = experiments().join("lora_finetune.toml");
    let err = load(&lora, &[r#"text.corpus=["a.txt","b.txt""#]).unwrap_err();
    assert!(err.contains("text.corpus"), "{err}");
    assert!(err.contains(r#"["a.txt","b.txt""#), "{err}");
}

#[test]
fn oom_steps_still_read_comma_text_and_now_lists() {
    let smoke = experiments().join("smoke.toml");
    for set in [
        "device.inject_oom.steps=3,17,40",
        "device.inject_oom.steps=[3,17,40]",
        "device.inject_oom.steps=[3, 17, 40]",
    ] {
        let config = load(&smoke, &[set]).unwrap();
        assert_eq!(config.device.inject_oom.steps, [3, 17, 40], "{set}");
    }
}

// ---- warmup_cosine ----

#[test]
fn warmup_cosine_is_a_schedule_kind_with_defaults() {
    let smoke = experiments().join("smoke.toml");
    let config = load(&smoke, &["schedule.kind=warmup_cosine"]).unwrap();
    assert_eq!(
        config.schedule,
        ScheduleConfig::WarmupCosine {
            warmup_steps: 0,
            min_lr: 0.0
        }
    );
    let config = load(
        &smoke,
        &[
            "schedule.kind=warmup_cosine",
            "schedule.warmup_steps=10",
            "schedule.min_lr=1e-5",
        ],
    )
    .unwrap();
    assert_eq!(
        config.schedule,
        ScheduleConfig::WarmupCosine {
            warmup_steps: 10,
            min_lr: 1e-5
        }
    );
    // Both keys shape the result: a resume refuses a change of them.
    let keys = config.result_keys();
    assert!(keys.contains_key("schedule.warmup_steps"), "{keys:?}");
    assert!(keys.contains_key("schedule.min_lr"), "{keys:?}");
}

#[test]
fn warmup_cosine_values_are_checked_by_key() {
    let smoke = experiments().join("smoke.toml");
    let err = load(
        &smoke,
        &["schedule.kind=warmup_cosine", "schedule.min_lr=1.0"],
    )
    .unwrap_err();
    assert!(err.contains("schedule.min_lr"), "{err}");
    let err = load(
        &smoke,
        &["schedule.kind=warmup_cosine", "schedule.min_lr=-1e-3"],
    )
    .unwrap_err();
    assert!(err.contains("schedule.min_lr"), "{err}");
    // pct_start belongs to one_cycle.
    let err = load(
        &smoke,
        &["schedule.kind=warmup_cosine", "schedule.pct_start=0.3"],
    )
    .unwrap_err();
    assert!(err.contains("pct_start"), "{err}");
}

/// A small byte-level LSTM on a corpus the test writes, run in `dir/run`.
fn token_experiment(dir: &Path, schedule: &str) -> PathBuf {
    let corpus = dir.join("corpus.txt");
    std::fs::write(&corpus, b"the cat sat on the mat.\n".repeat(40)).unwrap();
    let text = format!(
        r#"
[run]
name = "front-door"
seed = 1
log_every = 1000
profile = "none"
output_dir = "{run}"

[data]
format = "text"
dir = "{store}"
workers = 1
prefetch = 2

[text]
package = "no-such-package-for-tests"
corpus = ["{corpus}"]
sample_bytes = 8

[device]
kind = "cpu"

[model]
tokens = {{ length = 16, vocab = 256 }}
layers = [
  {{ type = "embedding", dim = 8 }},
  {{ type = "lstm", hidden = 16 }},
  {{ type = "linear", out = 256 }},
]

[train]
epochs = 2
batch_size = 8
threads = 1

[optimizer]
lr = 1e-2

[schedule]
{schedule}
"#,
        run = dir.join("run").display(),
        store = dir.join("store").display(),
        corpus = corpus.display(),
    );
    let path = dir.join("experiment.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn options() -> TrainOptions {
    TrainOptions {
        resume: Resume::No,
        allow_install: false,
        stop: None,
        ..Default::default()
    }
}

/// The step lines of a run's metrics: (step, batches_per_epoch, lr).
fn step_lrs(run: &Path) -> Vec<(u64, u64, f32)> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    text.lines()
        .filter_map(|line| {
            let value: serde_json::Value = serde_json::from_str(line).unwrap();
            (value["kind"] == "step").then(|| {
                let data = &value["data"];
                (
                    data["step"].as_u64().unwrap(),
                    data["batches_per_epoch"].as_u64().unwrap(),
                    data["lr"].as_f64().unwrap() as f32,
                )
            })
        })
        .collect()
}

/// One short token run covers the schedule, the lock and the plot.
#[test]
fn a_warmup_cosine_run_follows_its_schedule_leaves_no_lock_and_plots_bits_per_byte() {
    let dir = tempfile::tempdir().unwrap();
    let schedule = "kind = \"warmup_cosine\"\nwarmup_steps = 4\nmin_lr = 1e-4";
    let config = load(&token_experiment(dir.path(), schedule), &[]).unwrap();
    train(&config, &options()).unwrap();
    let run = dir.path().join("run");

    let steps = step_lrs(&run);
    let per_epoch = steps[0].1;
    let total = per_epoch * 2;
    assert!(total > 6, "{total} steps is too short to see the schedule");
    assert_eq!(steps.len() as u64, total);
    let expected = Schedule::WarmupCosine {
        max_lr: 1e-2,
        warmup_steps: 4,
        total_steps: total,
        min_lr: 1e-4,
    };
    // A step line's `step` counts the steps done; its rate is the last's.
    for &(step, _, lr) in &steps {
        assert_eq!(lr, expected.lr_at(step - 1), "step {step}");
    }
    let lrs: Vec<f32> = steps.iter().map(|s| s.2).collect();
    assert!(lrs[0] < lrs[1] && lrs[1] < lrs[3], "warm-up {lrs:?}");
    assert_eq!(lrs[3], 1e-2, "the peak is optimizer.lr");
    assert!(lrs[4..].windows(2).all(|w| w[1] <= w[0]), "cosine {lrs:?}");
    assert_eq!(*lrs.last().unwrap(), 1e-4, "the last step is at min_lr");

    assert!(!run.join(".lock").exists(), "a finished run left its .lock");

    let svg = std::fs::read_to_string(run.join("plots.svg")).unwrap();
    for id in ["train-loss", "validation-loss", "validation-bits-per-byte"] {
        assert!(svg.contains(&format!("id=\"{id}\"")), "{id} missing");
    }
    assert!(svg.contains("bits per byte"));
    assert!(!svg.contains("no data yet"), "{svg}");
}

#[test]
fn warmup_longer_than_the_run_names_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let schedule = "kind = \"warmup_cosine\"\nwarmup_steps = 100000";
    let config = load(&token_experiment(dir.path(), schedule), &[]).unwrap();
    let err = train(&config, &options()).unwrap_err().to_string();
    assert!(err.contains("schedule.warmup_steps"), "{err}");
    assert!(err.contains("100000"), "{err}");
}

// ---- plots ----

/// Synthetic metrics of a run of `epochs` epochs of 10 batches each; the
/// epoch lines carry `epoch_fields` (JSON members) too.
fn write_metrics(dir: &Path, epochs: u64, epoch_fields: &str) {
    let mut text = String::new();
    for epoch in 0..epochs {
        for batch in 0..10u64 {
            let step = epoch * 10 + batch + 1;
            text += &format!(
                "{{\"kind\":\"step\",\"data\":{{\"epoch\":{epoch},\"step\":{step},\"batch\":{batch},\"batches_per_epoch\":10,\"samples\":8,\"loss\":{},\"lr\":0.001,\"grad_norm\":1.0,\"skipped\":false,\"memory_bytes\":0,\"samples_per_sec\":{},\"oom_events\":0}}}}\n",
                2.3 / step as f64,
                1000.0 + step as f64
            );
        }
        text += &format!(
            "{{\"kind\":\"epoch\",\"data\":{{\"epoch\":{epoch},\"train_loss\":{},\"test_loss\":{},{epoch_fields}\"train_seconds\":1.0,\"train_samples_per_sec\":1100.0,\"skipped_steps\":0}}}}\n",
            1.0 / (epoch + 1) as f64,
            1.2 / (epoch + 1) as f64,
        );
    }
    std::fs::write(dir.join("metrics.jsonl"), text).unwrap();
}

/// The text of every tick label of `axis` ("x" or "y").
fn tick_labels(svg: &str, axis: &str) -> Vec<String> {
    let marker = format!("class=\"tick {axis}\"");
    svg.lines()
        .filter_map(|line| {
            let at = line.find(&marker)?;
            let rest = &line[at..];
            let start = rest.find('>')? + 1;
            let end = rest[start..].find('<')? + start;
            Some(rest[start..end].to_string())
        })
        .collect()
}

fn plot(task: Task, epochs: u64, epoch_fields: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    write_metrics(dir.path(), epochs, epoch_fields);
    std::fs::read_to_string(plot::write(dir.path(), task).unwrap()).unwrap()
}

fn assert_series(svg: &str, ids: &[&str]) {
    for id in ids {
        assert!(svg.contains(&format!("<polyline id=\"{id}\"")), "no {id}");
    }
    assert!(!svg.contains("no data yet"));
}

#[test]
fn a_classifier_plot_draws_loss_accuracy_and_throughput() {
    let svg = plot(
        Task::Classifier,
        3,
        "\"train_accuracy\":0.8,\"test_accuracy\":0.85,",
    );
    assert_series(
        &svg,
        &[
            "train-loss",
            "validation-loss",
            "train-accuracy",
            "test-accuracy",
            "throughput",
        ],
    );
    assert!(svg.contains("accuracy (%)"));
}

#[test]
fn a_frame_model_plot_draws_mse_beside_the_baseline() {
    let svg = plot(Task::Frames, 3, "\"test_baseline_loss\":0.05,");
    assert_series(
        &svg,
        &[
            "train-loss",
            "validation-loss",
            "mse",
            "baseline",
            "throughput",
        ],
    );
    assert!(svg.contains("per-pixel MSE"));
    assert!(!svg.contains("accuracy"));
}

#[test]
fn a_token_model_plot_draws_bits_per_byte() {
    let svg = plot(Task::Tokens, 3, "\"test_accuracy\":0.4,");
    assert_series(
        &svg,
        &[
            "train-loss",
            "validation-loss",
            "train-bits-per-byte",
            "validation-bits-per-byte",
        ],
    );
}

#[test]
fn tick_labels_are_round() {
    // 2.75 epochs: the old plot labelled the axis 0.688, 1.375, 2.750.
    let dir = tempfile::tempdir().unwrap();
    write_metrics(dir.path(), 3, "\"test_accuracy\":0.85,");
    let text = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    let cut: String = text.lines().take(28).map(|l| format!("{l}\n")).collect();
    std::fs::write(dir.path().join("metrics.jsonl"), cut).unwrap();
    let svg = std::fs::read_to_string(plot::write(dir.path(), Task::Classifier).unwrap()).unwrap();
    let xs = tick_labels(&svg, "x");
    assert!(!xs.is_empty());
    for label in &xs {
        let v: f64 = label.parse().unwrap();
        assert_eq!((v * 2.0).fract(), 0.0, "epoch tick {label}");
    }
    let ys = tick_labels(&svg, "y");
    // A panel's y ticks share their x position.
    let mut panels: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
    for line in svg.lines().filter(|l| l.contains("class=\"tick y\"")) {
        let marker = "class=\"tick y\" x=\"";
        let at = line.find(marker).unwrap() + marker.len();
        let x = line[at..].split('"').next().unwrap().to_string();
        let label = &tick_labels(line, "y")[0];
        panels.entry(x).or_default().push(label.parse().unwrap());
    }
    assert_eq!(panels.len(), 3, "{ys:?}");
    for ticks in panels.into_values() {
        let step = ticks[1] - ticks[0];
        let mantissa = step / 10f64.powf(step.log10().floor());
        assert!(
            [1.0, 2.0, 5.0].iter().any(|m| (mantissa - m).abs() < 1e-6),
            "step {step} in {ticks:?}"
        );
        for v in &ticks {
            let k = v / step;
            assert!((k - k.round()).abs() < 1e-6, "{v} is off the {step} grid");
        }
    }
    // No label carries more decimals than its step needs ("2.750").
    assert!(xs
        .iter()
        .chain(&ys)
        .all(|l| !l.ends_with('0') || !l.contains('.')));
}

#[test]
fn an_empty_run_still_gets_a_plot() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("metrics.jsonl"), "").unwrap();
    let svg = std::fs::read_to_string(plot::write(dir.path(), Task::Frames).unwrap()).unwrap();
    assert!(svg.contains("no data yet"));
}
