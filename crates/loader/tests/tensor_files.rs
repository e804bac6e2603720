//! Preprocessed tensor files (`.npz`, `.safetensors`, `.npy` pairs) as a
//! lazy dataset: the right rows, a cache of at most two decoded files over
//! a shard-aware epoch, and each bad file named. The files are written here
//! byte by byte in NumPy's and safetensors' formats.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use headroom_loader::{
    npy_bytes, DataLoader, Dataset, Element, LoaderConfig, ShuffleMode, TensorFiles,
    TensorFilesConfig,
};

fn npz(path: &Path, members: &[(&str, Vec<u8>)]) {
    let file = std::fs::File::create(path).unwrap();
    let mut zip = zip::ZipWriter::new(file);
    for (name, bytes) in members {
        let options = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Deflated);
        zip.start_file(format!("{name}.npy"), options).unwrap();
        zip.write_all(bytes).unwrap();
    }
    zip.finish().unwrap();
}

fn f32_bytes(values: impl IntoIterator<Item = f32>) -> Vec<u8> {
    values.into_iter().flat_map(f32::to_le_bytes).collect()
}

/// `files` npz files of `rows` 4×4 u8 images each: sample id `i` has every
/// pixel `i % 251` and label `i % 3`.
fn write_image_batches(dir: &Path, files: usize, rows: usize) {
    for f in 0..files {
        let ids = f * rows..(f + 1) * rows;
        let pixels: Vec<u8> = ids.clone().flat_map(|i| [(i % 251) as u8; 16]).collect();
        let labels: Vec<u8> = ids.flat_map(|i| (i as i64 % 3).to_le_bytes()).collect();
        npz(
            &dir.join(format!("part{f:02}.npz")),
            &[
                ("x", npy_bytes("|u1", &[rows, 4, 4], &pixels)),
                ("y", npy_bytes("<i8", &[rows], &labels)),
            ],
        );
    }
}

#[test]
fn a_directory_of_npz_batches_trains_lazily_with_two_files_cached() {
    let dir = tempfile::tempdir().unwrap();
    let (files, rows) = (6, 40);
    write_image_batches(dir.path(), files, rows);
    let data = TensorFiles::open(dir.path(), TensorFilesConfig::default()).unwrap();
    assert_eq!((data.len(), data.file_count()), (files * rows, files));
    assert_eq!(data.sample_shape(), [4, 4, 1]);
    assert_eq!(data.num_classes(), 3);
    assert_eq!(data.sample_kind().element, Element::U8);
    assert_eq!(
        data.memory_usage().current,
        4 * 240,
        "labels only, no input read"
    );
    let mut pixels = [0u8; 16];
    assert_eq!(data.read(131, &mut pixels).unwrap(), 131 % 3);
    assert_eq!(pixels, [131; 16]);

    let data = Arc::new(data);
    let loader = DataLoader::new(
        Arc::clone(&data) as Arc<dyn Dataset>,
        LoaderConfig {
            batch_size: 16,
            shuffle: true,
            shuffle_mode: ShuffleMode::ShardBlocks,
            seed: 7,
            workers: 2,
            ..LoaderConfig::default()
        },
    )
    .unwrap();
    for epoch in 0..2 {
        let mut seen = vec![0u32; files * rows];
        for batch in loader.epoch(epoch, 0) {
            let batch = batch.unwrap();
            for (k, &label) in batch.labels.iter().enumerate() {
                let id = batch.sample(k)[0] as usize;
                // ids past 250 wrap: pick the one with this label's residue.
                let id = (0..files * rows)
                    .find(|&i| i % 251 == id && i % 3 == label as usize && seen[i] == 0)
                    .unwrap();
                seen[id] += 1;
            }
        }
        assert!(
            seen.iter().all(|&n| n == 1),
            "every sample once in epoch {epoch}"
        );
    }
    let usage = data.memory_usage();
    let one_file = (rows * 16) as u64;
    assert!(
        usage.peak <= 4 * 240 + 2 * one_file,
        "peak {} bytes: more than two decoded files",
        usage.peak
    );
    assert!(usage.peak >= 4 * 240 + one_file, "{usage:?}");
}

#[test]
fn safetensors_and_npy_pairs_give_f32_features_and_numeric_targets() {
    let dir = tempfile::tempdir().unwrap();
    let features: Vec<f32> = (0..12).map(|i| i as f32 * 0.5).collect();
    let targets: Vec<f32> = (0..8).map(|i| i as f32 - 2.0).collect();
    let (x, y) = (f32_bytes(features.clone()), f32_bytes(targets.clone()));
    let tensors = [
        (
            "x",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![4, 3], &x).unwrap(),
        ),
        (
            "y",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![4, 2], &y).unwrap(),
        ),
    ];
    let path = dir.path().join("rows.safetensors");
    safetensors::serialize_to_file(tensors, None, &path).unwrap();
    let data = TensorFiles::open(&path, TensorFilesConfig::default()).unwrap();
    let kind = data.sample_kind();
    assert_eq!((kind.element, kind.values), (Element::F32, 2));
    assert_eq!(data.sample_shape(), [1, 3, 1]);
    let mut record = [0u8; 20];
    data.read(2, &mut record).unwrap();
    let read: Vec<f32> = record
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(read, [3.0, 3.5, 4.0, 2.0, 3.0]);

    // f16 inputs in .npy pairs become f32; the names follow the config.
    let pairs = tempfile::tempdir().unwrap();
    let halves: Vec<u8> = [1.5f32, -2.0, 0.25, 8.0]
        .iter()
        .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
        .collect();
    std::fs::write(
        pairs.path().join("a_in.npy"),
        npy_bytes("<f2", &[2, 2], &halves),
    )
    .unwrap();
    std::fs::write(
        pairs.path().join("a_out.npy"),
        npy_bytes("<i4", &[2], &[1, 0, 0, 0, 0, 0, 0, 0]),
    )
    .unwrap();
    let config = TensorFilesConfig {
        input: "in".into(),
        target: "out".into(),
        cache_files: 1,
    };
    let data = TensorFiles::open(pairs.path(), config).unwrap();
    let mut record = [0u8; 8];
    assert_eq!(data.read(0, &mut record).unwrap(), 1);
    assert_eq!(f32::from_le_bytes(record[..4].try_into().unwrap()), 1.5);
    assert_eq!(data.num_classes(), 2);
}

#[test]
fn each_bad_file_is_named_with_what_was_expected() {
    let message = |dir: &Path| match TensorFiles::open(dir, TensorFilesConfig::default()) {
        Ok(_) => panic!("{} opened", dir.display()),
        Err(e) => e.to_string(),
    };
    let case = |members: Vec<(&str, Vec<u8>)>| {
        let dir = tempfile::tempdir().unwrap();
        npz(&dir.path().join("bad.npz"), &members);
        let text = message(dir.path());
        assert!(text.contains("bad.npz"), "{text}");
        text
    };
    let x = || npy_bytes("|u1", &[2, 4], &[0; 8]);
    let text = case(vec![("x", x())]);
    assert!(
        text.contains("no array `y`") && text.contains("x"),
        "{text}"
    );
    let text = case(vec![("x", x()), ("y", npy_bytes("<i8", &[3], &[0; 24]))]);
    assert!(text.contains("[3]") && text.contains("[2]"), "{text}");
    let text = case(vec![
        ("x", npy_bytes(">f4", &[2, 1], &[0; 8])),
        ("y", npy_bytes("|u1", &[2], &[0; 2])),
    ]);
    assert!(
        text.contains("\">f4\"") && text.contains("little-endian"),
        "{text}"
    );
    let nan = f32_bytes([1.0, f32::NAN]);
    let text = case(vec![("x", x()), ("y", npy_bytes("<f4", &[2], &nan))]);
    assert!(
        text.contains("target row 1") && text.contains("not finite"),
        "{text}"
    );
    let text = case(vec![
        ("x", x()),
        (
            "y",
            npy_bytes("<i8", &[2], &(-1i64).to_le_bytes().repeat(2)),
        ),
    ]);
    assert!(text.contains("negative"), "{text}");

    // Files that disagree: the second is named against the first.
    let dir = tempfile::tempdir().unwrap();
    npz(
        &dir.path().join("a.npz"),
        &[("x", x()), ("y", npy_bytes("|u1", &[2], &[0, 1]))],
    );
    npz(
        &dir.path().join("b.npz"),
        &[
            ("x", npy_bytes("|u1", &[2, 5], &[0; 10])),
            ("y", npy_bytes("|u1", &[2], &[0, 1])),
        ],
    );
    let text = message(dir.path());
    assert!(
        text.contains("b.npz") && text.contains("the first file"),
        "{text}"
    );

    // A .npy input without its targets, and a folder with nothing usable.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p_x.npy"), x()).unwrap();
    let text = message(dir.path());
    assert!(
        text.contains("p_x.npy") && text.contains("p_y.npy"),
        "{text}"
    );
    let empty = tempfile::tempdir().unwrap();
    let text = message(empty.path());
    assert!(text.contains("no .npz, .safetensors"), "{text}");

    // A truncated file: found when its inputs are first read.
    let dir = tempfile::tempdir().unwrap();
    let whole = npy_bytes("<f4", &[2, 3], &f32_bytes([0.0; 6]));
    std::fs::write(dir.path().join("t_x.npy"), &whole[..whole.len() - 5]).unwrap();
    std::fs::write(dir.path().join("t_y.npy"), npy_bytes("|u1", &[2], &[0, 1])).unwrap();
    let data = TensorFiles::open(dir.path(), TensorFilesConfig::default()).unwrap();
    let text = data.read(0, &mut [0u8; 12]).unwrap_err().to_string();
    assert!(
        text.contains("t_x.npy") && text.contains("truncated"),
        "{text}"
    );
}
