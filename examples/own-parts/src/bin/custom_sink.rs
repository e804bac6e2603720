//! A sink of your own (steps.csv and epochs.csv beside metrics.jsonl)
//! on a run of the spirals:
//! `cargo run --release -p headroom-examples --bin custom_sink -- --out runs/csv`.

use headroom_examples::csv_sink::CsvSink;
use headroom_examples::{example_trainer, parse_args, run_and_report};

fn main() -> std::process::ExitCode {
    let (example, out) = match parse_args(std::env::args()) {
        Ok(parsed) => parsed,
        Err(e) => {
            eprintln!("error: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    match example_trainer(&example, &out, "mlp", false) {
        Ok(trainer) => run_and_report(trainer.sink(Box::new(CsvSink::new()))),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
