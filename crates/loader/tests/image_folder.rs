//! `ImageFolder`: labels from sorted class folders, exact PNG pixels and
//! close JPEG ones, resize against center crop, and every bad input named
//! by its file (at open when the header shows it, else at read).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use headroom_loader::{
    write_image, DataLoader, Dataset, ImageFit, ImageFolder, ImageFolderConfig, LoaderConfig,
};

/// A deterministic h×w×c pattern, different for each `seed`.
fn pattern(seed: usize, [h, w, c]: [usize; 3]) -> Vec<u8> {
    (0..h * w * c)
        .map(|i| ((i * 37 + seed * 101) % 251) as u8)
        .collect()
}

/// A smooth h×w×c image (JPEG keeps it close).
fn gradient([h, w, c]: [usize; 3]) -> Vec<u8> {
    let mut out = Vec::with_capacity(h * w * c);
    for y in 0..h {
        for x in 0..w {
            for ch in 0..c {
                out.push((40 + y * 4 + x * 3 + ch * 20) as u8);
            }
        }
    }
    out
}

fn config(size: [usize; 2], channels: usize, fit: ImageFit) -> ImageFolderConfig {
    ImageFolderConfig {
        size,
        channels,
        fit,
    }
}

fn read_all(data: &ImageFolder) -> Vec<(Vec<u8>, u32)> {
    let len = data.sample_shape().iter().product();
    (0..data.len())
        .map(|i| {
            let mut pixels = vec![0u8; len];
            let label = data.read(i, &mut pixels).unwrap();
            (pixels, label)
        })
        .collect()
}

fn mkdir(path: &Path) -> PathBuf {
    std::fs::create_dir_all(path).unwrap();
    path.to_path_buf()
}

#[test]
fn classes_are_sorted_folders_and_png_pixels_are_exact() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let shape = [8, 12, 3];
    // Made out of order: the dataset's order is by name.
    let dog = mkdir(&root.join("dog"));
    let cat = mkdir(&root.join("cat"));
    write_image(&dog.join("b.png"), &pattern(3, shape), shape).unwrap();
    write_image(&dog.join("a.PNG"), &pattern(2, shape), shape).unwrap();
    write_image(&cat.join("z.png"), &pattern(1, shape), shape).unwrap();
    // Not data: hidden files and folders, other types, files at the top.
    write_image(&cat.join(".hidden.png"), &pattern(9, shape), shape).unwrap();
    std::fs::write(cat.join("notes.txt"), "not an image").unwrap();
    std::fs::write(root.join("README.png"), "top-level files are not classes").unwrap();
    write_image(
        &mkdir(&root.join(".cache")).join("x.png"),
        &pattern(9, shape),
        shape,
    )
    .unwrap();

    let data = ImageFolder::open(root, config([8, 12], 3, ImageFit::Resize)).unwrap();
    assert_eq!(data.classes(), ["cat", "dog"]);
    assert_eq!(data.num_classes(), 2);
    assert_eq!(data.sample_shape(), [8, 12, 3]);
    let samples = read_all(&data);
    let expected = vec![
        (pattern(1, shape), 0),
        (pattern(2, shape), 1),
        (pattern(3, shape), 1),
    ];
    assert_eq!(samples, expected);
    assert_eq!(data.file(1).unwrap().0, dog.join("a.PNG"));
}

#[test]
fn a_gray_png_reads_exactly_as_one_channel() {
    let dir = tempfile::tempdir().unwrap();
    let shape = [10, 10, 1];
    let class = mkdir(&dir.path().join("only"));
    write_image(&class.join("g.png"), &pattern(5, shape), shape).unwrap();
    let data = ImageFolder::open(dir.path(), config([10, 10], 1, ImageFit::CenterCrop)).unwrap();
    assert_eq!(read_all(&data), vec![(pattern(5, shape), 0)]);
    // The same gray file as RGB: three equal channels.
    let rgb = ImageFolder::open(dir.path(), config([10, 10], 3, ImageFit::CenterCrop)).unwrap();
    let (pixels, _) = read_all(&rgb).remove(0);
    let gray = pattern(5, shape);
    for (i, px) in pixels.chunks(3).enumerate() {
        assert_eq!(px, [gray[i]; 3], "pixel {i}");
    }
}

#[test]
fn jpeg_pixels_are_close_gray_and_rgb() {
    let dir = tempfile::tempdir().unwrap();
    let class = mkdir(&dir.path().join("a"));
    for (name, shape) in [("rgb.jpg", [16, 16, 3]), ("gray.JPEG", [16, 16, 1])] {
        write_image(&class.join(name), &gradient(shape), shape).unwrap();
    }
    let data = ImageFolder::open(dir.path(), config([16, 16], 3, ImageFit::Resize)).unwrap();
    let samples = read_all(&data);
    // Sorted by name: gray.JPEG, then rgb.jpg.
    let gray = gradient([16, 16, 1]);
    let gray_as_rgb: Vec<u8> = gray.iter().flat_map(|&g| [g; 3]).collect();
    for ((pixels, label), want) in samples.iter().zip([gray_as_rgb, gradient([16, 16, 3])]) {
        assert_eq!(*label, 0);
        let error: f64 = pixels
            .iter()
            .zip(&want)
            .map(|(&a, &b)| (f64::from(a) - f64::from(b)).abs())
            .sum::<f64>()
            / want.len() as f64;
        assert!(error < 4.0, "mean absolute error {error}");
    }
}

#[test]
fn resize_stretches_and_center_crop_keeps_the_middle() {
    let dir = tempfile::tempdir().unwrap();
    let class = mkdir(&dir.path().join("wide"));
    // 16 high, 48 wide: black thirds left and right, white in the middle.
    let (h, w) = (16, 48);
    let pixels: Vec<u8> = (0..h * w)
        .map(|i| if (16..32).contains(&(i % w)) { 255 } else { 0 })
        .collect();
    write_image(&class.join("w.png"), &pixels, [h, w, 1]).unwrap();

    let crop = ImageFolder::open(dir.path(), config([8, 8], 1, ImageFit::CenterCrop)).unwrap();
    let (cropped, _) = read_all(&crop).remove(0);
    assert_eq!(cropped.len(), 64);
    // Scaled to 8×24, the middle 8 columns are the white third.
    assert!(cropped.iter().all(|&p| p > 200), "{cropped:?}");

    let resize = ImageFolder::open(dir.path(), config([8, 12], 1, ImageFit::Resize)).unwrap();
    assert_eq!(resize.sample_shape(), [8, 12, 1]);
    let (stretched, _) = read_all(&resize).remove(0);
    assert_eq!(stretched.len(), 96);
    // Every row: black at both edges, white in the middle.
    for row in stretched.chunks(12) {
        assert!(row[0] < 30 && row[11] < 30, "{row:?}");
        assert!(row[5] > 200 && row[6] > 200, "{row:?}");
    }
}

#[test]
fn workers_read_the_same_samples_as_one_thread() {
    let dir = tempfile::tempdir().unwrap();
    for class in 0..3 {
        let folder = mkdir(&dir.path().join(format!("c{class}")));
        for i in 0..6 {
            let shape = [6 + i, 9, 3];
            let name = format!("{i}.{}", if i % 2 == 0 { "png" } else { "jpg" });
            write_image(&folder.join(name), &pattern(class * 10 + i, shape), shape).unwrap();
        }
    }
    let data =
        Arc::new(ImageFolder::open(dir.path(), config([8, 8], 3, ImageFit::CenterCrop)).unwrap());
    let serial = read_all(&data);
    let loader = DataLoader::new(
        data.clone(),
        LoaderConfig {
            batch_size: 4,
            shuffle: false,
            drop_last: false,
            workers: 3,
            ..LoaderConfig::default()
        },
    )
    .unwrap();
    let mut parallel = Vec::new();
    for batch in loader.epoch(0, 0) {
        let batch = batch.unwrap();
        for (i, &label) in batch.labels.iter().enumerate() {
            parallel.push((batch.pixels[i * 192..(i + 1) * 192].to_vec(), label));
        }
    }
    assert_eq!(parallel, serial);
}

// ---- bad input: each error names the file or folder ----

fn open_err(root: &Path) -> String {
    ImageFolder::open(root, ImageFolderConfig::default())
        .unwrap_err()
        .to_string()
}

#[test]
fn a_missing_folder_or_a_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-folder");
    let err = open_err(&missing);
    assert!(err.contains(&missing.display().to_string()), "{err}");
    assert!(err.contains("one subfolder of images per class"), "{err}");

    let file = dir.path().join("file");
    std::fs::write(&file, "x").unwrap();
    let err = open_err(&file);
    assert!(
        err.contains(&file.display().to_string()) && err.contains("is a file"),
        "{err}"
    );
}

#[test]
fn no_class_folder_and_an_empty_class_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let err = open_err(dir.path());
    assert!(err.contains("holds no class folder"), "{err}");

    let full = mkdir(&dir.path().join("full"));
    write_image(&full.join("a.png"), &pattern(0, [4, 4, 1]), [4, 4, 1]).unwrap();
    let empty = mkdir(&dir.path().join("empty"));
    std::fs::write(empty.join("notes.txt"), "no images here").unwrap();
    let err = open_err(dir.path());
    assert!(err.contains(&empty.display().to_string()), "{err}");
    assert!(err.contains("holds no image"), "{err}");
}

#[test]
fn garbage_named_png_is_refused_at_open_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let class = mkdir(&dir.path().join("a"));
    write_image(&class.join("good.png"), &pattern(0, [4, 4, 1]), [4, 4, 1]).unwrap();
    let garbage = class.join("garbage.png");
    std::fs::write(&garbage, b"this is not a png at all, just bytes").unwrap();
    let err = open_err(dir.path());
    assert!(err.contains(&garbage.display().to_string()), "{err}");
    assert!(err.contains("PNG or JPEG"), "{err}");
}

/// A file cut after its header opens (the header is fine) and fails at
/// read, naming the file: never a panic, never a black sample.
#[test]
fn a_truncated_image_fails_at_read_naming_it() {
    for (name, shape) in [("cut.png", [24, 24, 3]), ("cut.jpg", [24, 24, 3])] {
        let dir = tempfile::tempdir().unwrap();
        let class = mkdir(&dir.path().join("a"));
        let path = class.join(name);
        write_image(&path, &pattern(1, shape), shape).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() * 2 / 3]).unwrap();
        let data = ImageFolder::open(dir.path(), config([24, 24], 3, ImageFit::Resize)).unwrap();
        let mut out = vec![0u8; 24 * 24 * 3];
        let err = data.read(0, &mut out).unwrap_err().to_string();
        assert!(err.contains(&path.display().to_string()), "{name}: {err}");
    }
}

#[test]
fn a_header_cut_short_is_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let class = mkdir(&dir.path().join("a"));
    let path = class.join("stub.png");
    write_image(&path, &pattern(1, [8, 8, 1]), [8, 8, 1]).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..12]).unwrap();
    let err = open_err(dir.path());
    assert!(err.contains(&path.display().to_string()), "{err}");
}

/// A photo stored sideways with an EXIF orientation (6: turn 90° clockwise
/// to view) is read upright.
#[test]
fn an_exif_orientation_is_applied() {
    use image::ImageEncoder as _;
    let dir = tempfile::tempdir().unwrap();
    let class = mkdir(&dir.path().join("a"));
    // Big-endian TIFF header, one IFD entry: Orientation (0x0112), SHORT, 6.
    let exif = vec![
        0x4D, 0x4D, 0, 0x2A, 0, 0, 0, 8, 0, 1, 0x01, 0x12, 0, 3, 0, 0, 0, 1, 0, 6, 0, 0, 0, 0, 0, 0,
    ];
    // 2 high, 3 wide: [[1, 2, 3], [4, 5, 6]] (times 40).
    let stored: Vec<u8> = (1..=6).map(|v| v * 40).collect();
    let mut bytes = Vec::new();
    let mut encoder = image::codecs::png::PngEncoder::new(&mut bytes);
    encoder.set_exif_metadata(exif).unwrap();
    encoder
        .write_image(&stored, 3, 2, image::ExtendedColorType::L8)
        .unwrap();
    std::fs::write(class.join("sideways.png"), bytes).unwrap();
    let data = ImageFolder::open(dir.path(), config([3, 2], 1, ImageFit::Resize)).unwrap();
    // Turned clockwise: 3 high, 2 wide, [[4, 1], [5, 2], [6, 3]].
    let upright: Vec<u8> = [4, 1, 5, 2, 6, 3].iter().map(|v| v * 40).collect();
    assert_eq!(read_all(&data), vec![(upright, 0)]);
}
