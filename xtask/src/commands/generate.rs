//! `cargo xtask generate`: a Hugging Face model directory's continuation of
//! a prompt, on the CPU (headroom-llm), greedy or top-p with a seed. The
//! continuation alone goes to stdout; what was loaded goes to the log.

use anyhow::{Context, Result};
use headroom_llm::{Model, Sampling, Tokenizer};

use crate::GenerateArgs;

pub fn run(args: GenerateArgs) -> Result<()> {
    let sampling = match (args.temperature, args.top_p) {
        (None, None) => Sampling::Greedy,
        (temperature, top_p) => Sampling::TopP {
            temperature: temperature.unwrap_or(1.0),
            top_p: top_p.unwrap_or(1.0),
            seed: args.seed,
        },
    };
    let context = || format!("generating with {}", args.model.display());
    let model = Model::load(&args.model).with_context(context)?;
    let tokenizer = Tokenizer::load(&args.model).with_context(context)?;
    tracing::info!(
        "{} ({} layers, hidden {}, vocabulary {}) from {}",
        model.config.architecture,
        model.config.num_layers,
        model.config.hidden_size,
        model.config.vocab_size,
        args.model.display()
    );
    let prompt = tokenizer.encode(&args.prompt)?;
    let ids = model.generate(&prompt, args.max_new_tokens, sampling)?;
    println!("{}", tokenizer.decode(&ids)?);
    Ok(())
}
