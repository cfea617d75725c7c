//! The agent's server: serves the protocol on every connection a [`Listener`] accepts.
//!
//! Threads are created ahead of need (at boot, so that a restored clone already has them): a
//! few workers each block in `accept` on the shared listener and then serve their connection
//! with blocking reads and writes, one call after the other. When the last idle worker takes a
//! connection it starts another (up to [`PoolConfig::max_workers`]). So a `ping` on an open
//! connection costs one `read` and one `write`, and on a fresh one an `accept` more; no thread
//! is created on the way.
//!
//! Calls on one connection are served in order, so a `sync` sent first after a restore is
//! applied before anything else on that connection is answered (and requests pipelined behind
//! it are only read afterwards). The server is generic over the listener so that tests run it
//! on Unix sockets; the guest uses [`crate::vsock::VsockListener`].

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::contexts::{ContextConfig, Contexts};
use crate::exec::{ExecEnv, Sink};
use crate::files::{self, Wire};
use crate::procs::Procs;
use crate::protocol::{
    self, Call, EndStatus, ErrorCode, ErrorInfo, Event, EventKind, Frame, FrameError, FrameReader,
    Pong, SyncRequest, Synced, CONNECTION_ID, MAX_FRAME, PROTOCOL_VERSION,
};
use crate::reaper::Children;
use crate::system::System;

/// A source of connections.
pub trait Listener: Send + Sync + 'static {
    /// The connection type.
    type Stream: Read + Write + AsFd + Send + 'static;
    /// Waits for the next connection (called from several threads at once).
    fn accept(&self) -> io::Result<Self::Stream>;
}

impl Listener for UnixListener {
    type Stream = UnixStream;

    fn accept(&self) -> io::Result<UnixStream> {
        UnixListener::accept(self).map(|(stream, _)| stream)
    }
}

/// Serves the protocol; shared by all workers.
pub struct Server {
    system: Box<dyn System>,
    children: Children,
    exec: ExecEnv,
    /// The processes `exec` started (shared by all connections).
    procs: Procs,
    /// The code contexts (`run_code` and friends).
    contexts: Arc<Contexts>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("children", &self.children)
            .field("exec", &self.exec)
            .finish_non_exhaustive()
    }
}

/// The events of the current call, queued until they are flushed in one write.
struct Conn<'a, S> {
    stream: &'a mut S,
    out: Vec<u8>,
    id: u64,
}

impl<S: Read + Write + AsFd> Sink for Conn<'_, S> {
    fn event(&mut self, kind: EventKind) {
        let event = Event {
            id: self.id,
            event: kind,
        };
        if let Err(e) = protocol::encode_frame(&event, &mut self.out, MAX_FRAME) {
            // Unreachable with the agent's bounded events; never send a frame over the limit.
            let event = Event {
                id: self.id,
                event: EventKind::Error(ErrorInfo::new(
                    ErrorCode::Internal,
                    format!("event not sent: {e}"),
                )),
            };
            let _ = protocol::encode_frame(&event, &mut self.out, MAX_FRAME);
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.out.is_empty() {
            return Ok(());
        }
        let result = self.stream.write_all(&self.out);
        self.out.clear();
        result
    }

    fn peer_fd(&self) -> Option<RawFd> {
        Some(self.stream.as_fd().as_raw_fd())
    }
}

impl<S: Read + Write + AsFd> Wire for Conn<'_, S> {
    fn out(&mut self) -> &mut Vec<u8> {
        &mut self.out
    }

    fn call_id(&self) -> u64 {
        self.id
    }

    fn event_for(&mut self, id: u64, kind: EventKind) {
        let current = std::mem::replace(&mut self.id, id);
        self.event(kind);
        self.id = current;
    }

    fn read_any<'r>(
        &mut self,
        reader: &'r mut FrameReader,
    ) -> Result<Option<Frame<'r>>, FrameError> {
        let fd = self.stream.as_fd().as_raw_fd();
        reader.read_any_socket(&mut *self.stream, fd)
    }
}

/// Output buffer capacity kept between calls (a `file_read` grows it to a binary chunk).
const KEEP_OUT: usize = 256 * 1024;

impl Server {
    /// A server using `system` for `ping`/`sync`, `children` to wait for programs, and `exec`
    /// for what programs get.
    pub fn new(system: Box<dyn System>, children: Children, exec: ExecEnv) -> Self {
        let contexts = Arc::new(Contexts::new(ContextConfig::from_env(), children.clone()));
        Self {
            system,
            children,
            exec,
            procs: Procs::new(),
            contexts,
        }
    }

    /// Replaces the code contexts' configuration (before serving: tests point it at the
    /// repository's driver).
    pub fn with_context_config(mut self, config: ContextConfig) -> Self {
        self.contexts = Arc::new(Contexts::new(config, self.children.clone()));
        self
    }

    /// The code contexts.
    pub fn contexts(&self) -> &Arc<Contexts> {
        &self.contexts
    }

    /// Serves one connection until the host closes it (`Ok`) or it becomes unusable (`Err`:
    /// an I/O error, a truncated frame, or a frame over [`MAX_FRAME`], which is answered with
    /// a `frame_too_large` error before closing).
    pub fn serve_connection<S: Read + Write + AsFd>(&self, mut stream: S) -> io::Result<()> {
        // Binary frames up to the JSON limit are read (and a `file_write` answers those over
        // MAX_BINARY_CHUNK with `oversize_chunk`); larger ones close the connection.
        let mut reader = FrameReader::new(MAX_FRAME);
        let mut conn = Conn {
            stream: &mut stream,
            out: Vec::with_capacity(4096),
            id: CONNECTION_ID,
        };
        loop {
            let request = match reader.read_any(&mut *conn.stream) {
                Ok(Some(Frame::Json(body))) => protocol::decode_request(body),
                Ok(Some(Frame::Binary { id, .. })) => Err((
                    id,
                    ErrorInfo::new(
                        ErrorCode::BadRequest,
                        format!(
                            "binary frame for call {id}, which is not a file_write in progress"
                        ),
                    ),
                )),
                Ok(None) => return Ok(()),
                Err(e @ FrameError::ShortBinary { .. }) => Err((
                    CONNECTION_ID,
                    ErrorInfo::new(ErrorCode::BadFrame, e.to_string()),
                )),
                Err(FrameError::Io(e)) => return Err(e),
                Err(e @ FrameError::TooLarge { .. }) => {
                    // The stream cannot be resynchronised without reading the body; say why and
                    // close.
                    conn.id = CONNECTION_ID;
                    conn.event(EventKind::Error(ErrorInfo::new(
                        ErrorCode::FrameTooLarge,
                        e.to_string(),
                    )));
                    let _ = conn.flush();
                    return Err(io::Error::new(io::ErrorKind::InvalidData, e.to_string()));
                }
                Err(e) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, e.to_string())),
            };
            match request {
                Ok(request) => {
                    conn.id = request.id;
                    self.dispatch(request.call, &mut conn, &mut reader)?;
                }
                Err((id, info)) => {
                    conn.id = id;
                    conn.event(EventKind::Error(info));
                }
            }
            conn.flush()?;
            if conn.out.capacity() > KEEP_OUT {
                conn.out = Vec::with_capacity(4096);
            }
        }
    }

    fn dispatch<S: Read + Write + AsFd>(
        &self,
        call: Call,
        conn: &mut Conn<'_, S>,
        reader: &mut FrameReader,
    ) -> io::Result<()> {
        match call {
            Call::Ping => {
                conn.event(EventKind::Pong(self.pong()));
                conn.event(EventKind::end(EndStatus::Ok));
            }
            Call::Sync(sync) => match self.sync(&sync) {
                Ok(synced) => {
                    conn.event(EventKind::Synced(synced));
                    conn.event(EventKind::end(EndStatus::Ok));
                }
                Err(info) => conn.event(EventKind::Error(info)),
            },
            Call::Exec(req) => self.procs.exec(&self.exec, &self.children, &req, conn)?,
            call @ (Call::FileRead(_)
            | Call::FileWrite(_)
            | Call::FileList(_)
            | Call::FileStat(_)
            | Call::FileMkdir(_)
            | Call::FileRemove(_)
            | Call::FileRename(_)
            | Call::FileWatch(_)) => files::serve(call, conn, reader)?,
            call @ (Call::StdinWrite(_)
            | Call::StdinClose(_)
            | Call::ProcessList
            | Call::ProcessAttach(_)
            | Call::ProcessSignal(_)
            | Call::ProcessResize(_)) => self.procs.serve(call, conn)?,
            Call::ContextCreate(req) => self.contexts.context_create(&req, conn),
            Call::ContextList => self.contexts.context_list(conn),
            Call::ContextRestart(req) => self.contexts.context_restart(&req, conn),
            Call::ContextRemove(req) => self.contexts.context_remove(&req, conn),
            Call::RunCode(req) => self.contexts.run_code(&req, conn)?,
            Call::Interrupt(req) => self.contexts.interrupt(&req, conn),
            Call::Warmup(req) => self.contexts.warmup(&req, conn)?,
        }
        Ok(())
    }

    fn pong(&self) -> Pong {
        Pong {
            uptime_ms: self.system.uptime_ms(),
            boot_id: self.system.boot_id(),
            protocol: PROTOCOL_VERSION,
            agent_version: env!("CARGO_PKG_VERSION").to_owned(),
        }
    }

    /// Sets the clock, then reseeds the RNG; both are attempted even if one fails. The clock
    /// goes first: the host read it when it sent the call, so every guest syscall before the
    /// set leaves the guest that much behind (each costs milliseconds on kvm_pvm).
    fn sync(&self, req: &SyncRequest) -> Result<Synced, ErrorInfo> {
        protocol::check_sync(req)?;
        let before = self.system.wall_clock_ns();
        let clock = self.system.set_wall_clock(req.wall_clock_ns);
        let entropy = self.system.add_entropy(&req.entropy);
        let mut failures = Vec::new();
        if let Err(e) = entropy {
            failures.push(format!("reseeding the RNG failed: {e}"));
        }
        if let Err(e) = clock {
            failures.push(format!("setting the clock failed: {e}"));
        }
        if !failures.is_empty() {
            return Err(ErrorInfo::new(ErrorCode::SyncFailed, failures.join("; ")));
        }
        self.contexts.note_sync();
        let step = i128::from(req.wall_clock_ns) - before;
        Ok(Synced {
            clock_step_ns: i64::try_from(step).unwrap_or(if step < 0 {
                i64::MIN
            } else {
                i64::MAX
            }),
        })
    }
}

/// How many worker threads serve connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// Workers started up front (each costs a handful of syscalls at boot).
    pub workers: usize,
    /// Most workers ever (concurrent connections beyond this wait in the backlog).
    pub max_workers: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            workers: 2,
            max_workers: 64,
        }
    }
}

#[derive(Debug, Default)]
struct PoolState {
    /// Workers waiting in `accept`.
    idle: AtomicUsize,
    /// Workers alive.
    total: AtomicUsize,
    /// Connections accepted so far.
    accepted: AtomicUsize,
}

/// The running workers (they are detached; this only observes them).
#[derive(Debug, Clone)]
pub struct Pool {
    state: Arc<PoolState>,
}

impl Pool {
    /// Workers alive.
    pub fn workers(&self) -> usize {
        self.state.total.load(Ordering::Relaxed)
    }

    /// Workers waiting for a connection.
    pub fn idle(&self) -> usize {
        self.state.idle.load(Ordering::Relaxed)
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.state.accepted.load(Ordering::Relaxed)
    }
}

/// Starts the workers and returns at once. Fails only if not even one worker could start.
pub fn serve<L: Listener>(
    server: Arc<Server>,
    listener: Arc<L>,
    config: PoolConfig,
) -> io::Result<Pool> {
    let state = Arc::new(PoolState::default());
    let max = config.max_workers.max(1);
    let mut first_error = None;
    for _ in 0..config.workers.clamp(1, max) {
        if let Err(e) = spawn_worker(&server, &listener, &state, max) {
            first_error.get_or_insert(e);
        }
    }
    match first_error {
        Some(e) if state.total.load(Ordering::Relaxed) == 0 => Err(e),
        _ => Ok(Pool { state }),
    }
}

fn spawn_worker<L: Listener>(
    server: &Arc<Server>,
    listener: &Arc<L>,
    state: &Arc<PoolState>,
    max: usize,
) -> io::Result<()> {
    let reserved = state
        .total
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
            (t < max).then_some(t + 1)
        });
    if reserved.is_err() {
        return Ok(());
    }
    state.idle.fetch_add(1, Ordering::AcqRel);
    let (server, listener, worker_state) = (server.clone(), listener.clone(), state.clone());
    // Unnamed: naming a thread costs a prctl in the guest.
    let spawned =
        std::thread::Builder::new().spawn(move || worker(&server, &listener, &worker_state, max));
    if let Err(e) = spawned {
        state.idle.fetch_sub(1, Ordering::AcqRel);
        state.total.fetch_sub(1, Ordering::AcqRel);
        return Err(e);
    }
    Ok(())
}

fn worker<L: Listener>(
    server: &Arc<Server>,
    listener: &Arc<L>,
    state: &Arc<PoolState>,
    max: usize,
) {
    loop {
        let stream = match listener.accept() {
            Ok(stream) => stream,
            Err(e) => match e.raw_os_error() {
                Some(libc::EINTR | libc::ECONNABORTED | libc::EPROTO | libc::ECONNRESET) => {
                    continue
                }
                Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
                // The listener is gone (shut down or closed): this worker ends.
                _ => {
                    state.idle.fetch_sub(1, Ordering::AcqRel);
                    state.total.fetch_sub(1, Ordering::AcqRel);
                    return;
                }
            },
        };
        state.accepted.fetch_add(1, Ordering::Relaxed);
        if state.idle.fetch_sub(1, Ordering::AcqRel) == 1 {
            // This was the last idle worker: make sure the next connection finds one.
            let _ = spawn_worker(server, listener, state, max);
        }
        // Errors end the connection; they are the host's to see (it reads EOF).
        let _ = server.serve_connection(stream);
        state.idle.fetch_add(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{
        decode_event, encode_frame, ExecRequest, ExitStatus, Request, MAX_ENTROPY, MIN_ENTROPY,
    };
    use std::sync::Mutex;
    use std::time::Instant;

    /// Records what `sync` asked for instead of touching the host.
    #[derive(Debug, Default)]
    struct FakeSystem {
        calls: Mutex<Vec<String>>,
        fail_entropy: bool,
        fail_clock: bool,
    }

    impl System for Arc<FakeSystem> {
        fn uptime_ms(&self) -> u64 {
            42
        }
        fn boot_id(&self) -> Option<String> {
            Some("fake-boot".into())
        }
        fn wall_clock_ns(&self) -> i128 {
            1_000
        }
        fn set_wall_clock(&self, ns: u64) -> io::Result<()> {
            self.calls.lock().unwrap().push(format!("clock {ns}"));
            if self.fail_clock {
                return Err(io::Error::from_raw_os_error(libc::EPERM));
            }
            Ok(())
        }
        fn add_entropy(&self, bytes: &[u8]) -> io::Result<()> {
            self.calls
                .lock()
                .unwrap()
                .push(format!("entropy {}", bytes.len()));
            if self.fail_entropy {
                return Err(io::Error::from_raw_os_error(libc::EPERM));
            }
            Ok(())
        }
    }

    fn server_with(system: Arc<FakeSystem>) -> Arc<Server> {
        Arc::new(Server::new(
            Box::new(system),
            Children::Direct,
            ExecEnv::new(Some(ExecEnv::open_devnull().unwrap()), true),
        ))
    }

    /// A server on one end of a socket pair, in its own thread; returns our end.
    fn connected(server: Arc<Server>) -> (UnixStream, std::thread::JoinHandle<io::Result<()>>) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let handle = std::thread::spawn(move || server.serve_connection(theirs));
        ours.set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        (ours, handle)
    }

    fn send(stream: &mut UnixStream, id: u64, call: Call) {
        protocol::write_frame(stream, &Request { id, call }).unwrap();
    }

    /// Reads events until a terminal one.
    fn events_until_end(reader: &mut FrameReader, stream: &mut UnixStream) -> Vec<Event> {
        let mut events = Vec::new();
        loop {
            let body = reader.read_frame(stream).unwrap().expect("event");
            let event = decode_event(body).unwrap();
            let done = event.event.is_terminal();
            events.push(event);
            if done {
                return events;
            }
        }
    }

    fn kinds(events: &[Event]) -> Vec<EventKind> {
        events.iter().map(|e| e.event.clone()).collect()
    }

    fn end_ok() -> EventKind {
        EventKind::end(EndStatus::Ok)
    }

    #[test]
    fn ping_answers_pong_then_end_in_one_write() {
        let (mut stream, server) = connected(server_with(Arc::default()));
        send(&mut stream, 1, Call::Ping);
        // Both frames arrive together: one read gets them.
        let mut reader = FrameReader::new(MAX_FRAME);
        std::thread::sleep(Duration::from_millis(50));
        reader.fill(&mut stream).unwrap();
        let first = decode_event(reader.next_buffered().unwrap().unwrap()).unwrap();
        let second = decode_event(reader.next_buffered().unwrap().unwrap()).unwrap();
        assert_eq!(first.id, 1);
        assert_eq!(
            first.event,
            EventKind::Pong(Pong {
                uptime_ms: 42,
                boot_id: Some("fake-boot".into()),
                protocol: PROTOCOL_VERSION,
                agent_version: env!("CARGO_PKG_VERSION").into(),
            })
        );
        assert_eq!((second.id, second.event), (1, end_ok()));
        drop(stream);
        server.join().unwrap().unwrap();
    }

    #[test]
    fn sync_applies_entropy_and_clock() {
        let system = Arc::new(FakeSystem::default());
        let (mut stream, _server) = connected(server_with(system.clone()));
        let mut reader = FrameReader::new(MAX_FRAME);
        send(
            &mut stream,
            5,
            Call::Sync(SyncRequest {
                wall_clock_ns: 3_000,
                entropy: vec![7; 64],
            }),
        );
        let events = events_until_end(&mut reader, &mut stream);
        assert_eq!(
            kinds(&events),
            [
                EventKind::Synced(Synced {
                    clock_step_ns: 2_000
                }),
                end_ok()
            ]
        );
        assert_eq!(*system.calls.lock().unwrap(), ["clock 3000", "entropy 64"]);
    }

    #[test]
    fn sync_errors_name_what_failed_and_bad_arguments_change_nothing() {
        let system = Arc::new(FakeSystem {
            fail_entropy: true,
            fail_clock: true,
            ..FakeSystem::default()
        });
        let (mut stream, _server) = connected(server_with(system.clone()));
        let mut reader = FrameReader::new(MAX_FRAME);
        let sync = |len| {
            Call::Sync(SyncRequest {
                wall_clock_ns: 3_000,
                entropy: vec![1; len],
            })
        };
        send(&mut stream, 1, sync(MIN_ENTROPY));
        match kinds(&events_until_end(&mut reader, &mut stream)).as_slice() {
            [EventKind::Error(info)] => {
                assert_eq!(info.code, ErrorCode::SyncFailed);
                assert!(
                    info.message.contains("reseeding the RNG failed"),
                    "{}",
                    info.message
                );
                assert!(
                    info.message.contains("setting the clock failed"),
                    "{}",
                    info.message
                );
            }
            other => panic!("{other:?}"),
        }
        system.calls.lock().unwrap().clear();
        for len in [MIN_ENTROPY - 1, MAX_ENTROPY + 1] {
            send(&mut stream, 2, sync(len));
            match kinds(&events_until_end(&mut reader, &mut stream)).as_slice() {
                [EventKind::Error(info)] => assert_eq!(info.code, ErrorCode::BadRequest),
                other => panic!("{other:?}"),
            }
        }
        assert!(system.calls.lock().unwrap().is_empty());
    }

    #[test]
    fn unknown_calls_and_garbage_get_errors_and_the_connection_survives() {
        let (mut stream, _server) = connected(server_with(Arc::default()));
        let mut reader = FrameReader::new(MAX_FRAME);
        let raw = |stream: &mut UnixStream, body: &[u8]| {
            let mut frame = (body.len() as u32).to_le_bytes().to_vec();
            frame.extend_from_slice(body);
            stream.write_all(&frame).unwrap();
        };
        raw(
            &mut stream,
            br#"{"id":3,"call":{"type":"teleport","code":"1"}}"#,
        );
        let events = events_until_end(&mut reader, &mut stream);
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].id, 3);
        assert!(
            matches!(&events[0].event, EventKind::Error(i) if i.code == ErrorCode::UnknownCall)
        );

        raw(&mut stream, b"\xff not json");
        let events = events_until_end(&mut reader, &mut stream);
        assert_eq!(events[0].id, CONNECTION_ID);
        assert!(matches!(&events[0].event, EventKind::Error(i) if i.code == ErrorCode::BadFrame));

        raw(
            &mut stream,
            br#"{"id":4,"call":{"type":"exec","argv":"ls"}}"#,
        );
        let events = events_until_end(&mut reader, &mut stream);
        assert_eq!(events[0].id, 4);
        assert!(matches!(&events[0].event, EventKind::Error(i) if i.code == ErrorCode::BadRequest));

        send(&mut stream, 5, Call::Ping);
        let events = events_until_end(&mut reader, &mut stream);
        assert_eq!(
            events.last().map(|e| (e.id, e.event.clone())),
            Some((5, end_ok()))
        );
    }

    #[test]
    fn oversized_frames_are_answered_then_the_connection_closes() {
        let (mut stream, server) = connected(server_with(Arc::default()));
        stream.write_all(&(MAX_FRAME + 1).to_le_bytes()).unwrap();
        let mut reader = FrameReader::new(MAX_FRAME);
        let events = events_until_end(&mut reader, &mut stream);
        assert_eq!(events[0].id, CONNECTION_ID);
        assert!(matches!(
            &events[0].event,
            EventKind::Error(i) if i.code == ErrorCode::FrameTooLarge && i.message.contains("16777217")
        ));
        assert!(reader.read_frame(&mut stream).unwrap().is_none(), "closed");
        assert!(server.join().unwrap().is_err());
    }

    #[test]
    fn truncated_frames_end_the_connection_quietly() {
        let (mut stream, server) = connected(server_with(Arc::default()));
        let mut frame = Vec::new();
        encode_frame(
            &Request {
                id: 1,
                call: Call::Ping,
            },
            &mut frame,
            MAX_FRAME,
        )
        .unwrap();
        stream.write_all(&frame[..frame.len() - 2]).unwrap();
        stream.shutdown(std::net::Shutdown::Write).unwrap();
        let err = server.join().unwrap().unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        let mut rest = Vec::new();
        stream.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty(), "no answer to a truncated frame");
    }

    #[test]
    fn pipelined_requests_are_answered_in_order() {
        let system = Arc::new(FakeSystem::default());
        let (mut stream, _server) = connected(server_with(system.clone()));
        let mut frames = Vec::new();
        let sync = Request {
            id: 1,
            call: Call::Sync(SyncRequest {
                wall_clock_ns: 9,
                entropy: vec![0; 32],
            }),
        };
        encode_frame(&sync, &mut frames, MAX_FRAME).unwrap();
        let exec = Request {
            id: 2,
            call: Call::Exec(ExecRequest::new(["/bin/echo", "after sync"])),
        };
        encode_frame(&exec, &mut frames, MAX_FRAME).unwrap();
        stream.write_all(&frames).unwrap();
        let mut reader = FrameReader::new(MAX_FRAME);
        let first = events_until_end(&mut reader, &mut stream);
        assert!(first.iter().all(|e| e.id == 1));
        let second = events_until_end(&mut reader, &mut stream);
        assert!(second.iter().all(|e| e.id == 2));
        assert!(matches!(second[0].event, EventKind::Started { pid } if pid > 0));
        assert_eq!(
            kinds(&second[1..]),
            [
                EventKind::Stdout {
                    data: b"after sync\n".to_vec()
                },
                EventKind::Exit(ExitStatus::Code(0)),
                end_ok()
            ]
        );
    }

    #[test]
    fn pool_serves_concurrent_connections_and_grows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let listener = Arc::new(UnixListener::bind(&path).unwrap());
        let pool = serve(
            server_with(Arc::default()),
            listener.clone(),
            PoolConfig {
                workers: 1,
                max_workers: 3,
            },
        )
        .unwrap();
        assert_eq!(pool.workers(), 1);

        // A long exec holds one worker; a ping on a second connection is still answered.
        let mut long = UnixStream::connect(&path).unwrap();
        let mut req = ExecRequest::new(["/bin/sh", "-c", "echo started; sleep 1"]);
        req.timeout_ms = Some(10_000);
        send(&mut long, 1, Call::Exec(req));
        let mut long_reader = FrameReader::new(MAX_FRAME);
        let body = long_reader.read_frame(&mut long).unwrap().unwrap();
        assert!(matches!(
            decode_event(body).unwrap().event,
            EventKind::Started { .. }
        ));
        let body = long_reader.read_frame(&mut long).unwrap().unwrap();
        assert!(matches!(
            decode_event(body).unwrap().event,
            EventKind::Stdout { .. }
        ));

        let started = Instant::now();
        let mut quick = UnixStream::connect(&path).unwrap();
        quick
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        send(&mut quick, 1, Call::Ping);
        let mut reader = FrameReader::new(MAX_FRAME);
        let events = events_until_end(&mut reader, &mut quick);
        assert!(matches!(events[0].event, EventKind::Pong(_)));
        assert!(
            started.elapsed() < Duration::from_millis(900),
            "{:?}",
            started.elapsed()
        );
        assert!(
            pool.workers() >= 2 && pool.workers() <= 3,
            "{}",
            pool.workers()
        );

        drop((long, quick));
        // Shutting the listener down ends the idle workers.
        // SAFETY: shutdown on a socket we own; no memory effects.
        unsafe { libc::shutdown(listener.as_raw_fd(), libc::SHUT_RDWR) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while pool.workers() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(pool.workers(), 0);
        assert_eq!(pool.accepted(), 2);
    }
}
