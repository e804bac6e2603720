//! The weights of a model directory: `model.safetensors`, or the shards a
//! `model.safetensors.index.json` names. Each file is memory-mapped and its
//! header checked once (a truncated or corrupt file fails here, naming it);
//! a tensor is converted to f32 (from bf16, f16 or f32) when it is taken
//! ([`WeightStore::take`]: norms, biases, positions, adapters), or taken as
//! a [`Weight`] ([`WeightStore::take_weight`]: the model's matrices), which
//! keeps a bf16 or f16 tensor in its dtype, read through a mapping of its
//! own bytes. The whole-file mapping costs address space, not memory: only
//! the pages read are resident, and they go when the store does; a
//! weight's own mapping lives as long as the weight.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::{Mmap, MmapOptions};
use safetensors::tensor::{Dtype, Metadata, TensorInfo};
use safetensors::SafeTensors;

use crate::error::{LlmError, Result};
use crate::weight::{Weight, WeightDtype};

struct Shard {
    path: PathBuf,
    /// Kept open to map single tensors' bytes ([`WeightStore::take_weight`]).
    file: File,
    map: Mmap,
    /// Where the data starts (after the 8-byte length and the header).
    data_start: usize,
    metadata: Metadata,
}

/// One file of the store as its bytes: the header (length prefix, JSON and
/// padding) as written, and the data its tensors' offsets index.
pub(crate) struct RawShard<'a> {
    pub path: &'a Path,
    pub header: &'a [u8],
    pub data: &'a [u8],
    pub metadata: &'a Metadata,
}

/// A tensor converted to f32, with its shape.
pub struct Loaded {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

pub struct WeightStore {
    shards: Vec<Shard>,
    /// Tensor name → shard.
    index: HashMap<String, usize>,
    /// What a missing tensor's message names: the single file, or the index.
    source: PathBuf,
}

fn open_shard(path: &Path) -> Result<Shard> {
    let file = File::open(path).map_err(|source| LlmError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    // SAFETY: the file is mapped read-only and only read through `map`; a
    // model directory rewritten while it is mapped is outside what we
    // support (the header check below would not see it), as for every
    // memory-mapped safetensors reader.
    let map = unsafe { Mmap::map(&file) }.map_err(|source| LlmError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let (header, metadata) =
        SafeTensors::read_metadata(&map).map_err(|source| LlmError::Safetensors {
            path: path.to_path_buf(),
            source,
        })?;
    Ok(Shard {
        path: path.to_path_buf(),
        file,
        map,
        data_start: 8 + header,
        metadata,
    })
}

impl WeightStore {
    /// Opens the weights of `dir`: `model.safetensors` if it exists, else the
    /// shards of `model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        if single.is_file() {
            let shard = open_shard(&single)?;
            let index = shard
                .metadata
                .tensors()
                .into_keys()
                .map(|name| (name, 0))
                .collect();
            return Ok(Self {
                shards: vec![shard],
                index,
                source: single,
            });
        }
        if !index_path.is_file() {
            return Err(LlmError::NoWeights {
                dir: dir.to_path_buf(),
            });
        }
        let text = std::fs::read_to_string(&index_path).map_err(|source| LlmError::Io {
            path: index_path.clone(),
            source,
        })?;
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|source| LlmError::Json {
                path: index_path.clone(),
                source,
            })?;
        let map = value
            .get("weight_map")
            .and_then(serde_json::Value::as_object)
            .ok_or_else(|| LlmError::ConfigKey {
                path: index_path.clone(),
                key: "weight_map".into(),
                problem: "missing or not an object",
                expected: "an object of tensor name to shard file",
            })?;
        let mut shard_of: HashMap<String, usize> = HashMap::new();
        let mut shards = Vec::new();
        let mut index = HashMap::new();
        // Sorted, so the first missing shard reported is the same every run.
        let mut entries: Vec<_> = map.iter().collect();
        entries.sort_by(|a, b| a.0.cmp(b.0));
        for (tensor, file) in entries {
            let file = file.as_str().ok_or_else(|| LlmError::ConfigKey {
                path: index_path.clone(),
                key: format!("weight_map.{tensor}"),
                problem: "not a string",
                expected: "a shard file name",
            })?;
            let slot = match shard_of.get(file) {
                Some(&slot) => slot,
                None => {
                    let path = dir.join(file);
                    if !path.is_file() {
                        return Err(LlmError::MissingShard {
                            index: index_path,
                            shard: file.to_string(),
                            tensor: tensor.clone(),
                        });
                    }
                    shards.push(open_shard(&path)?);
                    shard_of.insert(file.to_string(), shards.len() - 1);
                    shards.len() - 1
                }
            };
            index.insert(tensor.clone(), slot);
        }
        Ok(Self {
            shards,
            index,
            source: index_path,
        })
    }

    /// One safetensors file on its own (a LoRA adapter's
    /// `adapter_model.safetensors`); messages name the file.
    pub fn open_file(path: &Path) -> Result<Self> {
        let shard = open_shard(path)?;
        let index = shard
            .metadata
            .tensors()
            .into_keys()
            .map(|name| (name, 0))
            .collect();
        Ok(Self {
            shards: vec![shard],
            index,
            source: path.to_path_buf(),
        })
    }

    /// Every tensor's name, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.index.keys().cloned().collect();
        names.sort();
        names
    }

    /// A tensor's shape, if it exists.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let &slot = self.index.get(name)?;
        Some(self.shards[slot].metadata.info(name)?.shape.clone())
    }

    /// Whether a tensor of this name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// The file (or index) a message about the weights names.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// Every file, in the order opened, as its mapped bytes (merging copies
    /// them through, `crate::merge`).
    pub(crate) fn raw_shards(&self) -> impl Iterator<Item = RawShard<'_>> {
        self.shards.iter().map(|s| RawShard {
            path: &s.path,
            header: &s.map[..s.data_start],
            data: &s.map[s.data_start..],
            metadata: &s.metadata,
        })
    }

    /// A tensor's header entry, its bytes as stored and its file.
    pub(crate) fn raw(&self, name: &str) -> Option<(&TensorInfo, &[u8], &Path)> {
        let shard = &self.shards[*self.index.get(name)?];
        let info = shard.metadata.info(name)?;
        let (start, end) = info.data_offsets;
        let bytes = &shard.map[shard.data_start + start..shard.data_start + end];
        Some((info, bytes, &shard.path))
    }

    /// The `__metadata__` of the first file (an adapter file's only one).
    pub(crate) fn file_metadata(&self) -> Option<&std::collections::HashMap<String, String>> {
        self.shards.first()?.metadata.metadata().as_ref()
    }

    /// The header entry of tensor `name` and its shard, which must have
    /// shape `expected`.
    fn checked(&self, name: &str, expected: &[usize]) -> Result<(&Shard, &TensorInfo)> {
        let &slot = self
            .index
            .get(name)
            .ok_or_else(|| LlmError::MissingTensor {
                path: self.source.clone(),
                name: name.to_string(),
            })?;
        let shard = &self.shards[slot];
        let info = shard
            .metadata
            .info(name)
            .ok_or_else(|| LlmError::MissingTensor {
                path: shard.path.clone(),
                name: name.to_string(),
            })?;
        if info.shape != expected {
            return Err(LlmError::TensorShape {
                path: shard.path.clone(),
                name: name.to_string(),
                expected: expected.to_vec(),
                found: info.shape.clone(),
            });
        }
        match info.dtype {
            Dtype::F32 | Dtype::BF16 | Dtype::F16 => Ok((shard, info)),
            other => Err(LlmError::TensorDtype {
                path: shard.path.clone(),
                name: name.to_string(),
                dtype: format!("{other:?}"),
            }),
        }
    }

    /// The tensor `name` as f32, which must have shape `expected`.
    pub fn take(&self, name: &str, expected: &[usize]) -> Result<Loaded> {
        let (shard, info) = self.checked(name, expected)?;
        let (start, end) = info.data_offsets;
        // read_metadata checked that the offsets tile the data exactly to
        // the end of the file.
        let bytes = &shard.map[shard.data_start + start..shard.data_start + end];
        let data = match info.dtype {
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            // F32, the one other dtype `checked` lets through.
            _ => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        };
        Ok(Loaded {
            shape: info.shape.clone(),
            data,
        })
    }

    /// The matrix `name` of shape [rows, cols] as a [`Weight`]: f32 as an
    /// f32 copy, bf16 and f16 in their dtype, read through a read-only
    /// mapping of the tensor's own bytes (no copy; the pages are read as
    /// the products need them).
    pub fn take_weight(&self, name: &str, rows: usize, cols: usize) -> Result<Weight> {
        let (shard, info) = self.checked(name, &[rows, cols])?;
        let dtype = match info.dtype {
            Dtype::BF16 => WeightDtype::Bf16,
            Dtype::F16 => WeightDtype::F16,
            _ => {
                let data = self.take(name, &[rows, cols])?.data;
                return Ok(Weight::from_f32(rows, cols, data));
            }
        };
        let (start, end) = info.data_offsets;
        if start == end {
            return Ok(Weight::from_half_bytes(rows, cols, dtype, Vec::new()));
        }
        // SAFETY: as the whole file's mapping (`open_shard`): read-only,
        // only read through the weight, the file's contents assumed fixed
        // while the model is loaded. memmap2 aligns the offset to a page
        // and the returned slice starts at the byte asked for.
        let map = unsafe {
            MmapOptions::new()
                .offset((shard.data_start + start) as u64)
                .len(end - start)
                .map(&shard.file)
        }
        .map_err(|source| LlmError::Io {
            path: shard.path.clone(),
            source,
        })?;
        Ok(Weight::from_mapped(rows, cols, dtype, map, 0))
    }
}
