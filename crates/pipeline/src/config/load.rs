//! Reading an experiment: the file, a profile overlay, the environment and
//! `--set`, in that order.
//!
//! Profiles are overlays, not experiments: `run.profile = NAME` (or
//! `--profile NAME`) reads `<the experiment's directory>/profiles/NAME.toml`
//! on top of the experiment (or, when there is none, the built-in one in
//! `experiments/profiles/`: see `profile_candidates`). The rule that tells
//! the two apart is the location alone: a file whose directory is named
//! `profiles` is a profile, and `load` refuses it as an experiment (it
//! lacks the required keys, and the error would otherwise be a puzzling
//! "missing field").

use std::path::{Path, PathBuf};

use config::{Config, Environment, File, FileFormat};

use super::overrides::{blame_source, typed_value, ENV_PREFIX};
use super::{device_memory, ExperimentConfig, Overrides, Profile, SMALL_DEVICE_BYTES};
use crate::device::DeviceKind;
use crate::{PipelineError, Result};

/// The directory, beside an experiment, that holds its profiles.
pub const PROFILES_DIR: &str = "profiles";

/// Whether `path` is a profile: it lies in a directory named `profiles`.
pub fn is_profile(path: &Path) -> bool {
    path.parent()
        .and_then(Path::file_name)
        .is_some_and(|dir| dir == PROFILES_DIR)
}

/// Where the profile `name` of the experiment at `experiment` may be, in
/// order: `<experiment's directory>/profiles/`, then the current
/// directory's `experiments/profiles/` (a clone's root, where the default
/// experiment lives), then the `experiments/profiles/` of the workspace
/// this program was built from. The built-in profiles are found so for an
/// experiment kept anywhere (a copy in /tmp, a user's own directory), not
/// only for one in `experiments/`. Duplicates (the same directory reached
/// twice) are left out.
pub fn profile_candidates(experiment: &Path, name: &str) -> Vec<PathBuf> {
    let beside = experiment.parent().unwrap_or(Path::new("."));
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments");
    let built = std::fs::canonicalize(&built).unwrap_or(built);
    let dirs = [
        beside.join(PROFILES_DIR),
        Path::new("experiments").join(PROFILES_DIR),
        built.join(PROFILES_DIR),
    ];
    let mut seen: Vec<PathBuf> = Vec::new();
    let mut candidates = Vec::new();
    for dir in dirs {
        let key = std::fs::canonicalize(&dir).unwrap_or_else(|_| dir.clone());
        if seen.contains(&key) {
            continue;
        }
        seen.push(key);
        candidates.push(dir.join(format!("{name}.toml")));
    }
    candidates
}

/// Where the profile `name` of the experiment at `experiment` is: the
/// first of `profile_candidates` that is there (even if it cannot be
/// read: loading it says why), else the one beside the experiment.
pub fn profile_path(experiment: &Path, name: &str) -> PathBuf {
    let candidates = profile_candidates(experiment, name);
    candidates
        .iter()
        .find(|p| !crate::paths::is_absent(p))
        .or(candidates.first())
        .cloned()
        .unwrap_or_else(|| PathBuf::from(format!("{name}.toml")))
}

/// The profiles in `dir` (file stems, sorted), for naming them in an error.
fn profiles_in(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .filter_map(|p| p.file_stem().and_then(|s| s.to_str()).map(String::from))
        .collect();
    names.sort();
    names
}

fn auto_profile(
    config: &ExperimentConfig,
    gpu_memory: impl FnOnce(DeviceKind) -> Option<u64>,
) -> Result<Option<String>> {
    // The device the learner will use: a table's run is on the CPU even
    // where "auto" would find a GPU.
    let gpu = match (config.memory_limit()?, config.learner_device()) {
        (Some(_), _) | (None, DeviceKind::Cpu) => None,
        (None, kind) => gpu_memory(kind),
    };
    match device_memory(config, gpu)? {
        Some(bytes) if bytes < SMALL_DEVICE_BYTES => {
            tracing::warn!(
                "the device has {:.2} GiB (< 4 GiB): applying the low_memory profile (run.profile = \"none\" to opt out)",
                bytes as f64 / (1u64 << 30) as f64
            );
            Ok(Some("low_memory".into()))
        }
        _ => Ok(None),
    }
}

impl ExperimentConfig {
    /// Loads `path`, then its profile, then the environment, then
    /// `overrides`; then validates. A profile given as the experiment is
    /// refused, naming the `--profile` that applies it.
    ///
    /// Touches no device: `run.profile = "auto"` is judged by
    /// `device.memory_limit`, else by this process's memory, as for a run on
    /// the CPU. A command about to train uses [`Self::load_for_device`].
    pub fn load(path: &Path, overrides: &Overrides) -> Result<Self> {
        Self::load_for_device(path, overrides, |_| None)
    }

    /// As [`Self::load`], with `gpu_memory` telling, for the experiment's
    /// `device.kind`, the memory of the GPU the run will train on (None:
    /// the CPU), which `run.profile = "auto"` judges by when
    /// `device.memory_limit` is unset. `crate::device::gpu_memory` probes
    /// the GPU for it; it is asked only for "auto", and nothing else here
    /// touches a device.
    pub fn load_for_device(
        path: &Path,
        overrides: &Overrides,
        gpu_memory: impl FnOnce(DeviceKind) -> Option<u64>,
    ) -> Result<Self> {
        if is_profile(path) {
            let name = path
                .file_stem()
                .map_or_else(|| "NAME".to_string(), |s| s.to_string_lossy().into_owned());
            return Err(PipelineError::Config(format!(
                "{} is a profile, not an experiment: use --profile {name} (or run.profile = \"{name}\") \
                 with an experiment such as experiments/fashion_mnist.toml",
                path.display()
            )));
        }
        if !path.is_file() {
            return Err(PipelineError::Config(format!(
                "experiment file {} not found (expected a TOML file such as experiments/fashion_mnist.toml)",
                path.display()
            )));
        }
        let config = Self::build(path, None, overrides)?;
        let profile = match &config.run.profile {
            Profile::None => return Ok(config),
            Profile::Auto => match auto_profile(&config, gpu_memory)? {
                Some(name) => name,
                None => return Ok(config),
            },
            Profile::Named(name) => name.clone(),
        };
        let plain = !profile.is_empty() && !profile.contains(['/', '\\', '\0', '.']);
        let profile_path = profile_path(path, &profile);
        if plain && !crate::paths::is_absent(&profile_path) {
            if let Some(reason) = crate::paths::problem(&profile_path, crate::paths::Want::File) {
                return Err(PipelineError::value(
                    "run.profile",
                    format!("profile file {} {reason}", profile_path.display()),
                ));
            }
        } else {
            // Each place looked in, by the file it would be (a directory
            // that is not there is left out, but for the experiment's own).
            let looked: Vec<PathBuf> = profile_candidates(path, &profile)
                .into_iter()
                .enumerate()
                .filter(|(i, p)| *i == 0 || p.parent().is_some_and(Path::is_dir))
                .map(|(_, p)| p)
                .collect();
            let mut known: Vec<String> = looked
                .iter()
                .filter_map(|p| p.parent())
                .flat_map(profiles_in)
                .collect();
            known.sort();
            known.dedup();
            let shown: Vec<String> = looked.iter().map(|p| p.display().to_string()).collect();
            return Err(PipelineError::value(
                "run.profile",
                format!(
                    "no profile file {} (expected \"auto\", \"none\" or the name of a TOML file in \
                     one of their directories{})",
                    shown.join(" or "),
                    if known.is_empty() {
                        String::new()
                    } else {
                        format!(": {}", known.join(", "))
                    }
                ),
            ));
        }
        tracing::info!("profile {profile}: applying {}", profile_path.display());
        // An experiment that fixes its micro-batch through train.accumulate
        // (LoRA's batch 1 x 8) keeps it: a profile's train.micro_batch would
        // contradict it, and the run would be refused for a setting the user
        // never wrote.
        let mut left_out = Vec::new();
        if config.train.accumulate != 1 && config.train.micro_batch.is_none() {
            left_out.push(("train", "micro_batch"));
        }
        let overlay = ProfileOverlay {
            path: &profile_path,
            left_out: &left_out,
            accumulate: config.train.accumulate,
        };
        Self::build(path, Some(&overlay), overrides)
    }

    /// A run's own `config.toml`, as `train` recorded it: the profile is
    /// already in it, so only the environment and `overrides` go on top
    /// (its `run.profile` is a record, not applied again, so where the
    /// profiles live does not matter to a resume).
    pub fn load_resolved(path: &Path, overrides: &Overrides) -> Result<Self> {
        if !path.is_file() {
            return Err(PipelineError::Config(format!(
                "{} not found: --resume RUN_DIR expects a run directory written by `cargo xtask train`",
                path.display()
            )));
        }
        Self::build(path, None, overrides)
    }

    /// The experiment file, then a profile overlay, then the environment,
    /// then `--set`; deserialised and validated.
    fn build(path: &Path, profile: Option<&ProfileOverlay>, overrides: &Overrides) -> Result<Self> {
        let mut builder = Config::builder().add_source(File::from(path).format(FileFormat::Toml));
        if let Some(overlay) = profile {
            builder = match overlay.kept_text()? {
                None => builder.add_source(File::from(overlay.path).format(FileFormat::Toml)),
                Some(text) => builder.add_source(File::from_str(&text, FileFormat::Toml)),
            };
        }
        builder = builder.add_source(
            Environment::with_prefix(ENV_PREFIX)
                .prefix_separator("__")
                .separator("__")
                .try_parsing(true),
        );
        for (key, value) in &overrides.0 {
            builder = builder
                .set_override(key.as_str(), typed_value(key, value)?)
                .map_err(|e| PipelineError::value(key, e.to_string()))?;
        }
        let files = profile.map_or(path.display().to_string(), |p| {
            format!("{} + {}", path.display(), p.path.display())
        });
        let blame = |e: config::ConfigError| blame_source(&e.to_string(), &files, overrides);
        let config: Self = builder
            .build()
            .map_err(blame)?
            .try_deserialize()
            .map_err(blame)?;
        config.validate()?;
        Ok(config)
    }
}

/// A profile file applied over an experiment, less the keys the experiment
/// decides itself.
struct ProfileOverlay<'a> {
    path: &'a Path,
    /// (table, key) pairs of the profile left out.
    left_out: &'a [(&'a str, &'a str)],
    /// The experiment's train.accumulate, for the log line.
    accumulate: usize,
}

impl ProfileOverlay<'_> {
    /// The profile's text without the left-out keys it sets, or None when
    /// it sets none of them (the file is then read as it is).
    fn kept_text(&self) -> Result<Option<String>> {
        if self.left_out.is_empty() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(self.path).map_err(|e| {
            PipelineError::value(
                "run.profile",
                format!("reading profile file {}: {e}", self.path.display()),
            )
        })?;
        let mut table: toml::Table = text.parse().map_err(|e| {
            PipelineError::value(
                "run.profile",
                format!(
                    "profile file {} is not valid TOML: {e}",
                    self.path.display()
                ),
            )
        })?;
        let mut removed = false;
        for (section, key) in self.left_out {
            if let Some(toml::Value::Table(inner)) = table.get_mut(*section) {
                if let Some(value) = inner.remove(*key) {
                    tracing::info!(
                        "profile {}: {section}.{key} = {value} left out: the experiment sets \
                         train.accumulate = {}, which fixes the micro-batch",
                        self.path.display(),
                        self.accumulate
                    );
                    removed = true;
                }
            }
        }
        if !removed {
            return Ok(None);
        }
        toml::to_string(&table).map(Some).map_err(|e| {
            PipelineError::value(
                "run.profile",
                format!("profile file {}: {e}", self.path.display()),
            )
        })
    }
}
