//! A dataset of your own (the spirals, made from each sample's index)
//! trained by headroom's Trainer with a model from a spec:
//! `cargo run --release -p headroom-examples --bin custom_dataset -- --out runs/spirals`.

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
        Ok(trainer) => run_and_report(trainer),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
