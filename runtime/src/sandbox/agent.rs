//! The agent calls of a [`Sandbox`] — `run_code` in persistent contexts, `exec` and
//! background programs, files, watches — and the connections they run on.
//!
//! Every call takes a connection from a small pool (opening one costs the guest an `accept`),
//! so calls from several threads run concurrently, each on its own connection; a connection
//! that saw an error is dropped, never reused. The first connection after a restore is the
//! idle agent connection the snapshot kept, when it recorded one ([`crate::agent_link`]):
//! taken over with `ATTACH`, it costs the guest no `accept` and no reset. It sends `sync` (the
//! host's clock and fresh entropy) before anything else, so clones of one template never share
//! RNG state or a stale clock.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ember_agent::client::{Client, ClientError, FileWriteOptions};
use ember_agent::protocol::{self, Call, EndStatus, EventKind};

use super::{io_err, Execution, RunEnd, Sandbox, SandboxError};
use crate::agent_link::{self, KeptConnection, Link};
use crate::template::AGENT_PORT;

/// A connection to the sandbox's agent.
pub type AgentClient = Client<UnixStream>;

/// An idle agent connection and its host port (which names it to the VMM's `ATTACH`).
#[derive(Debug)]
pub(super) struct Pooled {
    pub(super) client: AgentClient,
    pub(super) host_port: u32,
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

impl Sandbox {
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
    pub(super) fn first_connection(
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

    pub(super) fn agent_err(&self, call: &'static str, source: ClientError) -> SandboxError {
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

    /// Creates a context (`python`, `bash`, `javascript`, `typescript`, `r`, `java`: see
    /// [`crate::call::LANGUAGES`]) and returns its id. A template's spare context
    /// is handed out when one is ready, so this costs milliseconds.
    pub fn context_create(
        &self,
        language: &str,
        cwd: Option<&str>,
    ) -> Result<String, SandboxError> {
        self.context_create_with_id(language, cwd, None)
    }

    /// [`Self::context_create`] under the caller's id `id` (when given).
    pub fn context_create_with_id(
        &self,
        language: &str,
        cwd: Option<&str>,
        id: Option<&str>,
    ) -> Result<String, SandboxError> {
        let req = protocol::ContextCreateRequest {
            language: language.into(),
            cwd: cwd.map(str::to_owned),
            env: self.env.clone(),
            id: id.map(str::to_owned),
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
