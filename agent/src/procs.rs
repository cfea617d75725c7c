//! The processes `exec` starts, shared by every connection: `process_list`, `process_attach`,
//! `process_signal`, `process_resize`, `stdin_write`, `stdin_close`.
//!
//! Every exec is entered in one table (keyed by its pid) before its `started` event is sent,
//! so that another connection can write its stdin or signal it while it runs.
//!
//! - A *foreground* exec is pumped by its connection's thread as in v1 ([`crate::exec::pump`]):
//!   output goes straight to the call, and the connection closing kills the process group.
//!   It leaves the table when its call ends.
//! - A *background* exec gets a thread of its own that pumps the output into two bounded rings
//!   (the last [`OUTPUT_KEEP`] bytes of each stream) and reaps the program. `process_attach`
//!   sends what the rings hold, then follows them live: the attaching thread sleeps in one
//!   `poll` on an eventfd of its own (written by the pump thread after each batch of output)
//!   and on its connection (hang-up ends the attach; the process survives). Once an attach
//!   has delivered the exit, the entry is dropped; ended entries nobody attaches to are
//!   dropped oldest first beyond [`MAX_ENDED`].

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::exec::{self, Creds, ExecEnv, Sink, Spawned, StartOptions};
use crate::protocol::{
    Call, EndStatus, ErrorCode, ErrorInfo, EventKind, ExecRequest, ExecUser, ExitStatus,
    ProcessInfo, PtySize, MAX_CHUNK,
};
use crate::reaper::Children;

/// Output kept per stream of a background process until it is attached to.
pub const OUTPUT_KEEP: usize = 1024 * 1024;

/// Ended processes kept for `process_list`/`process_attach` before the oldest is dropped.
pub const MAX_ENDED: usize = 64;

/// Where the unprivileged account is looked up.
pub const PASSWD: &str = "/etc/passwd";

/// The account `user: "user"` runs as.
pub const USER_NAME: &str = "user";

/// The last bytes of one output stream, and how many were ever written.
#[derive(Debug, Default)]
struct Ring {
    buf: VecDeque<u8>,
    total: u64,
}

impl Ring {
    fn push(&mut self, data: &[u8]) {
        self.total += data.len() as u64;
        let data = &data[data.len().saturating_sub(OUTPUT_KEEP)..];
        let overflow = (self.buf.len() + data.len()).saturating_sub(OUTPUT_KEEP);
        self.buf.drain(..overflow.min(self.buf.len()));
        self.buf.extend(data);
    }

    /// Stream offset of the oldest byte kept.
    fn start(&self) -> u64 {
        self.total - self.buf.len() as u64
    }

    /// Bytes from stream offset `pos` on (from the oldest kept if `pos` is older), in chunks
    /// of at most [`MAX_CHUNK`]; returns the new position.
    fn since(&self, pos: u64, out: &mut Vec<Vec<u8>>) -> u64 {
        let from = pos.max(self.start());
        let skip = usize::try_from(from - self.start()).unwrap_or(usize::MAX);
        let mut rest = self.buf.range(skip.min(self.buf.len())..);
        loop {
            let chunk: Vec<u8> = rest.by_ref().take(MAX_CHUNK).copied().collect();
            if chunk.is_empty() {
                return self.total;
            }
            out.push(chunk);
        }
    }
}

#[derive(Debug, Default)]
struct State {
    /// stdout, stderr.
    rings: [Ring; 2],
    /// Set once the program has been reaped (after its output was collected).
    exit: Option<(ExitStatus, bool)>,
    /// The pump is done and the program is being reaped: its pid may be reused any moment.
    reaping: bool,
    /// eventfds of the attached connections, written after each batch of output.
    subscribers: Vec<Arc<OwnedFd>>,
}

impl State {
    fn notify(&self) {
        for fd in &self.subscribers {
            let one = 1u64.to_ne_bytes();
            // SAFETY: writes 8 bytes from a live buffer to an eventfd kept open by the Arc.
            unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
        }
    }
}

#[derive(Debug)]
struct Proc {
    pid: libc::pid_t,
    argv: Vec<String>,
    background: bool,
    /// The write end of stdin when it is a stream (`stdin_stream`).
    stdin: Mutex<Option<File>>,
    /// A copy of the pty master (writes and resizes).
    master: Option<File>,
    state: Mutex<State>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update under these locks leaves the data consistent; a panicking thread (PID 1
    // reboots on panics anyway) does not make it unusable.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Proc {
    fn info(&self) -> ProcessInfo {
        let state = lock(&self.state);
        ProcessInfo {
            pid: self.pid,
            argv: self.argv.clone(),
            background: self.background,
            pty: self.master.is_some(),
            running: state.exit.is_none(),
            exit: state.exit.map(|(status, _)| status),
        }
    }

    /// Sends `signal` to the process group unless the program is already being reaped.
    fn signal(&self, signal: i32) -> Result<(), ErrorInfo> {
        let state = lock(&self.state);
        if state.reaping {
            return Err(no_such_process(self.pid, "has exited"));
        }
        // SAFETY: kill has no memory effects; the group leader is not reaped while `reaping`
        // is false (checked under the lock the pump thread takes before reaping).
        if unsafe { libc::kill(-self.pid, signal) } != 0 {
            let err = io::Error::last_os_error();
            return Err(match err.raw_os_error() {
                Some(libc::ESRCH) => no_such_process(self.pid, "has exited"),
                Some(libc::EINVAL) => ErrorInfo::new(
                    ErrorCode::BadRequest,
                    format!("process_signal: invalid signal {signal}"),
                ),
                _ => ErrorInfo::new(ErrorCode::Io, format!("signalling pid {}: {err}", self.pid)),
            });
        }
        Ok(())
    }

    fn mark_reaping(&self) {
        lock(&self.state).reaping = true;
    }
}

/// Records that a background process ended; drops the oldest ended entries beyond
/// [`MAX_ENDED`].
fn ended(table: &Mutex<Table>, pid: libc::pid_t) {
    let mut table = lock(table);
    table.ended.push_back(pid);
    while table.ended.len() > MAX_ENDED {
        let Some(old) = table.ended.pop_front() else {
            break;
        };
        let is_ended = table
            .procs
            .get(&old)
            .is_some_and(|p| lock(&p.state).exit.is_some());
        if is_ended {
            table.procs.remove(&old);
        }
    }
}

fn no_such_process(pid: libc::pid_t, why: &str) -> ErrorInfo {
    ErrorInfo::new(ErrorCode::NoSuchProcess, format!("pid {pid} {why}"))
}

/// Output of a background process: into its rings.
struct RingSink {
    proc: Arc<Proc>,
    dirty: bool,
}

impl Sink for RingSink {
    fn event(&mut self, kind: EventKind) {
        let slot = match &kind {
            EventKind::Stdout { .. } => 0,
            EventKind::Stderr { .. } => 1,
            _ => return,
        };
        if let EventKind::Stdout { data } | EventKind::Stderr { data } = kind {
            lock(&self.proc.state).rings[slot].push(&data);
            self.dirty = true;
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        if std::mem::take(&mut self.dirty) {
            lock(&self.proc.state).notify();
        }
        Ok(())
    }

    fn peer_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }
}

#[derive(Debug, Default)]
struct Table {
    procs: BTreeMap<libc::pid_t, Arc<Proc>>,
    /// Background processes that ended, oldest first.
    ended: VecDeque<libc::pid_t>,
}

/// The process table; one per agent.
#[derive(Debug)]
pub struct Procs {
    table: Arc<Mutex<Table>>,
    passwd: PathBuf,
    user: Mutex<Option<Creds>>,
}

impl Default for Procs {
    fn default() -> Self {
        Self::new()
    }
}

impl Procs {
    /// An empty table; `user: "user"` is looked up in [`PASSWD`].
    pub fn new() -> Self {
        Self::with_passwd(PASSWD)
    }

    /// An empty table looking accounts up in `passwd` (tests).
    pub fn with_passwd(passwd: impl Into<PathBuf>) -> Self {
        Self {
            table: Arc::new(Mutex::new(Table::default())),
            passwd: passwd.into(),
            user: Mutex::new(None),
        }
    }

    fn get(&self, pid: libc::pid_t) -> Result<Arc<Proc>, ErrorInfo> {
        lock(&self.table)
            .procs
            .get(&pid)
            .cloned()
            .ok_or_else(|| no_such_process(pid, "was not started by the agent (or is collected)"))
    }

    /// Drops `proc`'s entry if it is still the one under its pid.
    fn remove(&self, proc: &Arc<Proc>) {
        let mut table = lock(&self.table);
        if table
            .procs
            .get(&proc.pid)
            .is_some_and(|p| Arc::ptr_eq(p, proc))
        {
            table.procs.remove(&proc.pid);
        }
        table.ended.retain(|&pid| pid != proc.pid);
    }

    fn creds(&self) -> Result<Creds, ErrorInfo> {
        let mut cached = lock(&self.user);
        if let Some(creds) = &*cached {
            return Ok(creds.clone());
        }
        let text = std::fs::read_to_string(&self.passwd).map_err(|e| {
            ErrorInfo::new(
                ErrorCode::SpawnFailed,
                format!("reading {}: {e}", self.passwd.display()),
            )
        })?;
        let creds = Creds::from_passwd(&text, USER_NAME).ok_or_else(|| {
            ErrorInfo::new(
                ErrorCode::SpawnFailed,
                format!(
                    "no account {USER_NAME:?} in {} (the template must create it)",
                    self.passwd.display()
                ),
            )
        })?;
        *cached = Some(creds.clone());
        Ok(creds)
    }

    /// Serves `exec`: events go to `sink`; the terminal event is queued, not flushed. `Err`
    /// only when the connection is unusable.
    pub fn exec(
        &self,
        env: &ExecEnv,
        children: &Children,
        req: &ExecRequest,
        sink: &mut dyn Sink,
    ) -> io::Result<()> {
        let creds = match req.user {
            ExecUser::Root => None,
            ExecUser::User => match self.creds() {
                Ok(creds) => Some(creds),
                Err(info) => {
                    sink.event(EventKind::Error(info));
                    return Ok(());
                }
            },
        };
        let opts = StartOptions {
            creds: creds.as_ref(),
            stdin_stream: req.stdin_stream,
        };
        let spawned = match exec::start(env, children, req, opts) {
            Ok(spawned) => spawned,
            Err(info) => {
                sink.event(EventKind::Error(info));
                return Ok(());
            }
        };
        let Spawned {
            pid,
            pidfd,
            stdin,
            stdout,
            stderr,
            master,
        } = spawned;
        // A streamed stdin belongs to the table; otherwise the pump feeds `req.stdin`.
        let (table_stdin, pump_stdin) = if req.stdin_stream {
            (stdin, None)
        } else {
            (None, stdin)
        };
        let proc = Arc::new(Proc {
            pid,
            argv: req.argv.clone(),
            background: req.background,
            stdin: Mutex::new(table_stdin),
            master: master.map(File::from),
            state: Mutex::new(State::default()),
        });
        lock(&self.table).procs.insert(pid, proc.clone());
        let deadline = exec::deadline(req);
        let pipes = [Some(stdout), stderr];

        if req.background {
            let bytes = req.stdin.clone().unwrap_or_default();
            let children_copy = children.clone();
            let thread_proc = proc.clone();
            let table = self.table.clone();
            let spawned = std::thread::Builder::new().spawn(move || {
                let mut ring = RingSink {
                    proc: thread_proc.clone(),
                    dirty: false,
                };
                let pumped =
                    exec::pump(pid, &pidfd, pump_stdin, &bytes, pipes, deadline, &mut ring);
                let timed_out = matches!(pumped, exec::Pumped::Exited { timed_out: true });
                thread_proc.mark_reaping();
                let status = children_copy
                    .wait(pid)
                    .unwrap_or(ExitStatus::Signal(libc::SIGKILL));
                let mut state = lock(&thread_proc.state);
                state.exit = Some((status, timed_out));
                state.notify();
                drop(state);
                ended(&table, pid);
            });
            if let Err(e) = spawned {
                let _ = proc.signal(libc::SIGKILL);
                let _ = children.wait(pid);
                self.remove(&proc);
                sink.event(EventKind::Error(ErrorInfo::new(
                    ErrorCode::Internal,
                    format!("starting the output thread failed: {e}"),
                )));
                return Ok(());
            }
            sink.event(EventKind::Started { pid });
            sink.event(EventKind::end(EndStatus::Ok));
            return Ok(());
        }

        // Foreground: the host may need the pid (stdin, signals) before any output.
        sink.event(EventKind::Started { pid });
        let pumped = match sink.flush() {
            Ok(()) => exec::pump(
                pid,
                &pidfd,
                pump_stdin,
                req.stdin.as_deref().unwrap_or_default(),
                pipes,
                deadline,
                sink,
            ),
            Err(e) => {
                let _ = proc.signal(libc::SIGKILL);
                exec::Pumped::Abandoned(e)
            }
        };
        proc.mark_reaping();
        let result = exec::finish(children, pid, pumped, sink);
        self.remove(&proc);
        result
    }

    /// Serves the process calls other than `exec` (others are refused as `internal`).
    pub fn serve(&self, call: Call, sink: &mut dyn Sink) -> io::Result<()> {
        let result = match call {
            Call::StdinWrite(req) => self.stdin_write(req.pid, &req.data),
            Call::StdinClose(req) => self.stdin_close(req.pid),
            Call::ProcessList => {
                let processes = lock(&self.table).procs.values().map(|p| p.info()).collect();
                sink.event(EventKind::Processes { processes });
                Ok(())
            }
            Call::ProcessAttach(req) => return self.attach(req.pid, sink),
            Call::ProcessSignal(req) => self.get(req.pid).and_then(|p| {
                if !(0..=64).contains(&req.signal) {
                    return Err(ErrorInfo::new(
                        ErrorCode::BadRequest,
                        format!("process_signal: invalid signal {}", req.signal),
                    ));
                }
                p.signal(req.signal)
            }),
            Call::ProcessResize(req) => self.resize(req.pid, req.cols, req.rows),
            other => Err(ErrorInfo::new(
                ErrorCode::Internal,
                format!("{} is not a process call", other.type_name()),
            )),
        };
        sink.event(match result {
            Ok(()) => EventKind::end(EndStatus::Ok),
            Err(info) => EventKind::Error(info),
        });
        Ok(())
    }

    fn stdin_write(&self, pid: libc::pid_t, data: &[u8]) -> Result<(), ErrorInfo> {
        let proc = self.get(pid)?;
        let io_error = |e: io::Error| {
            ErrorInfo::new(
                ErrorCode::Io,
                format!("writing to the stdin of pid {pid}: {e}"),
            )
        };
        let mut stdin = lock(&proc.stdin);
        if let Some(pipe) = stdin.as_mut() {
            return pipe.write_all(data).map_err(io_error);
        }
        drop(stdin);
        match &proc.master {
            Some(master) => {
                let mut master: &File = master;
                master.write_all(data).map_err(io_error)
            }
            None => Err(ErrorInfo::new(
                ErrorCode::BadRequest,
                format!("the stdin of pid {pid} is not a stream (start it with stdin_stream or pty) or was closed"),
            )),
        }
    }

    fn stdin_close(&self, pid: libc::pid_t) -> Result<(), ErrorInfo> {
        let proc = self.get(pid)?;
        let pipe = lock(&proc.stdin).take();
        if let Some(master) = proc.master.as_ref() {
            let mut master: &File = master;
            // A terminal has no end of input to close: send the EOF character (^D), which a
            // program reading in canonical mode sees as end of file.
            return master.write_all(&[4]).map_err(|e| {
                ErrorInfo::new(
                    ErrorCode::Io,
                    format!("writing EOF to pid {pid}'s pty: {e}"),
                )
            });
        }
        if pipe.is_none() {
            return Err(ErrorInfo::new(
                ErrorCode::BadRequest,
                format!("the stdin of pid {pid} is not a stream or was already closed"),
            ));
        }
        Ok(())
    }

    fn resize(&self, pid: libc::pid_t, cols: u16, rows: u16) -> Result<(), ErrorInfo> {
        let proc = self.get(pid)?;
        let Some(master) = &proc.master else {
            return Err(ErrorInfo::new(
                ErrorCode::BadRequest,
                format!("pid {pid} does not run on a pty"),
            ));
        };
        if cols == 0 || rows == 0 {
            return Err(ErrorInfo::new(
                ErrorCode::BadRequest,
                "process_resize: cols and rows must be at least 1",
            ));
        }
        let fd = master
            .try_clone()
            .map(OwnedFd::from)
            .map_err(|e| ErrorInfo::new(ErrorCode::Io, format!("resizing pid {pid}: {e}")))?;
        exec::set_pty_size(&fd, PtySize { cols, rows })
            .map_err(|e| ErrorInfo::new(ErrorCode::Io, format!("resizing pid {pid}: {e}")))
    }

    fn attach(&self, pid: libc::pid_t, sink: &mut dyn Sink) -> io::Result<()> {
        let proc = match self.get(pid) {
            Ok(proc) if proc.background => proc,
            Ok(_) => {
                sink.event(EventKind::Error(ErrorInfo::new(
                    ErrorCode::BadRequest,
                    format!("pid {pid} is a foreground exec: its output goes to its own call"),
                )));
                return Ok(());
            }
            Err(info) => {
                sink.event(EventKind::Error(info));
                return Ok(());
            }
        };
        let wake = match eventfd() {
            Ok(fd) => Arc::new(fd),
            Err(e) => {
                sink.event(EventKind::Error(ErrorInfo::new(
                    ErrorCode::Io,
                    format!("eventfd: {e}"),
                )));
                return Ok(());
            }
        };
        let _subscription = Subscription::new(&proc, wake.clone());
        let mut pos = [0u64; 2];
        loop {
            let mut chunks = [Vec::new(), Vec::new()];
            let exit = {
                let state = lock(&proc.state);
                for (slot, ring) in state.rings.iter().enumerate() {
                    pos[slot] = ring.since(pos[slot], &mut chunks[slot]);
                }
                state.exit
            };
            let [out, err] = chunks;
            for data in out {
                sink.event(EventKind::Stdout { data });
            }
            for data in err {
                sink.event(EventKind::Stderr { data });
            }
            if let Some((status, timed_out)) = exit {
                sink.event(EventKind::Exit(status));
                sink.event(EventKind::end(if timed_out {
                    EndStatus::TimedOut
                } else {
                    EndStatus::Ok
                }));
                self.remove(&proc);
                return Ok(());
            }
            sink.flush()?;
            wait_wake(&wake, sink.peer_fd())?;
        }
    }
}

/// An attached connection's eventfd in a process's subscriber list, removed on drop.
struct Subscription<'a> {
    proc: &'a Proc,
    fd: Arc<OwnedFd>,
}

impl<'a> Subscription<'a> {
    fn new(proc: &'a Proc, fd: Arc<OwnedFd>) -> Self {
        lock(&proc.state).subscribers.push(fd.clone());
        Self { proc, fd }
    }
}

impl Drop for Subscription<'_> {
    fn drop(&mut self) {
        lock(&self.proc.state)
            .subscribers
            .retain(|fd| !Arc::ptr_eq(fd, &self.fd));
    }
}

fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd takes no pointers and returns a new descriptor or -1.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by eventfd and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sleeps until `wake` is written (and resets it) or the peer hangs up (an error).
fn wait_wake(wake: &OwnedFd, peer: Option<std::os::fd::RawFd>) -> io::Result<()> {
    loop {
        let mut fds = [
            libc::pollfd {
                fd: wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: peer.unwrap_or(-1),
                events: libc::POLLRDHUP,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of pollfd for its length; negative fds are ignored.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if fds[1].revents & (libc::POLLHUP | libc::POLLERR | libc::POLLRDHUP) != 0 {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the host closed the connection during process_attach",
            ));
        }
        if fds[0].revents != 0 {
            let mut count = [0u8; 8];
            // SAFETY: reads 8 bytes into a live buffer from an eventfd we own.
            unsafe { libc::read(wake.as_raw_fd(), count.as_mut_ptr().cast(), count.len()) };
            return Ok(());
        }
    }
}

/// A real server on socket pairs, for the tests of this module and [`crate::files`].
#[cfg(test)]
pub(crate) mod testing {
    use std::os::unix::net::UnixStream;
    use std::sync::Arc;

    use crate::client::Client;
    use crate::exec::ExecEnv;
    use crate::reaper::Children;
    use crate::server::Server;
    use crate::system::System;

    #[derive(Debug)]
    struct NoSystem;

    impl System for NoSystem {
        fn uptime_ms(&self) -> u64 {
            1
        }
        fn boot_id(&self) -> Option<String> {
            None
        }
        fn wall_clock_ns(&self) -> i128 {
            0
        }
        fn set_wall_clock(&self, _: u64) -> std::io::Result<()> {
            Ok(())
        }
        fn add_entropy(&self, _: &[u8]) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// A server like the guest's (outside PID 1).
    pub(crate) fn server() -> Arc<Server> {
        Arc::new(Server::new(
            Box::new(NoSystem),
            Children::Direct,
            ExecEnv::new(Some(ExecEnv::open_devnull().unwrap()), true),
        ))
    }

    /// A new connection to `server`, served in its own thread.
    pub(crate) fn connect(server: &Arc<Server>) -> Client<UnixStream> {
        let (host, guest) = UnixStream::pair().unwrap();
        let server = server.clone();
        std::thread::spawn(move || server.serve_connection(guest));
        Client::new(host)
    }

    /// A raw connection to `server` (for hand-made frames).
    pub(crate) fn connect_raw(server: &Arc<Server>) -> UnixStream {
        let (host, guest) = UnixStream::pair().unwrap();
        let server = server.clone();
        std::thread::spawn(move || server.serve_connection(guest));
        host.set_read_timeout(Some(std::time::Duration::from_secs(20)))
            .unwrap();
        host
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{connect, server};
    use super::*;
    use crate::client::OutputStream;
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    fn sh(script: &str) -> ExecRequest {
        ExecRequest::new(["/bin/sh", "-c", script])
    }

    #[test]
    fn ring_keeps_the_last_bytes_and_counts_all() {
        let mut ring = Ring::default();
        ring.push(&vec![1u8; OUTPUT_KEEP]);
        ring.push(b"xyz");
        assert_eq!(ring.total, OUTPUT_KEEP as u64 + 3);
        assert_eq!(ring.buf.len(), OUTPUT_KEEP);
        let mut chunks = Vec::new();
        let pos = ring.since(ring.total - 2, &mut chunks);
        assert_eq!(chunks, [b"yz".to_vec()]);
        assert_eq!(pos, ring.total);
        let mut chunks = Vec::new();
        ring.since(0, &mut chunks);
        assert_eq!(chunks.len(), OUTPUT_KEEP / MAX_CHUNK);
        assert!(chunks.iter().all(|c| c.len() <= MAX_CHUNK));
    }

    #[test]
    fn exec_reports_started_then_output_and_exit_codes() {
        let server = server();
        let mut client = connect(&server);
        let mut pid = 0;
        let mut out = Vec::new();
        let end = client
            .exec_observed(
                &sh("echo hi; exit 3"),
                |p| pid = p,
                |_, data| {
                    out.extend_from_slice(data);
                    Ok(())
                },
            )
            .unwrap();
        assert!(pid > 0);
        assert_eq!(out, b"hi\n");
        assert_eq!(end.status, ExitStatus::Code(3));
        // Foreground processes leave the table with their call.
        assert!(client.process_list().unwrap().iter().all(|p| p.pid != pid));
    }

    #[test]
    fn stdin_streams_from_a_second_connection() {
        let server = server();
        let mut first = connect(&server);
        let mut second = connect(&server);
        let (tx, rx) = mpsc::channel();
        let runner = std::thread::spawn(move || {
            let mut req = ExecRequest::new(["cat"]);
            req.stdin_stream = true;
            let mut out = Vec::new();
            let end = first
                .exec_observed(
                    &req,
                    |pid| tx.send(pid).unwrap(),
                    |stream, data| {
                        assert_eq!(stream, OutputStream::Stdout);
                        out.extend_from_slice(data);
                        Ok(())
                    },
                )
                .unwrap();
            (out, end)
        });
        let pid = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        second.stdin_write(pid, b"hello ").unwrap();
        second.stdin_write(pid, b"world").unwrap();
        second.stdin_close(pid).unwrap();
        let (out, end) = runner.join().unwrap();
        assert_eq!(out, b"hello world");
        assert_eq!(end.status, ExitStatus::Code(0));
        // The process is gone: its pid is unknown now.
        let err = second.stdin_write(pid, b"x").unwrap_err();
        assert!(err.is_remote(ErrorCode::NoSuchProcess), "{err}");
    }

    #[test]
    fn background_output_before_the_attach_is_delivered() {
        let server = server();
        let mut client = connect(&server);
        let pid = client
            .exec_start(&sh("echo before; echo err >&2; sleep 0.3; echo after"))
            .unwrap();
        // The starting connection goes away; the process survives it.
        drop(client);
        std::thread::sleep(Duration::from_millis(100));
        let mut client = connect(&server);
        let listed = client.process_list().unwrap();
        let entry = listed.iter().find(|p| p.pid == pid).expect("listed");
        assert!(entry.background && entry.running && entry.exit.is_none());
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let end = client
            .process_attach(pid, Duration::from_secs(10), |stream, data| {
                match stream {
                    OutputStream::Stdout => out.extend_from_slice(data),
                    OutputStream::Stderr => err.extend_from_slice(data),
                }
                Ok(())
            })
            .unwrap();
        assert_eq!(out, b"before\nafter\n");
        assert_eq!(err, b"err\n");
        assert_eq!(end.status, ExitStatus::Code(0));
        // Delivered: collected.
        assert!(client.process_list().unwrap().iter().all(|p| p.pid != pid));
        let err = client
            .process_attach(pid, Duration::from_secs(1), |_, _| Ok(()))
            .unwrap_err();
        assert!(err.is_remote(ErrorCode::NoSuchProcess), "{err}");
    }

    #[test]
    fn an_ended_background_process_is_listed_until_attached() {
        let server = server();
        let mut client = connect(&server);
        let pid = client.exec_start(&sh("echo done; exit 7")).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let list = client.process_list().unwrap();
            let entry = list.iter().find(|p| p.pid == pid).expect("kept");
            if !entry.running {
                assert_eq!(entry.exit, Some(ExitStatus::Code(7)));
                break;
            }
            assert!(Instant::now() < deadline);
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut out = Vec::new();
        let end = client
            .process_attach(pid, Duration::from_secs(5), |_, d| {
                out.extend_from_slice(d);
                Ok(())
            })
            .unwrap();
        assert_eq!(
            (out.as_slice(), end.status),
            (&b"done\n"[..], ExitStatus::Code(7))
        );
    }

    #[test]
    fn process_signal_reaches_the_group() {
        let server = server();
        let mut client = connect(&server);
        let pid = client.exec_start(&sh("sleep 30 & wait")).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        client.process_signal(pid, libc::SIGTERM).unwrap();
        let end = client
            .process_attach(pid, Duration::from_secs(10), |_, _| Ok(()))
            .unwrap();
        assert_eq!(end.status, ExitStatus::Signal(libc::SIGTERM));
        let err = client.process_signal(pid, libc::SIGTERM).unwrap_err();
        assert!(err.is_remote(ErrorCode::NoSuchProcess), "{err}");
        let err = client.process_signal(1 << 20, libc::SIGTERM).unwrap_err();
        assert!(err.is_remote(ErrorCode::NoSuchProcess), "{err}");
    }

    #[test]
    fn pty_programs_see_a_terminal_and_its_size() {
        let server = server();
        let mut client = connect(&server);
        let mut req = sh("tty; stty size");
        req.pty = Some(PtySize {
            cols: 100,
            rows: 30,
        });
        let mut out = Vec::new();
        let end = client
            .exec_observed(
                &req,
                |_| {},
                |stream, data| {
                    assert_eq!(stream, OutputStream::Stdout);
                    out.extend_from_slice(data);
                    Ok(())
                },
            )
            .unwrap();
        let text = String::from_utf8_lossy(&out);
        assert!(text.contains("/dev/pts/"), "{text}");
        assert!(text.contains("30 100"), "{text}");
        assert_eq!(end.status, ExitStatus::Code(0));

        // Resize a running one, then let it print its size.
        let mut req = sh("read line; stty size");
        req.pty = Some(PtySize { cols: 80, rows: 24 });
        let pid = client.exec_start(&req).unwrap();
        client.process_resize(pid, 120, 40).unwrap();
        client.stdin_write(pid, b"go\n").unwrap();
        let mut out = Vec::new();
        client
            .process_attach(pid, Duration::from_secs(10), |_, d| {
                out.extend_from_slice(d);
                Ok(())
            })
            .unwrap();
        let text = String::from_utf8_lossy(&out);
        assert!(text.contains("40 120"), "{text}");
        // Resizing a process without a pty is refused.
        let pid = client.exec_start(&sh("sleep 5")).unwrap();
        let err = client.process_resize(pid, 1, 1).unwrap_err();
        assert!(err.is_remote(ErrorCode::BadRequest), "{err}");
        client.process_signal(pid, libc::SIGKILL).unwrap();
    }

    /// Collects events from a direct call of the table.
    #[derive(Default)]
    struct Events(Vec<EventKind>);

    impl Sink for Events {
        fn event(&mut self, kind: EventKind) {
            self.0.push(kind);
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
        fn peer_fd(&self) -> Option<std::os::fd::RawFd> {
            None
        }
    }

    #[test]
    fn user_runs_as_the_unprivileged_account() {
        let dir = tempfile::tempdir().unwrap();
        let passwd = dir.path().join("passwd");
        std::fs::write(
            &passwd,
            "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n",
        )
        .unwrap();
        let procs = Procs::with_passwd(&passwd);
        let env = ExecEnv::new(None, true);
        let mut req = sh("id -u; id -g; echo $HOME");
        req.user = ExecUser::User;
        let mut events = Events::default();
        procs
            .exec(&env, &Children::Direct, &req, &mut events)
            .unwrap();
        let out: Vec<u8> = events
            .0
            .iter()
            .filter_map(|e| match e {
                EventKind::Stdout { data } => Some(data.clone()),
                _ => None,
            })
            .flatten()
            .collect();
        // SAFETY: geteuid has no memory effects.
        if unsafe { libc::geteuid() } == 0 {
            assert_eq!(String::from_utf8_lossy(&out), "1000\n1000\n/home/user\n");
        }
        // No such account: a clear error.
        let procs = Procs::with_passwd(dir.path().join("missing"));
        let mut events = Events::default();
        procs
            .exec(&env, &Children::Direct, &req, &mut events)
            .unwrap();
        assert!(
            matches!(&events.0[..], [EventKind::Error(i)] if i.code == ErrorCode::SpawnFailed),
            "{:?}",
            events.0
        );
    }

    #[test]
    fn ended_entries_are_bounded_oldest_first() {
        let procs = Procs::new();
        let fake = |pid| {
            Arc::new(Proc {
                pid,
                argv: vec![],
                background: true,
                stdin: Mutex::new(None),
                master: None,
                state: Mutex::new(State {
                    exit: Some((ExitStatus::Code(0), false)),
                    ..State::default()
                }),
            })
        };
        for pid in 1..=(MAX_ENDED as i32 + 6) {
            lock(&procs.table).procs.insert(pid, fake(pid));
            ended(&procs.table, pid);
        }
        let table = lock(&procs.table);
        assert_eq!(table.procs.len(), MAX_ENDED);
        assert_eq!(table.procs.keys().next(), Some(&7), "the oldest went first");
    }

    #[test]
    fn passwd_lines_parse() {
        let text =
            "root:x:0:0:root:/root:/bin/bash\nbad line\nuser:x:1000:1001:U:/home/user:/bin/sh";
        assert_eq!(
            Creds::from_passwd(text, "user"),
            Some(Creds {
                uid: 1000,
                gid: 1001,
                name: "user".into(),
                home: "/home/user".into()
            })
        );
        assert_eq!(Creds::from_passwd(text, "nobody"), None);
    }

    #[test]
    fn bad_stdin_combinations_are_refused() {
        let server = server();
        let mut client = connect(&server);
        let mut req = ExecRequest::new(["cat"]);
        req.stdin_stream = true;
        req.stdin = Some(b"x".to_vec());
        let err = client.exec(&req).unwrap_err();
        assert!(err.is_remote(ErrorCode::BadRequest), "{err}");
        let pid = client.exec_start(&sh("sleep 5")).unwrap();
        let err = client.stdin_write(pid, b"x").unwrap_err();
        assert!(err.is_remote(ErrorCode::BadRequest), "{err}");
        client.process_signal(pid, libc::SIGKILL).unwrap();
        client.ping().unwrap();
    }
}
