//! Preprocessed tensor files as a lazy dataset: a directory of `.npz`,
//! `.safetensors` or `.npy` files, each holding an input array and a target
//! array with the same first dimension (the rows of one preprocessed batch).
//!
//! Design: opening reads every file's headers and its target array (small:
//! one class id or a few values per row), never an input array; the index
//! maps a sample id to (file, row) through each file's first id. A read
//! decodes the file it needs whole and keeps it in an LRU of at most
//! `cache_files` decoded files, so memory stays flat however many files the
//! directory holds. Each file is a shard of [`ShardLayout`], so the loader's
//! shard-aware shuffle (`ShuffleMode::ShardBlocks`) reads each file once an
//! epoch with a cache of two.
//!
//! Two workers that miss the same file at once both decode it and one copy
//! is kept: the cache never holds more than `cache_files`, and a decode in
//! flight is the read it serves.
//!
//! Inputs of u8 stay u8 (images, normalised by the model's mean and std);
//! any other dtype (f16, f32, f64, integers) becomes f32 features. Integer
//! targets are class ids; float targets are numeric targets (regression),
//! as many per row as the target array's second dimension.
//!
//! A `.npy` file is one array: inputs and targets come in pairs,
//! `STEM{input}.npy` and `STEM{target}.npy` (with the default names:
//! `part0_x.npy` and `part0_y.npy`, or `x.npy` and `y.npy`).

use std::collections::{BTreeMap, VecDeque};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::{Dataset, Element, LoaderError, MemoryUsage, SampleKind, ShardLayout};

/// The arrays' names and how many decoded files may be held at once.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorFilesConfig {
    /// The input array's name (the npz member or safetensors tensor, or the
    /// `.npy` file's suffix). Default `"x"`.
    pub input: String,
    /// The target array's name. Default `"y"`.
    pub target: String,
    /// Decoded files held at once (at least 1). Default 2.
    pub cache_files: usize,
}

impl Default for TensorFilesConfig {
    fn default() -> Self {
        Self {
            input: "x".into(),
            target: "y".into(),
            cache_files: 2,
        }
    }
}

/// An array's element type as stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dtype {
    U8,
    I8,
    U16,
    I16,
    I32,
    U32,
    I64,
    U64,
    F16,
    BF16,
    F32,
    F64,
}

impl Dtype {
    fn size(self) -> usize {
        match self {
            Dtype::U8 | Dtype::I8 => 1,
            Dtype::U16 | Dtype::I16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 4,
            Dtype::I64 | Dtype::U64 | Dtype::F64 => 8,
        }
    }

    fn is_float(self) -> bool {
        matches!(self, Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64)
    }

    /// A NumPy type string (`<f4`, `|u1`): little-endian or byte-sized only.
    fn from_numpy(descr: &str) -> Option<Self> {
        Some(match descr {
            "|u1" | "<u1" => Dtype::U8,
            "|i1" | "<i1" => Dtype::I8,
            "<u2" => Dtype::U16,
            "<i2" => Dtype::I16,
            "<i4" => Dtype::I32,
            "<u4" => Dtype::U32,
            "<i8" => Dtype::I64,
            "<u8" => Dtype::U64,
            "<f2" => Dtype::F16,
            "<f4" => Dtype::F32,
            "<f8" => Dtype::F64,
            _ => return None,
        })
    }

    fn from_safetensors(name: &str) -> Option<Self> {
        Some(match name {
            "U8" => Dtype::U8,
            "I8" => Dtype::I8,
            "U16" => Dtype::U16,
            "I16" => Dtype::I16,
            "I32" => Dtype::I32,
            "U32" => Dtype::U32,
            "I64" => Dtype::I64,
            "U64" => Dtype::U64,
            "F16" => Dtype::F16,
            "BF16" => Dtype::BF16,
            "F32" => Dtype::F32,
            "F64" => Dtype::F64,
            _ => return None,
        })
    }

    /// Element `i` of little-endian `bytes` as f64 (exact for every type
    /// but 64-bit integers beyond 2^53).
    fn get(self, bytes: &[u8], i: usize) -> f64 {
        let at = |n: usize| &bytes[i * n..(i + 1) * n];
        let two = |b: &[u8]| [b[0], b[1]];
        let four = |b: &[u8]| [b[0], b[1], b[2], b[3]];
        let eight = |b: &[u8]| [b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]];
        match self {
            Dtype::U8 => f64::from(bytes[i]),
            Dtype::I8 => f64::from(bytes[i] as i8),
            Dtype::U16 => f64::from(u16::from_le_bytes(two(at(2)))),
            Dtype::I16 => f64::from(i16::from_le_bytes(two(at(2)))),
            Dtype::I32 => f64::from(i32::from_le_bytes(four(at(4)))),
            Dtype::U32 => f64::from(u32::from_le_bytes(four(at(4)))),
            Dtype::I64 => i64::from_le_bytes(eight(at(8))) as f64,
            Dtype::U64 => u64::from_le_bytes(eight(at(8))) as f64,
            Dtype::F16 => f64::from(half::f16::from_le_bytes(two(at(2)))),
            Dtype::BF16 => f64::from(half::bf16::from_le_bytes(two(at(2)))),
            Dtype::F32 => f64::from(f32::from_le_bytes(four(at(4)))),
            Dtype::F64 => f64::from_le_bytes(eight(at(8))),
        }
    }
}

/// An array read from a file: its type, shape and little-endian bytes
/// (empty when only the header was read).
struct Array {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

/// Where a file's two arrays are.
#[derive(Clone, Debug)]
enum Source {
    Npz(PathBuf),
    Safetensors(PathBuf),
    NpyPair { input: PathBuf, target: PathBuf },
}

impl Source {
    /// The file named in errors (the input's, for a pair).
    fn path(&self) -> &Path {
        match self {
            Source::Npz(p) | Source::Safetensors(p) => p,
            Source::NpyPair { input, .. } => input,
        }
    }
}

struct Decoded {
    /// Each row's input as the record's first part: u8 as stored, or f32
    /// little-endian.
    inputs: Vec<u8>,
}

/// The LRU of decoded files.
#[derive(Default)]
struct Cache {
    /// (file, its decoded inputs), most recently used last.
    files: VecDeque<(usize, Arc<Decoded>)>,
    current: u64,
    peak: u64,
}

/// A directory (or one file) of preprocessed tensor files: see the
/// module docs.
pub struct TensorFiles {
    root: PathBuf,
    config: TensorFilesConfig,
    sources: Vec<Source>,
    /// Sample id of each file's first row, and the total at the end.
    starts: Vec<usize>,
    shape: [usize; 3],
    input_dtype: Dtype,
    element: Element,
    /// Class ids (classification) or `values` per row (regression), all
    /// files, in id order.
    labels: Vec<u32>,
    values: Vec<f32>,
    values_per_row: usize,
    classes: usize,
    /// Bytes of the largest file's decoded inputs.
    largest_file: u64,
    fingerprint: u32,
    cache: Mutex<Cache>,
}

fn format_err(path: &Path, message: String) -> LoaderError {
    LoaderError::Format {
        path: path.to_path_buf(),
        message,
    }
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> LoaderError + '_ {
    move |reason| LoaderError::Io {
        path: path.to_path_buf(),
        reason,
    }
}

/// Reads one `.npy` array from `reader` (header only if `header_only`).
fn read_npy(
    reader: impl Read,
    path: &Path,
    what: &str,
    header_only: bool,
) -> Result<Array, LoaderError> {
    let npy = npyz::NpyFile::new(reader)
        .map_err(|e| format_err(path, format!("{what}: not a NumPy array ({e})")))?;
    let descr = match npy.dtype() {
        npyz::DType::Plain(t) => t.to_string(),
        other => {
            return Err(format_err(
                path,
                format!("{what}: a structured array ({other:?}); expected plain numbers"),
            ))
        }
    };
    let dtype = Dtype::from_numpy(&descr).ok_or_else(|| {
        format_err(
            path,
            format!(
                "{what}: dtype {descr:?}; expected little-endian u8, i8, u16, i16, i32, u32, \
                 i64, u64, f16, f32 or f64"
            ),
        )
    })?;
    if npy.order() == npyz::Order::Fortran && npy.shape().len() > 1 {
        return Err(format_err(
            path,
            format!("{what}: Fortran order; save it in C order (np.ascontiguousarray)"),
        ));
    }
    let shape: Vec<usize> = npy.shape().iter().map(|&d| d as usize).collect();
    if header_only {
        return Ok(Array {
            dtype,
            shape,
            bytes: Vec::new(),
        });
    }
    let count: usize = shape.iter().product();
    let len = count * dtype.size();
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(len)
        .map_err(|_| format_err(path, format!("{what}: {len} bytes could not be allocated")))?;
    npy.into_inner()
        .take(len as u64)
        .read_to_end(&mut bytes)
        .map_err(io_err(path))?;
    if bytes.len() != len {
        return Err(format_err(
            path,
            format!("{what}: truncated, {} of {len} bytes", bytes.len()),
        ));
    }
    Ok(Array {
        dtype,
        shape,
        bytes,
    })
}

/// Array `name` of an `.npz` archive.
fn read_npz_member(path: &Path, name: &str, header_only: bool) -> Result<Array, LoaderError> {
    let file = std::fs::File::open(path).map_err(io_err(path))?;
    let mut archive = zip::ZipArchive::new(std::io::BufReader::new(file))
        .map_err(|e| format_err(path, format!("not a readable .npz (zip) archive: {e}")))?;
    let member = format!("{name}.npy");
    let names: Vec<String> = archive
        .file_names()
        .filter_map(|n| n.ok().map(|n| n.to_string()))
        .collect();
    let entry = archive.by_name(&member).map_err(|_| {
        format_err(
            path,
            format!(
                "has no array `{name}` (its arrays: {})",
                names
                    .iter()
                    .map(|n| n.trim_end_matches(".npy"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
    })?;
    read_npy(entry, path, &format!("array `{name}`"), header_only)
}

/// Tensor `name` of a `.safetensors` file.
fn read_safetensors(path: &Path, name: &str, header_only: bool) -> Result<Array, LoaderError> {
    let mut file = std::fs::File::open(path).map_err(io_err(path))?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(io_err(path))?;
    let header_len = u64::from_le_bytes(len);
    if header_len > 100 << 20 {
        return Err(format_err(
            path,
            format!("a {header_len}-byte header: not a safetensors file"),
        ));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(io_err(path))?;
    let header: BTreeMap<String, serde_json::Value> = serde_json::from_slice(&header)
        .map_err(|e| format_err(path, format!("not a safetensors header: {e}")))?;
    let entry = header.get(name).ok_or_else(|| {
        let names: Vec<&str> = header
            .keys()
            .map(String::as_str)
            .filter(|k| *k != "__metadata__")
            .collect();
        format_err(
            path,
            format!("has no tensor `{name}` (its tensors: {})", names.join(", ")),
        )
    })?;
    let bad = || format_err(path, format!("tensor `{name}`: a malformed header entry"));
    let dtype_name = entry["dtype"].as_str().ok_or_else(bad)?;
    let dtype = Dtype::from_safetensors(dtype_name).ok_or_else(|| {
        format_err(
            path,
            format!("tensor `{name}`: dtype {dtype_name}; expected a number type"),
        )
    })?;
    let shape: Vec<usize> = entry["shape"]
        .as_array()
        .ok_or_else(bad)?
        .iter()
        .map(|d| d.as_u64().map(|d| d as usize).ok_or_else(bad))
        .collect::<Result<_, _>>()?;
    if header_only {
        return Ok(Array {
            dtype,
            shape,
            bytes: Vec::new(),
        });
    }
    let offsets = entry["data_offsets"].as_array().ok_or_else(bad)?;
    let (start, end) = match (
        offsets.first().and_then(|v| v.as_u64()),
        offsets.get(1).and_then(|v| v.as_u64()),
    ) {
        (Some(s), Some(e)) if s <= e => (s, e),
        _ => return Err(bad()),
    };
    let count: usize = shape.iter().product();
    if (end - start) as usize != count * dtype.size() {
        return Err(format_err(
            path,
            format!(
                "tensor `{name}`: {} bytes for {count} elements of {dtype_name}",
                end - start
            ),
        ));
    }
    use std::io::{Seek, SeekFrom};
    file.seek(SeekFrom::Start(8 + header_len + start))
        .map_err(io_err(path))?;
    let mut bytes = vec![0u8; (end - start) as usize];
    file.read_exact(&mut bytes)
        .map_err(|_| format_err(path, format!("tensor `{name}`: the file is truncated")))?;
    Ok(Array {
        dtype,
        shape,
        bytes,
    })
}

impl Source {
    fn array(
        &self,
        name: &str,
        config: &TensorFilesConfig,
        header_only: bool,
    ) -> Result<Array, LoaderError> {
        match self {
            Source::Npz(path) => read_npz_member(path, name, header_only),
            Source::Safetensors(path) => read_safetensors(path, name, header_only),
            Source::NpyPair { input, target } => {
                let path = if name == config.input { input } else { target };
                let file = std::fs::File::open(path).map_err(io_err(path))?;
                read_npy(
                    std::io::BufReader::new(file),
                    path,
                    "the array",
                    header_only,
                )
            }
        }
    }
}

/// The files of `root` (a directory, or one `.npz`/`.safetensors` file),
/// sorted by name.
fn list_sources(
    root: &Path,
    config: &TensorFilesConfig,
    with_targets: bool,
) -> Result<Vec<Source>, LoaderError> {
    let of_file = |path: &Path| match path.extension().and_then(|e| e.to_str()) {
        Some("npz") => Some(Source::Npz(path.to_path_buf())),
        Some("safetensors") => Some(Source::Safetensors(path.to_path_buf())),
        // Inputs alone (to score) may be one .npy array.
        Some("npy") if !with_targets => Some(Source::NpyPair {
            input: path.to_path_buf(),
            target: path.to_path_buf(),
        }),
        _ => None,
    };
    if root.is_file() {
        return of_file(root).map(|s| vec![s]).ok_or_else(|| {
            format_err(
                root,
                "expected a .npz or .safetensors file, or a directory of them".into(),
            )
        });
    }
    let mut names: Vec<PathBuf> = std::fs::read_dir(root)
        .map_err(io_err(root))?
        .map(|entry| entry.map(|e| e.path()).map_err(io_err(root)))
        .collect::<Result<_, _>>()?;
    names.sort();
    let input_suffix = format!("{}.npy", config.input);
    let target_suffix = format!("{}.npy", config.target);
    let mut sources = Vec::new();
    for path in &names {
        let file_name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if file_name.starts_with('.') {
            continue;
        }
        if path.extension().is_some_and(|e| e != "npy") {
            if let Some(source) = of_file(path) {
                sources.push(source);
            }
        } else if let Some(stem) = file_name.strip_suffix(&input_suffix) {
            let target = path.with_file_name(format!("{stem}{target_suffix}"));
            if with_targets && !target.is_file() {
                return Err(format_err(
                    path,
                    format!(
                        "has no partner {}: a .npy input needs its targets beside it",
                        target.display()
                    ),
                ));
            }
            sources.push(Source::NpyPair {
                input: path.clone(),
                target,
            });
        }
    }
    if sources.is_empty() {
        return Err(format_err(
            root,
            format!("holds no .npz, .safetensors or `*{input_suffix}` + `*{target_suffix}` files"),
        ));
    }
    Ok(sources)
}

impl TensorFiles {
    /// Opens `root`: every file's headers and targets, no inputs.
    pub fn open(root: &Path, config: TensorFilesConfig) -> Result<Self, LoaderError> {
        Self::open_with(root, config, true)
    }

    /// Opens `root`'s input arrays alone (inputs to score: the target
    /// arrays may be absent and are not read); every label is 0. `root`
    /// may also be one `.npy` file.
    pub fn open_inputs(root: &Path, config: TensorFilesConfig) -> Result<Self, LoaderError> {
        Self::open_with(root, config, false)
    }

    fn open_with(
        root: &Path,
        config: TensorFilesConfig,
        with_targets: bool,
    ) -> Result<Self, LoaderError> {
        let sources = list_sources(root, &config, with_targets)?;
        let mut starts = vec![0usize];
        let (mut labels, mut values) = (Vec::new(), Vec::new());
        let mut first: Option<(Dtype, Vec<usize>, Dtype, usize)> = None;
        let mut largest_file = 0u64;
        let mut hasher = crc32fast::Hasher::new();
        for source in &sources {
            let path = source.path();
            let input = source.array(&config.input, &config, true)?;
            let rows = *input.shape.first().ok_or_else(|| {
                format_err(
                    path,
                    format!("input `{}` is a scalar; expected [rows, ...]", config.input),
                )
            })?;
            let target = if with_targets {
                source.array(&config.target, &config, false)?
            } else {
                // No targets: as if each row had one class id, 0.
                Array {
                    dtype: Dtype::U8,
                    shape: vec![rows],
                    bytes: vec![0; rows],
                }
            };
            if target.shape.first() != Some(&rows) || target.shape.len() > 2 {
                return Err(format_err(
                    path,
                    format!(
                        "target `{}` has shape {:?}; expected [{rows}] or [{rows}, k] (one row per \
                         input row)",
                        config.target, target.shape
                    ),
                ));
            }
            let per_row = target.shape.get(1).copied().unwrap_or(1);
            let this = (
                input.dtype,
                input.shape[1..].to_vec(),
                target.dtype,
                per_row,
            );
            match &first {
                None => first = Some(this.clone()),
                Some(f) if *f != this => {
                    return Err(format_err(
                        path,
                        format!(
                        "holds {:?} inputs of per-row shape {:?} and {:?} targets ({} per row); \
                             the first file holds {:?} of {:?} and {:?} ({} per row)",
                        this.0, this.1, this.2, this.3, f.0, f.1, f.2, f.3
                    ),
                    ))
                }
                Some(_) => {}
            }
            let count = rows * per_row;
            if target.dtype.is_float() {
                for i in 0..count {
                    let v = target.dtype.get(&target.bytes, i) as f32;
                    if !v.is_finite() {
                        return Err(format_err(
                            path,
                            format!("target row {}: {v} is not finite", i / per_row),
                        ));
                    }
                    values.push(v);
                }
            } else {
                if per_row != 1 {
                    return Err(format_err(
                        path,
                        format!(
                            "integer targets of shape {:?}: class ids are one per row ([rows]); \
                             numeric targets are floats",
                            target.shape
                        ),
                    ));
                }
                for i in 0..rows {
                    let id = target.dtype.get(&target.bytes, i);
                    if !(0.0..f64::from(u32::MAX)).contains(&id) {
                        return Err(format_err(
                            path,
                            format!("target row {i}: class id {id} is negative or too large"),
                        ));
                    }
                    labels.push(id as u32);
                }
            }
            hasher.update(path.to_string_lossy().as_bytes());
            hasher.update(
                &std::fs::metadata(path)
                    .map_err(io_err(path))?
                    .len()
                    .to_le_bytes(),
            );
            hasher.update(&target.bytes);
            let elements: usize = input.shape[1..].iter().product();
            let element_size = if input.dtype == Dtype::U8 { 1 } else { 4 };
            largest_file = largest_file.max((rows * elements * element_size) as u64);
            starts.push(starts[starts.len() - 1] + rows);
        }
        let (input_dtype, dims, target_dtype, per_row) =
            first.ok_or_else(|| format_err(root, "holds no files".into()))?;
        let shape = match dims[..] {
            [f] => [1, f, 1],
            [h, w] => [h, w, 1],
            [h, w, c] => [h, w, c],
            _ => {
                return Err(format_err(
                    root,
                    format!(
                        "inputs of per-row shape {dims:?}; expected [features], [h, w] or [h, w, c]"
                    ),
                ))
            }
        };
        let classes = labels.iter().max().map_or(0, |&m| m as usize + 1);
        Ok(Self {
            root: root.to_path_buf(),
            config,
            sources,
            starts,
            shape,
            input_dtype,
            element: if input_dtype == Dtype::U8 {
                Element::U8
            } else {
                Element::F32
            },
            labels,
            values,
            values_per_row: if target_dtype.is_float() { per_row } else { 0 },
            classes,
            largest_file,
            fingerprint: hasher.finalize(),
            cache: Mutex::new(Cache::default()),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Each sample as `FILE row N`, in order.
    pub fn row_names(&self) -> Vec<String> {
        self.sources
            .iter()
            .zip(self.starts.windows(2))
            .flat_map(|(source, span)| {
                let name = source.path().display().to_string();
                (0..span[1] - span[0]).map(move |row| format!("{name} row {row}"))
            })
            .collect()
    }

    /// Number of files.
    pub fn file_count(&self) -> usize {
        self.sources.len()
    }

    /// File `k`'s inputs, from the cache or decoded now.
    fn decoded(&self, k: usize) -> Result<Arc<Decoded>, LoaderError> {
        let poisoned = || format_err(&self.root, "the file cache's lock was poisoned".into());
        {
            let mut cache = self.cache.lock().map_err(|_| poisoned())?;
            if let Some(at) = cache.files.iter().position(|(f, _)| *f == k) {
                let hit = cache.files.remove(at).ok_or_else(poisoned)?;
                let decoded = Arc::clone(&hit.1);
                cache.files.push_back(hit);
                return Ok(decoded);
            }
        }
        let source = &self.sources[k];
        let array = source.array(&self.config.input, &self.config, false)?;
        let inputs = match self.input_dtype {
            Dtype::U8 => array.bytes,
            dtype => {
                let count = array.bytes.len() / dtype.size();
                let mut out = Vec::new();
                out.try_reserve_exact(count * 4).map_err(|_| {
                    format_err(
                        source.path(),
                        format!("{} bytes could not be allocated", count * 4),
                    )
                })?;
                for i in 0..count {
                    out.extend_from_slice(&(dtype.get(&array.bytes, i) as f32).to_le_bytes());
                }
                out
            }
        };
        let decoded = Arc::new(Decoded { inputs });
        let mut cache = self.cache.lock().map_err(|_| poisoned())?;
        if !cache.files.iter().any(|(f, _)| *f == k) {
            while cache.files.len() >= self.config.cache_files.max(1) {
                if let Some((_, old)) = cache.files.pop_front() {
                    cache.current -= old.inputs.len() as u64;
                }
            }
            cache.current += decoded.inputs.len() as u64;
            cache.peak = cache.peak.max(cache.current);
            cache.files.push_back((k, Arc::clone(&decoded)));
        }
        Ok(decoded)
    }
}

impl Dataset for TensorFiles {
    fn len(&self) -> usize {
        self.starts.last().copied().unwrap_or(0)
    }

    fn sample_shape(&self) -> [usize; 3] {
        self.shape
    }

    fn num_classes(&self) -> usize {
        self.classes.max(1)
    }

    fn sample_kind(&self) -> SampleKind {
        SampleKind {
            element: self.element,
            values: self.values_per_row,
            value_scale: Vec::new(),
        }
    }

    fn read(&self, index: usize, out: &mut [u8]) -> Result<u32, LoaderError> {
        let len = self.len();
        if index >= len {
            return Err(LoaderError::Index { index, len });
        }
        let file = self.starts.partition_point(|&s| s <= index) - 1;
        let row = index - self.starts[file];
        let [h, w, c] = self.shape;
        let input_len = h * w * c * self.element.size();
        let expected = input_len + 4 * self.values_per_row;
        if out.len() != expected {
            return Err(LoaderError::Buffer {
                index,
                actual: out.len(),
                expected,
            });
        }
        let decoded = self.decoded(file)?;
        let source = decoded
            .inputs
            .get(row * input_len..(row + 1) * input_len)
            .ok_or_else(|| {
                format_err(
                    self.sources[file].path(),
                    format!("input row {row} is past the decoded array"),
                )
            })?;
        out[..input_len].copy_from_slice(source);
        let k = self.values_per_row;
        for (slot, v) in out[input_len..]
            .chunks_exact_mut(4)
            .zip(&self.values[index * k..(index + 1) * k])
        {
            slot.copy_from_slice(&v.to_le_bytes());
        }
        Ok(self.labels.get(index).copied().unwrap_or(0))
    }

    fn fingerprint(&self) -> Option<u32> {
        Some(self.fingerprint)
    }

    fn shard_layout(&self) -> Option<ShardLayout> {
        Some(ShardLayout {
            shard_lens: self.starts.windows(2).map(|w| w[1] - w[0]).collect(),
            window: self.config.cache_files.max(1),
        })
    }

    fn memory_limit(&self) -> u64 {
        self.largest_file * self.config.cache_files.max(1) as u64
            + 4 * (self.labels.len() + self.values.len()) as u64
    }

    fn memory_usage(&self) -> MemoryUsage {
        let fixed = 4 * (self.labels.len() + self.values.len()) as u64;
        match self.cache.lock() {
            Ok(cache) => MemoryUsage {
                current: fixed + cache.current,
                peak: fixed + cache.peak,
            },
            Err(_) => MemoryUsage {
                current: self.memory_limit(),
                peak: self.memory_limit(),
            },
        }
    }
}

/// A `.npy` file's bytes (format version 1.0, C order) holding `data`, the
/// little-endian elements of an array of NumPy type `descr` (`|u1`, `<f4`,
/// `<i8` …) and `shape`: for tests and examples that need tensor files
/// without NumPy.
pub fn npy_bytes(descr: &str, shape: &[usize], data: &[u8]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_text = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header =
        format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape_text}, }}");
    // The header ends in a newline at a multiple of 64 bytes from the start.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}
