//! A sink of your own (steps.csv and epochs.csv beside metrics.jsonl)
//! on a run of the spirals:
//! `cargo run --release -p headroom-examples --bin custom_sink -- --out runs/csv`.

use headroom_examples::csv_sink::CsvSink;
use headroom_examples::example_trainer;

fn main() -> std::process::ExitCode {
    headroom_examples::main_with(|example, out| {
        Ok(example_trainer(example, out, "mlp", false)?.sink(Box::new(CsvSink::new())))
    })
}
