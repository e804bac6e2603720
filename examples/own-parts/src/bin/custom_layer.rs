//! A layer of your own (the gated residual, registered by name and named
//! in the model spec) trained on the spirals; on `--device cuda` it is
//! refused by name (it has no CUDA implementation):
//! `cargo run --release -p headroom-examples --bin custom_layer -- --out runs/gated`.

use headroom_examples::{example_trainer, parse_args, run_and_report};

fn main() -> std::process::ExitCode {
    let (example, out) = match parse_args(std::env::args()) {
        Ok(parsed) => parsed,
        Err(e) => {
            eprintln!("error: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    match example_trainer(&example, &out, "gated mlp", true) {
        Ok(trainer) => run_and_report(trainer),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
