//! Fine-tuning data: a JSONL file, one example a line, either `{"text": …}`
//! (loss on every token) or `{"prompt": …, "completion": …}` (loss on the
//! completion's tokens only: the prompt's labels are -100). Text is encoded
//! with the model's tokenizer: the prompt (or text) with the special tokens
//! its post-processor adds (BOS for Llama's), the completion without them,
//! and the config's EOS appended so the model learns to stop. An example is
//! cut to `max_seq_length` (the count is reported); with `packing` every
//! example is laid end to end and cut into rows of `max_seq_length` (no
//! masking between examples, as TRL's classic packing).
//!
//! [`encode_jsonl`] streams: it reads a line at a time and hands each
//! finished row to a sink, holding one line and (with packing) less than
//! one row besides, so the token store (`token_store`) is written in
//! bounded memory. [`load_jsonl`] is the same rows collected in memory
//! ([`Dataset`]); the training loops read rows through [`Rows`], which both
//! the in-memory set and the token store give.
use std::io::BufRead;
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

/// Training rows by index, wherever they are held: in memory
/// ([`Dataset`]) or in the token store (`token_store::TokenStore`), which
/// gives the same rows in the same order.
pub trait Rows {
    /// Number of rows.
    fn len(&self) -> usize;

    /// Whether there is no row.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Row `index` (< len), as an owned copy.
    fn row(&self, index: usize) -> Result<Example>;
}

impl Rows for Dataset {
    fn len(&self) -> usize {
        self.examples.len()
    }

    fn row(&self, index: usize) -> Result<Example> {
        self.examples.get(index).cloned().ok_or_else(|| {
            LlmError::Input(format!(
                "row {index} is past the {} rows of the data",
                self.examples.len()
            ))
        })
    }
}

/// What [`encode_jsonl`] counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RowCounts {
    /// Rows handed to the sink.
    pub rows: usize,
    /// Examples cut to `max_seq_length` (0 with packing, which cuts rows).
    pub truncated: usize,
    /// Examples (rows, with packing) left with no counted label.
    pub dropped: usize,
}

/// Whether a row has a label the causal loss counts (it predicts positions
/// 1.., so label 0 is never read).
fn counts_a_label(labels: &[i64]) -> bool {
    labels.iter().skip(1).any(|&l| l != -100)
}

/// Reads and encodes `path` into memory. `eos` is appended to each
/// example unless its encoding already ends with it.
pub fn load_jsonl(
    path: &Path,
    tokenizer: &Tokenizer,
    eos: Option<u32>,
    options: DataOptions,
) -> Result<Dataset> {
    let mut examples = Vec::new();
    let counts = encode_jsonl(path, tokenizer, eos, options, |row| {
        examples.push(row);
        Ok(())
    })?;
    Ok(Dataset {
        examples,
        truncated: counts.truncated,
        dropped: counts.dropped,
    })
}

/// Reads and encodes `path` a line at a time, handing each row to `sink`
/// in the file's order (the rows `load_jsonl` collects).
pub fn encode_jsonl(
    path: &Path,
    tokenizer: &Tokenizer,
    eos: Option<u32>,
    options: DataOptions,
    mut sink: impl FnMut(Example) -> Result<()>,
) -> Result<RowCounts> {
    if options.max_seq_length < 2 {
        return Err(LlmError::Input(format!(
            "max_seq_length {} is too short: a row needs at least 2 tokens",
            options.max_seq_length
        )));
    }
    let io = |source| LlmError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let reader = std::io::BufReader::with_capacity(1 << 16, file);
    let max = options.max_seq_length;
    let mut counts = RowCounts::default();
    let mut lines_encoded = 0usize;
    // With packing: the tokens not yet cut into a row (fewer than `max`).
    let mut carry = Example {
        ids: Vec::new(),
        labels: Vec::new(),
    };
    let mut emit = |row: Example, counts: &mut RowCounts| -> Result<()> {
        if row.ids.len() >= 2 && counts_a_label(&row.labels) {
            counts.rows += 1;
            sink(row)
        } else {
            counts.dropped += 1;
            Ok(())
        }
    };
    for (index, raw) in reader.lines().enumerate() {
        let raw = raw.map_err(io)?;
        let Some(mut example) = encode_line(path, index + 1, &raw, tokenizer, eos)? else {
            continue;
        };
        lines_encoded += 1;
        if options.packing {
            carry.ids.append(&mut example.ids);
            carry.labels.append(&mut example.labels);
            while carry.ids.len() >= max {
                let rest_ids = carry.ids.split_off(max);
                let rest_labels = carry.labels.split_off(max);
                let row = std::mem::replace(
                    &mut carry,
                    Example {
                        ids: rest_ids,
                        labels: rest_labels,
                    },
                );
                emit(row, &mut counts)?;
            }
        } else {
            if example.ids.len() > max {
                example.ids.truncate(max);
                example.labels.truncate(max);
                counts.truncated += 1;
            }
            emit(example, &mut counts)?;
        }
    }
    if lines_encoded == 0 {
        return Err(LlmError::Data {
            path: path.to_path_buf(),
            line: 0,
            what: "no examples".into(),
        });
    }
    if options.packing && !carry.ids.is_empty() {
        emit(carry, &mut counts)?;
    }
    Ok(counts)
}

/// One line's example (None: a blank line), EOS appended, not yet cut.
fn encode_line(
    path: &Path,
    line: usize,
    raw: &str,
    tokenizer: &Tokenizer,
    eos: Option<u32>,
) -> Result<Option<Example>> {
    let bad = |what: String| LlmError::Data {
        path: path.to_path_buf(),
        line,
        what,
    };
    if raw.trim().is_empty() {
        return Ok(None);
    }
    let value: serde_json::Value =
        serde_json::from_str(raw).map_err(|e| bad(format!("not a JSON object: {e}")))?;
    let object = value
        .as_object()
        .ok_or_else(|| bad("not a JSON object".into()))?;
    let string = |key: &str| -> Result<Option<&str>> {
        match object.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| bad(format!("key `{key}` is not a string"))),
        }
    };
    let (mut ids, mut labels) = match (string("text")?, string("prompt")?, string("completion")?) {
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
                "key `completion` is missing (a `prompt` needs one)".into()
            ))
        }
        (None, None, Some(_)) => {
            return Err(bad(
                "key `prompt` is missing (a `completion` needs one)".into()
            ))
        }
        (Some(_), _, _) => {
            return Err(bad(
                "key `text` with `prompt`/`completion`: give one form or the other".into(),
            ))
        }
        (None, None, None) => {
            return Err(bad("no key `text`, and no `prompt` + `completion`".into()))
        }
    };
    if let Some(eos) = eos {
        if ids.last() != Some(&eos) {
            ids.push(eos);
            labels.push(i64::from(eos));
        }
    }
    Ok(Some(Example { ids, labels }))
}
