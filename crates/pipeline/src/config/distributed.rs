//! `[distributed]`: how the ranks of a data-parallel run talk (see
//! `crate::ranks`). Who the ranks are comes from the launcher (`mpirun`),
//! not from here; these settings change no result: the all-reduce's order
//! depends on the world size only, never on the bucket size.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DistributedConfig {
    /// Gradient bucket size in MiB: a bucket is all-reduced as soon as
    /// backward has filled it, while backward goes on.
    #[serde(default = "default_bucket_mb")]
    pub bucket_mb: f64,
    /// How long a rank waits for a peer in any exchange before it names
    /// the peer and every rank stops.
    #[serde(default = "default_timeout_s")]
    pub timeout_s: f64,
}

fn default_bucket_mb() -> f64 {
    25.0
}

fn default_timeout_s() -> f64 {
    300.0
}

impl Default for DistributedConfig {
    fn default() -> Self {
        Self {
            bucket_mb: default_bucket_mb(),
            timeout_s: default_timeout_s(),
        }
    }
}

impl DistributedConfig {
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }

    pub fn bucket_bytes(&self) -> usize {
        (self.bucket_mb * 1024.0 * 1024.0) as usize
    }

    pub fn timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.timeout_s)
    }
}
