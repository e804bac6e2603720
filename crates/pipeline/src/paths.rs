//! What a path is, when it is not the file (or directory) a command
//! expected: "missing" only for a path that is not there. A directory
//! where a file was expected, a symlink loop, a dangling symlink, a
//! permission error, a device or FIFO each say so, so that the user fixes
//! the right thing (`Path::is_file()` and `exists()` are false for all of
//! them alike).

use std::io::ErrorKind;
use std::path::Path;

/// What a command wants to find at a path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// A regular file (or a symlink to one) it can read.
    File,
    /// A directory it can list.
    Dir,
}

/// Whether `path` is absent: nothing there, not even a dangling symlink,
/// and no error but "not found" on the way to it. Only such a path may be
/// called missing (or be installed).
pub fn is_absent(path: &Path) -> bool {
    matches!(std::fs::symlink_metadata(path), Err(e) if e.kind() == ErrorKind::NotFound)
}

/// None when `path` is what `want` asks for and can be read; else why not,
/// as a phrase that follows the path: "does not exist", "is a directory,
/// not a file", "is a symlink loop", "cannot be read: permission denied".
pub fn problem(path: &Path, want: Want) -> Option<String> {
    let metadata = match std::fs::metadata(path) {
        Ok(metadata) => metadata,
        Err(e) => return Some(describe(path, &e)),
    };
    let kind = metadata.file_type();
    match want {
        Want::File if kind.is_dir() => return Some("is a directory, not a file".into()),
        Want::File if !kind.is_file() => {
            return Some(format!(
                "is not a regular file (a {})",
                special_kind(&metadata)
            ))
        }
        Want::Dir if !kind.is_dir() => return Some("is a file, not a directory".into()),
        _ => {}
    }
    let opened = match want {
        Want::File => std::fs::File::open(path).map(drop),
        Want::Dir => std::fs::read_dir(path).map(drop),
    };
    opened.err().map(|e| describe(path, &e))
}

/// `e`, met at `path`, as what the path is: the cause named, never just
/// "not found" for a path that is there.
pub fn describe(path: &Path, e: &std::io::Error) -> String {
    // ELOOP: a symlink that leads back to itself.
    if e.raw_os_error() == Some(libc::ELOOP) {
        return "is a symlink loop (it leads back to itself)".into();
    }
    match e.kind() {
        ErrorKind::NotFound => match std::fs::read_link(path) {
            Ok(target) => format!(
                "is a dangling symlink (to {}, which does not exist)",
                target.display()
            ),
            Err(_) => "does not exist".into(),
        },
        ErrorKind::PermissionDenied => {
            "cannot be read: permission denied (on it or a directory above it)".into()
        }
        ErrorKind::IsADirectory => "is a directory, not a file".into(),
        ErrorKind::NotADirectory => {
            "cannot be reached: a part of the path before its last is a file, not a directory"
                .into()
        }
        _ => format!("cannot be read: {e}"),
    }
}

/// A file type that is neither a file, a directory nor a symlink.
fn special_kind(metadata: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let kind = metadata.file_type();
    if kind.is_fifo() {
        "FIFO"
    } else if kind.is_socket() {
        "socket"
    } else if kind.is_block_device() || kind.is_char_device() {
        "device"
    } else {
        "special file"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_of_unreadable_path_is_named_as_what_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        let looped = dir.path().join("loop");
        std::os::unix::fs::symlink(&looped, &looped).unwrap();
        let dangling = dir.path().join("dangling");
        std::os::unix::fs::symlink(dir.path().join("gone"), &dangling).unwrap();
        let absent = dir.path().join("absent");
        let under_file = file.join("below");

        assert_eq!(problem(&file, Want::File), None);
        assert_eq!(problem(dir.path(), Want::Dir), None);
        let cases = [
            (dir.path(), Want::File, "is a directory, not a file"),
            (file.as_path(), Want::Dir, "is a file, not a directory"),
            (looped.as_path(), Want::File, "symlink loop"),
            (dangling.as_path(), Want::File, "dangling symlink"),
            (absent.as_path(), Want::File, "does not exist"),
            (
                under_file.as_path(),
                Want::File,
                "is a file, not a directory",
            ),
            (
                Path::new("/dev/null"),
                Want::File,
                "not a regular file (a device)",
            ),
        ];
        for (path, want, said) in cases {
            let reason = problem(path, want).unwrap_or_default();
            assert!(reason.contains(said), "{}: {reason}", path.display());
        }
        assert!(is_absent(&absent));
        assert!(!is_absent(&dangling) && !is_absent(&looped) && !is_absent(dir.path()));
    }

    #[test]
    fn a_permission_error_is_named_as_such() {
        // Made, not met: root (the test may run as root) reads through any
        // permission.
        let denied = std::io::Error::from(ErrorKind::PermissionDenied);
        let reason = describe(Path::new("/x"), &denied);
        assert!(reason.contains("permission denied"), "{reason}");
        let looped = std::io::Error::from_raw_os_error(libc::ELOOP);
        assert!(describe(Path::new("/x"), &looped).contains("symlink loop"));
    }
}
