//! What this process may really use, and sizes no run can survive.
//!
//! A container's cgroup limit, `ulimit -v` (RLIMIT_AS) or `ulimit -d`
//! (RLIMIT_DATA) are invisible in `/proc/meminfo`, yet an allocation past
//! them fails (and an infallible one aborts the process). With no
//! `device.memory_limit`, the run's tensor budget is a share of the room the
//! tightest of these leaves, so the OOM policy engages before the OS says no.

use std::path::{Path, PathBuf};

/// Share of the room left that the tensor pool may take by default: the
/// rest is for what lives outside the pool (the dataset, loader batches,
/// thread stacks and allocator arenas, layer scratch, checkpoint snapshots).
const DEFAULT_BUDGET_SHARE: f64 = 0.5;

/// A ceiling on this process's memory, and where it comes from.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryCeiling {
    /// Bytes the process may still take.
    pub room: u64,
    /// The limit itself (for the report).
    pub limit: u64,
    /// Where it was found, e.g. "cgroup v2 memory.max (/sys/fs/cgroup/x/memory.max)".
    pub source: String,
}

/// Every ceiling found, tightest first.
pub fn ceilings() -> Vec<MemoryCeiling> {
    let mut found = Vec::new();
    found.extend(cgroup_v2());
    found.extend(cgroup_v1());
    found.extend(rlimit(libc::RLIMIT_AS, "RLIMIT_AS (ulimit -v)", "VmSize:"));
    found.extend(rlimit(
        libc::RLIMIT_DATA,
        "RLIMIT_DATA (ulimit -d)",
        "VmData:",
    ));
    if let Some(available) = crate::available_memory_bytes() {
        found.push(MemoryCeiling {
            room: available,
            limit: crate::system_memory_bytes().unwrap_or(available),
            source: "available memory (MemAvailable in /proc/meminfo)".into(),
        });
    }
    found.sort_by_key(|c| c.room);
    found
}

/// The tightest ceiling, if the OS tells us any.
pub fn tightest() -> Option<MemoryCeiling> {
    ceilings().into_iter().next()
}

/// Room under the tightest ceiling below which a run does not start: its
/// threads' stacks, write buffers and the data's first read need about
/// this much outside the tensor pool, and some of those allocations
/// cannot be made fallible (a failed one aborts the process).
pub const MIN_START_ROOM: u64 = 4 << 20;

/// An error naming the tightest ceiling when it leaves less than
/// [`MIN_START_ROOM`]: said before anything is written, rather than an
/// abort partway through the start.
pub fn check_room_to_start() -> crate::Result<()> {
    match tightest() {
        Some(ceiling) if ceiling.room < MIN_START_ROOM => {
            Err(crate::PipelineError::OutOfMemory(format!(
                "{} leaves this process {} KiB, and a run needs at least {} MiB of memory to \
                 start: raise the limit",
                ceiling.source,
                ceiling.room >> 10,
                MIN_START_ROOM >> 20
            )))
        }
        _ => Ok(()),
    }
}

/// Address space each compute thread may take outside the pool during a
/// step, allowed for in the headroom: the direct convolution's index lists
/// (up to 512 KiB at its 256 KiB image chunks), rayon's job structures,
/// an im2col or gemm buffer growing once.
const THREAD_HEADROOM: u64 = 2 << 20;

/// The address space every fallible allocation of a run leaves free under
/// `RLIMIT_AS` / `RLIMIT_DATA` (`headroom_model::address_space`): what the
/// rest of the process may take beside the tensors at any moment of a
/// step, and that cannot fail softly. The base (a spawned thread's 8 MiB
/// stack, glibc's heap growth, the OOM policy's messages, the checkpoint
/// writer's buffers), 2 MiB per compute thread (`THREAD_HEADROOM`), and the
/// loaders' batches that may be made while a step runs
/// (`batch_bytes_in_flight`). The room measured at each allocation already
/// counts what is alive; this is for what may appear before the next.
pub fn address_space_headroom(threads: usize, batch_bytes_in_flight: u64) -> u64 {
    headroom_model::address_space::DEFAULT_HEADROOM
        + threads as u64 * THREAD_HEADROOM
        + batch_bytes_in_flight
}

/// The tensor budget when `device.memory_limit` is unset: a share of the
/// tightest ceiling's room.
pub fn default_budget() -> Option<(u64, MemoryCeiling)> {
    let ceiling = tightest()?;
    Some(((ceiling.room as f64 * DEFAULT_BUDGET_SHARE) as u64, ceiling))
}

fn cgroup_v2() -> Option<MemoryCeiling> {
    let membership = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let relative = membership.lines().find_map(|l| l.strip_prefix("0::"))?;
    let mut dir = Path::new("/sys/fs/cgroup").join(relative.trim_start_matches('/'));
    let mut tightest: Option<MemoryCeiling> = None;
    // A parent's limit binds the child too.
    loop {
        let files = CgroupFiles {
            max: "memory.max",
            usage: "memory.current",
            reclaimable: "inactive_file",
            kind: "cgroup v2",
        };
        if let Some(found) = cgroup_limit(&dir, &files) {
            if tightest.as_ref().is_none_or(|t| found.room < t.room) {
                tightest = Some(found);
            }
        }
        if !dir.pop() || !dir.starts_with("/sys/fs/cgroup") {
            return tightest;
        }
    }
}

fn cgroup_v1() -> Option<MemoryCeiling> {
    let membership = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let relative = membership.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers
            .split(',')
            .any(|c| c == "memory")
            .then_some(path)
    })?;
    let dir = PathBuf::from("/sys/fs/cgroup/memory").join(relative.trim_start_matches('/'));
    let files = CgroupFiles {
        max: "memory.limit_in_bytes",
        usage: "memory.usage_in_bytes",
        reclaimable: "total_inactive_file",
        kind: "cgroup v1",
    };
    cgroup_limit(&dir, &files)
}

/// Where a cgroup version keeps its limit, its usage, and the key in
/// `memory.stat` of the page cache it would drop before it kills.
struct CgroupFiles {
    max: &'static str,
    usage: &'static str,
    reclaimable: &'static str,
    kind: &'static str,
}

/// The cgroup's limit and the room under it. Its usage counts the page
/// cache of the files the run reads and writes (the dataset, every
/// checkpoint); the inactive part of it is dropped before anything is
/// killed, so it is room, as `docker stats` counts it.
fn cgroup_limit(dir: &Path, files: &CgroupFiles) -> Option<MemoryCeiling> {
    let (max_file, kind) = (files.max, files.kind);
    let max_path = dir.join(max_file);
    let limit: u64 = std::fs::read_to_string(&max_path)
        .ok()?
        .trim()
        .parse()
        .ok()?; // "max" (no limit) does not parse
                // cgroup v1 writes "no limit" as a number near i64::MAX.
    if limit >= 1 << 60 {
        return None;
    }
    let usage: u64 = std::fs::read_to_string(dir.join(files.usage))
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(0);
    let stat = std::fs::read_to_string(dir.join("memory.stat")).unwrap_or_default();
    let used = usage.saturating_sub(stat_value(&stat, files.reclaimable).unwrap_or(0));
    Some(MemoryCeiling {
        room: limit.saturating_sub(used),
        limit,
        source: format!("{kind} {max_file} ({})", max_path.display()),
    })
}

/// The value of `key` in a cgroup's `memory.stat` ("key value" lines).
fn stat_value(stat: &str, key: &str) -> Option<u64> {
    stat.lines().find_map(|line| {
        let (name, value) = line.split_once(' ')?;
        (name == key).then(|| value.trim().parse().ok())?
    })
}

fn rlimit(
    resource: libc::__rlimit_resource_t,
    name: &str,
    usage_key: &str,
) -> Option<MemoryCeiling> {
    let mut value = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass and reads nothing else.
    if unsafe { libc::getrlimit(resource, &mut value) } != 0
        || value.rlim_cur == libc::RLIM_INFINITY
    {
        return None;
    }
    let limit = value.rlim_cur;
    let used = status_bytes(usage_key).unwrap_or(0);
    Some(MemoryCeiling {
        room: limit.saturating_sub(used),
        limit,
        source: name.into(),
    })
}

fn status_bytes(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The inactive page cache is room: a run that has written gigabytes
    /// of checkpoints under a cgroup limit is not out of memory for it.
    #[test]
    fn a_cgroup_s_inactive_page_cache_counts_as_room() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
        write("memory.limit_in_bytes", "1000000\n");
        write("memory.usage_in_bytes", "900000\n");
        let files = CgroupFiles {
            max: "memory.limit_in_bytes",
            usage: "memory.usage_in_bytes",
            reclaimable: "total_inactive_file",
            kind: "cgroup v1",
        };
        assert_eq!(cgroup_limit(dir.path(), &files).unwrap().room, 100_000);
        write(
            "memory.stat",
            "cache 700000\ninactive_file 1\ntotal_inactive_file 600000\ntotal_active_file 5\n",
        );
        let ceiling = cgroup_limit(dir.path(), &files).unwrap();
        assert_eq!((ceiling.room, ceiling.limit), (700_000, 1_000_000));
        assert!(ceiling
            .source
            .starts_with("cgroup v1 memory.limit_in_bytes"));
        write("memory.limit_in_bytes", "9223372036854771712\n");
        assert!(cgroup_limit(dir.path(), &files).is_none(), "no limit");
    }

    /// Two compute threads and batches of 4096 Fashion-MNIST images, one
    /// worker and one prefetched (three in flight): 16 + 4 + 9.2 MiB.
    #[test]
    fn the_headroom_covers_threads_and_batches_in_flight() {
        let batches = 3 * 4096 * 784;
        assert_eq!(
            address_space_headroom(2, batches),
            (16 << 20) + (4 << 20) + 9_633_792
        );
        assert!(address_space_headroom(0, 0) >= headroom_model::address_space::DEFAULT_HEADROOM);
    }

    #[test]
    fn the_tightest_ceiling_comes_first() {
        let found = ceilings();
        assert!(found.windows(2).all(|w| w[0].room <= w[1].room));
        assert!(
            found.iter().any(|c| c.source.contains("MemAvailable")),
            "{found:?}"
        );
    }
}
