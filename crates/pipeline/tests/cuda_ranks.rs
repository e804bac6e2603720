//! GPU ranks over NCCL, on the CPU emulator of CUDA and its NCCL
//! (crates/cuda-emu/shim/nccl.cpp), each rank a process of its own (this
//! binary run again with `--ignored --exact rank_process`): one rank over
//! NCCL trains the bits of a learner alone; two ranks of half a batch each
//! end in the same bits as each other, and in the bits of one learner
//! accumulating the two halves as micro-batches, with dropout too (each
//! rank draws that learner's masks of its half); a rank that dies makes
//! its peer fail with an error naming the wait, never hang. In this
//! process: what GPU ranks refuse at start (ZeRO-1 at N > 1, a transport
//! that is not NCCL).
//!
//! The rank processes always run on the emulator (HEADROOM_CUDA_EMULATE=1),
//! also on a machine with a GPU, so that the reference and the ranks run
//! the same arithmetic; `cargo xtask gpu-bundle` runs `train --devices 1`
//! on the GPU itself.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

mod common;
#[path = "gpu_gate/mod.rs"]
mod gpu_gate;
#[path = "../../../tests/src/nvrtc_gate.rs"]
#[macro_use]
mod nvrtc_gate;

report_nvrtc_tests!("cuda_ranks", include_str!("cuda_ranks.rs"));

use common::{bits, settings};
use headroom_loader::Batch;
use headroom_model::cuda::nccl::NcclId;
use headroom_model::cuda::CudaBackend;
use headroom_model::ModelSpec;
use headroom_pipeline::learner::{CudaLearner, CudaOptions, Learner, NcclTransport};
use headroom_pipeline::ranks::Ranks;

/// No batch norm: its running statistics are per micro-batch in one
/// learner but the ranks' mean over ranks, which differ by design.
const MODEL: &str = r#"
input = [8, 8, 1]
mean = 0.5
std = 0.25
layers = [
  { type = "conv", out = 8 }, { type = "relu" },
  { type = "conv", out = 16, stride = 2 }, { type = "relu" },
  { type = "global_avg_pool" },
  { type = "linear", out = 4 },
]
"#;

const WITH_DROPOUT: &str = r#"
input = [8, 8, 1]
mean = 0.5
std = 0.25
layers = [
  { type = "flatten" }, { type = "linear", out = 16 }, { type = "relu" },
  { type = "dropout", p = 0.25 }, { type = "linear", out = 4 },
]
"#;

const STEPS: usize = 3;
const BATCH: usize = 8;

fn backend() -> Option<MutexGuard<'static, ()>> {
    gpu_gate::backend("cuda_ranks")
}

fn learner(model: &str, seed: u64) -> CudaLearner {
    let spec: ModelSpec = toml::from_str(model).expect("model");
    let be = CudaBackend::new(0).expect("backend");
    CudaLearner::new(be, &spec, seed, settings(), BATCH, CudaOptions::default()).expect("learner")
}

/// Rank `rank`'s part of global batch `index` when `world` ranks share it.
fn share(index: usize, rank: usize, world: usize) -> Batch {
    let whole = common::batch(index, BATCH, 4);
    let n = BATCH / world;
    let per = 64;
    Batch {
        shape: [n, 8, 8, 1],
        pixels: whole.pixels[rank * n * per..(rank + 1) * n * per].to_vec(),
        labels: whole.labels[rank * n..(rank + 1) * n].to_vec(),
        ..whole
    }
}

// ---------------------------------------------------------------------------
// The rank processes

/// What a rank process writes: every step's loss, then every value of the
/// learner's state, as bits.
fn outcome(learner: &mut CudaLearner, losses: &[f32]) -> Vec<u8> {
    let state = learner.snapshot().expect("snapshot");
    losses
        .iter()
        .map(|l| l.to_bits())
        .chain(bits(&state))
        .flat_map(u32::to_le_bytes)
        .collect()
}

/// The NCCL id of this world: rank 0 makes it and writes it to `path`
/// whole (renamed into place); the others wait for it.
fn world_id(rank: usize, path: &Path) -> NcclId {
    if rank == 0 {
        let id = NcclId::new().expect("ncclGetUniqueId");
        let tmp = path.with_extension("partial");
        std::fs::write(&tmp, id.to_hex()).expect("write the id");
        std::fs::rename(&tmp, path).expect("publish the id");
        return id;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            return NcclId::from_hex(&text).expect("a well-formed id");
        }
        assert!(Instant::now() < deadline, "rank 0 never wrote the id");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// One process of a test below, by HEADROOM_RANKS_TEST (`alone` or
/// `rank`), HEADROOM_RANKS_MODEL (`plain` or `dropout`),
/// HEADROOM_RANKS_RANK/WORLD, HEADROOM_RANKS_ID (the id's file),
/// HEADROOM_RANKS_OUT (the outcome's file) and HEADROOM_RANKS_DIE_AFTER (a
/// rank that exits without a word after that many steps).
#[test]
#[ignore = "one rank of the tests below, which start it"]
fn rank_process() {
    let role = std::env::var("HEADROOM_RANKS_TEST").expect("started by a test of this file");
    let var = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"));
    let number = |name: &str| var(name).parse::<usize>().expect("a number");
    let Some(_gpu) = backend() else {
        panic!("the emulator is unavailable in a rank process")
    };
    let model = match var("HEADROOM_RANKS_MODEL").as_str() {
        "dropout" => WITH_DROPOUT,
        _ => MODEL,
    };
    let mut learner = learner(model, 21);
    let mut losses = Vec::new();
    if role == "alone" {
        learner.set_micro_batch(number("HEADROOM_RANKS_MICRO"));
        for i in 0..STEPS {
            losses.push(
                learner
                    .train_batch(&share(i, 0, 1), 5e-3)
                    .expect("step")
                    .loss,
            );
        }
    } else {
        let (rank, world) = (
            number("HEADROOM_RANKS_RANK"),
            number("HEADROOM_RANKS_WORLD"),
        );
        let id = world_id(rank, Path::new(&var("HEADROOM_RANKS_ID")));
        let transport = NcclTransport::join(0, rank, world, &id).expect("joins the world");
        // Buckets of 64 values: the model's gradients go in 21, most of
        // them queued while backward runs.
        let mut ranks = Ranks::new(Box::new(transport), 256, Duration::from_secs(20));
        ranks.at_world_one = true;
        learner
            .join_ranks(ranks)
            .expect("the learner joins the ranks");
        let die_after = std::env::var("HEADROOM_RANKS_DIE_AFTER")
            .ok()
            .and_then(|n| n.parse::<usize>().ok());
        for i in 0..STEPS {
            if die_after == Some(i) {
                std::process::exit(0);
            }
            match learner.train_batch(&share(i, rank, world), 5e-3) {
                Ok(step) => losses.push(step.loss),
                Err(e) => {
                    std::fs::write(var("HEADROOM_RANKS_OUT"), format!("error: {e}"))
                        .expect("write the error");
                    return;
                }
            }
        }
    }
    if let Some((early, all)) = learner.ranked_buckets() {
        std::fs::write(
            format!("{}.buckets", var("HEADROOM_RANKS_OUT")),
            format!("{early} {all}"),
        )
        .expect("write the buckets' count");
    }
    std::fs::write(var("HEADROOM_RANKS_OUT"), outcome(&mut learner, &losses))
        .expect("write the outcome");
}

/// (buckets queued while backward ran, buckets) of a rank's last step.
fn buckets(out: &Path) -> (usize, usize) {
    let path = format!("{}.buckets", out.display());
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut numbers = text
        .split(' ')
        .map(|n| n.parse::<usize>().expect("a count"));
    (numbers.next().expect("early"), numbers.next().expect("all"))
}

fn scratch(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("headroom-cuda-ranks-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch directory");
    dir
}

/// Starts this binary's `rank_process` with `env` (plus the emulator).
fn start(env: &[(&str, String)], out: &Path) -> std::process::Child {
    let exe = std::env::current_exe().expect("this test binary");
    let mut cmd = Command::new(exe);
    cmd.args([
        "--ignored",
        "--exact",
        "rank_process",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("HEADROOM_CUDA_EMULATE", "1")
    .env("HEADROOM_RANKS_OUT", out)
    .env("HEADROOM_NCCL_EMU_TIMEOUT_S", "10")
    .stdout(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("start a rank process")
}

/// Waits for `children` (at most two minutes each), then reads their
/// outcomes.
fn finish(children: Vec<std::process::Child>, outs: &[PathBuf]) -> Vec<Vec<u8>> {
    for (k, mut child) in children.into_iter().enumerate() {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(status) = child.try_wait().expect("wait for a rank") {
                assert!(status.success(), "process {k} failed: {status}");
                break;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                panic!("process {k} hung for two minutes");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    outs.iter()
        .map(|p| std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .collect()
}

fn alone(dir: &Path, model: &str, micro: usize) -> Vec<u8> {
    let out = dir.join(format!("alone-{micro}"));
    let child = start(
        &[
            ("HEADROOM_RANKS_TEST", "alone".into()),
            ("HEADROOM_RANKS_MODEL", model.into()),
            ("HEADROOM_RANKS_MICRO", micro.to_string()),
        ],
        &out,
    );
    finish(vec![child], &[out]).remove(0)
}

fn on_ranks(
    dir: &Path,
    model: &str,
    world: usize,
    die_after: Option<(usize, usize)>,
) -> Vec<Vec<u8>> {
    let id = dir.join("nccl-id");
    let outs: Vec<PathBuf> = (0..world).map(|r| dir.join(format!("rank-{r}"))).collect();
    let children = (0..world)
        .map(|rank| {
            let mut env = vec![
                ("HEADROOM_RANKS_TEST", "rank".to_string()),
                ("HEADROOM_RANKS_MODEL", model.to_string()),
                ("HEADROOM_RANKS_RANK", rank.to_string()),
                ("HEADROOM_RANKS_WORLD", world.to_string()),
                ("HEADROOM_RANKS_ID", id.display().to_string()),
            ];
            if let Some((who, after)) = die_after {
                if who == rank {
                    env.push(("HEADROOM_RANKS_DIE_AFTER", after.to_string()));
                }
            }
            start(&env, &outs[rank])
        })
        .collect();
    let dying = die_after.map(|(who, _)| who);
    let kept: Vec<PathBuf> = outs
        .iter()
        .enumerate()
        .filter(|(r, _)| Some(*r) != dying)
        .map(|(_, p)| p.clone())
        .collect();
    finish(children, &kept)
}

/// No rank's output is the error a failed rank writes in its place.
fn assert_no_rank_failed(ranked: &[Vec<u8>]) {
    for (rank, r) in ranked.iter().enumerate() {
        let text = String::from_utf8_lossy(r);
        assert!(!text.starts_with("error:"), "rank {rank}: {text}");
    }
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn one_rank_over_nccl_trains_the_bits_of_a_learner_alone() {
    let Some(_gpu) = backend() else { return };
    let dir = scratch("one");
    let reference = alone(&dir, "plain", BATCH);
    let ranked = on_ranks(&dir, "plain", 1, None);
    assert_no_rank_failed(&ranked);
    assert_eq!(ranked[0].len(), reference.len());
    assert!(
        ranked[0] == reference,
        "one NCCL rank trained other bits than a learner alone"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn two_ranks_of_half_a_batch_train_the_bits_of_one_learner_accumulating_both_halves() {
    let Some(_gpu) = backend() else { return };
    let dir = scratch("two");
    let reference = alone(&dir, "plain", BATCH / 2);
    let ranked = on_ranks(&dir, "plain", 2, None);
    assert_no_rank_failed(&ranked);
    assert!(ranked[0] == ranked[1], "the two ranks ended in other bits");
    // Most buckets were reduced while backward went on, not after it.
    for rank in 0..2 {
        let (early, all) = buckets(&dir.join(format!("rank-{rank}")));
        assert!(
            all >= 20 && early * 2 > all,
            "rank {rank}: {early} of {all} buckets early"
        );
    }
    assert_eq!(ranked[0].len(), reference.len());
    // The losses come first: the global batch's, as the learner alone saw it.
    let first = |b: &[u8]| f32::from_bits(u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    assert!(first(&ranked[0]).is_finite() && first(&ranked[0]) > 0.0);
    assert!(
        ranked[0] == reference,
        "2 ranks × 4 trained other bits than one learner with micro-batches of 4 (first loss {} vs {})",
        first(&ranked[0]),
        first(&reference)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Rank r draws the masks one learner draws for its micro-batch r: were
/// both ranks to draw at the same counter, the halves' masks would be
/// equal and the bits would differ from the learner's, which draws two.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn two_ranks_with_dropout_draw_the_masks_of_one_learner_accumulating_both_halves() {
    let Some(_gpu) = backend() else { return };
    let dir = scratch("dropout");
    let reference = alone(&dir, "dropout", BATCH / 2);
    let ranked = on_ranks(&dir, "dropout", 2, None);
    assert_no_rank_failed(&ranked);
    for (rank, r) in ranked.iter().enumerate() {
        assert_eq!(r.len(), reference.len(), "rank {rank}");
        assert!(
            *r == reference,
            "rank {rank} with dropout trained other bits than one learner with micro-batches of 4"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn a_rank_that_dies_makes_its_peer_fail_with_an_error_not_hang() {
    let Some(_gpu) = backend() else { return };
    let dir = scratch("dies");
    let started = Instant::now();
    let ranked = on_ranks(&dir, "plain", 2, Some((1, 1)));
    let text = String::from_utf8_lossy(&ranked[0]).into_owned();
    assert!(
        text.starts_with("error:"),
        "rank 0 trained on without its peer"
    );
    assert!(text.contains("rank"), "{text}");
    assert!(
        started.elapsed() < Duration::from_secs(100),
        "{:?}",
        started.elapsed()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A world of two over threads (not NCCL): enough for the refusals, which
/// come before any exchange.
fn thread_ranks(shard: bool) -> Ranks {
    let mut transports = headroom_dist::threads::group(2);
    let mut ranks = Ranks::new(
        Box::new(transports.remove(0)),
        1 << 12,
        Duration::from_secs(5),
    );
    ranks.shard_optimizer = shard;
    ranks
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn gpu_ranks_refuse_zero_1_and_a_transport_that_is_not_nccl_at_start() {
    let Some(_gpu) = backend() else { return };
    let refusal = |model: &str, shard: bool| {
        let mut l = learner(model, 3);
        match l.join_ranks(thread_ranks(shard)) {
            Ok(()) => panic!("joined"),
            Err(e) => e.to_string(),
        }
    };
    let zero = refusal(MODEL, true);
    assert!(zero.contains("train.shard_optimizer"), "{zero}");
    let threads = refusal(MODEL, false);
    assert!(
        threads.contains("NCCL") && threads.contains("--devices"),
        "{threads}"
    );
}
