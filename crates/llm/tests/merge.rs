//! Merged models written as Hugging Face directories (`merge::merge_to_dir`)
//! on the three fixtures, GPT-2's adapter files, and every refusal.
//!
//! - llama + peft's own adapters: the merged directory loads to peft's
//!   logits (within 2e-5, as tests/peft.rs) and every untouched tensor's
//!   bytes are the base's.
//! - qwen2 (bf16): merged tensors stay bf16 and are exactly the in-memory
//!   f32 merge rounded to bf16; the logits then differ from the in-memory
//!   merge's by that rounding only (tolerance below).
//! - gpt2 (five shards): the same shard names and index; the logits equal
//!   the in-memory merge's (the same f32 arithmetic element by element:
//!   fused c_attn on disk, split q/k/v in memory).

mod common;

use std::path::Path;

use common::*;
use headroom_llm::config::Family;
use headroom_llm::lora::{module_keys, targets, Adapter, Adapters};
use headroom_llm::merge::merge_to_dir;
use headroom_llm::model::Mlp;
use headroom_llm::peft::{
    load_adapters, module_dims, read_config, save_adapters, LoraConfig, ADAPTER_CONFIG,
    ADAPTER_WEIGHTS, CHECKSUM_KEY,
};
use headroom_llm::{Model, ModelConfig};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Adapters on every layer's `target_modules` with A and B drawn from a
/// seeded stream in ±`amp` (B not zero, so the merge changes the model).
fn random_adapters(
    config: &ModelConfig,
    target_modules: &[&str],
    r: usize,
    seed: u64,
    amp: f32,
) -> Adapters {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    let mut draw = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * amp
    };
    let mut adapters = Adapters::new();
    for layer in 0..config.num_layers {
        for target in target_modules {
            for key in module_keys(config.family, layer, target) {
                let (inp, out) = module_dims(config, &key).expect("a module");
                let a = (0..r * inp).map(|_| draw()).collect();
                let b = (0..out * r).map(|_| draw()).collect();
                adapters.insert(
                    key,
                    Adapter {
                        a,
                        b,
                        r,
                        scale: 8.0 / r as f32,
                    },
                );
            }
        }
    }
    adapters
}

fn lora_config(target_modules: &[&str], r: usize) -> LoraConfig {
    let mut target_modules: Vec<String> = target_modules.iter().map(|t| t.to_string()).collect();
    target_modules.sort();
    LoraConfig {
        r,
        alpha: 8.0,
        dropout: 0.0,
        target_modules,
        use_rslora: false,
    }
}

/// Every tensor of the safetensors files in `dir` named by `files`: name →
/// (file, dtype, shape, bytes), and each file's `__metadata__`.
type Tensors = std::collections::BTreeMap<String, (String, Dtype, Vec<usize>, Vec<u8>)>;

fn tensors(dir: &Path, files: &[&str]) -> Tensors {
    let mut all = Tensors::new();
    for file in files {
        let bytes = std::fs::read(dir.join(file)).expect("read");
        let st = SafeTensors::deserialize(&bytes).expect("parses");
        for (name, view) in st.tensors() {
            all.insert(
                name,
                (
                    file.to_string(),
                    view.dtype(),
                    view.shape().to_vec(),
                    view.data().to_vec(),
                ),
            );
        }
    }
    all
}

fn file_metadata(path: &Path) -> Option<std::collections::HashMap<String, String>> {
    let bytes = std::fs::read(path).expect("read");
    let (_, meta) = SafeTensors::read_metadata(&bytes).expect("parses");
    meta.metadata().clone()
}

/// Untouched tensors have the base's bytes, merged ones (and only they)
/// changed, with the same dtype, shape and file.
fn assert_only_merged_changed(base: &Tensors, merged: &Tensors, changed: &[String]) {
    assert_eq!(
        base.keys().collect::<Vec<_>>(),
        merged.keys().collect::<Vec<_>>()
    );
    for (name, (file, dtype, shape, bytes)) in base {
        let (mfile, mdtype, mshape, mbytes) = &merged[name];
        assert_eq!((file, dtype, shape), (mfile, mdtype, mshape), "{name}");
        if changed.contains(name) {
            assert_ne!(bytes, mbytes, "{name} was merged");
        } else {
            assert_eq!(bytes, mbytes, "{name} is untouched");
        }
    }
}

fn no_partial_left(parent: &Path) {
    for entry in std::fs::read_dir(parent).expect("dir") {
        let name = entry.expect("entry").file_name();
        assert!(
            !name.to_string_lossy().contains(".partial-"),
            "left behind: {name:?}"
        );
    }
}

#[test]
fn llama_with_peft_adapters_merges_to_peft_logits() {
    let base_dir = fixture("llama");
    let adapters_dir = base_dir.join("peft_adapter");
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("merged");
    let report = merge_to_dir(&base_dir, &adapters_dir, &out).expect("merges");

    assert_eq!(report.modules.len(), 2 * 3);
    assert_eq!((report.r, report.scale), (4, 2.0));
    assert_eq!(report.weight_files, ["model.safetensors"]);
    assert!(report.tensors.iter().all(|t| t.dtype == "F32"));
    assert_eq!(
        report.copied,
        ["config.json", "generation_config.json", "tokenizer.json"]
    );
    assert!(
        report
            .skipped
            .iter()
            .any(|s| s.starts_with("peft_adapter/"))
            && report
                .skipped
                .iter()
                .any(|s| s.starts_with("reference.safetensors (safetensors, not among")),
        "{:?}",
        report.skipped
    );
    for file in &report.copied {
        assert_eq!(
            std::fs::read(base_dir.join(file)).expect("base"),
            std::fs::read(out.join(file)).expect("merged"),
            "{file} copied byte for byte"
        );
    }
    assert_eq!(
        report.weight_bytes,
        std::fs::metadata(out.join("model.safetensors"))
            .expect("written")
            .len()
    );
    let names: Vec<String> = report.tensors.iter().map(|t| t.name.clone()).collect();
    assert!(names.contains(&"model.layers.1.mlp.down_proj.weight".to_string()));
    assert_only_merged_changed(
        &tensors(&base_dir, &["model.safetensors"]),
        &tensors(&out, &["model.safetensors"]),
        &names,
    );
    assert_eq!(
        file_metadata(&base_dir.join("model.safetensors")),
        file_metadata(&out.join("model.safetensors"))
    );
    no_partial_left(tmp.path());

    let merged = Model::load(&out).expect("the merged directory loads");
    let batch = as_ids(&Reference::load("llama").rows("input_ids"));
    let logits = merged.logits(&batch).expect("logits");
    let (_, expected) =
        Reference::from_file("llama", "peft_adapter_logits.safetensors").f32s("logits");
    let diff = max_diff(&logits, &expected);
    println!("llama merged directory vs peft: max |diff| {diff:e}");
    assert!(diff < 2e-5, "logits differ from peft's by {diff}");

    // The same f32 bits as merging in memory.
    let mut in_memory = Model::load(&base_dir).expect("loads");
    let (adapters, _) = load_adapters(&adapters_dir, &in_memory).expect("loads");
    in_memory.merge_adapters(&adapters).expect("merges");
    for (a, b) in in_memory.blocks.iter().zip(&merged.blocks) {
        assert_eq!(a.q.weight, b.q.weight);
        assert_eq!(a.v.weight, b.v.weight);
    }
}

#[test]
fn qwen2_bf16_stays_bf16_and_matches_the_in_memory_merge() {
    let base_dir = fixture("qwen2");
    let mut model = Model::load(&base_dir).expect("loads");
    let all = targets(Family::Llama);
    let adapters = random_adapters(&model.config, all, 4, 3, 0.1);
    let tmp = tempfile::tempdir().expect("tempdir");
    let adapters_dir = tmp.path().join("adapters");
    save_adapters(&adapters_dir, &model, &adapters, &lora_config(all, 4)).expect("writes");
    let out = tmp.path().join("merged");
    let report = merge_to_dir(&base_dir, &adapters_dir, &out).expect("merges");
    assert_eq!(report.tensors.len(), 2 * 7);
    assert!(
        report.tensors.iter().all(|t| t.dtype == "BF16"),
        "{:?}",
        report.tensors
    );
    let names: Vec<String> = report.tensors.iter().map(|t| t.name.clone()).collect();
    let (base_t, merged_t) = (
        tensors(&base_dir, &["model.safetensors"]),
        tensors(&out, &["model.safetensors"]),
    );
    assert_only_merged_changed(&base_t, &merged_t, &names);
    assert!(merged_t
        .values()
        .all(|(_, dtype, _, _)| *dtype == Dtype::BF16));

    let batch = as_ids(&Reference::load("qwen2").rows("input_ids"));
    let base_logits = model.logits(&batch).expect("logits");
    model.merge_adapters(&adapters).expect("merges");
    let reloaded = Model::load(&out).expect("the merged directory loads");
    // Each merged weight is the in-memory f32 merge rounded to bf16 (round
    // to nearest even), exactly.
    for (a, b) in model.blocks.iter().zip(&reloaded.blocks) {
        let (
            Mlp::SwiGlu { gate, up, down },
            Mlp::SwiGlu {
                gate: g2,
                up: u2,
                down: d2,
            },
        ) = (&a.mlp, &b.mlp)
        else {
            panic!("Qwen2 has SwiGLU")
        };
        for (x, y) in [
            (&a.q, &b.q),
            (&a.k, &b.k),
            (&a.v, &b.v),
            (&a.o, &b.o),
            (gate, g2),
            (up, u2),
            (down, d2),
        ] {
            let rounded: Vec<f32> = x
                .weight
                .to_f32()
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_f32())
                .collect();
            assert_eq!(rounded, y.weight.to_f32());
        }
    }
    // Tolerance: the reloaded weights are the in-memory merge rounded to
    // bf16 (asserted bit for bit above), so the logits differ by that
    // rounding alone: bf16 keeps 8 significant bits, each merged weight
    // moves by up to 2^-9 (0.2%) of itself, and through 14 matrices in two
    // layers that moves these logits (max |logit| about 4.5, rms 1.1) by
    // 5.3e-2 here. 0.15 allows about three times that; the same merge with
    // one of its 14 adapters left out is further off than that (asserted,
    // so the tolerance does tell a wrong merge).
    let in_memory = model.logits(&batch).expect("logits");
    let logits = reloaded.logits(&batch).expect("logits");
    let diff = max_diff(&logits, &in_memory);
    let moved = max_diff(&base_logits, &in_memory);
    let mut partial = Model::load(&base_dir).expect("loads");
    let mut fewer = adapters.clone();
    fewer.remove("layers.1.self_attn.v_proj");
    partial.merge_adapters(&fewer).expect("merges");
    let missing = max_diff(&partial.logits(&batch).expect("logits"), &in_memory);
    println!(
        "qwen2 bf16 merged vs in-memory: max |diff| {diff:e}; the merge moved logits by {moved}, one adapter left out by {missing}"
    );
    assert!(moved > 0.3, "the adapters change the model: {moved}");
    assert!(missing > 0.15, "one adapter fewer: {missing}");
    assert!(diff < 0.15, "bf16 merge differs by {diff}");
}

const GPT2_SHARDS: [&str; 5] = [
    "model-00001-of-00005.safetensors",
    "model-00002-of-00005.safetensors",
    "model-00003-of-00005.safetensors",
    "model-00004-of-00005.safetensors",
    "model-00005-of-00005.safetensors",
];

#[test]
fn gpt2_sharded_merge_keeps_the_layout_and_the_in_memory_logits() {
    let base_dir = fixture("gpt2");
    let mut model = Model::load(&base_dir).expect("loads");
    let adapters = random_adapters(&model.config, &["c_attn", "c_proj", "c_fc"], 2, 5, 0.3);
    assert_eq!(adapters.len(), 2 * 4);
    let tmp = tempfile::tempdir().expect("tempdir");
    let adapters_dir = tmp.path().join("adapters");
    save_adapters(
        &adapters_dir,
        &model,
        &adapters,
        &lora_config(&["c_attn", "c_proj", "c_fc"], 2),
    )
    .expect("writes");
    let out = tmp.path().join("merged");
    let report = merge_to_dir(&base_dir, &adapters_dir, &out).expect("merges");
    assert_eq!(report.weight_files, GPT2_SHARDS);
    assert!(report
        .copied
        .contains(&"model.safetensors.index.json".to_string()));
    assert_eq!(
        std::fs::read(base_dir.join("model.safetensors.index.json")).expect("read"),
        std::fs::read(out.join("model.safetensors.index.json")).expect("read")
    );
    let names: Vec<String> = report.tensors.iter().map(|t| t.name.clone()).collect();
    assert_eq!(names.len(), 8);
    assert!(names.contains(&"transformer.h.1.attn.c_attn.weight".to_string()));
    assert!(names.contains(&"transformer.h.0.mlp.c_proj.weight".to_string()));
    assert_only_merged_changed(
        &tensors(&base_dir, &GPT2_SHARDS),
        &tensors(&out, &GPT2_SHARDS),
        &names,
    );
    for shard in GPT2_SHARDS {
        assert_eq!(
            file_metadata(&base_dir.join(shard)),
            file_metadata(&out.join(shard))
        );
    }

    let batch = as_ids(&Reference::load("gpt2").rows("input_ids"));
    let base_logits = model.logits(&batch).expect("logits");
    model.merge_adapters(&adapters).expect("merges in memory");
    let in_memory = model.logits(&batch).expect("logits");
    let reloaded = Model::load(&out).expect("the merged directory loads");
    let logits = reloaded.logits(&batch).expect("logits");
    let (diff, moved) = (
        max_diff(&logits, &in_memory),
        max_diff(&base_logits, &in_memory),
    );
    println!("gpt2 merged vs in-memory: max |diff| {diff:e}; the merge moved logits {moved}");
    assert!(moved > 0.1, "the adapters change the model: {moved}");
    assert!(diff <= 1e-6, "{diff}");
    // Fused c_attn on disk, split q/k/v in memory: the same bits.
    for (a, b) in model.blocks.iter().zip(&reloaded.blocks) {
        assert_eq!((&a.q.weight, &a.k.weight), (&b.q.weight, &b.k.weight));
        assert_eq!(a.v.weight, b.v.weight);
    }
}

#[test]
fn gpt2_adapters_round_trip_with_peft_names() {
    let model = Model::load(&fixture("gpt2")).expect("loads");
    let adapters = random_adapters(&model.config, &["c_attn", "c_proj"], 2, 9, 0.3);
    let config = lora_config(&["c_attn", "c_proj"], 2);
    let tmp = tempfile::tempdir().expect("tempdir");
    save_adapters(tmp.path(), &model, &adapters, &config).expect("writes");

    let file = tmp.path().join(ADAPTER_WEIGHTS);
    let written = tensors(tmp.path(), &[ADAPTER_WEIGHTS]);
    let mut expected = Vec::new();
    for layer in 0..2 {
        for module in ["attn.c_attn", "attn.c_proj", "mlp.c_proj"] {
            for part in ["lora_A", "lora_B"] {
                expected.push(format!(
                    "base_model.model.transformer.h.{layer}.{module}.{part}.weight"
                ));
            }
        }
    }
    expected.sort();
    assert_eq!(written.keys().cloned().collect::<Vec<_>>(), expected);
    let shape = |n: &str| written[n].2.clone();
    assert_eq!(
        shape("base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"),
        [2, 32]
    );
    assert_eq!(
        shape("base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"),
        [96, 2]
    );
    assert_eq!(
        shape("base_model.model.transformer.h.1.mlp.c_proj.lora_A.weight"),
        [2, 128]
    );
    let meta = file_metadata(&file).expect("metadata");
    assert_eq!(meta.get("format").map(String::as_str), Some("pt"));
    assert!(meta[CHECKSUM_KEY].starts_with("crc32:"), "{meta:?}");

    let json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join(ADAPTER_CONFIG)).expect("read"),
    )
    .expect("json");
    assert_eq!(json["fan_in_fan_out"], serde_json::json!(true));
    assert_eq!(
        json["target_modules"],
        serde_json::json!(["c_attn", "c_proj"])
    );
    assert_eq!(read_config(tmp.path()).expect("reads"), config);
    let (again, read) = load_adapters(tmp.path(), &model).expect("reloads");
    assert_eq!(read, config);
    assert_eq!(again.len(), adapters.len());
    for (key, ad) in &adapters {
        assert_eq!((&again[key].a, &again[key].b), (&ad.a, &ad.b), "{key}");
        assert_eq!(again[key].scale, 4.0);
    }

    // fan_in_fan_out false does not describe GPT-2's Conv1D.
    let mut edited = json.clone();
    edited["fan_in_fan_out"] = false.into();
    std::fs::write(tmp.path().join(ADAPTER_CONFIG), edited.to_string()).expect("write");
    let e = load_adapters(tmp.path(), &model)
        .expect_err("refused")
        .to_string();
    assert!(
        e.contains(ADAPTER_CONFIG) && e.contains("fan_in_fan_out") && e.contains("Conv1D"),
        "{e}"
    );
    // And true does not describe Llama's Linear.
    let llama = Model::load(&fixture("llama")).expect("loads");
    let llama_dir = tempfile::tempdir().expect("tempdir");
    let (peft_adapters, peft_config) =
        load_adapters(&fixture("llama").join("peft_adapter"), &llama).expect("loads");
    save_adapters(llama_dir.path(), &llama, &peft_adapters, &peft_config).expect("writes");
    let path = llama_dir.path().join(ADAPTER_CONFIG);
    let mut j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    assert_eq!(j["fan_in_fan_out"], serde_json::json!(false));
    j["fan_in_fan_out"] = true.into();
    std::fs::write(&path, j.to_string()).expect("write");
    let e = load_adapters(llama_dir.path(), &llama)
        .expect_err("refused")
        .to_string();
    assert!(
        e.contains("fan_in_fan_out") && e.contains("[out, in]"),
        "{e}"
    );
    // Llama's targets are not GPT-2's.
    let e = save_adapters(tmp.path(), &model, &adapters, &lora_config(&["q_proj"], 2))
        .expect_err("refused")
        .to_string();
    assert!(
        e.contains("q_proj") && e.contains("c_attn, c_proj, c_fc"),
        "{e}"
    );
}

/// llama's peft adapters written by save_adapters into a temporary
/// directory, with `edit` applied to their values first.
fn saved_llama(edit: impl Fn(&mut Adapters)) -> tempfile::TempDir {
    let model = Model::load(&fixture("llama")).expect("loads");
    let (mut adapters, config) =
        load_adapters(&fixture("llama").join("peft_adapter"), &model).expect("loads");
    edit(&mut adapters);
    let tmp = tempfile::tempdir().expect("tempdir");
    save_adapters(&tmp.path().join("adapters"), &model, &adapters, &config).expect("writes");
    tmp
}

#[test]
fn checksum_is_verified() {
    let model = Model::load(&fixture("llama")).expect("loads");
    let tmp = saved_llama(|_| {});
    let dir = tmp.path().join("adapters");
    let file = dir.join(ADAPTER_WEIGHTS);
    load_adapters(&dir, &model).expect("intact files load");

    // One byte of the last tensor's data flipped: same shapes, other values.
    let mut bytes = std::fs::read(&file).expect("read");
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&file, &bytes).expect("write");
    let e = load_adapters(&dir, &model)
        .expect_err("mismatch")
        .to_string();
    assert!(
        e.contains(ADAPTER_WEIGHTS)
            && e.contains("checksum mismatch")
            && e.matches("crc32:").count() == 2,
        "{e}"
    );
    let e = merge_to_dir(&fixture("llama"), &dir, &tmp.path().join("out"))
        .expect_err("refused")
        .to_string();
    assert!(e.contains("checksum mismatch"), "{e}");
    assert!(!tmp.path().join("out").exists());

    // lora_alpha edited in the config: the recorded sum covers it.
    bytes[last] ^= 0x40;
    std::fs::write(&file, &bytes).expect("write");
    load_adapters(&dir, &model).expect("restored");
    let path = dir.join(ADAPTER_CONFIG);
    let mut j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    j["lora_alpha"] = 16.into();
    std::fs::write(&path, j.to_string()).expect("write");
    let e = load_adapters(&dir, &model)
        .expect_err("mismatch")
        .to_string();
    assert!(e.contains("checksum mismatch"), "{e}");
}

#[test]
fn non_finite_and_misshapen_adapters_are_refused() {
    let key = "layers.1.self_attn.v_proj";
    let nan = saved_llama(|a| {
        if let Some(ad) = a.get_mut(key) {
            ad.b[5] = f32::NAN;
        }
    });
    let dir = nan.path().join("adapters");
    let out = nan.path().join("out");
    let e = merge_to_dir(&fixture("llama"), &dir, &out)
        .expect_err("NaN refused")
        .to_string();
    assert!(
        e.contains(ADAPTER_WEIGHTS)
            && e.contains("base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight")
            && e.contains("NaN")
            && e.contains("element 5"),
        "{e}"
    );
    assert!(!out.exists());
    no_partial_left(nan.path());

    // In memory: named, and the model left unchanged.
    let mut model = Model::load(&fixture("llama")).expect("loads");
    let (mut adapters, _) = load_adapters(&dir, &model).expect("a NaN still reads");
    let before = model.blocks[0].q.weight.clone();
    let e = model
        .merge_adapters(&adapters)
        .expect_err("NaN refused")
        .to_string();
    assert!(
        e.contains("v_proj.lora_B.weight") && e.contains("NaN"),
        "{e}"
    );
    assert_eq!(model.blocks[0].q.weight, before, "nothing merged");
    if let Some(ad) = adapters.get_mut(key) {
        ad.b[5] = f32::INFINITY;
    }
    let e = model
        .merge_adapters(&adapters)
        .expect_err("inf")
        .to_string();
    assert!(e.contains("inf"), "{e}");
    if let Some(ad) = adapters.get_mut(key) {
        ad.b[5] = 0.0;
        ad.a.pop();
    }
    let e = model
        .merge_adapters(&adapters)
        .expect_err("shape refused")
        .to_string();
    assert!(
        e.contains("base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight")
            && e.contains("needs shape [4, 32]"),
        "{e}"
    );

    // A file whose lora_A has the wrong shape (no checksum: as peft writes).
    let tmp = tempfile::tempdir().expect("tempdir");
    let src =
        std::fs::read(fixture("llama").join("peft_adapter").join(ADAPTER_WEIGHTS)).expect("read");
    let st = SafeTensors::deserialize(&src).expect("parses");
    let name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
    let wide: Vec<u8> = st.tensor(name).expect("t").data().repeat(2);
    let mut views = Vec::new();
    for (n, v) in st.tensors() {
        if n == name {
            views.push((
                n,
                TensorView::new(Dtype::F32, vec![4, 64], &wide).expect("v"),
            ));
        } else {
            views.push((n, v));
        }
    }
    let dir = tmp.path().join("adapters");
    std::fs::create_dir(&dir).expect("mkdir");
    std::fs::write(
        dir.join(ADAPTER_WEIGHTS),
        safetensors::serialize(views, None).expect("serialize"),
    )
    .expect("write");
    std::fs::copy(
        fixture("llama").join("peft_adapter").join(ADAPTER_CONFIG),
        dir.join(ADAPTER_CONFIG),
    )
    .expect("copy");
    let e = merge_to_dir(&fixture("llama"), &dir, &tmp.path().join("out"))
        .expect_err("shape refused")
        .to_string();
    assert!(
        e.contains(ADAPTER_WEIGHTS) && e.contains(name) && e.contains("[4, 32]"),
        "{e}"
    );

    // Adapters whose config does not fit the model: llama's on GPT-2.
    let e = merge_to_dir(
        &fixture("gpt2"),
        &fixture("llama").join("peft_adapter"),
        &tmp.path().join("out"),
    )
    .expect_err("refused")
    .to_string();
    assert!(
        e.contains(ADAPTER_CONFIG) && e.contains("GPT2LMHeadModel") && e.contains("down_proj"),
        "{e}"
    );
    assert!(!tmp.path().join("out").exists());
}

#[test]
fn outputs_that_would_overwrite_are_refused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model_dir = copy_fixture("llama");
    let adapters = fixture("llama").join("peft_adapter");
    let model = model_dir.path();
    let err = |out: &Path| {
        merge_to_dir(model, &adapters, out)
            .expect_err("refused")
            .to_string()
    };

    let e = err(model);
    assert!(e.contains("is the model directory"), "{e}");
    let e = err(&model.join("merged"));
    assert!(e.contains("is inside the model directory"), "{e}");
    assert!(!model.join("merged").exists());
    let e = err(&adapters);
    assert!(e.contains("is the adapters directory"), "{e}");
    let e = err(&adapters.join("sub").join("merged"));
    assert!(e.contains("is inside the adapters directory"), "{e}");

    let existing = tmp.path().join("existing");
    std::fs::create_dir(&existing).expect("mkdir");
    std::fs::write(existing.join("keep.txt"), "mine").expect("write");
    let e = err(&existing);
    assert!(
        e.contains("existing") && e.contains("not empty") && e.contains("refusing to overwrite"),
        "{e}"
    );
    assert_eq!(
        std::fs::read_to_string(existing.join("keep.txt")).expect("kept"),
        "mine"
    );
    let file = tmp.path().join("a-file");
    std::fs::write(&file, "x").expect("write");
    assert!(err(&file).contains("not a directory"));

    // An existing empty directory is filled; a missing parent is made.
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).expect("mkdir");
    merge_to_dir(model, &adapters, &empty).expect("an empty output is used");
    assert!(empty.join("model.safetensors").is_file());
    let nested = tmp.path().join("a").join("b");
    merge_to_dir(model, &adapters, &nested).expect("parents made");
    Model::load(&nested).expect("loads");
}

#[test]
fn a_merge_that_fails_midway_leaves_nothing() {
    // Finite adapters whose product overflows f32 in the last shard's
    // tensors: the first shards are written before the failure.
    let base_dir = fixture("gpt2");
    let model = Model::load(&base_dir).expect("loads");
    let mut adapters = random_adapters(&model.config, &["c_fc"], 2, 1, 0.3);
    if let Some(ad) = adapters.get_mut("h.1.mlp.c_fc") {
        ad.a.fill(1e20);
        ad.b.fill(1e20);
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let adapters_dir = tmp.path().join("adapters");
    save_adapters(&adapters_dir, &model, &adapters, &lora_config(&["c_fc"], 2)).expect("writes");
    let out = tmp.path().join("merged");
    let e = merge_to_dir(&base_dir, &adapters_dir, &out)
        .expect_err("overflow refused")
        .to_string();
    assert!(
        e.contains("transformer.h.1.mlp.c_fc.weight") && e.contains("not finite"),
        "{e}"
    );
    assert!(!out.exists(), "no output under its name");
    no_partial_left(tmp.path());
}

/// With HEADROOM_MERGE_OUT set, writes merged directories there for the
/// by-hand check that transformers loads them as peft's adapted models
/// (fixtures/check_merged_loads.py, docs/llm.md): llama with peft's
/// adapters; gpt2 and qwen2 with seeded adapters saved by save_adapters.
#[test]
#[ignore = "by hand: writes files for the Python check; HEADROOM_MERGE_OUT=DIR cargo test -p headroom-llm --test merge write_merged -- --ignored"]
fn write_merged_for_transformers_when_asked() {
    let Some(out) = std::env::var_os("HEADROOM_MERGE_OUT") else {
        panic!("set HEADROOM_MERGE_OUT to the directory to write into");
    };
    let out = std::path::PathBuf::from(out);
    merge_to_dir(
        &fixture("llama"),
        &fixture("llama").join("peft_adapter"),
        &out.join("llama_merged"),
    )
    .expect("llama merges");
    for (name, target_modules, r, amp) in [
        ("gpt2", &["c_attn", "c_proj", "c_fc"][..], 2, 0.3),
        ("qwen2", targets(Family::Llama), 4, 0.1),
    ] {
        let model = Model::load(&fixture(name)).expect("loads");
        let adapters = random_adapters(&model.config, target_modules, r, 5, amp);
        let dir = out.join(format!("{name}_adapters"));
        save_adapters(&dir, &model, &adapters, &lora_config(target_modules, r)).expect("writes");
        merge_to_dir(&fixture(name), &dir, &out.join(format!("{name}_merged"))).expect("merges");
    }
}
