//! Volumes: named, durable directories owned by the server, mounted into sandboxes through a
//! file server over vsock (`server.rs`) and a FUSE client in the guest agent
//! (`agent/src/volume_fuse.rs`). `docs/volumes.md` states the mechanism, why, and the semantics.
//!
//! At rest: `$EMBER_HOME/volumes/<name>/` (0700, the server's account) holds `meta.json` (cap,
//! creation time), `data/` (the files, as plain files) and `staging/` (writes not yet
//! published; emptied when the volume is opened). Which sandboxes mount which volumes is kept in
//! `$EMBER_HOME/volumes/.mounts/<sandbox>.json`, so a restarted server serves them again.

pub mod fsops;
pub mod server;

use std::collections::HashMap;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

pub use fsops::Vol;

/// Default cap of a volume created without one: 1 GiB.
pub const DEFAULT_CAP_BYTES: u64 = 1 << 30;
/// The largest cap accepted: 1 TiB.
pub const MAX_CAP_BYTES: u64 = 1 << 40;

/// A volume mounted into a sandbox at create.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct VolumeMount {
    /// The volume's name.
    pub name: String,
    /// Where it appears in the guest (absolute).
    pub path: String,
    /// Mounted read-only (the host refuses writes too).
    #[serde(default)]
    pub read_only: bool,
}

impl VolumeMount {
    /// Parses the CLI's `NAME:/path[:ro]`.
    pub fn parse(s: &str) -> Result<VolumeMount, String> {
        let mut it = s.splitn(3, ':');
        let name = it.next().unwrap_or_default().to_string();
        let path = it
            .next()
            .ok_or_else(|| format!("--volume {s:?}: expected NAME:/path[:ro]"))?
            .to_string();
        let read_only = match it.next() {
            None | Some("rw") => false,
            Some("ro") => true,
            Some(o) => return Err(format!("--volume {s:?}: unknown option {o:?} (ro or rw)")),
        };
        Ok(VolumeMount {
            name,
            path,
            read_only,
        })
    }
}

/// A volume's description.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct VolumeInfo {
    /// Its name.
    pub name: String,
    /// Most bytes its files may hold.
    pub cap_bytes: u64,
    /// Bytes its files hold now (including writes not yet published).
    pub used_bytes: u64,
    /// When it was made (RFC 3339).
    pub created_at: String,
    /// Sandboxes (not ended) that mount it.
    pub mounted_by: Vec<String>,
}

/// One file or directory in a volume (the content API).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct VolumeEntry {
    /// Path from the volume's root.
    pub path: String,
    /// Its last component.
    pub name: String,
    /// `file` or `dir`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Bytes (0 for a directory).
    pub size: u64,
    /// Permission bits.
    pub mode: u32,
    /// Last modification (RFC 3339).
    pub modified_at: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Meta {
    name: String,
    cap_bytes: u64,
    created_ms: i64,
}

/// What a volume call refuses or fails with.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// No volume of that name.
    #[error("no volume {0:?}")]
    NotFound(String),
    /// A create of a name that exists.
    #[error("volume {0:?} exists already")]
    Exists(String),
    /// A delete of a volume that sandboxes mount (without `force`).
    #[error(
        "volume {name:?} is mounted by sandbox(es) {sandboxes:?} (kill them, or delete with force)"
    )]
    InUse {
        /// The volume.
        name: String,
        /// Who mounts it.
        sandboxes: Vec<String>,
    },
    /// No file or directory at that path.
    #[error("volume {name:?}: no such file or directory: {path:?}")]
    NoSuchPath {
        /// The volume.
        name: String,
        /// The path.
        path: String,
    },
    /// The write would take the volume past its cap.
    #[error("volume {name:?} is full: the write would pass its cap of {cap_bytes} bytes")]
    Full {
        /// The volume.
        name: String,
        /// Its cap.
        cap_bytes: u64,
    },
    /// A bad name, cap, mount or path.
    #[error("{0}")]
    Invalid(String),
    /// A host file operation failed.
    #[error("volume {name:?}: {what}: {source}")]
    Io {
        /// The volume.
        name: String,
        /// What was being done.
        what: String,
        /// Why.
        source: io::Error,
    },
}

/// Checks a volume name: 1 to 63 of `a-z 0-9 - _ .`, starting with a letter or digit.
pub fn check_name(name: &str) -> Result<(), VolumeError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_.".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(VolumeError::Invalid(format!(
            "invalid volume name {name:?}: 1 to 63 of a-z, 0-9, '-', '_', '.', starting with a \
             letter or digit"
        )))
    }
}

/// A content-API path (`/a/b`, `a/b`; `/` or empty is the root) as the protocol's path.
pub fn api_path(path: &str) -> Result<String, VolumeError> {
    let p = path.trim_start_matches('/').trim_end_matches('/');
    ember_agent::volume_wire::check_path(p)
        .map_err(|m| VolumeError::Invalid(format!("path {path:?} refused: {m}")))?;
    Ok(p.to_string())
}

/// Every volume on this host, and who mounts which.
#[derive(Debug)]
pub struct Volumes {
    root: PathBuf,
    open: Mutex<HashMap<String, Arc<Vol>>>,
    /// Sandbox id → its mounts.
    mounts: Mutex<HashMap<String, Vec<VolumeMount>>>,
    /// Sandbox id → the stop flag of its listener.
    listeners: Mutex<HashMap<String, Arc<AtomicBool>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Volumes {
    /// The volumes under `home/volumes` (made 0700 if missing).
    pub fn new(home: &Path) -> io::Result<Volumes> {
        let root = home.join("volumes");
        std::fs::create_dir_all(root.join(".mounts"))?;
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o700))?;
        let mut mounts = HashMap::new();
        if let Ok(rd) = std::fs::read_dir(root.join(".mounts")) {
            for e in rd.flatten() {
                let p = e.path();
                let Some(id) = p.file_stem().and_then(|s| s.to_str()).map(str::to_string) else {
                    continue;
                };
                if let Ok(m) = std::fs::read(&p)
                    .map_err(|e| e.to_string())
                    .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
                {
                    mounts.insert(id, m);
                }
            }
        }
        Ok(Volumes {
            root,
            open: Mutex::new(HashMap::new()),
            mounts: Mutex::new(mounts),
            listeners: Mutex::new(HashMap::new()),
        })
    }

    fn dir(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    fn meta(&self, name: &str) -> Result<Meta, VolumeError> {
        check_name(name)?;
        let p = self.dir(name).join("meta.json");
        let b = match std::fs::read(&p) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(VolumeError::NotFound(name.to_string()))
            }
            Err(source) => {
                return Err(VolumeError::Io {
                    name: name.into(),
                    what: "read meta.json".into(),
                    source,
                })
            }
        };
        serde_json::from_slice(&b).map_err(|e| VolumeError::Io {
            name: name.into(),
            what: "parse meta.json".into(),
            source: io::Error::other(e),
        })
    }

    /// The open volume `name`.
    pub fn vol(&self, name: &str) -> Result<Arc<Vol>, VolumeError> {
        if let Some(v) = lock(&self.open).get(name) {
            return Ok(v.clone());
        }
        let m = self.meta(name)?;
        let mut open = lock(&self.open);
        if let Some(v) = open.get(name) {
            return Ok(v.clone());
        }
        let v =
            Vol::open(name, &self.dir(name), m.cap_bytes).map_err(|source| VolumeError::Io {
                name: name.into(),
                what: "open".into(),
                source,
            })?;
        open.insert(name.to_string(), v.clone());
        Ok(v)
    }

    /// Makes volume `name`.
    pub fn create(&self, name: &str, cap_bytes: Option<u64>) -> Result<(), VolumeError> {
        check_name(name)?;
        let cap = cap_bytes.unwrap_or(DEFAULT_CAP_BYTES);
        if cap == 0 || cap > MAX_CAP_BYTES {
            return Err(VolumeError::Invalid(format!(
                "cap_bytes must be 1 to {MAX_CAP_BYTES}"
            )));
        }
        let dir = self.dir(name);
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                return Err(VolumeError::Exists(name.to_string()))
            }
            Err(source) => {
                return Err(VolumeError::Io {
                    name: name.into(),
                    what: "mkdir".into(),
                    source,
                })
            }
        }
        let io_err = |what: &str| {
            let what = what.to_string();
            move |source| VolumeError::Io {
                name: name.into(),
                what,
                source,
            }
        };
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io_err("chmod"))?;
        std::fs::create_dir(dir.join("data")).map_err(io_err("mkdir data"))?;
        let meta = Meta {
            name: name.to_string(),
            cap_bytes: cap,
            created_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as i64)
                .unwrap_or(0),
        };
        let tmp = dir.join(".meta.json.tmp");
        std::fs::write(&tmp, serde_json::to_vec(&meta).unwrap_or_default())
            .map_err(io_err("write meta.json"))?;
        std::fs::rename(&tmp, dir.join("meta.json")).map_err(io_err("write meta.json"))?;
        Ok(())
    }

    /// Names of every volume.
    pub fn names(&self) -> Result<Vec<String>, VolumeError> {
        let mut out = Vec::new();
        let rd = std::fs::read_dir(&self.root).map_err(|source| VolumeError::Io {
            name: String::new(),
            what: "list volumes".into(),
            source,
        })?;
        for e in rd.flatten() {
            if let Some(n) = e.file_name().to_str() {
                if check_name(n).is_ok() && e.path().join("meta.json").is_file() {
                    out.push(n.to_string());
                }
            }
        }
        out.sort();
        Ok(out)
    }

    /// Volume `name`'s description; `alive` says whether a sandbox id has not ended.
    pub fn info(
        &self,
        name: &str,
        alive: &dyn Fn(&str) -> bool,
    ) -> Result<VolumeInfo, VolumeError> {
        let m = self.meta(name)?;
        let v = self.vol(name)?;
        Ok(VolumeInfo {
            name: m.name,
            cap_bytes: m.cap_bytes,
            used_bytes: v.used(),
            created_at: rfc3339(m.created_ms),
            mounted_by: self.mounted_by(name, alive),
        })
    }

    /// The sandboxes (not ended) that mount `name`; forgets the ended ones.
    pub fn mounted_by(&self, name: &str, alive: &dyn Fn(&str) -> bool) -> Vec<String> {
        let mut out = Vec::new();
        let mut gone = Vec::new();
        {
            let m = lock(&self.mounts);
            for (id, ms) in m.iter() {
                if ms.iter().any(|x| x.name == name) {
                    if alive(id) {
                        out.push(id.clone());
                    } else {
                        gone.push(id.clone());
                    }
                }
            }
        }
        for id in gone {
            self.forget(&id);
        }
        out.sort();
        out
    }

    /// Deletes volume `name` and its files; refused while mounted unless `force`.
    pub fn delete(
        &self,
        name: &str,
        force: bool,
        alive: &dyn Fn(&str) -> bool,
    ) -> Result<(), VolumeError> {
        self.meta(name)?;
        let users = self.mounted_by(name, alive);
        if !users.is_empty() && !force {
            return Err(VolumeError::InUse {
                name: name.to_string(),
                sandboxes: users,
            });
        }
        lock(&self.open).remove(name);
        // Renamed away first: the name is free at once, and a crash mid-delete leaves no volume.
        let dir = self.dir(name);
        let trash = self
            .root
            .join(format!(".deleted-{name}-{}", crate::paths::random_id()));
        std::fs::rename(&dir, &trash).map_err(|source| VolumeError::Io {
            name: name.into(),
            what: "delete".into(),
            source,
        })?;
        let _ = std::fs::remove_dir_all(&trash);
        Ok(())
    }

    /// Checks and records sandbox `id`'s mounts (before its VM starts).
    pub fn register(&self, id: &str, mounts: &[VolumeMount]) -> Result<(), VolumeError> {
        if mounts.is_empty() {
            return Ok(());
        }
        if mounts.len() > 16 {
            return Err(VolumeError::Invalid("at most 16 volume mounts".into()));
        }
        let mut paths = std::collections::BTreeSet::new();
        for m in mounts {
            self.meta(&m.name)?;
            if !m.path.starts_with('/')
                || m.path == "/"
                || m.path.contains('\0')
                || m.path.contains(':')
                || m.path.split('/').any(|c| c == ".." || c == ".")
            {
                return Err(VolumeError::Invalid(format!(
                    "volume mount path {:?}: an absolute guest path other than / (no '.', '..' or ':')",
                    m.path
                )));
            }
            if !paths.insert(m.path.trim_end_matches('/')) {
                return Err(VolumeError::Invalid(format!(
                    "two volumes mounted at {:?}",
                    m.path
                )));
            }
        }
        let file = self.root.join(".mounts").join(format!("{id}.json"));
        std::fs::write(&file, serde_json::to_vec(mounts).unwrap_or_default()).map_err(
            |source| VolumeError::Io {
                name: mounts[0].name.clone(),
                what: "record mounts".into(),
                source,
            },
        )?;
        lock(&self.mounts).insert(id.to_string(), mounts.to_vec());
        Ok(())
    }

    /// Sandbox `id`'s mounts.
    pub fn mounts_of(&self, id: &str) -> Vec<VolumeMount> {
        lock(&self.mounts).get(id).cloned().unwrap_or_default()
    }

    /// Forgets sandbox `id` (it ended): its mounts and its listener.
    pub fn forget(&self, id: &str) {
        lock(&self.mounts).remove(id);
        let _ = std::fs::remove_file(self.root.join(".mounts").join(format!("{id}.json")));
        if let Some(stop) = lock(&self.listeners).remove(id) {
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Serves sandbox `id`'s mounts to its (new) VMM, whose vsock socket is `uds`.
    pub fn attach(self: &Arc<Self>, id: &str, uds: &Path) -> io::Result<()> {
        if self.mounts_of(id).is_empty() {
            return Ok(());
        }
        let stop = server::listen(self.clone(), id.to_string(), uds)?;
        if let Some(old) = lock(&self.listeners).insert(id.to_string(), stop) {
            old.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }
}

/// `ms` since the epoch as RFC 3339.
pub fn rfc3339(ms: i64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_millis(t).to_string()
}

/// What an I/O error in volume `name` at `path` means to a caller.
pub fn path_error(name: &str, path: &str, e: io::Error) -> VolumeError {
    match e.raw_os_error() {
        Some(libc::ENOENT) => VolumeError::NoSuchPath {
            name: name.into(),
            path: path.into(),
        },
        Some(libc::ENOSPC) => VolumeError::Full {
            name: name.into(),
            cap_bytes: 0,
        },
        Some(libc::ELOOP) | Some(libc::EXDEV) => VolumeError::Invalid(format!(
            "path {path:?} refused: it leaves the volume or crosses a symlink"
        )),
        Some(libc::EEXIST) => VolumeError::Invalid(format!("{path:?} exists")),
        Some(libc::ENOTEMPTY) => {
            VolumeError::Invalid(format!("{path:?} is a directory that is not empty"))
        }
        Some(libc::EISDIR) => VolumeError::Invalid(format!("{path:?} is a directory")),
        Some(libc::ENOTDIR) => VolumeError::Invalid(format!("{path:?}: not a directory")),
        Some(libc::EBUSY) => VolumeError::Invalid("the volume's root cannot be changed".into()),
        _ if e.kind() == io::ErrorKind::InvalidInput => {
            VolumeError::Invalid(format!("path {path:?} refused: {e}"))
        }
        _ => VolumeError::Io {
            name: name.into(),
            what: format!("{path:?}"),
            source: e,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_paths_are_checked() {
        assert!(check_name("data-1").is_ok());
        for bad in ["", "A", "-x", ".x", "a/b", &"a".repeat(64)] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
        assert_eq!(api_path("/a/b/").unwrap(), "a/b");
        assert_eq!(api_path("/").unwrap(), "");
        assert!(api_path("/../etc").is_err());
        assert!(api_path("a/../../b").is_err());
    }

    #[test]
    fn create_list_delete_and_in_use() {
        let home = tempfile::tempdir().unwrap();
        let v = Volumes::new(home.path()).unwrap();
        v.create("one", Some(100)).unwrap();
        assert!(matches!(v.create("one", None), Err(VolumeError::Exists(_))));
        assert_eq!(v.names().unwrap(), ["one"]);
        let m = VolumeMount::parse("one:/mnt/one:ro").unwrap();
        assert!(m.read_only);
        v.register("sb1", &[m]).unwrap();
        let alive = |_: &str| true;
        assert!(matches!(
            v.delete("one", false, &alive),
            Err(VolumeError::InUse { .. })
        ));
        // Reloaded from disk, the mount is still known.
        let v2 = Volumes::new(home.path()).unwrap();
        assert_eq!(v2.mounts_of("sb1").len(), 1);
        let dead = |_: &str| false;
        v.delete("one", false, &dead).unwrap();
        assert!(v.names().unwrap().is_empty());
        assert!(matches!(
            v.register("sb2", &[VolumeMount::parse("nope:/x").unwrap()]),
            Err(VolumeError::NotFound(_))
        ));
    }
}
