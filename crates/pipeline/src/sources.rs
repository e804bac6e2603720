//! Where a run's data comes from on this machine: the Fashion-MNIST files
//! (a configured directory, the Debian package's, or installed with apt
//! when allowed), and the shard cache's settings. A leaf: the image, frame
//! and text sources all read it.

use std::path::{Path, PathBuf};
use std::process::Command;

use headroom_loader::ShardCacheConfig;

use crate::config::{parse_bytes, ExperimentConfig};
use crate::paths::{self, Want};
use crate::{PipelineError, Result};

pub(crate) fn shard_cache(config: &ExperimentConfig) -> Result<ShardCacheConfig> {
    let settings = &config.loader;
    Ok(ShardCacheConfig {
        max_cache_shards: settings.max_cache_shards,
        cache_bytes: settings
            .cache_bytes
            .as_deref()
            .map(|text| parse_bytes("loader.cache_bytes", text))
            .transpose()?,
        read_ahead: settings.read_ahead,
        full_load: settings.full_load,
    })
}

pub const SYSTEM_DIR: &str = "/usr/share/datasets/fashion-mnist";
pub const PACKAGE: &str = "dataset-fashion-mnist";
const FILES: [&str; 4] = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
];

/// Whether a directory holds all four Fashion-MNIST files (raw or .gz).
pub fn has_fashion_mnist(dir: &Path) -> bool {
    FILES
        .iter()
        .all(|f| dir.join(f).is_file() || dir.join(format!("{f}.gz")).is_file())
}

/// The directory to read, in order of preference. An explicitly configured
/// directory that lacks the files is an error, not a reason to look elsewhere.
pub fn locate_fashion_mnist(configured: Option<&Path>, allow_install: bool) -> Result<PathBuf> {
    if let Some(dir) = configured {
        if has_fashion_mnist(dir) {
            return Ok(dir.to_path_buf());
        }
        return Err(missing_files("data.dir", dir));
    }
    if let Some(dir) = std::env::var_os("FASHION_MNIST_DIR") {
        let dir = PathBuf::from(dir);
        if has_fashion_mnist(&dir) {
            return Ok(dir);
        }
        return Err(missing_files("FASHION_MNIST_DIR", &dir));
    }
    let system = PathBuf::from(SYSTEM_DIR);
    if has_fashion_mnist(&system) {
        return Ok(system);
    }
    if allow_install && can_install_with_apt() {
        tracing::info!(
            "Fashion-MNIST not found; installing the Debian package {PACKAGE} with apt-get"
        );
        install_with_apt(PACKAGE)?;
        if has_fashion_mnist(&system) {
            return Ok(system);
        }
    }
    Err(PipelineError::DatasetMissing(format!(
        "Fashion-MNIST not found in data.dir, $FASHION_MNIST_DIR or {SYSTEM_DIR}. Install it with:\n    \
         sudo apt-get update && sudo apt-get install -y {PACKAGE}\n\
         or point data.dir (or FASHION_MNIST_DIR) at a directory holding {}",
        FILES.join(", ")
    )))
}

/// Names each missing file, not only the list of what was expected, and
/// each file that is there but cannot be read as what it is (a directory,
/// a symlink loop, a permission error); likewise the directory itself.
fn missing_files(setting: &str, dir: &Path) -> PipelineError {
    if let Some(reason) = paths::problem(dir, Want::Dir) {
        return PipelineError::DatasetMissing(format!(
            "{setting} = {} {reason} (expected a directory holding {}, each raw or with .gz)",
            dir.display(),
            FILES.join(", ")
        ));
    }
    let mut missing = Vec::new();
    let mut unreadable = Vec::new();
    for f in FILES {
        let (raw, gz) = (dir.join(f), dir.join(format!("{f}.gz")));
        if raw.is_file() || gz.is_file() {
            continue;
        }
        let there = [raw.clone(), gz].into_iter().find(|p| !paths::is_absent(p));
        match there {
            Some(there) => unreadable.push(format!(
                "{} {}",
                there.display(),
                paths::problem(&there, Want::File).unwrap_or_default()
            )),
            None => missing.push(raw.display().to_string()),
        }
    }
    let mut problems = Vec::new();
    if !missing.is_empty() {
        problems.push(format!("missing {}", missing.join(", ")));
    }
    problems.extend(unreadable);
    PipelineError::DatasetMissing(format!(
        "{setting} = {} does not hold Fashion-MNIST: {} (each raw or with .gz; expected {})",
        dir.display(),
        problems.join("; "),
        FILES.join(", ")
    ))
}

pub(crate) fn can_install_with_apt() -> bool {
    let is_root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false);
    let os = std::fs::read_to_string("/etc/os-release").unwrap_or_default();
    let debian_like = os.lines().any(|l| {
        (l.starts_with("ID=") || l.starts_with("ID_LIKE="))
            && (l.contains("debian") || l.contains("ubuntu"))
    });
    is_root && debian_like && Path::new("/usr/bin/apt-get").exists()
}

/// Installs a Debian package (apt-get update, then install), as root.
pub(crate) fn install_with_apt(package: &str) -> Result<()> {
    let run = |args: &[&str]| -> Result<()> {
        let status = Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .map_err(|e| PipelineError::io("apt-get", e))?;
        if status.success() {
            Ok(())
        } else {
            Err(PipelineError::DatasetMissing(format!(
                "`apt-get {}` failed ({status}); install {package} by hand",
                args.join(" ")
            )))
        }
    };
    run(&["update", "-qq"])?;
    run(&["install", "-y", "-qq", package])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configured_dir_without_files_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let err = locate_fashion_mnist(Some(dir.path()), false)
            .unwrap_err()
            .to_string();
        assert!(err.contains(&dir.path().display().to_string()), "{err}");
        assert!(err.contains("train-images-idx3-ubyte"), "{err}");
    }

    #[test]
    fn a_file_that_is_there_but_unreadable_is_named_as_what_it_is_not_missing() {
        let dir = tempfile::tempdir().unwrap();
        for f in &FILES[1..] {
            std::fs::write(dir.path().join(f), b"").unwrap();
        }
        std::fs::create_dir(dir.path().join(FILES[0])).unwrap();
        let err = locate_fashion_mnist(Some(dir.path()), false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("{} is a directory, not a file", FILES[0])),
            "{err}"
        );
        assert!(!err.contains("missing"), "{err}");
        let file = dir.path().join(FILES[1]);
        let err = locate_fashion_mnist(Some(&file), false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("is a file, not a directory"), "{err}");
    }

    #[test]
    fn configured_dir_with_files_is_used() {
        let dir = tempfile::tempdir().unwrap();
        for f in FILES {
            std::fs::write(dir.path().join(format!("{f}.gz")), b"").unwrap();
        }
        assert_eq!(
            locate_fashion_mnist(Some(dir.path()), false).unwrap(),
            dir.path()
        );
    }
}
