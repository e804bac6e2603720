//! `cargo xtask export`: a checkpoint's weights as a safetensors file that
//! PyTorch (or anything else) loads. Tensors keep the names the model spec
//! gives them (`layers.0.conv.weight`, ...) and headroom's layouts, which the
//! file's metadata states: convolution weights HWIO `[kh, kw, in, out]`,
//! linear weights `[in, out]`, activations NHWC. Batch-norm running
//! statistics are written beside their layer's parameters.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

use headroom_model::Network;
use safetensors::Dtype;

use crate::checkpoint::{self, Checkpoint};
use crate::{PipelineError, Result};

/// What the metadata says about layouts, for whoever loads the file.
const LAYOUT: &str =
    "activations NHWC; conv weight HWIO [kh, kw, in, out] (PyTorch: permute(3, 2, 0, 1)); \
                      linear weight [in, out] (PyTorch: transpose); f32 little-endian";

/// What `safetensors` wrote.
pub struct Exported {
    /// The checkpoint read (a run directory's newest valid one when a
    /// directory was named).
    pub checkpoint: PathBuf,
    pub output: PathBuf,
    pub tensors: usize,
}

/// Writes the weights of `checkpoint` (a checkpoint file or a run directory)
/// to `output` in safetensors format; by default beside the checkpoint read,
/// with the extension `.safetensors`.
pub fn safetensors(checkpoint: &Path, output: Option<&Path>) -> Result<Exported> {
    let (checkpoint, saved) = crate::eval::run_checkpoint(checkpoint)?;
    let output = output.map_or_else(
        || checkpoint.with_extension("safetensors"),
        Path::to_path_buf,
    );
    check_output(&output, &[&checkpoint])?;
    let tensors = named_values(&saved, &checkpoint)?;
    let metadata = BTreeMap::from([
        ("format".to_string(), "pt".to_string()),
        ("producer".to_string(), "headroom".to_string()),
        ("layout".to_string(), LAYOUT.to_string()),
        ("model_spec".to_string(), saved.meta.model_json.clone()),
        ("step".to_string(), saved.meta.step.to_string()),
    ]);
    let views = tensors
        .iter()
        .map(|t| (t.name.as_str(), t.shape.as_slice(), t.values));
    write_safetensors(views, &metadata, &output)?;
    Ok(Exported {
        checkpoint,
        output,
        tensors: tensors.len(),
    })
}

/// Refuses, before any work, an output that cannot be a file (a directory,
/// or a path whose directory does not exist), that is one of the command's
/// `inputs` (the same path, or the same file through a symlink or a hard
/// link: the written file replaces it, so the input would be lost), or
/// that is a checkpoint of a run (export writes a new file, never over the
/// state a run resumes from).
pub fn check_output(output: &Path, inputs: &[&Path]) -> Result<()> {
    let refuse = |reason: String| PipelineError::Output {
        path: output.to_path_buf(),
        reason,
    };
    if output.is_dir() {
        return Err(refuse(
            "is a directory: name the file to write, e.g. DIR/model.safetensors".into(),
        ));
    }
    if let Some(input) = inputs.iter().find(|input| same_file(output, input)) {
        return Err(refuse(format!(
            "is the input {} (the same file): writing it would destroy what is read; \
             name another output file",
            input.display()
        )));
    }
    if is_checkpoint(output) {
        return Err(refuse(
            "is a checkpoint of a run: writing it would destroy it; name another output file"
                .into(),
        ));
    }
    match output.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(dir) if !dir.is_dir() => Err(refuse(format!(
            "its directory {} does not exist",
            dir.display()
        ))),
        _ => Ok(()),
    }
}

/// Whether `a` and `b` name one file: one path, or through a symlink or a
/// hard link (one device and inode). A path that does not exist is no
/// input's file; its canonical form is compared as well, for an input
/// that has gone since it was read.
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    if let (Ok(x), Ok(y)) = (std::fs::metadata(a), std::fs::metadata(b)) {
        return (x.dev(), x.ino()) == (y.dev(), y.ino());
    }
    matches!(
        (std::fs::canonicalize(a), std::fs::canonicalize(b)),
        (Ok(x), Ok(y)) if x == y
    )
}

/// Whether `path` is one of the checkpoints in its directory.
fn is_checkpoint(path: &Path) -> bool {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let Some(name) = path.file_name() else {
        return false;
    };
    checkpoint::list(dir).is_ok_and(|list| list.iter().any(|p| p.file_name() == Some(name)))
}

/// One tensor of a checkpoint under the name its model gives it.
pub struct NamedValues<'a> {
    pub name: String,
    pub shape: Vec<usize>,
    pub values: &'a [f32],
    /// A parameter (false: a batch-norm buffer).
    pub param: bool,
}

/// The checkpoint's parameters and buffers under the model's own names and
/// shapes (the model is rebuilt from the spec the checkpoint records), so
/// that export and fine-tuning (`finetune`) name tensors the same way.
pub fn named_values<'a>(saved: &'a Checkpoint, path: &Path) -> Result<Vec<NamedValues<'a>>> {
    let bad = |reason: String| PipelineError::Checkpoint {
        path: path.to_path_buf(),
        reason,
    };
    let spec = saved.model().map_err(bad)?;
    let mut network = Network::build(&spec, 0)?;
    let params: Vec<(String, Vec<usize>)> = network
        .params_mut()
        .iter()
        .map(|p| (p.name.clone(), p.value.shape().to_vec()))
        .collect();
    if params.len() != saved.params.len() {
        return Err(bad(format!(
            "{} parameter tensors, the model spec has {}",
            saved.params.len(),
            params.len()
        )));
    }
    let buffer_shapes: Vec<Vec<usize>> = network
        .buffers_mut()
        .iter()
        .map(|b| b.shape().to_vec())
        .collect();
    let buffer_names = buffer_names(&params, buffer_shapes.len());
    let mut out = Vec::new();
    let pairs = params
        .into_iter()
        .zip(&saved.params)
        .map(|(named, values)| (named, values, true))
        .chain(
            buffer_names
                .into_iter()
                .zip(buffer_shapes)
                .zip(&saved.buffers)
                .map(|(named, values)| (named, values, false)),
        );
    for ((name, shape), values, param) in pairs {
        if shape.iter().product::<usize>() != values.len() {
            return Err(bad(format!(
                "{name} holds {} values, its shape {shape:?} needs {}",
                values.len(),
                shape.iter().product::<usize>()
            )));
        }
        out.push(NamedValues {
            name,
            shape,
            values,
            param,
        });
    }
    Ok(out)
}

/// Buffers are the batch-norm layers' running mean and variance, in layer
/// order: named after each layer's `gamma` parameter.
fn buffer_names(params: &[(String, Vec<usize>)], count: usize) -> Vec<String> {
    let norms: Vec<&str> = params
        .iter()
        .filter_map(|(name, _)| name.strip_suffix(".gamma"))
        .collect();
    if norms.len() * 2 != count {
        return (0..count).map(|i| format!("buffers.{i}")).collect();
    }
    norms
        .iter()
        .flat_map(|layer| {
            [
                format!("{layer}.running_mean"),
                format!("{layer}.running_var"),
            ]
        })
        .collect()
}

/// An f32 tensor to write or just read: name, shape, values.
pub type F32Tensor = (String, Vec<usize>, Vec<f32>);

/// Writes f32 `tensors` and `metadata` to `output` in safetensors format.
pub fn write_f32_safetensors(
    tensors: &[F32Tensor],
    metadata: &BTreeMap<String, String>,
    output: &Path,
) -> Result<()> {
    let views = tensors
        .iter()
        .map(|(name, shape, values)| (name.as_str(), shape.as_slice(), values.as_slice()));
    write_safetensors(views, metadata, output)
}

/// The safetensors format, written here rather than by the `safetensors`
/// crate (which still reads it back, in the tests and in
/// `read_f32_safetensors`): an 8-byte little-endian header length, a JSON
/// header padded with spaces to a multiple of 8 bytes (the metadata, then
/// each tensor's dtype, shape and byte range), then the values. Because
/// - the crate takes the metadata as a `HashMap`, whose order changes from
///   one process to the next, so the same weights made different bytes;
///   here the metadata and the tensors go in name order;
/// - the crate's temporary file is private (0600) and its rename keeps
///   that, so a file exported for other tools or users could not be read
///   by them;
/// - the values stream to the file; the crate wants them all as bytes
///   first, a second copy of the model in memory;
/// - the file is made as a checkpoint is (`write_atomically`): fsynced and
///   renamed into place, never half-written.
fn write_safetensors<'a>(
    tensors: impl Iterator<Item = (&'a str, &'a [usize], &'a [f32])>,
    metadata: &BTreeMap<String, String>,
    output: &Path,
) -> Result<()> {
    let mut tensors: Vec<_> = tensors.collect();
    tensors.sort_by_key(|t| t.0);
    let refuse = |reason: String| PipelineError::Output {
        path: output.to_path_buf(),
        reason,
    };
    if let Some(pair) = tensors.windows(2).find(|pair| pair[0].0 == pair[1].0) {
        return Err(refuse(format!("two tensors are named {}", pair[0].0)));
    }
    let mut header = serde_json::Map::new();
    header.insert(METADATA_KEY.into(), serde_json::json!(metadata));
    let mut offset = 0;
    for (name, shape, values) in &tensors {
        let end = offset + 4 * values.len();
        let entry =
            serde_json::json!({ "dtype": "F32", "shape": shape, "data_offsets": [offset, end] });
        header.insert((*name).to_string(), entry);
        offset = end;
    }
    let mut header = serde_json::to_vec(&header).map_err(|e| refuse(format!("header: {e}")))?;
    header.resize(header.len().next_multiple_of(8), b' ');
    checkpoint::write_atomically(output, |mut out, tmp| {
        let mut fill = || -> std::io::Result<()> {
            out.write_all(&(header.len() as u64).to_le_bytes())?;
            out.write_all(&header)?;
            tensors
                .iter()
                .try_for_each(|(_, _, values)| checkpoint::write_values(&mut out, values))
        };
        fill().map_err(|e| PipelineError::io(tmp, e))?;
        Ok(out)
    })
}

/// The header entry that holds the file's metadata, not a tensor.
const METADATA_KEY: &str = "__metadata__";

/// Reads every tensor (f32 only) and the metadata of a safetensors file.
pub fn read_f32_safetensors(path: &Path) -> Result<(Vec<F32Tensor>, HashMap<String, String>)> {
    let bad = |reason: String| PipelineError::Checkpoint {
        path: path.to_path_buf(),
        reason,
    };
    let bytes = std::fs::read(path).map_err(|e| PipelineError::io(path, e))?;
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)
        .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
    let metadata = header.metadata().clone().unwrap_or_default();
    let file = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
    let mut tensors = Vec::new();
    for (name, view) in file.tensors() {
        if view.dtype() != Dtype::F32 {
            return Err(bad(format!("{name} is {:?}, expected F32", view.dtype())));
        }
        let values = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        tensors.push((name, view.shape().to_vec(), values));
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    Ok((tensors, metadata))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata() -> BTreeMap<String, String> {
        BTreeMap::from([
            ("producer".to_string(), "headroom".to_string()),
            ("format".to_string(), "pt".to_string()),
        ])
    }

    #[test]
    fn the_safetensors_crate_reads_what_is_written_and_the_bytes_do_not_depend_on_order() {
        let dir = tempfile::tempdir().unwrap();
        let tensors: Vec<F32Tensor> = vec![
            (
                "b.weight".into(),
                vec![2, 3],
                vec![1.0, -2.5, 3.0, 0.0, f32::MIN_POSITIVE, 7.0],
            ),
            ("a.bias".into(), vec![1], vec![0.25]),
            ("c.empty".into(), vec![0, 4], vec![]),
        ];
        let forward = dir.path().join("forward.safetensors");
        write_f32_safetensors(&tensors, &metadata(), &forward).unwrap();
        let reversed: Vec<F32Tensor> = tensors.iter().rev().cloned().collect();
        let backward = dir.path().join("backward.safetensors");
        write_f32_safetensors(&reversed, &metadata(), &backward).unwrap();
        let bytes = std::fs::read(&forward).unwrap();
        assert_eq!(bytes, std::fs::read(&backward).unwrap());

        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!(header_len % 8, 0, "the values start 8-byte aligned");
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, shape, values) in &tensors {
            let view = file.tensor(name).unwrap();
            assert_eq!(view.dtype(), Dtype::F32);
            assert_eq!(view.shape(), shape.as_slice());
            let read: Vec<f32> = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            assert_eq!(&read, values, "{name}");
        }
        let (read, read_metadata) = read_f32_safetensors(&forward).unwrap();
        assert_eq!(read.len(), 3);
        assert_eq!(
            read_metadata,
            metadata().into_iter().collect::<HashMap<_, _>>()
        );
    }

    #[test]
    fn two_tensors_of_one_name_are_refused_and_nothing_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let output = dir.path().join("twice.safetensors");
        let tensors: Vec<F32Tensor> = vec![
            ("w".into(), vec![1], vec![1.0]),
            ("w".into(), vec![1], vec![2.0]),
        ];
        let e = write_f32_safetensors(&tensors, &metadata(), &output).unwrap_err();
        assert!(e.to_string().contains("two tensors are named w"), "{e}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
