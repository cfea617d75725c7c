//! A sandbox handle: one VM restored from a template (or any snapshot) in its own `ember-vmm`
//! process, with its own copy-on-write root overlay and vsock socket, and the agent calls an
//! agent platform needs — `run_code` in persistent contexts, `exec`, files — for in-process
//! use. The runtime (ids that outlive the process, lifecycle, the server) builds on this.
//!
//! - This file: the [`Sandbox`] type, its options and errors, and the VMM process it holds:
//!   start ([`Sandbox::create`], [`Sandbox::restore`], [`Sandbox::launch`],
//!   [`Sandbox::attach`]), take over ([`Sandbox::adopt`]), snapshot, kill, pid and pidfd.
//! - `agent.rs`: the calls to the guest's agent (code, contexts, programs, files, watches)
//!   and the connections they run on: the first one after a restore, the pool, the one a
//!   snapshot keeps ([`Sandbox::hold_connection`]).
//! - `execution.rs`: [`Execution`], what one `run_code` produced, and [`RunEnd`].
//!
//! Every public item is re-exported here: the paths stay `ember_runtime::sandbox::*`.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ember_agent::client::ClientError;

use crate::agent_link::{self, KeptConnection, Link, LinkMode};
use crate::paths;
use crate::template::Template;

mod agent;
mod execution;

use agent::Pooled;
pub use agent::{AgentClient, HeldConnection};
pub use execution::{Execution, RunEnd};

/// Errors of a sandbox. Each says what was being done.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// Files of the sandbox on the host.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// On which path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The VMM did not start or died.
    #[error("sandbox {id}: {message}")]
    Vmm {
        /// The sandbox.
        id: String,
        /// What happened.
        message: String,
    },
    /// The agent call failed (transport, protocol, or the agent's own error).
    #[error("sandbox {id}: {call}: {source}")]
    Agent {
        /// The sandbox.
        id: String,
        /// The call.
        call: &'static str,
        /// Why.
        source: ClientError,
    },
    /// The sandbox was killed.
    #[error("sandbox {0} is no longer running")]
    Gone(String),
}

/// How to create a sandbox.
#[derive(Debug, Clone)]
pub struct SandboxOptions {
    /// The directory for its files (VMM report, sockets, overlay, console); default
    /// `$EMBER_HOME/run/<id>`, removed when the sandbox is killed.
    pub workdir: Option<PathBuf>,
    /// The VMM binary (default: [`ember_vmm::launcher::find_vmm_binary`]).
    pub vmm: Option<PathBuf>,
    /// How long the restored guest may take to answer (default 60 s).
    pub connect_timeout: Duration,
    /// Kill the VMM when the thread that created the sandbox exits (`PR_SET_PDEATHSIG`): for
    /// one-shot tools like `ember run`, so that Ctrl-C leaves no VM behind. Off by default: a
    /// library user's creating thread may end long before the sandbox should.
    pub die_with_parent: bool,
    /// How the first agent connection is made (default: take over the one the snapshot kept).
    pub link: LinkMode,
}

impl Default for SandboxOptions {
    fn default() -> Self {
        Self {
            workdir: None,
            vmm: None,
            connect_timeout: Duration::from_secs(60),
            die_with_parent: false,
            link: LinkMode::Attach,
        }
    }
}

/// Timings of a create, milliseconds from spawning the VMM.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CreateTimings {
    /// Spawn → the vsock socket exists (the VM is built and about to run).
    pub vmm_ready_ms: f64,
    /// Spawn → the agent answered `sync` (clock and entropy set).
    pub synced_ms: f64,
    /// Time the start waited for admission before it began (the runtime's start gate).
    pub queued_ms: f64,
}

/// How to start a sandbox's VMM ([`Sandbox::launch`]).
#[derive(Debug)]
pub struct LaunchSpec {
    /// The command (stdio is set by `launch`: stderr goes to `log`).
    pub command: Command,
    /// The sandbox's host directory (removed on kill).
    pub dir: PathBuf,
    /// Host path of the VMM's vsock socket.
    pub uds: PathBuf,
    /// Host path of the VMM's control socket.
    pub api: PathBuf,
    /// Where the launcher's stderr goes (read for the reason when it exits).
    pub log: PathBuf,
    /// Kill the VMM when the creating thread exits (see [`SandboxOptions::die_with_parent`]).
    pub die_with_parent: bool,
    /// The idle agent connection the snapshot kept ([`agent_link::recorded`]): the first
    /// connection takes it over. `None`: connect anew.
    pub kept: Option<KeptConnection>,
}

/// Host paths of a running VMM to take over ([`Sandbox::adopt`]).
#[derive(Debug, Clone)]
pub struct AdoptPaths {
    /// The sandbox's host directory.
    pub dir: PathBuf,
    /// The vsock socket.
    pub uds: PathBuf,
    /// The control socket.
    pub api: PathBuf,
    /// The launcher's stderr log.
    pub log: PathBuf,
}

/// The VMM process: our child, or one adopted by pid.
#[derive(Debug)]
enum Proc {
    Child(Child),
    Adopted { pid: i32, pidfd: OwnedFd },
}

fn pidfd_open(pid: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a descriptor the kernel just returned to us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn pidfd_exited(pidfd: &OwnedFd) -> bool {
    let mut fds = [libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }];
    // SAFETY: `fds` is a valid array of one pollfd for the duration of the call.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), 1, 0) };
    n > 0 && fds[0].revents & libc::POLLIN != 0
}

/// A running sandbox.
#[derive(Debug)]
pub struct Sandbox {
    id: String,
    dir: PathBuf,
    uds: PathBuf,
    api: PathBuf,
    log: PathBuf,
    child: Mutex<Option<Proc>>,
    pidfd: Option<OwnedFd>,
    pool: Mutex<Vec<Pooled>>,
    /// How the first agent connection was made (`None` for an adopted VMM).
    link: Option<Link>,
    /// Leave the VMM running when the handle is dropped ([`Sandbox::detach`]).
    detached: std::sync::atomic::AtomicBool,
    template: Option<String>,
    timings: CreateTimings,
    env: BTreeMap<String, String>,
    /// The isolated network namespace of an unjailed restore of a networked snapshot
    /// (deleted after the VMM, on drop).
    netns: Option<ember_vmm::netns::IsolatedNetns>,
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> SandboxError {
    let path = path.to_path_buf();
    move |source| SandboxError::Io { what, path, source }
}

impl Sandbox {
    /// Restores `template` into a new sandbox.
    pub fn create(template: &Template, opts: &SandboxOptions) -> Result<Sandbox, SandboxError> {
        let mut s = Sandbox::restore(&template.snapshot_dir(), opts)?;
        s.template = Some(template.info.name.clone());
        s.env = template.info.env.clone();
        Ok(s)
    }

    /// Restores the snapshot in `snapshot` (a template's, or one taken with
    /// [`Sandbox::snapshot`]) into a new sandbox.
    pub fn restore(snapshot: &Path, opts: &SandboxOptions) -> Result<Sandbox, SandboxError> {
        let id = paths::random_id();
        let dir = opts
            .workdir
            .clone()
            .unwrap_or_else(|| paths::run_dir().join(&id));
        std::fs::create_dir_all(&dir).map_err(io_err("cannot create", &dir))?;
        let vmm = match &opts.vmm {
            Some(v) => v.clone(),
            None => ember_vmm::launcher::find_vmm_binary().map_err(|e| SandboxError::Vmm {
                id: id.clone(),
                message: e.to_string(),
            })?,
        };
        let uds = dir.join("vsock");
        let api = dir.join("api.sock");
        let overlay = dir.join("root.overlay");
        let log = dir.join("vmm.log");
        let mut cmd = Command::new(&vmm);
        cmd.arg("--restore")
            .arg(snapshot)
            .arg("--vsock-uds")
            .arg(&uds)
            .arg("--disk-path")
            .arg(&overlay)
            .arg("--api-sock")
            .arg(&api)
            .arg("--report")
            .arg(dir.join("report.jsonl"))
            .arg("--serial")
            .arg(format!("file:{}", dir.join("console.log").display()));
        if opts.link == LinkMode::TransportReset {
            cmd.arg("--vsock-transport-reset");
        }
        let kept = match opts.link {
            LinkMode::Attach => agent_link::recorded(snapshot),
            LinkMode::Connect | LinkMode::TransportReset => None,
        };
        // A networked snapshot's VMM opens its TAP by name: outside the runtime (which gives
        // each sandbox a namespace with a policy) it runs in an isolated namespace, which is
        // policy `none`.
        let netns =
            ember_vmm::netns::for_snapshot(snapshot).map_err(|message| SandboxError::Vmm {
                id: id.clone(),
                message: format!("network namespace: {message}"),
            })?;
        if let Some(ns) = &netns {
            ns.enter_on_exec(&mut cmd).map_err(|e| SandboxError::Vmm {
                id: id.clone(),
                message: e.to_string(),
            })?;
        }
        let spec = LaunchSpec {
            command: cmd,
            dir: dir.clone(),
            uds,
            api,
            log,
            die_with_parent: opts.die_with_parent,
            kept,
        };
        let mut s = Sandbox::launch(id, spec, opts.connect_timeout)?;
        s.netns = netns;
        Ok(s)
    }

    /// Starts a VMM with `spec.command` (any launcher: the VMM itself, or `ember-jailer`
    /// exec'ing it), waits for the guest's agent and syncs its clock and entropy.
    pub fn launch(
        id: String,
        spec: LaunchSpec,
        connect_timeout: Duration,
    ) -> Result<Sandbox, SandboxError> {
        let LaunchSpec {
            mut command,
            dir,
            uds,
            api,
            log,
            die_with_parent,
            kept,
        } = spec;
        let stderr = std::fs::File::create(&log).map_err(io_err("cannot create", &log))?;
        let t0 = Instant::now();
        if die_with_parent {
            use std::os::unix::process::CommandExt;
            let die_with_parent = || {
                // SAFETY: prctl(PR_SET_PDEATHSIG) takes plain integers and touches no memory.
                if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) } != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            };
            // SAFETY: the hook runs in the child between fork and exec and only calls prctl,
            // which is async-signal-safe; it allocates nothing and takes no locks.
            unsafe { command.pre_exec(die_with_parent) };
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .map_err(|e| SandboxError::Vmm {
                id: id.clone(),
                message: format!("cannot start {:?}: {e}", command.get_program()),
            })?;
        Self::attach(
            id,
            child,
            AdoptPaths { dir, uds, api, log },
            t0,
            connect_timeout,
            kept,
        )
    }

    /// Takes over `child`, a VMM this process started (with [`Sandbox::launch`], or ahead of
    /// time by the runtime's warm pool and since told to restore), waits for the guest's agent
    /// and syncs its clock and entropy. The first connection is `kept`, the idle connection the
    /// snapshot kept, when given: taken over with `ATTACH` (no reset, no `accept` in the
    /// guest); when that fails — the VMM kept no such connection, or it does not answer — a
    /// log line says so and a new connection is made. `t0` is when the create began (for
    /// [`Sandbox::timings`]). A failure kills the VMM.
    pub fn attach(
        id: String,
        child: Child,
        paths: AdoptPaths,
        t0: Instant,
        connect_timeout: Duration,
        kept: Option<KeptConnection>,
    ) -> Result<Sandbox, SandboxError> {
        Self::attach_with(id, child, paths, t0, connect_timeout, |sb| {
            sb.first_connection(t0, connect_timeout, kept)
        })
    }

    /// Takes over `child`, a warm pool member whose guest already runs and whose agent
    /// connection `client` (host port `host_port`) the pool made when it filled the member
    /// (see `runtime/pooled.rs`): only the sync — the host's clock and fresh entropy, the
    /// reseed of every context's RNG before its next cell — is left. A failure kills the VMM.
    pub fn attach_primed(
        id: String,
        child: Child,
        paths: AdoptPaths,
        t0: Instant,
        connect_timeout: Duration,
        mut client: AgentClient,
        host_port: u32,
    ) -> Result<Sandbox, SandboxError> {
        Self::attach_with(id, child, paths, t0, connect_timeout, |sb| {
            client.sync_now().map_err(|e| sb.agent_err("sync", e))?;
            Ok((client, Link::Primed { host_port }))
        })
    }

    fn attach_with(
        id: String,
        child: Child,
        paths: AdoptPaths,
        t0: Instant,
        connect_timeout: Duration,
        first: impl FnOnce(&Sandbox) -> Result<(AgentClient, Link), SandboxError>,
    ) -> Result<Sandbox, SandboxError> {
        let AdoptPaths { dir, uds, api, log } = paths;
        let pidfd = pidfd_open(child.id() as i32).ok();
        let mut sandbox = Sandbox {
            id,
            dir,
            uds,
            api,
            log,
            child: Mutex::new(Some(Proc::Child(child))),
            pidfd,
            pool: Mutex::new(Vec::new()),
            link: None,
            detached: std::sync::atomic::AtomicBool::new(false),
            template: None,
            timings: CreateTimings::default(),
            env: BTreeMap::new(),
            netns: None,
        };
        // From here on, a failure kills the VMM (Drop).
        sandbox.wait_socket(t0, connect_timeout)?;
        sandbox.timings.vmm_ready_ms = t0.elapsed().as_secs_f64() * 1e3;
        let (client, link) = first(&sandbox)?;
        sandbox.timings.synced_ms = t0.elapsed().as_secs_f64() * 1e3;
        let host_port = link.host_port();
        sandbox.link = Some(link);
        sandbox
            .pool
            .lock()
            .map_err(|_| SandboxError::Gone(sandbox.id.clone()))?
            .push(Pooled { client, host_port });
        Ok(sandbox)
    }

    /// Takes over a running VMM that another process started (a restarted server
    /// re-attaching its sandboxes): `pid` is watched through a pidfd, killed on
    /// [`Sandbox::kill`]. Fails when no such process runs.
    pub fn adopt(id: String, pid: i32, spec_paths: AdoptPaths) -> Result<Sandbox, SandboxError> {
        let pidfd = pidfd_open(pid).map_err(|e| SandboxError::Vmm {
            id: id.clone(),
            message: format!("cannot watch VMM pid {pid}: {e}"),
        })?;
        let AdoptPaths { dir, uds, api, log } = spec_paths;
        let watch = pidfd
            .try_clone()
            .map_err(io_err("cannot duplicate the pidfd of", &dir))?;
        Ok(Sandbox {
            id,
            dir,
            uds,
            api,
            log,
            child: Mutex::new(Some(Proc::Adopted { pid, pidfd })),
            pidfd: Some(watch),
            pool: Mutex::new(Vec::new()),
            link: None,
            detached: std::sync::atomic::AtomicBool::new(false),
            template: None,
            timings: CreateTimings::default(),
            env: BTreeMap::new(),
            netns: None,
        })
    }

    /// Sets what [`Sandbox::template`] and the environment of new contexts say (for
    /// sandboxes the runtime launched itself).
    pub fn set_template(&mut self, name: Option<String>, env: BTreeMap<String, String>) {
        self.template = name;
        self.env = env;
    }

    /// Leaves the VMM running when this handle is dropped (a server that stops while its
    /// sandboxes live on, to be re-attached by the next one with [`Sandbox::adopt`]).
    pub fn detach(&self) {
        self.detached
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// A pidfd of the VMM process (readable once it exited), for event loops that watch many.
    pub fn pidfd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        self.pidfd.as_ref().map(|f| f.as_fd())
    }

    /// Reaps the VMM if it exited: `Some(how)` (exit status or signal; for an adopted
    /// process only "exited").
    pub fn exit_status(&self) -> Option<String> {
        let mut child = self.child.lock().ok()?;
        match child.as_mut()? {
            Proc::Child(c) => c.try_wait().ok().flatten().map(|s| s.to_string()),
            Proc::Adopted { pidfd, .. } => pidfd_exited(pidfd).then(|| "exited".to_string()),
        }
    }

    fn wait_socket(&self, t0: Instant, timeout: Duration) -> Result<(), SandboxError> {
        loop {
            if self.uds.exists() {
                return Ok(());
            }
            if let Some(message) = self.exited()? {
                return Err(SandboxError::Vmm {
                    id: self.id.clone(),
                    message,
                });
            }
            if t0.elapsed() > timeout {
                return Err(SandboxError::Vmm {
                    id: self.id.clone(),
                    message: format!("the VMM did not open its vsock socket within {timeout:?}"),
                });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// `Some(reason)` when the VMM has exited (with its own message when it left one).
    fn exited(&self) -> Result<Option<String>, SandboxError> {
        let mut child = self
            .child
            .lock()
            .map_err(|_| SandboxError::Gone(self.id.clone()))?;
        let Some(c) = child.as_mut() else {
            return Ok(Some("killed".into()));
        };
        let status = match c {
            Proc::Child(c) => c.try_wait().map(|s| s.map(|s| s.to_string())),
            Proc::Adopted { pidfd, .. } => Ok(pidfd_exited(pidfd).then(|| "exited".to_string())),
        };
        match status {
            Ok(Some(status)) => {
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                let last = log
                    .lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("");
                Ok(Some(format!("the VMM exited ({status}): {last}")))
            }
            _ => Ok(None),
        }
    }

    /// The sandbox's id (random, 16 hex digits).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The directory holding its files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The template it was created from, if any.
    pub fn template(&self) -> Option<&str> {
        self.template.as_deref()
    }

    /// Environment the template sets for code.
    pub fn template_env(&self) -> &BTreeMap<String, String> {
        &self.env
    }

    /// How long the create took.
    pub fn timings(&self) -> CreateTimings {
        self.timings
    }

    /// Records how long the start waited for admission (the runtime's start gate).
    pub fn set_queued_ms(&mut self, ms: f64) {
        self.timings.queued_ms = ms;
    }

    /// The VMM's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.lock().ok()?.as_ref().map(|p| match p {
            Proc::Child(c) => c.id(),
            Proc::Adopted { pid, .. } => *pid as u32,
        })
    }

    /// The VMM's control socket.
    pub fn api_socket(&self) -> &Path {
        &self.api
    }

    /// How the first agent connection after the restore was made (`None` for a VMM taken
    /// over with [`Sandbox::adopt`]).
    pub fn link(&self) -> Option<&Link> {
        self.link.as_ref()
    }

    /// Takes a full snapshot (memory and disk) of the running sandbox into `dir` (which must
    /// not exist); the sandbox keeps running. [`Sandbox::restore`] continues from it, on the
    /// idle agent connection held through the snapshot (recorded in `dir`).
    pub fn snapshot(&self, dir: &Path) -> Result<(), SandboxError> {
        // The pool is only good for this VM, which keeps running, so it stays; one idle
        // connection is held out of it so that the snapshot keeps it quiet.
        let held = self.hold_connection()?;
        let reply = ember_vmm::api::call(
            &self.api,
            &ember_vmm::api::Request::Snapshot {
                dir: dir.to_path_buf(),
                kind: ember_vmm::api::SnapshotKind::Full,
                after: ember_vmm::api::AfterSnapshot::Continue,
            },
        )
        .map_err(|message| SandboxError::Vmm {
            id: self.id.clone(),
            message,
        })?;
        if reply["ok"] != true {
            return Err(SandboxError::Vmm {
                id: self.id.clone(),
                message: format!("snapshot refused: {reply}"),
            });
        }
        agent_link::record(dir, held.kept()).map_err(io_err("cannot write", dir))
    }

    /// Stops the VM (its process is killed, its files removed).
    pub fn kill(&self) -> Result<(), SandboxError> {
        self.pool
            .lock()
            .map_err(|_| SandboxError::Gone(self.id.clone()))?
            .clear();
        let child = self
            .child
            .lock()
            .map_err(|_| SandboxError::Gone(self.id.clone()))?
            .take();
        match child {
            Some(Proc::Child(mut c)) => {
                let _ = c.kill();
                let _ = c.wait();
            }
            Some(Proc::Adopted { pid, pidfd }) => {
                // SAFETY: pidfd_send_signal on a pidfd we own; the pidfd pins the process
                // identity, so no recycled pid is signalled.
                unsafe {
                    libc::syscall(
                        libc::SYS_pidfd_send_signal,
                        pidfd.as_raw_fd(),
                        libc::SIGKILL,
                        std::ptr::null::<libc::siginfo_t>(),
                        0,
                    )
                };
                let mut fds = [libc::pollfd {
                    fd: pidfd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                }];
                // SAFETY: `fds` is a valid array of one pollfd for the duration of the call.
                unsafe { libc::poll(fds.as_mut_ptr(), 1, 5000) };
                let _ = pid;
            }
            None => {}
        }
        if self.dir.exists() {
            std::fs::remove_dir_all(&self.dir).map_err(io_err("cannot remove", &self.dir))?;
        }
        Ok(())
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if !self.detached.load(std::sync::atomic::Ordering::Relaxed) {
            let _ = self.kill();
        }
    }
}
