//! `bench-loader-one --mode image_folder`: preprocessing a folder of
//! images into a shard store (`cargo xtask preprocess --kind
//! image_folder`), beside torchvision's `ImageFolder` + PIL doing the same
//! work (`bench/torch/torchvision_imagefolder.py`: decode, gather the
//! uint8 pixels and labels, write them), on one core and on every core,
//! each pinned with `taskset` to the same cores, side by side in one run.
//!
//! The folder is Fashion-MNIST written as 28×28 grayscale PNGs (the first
//! `--rows` training images, a sixth as many test images), made once.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use headroom_loader::{Dataset, IdxDataset, Split};
use serde::Deserialize;

/// Training images written unless `--rows` says otherwise.
pub const IMAGES: usize = 12_000;
/// Passes per reader and core count; the fastest counts.
const REPEAT: usize = 3;

pub fn image_folder(folder: &Path, images: usize) -> Result<()> {
    if !folder.exists() {
        write_png_folder(folder, images)?;
    }
    let count = count_files(folder)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pin = Command::new("taskset").arg("-V").output().is_ok();
    println!(
        "preprocessing {} ({count} PNG files), fastest of {REPEAT} passes{}",
        folder.display(),
        if pin { "" } else { " (no taskset: not pinned)" }
    );
    println!(
        "{:>6} | {:>54} | {:>8} | {:>9}",
        "cores", "how", "seconds", "images/s"
    );
    let scratch =
        std::env::temp_dir().join(format!("headroom-preprocess-bench-{}", std::process::id()));
    let mut core_counts = vec![1];
    if cores > 1 {
        core_counts.push(cores);
    }
    for cores in core_counts {
        let cpus = format!("0-{}", cores - 1);
        let pinned = |program: &Path| {
            let mut command = if pin {
                let mut c = Command::new("taskset");
                c.args(["-c", &cpus]).arg(program);
                c
            } else {
                Command::new(program)
            };
            command.env("RAYON_NUM_THREADS", cores.to_string());
            command
        };
        let exe = std::env::current_exe().context("finding this program")?;
        let mut best = f64::INFINITY;
        for _ in 0..REPEAT {
            let start = Instant::now();
            let output = pinned(&exe)
                .args([
                    "preprocess",
                    "--kind",
                    "image_folder",
                    "--overwrite",
                    "--from",
                ])
                .arg(folder)
                .arg("--output")
                .arg(&scratch)
                .output()
                .context("running preprocess")?;
            if !output.status.success() {
                bail!(
                    "preprocess failed: {}",
                    String::from_utf8_lossy(&output.stderr)
                );
            }
            best = best.min(start.elapsed().as_secs_f64());
        }
        println!(
            "{cores:>6} | {:>54} | {best:>8.3} | {:>9.0}",
            format!("headroom preprocess, {cores} thread(s)"),
            count as f64 / best
        );
        // The same cores: in-process decoding on one, a worker per core
        // on more.
        let workers = if cores == 1 { 0 } else { cores };
        let script = Path::new("bench/torch/torchvision_imagefolder.py");
        let output = pinned(Path::new("python3"))
            .arg(script)
            .arg(folder)
            .args([
                "--workers",
                &workers.to_string(),
                "--repeat",
                &REPEAT.to_string(),
            ])
            .output()
            .with_context(|| format!("running {}", script.display()))?;
        if !output.status.success() {
            println!(
                "{cores:>6} | torchvision: {} failed (is torchvision installed? `pip install torch \
                 torchvision pillow`): {}",
                script.display(),
                String::from_utf8_lossy(&output.stderr).lines().last().unwrap_or("")
            );
            continue;
        }
        let text = String::from_utf8_lossy(&output.stdout);
        let torch: TorchPreprocess = serde_json::from_str(text.trim())
            .with_context(|| format!("{} printed {text}", script.display()))?;
        if torch.images != count {
            bail!(
                "torchvision read {} images, the folder holds {count}",
                torch.images
            );
        }
        println!(
            "{cores:>6} | {:>54} | {:>8.3} | {:>9.0}",
            torch.reader, torch.seconds, torch.images_per_s
        );
        println!(
            "{cores:>6} | headroom / torchvision: {:.2}x the images/s",
            best.recip() * torch.seconds
        );
    }
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(())
}

#[derive(Debug, Deserialize)]
struct TorchPreprocess {
    reader: String,
    images: usize,
    seconds: f64,
    images_per_s: f64,
}

/// `folder/{train,test}/class_N/INDEX.png` from the installed
/// Fashion-MNIST: `images` training images and a sixth as many test ones,
/// written beside and renamed into place, so a half-written folder is
/// never taken for the set.
fn write_png_folder(folder: &Path, images: usize) -> Result<()> {
    let source = headroom_pipeline::data::locate_fashion_mnist(None, false)?;
    let partial = PathBuf::from(format!("{}.partial", folder.display()));
    if partial.exists() {
        std::fs::remove_dir_all(&partial)
            .with_context(|| format!("removing {}", partial.display()))?;
    }
    for (split, count) in [(Split::Train, images), (Split::Test, images.div_ceil(6))] {
        let set = IdxDataset::fashion_mnist(&source, split)?;
        let count = count.min(set.len());
        let mut pixels = vec![0u8; 28 * 28];
        for index in 0..count {
            let label = set.read(index, &mut pixels)?;
            let dir = partial
                .join(split.to_string())
                .join(format!("class_{label}"));
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let path = dir.join(format!("{index:06}.png"));
            image::save_buffer(&path, &pixels, 28, 28, image::ExtendedColorType::L8)
                .with_context(|| format!("writing {}", path.display()))?;
        }
    }
    std::fs::rename(&partial, folder)
        .with_context(|| format!("renaming {} to {}", partial.display(), folder.display()))
}

fn count_files(folder: &Path) -> Result<usize> {
    let mut count = 0;
    for split in ["train", "test"] {
        let dir = folder.join(split);
        for class in
            std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?
        {
            let class = class?.path();
            count += std::fs::read_dir(&class)
                .with_context(|| format!("reading {}", class.display()))?
                .count();
        }
    }
    Ok(count)
}
