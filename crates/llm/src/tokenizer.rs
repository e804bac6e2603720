//! `tokenizer.json` through Hugging Face's `tokenizers` crate, encoding with
//! the special tokens the file's post-processor adds (as transformers'
//! `tokenizer(text)` does) and decoding without them.

use std::path::{Path, PathBuf};

use crate::error::{LlmError, Result};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl Tokenizer {
    /// Loads `<dir>/tokenizer.json`.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(LlmError::Tokenizer {
                path,
                message: "no such file".into(),
            });
        }
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| LlmError::Tokenizer {
            path: path.clone(),
            message: e.to_string(),
        })?;
        Ok(Self { inner, path })
    }

    /// The `tokenizer.json` it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, true)
    }

    /// `text` with the post-processor's special tokens or without them (a
    /// completion continues its prompt, so it gets no BOS).
    pub fn encode_with(&self, text: &str, special: bool) -> Result<Vec<u32>> {
        self.inner
            .encode(text, special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| LlmError::Tokenizer {
                path: self.path.clone(),
                message: format!("encoding failed: {e}"),
            })
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| LlmError::Tokenizer {
                path: self.path.clone(),
                message: format!("decoding failed: {e}"),
            })
    }
}
