//! `cargo xtask preprocess`: Fashion-MNIST, a folder of photos
//! (`--from DIR --kind image_folder`), a table (`--kind csv`) or tensor
//! files (`--kind npy|safetensors`) into a shard store, or a text
//! experiment's corpus into its window store.
//!
//! A table's or tensor files' samples keep their kind in the store (format
//! version 2: f32 features, numeric targets, a table's standardisation and
//! column names), so training on the store is training on the source.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{bail, Context, Result};
use headroom_loader::{
    Dataset, IdxDataset, ImageFolderConfig, LoaderError, MemoryUsage, SampleKind, ShardLayout,
    ShardSize, Split, StoreSource, TableConfig, TableTarget, TensorFiles, TensorFilesConfig,
};
use headroom_pipeline::config::ImageFit;
use headroom_pipeline::data::CLASSES_FILE;
use headroom_pipeline::{shell, ExperimentConfig, Overrides};

use crate::PreprocessArgs;

pub fn run(args: PreprocessArgs) -> Result<()> {
    let PreprocessArgs {
        input,
        output,
        from,
        kind,
        targets,
        features,
        regression,
        input_array,
        target_array,
        image_size,
        channels,
        fit,
        config,
        overrides,
        no_install,
        shard_size,
        overwrite,
    } = args;
    match (config, output, from) {
        (Some(config), _, _) => preprocess_text(&config, &overrides, !no_install),
        (None, Some(output), Some(from)) => {
            let kind = kind.unwrap_or_default();
            let shard_size: ShardSize = shard_size.parse().context("--shard-size")?;
            let image_flags = image_size.is_some() || channels.is_some() || fit.is_some();
            let table_flags = !targets.is_empty() || !features.is_empty() || regression;
            let array_flags = input_array.is_some() || target_array.is_some();
            let stray = |flags: bool, what: &str| {
                if flags {
                    bail!("{what} apply to another --kind than {kind:?}: remove them");
                }
                Ok(())
            };
            match kind.as_str() {
                "image_folder" => {
                    stray(table_flags, "--targets, --features and --regression")?;
                    stray(array_flags, "--input-array and --target-array")?;
                    let images = image_options(image_size.as_deref(), channels, fit.as_deref())?;
                    preprocess_images(&from, images, &output, shard_size, overwrite)
                }
                "csv" => {
                    stray(image_flags, "--image-size, --channels and --fit")?;
                    stray(array_flags, "--input-array and --target-array")?;
                    let table = TableArgs {
                        targets,
                        features,
                        regression,
                    };
                    preprocess_table(&from, &table, &output, shard_size, overwrite)
                }
                "npy" | "safetensors" => {
                    stray(image_flags, "--image-size, --channels and --fit")?;
                    stray(table_flags, "--targets, --features and --regression")?;
                    let defaults = TensorFilesConfig::default();
                    let arrays = TensorFilesConfig {
                        input: input_array.unwrap_or(defaults.input),
                        target: target_array.unwrap_or(defaults.target),
                        ..defaults
                    };
                    preprocess_tensors(&from, arrays, &output, shard_size, overwrite)
                }
                _ => bail!(
                    "--kind {kind:?}: expected image_folder, csv, npy or safetensors (the kind \
                     of data --from holds)"
                ),
            }
        }
        (None, Some(output), None) => preprocess(input, &output, &shard_size, overwrite),
        (None, None, _) => bail!(
            "preprocess needs --output (Fashion-MNIST, or --from DIR --kind image_folder) or --config (text)"
        ),
    }
}

/// `--image-size HxW`, `--channels`, `--fit`, each defaulting as
/// `data.image_size`, `data.channels` and `data.fit` do.
fn image_options(
    size: Option<&str>,
    channels: Option<usize>,
    fit: Option<&str>,
) -> Result<ImageFolderConfig> {
    let defaults = ImageFolderConfig::default();
    let size = match size {
        None => defaults.size,
        Some(text) => {
            let parsed = text
                .split_once(['x', 'X'])
                .and_then(|(h, w)| Some([h.trim().parse().ok()?, w.trim().parse().ok()?]));
            match parsed {
                Some([h, w]) if h > 0 && w > 0 => [h, w],
                _ => bail!("--image-size {text:?}: expected HEIGHTxWIDTH such as 28x28"),
            }
        }
    };
    let fit = match fit {
        None => defaults.fit,
        Some(text) => ImageFit::parse("--fit", text)?.into(),
    };
    Ok(ImageFolderConfig {
        size,
        channels: channels.unwrap_or(defaults.channels),
        fit,
    })
}

/// Packs `from`'s train/ and test/ image folders into `output`'s shard
/// stores (each written atomically), with `classes.json` beside them.
fn preprocess_images(
    from: &Path,
    images: ImageFolderConfig,
    output: &Path,
    shard_size: ShardSize,
    overwrite: bool,
) -> Result<()> {
    let (train, test) = headroom_pipeline::data::open_image_folder_splits(from, images)?;
    let classes = train.classes().to_vec();
    for (name, source) in [("train", train), ("test", test)] {
        let counted = Counted::new(&source, name, "images");
        let summary =
            headroom_loader::preprocess(&counted, &output.join(name), shard_size, overwrite);
        counted.finish();
        println!("{name}: {}", summary?);
    }
    write_classes(output, Some(&classes))?;
    let [h, w] = images.size;
    println!(
        "train on it with: cargo xtask train --set data.format=shards --set {} \
         --set 'model.input=[{h}, {w}, {}]'",
        shell::quote(&format!("data.dir={}", output.display())),
        images.channels
    );
    Ok(())
}

/// Writes the class names beside the stores (`classes.json`, which a
/// shards run records with the run), or removes a list left by an earlier
/// store there when the new one has no classes.
fn write_classes(output: &Path, classes: Option<&[String]>) -> Result<()> {
    let path = output.join(CLASSES_FILE);
    let Some(classes) = classes else {
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing the stale {}", path.display()))
            }
            _ => return Ok(()),
        }
    };
    let text = serde_json::to_string_pretty(classes)?;
    // Written beside the stores, by rename so no half-written list is read.
    let partial = output.join(format!(".{CLASSES_FILE}.tmp-{}", std::process::id()));
    std::fs::write(&partial, text).with_context(|| format!("writing {}", partial.display()))?;
    std::fs::rename(&partial, &path).with_context(|| format!("writing {}", path.display()))?;
    println!("{} classes: {}", classes.len(), classes.join(", "));
    Ok(())
}

/// `--targets`, `--features` and `--regression`: a table's columns, as
/// data.targets, data.features and a regression loss name them.
struct TableArgs {
    targets: Vec<String>,
    features: Vec<String>,
    regression: bool,
}

/// Packs `from`'s train.csv and test.csv into `output`'s stores: each row's
/// features standardised with the training table's statistics (recorded
/// in the index, as a CSV run records them), then its class or targets.
fn preprocess_table(
    from: &Path,
    table: &TableArgs,
    output: &Path,
    shard_size: ShardSize,
    overwrite: bool,
) -> Result<()> {
    if table.targets.is_empty() {
        bail!("--kind csv needs --targets naming the target column(s), e.g. --targets price");
    }
    if !table.regression && table.targets.len() != 1 {
        bail!(
            "--targets names {} columns, and a class target is one column; for numeric targets \
             add --regression",
            table.targets.len()
        );
    }
    let config = |classes: Option<Vec<String>>| TableConfig {
        targets: table.targets.clone(),
        features: table.features.clone(),
        target: match table.regression {
            true => TableTarget::Values,
            false => TableTarget::Classes { classes },
        },
    };
    let pair = headroom_pipeline::tables::open_table_pair(from, "--from", config)?;
    let source = StoreSource {
        kind: "csv".into(),
        inputs: pair.train.feature_names().to_vec(),
        targets: pair.train.target_names().to_vec(),
        feature_scale: pair.scale.features.clone(),
    };
    let splits: [&dyn Dataset; 2] = [&pair.train, &pair.test];
    pack_typed_splits(splits, &source, "rows", output, shard_size, overwrite)?;
    write_classes(output, pair.classes.as_deref())?;
    let features = pair.train.feature_names().len();
    let outputs = match &pair.classes {
        Some(classes) => classes.len(),
        None => table.targets.len(),
    };
    println!(
        "train on it with: cargo xtask train --set data.format=shards --set {} \
         --set 'model.input=[1, {features}, 1]'{} (a model whose last layer has {outputs} outputs)",
        shell::quote(&format!("data.dir={}", output.display())),
        if table.regression {
            " --set train.loss=mse"
        } else {
            ""
        }
    );
    Ok(())
}

/// Packs `from`'s train/ and test/ directories of tensor files into
/// `output`'s stores, each sample's record as the files give it.
fn preprocess_tensors(
    from: &Path,
    arrays: TensorFilesConfig,
    output: &Path,
    shard_size: ShardSize,
    overwrite: bool,
) -> Result<()> {
    let open = |split: &str| -> Result<TensorFiles> {
        let dir = from.join(split);
        if !dir.is_dir() {
            bail!(
                "{} is not a directory: --kind npy/safetensors reads train/ and test/ from \
                 --from, each a directory of .npz, .safetensors or .npy files",
                dir.display()
            );
        }
        Ok(TensorFiles::open(&dir, arrays.clone())?)
    };
    let (train, test) = (open("train")?, open("test")?);
    if train.sample_shape() != test.sample_shape() || train.sample_kind() != test.sample_kind() {
        bail!(
            "{} holds samples of {:?} ({:?}) and {} of {:?} ({:?}): both splits must hold the \
             same arrays",
            train.root().display(),
            train.sample_shape(),
            train.sample_kind(),
            test.root().display(),
            test.sample_shape(),
            test.sample_kind()
        );
    }
    let source = StoreSource {
        kind: "tensors".into(),
        inputs: vec![arrays.input.clone()],
        targets: vec![arrays.target.clone()],
        feature_scale: Vec::new(),
    };
    let splits: [&dyn Dataset; 2] = [&train, &test];
    pack_typed_splits(splits, &source, "samples", output, shard_size, overwrite)?;
    write_classes(output, None)?;
    let shape = train.sample_shape();
    let regression = train.sample_kind().values > 0;
    println!(
        "train on it with: cargo xtask train --set data.format=shards --set {} \
         --set 'model.input={shape:?}'{}",
        shell::quote(&format!("data.dir={}", output.display())),
        if regression {
            " --set train.loss=mse"
        } else {
            ""
        }
    );
    Ok(())
}

/// A dataset read through, counting the samples read and printing one
/// progress line (rewritten in place) as decoding photos takes a while.
struct Counted<'a> {
    inner: &'a dyn Dataset,
    name: &'a str,
    unit: &'a str,
    done: AtomicUsize,
}

impl<'a> Counted<'a> {
    fn new(inner: &'a dyn Dataset, name: &'a str, unit: &'a str) -> Self {
        Self {
            inner,
            name,
            unit,
            done: AtomicUsize::new(0),
        }
    }

    fn show(&self, done: usize) {
        let mut err = std::io::stderr().lock();
        // Progress only: a closed stderr must not stop the packing.
        let _ = write!(
            err,
            "\r{}: {done}/{} {}",
            self.name,
            self.inner.len(),
            self.unit
        );
        let _ = err.flush();
    }

    fn finish(&self) {
        self.show(self.done.load(Ordering::Relaxed));
        eprintln!();
    }
}

impl Dataset for Counted<'_> {
    fn len(&self) -> usize {
        self.inner.len()
    }

    fn sample_shape(&self) -> [usize; 3] {
        self.inner.sample_shape()
    }

    fn num_classes(&self) -> usize {
        self.inner.num_classes()
    }

    fn sample_kind(&self) -> SampleKind {
        self.inner.sample_kind()
    }

    fn read(&self, index: usize, out: &mut [u8]) -> Result<u32, LoaderError> {
        let label = self.inner.read(index, out)?;
        let done = self.done.fetch_add(1, Ordering::Relaxed) + 1;
        if done.is_multiple_of(256) {
            self.show(done);
        }
        Ok(label)
    }

    fn shard_layout(&self) -> Option<ShardLayout> {
        self.inner.shard_layout()
    }

    fn memory_limit(&self) -> u64 {
        self.inner.memory_limit()
    }

    fn memory_usage(&self) -> MemoryUsage {
        self.inner.memory_usage()
    }
}

fn preprocess(
    input: Option<PathBuf>,
    output: &std::path::Path,
    shard_size: &str,
    overwrite: bool,
) -> Result<()> {
    let shard_size: ShardSize = shard_size.parse().context("--shard-size")?;
    let input = headroom_pipeline::data::locate_fashion_mnist(input.as_deref(), false)?;
    for (split, name) in [(Split::Train, "train"), (Split::Test, "test")] {
        let source = IdxDataset::fashion_mnist(&input, split)?;
        let summary =
            headroom_loader::preprocess(&source, &output.join(name), shard_size, overwrite)?;
        println!("{name}: {summary}");
    }
    println!(
        "train on it with: cargo xtask train --set data.format=shards --set {}",
        shell::quote(&format!("data.dir={}", output.display()))
    );
    Ok(())
}

/// Packs a text experiment's corpus into the store `train` reads.
fn preprocess_text(config: &Path, overrides: &[String], allow_install: bool) -> Result<()> {
    let experiment = ExperimentConfig::load(config, &Overrides::parse(overrides)?)?;
    if experiment.data.format != headroom_pipeline::config::DataFormat::Text {
        bail!(
            "{}: data.format is \"{}\"; --config packs text experiments only",
            config.display(),
            experiment.data.format
        );
    }
    let store = headroom_pipeline::text::pack(&experiment, allow_install)?;
    println!(
        "text windows packed in {} (train/ and test/)",
        store.display()
    );
    println!(
        "train on it with: cargo xtask train --config {}",
        shell::quote_path(config)
    );
    Ok(())
}

/// Packs a typed source's train and test splits into `output/train` and
/// `output/test`, with the progress line (`unit`: "rows", "samples").
fn pack_typed_splits(
    splits: [&dyn Dataset; 2],
    source: &headroom_loader::StoreSource,
    unit: &str,
    output: &Path,
    shard_size: ShardSize,
    overwrite: bool,
) -> Result<()> {
    for (name, split) in ["train", "test"].into_iter().zip(splits) {
        let counted = Counted::new(split, name, unit);
        let summary = headroom_loader::preprocess_from(
            &counted,
            source,
            &output.join(name),
            shard_size,
            overwrite,
        );
        counted.finish();
        println!("{name}: {}", summary?);
    }
    Ok(())
}
