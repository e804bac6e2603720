//! `--set key=value` overrides: how their text is typed (numbers, booleans,
//! TOML lists and inline tables), and which source a bad value is blamed on
//! (the `--set`, an environment variable, or the experiment file).

use crate::{PipelineError, Result};

/// The environment variables' prefix: `HEADROOM__SECTION__KEY`.
pub(super) const ENV_PREFIX: &str = "HEADROOM";

/// `--set key=value` pairs, applied last.
#[derive(Clone, Debug, Default)]
pub struct Overrides(pub Vec<(String, String)>);

impl Overrides {
    /// Parses "key=value" strings; a pair without `=` is an error naming it.
    pub fn parse(pairs: &[String]) -> Result<Self> {
        pairs
            .iter()
            .map(|pair| match pair.split_once('=') {
                Some((k, v)) if !k.trim().is_empty() => {
                    Ok((k.trim().to_string(), v.trim().to_string()))
                }
                _ => Err(PipelineError::Config(format!(
                    "--set expects key=value, got `{pair}`"
                ))),
            })
            .collect::<Result<Vec<_>>>()
            .map(Self)
    }
}

/// A `--set` value typed the way the environment's values are
/// (`try_parsing`): a number or a boolean when it reads as one, else text.
/// Untyped text would reach tagged tables such as `[schedule]` as a string
/// and be refused there (`schedule.pct_start=0.5`).
///
/// A value that starts with `[` or `{` is TOML: an inline array
/// (`text.corpus=["a.txt","b.txt"]`) or an inline table (`{ num_ops = 2 }`),
/// and malformed TOML is an error naming the key and the value. (Comma
/// text such as `device.inject_oom.steps=3,17,40` stays text: that key
/// reads it itself.)
pub(super) fn typed_value(key: &str, text: &str) -> Result<config::Value> {
    let trimmed = text.trim();
    if trimmed.starts_with('[') || trimmed.starts_with('{') {
        return toml_value(key, trimmed);
    }
    let looks_numeric = text.chars().any(|c| c.is_ascii_digit());
    if let Ok(integer) = text.parse::<i64>() {
        return Ok(integer.into());
    }
    if looks_numeric {
        if let Ok(float) = text.parse::<f64>() {
            return Ok(float.into());
        }
    }
    Ok(match text {
        "true" => true.into(),
        "false" => false.into(),
        _ => text.into(),
    })
}

/// An inline TOML array or table, read as the right-hand side of `value = `.
fn toml_value(key: &str, text: &str) -> Result<config::Value> {
    let bad = |why: String| {
        PipelineError::Config(format!(
            "--set {key}={text}: expected a TOML list such as [\"a.txt\", \"b.txt\"] or an inline \
             table such as {{ name = 1 }}: {why}"
        ))
    };
    let mut document: toml::Table =
        toml::from_str(&format!("value = {text}")).map_err(|e| bad(e.message().trim().into()))?;
    let value = document
        .remove("value")
        .ok_or_else(|| bad("no value".into()))?;
    Ok(from_toml(value))
}

fn from_toml(value: toml::Value) -> config::Value {
    match value {
        toml::Value::String(s) => s.into(),
        toml::Value::Integer(i) => i.into(),
        toml::Value::Float(f) => f.into(),
        toml::Value::Boolean(b) => b.into(),
        toml::Value::Datetime(d) => d.to_string().into(),
        toml::Value::Array(items) => items
            .into_iter()
            .map(from_toml)
            .collect::<Vec<config::Value>>()
            .into(),
        toml::Value::Table(table) => table
            .into_iter()
            .map(|(k, v)| (k, from_toml(v)))
            .collect::<config::Map<String, config::Value>>()
            .into(),
    }
}

/// Names where a bad value came from: the `--set` override, the
/// environment variable, or the experiment file(s).
pub(super) fn blame_source(message: &str, files: &str, overrides: &Overrides) -> PipelineError {
    let quoted = |after: &str| {
        message
            .split_once(after)
            .and_then(|(_, rest)| rest.split_once('`'))
            .map(|(name, _)| name.to_string())
    };
    // An unknown key is reported against its table: `--set loader.workers`
    // gives "unknown field `workers` ... for key `loader`".
    let key = match (quoted("for key `"), quoted("unknown field `")) {
        (Some(table), Some(field)) => Some(format!("{table}.{field}")),
        (table, field) => table.or(field),
    };
    let message = message.trim_end_matches(" in the environment");
    let Some(key) = key else {
        return PipelineError::Config(format!("{files}: {message}"));
    };
    let within = |k: &str| {
        k == key
            || k.strip_prefix(key.as_str())
                .is_some_and(|r| r.starts_with('.'))
    };
    if let Some((set, _)) = overrides.0.iter().find(|(k, _)| within(k)) {
        return PipelineError::Config(format!("--set {set}: {message}"));
    }
    let variable = env_variable(&key);
    if std::env::var_os(&variable).is_some() {
        return PipelineError::Config(format!("environment variable {variable}: {message}"));
    }
    PipelineError::Config(format!("{files}: {message}"))
}

/// `train.epochs` -> `HEADROOM__TRAIN__EPOCHS`.
fn env_variable(key: &str) -> String {
    format!("{ENV_PREFIX}__{}", key.replace('.', "__").to_uppercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_values_are_typed_as_before() {
        let kind = |text: &str| typed_value("k", text).unwrap().kind.to_string();
        assert_eq!(typed_value("k", "3").unwrap().into_int().unwrap(), 3);
        assert_eq!(typed_value("k", "0.5").unwrap().into_float().unwrap(), 0.5);
        assert!(typed_value("k", "true").unwrap().into_bool().unwrap());
        assert_eq!(kind("3,17,40"), "3,17,40");
        assert_eq!(kind("auto"), "auto");
    }

    #[test]
    fn lists_and_inline_tables_are_toml() {
        let list = typed_value("text.corpus", r#"["a.txt", "b.txt"]"#)
            .unwrap()
            .into_array()
            .unwrap();
        let names: Vec<String> = list.into_iter().map(|v| v.into_string().unwrap()).collect();
        assert_eq!(names, ["a.txt", "b.txt"]);
        let table = typed_value("augment.rand_augment", "{ num_ops = 2 }")
            .unwrap()
            .into_table()
            .unwrap();
        assert_eq!(table["num_ops"].clone().into_int().unwrap(), 2);
    }

    #[test]
    fn a_malformed_list_names_the_key_and_the_value() {
        let err = typed_value("text.corpus", r#"["a.txt", "b.txt""#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("text.corpus"), "{err}");
        assert!(err.contains(r#"["a.txt", "b.txt""#), "{err}");
    }
}
