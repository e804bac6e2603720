//! A layer of your own (the gated residual, registered by name and named
//! in the model spec) trained on the spirals; on `--device cuda` it is
//! refused by name (it has no CUDA implementation):
//! `cargo run --release -p headroom-examples --bin custom_layer -- --out runs/gated`.

use headroom_examples::example_trainer;

fn main() -> std::process::ExitCode {
    headroom_examples::main_with(|example, out| example_trainer(example, out, "gated mlp", true))
}
