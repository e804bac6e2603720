//! CSV tables as datasets: f32 features and numeric targets through the
//! loader, class columns, standardisation, and each bad input named.

use std::path::PathBuf;
use std::sync::Arc;

use headroom_loader::{
    AugmentConfig, CsvTable, DataLoader, Dataset, Element, LoaderConfig, LoaderError, TableConfig,
    TableTarget,
};

fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn values(targets: &[&str]) -> TableConfig {
    TableConfig {
        targets: targets.iter().map(|t| t.to_string()).collect(),
        features: Vec::new(),
        target: TableTarget::Values,
    }
}

fn classes(target: &str, known: Option<Vec<String>>) -> TableConfig {
    TableConfig {
        targets: vec![target.to_string()],
        features: Vec::new(),
        target: TableTarget::Classes { classes: known },
    }
}

fn error_of(result: Result<CsvTable, LoaderError>) -> String {
    match result {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_regression_table_reaches_the_batch_as_f32_features_and_targets() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        &dir,
        "train.csv",
        "a,y,b\n1,10,100\n2,20,200\n3,30,300\n4,40,400\n",
    );
    let table = CsvTable::open(&path, &values(&["y"])).unwrap();
    assert_eq!(table.feature_names(), ["a", "b"]);
    assert_eq!(table.sample_shape(), [1, 2, 1]);
    let kind = table.sample_kind();
    assert_eq!((kind.element, kind.values), (Element::F32, 1));
    let loader = DataLoader::new(
        Arc::new(table),
        LoaderConfig {
            batch_size: 4,
            ..LoaderConfig::default()
        },
    )
    .unwrap();
    let batch = loader.epoch(0, 0).next().unwrap().unwrap();
    assert!(batch.pixels.is_empty());
    assert_eq!(
        batch.features.as_deref(),
        Some(&[1.0, 100.0, 2.0, 200.0, 3.0, 300.0, 4.0, 400.0][..])
    );
    assert_eq!(batch.values.as_deref(), Some(&[10.0, 20.0, 30.0, 40.0][..]));
    let half = batch.slice(1..3);
    assert_eq!(
        half.features.as_deref(),
        Some(&[2.0, 200.0, 3.0, 300.0][..])
    );
    assert_eq!(half.values.as_deref(), Some(&[20.0, 30.0][..]));
}

#[test]
fn standardising_uses_the_training_tables_statistics_and_says_how_to_undo_it() {
    let dir = tempfile::tempdir().unwrap();
    let train = write(&dir, "train.csv", "x,y\n1,0\n3,10\n");
    let test = write(&dir, "test.csv", "x,y\n5,20\n");
    let mut train = CsvTable::open(&train, &values(&["y"])).unwrap();
    let mut test = CsvTable::open(&test, &values(&["y"])).unwrap();
    let scale = train.scale();
    assert_eq!(scale.features, vec![(2.0, 1.0)]);
    assert_eq!(scale.values, vec![(5.0, 5.0)]);
    train.standardize(&scale).unwrap();
    test.standardize(&scale).unwrap();
    let mut record = [0u8; 8];
    test.read(0, &mut record).unwrap();
    let x = f32::from_le_bytes(record[..4].try_into().unwrap());
    let y = f32::from_le_bytes(record[4..].try_into().unwrap());
    assert_eq!((x, y), (3.0, 3.0));
    assert_eq!(test.sample_kind().unscale(0, y), 20.0);
    assert!(test.standardize(&scale).is_err(), "standardised twice");
}

#[test]
fn class_columns_map_names_to_sorted_ids_and_integers_to_themselves() {
    let dir = tempfile::tempdir().unwrap();
    let named = write(&dir, "n.csv", "x,kind\n1,dog\n2,cat\n3,dog\n");
    let table = CsvTable::open(&named, &classes("kind", None)).unwrap();
    assert_eq!(table.classes(), ["cat", "dog"]);
    let labels: Vec<u32> = (0..3)
        .map(|i| table.read(i, &mut [0u8; 4]).unwrap())
        .collect();
    assert_eq!(labels, [1, 0, 1]);
    assert_eq!(table.sample_kind().values, 0);

    let numbered = write(&dir, "i.csv", "x,digit\n1,2\n2,10\n");
    let table = CsvTable::open(&numbered, &classes("digit", None)).unwrap();
    assert_eq!(table.num_classes(), 11, "ids 0..=10, not sorted as text");
    assert_eq!(table.read(1, &mut [0u8; 4]).unwrap(), 10);

    // A test table takes the training table's classes; a class it lacks is
    // named with its line.
    let test = write(&dir, "t.csv", "x,kind\n1,cat\n2,bird\n");
    let known = Some(vec!["cat".to_string(), "dog".to_string()]);
    let message = error_of(CsvTable::open(&test, &classes("kind", known)));
    assert!(message.contains("t.csv"), "{message}");
    assert!(
        message.contains("line 3") && message.contains("\"bird\""),
        "{message}"
    );
}

#[test]
fn each_bad_input_is_an_error_naming_the_file_the_line_and_the_column() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, &str, &[&str]); 8] = [
        (
            "ragged.csv",
            "a,y\n1,2\n3\n",
            &["line 3", "1 cells", "header has 2"],
        ),
        (
            "word.csv",
            "a,y\n1,2\nabc,4\n",
            &["line 3", "column `a`", "\"abc\""],
        ),
        (
            "nan.csv",
            "a,y\n1,NaN\n",
            &["line 2", "column `y`", "not finite"],
        ),
        (
            "inf.csv",
            "a,y\ninf,1\n",
            &["line 2", "column `a`", "not finite"],
        ),
        ("nocol.csv", "a,b\n1,2\n", &["no column `y`", "a, b"]),
        ("noheader.csv", "1,2\n3,4\n", &["header"]),
        ("empty.csv", "", &["header"]),
        ("norows.csv", "a,y\n", &["no rows"]),
    ];
    for (name, text, needles) in cases {
        let path = write(&dir, name, text);
        let message = error_of(CsvTable::open(&path, &values(&["y"])));
        assert!(message.contains(name), "{name}: {message}");
        for needle in needles {
            assert!(
                message.contains(needle),
                "{name}: {message:?} lacks {needle:?}"
            );
        }
    }
    let twice = write(&dir, "twice.csv", "a,a,y\n1,2,3\n");
    let message = error_of(CsvTable::open(&twice, &values(&["y"])));
    assert!(message.contains("`a` twice"), "{message}");
    let one = write(&dir, "one.csv", "a,kind\n1,x\n2,x\n");
    let message = error_of(CsvTable::open(&one, &classes("kind", None)));
    assert!(message.contains("single class"), "{message}");
    let missing = dir.path().join("absent.csv");
    let message = error_of(CsvTable::open(&missing, &values(&["y"])));
    assert!(message.contains("absent.csv"), "{message}");
}

#[test]
fn augmentations_and_a_device_resident_copy_are_refused_for_feature_tables() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(&dir, "t.csv", "a,y\n1,2\n3,4\n");
    let table: Arc<dyn Dataset> = Arc::new(CsvTable::open(&path, &values(&["y"])).unwrap());
    let flip = LoaderConfig {
        batch_size: 2,
        augment: AugmentConfig {
            flip: true,
            ..AugmentConfig::default()
        },
        ..LoaderConfig::default()
    };
    let message = DataLoader::new(Arc::clone(&table), flip)
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("augment.flip") && message.contains("f32 features"),
        "{message}"
    );
    let resident = LoaderConfig {
        batch_size: 2,
        resident: true,
        ..LoaderConfig::default()
    };
    let message = DataLoader::new(table, resident).unwrap_err().to_string();
    assert!(message.contains("data.on_device = false"), "{message}");
}
