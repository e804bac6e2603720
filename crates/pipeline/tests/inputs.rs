//! Commands never destroy or mis-score their inputs: `export` (and a
//! merge) refuses an output that is its own input, by any path to it;
//! `eval RUN_DIR` scores only the run's own checkpoints.

use std::path::{Path, PathBuf};

use headroom_pipeline::checkpoint;
use headroom_pipeline::{eval, export, train, ExperimentConfig, Overrides, Resume, TrainOptions};

/// A tiny GPT (width `dim`) over `corpus`, run in `dir/<name>`.
fn experiment(dir: &Path, name: &str, corpus: &Path, dim: usize) -> String {
    format!(
        r#"
[run]
name = "{name}"
seed = 5
log_every = 1000
profile = "none"
output_dir = "{run}"

[data]
format = "text"
dir = "{store}"
workers = 1
prefetch = 2

[text]
corpus = ["{corpus}"]
sample_bytes = 8

[device]
kind = "cpu"

[model]
tokens = {{ length = 16, vocab = 256 }}
layers = [
  {{ type = "embedding", dim = {dim}, positions = true }},
  {{ type = "layer_norm" }},
  {{ type = "linear", out = 256 }},
]

[train]
epochs = 1
batch_size = 8
threads = 1

[optimizer]
lr = 1e-2

[schedule]
kind = "constant"
"#,
        run = dir.join(name).display(),
        store = dir.join(format!("store-{name}")).display(),
        corpus = corpus.display(),
    )
}

/// Trains the run `name` (width `dim`) in `dir`; returns its directory.
fn trained(dir: &Path, name: &str, dim: usize) -> PathBuf {
    let corpus = dir.join("corpus.txt");
    if !corpus.exists() {
        std::fs::write(
            &corpus,
            b"the cat sat on the mat. the dog ran to the log.\n".repeat(20),
        )
        .unwrap();
    }
    let toml = dir.join(format!("{name}.toml"));
    std::fs::write(&toml, experiment(dir, name, &corpus, dim)).unwrap();
    let config = ExperimentConfig::load(&toml, &Overrides::default()).unwrap();
    let options = TrainOptions {
        resume: Resume::No,
        allow_install: false,
        stop: None,
        ..Default::default()
    };
    train(&config, &options).unwrap();
    dir.join(name)
}

fn newest(run: &Path) -> PathBuf {
    checkpoint::list(run).unwrap().pop().unwrap()
}

#[test]
fn export_refuses_an_output_that_is_its_input_by_any_path() {
    let dir = tempfile::tempdir().unwrap();
    let run = trained(dir.path(), "run", 8);
    let input = newest(&run);
    let before = std::fs::read(&input).unwrap();
    let symlink = dir.path().join("link.safetensors");
    std::os::unix::fs::symlink(&input, &symlink).unwrap();
    let hard = dir.path().join("hard.safetensors");
    std::fs::hard_link(&input, &hard).unwrap();
    let older = run.join(checkpoint::file_name(0));
    std::fs::write(&older, b"an older checkpoint").unwrap();
    for (named, output) in [
        (&input, &input),
        (&run, &input),
        (&input, &symlink),
        (&input, &hard),
        (&run, &older),
    ] {
        let e = export::safetensors(named, Some(output))
            .err()
            .unwrap_or_else(|| panic!("{} over {}", named.display(), output.display()))
            .to_string();
        assert!(
            e.contains("the same file") || e.contains("is a checkpoint"),
            "{e}"
        );
        assert!(e.contains(&output.display().to_string()), "{e}");
    }
    assert_eq!(
        std::fs::read(&input).unwrap(),
        before,
        "the input is intact"
    );
    assert_eq!(std::fs::read(&older).unwrap(), b"an older checkpoint");
    // A new file beside it is written.
    let fresh = dir.path().join("model.safetensors");
    export::safetensors(&run, Some(&fresh)).unwrap();
    assert!(fresh.is_file());
}

#[test]
fn eval_and_export_of_a_run_directory_take_only_the_runs_own_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let own = trained(dir.path(), "own", 8);
    let other = trained(dir.path(), "other", 4);
    let own_checkpoint = newest(&own);
    // Another run's checkpoint, named to sort after every one of this run.
    let foreign = own.join(checkpoint::file_name(9_999_999_999));
    std::fs::copy(newest(&other), &foreign).unwrap();

    let report = eval::evaluate_checkpoint(&own, None, 8, None).unwrap();
    assert_eq!(report.checkpoint, own_checkpoint);
    let direct = eval::evaluate_checkpoint(&own_checkpoint, None, 8, None).unwrap();
    assert_eq!(report.loss, direct.loss);

    let exported = export::safetensors(&own, Some(&dir.path().join("own.safetensors"))).unwrap();
    assert_eq!(exported.checkpoint, own_checkpoint);

    // Only foreign files: refused, not scored.
    std::fs::remove_file(&own_checkpoint).unwrap();
    for path in checkpoint::list(&own).unwrap() {
        if path != foreign {
            std::fs::remove_file(path).unwrap();
        }
    }
    let e = eval::evaluate_checkpoint(&own, None, 8, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("none of its 1 checkpoints"), "{e}");
}

/// `[text]` with `corpus` and `package`.
fn text_config(corpus: &Path, package: &str) -> headroom_pipeline::config::TextConfig {
    let mut text: headroom_pipeline::config::TextConfig = toml::from_str("").unwrap();
    text.corpus = vec![corpus.to_path_buf()];
    text.package = Some(package.into());
    text
}

#[test]
fn a_corpus_path_that_is_not_a_regular_file_is_refused_as_what_it_is_before_any_install() {
    let dir = tempfile::tempdir().unwrap();
    let looped = dir.path().join("loop.txt");
    std::os::unix::fs::symlink(&looped, &looped).unwrap();
    let fifo = dir.path().join("fifo.txt");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let dangling = dir.path().join("dangling.txt");
    std::os::unix::fs::symlink(dir.path().join("gone.txt"), &dangling).unwrap();
    let cases = [
        (dir.path().to_path_buf(), "is a directory, not a file"),
        (looped, "is a symlink loop"),
        (fifo, "is not a regular file (a FIFO)"),
        (dangling, "is a dangling symlink"),
    ];
    for (path, said) in cases {
        // Install allowed, and a package named: were it tried, apt-get
        // would run (and fail on a package that does not exist).
        let started = std::time::Instant::now();
        let e = headroom_pipeline::text::read_corpus(
            &text_config(&path, "headroom-no-such-package"),
            true,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("text.corpus") && e.contains(said), "{e}");
        assert!(e.contains(&path.display().to_string()), "{e}");
        assert!(!e.contains("apt-get"), "{e}");
        assert!(
            started.elapsed().as_secs() < 5,
            "took {:?}",
            started.elapsed()
        );
    }
    let absent = dir.path().join("absent.txt");
    let e = headroom_pipeline::text::read_corpus(&text_config(&absent, "pkg"), false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("does not exist") && e.contains("apt-get install -y pkg"),
        "{e}"
    );
}

#[test]
fn eval_names_a_symlink_loop_as_such_not_as_missing() {
    let dir = tempfile::tempdir().unwrap();
    let looped = dir.path().join("loop");
    std::os::unix::fs::symlink(&looped, &looped).unwrap();
    let e = eval::evaluate_checkpoint(&looped, None, 8, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("symlink loop"), "{e}");
    assert!(!e.contains("no such"), "{e}");
}

#[test]
fn an_experiment_outside_experiments_finds_the_built_in_profiles() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus.txt");
    let text = experiment(dir.path(), "elsewhere", &corpus, 8)
        .replace("profile = \"none\"", "profile = \"max_speed\"");
    let toml = dir.path().join("elsewhere.toml");
    std::fs::write(&toml, text).unwrap();
    let config = ExperimentConfig::load(&toml, &Overrides::default()).unwrap();
    // max_speed sets data.prefetch = 8 (the experiment says 2).
    assert_eq!(config.data.prefetch, 8);

    // A profile beside the experiment still comes first.
    std::fs::create_dir(dir.path().join("profiles")).unwrap();
    std::fs::write(
        dir.path().join("profiles/max_speed.toml"),
        "[data]\nprefetch = 3\n",
    )
    .unwrap();
    let config = ExperimentConfig::load(&toml, &Overrides::default()).unwrap();
    assert_eq!(config.data.prefetch, 3);

    // An unknown one names every place looked in and the profiles there.
    let e = ExperimentConfig::load(
        &toml,
        &Overrides::parse(&["run.profile=nonesuch".to_string()]).unwrap(),
    )
    .unwrap_err()
    .to_string();
    let beside = dir.path().join("profiles/nonesuch.toml");
    assert!(
        e.contains(&format!("no profile file {}", beside.display())),
        "{e}"
    );
    assert!(e.contains("experiments/profiles/nonesuch.toml"), "{e}");
    assert!(e.contains("low_memory") && e.contains("max_speed"), "{e}");
}

#[test]
fn lora_merge_verifies_the_adapters_checksum_shapes_and_finite_values() {
    use headroom_pipeline::export::F32Tensor;
    use headroom_pipeline::finetune;
    let dir = tempfile::tempdir().unwrap();
    let base = trained(dir.path(), "base", 8);
    let saved = checkpoint::load(&newest(&base)).unwrap();
    let named = export::named_values(&saved, &newest(&base)).unwrap();
    let weight = named
        .iter()
        .find(|t| t.shape == [8, 256])
        .expect("the output projection");
    let layer = weight.name.strip_suffix(".weight").unwrap().to_string();
    let scales = format!("{{\"{layer}\":2.0}}");
    // Writes an adapters file of `tensors`; `checksum` None: the right one.
    let write = |file: &str, tensors: &[F32Tensor], checksum: Option<&str>| -> PathBuf {
        let path = dir.path().join(file);
        let right = finetune::adapters_checksum(tensors, &scales);
        let metadata = std::collections::BTreeMap::from([
            ("adapter".to_string(), "lora".to_string()),
            ("scales".to_string(), scales.clone()),
            (
                finetune::CHECKSUM_KEY.to_string(),
                checksum.map_or(right, String::from),
            ),
        ]);
        export::write_f32_safetensors(tensors, &metadata, &path).unwrap();
        path
    };
    let a: F32Tensor = (format!("{layer}.lora_a"), vec![1, 8], vec![0.125; 8]);
    let b: F32Tensor = (format!("{layer}.lora_b"), vec![256, 1], vec![0.5; 256]);
    let good = write("good.safetensors", &[a.clone(), b.clone()], None);
    let merged = dir.path().join("merged.safetensors");
    finetune::merge(&base, &good, &merged).unwrap();
    let (tensors, _) = export::read_f32_safetensors(&merged).unwrap();
    let folded = tensors.iter().find(|t| t.0 == weight.name).unwrap();
    assert!((folded.2[0] - (weight.values[0] + 2.0 * 0.125 * 0.5)).abs() < 1e-6);

    let mut nan_a = a.clone();
    nan_a.2[3] = f32::NAN;
    let mut stray = a.clone();
    stray.0 = "layers.0.lora_a".into();
    let cases = [
        (
            write(
                "tampered.safetensors",
                &[a.clone(), b.clone()],
                Some("crc32:00000000"),
            ),
            "checksum crc32:00000000",
        ),
        (
            write("nan.safetensors", &[nan_a, b.clone()], None),
            "lora_a[3] is NaN: every adapter value must be finite",
        ),
        (
            write("stray.safetensors", &[a.clone(), b.clone(), stray], None),
            "holds layers.0.lora_a",
        ),
        (
            write(
                "shape.safetensors",
                &[(a.0.clone(), vec![1, 7], vec![0.0; 7]), b.clone()],
                None,
            ),
            "do not fit the base weight",
        ),
    ];
    for (file, said) in cases {
        let output = dir.path().join("refused.safetensors");
        let e = finetune::merge(&base, &file, &output)
            .unwrap_err()
            .to_string();
        assert!(e.contains(said), "{}: {e}", file.display());
        assert!(e.contains(&file.display().to_string()), "{e}");
        assert!(!output.exists());
    }
}
