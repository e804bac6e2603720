//! A dataset of your own (the spirals, made from each sample's index)
//! trained by headroom's Trainer with a model from a spec:
//! `cargo run --release -p headroom-examples --bin custom_dataset -- --out runs/spirals`.

use headroom_examples::example_trainer;

fn main() -> std::process::ExitCode {
    headroom_examples::main_with(|example, out| example_trainer(example, out, "mlp", false))
}
