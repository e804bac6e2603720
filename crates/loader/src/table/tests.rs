use super::*;

#[test]
fn a_cell_that_is_not_utf8_is_named_and_text_around_it_reads() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.csv");
    let config = TableConfig {
        targets: vec!["y".into()],
        features: Vec::new(),
        target: TableTarget::Values,
    };
    // Multi-byte text in a column that is not read leaves the numbers
    // as they are.
    std::fs::write(&path, "a,note,b,y\n1,é,2,3\n4,ü€,5.5,6\n").unwrap();
    let features = TableConfig {
        features: vec!["a".into(), "b".into()],
        ..config.clone()
    };
    let table = CsvTable::open(&path, &features).unwrap();
    assert_eq!(table.features, [1.0, 2.0, 4.0, 5.5]);
    assert_eq!(table.values, [3.0, 6.0]);
    let mut bytes = b"a,b,y\n1,2,3\n4,".to_vec();
    bytes.extend_from_slice(b"\xff5,6\n");
    std::fs::write(&path, bytes).unwrap();
    let err = CsvTable::open(&path, &config).unwrap_err().to_string();
    assert!(
        err.contains("line 3, column `b`: the cell is not UTF-8 text"),
        "{err}"
    );
}

/// xorshift64: fixed cases, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
}

/// A cell reads as before: `str::trim` then `str::parse::<f32>`, finite
/// (the same bits, or the same error); and the fast path
/// (`fast_float2`) gives every ASCII cell's value, never another one.
fn assert_same_as_rust(cell: &[u8]) {
    let path = Path::new("t.csv");
    let reference = match std::str::from_utf8(cell) {
        Ok(text) => number(path, 7, "c", text),
        Err(_) => Err(format_err(
            path,
            "line 7, column `c`: the cell is not UTF-8 text".into(),
        )),
    };
    let new = parse::cell_number(path, 7, "c", cell);
    let context = String::from_utf8_lossy(cell);
    match (&new, &reference) {
        (Ok(new), Ok(expected)) => assert_eq!(new.to_bits(), expected.to_bits(), "{context:?}"),
        (Err(new), Err(expected)) => {
            assert_eq!(new.to_string(), expected.to_string(), "{context:?}")
        }
        _ => panic!("{context:?}: {new:?}, before {reference:?}"),
    }
    let rust = reference.ok().map(f32::to_bits);
    match parse::fast_finite(cell) {
        Some(value) => assert_eq!(Some(value.to_bits()), rust, "{context:?}"),
        None if cell.is_ascii() => assert_eq!(rust, None, "{context:?}: not on the fast path"),
        None => {}
    }
}

#[test]
fn the_fast_float_parse_gives_str_parse_s_f32_bits() {
    let edge = [
        "0",
        "-0",
        "+0",
        "0.0",
        "-0.0",
        "1",
        "+1",
        "-1",
        "1.",
        ".5",
        "+.5",
        "-.5",
        ".",
        "+",
        "-",
        "",
        " ",
        "e5",
        "1e",
        "1e+",
        "1e-",
        "1e5",
        "1E5",
        "1e+5",
        "1e-5",
        "+1e-5",
        "1.5e38",
        "3.4028235e38",
        "3.4028236e38",
        "3.40282357e38",
        "3.4028237e38",
        "1e39",
        "-1e39",
        "1e-45",
        "1.4e-45",
        "7e-46",
        "7.1e-46",
        "1e-46",
        "1.1754942e-38",
        "1.17549435e-38",
        "1e-38",
        "2.5e-45",
        "1e-400",
        "1e400",
        "0e999999",
        "1e-999999",
        "00001.5",
        "1_0",
        "1,5",
        "1.5.5",
        "0x10",
        "0b1",
        "1f",
        "1.5f32",
        "inf",
        "-inf",
        "+inf",
        "INF",
        "Inf",
        "infinity",
        "-Infinity",
        "INFINITY",
        "infinit",
        "infx",
        "nan",
        "NaN",
        "-nan",
        "+NaN",
        "NAN",
        "nanx",
        "snan",
        " 1.5",
        "1.5 ",
        "\t2\t",
        "\x0b3\x0c",
        "\r4\n",
        "\u{a0}5",
        "6\u{2003}",
        "1 2",
        "--1",
        "+-1",
        "1e+-5",
        "٣",
        "1.5\0",
        "0.1",
        "0.2",
        "0.3",
        "16777217",
        "16777216.5",
        "16777217.000000001",
        "33554435",
        "1.00000005960464477539",
        "1.0000000596046447753906250000001",
        "1.00000005960464477539062499999",
        "0.000000000000000000000000000000000000000000001401298464324817070923729583289916131280",
        "123456789012345678901234567890",
        "9999999999999999999999999999999999999999",
        "4.9406564584124654e-324",
        "2.2250738585072014e-308",
        "1e-38f",
    ];
    for cell in edge {
        assert_same_as_rust(cell.as_bytes());
    }
    let long = format!("0.{}1", "0".repeat(800));
    assert_same_as_rust(long.as_bytes());
    let long = format!("{}e-700", "1".repeat(700));
    assert_same_as_rust(long.as_bytes());
    assert_same_as_rust(b"\xff1");
    assert_same_as_rust(b"1\xff");
    let mut rng = Rng(0x1234_5678_9abc_def1);
    for _ in 0..200_000 {
        // Random f32 bits, written as Rust writes them and as a C printf
        // would (exponent, many digits), and perturbed near a halfway
        // point.
        let bits = rng.next() as u32;
        let value = f32::from_bits(bits);
        let written = [
            format!("{value}"),
            format!("{value:e}"),
            format!("{:.9e}", value),
            format!("{:.20e}", f64::from(value)),
            format!("{}", f64::from(value) + f64::from(value) * 2f64.powi(-25)),
            format!("{:.6}", f64::from(value)),
        ];
        for text in &written {
            assert_same_as_rust(text.as_bytes());
        }
        // Random decimal strings: sign, digits, point, exponent.
        let mut text = String::new();
        text.push_str(rng.pick(&["", "", "-", "+", " "]));
        for _ in 0..rng.below(25) {
            text.push(char::from(b'0' + rng.below(10) as u8));
        }
        if rng.below(2) == 0 {
            text.push('.');
            for _ in 0..rng.below(25) {
                text.push(char::from(b'0' + rng.below(10) as u8));
            }
        }
        if rng.below(3) == 0 {
            text.push_str(rng.pick(&["e", "E", "e+", "e-", "E-"]));
            text.push_str(&(rng.below(100) as i64 - 50).to_string());
        }
        text.push_str(rng.pick(&["", "", "", " ", "x", "\t"]));
        assert_same_as_rust(text.as_bytes());
    }
}

/// A table read by the new reader and by the reference one (the `csv`
/// crate and `str::parse`), or the same error.
fn assert_same_table(path: &Path, config: &TableConfig, skip: bool, what: &str) {
    assert_same_table_by(path, config, skip, what, &READERS);
}

/// The readers compared: the machine's tuning, and blocks small enough to
/// cut records and split small files over two to four cores.
const READERS: [(&str, BodyReader); 6] = [
    ("machine", fast_body),
    ("block 1, one core", |r, c, s| {
        tuned_body(r, c, s, tuned(1, 1))
    }),
    ("block 7, one core", |r, c, s| {
        tuned_body(r, c, s, tuned(7, 1))
    }),
    ("block 64, two cores", |r, c, s| {
        tuned_body(r, c, s, tuned(64, 2))
    }),
    ("block 300, three cores", |r, c, s| {
        tuned_body(r, c, s, tuned(300, 3))
    }),
    ("block 1 MiB, four cores", |r, c, s| {
        tuned_body(r, c, s, tuned(1 << 20, 4))
    }),
];

const fn tuned(block: usize, threads: usize) -> parse::Tuning {
    parse::Tuning {
        block,
        parallel_min: 0,
        threads,
    }
}

fn assert_same_table_by(
    path: &Path,
    config: &TableConfig,
    skip: bool,
    what: &str,
    readers: &[(&str, BodyReader)],
) {
    let read = |body: BodyReader| {
        let mut skipped = Vec::new();
        let result = CsvTable::read_with(path, config, skip.then_some(&mut skipped), body);
        (result.map_err(|e| e.to_string()), skipped)
    };
    let (expected, expected_skipped) = read(reference::body);
    for &(name, body) in readers {
        let (table, skipped) = read(body);
        let context = format!("{what} (skip {skip}, reader {name})");
        assert_eq!(skipped, expected_skipped, "{context}");
        match (&table, &expected) {
            (Ok(table), Ok(expected)) => {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&table.features), bits(&expected.features), "{context}");
                assert_eq!(bits(&table.values), bits(&expected.values), "{context}");
                assert_eq!(table.labels, expected.labels, "{context}");
                assert_eq!(table.lines, expected.lines, "{context}");
                assert_eq!(table.classes, expected.classes, "{context}");
                assert_eq!(table.feature_names, expected.feature_names, "{context}");
                assert_eq!(table.fingerprint(), expected.fingerprint(), "{context}");
            }
            (Err(error), Err(expected)) => assert_eq!(error, expected, "{context}"),
            _ => panic!("{context}: {table:?} but the reference {expected:?}"),
        }
    }
}

/// A random CSV: numbers in many spellings, quoted cells, every line end,
/// blank lines, and (`bad`) ragged rows, text, NaN and infinities, bytes
/// that are not UTF-8.
fn random_csv(rng: &mut Rng, bad: bool, class: bool) -> Vec<u8> {
    let good = [
        "1",
        "-2.5",
        "+3",
        "0.000001",
        "1e3",
        "-1.5E-3",
        "  4.25 ",
        "\t7",
        "12345678.9",
        "0",
        "-0",
        ".5",
        "5.",
        "\"8.5\"",
        "\"1\"0",
        "\" 9 \"",
        "3.4028235e38",
        "1e-45",
    ];
    let wrong = [
        "abc",
        "",
        "NaN",
        "inf",
        "-infinity",
        "1e39",
        "\"nan\"",
        "1,5",
        "\"a,b\"",
        "\"x\ny\"",
        "\u{a0}6",
        "\u{2003}",
        "2..5",
        "\"\"",
        "\"7\"8",
        "9\"",
        "\u{1}",
    ];
    let ends = ["\n", "\n", "\n", "\r\n", "\r\n", "\r"];
    let classes = ["cat", "dog", " bird ", "\"a,b\"", "\"q\"\"\"", "cat", "dog"];
    let mut text = String::new();
    text.push_str(if class { "a,kind,b,y" } else { "a,note,b,y" });
    let end = rng.pick(&ends);
    text.push_str(end);
    let rows = 1 + rng.below(60);
    for _ in 0..rows {
        let width = match bad && rng.below(12) == 0 {
            true => rng.pick(&["3", "5", "1"]).parse().unwrap_or(4),
            false => 4,
        };
        let mut cells = Vec::new();
        for k in 0..width {
            let cell = if k == 1 {
                match class {
                    true => rng.pick(&classes),
                    false => rng.pick(&["note", "\"a \"\"b\"\" c\"", "é", "\"x\r\ny\""]),
                }
            } else if bad && rng.below(8) == 0 {
                rng.pick(&wrong)
            } else {
                rng.pick(&good)
            };
            cells.push(cell);
        }
        text.push_str(&cells.join(","));
        if rng.below(10) == 0 {
            // A blank line.
            text.push_str(rng.pick(&ends));
        }
        text.push_str(rng.pick(&ends));
    }
    if rng.below(2) == 0 {
        // No line end after the last row.
        text.truncate(text.trim_end_matches(['\r', '\n']).len());
    } else if rng.below(2) == 0 {
        text.push_str(rng.pick(&ends));
    }
    // "\u{1}" above stands for a byte that is not UTF-8.
    text.into_bytes()
        .into_iter()
        .map(|b| if b == 1 { 0xff } else { b })
        .collect()
}

#[test]
fn the_reader_gives_the_reference_readers_table_lines_and_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.csv");
    let configs = |class: bool| -> Vec<TableConfig> {
        match class {
            true => vec![
                TableConfig {
                    targets: vec!["kind".into()],
                    features: Vec::new(),
                    target: TableTarget::Classes { classes: None },
                },
                TableConfig {
                    targets: vec!["kind".into()],
                    features: vec!["y".into(), "a".into()],
                    target: TableTarget::Classes {
                        classes: Some(vec!["bird".into(), "cat".into(), "dog".into()]),
                    },
                },
            ],
            false => vec![
                TableConfig {
                    targets: vec!["y".into()],
                    features: vec!["b".into(), "a".into()],
                    target: TableTarget::Values,
                },
                TableConfig {
                    targets: vec!["y".into(), "a".into()],
                    features: vec!["b".into()],
                    target: TableTarget::Values,
                },
                TableConfig {
                    targets: vec!["y".into()],
                    features: vec!["a".into(), "b".into()],
                    target: TableTarget::Absent,
                },
            ],
        }
    };
    let mut rng = Rng(0x0dd_ba11_cafe_f00d);
    let (mut errors, mut reads) = (0, 0);
    for case in 0..400 {
        let (bad, class) = (case % 3 != 0, case % 2 == 0);
        let text = random_csv(&mut rng, bad, class);
        std::fs::write(&path, &text).unwrap();
        let what = format!("case {case}: {:?}", String::from_utf8_lossy(&text));
        for config in configs(class) {
            for skip in [false, true] {
                assert_same_table(&path, &config, skip, &what);
            }
            errors += usize::from(CsvTable::open(&path, &config).is_err());
            reads += 1;
        }
    }
    // Both kinds of case were met.
    assert!(errors > 100 && errors + 100 < reads, "{errors} of {reads}");
}

#[test]
fn the_reader_matches_the_reference_on_fixed_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.csv");
    let values = TableConfig {
        targets: vec!["y".into()],
        features: Vec::new(),
        target: TableTarget::Values,
    };
    let labels = TableConfig {
        targets: vec!["y".into()],
        features: Vec::new(),
        target: TableTarget::Labels,
    };
    let files: [&[u8]; 18] = [
        b"a,y\n1, 1\n2,False\n3,\"0\"\n4,1.0\r\n5,TRUE\n6,0.0",
        b"a,y\n1,1\n2,yes\n3,\xff\n4,0\n",
        b"a,y\n1,2\n3,4\n",
        b"a,y\r\n1,2\r\n3,4\r\n\r\n",
        b"a,y\r1,2\r3,4",
        b"a,y\n1,2\n\n\n3,4\n\n",
        b"\xef\xbb\xbfa,y\n1,2\n",
        b"\n\na,y\n1,2\n",
        b"a,y\n\"1\n\",2\n3,\"4\"\"\"\n5,6\n",
        b"a,y\n1,2,3\n4,5\n",
        b"a,y\n1,NaN\n4,5\n",
        b"a,y\n1,-inf\n4,+Infinity\n",
        b"a,y\n1,2\n4,\n",
        b"a,y\n1,2\n4",
        b"a,y\n1,2\n4,5,",
        b"a,y\n1,\"2",
        b"a,y\n1,0\n1,true\n0,2\n",
        b"a,y\n",
    ];
    for text in files {
        std::fs::write(&path, text).unwrap();
        let what = format!("{:?}", String::from_utf8_lossy(text));
        for config in [&values, &labels] {
            for skip in [false, true] {
                assert_same_table(&path, config, skip, &what);
            }
        }
    }
}

#[test]
fn a_large_file_read_on_every_core_is_the_serial_readers_table() {
    // Over parallel_min and two blocks, with bad rows far apart: the parts
    // name the same first bad line and the same skipped rows.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.csv");
    let mut rng = Rng(42);
    for ending in ["\n", "\r\n"] {
        let mut text = format!("f0,f1,f2,y{ending}");
        for row in 0..300_000 {
            for _ in 0..3 {
                text.push_str(&format!("{:.6},", rng.next() as f64 / 1e17 - 92.0));
            }
            match row % 99_991 {
                50_000 => text.push_str("nan"),
                70_000 => text.push_str("1,2"),
                _ => text.push_str(&format!("{}", rng.below(1000))),
            }
            text.push_str(ending);
            if row % 77_777 == 0 {
                text.push_str(ending);
            }
        }
        std::fs::write(&path, &text).unwrap();
        let config = TableConfig {
            targets: vec!["y".into()],
            features: Vec::new(),
            target: TableTarget::Values,
        };
        for skip in [false, true] {
            let what = format!("big file, {ending:?}");
            assert_same_table_by(&path, &config, skip, &what, &[READERS[0], READERS[5]]);
        }
        let mut skipped = Vec::new();
        CsvTable::read_with(&path, &config, Some(&mut skipped), fast_body).unwrap();
        assert_eq!(skipped.len(), 6, "{skipped:?}");
    }
}
