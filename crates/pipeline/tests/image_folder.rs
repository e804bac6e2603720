//! `data.format = "image_folder"`: a small conv net trains one epoch on
//! generated RGB photos on the CPU, the run records the class names, and a
//! folder or model that does not fit is refused before training, by key.

use std::path::{Path, PathBuf};

use headroom_loader::write_image;
use headroom_pipeline::{
    checkpoint, data, train, ExperimentConfig, Overrides, Resume, TrainOptions,
};

fn smoke() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments/smoke.toml")
}

fn load(sets: &[String]) -> Result<ExperimentConfig, String> {
    let overrides = Overrides::parse(sets).map_err(|e| e.to_string())?;
    ExperimentConfig::load(&smoke(), &overrides).map_err(|e| e.to_string())
}

/// `root/split/class/NAME` for each split: `per_class` images per class,
/// PNG and JPEG in turn, of several sizes, each class its own colour.
fn write_folder(root: &Path, classes: &[&str], per_class: [usize; 2]) {
    for (split, count) in ["train", "test"].into_iter().zip(per_class) {
        for (label, class) in classes.iter().enumerate() {
            let dir = root.join(split).join(class);
            std::fs::create_dir_all(&dir).unwrap();
            for i in 0..count {
                let (h, w) = (12 + i % 3 * 2, 12 + i % 4 * 3);
                let mut pixels = Vec::with_capacity(h * w * 3);
                for p in 0..h * w {
                    for c in 0..3 {
                        let base = if c == label % 3 { 200 } else { 30 };
                        pixels.push((base + (p * 7 + i * 13) % 40) as u8);
                    }
                }
                let name = format!("{i:02}.{}", if i % 2 == 0 { "png" } else { "jpg" });
                write_image(&dir.join(name), &pixels, [h, w, 3]).unwrap();
            }
        }
    }
}

/// The smoke net on `dir`'s 12×12 RGB images, one CPU epoch into `out`.
fn sets(dir: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    let mut sets = vec![
        "data.format=image_folder".to_string(),
        format!("data.dir={}", dir.display()),
        "data.image_size=[12, 12]".into(),
        "data.channels=3".into(),
        "data.fit=resize".into(),
        "data.train_samples=0".into(),
        "data.test_samples=0".into(),
        "model.input=[12, 12, 3]".into(),
        "device.kind=cpu".into(),
        "train.epochs=1".into(),
        "train.batch_size=8".into(),
        "train.threads=2".into(),
        "data.workers=1".into(),
        format!("run.output_dir={}", out.display()),
    ];
    sets.extend(extra.iter().map(|s| s.to_string()));
    sets
}

fn options() -> TrainOptions {
    TrainOptions {
        resume: Resume::No,
        allow_install: false,
        stop: None,
        ..Default::default()
    }
}

#[test]
fn a_conv_net_trains_an_epoch_on_rgb_photos_and_records_the_classes() {
    let dir = tempfile::tempdir().unwrap();
    let (images, out) = (dir.path().join("photos"), dir.path().join("run"));
    write_folder(&images, &["red", "green", "blue"], [8, 4]);
    let config = load(&sets(&images, &out, &[])).unwrap();
    let summary = train(&config, &options()).unwrap();

    let (accuracy, loss) = (summary.test_accuracy.unwrap(), summary.test_loss.unwrap());
    assert!(
        accuracy.is_finite() && (0.0..=1.0).contains(&accuracy),
        "{accuracy}"
    );
    assert!(loss.is_finite() && loss > 0.0, "{loss}");
    // Ten outputs: top-5 is reported, and counts at least what top-1 does.
    let top5 = summary
        .test_top5_accuracy
        .expect("top-5 of a 10-output model");
    assert!((accuracy..=1.0).contains(&top5), "{top5} vs {accuracy}");
    assert!(summary
        .test_macro_f1
        .is_some_and(|f1| (0.0..=1.0).contains(&f1)));
    assert_eq!(summary.epochs.len(), 1);
    assert!(
        !checkpoint::list(&out).unwrap().is_empty(),
        "no checkpoint in {}",
        out.display()
    );
    // Label order is the sorted folder names.
    assert_eq!(
        data::recorded_classes(&out).unwrap(),
        Some(vec!["blue".to_string(), "green".into(), "red".into()])
    );
}

#[test]
fn a_model_reading_other_channels_is_refused_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("photos");
    let sets = sets(
        &images,
        &dir.path().join("run"),
        &["model.input=[12, 12, 1]"],
    );
    // No folder needed: the experiment itself is refused.
    let err = load(&sets).unwrap_err();
    assert!(err.contains("model.input"), "{err}");
    assert!(err.contains("data.channels = 3"), "{err}");
    assert!(err.contains("set model.input = [12, 12, 3]"), "{err}");

    let sets = self::sets(
        &images,
        &dir.path().join("run"),
        &["data.image_size=[16, 16]"],
    );
    let err = load(&sets).unwrap_err();
    assert!(err.contains("data.image_size = [16, 16]"), "{err}");
}

#[test]
fn image_keys_belong_to_image_folders_and_are_checked() {
    let err = load(&["data.channels=3".to_string()]).unwrap_err();
    assert!(
        err.contains("data.channels") && err.contains("\"image_folder\" only"),
        "{err}"
    );
    let dir = tempfile::tempdir().unwrap();
    let sets = sets(
        dir.path(),
        dir.path(),
        &["data.channels=4", "model.input=[12, 12, 4]"],
    );
    let err = load(&sets).unwrap_err();
    assert!(
        err.contains("data.channels") && err.contains("expected 1 (grayscale) or 3"),
        "{err}"
    );
    let err = load(&self::sets(dir.path(), dir.path(), &["data.fit=squash"])).unwrap_err();
    assert!(err.contains("\"center_crop\" or \"resize\""), "{err}");
    // The defaults: 28×28 gray, as the Fashion-MNIST models read.
    let config = load(&[
        "data.format=image_folder".to_string(),
        "data.dir=photos".into(),
        "data.train_samples=0".into(),
        "data.test_samples=0".into(),
    ])
    .unwrap();
    let images = config.data.image_folder();
    assert_eq!((images.size, images.channels), ([28, 28], 1));
    assert_eq!(images.fit, headroom_loader::ImageFit::CenterCrop);
}

#[test]
fn train_and_test_with_other_classes_are_refused_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("photos");
    write_folder(&images, &["cat", "dog"], [1, 1]);
    let extra = images.join("test").join("emu");
    std::fs::create_dir_all(&extra).unwrap();
    std::fs::copy(images.join("test/cat/00.png"), extra.join("00.png")).unwrap();
    let config = load(&sets(&images, &dir.path().join("run"), &[])).unwrap();
    let err = train(&config, &options()).unwrap_err().to_string();
    assert!(err.contains("[\"cat\", \"dog\"]"), "{err}");
    assert!(err.contains("[\"cat\", \"dog\", \"emu\"]"), "{err}");
}

#[test]
fn more_classes_than_outputs_is_refused_naming_the_count() {
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("photos");
    let names: Vec<String> = (0..11).map(|i| format!("c{i:02}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    write_folder(&images, &names, [1, 1]);
    let config = load(&sets(&images, &dir.path().join("run"), &[])).unwrap();
    let err = train(&config, &options()).unwrap_err().to_string();
    assert!(
        err.contains("holds 11 classes") && err.contains("10 outputs"),
        "{err}"
    );
}

#[test]
fn a_corrupt_test_image_is_named_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("photos");
    write_folder(&images, &["a", "b"], [2, 2]);
    let victim = images.join("test/b/01.jpg");
    let bytes = std::fs::read(&victim).unwrap();
    std::fs::write(&victim, &bytes[..bytes.len() / 2]).unwrap();
    let config = load(&sets(&images, &dir.path().join("run"), &[])).unwrap();
    let err = train(&config, &options()).unwrap_err().to_string();
    assert!(err.contains(&victim.display().to_string()), "{err}");
}

#[test]
fn bad_samples_skip_leaves_out_unreadable_images_and_names_them() {
    let dir = tempfile::tempdir().unwrap();
    let (images, out) = (dir.path().join("photos"), dir.path().join("run"));
    write_folder(&images, &["red", "green", "blue"], [8, 4]);
    // A truncated JPEG (its header reads, its body does not end), a file
    // that is no image at all, both in the training split.
    let jpeg = images.join("train/red/01.jpg");
    let bytes = std::fs::read(&jpeg).unwrap();
    std::fs::write(&jpeg, &bytes[..bytes.len() - 8]).unwrap();
    std::fs::write(images.join("train/green/zz.png"), b"not a png").unwrap();

    // By default the first is an error naming the file, before training.
    let config = load(&sets(&images, &out, &[])).unwrap();
    let err = train(&config, &options()).unwrap_err().to_string();
    assert!(err.contains("zz.png") || err.contains("01.jpg"), "{err}");

    let config = load(&sets(&images, &out, &["data.bad_samples=skip"])).unwrap();
    let summary = train(&config, &options()).unwrap();
    assert_eq!(summary.epochs.len(), 1);
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("dataset.json")).unwrap()).unwrap();
    let skipped = record["skipped"].as_array().unwrap();
    let names: Vec<&str> = skipped
        .iter()
        .map(|s| s["sample"].as_str().unwrap())
        .collect();
    assert_eq!(skipped.len(), 2, "{record}");
    assert!(names.iter().any(|n| n.ends_with("red/01.jpg")), "{names:?}");
    assert!(
        names.iter().any(|n| n.ends_with("green/zz.png")),
        "{names:?}"
    );
    assert!(skipped.iter().all(|s| s["split"] == "train"), "{record}");
    assert_eq!(record["train_samples"], 3 * 8 - 1, "{record}");
    assert!(
        skipped[0]["reason"].as_str().unwrap().contains("truncated")
            || skipped[1]["reason"].as_str().unwrap().contains("truncated"),
        "{record}"
    );

    // A class whose every image is unreadable is never emptied silently.
    for entry in std::fs::read_dir(images.join("test/blue")).unwrap() {
        std::fs::write(entry.unwrap().path(), b"broken").unwrap();
    }
    let out2 = dir.path().join("run2");
    let config = load(&sets(&images, &out2, &["data.bad_samples=skip"])).unwrap();
    let err = train(&config, &options()).unwrap_err().to_string();
    assert!(
        err.contains("test/blue") && err.contains("empty the class"),
        "{err}"
    );
    // Not for data that is checked whole.
    let err = load(&["data.bad_samples=skip".to_string()]).unwrap_err();
    assert!(err.contains("data.bad_samples"), "{err}");
}
