//! Reading a shard file for [`crate::ShardedDataset`]: whole, its size
//! checked against the index, tried again after an I/O error that may
//! pass (a network file system's EIO or stale handle, a timeout) but not
//! after one that lasts (a corrupt, truncated or missing file).

use std::fs::File;
use std::io::{self, Read};
use std::path::Path;
use std::time::Duration;

use crate::store::{self, StoreIndex};
use crate::LoaderError;

/// Why a shard file could not be read, and whether reading it again may
/// succeed.
#[derive(Debug, PartialEq)]
pub(crate) struct ReadFault {
    pub(crate) message: String,
    may_pass: bool,
}

impl ReadFault {
    fn io(message: String, e: &io::Error) -> Self {
        Self {
            message,
            may_pass: may_pass(e),
        }
    }

    fn lasting(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            may_pass: false,
        }
    }
}

/// An I/O error that a later try may not meet.
fn may_pass(e: &io::Error) -> bool {
    use io::ErrorKind::{Interrupted, TimedOut, WouldBlock};
    matches!(e.kind(), Interrupted | TimedOut | WouldBlock) || passing_os_error(e)
}

#[cfg(target_os = "linux")]
fn passing_os_error(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EIO | libc::ESTALE))
}

#[cfg(not(target_os = "linux"))]
fn passing_os_error(_: &io::Error) -> bool {
    false
}

/// The whole of a shard file that the index says holds `expected` bytes.
pub(crate) fn read_shard_file(path: &Path, expected: u64) -> Result<Vec<u8>, ReadFault> {
    let mut file = File::open(path).map_err(|e| ReadFault::io(unopenable(&e), &e))?;
    if let Some(fault) = size_fault(file.metadata().map(|m| m.len()), expected) {
        return Err(ReadFault::lasting(fault));
    }
    // A shard's size is the store's (data.shard_size when it was made): a
    // refused allocation is this read's error, not an abort.
    let mut bytes = Vec::new();
    usize::try_from(expected)
        .map_err(|e| e.to_string())
        .and_then(|len| bytes.try_reserve_exact(len).map_err(|e| e.to_string()))
        .map_err(|e| {
            ReadFault::lasting(format!(
                "its {expected} bytes cannot be held in memory ({e}); make the store again with \
                 smaller shards or raise the memory limit"
            ))
        })?;
    bytes.resize(expected as usize, 0);
    file.read_exact(&mut bytes).map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            ReadFault::lasting("truncated while being read")
        } else {
            ReadFault::io(format!("read failed: {e}"), &e)
        }
    })?;
    Ok(bytes)
}

/// `read`, tried again after each of `delays` while it fails with a fault
/// that may pass; each new try is logged.
pub(crate) fn with_retries<T>(
    path: &Path,
    delays: &[Duration],
    mut read: impl FnMut() -> Result<T, ReadFault>,
) -> Result<T, ReadFault> {
    let mut delays = delays.iter();
    for tries in 1.. {
        match read() {
            Err(mut fault) if fault.may_pass => {
                let Some(&delay) = delays.next() else {
                    fault.message = format!("{} ({tries} tries)", fault.message);
                    return Err(fault);
                };
                tracing::warn!(
                    "shard {}: {}; reading it again in {} ms",
                    path.display(),
                    fault.message,
                    delay.as_millis()
                );
                std::thread::sleep(delay);
            }
            done => return done,
        }
    }
    unreachable!("the tries end with the delays")
}

fn unopenable(e: &io::Error) -> String {
    if e.kind() == io::ErrorKind::NotFound {
        "missing: the store is incomplete (re-run preprocess)".into()
    } else {
        format!("cannot open: {e}")
    }
}

/// What is wrong with a shard file whose size is `on_disk` where the index
/// says `expected` bytes; None when nothing is.
fn size_fault(on_disk: io::Result<u64>, expected: u64) -> Option<String> {
    match on_disk {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Some(unopenable(&e)),
        Err(e) => Some(format!("cannot stat: {e}")),
        Ok(actual) if actual != expected => Some(format!(
            "{} file: {actual} bytes on disk, the index says {expected} (re-run preprocess)",
            if actual < expected {
                "truncated"
            } else {
                "overlong"
            },
        )),
        Ok(_) => None,
    }
}

/// Every shard file of the index is there with its size: a store with a
/// file missing or cut short is refused when it is opened (one `stat` per
/// shard, nothing read), not at whatever step first touches that shard.
pub(crate) fn check_shard_files(dir: &Path, index: &StoreIndex) -> Result<(), LoaderError> {
    for (k, meta) in index.shards.iter().enumerate() {
        let path = dir.join(store::shard_file_name(k));
        if let Some(message) = size_fault(std::fs::metadata(&path).map(|m| m.len()), meta.bytes) {
            return Err(LoaderError::Shard {
                path,
                index: None,
                message,
            });
        }
    }
    Ok(())
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    fn eio() -> io::Error {
        io::Error::from_raw_os_error(libc::EIO)
    }

    /// A read that fails `failures` times with `fault`, then gives 7; the
    /// tries it took.
    fn flaky(failures: usize, fault: impl Fn() -> ReadFault) -> (Result<u32, ReadFault>, usize) {
        let mut tries = 0;
        let delays = [Duration::ZERO; 3];
        let result = with_retries(Path::new("s.bin"), &delays, || {
            tries += 1;
            if tries <= failures {
                Err(fault())
            } else {
                Ok(7)
            }
        });
        (result, tries)
    }

    #[test]
    fn an_error_that_may_pass_is_tried_again_and_one_that_lasts_is_not() {
        let passing = || ReadFault::io("read failed: EIO".into(), &eio());
        assert!(passing().may_pass);
        assert_eq!(flaky(2, passing), (Ok(7), 3));
        let (result, tries) = flaky(9, passing);
        assert_eq!(tries, 4, "once and again after each of the 3 delays");
        assert_eq!(result.unwrap_err().message, "read failed: EIO (4 tries)");
        let (result, tries) = flaky(1, || ReadFault::lasting("truncated while being read"));
        assert_eq!(tries, 1);
        assert_eq!(result.unwrap_err().message, "truncated while being read");
    }

    #[test]
    fn only_errors_that_may_pass_are_retried() {
        assert!(may_pass(&io::Error::from_raw_os_error(libc::ESTALE)));
        assert!(may_pass(&io::Error::from(io::ErrorKind::TimedOut)));
        for lasting in [libc::ENOENT, libc::EACCES, libc::EISDIR] {
            assert!(
                !may_pass(&io::Error::from_raw_os_error(lasting)),
                "{lasting}"
            );
        }
    }
}
