//! peft's adapter files, both ways, on the llama fixture:
//! fixtures/llama/peft_adapter/ is what peft's `save_pretrained` wrote (r 4,
//! alpha 8 on q/v/down, random B) and peft_adapter_logits.safetensors the
//! logits of base + those adapters. Our reader, merged into the base, must
//! give those logits (within 2e-5: f32 both sides, W + s·B·A summed in
//! another order than peft's separate branch; a wrong scale or a swapped A/B
//! moves them by 1e-2 or more), and our writer must lay out the same names,
//! shapes and config keys.

mod common;

use common::*;
use headroom_llm::peft::{
    load_adapters, read_config, save_adapters, ADAPTER_CONFIG, ADAPTER_WEIGHTS,
};
use headroom_llm::Model;
use safetensors::SafeTensors;

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn peft_adapters_load_and_give_peft_logits() {
    let mut model = Model::load(&fixture("llama")).expect("loads");
    let dir = fixture("llama").join("peft_adapter");
    let (adapters, config) = load_adapters(&dir, &model).expect("peft's adapters load");
    assert_eq!((config.r, config.alpha), (4, 8.0));
    assert_eq!(config.target_modules, ["down_proj", "q_proj", "v_proj"]);
    assert_eq!(adapters.len(), 3 * 2);
    let batch = as_ids(&Reference::load("llama").rows("input_ids"));
    let base = model.logits(&batch).expect("base logits");
    model.merge_adapters(&adapters).expect("merge");
    let ours = model.logits(&batch).expect("adapted logits");
    let (_, expected) =
        Reference::from_file("llama", "peft_adapter_logits.safetensors").f32s("logits");
    assert!(
        max_diff(&base, &expected) > 1e-2,
        "the adapters change the logits"
    );
    let diff = max_diff(&ours, &expected);
    println!("max |diff| vs peft: {diff:e}");
    assert!(diff < 2e-5, "logits differ from peft's by {diff}");
}

#[test]
fn written_adapters_match_peft_layout_and_reload() {
    let model = Model::load(&fixture("llama")).expect("loads");
    let peft_dir = fixture("llama").join("peft_adapter");
    let (adapters, config) = load_adapters(&peft_dir, &model).expect("loads");
    let out = tempfile::tempdir().expect("tempdir");
    let dir = out.path().join("adapters");
    save_adapters(&dir, &model, &adapters, &config).expect("writes");

    let theirs = std::fs::read(peft_dir.join(ADAPTER_WEIGHTS)).expect("read");
    let ours = std::fs::read(dir.join(ADAPTER_WEIGHTS)).expect("read");
    let theirs = SafeTensors::deserialize(&theirs).expect("parses");
    let ours = SafeTensors::deserialize(&ours).expect("parses");
    let mut names = theirs.names();
    names.sort();
    let mut our_names = ours.names();
    our_names.sort();
    assert_eq!(names, our_names);
    for name in names {
        let (a, b) = (
            theirs.tensor(name).expect("t"),
            ours.tensor(name).expect("o"),
        );
        assert_eq!((a.dtype(), a.shape()), (b.dtype(), b.shape()), "{name}");
        assert_eq!(a.data(), b.data(), "{name}: the values round-trip exactly");
    }

    let read = |p: &std::path::Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(p.join(ADAPTER_CONFIG)).expect("read"))
            .expect("json")
    };
    let (theirs, ours) = (read(&peft_dir), read(&dir));
    for key in [
        "peft_type",
        "task_type",
        "r",
        "lora_alpha",
        "lora_dropout",
        "bias",
        "fan_in_fan_out",
        "use_rslora",
        "use_dora",
    ] {
        assert_eq!(
            theirs[key].as_f64().map(|v| v as f32),
            ours[key].as_f64().map(|v| v as f32),
            "{key}"
        );
        assert_eq!(theirs[key].is_null(), ours[key].is_null(), "{key}");
        if let Some(s) = theirs[key].as_str() {
            assert_eq!(Some(s), ours[key].as_str(), "{key}");
        }
        if let Some(b) = theirs[key].as_bool() {
            assert_eq!(Some(b), ours[key].as_bool(), "{key}");
        }
    }
    assert!(ours["base_model_name_or_path"].is_string());
    assert_eq!(read_config(&dir).expect("config"), config);
    let (again, _) = load_adapters(&dir, &model).expect("ours reload");
    for (key, ad) in &adapters {
        assert_eq!((&again[key].a, &again[key].b), (&ad.a, &ad.b), "{key}");
    }
    assert!(!dir.join(format!(".{ADAPTER_WEIGHTS}.tmp")).exists());
}

/// A copy of peft's adapter directory with its config or weights changed.
fn broken(
    edit_config: impl Fn(&mut serde_json::Value),
    drop_tensor: Option<&str>,
) -> tempfile::TempDir {
    let model = Model::load(&fixture("llama")).expect("loads");
    let peft_dir = fixture("llama").join("peft_adapter");
    let tmp = tempfile::tempdir().expect("tempdir");
    let text = std::fs::read_to_string(peft_dir.join(ADAPTER_CONFIG)).expect("read");
    let mut json: serde_json::Value = serde_json::from_str(&text).expect("json");
    let (mut adapters, config) = load_adapters(&peft_dir, &model).expect("loads");
    if let Some(key) = drop_tensor {
        adapters.remove(key);
    }
    // Written with the original config, then the config replaced.
    save_adapters(tmp.path(), &model, &adapters, &config).expect("writes");
    edit_config(&mut json);
    std::fs::write(tmp.path().join(ADAPTER_CONFIG), json.to_string()).expect("write");
    tmp
}

#[test]
fn bad_adapter_files_are_named() {
    let model = Model::load(&fixture("llama")).expect("loads");
    let err = |dir: &std::path::Path| {
        load_adapters(dir, &model)
            .expect_err("must fail")
            .to_string()
    };

    let missing = broken(|_| {}, Some("layers.1.self_attn.v_proj"));
    let e = err(missing.path());
    assert!(
        e.contains(ADAPTER_WEIGHTS)
            && e.contains("base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight")
            && e.contains("missing"),
        "{e}"
    );

    let wrong_r = broken(|j| j["r"] = 8.into(), None);
    let e = err(wrong_r.path());
    assert!(
        e.contains("r = 8") && e.contains("lora_A.weight") && e.contains("[4, "),
        "{e}"
    );

    let extra = broken(
        |j| j["target_modules"] = serde_json::json!(["q_proj", "v_proj"]),
        None,
    );
    let e = err(extra.path());
    assert!(
        e.contains("down_proj.lora_A.weight") && e.contains("not a lora_A/lora_B"),
        "{e}"
    );

    let more = broken(
        |j| j["target_modules"] = serde_json::json!(["q_proj", "v_proj", "down_proj", "k_proj"]),
        None,
    );
    let e = err(more.path());
    assert!(
        e.contains("k_proj.lora_A.weight") && e.contains("missing"),
        "{e}"
    );

    let regex = broken(|j| j["target_modules"] = ".*proj".into(), None);
    let e = err(regex.path());
    assert!(
        e.contains(ADAPTER_CONFIG) && e.contains("target_modules"),
        "{e}"
    );

    let dora = broken(|j| j["use_dora"] = true.into(), None);
    assert!(err(dora.path()).contains("use_dora"));

    let gpt2 = Model::load(&fixture("gpt2")).expect("loads");
    let e = load_adapters(&fixture("llama").join("peft_adapter"), &gpt2)
        .expect_err("GPT-2 refused")
        .to_string();
    assert!(e.contains("GPT2LMHeadModel"), "{e}");
}

/// With HEADROOM_PEFT_OUT set, writes our adapters (peft's values) and the
/// logits we compute with them there, for the by-hand check that peft's
/// `PeftModel.from_pretrained` loads our files (docs/llm.md).
#[test]
#[ignore = "by hand: writes files for the Python check; HEADROOM_PEFT_OUT=DIR cargo test -p headroom-llm --test peft write_ours -- --ignored"]
fn write_ours_for_peft_when_asked() {
    let Some(out) = std::env::var_os("HEADROOM_PEFT_OUT") else {
        panic!("set HEADROOM_PEFT_OUT to the directory to write into");
    };
    let out = std::path::PathBuf::from(out);
    let mut model = Model::load(&fixture("llama")).expect("loads");
    let (adapters, config) =
        load_adapters(&fixture("llama").join("peft_adapter"), &model).expect("loads");
    save_adapters(&out, &model, &adapters, &config).expect("writes");
    let batch = as_ids(&Reference::load("llama").rows("input_ids"));
    model.merge_adapters(&adapters).expect("merge");
    let logits = model.logits(&batch).expect("logits");
    let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(out.join("our_logits.f32"), bytes).expect("write");
}

/// The same adapters are the same bytes, whatever order the process's hash
/// maps iterate in: each save here runs in its own process (the test binary
/// run again with HEADROOM_PEFT_SAVE_TO), whose hash seeds differ.
#[test]
fn the_same_adapters_save_to_the_same_bytes_in_every_process() {
    if let Ok(dir) = std::env::var("HEADROOM_PEFT_SAVE_TO") {
        let model = headroom_llm::Model::load(&common::fixture("llama")).expect("loads");
        let adapters = headroom_llm::lora::new_adapters(&model, 4, 8.0, &["q_proj", "v_proj"], 9)
            .expect("adapters");
        let config = headroom_llm::peft::LoraConfig {
            r: 4,
            alpha: 8.0,
            dropout: 0.0,
            target_modules: vec!["q_proj".into(), "v_proj".into()],
            use_rslora: false,
        };
        headroom_llm::peft::save_adapters(std::path::Path::new(&dir), &model, &adapters, &config)
            .expect("saves");
        return;
    }
    let root = tempfile::tempdir().expect("tempdir");
    let exe = std::env::current_exe().expect("test binary");
    let mut files = Vec::new();
    for i in 0..6 {
        let dir = root.path().join(format!("run{i}"));
        let status = std::process::Command::new(&exe)
            .args([
                "--exact",
                "the_same_adapters_save_to_the_same_bytes_in_every_process",
            ])
            .env("HEADROOM_PEFT_SAVE_TO", &dir)
            .status()
            .expect("runs");
        assert!(status.success());
        files.push(std::fs::read(dir.join("adapter_model.safetensors")).expect("written"));
    }
    assert!(
        files.iter().all(|f| f == &files[0]),
        "the bytes differ between processes"
    );
    // And they still load, checksum and all.
    let model = headroom_llm::Model::load(&common::fixture("llama")).expect("loads");
    headroom_llm::peft::load_adapters(&root.path().join("run0"), &model).expect("loads back");
}
