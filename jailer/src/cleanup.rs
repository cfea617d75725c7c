//! Clean-up after the VMM has exited: unmount anything left under the jail
//! directory, remove it, remove the jail's cgroups. Idempotent.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::cgroup::{CgroupError, Cgroups};
use crate::config::{
    check_abs_path, validate_cgroup_parent, validate_id, ConfigError, JailConfig,
    DEFAULT_CGROUP_PARENT, DEFAULT_CGROUP_ROOT,
};
use crate::mount::{self, MountError};

/// Which jail to clean up.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CleanupConfig {
    /// Jail id.
    pub id: String,
    /// Chroot base the jail was built under.
    pub chroot_base: PathBuf,
    /// Where cgroup hierarchies are mounted.
    pub cgroup_root: PathBuf,
    /// Parent cgroup the jail's cgroups were made under.
    pub cgroup_parent: PathBuf,
}

impl CleanupConfig {
    /// Clean-up for jail `id` under `chroot_base`, default cgroup locations.
    pub fn new(id: impl Into<String>, chroot_base: impl Into<PathBuf>) -> Self {
        Self {
            id: id.into(),
            chroot_base: chroot_base.into(),
            cgroup_root: PathBuf::from(DEFAULT_CGROUP_ROOT),
            cgroup_parent: PathBuf::from(DEFAULT_CGROUP_PARENT),
        }
    }

    /// The clean-up matching a jail configuration.
    pub fn for_jail(cfg: &JailConfig) -> Self {
        Self {
            id: cfg.id.clone(),
            chroot_base: cfg.chroot_base.clone(),
            cgroup_root: cfg.cgroup_root.clone(),
            cgroup_parent: cfg.cgroup_parent.clone(),
        }
    }

    /// `<chroot_base>/<id>`.
    pub fn jail_dir(&self) -> PathBuf {
        self.chroot_base.join(&self.id)
    }

    /// The command line for `ember-jailer` (starting with `cleanup`).
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec![
            "cleanup".to_string(),
            "--id".to_string(),
            self.id.clone(),
            "--chroot-base".to_string(),
            self.chroot_base.to_string_lossy().into_owned(),
        ];
        if self.cgroup_root != Path::new(DEFAULT_CGROUP_ROOT) {
            a.push("--cgroup-root".into());
            a.push(self.cgroup_root.to_string_lossy().into_owned());
        }
        if self.cgroup_parent != Path::new(DEFAULT_CGROUP_PARENT) {
            a.push("--cgroup-parent".into());
            a.push(self.cgroup_parent.to_string_lossy().into_owned());
        }
        a
    }

    /// Checks the id and path shapes.
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate_id(&self.id)?;
        check_abs_path("chroot base", &self.chroot_base)?;
        check_abs_path("cgroup root", &self.cgroup_root)?;
        validate_cgroup_parent(&self.cgroup_parent)
    }
}

/// A clean-up failure.
#[derive(Debug, thiserror::Error)]
pub enum CleanupError {
    /// Bad arguments (exit 2).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The jail's cgroups still hold processes; nothing was removed.
    #[error("jail is still in use: cgroup {path:?} holds processes {pids}; stop the VMM first")]
    StillRunning {
        /// The busy cgroup.
        path: PathBuf,
        /// Its pids.
        pids: String,
    },
    /// Unmounting leftovers failed.
    #[error(transparent)]
    Mount(#[from] MountError),
    /// Something is still mounted under the jail; nothing was deleted.
    #[error("{path:?} is still mounted under the jail; refusing to delete the jail directory")]
    StillMounted {
        /// The mount point.
        path: PathBuf,
    },
    /// Removing the jail directory failed.
    #[error("cannot remove jail directory {path:?}: {source}")]
    RemoveJail {
        /// The directory.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// Removing the cgroups failed.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
}

impl CleanupError {
    /// 2 for usage errors, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            CleanupError::Config(_) => crate::EXIT_USAGE,
            _ => crate::EXIT_SETUP,
        }
    }
}

/// What clean-up did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CleanupReport {
    /// Mount points that were detached.
    pub unmounted: Vec<PathBuf>,
    /// Whether the jail directory existed and was removed.
    pub removed_jail: bool,
    /// Cgroup directories removed.
    pub removed_cgroups: Vec<PathBuf>,
    /// OOM kills recorded by the jail's memory cgroup before removal.
    pub oom_kills: Option<u64>,
}

/// Removes the jail directory (after unmounting anything under it) and the
/// jail's cgroups. Running it again, or for a jail that never existed, is
/// not an error.
pub fn cleanup(cfg: &CleanupConfig) -> Result<CleanupReport, CleanupError> {
    cfg.validate()?;
    let mut report = CleanupReport::default();
    // Refuse (and touch nothing) while the jail still has processes.
    let cgroups = Cgroups::existing(&cfg.cgroup_root, &cfg.cgroup_parent, &cfg.id)?;
    if let Some((path, pids)) = cgroups.busy(std::time::Duration::from_secs(1)) {
        return Err(CleanupError::StillRunning { path, pids });
    }
    let jail = cfg.jail_dir();
    report.unmounted = mount::unmount_all_under(&jail)?;
    // Never recurse into a mount: that would delete host files.
    let info = fs::read_to_string("/proc/self/mountinfo").map_err(MountError::MountInfo)?;
    if let Some(path) = mount::mounts_under(&info, &jail).into_iter().next() {
        return Err(CleanupError::StillMounted { path });
    }
    match fs::remove_dir_all(&jail) {
        Ok(()) => report.removed_jail = true,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(source) => return Err(CleanupError::RemoveJail { path: jail, source }),
    }
    report.oom_kills = cgroups.oom_kills();
    report.removed_cgroups = cgroups.remove()?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_and_validation() {
        let mut c = CleanupConfig::new("vm-1", "/srv/jail");
        assert_eq!(
            c.to_args(),
            ["cleanup", "--id", "vm-1", "--chroot-base", "/srv/jail"]
        );
        c.cgroup_parent = "tenant".into();
        assert_eq!(c.to_args()[5..], ["--cgroup-parent", "tenant"]);
        c.validate().unwrap();
        c.id = "../x".into();
        assert!(c.validate().is_err());
        let c = CleanupConfig::new("a", "rel");
        assert!(matches!(
            c.validate(),
            Err(ConfigError::RelativePath { .. })
        ));
    }

    #[test]
    fn removes_plain_jail_dir_and_is_idempotent() {
        let tmp = tempfile::tempdir().unwrap();
        let mut c = CleanupConfig::new("vm-x", tmp.path());
        // A scratch directory stands in for the cgroup root: no leaves there.
        c.cgroup_root = tmp.path().join("cg");
        fs::create_dir(&c.cgroup_root).unwrap();
        fs::create_dir_all(c.jail_dir().join("root/dev")).unwrap();
        fs::write(c.jail_dir().join("root/ember-vmm"), b"x").unwrap();
        let r = cleanup(&c).unwrap();
        assert!(r.removed_jail);
        assert!(!c.jail_dir().exists());
        let r = cleanup(&c).unwrap();
        assert_eq!(r, CleanupReport::default());
    }
}
