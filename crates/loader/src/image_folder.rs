//! A folder of photos as a dataset: `ROOT/<class>/*.{png,jpg,jpeg}`.
//!
//! Classes are the subfolder names, sorted (label = index); each class's
//! files are sorted by name, so sample `i` is the same file on every
//! machine. Hidden entries and files of other types are ignored.
//!
//! Opening reads only what is cheap: the listing and every file's header
//! (its dimensions), so a folder larger than memory opens fast and a
//! non-image named `.png` is refused before any training, naming the file.
//! Pixels are decoded when a sample is read (`&self`, no shared state, so
//! the loader's workers decode in parallel); a file whose body turns out
//! corrupt or truncated is an error naming it, never a panic or a black
//! sample. An EXIF orientation (a phone's photo stored sideways) is
//! applied, so samples are upright as image viewers show them.

use std::ffi::OsStr;
use std::io::Cursor;
use std::path::{Path, PathBuf};

use image::imageops::FilterType;
use image::{DynamicImage, ImageDecoder as _, ImageEncoder as _, ImageFormat, ImageReader};

use crate::error::io_err;
use crate::{Dataset, LoaderError, Skipped};

/// The file extensions read (compared without regard to case).
pub const IMAGE_EXTENSIONS: [&str; 3] = ["png", "jpg", "jpeg"];

/// How an image whose size is not the output size is made to fit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ImageFit {
    /// Stretch to exactly h×w (the aspect ratio may change).
    Resize,
    /// Scale so that the image covers h×w (the shorter side fits), then
    /// keep the center: nothing is distorted, the edges may be cut.
    #[default]
    CenterCrop,
}

/// What every sample of an [`ImageFolder`] becomes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageFolderConfig {
    /// Output `[height, width]`.
    pub size: [usize; 2],
    /// 1 (grayscale) or 3 (RGB).
    pub channels: usize,
    pub fit: ImageFit,
}

impl Default for ImageFolderConfig {
    /// 28×28 grayscale, center-cropped: the input of the Fashion-MNIST
    /// models.
    fn default() -> Self {
        Self {
            size: [28, 28],
            channels: 1,
            fit: ImageFit::CenterCrop,
        }
    }
}

/// The largest output side: a mistake (pixels, not a model input) beyond it.
const MAX_SIDE: usize = 4096;

/// Labelled photos read from `ROOT/<class>/<file>`.
#[derive(Debug)]
pub struct ImageFolder {
    root: PathBuf,
    classes: Vec<String>,
    /// Every image with its label, classes in order, files sorted by name.
    files: Vec<(PathBuf, u32)>,
    config: ImageFolderConfig,
}

fn bad(path: &Path, message: impl Into<String>) -> LoaderError {
    LoaderError::Image {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Hidden files and folders (`.DS_Store`, `.git`, editors' backups) are
/// not data.
fn is_hidden(name: &OsStr) -> bool {
    name.as_encoded_bytes().first() == Some(&b'.')
}

fn is_image_name(path: &Path) -> bool {
    path.extension()
        .and_then(OsStr::to_str)
        .is_some_and(|ext| IMAGE_EXTENSIONS.iter().any(|e| ext.eq_ignore_ascii_case(e)))
}

/// The non-hidden entries of `dir`, sorted by name, with whether each is a
/// directory (symlinks followed).
fn sorted_entries(dir: &Path) -> Result<Vec<(PathBuf, bool)>, LoaderError> {
    let mut entries = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        if is_hidden(&entry.file_name()) {
            continue;
        }
        let path = entry.path();
        let meta = std::fs::metadata(&path).map_err(io_err(&path))?;
        entries.push((path, meta.is_dir()));
    }
    entries.sort();
    Ok(entries)
}

impl ImageFolder {
    /// Lists `root`'s classes and images and reads every image's header.
    /// Errors name the folder or file and what was expected: `root` missing
    /// or not a directory, no class folder, a class with no image, a file
    /// whose header is not a PNG or JPEG one.
    pub fn open(root: &Path, config: ImageFolderConfig) -> Result<Self, LoaderError> {
        Self::list(root, config, None)
    }

    /// [`ImageFolder::open`], every image decoded once to find those that
    /// cannot be read (a bad header, a truncated or corrupt body), which
    /// are left out and returned with the reason (`data.bad_samples =
    /// "skip"`). A class folder whose every image is unreadable is an
    /// error: skipping never empties a class.
    pub fn open_skipping(
        root: &Path,
        config: ImageFolderConfig,
    ) -> Result<(Self, Vec<Skipped>), LoaderError> {
        let mut skipped = Vec::new();
        let folder = Self::list(root, config, Some(&mut skipped))?;
        Ok((folder, skipped))
    }

    fn list(
        root: &Path,
        config: ImageFolderConfig,
        mut skipped: Option<&mut Vec<Skipped>>,
    ) -> Result<Self, LoaderError> {
        check_config(&config)?;
        // Skipping decodes every image once, into this.
        let mut scratch = match skipped {
            Some(_) => vec![0u8; config.size[0] * config.size[1] * config.channels],
            None => Vec::new(),
        };
        let meta = std::fs::metadata(root).map_err(|e| {
            bad(
                root,
                format!("{e}; expected a folder holding one subfolder of images per class"),
            )
        })?;
        if !meta.is_dir() {
            return Err(bad(
                root,
                "is a file; expected a folder holding one subfolder of images per class",
            ));
        }
        let mut classes = Vec::new();
        let mut files = Vec::new();
        for (class_dir, is_dir) in sorted_entries(root)? {
            if !is_dir {
                continue;
            }
            let name = class_dir
                .file_name()
                .and_then(OsStr::to_str)
                .ok_or_else(|| bad(&class_dir, "a class folder's name must be UTF-8"))?
                .to_string();
            let label = u32::try_from(classes.len())
                .map_err(|_| bad(root, "more than 2^32 class folders"))?;
            let before = files.len();
            let mut left_out = 0usize;
            for (file, is_dir) in sorted_entries(&class_dir)? {
                if !is_dir && is_image_name(&file) {
                    let readable = match skipped {
                        None => check_header(&file),
                        Some(_) => {
                            check_header(&file).and_then(|()| decode(&file, &config, &mut scratch))
                        }
                    };
                    match (readable, skipped.as_deref_mut()) {
                        (Ok(()), _) => files.push((file, label)),
                        (Err(e), Some(skipped)) => {
                            skipped.push(Skipped::file(&file, e));
                            left_out += 1;
                        }
                        (Err(e), None) => return Err(e),
                    }
                }
            }
            if files.len() == before && left_out > 0 {
                return Err(bad(
                    &class_dir,
                    format!(
                        "every image of the class ({left_out}) is unreadable: skipping would \
                         empty the class; fix or remove the files, or the folder"
                    ),
                ));
            }
            if files.len() == before {
                return Err(bad(
                    &class_dir,
                    "class folder holds no image; expected at least one .png, .jpg or .jpeg file \
                     (or remove the folder)",
                ));
            }
            classes.push(name);
        }
        if classes.is_empty() {
            return Err(bad(
                root,
                "holds no class folder; expected one subfolder of images per class \
                 (ROOT/<class>/<image>.png)",
            ));
        }
        Ok(Self {
            root: root.to_path_buf(),
            classes,
            files,
            config,
        })
    }

    /// The folder opened.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Class names (the subfolders), in label order.
    pub fn classes(&self) -> &[String] {
        &self.classes
    }

    /// Sample `index`'s file and label.
    pub fn file(&self, index: usize) -> Option<(&Path, u32)> {
        self.files.get(index).map(|(p, l)| (p.as_path(), *l))
    }

    /// What the samples become.
    pub fn config(&self) -> ImageFolderConfig {
        self.config
    }
}

fn check_config(config: &ImageFolderConfig) -> Result<(), LoaderError> {
    let [h, w] = config.size;
    if !(1..=MAX_SIDE).contains(&h) || !(1..=MAX_SIDE).contains(&w) {
        return Err(LoaderError::Config {
            field: "size",
            message: format!("[{h}, {w}]: each side must be from 1 to {MAX_SIDE} pixels"),
        });
    }
    if config.channels != 1 && config.channels != 3 {
        return Err(LoaderError::Config {
            field: "channels",
            message: format!("{}: expected 1 (grayscale) or 3 (RGB)", config.channels),
        });
    }
    Ok(())
}

/// The format from the file's first bytes, else from its extension (so a
/// JPEG saved as `.png` still reads, and garbage is blamed on the format the
/// name promises).
fn reader_of<R: std::io::BufRead + std::io::Seek>(
    path: &Path,
    reader: ImageReader<R>,
) -> Result<ImageReader<R>, LoaderError> {
    let mut reader = reader.with_guessed_format().map_err(io_err(path))?;
    if reader.format().is_none() {
        reader.set_format(ImageFormat::from_path(path).map_err(|e| bad(path, e.to_string()))?);
    }
    Ok(reader)
}

/// Reads the header only: the image's dimensions, which must be non-zero.
fn check_header(path: &Path) -> Result<(), LoaderError> {
    let reader = ImageReader::open(path).map_err(io_err(path))?;
    let (w, h) = reader_of(path, reader)?
        .into_dimensions()
        .map_err(|e| bad(path, format!("not a readable PNG or JPEG header: {e}")))?;
    if w == 0 || h == 0 {
        return Err(bad(
            path,
            format!("the image is {w}×{h}; expected at least one pixel"),
        ));
    }
    Ok(())
}

/// The JPEG decoder fills a body cut short with grey instead of failing,
/// so the file's structure is walked: marker segments by their lengths,
/// each scan's entropy-coded data (where 0xFF is followed by 0x00 or a
/// restart marker) up to the next marker, until the end-of-image marker
/// (0xFFD9). Running out of bytes first means the file was truncated. Data
/// after the end marker (a phone's appended video, padding) is allowed.
fn check_jpeg_end(path: &Path, bytes: &[u8]) -> Result<(), LoaderError> {
    let truncated = || {
        bad(
            path,
            "the JPEG ends before its end-of-image marker: the file is truncated",
        )
    };
    // After the start-of-image marker (0xFFD8).
    let mut at = 2;
    let mut in_scan = false;
    loop {
        if in_scan {
            // Entropy-coded data: find the next real marker.
            let is_marker = |at: usize| {
                bytes[at] == 0xFF && !matches!(bytes[at + 1], 0x00 | 0xD0..=0xD7 | 0xFF)
            };
            while at + 1 < bytes.len() && !is_marker(at) {
                at += 1;
            }
        }
        // Fill bytes (0xFF runs) may precede a marker.
        while at + 1 < bytes.len() && bytes[at] == 0xFF && bytes[at + 1] == 0xFF {
            at += 1;
        }
        let (Some(&0xFF), Some(&marker)) = (bytes.get(at), bytes.get(at + 1)) else {
            return Err(truncated());
        };
        at += 2;
        match marker {
            0xD9 => return Ok(()),
            // Markers without a length.
            0x01 | 0xD0..=0xD8 => continue,
            _ => {}
        }
        let (Some(&hi), Some(&lo)) = (bytes.get(at), bytes.get(at + 1)) else {
            return Err(truncated());
        };
        at += usize::from(u16::from_be_bytes([hi, lo]));
        if at > bytes.len() {
            return Err(truncated());
        }
        // Start of scan: its entropy-coded data follows the header.
        in_scan = marker == 0xDA;
    }
}

/// Decodes `path` and fits it to `config` as u8 HWC.
fn decode(path: &Path, config: &ImageFolderConfig, out: &mut [u8]) -> Result<(), LoaderError> {
    let bytes = std::fs::read(path).map_err(io_err(path))?;
    let reader = reader_of(path, ImageReader::new(Cursor::new(&bytes)))?;
    if reader.format() == Some(ImageFormat::Jpeg) {
        check_jpeg_end(path, &bytes)?;
    }
    let undecodable = |e: image::ImageError| bad(path, format!("cannot decode the image: {e}"));
    let mut decoder = reader.into_decoder().map_err(undecodable)?;
    // A phone's photo is stored sideways with an EXIF note saying how to
    // turn it: turned here, so the sample is upright as viewers show it.
    let orientation = decoder.orientation().map_err(undecodable)?;
    let mut image = DynamicImage::from_decoder(decoder).map_err(undecodable)?;
    image.apply_orientation(orientation);
    let [h, w] = config.size;
    let (h32, w32) = (h as u32, w as u32);
    // An image of the right size is used as is (exact pixels); resampling
    // is linear (triangle filter), deterministic on every machine.
    let fitted = if image.width() == w32 && image.height() == h32 {
        image
    } else {
        match config.fit {
            ImageFit::Resize => image.resize_exact(w32, h32, FilterType::Triangle),
            ImageFit::CenterCrop => image.resize_to_fill(w32, h32, FilterType::Triangle),
        }
    };
    let pixels = match config.channels {
        1 => DynamicImage::ImageLuma8(fitted.to_luma8()).into_bytes(),
        _ => DynamicImage::ImageRgb8(fitted.to_rgb8()).into_bytes(),
    };
    if pixels.len() != out.len() {
        return Err(bad(
            path,
            format!(
                "decoded to {} bytes, expected {} ({h}×{w}×{})",
                pixels.len(),
                out.len(),
                config.channels
            ),
        ));
    }
    out.copy_from_slice(&pixels);
    Ok(())
}

impl Dataset for ImageFolder {
    fn len(&self) -> usize {
        self.files.len()
    }

    fn sample_shape(&self) -> [usize; 3] {
        let [h, w] = self.config.size;
        [h, w, self.config.channels]
    }

    fn num_classes(&self) -> usize {
        self.classes.len()
    }

    /// Each image's path under the root, size in bytes and class, and the
    /// fit settings: decoding every photo at each start would cost what an
    /// epoch does. A file edited in place to the same size is not seen.
    fn fingerprint(&self) -> Option<u32> {
        let mut digest = crc32fast::Hasher::new();
        for name in &self.classes {
            digest.update(name.as_bytes());
            digest.update(&[0]);
        }
        for (path, label) in &self.files {
            let relative = path.strip_prefix(&self.root).unwrap_or(path);
            digest.update(relative.to_string_lossy().as_bytes());
            digest.update(&[0]);
            let size = std::fs::metadata(path).map_or(u64::MAX, |m| m.len());
            digest.update(&size.to_le_bytes());
            digest.update(&label.to_le_bytes());
        }
        digest.update(format!("{:?}", self.config).as_bytes());
        Some(digest.finalize())
    }

    fn read(&self, index: usize, out: &mut [u8]) -> Result<u32, LoaderError> {
        let (path, label) = self.files.get(index).ok_or(LoaderError::Index {
            index,
            len: self.files.len(),
        })?;
        let expected = self.sample_shape().iter().product::<usize>();
        if out.len() != expected {
            return Err(LoaderError::Buffer {
                index,
                expected,
                actual: out.len(),
            });
        }
        decode(path, &self.config, out)?;
        Ok(*label)
    }
}

/// Unlabelled photos to score: one PNG or JPEG file, or every image in a
/// folder (sorted by name; hidden files and other types skipped, no
/// subfolders), decoded and fit as an [`ImageFolder`]'s are. Every label is
/// 0.
#[derive(Debug)]
pub struct ImageFiles {
    files: Vec<PathBuf>,
    config: ImageFolderConfig,
}

impl ImageFiles {
    /// Lists `path`'s images and reads each one's header.
    pub fn open(path: &Path, config: ImageFolderConfig) -> Result<Self, LoaderError> {
        check_config(&config)?;
        let meta = std::fs::metadata(path).map_err(|e| {
            bad(
                path,
                format!("{e}; expected a PNG or JPEG image, or a folder of them"),
            )
        })?;
        let files: Vec<PathBuf> = if meta.is_dir() {
            sorted_entries(path)?
                .into_iter()
                .filter(|(p, is_dir)| !is_dir && is_image_name(p))
                .map(|(p, _)| p)
                .collect()
        } else {
            vec![path.to_path_buf()]
        };
        if files.is_empty() {
            return Err(bad(
                path,
                "holds no .png, .jpg or .jpeg file (subfolders are not searched)",
            ));
        }
        for file in &files {
            check_header(file)?;
        }
        Ok(Self { files, config })
    }

    /// The image of each sample, in order.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }
}

impl Dataset for ImageFiles {
    fn len(&self) -> usize {
        self.files.len()
    }

    fn sample_shape(&self) -> [usize; 3] {
        let [h, w] = self.config.size;
        [h, w, self.config.channels]
    }

    fn num_classes(&self) -> usize {
        1
    }

    fn read(&self, index: usize, out: &mut [u8]) -> Result<u32, LoaderError> {
        let path = self.files.get(index).ok_or(LoaderError::Index {
            index,
            len: self.files.len(),
        })?;
        decode(path, &self.config, out)?;
        Ok(0)
    }
}

/// Writes a u8 HWC image (`channels` 1 or 3) as PNG or JPEG (quality 90),
/// chosen by `path`'s extension: for tests and examples that need an
/// image folder.
pub fn write_image(path: &Path, pixels: &[u8], [h, w, c]: [usize; 3]) -> Result<(), LoaderError> {
    let color = match c {
        1 => image::ExtendedColorType::L8,
        3 => image::ExtendedColorType::Rgb8,
        _ => return Err(bad(path, format!("{c} channels; expected 1 or 3"))),
    };
    if pixels.len() != h * w * c {
        return Err(bad(
            path,
            format!("{} bytes for a {h}×{w}×{c} image", pixels.len()),
        ));
    }
    let format = ImageFormat::from_path(path).map_err(|e| bad(path, e.to_string()))?;
    let mut bytes = Vec::new();
    let result = match format {
        ImageFormat::Png => image::codecs::png::PngEncoder::new(&mut bytes)
            .write_image(pixels, w as u32, h as u32, color),
        ImageFormat::Jpeg => image::codecs::jpeg::JpegEncoder::new_with_quality(&mut bytes, 90)
            .write_image(pixels, w as u32, h as u32, color),
        other => {
            return Err(bad(
                path,
                format!("{other:?}: expected .png, .jpg or .jpeg"),
            ))
        }
    };
    result.map_err(|e| bad(path, format!("encoding: {e}")))?;
    std::fs::write(path, bytes).map_err(io_err(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hidden_names_and_extensions() {
        assert!(is_hidden(OsStr::new(".DS_Store")));
        assert!(!is_hidden(OsStr::new("cat.png")));
        for name in ["a.png", "a.PNG", "a.Jpg", "a.jpeg", "a.JPEG"] {
            assert!(is_image_name(Path::new(name)), "{name}");
        }
        for name in ["a.gif", "a.txt", "png", "a.png.bak"] {
            assert!(!is_image_name(Path::new(name)), "{name}");
        }
    }

    #[test]
    fn a_jpeg_without_its_end_marker_is_truncated() {
        let path = Path::new("x.jpg");
        // SOI, an APP0 segment of 4 bytes, a scan (header of 3 bytes, then
        // data holding a stuffed 0xFF00 and a restart marker), EOI.
        let whole = [
            0xFF, 0xD8, 0xFF, 0xE0, 0, 4, 1, 2, 0xFF, 0xDA, 0, 3, 9, 5, 0xFF, 0x00, 6, 0xFF, 0xD3,
            7, 0xFF, 0xD9,
        ];
        assert!(check_jpeg_end(path, &whole).is_ok());
        let mut trailing = whole.to_vec();
        trailing.extend([0, 0, b'm', b'p', b'4', 0xFF, 0xDA]);
        assert!(check_jpeg_end(path, &trailing).is_ok());
        for cut in [3, 7, 12, 16, 20] {
            let err = check_jpeg_end(path, &whole[..cut]).unwrap_err();
            assert!(err.to_string().contains("x.jpg"), "cut at {cut}: {err}");
        }
    }

    #[test]
    fn bad_options_are_refused_by_name() {
        let three = ImageFolderConfig {
            channels: 4,
            ..ImageFolderConfig::default()
        };
        let err = check_config(&three).unwrap_err().to_string();
        assert!(
            err.contains("channels") && err.contains("expected 1"),
            "{err}"
        );
        let empty = ImageFolderConfig {
            size: [0, 8],
            ..ImageFolderConfig::default()
        };
        assert!(check_config(&empty)
            .unwrap_err()
            .to_string()
            .contains("size"));
    }
}
