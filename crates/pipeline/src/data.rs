//! Finding Fashion-MNIST: `data.dir`, then `$FASHION_MNIST_DIR`, then the
//! Debian package's directory. If none holds it, install the package when we
//! are root on Debian or Ubuntu; otherwise stop with the exact command. Never
//! fall back to other data.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{PipelineError, Result};

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
        return Err(PipelineError::DatasetMissing(format!(
            "data.dir = {} does not hold Fashion-MNIST (expected {} with or without .gz)",
            dir.display(),
            FILES.join(", ")
        )));
    }
    if let Some(dir) = std::env::var_os("FASHION_MNIST_DIR") {
        let dir = PathBuf::from(dir);
        if has_fashion_mnist(&dir) {
            return Ok(dir);
        }
        return Err(PipelineError::DatasetMissing(format!(
            "FASHION_MNIST_DIR = {} does not hold Fashion-MNIST (expected {} with or without .gz)",
            dir.display(),
            FILES.join(", ")
        )));
    }
    let system = PathBuf::from(SYSTEM_DIR);
    if has_fashion_mnist(&system) {
        return Ok(system);
    }
    if allow_install && can_install_with_apt() {
        tracing::info!(
            "Fashion-MNIST not found; installing the Debian package {PACKAGE} with apt-get"
        );
        install_with_apt()?;
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

fn can_install_with_apt() -> bool {
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

fn install_with_apt() -> Result<()> {
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
                "`apt-get {}` failed ({status}); install {PACKAGE} by hand",
                args.join(" ")
            )))
        }
    };
    run(&["update", "-qq"])?;
    run(&["install", "-y", "-qq", PACKAGE])
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
