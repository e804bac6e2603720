//! `cargo xtask preprocess`: Fashion-MNIST or a folder of photos
//! (`--from DIR --kind image_folder`) into a shard store, or a text
//! experiment's corpus into its window store.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{bail, Context, Result};
use headroom_loader::{
    Dataset, IdxDataset, ImageFolderConfig, LoaderError, MemoryUsage, ShardLayout, ShardSize, Split,
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
            if kind != "image_folder" {
                bail!("--kind {kind:?}: expected image_folder (the kind of data --from holds)");
            }
            let images = image_options(image_size.as_deref(), channels, fit.as_deref())?;
            preprocess_images(&from, images, &output, &shard_size, overwrite)
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
    shard_size: &str,
    overwrite: bool,
) -> Result<()> {
    let shard_size: ShardSize = shard_size.parse().context("--shard-size")?;
    let (train, test) = headroom_pipeline::data::open_image_folder_splits(from, images)?;
    let classes = train.classes().to_vec();
    for (name, source) in [("train", train), ("test", test)] {
        let counted = Counted::new(&source, name);
        let summary =
            headroom_loader::preprocess(&counted, &output.join(name), shard_size, overwrite);
        counted.finish();
        println!("{name}: {}", summary?);
    }
    let text = serde_json::to_string_pretty(&classes)?;
    // Written beside the stores, by rename so no half-written list is read.
    let path = output.join(CLASSES_FILE);
    let partial = output.join(format!(".{CLASSES_FILE}.tmp-{}", std::process::id()));
    std::fs::write(&partial, text).with_context(|| format!("writing {}", partial.display()))?;
    std::fs::rename(&partial, &path).with_context(|| format!("writing {}", path.display()))?;
    println!("{} classes: {}", classes.len(), classes.join(", "));
    let [h, w] = images.size;
    println!(
        "train on it with: cargo xtask train --set data.format=shards --set {} \
         --set 'model.input=[{h}, {w}, {}]'",
        shell::quote(&format!("data.dir={}", output.display())),
        images.channels
    );
    Ok(())
}

/// A dataset read through, counting the samples read and printing one
/// progress line (rewritten in place) as decoding photos takes a while.
struct Counted<'a> {
    inner: &'a dyn Dataset,
    name: &'a str,
    done: AtomicUsize,
}

impl<'a> Counted<'a> {
    fn new(inner: &'a dyn Dataset, name: &'a str) -> Self {
        Self {
            inner,
            name,
            done: AtomicUsize::new(0),
        }
    }

    fn show(&self, done: usize) {
        let mut err = std::io::stderr().lock();
        // Progress only: a closed stderr must not stop the packing.
        let _ = write!(err, "\r{}: {done}/{} images", self.name, self.inner.len());
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
