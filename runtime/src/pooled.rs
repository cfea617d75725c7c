//! The runtime's warm pool members: VMMs started with `ember-vmm --wait-restore` inside a
//! full jail (namespaces, `pivot_root`, cgroup with the template's default limits, uid
//! dropped, the `restore` seccomp filter on) and, for templates with a network device, in
//! their own network namespace with policy `none` (which refuses everything until the
//! claiming create applies its own policy). The snapshot's files are bind-mounted into the
//! jail at fill time, so a pool is per template snapshot ([`crate::pool`]).
//!
//! Once the member waits, the filler has it restore the snapshot with its vCPUs held (all the
//! per-clone overrides are in-jail paths known at fill time: `/work/vsock`,
//! `/work/disk<i>.overlay`, the TAP in its own namespace), so a claim only sends `start`
//! ([`ember_vmm::pooled`]) and attaches to it like a fresh launch ([`Sandbox::attach`]): the
//! create path pays neither the process creation, the jail, cgroup and namespace set-up, nor
//! the restore itself.

use std::collections::BTreeSet;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ember_jailer::{CgroupLimits, JailConfig};
use ember_vmm::pooled::{RestoreRequest, WaitRequest};

use super::config::RuntimeConfig;
use super::error::RuntimeError;
use super::jailed::{self, Binaries, Live};
use crate::jail::{self, SnapshotDisk};
use crate::netpolicy::{NetManager, NetworkPolicy, SandboxNet};
use crate::sandbox::{AdoptPaths, AgentClient};
use crate::Sandbox;

/// Prefix of pool members' jail ids (and so of their cgroups and namespaces).
pub const JAIL_PREFIX: &str = "pool";

/// Longest a member may take to come up waiting.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A jailed VMM waiting for its restore.
#[derive(Debug)]
pub struct WarmVmm {
    /// Its jail id.
    pub jail_id: String,
    /// The uid it runs as (reserved for it).
    pub uid: u32,
    /// Its jail.
    pub jail: JailConfig,
    child: Child,
    pidfd: Option<OwnedFd>,
    /// Its network namespace (policy `none` until claimed).
    pub net: Option<Arc<SandboxNet>>,
    /// The snapshot's disks (host paths).
    pub disks: Vec<SnapshotDisk>,
    /// The cgroup limits it was started with.
    pub limits: CgroupLimits,
    /// What to send it.
    pub restore: RestoreRequest,
    /// Its host-side state directory (launcher log).
    state: PathBuf,
    /// When it was ready.
    pub ready_at: Instant,
    /// A primed member's agent connection (synced, its default context has run the priming
    /// cell) and host port: its guest runs already.
    primed: Option<(AgentClient, u32)>,
}

/// The limits a create asks for when it names none of its own: what pool members get.
pub fn default_limits(cfg: &RuntimeConfig, memory_mib: u64) -> CgroupLimits {
    CgroupLimits {
        memory_bytes: Some((memory_mib + cfg.vmm_overhead_mib) << 20),
        cpu_quota_us: cfg.max_cpu_percent.map(|p| u64::from(p) * 1000),
        cpu_period_us: cfg.max_cpu_percent.map(|_| 100_000),
        pids_max: Some(cfg.pids_max),
        ..Default::default()
    }
}

/// Takes a free jail uid from `uids`.
pub(super) fn alloc_uid(cfg: &RuntimeConfig, uids: &Mutex<BTreeSet<u32>>) -> Option<u32> {
    let mut uids = super::lock(uids);
    let uid = (cfg.uid_base..cfg.uid_base + cfg.uid_count).find(|u| !uids.contains(u))?;
    uids.insert(uid);
    Some(uid)
}

/// Starts, checks and releases members for [`crate::pool::Pool`].
#[derive(Debug)]
pub struct VmmFiller {
    pub(super) cfg: RuntimeConfig,
    pub(super) bins: Binaries,
    pub(super) uids: Arc<Mutex<BTreeSet<u32>>>,
    pub(super) net: Arc<NetManager>,
}

impl VmmFiller {
    /// Where pool members' host-side state lives (emptied at open).
    pub fn pool_dir(cfg: &RuntimeConfig) -> PathBuf {
        cfg.home.join("pool")
    }

    fn start(&self, dir: &Path, uid: u32, jail_id: &str) -> Result<WarmVmm, String> {
        let cfg = &self.cfg;
        let state = Self::pool_dir(cfg).join(jail_id);
        let work = state.join("jail-work");
        std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;
        let disks = jailed::snapshot_disks(dir).map_err(|e| e.to_string())?;
        let snap =
            ember_vmm::persist::load_state(dir, &ember_vmm::persist::RestoreOptions::default())
                .map_err(|e| e.to_string())?;
        let limits = default_limits(cfg, snap.config.mem_mib);
        let net = if snap.config.net.is_empty() {
            None
        } else {
            Some(
                self.net
                    .setup(jail_id, uid, &NetworkPolicy::default())
                    .map_err(|e| format!("network namespace: {e}"))?,
            )
        };
        let opts = super::jailed::jail_options(cfg, &self.bins, uid, limits.clone());
        let extra = super::jailed::vmm_args(cfg);
        let built =
            jail::restore_waiting(&opts, jail_id, &self.bins.vmm, dir, &disks, &work, &extra);
        let (mut launch, restore) = match built {
            Ok(x) => x,
            Err(e) => {
                if let Some(n) = &net {
                    self.net.teardown(n);
                }
                return Err(e.to_string());
            }
        };
        launch.config.cgroup_parent = cfg.cgroup_parent();
        launch.config.netns = net.as_ref().map(|n| n.path.clone());
        let log = state.join("launch.log");
        let spawned = std::fs::File::create(&log)
            .map_err(|e| format!("{}: {e}", log.display()))
            .and_then(|stderr| {
                Command::new(&self.bins.jailer)
                    .args(launch.config.to_args())
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(stderr)
                    .spawn()
                    .map_err(|e| format!("cannot start {}: {e}", self.bins.jailer.display()))
            });
        let child = match spawned {
            Ok(c) => c,
            Err(e) => {
                let _ = jailed::release_jail(&launch.config);
                if let Some(n) = &net {
                    self.net.teardown(n);
                }
                return Err(e);
            }
        };
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, child.id() as i32, 0) };
        // SAFETY: a descriptor the kernel just returned; nothing else owns it.
        let pidfd = (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) });
        let mut warm = WarmVmm {
            jail_id: jail_id.to_string(),
            uid,
            jail: launch.config,
            child,
            pidfd,
            net,
            disks,
            limits,
            restore,
            state,
            ready_at: Instant::now(),
            primed: None,
        };
        match self
            .wait_ready(&mut warm)
            .and_then(|_| precopy_overlays(&warm, dir, uid))
            .and_then(|_| restore_held(&warm))
            .and_then(|_| {
                if cfg.pool.prime {
                    warm.primed = Some(prime(cfg, &warm, dir, cfg.connect_timeout)?);
                }
                Ok(())
            }) {
            Ok(()) => {
                warm.ready_at = Instant::now();
                Ok(warm)
            }
            Err(e) => {
                let detail = std::fs::read_to_string(&log).unwrap_or_default();
                self.release(warm, false);
                Err(format!("{e} ({})", detail.trim()))
            }
        }
    }

    /// Waits until the member answers `ping` on its control socket.
    fn wait_ready(&self, w: &mut WarmVmm) -> Result<(), String> {
        let sock = w.api_host();
        let deadline = Instant::now() + READY_TIMEOUT;
        let mut backoff = Duration::from_millis(1);
        loop {
            if let Ok(Some(status)) = w.child.try_wait() {
                return Err(format!("the waiting VMM exited ({status})"));
            }
            if sock.exists() {
                if let Ok(r) = ember_vmm::pooled::call(&sock, &WaitRequest::Ping, READY_TIMEOUT) {
                    if r["waiting"] == true {
                        return Ok(());
                    }
                }
            }
            if Instant::now() > deadline {
                return Err("the waiting VMM did not answer in time".into());
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(20));
        }
    }

    /// Kills a member and releases its jail, namespace, uid and files. `claimed`: its
    /// namespace is torn down by the sandbox that claimed it, not here.
    fn release(&self, mut w: WarmVmm, claimed: bool) {
        let _ = w.child.kill();
        let _ = w.child.wait();
        if let Err(e) = jailed::release_jail(&w.jail) {
            tracing::error!("pool: {e}");
        }
        if !claimed {
            if let Some(n) = &w.net {
                self.net.teardown(n);
            }
            super::lock(&self.uids).remove(&w.uid);
        }
        let _ = std::fs::remove_dir_all(&w.state);
    }
}

/// Copies the snapshot's overlay files to where the restore request puts the clone's own
/// (`/work/disk<i>.overlay`), owned by the jail's uid: the VMM uses an existing file as is, so
/// the copy is off the create's critical path.
fn precopy_overlays(w: &WarmVmm, dir: &Path, uid: u32) -> Result<(), String> {
    for (i, (disk, path)) in w.disks.iter().zip(&w.restore.disk_paths).enumerate() {
        let (SnapshotDisk::Overlay { .. }, Some(path)) = (disk, path) else {
            continue;
        };
        let src = dir.join(ember_vmm::persist::overlay_file_name(i));
        let dst = w.jail.host_path(path);
        ember_vmm::persist::sparse_copy(&src, &dst).map_err(|e| e.to_string())?;
        std::os::unix::fs::chown(&dst, Some(uid), Some(uid))
            .map_err(|e| format!("chown {}: {e}", dst.display()))?;
    }
    Ok(())
}

/// Has the member restore its snapshot now and hold its vCPUs until the claim's `start`.
fn restore_held(w: &WarmVmm) -> Result<(), String> {
    let mut req = w.restore.clone();
    req.hold = true;
    match ember_vmm::pooled::call(&w.api_host(), &WaitRequest::Restore(req), READY_TIMEOUT) {
        Ok(r) if r["ok"] == true && r["held"] == true => Ok(()),
        Ok(r) => Err(format!(
            "the waiting VMM refused the restore: {}",
            r["error"]
        )),
        Err(e) => Err(e),
    }
}

/// What a primed member's default context runs before it is handed out: a cell through the
/// same path as a user's first (the agent's `run_code`, IPython's `run_cell`, a result), not
/// stored in the context's history.
const PRIMING_CELL: &str = "1 + 1";

/// Primes a member restored with its vCPUs held: starts them, takes over the snapshot's kept
/// agent connection (or connects), syncs and runs [`PRIMING_CELL`] silently in the default
/// context. What a create's first call used to pay for happens here, off its path: the
/// guest's catch-up after the restore (clock, timers, deferred work) and, on kvm_pvm, the
/// shadow-page fills of every page the first cell touches (~2,300). The create then only
/// syncs again (the clock and entropy of the moment it is handed out).
fn prime(
    cfg: &RuntimeConfig,
    w: &WarmVmm,
    dir: &Path,
    timeout: Duration,
) -> Result<(AgentClient, u32), String> {
    // Background work: the guest's catch-up and first cell must not slow the sandboxes in use
    // (a refill starts right after a claim, beside that sandbox's first cell).
    set_member_priority(cfg, &w.jail_id, Priority::Background);
    match ember_vmm::pooled::call(&w.api_host(), &WaitRequest::Start, READY_TIMEOUT) {
        Ok(r) if r["ok"] == true => {}
        Ok(r) => return Err(format!("the pooled VMM refused to start: {}", r["error"])),
        Err(e) => return Err(e),
    }
    // The vCPU threads the start made.
    set_member_priority(cfg, &w.jail_id, Priority::Background);
    let uds = w.jail.host_path(Path::new("/work/vsock"));
    let made = match crate::agent_link::recorded(dir) {
        Some(k) => crate::agent_link::attach(&uds, k, timeout),
        None => crate::agent_link::connect(&uds, crate::template::AGENT_PORT, timeout),
    };
    let (mut client, host_port) = made.map_err(|e| format!("priming: agent connection: {e}"))?;
    client
        .sync_now()
        .map_err(|e| format!("priming: sync: {e}"))?;
    let req = ember_agent::protocol::RunCodeRequest {
        code: PRIMING_CELL.into(),
        silent: true,
        ..Default::default()
    };
    // A template without Python (an image of its own) refuses the cell: the member is still
    // started, connected and synced. A broken connection fails the fill.
    match client.run_code(&req, timeout, |_| Ok(())) {
        Ok(end) if end.status == ember_agent::protocol::EndStatus::Ok => {}
        Ok(end) => tracing::debug!("pool: the priming cell ended {:?}", end.status),
        Err(ember_agent::client::ClientError::Remote(info)) => {
            tracing::debug!("pool: no priming cell: {}", info.message)
        }
        Err(e) => return Err(format!("priming: run_code: {e}")),
    }
    Ok((client, host_port))
}

/// A member's CPU priority.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Priority {
    /// While it is primed: `nice` 19 for every thread, and the lowest CPU share of its cgroup
    /// when it has a `cpu` one (where `nice` does not reach across cgroups).
    Background,
    /// Once claimed: what any sandbox gets.
    Normal,
}

/// Sets the priority of every thread of the processes in jail `jail_id`'s cgroups. Best
/// effort: a thread gone meanwhile is skipped, a failure is logged (it costs speed, not
/// correctness).
fn set_member_priority(cfg: &RuntimeConfig, jail_id: &str, p: Priority) {
    let nice = match p {
        Priority::Background => 19,
        Priority::Normal => 0,
    };
    let mut pids = BTreeSet::new();
    for leaf in jailed::cgroup_dirs(cfg, jail_id) {
        if let Ok(text) = std::fs::read_to_string(leaf.join("cgroup.procs")) {
            pids.extend(text.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
        }
        // cgroup v1 `cpu.shares` (default 1024, least 2), v2 `cpu.weight` (100, least 1).
        for (file, low, normal) in [("cpu.shares", "2", "1024"), ("cpu.weight", "1", "100")] {
            let path = leaf.join(file);
            if path.exists() {
                let value = if p == Priority::Background {
                    low
                } else {
                    normal
                };
                if let Err(e) = std::fs::write(&path, value) {
                    tracing::warn!("pool: {}: {e}", path.display());
                }
            }
        }
    }
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for tid in tasks.flatten() {
            let Some(tid) = tid.file_name().to_str().and_then(|t| t.parse::<u32>().ok()) else {
                continue;
            };
            // SAFETY: setpriority takes plain integers and touches no memory.
            let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice) };
            if r != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::ESRCH) {
                    tracing::warn!("pool: setpriority({tid}, {nice}): {e}");
                }
            }
        }
    }
}

impl WarmVmm {
    fn api_host(&self) -> PathBuf {
        self.jail.host_path(Path::new("/work/api.sock"))
    }

    /// Restores the snapshot in it and attaches to it as sandbox `id`, whose host directory
    /// is `state` (its launcher log moves there), taking over `kept` (the idle agent
    /// connection the snapshot kept) when given. On failure the VMM is killed and its jail
    /// released; the uid and namespace are the caller's to free (returned with the error).
    pub(super) fn claim(
        self,
        cfg: &RuntimeConfig,
        id: &str,
        state: &Path,
        t0: Instant,
        connect_timeout: Duration,
        kept: Option<crate::agent_link::KeptConnection>,
    ) -> Result<Live, (RuntimeError, u32, Option<Arc<SandboxNet>>)> {
        let WarmVmm {
            jail_id,
            uid,
            jail,
            mut child,
            pidfd: _,
            net,
            disks,
            limits: _,
            restore: _,
            state: pool_state,
            ready_at: _,
            primed,
        } = self;
        let fail = |child: Option<&mut Child>, jail: &JailConfig, e: String| {
            if let Some(c) = child {
                let _ = c.kill();
                let _ = c.wait();
            }
            let _ = jailed::release_jail(jail);
            let _ = std::fs::remove_dir_all(&pool_state);
            (RuntimeError::Internal(e), uid, net.clone())
        };
        let sock = jail.host_path(Path::new("/work/api.sock"));
        let log = state.join("launch.log");
        if let Err(e) = std::fs::create_dir_all(state)
            .and_then(|_| std::fs::rename(pool_state.join("launch.log"), &log))
        {
            return Err(fail(
                Some(&mut child),
                &jail,
                format!("{}: {e}", state.display()),
            ));
        }
        let paths = AdoptPaths {
            dir: jail.host_path(Path::new("/work")),
            uds: jail.host_path(Path::new("/work/vsock")),
            api: sock.clone(),
            log,
        };
        let attached = match primed {
            // The guest runs and its connection is made: a sync is all that is left, at the
            // priority of a sandbox in use.
            Some((client, host_port)) => {
                set_member_priority(cfg, &jail_id, Priority::Normal);
                Sandbox::attach_primed(
                    id.to_string(),
                    child,
                    paths,
                    t0,
                    connect_timeout,
                    client,
                    host_port,
                )
            }
            // The VM is restored and held: starting its vCPUs is all that is left.
            None => {
                match ember_vmm::pooled::call(&sock, &WaitRequest::Start, connect_timeout) {
                    Ok(r) if r["ok"] == true => {}
                    Ok(r) => {
                        return Err(fail(
                            Some(&mut child),
                            &jail,
                            format!("the pooled VMM refused to start: {}", r["error"]),
                        ))
                    }
                    Err(e) => return Err(fail(Some(&mut child), &jail, e)),
                }
                Sandbox::attach(id.to_string(), child, paths, t0, connect_timeout, kept)
            }
        };
        match attached {
            Ok(sandbox) => {
                let _ = std::fs::remove_dir_all(&pool_state);
                Ok(Live {
                    sandbox,
                    jail,
                    disks,
                    net,
                    pooled: true,
                })
            }
            // `attach` / `attach_primed` killed the VMM.
            Err(e) => Err(fail(None, &jail, e.to_string())),
        }
    }
}

impl crate::pool::Filler for VmmFiller {
    type Member = WarmVmm;

    fn fill(&self, _template: &str, dir: &Path) -> Result<WarmVmm, String> {
        let uid = alloc_uid(&self.cfg, &self.uids).ok_or("no free jail uid")?;
        let rid = crate::paths::random_id();
        let jail_id = format!("{JAIL_PREFIX}{}-{}", &rid[..12], &rid[12..]);
        self.start(dir, uid, &jail_id).inspect_err(|_| {
            super::lock(&self.uids).remove(&uid);
        })
    }

    fn alive(&self, m: &WarmVmm) -> bool {
        let Some(fd) = &m.pidfd else {
            return true;
        };
        let mut fds = [libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        // SAFETY: `fds` is a valid array of one pollfd for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 1, 0) };
        !(n > 0 && fds[0].revents & libc::POLLIN != 0)
    }

    fn discard(&self, m: WarmVmm) {
        self.release(m, false);
    }
}
