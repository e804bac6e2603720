//! Commands never destroy their inputs nor print what they should not:
//! raw control bytes of a text sample are escaped before they reach the
//! terminal.

// Not every helper is used here.
#[allow(dead_code, unused_imports)]
mod common;

use std::path::{Path, PathBuf};

use common::*;

/// A tiny text experiment in `dir` whose prompt is `prompt` (TOML string
/// syntax); returns its file.
fn text_experiment(dir: &Path, prompt: &str) -> PathBuf {
    let corpus = dir.join("corpus.txt");
    std::fs::write(
        &corpus,
        b"the cat sat on the mat. the dog ran to the log.\n".repeat(20),
    )
    .unwrap();
    let toml = format!(
        r#"
[run]
name = "text"
seed = 5
log_every = 1000
profile = "none"
output_dir = "{run}"

[data]
format = "text"
dir = "{store}"
workers = 1

[text]
corpus = ["{corpus}"]
sample_bytes = 4
prompt = "{prompt}"

[device]
kind = "cpu"

[model]
tokens = {{ length = 16, vocab = 256 }}
layers = [
  {{ type = "embedding", dim = 4, positions = true }},
  {{ type = "linear", out = 256 }},
]

[train]
epochs = 1
batch_size = 8
threads = 1

[optimizer]
lr = 1e-2

[schedule]
kind = "constant"
"#,
        run = dir.join("run").display(),
        store = dir.join("store").display(),
        corpus = corpus.display(),
    );
    let path = dir.join("text.toml");
    std::fs::write(&path, toml).unwrap();
    path
}

#[test]
fn control_bytes_of_a_text_sample_are_escaped_before_the_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let config = text_experiment(dir.path(), r"\u001B]0;owned\u0007\u001B[2J\r");
    let output = run(&[
        "train",
        "--config",
        config.to_str().unwrap(),
        "--no-install",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        !output
            .stdout
            .iter()
            .any(|&b| b == 0x1b || b == 0x07 || b == b'\r'),
        "raw control bytes printed: {stdout:?}"
    );
    assert!(stdout.contains(r"\x1b]0;owned\x07\x1b[2J\r"), "{stdout}");
    // The file keeps the bytes as generated.
    let sample = std::fs::read(dir.path().join("run/sample.txt")).unwrap();
    assert!(sample.starts_with(b"\x1b]0;owned\x07\x1b[2J\r"));
}
