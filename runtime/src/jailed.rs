//! One sandbox VM in its jail: starting a jailed restore, finding it again after a server
//! restart, stopping it and releasing everything it held (process, jail directory and
//! mounts, cgroup), and the watcher that learns of every VMM exit at once through pidfds.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ember_jailer::{CgroupLimits, CleanupConfig, JailConfig};

use super::config::RuntimeConfig;
use super::error::RuntimeError;
use crate::jail::{self, JailOptions, SnapshotDisk};
use crate::sandbox::{AdoptPaths, LaunchSpec};
use crate::Sandbox;

/// Name of the file, in snapshot directories the runtime writes, that records the host
/// paths of the disks (a jailed VMM's snapshot holds in-jail paths).
pub const DISKS_FILE: &str = "ember-disks.json";

/// A running VM and its jail.
#[derive(Debug)]
pub struct Live {
    /// The handle (agent connections, the VMM process).
    pub sandbox: Sandbox,
    /// The jail it runs in.
    pub jail: JailConfig,
    /// Its disks with host paths (what a snapshot of it records in [`DISKS_FILE`]).
    pub disks: Vec<SnapshotDisk>,
    /// Its network namespace, when its snapshot has a network device.
    pub net: Option<Arc<crate::netpolicy::SandboxNet>>,
    /// It came from the warm pool (a VMM started ahead, told to restore at create).
    pub pooled: bool,
}

impl Live {
    /// The host path of `path_in_jail`.
    pub fn host_path(&self, path_in_jail: &str) -> PathBuf {
        self.jail.host_path(Path::new(path_in_jail))
    }
}

/// Resolved binaries.
#[derive(Debug, Clone)]
pub struct Binaries {
    /// ember-vmm.
    pub vmm: PathBuf,
    /// ember-jailer.
    pub jailer: PathBuf,
    /// `vmm` is the runtime's shared copy: jails hard-link it.
    pub vmm_link: bool,
}

impl Binaries {
    /// Finds the binaries (config, environment, beside the VMM).
    pub fn find(cfg: &RuntimeConfig) -> Result<Binaries, RuntimeError> {
        let vmm = match &cfg.vmm {
            Some(v) => v.clone(),
            None => ember_vmm::launcher::find_vmm_binary()
                .map_err(|e| RuntimeError::Internal(e.to_string()))?,
        };
        let jailer = match (&cfg.jailer, std::env::var_os("EMBER_JAILER")) {
            (Some(j), _) => j.clone(),
            (None, Some(j)) => PathBuf::from(j),
            (None, None) => vmm.with_file_name("ember-jailer"),
        };
        if !jailer.is_file() {
            return Err(RuntimeError::Internal(format!(
                "cannot find ember-jailer at {} (build it with `cargo build --release`, or set \
                 EMBER_JAILER)",
                jailer.display()
            )));
        }
        let mut bins = Binaries {
            vmm,
            jailer,
            vmm_link: false,
        };
        if cfg.share_vmm_binary {
            bins.vmm = shared_vmm_copy(&cfg.home.join("bin"), &bins.vmm)?;
            bins.vmm_link = true;
        }
        Ok(bins)
    }
}

/// A root-owned, read-only copy of `vmm` in `dir`, named by its content hash
/// (`ember-vmm-<16 hex>`), made once and then reused: the file jails hard-link.
fn shared_vmm_copy(dir: &Path, vmm: &Path) -> Result<PathBuf, RuntimeError> {
    use sha2::Digest;
    use std::os::unix::fs::PermissionsExt;
    let bytes = std::fs::read(vmm).map_err(RuntimeError::io("cannot read", vmm))?;
    let hash = sha2::Sha256::digest(&bytes);
    let name: String = hash[..8].iter().map(|b| format!("{b:02x}")).collect();
    let dest = dir.join(format!("ember-vmm-{name}"));
    if let Ok(m) = std::fs::metadata(&dest) {
        use std::os::unix::fs::MetadataExt;
        if m.is_file() && m.len() == bytes.len() as u64 && m.mode() & 0o7777 == 0o555 {
            return Ok(dest);
        }
    }
    std::fs::create_dir_all(dir).map_err(RuntimeError::io("cannot create", dir))?;
    let tmp = dir.join(format!(".ember-vmm-{name}.{}", std::process::id()));
    std::fs::write(&tmp, &bytes).map_err(RuntimeError::io("cannot write", &tmp))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o555))
        .map_err(RuntimeError::io("cannot set the mode of", &tmp))?;
    std::fs::rename(&tmp, &dest).map_err(RuntimeError::io("cannot rename into", &dest))?;
    // Older copies are left to jails that may still link them; they are small and few.
    Ok(dest)
}

/// What a jailed start needs.
#[derive(Debug)]
pub struct StartSpec<'a> {
    /// Sandbox id.
    pub id: &'a str,
    /// Jail id (unique per start).
    pub jail_id: &'a str,
    /// Host uid/gid.
    pub uid: u32,
    /// The snapshot to restore.
    pub snapshot: &'a Path,
    /// Its disks with host paths.
    pub disks: &'a [SnapshotDisk],
    /// Cgroup limits.
    pub limits: CgroupLimits,
    /// The network namespace to run in.
    pub net: Option<Arc<crate::netpolicy::SandboxNet>>,
    /// The idle agent connection the snapshot kept, to take over.
    pub kept: Option<crate::agent_link::KeptConnection>,
    /// Boot this VM (host paths) instead of restoring `snapshot`: a sandbox resumed from its
    /// disk alone (`lifecycle::boot`). The guest then has `connect_timeout` to boot to its
    /// agent.
    pub boot: Option<(&'a ember_vmm::vm::VmConfig, std::time::Duration)>,
}

/// Reads the disks of a snapshot: from [`DISKS_FILE`] when the runtime wrote one, else from
/// the snapshot's state (a template's snapshot, taken on the host).
pub fn snapshot_disks(dir: &Path) -> Result<Vec<SnapshotDisk>, RuntimeError> {
    let f = dir.join(DISKS_FILE);
    if f.is_file() {
        let text = std::fs::read_to_string(&f).map_err(RuntimeError::io("cannot read", &f))?;
        let list: Vec<(Option<PathBuf>, Option<PathBuf>, bool)> = serde_json::from_str(&text)
            .map_err(|e| RuntimeError::Internal(format!("{}: {e}", f.display())))?;
        return Ok(list
            .into_iter()
            .map(|(base, path, writable)| match (base, path) {
                (Some(base), _) => SnapshotDisk::Overlay { base },
                (None, p) => SnapshotDisk::Raw {
                    path: p.unwrap_or_default(),
                    writable,
                },
            })
            .collect());
    }
    jail::snapshot_disks(dir).map_err(|e| RuntimeError::Internal(e.to_string()))
}

/// Writes [`DISKS_FILE`] into a snapshot directory.
pub fn write_disks(dir: &Path, disks: &[SnapshotDisk]) -> Result<(), RuntimeError> {
    let list: Vec<(Option<&PathBuf>, Option<&PathBuf>, bool)> = disks
        .iter()
        .map(|d| match d {
            SnapshotDisk::Overlay { base } => (Some(base), None, false),
            SnapshotDisk::Raw { path, writable } => (None, Some(path), *writable),
        })
        .collect();
    let f = dir.join(DISKS_FILE);
    let text = serde_json::to_vec(&list).map_err(|e| RuntimeError::Internal(e.to_string()))?;
    std::fs::write(&f, text).map_err(RuntimeError::io("cannot write", &f))
}

/// The VMM's arguments every jailed sandbox gets (control socket, report, console and log
/// files in `/work`, each capped at `log_max_bytes`).
pub(crate) fn vmm_args(cfg: &RuntimeConfig) -> Vec<String> {
    let max = cfg.log_max_bytes.to_string();
    [
        "--api-sock",
        "/work/api.sock",
        "--report",
        "/work/report.jsonl",
        "--serial",
        "file:/work/console.log",
        "--serial-max-bytes",
        &max,
        "--log-file",
        "/work/vmm.log",
        "--log-max-bytes",
        &max,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

pub(crate) fn jail_options(
    cfg: &RuntimeConfig,
    bins: &Binaries,
    uid: u32,
    limits: CgroupLimits,
) -> JailOptions {
    JailOptions {
        jailer: bins.jailer.clone(),
        uid,
        gid: uid,
        chroot_base: cfg.jails_dir(),
        limits,
        new_pid_ns: false,
        exec_link: bins.vmm_link,
    }
}

/// A jail configuration as the runtime builds it, for clean-up of a jail it only knows by
/// id (after a restart).
pub fn jail_config_for(cfg: &RuntimeConfig, bins: &Binaries, jail_id: &str) -> JailConfig {
    let mut j = JailConfig::new(jail_id, &bins.vmm, 1, 1, cfg.jails_dir());
    j.cgroup_parent = cfg.cgroup_parent();
    j
}

/// Restores `spec.snapshot` into a fresh jail and waits for the guest to be synced.
pub fn start(
    cfg: &RuntimeConfig,
    bins: &Binaries,
    spec: &StartSpec<'_>,
) -> Result<Live, RuntimeError> {
    let state = cfg.sandbox_dir(spec.id);
    let empty = state.join("jail-work");
    std::fs::create_dir_all(&empty).map_err(RuntimeError::io("cannot create", &empty))?;
    let opts = jail_options(cfg, bins, spec.uid, spec.limits.clone());
    let extra = vmm_args(cfg);
    let launched = match spec.boot {
        Some((vm, _)) => jail::boot(&opts, spec.jail_id, &bins.vmm, vm, &empty, &extra),
        None => jail::restore(
            &opts,
            spec.jail_id,
            &bins.vmm,
            spec.snapshot,
            spec.disks,
            &empty,
            &extra,
        ),
    };
    let mut launch = launched.map_err(|e| RuntimeError::Internal(e.to_string()))?;
    launch.config.cgroup_parent = cfg.cgroup_parent();
    launch.config.netns = spec.net.as_ref().map(|n| n.path.clone());
    let mut command = Command::new(&bins.jailer);
    command.args(launch.config.to_args());
    let log = state.join("launch.log");
    let ls = LaunchSpec {
        command,
        dir: launch.config.host_path(Path::new("/work")),
        uds: launch.config.host_path(Path::new("/work/vsock")),
        api: launch.api_sock_host.clone(),
        log,
        die_with_parent: false,
        kept: spec.kept,
    };
    let connect_timeout = spec.boot.map_or(cfg.connect_timeout, |(_, t)| t);
    match Sandbox::launch(spec.id.to_string(), ls, connect_timeout) {
        Ok(sandbox) => Ok(Live {
            sandbox,
            jail: launch.config,
            disks: spec.disks.to_vec(),
            net: spec.net.clone(),
            pooled: false,
        }),
        Err(e) => {
            // Sandbox::launch killed what it started; the jail remains.
            let _ = release_jail(&launch.config);
            let detail =
                std::fs::read_to_string(launch.config.host_path(Path::new("/work/vmm.log")))
                    .ok()
                    .and_then(|t| {
                        t.lines()
                            .rev()
                            .find(|l| !l.trim().is_empty())
                            .map(str::to_owned)
                    });
            Err(RuntimeError::Internal(match detail {
                Some(d) => format!("{e} (VMM log: {d})"),
                None => e.to_string(),
            }))
        }
    }
}

/// Re-attaches a VMM that runs in jail `jail_id` as `pid` (after a server restart). Checks
/// that the pid is really in that jail's cgroup (pids are recycled).
pub fn adopt(
    cfg: &RuntimeConfig,
    bins: &Binaries,
    id: &str,
    jail_id: &str,
    pid: u32,
    source: &Path,
) -> Result<Live, RuntimeError> {
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    if !cgroup.contains(&format!("/{jail_id}")) {
        return Err(RuntimeError::Internal(format!(
            "the VMM (pid {pid}) of sandbox {id} is gone"
        )));
    }
    let jail = jail_config_for(cfg, bins, jail_id);
    let paths = AdoptPaths {
        dir: jail.host_path(Path::new("/work")),
        uds: jail.host_path(Path::new("/work/vsock")),
        api: jail.host_path(Path::new("/work/api.sock")),
        log: cfg.sandbox_dir(id).join("launch.log"),
    };
    let sandbox = Sandbox::adopt(id.to_string(), pid as i32, paths)?;
    // The disks it was restored with are those of the snapshot it came from.
    let disks = snapshot_disks(source).unwrap_or_default();
    Ok(Live {
        sandbox,
        jail,
        disks,
        net: None,
        pooled: false,
    })
}

fn cgroup_root() -> &'static Path {
    Path::new(ember_jailer::config::DEFAULT_CGROUP_ROOT)
}

/// The cgroup directories of jail `jail_id` (one on v2, one per controller on v1).
pub fn cgroup_dirs(cfg: &RuntimeConfig, jail_id: &str) -> Vec<PathBuf> {
    ember_jailer::Cgroups::existing(cgroup_root(), &cfg.cgroup_parent(), jail_id)
        .map(|c| c.leaves().iter().map(|l| l.path.clone()).collect())
        .unwrap_or_default()
}

/// The runtime's parent cgroup directories (`<root>/<parent>` on v2, and
/// `<root>/<controller>/<parent>` on v1).
pub fn cgroup_parents(cfg: &RuntimeConfig) -> Vec<PathBuf> {
    let parent = cfg.cgroup_parent();
    let mut out = vec![cgroup_root().join(&parent)];
    if let Ok(entries) = std::fs::read_dir(cgroup_root()) {
        for e in entries.flatten() {
            out.push(e.path().join(&parent));
        }
    }
    out.retain(|p| p.is_dir());
    out
}

/// Ids of the jails that have a cgroup under the runtime's parent.
pub fn cgroup_jail_ids(cfg: &RuntimeConfig) -> std::collections::BTreeSet<String> {
    let mut ids = std::collections::BTreeSet::new();
    for parent in cgroup_parents(cfg) {
        if let Ok(entries) = std::fs::read_dir(parent) {
            for e in entries.flatten() {
                if e.path().is_dir() {
                    ids.insert(e.file_name().to_string_lossy().into_owned());
                }
            }
        }
    }
    ids
}

/// Kills every process left in a jail's cgroups.
pub fn kill_cgroup(cfg: &RuntimeConfig, jail_id: &str) {
    for dir in cgroup_dirs(cfg, jail_id) {
        if std::fs::write(dir.join("cgroup.kill"), "1").is_ok() {
            continue;
        }
        // cgroup v1 (no cgroup.kill): signal each process.
        if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) {
            for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                // SAFETY: kill(2) with a pid read from the jail's own cgroup and SIGKILL.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
}

/// Removes the runtime's (empty) parent cgroups, e.g. when a test runtime goes away.
pub fn remove_cgroup_parents(cfg: &RuntimeConfig) {
    for p in cgroup_parents(cfg) {
        let _ = std::fs::remove_dir(p);
    }
}

/// Removes a jail (its directory, mounts, cgroup). Returns the OOM kills its memory cgroup
/// recorded.
pub fn release_jail(jail: &JailConfig) -> Result<Option<u64>, RuntimeError> {
    let mut last = None;
    // A just-killed VMM may take a moment to leave its cgroup.
    for _ in 0..50 {
        match ember_jailer::cleanup(&CleanupConfig::for_jail(jail)) {
            Ok(report) => return Ok(report.oom_kills),
            Err(e) => {
                last = Some(e.to_string());
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
    Err(RuntimeError::Internal(format!(
        "cannot clean up jail {}: {}",
        jail.id,
        last.unwrap_or_default()
    )))
}

/// The OOM kills a jail's memory cgroup recorded so far.
pub fn oom_kills(jail: &JailConfig) -> u64 {
    ember_jailer::Cgroups::existing(&jail.cgroup_root, &jail.cgroup_parent, &jail.id)
        .ok()
        .and_then(|c| c.oom_kills())
        .unwrap_or(0)
}

/// What the watcher holds per VMM: sandbox id, jail id, a pidfd.
type Watched = HashMap<u64, (String, String, OwnedFd)>;

/// Watches VMM pidfds with one epoll thread and calls back when one becomes readable (the
/// process exited): deaths are seen at once, without polling.
#[derive(Debug)]
pub struct Watcher {
    epoll: OwnedFd,
    watched: Arc<Mutex<Watched>>,
    next: std::sync::atomic::AtomicU64,
}

impl Watcher {
    /// Starts the thread; `on_exit(sandbox id, jail id)` runs on it for each exit.
    pub fn start(
        on_exit: impl Fn(String, String) + Send + 'static,
    ) -> Result<Arc<Watcher>, RuntimeError> {
        // SAFETY: epoll_create1 takes flags and returns a new descriptor or -1.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(RuntimeError::Internal(format!(
                "epoll_create1: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: a descriptor the kernel just returned; nothing else owns it.
        let epoll = unsafe { OwnedFd::from_raw_fd(fd) };
        let w = Arc::new(Watcher {
            epoll,
            watched: Arc::new(Mutex::new(HashMap::new())),
            next: std::sync::atomic::AtomicU64::new(1),
        });
        let weak = Arc::downgrade(&w);
        std::thread::Builder::new()
            .name("ember-watch".into())
            .spawn(move || loop {
                let Some(w) = weak.upgrade() else { return };
                let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 32];
                // SAFETY: `evs` is a valid buffer of 32 events for the duration of the call.
                let n = unsafe {
                    libc::epoll_wait(w.epoll.as_raw_fd(), evs.as_mut_ptr(), evs.len() as i32, 500)
                };
                let mut exits = Vec::new();
                if n > 0 {
                    let mut map = match w.watched.lock() {
                        Ok(m) => m,
                        Err(_) => return,
                    };
                    for ev in &evs[..n as usize] {
                        let token = ev.u64;
                        if let Some((id, jail, fd)) = map.remove(&token) {
                            // SAFETY: removing a registered descriptor from our epoll set.
                            unsafe {
                                libc::epoll_ctl(
                                    w.epoll.as_raw_fd(),
                                    libc::EPOLL_CTL_DEL,
                                    fd.as_raw_fd(),
                                    std::ptr::null_mut(),
                                )
                            };
                            exits.push((id, jail));
                        }
                    }
                }
                drop(w);
                for (id, jail) in exits {
                    on_exit(id, jail);
                }
            })
            .map_err(|e| RuntimeError::Internal(format!("cannot start the watcher: {e}")))?;
        Ok(w)
    }

    /// Watches `sandbox`'s VMM.
    pub fn watch(&self, id: &str, jail_id: &str, sandbox: &Sandbox) -> Result<(), RuntimeError> {
        let Some(pidfd) = sandbox.pidfd() else {
            return Err(RuntimeError::Internal(format!(
                "sandbox {id}: no pidfd for its VMM"
            )));
        };
        let fd = pidfd
            .try_clone_to_owned()
            .map_err(|e| RuntimeError::Internal(format!("dup pidfd: {e}")))?;
        let token = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: token,
        };
        let mut map = self
            .watched
            .lock()
            .map_err(|_| RuntimeError::Internal("watcher poisoned".into()))?;
        // SAFETY: adds a descriptor we own (kept in `watched` while registered) to our epoll.
        let r = unsafe {
            libc::epoll_ctl(
                self.epoll.as_raw_fd(),
                libc::EPOLL_CTL_ADD,
                fd.as_raw_fd(),
                &mut ev,
            )
        };
        if r != 0 {
            return Err(RuntimeError::Internal(format!(
                "epoll_ctl: {}",
                std::io::Error::last_os_error()
            )));
        }
        map.insert(token, (id.to_string(), jail_id.to_string(), fd));
        Ok(())
    }
}
