//! A fine-tuning run in its directory on the llama fixture: a checkpoint
//! reads back as the state it saved, a run stopped and resumed is
//! bit-identical to one never stopped (dropout and batch 2, so the masks
//! and the order are exercised), a corrupt newest checkpoint falls back to
//! the one before, another model or data file is refused naming which,
//! the newest K checkpoints are kept, and metrics.jsonl holds each step once.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use common::*;
use headroom_llm::data::{load_jsonl, DataOptions, Dataset};
use headroom_llm::finetune::checkpoint::{self, Meta};
use headroom_llm::finetune::run::{self, Event, Outcome, RunRecord, RunSettings};
use headroom_llm::finetune::{FinetuneOptions, Trainer};
use headroom_llm::{Model, Tokenizer};

const FIVE: &str = "{\"text\": \"The lazy fox trains a frozen model.\"}\n\
    {\"prompt\": \"The quick brown\", \"completion\": \" fox within the memory it has\"}\n\
    {\"text\": \"piece by piece, the lazy fox\"}\n\
    {\"text\": \"memory\"}\n\
    {\"prompt\": \"A frozen\", \"completion\": \" model, piece by piece, within the memory it has.\"}\n";

struct Setup {
    tmp: tempfile::TempDir,
    model: Model,
    data: Dataset,
    settings: RunSettings,
}

fn setup() -> Setup {
    let tmp = tempfile::tempdir().expect("tempdir");
    let path = tmp.path().join("train.jsonl");
    std::fs::write(&path, FIVE).expect("write");
    let model = Model::load(&fixture("llama")).expect("loads");
    let data = load_data(&model, &path);
    let settings = RunSettings {
        model: fixture("llama"),
        data: path,
        data_options: DataOptions::default(),
        options: FinetuneOptions {
            r: 4,
            alpha: 8.0,
            dropout: 0.2,
            target_modules: vec!["q_proj".into(), "v_proj".into(), "o_proj".into()],
            epochs: 4,
            lr: 1e-2,
            batch_size: 2,
            accumulate: 1,
            seed: 11,
            ..FinetuneOptions::default()
        },
        save_steps: Some(2),
        keep_checkpoints: 2,
    };
    Setup {
        tmp,
        model,
        data,
        settings,
    }
}

fn load_data(model: &Model, path: &Path) -> Dataset {
    let tok = Tokenizer::load(&fixture("llama")).expect("tokenizer");
    load_jsonl(
        path,
        &tok,
        model.config.eos_token_ids.first().copied(),
        DataOptions::default(),
    )
    .expect("data")
}

/// Runs to the end (or to the stop after step `stop_after`), collecting the
/// events as text.
fn go(
    s: &Setup,
    out: &Path,
    settings: &RunSettings,
    resume: bool,
    stop_after: Option<usize>,
) -> (headroom_llm::Result<Outcome>, Vec<String>) {
    let stop = AtomicBool::new(false);
    let mut events = Vec::new();
    let on_event = |e: Event| {
        if let Event::Step { log, .. } = &e {
            if Some(log.step) == stop_after {
                stop.store(true, Ordering::SeqCst);
            }
        }
        events.push(match e {
            Event::Step { log, .. } => format!("step {}", log.step),
            Event::Checkpoint(p) => format!("checkpoint {}", name(p)),
            Event::Pruned(p) => format!("pruned {}", name(p)),
            Event::RemovedTemporary(p) => format!("removed {}", name(p)),
            Event::Skipped { error, set_aside } => {
                format!("skipped {error} as {}", name(set_aside))
            }
            Event::Resumed { step, .. } => format!("resumed {step}"),
            Event::Changed { key, .. } => format!("changed {key}"),
        });
    };
    let result = if resume {
        run::resume(out, settings, &s.model, &s.data, Some(&stop), on_event)
    } else {
        run::start(out, settings, &s.model, &s.data, Some(&stop), on_event)
    };
    (result, events)
}

fn name(p: &Path) -> String {
    p.file_name()
        .map_or(String::new(), |n| n.to_string_lossy().into_owned())
}

fn read(p: PathBuf) -> Vec<u8> {
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// metrics.jsonl's (step, loss) pairs.
fn metrics(out: &Path) -> Vec<(u64, f64)> {
    String::from_utf8(read(out.join(run::METRICS)))
        .expect("utf-8")
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            for key in ["epoch", "lr", "tokens", "tokens_per_s", "elapsed_s"] {
                assert!(v.get(key).is_some(), "{key} in {l}");
            }
            (
                v["step"].as_u64().expect("step"),
                v["loss"].as_f64().expect("loss"),
            )
        })
        .collect()
}

fn steps(out: &Path) -> Vec<usize> {
    checkpoint::list(out)
        .expect("lists")
        .into_iter()
        .map(|(s, _)| s)
        .collect()
}

#[test]
fn a_checkpoint_reads_back_as_the_state_it_saved() {
    let s = setup();
    let mut trainer = Trainer::new(&s.model, &s.data, &s.settings.options).expect("trainer");
    for _ in 0..4 {
        trainer.step().expect("step");
    }
    let out = s.tmp.path().join("ckpt");
    std::fs::create_dir_all(&out).expect("mkdir");
    let meta = Meta {
        elapsed_s: 1.5,
        settings: s.settings.to_json().expect("json"),
        model: checkpoint::model_fingerprint(&fixture("llama")).expect("fingerprint"),
        data: checkpoint::data_fingerprint(&s.settings.data).expect("fingerprint"),
    };
    let path = checkpoint::write(
        &out,
        &s.model,
        trainer.state(),
        &trainer.lora_config(),
        &meta,
    )
    .expect("writes");
    assert_eq!(name(&path), "checkpoint-step0000000004");
    let saved = checkpoint::load(&path, &s.model).expect("loads");
    let (a, b) = (trainer.state(), &saved.state);
    assert_eq!(
        (a.step, a.epoch, a.position),
        (4, 1, 2),
        "steps of 2, 2, 1 on 5 examples, then 2"
    );
    assert_eq!((a.step, a.epoch, a.position), (b.step, b.epoch, b.position));
    assert_eq!(a.keys, b.keys);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (i, key) in a.keys.iter().enumerate() {
        assert_eq!(bits(&a.adapters[key].a), bits(&b.adapters[key].a), "{key}");
        assert_eq!(bits(&a.adapters[key].b), bits(&b.adapters[key].b), "{key}");
        assert_eq!(a.adapters[key].scale, b.adapters[key].scale, "{key}");
        assert_eq!(bits(&a.m[i].0), bits(&b.m[i].0), "{key}");
        assert_eq!(bits(&a.m[i].1), bits(&b.m[i].1), "{key}");
        assert_eq!(bits(&a.v[i].0), bits(&b.v[i].0), "{key}");
        assert_eq!(bits(&a.v[i].1), bits(&b.v[i].1), "{key}");
    }
    assert!(a.m.iter().any(|(ma, _)| ma.iter().any(|&x| x != 0.0)));
    assert_eq!(saved.meta.elapsed_s, 1.5);
    assert_eq!(saved.meta.settings, meta.settings);
    // The checkpoint's adapters are peft's files, and load as such.
    headroom_llm::peft::load_adapters(&path, &s.model).expect("peft files");
}

#[test]
fn a_run_stopped_and_resumed_is_bit_identical_to_one_never_stopped() {
    let s = setup();
    let straight = s.tmp.path().join("straight");
    let (outcome, _) = go(&s, &straight, &s.settings, false, None);
    let total = 4 * 3; // ceil(5 / 2) steps an epoch
    assert!(
        matches!(outcome, Ok(Outcome::Finished { step, .. }) if step == total),
        "{outcome:?}"
    );

    let stopped = s.tmp.path().join("stopped");
    let (outcome, events) = go(&s, &stopped, &s.settings, false, Some(5));
    match outcome {
        Ok(Outcome::Stopped {
            step, checkpoint, ..
        }) => {
            assert_eq!(step, 5);
            assert_eq!(name(&checkpoint), "checkpoint-step0000000005");
        }
        other => panic!("{other:?}"),
    }
    assert!(events.contains(&"checkpoint checkpoint-step0000000004".into()));
    assert!(!stopped.join("adapter_model.safetensors").exists());
    assert_eq!(steps(&stopped), vec![4, 5], "the newest 2 are kept");
    // A killed run's steps after its checkpoint, and a torn line: dropped.
    let mut lines = read(stopped.join(run::METRICS));
    lines.extend_from_slice(b"{\"step\": 6, \"loss\": 1.0}\n{\"step\": 7, \"lo");
    std::fs::write(stopped.join(run::METRICS), lines).expect("write");

    let (outcome, events) = go(&s, &stopped, &s.settings, true, None);
    assert!(
        matches!(outcome, Ok(Outcome::Finished { .. })),
        "{outcome:?}"
    );
    assert!(events.contains(&"resumed 5".into()), "{events:?}");
    assert!(events.contains(&"step 6".into()) && !events.contains(&"step 5".into()));
    for file in ["adapter_model.safetensors", "adapter_config.json"] {
        assert!(
            read(straight.join(file)) == read(stopped.join(file)),
            "{file} differs"
        );
    }
    let last = checkpoint::dir_name(total);
    for file in ["optimizer.safetensors", "adapter_model.safetensors"] {
        assert!(
            read(straight.join(&last).join(file)) == read(stopped.join(&last).join(file)),
            "{last}/{file} differs"
        );
    }
    let (a, b) = (metrics(&straight), metrics(&stopped));
    assert_eq!(
        a.iter().map(|m| m.0).collect::<Vec<_>>(),
        (1..=12).collect::<Vec<_>>()
    );
    assert_eq!(a, b, "every step once, with the same loss");
    let record = RunRecord::read(&stopped).expect("run.json");
    assert_eq!(record.resumes.len(), 1);
    assert_eq!(record.resumes[0]["from_step"], 5);
}

#[test]
fn a_corrupt_newest_checkpoint_falls_back_to_the_one_before() {
    let s = setup();
    let settings = RunSettings {
        save_steps: Some(1),
        keep_checkpoints: 3,
        ..s.settings.clone()
    };
    let straight = s.tmp.path().join("straight");
    go(&s, &straight, &settings, false, None).0.expect("runs");
    let out = s.tmp.path().join("run");
    let (outcome, _) = go(&s, &out, &settings, false, Some(4));
    assert!(
        matches!(outcome, Ok(Outcome::Stopped { step: 4, .. })),
        "{outcome:?}"
    );
    assert_eq!(steps(&out), vec![2, 3, 4]);
    // Step 4's weights cut short, and what a write killed midway leaves.
    let weights = out.join("checkpoint-step0000000004/adapter_model.safetensors");
    let bytes = read(weights.clone());
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).expect("truncate");
    let tmp = out.join(".checkpoint-step0000000005.tmp");
    std::fs::create_dir_all(&tmp).expect("mkdir");
    std::fs::write(tmp.join("optimizer.safetensors"), b"half").expect("write");

    let (outcome, events) = go(&s, &out, &settings, true, None);
    assert!(
        matches!(outcome, Ok(Outcome::Finished { .. })),
        "{outcome:?}"
    );
    let skipped = events
        .iter()
        .find(|e| e.starts_with("skipped"))
        .unwrap_or_else(|| panic!("no skip in {events:?}"));
    assert!(
        skipped.contains("checkpoint-step0000000004")
            && skipped.contains("adapter_model.safetensors")
            && skipped.contains("truncated or corrupt")
            && skipped.ends_with("as checkpoint-step0000000004.corrupt"),
        "{skipped}"
    );
    assert!(events.contains(&"resumed 3".into()), "{events:?}");
    assert!(events.contains(&"removed .checkpoint-step0000000005.tmp".into()));
    assert!(!tmp.exists());
    assert!(
        out.join("checkpoint-step0000000004.corrupt").is_dir(),
        "kept for a look"
    );
    assert!(
        read(straight.join("adapter_model.safetensors"))
            == read(out.join("adapter_model.safetensors")),
        "the fallback resumes exactly"
    );
    assert_eq!(metrics(&straight), metrics(&out));

    // Nothing that loads: an error naming each, no training.
    let lone = s.tmp.path().join("lone");
    let one = RunSettings {
        options: FinetuneOptions {
            max_steps: Some(1),
            ..settings.options.clone()
        },
        ..settings.clone()
    };
    go(&s, &lone, &one, false, None).0.expect("runs");
    let state = lone
        .join("checkpoint-step0000000001")
        .join(checkpoint::STATE_FILE);
    std::fs::write(&state, b"{\"format\": 1, \"st").expect("write");
    let e = go(&s, &lone, &one, true, None)
        .0
        .expect_err("refused")
        .to_string();
    assert!(
        e.contains("no checkpoint loads") && e.contains("trainer_state.json is not valid JSON"),
        "{e}"
    );
}

#[test]
fn another_model_data_or_shaping_setting_is_refused_naming_which() {
    let s = setup();
    let out = s.tmp.path().join("run");
    let (outcome, _) = go(&s, &out, &s.settings, false, Some(2));
    assert!(
        matches!(outcome, Ok(Outcome::Stopped { .. })),
        "{outcome:?}"
    );
    let before = read(out.join(run::RUN_RECORD));

    // The data file edited.
    let mut edited = read(s.settings.data.clone());
    edited.extend_from_slice(b"{\"text\": \"one more\"}\n");
    std::fs::write(&s.settings.data, &edited).expect("write");
    let e = go(&s, &out, &s.settings, true, None)
        .0
        .expect_err("refused")
        .to_string();
    assert!(
        e.contains("the data file") && e.contains("train.jsonl"),
        "{e}"
    );
    std::fs::write(&s.settings.data, FIVE).expect("write");

    // A model directory whose config.json differs (same weights).
    let copy = s.tmp.path().join("model");
    std::fs::create_dir_all(&copy).expect("mkdir");
    for file in ["model.safetensors", "tokenizer.json", "config.json"] {
        std::fs::copy(fixture("llama").join(file), copy.join(file)).expect("copy");
    }
    let config = String::from_utf8(read(copy.join("config.json"))).expect("utf-8");
    std::fs::write(
        copy.join("config.json"),
        config.replace("\"initializer_range\": 0.2", "\"initializer_range\": 0.3"),
    )
    .expect("write");
    let other = Setup {
        tmp: tempfile::tempdir().expect("tempdir"),
        model: Model::load(&copy).expect("loads"),
        data: load_data(&s.model, &s.settings.data),
        settings: s.settings.clone(),
    };
    let moved = RunSettings {
        model: copy.clone(),
        ..s.settings.clone()
    };
    let e = go(&other, &out, &moved, true, None)
        .0
        .expect_err("refused")
        .to_string();
    assert!(
        e.contains("the model") && e.contains("config.json changed"),
        "{e}"
    );

    // A setting that shapes the result.
    let r8 = RunSettings {
        options: FinetuneOptions {
            r: 8,
            ..s.settings.options.clone()
        },
        ..s.settings.clone()
    };
    let e = go(&s, &out, &r8, true, None)
        .0
        .expect_err("refused")
        .to_string();
    assert!(
        e.contains("`r` is 4") && e.contains("cannot change on resume"),
        "{e}"
    );
    let e = go(&s, &out, &s.settings, false, None)
        .0
        .expect_err("refused")
        .to_string();
    assert!(e.contains("holds a fine-tuning run already"), "{e}");
    assert!(
        read(out.join(run::RUN_RECORD)) == before,
        "refusals leave run.json"
    );

    // An allowed change is recorded, and the model copied elsewhere
    // (same files) is the same model.
    let same = s.tmp.path().join("same");
    std::fs::create_dir_all(&same).expect("mkdir");
    for file in ["model.safetensors", "tokenizer.json", "config.json"] {
        std::fs::copy(fixture("llama").join(file), same.join(file)).expect("copy");
    }
    let changed = RunSettings {
        model: same.clone(),
        options: FinetuneOptions {
            lr: 5e-3,
            epochs: 5,
            ..s.settings.options.clone()
        },
        ..s.settings.clone()
    };
    let moved_model = Setup {
        tmp: tempfile::tempdir().expect("tempdir"),
        model: Model::load(&same).expect("loads"),
        data: load_data(&s.model, &s.settings.data),
        settings: changed.clone(),
    };
    let (outcome, events) = go(&moved_model, &out, &changed, true, None);
    assert!(
        matches!(outcome, Ok(Outcome::Finished { step: 15, .. })),
        "{outcome:?}"
    );
    for key in ["model", "lr", "epochs"] {
        assert!(events.contains(&format!("changed {key}")), "{events:?}");
    }
    let record = RunRecord::read(&out).expect("run.json");
    assert_eq!(record.settings.options.lr, 5e-3);
    assert_eq!(record.settings.options.epochs, 5);
    assert_eq!(record.resumes[0]["changed"]["lr"]["was"], 0.01);
}

#[test]
fn the_newest_k_checkpoints_are_kept() {
    let s = setup();
    let out = s.tmp.path().join("run");
    let settings = RunSettings {
        save_steps: Some(1),
        keep_checkpoints: 3,
        options: FinetuneOptions {
            max_steps: Some(7),
            ..s.settings.options.clone()
        },
        ..s.settings.clone()
    };
    let (outcome, events) = go(&s, &out, &settings, false, None);
    assert!(
        matches!(outcome, Ok(Outcome::Finished { step: 7, .. })),
        "{outcome:?}"
    );
    assert_eq!(steps(&out), vec![5, 6, 7]);
    assert_eq!(events.iter().filter(|e| e.starts_with("pruned")).count(), 4);
    assert_eq!(metrics(&out).len(), 7);
    // The default: a checkpoint at each epoch's end (every 3 steps here)
    // and at the end, the newest 2 kept.
    let out = s.tmp.path().join("default");
    let settings = RunSettings {
        save_steps: None,
        options: FinetuneOptions {
            max_steps: Some(8),
            ..s.settings.options.clone()
        },
        ..s.settings.clone()
    };
    let (_, events) = go(&s, &out, &settings, false, None);
    let written: Vec<&String> = events
        .iter()
        .filter(|e| e.starts_with("checkpoint"))
        .collect();
    assert_eq!(
        written,
        [
            "checkpoint checkpoint-step0000000003",
            "checkpoint checkpoint-step0000000006",
            "checkpoint checkpoint-step0000000008"
        ]
    );
    assert_eq!(steps(&out), vec![6, 8]);
}
