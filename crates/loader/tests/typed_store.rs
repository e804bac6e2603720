//! Shard stores of typed samples (format version 2): a table or tensor
//! files packed into a store read back record for record, with their kind
//! and a table's standardisation; a version-1 image store is written and
//! read as before; a corrupt or newer index is refused; a preprocess that
//! fails leaves no store.

use std::io::Write as _;
use std::path::Path;

use headroom_loader::{
    npy_bytes, preprocess, preprocess_from, CsvTable, Dataset, Element, LoaderError, SampleKind,
    ShardCacheConfig, ShardSize, ShardedDataset, StoreSource, SyntheticDataset, TableConfig,
    TableTarget, TensorFiles, TensorFilesConfig,
};

/// A CSV of `rows` rows: features a, b, c, a class column and two numeric
/// targets.
fn write_csv(path: &Path, rows: usize) {
    let mut text = String::from("a,b,kind,c,y,z\n");
    for i in 0..rows {
        let (a, b, c) = (i as f32 * 0.37, (i % 7) as f32 - 3.0, (i * i % 11) as f32);
        let kind = ["cat", "dog", "eel"][i % 3];
        text.push_str(&format!(
            "{a},{b},{kind},{c},{},{}\n",
            2.0 * a - b,
            c * 0.5 + 1.0
        ));
    }
    std::fs::write(path, text).unwrap();
}

fn open_store(dir: &Path) -> ShardedDataset {
    ShardedDataset::open(dir, ShardCacheConfig::default()).unwrap()
}

/// Every record and label of `store` is `source`'s, bit for bit.
fn assert_same_records(source: &dyn Dataset, store: &dyn Dataset) {
    assert_eq!(store.len(), source.len());
    assert_eq!(store.sample_shape(), source.sample_shape());
    assert_eq!(store.num_classes(), source.num_classes());
    assert_eq!(store.sample_kind(), source.sample_kind());
    let len = source
        .sample_kind()
        .record_len(source.sample_shape())
        .unwrap();
    let (mut want, mut got) = (vec![0u8; len], vec![0u8; len]);
    for i in 0..source.len() {
        let a = source.read(i, &mut want).unwrap();
        let b = store.read(i, &mut got).unwrap();
        assert_eq!((a, &want), (b, &got), "sample {i}");
    }
}

fn table_source(table: &CsvTable, scale: &headroom_loader::TableScale) -> StoreSource {
    StoreSource {
        kind: "csv".into(),
        inputs: table.feature_names().to_vec(),
        targets: table.target_names().to_vec(),
        feature_scale: scale.features.clone(),
    }
}

#[test]
fn a_regression_table_round_trips_with_its_scale() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("train.csv");
    write_csv(&csv, 53);
    let config = TableConfig {
        targets: vec!["y".into(), "z".into()],
        features: vec!["c".into(), "a".into(), "b".into()],
        target: TableTarget::Values,
    };
    let mut table = CsvTable::open(&csv, &config).unwrap();
    let scale = table.scale();
    table.standardize(&scale).unwrap();
    let out = dir.path().join("store");
    let summary = preprocess_from(
        &table,
        &table_source(&table, &scale),
        &out,
        ShardSize::Samples(10),
        false,
    )
    .unwrap();
    assert_eq!((summary.version, summary.shards), (2, 6));
    let store = open_store(&out);
    assert_eq!(store.format_version(), 2);
    assert_eq!(
        store.sample_kind(),
        SampleKind {
            element: Element::F32,
            values: 2,
            value_scale: scale.values.clone(),
        }
    );
    assert_same_records(&table, &store);
    assert_eq!(store.table_scale(), Some(scale));
    assert_eq!(store.source().inputs, ["c", "a", "b"]);
    assert_eq!(store.source().targets, ["y", "z"]);
    let (kind, source) = ShardedDataset::read_kind(&out).unwrap();
    assert_eq!((kind, &source), (store.sample_kind(), store.source()));
}

#[test]
fn a_class_table_round_trips_and_its_fingerprint_follows_the_kind() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("train.csv");
    write_csv(&csv, 31);
    let config = TableConfig {
        targets: vec!["kind".into()],
        features: Vec::new(),
        target: TableTarget::Classes { classes: None },
    };
    let mut table = CsvTable::open(&csv, &config).unwrap();
    let scale = table.scale();
    table.standardize(&scale).unwrap();
    let (one, two) = (dir.path().join("one"), dir.path().join("two"));
    let source = table_source(&table, &scale);
    preprocess_from(&table, &source, &one, ShardSize::Samples(8), false).unwrap();
    assert_same_records(&table, &open_store(&one));
    // The same records recorded with another standardisation: another
    // fingerprint, so a resumed run notices.
    let mut other = source.clone();
    other.feature_scale[0].0 += 1.0;
    preprocess_from(&table, &other, &two, ShardSize::Samples(8), false).unwrap();
    assert_ne!(
        open_store(&one).fingerprint(),
        open_store(&two).fingerprint()
    );
}

/// `dir/partNN_x.npy` (f32 `[rows, 2, 3]`) and `dir/partNN_y.npy` (i64
/// class ids or f32 values) for each of `files` files.
fn write_npy_pairs(dir: &Path, files: usize, rows: usize, values: bool) {
    std::fs::create_dir_all(dir).unwrap();
    for f in 0..files {
        let x: Vec<u8> = (0..rows * 6)
            .flat_map(|k| ((f * 1000 + k) as f32 * 0.25 - 7.0).to_le_bytes())
            .collect();
        std::fs::write(
            dir.join(format!("part{f:02}_x.npy")),
            npy_bytes("<f4", &[rows, 2, 3], &x),
        )
        .unwrap();
        let y = if values {
            let y: Vec<u8> = (0..rows)
                .flat_map(|r| ((f * rows + r) as f32 * 1.5).to_le_bytes())
                .collect();
            npy_bytes("<f4", &[rows], &y)
        } else {
            let y: Vec<u8> = (0..rows)
                .flat_map(|r| (((f + r) % 4) as i64).to_le_bytes())
                .collect();
            npy_bytes("<i8", &[rows], &y)
        };
        std::fs::write(dir.join(format!("part{f:02}_y.npy")), y).unwrap();
    }
}

/// An npz file holding `x` and `y`.
fn write_npz(path: &Path, x: Vec<u8>, y: Vec<u8>) {
    let mut zip = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
    for (name, bytes) in [("x", x), ("y", y)] {
        zip.start_file(
            format!("{name}.npy"),
            zip::write::SimpleFileOptions::default(),
        )
        .unwrap();
        zip.write_all(&bytes).unwrap();
    }
    zip.finish().unwrap();
}

#[test]
fn tensor_files_round_trip_classes_and_values() {
    let dir = tempfile::tempdir().unwrap();
    for values in [false, true] {
        let files = dir.path().join(format!("files-{values}"));
        write_npy_pairs(&files, 3, 5, values);
        let source = TensorFiles::open(&files, TensorFilesConfig::default()).unwrap();
        let out = dir.path().join(format!("store-{values}"));
        let recorded = StoreSource {
            kind: "tensors".into(),
            inputs: vec!["x".into()],
            targets: vec!["y".into()],
            feature_scale: Vec::new(),
        };
        preprocess_from(&source, &recorded, &out, ShardSize::Samples(4), false).unwrap();
        let store = open_store(&out);
        assert_eq!(store.sample_kind().values, usize::from(values));
        assert_eq!(store.sample_kind().element, Element::F32);
        assert_same_records(&source, &store);
        assert_eq!(store.source(), &recorded);
        assert_eq!(store.table_scale(), None);
    }
    // npz batches of u8 images with class ids and no source recorded: a
    // version-1 store, as an image store is.
    let npz = dir.path().join("npz");
    std::fs::create_dir_all(&npz).unwrap();
    for f in 0..2 {
        let x: Vec<u8> = (0..4 * 9).map(|k| (k * 7 + f) as u8).collect();
        let y: Vec<u8> = (0..4)
            .flat_map(|r| ((r % 2) as i64).to_le_bytes())
            .collect();
        write_npz(
            &npz.join(format!("b{f}.npz")),
            npy_bytes("|u1", &[4, 3, 3], &x),
            npy_bytes("<i8", &[4], &y),
        );
    }
    let source = TensorFiles::open(&npz, TensorFilesConfig::default()).unwrap();
    let out = dir.path().join("npz-store");
    let summary = preprocess(&source, &out, ShardSize::Samples(3), false).unwrap();
    assert_eq!(summary.version, 1);
    assert_same_records(&source, &open_store(&out));
}

#[test]
fn an_image_store_is_still_written_and_read_as_version_1() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("images");
    let source = SyntheticDataset::new(9, [2, 3, 1], 4);
    let summary = preprocess(&source, &out, ShardSize::Samples(4), false).unwrap();
    assert_eq!(summary.version, 1);
    let index = std::fs::read(out.join("index.bin")).unwrap();
    // Version 1: a 40-byte header, 16 bytes per shard, a checksum.
    assert_eq!(&index[8..12], &1u32.to_le_bytes());
    assert_eq!(index.len(), 40 + 16 * 3 + 4);
    let shard = std::fs::read(out.join("shard-000000.bin")).unwrap();
    assert_eq!(&shard[8..12], &1u32.to_le_bytes());
    assert_eq!(&shard[44..48], &0u32.to_le_bytes(), "reserved field");
    // 48-byte header, 5 offsets, 4 labels, 4 samples of 6 bytes.
    assert_eq!(shard.len(), 48 + 8 * 5 + 4 * 4 + 4 * 6);
    let store = open_store(&out);
    assert_eq!(store.format_version(), 1);
    assert_eq!(store.sample_kind(), SampleKind::default());
    assert!(store.source().is_empty());
    assert_same_records(&source, &store);
}

/// A typed store of 20 rows in shards of 8.
fn typed_store(dir: &Path) -> std::path::PathBuf {
    let csv = dir.join("t.csv");
    write_csv(&csv, 20);
    let config = TableConfig {
        targets: vec!["y".into()],
        features: vec!["a".into(), "b".into(), "c".into()],
        target: TableTarget::Values,
    };
    let table = CsvTable::open(&csv, &config).unwrap();
    let out = dir.join("store");
    preprocess_from(
        &table,
        &StoreSource::default(),
        &out,
        ShardSize::Samples(8),
        false,
    )
    .unwrap();
    out
}

#[test]
fn a_corrupt_typed_index_or_shard_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = typed_store(dir.path());
    let path = out.join("index.bin");
    let good = std::fs::read(&path).unwrap();
    assert_eq!(&good[8..12], &2u32.to_le_bytes());
    // A byte of the kind block (the element type), then the checksum.
    for at in [44, good.len() - 1] {
        let mut bad = good.clone();
        bad[at] ^= 1;
        std::fs::write(&path, &bad).unwrap();
        let err = ShardedDataset::open(&out, ShardCacheConfig::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("index.bin"), "{err}");
        assert!(err.contains("checksum mismatch"), "byte {at}: {err}");
    }
    // A newer format version.
    let mut newer = good.clone();
    newer[8..12].copy_from_slice(&4u32.to_le_bytes());
    std::fs::write(&path, &newer).unwrap();
    let err = ShardedDataset::open(&out, ShardCacheConfig::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("format version 4"), "{err}");
    std::fs::write(&path, &good).unwrap();
    // A flipped byte of a record: found when its shard is read.
    let shard = out.join("shard-000001.bin");
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x10;
    std::fs::write(&shard, &bytes).unwrap();
    let store = open_store(&out);
    let mut record = vec![0u8; 4 * (store.sample_shape()[1] + 1)];
    store.read(0, &mut record).unwrap();
    let err = store.read(8, &mut record).unwrap_err().to_string();
    assert!(
        err.contains("shard-000001.bin") && err.contains("checksum"),
        "{err}"
    );
}

/// A table whose read fails at one row, as a source that goes bad while
/// it is packed.
struct FailsAt<'a>(&'a dyn Dataset, usize);

impl Dataset for FailsAt<'_> {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn sample_shape(&self) -> [usize; 3] {
        self.0.sample_shape()
    }
    fn num_classes(&self) -> usize {
        self.0.num_classes()
    }
    fn sample_kind(&self) -> SampleKind {
        self.0.sample_kind()
    }
    fn read(&self, index: usize, out: &mut [u8]) -> Result<u32, LoaderError> {
        if index == self.1 {
            return Err(LoaderError::Format {
                path: "rows.csv".into(),
                message: format!("row {index} went bad"),
            });
        }
        self.0.read(index, out)
    }
}

#[test]
fn a_preprocess_that_fails_midway_leaves_no_store() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("t.csv");
    write_csv(&csv, 30);
    let config = TableConfig {
        targets: vec!["y".into()],
        features: vec!["a".into(), "b".into(), "c".into()],
        target: TableTarget::Values,
    };
    let table = CsvTable::open(&csv, &config).unwrap();
    let out = dir.path().join("store");
    let err = preprocess_from(
        &FailsAt(&table, 17),
        &StoreSource::default(),
        &out,
        ShardSize::Samples(8),
        false,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("row 17 went bad"), "{err}");
    assert!(!out.exists(), "a failed preprocess left {}", out.display());
    assert!(ShardedDataset::open(&out, ShardCacheConfig::default()).is_err());
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["t.csv"], "temporary directories left behind");
}

#[test]
fn safetensors_with_named_arrays_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let files = dir.path().join("st");
    std::fs::create_dir_all(&files).unwrap();
    for f in 0..2u8 {
        let x: Vec<u8> = (0..5 * 4)
            .flat_map(|i| (f32::from(f) * 10.0 + i as f32 * 0.5).to_le_bytes())
            .collect();
        let y: Vec<u8> = (0..5 * 2)
            .flat_map(|i| (i as f32 - f32::from(f)).to_le_bytes())
            .collect();
        let tensors = [
            (
                "feats",
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![5, 4], &x)
                    .unwrap(),
            ),
            (
                "out",
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![5, 2], &y)
                    .unwrap(),
            ),
        ];
        safetensors::serialize_to_file(tensors, None, &files.join(format!("p{f}.safetensors")))
            .unwrap();
    }
    let arrays = TensorFilesConfig {
        input: "feats".into(),
        target: "out".into(),
        ..TensorFilesConfig::default()
    };
    let source = TensorFiles::open(&files, arrays).unwrap();
    let recorded = StoreSource {
        kind: "tensors".into(),
        inputs: vec!["feats".into()],
        targets: vec!["out".into()],
        feature_scale: Vec::new(),
    };
    let out = dir.path().join("store");
    preprocess_from(&source, &recorded, &out, ShardSize::Bytes(400), false).unwrap();
    let store = open_store(&out);
    assert_eq!(store.sample_kind().values, 2);
    assert!(store.shard_count() > 1, "{} shards", store.shard_count());
    assert_same_records(&source, &store);
    assert_eq!(ShardedDataset::read_kind(&out).unwrap().1, recorded);
}
