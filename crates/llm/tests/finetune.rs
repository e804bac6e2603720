//! LoRA fine-tuning on the llama fixture: a few steps lower the loss on the
//! examples trained on, the base stays as it was, and the adapters written in
//! peft's files reload into a model whose loss is the trained one.

mod common;

use common::*;
use headroom_llm::data::{load_jsonl, DataOptions, Dataset};
use headroom_llm::finetune::{finetune, FinetuneOptions, LrSchedule};
use headroom_llm::peft::{load_adapters, save_adapters};
use headroom_llm::{Model, Tokenizer};

fn dataset(model: &Model) -> (tempfile::TempDir, Dataset) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let path = tmp.path().join("train.jsonl");
    std::fs::write(
        &path,
        "{\"text\": \"The lazy fox trains a frozen model.\"}\n\
         {\"prompt\": \"The quick brown\", \"completion\": \" fox within the memory it has\"}\n\
         {\"text\": \"piece by piece, the lazy fox\"}\n",
    )
    .expect("write");
    let tok = Tokenizer::load(&fixture("llama")).expect("tokenizer");
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

#[test]
fn a_few_steps_lower_the_loss_and_the_files_reload() {
    let model = Model::load(&fixture("llama")).expect("loads");
    let (_tmp, data) = dataset(&model);
    let before = mean_loss(&model, &data);
    let options = FinetuneOptions {
        r: 4,
        alpha: 8.0,
        target_modules: vec!["q_proj".into(), "v_proj".into(), "down_proj".into()],
        epochs: 8,
        lr: 1e-2,
        accumulate: 2,
        seed: 3,
        ..FinetuneOptions::default()
    };
    let mut log = Vec::new();
    let (adapters, config) = finetune(&model, &data, &options, |s| log.push(*s)).expect("trains");
    assert_eq!(log.len(), 2 * 8, "ceil(3 / 2) steps an epoch");
    assert!(log.iter().all(|s| s.loss.is_finite() && s.lr == 1e-2));
    println!(
        "loss: {before} -> {:?}",
        log.iter().map(|s| s.loss).collect::<Vec<_>>()
    );

    let out = tempfile::tempdir().expect("tempdir");
    save_adapters(out.path(), &model, &adapters, &config).expect("writes");
    let mut adapted = Model::load(&fixture("llama")).expect("loads");
    assert_eq!(mean_loss(&adapted, &data), before, "the base is untouched");
    let (loaded, _) = load_adapters(out.path(), &adapted).expect("reloads");
    adapted.merge_adapters(&loaded).expect("merge");
    let after = mean_loss(&adapted, &data);
    assert!(after < before * 0.8, "loss {before} -> {after}");
    // The merged model's loss is the trained adapters' (unmerged) loss.
    let e = &data.examples[0];
    let (unmerged, _) = model
        .lora_gradients(
            &adapters,
            std::slice::from_ref(&e.ids),
            std::slice::from_ref(&e.labels),
        )
        .expect("loss");
    let merged = adapted
        .loss(
            std::slice::from_ref(&e.ids),
            std::slice::from_ref(&e.labels),
        )
        .expect("loss");
    assert!((merged - unmerged).abs() < 1e-4, "{merged} vs {unmerged}");
}

#[test]
fn schedule_and_refusals() {
    let s = LrSchedule::WarmupCosine { warmup_steps: 2 };
    assert_eq!(s.lr_at(1.0, 0, 10), 0.0);
    assert_eq!(s.lr_at(1.0, 1, 10), 0.5);
    assert_eq!(s.lr_at(1.0, 2, 10), 1.0);
    assert!((s.lr_at(1.0, 6, 10) - 0.5).abs() < 1e-6);
    assert_eq!(LrSchedule::Constant.lr_at(0.3, 7, 10), 0.3);

    let model = Model::load(&fixture("llama")).expect("loads");
    let (_tmp, data) = dataset(&model);
    let run = |o: FinetuneOptions| {
        finetune(&model, &data, &o, |_| {})
            .expect_err("refused")
            .to_string()
    };
    let e = run(FinetuneOptions {
        dropout: 1.0,
        ..FinetuneOptions::default()
    });
    assert!(e.contains("dropout 1"), "{e}");
    let e = run(FinetuneOptions {
        target_modules: vec!["c_attn".into()],
        ..FinetuneOptions::default()
    });
    assert!(e.contains("c_attn"), "{e}");
    let mut steps = 0;
    finetune(
        &model,
        &data,
        &FinetuneOptions {
            max_steps: Some(1),
            accumulate: 1,
            ..FinetuneOptions::default()
        },
        |_| steps += 1,
    )
    .expect("trains");
    assert_eq!(steps, 1, "max_steps stops the loop");

    // Dropout: seeded (a rerun is the same run), and it changes the run.
    let with = |dropout: f32| {
        let options = FinetuneOptions {
            dropout,
            accumulate: 1,
            lr: 1e-2,
            max_steps: Some(3),
            r: 4,
            ..FinetuneOptions::default()
        };
        let mut log = Vec::new();
        finetune(&model, &data, &options, |s| log.push(s.loss)).expect("trains");
        log
    };
    let (a, b, none) = (with(0.3), with(0.3), with(0.0));
    assert_eq!(a, b);
    assert_ne!(a, none);
}
