//! A sandbox handle: one VM restored from a template (or any snapshot) in its own `ember-vmm`
//! process, with its own copy-on-write root overlay and vsock socket, and the agent calls an
//! agent platform needs — `run_code` in persistent contexts, `exec`, files — for in-process
//! use. The runtime (ids that outlive the process, lifecycle, the server) builds on this.
//!
//! Every call takes a connection from a small pool (opening one costs the guest an `accept`),
//! so calls from several threads run concurrently, each on its own connection; a connection
//! that saw an error is dropped, never reused. The first connection after a restore is the
//! idle agent connection the snapshot kept, when it recorded one ([`crate::agent_link`]):
//! taken over with `ATTACH`, it costs the guest no `accept` and no reset. It sends `sync` (the
//! host's clock and fresh entropy) before anything else, so clones of one template never share
//! RNG state or a stale clock.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use ember_agent::client::RunEnd;
use ember_agent::client::{Client, ClientError, FileWriteOptions};
use ember_agent::protocol::{self, Call, EndStatus, EventKind};

use crate::agent_link::{self, KeptConnection, Link, LinkMode};
use crate::paths;
use crate::template::{Template, AGENT_PORT};

/// A connection to the sandbox's agent.
pub type AgentClient = Client<UnixStream>;

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

/// Errors of a first connection that a restored guest settles by itself.
fn transient(e: &ClientError) -> bool {
    match e {
        ClientError::Handshake(_) | ClientError::Closed => true,
        ClientError::Io { source, .. } => matches!(
            source.kind(),
            std::io::ErrorKind::ConnectionRefused
                | std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::BrokenPipe
                | std::io::ErrorKind::UnexpectedEof
                // EAGAIN from `connect` on the VMM's socket: its listen backlog is full (a
                // starved VMM has not accepted yet). Measured at ~2,200 idle sandboxes.
                | std::io::ErrorKind::WouldBlock
        ),
        _ => false,
    }
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

/// An idle agent connection and its host port (which names it to the VMM's `ATTACH`).
#[derive(Debug)]
struct Pooled {
    client: AgentClient,
    host_port: u32,
}

/// A pooled connection; goes back to the pool on drop unless a call on it failed.
struct Conn<'a> {
    sandbox: &'a Sandbox,
    client: Option<Pooled>,
    healthy: bool,
}

impl Drop for Conn<'_> {
    fn drop(&mut self) {
        if let (true, Some(c)) = (self.healthy, self.client.take()) {
            if let Ok(mut pool) = self.sandbox.pool.lock() {
                if pool.len() < 8 {
                    pool.push(c);
                }
            }
        }
    }
}

/// How long [`Sandbox::hold_connection`] waits for a new connection's `ping` (a guest that
/// does not answer makes the snapshot go without a kept connection, not wait).
const HOLD_PING_TIMEOUT: Duration = Duration::from_secs(5);

/// An idle agent connection held out of the pool while a snapshot is taken
/// ([`Sandbox::hold_connection`]); back to the pool on drop.
#[derive(Debug)]
pub struct HeldConnection<'a> {
    sandbox: &'a Sandbox,
    conn: Option<Pooled>,
}

impl HeldConnection<'_> {
    /// The record a restore attaches with.
    pub fn kept(&self) -> KeptConnection {
        KeptConnection {
            port: AGENT_PORT,
            host_port: self.conn.as_ref().map(|c| c.host_port).unwrap_or(0),
        }
    }
}

impl Drop for HeldConnection<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.conn.take() {
            if let Ok(mut pool) = self.sandbox.pool.lock() {
                if pool.len() < 8 {
                    pool.push(c);
                }
            }
        }
    }
}

/// Longest a single file transfer may take (1 GiB at the slowest vsock rate measured here,
/// ~1 MiB/s, with margin).
const FILE_TIMEOUT: Duration = Duration::from_secs(4 * 3600);

/// Counts what goes through to the inner writer.
struct Counted<'a, W: Write>(&'a mut W, u64);

impl<W: Write> Write for Counted<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.0.write(buf)?;
        self.1 += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
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
        let (client, link) = sandbox.first_connection(t0, connect_timeout, kept)?;
        sandbox.timings.synced_ms = t0.elapsed().as_secs_f64() * 1e3;
        let host_port = match &link {
            Link::Attached { host_port }
            | Link::Connected { host_port }
            | Link::Fallback { host_port, .. } => *host_port,
        };
        sandbox.link = Some(link);
        sandbox
            .pool
            .lock()
            .map_err(|_| SandboxError::Gone(sandbox.id.clone()))?
            .push(Pooled { client, host_port });
        Ok(sandbox)
    }

    /// Says why the kept connection is not used (once per create: not guest-triggered in
    /// volume) and returns the reason.
    fn give_up_kept(&self, reason: String) -> String {
        tracing::warn!(
            "sandbox {}: not using the snapshot's kept agent connection: {reason}; connecting anew",
            self.id
        );
        reason
    }

    /// Before another first-connection attempt: fails if the VMM has exited, else sleeps
    /// `backoff` and doubles it (at most 50 ms).
    fn retry_after(&self, backoff: &mut Duration) -> Result<(), SandboxError> {
        if let Some(message) = self.exited()? {
            return Err(SandboxError::Vmm {
                id: self.id.clone(),
                message,
            });
        }
        std::thread::sleep(*backoff);
        *backoff = (*backoff * 2).min(Duration::from_millis(50));
        Ok(())
    }

    /// The first agent connection of a restored VM, synced: the kept one when possible.
    fn first_connection(
        &self,
        t0: Instant,
        connect_timeout: Duration,
        mut kept: Option<KeptConnection>,
    ) -> Result<(AgentClient, Link), SandboxError> {
        let mut fallback: Option<String> = None;
        // The socket file appears at bind(); until the VMM's listen() a connect is refused.
        // Without a kept connection, a restored guest also handles the resets the device sends
        // it at restore (a transport reset for older snapshots; an RST per connection the
        // snapshot held, which a plain `CONNECT` also sends for kept ones): a new connection
        // that races with them is reset (handshake refused, or closed before `sync` is
        // answered). Both are retried until the deadline. Each refused attempt costs the
        // guest kernel work (slow on kvm_pvm): back off.
        let mut backoff = Duration::from_millis(1);
        loop {
            let left = connect_timeout
                .saturating_sub(t0.elapsed())
                .max(Duration::from_secs(1));
            let Some(k) = kept else {
                let attempt = agent_link::connect(&self.uds, AGENT_PORT, left)
                    .map_err(|e| ("connect", e))
                    .and_then(|(mut c, port)| {
                        c.sync_now().map(|_| (c, port)).map_err(|e| ("sync", e))
                    });
                match attempt {
                    Ok((c, host_port)) => {
                        let link = match fallback.take() {
                            Some(reason) => Link::Fallback { host_port, reason },
                            None => Link::Connected { host_port },
                        };
                        return Ok((c, link));
                    }
                    Err((_, e)) if transient(&e) && t0.elapsed() < connect_timeout => {
                        self.retry_after(&mut backoff)?;
                        continue;
                    }
                    Err((call, source)) => return Err(self.agent_err(call, source)),
                }
            };
            match agent_link::attach(&self.uds, k, left) {
                Ok((mut c, host_port)) if host_port == k.host_port => {
                    // Half of what is left for the answer: a kept connection that does not
                    // answer still leaves time for a new one.
                    let mut limits = c.limits();
                    let normal = limits.timeout;
                    limits.timeout = (left / 2).max(Duration::from_secs(1));
                    c.set_limits(limits);
                    match c.sync_now() {
                        Ok(_) => {
                            limits.timeout = normal;
                            c.set_limits(limits);
                            return Ok((c, Link::Attached { host_port }));
                        }
                        Err(e) => {
                            fallback = Some(self.give_up_kept(format!("sync on it failed: {e}")));
                            kept = None;
                        }
                    }
                }
                Ok((c, host_port)) => {
                    // The VMM had no such connection and made a new one; the next attempt
                    // connects with `CONNECT`, which also resets what the snapshot kept.
                    drop(c);
                    fallback = Some(self.give_up_kept(format!(
                        "the VMM kept no connection with host port {} (it answered {host_port})",
                        k.host_port
                    )));
                    kept = None;
                }
                Err(ClientError::Io { source, .. })
                    if matches!(
                        source.kind(),
                        std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::WouldBlock
                    ) && t0.elapsed() < connect_timeout =>
                {
                    // Not listening yet, or its backlog is full (a starved VMM); a kept
                    // connection is answered at once once the VMM runs.
                    self.retry_after(&mut backoff)?;
                }
                Err(e) => {
                    fallback = Some(self.give_up_kept(format!("ATTACH failed: {e}")));
                    kept = None;
                }
            }
        }
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

    fn agent_err(&self, call: &'static str, source: ClientError) -> SandboxError {
        SandboxError::Agent {
            id: self.id.clone(),
            call,
            source,
        }
    }

    /// An idle connection from the pool, if one is there.
    fn pop_pooled(&self) -> Result<Option<Pooled>, SandboxError> {
        Ok(self
            .pool
            .lock()
            .map_err(|_| SandboxError::Gone(self.id.clone()))?
            .pop())
    }

    fn conn(&self) -> Result<Conn<'_>, SandboxError> {
        let pooled = self.pop_pooled()?;
        let client = match pooled {
            Some(c) => c,
            None => {
                if let Some(message) = self.exited()? {
                    return Err(SandboxError::Vmm {
                        id: self.id.clone(),
                        message,
                    });
                }
                // `CONNECT` also resets what the snapshot kept and nobody attached to (the
                // guest's workers blocked on those go back to accepting).
                let (client, host_port) =
                    agent_link::connect(&self.uds, AGENT_PORT, Duration::from_secs(30))
                        .map_err(|source| self.agent_err("connect", source))?;
                Pooled { client, host_port }
            }
        };
        Ok(Conn {
            sandbox: self,
            client: Some(client),
            healthy: true,
        })
    }

    /// Runs one call on a pooled connection, passing its events to `on_event`.
    pub fn call(
        &self,
        call: &Call,
        timeout: Duration,
        mut on_event: impl FnMut(EventKind) -> Result<(), ClientError>,
    ) -> Result<EndStatus, SandboxError> {
        let mut conn = self.conn()?;
        let name = call.type_name();
        let client = &mut conn.client.as_mut().expect("client present").client;
        match client.call(call, timeout, &mut on_event) {
            Ok(status) => Ok(status),
            Err(e) => {
                // A remote error (the agent answered `error`) leaves the connection usable.
                conn.healthy = matches!(e, ClientError::Remote(_));
                Err(self.agent_err(name, e))
            }
        }
    }

    /// Runs `f` with a pooled connection (for the client's own streaming helpers).
    pub fn with_client<T>(
        &self,
        name: &'static str,
        f: impl FnOnce(&mut AgentClient) -> Result<T, ClientError>,
    ) -> Result<T, SandboxError> {
        let mut conn = self.conn()?;
        let client = &mut conn.client.as_mut().expect("client present").client;
        match f(client) {
            Ok(v) => Ok(v),
            Err(e) => {
                conn.healthy = matches!(e, ClientError::Remote(_));
                Err(self.agent_err(name, e))
            }
        }
    }

    /// Runs code (see `run_code` in `agent/PROTOCOL.md`); events stream to `on_event` as the
    /// guest produces them.
    pub fn run_code(
        &self,
        req: &protocol::RunCodeRequest,
        mut on_event: impl FnMut(&EventKind),
    ) -> Result<RunEnd, SandboxError> {
        let timeout = req
            .timeout_ms
            .map(|ms| Duration::from_millis(ms) + Duration::from_secs(30))
            .unwrap_or(Duration::from_secs(24 * 3600));
        self.with_client("run_code", |c| {
            c.run_code(req, timeout, |ev| {
                on_event(&ev);
                Ok(())
            })
        })
    }

    /// Runs `code` in the default context and collects everything it produced.
    pub fn run(&self, code: &str) -> Result<Execution, SandboxError> {
        let mut x = Execution::default();
        let req = protocol::RunCodeRequest {
            code: code.into(),
            ..Default::default()
        };
        let end = self.run_code(&req, |ev| x.push(ev))?;
        x.end = Some(end);
        Ok(x)
    }

    /// Creates a context (`python` or `bash`) and returns its id. A template's spare context
    /// is handed out when one is ready, so this costs milliseconds.
    pub fn context_create(
        &self,
        language: &str,
        cwd: Option<&str>,
    ) -> Result<String, SandboxError> {
        let req = protocol::ContextCreateRequest {
            language: language.into(),
            cwd: cwd.map(str::to_owned),
            env: self.env.clone(),
            id: None,
        };
        let mut id = None;
        self.call(&Call::ContextCreate(req), Duration::from_secs(600), |ev| {
            if let EventKind::Context(info) = ev {
                id = Some(info.id);
            }
            Ok(())
        })?;
        id.ok_or_else(|| SandboxError::Vmm {
            id: self.id.clone(),
            message: "context_create answered without a context".into(),
        })
    }

    /// The contexts of the sandbox.
    pub fn context_list(&self) -> Result<Vec<protocol::ContextInfo>, SandboxError> {
        let mut out = Vec::new();
        self.call(&Call::ContextList, Duration::from_secs(60), |ev| {
            if let EventKind::Contexts { contexts } = ev {
                out = contexts;
            }
            Ok(())
        })?;
        Ok(out)
    }

    /// Restarts a context (fresh process, same id; its state is lost).
    pub fn context_restart(&self, context: &str) -> Result<(), SandboxError> {
        let req = protocol::ContextRef {
            context: context.into(),
        };
        self.call(&Call::ContextRestart(req), Duration::from_secs(600), |_| {
            Ok(())
        })
        .map(drop)
    }

    /// Removes a context (its process is killed).
    pub fn context_remove(&self, context: &str) -> Result<(), SandboxError> {
        let req = protocol::ContextRef {
            context: context.into(),
        };
        self.call(&Call::ContextRemove(req), Duration::from_secs(60), |_| {
            Ok(())
        })
        .map(drop)
    }

    /// Interrupts the code running in `context` (a `run_code` on another thread then ends with
    /// `interrupted`).
    pub fn interrupt(&self, context: &str) -> Result<(), SandboxError> {
        let req = protocol::ContextRef {
            context: context.into(),
        };
        self.call(&Call::Interrupt(req), Duration::from_secs(60), |_| Ok(()))
            .map(drop)
    }

    /// Runs a program (see `exec` in `agent/PROTOCOL.md`): `started`, output, `exit`, `end`
    /// events go to `on_event`. A foreground program is killed if the call is abandoned.
    pub fn exec(
        &self,
        req: &protocol::ExecRequest,
        mut on_event: impl FnMut(&EventKind),
    ) -> Result<EndStatus, SandboxError> {
        let timeout = req
            .timeout_ms
            .map(|ms| Duration::from_millis(ms) + Duration::from_secs(30))
            .unwrap_or(Duration::from_secs(24 * 3600));
        self.call(&Call::Exec(req.clone()), timeout, |ev| {
            on_event(&ev);
            Ok(())
        })
    }

    /// Starts a background program; returns its pid in the guest.
    pub fn exec_background(&self, req: &protocol::ExecRequest) -> Result<i32, SandboxError> {
        let mut req = req.clone();
        req.background = true;
        self.with_client("exec", |c| c.exec_start(&req))
    }

    /// Feeds bytes to a program started with `stdin_stream`.
    pub fn stdin_write(&self, pid: i32, data: &[u8]) -> Result<(), SandboxError> {
        self.with_client("stdin_write", |c| c.stdin_write(pid, data))
    }

    /// Closes a program's stdin.
    pub fn stdin_close(&self, pid: i32) -> Result<(), SandboxError> {
        self.with_client("stdin_close", |c| c.stdin_close(pid))
    }

    /// The programs the agent started that are running or not yet collected.
    pub fn process_list(&self) -> Result<Vec<protocol::ProcessInfo>, SandboxError> {
        self.with_client("process_list", |c| c.process_list())
    }

    /// Streams a background program's output (what it wrote so far, then live) until it
    /// exits.
    pub fn process_attach(
        &self,
        pid: i32,
        mut on_event: impl FnMut(&EventKind),
    ) -> Result<EndStatus, SandboxError> {
        let call = Call::ProcessAttach(protocol::PidRequest { pid });
        self.call(&call, Duration::from_secs(24 * 3600), |ev| {
            on_event(&ev);
            Ok(())
        })
    }

    /// Sends `signal` to a program's process group.
    pub fn process_signal(&self, pid: i32, signal: i32) -> Result<(), SandboxError> {
        self.with_client("process_signal", |c| c.process_signal(pid, signal))
    }

    /// Resizes a program's pseudo-terminal.
    pub fn process_resize(&self, pid: i32, cols: u16, rows: u16) -> Result<(), SandboxError> {
        self.with_client("process_resize", |c| c.process_resize(pid, cols, rows))
    }

    /// Streams `data` into the guest file `path` (created or replaced atomically when
    /// complete; parent directories created). Returns the bytes written.
    pub fn write_file(&self, path: &str, data: &mut impl Read) -> Result<u64, SandboxError> {
        self.with_client("file_write", |c| {
            c.file_write(path, FileWriteOptions::default(), data, FILE_TIMEOUT)
        })
    }

    /// Streams the guest file `path` into `out`; returns the bytes read.
    pub fn read_file(&self, path: &str, out: &mut impl Write) -> Result<u64, SandboxError> {
        let mut counted = Counted(out, 0);
        self.with_client("file_read", |c| {
            c.file_read(path, None, None, FILE_TIMEOUT, &mut counted)
        })?;
        Ok(counted.1)
    }

    /// Uploads the host file `local` to the guest path `guest`.
    pub fn upload(&self, local: &Path, guest: &str) -> Result<u64, SandboxError> {
        let mut f = std::fs::File::open(local).map_err(io_err("cannot open", local))?;
        self.write_file(guest, &mut f)
    }

    /// Downloads the guest file `guest` to the host path `local` (written to a temporary
    /// file beside it and renamed into place when complete).
    pub fn download(&self, guest: &str, local: &Path) -> Result<u64, SandboxError> {
        let dir = match local.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let mut tmp = tempfile::NamedTempFile::new_in(&dir)
            .map_err(io_err("cannot create a file in", &dir))?;
        let n = self.read_file(guest, tmp.as_file_mut())?;
        tmp.persist(local).map_err(|e| SandboxError::Io {
            what: "cannot write",
            path: local.to_path_buf(),
            source: e.error,
        })?;
        Ok(n)
    }

    /// Lists a guest directory, `depth` levels down.
    pub fn list(&self, path: &str, depth: u32) -> Result<Vec<protocol::DirEntry>, SandboxError> {
        self.with_client("file_list", |c| c.file_list(path, Some(depth)))
    }

    /// Metadata of a guest path.
    pub fn stat(&self, path: &str) -> Result<protocol::FileStat, SandboxError> {
        self.with_client("file_stat", |c| c.file_stat(path))
    }

    /// `mkdir -p` in the guest.
    pub fn mkdir(&self, path: &str) -> Result<(), SandboxError> {
        self.with_client("file_mkdir", |c| c.file_mkdir(path))
    }

    /// Removes a guest path (`recursive` for directories with content).
    pub fn remove(&self, path: &str, recursive: bool) -> Result<(), SandboxError> {
        self.with_client("file_remove", |c| c.file_remove(path, recursive))
    }

    /// Renames a guest path.
    pub fn rename(&self, from: &str, to: &str) -> Result<(), SandboxError> {
        self.with_client("file_rename", |c| c.file_rename(from, to))
    }

    /// Watches a guest directory; `on_event(path, op)` returns false to stop.
    pub fn watch(
        &self,
        path: &str,
        recursive: bool,
        timeout: Duration,
        on_event: impl FnMut(&str, protocol::FsOp) -> bool,
    ) -> Result<(), SandboxError> {
        self.with_client("file_watch", |c| {
            c.file_watch(path, recursive, timeout, on_event)
        })
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

    /// Holds an idle agent connection aside (from the pool, or a new one answered a `ping`)
    /// while a snapshot is taken: no call runs on it, so the snapshot keeps it, and
    /// [`HeldConnection::kept`] is what to record ([`agent_link::record`]) for the restore to
    /// attach to. It goes back to the pool when dropped.
    pub fn hold_connection(&self) -> Result<HeldConnection<'_>, SandboxError> {
        let pooled = self.pop_pooled()?;
        let conn = match pooled {
            // It has answered its last call in full: nothing is in flight on it.
            Some(p) => p,
            None => {
                // A new one must have been accepted and served by the agent to be quiet.
                let mut conn = self.conn()?;
                let mut p = conn.client.take().expect("client present");
                let mut limits = p.client.limits();
                let normal = limits.timeout;
                limits.timeout = HOLD_PING_TIMEOUT;
                p.client.set_limits(limits);
                p.client.ping().map_err(|e| self.agent_err("ping", e))?;
                limits.timeout = normal;
                p.client.set_limits(limits);
                p
            }
        };
        Ok(HeldConnection {
            sandbox: self,
            conn: Some(conn),
        })
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

/// Everything one `run_code` produced, collected.
#[derive(Debug, Clone, Default)]
pub struct Execution {
    /// stdout, as received.
    pub stdout: Vec<u8>,
    /// stderr, as received.
    pub stderr: Vec<u8>,
    /// The value of the last expression (MIME bundle), if any.
    pub result: Option<serde_json::Map<String, serde_json::Value>>,
    /// `display` bundles, in order.
    pub displays: Vec<serde_json::Map<String, serde_json::Value>>,
    /// The exception the code raised, if any.
    pub exception: Option<protocol::Exception>,
    /// Whether output was cut at the cap.
    pub truncated: bool,
    /// How it ended.
    pub end: Option<RunEnd>,
}

impl Execution {
    /// Adds one event.
    pub fn push(&mut self, ev: &EventKind) {
        match ev {
            EventKind::Stdout { data } => self.stdout.extend_from_slice(data),
            EventKind::Stderr { data } => self.stderr.extend_from_slice(data),
            EventKind::Result(r) => self.result = Some(r.data.clone()),
            EventKind::Display(d) => self.displays.push(d.data.clone()),
            EventKind::Exception(x) => self.exception = Some(x.clone()),
            EventKind::Truncated { .. } => self.truncated = true,
            _ => {}
        }
    }

    /// stdout as text.
    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    /// The result's `text/plain`, if any.
    pub fn text(&self) -> Option<&str> {
        self.result.as_ref()?.get("text/plain")?.as_str()
    }

    /// Every bundle (result and displays) that has `mime`.
    pub fn all_with(&self, mime: &str) -> Vec<&serde_json::Value> {
        self.result
            .iter()
            .chain(self.displays.iter())
            .filter_map(|b| b.get(mime))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn io(kind: std::io::ErrorKind) -> ClientError {
        ClientError::Io {
            context: "CONNECT 1024".into(),
            source: kind.into(),
        }
    }

    #[test]
    fn a_starved_vmm_is_waited_for_and_a_refusal_of_access_is_not() {
        use std::io::ErrorKind::*;
        // A full listen backlog (EAGAIN) is what a starved VMM looks like at ~2,200 sandboxes.
        for kind in [
            ConnectionRefused,
            WouldBlock,
            ConnectionReset,
            UnexpectedEof,
        ] {
            assert!(transient(&io(kind)), "{kind:?}");
        }
        for kind in [PermissionDenied, NotFound, InvalidInput] {
            assert!(!transient(&io(kind)), "{kind:?}");
        }
        assert!(transient(&ClientError::Closed));
    }
}
