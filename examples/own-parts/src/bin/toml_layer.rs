//! A TOML experiment that names a layer of your own
//! (`experiments/gated_spirals.toml`: `{ type = "custom", name =
//! "gated_residual" }`), trained by `headroom_pipeline::train` exactly as
//! `cargo xtask train` trains an experiment, the registry passed in
//! `TrainOptions::layers`; then the run's newest checkpoint is scored by
//! `eval` and its test table by `predict`, through the same registry.
//!
//! `cargo run --release -p headroom-examples --bin toml_layer -- --out runs/toml
//! [--resume] [--epochs N] [--samples N]`: the spirals are written as
//! `OUT/data/{train,test}.csv` (columns x, y, arm), the run goes in
//! `OUT/run`, the predictions in `OUT/predictions.csv`.

use std::fs;
use std::path::Path;
use std::process::ExitCode;

use headroom_examples::{parse_args, registry, spirals::Spirals, spirals::ARMS, Example};
use headroom_pipeline::{eval, predict, ExperimentConfig, Overrides, Resume, TrainOptions};

const EXPERIMENT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/experiments/gated_spirals.toml"
);

fn main() -> ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
    let (example, out) = match parse_args(std::env::args()) {
        Ok(parsed) => parsed,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&example, &out) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(example: &Example, out: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let data = out.join("data");
    write_spirals(&data, example)?;
    let run_dir = out.join("run");
    let overrides = Overrides::parse(&[
        format!("data.dir={}", data.display()),
        format!("run.output_dir={}", run_dir.display()),
        format!("train.epochs={}", example.epochs),
    ])?;
    let config = ExperimentConfig::load(Path::new(EXPERIMENT), &overrides)?;
    let layers = registry();
    let summary = headroom_pipeline::train(
        &config,
        &TrainOptions {
            resume: if example.resume {
                Resume::Latest
            } else {
                Resume::No
            },
            layers: layers.clone(),
            ..TrainOptions::default()
        },
    )?;
    println!(
        "trained: {} epochs, step {}, test accuracy {}",
        summary.epoch,
        summary.step,
        summary
            .test_accuracy
            .map_or("-".into(), |a| format!("{:.2}%", a * 100.0))
    );
    let report = eval::evaluate_checkpoint_with(&run_dir, None, 256, None, &layers)?;
    println!(
        "eval: step {}, test accuracy {}, test loss {:.4}",
        report.step,
        report
            .accuracy
            .map_or("-".into(), |a| format!("{:.2}%", a * 100.0)),
        report.loss
    );
    let options = predict::PredictOptions {
        layers,
        ..predict::PredictOptions::default()
    };
    let predictions = predict::predict_with(&run_dir, &data.join("test.csv"), &options)?;
    let mut file = fs::File::create(out.join("predictions.csv"))?;
    predict::write_csv(&predictions, &mut file)?;
    println!(
        "predict: {} rows in {}",
        predictions.sources.len(),
        out.join("predictions.csv").display()
    );
    Ok(())
}

/// `DIR/train.csv` and `DIR/test.csv`: the spirals' points and arms (the
/// test set drawn with the next seed), written once.
fn write_spirals(dir: &Path, example: &Example) -> std::io::Result<()> {
    fs::create_dir_all(dir)?;
    for (name, samples, seed) in [
        ("train.csv", example.train_samples, example.seed),
        ("test.csv", example.test_samples, example.seed + 1),
    ] {
        let path = dir.join(name);
        if path.exists() {
            continue;
        }
        let spirals = Spirals::new(samples, ARMS, seed);
        let mut text = String::from("x,y,arm\n");
        for index in 0..samples {
            let ([x, y], arm) = spirals.point(index);
            text.push_str(&format!("{x},{y},{arm}\n"));
        }
        let partial = dir.join(format!(".{name}.partial"));
        fs::write(&partial, text)?;
        fs::rename(&partial, &path)?;
    }
    Ok(())
}
