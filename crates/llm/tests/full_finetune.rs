//! The full fine-tune (`finetune::full`) and the trained model written as a
//! Hugging Face directory (`merge::write_model_dir`) on the three fixtures:
//!
//! - llama (f32): a few AdamW steps over every weight lower the loss; the
//!   written directory reloads to the trained model's logits exactly (the
//!   same f32 bits in every tensor), every weight tensor changed, every
//!   other file byte-identical.
//! - qwen2 (bf16, tied head): the written tensors stay bf16 and are the
//!   trained f32 weights rounded to nearest even, so the reloaded model is
//!   exactly the trained one with every weight rounded to bf16 (logits
//!   equal), and within 0.15 of the unrounded trained model's logits (bf16
//!   keeps 8 significant bits: each weight moves by up to 2⁻⁹ of itself;
//!   tests/merge.rs bounds the same effect on a merge); no head of its own.
//! - gpt2 (five shards, fused c_attn): the same shard names, the index
//!   byte-identical, the trained logits exactly.
//!
//! Plus batch × accumulate giving the same steps (token-weighted), the
//! trainer's steps and `max_steps`, and the refusals.

mod common;

use std::path::Path;

use common::*;
use headroom_llm::data::{load_jsonl, DataOptions, Dataset};
use headroom_llm::finetune::full::{finetune_full, FullOptions, FullTrainer};
use headroom_llm::finetune::LrSchedule;
use headroom_llm::merge::write_model_dir;
use headroom_llm::{Model, Tokenizer};
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;

fn dataset(name: &str, model: &Model) -> (tempfile::TempDir, Dataset) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let path = tmp.path().join("train.jsonl");
    std::fs::write(
        &path,
        "{\"text\": \"The lazy fox trains a frozen model.\"}\n\
         {\"prompt\": \"The quick brown\", \"completion\": \" fox within the memory it has\"}\n\
         {\"text\": \"piece by piece, the lazy fox\"}\n",
    )
    .expect("write");
    let tok = Tokenizer::load(&fixture(name)).expect("tokenizer");
    let data = load_jsonl(
        &path,
        &tok,
        model.config.eos_token_ids.first().copied(),
        DataOptions::default(),
    )
    .expect("data");
    (tmp, data)
}

fn mean_loss(model: &Model, data: &Dataset) -> f32 {
    let sum: f32 = data
        .examples
        .iter()
        .map(|e| {
            model
                .loss(
                    std::slice::from_ref(&e.ids),
                    std::slice::from_ref(&e.labels),
                )
                .expect("loss")
        })
        .sum();
    sum / data.examples.len() as f32
}

fn options(epochs: usize, lr: f32) -> FullOptions {
    FullOptions {
        epochs,
        lr,
        batch_size: 2,
        accumulate: 1,
        schedule: LrSchedule::WarmupCosine { warmup_steps: 1 },
        weight_decay: 0.01,
        max_steps: None,
        seed: 3,
    }
}

/// The fixture trained for `epochs` (two steps each) at `lr`, with its data.
fn trained(name: &str, epochs: usize, lr: f32) -> (Model, Dataset, Vec<f32>) {
    let mut model = Model::load(&fixture(name)).expect("loads");
    let (_tmp, data) = dataset(name, &model);
    let mut losses = Vec::new();
    finetune_full(&mut model, &data, &options(epochs, lr), |log| {
        losses.push(log.loss)
    })
    .expect("trains");
    (model, data, losses)
}

fn logits(model: &Model) -> Vec<f32> {
    let ids = vec![vec![1u32, 17, 42, 99, 7, 250, 3, 64]];
    model.logits(&ids).expect("logits")
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn no_partial_left(parent: &Path) {
    for entry in std::fs::read_dir(parent).expect("read") {
        let name = entry.expect("entry").file_name();
        assert!(
            !name.to_string_lossy().contains(".partial-"),
            "left {name:?}"
        );
    }
}

/// Each weight file's tensors by name: (dtype, bytes).
fn tensors(dir: &Path, files: &[String]) -> Vec<(String, Dtype, Vec<u8>)> {
    let mut out = Vec::new();
    for file in files {
        let bytes = std::fs::read(dir.join(file)).expect("read");
        let st = SafeTensors::deserialize(&bytes).expect("safetensors");
        for (name, view) in st.tensors() {
            out.push((name, view.dtype(), view.data().to_vec()));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[test]
fn a_few_full_steps_lower_the_loss_on_llama() {
    let base = Model::load(&fixture("llama")).expect("loads");
    let (_tmp, data) = dataset("llama", &base);
    let before = mean_loss(&base, &data);
    let (model, data, losses) = trained("llama", 4, 1e-2);
    let after = mean_loss(&model, &data);
    assert_eq!(losses.len(), 8, "two steps an epoch: {losses:?}");
    assert!(after < 0.8 * before, "{before} -> {after} ({losses:?})");
    assert!(losses[7] < losses[1], "{losses:?}");
    // Every weight moved, and the base on disk is untouched.
    for (name, _) in base.weight_names() {
        let (a, b) = (base.weight(&name).unwrap(), model.weight(&name).unwrap());
        assert_ne!(a.data, b.data, "{name} did not change");
    }
    assert_eq!(
        mean_loss(&Model::load(&fixture("llama")).unwrap(), &data),
        before
    );
}

#[test]
fn batch_times_accumulate_gives_the_same_steps() {
    let run = |batch_size, accumulate| {
        let mut model = Model::load(&fixture("llama")).expect("loads");
        let (_tmp, data) = dataset("llama", &model);
        let o = FullOptions {
            batch_size,
            accumulate,
            schedule: LrSchedule::Constant,
            ..options(2, 1e-3)
        };
        let mut losses = Vec::new();
        finetune_full(&mut model, &data, &o, |log| losses.push(log.loss)).expect("trains");
        (model, losses)
    };
    let (a, la) = run(3, 1);
    let (b, lb) = run(1, 3);
    assert_eq!(la.len(), 2);
    assert!(max_diff(&la, &lb) < 1e-4, "{la:?} {lb:?}");
    let (mut off, mut all, mut worst) = (0usize, 0usize, 0f32);
    for (name, _) in a.weight_names() {
        let (wa, wb) = (a.weight(&name).unwrap().data, b.weight(&name).unwrap().data);
        for (x, y) in wa.iter().zip(&wb) {
            let d = (x - y).abs();
            off += usize::from(d > 1e-6);
            worst = worst.max(d);
        }
        all += wa.len();
    }
    // Adam scales each element's step to about lr whatever its gradient's
    // size, so an element whose gradient is f32 noise (near ε = 1e-8) may
    // step differently under another summation order: a handful do (6 of
    // 37,792 here, by up to 2.3e-4 at lr 1e-3); every other weight agrees
    // within 1e-6.
    assert!(off * 1000 < all, "{off} of {all} differ by more than 1e-6");
    assert!(worst < 4e-3, "two steps of lr 1e-3 differ by {worst}");
}

#[test]
fn llama_written_directory_reloads_to_the_trained_logits_exactly() {
    let (model, _, _) = trained("llama", 1, 1e-2);
    let base = Model::load(&fixture("llama")).expect("loads");
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("trained");
    let report = write_model_dir(&model, &fixture("llama"), &out).expect("writes");
    let names: Vec<String> = model.weight_names().into_iter().map(|(n, _)| n).collect();
    let written: Vec<String> = report.tensors.iter().map(|t| t.name.clone()).collect();
    assert_eq!(written, names, "every weight tensor rewritten");
    assert!(report.kept.is_empty(), "{:?}", report.kept);
    assert_eq!(report.weight_files, vec!["model.safetensors".to_string()]);

    let reloaded = Model::load(&out).expect("reloads");
    assert_eq!(logits(&reloaded), logits(&model), "f32 written exactly");
    assert_ne!(logits(&reloaded), logits(&base));
    for name in &names {
        assert_eq!(reloaded.weight(name).unwrap(), model.weight(name).unwrap());
    }
    // Every weight tensor's bytes changed; dtypes, shapes and header kept.
    let files = &report.weight_files;
    let (old, new) = (tensors(&fixture("llama"), files), tensors(&out, files));
    assert_eq!(old.len(), new.len());
    for (o, n) in old.iter().zip(&new) {
        assert_eq!((&o.0, o.1), (&n.0, n.1));
        assert_ne!(o.2, n.2, "{} unchanged", o.0);
    }
    let header = |dir: &Path| {
        let bytes = std::fs::read(dir.join("model.safetensors")).expect("read");
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        bytes[..8 + n].to_vec()
    };
    assert_eq!(header(&out), header(&fixture("llama")));
    // The other files byte for byte; references and the adapter dir left out.
    for file in &report.copied {
        assert_eq!(
            std::fs::read(out.join(file)).unwrap(),
            std::fs::read(fixture("llama").join(file)).unwrap(),
            "{file}"
        );
    }
    for file in ["config.json", "tokenizer.json", "generation_config.json"] {
        assert!(report.copied.iter().any(|c| c == file), "{file} copied");
    }
    assert!(!out.join("reference.safetensors").exists());
    assert!(!out.join("peft_adapter").exists());
    no_partial_left(tmp.path());
}

#[test]
fn qwen2_bf16_is_written_as_the_trained_weights_rounded_to_bf16() {
    let (model, _, _) = trained("qwen2", 1, 1e-2);
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("trained");
    let report = write_model_dir(&model, &fixture("qwen2"), &out).expect("writes");
    assert!(report.tensors.iter().all(|t| t.dtype == "BF16"));
    assert!(report.tensors.iter().all(|t| t.name != "lm_head.weight"));
    let reloaded = Model::load(&out).expect("reloads");
    // The in-memory model with every weight rounded as the writer rounds.
    let mut rounded = Model::load(&fixture("qwen2")).expect("loads");
    for (name, _) in model.weight_names() {
        let w: Vec<f32> = model
            .weight(&name)
            .unwrap()
            .data
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        assert_eq!(reloaded.weight(&name).unwrap().data, w, "{name}");
        rounded.set_weight(&name, &w).unwrap();
    }
    assert_eq!(logits(&reloaded), logits(&rounded));
    let d = max_diff(&logits(&reloaded), &logits(&model));
    assert!(d < 0.15, "bf16 rounding moved the logits by {d}");
    // Every stored tensor changed (the training moves weights by about
    // lr = 1e-2, more than bf16's step at their size).
    let files = &report.weight_files;
    for (o, n) in tensors(&fixture("qwen2"), files)
        .iter()
        .zip(&tensors(&out, files))
    {
        assert_ne!(o.2, n.2, "{} unchanged", o.0);
    }
}

#[test]
fn gpt2_written_directory_keeps_its_shards_and_index() {
    let (model, _, _) = trained("gpt2", 1, 1e-2);
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("trained");
    let report = write_model_dir(&model, &fixture("gpt2"), &out).expect("writes");
    let shards: Vec<String> = (1..=5)
        .map(|i| format!("model-0000{i}-of-00005.safetensors"))
        .collect();
    assert_eq!(report.weight_files, shards);
    let index = "model.safetensors.index.json";
    assert_eq!(
        std::fs::read(out.join(index)).unwrap(),
        std::fs::read(fixture("gpt2").join(index)).unwrap()
    );
    let written: Vec<String> = report.tensors.iter().map(|t| t.name.clone()).collect();
    let names: Vec<String> = model.weight_names().into_iter().map(|(n, _)| n).collect();
    assert_eq!(written, names);
    let reloaded = Model::load(&out).expect("reloads");
    assert_eq!(logits(&reloaded), logits(&model));
}

#[test]
fn refused_outputs_and_non_finite_weights_write_nothing() {
    let model_dir = copy_fixture("llama");
    let dir = model_dir.path();
    let mut model = Model::load(dir).expect("loads");
    let err = |model: &Model, out: &Path| {
        write_model_dir(model, dir, out)
            .expect_err("refused")
            .to_string()
    };
    assert!(err(&model, dir).contains("is the model directory"));
    let e = err(&model, &dir.join("trained"));
    assert!(e.contains("is inside the model directory"), "{e}");
    assert!(!dir.join("trained").exists());

    let tmp = tempfile::tempdir().expect("tempdir");
    let existing = tmp.path().join("existing");
    std::fs::create_dir(&existing).unwrap();
    std::fs::write(existing.join("keep.txt"), "mine").unwrap();
    let e = err(&model, &existing);
    assert!(
        e.contains("not empty") && e.contains("refusing to overwrite"),
        "{e}"
    );
    assert_eq!(
        std::fs::read_to_string(existing.join("keep.txt")).unwrap(),
        "mine"
    );

    // A NaN in one weight: an error naming it, and nothing under the name.
    let name = "model.layers.1.mlp.up_proj.weight";
    let mut w = model.weight(name).unwrap().data;
    w[5] = f32::NAN;
    model.set_weight(name, &w).unwrap();
    let out = tmp.path().join("nan");
    let e = err(&model, &out);
    assert!(e.contains(name) && e.contains("trained"), "{e}");
    assert!(!out.exists());
    no_partial_left(tmp.path());

    // Another model's weights do not fit this base.
    let gpt2 = Model::load(&fixture("gpt2")).unwrap();
    let e = err(&gpt2, &tmp.path().join("other"));
    assert!(
        e.contains("transformer.") && e.contains("is missing"),
        "{e}"
    );
}

#[test]
fn the_trainer_reports_each_step_and_stops_at_max_steps() {
    let mut model = Model::load(&fixture("llama")).expect("loads");
    let (_tmp, data) = dataset("llama", &model);
    let o = FullOptions {
        max_steps: Some(3),
        ..options(5, 1e-3)
    };
    let mut trainer = FullTrainer::new(&mut model, &data, &o).expect("trainer");
    assert_eq!(trainer.total_steps(), 3);
    let mut logs = Vec::new();
    while !trainer.done() {
        logs.push(trainer.step().expect("step"));
    }
    assert_eq!(logs.iter().map(|l| l.step).collect::<Vec<_>>(), [1, 2, 3]);
    assert_eq!(
        logs.iter().map(|l| l.examples).collect::<Vec<_>>(),
        [2, 1, 2]
    );
    assert_eq!(logs[1].lr, 1e-3, "warm-up over one step, then the cosine");
    assert!(trainer.step().is_err());
    let bad = FullOptions {
        lr: -1.0,
        ..options(1, 1e-3)
    };
    assert!(FullTrainer::new(&mut model, &data, &bad).is_err());
}

/// By hand (check_finetuned_loads.py): with `HEADROOM_FULLFT_OUT` set, each
/// fixture trained as above is written to `OUT/NAME_trained`, with the
/// logits our loader computes from that directory on the fixture's
/// `input_ids` in `OUT/NAME_ours.f32` (little-endian f32, row-major).
#[test]
#[ignore = "by hand: writes files for the Python check; HEADROOM_FULLFT_OUT=DIR cargo test -p headroom-llm --test full_finetune write_trained -- --ignored"]
fn write_trained_for_transformers_when_asked() {
    let Some(out) = std::env::var_os("HEADROOM_FULLFT_OUT") else {
        panic!("set HEADROOM_FULLFT_OUT to the directory to write into");
    };
    let out = std::path::PathBuf::from(out);
    std::fs::create_dir_all(&out).expect("mkdir");
    for name in MODELS {
        let (model, _, _) = trained(name, 1, 1e-2);
        let dir = out.join(format!("{name}_trained"));
        write_model_dir(&model, &fixture(name), &dir).expect("writes");
        let ids = as_ids(&Reference::load(name).rows("input_ids"));
        let ours = Model::load(&dir)
            .expect("reloads")
            .logits(&ids)
            .expect("logits");
        let bytes: Vec<u8> = ours.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(out.join(format!("{name}_ours.f32")), bytes).expect("write");
    }
}
