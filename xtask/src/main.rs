//! `cargo xtask <command>`: the front door. `train` runs an experiment.
//! This file holds the command line (clap's definitions) and the dispatch;
//! each command's body is in `commands/<command>.rs`.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

mod cargo;
mod commands;
mod devices;
mod ranks;
mod signals;

const DEFAULT_EXPERIMENT: &str = "experiments/fashion_mnist.toml";

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "headroom: train neural networks within the memory you have"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train an experiment (default: the Fashion-MNIST ResNet on the CPU).
    Train(TrainArgs),
    /// Time the training step (and the loader); optionally beside PyTorch.
    Bench(BenchCommand),
    /// The whole job (`train`'s, from the process's start to its summary),
    /// alternated with PyTorch's same job with --compare-torch: both walls,
    /// both accuracies, the ratio, the load average beside each run.
    BenchJob(BenchJobCommand),
    /// One loader configuration as a JSON line (used by `bench --loader`).
    #[command(hide = true)]
    BenchLoaderOne(BenchLoaderOneCommand),
    /// Pack a Fashion-MNIST directory, or your images, table or tensor files
    /// (--from DIR --kind image_folder|csv|npy|safetensors), into a shard
    /// store (train/ and test/), or, with --config, a text experiment's
    /// corpus into its window store.
    Preprocess(PreprocessArgs),
    /// Test accuracy, loss and confusion matrix of a checkpoint (a token
    /// model: validation loss and bits per byte).
    Eval(EvalArgs),
    /// Score new inputs with a trained run: images, a CSV or tensor files
    /// in, each input's class and probabilities (or values) out, as CSV or
    /// JSON, with the preprocessing the run trained with.
    Predict(PredictArgs),
    /// Write a checkpoint's weights for other tools (safetensors: names as in
    /// the model spec, layouts in the file's metadata).
    Export(ExportArgs),
    /// Fold LoRA adapters (a run's adapters.safetensors) into their base
    /// weights: the base architecture's tensors as safetensors, named as
    /// `export` names them. With --model: peft adapters (a directory) into
    /// a Hugging Face model, written as a new model directory.
    LoraMerge(LoraMergeArgs),
    /// Continue a prompt with a Hugging Face model directory (Llama, Qwen2,
    /// Mistral or GPT-2: config.json, safetensors, tokenizer.json) on the
    /// CPU: greedy, or top-p with --temperature/--top-p/--seed.
    Generate(GenerateArgs),
    /// LoRA fine-tuning of a Hugging Face model directory (the Llama family)
    /// on a JSONL file (`text`, or `prompt` + `completion`) on the CPU, in
    /// a run directory (checkpoints, run.json, metrics.jsonl; `--resume
    /// OUT` continues one), ending with peft's adapter_model.safetensors and
    /// adapter_config.json at its top level.
    LoraLlm(LoraLlmArgs),
    /// Full fine-tuning of a small Hugging Face model directory (every
    /// weight, AdamW) on a JSONL file on the CPU, written at the end as a
    /// new Hugging Face model directory in the base's layout and dtypes.
    FinetuneLlm(FinetuneLlmArgs),
    /// What this machine has and what headroom will do on it.
    Doctor,
    /// Every GPU check: driver, GPU, NVRTC and cuBLAS report, kernels compiled for
    /// this GPU, and every CUDA test binary with skipping turned into failure.
    GpuCheck(GpuCheckArgs),
    /// Run every CUDA parity test on the CPU emulator under valgrind's
    /// memcheck (after a control it must fault): finds kernels that read
    /// locals they never wrote. Logs in target/memcheck.
    Memcheck(MemcheckArgs),
    /// One timed configuration as a JSON line (used by `bench`).
    #[command(hide = true)]
    BenchStep(BenchStepCommand),
    /// A LoRA fine-tuning step on a Hugging Face model of published shapes
    /// (random weights): tokens/s and peak memory, beside transformers +
    /// peft with --compare-peft.
    BenchLlm(commands::llm_bench::BenchLlmArgs),
}

#[derive(clap::Args)]
struct TrainArgs {
    /// Experiment TOML file; repeat to run several in sequence
    /// [default: experiments/fashion_mnist.toml; with --resume RUN_DIR,
    /// the run's own config.toml].
    #[arg(long)]
    config: Vec<PathBuf>,
    /// Profile overlay, experiments/profiles/NAME.toml: low_memory, max_speed, cpu, none
    /// (default: auto, which picks low_memory below 4 GiB). Same as --set run.profile=NAME.
    #[arg(long)]
    profile: Option<String>,
    /// Loader worker threads. Same as --set data.workers=N.
    #[arg(long)]
    workers: Option<usize>,
    #[command(flatten)]
    switches: Switches,
    /// Continue a run: a run directory (its own config.toml is the
    /// experiment, --set goes on top), a checkpoint file in one, or, with
    /// no value, the newest run of the experiment.
    #[arg(long, value_name = "RUN_DIR|CHECKPOINT", num_args = 0..=1, default_missing_value = "")]
    resume: Option<String>,
    /// Override a config key, e.g. --set train.epochs=1 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    /// Never install the dataset package, even as root.
    #[arg(long)]
    no_install: bool,
    /// Train data parallel on N GPUs of this machine, one process per GPU,
    /// over NCCL (train.batch_size per GPU). --devices 1 trains on one GPU
    /// through the same path, to measure what the path costs.
    #[arg(long, value_parser = at_least_one())]
    devices: Option<usize>,
}

#[derive(clap::Args)]
struct BenchCommand {
    #[arg(long, default_value = DEFAULT_EXPERIMENT)]
    config: PathBuf,
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    /// Batch sizes to time [default: 32,128,256 on the CPU, 128,512 on a GPU].
    #[arg(long, value_delimiter = ',', value_parser = at_least_one())]
    batch: Vec<usize>,
    /// Where the step runs: cpu or cuda (the GPU; PyTorch then runs with
    /// AMP, channels_last, fused AdamW and torch.compile).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Compute threads (default: every core).
    #[arg(long, value_parser = at_least_one())]
    threads: Option<usize>,
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    #[arg(long, default_value_t = 20, value_parser = at_least_one())]
    steps: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Also write the JSON report to this file (the table is still printed).
    #[arg(long, value_name = "PATH")]
    json_out: Option<PathBuf>,
    /// GPU: after the timed steps, time 10 more segment by segment (each
    /// layer's forward and backward, the loss, the optimizer; launched
    /// one kernel at a time) and print where the time goes.
    #[arg(long)]
    profile: bool,
    /// Also run the PyTorch equivalent (same model, batch, threads) and print the ratio.
    #[arg(long)]
    compare_torch: bool,
    /// With --device cuda --compare-torch: torch.compile's mode for
    /// PyTorch's step (`reduce-overhead` replays CUDA graphs, as
    /// headroom's step does).
    #[arg(long, default_value = "default", value_parser = ["default", "reduce-overhead", "max-autotune"])]
    torch_compile_mode: String,
    /// Time the loader alone: shards with cache 1 and 2, full load, and IDX in memory.
    #[arg(long)]
    loader: bool,
    /// Hold headroom and PyTorch to AVX2+FMA (and the peak to the AVX2
    /// FMA loop): an AVX2-only machine's comparison on an AVX-512 one.
    #[arg(long)]
    avx2_only: bool,
}

#[derive(clap::Args)]
struct BenchJobCommand {
    #[arg(long, default_value = DEFAULT_EXPERIMENT)]
    config: PathBuf,
    /// Override a config key on both sides, e.g. --set train.epochs=1.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    /// Compute threads on both sides (default: every core).
    #[arg(long, value_parser = at_least_one())]
    threads: Option<usize>,
    /// Loader workers on both sides (default: the experiment's data.workers,
    /// or what headroom picks for this machine).
    #[arg(long)]
    workers: Option<usize>,
    /// Rounds of the job (each side once a round, the order alternating).
    #[arg(long, default_value_t = 1, value_parser = at_least_one())]
    rounds: usize,
    /// Also run PyTorch's same job (bench/torch/torch_fashion_mnist.py).
    #[arg(long)]
    compare_torch: bool,
    /// Hold both sides to AVX2+FMA on an AVX-512 CPU (as `bench --avx2-only`).
    #[arg(long)]
    avx2_only: bool,
    /// Where the runs and their logs go (a new folder each time).
    #[arg(long, default_value = "target/bench-job")]
    output_dir: PathBuf,
    /// Also write the report as JSON to this file.
    #[arg(long, value_name = "PATH")]
    json_out: Option<PathBuf>,
}

#[derive(clap::Args)]
struct BenchLoaderOneCommand {
    /// The experiment (every mode but csv).
    #[arg(long)]
    config: Option<PathBuf>,
    /// The shard store; with --mode csv, the CSV file (written first, with
    /// --rows rows, when it does not exist); with --mode image_folder, the
    /// PNG folder (written first from Fashion-MNIST, --rows training
    /// images, when it does not exist).
    #[arg(long)]
    store: PathBuf,
    /// cache1, cache2, full or idx: one loader configuration as a JSON line;
    /// csv: CSV ingest rows/s of headroom's table reader beside pandas'
    /// read_csv (bench/pandas_read_csv.py) on the same file; image_folder:
    /// `preprocess --kind image_folder` images/s beside torchvision's
    /// ImageFolder + PIL (bench/torch/torchvision_imagefolder.py), pinned
    /// to the same cores.
    #[arg(long)]
    mode: String,
    /// With --mode csv: rows of the generated CSV (8 features and a target);
    /// with --mode image_folder: training images of the generated folder.
    #[arg(long)]
    rows: Option<usize>,
}

#[derive(clap::Args)]
struct PreprocessArgs {
    /// Directory with the IDX files (default: where `train` would look).
    #[arg(long)]
    input: Option<PathBuf>,
    /// The store to write (Fashion-MNIST, or --from's images; required
    /// without --config). It gets train/ and test/ shard stores.
    #[arg(long, required_unless_present = "config")]
    output: Option<PathBuf>,
    /// Data of your own to pack, of the --kind given: for image_folder, a
    /// folder holding train/ and test/, each with one subfolder of PNG or
    /// JPEG images per class; for csv, a folder holding train.csv and
    /// test.csv; for npy or safetensors, a folder holding train/ and test/,
    /// each a directory of .npz, .safetensors or .npy files.
    #[arg(long, requires = "kind", conflicts_with = "input")]
    from: Option<PathBuf>,
    /// What --from holds: image_folder, csv, npy or safetensors (npy and
    /// safetensors read any of .npz, .safetensors and STEM_x.npy +
    /// STEM_y.npy, as data.format = "tensors" does).
    #[arg(long, requires = "from")]
    kind: Option<String>,
    /// With --kind csv: the target column(s), comma-separated, as
    /// data.targets names them.
    #[arg(long, requires = "from", value_delimiter = ',')]
    targets: Vec<String>,
    /// With --kind csv: the feature columns in model order, as
    /// data.features [default: every column that is not a target].
    #[arg(long, requires = "from", value_delimiter = ',')]
    features: Vec<String>,
    /// With --kind csv: the targets are numbers (a regression, trained
    /// with train.loss = "mse" or "huber"); without it the one target
    /// column holds classes.
    #[arg(long, requires = "from")]
    regression: bool,
    /// With --kind npy or safetensors: the input array's name, as
    /// data.input_array [default: x].
    #[arg(long, requires = "from")]
    input_array: Option<String>,
    /// With --kind npy or safetensors: the target array's name, as
    /// data.target_array [default: y].
    #[arg(long, requires = "from")]
    target_array: Option<String>,
    /// With --kind image_folder: each image's HEIGHTxWIDTH [default: 28x28].
    #[arg(long, requires = "from", value_name = "HxW")]
    image_size: Option<String>,
    /// With --kind image_folder: 1 (grayscale) or 3 (RGB) [default: 1].
    #[arg(long, requires = "from")]
    channels: Option<usize>,
    /// With --kind image_folder: how an image of another size is fit,
    /// center_crop or resize [default: center_crop].
    #[arg(long, requires = "from")]
    fit: Option<String>,
    /// A text experiment (data.format = "text"): pack its `[text]` corpus
    /// where `train` will read it (data.dir), installing the package if
    /// missing and allowed.
    #[arg(long, conflicts_with_all = ["input", "output", "from"])]
    config: Option<PathBuf>,
    /// --set key=value overrides of the text experiment.
    #[arg(long = "set", requires = "config")]
    overrides: Vec<String>,
    /// With --config: never install the corpus package.
    #[arg(long)]
    no_install: bool,
    /// Samples per shard ("4096") or bytes per shard ("64MiB").
    #[arg(long, default_value = "4096")]
    shard_size: String,
    /// Replace an existing store (atomically).
    #[arg(long)]
    overwrite: bool,
}

#[derive(clap::Args)]
struct EvalArgs {
    #[arg(long)]
    checkpoint: PathBuf,
    /// Dataset directory, if not the one the run used.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Test-time augmentation: "none" or "flip" (default: the run's
    /// eval.tta).
    #[arg(long)]
    tta: Option<String>,
}

#[derive(clap::Args)]
struct PredictArgs {
    /// A run directory (its newest checkpoint of its own) or a checkpoint.
    #[arg(long)]
    checkpoint: PathBuf,
    /// An image or a folder of images (image models), a CSV (a table's
    /// run), or .npz/.safetensors/.npy inputs (a tensor files' run).
    #[arg(long)]
    input: PathBuf,
    /// Where to write: a .json file gets JSON, anything else CSV; unset:
    /// CSV on standard output.
    #[arg(long)]
    output: Option<PathBuf>,
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// cpu, cuda (an image classifier on the GPU) or auto (the GPU when
    /// there is one and the run is an image classifier).
    #[arg(long, default_value = "cpu")]
    device: String,
}

#[derive(clap::Args)]
struct ExportArgs {
    #[arg(long)]
    checkpoint: PathBuf,
    /// Only "safetensors" for now.
    #[arg(long, default_value = "safetensors")]
    format: String,
    /// Default: the checkpoint's path with the extension .safetensors.
    #[arg(long)]
    output: Option<PathBuf>,
}

#[derive(clap::Args)]
struct LoraMergeArgs {
    /// A run's adapters.safetensors; with --model, a peft adapter directory
    /// (adapter_model.safetensors + adapter_config.json).
    #[arg(long)]
    adapters: PathBuf,
    /// Base checkpoint or run directory [default: the one the adapters
    /// file records].
    #[arg(long, conflicts_with = "model")]
    base: Option<PathBuf>,
    /// A Hugging Face model directory (Llama family or GPT-2) to merge peft
    /// adapters into; --output is then the new model directory.
    #[arg(long, requires = "output")]
    model: Option<PathBuf>,
    /// Default: merged.safetensors beside the adapters. With --model: a
    /// directory that does not exist yet (or is empty).
    #[arg(long)]
    output: Option<PathBuf>,
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// The model directory.
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    prompt: String,
    #[arg(long, default_value_t = 32)]
    max_new_tokens: usize,
    /// Sample instead of greedy: logits divided by this [default with
    /// --top-p: 1].
    #[arg(long)]
    temperature: Option<f32>,
    /// Sample from the smallest set of likeliest tokens holding this much
    /// probability [default with --temperature: 1].
    #[arg(long)]
    top_p: Option<f32>,
    /// The sampling seed (same seed and prompt, same text).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// A LoRA adapter directory (peft's adapter_model.safetensors and
    /// adapter_config.json, e.g. from lora-llm), merged into the model.
    #[arg(long)]
    adapters: Option<PathBuf>,
}

/// `lora-llm`: a new run (--model, --data, --output) or `--resume OUT`,
/// which takes the run's recorded settings; a setting given with
/// `--resume` must be one that may change (--epochs, --lr, --max-steps,
/// --save-steps, --keep-checkpoints, or --model/--data pointing at the same
/// files moved) or equal the recorded one.
#[derive(clap::Args)]
struct LoraLlmArgs {
    /// A fine-tuning recipe (TOML: experiments/llm/lora_llm.toml is the seed
    /// recipe); the flags given go on top of it. Relative paths in it are
    /// from its directory.
    #[arg(long, value_name = "FILE", conflicts_with = "resume")]
    config: Option<PathBuf>,
    /// Override a recipe key, e.g. --set lora.r=4 --set train.lr=1e-3
    /// (repeatable; over --config, under the flags).
    #[arg(long = "set", value_name = "KEY=VALUE", conflicts_with = "resume")]
    overrides: Vec<String>,
    /// Refuse, before the first step, a fine-tune that would need more
    /// memory than this (e.g. 4GiB): weights, adapters with their gradients
    /// and moments, and one pass at the largest micro-batch the data holds
    /// [default: the room the system leaves: cgroup, rlimits, available
    /// memory].
    #[arg(long, value_name = "BYTES")]
    memory_limit: Option<String>,
    /// The model directory [resume: the run's].
    #[arg(long)]
    model: Option<PathBuf>,
    /// JSONL, one example a line: {"text": …} or {"prompt": …, "completion": …}
    /// [resume: the run's].
    #[arg(long)]
    data: Option<PathBuf>,
    /// The run directory (made if missing): checkpoints, run.json,
    /// metrics.jsonl, and the final adapters at its top level.
    #[arg(long, conflicts_with = "resume")]
    output: Option<PathBuf>,
    /// Continue the run in this directory from its newest checkpoint.
    #[arg(long, value_name = "OUT")]
    resume: Option<PathBuf>,
    /// [default: 8]
    #[arg(long)]
    r: Option<usize>,
    /// [default: 16]
    #[arg(long)]
    alpha: Option<f32>,
    /// Dropout on the adapters' input (peft's lora_dropout), in [0, 1)
    /// [default: 0].
    #[arg(long)]
    dropout: Option<f32>,
    /// Comma-separated module names (q_proj, k_proj, v_proj, o_proj,
    /// gate_proj, up_proj, down_proj) [default: q_proj,v_proj].
    #[arg(long)]
    target: Option<String>,
    /// [default: 1]
    #[arg(long, value_parser = at_least_one())]
    epochs: Option<usize>,
    /// [default: 2e-4]
    #[arg(long)]
    lr: Option<f32>,
    /// Examples per micro-batch, right-padded to the longest [default: 1].
    #[arg(long, value_parser = at_least_one())]
    batch_size: Option<usize>,
    /// Micro-batches per optimizer step [default: 8].
    #[arg(long, value_parser = at_least_one())]
    accumulate: Option<usize>,
    /// Warm up over this many steps, then a cosine to 0 [default: constant lr].
    #[arg(long)]
    warmup_steps: Option<usize>,
    /// [default: 0]
    #[arg(long)]
    weight_decay: Option<f32>,
    /// Stop after this many optimizer steps.
    #[arg(long)]
    max_steps: Option<usize>,
    /// [default: 1024]
    #[arg(long)]
    max_seq_length: Option<usize>,
    /// Lay the examples end to end in rows of --max-seq-length.
    #[arg(long)]
    packing: bool,
    /// [default: 0]
    #[arg(long)]
    seed: Option<u64>,
    /// Checkpoint every N optimizer steps [default: at each epoch's end];
    /// also at the end and on SIGINT/SIGTERM.
    #[arg(long, value_parser = at_least_one())]
    save_steps: Option<usize>,
    /// Checkpoints kept, the newest [default: 2].
    #[arg(long, value_parser = at_least_one())]
    keep_checkpoints: Option<usize>,
    /// Where the JSONL's token stores are kept, one per data file,
    /// tokenizer and data options [default: $XDG_CACHE_HOME/headroom/llm-tokens,
    /// else ~/.cache/headroom/llm-tokens].
    #[arg(long, value_name = "DIR")]
    token_cache: Option<PathBuf>,
}

/// `finetune-llm`: a full fine-tune (every weight) in a run directory OUT
/// (run.json, metrics.jsonl, checkpoints), the trained model written at the
/// end as OUT/model, a Hugging Face model directory; `--resume OUT`
/// continues one from its newest checkpoint with its recorded settings.
#[derive(clap::Args)]
struct FinetuneLlmArgs {
    /// Refuse, before the first step, a fine-tune that would need more
    /// memory than this (e.g. 4GiB): the weights, their gradients (the
    /// step's sum and a pass's), AdamW's two moments, and one pass at the
    /// largest micro-batch [default: the room the system leaves: cgroup,
    /// rlimits, available memory].
    #[arg(long, value_name = "BYTES")]
    memory_limit: Option<String>,
    /// The model directory (config.json, safetensors, tokenizer.json)
    /// [resume: the run's].
    #[arg(long)]
    model: Option<PathBuf>,
    /// JSONL, one example a line: {"text": …} or {"prompt": …, "completion": …}
    /// [resume: the run's].
    #[arg(long)]
    data: Option<PathBuf>,
    /// The run directory (made if missing; one holding a run is refused):
    /// run.json, metrics.jsonl, checkpoints, and the trained model in
    /// OUT/model at the end.
    #[arg(long, conflicts_with = "resume")]
    output: Option<PathBuf>,
    /// Continue the run in this directory from its newest checkpoint.
    #[arg(long, value_name = "OUT")]
    resume: Option<PathBuf>,
    /// [default: 1]
    #[arg(long, value_parser = at_least_one())]
    epochs: Option<usize>,
    /// [default: 2e-5]
    #[arg(long)]
    lr: Option<f32>,
    /// Examples per micro-batch, right-padded to the longest [default: 1].
    #[arg(long, value_parser = at_least_one())]
    batch_size: Option<usize>,
    /// Micro-batches per optimizer step [default: 8].
    #[arg(long, value_parser = at_least_one())]
    accumulate: Option<usize>,
    /// Warm up over this many steps, then a cosine to 0 [default: constant lr].
    #[arg(long)]
    warmup_steps: Option<usize>,
    /// [default: 0]
    #[arg(long)]
    weight_decay: Option<f32>,
    /// Stop after this many optimizer steps.
    #[arg(long)]
    max_steps: Option<usize>,
    /// [default: 1024]
    #[arg(long)]
    max_seq_length: Option<usize>,
    /// Lay the examples end to end in rows of --max-seq-length.
    #[arg(long)]
    packing: bool,
    /// [default: 0]
    #[arg(long)]
    seed: Option<u64>,
    /// Clip each step's gradient to this global L2 norm, as torch's
    /// clip_grad_norm_ [default: no clipping].
    #[arg(long)]
    max_grad_norm: Option<f32>,
    /// Checkpoint every N optimizer steps [default: at each epoch's end];
    /// also at the end and on SIGINT/SIGTERM.
    #[arg(long, value_parser = at_least_one())]
    save_steps: Option<usize>,
    /// Checkpoints kept, the newest [default: 2].
    #[arg(long, value_parser = at_least_one())]
    keep_checkpoints: Option<usize>,
    /// Where the JSONL's token stores are kept [default:
    /// $XDG_CACHE_HOME/headroom/llm-tokens, else ~/.cache/headroom/llm-tokens].
    #[arg(long, value_name = "DIR")]
    token_cache: Option<PathBuf>,
}

#[derive(clap::Args)]
struct MemcheckArgs {
    /// Only the tests whose name contains this.
    filter: Option<String>,
    /// Also the learner's and the training runs' CUDA tests
    /// (cuda_learner, cuda_training): about three times as long.
    #[arg(long)]
    all: bool,
}

#[derive(clap::Args)]
struct BenchStepCommand {
    #[arg(long)]
    config: PathBuf,
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    #[arg(long, value_parser = at_least_one())]
    batch: usize,
    #[arg(long, value_parser = at_least_one())]
    threads: usize,
    #[arg(long)]
    warmup: usize,
    #[arg(long, value_parser = at_least_one())]
    steps: usize,
    #[arg(long)]
    profile: bool,
}

#[derive(clap::Args)]
struct GpuCheckArgs {
    /// Print the CUDA test binaries it runs (PACKAGE TEST, one a line) and
    /// stop: no report, no GPU needed.
    #[arg(long)]
    list: bool,
}

/// The train switches that map to config keys.
#[derive(clap::Args, Debug)]
struct Switches {
    /// f32 instead of mixed precision on the GPU (f32 activations and
    /// weights, no loss scaling). Same as --set device.amp=false; the CPU
    /// trains in f32 either way.
    #[arg(long)]
    no_amp: bool,
    /// Fusion off: batch norm, ReLU and the residual add as separate
    /// passes (CPU) or kernels (GPU). Same as --set device.fusion=false.
    #[arg(long)]
    no_fusion: bool,
    /// CUDA graphs off: the GPU step launches every kernel from the host
    /// instead of replaying a captured graph. Same as --set device.graphs=false.
    #[arg(long)]
    no_graphs: bool,
    /// Channels-last off. headroom is channels-last (NHWC) only: there is no other layout to switch to.
    #[arg(long)]
    no_channels_last: bool,
}

fn main() -> ExitCode {
    keep_freed_memory();
    init_logging();
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(error) => {
            // One clear message, with its causes, and a failing exit status;
            // every rank's, named.
            match ranks::launcher_rank_world() {
                Some((rank, world)) if world > 1 => {
                    eprintln!("error (rank {rank} of {world}): {}", error_chain(&error))
                }
                _ => eprintln!("error: {}", error_chain(&error)),
            }
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes, each said once: a cause whose text the message
/// already holds (an error that prints its source) is not repeated.
fn error_chain(error: &anyhow::Error) -> String {
    let mut message = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        if message.contains(&text) {
            continue;
        }
        if !message.is_empty() {
            message.push_str(": ");
        }
        message.push_str(&text);
    }
    message
}

/// Keeps freed memory in the process (glibc would hand every freed
/// activation, up to 13 MB each, back to the OS and fault it in again on
/// the next step: measured at 9x the cost of a ReLU forward+backward).
/// Under an address-space limit (RLIMIT_AS), instead: one malloc arena
/// (each extra one reserves 64 MiB of address space per thread that
/// allocates, which alone would exhaust a few hundred MiB of limit and make
/// thread creation fail), and every block of 256 KiB or more its own
/// mapping, so that what the tensor pool releases after an out-of-memory
/// error goes back to the OS as address space. Kept in the heap, it stayed
/// counted against the limit, and the retry's next allocation outside the
/// pool, which no policy sees, could be refused and abort the process.
/// What keeps the pool itself from taking the last of the limit is the
/// headroom of `headroom_model::address_space` (docs/memory.md).
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tunables and getrlimit only
    // writes the struct we pass; both run before any other thread exists.
    unsafe {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_AS, &mut limit) == 0
            && limit.rlim_cur != libc::RLIM_INFINITY
        {
            libc::mallopt(libc::M_ARENA_MAX, 1);
            libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 10);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 20);
        } else {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        }
    }
}

fn init_logging() {
    // A data-parallel run's followers: warnings and errors only (the
    // leader logs the run).
    let default = if ranks::launcher_rank() > 0 {
        "warn"
    } else {
        "info"
    };
    let filter =
        EnvFilter::try_from_env("HEADROOM_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .with_timer(tracing_subscriber::fmt::time::uptime())
        .init();
}

fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Train(args) => commands::train::run(args),
        Command::Bench(args) => done(commands::bench::command(args)),
        Command::BenchJob(args) => done(commands::job_bench::run(args)),
        Command::BenchLoaderOne(args) => done(commands::loader_bench::one_command(args)),
        Command::Preprocess(args) => done(commands::preprocess::run(args)),
        Command::BenchStep(args) => done(commands::bench::step_command(args)),
        Command::Eval(args) => commands::eval::run(args),
        Command::Predict(args) => done(commands::predict::run(args)),
        Command::Export(args) => commands::export::run(args),
        Command::LoraMerge(args) => commands::lora_merge::run(args),
        Command::Generate(args) => done(commands::generate::run(args)),
        Command::LoraLlm(args) => commands::lora_llm::run(args),
        Command::FinetuneLlm(args) => commands::finetune_llm::run(args),
        Command::BenchLlm(args) => done(commands::llm_bench::run(args)),
        Command::Doctor => done(commands::doctor::run()),
        Command::GpuCheck(args) => done(commands::gpu_check::run(&args)),
        Command::Memcheck(args) => done(commands::memcheck::run(args.filter.as_deref(), args.all)),
    }
}

/// A command that succeeded exits 0.
fn done(result: Result<()>) -> Result<ExitCode> {
    result.map(|()| ExitCode::SUCCESS)
}

/// A count that must be 1 or more (a batch, a number of steps or threads):
/// 0 is refused by the argument parser, naming the switch.
fn at_least_one() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::new().range(1..)
}
