//! Snapshot directories, written atomically.
//!
//! A snapshot is a directory holding [`STATE_FILE`], [`MEMORY_FILE`] and optionally
//! [`MEMORY_DIFF_FILE`] or other files the VMM chooses. [`SnapshotWriter`] builds it in a hidden
//! temporary sibling (`.<name>.tmp-<pid>-<n>`) and renames it into place on
//! [`commit`](SnapshotWriter::commit), after fsyncing every file and the directory. A crash at
//! any point therefore never leaves a directory at the final name that is incomplete: either the
//! old snapshot (or nothing) is there, or the complete new one.
//!
//! Temporary directories left by a crashed process can be removed with [`remove_temp_dirs`].
//! [`SnapshotDir`] opens a committed snapshot for reading.

use std::ffi::OsStr;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;

use crate::fsutil;
use crate::state::{self, StateError};

/// Name of the state file inside a snapshot directory.
pub const STATE_FILE: &str = "state";
/// Name of the full guest memory file inside a snapshot directory.
pub const MEMORY_FILE: &str = "memory";
/// Name of the dirty-pages memory file of a diff snapshot.
pub const MEMORY_DIFF_FILE: &str = "memory.diff";

/// Why a snapshot directory could not be created, committed or opened.
#[derive(Debug, thiserror::Error)]
pub enum DirError {
    /// A filesystem operation failed.
    #[error("snapshot directory {}: cannot {op}: {source}", path.display())]
    Io {
        /// The path the operation was applied to.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The underlying error.
        source: io::Error,
    },
    /// The final path cannot name a snapshot directory (no final component, e.g. `/` or `..`).
    #[error("{}: not usable as a snapshot directory path: {reason}", path.display())]
    InvalidPath {
        /// The path given.
        path: PathBuf,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A file name for [`SnapshotWriter::path`] / [`SnapshotDir::path`] is not a plain name.
    #[error(
        "snapshot file name {name:?} is not a plain file name (no '/', not empty, '.' or '..')"
    )]
    InvalidName {
        /// The name given.
        name: String,
    },
    /// Committing would overwrite a non-empty directory and replacing was not requested.
    #[error(
        "snapshot directory {} already exists and is not empty; use commit_replace to overwrite it",
        path.display()
    )]
    AlreadyExists {
        /// The final directory.
        path: PathBuf,
    },
    /// Something that is not a directory is in the way.
    #[error("{} exists and is not a directory", path.display())]
    NotADirectory {
        /// The offending path.
        path: PathBuf,
    },
    /// A committed snapshot directory lacks a required file.
    #[error("snapshot directory {}: missing {name:?}", dir.display())]
    MissingFile {
        /// The snapshot directory.
        dir: PathBuf,
        /// The missing file.
        name: &'static str,
    },
}

fn io_err<'p>(path: &'p Path, op: &'static str) -> impl FnOnce(io::Error) -> DirError + 'p {
    move |source| DirError::Io {
        path: path.to_path_buf(),
        op,
        source,
    }
}

/// Join `name` onto `dir` after checking it is a single plain component.
fn join_name(dir: &Path, name: &str) -> Result<PathBuf, DirError> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        return Err(DirError::InvalidName {
            name: name.to_string(),
        });
    }
    Ok(dir.join(name))
}

/// Builds a snapshot directory in a temporary sibling and moves it into place on commit.
///
/// ```no_run
/// use ember_snapshot::{write_state, SnapshotWriter, STATE_FILE};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let writer = SnapshotWriter::create("/var/lib/ember/snap/abc")?;
/// write_state(writer.path(STATE_FILE)?, &42u32)?;
/// // ... write `memory` with ember_snapshot::write_full(writer.path(MEMORY_FILE)?, ...)
/// let final_dir = writer.commit()?;
/// # let _ = final_dir; Ok(()) }
/// ```
///
/// Dropping the writer without committing removes the temporary directory.
#[derive(Debug)]
pub struct SnapshotWriter {
    final_dir: PathBuf,
    temp_dir: PathBuf,
    committed: bool,
}

impl SnapshotWriter {
    /// Start a snapshot that will end up at `final_dir`. Creates the parent directories if
    /// needed and an empty hidden temporary directory next to `final_dir`.
    ///
    /// Nothing at `final_dir` is touched until commit.
    ///
    /// # Errors
    /// [`DirError::InvalidPath`] if `final_dir` has no final component, [`DirError::Io`] if the
    /// parent or the temporary directory cannot be created.
    pub fn create(final_dir: impl AsRef<Path>) -> Result<Self, DirError> {
        let final_dir = final_dir.as_ref().to_path_buf();
        let invalid = |reason| DirError::InvalidPath {
            path: final_dir.clone(),
            reason,
        };
        if final_dir.file_name().is_none() {
            return Err(invalid("it has no final name component"));
        }
        let parent = fsutil::parent_dir(&final_dir);
        fs::create_dir_all(parent).map_err(io_err(parent, "create the parent directory"))?;
        // A name can collide only with a leftover of an earlier process with our pid; skip it.
        for _ in 0..64 {
            let temp_dir = fsutil::sibling_temp_name(&final_dir, "tmp")
                .ok_or_else(|| invalid("it has no final name component"))?;
            match fs::create_dir(&temp_dir) {
                Ok(()) => {
                    return Ok(Self {
                        final_dir,
                        temp_dir,
                        committed: false,
                    })
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io_err(&temp_dir, "create the temporary directory")(e)),
            }
        }
        Err(DirError::Io {
            path: final_dir.clone(),
            op: "find a free temporary directory name",
            source: io::Error::from(io::ErrorKind::AlreadyExists),
        })
    }

    /// Where to write the file `name` (e.g. [`STATE_FILE`]) of the snapshot being built.
    ///
    /// # Errors
    /// [`DirError::InvalidName`] unless `name` is a single plain file name.
    pub fn path(&self, name: &str) -> Result<PathBuf, DirError> {
        join_name(&self.temp_dir, name)
    }

    /// The temporary directory files are written into.
    pub fn temp_dir(&self) -> &Path {
        &self.temp_dir
    }

    /// The directory the snapshot will have after commit.
    pub fn final_dir(&self) -> &Path {
        &self.final_dir
    }

    /// Make the snapshot durable and move it to its final name.
    ///
    /// Every file in the temporary directory and the directory itself are fsynced, then the
    /// directory is renamed to the final name and the parent is fsynced. An existing *empty*
    /// directory at the final name is replaced; anything else there is refused.
    ///
    /// Returns the final directory.
    ///
    /// # Errors
    /// [`DirError::AlreadyExists`] if a non-empty directory is in the way (the temporary directory
    /// is then removed), [`DirError::NotADirectory`] if a file is, [`DirError::Io`] otherwise.
    pub fn commit(self) -> Result<PathBuf, DirError> {
        self.finish(false)
    }

    /// Like [`commit`](Self::commit), but an existing snapshot at the final name is replaced.
    ///
    /// Where the filesystem supports `renameat2(RENAME_EXCHANGE)` the swap is a single atomic
    /// step (a complete snapshot is at the final name at every instant); otherwise the old one is
    /// first renamed aside to `.<name>.old-<pid>-<n>`, leaving a short window with nothing at the
    /// final name. The old directory is removed afterwards.
    ///
    /// # Errors
    /// As [`commit`](Self::commit), except `AlreadyExists`.
    pub fn commit_replace(self) -> Result<PathBuf, DirError> {
        self.finish(true)
    }

    fn finish(mut self, replace: bool) -> Result<PathBuf, DirError> {
        sync_tree(&self.temp_dir)?;
        let parent = fsutil::parent_dir(&self.final_dir).to_path_buf();

        if let Ok(meta) = fs::symlink_metadata(&self.final_dir) {
            if !meta.is_dir() {
                return Err(DirError::NotADirectory {
                    path: self.final_dir.clone(),
                });
            }
        }

        // rename(2) atomically replaces an empty directory and refuses a non-empty one.
        let old = match fs::rename(&self.temp_dir, &self.final_dir) {
            Ok(()) => None,
            Err(e) if is_not_empty(&e) => {
                if !replace {
                    return Err(DirError::AlreadyExists {
                        path: self.final_dir.clone(),
                    });
                }
                Some(self.swap_in()?)
            }
            Err(e) => return Err(io_err(&self.final_dir, "rename the snapshot into place")(e)),
        };
        self.committed = true;
        fsutil::sync_dir(&parent).map_err(io_err(&parent, "fsync the parent directory"))?;
        if let Some(old) = old {
            // Best effort: the new snapshot is in place and durable. A leftover has a temporary
            // name and is removed by `remove_temp_dirs`.
            let _ = fs::remove_dir_all(old);
        }
        Ok(self.final_dir.clone())
    }

    /// Put the temporary directory at the final name, where a non-empty directory already is.
    /// Returns where the old snapshot now is.
    fn swap_in(&self) -> Result<PathBuf, DirError> {
        match exchange(&self.temp_dir, &self.final_dir) {
            // The temporary name now holds the old snapshot.
            Ok(()) => Ok(self.temp_dir.clone()),
            Err(e) if exchange_unsupported(&e) => self.swap_in_by_rename_aside(),
            Err(e) => Err(io_err(&self.final_dir, "exchange the old and new snapshot")(e)),
        }
    }

    /// Fallback of [`swap_in`](Self::swap_in) without `RENAME_EXCHANGE`: move the old snapshot
    /// aside, then rename the new one into place.
    fn swap_in_by_rename_aside(&self) -> Result<PathBuf, DirError> {
        let aside = fsutil::sibling_temp_name(&self.final_dir, "old").ok_or_else(|| {
            DirError::InvalidPath {
                path: self.final_dir.clone(),
                reason: "it has no final name component",
            }
        })?;
        fs::rename(&self.final_dir, &aside)
            .map_err(io_err(&self.final_dir, "move the old snapshot aside"))?;
        if let Err(e) = fs::rename(&self.temp_dir, &self.final_dir) {
            // Put the old one back; if even that fails it stays recoverable at `aside`.
            let _ = fs::rename(&aside, &self.final_dir);
            return Err(io_err(&self.final_dir, "rename the snapshot into place")(e));
        }
        Ok(aside)
    }
}

impl Drop for SnapshotWriter {
    fn drop(&mut self) {
        if !self.committed {
            // Best effort: nothing useful can be done with an error in drop.
            let _ = fs::remove_dir_all(&self.temp_dir);
        }
    }
}

fn is_not_empty(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOTEMPTY) | Some(libc::EEXIST))
}

fn exchange_unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINVAL) | Some(libc::ENOSYS) | Some(libc::EOPNOTSUPP)
    )
}

/// Atomically swap two paths with `renameat2(RENAME_EXCHANGE)`.
fn exchange(a: &Path, b: &Path) -> io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let to_c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
    };
    let (a, b) = (to_c(a)?, to_c(b)?);
    // SAFETY: both pointers come from live `CString`s, so they are valid NUL-terminated strings
    // for the duration of the call; the syscall does not retain them. Raw syscall rather than the
    // libc wrapper so this works with any glibc/musl version.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// fsync every regular file under `dir` (recursively), then the directories themselves.
fn sync_tree(dir: &Path) -> Result<(), DirError> {
    for entry in fs::read_dir(dir).map_err(io_err(dir, "list the temporary directory"))? {
        let entry = entry.map_err(io_err(dir, "list the temporary directory"))?;
        let path = entry.path();
        let kind = entry
            .file_type()
            .map_err(io_err(&path, "stat a snapshot file"))?;
        if kind.is_dir() {
            sync_tree(&path)?;
        } else if kind.is_file() {
            fs::File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(io_err(&path, "fsync a snapshot file"))?;
        }
    }
    fsutil::sync_dir(dir).map_err(io_err(dir, "fsync the temporary directory"))
}

/// Whether `name` looks like a temporary or set-aside directory made by [`SnapshotWriter`]:
/// `.<name>.tmp-<pid>-<n>` or `.<name>.old-<pid>-<n>`.
pub fn is_temp_name(name: &OsStr) -> bool {
    let Some(name) = name.to_str() else {
        return false;
    };
    let Some(rest) = name.strip_prefix('.') else {
        return false;
    };
    let Some((_, tail)) = rest
        .rsplit_once(".tmp-")
        .or_else(|| rest.rsplit_once(".old-"))
    else {
        return false;
    };
    let Some((pid, n)) = tail.split_once('-') else {
        return false;
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    digits(pid) && digits(n)
}

/// Remove every temporary or set-aside snapshot directory (see [`is_temp_name`]) directly under
/// `parent`, returning what was removed.
///
/// Call this only when no [`SnapshotWriter`] can be working under `parent` (e.g. at server start,
/// after orphaned VMMs were killed): it does not know which writers are still alive.
///
/// # Errors
/// [`DirError::Io`] if `parent` cannot be listed or an entry cannot be removed.
pub fn remove_temp_dirs(parent: impl AsRef<Path>) -> Result<Vec<PathBuf>, DirError> {
    let parent = parent.as_ref();
    let mut removed = Vec::new();
    for entry in fs::read_dir(parent).map_err(io_err(parent, "list the directory"))? {
        let entry = entry.map_err(io_err(parent, "list the directory"))?;
        let path = entry.path();
        if !is_temp_name(&entry.file_name()) {
            continue;
        }
        let is_dir = entry.file_type().map(|t| t.is_dir()).unwrap_or(false);
        if is_dir {
            fs::remove_dir_all(&path).map_err(io_err(&path, "remove a stale temporary dir"))?;
            removed.push(path);
        }
    }
    Ok(removed)
}

/// A committed snapshot directory, opened for reading.
#[derive(Debug, Clone)]
pub struct SnapshotDir {
    dir: PathBuf,
}

impl SnapshotDir {
    /// Open the snapshot at `dir`, checking that it is a directory with a [`STATE_FILE`].
    /// Contents are not validated here; [`read_state`](Self::read_state) does that.
    ///
    /// # Errors
    /// [`DirError::Io`] if `dir` cannot be inspected, [`DirError::NotADirectory`],
    /// [`DirError::MissingFile`].
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, DirError> {
        let dir = dir.as_ref().to_path_buf();
        let meta = fs::metadata(&dir).map_err(io_err(&dir, "open the snapshot"))?;
        if !meta.is_dir() {
            return Err(DirError::NotADirectory { path: dir });
        }
        if !dir.join(STATE_FILE).is_file() {
            return Err(DirError::MissingFile {
                dir,
                name: STATE_FILE,
            });
        }
        Ok(Self { dir })
    }

    /// The snapshot directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The path of the file `name` in the snapshot.
    ///
    /// # Errors
    /// [`DirError::InvalidName`] unless `name` is a single plain file name.
    pub fn path(&self, name: &str) -> Result<PathBuf, DirError> {
        join_name(&self.dir, name)
    }

    /// Whether the snapshot contains a file `name` (false for invalid names).
    pub fn has(&self, name: &str) -> bool {
        self.path(name).map(|p| p.is_file()).unwrap_or(false)
    }

    /// Read, check and decode the snapshot's [`STATE_FILE`].
    ///
    /// # Errors
    /// See [`crate::read_state`].
    pub fn read_state<T: DeserializeOwned>(&self) -> Result<T, StateError> {
        state::read_state(self.dir.join(STATE_FILE))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{read_state, write_state};

    fn entries(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .expect("list")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn commit_moves_complete_dir_into_place() {
        let root = tempfile::tempdir().expect("tempdir");
        let final_dir = root.path().join("nested/snap");
        let writer = SnapshotWriter::create(&final_dir).expect("create");
        assert!(writer.temp_dir().is_dir());
        assert!(!final_dir.exists());
        write_state(writer.path(STATE_FILE).expect("name"), &7u32).expect("state");
        fs::write(writer.path(MEMORY_FILE).expect("name"), [1u8; 100]).expect("memory");
        let temp = writer.temp_dir().to_path_buf();
        let out = writer.commit().expect("commit");
        assert_eq!(out, final_dir);
        assert!(!temp.exists());
        assert_eq!(entries(&final_dir), [MEMORY_FILE, STATE_FILE]);
        assert_eq!(entries(&root.path().join("nested")), ["snap"]);
        let snap = SnapshotDir::open(&final_dir).expect("open");
        assert_eq!(snap.read_state::<u32>().expect("state"), 7);
        assert!(snap.has(MEMORY_FILE));
        assert!(!snap.has(MEMORY_DIFF_FILE));
        assert!(!snap.has("../snap"));
    }

    #[test]
    fn drop_without_commit_leaves_nothing() {
        let root = tempfile::tempdir().expect("tempdir");
        let final_dir = root.path().join("snap");
        {
            let writer = SnapshotWriter::create(&final_dir).expect("create");
            fs::write(writer.path(MEMORY_FILE).expect("name"), b"partial").expect("write");
        }
        assert!(!final_dir.exists());
        assert!(
            entries(root.path()).is_empty(),
            "{:?}",
            entries(root.path())
        );
    }

    #[test]
    fn commit_refuses_non_empty_existing_dir() {
        let root = tempfile::tempdir().expect("tempdir");
        let final_dir = root.path().join("snap");
        fs::create_dir(&final_dir).expect("mkdir");
        fs::write(final_dir.join(STATE_FILE), b"old").expect("old");
        let writer = SnapshotWriter::create(&final_dir).expect("create");
        fs::write(writer.path(STATE_FILE).expect("name"), b"new").expect("new");
        let err = writer.commit().expect_err("must refuse");
        assert!(matches!(err, DirError::AlreadyExists { .. }), "{err}");
        assert!(err.to_string().contains("snap"), "{err}");
        // Old untouched, temp gone.
        assert_eq!(fs::read(final_dir.join(STATE_FILE)).expect("read"), b"old");
        assert_eq!(entries(root.path()), ["snap"]);
    }

    #[test]
    fn commit_replaces_empty_existing_dir() {
        let root = tempfile::tempdir().expect("tempdir");
        let final_dir = root.path().join("snap");
        fs::create_dir(&final_dir).expect("mkdir");
        let writer = SnapshotWriter::create(&final_dir).expect("create");
        fs::write(writer.path(STATE_FILE).expect("name"), b"new").expect("new");
        writer.commit().expect("empty dir is replaced");
        assert_eq!(fs::read(final_dir.join(STATE_FILE)).expect("read"), b"new");
    }

    #[test]
    fn commit_replace_overwrites_and_cleans_up() {
        let root = tempfile::tempdir().expect("tempdir");
        let final_dir = root.path().join("snap");
        fs::create_dir(&final_dir).expect("mkdir");
        fs::write(final_dir.join(STATE_FILE), b"old").expect("old");
        fs::write(final_dir.join("extra"), b"old extra").expect("old");
        let writer = SnapshotWriter::create(&final_dir).expect("create");
        write_state(writer.path(STATE_FILE).expect("name"), &"new").expect("new");
        writer.commit_replace().expect("replace");
        assert_eq!(
            read_state::<String>(final_dir.join(STATE_FILE)).expect("state"),
            "new"
        );
        assert_eq!(entries(&final_dir), [STATE_FILE]);
        assert_eq!(entries(root.path()), ["snap"]);
    }

    #[test]
    fn replace_fallback_path_works() {
        // The rename-aside path, which commit_replace takes on filesystems without
        // RENAME_EXCHANGE.
        let root = tempfile::tempdir().expect("tempdir");
        let final_dir = root.path().join("snap");
        fs::create_dir(&final_dir).expect("mkdir");
        fs::write(final_dir.join("old"), b"x").expect("old");
        let mut writer = SnapshotWriter::create(&final_dir).expect("create");
        fs::write(writer.path("new").expect("name"), b"y").expect("new");
        let aside = writer.swap_in_by_rename_aside().expect("swap");
        writer.committed = true;
        assert_eq!(entries(&aside), ["old"]);
        assert!(is_temp_name(aside.file_name().expect("name")));
        assert_eq!(remove_temp_dirs(root.path()).expect("cleanup"), [aside]);
        drop(writer);
        assert_eq!(entries(&final_dir), ["new"]);
        assert_eq!(entries(root.path()), ["snap"]);
    }

    #[test]
    fn exchange_swaps_two_directories() {
        let root = tempfile::tempdir().expect("tempdir");
        let (a, b) = (root.path().join("a"), root.path().join("b"));
        fs::create_dir(&a).expect("a");
        fs::create_dir(&b).expect("b");
        fs::write(a.join("from_a"), b"").expect("a file");
        fs::write(b.join("from_b"), b"").expect("b file");
        match exchange(&a, &b) {
            Ok(()) => {
                assert_eq!(entries(&a), ["from_b"]);
                assert_eq!(entries(&b), ["from_a"]);
            }
            // A filesystem without RENAME_EXCHANGE: commit_replace falls back.
            Err(e) => assert!(exchange_unsupported(&e), "{e}"),
        }
    }

    #[test]
    fn file_in_the_way_is_refused() {
        let root = tempfile::tempdir().expect("tempdir");
        let final_dir = root.path().join("snap");
        fs::write(&final_dir, b"file").expect("file");
        let writer = SnapshotWriter::create(&final_dir).expect("create");
        let err = writer.commit_replace().expect_err("file in the way");
        assert!(matches!(err, DirError::NotADirectory { .. }), "{err}");
        assert_eq!(entries(root.path()), ["snap"]);
        assert_eq!(fs::read(&final_dir).expect("read"), b"file");
    }

    #[test]
    fn names_are_checked() {
        let root = tempfile::tempdir().expect("tempdir");
        let writer = SnapshotWriter::create(root.path().join("snap")).expect("create");
        for bad in ["", ".", "..", "a/b", "../x", "/etc/passwd"] {
            assert!(
                matches!(writer.path(bad), Err(DirError::InvalidName { .. })),
                "{bad:?}"
            );
        }
        assert!(writer.path("memory.diff").is_ok());
        assert!(matches!(
            SnapshotWriter::create("/"),
            Err(DirError::InvalidPath { .. })
        ));
    }

    #[test]
    fn concurrent_writers_first_commit_wins() {
        let root = tempfile::tempdir().expect("tempdir");
        let final_dir = root.path().join("snap");
        let a = SnapshotWriter::create(&final_dir).expect("a");
        let b = SnapshotWriter::create(&final_dir).expect("b");
        assert_ne!(a.temp_dir(), b.temp_dir());
        fs::write(a.path("f").expect("name"), b"a").expect("a");
        fs::write(b.path("f").expect("name"), b"b").expect("b");
        b.commit().expect("b first");
        assert!(matches!(a.commit(), Err(DirError::AlreadyExists { .. })));
        assert_eq!(fs::read(final_dir.join("f")).expect("read"), b"b");
        assert_eq!(entries(root.path()), ["snap"]);
    }

    #[test]
    fn temp_names_and_cleanup() {
        assert!(is_temp_name(OsStr::new(".snap.tmp-123-0")));
        assert!(is_temp_name(OsStr::new(".a.b.old-1-22")));
        assert!(!is_temp_name(OsStr::new("snap")));
        assert!(!is_temp_name(OsStr::new(".snap.tmp-x-0")));
        assert!(!is_temp_name(OsStr::new(".snap.tmp-1-")));

        let root = tempfile::tempdir().expect("tempdir");
        let final_dir = root.path().join("snap");
        let writer = SnapshotWriter::create(&final_dir).expect("create");
        fs::write(writer.path("f").expect("name"), b"x").expect("write");
        // Simulate a crash: the writer never runs its Drop.
        std::mem::forget(writer);
        fs::create_dir(root.path().join("keep")).expect("mkdir");
        let removed = remove_temp_dirs(root.path()).expect("cleanup");
        assert_eq!(removed.len(), 1);
        assert_eq!(entries(root.path()), ["keep"]);
    }

    #[test]
    fn open_checks_the_directory() {
        let root = tempfile::tempdir().expect("tempdir");
        let err = SnapshotDir::open(root.path().join("nope")).expect_err("missing");
        assert!(matches!(err, DirError::Io { .. }));
        let err = SnapshotDir::open(root.path()).expect_err("no state");
        assert!(
            matches!(
                err,
                DirError::MissingFile {
                    name: STATE_FILE,
                    ..
                }
            ),
            "{err}"
        );
        fs::write(root.path().join("f"), b"").expect("file");
        let err = SnapshotDir::open(root.path().join("f")).expect_err("file");
        assert!(matches!(err, DirError::NotADirectory { .. }));
    }
}
