//! IDX reading: round trips (raw and gzip) and every malformed case.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use headroom_loader::{Dataset, IdxDataset, LoaderError, Split};

fn file_name(p: &Path) -> String {
    p.file_name().unwrap().to_string_lossy().into_owned()
}

fn check_contents(ds: &IdxDataset, n: usize, rows: usize, cols: usize, classes: u8) {
    assert_eq!(ds.len(), n);
    assert_eq!(ds.sample_shape(), [rows, cols, 1]);
    assert_eq!(ds.num_classes(), classes as usize);
    let want_px = images(n, rows, cols);
    let want_lb = labels(n, classes);
    assert_eq!(ds.pixels(), &want_px[..]);
    assert_eq!(ds.labels(), &want_lb[..]);
    let mut out = vec![0u8; rows * cols];
    for i in 0..n {
        let label = ds.read(i, &mut out).unwrap();
        assert_eq!(label, u32::from(want_lb[i]));
        assert_eq!(out, want_px[i * rows * cols..(i + 1) * rows * cols]);
    }
}

#[test]
fn round_trip_raw() {
    let dir = tempfile::tempdir().unwrap();
    let img = write(dir.path(), "img", &images_idx(23, 5, 4));
    let lab = write(dir.path(), "lab", &labels_idx(23, 10));
    let ds = IdxDataset::open(&img, &lab).unwrap();
    check_contents(&ds, 23, 5, 4, 10);
}

#[test]
fn round_trip_gzip_detected_by_magic_not_name() {
    let dir = tempfile::tempdir().unwrap();
    // Compressed files without a .gz suffix, and a raw file named .gz.
    let img = write(dir.path(), "img", &gzip(&images_idx(17, 3, 6)));
    let lab = write(dir.path(), "lab.gz", &labels_idx(17, 7));
    let ds = IdxDataset::open(&img, &lab).unwrap();
    check_contents(&ds, 17, 3, 6, 7);
    let lab = write(dir.path(), "lab2", &gzip(&labels_idx(17, 7)));
    let img = write(dir.path(), "img2.gz", &images_idx(17, 3, 6));
    check_contents(&IdxDataset::open(&img, &lab).unwrap(), 17, 3, 6, 7);
}

#[test]
fn num_classes_is_max_label_plus_one() {
    let dir = tempfile::tempdir().unwrap();
    let img = write(dir.path(), "img", &images_idx(3, 2, 2));
    let lab = write(dir.path(), "lab", &idx_bytes(0x0801, &[3], &[0, 255, 4]));
    let ds = IdxDataset::open(&img, &lab).unwrap();
    assert_eq!(ds.num_classes(), 256);
    let mut out = [0u8; 4];
    assert_eq!(ds.read(1, &mut out).unwrap(), 255);
}

#[test]
fn read_checks_index_and_buffer() {
    let dir = tempfile::tempdir().unwrap();
    let img = write(dir.path(), "img", &images_idx(4, 2, 3));
    let lab = write(dir.path(), "lab", &labels_idx(4, 3));
    let ds = IdxDataset::open(&img, &lab).unwrap();
    let mut out = [0u8; 6];
    let e = ds.read(4, &mut out).unwrap_err();
    assert!(matches!(e, LoaderError::Index { index: 4, len: 4 }), "{e}");
    let e = ds.read(0, &mut out[..5]).unwrap_err();
    assert!(e.to_string().contains("expected 6"), "{e}");
}

#[test]
fn truncated_keeps_the_first_samples() {
    let dir = tempfile::tempdir().unwrap();
    let img = write(dir.path(), "img", &images_idx(20, 2, 2));
    let lab = write(dir.path(), "lab", &labels_idx(20, 10));
    let ds = IdxDataset::open(&img, &lab).unwrap().truncated(5);
    assert_eq!(ds.len(), 5);
    assert_eq!(ds.num_classes(), 10);
    assert_eq!(ds.pixels(), &images(20, 2, 2)[..20]);
    assert_eq!(ds.labels(), &labels(20, 10)[..5]);
    let ds = ds.truncated(100);
    assert_eq!(ds.len(), 5);
}

/// Opens with the given image and label bytes and returns the error.
fn open_err(img: &[u8], lab: &[u8]) -> (String, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let img = write(dir.path(), "bad-images-file", img);
    let lab = write(dir.path(), "bad-labels-file", lab);
    let err = IdxDataset::open(&img, &lab).expect_err("malformed input must fail");
    (err.to_string(), file_name(&img), file_name(&lab))
}

#[test]
fn bad_magic_names_the_file() {
    // Labels where images are expected.
    let (e, img, _) = open_err(&labels_idx(4, 10), &labels_idx(4, 10));
    assert!(
        e.contains(&img) && e.contains("magic") && e.contains("0x00000803"),
        "{e}"
    );
    // A float IDX file (dtype 0x0d).
    let (e, img, _) = open_err(&idx_bytes(0x0d03, &[1, 1, 1], &[0; 4]), &labels_idx(1, 2));
    assert!(e.contains(&img) && e.contains("0x00000d03"), "{e}");
    // Images where labels are expected, gzip-compressed.
    let (e, _, lab) = open_err(&images_idx(2, 2, 2), &gzip(&images_idx(2, 2, 2)));
    assert!(
        e.contains(&lab) && e.contains("magic") && e.contains("0x00000801"),
        "{e}"
    );
}

#[test]
fn truncated_data_names_the_file_and_sizes() {
    let mut img = images_idx(10, 4, 4);
    img.pop();
    let (e, name, _) = open_err(&img, &labels_idx(10, 3));
    assert!(e.contains(&name), "{e}");
    assert!(
        e.contains("160") && e.contains("159") && e.contains("truncated"),
        "{e}"
    );
    // Same through gzip.
    let (e, name, _) = open_err(&gzip(&img), &labels_idx(10, 3));
    assert!(
        e.contains(&name) && e.contains("160") && e.contains("159"),
        "{e}"
    );
    // Truncated labels.
    let mut lab = labels_idx(10, 3);
    lab.truncate(lab.len() - 3);
    let (e, _, name) = open_err(&images_idx(10, 4, 4), &lab);
    assert!(
        e.contains(&name) && e.contains("expected") || e.contains("10"),
        "{e}"
    );
    assert!(e.contains(&name) && e.contains('7'), "{e}");
}

#[test]
fn overlong_data_names_the_file_and_sizes() {
    let mut img = images_idx(10, 4, 4);
    img.extend_from_slice(&[1, 2, 3]);
    let (e, name, _) = open_err(&img, &labels_idx(10, 3));
    assert!(
        e.contains(&name) && e.contains("160") && e.contains("163") && e.contains("overlong"),
        "{e}"
    );
    let (e, name, _) = open_err(&gzip(&img), &labels_idx(10, 3));
    assert!(
        e.contains(&name) && e.contains("160") && e.contains("163"),
        "{e}"
    );
}

#[test]
fn short_header_and_empty_file() {
    let (e, name, _) = open_err(&[0, 0, 8, 3, 0], &labels_idx(1, 2));
    assert!(e.contains(&name) && e.contains("header"), "{e}");
    let (e, name, _) = open_err(&[], &labels_idx(1, 2));
    assert!(e.contains(&name) && e.contains("header"), "{e}");
    let (e, _, name) = open_err(&images_idx(1, 2, 2), &gzip(&[0, 0, 8]));
    assert!(e.contains(&name) && e.contains("header"), "{e}");
}

#[test]
fn corrupt_gzip_stream_names_the_file() {
    let gz = gzip(&images_idx(50, 8, 8));
    // Cut the compressed stream in the middle.
    let (e, name, _) = open_err(&gz[..gz.len() / 2], &labels_idx(50, 3));
    assert!(e.contains(&name), "{e}");
    // Garbage after the gzip magic.
    let (e, name, _) = open_err(
        &[0x1f, 0x8b, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
        &labels_idx(50, 3),
    );
    assert!(e.contains(&name), "{e}");
}

#[test]
fn count_mismatch_names_both_files_and_counts() {
    let (e, img, lab) = open_err(&images_idx(12, 2, 2), &labels_idx(11, 3));
    assert!(e.contains(&img) && e.contains(&lab), "{e}");
    assert!(e.contains("12") && e.contains("11"), "{e}");
}

#[test]
fn huge_header_dims_on_a_tiny_file_fail_fast_without_allocating() {
    let start = Instant::now();
    // 4e9 images of 65535 x 65535: overflows any address space.
    let (e, name, _) = open_err(
        &idx_bytes(0x0803, &[u32::MAX, 65535, 65535], &[1, 2, 3]),
        &labels_idx(1, 2),
    );
    assert!(e.contains(&name), "{e}");
    // 1e6 images of 1000 x 1000 (1 TB) declared by a 19-byte file.
    let huge = idx_bytes(0x0803, &[1_000_000, 1000, 1000], &[1, 2, 3]);
    let (e, name, _) = open_err(&huge, &labels_idx(1, 2));
    assert!(e.contains(&name) && e.contains("1000000000000"), "{e}");
    // The same header, gzip-compressed.
    let (e, name, _) = open_err(&gzip(&huge), &labels_idx(1, 2));
    assert!(e.contains(&name) && e.contains("1000000000000"), "{e}");
    // Labels claiming 4e9 entries.
    let (e, _, name) = open_err(
        &images_idx(1, 2, 2),
        &gzip(&idx_bytes(0x0801, &[u32::MAX], &[1])),
    );
    assert!(e.contains(&name), "{e}");
    // 64 MiB declared, gzip of a few bytes: under the ratio cap, so it is
    // decompressed, found short, and rejected (memory grows with the data).
    let mid = idx_bytes(0x0803, &[64, 1024, 1024], &[0; 10]);
    let (e, name, _) = open_err(&gzip(&mid), &labels_idx(64, 2));
    assert!(
        e.contains(&name) && e.contains("67108864") && e.contains("truncated"),
        "{e}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn zero_sized_images_are_rejected() {
    let (e, name, _) = open_err(&idx_bytes(0x0803, &[3, 0, 5], &[]), &labels_idx(3, 2));
    assert!(e.contains(&name) && e.contains("0 x 5"), "{e}");
}

#[test]
fn missing_file_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let lab = write(dir.path(), "lab", &labels_idx(1, 2));
    let missing = dir.path().join("no-such-images");
    let e = IdxDataset::open(&missing, &lab).unwrap_err();
    assert!(matches!(e, LoaderError::Io { .. }));
    assert!(e.to_string().contains("no-such-images"), "{e}");
    // The OS's reason is in the message once, not chained again as a source
    // (which error reports would print a second time).
    assert!(e.to_string().contains("No such file"), "{e}");
    assert!(std::error::Error::source(&e).is_none());
}

#[test]
fn fashion_mnist_finds_raw_and_gz_files() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(
        d,
        "train-images-idx3-ubyte.gz",
        &gzip(&images_idx(30, 28, 28)),
    );
    write(d, "train-labels-idx1-ubyte", &labels_idx(30, 10));
    write(d, "t10k-images-idx3-ubyte", &images_idx(8, 28, 28));
    write(d, "t10k-labels-idx1-ubyte.gz", &gzip(&labels_idx(8, 10)));
    let train = IdxDataset::fashion_mnist(d, Split::Train).unwrap();
    check_contents(&train, 30, 28, 28, 10);
    let test = IdxDataset::fashion_mnist(d, Split::Test).unwrap();
    check_contents(&test, 8, 28, 28, 10);
}

#[test]
fn fashion_mnist_missing_lists_what_was_tried() {
    let dir = tempfile::tempdir().unwrap();
    let absent = dir.path().join("nowhere");
    let e = IdxDataset::fashion_mnist(&absent, Split::Train).unwrap_err();
    let LoaderError::Missing { tried, .. } = &e else {
        panic!("expected Missing, got {e}");
    };
    assert_eq!(tried.len(), 4, "{tried:?}");
    let msg = e.to_string();
    for name in [
        "train-images-idx3-ubyte",
        "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte",
        "train-labels-idx1-ubyte.gz",
    ] {
        assert!(
            msg.contains(&absent.join(name).display().to_string()),
            "{msg}"
        );
    }
    // Only the labels missing: only their paths are listed.
    let d = dir.path();
    write(d, "t10k-images-idx3-ubyte", &images_idx(2, 28, 28));
    let e = IdxDataset::fashion_mnist(d, Split::Test).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("t10k-labels-idx1-ubyte.gz") && !msg.contains("t10k-images"),
        "{msg}"
    );
}
