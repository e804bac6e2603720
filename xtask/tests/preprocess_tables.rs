//! `cargo xtask preprocess --kind csv|npy|safetensors`: a table or a
//! directory of tensor files packed into a shard store trains as the
//! source does (the same figures, the same recorded standardisation and
//! classes), and `predict` scores new rows of a run trained on the store.

// Not every helper is used here.
#[allow(dead_code, unused_imports)]
mod common;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Output;

use common::*;
use headroom_loader::npy_bytes;

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn noise(i: usize) -> f64 {
    let x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11;
    (x as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
}

/// `dir/train.csv` and `dir/test.csv`: features a, b, a class column
/// `kind` and a numeric target y = 100 + 20a - 10b.
fn write_tables(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    for (name, from, count) in [("train.csv", 0, 300), ("test.csv", 5000, 80)] {
        let mut text = String::from("a,b,kind,y\n");
        for i in from..from + count {
            let (a, b) = (noise(2 * i), noise(2 * i + 1));
            let y = 100.0 + 20.0 * a - 10.0 * b;
            let kind = if y < 100.0 { "low" } else { "high" };
            writeln!(text, "{a:.6},{b:.6},{kind},{y:.6}").unwrap();
        }
        std::fs::write(dir.join(name), text).unwrap();
    }
}

/// An experiment in `dir/NAME.toml` reading `data` (a TOML `[data]` body)
/// with a small MLP on `input` and `outputs` outputs.
fn experiment(dir: &Path, name: &str, data: &str, input: &str, head: &str) -> PathBuf {
    let toml = format!(
        r#"
[run]
name = "{name}"
seed = 3
log_every = 1000
profile = "none"
output_dir = "{run}"

[data]
{data}
workers = 1

[device]
kind = "auto"

[model]
input = {input}
mean = 0.0
std = 1.0
layers = [
  {{ type = "flatten" }},
  {{ type = "linear", out = 16 }}, {{ type = "relu" }},
  {head}
]

[train]
epochs = 2
batch_size = 32
threads = 1

[optimizer]
lr = 1e-2

[schedule]
kind = "constant"
"#,
        run = dir.join(format!("run-{name}")).display(),
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, toml).unwrap();
    path
}

/// Trains `config` with `sets`; returns stdout.
fn train(config: &Path, sets: &[&str]) -> String {
    let mut args = vec![
        "train",
        "--config",
        config.to_str().unwrap(),
        "--no-install",
    ];
    for set in sets {
        args.extend(["--set", set]);
    }
    let out = run(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    stdout(&out)
}

/// The `test ...` figure lines of a run's summary (timings left out).
fn test_figures(stdout: &str) -> Vec<String> {
    let figures: Vec<String> = stdout
        .lines()
        .filter(|l| l.starts_with("test "))
        .map(str::to_string)
        .collect();
    assert!(!figures.is_empty(), "no test figures in {stdout}");
    figures
}

fn dataset_json(run: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(run.join("dataset.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn preprocess(args: &[&str]) -> Output {
    let mut all = vec!["preprocess"];
    all.extend(args);
    run(&all)
}

#[test]
fn a_csv_regression_store_trains_and_predicts_as_the_csv_does() {
    let dir = tempfile::tempdir().unwrap();
    let (tables, store) = (dir.path().join("table"), dir.path().join("store"));
    write_tables(&tables);
    let out = preprocess(&[
        "--from",
        tables.to_str().unwrap(),
        "--kind",
        "csv",
        "--targets",
        "y",
        "--features",
        "a,b",
        "--regression",
        "--output",
        store.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("train: 300/300 rows"),
        "{}",
        stderr(&out)
    );
    assert!(stdout(&out).contains("train.loss=mse"), "{}", stdout(&out));
    assert!(!store.join("classes.json").exists());

    let head = r#"{ type = "linear", out = 1 },"#;
    let direct = experiment(
        dir.path(),
        "csv",
        &format!(
            "format = \"csv\"\ndir = \"{}\"\ntargets = [\"y\"]\nfeatures = [\"a\", \"b\"]",
            tables.display()
        ),
        "[1, 2, 1]",
        head,
    );
    let packed = experiment(
        dir.path(),
        "store",
        &format!("format = \"shards\"\ndir = \"{}\"", store.display()),
        "[1, 2, 1]",
        head,
    );
    let loss = "train.loss=mse";
    let a = train(&direct, &[loss]);
    // A store is shuffled by shard blocks by default; the CSV globally.
    let b = train(&packed, &[loss, "loader.shuffle_mode=global"]);
    assert!(a.contains("test RMSE"), "{a}");
    assert_eq!(test_figures(&a), test_figures(&b));
    let (run_csv, run_store) = (dir.path().join("run-csv"), dir.path().join("run-store"));
    let (ja, jb) = (dataset_json(&run_csv), dataset_json(&run_store));
    assert!(ja["scale"].is_object(), "{ja}");
    assert_eq!(ja["scale"], jb["scale"]);

    // New rows without the target column, scored by both runs alike.
    let rows = dir.path().join("new.csv");
    std::fs::write(&rows, "b,a\n0.5,0.25\n-1,1\n").unwrap();
    let scored = |run_dir: &Path| {
        let out = run(&[
            "predict",
            "--checkpoint",
            run_dir.to_str().unwrap(),
            "--input",
            rows.to_str().unwrap(),
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
    };
    let (pa, pb) = (scored(&run_csv), scored(&run_store));
    assert!(pa.starts_with("input,y\n"), "{pa}");
    assert_eq!(pa, pb);
}

#[test]
fn a_csv_class_store_records_its_classes_as_the_csv_run_does() {
    let dir = tempfile::tempdir().unwrap();
    let (tables, store) = (dir.path().join("table"), dir.path().join("store"));
    write_tables(&tables);
    let out = preprocess(&[
        "--from",
        tables.to_str().unwrap(),
        "--kind",
        "csv",
        "--targets",
        "kind",
        "--features",
        "a,b",
        "--output",
        store.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let head = r#"{ type = "linear", out = 2 },"#;
    let direct = experiment(
        dir.path(),
        "csv",
        &format!(
            "format = \"csv\"\ndir = \"{}\"\ntargets = [\"kind\"]\nfeatures = [\"a\", \"b\"]",
            tables.display()
        ),
        "[1, 2, 1]",
        head,
    );
    let packed = experiment(
        dir.path(),
        "store",
        &format!("format = \"shards\"\ndir = \"{}\"", store.display()),
        "[1, 2, 1]",
        head,
    );
    let a = train(&direct, &[]);
    let b = train(&packed, &["loader.shuffle_mode=global"]);
    assert_eq!(test_figures(&a), test_figures(&b));
    let (ja, jb) = (
        dataset_json(&dir.path().join("run-csv")),
        dataset_json(&dir.path().join("run-store")),
    );
    assert_eq!(ja["classes"], serde_json::json!(["high", "low"]));
    assert_eq!(
        (&ja["classes"], &ja["scale"]),
        (&jb["classes"], &jb["scale"])
    );
}

/// `dir/{train,test}/partNN_x.npy` (f32 `[rows, 4]`) and `_y.npy` (i64
/// class: whether the first two features sum above the last two).
fn write_npy_dir(dir: &Path) {
    for (split, files) in [("train", 3), ("test", 1)] {
        let split = dir.join(split);
        std::fs::create_dir_all(&split).unwrap();
        for f in 0..files {
            let rows = 40;
            let mut x = Vec::new();
            let mut y = Vec::new();
            for r in 0..rows {
                let i = (f * rows + r) * 4 + if split.ends_with("test") { 9000 } else { 0 };
                let v: Vec<f32> = (0..4).map(|k| noise(i + k) as f32).collect();
                x.extend(v.iter().flat_map(|v| v.to_le_bytes()));
                let class = i64::from(v[0] + v[1] > v[2] + v[3]);
                y.extend(class.to_le_bytes());
            }
            std::fs::write(
                split.join(format!("part{f:02}_x.npy")),
                npy_bytes("<f4", &[rows, 4], &x),
            )
            .unwrap();
            std::fs::write(
                split.join(format!("part{f:02}_y.npy")),
                npy_bytes("<i8", &[rows], &y),
            )
            .unwrap();
        }
    }
}

#[test]
fn an_npy_directory_store_trains_as_the_files_do_and_predicts_an_npy() {
    let dir = tempfile::tempdir().unwrap();
    let (files, store) = (dir.path().join("files"), dir.path().join("store"));
    write_npy_dir(&files);
    let out = preprocess(&[
        "--from",
        files.to_str().unwrap(),
        "--kind",
        "npy",
        "--output",
        store.to_str().unwrap(),
        "--shard-size",
        "40",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("train: 120/120 samples"),
        "{}",
        stderr(&out)
    );
    let head = r#"{ type = "linear", out = 2 },"#;
    let direct = experiment(
        dir.path(),
        "files",
        &format!("format = \"tensors\"\ndir = \"{}\"", files.display()),
        "[1, 4, 1]",
        head,
    );
    let packed = experiment(
        dir.path(),
        "store",
        &format!("format = \"shards\"\ndir = \"{}\"", store.display()),
        "[1, 4, 1]",
        head,
    );
    // One file per shard: the shard-block order is the same too.
    let a = train(&direct, &[]);
    let b = train(&packed, &[]);
    assert!(a.contains("test accuracy"), "{a}");
    assert_eq!(test_figures(&a), test_figures(&b));

    let input = dir.path().join("new_x.npy");
    let x: Vec<u8> = [0.9f32, 0.8, -0.7, -0.9, -1.0, -0.5, 0.5, 1.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    std::fs::write(&input, npy_bytes("<f4", &[2, 4], &x)).unwrap();
    let out = run(&[
        "predict",
        "--checkpoint",
        dir.path().join("run-store").to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert_eq!(text.lines().count(), 3, "{text}");
    assert!(text.starts_with("input,class,p_0,p_1\n"), "{text}");
}

#[test]
fn bad_table_options_and_cells_are_named_and_leave_no_store() {
    let dir = tempfile::tempdir().unwrap();
    let (tables, store) = (dir.path().join("table"), dir.path().join("store"));
    write_tables(&tables);
    let base = [
        "--from",
        tables.to_str().unwrap(),
        "--output",
        store.to_str().unwrap(),
    ];
    for (extra, expected) in [
        (&["--kind", "csv"][..], "needs --targets"),
        (
            &["--kind", "csv", "--targets", "a,y"][..],
            "add --regression",
        ),
        (
            &["--kind", "csv", "--targets", "price"][..],
            "no column `price`",
        ),
        (
            &["--kind", "csv", "--targets", "y", "--input-array", "x"][..],
            "--input-array",
        ),
        (
            &["--kind", "parquet"][..],
            "expected image_folder, csv, npy",
        ),
        (&["--kind", "npy"][..], "is not a directory"),
    ] {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        let out = preprocess(&args);
        assert!(!out.status.success(), "{extra:?}");
        assert!(
            stderr(&out).contains(expected),
            "{extra:?}: {}",
            stderr(&out)
        );
    }
    // A non-numeric cell names the file, the line and the column.
    let test_csv = tables.join("test.csv");
    let mut text = std::fs::read_to_string(&test_csv).unwrap();
    text.push_str("0.1,oops,low,3\n");
    std::fs::write(&test_csv, text).unwrap();
    let out = preprocess(&[
        "--from",
        tables.to_str().unwrap(),
        "--kind",
        "csv",
        "--targets",
        "y",
        "--regression",
        "--features",
        "a,b",
        "--output",
        store.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("test.csv") && err.contains("line 82") && err.contains("column `b`"),
        "{err}"
    );
    assert!(
        !store.exists(),
        "a refused preprocess wrote {}",
        store.display()
    );
}

/// A safetensors file of `feats` (f32 `[rows, 3]`) and `out` (f32 `[rows]`,
/// 2a - b + c).
fn write_safetensors(path: &Path, rows: usize, from: usize) {
    let mut x = Vec::new();
    let mut y = Vec::new();
    for r in from..from + rows {
        let v: Vec<f32> = (0..3).map(|k| noise(3 * r + k) as f32).collect();
        x.extend(v.iter().flat_map(|v| v.to_le_bytes()));
        y.extend((2.0 * v[0] - v[1] + v[2]).to_le_bytes());
    }
    let tensors = [
        (
            "feats",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![rows, 3], &x)
                .unwrap(),
        ),
        (
            "out",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![rows], &y).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(tensors, None, path).unwrap();
}

#[test]
fn a_safetensors_store_with_named_arrays_regresses_and_predicts_by_those_names() {
    let dir = tempfile::tempdir().unwrap();
    let (files, store) = (dir.path().join("files"), dir.path().join("store"));
    for (split, parts) in [("train", 2), ("test", 1)] {
        std::fs::create_dir_all(files.join(split)).unwrap();
        for p in 0..parts {
            let from = p * 64 + if split == "test" { 7000 } else { 0 };
            write_safetensors(
                &files.join(split).join(format!("p{p}.safetensors")),
                64,
                from,
            );
        }
    }
    let out = preprocess(&[
        "--from",
        files.to_str().unwrap(),
        "--kind",
        "safetensors",
        "--input-array",
        "feats",
        "--target-array",
        "out",
        "--output",
        store.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("train.loss=mse"), "{}", stdout(&out));
    let packed = experiment(
        dir.path(),
        "store",
        &format!("format = \"shards\"\ndir = \"{}\"", store.display()),
        "[1, 3, 1]",
        r#"{ type = "linear", out = 1 },"#,
    );
    let text = train(&packed, &["train.loss=mse"]);
    assert!(text.contains("test RMSE"), "{text}");

    // New rows in a file whose input array is `feats`, as the store's.
    let input = dir.path().join("new.safetensors");
    write_safetensors(&input, 3, 9000);
    let out = run(&[
        "predict",
        "--checkpoint",
        dir.path().join("run-store").to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert_eq!(text.lines().count(), 4, "{text}");
    assert!(text.starts_with("input,"), "{text}");
}
