//! Data parallel for a run built in code (`Trainer::builder().ranks(…)`):
//! 2 ranks × 16 end in the weights of 1 process × 32 in 2 micro-batches,
//! bit for bit, dropout's masks included, rank 0 writes the checkpoints, the follower's scratch
//! directory is gone at the end.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use headroom_dist::threads::group;
use headroom_loader::SyntheticDataset;
use headroom_pipeline::checkpoint;
use headroom_pipeline::ranks::Ranks;
use headroom_pipeline::trainer::{
    network, DeviceKind, LoopSettings, MicroBatch, NetworkPlan, RunSummary, ScheduleKind,
    ScheduleSettings, StepSettings,
};
use headroom_pipeline::{Resume, Trainer};

const SAMPLES: usize = 256;

fn run(dir: &Path, batch: usize, micro: usize, ranks: Option<Ranks>) -> RunSummary {
    // Dropout: rank r's samples get the masks one process draws for them.
    let spec = toml::from_str(
        r#"
        input = [4, 4, 1]
        mean = 0.5
        std = 0.25
        layers = [{ type = "flatten" }, { type = "linear", out = 8 }, { type = "relu" },
                  { type = "dropout", p = 0.3 }, { type = "linear", out = 2 }]
        "#,
    )
    .expect("spec");
    let plan = NetworkPlan {
        spec,
        seed: 1,
        build: Default::default(),
        layers: Default::default(),
        step: StepSettings {
            label_smoothing: 0.0,
            clip_norm: 0.5,
            focal_gamma: None,
            regression: None,
            optimizer: Default::default(),
        },
        batch,
        device: DeviceKind::Cpu,
        cuda: Default::default(),
    };
    let data = || Arc::new(SyntheticDataset::new(SAMPLES, [4, 4, 1], 2));
    let mut builder = Trainer::builder()
        .output_dir(dir)
        .model("mlp", network(plan))
        .data(data(), data())
        .loop_settings(LoopSettings {
            epochs: 2,
            batch_size: batch,
            micro_batch: MicroBatch::Size(micro),
            threads: 1,
            ..Default::default()
        })
        .schedule(ScheduleSettings {
            lr: 0.01,
            kind: ScheduleKind::Constant,
        })
        .resume(Resume::No);
    if let Some(ranks) = ranks {
        builder = builder.ranks(ranks);
    }
    builder.build().expect("builds").run().expect("runs")
}

fn weights(dir: &Path) -> Vec<Vec<f32>> {
    let (found, _) = checkpoint::newest_valid(dir).expect("listing");
    let (path, _) = found.expect("a checkpoint");
    checkpoint::load(&path).expect("loads").params
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("headroom-dpb-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn a_trainer_built_in_code_trains_on_ranks_the_weights_of_one_process() {
    let (one, two) = (scratch("one"), scratch("two"));
    let alone = run(&one, 32, 16, None);
    let handles: Vec<_> = group(2)
        .into_iter()
        .map(|t| {
            let dir = two.clone();
            std::thread::spawn(move || {
                let ranks = Ranks::new(Box::new(t), 1 << 10, Duration::from_secs(60));
                run(&dir, 16, 16, Some(ranks))
            })
        })
        .collect();
    let summaries: Vec<RunSummary> = handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect();
    for s in &summaries {
        assert_eq!(s.step, alone.step);
    }
    assert!(alone.step > 0);
    let bits = |w: Vec<Vec<f32>>| -> Vec<Vec<u32>> {
        w.into_iter()
            .map(|t| t.into_iter().map(f32::to_bits).collect())
            .collect()
    };
    assert_eq!(bits(weights(&one)), bits(weights(&two)));
    assert_eq!(summaries[0].output_dir, two);
    assert_ne!(summaries[1].output_dir, two);
    assert!(
        !summaries[1].output_dir.exists(),
        "the follower's scratch directory is left"
    );
    let _ = (std::fs::remove_dir_all(&one), std::fs::remove_dir_all(&two));
}
