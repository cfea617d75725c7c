//! The host's side of the protocol: a blocking client.
//!
//! The guest is hostile, so everything it sends is bounded: frames by
//! [`ClientLimits::max_frame`], collected output by [`ClientLimits::max_output`], and every call
//! by a deadline that covers the whole exchange (a guest that trickles one byte at a time still
//! runs into it). A frame that cannot be decoded, or a broken stream, makes the client refuse
//! further calls ([`ClientError::Broken`]); a timeout does not, because the framing is intact:
//! events of an abandoned call that arrive later are skipped by their id.
//!
//! The host reaches the guest through the VMM's vsock Unix socket: [`Client::connect_uds`]
//! connects to it, sends `CONNECT <port>\n` and expects `OK <host port>\n`.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use thiserror::Error;

use crate::protocol::{
    self, Call, ContextCreateRequest, ContextInfo, ContextRef, EndStatus, ErrorCode, ErrorInfo,
    Event, EventKind, ExecRequest, ExitStatus, Frame, FrameError, FrameReader, Pong,
    RunCodeRequest, SyncRequest, Synced, WarmupRequest, CONNECTION_ID, MAX_BINARY_CHUNK, MAX_FRAME,
};

/// A byte stream whose blocking reads and writes can be given a timeout.
pub trait Transport: Read + Write {
    /// Sets the read timeout (`None`: block forever).
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    /// Sets the write timeout (`None`: block forever).
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
}

impl Transport for UnixStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        UnixStream::set_read_timeout(self, timeout)
    }
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        UnixStream::set_write_timeout(self, timeout)
    }
}

impl Transport for TcpStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        TcpStream::set_read_timeout(self, timeout)
    }
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        TcpStream::set_write_timeout(self, timeout)
    }
}

/// Longest `OK <port>\n` reply accepted from the VMM.
pub const MAX_HANDSHAKE_REPLY: usize = 32;

/// Bytes of entropy [`Client::sync_now`] sends.
pub const SYNC_ENTROPY: usize = 64;

/// Bounds on what the client accepts from the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientLimits {
    /// Largest event frame body accepted.
    pub max_frame: u32,
    /// Most stdout plus stderr bytes [`Client::exec`] collects.
    pub max_output: usize,
    /// Deadline of calls without a time limit of their own (`ping`, `sync`, `exec` without
    /// `timeout_ms`).
    pub timeout: Duration,
    /// Added to an `exec`'s `timeout_ms` for the client's deadline: the agent needs a moment to
    /// kill the program and report.
    pub exec_grace: Duration,
}

impl Default for ClientLimits {
    fn default() -> Self {
        Self {
            max_frame: MAX_FRAME,
            max_output: 64 * 1024 * 1024,
            timeout: Duration::from_secs(30),
            exec_grace: Duration::from_secs(5),
        }
    }
}

/// A call that failed.
#[derive(Debug, Error)]
pub enum ClientError {
    /// Connecting, reading or writing failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// The VMM's `CONNECT` handshake failed.
    #[error("vsock handshake failed: {0}")]
    Handshake(String),
    /// The deadline passed.
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// What was being done.
        what: String,
        /// The time allowed.
        after: Duration,
    },
    /// The guest sent a frame over the limit or closed the connection inside one.
    #[error("bad frame from the guest: {0}")]
    Frame(#[source] FrameError),
    /// The guest sent a frame that is not a valid event.
    #[error("undecodable event from the guest: {0}")]
    Decode(#[source] serde_json::Error),
    /// The guest sent valid events that make no sense for the call.
    #[error("protocol violation by the guest: {0}")]
    Protocol(String),
    /// The guest closed the connection.
    #[error("the guest closed the connection")]
    Closed,
    /// The agent answered with an error event.
    #[error("the agent refused the call: {0}")]
    Remote(ErrorInfo),
    /// `exec` output went over [`ClientLimits::max_output`].
    #[error("the program's output exceeds the limit of {limit} bytes")]
    OutputLimit {
        /// The limit.
        limit: usize,
    },
    /// An earlier error left the connection unusable.
    #[error("the connection is unusable after an earlier error: {0}")]
    Broken(String),
    /// The host's RNG failed.
    #[error("getrandom failed: {0}")]
    Entropy(#[source] io::Error),
}

impl ClientError {
    /// Whether the guest answered with an error of this code.
    pub fn is_remote(&self, code: ErrorCode) -> bool {
        matches!(self, ClientError::Remote(info) if info.code == code)
    }
}

/// What [`Client::exec`] collected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    /// Everything the program wrote to stdout.
    pub stdout: Vec<u8>,
    /// Everything the program wrote to stderr.
    pub stderr: Vec<u8>,
    /// How it ended.
    pub status: ExitStatus,
    /// Whether the time limit killed it.
    pub timed_out: bool,
}

/// Which output stream a chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputStream {
    /// stdout.
    Stdout,
    /// stderr.
    Stderr,
}

/// How a streamed exec ended (see [`Client::exec_streaming`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExecEnd {
    /// How the program ended.
    pub status: ExitStatus,
    /// Whether the time limit killed it.
    pub timed_out: bool,
}

#[derive(Serialize)]
struct RequestRef<'a> {
    id: u64,
    call: &'a Call,
}

/// A blocking protocol client over any [`Transport`].
#[derive(Debug)]
pub struct Client<S> {
    stream: S,
    reader: FrameReader,
    next_id: u64,
    limits: ClientLimits,
    broken: Option<String>,
    /// `file_read` calls abandoned before their data ended: their late binary frames are
    /// skipped (any other binary frame is a protocol violation).
    abandoned_reads: std::collections::BTreeSet<u64>,
    /// `execution_count` and `duration_ms` of the last `end` received (`run_code`).
    last_end: (Option<u64>, Option<u64>),
}

/// Receives a `file_read`'s binary frames (an empty slice ends the data).
pub(crate) type DataSink<'a> = &'a mut dyn FnMut(&[u8]) -> Result<(), ClientError>;

#[path = "client_files.rs"]
mod files_api;
pub use files_api::{FileWriteOptions, ProcessEnd};

fn remaining(deadline: Instant) -> Option<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    (!left.is_zero()).then_some(left)
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

impl Client<UnixStream> {
    /// Connects to the guest's `port` through the VMM's vsock Unix socket at `uds_path`:
    /// `CONNECT <port>\n`, then `OK <n>\n`, all within `timeout`.
    pub fn connect_uds(
        uds_path: impl AsRef<Path>,
        port: u32,
        timeout: Duration,
    ) -> Result<Self, ClientError> {
        let path = uds_path.as_ref();
        let deadline = Instant::now() + timeout;
        let stream = UnixStream::connect(path).map_err(|source| ClientError::Io {
            context: format!("connecting to {}", path.display()),
            source,
        })?;
        let mut client = Client::new(stream);
        client.handshake(port, deadline, timeout)?;
        Ok(client)
    }
}

impl<S: Transport> Client<S> {
    /// A client on an already connected stream (after any handshake), with default limits.
    pub fn new(stream: S) -> Self {
        Self::with_limits(stream, ClientLimits::default())
    }

    /// A client with the given limits.
    pub fn with_limits(stream: S, limits: ClientLimits) -> Self {
        Self {
            stream,
            reader: FrameReader::new(limits.max_frame).with_binary_limit(MAX_BINARY_CHUNK as u32),
            next_id: 1,
            limits,
            broken: None,
            abandoned_reads: std::collections::BTreeSet::new(),
            last_end: (None, None),
        }
    }

    /// The limits in force.
    pub fn limits(&self) -> ClientLimits {
        self.limits
    }

    /// Changes the limits (the frame limit applies from the next frame).
    pub fn set_limits(&mut self, limits: ClientLimits) {
        self.limits = limits;
        let buffered = self.reader.buffered().to_vec();
        self.reader = FrameReader::new(limits.max_frame).with_binary_limit(MAX_BINARY_CHUNK as u32);
        // Keep bytes already received; they belong to the next frames.
        let mut rest = &buffered[..];
        while !rest.is_empty() {
            if !matches!(self.reader.fill(&mut rest), Ok(n) if n > 0) {
                break;
            }
        }
    }

    /// The stream (for the caller to close or inspect).
    pub fn get_ref(&self) -> &S {
        &self.stream
    }

    /// Takes the stream back.
    pub fn into_inner(self) -> S {
        self.stream
    }

    fn io_error(
        &mut self,
        context: &str,
        source: io::Error,
        deadline_after: Duration,
    ) -> ClientError {
        if is_timeout(&source) {
            return ClientError::Timeout {
                what: context.to_owned(),
                after: deadline_after,
            };
        }
        self.broken = Some(format!("{context}: {source}"));
        ClientError::Io {
            context: context.to_owned(),
            source,
        }
    }

    fn handshake(
        &mut self,
        port: u32,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<(), ClientError> {
        let what = "vsock handshake";
        let line = format!("CONNECT {port}\n");
        self.write_all_by(line.as_bytes(), deadline, timeout, what)?;
        loop {
            let buffered = self.reader.buffered();
            if let Some(nl) = buffered.iter().position(|&b| b == b'\n') {
                let reply = String::from_utf8_lossy(&buffered[..nl]).into_owned();
                self.reader.consume(nl + 1);
                let reply = reply.strip_suffix('\r').unwrap_or(&reply);
                let valid = reply
                    .strip_prefix("OK ")
                    .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
                if !valid {
                    self.broken = Some(format!("handshake reply {reply:?}"));
                    return Err(ClientError::Handshake(format!(
                        "unexpected reply {reply:?} to CONNECT {port}"
                    )));
                }
                return Ok(());
            }
            if buffered.len() >= MAX_HANDSHAKE_REPLY {
                self.broken = Some("handshake reply too long".into());
                return Err(ClientError::Handshake(format!(
                    "no newline in the first {MAX_HANDSHAKE_REPLY} bytes of the reply"
                )));
            }
            if self.fill_by(deadline, timeout, what)? == 0 {
                self.broken = Some("closed during the handshake".into());
                return Err(ClientError::Handshake(format!(
                    "the VMM closed the connection: nothing listens on guest port {port}, or the \
                     guest is not up"
                )));
            }
        }
    }

    fn write_all_by(
        &mut self,
        bytes: &[u8],
        deadline: Instant,
        timeout: Duration,
        what: &str,
    ) -> Result<(), ClientError> {
        let mut written = 0;
        while written < bytes.len() {
            let Some(left) = remaining(deadline) else {
                return Err(self.partial_write_timeout(written, what, timeout));
            };
            if let Err(e) = self.stream.set_write_timeout(Some(left)) {
                return Err(self.io_error("setting a write timeout", e, timeout));
            }
            match self.stream.write(&bytes[written..]) {
                Ok(0) => {
                    self.broken = Some("the guest stopped reading".into());
                    return Err(ClientError::Closed);
                }
                Ok(n) => written += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if is_timeout(&e) => {
                    return Err(self.partial_write_timeout(written, what, timeout))
                }
                Err(e) => return Err(self.io_error(what, e, timeout)),
            }
        }
        Ok(())
    }

    fn partial_write_timeout(
        &mut self,
        written: usize,
        what: &str,
        timeout: Duration,
    ) -> ClientError {
        if written > 0 {
            // Half a frame is on the wire; nothing sent after it could be understood.
            self.broken = Some(format!("{what}: timed out in the middle of a write"));
        }
        ClientError::Timeout {
            what: what.to_owned(),
            after: timeout,
        }
    }

    /// One read before the deadline.
    fn fill_by(
        &mut self,
        deadline: Instant,
        timeout: Duration,
        what: &str,
    ) -> Result<usize, ClientError> {
        let Some(left) = remaining(deadline) else {
            return Err(ClientError::Timeout {
                what: what.to_owned(),
                after: timeout,
            });
        };
        if let Err(e) = self.stream.set_read_timeout(Some(left)) {
            return Err(self.io_error("setting a read timeout", e, timeout));
        }
        self.reader
            .fill(&mut self.stream)
            .map_err(|e| self.io_error(what, e, timeout))
    }

    fn next_event(
        &mut self,
        deadline: Instant,
        timeout: Duration,
        what: &str,
    ) -> Result<Event, ClientError> {
        self.next_message(deadline, timeout, what, None)
    }

    /// The next event; binary frames of call `data.0` go to `data.1`, those of abandoned
    /// reads are skipped, any other is a protocol violation.
    fn next_message(
        &mut self,
        deadline: Instant,
        timeout: Duration,
        what: &str,
        mut data: Option<(u64, DataSink<'_>)>,
    ) -> Result<Event, ClientError> {
        loop {
            match self.reader.next_any() {
                Ok(Some(Frame::Json(body))) => {
                    return protocol::decode_event(body).map_err(|e| {
                        self.broken = Some(format!("undecodable event: {e}"));
                        ClientError::Decode(e)
                    })
                }
                Ok(Some(Frame::Binary { id, data: bytes })) => {
                    match &mut data {
                        Some((want, sink)) if *want == id => sink(bytes)?,
                        _ if self.abandoned_reads.contains(&id) => {
                            if bytes.is_empty() {
                                self.abandoned_reads.remove(&id);
                            }
                        }
                        _ => {
                            let message = format!("binary frame for call {id} in a {what} call");
                            self.broken = Some(message.clone());
                            return Err(ClientError::Protocol(message));
                        }
                    }
                    // More frames may be buffered already.
                    continue;
                }
                Ok(None) => {}
                Err(e) => {
                    self.broken = Some(e.to_string());
                    return Err(ClientError::Frame(e));
                }
            }
            if self.fill_by(deadline, timeout, what)? == 0 {
                let have = self.reader.buffered().len();
                self.broken = Some("the guest closed the connection".into());
                if have > 0 {
                    return Err(ClientError::Frame(FrameError::Truncated { have, need: 0 }));
                }
                return Err(ClientError::Closed);
            }
        }
    }

    /// Sends `call` and hands each of its non-terminal events to `on_event`, until the call's
    /// `end` (returned) or `error` (returned as [`ClientError::Remote`]), all within
    /// `timeout`. An error from `on_event` abandons the call (its later events are skipped by
    /// the next call).
    pub fn call(
        &mut self,
        call: &Call,
        timeout: Duration,
        on_event: impl FnMut(EventKind) -> Result<(), ClientError>,
    ) -> Result<EndStatus, ClientError> {
        self.call_with_data(call, timeout, on_event, None)
    }

    /// [`Client::call`], with the call's binary frames (a `file_read`'s) going to `data`.
    pub(crate) fn call_with_data(
        &mut self,
        call: &Call,
        timeout: Duration,
        mut on_event: impl FnMut(EventKind) -> Result<(), ClientError>,
        mut data: Option<DataSink<'_>>,
    ) -> Result<EndStatus, ClientError> {
        if let Some(reason) = &self.broken {
            return Err(ClientError::Broken(reason.clone()));
        }
        let what = call.type_name();
        let deadline = Instant::now()
            .checked_add(timeout)
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(365 * 24 * 3600));
        let id = self.next_id;
        self.next_id += 1;
        let mut frame = Vec::new();
        protocol::encode_frame(&RequestRef { id, call }, &mut frame, MAX_FRAME)
            .map_err(ClientError::Frame)?;
        self.write_all_by(&frame, deadline, timeout, what)?;
        loop {
            let sink = data.as_mut().map(|sink| (id, &mut **sink as DataSink<'_>));
            let event = match self.next_message(deadline, timeout, what, sink) {
                Ok(event) => event,
                Err(e) => {
                    if data.is_some() {
                        self.abandoned_reads.insert(id);
                    }
                    return Err(e);
                }
            };
            if event.id != id {
                // A connection-level error can only be about what we just sent.
                if let (CONNECTION_ID, EventKind::Error(info)) = (event.id, &event.event) {
                    return Err(ClientError::Remote(info.clone()));
                }
                continue; // a late event of an abandoned call
            }
            match event.event {
                EventKind::End {
                    status,
                    execution_count,
                    duration_ms,
                } => {
                    self.last_end = (execution_count, duration_ms);
                    return Ok(status);
                }
                EventKind::Error(info) => return Err(ClientError::Remote(info)),
                EventKind::Unknown => {}
                other => {
                    if let Err(e) = on_event(other) {
                        if data.is_some() {
                            self.abandoned_reads.insert(id);
                        }
                        return Err(e);
                    }
                }
            }
        }
    }

    /// `ping`: checks that the agent answers.
    pub fn ping(&mut self) -> Result<Pong, ClientError> {
        let mut pong = None;
        self.call(&Call::Ping, self.limits.timeout, |event| match event {
            EventKind::Pong(p) if pong.is_none() => {
                pong = Some(p);
                Ok(())
            }
            other => Err(unexpected("ping", &other)),
        })?;
        pong.ok_or_else(|| ClientError::Protocol("ping ended without a pong".into()))
    }

    /// `sync` with the given clock and entropy.
    pub fn sync(&mut self, wall_clock_ns: u64, entropy: Vec<u8>) -> Result<Synced, ClientError> {
        let call = Call::Sync(SyncRequest {
            wall_clock_ns,
            entropy,
        });
        let mut synced = None;
        self.call(&call, self.limits.timeout, |event| match event {
            EventKind::Synced(s) if synced.is_none() => {
                synced = Some(s);
                Ok(())
            }
            other => Err(unexpected("sync", &other)),
        })?;
        synced.ok_or_else(|| ClientError::Protocol("sync ended without a synced event".into()))
    }

    /// `sync` with the host's wall clock and [`SYNC_ENTROPY`] bytes from `getrandom`: the first
    /// call after a snapshot restore.
    pub fn sync_now(&mut self) -> Result<Synced, ClientError> {
        let entropy = host_entropy(SYNC_ENTROPY).map_err(ClientError::Entropy)?;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .ok()
            .and_then(|d| u64::try_from(d.as_nanos()).ok())
            .ok_or_else(|| {
                ClientError::Protocol("the host's clock is before 1970 or after 2554".into())
            })?;
        self.sync(now, entropy)
    }

    /// `exec`, collecting output (at most [`ClientLimits::max_output`] bytes). The deadline
    /// is the request's `timeout_ms` plus [`ClientLimits::exec_grace`], or
    /// [`ClientLimits::timeout`] without one. A non-zero exit is not an error.
    pub fn exec(&mut self, req: &ExecRequest) -> Result<ExecOutput, ClientError> {
        let limit = self.limits.max_output;
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        let end = self.exec_streaming(req, |stream, data| {
            if stdout.len() + stderr.len() + data.len() > limit {
                return Err(ClientError::OutputLimit { limit });
            }
            match stream {
                OutputStream::Stdout => stdout.extend_from_slice(data),
                OutputStream::Stderr => stderr.extend_from_slice(data),
            }
            Ok(())
        })?;
        Ok(ExecOutput {
            stdout,
            stderr,
            status: end.status,
            timed_out: end.timed_out,
        })
    }

    /// `exec`, handing each output chunk to `on_output` as it arrives.
    pub fn exec_streaming(
        &mut self,
        req: &ExecRequest,
        mut on_output: impl FnMut(OutputStream, &[u8]) -> Result<(), ClientError>,
    ) -> Result<ExecEnd, ClientError> {
        let timeout = match req.timeout_ms {
            Some(ms) => Duration::from_millis(ms).saturating_add(self.limits.exec_grace),
            None => self.limits.timeout,
        };
        let mut status = None;
        let end = self.call(&Call::Exec(req.clone()), timeout, |event| match event {
            EventKind::Stdout { data } if status.is_none() => {
                on_output(OutputStream::Stdout, &data)
            }
            EventKind::Stderr { data } if status.is_none() => {
                on_output(OutputStream::Stderr, &data)
            }
            // v2 agents announce the pid first.
            EventKind::Started { .. } if status.is_none() => Ok(()),
            EventKind::Exit(s) if status.is_none() => {
                status = Some(s);
                Ok(())
            }
            other => Err(unexpected("exec", &other)),
        })?;
        let status = status
            .ok_or_else(|| ClientError::Protocol("exec ended without an exit event".into()))?;
        Ok(ExecEnd {
            status,
            timed_out: end == EndStatus::TimedOut,
        })
    }
}

/// How a `run_code` ended (see [`Client::run_code`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RunEnd {
    /// `ok`, `error`, `timed_out`, `interrupted` or `context_died`.
    pub status: EndStatus,
    /// The cell's number in its context.
    pub execution_count: Option<u64>,
    /// How long the code ran, in milliseconds.
    pub duration_ms: Option<u64>,
}

impl<S: Transport> Client<S> {
    /// `run_code`: events (`stdout`, `stderr`, `result`, `display`, `exception`, `truncated`,
    /// `context_restarted`) go to `on_event` as they arrive; the deadline is `timeout`.
    pub fn run_code(
        &mut self,
        req: &RunCodeRequest,
        timeout: Duration,
        on_event: impl FnMut(EventKind) -> Result<(), ClientError>,
    ) -> Result<RunEnd, ClientError> {
        self.last_end = (None, None);
        let status = self.call(&Call::RunCode(req.clone()), timeout, on_event)?;
        Ok(RunEnd {
            status,
            execution_count: self.last_end.0,
            duration_ms: self.last_end.1,
        })
    }

    /// `context_create`: the new context.
    pub fn context_create(
        &mut self,
        req: &ContextCreateRequest,
        timeout: Duration,
    ) -> Result<ContextInfo, ClientError> {
        let mut info = None;
        self.call(
            &Call::ContextCreate(req.clone()),
            timeout,
            |event| match event {
                EventKind::Context(c) if info.is_none() => {
                    info = Some(c);
                    Ok(())
                }
                other => Err(unexpected("context_create", &other)),
            },
        )?;
        info.ok_or_else(|| ClientError::Protocol("context_create ended without a context".into()))
    }

    /// `context_list`.
    pub fn context_list(&mut self) -> Result<Vec<ContextInfo>, ClientError> {
        let mut list = None;
        self.call(
            &Call::ContextList,
            self.limits.timeout,
            |event| match event {
                EventKind::Contexts { contexts } if list.is_none() => {
                    list = Some(contexts);
                    Ok(())
                }
                other => Err(unexpected("context_list", &other)),
            },
        )?;
        list.ok_or_else(|| ClientError::Protocol("context_list ended without contexts".into()))
    }

    /// `context_restart`: the context with its fresh process.
    pub fn context_restart(
        &mut self,
        context: &str,
        timeout: Duration,
    ) -> Result<ContextInfo, ClientError> {
        let call = Call::ContextRestart(ContextRef {
            context: context.into(),
        });
        let mut info = None;
        self.call(&call, timeout, |event| match event {
            EventKind::Context(c) if info.is_none() => {
                info = Some(c);
                Ok(())
            }
            other => Err(unexpected("context_restart", &other)),
        })?;
        info.ok_or_else(|| ClientError::Protocol("context_restart ended without a context".into()))
    }

    /// `context_remove`.
    pub fn context_remove(&mut self, context: &str) -> Result<(), ClientError> {
        let call = Call::ContextRemove(ContextRef {
            context: context.into(),
        });
        self.call(&call, self.limits.timeout, |other| {
            Err(unexpected("context_remove", &other))
        })
        .map(drop)
    }

    /// `interrupt`: SIGINT to the code running in `context` (its `run_code` ends
    /// `interrupted`).
    pub fn interrupt(&mut self, context: &str) -> Result<(), ClientError> {
        let call = Call::Interrupt(ContextRef {
            context: context.into(),
        });
        self.call(&call, self.limits.timeout, |other| {
            Err(unexpected("interrupt", &other))
        })
        .map(drop)
    }

    /// `warmup` (template build time): the warm-up's events go to `on_event`.
    pub fn warmup(
        &mut self,
        req: &WarmupRequest,
        timeout: Duration,
        on_event: impl FnMut(EventKind) -> Result<(), ClientError>,
    ) -> Result<EndStatus, ClientError> {
        self.call(&Call::Warmup(req.clone()), timeout, on_event)
    }
}

fn unexpected(call: &str, event: &EventKind) -> ClientError {
    let name = serde_json::to_value(event)
        .ok()
        .and_then(|v| v.get("type").and_then(|t| t.as_str()).map(str::to_owned))
        .unwrap_or_else(|| "?".into());
    ClientError::Protocol(format!("unexpected {name} event in a {call} call"))
}

/// `n` bytes from the host kernel's RNG (`getrandom`).
pub fn host_entropy(n: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; n];
    let mut filled = 0;
    while filled < n {
        // SAFETY: the pointer and length describe the unfilled tail of `buf`.
        let r = unsafe { libc::getrandom(buf[filled..].as_mut_ptr().cast(), n - filled, 0) };
        match usize::try_from(r) {
            Ok(k) => filled += k,
            Err(_) => {
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::Interrupted {
                    return Err(err);
                }
            }
        }
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{decode_request, encode_frame, Request, MIN_ENTROPY};
    use crate::reaper::Children;
    use crate::server::Server;
    use crate::system::System;
    use std::os::unix::net::UnixListener;

    /// A fake guest on the other end of a socket pair, scripted per test.
    fn guest<F>(script: F) -> (Client<UnixStream>, std::thread::JoinHandle<()>)
    where
        F: FnOnce(UnixStream) + Send + 'static,
    {
        let (host, guest) = UnixStream::pair().unwrap();
        let handle = std::thread::spawn(move || script(guest));
        (Client::new(host), handle)
    }

    fn read_request(stream: &mut UnixStream, reader: &mut FrameReader) -> Request {
        decode_request(reader.read_frame(stream).unwrap().unwrap()).unwrap()
    }

    fn send_event(stream: &mut UnixStream, id: u64, event: EventKind) {
        protocol::write_frame(stream, &Event { id, event }).unwrap();
    }

    fn short_limits() -> ClientLimits {
        ClientLimits {
            timeout: Duration::from_millis(300),
            exec_grace: Duration::from_millis(300),
            ..ClientLimits::default()
        }
    }

    #[derive(Debug)]
    struct NoSystem;

    impl System for NoSystem {
        fn uptime_ms(&self) -> u64 {
            7
        }
        fn boot_id(&self) -> Option<String> {
            None
        }
        fn wall_clock_ns(&self) -> i128 {
            0
        }
        fn set_wall_clock(&self, _: u64) -> io::Result<()> {
            Ok(())
        }
        fn add_entropy(&self, bytes: &[u8]) -> io::Result<()> {
            assert_eq!(bytes.len(), SYNC_ENTROPY);
            Ok(())
        }
    }

    /// A real server (fake system) on a socket pair.
    fn real_server() -> Client<UnixStream> {
        let (host, guest) = UnixStream::pair().unwrap();
        let server = Server::new(
            Box::new(NoSystem),
            Children::Direct,
            crate::exec::ExecEnv::new(None, true),
        );
        std::thread::spawn(move || server.serve_connection(guest));
        Client::new(host)
    }

    #[test]
    fn talks_to_the_real_server() {
        let mut client = real_server();
        let pong = client.ping().unwrap();
        assert_eq!(pong.uptime_ms, 7);
        assert_eq!(pong.protocol, protocol::PROTOCOL_VERSION);
        let synced = client.sync_now().unwrap();
        assert!(synced.clock_step_ns > 0);

        let mut req = ExecRequest::new(["/bin/sh", "-c", "cat; echo e >&2; exit 4"]);
        req.stdin = Some(b"in".to_vec());
        req.timeout_ms = Some(10_000);
        let out = client.exec(&req).unwrap();
        assert_eq!(
            out,
            ExecOutput {
                stdout: b"in".to_vec(),
                stderr: b"e\n".to_vec(),
                status: ExitStatus::Code(4),
                timed_out: false,
            }
        );

        let mut req = ExecRequest::new(["sleep", "10"]);
        req.timeout_ms = Some(100);
        let out = client.exec(&req).unwrap();
        assert!(out.timed_out);
        assert_eq!(out.status, ExitStatus::Signal(libc::SIGKILL));

        let err = client
            .exec(&ExecRequest::new(["/nonexistent"]))
            .unwrap_err();
        assert!(err.is_remote(ErrorCode::SpawnFailed), "{err}");
        let err = client.sync(1, vec![0; MIN_ENTROPY - 1]).unwrap_err();
        assert!(err.is_remote(ErrorCode::BadRequest), "{err}");
        // Errors from the agent leave the connection usable.
        client.ping().unwrap();
    }

    #[test]
    fn output_is_bounded() {
        let mut client = real_server();
        client.set_limits(ClientLimits {
            max_output: 1000,
            ..ClientLimits::default()
        });
        let err = client
            .exec(&ExecRequest::new([
                "/bin/sh",
                "-c",
                "head -c 5000 /dev/zero",
            ]))
            .unwrap_err();
        assert!(
            matches!(err, ClientError::OutputLimit { limit: 1000 }),
            "{err}"
        );
        // The abandoned call's remaining events are skipped.
        client.ping().unwrap();
        let out = client.exec(&ExecRequest::new(["/bin/echo", "ok"])).unwrap();
        assert_eq!(out.stdout, b"ok\n");
    }

    #[test]
    fn a_silent_guest_times_out_and_late_answers_are_skipped() {
        let (mut client, guest) = guest(|mut stream| {
            let mut reader = FrameReader::new(MAX_FRAME);
            let first = read_request(&mut stream, &mut reader);
            std::thread::sleep(Duration::from_millis(500));
            // Answer the first ping late, then the second one properly.
            let second = read_request(&mut stream, &mut reader);
            for id in [first.id, second.id] {
                send_event(
                    &mut stream,
                    id,
                    EventKind::Pong(Pong {
                        uptime_ms: id,
                        boot_id: None,
                        protocol: 1,
                        agent_version: String::new(),
                    }),
                );
                send_event(&mut stream, id, EventKind::end(EndStatus::Ok));
            }
            std::thread::sleep(Duration::from_millis(200));
        });
        client.set_limits(short_limits());
        let started = Instant::now();
        let err = client.ping().unwrap_err();
        assert!(matches!(err, ClientError::Timeout { .. }), "{err}");
        let elapsed = started.elapsed();
        assert!(
            elapsed >= Duration::from_millis(300) && elapsed < Duration::from_millis(1000),
            "{elapsed:?}"
        );
        client.set_limits(ClientLimits::default());
        let pong = client.ping().unwrap();
        assert_eq!(pong.uptime_ms, 2, "the late pong of call 1 was skipped");
        guest.join().unwrap();
    }

    #[test]
    fn a_trickling_guest_cannot_extend_the_deadline() {
        let (mut client, guest) = guest(|mut stream| {
            let mut reader = FrameReader::new(MAX_FRAME);
            let req = read_request(&mut stream, &mut reader);
            let mut frame = Vec::new();
            let event = Event {
                id: req.id,
                event: EventKind::end(EndStatus::Ok),
            };
            encode_frame(&event, &mut frame, MAX_FRAME).unwrap();
            for byte in frame {
                if stream.write_all(&[byte]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        client.set_limits(short_limits());
        let started = Instant::now();
        let err = client.ping().unwrap_err();
        assert!(matches!(err, ClientError::Timeout { .. }), "{err}");
        assert!(started.elapsed() < Duration::from_millis(1000));
        drop(client);
        guest.join().unwrap();
    }

    #[test]
    fn hostile_frames_break_the_connection() {
        // Oversized.
        let (mut client, guest1) = guest(|mut stream| {
            let mut reader = FrameReader::new(MAX_FRAME);
            read_request(&mut stream, &mut reader);
            let _ = stream.write_all(&u32::MAX.to_le_bytes());
            std::thread::sleep(Duration::from_millis(200));
        });
        let err = client.ping().unwrap_err();
        assert!(
            matches!(err, ClientError::Frame(FrameError::TooLarge { .. })),
            "{err}"
        );
        assert!(matches!(client.ping().unwrap_err(), ClientError::Broken(_)));
        guest1.join().unwrap();

        // Not an event.
        let (mut client, guest2) = guest(|mut stream| {
            let mut reader = FrameReader::new(MAX_FRAME);
            read_request(&mut stream, &mut reader);
            let _ = stream.write_all(&[2, 0, 0, 0, b'{', b'}']);
        });
        assert!(matches!(client.ping().unwrap_err(), ClientError::Decode(_)));
        guest2.join().unwrap();

        // Truncated, then closed.
        let (mut client, guest3) = guest(|mut stream| {
            let mut reader = FrameReader::new(MAX_FRAME);
            read_request(&mut stream, &mut reader);
            let _ = stream.write_all(&[9, 0, 0, 0, b'{']);
        });
        let err = client.ping().unwrap_err();
        assert!(
            matches!(err, ClientError::Frame(FrameError::Truncated { .. })),
            "{err}"
        );
        guest3.join().unwrap();

        // Closed between frames.
        let (mut client, guest4) = guest(|mut stream| {
            let mut reader = FrameReader::new(MAX_FRAME);
            read_request(&mut stream, &mut reader);
        });
        assert!(matches!(client.ping().unwrap_err(), ClientError::Closed));
        guest4.join().unwrap();

        // A smaller client frame limit applies to the guest's frames.
        let (mut client, guest5) = guest(|mut stream| {
            let mut reader = FrameReader::new(MAX_FRAME);
            let req = read_request(&mut stream, &mut reader);
            let data = vec![0; 4096];
            send_event(&mut stream, req.id, EventKind::Stdout { data });
        });
        client.set_limits(ClientLimits {
            max_frame: 1024,
            ..ClientLimits::default()
        });
        let err = client.exec(&ExecRequest::new(["x"])).unwrap_err();
        assert!(
            matches!(
                err,
                ClientError::Frame(FrameError::TooLarge { max: 1024, .. })
            ),
            "{err}"
        );
        guest5.join().unwrap();
    }

    #[test]
    fn nonsensical_event_sequences_are_protocol_errors() {
        let (mut client, guest) = guest(|mut stream| {
            let mut reader = FrameReader::new(MAX_FRAME);
            let req = read_request(&mut stream, &mut reader);
            send_event(&mut stream, req.id, EventKind::end(EndStatus::Ok));
            let req = read_request(&mut stream, &mut reader);
            send_event(&mut stream, req.id, EventKind::Stdout { data: vec![1] });
            send_event(&mut stream, req.id, EventKind::end(EndStatus::Ok));
            let req = read_request(&mut stream, &mut reader);
            send_event(&mut stream, req.id, EventKind::Exit(ExitStatus::Code(0)));
            send_event(&mut stream, req.id, EventKind::Exit(ExitStatus::Code(1)));
            send_event(&mut stream, req.id, EventKind::end(EndStatus::Ok));
            std::thread::sleep(Duration::from_millis(100));
        });
        let err = client.ping().unwrap_err();
        assert!(err.to_string().contains("without a pong"), "{err}");
        let err = client.exec(&ExecRequest::new(["x"])).unwrap_err();
        assert!(err.to_string().contains("without an exit"), "{err}");
        let err = client.exec(&ExecRequest::new(["x"])).unwrap_err();
        assert!(err.to_string().contains("unexpected exit event"), "{err}");
        guest.join().unwrap();
    }

    #[test]
    fn connection_level_errors_end_the_call() {
        let (mut client, guest) = guest(|mut stream| {
            let mut reader = FrameReader::new(MAX_FRAME);
            read_request(&mut stream, &mut reader);
            let info = ErrorInfo::new(ErrorCode::BadFrame, "what?");
            send_event(&mut stream, CONNECTION_ID, EventKind::Error(info));
        });
        assert!(client.ping().unwrap_err().is_remote(ErrorCode::BadFrame));
        guest.join().unwrap();
    }

    /// A stand-in for the VMM's vsock socket: checks the CONNECT line, replies with `reply`,
    /// then serves the protocol with a real server.
    fn fake_vmm(reply: &'static [u8], serve: bool) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.sock");
        let listener = UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut line = [0u8; 13];
            stream.read_exact(&mut line).unwrap();
            assert_eq!(&line, b"CONNECT 1024\n");
            if reply.is_empty() {
                std::thread::sleep(Duration::from_millis(600));
                return;
            }
            stream.write_all(reply).unwrap();
            if serve {
                let server = Server::new(
                    Box::new(NoSystem),
                    Children::Direct,
                    crate::exec::ExecEnv::new(None, true),
                );
                let _ = server.serve_connection(stream);
            }
        });
        (dir, path)
    }

    #[test]
    fn connect_uds_does_the_vmm_handshake() {
        let (_dir, path) = fake_vmm(b"OK 1073741824\n", true);
        let mut client = Client::connect_uds(&path, 1024, Duration::from_secs(5)).unwrap();
        assert_eq!(client.ping().unwrap().uptime_ms, 7);
    }

    #[test]
    fn handshake_failures_are_clear() {
        let (_dir, path) = fake_vmm(b"", false);
        let started = Instant::now();
        let err = Client::connect_uds(&path, 1024, Duration::from_millis(200)).unwrap_err();
        assert!(matches!(err, ClientError::Timeout { .. }), "{err}");
        assert!(started.elapsed() < Duration::from_millis(500));

        let (_dir, path) = fake_vmm(b"NO\n", false);
        let err = Client::connect_uds(&path, 1024, Duration::from_secs(5)).unwrap_err();
        assert!(err.to_string().contains("unexpected reply \"NO\""), "{err}");

        let (_dir, path) = fake_vmm(b"OK 12345678901234567890123456789012345", false);
        let err = Client::connect_uds(&path, 1024, Duration::from_secs(5)).unwrap_err();
        assert!(err.to_string().contains("no newline"), "{err}");

        let err = Client::connect_uds("/nonexistent/ember.sock", 1024, Duration::from_secs(1))
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("connecting to /nonexistent/ember.sock"),
            "{err}"
        );
    }

    #[test]
    fn handshake_eof_says_nothing_listens() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.sock");
        let listener = UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut line = [0u8; 13];
            let _ = stream.read_exact(&mut line);
        });
        let err = Client::connect_uds(&path, 1024, Duration::from_secs(5)).unwrap_err();
        assert!(
            err.to_string()
                .contains("nothing listens on guest port 1024"),
            "{err}"
        );
    }

    #[test]
    fn changing_limits_keeps_buffered_events() {
        let (mut client, guest) = guest(|mut stream| {
            let mut reader = FrameReader::new(MAX_FRAME);
            let req = read_request(&mut stream, &mut reader);
            // The answer to the ping, and the events of the next call (a big stdout chunk, then
            // an end without an exit) arrive in one write.
            let pong = EventKind::Pong(Pong {
                uptime_ms: 1,
                boot_id: None,
                protocol: 1,
                agent_version: String::new(),
            });
            let end = EventKind::end(EndStatus::Ok);
            let mut frames = Vec::new();
            for (id, event) in [
                (req.id, pong),
                (req.id, end.clone()),
                (
                    req.id + 1,
                    EventKind::Stdout {
                        data: vec![b'x'; 200_000],
                    },
                ),
                (req.id + 1, end),
            ] {
                encode_frame(&Event { id, event }, &mut frames, MAX_FRAME).unwrap();
            }
            stream.write_all(&frames).unwrap();
            std::thread::sleep(Duration::from_millis(300));
        });
        client.ping().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        client.set_limits(ClientLimits::default());
        // The second call's events were already buffered when the reader was replaced.
        let err = client.exec(&ExecRequest::new(["x"])).unwrap_err();
        assert!(err.to_string().contains("without an exit"), "{err}");
        guest.join().unwrap();
    }

    #[test]
    fn host_entropy_is_random() {
        let a = host_entropy(64).unwrap();
        let b = host_entropy(64).unwrap();
        assert_eq!(a.len(), 64);
        assert_ne!(a, b);
    }

    #[test]
    fn ids_increase_and_are_never_zero() {
        let (mut client, guest) = guest(|mut stream| {
            let mut reader = FrameReader::new(MAX_FRAME);
            for expected in 1..=3 {
                let req = read_request(&mut stream, &mut reader);
                assert_eq!(req.id, expected);
                send_event(
                    &mut stream,
                    req.id,
                    EventKind::Error(ErrorInfo::new(ErrorCode::Io, "x")),
                );
            }
        });
        for _ in 0..3 {
            assert!(client.ping().unwrap_err().is_remote(ErrorCode::Io));
        }
        guest.join().unwrap();
    }
}
