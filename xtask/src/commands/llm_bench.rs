//! `cargo xtask bench-llm`: the LoRA fine-tuning step on a model of
//! published shapes with random weights (`headroom_llm::shapes`), written
//! once under target/bench-llm/, timed here in a child process of its own
//! (so its peak RSS is the step's alone) and, with `--compare-peft`, by
//! transformers + peft (`bench/torch/peft_lora_step.py`) on the same
//! directory, sequence length, adapters and threads, one after the other.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use headroom_llm::finetune::adamw;
use headroom_llm::lora::new_adapters;
use headroom_llm::shapes::{write_random, Preset};
use headroom_llm::Model;
use serde::{Deserialize, Serialize};

#[derive(clap::Args)]
pub struct BenchLlmArgs {
    /// The shapes: smollm2-360m, qwen2.5-0.5b or llama-3.2-1b (written with
    /// random weights), or a model directory.
    #[arg(long, default_value = "smollm2-360m")]
    shapes: String,
    /// Only the first N blocks (the same widths; a quicker run).
    #[arg(long)]
    layers: Option<usize>,
    /// Tokens per sequence (one sequence per micro-step).
    #[arg(long, default_value_t = 1024)]
    seq: usize,
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    #[arg(long, default_value_t = 2, value_parser = crate::at_least_one())]
    steps: usize,
    #[arg(long, default_value_t = 8, value_parser = crate::at_least_one())]
    r: usize,
    #[arg(long, default_value_t = 16.0)]
    alpha: f32,
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "q_proj,k_proj,v_proj,o_proj"
    )]
    target: Vec<String>,
    /// Compute threads for both sides (default: every core).
    #[arg(long, value_parser = crate::at_least_one())]
    threads: Option<usize>,
    /// Keep blocks' activations for the backward within this many bytes
    /// (e.g. 2GiB) instead of recomputing them (headroom's side only; the
    /// default recomputes every block, as gradient checkpointing does).
    #[arg(long, value_name = "BYTES")]
    keep_activations: Option<String>,
    /// Also time transformers + peft (f32 on the CPU) on the same model.
    #[arg(long)]
    compare_peft: bool,
    /// Write the JSON report here too.
    #[arg(long, value_name = "PATH")]
    json_out: Option<PathBuf>,
    /// Time this process's side only and print one JSON line (what the
    /// parent runs).
    #[arg(long, hide = true)]
    one: Option<PathBuf>,
}

/// One side's figures.
#[derive(Serialize, Deserialize, Debug)]
struct Side {
    side: String,
    threads: usize,
    seq: usize,
    steps: usize,
    seconds_per_sequence: f64,
    tokens_per_s: f64,
    load_s: f64,
    loss: f64,
    adapter_params: usize,
    peak_rss_bytes: Option<u64>,
}

pub fn run(args: BenchLlmArgs) -> Result<()> {
    if let Some(dir) = &args.one {
        let side = time_ours(dir, &args)?;
        println!("{}", serde_json::to_string(&side)?);
        return Ok(());
    }
    let dir = model_dir(&args)?;
    let ours = child(&dir, &args)?;
    let peft = if args.compare_peft {
        peft_side(&dir, &args)?
    } else {
        None
    };
    println!(
        "LoRA r {} alpha {} on {}, sequence {}, {} timed sequence(s) after {} warm-up, {} thread(s), \
         headroom {}: {}",
        args.r,
        args.alpha,
        args.target.join(","),
        args.seq,
        args.steps,
        args.warmup,
        ours.threads,
        match &args.keep_activations {
            Some(k) => format!("keeping activations within {k}"),
            None => "recomputing every block".into(),
        },
        dir.display()
    );
    println!("| side | tokens/s | s/sequence | peak RSS MiB | load s | loss |");
    println!("|---|---|---|---|---|---|");
    for side in std::iter::once(&ours).chain(peft.as_ref()) {
        println!(
            "| {} | {:.1} | {:.2} | {} | {:.1} | {:.4} |",
            side.side,
            side.tokens_per_s,
            side.seconds_per_sequence,
            side.peak_rss_bytes
                .map_or("-".into(), |b| format!("{:.0}", b as f64 / 1048576.0)),
            side.load_s,
            side.loss
        );
    }
    if let Some(p) = &peft {
        println!(
            "headroom / peft: {:.2}× the tokens/s{}",
            ours.tokens_per_s / p.tokens_per_s,
            match (ours.peak_rss_bytes, p.peak_rss_bytes) {
                (Some(a), Some(b)) => format!(", {:.2}× the peak RSS", a as f64 / b as f64),
                _ => String::new(),
            }
        );
    }
    if let Some(path) = &args.json_out {
        let report = serde_json::json!({ "model": dir, "headroom": ours, "peft": peft });
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// The model directory: the one given, or the preset's under target/.
fn model_dir(args: &BenchLlmArgs) -> Result<PathBuf> {
    let given = Path::new(&args.shapes);
    if given.join("config.json").is_file() {
        return Ok(given.to_path_buf());
    }
    let Some(preset) = Preset::parse(&args.shapes) else {
        bail!(
            "--shapes {}: neither a model directory (no config.json there) nor one of {}",
            args.shapes,
            Preset::ALL.map(Preset::name).join(", ")
        );
    };
    let name = match args.layers {
        Some(l) => format!("{}-{l}layers", preset.name()),
        None => preset.name().to_string(),
    };
    let dir = PathBuf::from("target/bench-llm").join(name);
    if !dir.join("model.safetensors").is_file() || !dir.join("config.json").is_file() {
        eprintln!("writing {} (random weights, bf16)", dir.display());
        let params = write_random(&dir, preset, args.layers, 0)
            .with_context(|| format!("writing {}", dir.display()))?;
        eprintln!("{params} parameters written");
    }
    Ok(dir)
}

/// Runs this command's timing in a child process and reads its JSON line.
fn child(dir: &Path, args: &BenchLlmArgs) -> Result<Side> {
    let exe = std::env::current_exe().context("finding this program")?;
    let mut cmd = Command::new(exe);
    cmd.arg("bench-llm")
        .arg("--one")
        .arg(dir)
        .args(["--seq", &args.seq.to_string()])
        .args(["--warmup", &args.warmup.to_string()])
        .args(["--steps", &args.steps.to_string()])
        .args(["--r", &args.r.to_string()])
        .args(["--alpha", &args.alpha.to_string()])
        .args(["--target", &args.target.join(",")]);
    if let Some(t) = args.threads {
        cmd.args(["--threads", &t.to_string()]);
    }
    if let Some(k) = &args.keep_activations {
        cmd.args(["--keep-activations", k]);
    }
    let output = cmd.output().context("running bench-llm --one")?;
    if !output.status.success() {
        bail!(
            "bench-llm --one {} failed: {}",
            dir.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let text = String::from_utf8_lossy(&output.stdout);
    serde_json::from_str(text.trim()).with_context(|| format!("bench-llm --one printed {text}"))
}

use headroom_llm::math::splitmix64 as next;

/// headroom's side: load, adapters (B drawn small so every product is
/// real), then `warmup + steps` micro-steps of one random sequence each:
/// the gradient pass and PyTorch's AdamW update of the adapters.
fn time_ours(dir: &Path, args: &BenchLlmArgs) -> Result<Side> {
    if let Some(t) = args.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build_global()
            .context("starting the compute threads")?;
    }
    let keep = match &args.keep_activations {
        Some(text) => headroom_pipeline::config::parse_bytes("--keep-activations", text)? as usize,
        None => 0,
    };
    let start = Instant::now();
    let model = Model::load(dir)?;
    let targets: Vec<&str> = args.target.iter().map(String::as_str).collect();
    let mut adapters = new_adapters(&model, args.r, args.alpha, &targets, 1)?;
    let mut state = 7u64;
    // In key order: a hash map's order differs from run to run.
    let mut keys: Vec<String> = adapters.keys().cloned().collect();
    keys.sort();
    for key in &keys {
        let Some(ad) = adapters.get_mut(key) else {
            continue;
        };
        for b in ad.b.iter_mut() {
            *b = ((next(&mut state) >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.02;
        }
    }
    let load_s = start.elapsed().as_secs_f64();
    let vocab = model.config.vocab_size as u64;
    let adapter_params = adapters.values().map(|a| a.a.len() + a.b.len()).sum();
    // (m, v) of A and of B, by key.
    type Moments = [Vec<f32>; 4];
    let mut moments: std::collections::HashMap<String, Moments> = adapters
        .iter()
        .map(|(k, a)| {
            let (na, nb) = (a.a.len(), a.b.len());
            (
                k.clone(),
                [vec![0.0; na], vec![0.0; na], vec![0.0; nb], vec![0.0; nb]],
            )
        })
        .collect();
    let mut loss = 0.0f64;
    let mut timed = 0.0f64;
    for step in 0..args.warmup + args.steps {
        let ids: Vec<u32> = (0..args.seq)
            .map(|_| (next(&mut state) % vocab) as u32)
            .collect();
        let labels: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
        let t0 = Instant::now();
        let (l, grads) = model.lora_gradients_kept(&adapters, &[ids], &[labels], None, keep)?;
        for (key, (da, db)) in &grads {
            let (Some(ad), Some([ma, va, mb, vb])) = (adapters.get_mut(key), moments.get_mut(key))
            else {
                continue;
            };
            let t = step as u64 + 1;
            adamw(&mut ad.a, da, ma, va, 2e-4, 0.0, t);
            adamw(&mut ad.b, db, mb, vb, 2e-4, 0.0, t);
        }
        if step >= args.warmup {
            timed += t0.elapsed().as_secs_f64();
            loss = l as f64;
        }
    }
    Ok(Side {
        side: "headroom".into(),
        threads: rayon::current_num_threads(),
        seq: args.seq,
        steps: args.steps,
        seconds_per_sequence: timed / args.steps as f64,
        tokens_per_s: (args.seq * args.steps) as f64 / timed,
        load_s,
        loss,
        adapter_params,
        peak_rss_bytes: headroom_pipeline::peak_rss_bytes(),
    })
}

/// transformers + peft on the same directory, or None (with a warning)
/// when python3 cannot run it.
fn peft_side(dir: &Path, args: &BenchLlmArgs) -> Result<Option<Side>> {
    let script = Path::new("bench/torch/peft_lora_step.py");
    let threads = args.threads.unwrap_or_else(rayon::current_num_threads);
    let output = Command::new("python3")
        .arg(script)
        .arg("--model")
        .arg(dir)
        .args(["--seq", &args.seq.to_string()])
        .args(["--warmup", &args.warmup.to_string()])
        .args(["--steps", &args.steps.to_string()])
        .args(["--r", &args.r.to_string()])
        .args(["--alpha", &args.alpha.to_string()])
        .args(["--target", &args.target.join(",")])
        .args(["--threads", &threads.to_string()])
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !output.status.success() {
        tracing::warn!(
            "--compare-peft: {} failed (are torch, transformers and peft installed? \
             `pip install torch transformers peft`): {}",
            script.display(),
            String::from_utf8_lossy(&output.stderr)
        );
        return Ok(None);
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text.lines().last().unwrap_or_default();
    Ok(Some(serde_json::from_str(line.trim()).with_context(
        || format!("{} printed {text}", script.display()),
    )?))
}
