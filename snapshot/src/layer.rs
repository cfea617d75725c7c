//! Layered memory: a snapshot whose `memory` holds only the pages a restored VM changed, over
//! the memory file it was restored from (its *base*).
//!
//! A VM restored from a snapshot maps that snapshot's memory file `MAP_PRIVATE`, so the pages
//! it never wrote are still the base's. A layered snapshot stores those written pages (a
//! sparse file of the full size, like a diff: the page list is in the VMM's state) plus a
//! [`LayerState`] in [`LAYER_FILE`] naming the base and recording its identity. Restore maps
//! the base privately and the layer's pages over it.
//!
//! The base is found, in order, as [`BASE_MEMORY_FILE`] inside the layered snapshot (a hard
//! link the writer or its orchestrator places there, so removing or rebuilding the template
//! the base came from cannot break the snapshot), or at the path recorded in the layer state.
//! Either must have the recorded identity (size, inode, modification time): a memory file is
//! never changed in place (writers create a new inode), so a file with the same inode and
//! mtime is the same contents. A missing or different base is refused, naming the file.

use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::state::{read_state, write_state, StateError};

/// Name of the layer description inside a layered snapshot directory.
pub const LAYER_FILE: &str = "layer";
/// Name of the (hard-linked) base memory file inside a layered snapshot directory.
pub const BASE_MEMORY_FILE: &str = "memory.base";

/// What identifies a base memory file: a memory file is never rewritten in place, so the
/// same inode with the same size and modification time has the same contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BaseIdentity {
    /// Size in bytes.
    pub len: u64,
    /// Inode number.
    pub ino: u64,
    /// Modification time, seconds since the epoch.
    pub mtime_sec: i64,
    /// Modification time, nanoseconds.
    pub mtime_nsec: i64,
}

impl BaseIdentity {
    /// The identity of an open file.
    ///
    /// # Errors
    /// The `fstat` failure.
    pub fn of(file: &File) -> io::Result<Self> {
        Ok(Self::from_metadata(&file.metadata()?))
    }

    /// The identity recorded in `meta`.
    pub fn from_metadata(meta: &std::fs::Metadata) -> Self {
        Self {
            len: meta.len(),
            ino: meta.ino(),
            mtime_sec: meta.mtime(),
            mtime_nsec: meta.mtime_nsec(),
        }
    }

    /// What differs between `self` (expected) and `found`, for error messages; `None` if they
    /// are the same.
    pub fn difference(&self, found: &Self) -> Option<String> {
        let mut what = Vec::new();
        if self.len != found.len {
            what.push(format!("size {} (expected {})", found.len, self.len));
        }
        if self.ino != found.ino {
            what.push(format!("inode {} (expected {})", found.ino, self.ino));
        }
        if (self.mtime_sec, self.mtime_nsec) != (found.mtime_sec, found.mtime_nsec) {
            what.push(format!(
                "modification time {}.{:09} (expected {}.{:09})",
                found.mtime_sec, found.mtime_nsec, self.mtime_sec, self.mtime_nsec
            ));
        }
        (!what.is_empty()).then(|| what.join(", "))
    }
}

/// The contents of [`LAYER_FILE`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LayerState {
    /// Where the writer found the base memory file (a path in the writer's view of the
    /// filesystem, e.g. inside its jail).
    pub base_path: PathBuf,
    /// The base's identity.
    pub base: BaseIdentity,
    /// Pages stored in the layer (the rest are the base's); a cross-check of the page list
    /// in the VMM's state.
    pub pages: u64,
}

/// Why a layered snapshot's layer or base is not usable.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    /// The layer description is unreadable, corrupt or truncated.
    #[error(transparent)]
    State(#[from] StateError),
    /// No base memory file was found.
    #[error(
        "layered snapshot {}: its base memory file is gone: neither {} nor {} exists \
         (was the template it was paused from removed or rebuilt?)",
        dir.display(), linked.display(), recorded.display()
    )]
    BaseMissing {
        /// The layered snapshot.
        dir: PathBuf,
        /// The hard link expected inside it.
        linked: PathBuf,
        /// The path the layer state records.
        recorded: PathBuf,
    },
    /// A base memory file exists but is not the one the layer was written over.
    #[error(
        "layered snapshot {}: base memory file {} is not the one it was taken over: {what} \
         (was the template it was paused from rebuilt?)",
        dir.display(), path.display()
    )]
    BaseChanged {
        /// The layered snapshot.
        dir: PathBuf,
        /// The file found.
        path: PathBuf,
        /// What differs.
        what: String,
    },
    /// The base could not be opened or inspected.
    #[error("layered snapshot {}: base memory file {}: cannot {op}: {source}", dir.display(), path.display())]
    Io {
        /// The layered snapshot.
        dir: PathBuf,
        /// The file.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// Why.
        source: io::Error,
    },
}

/// Writes `layer` as `path` (framed and checksummed like a state file).
///
/// # Errors
/// As [`write_state`].
pub fn write_layer(path: impl AsRef<Path>, layer: &LayerState) -> Result<(), LayerError> {
    Ok(write_state(path, layer)?)
}

/// Reads the layer description of the snapshot in `dir`, or `None` if it is not layered.
///
/// # Errors
/// [`LayerError::State`] for an unreadable, corrupt, truncated or newer-version file.
pub fn read_layer(dir: &Path) -> Result<Option<LayerState>, LayerError> {
    let path = dir.join(LAYER_FILE);
    match std::fs::symlink_metadata(&path) {
        Ok(_) => Ok(Some(read_state(&path)?)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(StateError::Io {
            origin: crate::state::Origin::File(path),
            op: "stat the file",
            source,
        }
        .into()),
    }
}

/// Opens the base memory file of the layered snapshot in `dir` (the hard link inside it if
/// there is one, else the recorded path) and checks it is the one the layer was written over.
/// Returns its path and the open file (map this file, not the path, so a rename in between
/// cannot swap it).
///
/// # Errors
/// [`LayerError::BaseMissing`], [`LayerError::BaseChanged`], [`LayerError::Io`].
pub fn open_base(dir: &Path, layer: &LayerState) -> Result<(PathBuf, File), LayerError> {
    let linked = dir.join(BASE_MEMORY_FILE);
    // The recorded path is in the writer's view: restored elsewhere (another jail, where the
    // snapshot itself is mounted where its base was) it may name this snapshot's own layer.
    let own = dir.join(crate::MEMORY_FILE);
    let recorded = (layer.base_path != own).then_some(&layer.base_path);
    for path in std::iter::once(&linked).chain(recorded) {
        let file = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(source) => {
                return Err(LayerError::Io {
                    dir: dir.to_path_buf(),
                    path: path.clone(),
                    op: "open it",
                    source,
                })
            }
        };
        let meta = file.metadata().map_err(|source| LayerError::Io {
            dir: dir.to_path_buf(),
            path: path.clone(),
            op: "stat it",
            source,
        })?;
        if !meta.is_file() {
            return Err(LayerError::BaseChanged {
                dir: dir.to_path_buf(),
                path: path.clone(),
                what: "not a regular file".into(),
            });
        }
        if let Some(what) = layer.base.difference(&BaseIdentity::from_metadata(&meta)) {
            return Err(LayerError::BaseChanged {
                dir: dir.to_path_buf(),
                path: path.clone(),
                what,
            });
        }
        return Ok((path.clone(), file));
    }
    Err(LayerError::BaseMissing {
        dir: dir.to_path_buf(),
        linked,
        recorded: layer.base_path.clone(),
    })
}

/// Places a hard link to `base` inside the layered snapshot `dir` as [`BASE_MEMORY_FILE`],
/// after checking `base` is the file the layer was written over; a link already there is
/// replaced. Fails (e.g. `EXDEV` across filesystems) without changing the snapshot's meaning:
/// it then still names the recorded path.
///
/// # Errors
/// [`LayerError::BaseChanged`] if `base` is another file, [`LayerError::Io`].
pub fn link_base(dir: &Path, layer: &LayerState, base: &Path) -> Result<PathBuf, LayerError> {
    let io = |op: &'static str, path: &Path| {
        let (dir, path) = (dir.to_path_buf(), path.to_path_buf());
        move |source| LayerError::Io {
            dir,
            path,
            op,
            source,
        }
    };
    let meta = std::fs::metadata(base).map_err(io("stat it", base))?;
    if let Some(what) = layer.base.difference(&BaseIdentity::from_metadata(&meta)) {
        return Err(LayerError::BaseChanged {
            dir: dir.to_path_buf(),
            path: base.to_path_buf(),
            what,
        });
    }
    let link = dir.join(BASE_MEMORY_FILE);
    match std::fs::remove_file(&link) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("replace the link", &link)(e)),
    }
    std::fs::hard_link(base, &link).map_err(io("hard-link it into the snapshot", base))?;
    // The link is the same inode: check nothing was swapped in between.
    let linked = std::fs::metadata(&link).map_err(io("stat it", &link))?;
    if let Some(what) = layer.base.difference(&BaseIdentity::from_metadata(&linked)) {
        let _ = std::fs::remove_file(&link);
        return Err(LayerError::BaseChanged {
            dir: dir.to_path_buf(),
            path: base.to_path_buf(),
            what,
        });
    }
    Ok(link)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer_over(base: &Path) -> LayerState {
        let f = File::open(base).expect("open base");
        LayerState {
            base_path: base.to_path_buf(),
            base: BaseIdentity::of(&f).expect("identity"),
            pages: 3,
        }
    }

    #[test]
    fn layer_round_trips_and_absent_is_none() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = dir.path().join("memory");
        std::fs::write(&base, vec![1u8; 8192]).expect("base");
        assert!(read_layer(dir.path()).expect("read").is_none());
        let layer = layer_over(&base);
        write_layer(dir.path().join(LAYER_FILE), &layer).expect("write");
        assert_eq!(read_layer(dir.path()).expect("read"), Some(layer));
    }

    #[test]
    fn corrupt_or_truncated_layer_is_refused_naming_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = dir.path().join("memory");
        std::fs::write(&base, vec![1u8; 8192]).expect("base");
        let path = dir.path().join(LAYER_FILE);
        write_layer(&path, &layer_over(&base)).expect("write");
        let mut bytes = std::fs::read(&path).expect("read");
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0xff;
        std::fs::write(&path, &bytes).expect("corrupt");
        let e = read_layer(dir.path()).expect_err("corrupt");
        let msg = e.to_string();
        assert!(msg.contains("checksum") && msg.contains("layer"), "{msg}");
        std::fs::write(&path, &bytes[..10]).expect("truncate");
        let msg = read_layer(dir.path()).expect_err("truncated").to_string();
        assert!(msg.contains("truncated") && msg.contains("layer"), "{msg}");
    }

    #[test]
    fn base_is_found_linked_or_recorded_and_checked() {
        let tpl = tempfile::tempdir().expect("tempdir");
        let snap = tempfile::tempdir().expect("tempdir");
        let base = tpl.path().join("memory");
        std::fs::write(&base, vec![1u8; 8192]).expect("base");
        let layer = layer_over(&base);

        // Recorded path.
        let (p, _) = open_base(snap.path(), &layer).expect("recorded");
        assert_eq!(p, base);

        // Hard link: survives the template's removal.
        let link = link_base(snap.path(), &layer, &base).expect("link");
        assert_eq!(link, snap.path().join(BASE_MEMORY_FILE));
        std::fs::remove_file(&base).expect("remove template memory");
        let (p, _) = open_base(snap.path(), &layer).expect("linked");
        assert_eq!(p, link);

        // Gone altogether.
        std::fs::remove_file(&link).expect("remove link");
        let e = open_base(snap.path(), &layer).expect_err("missing");
        assert!(matches!(e, LayerError::BaseMissing { .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.contains("memory.base") && msg.contains("gone"), "{msg}");

        // Rebuilt: a new file at the recorded path.
        std::fs::write(&base, vec![2u8; 8192]).expect("rebuild");
        let e = open_base(snap.path(), &layer).expect_err("changed");
        assert!(matches!(e, LayerError::BaseChanged { .. }), "{e}");
        // (The filesystem may reuse the freed inode number: the mtime still tells.)
        let msg = e.to_string();
        assert!(
            msg.contains("not the one") && msg.contains("memory"),
            "{msg}"
        );
        // And it cannot be linked in as the base either.
        let e = link_base(snap.path(), &layer, &base).expect_err("changed");
        assert!(matches!(e, LayerError::BaseChanged { .. }), "{e}");
        assert!(!snap.path().join(BASE_MEMORY_FILE).exists());
    }
}
