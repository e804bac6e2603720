//! Running cargo from a command (memcheck builds its test binaries).

use std::process::Command;

use anyhow::{bail, Context, Result};

/// Runs cargo with `args` (a build that prints JSON messages) and returns
/// its messages; `what` names the build in errors.
pub(crate) fn cargo_messages(args: &[&str], what: &str) -> Result<Vec<serde_json::Value>> {
    let output = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(args)
        .output()
        .with_context(|| format!("building {what} with cargo"))?;
    if !output.status.success() {
        bail!(
            "building {what} failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect())
}
