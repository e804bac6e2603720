//! The room every fallible allocation leaves under the process's own
//! address-space limits, for the allocations that cannot fail softly.
//!
//! Under `RLIMIT_AS` (`ulimit -v`) or `RLIMIT_DATA` (`ulimit -d`) the OS
//! refuses a mapping past the limit, and a refused ordinary allocation (a
//! `Vec` push, a loader's batch, a thread's stack) aborts the process. The
//! tensor pool and the layers' scratch are fallible, but when they may take
//! address space up to the limit, whichever allocation comes next at the
//! edge decides between an error and an abort, and with several threads
//! allocating at once that is chance: `xtask/tests/trust.rs` aborted one run
//! in five under load ("memory allocation of 262144 bytes failed": a direct
//! convolution's index list growing on a compute thread, after the pool's
//! blocks had left 128 KiB of a 400 MB limit). So a fallible allocation
//! that would leave less than [`headroom`] under those limits is refused
//! here, before the OS is asked, and reported as the system's refusal (it
//! is the system's limit that says no); what cannot fail softly keeps the
//! headroom. The pipeline sizes it for its run (`set_headroom`: threads,
//! loader batches in flight); [`DEFAULT_HEADROOM`] otherwise.
//!
//! Memory: none. A measurement reads `/proc/self/statm` into a stack buffer
//! (no heap allocation: it runs at the edge). It is taken again when the
//! last one is 10 ms old, when a quarter of the headroom has been admitted
//! since, and on every request once the room is under twice the headroom;
//! in between, an admission costs a lock and a clock read.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The headroom of a process that set none: a spawned thread's stack (8
/// MiB for a pthread default), glibc's heap growth, error and log text.
pub const DEFAULT_HEADROOM: u64 = 16 << 20;

/// How long a measurement stands for what the rest of the process has
/// taken since (the loader, the compute threads' own vectors).
const FRESH: Duration = Duration::from_millis(10);

static HEADROOM: AtomicU64 = AtomicU64::new(DEFAULT_HEADROOM);
static ESTIMATE: Mutex<Option<Estimate>> = Mutex::new(None);

/// The last measurement, and what was admitted after it.
struct Estimate {
    at: Instant,
    /// Room under the tightest finite limit then; None: no finite limit.
    room: Option<u64>,
    /// Bytes admitted since.
    taken: u64,
}

/// Sets the address space every fallible allocation leaves free under
/// `RLIMIT_AS` / `RLIMIT_DATA` from now on (process-wide: the limits are).
pub fn set_headroom(bytes: u64) {
    HEADROOM.store(bytes, Ordering::Relaxed);
    // A stale estimate was judged against the old headroom.
    *ESTIMATE.lock().unwrap_or_else(PoisonError::into_inner) = None;
}

/// The address space fallible allocations leave free under the limits.
pub fn headroom() -> u64 {
    HEADROOM.load(Ordering::Relaxed)
}

/// Bytes left under the tightest of `RLIMIT_AS` and `RLIMIT_DATA` now;
/// None when neither is finite (or `/proc` cannot tell).
pub fn room() -> Option<u64> {
    measure()
}

/// Whether a fallible allocation of `bytes` may go to the OS: false when it
/// would leave less than the headroom under the process's limits.
pub(crate) fn admits(bytes: u64) -> bool {
    let headroom = headroom();
    let mut estimate = ESTIMATE.lock().unwrap_or_else(PoisonError::into_inner);
    let now = Instant::now();
    if let Some(last) = estimate.as_mut() {
        if now.duration_since(last.at) < FRESH {
            let Some(room) = last.room else {
                return true;
            };
            let taken = last.taken.saturating_add(bytes);
            if taken <= headroom / 4 && room.saturating_sub(taken) >= headroom.saturating_mul(2) {
                last.taken = taken;
                return true;
            }
        }
    }
    let room = measure();
    let admitted = room.is_none_or(|room| room >= bytes.saturating_add(headroom));
    *estimate = Some(Estimate {
        at: now,
        room,
        taken: if admitted { bytes } else { 0 },
    });
    admitted
}

#[cfg(target_os = "linux")]
fn measure() -> Option<u64> {
    let address_space = finite_limit(libc::RLIMIT_AS as _);
    let data = finite_limit(libc::RLIMIT_DATA as _);
    if address_space.is_none() && data.is_none() {
        return None;
    }
    let (size_pages, data_pages) = statm_pages()?;
    // SAFETY: sysconf reads a constant of the process.
    let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        p if p > 0 => p as u64,
        _ => 4096,
    };
    // statm's data counts the stack too: a little more than RLIMIT_DATA
    // counts, which errs on the safe side.
    let rooms = [
        address_space.map(|limit| limit.saturating_sub(size_pages * page)),
        data.map(|limit| limit.saturating_sub(data_pages * page)),
    ];
    rooms.into_iter().flatten().min()
}

#[cfg(not(target_os = "linux"))]
fn measure() -> Option<u64> {
    None
}

#[cfg(target_os = "linux")]
fn finite_limit(resource: libc::c_int) -> Option<u64> {
    let mut value = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass and reads nothing else.
    let read = unsafe { libc::getrlimit(resource as _, &mut value) } == 0;
    (read && value.rlim_cur != libc::RLIM_INFINITY).then_some(value.rlim_cur)
}

/// The process's whole mapped size and its data + stack, in pages (the
/// first and sixth fields of `/proc/self/statm`), read without touching
/// the heap.
#[cfg(target_os = "linux")]
fn statm_pages() -> Option<(u64, u64)> {
    use std::io::Read;
    let mut file = std::fs::File::open("/proc/self/statm").ok()?;
    let mut text = [0u8; 160];
    let len = file.read(&mut text).ok()?;
    let text = std::str::from_utf8(&text[..len]).ok()?;
    let mut fields = text.split_ascii_whitespace();
    let size = fields.next()?.parse().ok()?;
    let data = fields.nth(4)?.parse().ok()?;
    Some((size, data))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test process has no finite limit (cargo's runner sets none), or
    /// one with room: either way a small request is admitted and statm
    /// parses.
    #[test]
    fn a_small_request_is_admitted_and_statm_parses() {
        assert!(statm_pages().is_some_and(|(size, data)| size >= data && size > 0));
        if room().is_none_or(|room| room > 4 * headroom()) {
            assert!(admits(4096));
        }
    }
}
