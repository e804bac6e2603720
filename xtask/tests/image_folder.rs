//! `cargo xtask preprocess --from DIR --kind image_folder`: a folder of
//! photos becomes a shard store (train/, test/, classes.json) that
//! `cargo xtask train --set data.format=shards` trains on; bad options and
//! bad images are named.

use std::path::Path;
use std::process::{Command, Output};

use headroom_loader::write_image;

/// `cargo xtask <args>` from the repository root (as `common::run`, which
/// is not shared here: its other helpers would be unused in this binary).
fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(args)
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
        .output()
        .expect("run xtask")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// `root/{train,test}/{class}/NN.{png,jpg}`: RGB images of several sizes.
fn write_photos(root: &Path, classes: &[&str], per_class: [usize; 2]) {
    for (split, count) in ["train", "test"].into_iter().zip(per_class) {
        for (label, class) in classes.iter().enumerate() {
            let dir = root.join(split).join(class);
            std::fs::create_dir_all(&dir).unwrap();
            for i in 0..count {
                let (h, w) = (10 + i % 3 * 3, 10 + i % 2 * 4);
                let pixels: Vec<u8> = (0..h * w * 3)
                    .map(|p| ((p % 3 == label) as u8) * 180 + ((p * 11 + i * 5) % 50) as u8)
                    .collect();
                let name = format!("{i:02}.{}", if i % 2 == 0 { "png" } else { "jpg" });
                write_image(&dir.join(name), &pixels, [h, w, 3]).unwrap();
            }
        }
    }
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn photos_are_packed_into_a_store_that_trains() {
    let dir = tempfile::tempdir().unwrap();
    let (photos, store, run_dir) = (
        dir.path().join("photos"),
        dir.path().join("store"),
        dir.path().join("run"),
    );
    write_photos(&photos, &["ant", "bee", "cat"], [8, 3]);
    let out = run(&[
        "preprocess",
        "--from",
        photos.to_str().unwrap(),
        "--kind",
        "image_folder",
        "--output",
        store.to_str().unwrap(),
        "--image-size",
        "12x12",
        "--channels",
        "3",
        "--fit",
        "resize",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("train: 24/24 images"),
        "{}",
        stderr(&out)
    );
    assert!(
        stdout(&out).contains("data.format=shards"),
        "{}",
        stdout(&out)
    );
    let classes: Vec<String> =
        serde_json::from_str(&std::fs::read_to_string(store.join("classes.json")).unwrap())
            .unwrap();
    assert_eq!(classes, ["ant", "bee", "cat"]);

    let out = run(&[
        "train",
        "--config",
        "experiments/smoke.toml",
        "--no-install",
        "--set",
        "data.format=shards",
        "--set",
        &format!("data.dir={}", store.display()),
        "--set",
        "data.train_samples=0",
        "--set",
        "data.test_samples=0",
        "--set",
        "model.input=[12, 12, 3]",
        "--set",
        "device.kind=cpu",
        "--set",
        "train.epochs=1",
        "--set",
        "train.batch_size=8",
        "--set",
        &format!("run.output_dir={}", run_dir.display()),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let checkpoints = std::fs::read_dir(&run_dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "ckpt"))
        .count();
    assert!(checkpoints > 0, "no checkpoint in {}", run_dir.display());
    // The store's class names are recorded with the run.
    let identity = std::fs::read_to_string(run_dir.join("dataset.json")).unwrap();
    assert!(identity.contains("\"bee\""), "{identity}");
}

#[test]
fn bad_options_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let photos = dir.path().join("photos");
    write_photos(&photos, &["a"], [1, 1]);
    let store = dir.path().join("store");
    let base = [
        "preprocess",
        "--from",
        photos.to_str().unwrap(),
        "--output",
        store.to_str().unwrap(),
    ];
    for (extra, expected) in [
        (&["--kind", "parquet"][..], "expected image_folder"),
        (
            &["--kind", "image_folder", "--image-size", "12"],
            "expected HEIGHTxWIDTH",
        ),
        (
            &["--kind", "image_folder", "--fit", "squash"],
            "\"center_crop\" or \"resize\"",
        ),
        (
            &["--kind", "image_folder", "--channels", "2"],
            "expected 1 (grayscale) or 3 (RGB)",
        ),
    ] {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        let out = run(&args);
        assert!(!out.status.success(), "{extra:?}");
        assert!(
            stderr(&out).contains(expected),
            "{extra:?}: {}",
            stderr(&out)
        );
    }
    assert!(
        !store.exists(),
        "a refused preprocess wrote {}",
        store.display()
    );
}

#[test]
fn a_garbage_image_is_named_and_no_store_is_left() {
    let dir = tempfile::tempdir().unwrap();
    let photos = dir.path().join("photos");
    write_photos(&photos, &["a", "b"], [2, 1]);
    let garbage = photos.join("train/b/zz.jpeg");
    std::fs::write(&garbage, b"not a jpeg").unwrap();
    let store = dir.path().join("store");
    let out = run(&[
        "preprocess",
        "--from",
        photos.to_str().unwrap(),
        "--kind",
        "image_folder",
        "--output",
        store.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains(&garbage.display().to_string()),
        "{}",
        stderr(&out)
    );
    assert!(!store.join("train").exists());
}
