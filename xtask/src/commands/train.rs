//! `cargo xtask train`: one experiment or several in sequence, fresh or
//! resumed, and the summary each run ends with.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use headroom_pipeline::config::DataFormat;
use headroom_pipeline::{rundir, shell, train, ExperimentConfig, Overrides, Resume, TrainOptions};

use crate::signals;
use crate::{Switches, TrainArgs, DEFAULT_EXPERIMENT};

pub fn run(args: TrainArgs) -> Result<ExitCode> {
    let TrainArgs {
        config,
        profile,
        workers,
        switches,
        resume,
        mut overrides,
        no_install,
        devices,
    } = args;
    apply_switches(&switches, &mut overrides);
    if let Some(name) = profile {
        overrides.push(format!("run.profile={name}"));
    }
    if let Some(n) = workers {
        overrides.push(format!("data.workers={n}"));
    }
    if let Some(n) = devices.filter(|_| !crate::devices::is_rank()) {
        // The ranks read the experiment themselves; the launcher only needs
        // its device and how long a failed rank's peers may take to stop.
        let parsed = Overrides::parse(&overrides)?;
        let experiment = match resume.as_deref() {
            Some(path) if !path.is_empty() => {
                resumed_experiment(Path::new(path), &config, &parsed)?.experiment
            }
            _ => super::load_experiment(&or_default(config.clone()).remove(0), &parsed)?,
        };
        crate::devices::check_device(&experiment, n)?;
        return crate::devices::launch(n, experiment.distributed.timeout());
    }
    let overrides = Overrides::parse(&overrides)?;
    let experiments = match resume.as_deref() {
        None => fresh_experiments(&or_default(config), &overrides, Resume::No)?,
        Some("") => fresh_experiments(&or_default(config), &overrides, Resume::Latest)?,
        Some(path) => vec![resumed_experiment(Path::new(path), &config, &overrides)?],
    };
    train_in_sequence(experiments, !no_install)
}

/// What to train: the experiment, where it came from, and how to start.
struct Planned {
    experiment: ExperimentConfig,
    source: PathBuf,
    resume: Resume,
}

fn or_default(configs: Vec<PathBuf>) -> Vec<PathBuf> {
    if configs.is_empty() {
        vec![PathBuf::from(DEFAULT_EXPERIMENT)]
    } else {
        configs
    }
}

fn fresh_experiments(
    configs: &[PathBuf],
    overrides: &Overrides,
    resume: Resume,
) -> Result<Vec<Planned>> {
    configs
        .iter()
        .map(|path| {
            Ok(Planned {
                experiment: super::load_experiment(path, overrides)?,
                source: path.clone(),
                resume: resume.clone(),
            })
        })
        .collect()
}

/// `--resume RUN_DIR` or `--resume RUN_DIR/checkpoint-....ckpt`: the run's
/// own resolved config.toml is the experiment, so nothing has to be retyped
/// and nothing else can be resumed by mistake; `--set` goes on top (and
/// resume refuses, naming the key, what would change the result).
fn resumed_experiment(path: &Path, configs: &[PathBuf], overrides: &Overrides) -> Result<Planned> {
    if !path.exists() {
        bail!(
            "--resume {}: no such run directory or checkpoint",
            path.display()
        );
    }
    let (dir, resume) = if path.is_dir() {
        (path.to_path_buf(), Resume::Latest)
    } else {
        let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        (dir, Resume::From(path.to_path_buf()))
    };
    let recorded = dir.join(rundir::CONFIG_FILE);
    if configs.is_empty() && !recorded.is_file() {
        refuse_unknown_directory(&dir)?;
    }
    let (experiment, source) = match configs {
        [] if recorded.is_file() => {
            let mut experiment = ExperimentConfig::load_resolved(&recorded, overrides)?;
            // The record's own output_dir may name where the run was before
            // it was moved; only one set on top of it is a request.
            let as_recorded = rundir::recorded_output_dir(&recorded);
            if experiment.run.output_dir != as_recorded {
                refuse_another_output_dir(path, &dir, experiment.run.output_dir.as_deref())?;
            }
            experiment.run.output_dir = Some(dir);
            (experiment, recorded)
        }
        // An explicit experiment is checked against the checkpoint (and
        // refused, naming the key, if it would change the result).
        [] | [_] => {
            let config = configs
                .first()
                .cloned()
                .unwrap_or_else(|| PathBuf::from(DEFAULT_EXPERIMENT));
            let mut experiment = super::load_experiment(&config, overrides)?;
            refuse_another_output_dir(path, &dir, experiment.run.output_dir.as_deref())?;
            experiment.run.output_dir = Some(dir);
            (experiment, config)
        }
        _ => bail!(
            "--resume {} continues one run: give at most one --config",
            path.display()
        ),
    };
    Ok(Planned {
        experiment,
        source,
        resume,
    })
}

/// `--resume D` continues the run in D: a `run.output_dir` naming another
/// directory (from `--set`, the environment or the `--config` file) is
/// refused rather than ignored (the run would go on in D) or obeyed (a
/// resume in an empty NEW silently starts from scratch). Forking is one
/// copy away, and the message says so.
fn refuse_another_output_dir(given: &Path, dir: &Path, requested: Option<&Path>) -> Result<()> {
    let Some(requested) = requested else {
        return Ok(());
    };
    let same = requested == dir
        || matches!(
            (requested.canonicalize(), dir.canonicalize()),
            (Ok(a), Ok(b)) if a == b
        );
    if same {
        return Ok(());
    }
    let (dir_word, new_word) = (shell::quote_path(dir), shell::quote_path(requested));
    bail!(
        "--resume {} continues the run in {}, but run.output_dir is {}: a resume cannot move a run. \
         Leave run.output_dir out to continue it where it is, or continue a copy elsewhere: \
         cp -r {dir_word} {new_word} && cargo xtask train --resume {new_word}",
        given.display(),
        dir.display(),
        requested.display(),
    )
}

/// `--resume DIR` without `--config`, where DIR has no `config.toml`: a
/// directory with checkpoints (from before runs recorded their config) is
/// resumed with the default experiment, checked against them; one without
/// is not a run at all (`--resume runs`, a typo), and training the default
/// experiment into it would be a surprise, not a resume.
fn refuse_unknown_directory(dir: &Path) -> Result<()> {
    if !headroom_pipeline::checkpoint::list(dir)?.is_empty() {
        return Ok(());
    }
    bail!(
        "--resume {}: not a run directory (no {} and no checkpoint-step*.ckpt in it). \
         Give a run's directory (runs/NAME-DATE), one of its checkpoints, or \
         `--config EXPERIMENT --resume` for the newest run of that experiment",
        dir.display(),
        rundir::CONFIG_FILE
    )
}

/// The switches that map to config keys become overrides; the one that
/// cannot change anything says so.
fn apply_switches(switches: &Switches, overrides: &mut Vec<String>) {
    let keys = [
        (switches.no_amp, "device.amp=false"),
        (switches.no_fusion, "device.fusion=false"),
        (switches.no_graphs, "device.graphs=false"),
    ];
    overrides.extend(
        keys.iter()
            .filter(|(on, _)| *on)
            .map(|(_, key)| key.to_string()),
    );
    if switches.no_channels_last {
        tracing::warn!(
            "--no-channels-last: headroom is channels-last (NHWC) only; there is no other layout"
        );
    }
}

/// Trains each experiment in turn. A run stopped by a signal ends the
/// sequence with 128 + the signal's number (130 for SIGINT, 143 for
/// SIGTERM), after printing the command that continues it.
fn train_in_sequence(planned: Vec<Planned>, allow_install: bool) -> Result<ExitCode> {
    let stop = signals::StopOnSignals::install()?;
    let count = planned.len();
    let ranks = match planned.first() {
        Some(first) => crate::ranks::from_launcher(&first.experiment, stop.flag())?,
        None => None,
    };
    if ranks.is_some() && count > 1 {
        bail!("a data-parallel run trains one experiment: give one --config (got {count})");
    }
    let world = ranks.as_ref().map_or(1, |r| r.world);
    let leader = ranks.as_ref().is_none_or(|r| r.is_leader());
    for (i, plan) in planned.into_iter().enumerate() {
        let experiment = &plan.experiment;
        tracing::info!(
            "experiment {} from {} ({} of {count})",
            experiment.run.name,
            plan.source.display(),
            i + 1,
        );
        let options = TrainOptions {
            resume: plan.resume.clone(),
            allow_install,
            stop: Some(stop.flag()),
            ranks: ranks.clone(),
            ..Default::default()
        };
        if !train_missing_base(experiment, &options)? {
            println!("stopped while training the base; run the same command again to continue");
            return Ok(stop.exit_code());
        }
        let summary = train(experiment, &options)
            .with_context(|| format!("training {} failed", experiment.run.name))?;
        if !leader {
            // The leader reports the run, writes its reports and says how
            // to continue it.
            return Ok(if summary.interrupted {
                stop.exit_code()
            } else {
                ExitCode::SUCCESS
            });
        }
        print_summary(experiment, &summary);
        if experiment.data.format == DataFormat::Text && !summary.interrupted {
            // The sample is cut short by the first signal, as training is.
            let flag = stop.flag();
            let report =
                headroom_pipeline::text::write_report_until(experiment, &summary, Some(&flag))
                    .with_context(|| {
                        format!("writing the text report of {}", experiment.run.name)
                    })?;
            print_text_report(&report);
            if flag.load(std::sync::atomic::Ordering::SeqCst) {
                println!("stopped while sampling; the run itself is complete");
                return Ok(stop.exit_code());
            }
        }
        if experiment.finetune.is_some() && !summary.interrupted {
            // The base's evaluation is given up at the first signal; the
            // adapters are written before it.
            let flag = stop.flag();
            let report =
                headroom_pipeline::finetune::write_report_until(experiment, &summary, Some(&flag))
                    .with_context(|| {
                        format!("writing the fine-tuning report of {}", experiment.run.name)
                    })?;
            print_finetune_report(&report);
            if flag.load(std::sync::atomic::Ordering::SeqCst) {
                println!("stopped while reporting; the run itself is complete");
                return Ok(stop.exit_code());
            }
        }
        if summary.memory_left_after_run != 0 {
            bail!(
                "{} bytes of tensor memory were still held after {} ended",
                summary.memory_left_after_run,
                experiment.run.name
            );
        }
        if summary.interrupted {
            let dir = summary
                .last_checkpoint
                .as_deref()
                .and_then(Path::parent)
                .map_or_else(|| experiment.output_dir().to_path_buf(), Path::to_path_buf);
            // Quoted: the line is meant to be pasted into a shell.
            let dir = shell::quote_path(&dir);
            let command = if crate::devices::is_rank() {
                crate::devices::resume_command(world)
            } else if world > 1 {
                format!("mpirun -np {world} target/release/xtask train")
            } else {
                "cargo xtask train".to_string()
            };
            println!(
                "stopped at epoch {} step {}; continue with: {command} --resume {dir}",
                summary.epoch + 1,
                summary.step,
            );
            return Ok(stop.exit_code());
        }
        if i + 1 < count {
            tracing::info!(
                "{} released all of its tensor memory (pool in use: 0 bytes)",
                experiment.run.name
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A fine-tuning experiment whose base (`finetune.base`, a run directory)
/// holds no checkpoint yet trains it first from `finetune.base_experiment`,
/// so that one command works on a fresh machine. False when a signal
/// stopped that run.
fn train_missing_base(experiment: &ExperimentConfig, options: &TrainOptions) -> Result<bool> {
    use headroom_pipeline::finetune;
    let Some(ft) = &experiment.finetune else {
        return Ok(true);
    };
    let is_file = ft.base.extension().is_some_and(|e| e == "ckpt");
    let (Some(base_experiment), false) = (&ft.base_experiment, is_file) else {
        return Ok(true);
    };
    if finetune::base_checkpoint(ft).is_ok() {
        return Ok(true);
    }
    tracing::info!(
        "finetune.base {} holds no checkpoint: training the base first from {} (finetune.base_experiment)",
        ft.base.display(),
        base_experiment.display()
    );
    let overrides = Overrides::parse(&[format!("run.output_dir={}", ft.base.display())])?;
    let base = super::load_experiment(base_experiment, &overrides)?;
    let options = TrainOptions {
        resume: Resume::No,
        ..options.clone()
    };
    let summary = train(&base, &options)
        .with_context(|| format!("training the base {} failed", base.run.name))?;
    print_summary(&base, &summary);
    Ok(!summary.interrupted)
}

fn print_finetune_report(report: &headroom_pipeline::finetune::FinetuneReport) {
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let f = &report.figures;
    println!(
        "fine-tuning     {:?} from {}",
        report.train,
        report.base_checkpoint.display()
    );
    println!(
        "parameters      {} trainable of {} ({:.2}%)",
        f.trainable,
        f.parameters,
        100.0 * f.trainable as f64 / f.parameters.max(1) as f64
    );
    println!(
        "optimizer state {} bytes ({:.3} MiB)",
        f.optimizer_state_bytes,
        mib(f.optimizer_state_bytes)
    );
    println!(
        "peak memory     tensors {:.2} MiB in use ({:.2} MiB reserved), RSS {}",
        mib(report.tensor_peak_in_use_bytes),
        mib(report.tensor_peak_reserved_bytes),
        report
            .peak_rss_bytes
            .map_or("unknown".into(), |b| format!("{:.0} MiB", mib(b)))
    );
    match report.bits_per_byte_before {
        Some(before) => println!(
            "bits per byte   {before:.3} before (the base), {:.3} after",
            report.bits_per_byte_after
        ),
        None => println!(
            "bits per byte   {:.3} after (the base was not measured: stopped)",
            report.bits_per_byte_after
        ),
    }
    if let (Some(file), Some(bytes)) = (&report.adapters_file, report.adapters_file_bytes) {
        println!(
            "adapters        {} ({:.1} KiB)",
            file.display(),
            bytes as f64 / 1024.0
        );
        println!(
            "merge with      cargo xtask lora-merge --adapters {} --output merged.safetensors",
            shell::quote_path(file)
        );
    }
}

fn print_text_report(report: &headroom_pipeline::text::TextReport) {
    println!(
        "validation loss {:.4} nats per byte",
        report.validation_loss
    );
    println!("bits per byte   {:.3}", report.bits_per_byte);
    println!("token accuracy  {:.2}%", report.token_accuracy * 100.0);
    println!(
        "training        {:.0} windows/s, {:.0} tokens/s",
        report.train_samples_per_sec, report.train_tokens_per_sec
    );
    println!("sample          {}", report.sample_file.display());
    // The sample is the model's raw bytes: escaped, so that none of them
    // can drive the terminal (sample.txt keeps them as they are).
    println!("{}", headroom_pipeline::text::terminal_safe(&report.sample));
}

fn print_summary(experiment: &ExperimentConfig, summary: &headroom_pipeline::RunSummary) {
    let rss = summary
        .peak_rss_bytes
        .map(|b| format!("{:.0} MiB", b as f64 / (1024.0 * 1024.0)))
        .unwrap_or_else(|| "unknown".into());
    println!();
    println!("== {} ==", experiment.run.name);
    match (
        summary.test_accuracy,
        summary.test_loss,
        summary.test_baseline_loss,
        summary.test_regression,
    ) {
        (_, Some(loss), _, None) if summary.test_multilabel.is_some() => {
            if let Some(m) = summary.test_multilabel {
                println!(
                    "test exact match {:.2}% (every label right)",
                    m.exact_match * 100.0
                );
                println!("test per label  {:.2}%", m.label_accuracy * 100.0);
                println!(
                    "test macro-F1   {:.4} (micro-F1 {:.4})",
                    m.macro_f1, m.micro_f1
                );
            }
            println!("test loss       {loss:.4} (binary cross-entropy per label)");
        }
        (_, Some(loss), _, Some(r)) => {
            println!("test RMSE       {:.4} (in the targets' units)", r.rmse);
            println!("test MAE        {:.4}", r.mae);
            println!("test R²         {:.4}", r.r2);
            println!("test loss       {loss:.4} (on standardised targets)");
        }
        (_, Some(loss), Some(baseline), None) => {
            println!("test loss       {loss:.5} (per-pixel MSE of the next frame)");
            println!(
                "copy-last       {baseline:.5} (the same loss, predicting the last frame seen)"
            );
        }
        (Some(accuracy), Some(loss), None, None) => {
            println!("test accuracy   {:.2}%", accuracy * 100.0);
            if let Some(top5) = summary.test_top5_accuracy {
                println!("test top-5      {:.2}%", top5 * 100.0);
            }
            if let Some(f1) = summary.test_macro_f1 {
                println!("test macro-F1   {f1:.4}");
            }
            println!("test loss       {loss:.4}");
        }
        _ => println!("test figures    (not evaluated: stopped mid-epoch)"),
    }
    if let Some((path, epoch)) = &summary.best_checkpoint {
        println!(
            "best epoch      {} ({}){}",
            epoch + 1,
            shell::quote_path(path),
            if summary.test_from_best {
                ": the test figures above are its weights'"
            } else {
                ""
            }
        );
    }
    if summary.stopped_early {
        println!(
            "stopped early   after epoch {} (train.early_stopping's patience)",
            summary.epoch
        );
    }
    println!("epochs run      {}", summary.epochs.len());
    println!("wall time       {:.1} s", summary.wall_seconds);
    if summary.epochs.is_empty() {
        println!("train speed     n/a (no epoch completed in this run)");
    } else {
        println!(
            "train speed     {:.0} samples/s ({} threads)",
            summary.train_samples_per_sec, summary.threads
        );
    }
    println!("peak RSS        {rss}");
    let pool = &summary.memory;
    println!(
        "tensor memory   peak {:.1} MiB in use, {:.1} MiB reserved{}; micro-batch {}{}",
        pool.peak_in_use_bytes as f64 / (1 << 20) as f64,
        pool.peak_reserved_bytes as f64 / (1 << 20) as f64,
        summary.memory_limit.map_or(String::new(), |l| format!(
            " (limit {:.1} MiB)",
            l as f64 / (1 << 20) as f64
        )),
        summary.micro_batch,
        if summary.oom_events > 0 {
            format!(", {} out-of-memory events handled", summary.oom_events)
        } else {
            String::new()
        }
    );
    if summary.cache_cleanups > 0 {
        println!(
            "cache cleanups  {} in {:.1} ms total",
            summary.cache_cleanups,
            summary.cache_cleanup_seconds * 1e3
        );
    }
    let loader = &summary.loader_memory;
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!(
        "loader memory   data/cache peak {:.1} MiB, prefetched batches peak {:.1} MiB{}",
        mib(loader.cache_peak_bytes),
        mib(loader.prefetched_bytes_max),
        loader
            .budget
            .map_or(String::new(), |b| format!(" (budget {:.1} MiB)", mib(b)))
    );
    if summary.data_on_device {
        println!("training data   held on the device; batches made there (data.on_device)");
    }
    if let Some(path) = &summary.resumed_from {
        println!("resumed from    {}", path.display());
    }
    if let Some(path) = &summary.last_checkpoint {
        println!("checkpoint      {}", path.display());
    }
}
