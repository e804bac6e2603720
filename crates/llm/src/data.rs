//! Fine-tuning data: a JSONL file, one example a line, either `{"text": …}`
//! (loss on every token) or `{"prompt": …, "completion": …}` (loss on the
//! completion's tokens only: the prompt's labels are -100). Text is encoded
//! with the model's tokenizer: the prompt (or text) with the special tokens
//! its post-processor adds (BOS for Llama's), the completion without them,
//! and the config's EOS appended so the model learns to stop. An example is
//! cut to `max_seq_length` (the count is reported); with `packing` every
//! example is laid end to end and cut into rows of `max_seq_length` (no
//! masking between examples, as TRL's classic packing). Memory: every
//! example's ids and labels, held at once (fine-tuning sets are small next to
//! the model).

use std::path::Path;

use crate::error::{LlmError, Result};
use crate::tokenizer::Tokenizer;

/// One training row: ids and their labels (-100: not counted).
#[derive(Clone, Debug, PartialEq)]
pub struct Example {
    pub ids: Vec<u32>,
    pub labels: Vec<i64>,
}

#[derive(Clone, Copy, Debug)]
pub struct DataOptions {
    pub max_seq_length: usize,
    pub packing: bool,
}

impl Default for DataOptions {
    fn default() -> Self {
        Self {
            max_seq_length: 1024,
            packing: false,
        }
    }
}

/// The rows a file gave, and what it cost to make them.
#[derive(Clone, Debug)]
pub struct Dataset {
    pub examples: Vec<Example>,
    /// Examples cut to `max_seq_length` (0 with packing, which cuts rows).
    pub truncated: usize,
    /// Examples left with no counted label (a prompt that filled the row).
    pub dropped: usize,
}

/// Whether a row has a label the causal loss counts (it predicts positions
/// 1.., so label 0 is never read).
fn counts(labels: &[i64]) -> bool {
    labels.iter().skip(1).any(|&l| l != -100)
}

/// Reads and encodes `path`. `eos` is appended to each example unless its
/// encoding already ends with it.
pub fn load_jsonl(
    path: &Path,
    tokenizer: &Tokenizer,
    eos: Option<u32>,
    options: DataOptions,
) -> Result<Dataset> {
    if options.max_seq_length < 2 {
        return Err(LlmError::Input(format!(
            "max_seq_length {} is too short: a row needs at least 2 tokens",
            options.max_seq_length
        )));
    }
    let text = std::fs::read_to_string(path).map_err(|source| LlmError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let bad = |line: usize, what: String| LlmError::Data {
        path: path.to_path_buf(),
        line,
        what,
    };
    let mut encoded = Vec::new();
    for (index, raw) in text.lines().enumerate() {
        let line = index + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value =
            serde_json::from_str(raw).map_err(|e| bad(line, format!("not a JSON object: {e}")))?;
        let object = value
            .as_object()
            .ok_or_else(|| bad(line, "not a JSON object".into()))?;
        let string = |key: &str| -> Result<Option<&str>> {
            match object.get(key) {
                None => Ok(None),
                Some(v) => v
                    .as_str()
                    .map(Some)
                    .ok_or_else(|| bad(line, format!("key `{key}` is not a string"))),
            }
        };
        let (mut ids, mut labels) =
            match (string("text")?, string("prompt")?, string("completion")?) {
                (Some(text), None, None) => {
                    let ids = tokenizer.encode(text)?;
                    let labels = ids.iter().map(|&i| i64::from(i)).collect();
                    (ids, labels)
                }
                (None, Some(prompt), Some(completion)) => {
                    let mut ids = tokenizer.encode(prompt)?;
                    let mut labels = vec![-100i64; ids.len()];
                    let rest = tokenizer.encode_with(completion, false)?;
                    labels.extend(rest.iter().map(|&i| i64::from(i)));
                    ids.extend(rest);
                    (ids, labels)
                }
                (None, Some(_), None) => {
                    return Err(bad(
                        line,
                        "key `completion` is missing (a `prompt` needs one)".into(),
                    ))
                }
                (None, None, Some(_)) => {
                    return Err(bad(
                        line,
                        "key `prompt` is missing (a `completion` needs one)".into(),
                    ))
                }
                (Some(_), _, _) => {
                    return Err(bad(
                        line,
                        "key `text` with `prompt`/`completion`: give one form or the other".into(),
                    ))
                }
                (None, None, None) => {
                    return Err(bad(
                        line,
                        "no key `text`, and no `prompt` + `completion`".into(),
                    ))
                }
            };
        if let Some(eos) = eos {
            if ids.last() != Some(&eos) {
                ids.push(eos);
                labels.push(i64::from(eos));
            }
        }
        encoded.push(Example { ids, labels });
    }
    if encoded.is_empty() {
        return Err(LlmError::Data {
            path: path.to_path_buf(),
            line: 0,
            what: "no examples".into(),
        });
    }
    let max = options.max_seq_length;
    let mut dataset = Dataset {
        examples: Vec::new(),
        truncated: 0,
        dropped: 0,
    };
    if options.packing {
        let ids: Vec<u32> = encoded.iter().flat_map(|e| e.ids.iter().copied()).collect();
        let labels: Vec<i64> = encoded
            .iter()
            .flat_map(|e| e.labels.iter().copied())
            .collect();
        for (ids, labels) in ids.chunks(max).zip(labels.chunks(max)) {
            if ids.len() >= 2 && counts(labels) {
                dataset.examples.push(Example {
                    ids: ids.to_vec(),
                    labels: labels.to_vec(),
                });
            } else {
                dataset.dropped += 1;
            }
        }
    } else {
        for mut example in encoded {
            if example.ids.len() > max {
                example.ids.truncate(max);
                example.labels.truncate(max);
                dataset.truncated += 1;
            }
            if example.ids.len() >= 2 && counts(&example.labels) {
                dataset.examples.push(example);
            } else {
                dataset.dropped += 1;
            }
        }
    }
    Ok(dataset)
}
