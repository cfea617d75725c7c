//! The jail's mount namespace: private propagation, bind mounts,
//! `pivot_root` into the jail root, and an optional pid-only `/proc`.

use std::ffi::CStr;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use crate::sys;

/// Where the old root is parked during `pivot_root` (removed right after).
pub const OLD_ROOT: &str = "/old_root";

/// A failure while building the jail's mount namespace.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    /// `unshare(CLONE_NEWNS)` failed.
    #[error("cannot create a mount namespace: {0}")]
    Unshare(#[source] io::Error),
    /// Making `/` recursively private failed.
    #[error("cannot make / recursively private: {0}")]
    MakePrivate(#[source] io::Error),
    /// A bind mount failed.
    #[error("cannot bind-mount {src:?} on {target:?}: {source}")]
    Bind {
        /// Source.
        src: PathBuf,
        /// Target.
        target: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// Remounting a bind mount with new flags failed.
    #[error("cannot remount {target:?} ({flags}): {source}")]
    Remount {
        /// Target.
        target: PathBuf,
        /// The flags asked for.
        flags: &'static str,
        /// Why.
        source: io::Error,
    },
    /// A directory step failed.
    #[error("cannot {what} {path:?}: {source}")]
    Dir {
        /// The step (chdir, mkdir, rmdir).
        what: &'static str,
        /// The directory.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// `pivot_root` failed.
    #[error("cannot pivot_root into {root:?}: {source}")]
    PivotRoot {
        /// The new root.
        root: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// Detaching the old root failed.
    #[error("cannot unmount the old root {OLD_ROOT}: {0}")]
    UmountOldRoot(#[source] io::Error),
    /// Mounting `/proc` failed.
    #[error("cannot mount /proc in the jail: {0}")]
    Proc(#[source] io::Error),
    /// Unmounting a leftover mount failed.
    #[error("cannot unmount {path:?}: {source}")]
    Umount {
        /// The mount point.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// Reading the mount table failed.
    #[error("cannot read /proc/self/mountinfo: {0}")]
    MountInfo(#[source] io::Error),
}

/// One bind mount to make: `src` (host) onto `target` (host path inside the
/// jail root, already created).
#[derive(Debug, Clone)]
pub struct BindMount {
    /// Host source.
    pub src: PathBuf,
    /// Host path of the mount point inside the jail root.
    pub target: PathBuf,
    /// Read-only.
    pub read_only: bool,
}

/// Unshares a mount namespace, makes `/` recursively private, bind-mounts
/// `root` onto itself, makes `binds` under it, and `pivot_root`s into it. On
/// return `/` is the jail root, the old root is detached and its directory
/// removed, and the working directory is `/`.
pub fn pivot_into(root: &Path, binds: &[BindMount]) -> Result<(), MountError> {
    sys::unshare(libc::CLONE_NEWNS).map_err(MountError::Unshare)?;
    // Nothing done from here on may propagate back to the host.
    sys::mount(
        None,
        Path::new("/"),
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
    )
    .map_err(MountError::MakePrivate)?;
    // pivot_root needs the new root to be a mount point.
    sys::mount(Some(root), root, None, libc::MS_BIND | libc::MS_REC, None).map_err(|source| {
        MountError::Bind {
            src: root.to_path_buf(),
            target: root.to_path_buf(),
            source,
        }
    })?;
    for b in binds {
        bind(b)?;
    }
    let dir_err = |what, path: &Path| {
        let path = path.to_path_buf();
        move |source| MountError::Dir { what, path, source }
    };
    std::env::set_current_dir(root).map_err(dir_err("chdir to", root))?;
    let old = Path::new(OLD_ROOT.trim_start_matches('/'));
    fs::create_dir(old).map_err(dir_err("create", Path::new(OLD_ROOT)))?;
    sys::pivot_root(Path::new("."), old).map_err(|source| MountError::PivotRoot {
        root: root.to_path_buf(),
        source,
    })?;
    std::env::set_current_dir("/").map_err(dir_err("chdir to", Path::new("/")))?;
    sys::umount2(Path::new(OLD_ROOT), libc::MNT_DETACH).map_err(MountError::UmountOldRoot)?;
    fs::remove_dir(OLD_ROOT).map_err(dir_err("remove", Path::new(OLD_ROOT)))?;
    Ok(())
}

/// A non-recursive bind mount, remounted `nosuid,nodev` (and `ro` if asked).
fn bind(b: &BindMount) -> Result<(), MountError> {
    sys::mount(Some(&b.src), &b.target, None, libc::MS_BIND, None).map_err(|source| {
        MountError::Bind {
            src: b.src.clone(),
            target: b.target.clone(),
            source,
        }
    })?;
    let mut flags = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_NOSUID | libc::MS_NODEV;
    let mut names = "nosuid,nodev";
    if b.read_only {
        flags |= libc::MS_RDONLY;
        names = "ro,nosuid,nodev";
    }
    sys::mount(None, &b.target, None, flags, None).map_err(|source| MountError::Remount {
        target: b.target.clone(),
        flags: names,
        source,
    })
}

/// Mounts a `/proc` that shows only process directories (`subset=pid`) and
/// hides other users' processes (`hidepid=invisible`); `nosuid,nodev,noexec`.
/// Kernels older than 5.8 get `hidepid=2` without the subset.
pub fn mount_proc() -> Result<(), MountError> {
    let target = Path::new("/proc");
    match fs::create_dir(target) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(source) => {
            return Err(MountError::Dir {
                what: "create",
                path: target.to_path_buf(),
                source,
            })
        }
    }
    let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    let fstype: &CStr = c"proc";
    let modern: &CStr = c"hidepid=invisible,subset=pid";
    let legacy: &CStr = c"hidepid=2";
    let src = Path::new("proc");
    match sys::mount(Some(src), target, Some(fstype), flags, Some(modern)) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            sys::mount(Some(src), target, Some(fstype), flags, Some(legacy))
                .map_err(MountError::Proc)
        }
        Err(e) => Err(MountError::Proc(e)),
    }
}

/// Decodes the octal escapes (`\040` etc.) of a mountinfo path field.
fn unescape(field: &str) -> PathBuf {
    use std::os::unix::ffi::OsStringExt;
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b.get(i + 1..i + 4).and_then(|d| {
            if b[i] != b'\\' || !d.iter().all(|c| (b'0'..=b'7').contains(c)) {
                return None;
            }
            let v = d.iter().fold(0u32, |acc, c| acc * 8 + u32::from(c - b'0'));
            u8::try_from(v).ok()
        });
        if let Some(v) = octal {
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

/// Mount points (field 5 of mountinfo) at or below `dir`, in table order.
pub(crate) fn mounts_under(mountinfo: &str, dir: &Path) -> Vec<PathBuf> {
    mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(unescape)
        .filter(|p| p.starts_with(dir))
        .collect()
}

/// Unmounts (lazily, without following symlinks) every mount at or below
/// `dir` in this mount namespace, deepest and newest first. Returns them.
pub fn unmount_all_under(dir: &Path) -> Result<Vec<PathBuf>, MountError> {
    let mut done = Vec::new();
    // Each pass unmounts what is visible; stacked mounts need more passes.
    for _ in 0..16 {
        let info = fs::read_to_string("/proc/self/mountinfo").map_err(MountError::MountInfo)?;
        let mut mounts = mounts_under(&info, dir);
        if mounts.is_empty() {
            break;
        }
        mounts.reverse();
        mounts.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for path in mounts {
            match sys::umount2(&path, libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW) {
                Ok(()) => done.push(path),
                // Already gone with a parent that was detached first.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(source) => return Err(MountError::Umount { path, source }),
            }
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    const INFO: &str = "\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 22 0:26 / /proc rw - proc proc rw
40 22 254:0 /x /srv/jail/vm1/root/data rw - ext4 /dev/vda rw
41 22 254:0 /y /srv/jail/vm1/root/with\\040space rw - ext4 /dev/vda rw
42 22 254:0 /z /srv/jail/vm10/root rw - ext4 /dev/vda rw
43 40 254:0 /w /srv/jail/vm1/root/data/deeper rw - ext4 /dev/vda rw
";

    #[test]
    fn mountinfo_filter() {
        let got = mounts_under(INFO, Path::new("/srv/jail/vm1"));
        assert_eq!(
            got,
            [
                PathBuf::from("/srv/jail/vm1/root/data"),
                PathBuf::from("/srv/jail/vm1/root/with space"),
                PathBuf::from("/srv/jail/vm1/root/data/deeper"),
            ]
        );
        assert!(mounts_under(INFO, Path::new("/nothing")).is_empty());
    }

    #[test]
    fn unescape_octal() {
        assert_eq!(unescape("/a\\040b\\011c"), PathBuf::from("/a b\tc"));
        assert_eq!(unescape("/a\\0"), PathBuf::from("/a\\0"));
        assert_eq!(unescape("/a\\\\"), PathBuf::from("/a\\\\"));
    }

    #[test]
    fn unmount_nothing_is_fine() {
        assert!(unmount_all_under(Path::new("/definitely/not/mounted"))
            .unwrap()
            .is_empty());
    }
}
