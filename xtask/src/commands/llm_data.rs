//! The fine-tuning commands' data: the JSONL tokenised once into a token
//! store (`headroom_llm::token_store`) under the token cache, one store per
//! input fingerprint (the JSONL's bytes, `tokenizer.json`, EOS and the data
//! options), so a resume or another run on the same data reads the rows
//! already made. The cache is `--token-cache DIR`, else
//! `$XDG_CACHE_HOME/headroom/llm-tokens`, else
//! `$HOME/.cache/headroom/llm-tokens`. Memory: the store's shard cache
//! budget (`TokenStoreOptions::cache_bytes`) and one micro-batch's rows.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use headroom_llm::data::{DataOptions, Rows};
use headroom_llm::token_store::{Origin, TokenStore, TokenStoreOptions};
use headroom_llm::{Model, Tokenizer};

/// Where token stores are kept.
pub(crate) fn token_cache_root(flag: Option<&Path>) -> Result<PathBuf> {
    if let Some(dir) = flag {
        return Ok(dir.to_path_buf());
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir).join("headroom/llm-tokens"));
    }
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .context("no --token-cache, XDG_CACHE_HOME or HOME: give --token-cache DIR")?;
    Ok(PathBuf::from(home).join(".cache/headroom/llm-tokens"))
}

/// The rows of `data` for `model`, from the token cache (tokenised now if
/// this input has no store there yet), logged with their counts.
pub(crate) fn open_rows(
    model: &Model,
    tokenizer: &Tokenizer,
    data: &Path,
    options: DataOptions,
    token_cache: Option<&Path>,
) -> Result<TokenStore> {
    let root = token_cache_root(token_cache)?;
    let store = TokenStore::open_or_build_in_cache(
        &root,
        data,
        tokenizer,
        model.config.eos_token_ids.first().copied(),
        options,
        TokenStoreOptions::default(),
    )?;
    let how = match store.origin() {
        Origin::Reused => "read from the token store, tokenised before".to_string(),
        Origin::Built => "tokenised into the token store".to_string(),
        Origin::Rebuilt(why) => format!("tokenised again into the token store ({why})"),
    };
    tracing::info!(
        "{}: {} rows from {} ({} truncated to {} tokens, {} without a counted label dropped); \
         {how} {} ({} in {} shards, read through a cache of at most {} bytes)",
        model.config.architecture,
        store.len(),
        data.display(),
        store.truncated(),
        options.max_seq_length,
        store.dropped(),
        store.dir().display(),
        headroom_model::memory::bytes_text(store.store_bytes()),
        store.shard_count(),
        store.cache_limit_bytes()
    );
    Ok(store)
}
