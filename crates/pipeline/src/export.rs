//! `cargo xtask export`: a checkpoint's weights as a safetensors file that
//! PyTorch (or anything else) loads. Tensors keep the names the model spec
//! gives them (`layers.0.conv.weight`, ...) and headroom's layouts, which the
//! file's metadata states: convolution weights HWIO `[kh, kw, in, out]`,
//! linear weights `[in, out]`, activations NHWC. Batch-norm running
//! statistics are written beside their layer's parameters.

use std::collections::HashMap;
use std::path::Path;

use headroom_model::Network;
use safetensors::{serialize_to_file, Dtype, View};

use crate::checkpoint::{self, Checkpoint};
use crate::{PipelineError, Result};

/// What the metadata says about layouts, for whoever loads the file.
const LAYOUT: &str =
    "activations NHWC; conv weight HWIO [kh, kw, in, out] (PyTorch: permute(3, 2, 0, 1)); \
                      linear weight [in, out] (PyTorch: transpose); f32 little-endian";

/// One tensor to write: shape and little-endian f32 bytes.
struct Named {
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for &Named {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// Writes the weights of `checkpoint_path` to `output` in safetensors format;
/// returns the number of tensors written.
pub fn safetensors(checkpoint_path: &Path, output: &Path) -> Result<usize> {
    let saved = checkpoint::load(checkpoint_path)?;
    let tensors = named_tensors(&saved, checkpoint_path)?;
    let spec = saved.meta.model_json.clone();
    let metadata = HashMap::from([
        ("format".to_string(), "pt".to_string()),
        ("producer".to_string(), "headroom".to_string()),
        ("layout".to_string(), LAYOUT.to_string()),
        ("model_spec".to_string(), spec),
        ("step".to_string(), saved.meta.step.to_string()),
    ]);
    let views: Vec<(String, &Named)> = tensors.iter().map(|(n, t)| (n.clone(), t)).collect();
    serialize_to_file(views, Some(metadata), output).map_err(|e| PipelineError::Checkpoint {
        path: output.to_path_buf(),
        reason: format!("cannot write safetensors: {e}"),
    })?;
    Ok(tensors.len())
}

/// The checkpoint's parameters and buffers under the model's own names and
/// shapes, as little-endian bytes for the file.
fn named_tensors(saved: &Checkpoint, path: &Path) -> Result<Vec<(String, Named)>> {
    Ok(named_values(saved, path)?
        .into_iter()
        .map(|t| {
            let bytes = t.values.iter().flat_map(|v| v.to_le_bytes()).collect();
            (
                t.name,
                Named {
                    shape: t.shape,
                    bytes,
                },
            )
        })
        .collect())
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
    metadata: HashMap<String, String>,
    output: &Path,
) -> Result<()> {
    let named: Vec<(String, Named)> = tensors
        .iter()
        .map(|(name, shape, values)| {
            let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            let shape = shape.clone();
            (name.clone(), Named { shape, bytes })
        })
        .collect();
    let views: Vec<(String, &Named)> = named.iter().map(|(n, t)| (n.clone(), t)).collect();
    serialize_to_file(views, Some(metadata), output).map_err(|e| PipelineError::Checkpoint {
        path: output.to_path_buf(),
        reason: format!("cannot write safetensors: {e}"),
    })
}

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
