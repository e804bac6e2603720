//! The token store: the JSONL tokenised once into headroom-loader's shard
//! store of variable-length records. Its rows are `load_jsonl`'s (plain,
//! truncated, packed, with the same counts); it is reused while the JSONL,
//! the tokenizer and the data options are the same and rebuilt (saying
//! why) when one changes or it does not open; training through it gives
//! the in-memory path's losses and weights bit for bit; and reading every
//! row of a store many shards long keeps the cache within its byte budget.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use headroom_llm::data::{load_jsonl, DataOptions, Dataset, Rows};
use headroom_llm::finetune::full::{finetune_full, FullOptions};
use headroom_llm::finetune::{batch, finetune, FinetuneOptions, StepLog};
use headroom_llm::token_store::{Origin, TokenStore, TokenStoreOptions};
use headroom_llm::{Model, Tokenizer};

const LINES: &str = "{\"text\": \"The lazy fox trains a frozen model.\"}\n\
     {\"prompt\": \"The quick brown\", \"completion\": \" fox within the memory it has\"}\n\
     \n\
     {\"text\": \"piece by piece, the lazy fox\"}\n\
     {\"prompt\": \"A prompt long enough to fill the whole row on its own\", \"completion\": \" x\"}\n";

fn setup() -> (Model, Tokenizer, Option<u32>) {
    let model = Model::load(&fixture("llama")).expect("loads");
    let tok = Tokenizer::load(&fixture("llama")).expect("tokenizer");
    let eos = model.config.eos_token_ids.first().copied();
    (model, tok, eos)
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write");
    path
}

fn all_rows(rows: &dyn Rows) -> Vec<headroom_llm::data::Example> {
    (0..rows.len()).map(|i| rows.row(i).expect("row")).collect()
}

#[test]
fn the_store_holds_load_jsonl_rows_and_counts() {
    let (_model, tok, eos) = setup();
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = write(tmp.path(), "train.jsonl", LINES);
    for (k, options) in [
        DataOptions::default(),
        DataOptions {
            max_seq_length: 12,
            packing: false,
        },
        DataOptions {
            max_seq_length: 7,
            packing: true,
        },
    ]
    .into_iter()
    .enumerate()
    {
        let memory = load_jsonl(&data, &tok, eos, options).expect("loads");
        let dir = tmp.path().join(format!("tokens-{k}"));
        let small = TokenStoreOptions {
            shard_bytes: 64,
            cache_bytes: 4096,
        };
        let store =
            TokenStore::open_or_build(&dir, &data, &tok, eos, options, small).expect("store");
        assert_eq!(store.origin(), &Origin::Built);
        assert_eq!(all_rows(&store), memory.examples, "{options:?}");
        assert_eq!(
            (store.truncated(), store.dropped()),
            (memory.truncated, memory.dropped),
            "{options:?}"
        );
        assert!(store.shard_count() > 1, "{} shards", store.shard_count());
        let longest = memory.examples.iter().map(|e| e.ids.len()).max();
        assert_eq!(Some(store.longest()), longest);
        if k == 1 {
            assert!(memory.truncated > 0 && memory.dropped > 0, "{memory:?}");
        }
    }
}

#[test]
fn a_store_is_reused_until_an_input_changes() {
    let (_model, tok, eos) = setup();
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = write(tmp.path(), "train.jsonl", LINES);
    let dir = tmp.path().join("tokens");
    let options = DataOptions::default();
    let store_options = TokenStoreOptions::default();
    let open = |options| {
        TokenStore::open_or_build(&dir, &data, &tok, eos, options, store_options).expect("store")
    };
    assert_eq!(open(options).origin(), &Origin::Built);
    let index = std::fs::read(dir.join("index.bin")).expect("index");
    let reused = open(options);
    assert_eq!(reused.origin(), &Origin::Reused);
    assert_eq!(std::fs::read(dir.join("index.bin")).expect("index"), index);
    drop(reused);

    // Another option: rebuilt, saying what was recorded.
    let packed = DataOptions {
        packing: true,
        ..options
    };
    match open(packed).origin() {
        Origin::Rebuilt(why) => assert!(why.contains("other inputs"), "{why}"),
        other => panic!("{other:?}"),
    }
    // The data edited: rebuilt, and the rows are the new file's.
    std::fs::write(&data, "{\"text\": \"only one line now\"}\n").expect("write");
    let store = open(packed);
    assert!(matches!(store.origin(), Origin::Rebuilt(_)));
    assert_eq!(
        all_rows(&store),
        load_jsonl(&data, &tok, eos, packed)
            .expect("loads")
            .examples
    );
    drop(store);
    // A corrupt index: rebuilt, naming why it did not open.
    let mut bad = std::fs::read(dir.join("index.bin")).expect("index");
    bad[20] ^= 1;
    std::fs::write(dir.join("index.bin"), bad).expect("write");
    match open(packed).origin() {
        Origin::Rebuilt(why) => assert!(why.contains("checksum mismatch"), "{why}"),
        other => panic!("{other:?}"),
    }
    // In a cache: one store per fingerprint, so each input's is reused.
    let cache = tmp.path().join("cache");
    let in_cache = |options| {
        TokenStore::open_or_build_in_cache(&cache, &data, &tok, eos, options, store_options)
            .expect("store")
    };
    let (first, second) = (in_cache(options), in_cache(packed));
    assert_eq!(
        (first.origin(), second.origin()),
        (&Origin::Built, &Origin::Built)
    );
    assert_ne!(first.dir(), second.dir());
    assert_eq!(in_cache(options).origin(), &Origin::Reused);
    assert_eq!(in_cache(packed).origin(), &Origin::Reused);
    // Two runs making the same store at once: both end with it.
    let shared = tmp.path().join("shared");
    let (a, b) = std::thread::scope(|scope| {
        let make = || {
            TokenStore::open_or_build(&shared, &data, &tok, eos, options, store_options)
                .map(|store| all_rows(&store))
                .map_err(|e| e.to_string())
        };
        let a = scope.spawn(make);
        let b = scope.spawn(make);
        (a.join().expect("thread"), b.join().expect("thread"))
    });
    let expected = load_jsonl(&data, &tok, eos, options)
        .expect("loads")
        .examples;
    assert_eq!(a.as_ref(), Ok(&expected));
    assert_eq!(b.as_ref(), Ok(&expected));
    // A directory that holds something else is refused, not replaced.
    let other = tmp.path().join("not-a-store");
    std::fs::create_dir(&other).expect("mkdir");
    std::fs::write(other.join("notes.txt"), "mine").expect("write");
    let err = TokenStore::open_or_build(&other, &data, &tok, eos, options, store_options)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("not-a-store"), "{err}");
    assert!(other.join("notes.txt").is_file());
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn losses(log: &[StepLog]) -> Vec<u32> {
    log.iter().map(|s| s.loss.to_bits()).collect()
}

#[test]
fn training_through_the_store_is_the_in_memory_run_bit_for_bit() {
    let (model, tok, eos) = setup();
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = write(tmp.path(), "train.jsonl", LINES);
    let options = DataOptions::default();
    let memory: Dataset = load_jsonl(&data, &tok, eos, options).expect("loads");
    let small = TokenStoreOptions {
        shard_bytes: 64,
        cache_bytes: 1024,
    };
    let store = TokenStore::open_or_build(&tmp.path().join("t"), &data, &tok, eos, options, small)
        .expect("store");

    let lora = FinetuneOptions {
        r: 4,
        alpha: 8.0,
        dropout: 0.1,
        target_modules: vec!["q_proj".into(), "v_proj".into()],
        epochs: 3,
        lr: 1e-2,
        batch_size: 2,
        accumulate: 1,
        seed: 5,
        ..FinetuneOptions::default()
    };
    let run = |rows: &dyn Rows| {
        let mut log = Vec::new();
        let (adapters, _) = finetune(&model, rows, &lora, |s| log.push(*s)).expect("trains");
        let mut keys: Vec<_> = adapters.keys().cloned().collect();
        keys.sort();
        let weights: Vec<_> = keys
            .iter()
            .map(|k| (bits(&adapters[k].a), bits(&adapters[k].b)))
            .collect();
        (losses(&log), weights)
    };
    let (in_memory, from_store) = (run(&memory), run(&store));
    assert_eq!(in_memory.0.len(), 6);
    assert_eq!(in_memory, from_store);

    let full = FullOptions {
        epochs: 1,
        lr: 1e-3,
        batch_size: 2,
        accumulate: 1,
        seed: 2,
        ..FullOptions::default()
    };
    let run_full = |rows: &dyn Rows| {
        let mut trained = Model::load(&fixture("llama")).expect("loads");
        let mut log = Vec::new();
        finetune_full(&mut trained, rows, &full, |s| log.push(*s)).expect("trains");
        let name = "model.layers.0.self_attn.q_proj.weight";
        (
            losses(&log),
            bits(&trained.weight(name).expect("weight").data),
        )
    };
    assert_eq!(run_full(&memory), run_full(&store));
}

#[test]
fn reading_every_row_stays_within_the_cache_budget() {
    let (_model, tok, eos) = setup();
    let tmp = tempfile::tempdir().expect("tempdir");
    let text: String = (0..300)
        .map(|i| {
            format!(
                "{{\"text\": \"example {i}: the lazy fox, piece {}\"}}\n",
                i * 7
            )
        })
        .collect();
    let data = write(tmp.path(), "many.jsonl", &text);
    let budget = TokenStoreOptions {
        shard_bytes: 512,
        cache_bytes: 2048,
    };
    let options = DataOptions::default();
    let store = TokenStore::open_or_build(&tmp.path().join("t"), &data, &tok, eos, options, budget)
        .expect("store");
    assert_eq!(store.len(), 300);
    assert!(
        store.store_bytes() > 8 * budget.cache_bytes,
        "{} bytes of shards",
        store.store_bytes()
    );
    let memory = load_jsonl(&data, &tok, eos, options).expect("loads");
    for epoch in 0..2 {
        for i in batch::order(store.len(), 9, epoch) {
            assert_eq!(store.row(i).expect("row"), memory.examples[i]);
        }
    }
    let stats = store.cache_stats();
    assert!(
        stats.peak_resident_bytes <= budget.cache_bytes,
        "the cache held {} bytes at its peak, over the {}-byte budget",
        stats.peak_resident_bytes,
        budget.cache_bytes
    );
    assert!(stats.misses > store.shard_count() as u64, "{stats:?}");
}
