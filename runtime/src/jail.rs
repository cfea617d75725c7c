//! Running `ember-vmm` inside `ember-jailer`: the jail's files, the in-jail paths the VMM is
//! given, and clean-up afterwards.
//!
//! Layout inside the jail: `/ember-vmm` (a copy), `/vmlinux` and `/disk0`, `/disk1`, … (hard
//! links or copies for a boot; read-only bind mounts for a restore, unless the disk is
//! writable), `/snapshot` (a read-only bind mount) and `/disk<i>.base` (overlay base images)
//! for restores, and `/work` (owned by the jail's uid) holding `vm.json`, `report.jsonl`,
//! `api.sock`, `vsock` and a restored clone's own overlays.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use ember_jailer::{BindSpec, CgroupLimits, CleanupConfig, FileSpec, JailConfig};
use ember_vmm::vm::{DiskMode, VmConfig};

/// How to jail a VM.
#[derive(Debug, Clone)]
pub struct JailOptions {
    /// The jailer binary.
    pub jailer: PathBuf,
    /// uid the VMM runs as.
    pub uid: u32,
    /// gid the VMM runs as.
    pub gid: u32,
    /// Where jails are built.
    pub chroot_base: PathBuf,
    /// Cgroup limits.
    pub limits: CgroupLimits,
    /// Run the VMM as pid 1 of its own PID namespace.
    pub new_pid_ns: bool,
    /// Hard-link the VMM binary into the jail (it is a shared copy made for it).
    pub exec_link: bool,
}

/// A prepared jailed launch.
#[derive(Debug)]
pub struct JailedLaunch {
    /// The jail's configuration.
    pub config: JailConfig,
    /// Arguments for `ember-jailer` (the VMM's come after `--`, the launcher appends
    /// `--report`).
    pub args: Vec<OsString>,
    /// Where the host reads the VMM's report.
    pub report_host: PathBuf,
    /// The report path as the VMM sees it.
    pub report_in_jail: PathBuf,
    /// The control socket as the host reaches it.
    pub api_sock_host: PathBuf,
}

/// Errors preparing a jail.
#[derive(Debug, thiserror::Error)]
pub enum JailSetupError {
    /// Files in the work directory.
    #[error("{what} {path}: {source}")]
    Io {
        /// What.
        what: &'static str,
        /// Where.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The snapshot's state could not be read.
    #[error("snapshot {0}: {1}")]
    Snapshot(PathBuf, String),
    /// The VMM's shared libraries could not be listed.
    #[error("cannot list the shared libraries of {0}: {1}")]
    Libraries(PathBuf, String),
}

/// The ELF interpreter and shared libraries `binary` needs (empty for a static binary), as
/// the dynamic loader resolves them on this host.
pub fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>, JailSetupError> {
    let out = std::process::Command::new("ldd")
        .arg(binary)
        .output()
        .map_err(|e| JailSetupError::Libraries(binary.to_path_buf(), e.to_string()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if text.contains("not a dynamic executable") || text.contains("statically linked") {
        return Ok(Vec::new());
    }
    let mut libs = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or "/lib64/ld-linux... (0x...)"
        let path = match line.split_once("=>") {
            Some((_, rhs)) => rhs.split_whitespace().next(),
            None => line
                .split_whitespace()
                .next()
                .filter(|p| p.starts_with('/')),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            libs.push(PathBuf::from(p));
        }
    }
    if libs.is_empty() && !out.status.success() {
        return Err(JailSetupError::Libraries(
            binary.to_path_buf(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ));
    }
    Ok(libs)
}

/// [`shared_libraries`], remembered per binary (path, size and modification time): every
/// jailed start needs the list, and running `ldd` costs a process per start.
pub fn shared_libraries_cached(binary: &Path) -> Result<Vec<PathBuf>, JailSetupError> {
    type Key = (PathBuf, u64, Option<std::time::SystemTime>);
    static CACHE: std::sync::Mutex<Vec<(Key, Vec<PathBuf>)>> = std::sync::Mutex::new(Vec::new());
    let meta = std::fs::metadata(binary).ok();
    let key = (
        binary.to_path_buf(),
        meta.as_ref().map_or(0, |m| m.len()),
        meta.and_then(|m| m.modified().ok()),
    );
    if let Some((_, libs)) = CACHE
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .find(|(k, _)| *k == key)
    {
        return Ok(libs.clone());
    }
    let libs = shared_libraries(binary)?;
    let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    cache.retain(|(k, _)| k.0 != key.0);
    cache.push((key, libs.clone()));
    Ok(libs)
}

fn file(src: &Path, dest: &str, writable: bool) -> FileSpec {
    FileSpec {
        src: src.to_path_buf(),
        dest: PathBuf::from(dest),
        writable,
    }
}

fn common(
    opts: &JailOptions,
    id: &str,
    vmm: &Path,
    workdir: &Path,
) -> Result<JailConfig, JailSetupError> {
    let mut cfg = JailConfig::new(id, vmm, opts.uid, opts.gid, &opts.chroot_base);
    cfg.limits = opts.limits.clone();
    cfg.new_pid_ns = opts.new_pid_ns;
    cfg.exec_link = opts.exec_link;
    for lib in shared_libraries_cached(vmm)? {
        let dest = lib.display().to_string();
        cfg.files.push(file(&lib, &dest, false));
    }
    cfg.files.push(file(workdir, "/work", true));
    Ok(cfg)
}

fn finish(cfg: JailConfig, vmm_args: Vec<String>) -> JailedLaunch {
    let mut cfg = cfg;
    cfg.vmm_args = vmm_args;
    let args = cfg.to_args().into_iter().map(OsString::from).collect();
    JailedLaunch {
        report_host: cfg.host_path(Path::new("/work/report.jsonl")),
        report_in_jail: PathBuf::from("/work/report.jsonl"),
        api_sock_host: cfg.host_path(Path::new("/work/api.sock")),
        config: cfg,
        args,
    }
}

/// A jailed cold boot of `vm`: rewrites its paths to in-jail ones.
pub fn boot(
    opts: &JailOptions,
    id: &str,
    vmm: &Path,
    vm: &VmConfig,
    workdir: &Path,
    extra_vmm_args: &[String],
) -> Result<JailedLaunch, JailSetupError> {
    let mut cfg = common(opts, id, vmm, workdir)?;
    let mut inner = vm.clone();
    cfg.files.push(file(&vm.kernel, "/vmlinux", false));
    inner.kernel = PathBuf::from("/vmlinux");
    for (i, d) in inner.disks.iter_mut().enumerate() {
        let dest = format!("/disk{i}");
        // An overlay is the VM's own writable layer; its base is shared and read-only.
        let writable = matches!(d.mode, DiskMode::ReadWrite | DiskMode::Overlay { .. });
        cfg.files.push(file(&d.path, &dest, writable));
        d.path = PathBuf::from(dest);
        if let DiskMode::Overlay { base } = &mut d.mode {
            // Bound, not placed: a base on another file system would be copied whole.
            let dest = PathBuf::from(format!("/disk{i}.base"));
            cfg.binds.push(BindSpec {
                src: base.clone(),
                dest: dest.clone(),
                read_only: true,
            });
            *base = dest;
        }
    }
    let json = serde_json::to_vec_pretty(&inner).map_err(|e| JailSetupError::Io {
        what: "cannot encode",
        path: workdir.join("vm.json"),
        source: std::io::Error::other(e),
    })?;
    let vm_json = workdir.join("vm.json");
    std::fs::write(&vm_json, json).map_err(|source| JailSetupError::Io {
        what: "cannot write",
        path: vm_json,
        source,
    })?;
    let mut args = vec!["--config".to_string(), "/work/vm.json".to_string()];
    args.extend(extra_vmm_args.iter().cloned());
    Ok(finish(cfg, args))
}

/// The host paths a snapshot's disks refer to, in order: what a jailed restore must make
/// visible inside the jail (the snapshot holds host paths of the machine that took it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SnapshotDisk {
    /// A copy-on-write overlay over this shared base image (the overlay itself is in the
    /// snapshot directory; each restore gets its own copy).
    Overlay {
        /// The base image.
        base: PathBuf,
    },
    /// A raw image used in place.
    Raw {
        /// The image.
        path: PathBuf,
        /// Whether the guest may write it.
        writable: bool,
    },
}

/// Reads the disks of the snapshot in `snapshot` (its state file is checked as for a
/// restore).
pub fn snapshot_disks(snapshot: &Path) -> Result<Vec<SnapshotDisk>, JailSetupError> {
    let state =
        ember_vmm::persist::load_state(snapshot, &ember_vmm::persist::RestoreOptions::default())
            .map_err(|e| JailSetupError::Snapshot(snapshot.to_path_buf(), e.to_string()))?;
    Ok(state
        .config
        .disks
        .iter()
        .map(|d| match &d.mode {
            DiskMode::Overlay { base } => SnapshotDisk::Overlay { base: base.clone() },
            mode => SnapshotDisk::Raw {
                path: d.path.clone(),
                writable: *mode == DiskMode::ReadWrite,
            },
        })
        .collect())
}

/// Whether the snapshot in `snapshot` has network devices (its VM then needs a namespace
/// holding their TAPs).
pub fn snapshot_has_net(snapshot: &Path) -> Result<bool, JailSetupError> {
    let state =
        ember_vmm::persist::load_state(snapshot, &ember_vmm::persist::RestoreOptions::default())
            .map_err(|e| JailSetupError::Snapshot(snapshot.to_path_buf(), e.to_string()))?;
    Ok(!state.config.net.is_empty())
}

/// A jailed restore of the snapshot in `snapshot` whose disks are `disks`
/// ([`snapshot_disks`]). The snapshot directory is bind-mounted read-only at `/snapshot`;
/// every path the snapshot holds is re-mapped into the jail: an overlay disk's base image is
/// bind-mounted read-only at `/disk<i>.base` and the clone's own overlay is
/// `/work/disk<i>.overlay` (the VMM creates it from the snapshot's copy); a raw disk is
/// bind-mounted at `/disk<i>`; the vsock socket is `/work/vsock`.
pub fn restore(
    opts: &JailOptions,
    id: &str,
    vmm: &Path,
    snapshot: &Path,
    disks: &[SnapshotDisk],
    workdir: &Path,
    extra_vmm_args: &[String],
) -> Result<JailedLaunch, JailSetupError> {
    let (cfg, req) = restore_jail(opts, id, vmm, snapshot, disks, workdir)?;
    let mut args = vec![
        "--restore".to_string(),
        req.dir.display().to_string(),
        "--vsock-uds".to_string(),
        "/work/vsock".to_string(),
    ];
    let keep = |p: &Option<PathBuf>| {
        p.as_ref()
            .map_or("-".to_string(), |p| p.display().to_string())
    };
    for (path, base) in req.disk_paths.iter().zip(&req.disk_bases) {
        args.extend([
            "--disk-path".to_string(),
            keep(path),
            "--disk-base".to_string(),
            keep(base),
        ]);
    }
    args.extend(extra_vmm_args.iter().cloned());
    Ok(finish(cfg, args))
}

/// A jailed VMM that waits for its restore (`ember-vmm --wait-restore`, a warm-pool VMM):
/// the jail is that of [`restore`]; the request to send it when it is claimed comes back with
/// the launch. `extra_vmm_args` must include `--api-sock` (where it waits).
pub fn restore_waiting(
    opts: &JailOptions,
    id: &str,
    vmm: &Path,
    snapshot: &Path,
    disks: &[SnapshotDisk],
    workdir: &Path,
    extra_vmm_args: &[String],
) -> Result<(JailedLaunch, ember_vmm::pooled::RestoreRequest), JailSetupError> {
    let (cfg, req) = restore_jail(opts, id, vmm, snapshot, disks, workdir)?;
    let mut args = vec!["--wait-restore".to_string()];
    args.extend(extra_vmm_args.iter().cloned());
    Ok((finish(cfg, args), req))
}

/// The jail of a restore and the in-jail paths the VMM restores with.
fn restore_jail(
    opts: &JailOptions,
    id: &str,
    vmm: &Path,
    snapshot: &Path,
    disks: &[SnapshotDisk],
    workdir: &Path,
) -> Result<(JailConfig, ember_vmm::pooled::RestoreRequest), JailSetupError> {
    let mut cfg = common(opts, id, vmm, workdir)?;
    // A restored VMM reads its own /proc/self/pagemap for layered (pause) snapshots: the
    // pages it wrote are its private copies of the snapshot's memory (vmm/src/layer.rs).
    cfg.mount_proc = true;
    cfg.binds.push(BindSpec {
        src: snapshot.to_path_buf(),
        dest: PathBuf::from("/snapshot"),
        read_only: true,
    });
    let mut req = ember_vmm::pooled::RestoreRequest {
        dir: PathBuf::from("/snapshot"),
        vsock_uds: Some(PathBuf::from("/work/vsock")),
        ..Default::default()
    };
    for (i, d) in disks.iter().enumerate() {
        match d {
            SnapshotDisk::Overlay { base } => {
                let dest = format!("/disk{i}.base");
                cfg.binds.push(BindSpec {
                    src: base.clone(),
                    dest: PathBuf::from(&dest),
                    read_only: true,
                });
                req.disk_paths
                    .push(Some(PathBuf::from(format!("/work/disk{i}.overlay"))));
                req.disk_bases.push(Some(PathBuf::from(dest)));
            }
            SnapshotDisk::Raw { path, writable } => {
                let dest = format!("/disk{i}");
                cfg.binds.push(BindSpec {
                    src: path.clone(),
                    dest: PathBuf::from(&dest),
                    read_only: !writable,
                });
                req.disk_paths.push(Some(PathBuf::from(dest)));
                req.disk_bases.push(None);
            }
        }
    }
    Ok((cfg, req))
}

/// Removes a jail after its VMM exited.
pub fn cleanup(cfg: &JailConfig) -> Result<(), String> {
    ember_jailer::cleanup(&CleanupConfig::for_jail(cfg))
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// A fresh jail id.
pub fn new_id() -> String {
    let mut b = [0u8; 6];
    // SAFETY: getrandom writes at most `b.len()` bytes into `b`.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    let r: u64 = if n == b.len() as isize {
        b.iter().fold(0, |a, x| (a << 8) | u64::from(*x))
    } else {
        u64::from(std::process::id()) << 16
    };
    format!("vm-{r:012x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_the_loader_and_libc_of_a_dynamic_binary() {
        let libs = shared_libraries(Path::new("/bin/sh")).unwrap();
        assert!(
            libs.iter().any(|p| p.to_string_lossy().contains("libc.so")),
            "{libs:?}"
        );
        assert!(
            libs.iter()
                .any(|p| p.to_string_lossy().contains("ld-linux")),
            "{libs:?}"
        );
    }

    #[test]
    fn boot_rewrites_paths_into_the_jail() {
        let work = tempfile::tempdir().unwrap();
        let opts = JailOptions {
            jailer: "/usr/bin/true".into(),
            uid: 10000,
            gid: 10000,
            chroot_base: "/srv/jail".into(),
            limits: CgroupLimits::default(),
            new_pid_ns: false,
            exec_link: false,
        };
        let mut vm = VmConfig::new("/k/vmlinux".into());
        vm.disks.push(ember_vmm::vm::DiskConfig {
            path: "/images/root.ext4".into(),
            mode: DiskMode::ReadOnly,
            id: "rootfs".into(),
        });
        vm.disks.push(ember_vmm::vm::DiskConfig {
            path: "/state/disk0.overlay".into(),
            mode: DiskMode::Overlay {
                base: "/images/base.ext4".into(),
            },
            id: "data".into(),
        });
        let j = boot(&opts, "vm-1", Path::new("/bin/sh"), &vm, work.path(), &[]).unwrap();
        let inner: VmConfig =
            serde_json::from_slice(&std::fs::read(work.path().join("vm.json")).unwrap()).unwrap();
        assert_eq!(inner.kernel, PathBuf::from("/vmlinux"));
        assert_eq!(inner.disks[0].path, PathBuf::from("/disk0"));
        assert!(j
            .config
            .files
            .iter()
            .any(|f| f.dest == Path::new("/disk0") && !f.writable));
        // An overlay: its own file writable, its base read-only, both at in-jail paths.
        assert_eq!(inner.disks[1].path, PathBuf::from("/disk1"));
        assert_eq!(
            inner.disks[1].mode,
            DiskMode::Overlay {
                base: "/disk1.base".into()
            }
        );
        let f = |dest: &str| {
            j.config
                .files
                .iter()
                .find(|f| f.dest == Path::new(dest))
                .cloned()
        };
        assert!(f("/disk1").unwrap().writable);
        assert_eq!(
            f("/disk1").unwrap().src,
            PathBuf::from("/state/disk0.overlay")
        );
        assert!(j
            .config
            .binds
            .iter()
            .any(|b| b.dest == Path::new("/disk1.base") && b.read_only));
        assert_eq!(
            j.report_host,
            PathBuf::from("/srv/jail/vm-1/root/work/report.jsonl")
        );
        let args: Vec<String> = j
            .args
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let dd = args.iter().position(|a| a == "--").unwrap();
        assert_eq!(&args[dd + 1..], ["--config", "/work/vm.json"]);
        assert!(new_id().starts_with("vm-"));
    }
}
