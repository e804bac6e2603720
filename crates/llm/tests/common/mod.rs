//! Shared by the tests: the fixture directories and their reference tensors.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype;
use safetensors::SafeTensors;

/// The text and prompt make_fixtures.py encodes.
pub const TEXT: &str =
    "The lazy fox trains a frozen model within the memory it has, piece by piece.";
pub const PROMPT: &str = "The quick brown";

pub const MODELS: [&str; 3] = ["llama", "qwen2", "gpt2"];

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

/// One tensor of a fixture's reference.safetensors: shape and values (i64
/// tensors as i64, f32 as f32).
pub struct Reference {
    bytes: Vec<u8>,
}

impl Reference {
    pub fn load(model: &str) -> Self {
        Self::from_file(model, "reference.safetensors")
    }

    pub fn from_file(model: &str, file: &str) -> Self {
        let path = fixture(model).join(file);
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        Self { bytes }
    }

    pub fn names(&self) -> Vec<String> {
        let st = SafeTensors::deserialize(&self.bytes).expect("reference parses");
        st.names().into_iter().map(String::from).collect()
    }

    fn view(&self, name: &str) -> (Dtype, Vec<usize>, Vec<u8>) {
        let st = SafeTensors::deserialize(&self.bytes).expect("reference parses");
        let t = st.tensor(name).expect("reference tensor");
        (t.dtype(), t.shape().to_vec(), t.data().to_vec())
    }

    pub fn i64s(&self, name: &str) -> (Vec<usize>, Vec<i64>) {
        let (dtype, shape, data) = self.view(name);
        assert_eq!(dtype, Dtype::I64, "{name}");
        let values = data
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        (shape, values)
    }

    pub fn f32s(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let (dtype, shape, data) = self.view(name);
        assert_eq!(dtype, Dtype::F32, "{name}");
        let values = data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        (shape, values)
    }

    /// A [batch, T] i64 tensor as rows.
    pub fn rows(&self, name: &str) -> Vec<Vec<i64>> {
        let (shape, values) = self.i64s(name);
        values.chunks_exact(shape[1]).map(<[i64]>::to_vec).collect()
    }
}

pub fn as_ids(rows: &[Vec<i64>]) -> Vec<Vec<u32>> {
    rows.iter()
        .map(|r| r.iter().map(|&v| u32::try_from(v).expect("id")).collect())
        .collect()
}

/// Copies a fixture directory into a fresh temporary directory.
pub fn copy_fixture(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().expect("tempdir");
    for entry in std::fs::read_dir(fixture(name)).expect("fixture dir") {
        let entry = entry.expect("entry");
        // The model's files only (llama/peft_adapter/ is a directory).
        if entry.path().is_dir() {
            continue;
        }
        std::fs::copy(entry.path(), tmp.path().join(entry.file_name())).expect("copy");
    }
    tmp
}
