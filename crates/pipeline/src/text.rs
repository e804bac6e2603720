//! Byte-level language modelling: the `[text]` corpus (files of a Debian
//! package, installed as Fashion-MNIST's is), packed on first use into a
//! shard store of next-token windows that training reads lazily through the
//! index and the LRU shard cache; the checks that the data fits the token
//! model; and, after training, the report (validation loss, bits per byte,
//! samples/s) and a generated sample in the run directory.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use headroom_loader::{
    preprocess, split_for_validation, window_length, Dataset, ShardSize, ShardedDataset,
    TextWindows, INDEX_FILE,
};
use headroom_model::init::InitRng;
use headroom_model::{Mode, Network, TokenInput};

use crate::config::{ExperimentConfig, TextConfig};
use crate::learner::{CpuLearner, Learner};
use crate::paths::{self, Want};
use crate::{checkpoint, PipelineError, Result, RunSummary};

/// Windows per shard: small enough that a store of a small corpus has
/// several shards (so the cache and read-ahead have work to do).
const WINDOWS_PER_SHARD: usize = 256;

/// The sample written beside the run's checkpoints.
pub const SAMPLE_FILE: &str = "sample.txt";
/// The text model's figures, as JSON, in the run directory.
pub const REPORT_FILE: &str = "text_report.json";

/// The `[text]` table (`validate` made sure it is there for "text" data).
fn text_config(config: &ExperimentConfig) -> Result<&TextConfig> {
    config.text.as_ref().ok_or_else(|| {
        PipelineError::value("text.corpus", "data.format = \"text\" needs a [text] table")
    })
}

fn token_input(config: &ExperimentConfig) -> Result<TokenInput> {
    config.model.tokens.ok_or_else(|| {
        PipelineError::value(
            "model.tokens",
            "text data needs a token model: set model.tokens = { length, vocab = 256 }",
        )
    })
}

/// The training and validation windows of the corpus, packed into a shard
/// store the first time (the store is keyed by the corpus's contents, the
/// model's length, the split and the sample limits, so any change packs a
/// new one), then opened lazily.
pub fn open_splits(
    config: &ExperimentConfig,
    allow_install: bool,
) -> Result<(Arc<dyn Dataset>, Arc<dyn Dataset>)> {
    let store = pack(config, allow_install)?;
    let cache = crate::sources::shard_cache(config)?;
    let open = |split: &str| -> Result<Arc<dyn Dataset>> {
        let store = ShardedDataset::open(&store.join(split), cache)?;
        tracing::info!(
            "text {split} windows from {}: {} windows in {} shards, read through a {}-shard cache",
            store.dir().display(),
            store.len(),
            store.shard_count(),
            store.cache_capacity_shards()
        );
        Ok(Arc::new(store))
    };
    Ok((open("train")?, open("test")?))
}

/// Packs the corpus into `<store root>/L<length>-<key>/{train,test}` unless
/// it is there already; returns that directory.
pub fn pack(config: &ExperimentConfig, allow_install: bool) -> Result<PathBuf> {
    let text = text_config(config)?;
    let length = token_input(config)?.length;
    let corpus = read_corpus(text, allow_install)?;
    let (train, validation) = split_for_validation(&corpus, text.validation_fraction);
    let limits = (config.data.train_samples, config.data.test_samples);
    let dir = store_root(config)?.join(format!(
        "L{length}-{:08x}",
        store_key(&corpus, length, text.validation_fraction, limits)
    ));
    if dir.join("train").join(INDEX_FILE).is_file() && dir.join("test").join(INDEX_FILE).is_file() {
        return Ok(dir);
    }
    let per_shard = ShardSize::Samples(WINDOWS_PER_SHARD);
    // The test split goes last: its index marks a complete store.
    for (split, bytes, limit) in [("train", train, limits.0), ("test", validation, limits.1)] {
        let what = format!("the {split} part of text.corpus");
        let mut copy = Vec::new();
        reserve(&mut copy, bytes.len() as u64, "text.corpus", &what)?;
        copy.extend_from_slice(bytes);
        let windows = TextWindows::new(copy, length, limit, &what)?;
        let summary = preprocess(&windows, &dir.join(split), per_shard, true)?;
        tracing::info!("packed {split}: {summary}");
    }
    Ok(dir)
}

fn store_root(config: &ExperimentConfig) -> Result<PathBuf> {
    if let Some(dir) = &config.data.dir {
        return Ok(dir.clone());
    }
    let home = std::env::var_os("HOME").ok_or_else(|| {
        PipelineError::value(
            "data.dir",
            "is unset and so is $HOME: say where to keep the packed text store",
        )
    })?;
    Ok(PathBuf::from(home).join(".cache/headroom/text"))
}

/// What a packed store depends on, as one CRC.
fn store_key(corpus: &[u8], length: usize, fraction: f64, limits: (usize, usize)) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(corpus);
    for value in [
        length as u64,
        fraction.to_bits(),
        limits.0 as u64,
        limits.1 as u64,
    ] {
        hasher.update(&value.to_le_bytes());
    }
    hasher.finalize()
}

/// The corpus files joined in order. A missing file installs `text.package`
/// when we may (root on Debian or Ubuntu, not --no-install), else is an error
/// naming the file, the key and the command that installs it. A path that
/// is there but is no readable regular file (a directory, a symlink loop or
/// a dangling one, a FIFO, a permission error) is refused as what it is,
/// before anything is installed: a package would not change it, and a FIFO
/// would hang the read.
pub fn read_corpus(text: &TextConfig, allow_install: bool) -> Result<Vec<u8>> {
    for path in text.corpus.iter().filter(|p| !paths::is_absent(p)) {
        if let Some(reason) = paths::problem(path, Want::File) {
            return Err(PipelineError::value(
                "text.corpus",
                format!(
                    "{} {reason} (expected a text file to train on)",
                    path.display()
                ),
            ));
        }
    }
    let missing = |text: &TextConfig| -> Vec<PathBuf> {
        text.corpus
            .iter()
            .filter(|p| !p.is_file())
            .cloned()
            .collect()
    };
    let mut absent = missing(text);
    if let (false, Some(package)) = (absent.is_empty(), &text.package) {
        if allow_install && crate::sources::can_install_with_apt() {
            tracing::info!(
                "text corpus not found; installing the Debian package {package} with apt-get"
            );
            crate::sources::install_with_apt(package)?;
            absent = missing(text);
        }
    }
    if let Some(first) = absent.first() {
        return Err(missing_corpus(text, first));
    }
    // The files' sizes are the user's: the corpus is held once, in memory
    // asked for up front, and a refusal is an error naming the files.
    let mut total = 0u64;
    for path in &text.corpus {
        let meta = std::fs::metadata(path).map_err(|e| PipelineError::io(path, e))?;
        total = total.saturating_add(meta.len());
    }
    let mut corpus = Vec::new();
    reserve(&mut corpus, total, "text.corpus", "the corpus files joined")?;
    for path in &text.corpus {
        let mut file = std::fs::File::open(path).map_err(|e| PipelineError::io(path, e))?;
        // Fallible: a file grown since it was measured is read on, and a
        // refused allocation is an OutOfMemory error, not an abort.
        std::io::Read::read_to_end(&mut file, &mut corpus)
            .map_err(|e| PipelineError::io(path, e))?;
    }
    Ok(corpus)
}

/// Room for `bytes` more in `buffer`, or an error naming `key` and `what`
/// the buffer is for.
fn reserve(buffer: &mut Vec<u8>, bytes: u64, key: &str, what: &str) -> Result<()> {
    let refused = |reason: String| {
        PipelineError::value(
            key,
            format!(
                "{what} take {}, which this process cannot hold in memory ({reason}); \
                 use a smaller corpus or raise the memory limit",
                headroom_model::memory::bytes_text(bytes)
            ),
        )
    };
    let bytes = usize::try_from(bytes).map_err(|e| refused(e.to_string()))?;
    buffer
        .try_reserve_exact(bytes)
        .map_err(|e| refused(e.to_string()))
}

fn missing_corpus(text: &TextConfig, file: &Path) -> PipelineError {
    let install = match &text.package {
        Some(package) => format!(
            "; it comes from the Debian package {package}: sudo apt-get update && sudo apt-get install -y {package}"
        ),
        None => String::new(),
    };
    PipelineError::DatasetMissing(format!(
        "text.corpus: {} {}{install}",
        file.display(),
        paths::problem(file, Want::File).unwrap_or_else(|| "does not exist".into())
    ))
}

/// The checks `train` makes for a token model: the data are windows of
/// exactly `model.tokens.length` tokens (a longer sequence than the model's
/// context is an error, as is a shorter one), over the model's vocabulary,
/// and the last layer scores every token of it.
pub fn check_data_fits_token_model(
    config: &ExperimentConfig,
    tokens: TokenInput,
    data: &dyn Dataset,
    learner: &dyn Learner,
) -> Result<()> {
    let source = describe_source(config);
    let Some(length) = window_length(data.sample_shape()) else {
        return Err(PipelineError::value(
            "model.tokens",
            format!(
                "{source} holds samples of shape {:?}, not text windows; a token model trains on data.format = \"text\" \
                 (or a store of text windows)",
                data.sample_shape()
            ),
        ));
    };
    if length != tokens.length {
        let relation = if length > tokens.length {
            "longer than"
        } else {
            "shorter than"
        };
        return Err(PipelineError::value(
            "model.tokens.length",
            format!(
                "{source} holds sequences of {length} tokens, {relation} the model's context of {} \
                 (windows are model.tokens.length + 1 bytes: repack the store for this length)",
                tokens.length
            ),
        ));
    }
    if data.num_classes() != tokens.vocab {
        return Err(PipelineError::value(
            "model.tokens.vocab",
            format!(
                "is {}, but {source} is byte-level text with a vocabulary of {}",
                tokens.vocab,
                data.num_classes()
            ),
        ));
    }
    if learner.num_classes() != tokens.vocab {
        return Err(PipelineError::value(
            "model.layers",
            format!(
                "the last layer scores {} classes per token, but the vocabulary (model.tokens.vocab) has {}",
                learner.num_classes(),
                tokens.vocab
            ),
        ));
    }
    Ok(())
}

fn describe_source(config: &ExperimentConfig) -> String {
    match (&config.text, &config.data.dir) {
        (Some(text), _) if config.data.format == crate::config::DataFormat::Text => {
            let files: Vec<String> = text
                .corpus
                .iter()
                .map(|p| p.display().to_string())
                .collect();
            format!("text.corpus ({})", files.join(", "))
        }
        (_, Some(dir)) => format!("data.dir = {}", dir.display()),
        _ => "the data".into(),
    }
}

/// What `write_report` measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TextReport {
    pub validation_loss: f32,
    /// Validation loss in bits: the loss (nats per byte) / ln 2.
    pub bits_per_byte: f32,
    pub token_accuracy: f32,
    pub train_samples_per_sec: f64,
    pub train_tokens_per_sec: f64,
    pub sample_file: PathBuf,
    pub sample: String,
}

/// After a completed text run: generates `sample.txt` from the last
/// checkpoint and writes `text_report.json` beside it.
pub fn write_report(config: &ExperimentConfig, summary: &RunSummary) -> Result<TextReport> {
    write_report_until(config, summary, None)
}

/// [`write_report`], with the sample cut short once `stop` is set (the
/// first SIGINT or SIGTERM): the bytes drawn so far are the sample, and
/// the log says it was cut.
pub fn write_report_until(
    config: &ExperimentConfig,
    summary: &RunSummary,
    stop: Option<&AtomicBool>,
) -> Result<TextReport> {
    let text = text_config(config)?;
    let tokens = token_input(config)?;
    let checkpoint_path = summary.last_checkpoint.as_deref().ok_or_else(|| {
        PipelineError::value("checkpoint", "the run wrote no checkpoint to generate from")
    })?;
    let dir = checkpoint_path.parent().unwrap_or(Path::new("."));
    let mut learner = learner_from_checkpoint(config, checkpoint_path)?;
    let generated = generate_until(
        learner.network_mut(),
        text.prompt.as_bytes(),
        text.sample_bytes,
        text.temperature,
        config.run.seed,
        stop,
    )?;
    if generated.len() < text.sample_bytes {
        tracing::warn!(
            "the sample was cut short by the stop request: {} of text.sample_bytes = {} bytes",
            generated.len(),
            text.sample_bytes
        );
    }
    let sample =
        String::from_utf8_lossy(&[text.prompt.as_bytes(), &generated].concat()).into_owned();
    let sample_file = dir.join(SAMPLE_FILE);
    std::fs::write(&sample_file, &sample).map_err(|e| PipelineError::io(&sample_file, e))?;
    let validation_loss = summary.test_loss.unwrap_or(f32::NAN);
    let report = TextReport {
        validation_loss,
        bits_per_byte: validation_loss / std::f32::consts::LN_2,
        token_accuracy: summary.test_accuracy.unwrap_or(f32::NAN),
        train_samples_per_sec: summary.train_samples_per_sec,
        train_tokens_per_sec: summary.train_samples_per_sec * tokens.length as f64,
        sample_file,
        sample,
    };
    let path = dir.join(REPORT_FILE);
    let json = serde_json::to_string_pretty(&report).map_err(|e| PipelineError::Stage {
        stage: "text report",
        reason: e.to_string(),
    })?;
    std::fs::write(&path, json).map_err(|e| PipelineError::io(&path, e))?;
    Ok(report)
}

/// `text` made safe to print on a terminal: a generated sample (or its
/// prompt) may hold any byte, and a raw escape sequence would recolour,
/// retitle or clear the user's terminal, or hide what was printed before.
/// Every control character but the newline and the tab, and the Unicode
/// controls that reorder text (bidirectional overrides), is written as an
/// escape: `\x1b`, `\r`, `\u{202e}`. The file `sample.txt` keeps the raw
/// bytes.
pub fn terminal_safe(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\n' | '\t' => out.push(c),
            '\r' => out.push_str("\\r"),
            c if c.is_control() && u32::from(c) < 0x80 => {
                out.push_str(&format!("\\x{:02x}", u32::from(c)));
            }
            c if c.is_control() || is_bidi_control(c) => {
                out.push_str(&format!("\\u{{{:x}}}", u32::from(c)));
            }
            c => out.push(c),
        }
    }
    out
}

/// The characters that change the direction text is shown in.
fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

fn learner_from_checkpoint(config: &ExperimentConfig, path: &Path) -> Result<CpuLearner> {
    crate::parts::restored_cpu_learner(
        config,
        checkpoint::load(path)?,
        path,
        1,
        &headroom_model::LayerRegistry::default(),
    )
}

/// `count` bytes continuing `prompt`, each drawn from the model's
/// distribution at `temperature` with random numbers from `seed` (the same
/// seed and weights give the same text). The model reads the last
/// `length` bytes; a shorter context is padded after its end, which a
/// causal model never looks at from the position it is scored at.
pub fn generate(
    network: &mut Network,
    prompt: &[u8],
    count: usize,
    temperature: f32,
    seed: u64,
) -> Result<Vec<u8>> {
    generate_until(network, prompt, count, temperature, seed, None)
}

/// [`generate`], ending early (with the bytes drawn so far) once `stop` is
/// set: each byte is a forward pass, so a long sample must not outlast a
/// request to stop.
pub fn generate_until(
    network: &mut Network,
    prompt: &[u8],
    count: usize,
    temperature: f32,
    seed: u64,
    stop: Option<&AtomicBool>,
) -> Result<Vec<u8>> {
    let length = network.input_shape().first().copied().unwrap_or(1);
    let vocab = network.num_classes();
    let mut rng = InitRng::new(seed);
    let mut text: Vec<u8> = if prompt.is_empty() {
        b"\n".to_vec()
    } else {
        prompt.to_vec()
    };
    let start = text.len();
    for _ in 0..count {
        if stop.is_some_and(|flag| flag.load(Ordering::SeqCst)) {
            break;
        }
        let context = &text[text.len().saturating_sub(length)..];
        let position = context.len() - 1;
        let mut ids: Vec<u32> = context.iter().map(|&b| u32::from(b)).collect();
        ids.resize(length, u32::from(b' '));
        let input = network.input_from_tokens(1, &ids)?;
        let logits = network.forward(&input, Mode::Eval)?;
        let row = &logits.data()[position * vocab..(position + 1) * vocab];
        let next = draw(row, temperature, rng.uniform());
        text.push(u8::try_from(next).unwrap_or(b'?'));
    }
    Ok(text.split_off(start))
}

/// The index whose cumulative softmax(row / temperature) first exceeds `u`.
fn draw(row: &[f32], temperature: f32, u: f64) -> usize {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let weights: Vec<f64> = row
        .iter()
        .map(|&x| (((x - max) / temperature) as f64).exp())
        .collect();
    let mut left = u * weights.iter().sum::<f64>();
    for (k, w) in weights.iter().enumerate() {
        left -= w;
        if left < 0.0 {
            return k;
        }
    }
    row.len().saturating_sub(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draw_picks_by_cumulative_probability_and_sharpens_with_temperature() {
        let row = [0.0f32, (3.0f32).ln()];
        // Probabilities 1/4 and 3/4.
        assert_eq!(draw(&row, 1.0, 0.2), 0);
        assert_eq!(draw(&row, 1.0, 0.3), 1);
        // At a low temperature the larger score takes almost everything.
        assert_eq!(draw(&row, 0.05, 0.01), 1);
    }

    #[test]
    fn terminal_safe_escapes_every_control_but_newline_and_tab() {
        let raw = "a\x1b[2J\x07b\r\nc\td\\x1b \u{9b}\u{202e}é\x7f";
        let safe = terminal_safe(raw);
        assert_eq!(safe, "a\\x1b[2J\\x07b\\r\nc\td\\x1b \\u{9b}\\u{202e}é\\x7f");
        assert!(!safe
            .chars()
            .any(|c| c.is_control() && c != '\n' && c != '\t'));
    }

    fn tiny_token_network() -> Network {
        let spec: headroom_model::ModelSpec = toml::from_str(
            r#"
            tokens = { length = 8, vocab = 256 }
            layers = [{ type = "embedding", dim = 4 }, { type = "linear", out = 256 }]
            "#,
        )
        .unwrap();
        Network::build(&spec, 1).unwrap()
    }

    #[test]
    fn sampling_stops_at_a_stop_request_with_what_it_drew() {
        let mut network = tiny_token_network();
        let whole = generate(&mut network, b"ab", 16, 0.7, 3).unwrap();
        assert_eq!(whole.len(), 16);
        let stop = AtomicBool::new(true);
        let cut = generate_until(&mut network, b"ab", 16, 0.7, 3, Some(&stop)).unwrap();
        assert!(cut.is_empty(), "{} bytes drawn after the stop", cut.len());
    }

    #[test]
    fn a_corpus_too_large_to_hold_is_an_error_naming_it_not_an_abort() {
        let mut corpus = Vec::new();
        let err = reserve(
            &mut corpus,
            u64::MAX / 2,
            "text.corpus",
            "the corpus files joined",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("text.corpus"), "{err}");
        assert!(err.contains("cannot hold in memory"), "{err}");
        reserve(&mut corpus, 1024, "text.corpus", "the corpus").unwrap();
        assert!(corpus.capacity() >= 1024);
    }

    #[test]
    fn store_key_changes_with_every_input() {
        let base = store_key(b"abc", 8, 0.05, (0, 0));
        assert_ne!(base, store_key(b"abd", 8, 0.05, (0, 0)));
        assert_ne!(base, store_key(b"abc", 9, 0.05, (0, 0)));
        assert_ne!(base, store_key(b"abc", 8, 0.1, (0, 0)));
        assert_ne!(base, store_key(b"abc", 8, 0.05, (5, 0)));
        assert_eq!(base, store_key(b"abc", 8, 0.05, (0, 0)));
    }
}
