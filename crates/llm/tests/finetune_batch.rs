//! Batches above 1 on the llama fixture: right padding changes no real
//! token's result (a padded batch of two gives each example's own loss and
//! gradients, token-weighted), and a step's gradient is that of the mean
//! over its counted tokens, so batch 4 × accumulate 1 trains as batch 1 ×
//! accumulate 4.

mod common;

use common::*;
use headroom_llm::data::{load_jsonl, DataOptions, Dataset, Example};
use headroom_llm::finetune::batch::{counted, pad, pad_id};
use headroom_llm::finetune::{finetune, FinetuneOptions};
use headroom_llm::lora::{new_adapters, AdapterGrads};
use headroom_llm::{Model, ModelConfig, Tokenizer};

fn dataset(model: &Model, lines: &str) -> (tempfile::TempDir, Dataset) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let path = tmp.path().join("train.jsonl");
    std::fs::write(&path, lines).expect("write");
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

const FIVE: &str = "{\"text\": \"The lazy fox trains a frozen model.\"}\n\
    {\"prompt\": \"The quick brown\", \"completion\": \" fox within the memory it has\"}\n\
    {\"text\": \"piece by piece, the lazy fox\"}\n\
    {\"text\": \"memory\"}\n\
    {\"prompt\": \"A frozen\", \"completion\": \" model, piece by piece, within the memory it has.\"}\n";

fn close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
        .fold(0.0f32, f32::max);
    assert!(worst <= tol, "{what}: largest difference {worst}");
}

#[test]
fn a_padded_batch_gives_each_examples_own_loss_and_gradients() {
    let model = Model::load(&fixture("llama")).expect("loads");
    let (_tmp, data) = dataset(&model, FIVE);
    let mut adapters =
        new_adapters(&model, 4, 8.0, &["q_proj", "v_proj", "down_proj"], 1).expect("adapters");
    // B away from zero, so that A's gradients are not zero either.
    let mut keys: Vec<String> = adapters.keys().cloned().collect();
    keys.sort();
    for (k, key) in keys.iter().enumerate() {
        let ad = adapters.get_mut(key).expect("key");
        for (i, b) in ad.b.iter_mut().enumerate() {
            *b = ((i * 7 + k * 13) % 11) as f32 * 0.01 - 0.05;
        }
    }
    let (short, long) = (&data.examples[3], &data.examples[4]);
    assert!(
        short.ids.len() + 5 < long.ids.len(),
        "rows of unequal length"
    );
    let alone = |e: &Example| {
        model
            .lora_gradients(
                &adapters,
                std::slice::from_ref(&e.ids),
                std::slice::from_ref(&e.labels),
            )
            .expect("gradients")
    };
    let ((l1, g1), (l2, g2)) = (alone(short), alone(long));
    let (c1, c2) = (counted(&short.labels) as f32, counted(&long.labels) as f32);

    // One example padded far past its end: its own loss and gradients.
    let mut padded = short.clone();
    padded
        .ids
        .resize(short.ids.len() + 6, pad_id(&model.config));
    padded.labels.resize(short.ids.len() + 6, -100);
    let (lp, gp) = alone(&padded);
    assert!((lp - l1).abs() <= 1e-6, "{lp} vs {l1}");
    for key in &keys {
        close(&gp[key].0, &g1[key].0, 1e-6, key);
        close(&gp[key].1, &g1[key].1, 1e-6, key);
    }

    // The two in one padded batch: the token-weighted mean of each's own.
    let batch = pad(&[short, long], pad_id(&model.config));
    assert_eq!(batch.counted as f32, c1 + c2);
    let (l, g): (f32, AdapterGrads) = model
        .lora_gradients(&adapters, &batch.ids, &batch.labels)
        .expect("gradients");
    let want = (c1 * l1 + c2 * l2) / (c1 + c2);
    assert!((l - want).abs() <= 1e-5, "{l} vs {want}");
    let mut moved = 0.0f32;
    for key in &keys {
        for side in 0..2 {
            let pick = |g: &AdapterGrads| {
                if side == 0 {
                    g[key].0.clone()
                } else {
                    g[key].1.clone()
                }
            };
            let mixed: Vec<f32> = pick(&g1)
                .iter()
                .zip(pick(&g2))
                .map(|(a, b)| (c1 * a + c2 * b) / (c1 + c2))
                .collect();
            close(&pick(&g), &mixed, 1e-5, key);
            moved = pick(&g).iter().fold(moved, |m, v| m.max(v.abs()));
        }
    }
    assert!(moved > 1e-3, "the gradients are not all zero: {moved}");
}

#[test]
fn batch_4_by_accumulate_1_is_batch_1_by_accumulate_4() {
    let model = Model::load(&fixture("llama")).expect("loads");
    let (_tmp, data) = dataset(&model, FIVE);
    let train = |batch_size: usize, accumulate: usize| {
        let options = FinetuneOptions {
            r: 4,
            alpha: 8.0,
            target_modules: vec!["q_proj".into(), "v_proj".into(), "down_proj".into()],
            epochs: 3,
            lr: 1e-2,
            batch_size,
            accumulate,
            seed: 5,
            ..FinetuneOptions::default()
        };
        let mut log = Vec::new();
        let (adapters, _) = finetune(&model, &data, &options, |s| log.push(*s)).expect("trains");
        (adapters, log)
    };
    let (a, log_a) = train(4, 1);
    let (b, log_b) = train(1, 4);
    let (c, log_c) = train(2, 2);
    assert_eq!(log_a.len(), 2 * 3, "ceil(5 / 4) steps an epoch");
    for ((x, y), z) in log_a.iter().zip(&log_b).zip(&log_c) {
        assert_eq!((x.tokens, x.examples), (y.tokens, y.examples));
        assert_eq!((x.tokens, x.examples), (z.tokens, z.examples));
        assert!((x.loss - y.loss).abs() < 1e-5, "{} vs {}", x.loss, y.loss);
        assert!((x.loss - z.loss).abs() < 1e-5, "{} vs {}", x.loss, z.loss);
    }
    for (key, ad) in &a {
        close(&ad.a, &b[key].a, 1e-4, key);
        close(&ad.b, &b[key].b, 1e-4, key);
        close(&ad.a, &c[key].a, 1e-4, key);
        close(&ad.b, &c[key].b, 1e-4, key);
    }
    // The step's loss is the mean over its counted tokens, not over its
    // examples: a step of unequal rows tells the two apart.
    let options = FinetuneOptions {
        r: 4,
        target_modules: vec!["q_proj".into()],
        batch_size: 1,
        accumulate: 5,
        max_steps: Some(1),
        seed: 5,
        ..FinetuneOptions::default()
    };
    let mut first = None;
    finetune(&model, &data, &options, |s| first = Some(*s)).expect("trains");
    let first = first.expect("one step");
    let (mut sum, mut tokens, mut per_example) = (0.0f64, 0usize, 0.0f64);
    for e in &data.examples {
        let l = model
            .loss(
                std::slice::from_ref(&e.ids),
                std::slice::from_ref(&e.labels),
            )
            .expect("loss") as f64;
        let c = counted(&e.labels);
        sum += l * c as f64;
        tokens += c;
        per_example += l / data.examples.len() as f64;
    }
    assert_eq!(first.tokens, tokens);
    let weighted = (sum / tokens as f64) as f32;
    assert!(
        (first.loss - weighted).abs() < 1e-5,
        "{} vs {weighted}",
        first.loss
    );
    assert!(
        (weighted - per_example as f32).abs() > 1e-3,
        "the test tells them apart"
    );
}

#[test]
fn the_pad_id_is_the_configs_pad_then_eos_then_0() {
    let dir = fixture("llama");
    let text = std::fs::read_to_string(dir.join("config.json")).expect("config");
    let config = ModelConfig::parse(&text, &dir.join("config.json")).expect("parses");
    assert_eq!(config.pad_token_id, None, "the fixture's is null");
    assert_eq!(pad_id(&config), config.eos_token_ids[0]);
    let with = text.replace("\"pad_token_id\": null", "\"pad_token_id\": 7");
    let config7 = ModelConfig::parse(&with, &dir.join("config.json")).expect("parses");
    assert_eq!(pad_id(&config7), 7);
    let mut none = config;
    none.eos_token_ids.clear();
    assert_eq!(pad_id(&none), 0);
    let bad = text.replace("\"pad_token_id\": null", "\"pad_token_id\": \"x\"");
    let e = ModelConfig::parse(&bad, &dir.join("config.json"))
        .expect_err("refused")
        .to_string();
    assert!(
        e.contains("config.json") && e.contains("pad_token_id"),
        "{e}"
    );
}
