//! Small filesystem helpers shared by the modules of this crate: unique temporary names next to a
//! target, directory fsync and atomic file replacement.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Counter that makes temporary names unique within one process.
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// The directory that holds `path`. A bare relative name ("state") lives in ".".
pub(crate) fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// A fresh sibling name of `path`: `.<name>.<tag>-<pid>-<n>` in the same directory, so a rename
/// from it to `path` never crosses a filesystem.
///
/// Returns `None` when `path` has no final component (e.g. `/` or `..`).
pub(crate) fn sibling_temp_name(path: &Path, tag: &str) -> Option<PathBuf> {
    let name = path.file_name()?;
    let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut temp = OsString::from(".");
    temp.push(name);
    temp.push(format!(".{tag}-{}-{n}", std::process::id()));
    Some(parent_dir(path).join(temp))
}

/// fsync a directory, making renames and creations inside it durable.
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Which step of [`atomic_write`] failed, for error messages.
pub(crate) type Step = &'static str;

/// Write `bytes` to `path` so that a crash leaves either the old file or the complete new one:
/// write a temporary sibling, fsync it, rename it over `path`, fsync the directory.
pub(crate) fn atomic_write(path: &Path, bytes: &[u8]) -> Result<(), (Step, io::Error)> {
    let temp = sibling_temp_name(path, "tmp").ok_or_else(|| {
        (
            "choose a temporary name",
            io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"),
        )
    })?;
    let result = write_synced(&temp, bytes).and_then(|()| {
        fs::rename(&temp, path).map_err(|e| ("rename the temporary file into place", e))
    });
    if result.is_err() {
        // Best effort: the temporary file is ours and useless now.
        let _ = fs::remove_file(&temp);
        return result;
    }
    sync_dir(parent_dir(path)).map_err(|e| ("fsync the containing directory", e))
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), (Step, io::Error)> {
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| ("create a temporary file", e))?;
    file.write_all(bytes)
        .map_err(|e| ("write the temporary file", e))?;
    file.sync_all().map_err(|e| ("fsync the temporary file", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parent_of_bare_name_is_dot() {
        assert_eq!(parent_dir(Path::new("state")), Path::new("."));
        assert_eq!(parent_dir(Path::new("/a/state")), Path::new("/a"));
    }

    #[test]
    fn temp_names_are_unique_hidden_siblings() {
        let a = sibling_temp_name(Path::new("/x/snap"), "tmp").expect("has a name");
        let b = sibling_temp_name(Path::new("/x/snap"), "tmp").expect("has a name");
        assert_ne!(a, b);
        assert_eq!(a.parent(), Some(Path::new("/x")));
        let name = a.file_name().and_then(|n| n.to_str()).expect("utf-8");
        assert!(name.starts_with(".snap.tmp-"), "{name}");
        assert!(sibling_temp_name(Path::new("/"), "tmp").is_none());
    }

    #[test]
    fn atomic_write_replaces_and_leaves_no_temp() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f");
        atomic_write(&path, b"one").expect("first write");
        atomic_write(&path, b"two").expect("second write");
        assert_eq!(fs::read(&path).expect("read"), b"two");
        let entries: Vec<_> = fs::read_dir(dir.path()).expect("list").collect();
        assert_eq!(entries.len(), 1);
    }
}
