//! `lora-llm --config FILE [--set KEY=VALUE]…`: a fine-tuning recipe as an
//! experiment file (the seed recipe is `experiments/llm/lora_llm.toml`). Every
//! setting the command takes as a flag has a key; the file is read first,
//! `--set` goes on top of it (as `cargo xtask train --set` does), and the
//! flags given on the command line go on top of both. The result fills the
//! command's arguments, so a run from the file is the same run as one from
//! the same flags (xtask/tests/lora_llm_config.rs). Relative paths in the
//! file are taken from the file's directory, those in `--set` from the
//! current one.
//!
//! Each key is checked: an unknown key (with the known ones listed), a
//! value of the wrong type or out of range are errors naming the file or
//! the `--set` and the key. Nothing else is kept: the resolved settings go
//! to run.json as a run from flags records them.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::LoraLlmArgs;

/// What a key holds.
#[derive(Clone, Copy)]
enum Kind {
    Path,
    Text,
    Count,
    Number,
    Flag,
    Bytes,
    Names,
}

impl Kind {
    fn expected(self) -> &'static str {
        match self {
            Kind::Path => "a path (a string)",
            Kind::Text => "a string",
            Kind::Count => "a whole number of 0 or more",
            Kind::Number => "a number",
            Kind::Flag => "true or false",
            Kind::Bytes => "a byte size: a whole number or a string such as \"4GiB\"",
            Kind::Names => "a list of strings such as [\"q_proj\", \"v_proj\"]",
        }
    }
}

/// Every key, `section.name`, and what it holds.
const KEYS: &[(&str, Kind)] = &[
    ("model", Kind::Path),
    ("data", Kind::Path),
    ("output", Kind::Path),
    ("token_cache", Kind::Path),
    ("memory_limit", Kind::Bytes),
    ("lora.r", Kind::Count),
    ("lora.alpha", Kind::Number),
    ("lora.dropout", Kind::Number),
    ("lora.target_modules", Kind::Names),
    ("sequence.max_seq_length", Kind::Count),
    ("sequence.packing", Kind::Flag),
    ("train.epochs", Kind::Count),
    ("train.lr", Kind::Number),
    ("train.batch_size", Kind::Count),
    ("train.accumulate", Kind::Count),
    ("train.warmup_steps", Kind::Count),
    ("train.weight_decay", Kind::Number),
    ("train.max_steps", Kind::Count),
    ("train.seed", Kind::Count),
    ("checkpoints.save_steps", Kind::Count),
    ("checkpoints.keep", Kind::Count),
];

/// A checked value.
enum Value {
    Path(PathBuf),
    Text(String),
    Count(u64),
    Number(f64),
    Flag(bool),
    Names(Vec<String>),
}

fn known() -> String {
    KEYS.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(", ")
}

/// `value` checked as `key`'s kind; `base` resolves relative paths.
fn check(key: &str, kind: Kind, value: &toml::Value, base: &Path, from: &str) -> Result<Value> {
    let wrong = || {
        anyhow::anyhow!(
            "{from}: key `{key}` is {}, expected {}",
            describe(value),
            kind.expected()
        )
    };
    Ok(match (kind, value) {
        (Kind::Path, toml::Value::String(s)) => {
            let p = PathBuf::from(s);
            Value::Path(if p.is_relative() { base.join(p) } else { p })
        }
        (Kind::Text, toml::Value::String(s)) => Value::Text(s.clone()),
        (Kind::Count, toml::Value::Integer(i)) => {
            Value::Count(u64::try_from(*i).map_err(|_| wrong())?)
        }
        (Kind::Number, toml::Value::Float(f)) => Value::Number(*f),
        (Kind::Number, toml::Value::Integer(i)) => Value::Number(*i as f64),
        (Kind::Flag, toml::Value::Boolean(b)) => Value::Flag(*b),
        (Kind::Bytes, toml::Value::String(s)) => Value::Text(s.clone()),
        (Kind::Bytes, toml::Value::Integer(i)) if *i > 0 => Value::Text(i.to_string()),
        (Kind::Names, toml::Value::Array(items)) => Value::Names(
            items
                .iter()
                .map(|v| v.as_str().map(String::from).ok_or_else(wrong))
                .collect::<Result<_>>()?,
        ),
        _ => return Err(wrong()),
    })
}

fn describe(value: &toml::Value) -> String {
    match value {
        toml::Value::String(s) => format!("the string {s:?}"),
        toml::Value::Integer(i) => format!("the integer {i}"),
        toml::Value::Float(f) => format!("the number {f}"),
        toml::Value::Boolean(b) => format!("{b}"),
        toml::Value::Datetime(d) => format!("the date {d}"),
        toml::Value::Array(_) => "a list".into(),
        toml::Value::Table(_) => "a table".into(),
    }
}

/// The file's keys flattened to `section.name`, every one known.
fn flatten(table: &toml::Table, from: &str) -> Result<Vec<(String, toml::Value)>> {
    let mut out = Vec::new();
    for (name, value) in table {
        match value {
            toml::Value::Table(inner)
                if KEYS.iter().any(|(k, _)| k.starts_with(&format!("{name}."))) =>
            {
                for (sub, v) in inner {
                    out.push((format!("{name}.{sub}"), v.clone()));
                }
            }
            _ => out.push((name.clone(), value.clone())),
        }
    }
    for (key, _) in &out {
        if !KEYS.iter().any(|(k, _)| k == key) {
            bail!("{from}: unknown key `{key}`; the keys are {}", known());
        }
    }
    Ok(out)
}

/// A `--set` value as TOML (`lora.r=4`, `train.lr=1e-3`, `lora.target_modules=["q_proj"]`),
/// else as a bare string (`data=train.jsonl`).
fn set_value(key: &str, text: &str) -> Result<toml::Value> {
    let text = text.trim();
    match toml::from_str::<toml::Table>(&format!("value = {text}")) {
        Ok(mut t) => t
            .remove("value")
            .with_context(|| format!("--set {key}={text}: no value")),
        Err(_) if !text.starts_with('[') && !text.starts_with('{') => {
            Ok(toml::Value::String(text.to_string()))
        }
        Err(e) => bail!(
            "--set {key}={text}: not a TOML value: {}",
            e.message().trim()
        ),
    }
}

/// Fills the arguments the command line left unset from `--config` and
/// `--set` (the flags win), checking every key.
pub(crate) fn apply_config(args: &mut LoraLlmArgs) -> Result<()> {
    let mut entries: Vec<(String, toml::Value, PathBuf, String)> = Vec::new();
    if let Some(path) = &args.config {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("{}: cannot be read (--config)", path.display()))?;
        let from = path.display().to_string();
        let table: toml::Table = toml::from_str(&text)
            .map_err(|e| anyhow::anyhow!("{from}: not valid TOML: {}", e.message().trim()))?;
        let base = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
        for (key, value) in flatten(&table, &from)? {
            entries.push((key, value, base.clone(), from.clone()));
        }
    }
    for pair in &args.overrides {
        let Some((key, text)) = pair.split_once('=').filter(|(k, _)| !k.trim().is_empty()) else {
            bail!("--set expects KEY=VALUE, got `{pair}`");
        };
        let key = key.trim().to_string();
        let value = set_value(&key, text)?;
        let from = format!("--set {pair}");
        if !KEYS.iter().any(|(k, _)| *k == key) {
            bail!("{from}: unknown key `{key}`; the keys are {}", known());
        }
        entries.push((key, value, PathBuf::from("."), from));
    }
    // Later entries (the --set ones) win over earlier ones (the file's).
    let mut resolved: Vec<(String, Value)> = Vec::new();
    for (key, value, base, from) in entries {
        let kind = KEYS
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, kind)| *kind)
            .unwrap_or(Kind::Text);
        let checked = check(&key, kind, &value, &base, &from)?;
        let checked = range_check(&key, checked, &from)?;
        resolved.retain(|(k, _)| *k != key);
        resolved.push((key, checked));
    }
    for (key, value) in resolved {
        fill(args, &key, value);
    }
    Ok(())
}

/// The ranges the flags' parsers enforce, for the same keys.
fn range_check(key: &str, value: Value, from: &str) -> Result<Value> {
    let at_least_one = [
        "train.epochs",
        "train.batch_size",
        "train.accumulate",
        "checkpoints.save_steps",
        "checkpoints.keep",
    ];
    if let Value::Count(0) = value {
        if at_least_one.contains(&key) {
            bail!("{from}: key `{key}` is 0, expected at least 1");
        }
    }
    Ok(value)
}

fn fill(a: &mut LoraLlmArgs, key: &str, value: Value) {
    use Value::*;
    let usize_of = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
    match (key, value) {
        ("model", Path(p)) => _ = a.model.get_or_insert(p),
        ("data", Path(p)) => _ = a.data.get_or_insert(p),
        ("output", Path(p)) => _ = a.output.get_or_insert(p),
        ("token_cache", Path(p)) => _ = a.token_cache.get_or_insert(p),
        ("memory_limit", Text(t)) => _ = a.memory_limit.get_or_insert(t),
        ("lora.r", Count(n)) => _ = a.r.get_or_insert(usize_of(n)),
        ("lora.alpha", Number(x)) => _ = a.alpha.get_or_insert(x as f32),
        ("lora.dropout", Number(x)) => _ = a.dropout.get_or_insert(x as f32),
        ("lora.target_modules", Names(v)) => _ = a.target.get_or_insert(v.join(",")),
        ("sequence.max_seq_length", Count(n)) => _ = a.max_seq_length.get_or_insert(usize_of(n)),
        ("sequence.packing", Flag(b)) => a.packing |= b,
        ("train.epochs", Count(n)) => _ = a.epochs.get_or_insert(usize_of(n)),
        ("train.lr", Number(x)) => _ = a.lr.get_or_insert(x as f32),
        ("train.batch_size", Count(n)) => _ = a.batch_size.get_or_insert(usize_of(n)),
        ("train.accumulate", Count(n)) => _ = a.accumulate.get_or_insert(usize_of(n)),
        ("train.warmup_steps", Count(n)) => _ = a.warmup_steps.get_or_insert(usize_of(n)),
        ("train.weight_decay", Number(x)) => _ = a.weight_decay.get_or_insert(x as f32),
        ("train.max_steps", Count(n)) => _ = a.max_steps.get_or_insert(usize_of(n)),
        ("train.seed", Count(n)) => _ = a.seed.get_or_insert(n),
        ("checkpoints.save_steps", Count(n)) => _ = a.save_steps.get_or_insert(usize_of(n)),
        ("checkpoints.keep", Count(n)) => _ = a.keep_checkpoints.get_or_insert(usize_of(n)),
        // Every key of KEYS is matched above with the kind `check` gives it.
        _ => {}
    }
}
