//! `cargo xtask generate`: a Hugging Face model directory's continuation of
//! a prompt, on the CPU (headroom-llm), greedy or top-p with a seed. The
//! continuation alone goes to stdout; what was loaded goes to the log.
//! `--adapters DIR` merges peft-format LoRA adapters into the model first.

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
    let mut model = Model::load(&args.model).with_context(context)?;
    if let Some(dir) = &args.adapters {
        let (adapters, config) = headroom_llm::peft::load_adapters(dir, &model)?;
        model.merge_adapters(&adapters)?;
        tracing::info!(
            "LoRA adapters from {} ({} modules, r {}) merged",
            dir.display(),
            adapters.len(),
            config.r
        );
    }
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
