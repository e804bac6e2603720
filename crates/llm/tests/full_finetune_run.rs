//! A full fine-tune in its run directory (`finetune::full_run`): a run
//! killed after its first checkpoint (the directory as a kill leaves it,
//! with a step past the checkpoint and a torn line in metrics.jsonl) and
//! resumed writes the same bytes as a run never stopped (the final model,
//! the last checkpoint's weights and moments) and the same losses; a
//! corrupt newest checkpoint is set aside and the one before resumes
//! exactly; a stop checkpoints; clipping moves the weights and logs the
//! norm; settings that shape the result may not change on resume.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use common::*;
use headroom_llm::data::{load_jsonl, DataOptions, Dataset};
use headroom_llm::finetune::full::FullOptions;
use headroom_llm::finetune::full_run::{self, FullOutcome, FullRunSettings};
use headroom_llm::finetune::run::Event;
use headroom_llm::finetune::LrSchedule;
use headroom_llm::{Model, Tokenizer};

fn setup(dir: &Path) -> (FullRunSettings, Dataset) {
    let data = dir.join("train.jsonl");
    std::fs::write(
        &data,
        "{\"text\": \"The lazy fox trains a frozen model.\"}\n\
         {\"prompt\": \"The quick brown\", \"completion\": \" fox within the memory it has\"}\n\
         {\"text\": \"piece by piece, the lazy fox\"}\n",
    )
    .expect("write");
    let model = fixture("llama");
    let tok = Tokenizer::load(&model).expect("tokenizer");
    let rows = load_jsonl(&data, &tok, Some(0), DataOptions::default()).expect("data");
    let settings = FullRunSettings {
        model,
        data,
        data_options: DataOptions::default(),
        options: FullOptions {
            epochs: 2,
            lr: 3e-3,
            batch_size: 2,
            accumulate: 1,
            schedule: LrSchedule::WarmupCosine { warmup_steps: 1 },
            weight_decay: 0.01,
            max_steps: None,
            seed: 4,
        },
        max_grad_norm: Some(1.0),
        save_steps: Some(1),
        keep_checkpoints: 2,
    };
    (settings, rows)
}

/// Runs to the end (`resume`: from what `out` holds), calling `watch` on
/// each event.
fn run(
    out: &Path,
    settings: &FullRunSettings,
    data: &Dataset,
    resume: bool,
    mut watch: impl FnMut(&Event),
) -> FullOutcome {
    let mut model = Model::load(&settings.model).expect("loads");
    let on_event = |e: Event| watch(&e);
    if resume {
        full_run::resume(out, settings, &mut model, data, None, on_event).expect("resumes")
    } else {
        full_run::start(out, settings, &mut model, data, None, on_event).expect("runs")
    }
}

fn losses(out: &Path) -> Vec<(u64, String, String)> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .expect("metrics")
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a whole line");
            (
                v["step"].as_u64().expect("step"),
                v["loss"].to_string(),
                v["grad_norm"].to_string(),
            )
        })
        .collect()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read") {
        let entry = entry.expect("entry");
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).expect("copy");
        }
    }
}

fn read(path: PathBuf) -> Vec<u8> {
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn killed_after_a_checkpoint_and_resumed_is_the_run_never_stopped() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (settings, data) = setup(tmp.path());
    // 3 examples, batch 2: two steps an epoch, four in all.
    let whole = tmp.path().join("whole");
    let killed = tmp.path().join("killed");
    let corrupt = tmp.path().join("corrupt");
    let mut checkpoints = 0;
    let outcome = run(&whole, &settings, &data, false, |e| {
        if let Event::Checkpoint(_) = e {
            checkpoints += 1;
            // The directory as a kill right after this checkpoint leaves it.
            match checkpoints {
                1 => copy_dir(&whole, &killed),
                3 => copy_dir(&whole, &corrupt),
                _ => {}
            }
        }
    });
    let FullOutcome::Finished {
        step, model_dir, ..
    } = outcome
    else {
        panic!("{outcome:?}")
    };
    assert_eq!((step, checkpoints), (4, 4));
    assert_eq!(model_dir, whole.join("model"));
    let trained = Model::load(&model_dir).expect("the written model loads");
    let base = Model::load(&settings.model).expect("loads");
    let ids = vec![vec![1u32, 5, 9, 14, 3]];
    assert_ne!(
        trained.logits(&ids).expect("logits"),
        base.logits(&ids).expect("logits")
    );
    let whole_losses = losses(&whole);
    assert_eq!(whole_losses.len(), 4);
    let norms: Vec<f64> = whole_losses
        .iter()
        .map(|(_, _, n)| n.parse().expect("a norm"))
        .collect();
    assert!(
        norms.iter().any(|&n| n > 1.0),
        "clipping never acted: {norms:?}"
    );

    // A kill after step 1's checkpoint: step 2 logged, then a torn line.
    let mut metrics = std::fs::OpenOptions::new()
        .append(true)
        .open(killed.join("metrics.jsonl"))
        .expect("open");
    use std::io::Write as _;
    write!(
        metrics,
        "{{\"step\": 2, \"loss\": 1.0}}\n{{\"step\": 3, \"lo"
    )
    .expect("append");
    drop(metrics);
    let mut resumed_from = None;
    run(&killed, &settings, &data, true, |e| {
        if let Event::Resumed { step, .. } = e {
            resumed_from = Some(*step);
        }
    });
    assert_eq!(resumed_from, Some(1));
    assert_eq!(losses(&killed), whole_losses);
    for file in [
        "model/model.safetensors",
        "checkpoint-step0000000004/model.safetensors",
        "checkpoint-step0000000004/optimizer.safetensors",
    ] {
        assert!(
            read(killed.join(file)) == read(whole.join(file)),
            "{file} differs"
        );
    }

    // The newest checkpoint (step 3) corrupt: set aside, step 2 resumes.
    let newest = corrupt.join("checkpoint-step0000000003/optimizer.safetensors");
    let mut bytes = read(newest.clone());
    let at = bytes.len() - 3;
    bytes[at] ^= 0x20;
    std::fs::write(&newest, bytes).expect("write");
    let (mut skipped, mut resumed_from) = (Vec::new(), None);
    run(&corrupt, &settings, &data, true, |e| match e {
        Event::Skipped { error, set_aside } => {
            skipped.push((error.to_string(), set_aside.to_path_buf()))
        }
        Event::Resumed { step, .. } => resumed_from = Some(*step),
        _ => {}
    });
    assert_eq!(resumed_from, Some(2));
    assert_eq!(skipped.len(), 1, "{skipped:?}");
    assert!(
        skipped[0].0.contains("optimizer.safetensors"),
        "{skipped:?}"
    );
    assert!(skipped[0].0.contains("truncated or corrupt"), "{skipped:?}");
    assert!(skipped[0].1.ends_with("checkpoint-step0000000003.corrupt"));
    assert!(
        read(corrupt.join("model/model.safetensors"))
            == read(whole.join("model/model.safetensors"))
    );
    assert_eq!(losses(&corrupt), whole_losses);
}

#[test]
fn a_stop_checkpoints_and_settings_that_shape_the_run_stay() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (settings, data) = setup(tmp.path());
    let out = tmp.path().join("stopped");
    let stop = AtomicBool::new(true);
    let mut model = Model::load(&settings.model).expect("loads");
    let outcome =
        full_run::start(&out, &settings, &mut model, &data, Some(&stop), |_| {}).expect("runs");
    let FullOutcome::Stopped {
        step, checkpoint, ..
    } = outcome
    else {
        panic!("{outcome:?}")
    };
    assert_eq!(step, 1);
    assert!(checkpoint.join("model.safetensors").is_file());
    assert!(!out.join("model").exists(), "no model before the end");
    // A second start is refused; so is a resume that changes the batch.
    let again = full_run::start(&out, &settings, &mut model, &data, None, |_| {});
    assert!(again
        .unwrap_err()
        .to_string()
        .contains("holds a fine-tuning run already"));
    let mut other = settings.clone();
    other.options.batch_size = 1;
    let mut model = Model::load(&settings.model).expect("loads");
    let err = full_run::resume(&out, &other, &mut model, &data, None, |_| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("`batch_size` is 2"), "{err}");
    // Without clipping the same run ends elsewhere.
    let unclipped = FullRunSettings {
        max_grad_norm: None,
        ..settings.clone()
    };
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    run(&a, &settings, &data, false, |_| {});
    run(&b, &unclipped, &data, false, |_| {});
    assert!(read(a.join("model/model.safetensors")) != read(b.join("model/model.safetensors")));
}
