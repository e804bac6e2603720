//! Run directories: `runs/<experiment>-<UTC timestamp>/` for a fresh run,
//! the newest one of the experiment for `--resume`, or exactly
//! `run.output_dir` when it is set. Each holds the resolved config, the
//! metrics, the checkpoints and the plots.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::config::ExperimentConfig;
use crate::resume::Resume;
use crate::{checkpoint, PipelineError, Result};

/// The directory this run writes to.
pub fn resolve(config: &ExperimentConfig, resume: &Resume) -> Result<PathBuf> {
    if let Some(dir) = &config.run.output_dir {
        return Ok(dir.clone());
    }
    if *resume == Resume::Latest {
        if let Some(dir) = newest_with_checkpoints(&config.run.runs_dir, &config.run.name)? {
            return Ok(dir);
        }
    }
    let stamp = utc_timestamp(SystemTime::now());
    let base = config
        .run
        .runs_dir
        .join(format!("{}-{stamp}", config.run.name));
    let mut dir = base.clone();
    let mut n = 2;
    while dir.exists() {
        dir = PathBuf::from(format!("{}-{n}", base.display()));
        n += 1;
    }
    Ok(dir)
}

/// Writes the experiment exactly as resolved (file, environment, --set).
pub fn write_resolved_config(dir: &Path, config: &ExperimentConfig) -> Result<()> {
    let text = toml::to_string(config)
        .map_err(|e| PipelineError::Config(format!("cannot record the config: {e}")))?;
    let path = dir.join("config.toml");
    std::fs::write(&path, text).map_err(|e| PipelineError::io(path, e))
}

fn newest_with_checkpoints(runs_dir: &Path, name: &str) -> Result<Option<PathBuf>> {
    let Ok(entries) = std::fs::read_dir(runs_dir) else {
        return Ok(None);
    };
    let prefix = format!("{name}-");
    let mut candidates: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.starts_with(&prefix)
                    && n[prefix.len()..].starts_with(|c: char| c.is_ascii_digit())
            })
        })
        .collect();
    candidates.sort();
    for dir in candidates.into_iter().rev() {
        if !checkpoint::list(&dir)?.is_empty() {
            return Ok(Some(dir));
        }
    }
    Ok(None)
}

/// `YYYYMMDD-HHMMSS` in UTC, from the civil-from-days algorithm.
fn utc_timestamp(time: SystemTime) -> String {
    let secs = time.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn timestamps_are_utc_calendar_dates() {
        assert_eq!(utc_timestamp(UNIX_EPOCH), "19700101-000000");
        let t = UNIX_EPOCH + Duration::from_secs(1_795_258_861); // 2026-11-21 11:01:01
        assert_eq!(utc_timestamp(t), "20261121-110101");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(utc_timestamp(leap), "20000229-000000");
    }
}
