//! The sandbox protocol spoken over vsock: wire types and framing.
//!
//! This module is a plain library with no guest-only code: the host (the `sandbox` crate, tests)
//! uses it together with [`crate::client`]. `agent/PROTOCOL.md` is the normative description of
//! the wire format; this is its implementation.
//!
//! In short: every message is a *frame*, a `u32` little-endian body length followed by that many
//! bytes of JSON. The host sends [`Request`]s (`{"id": 7, "call": {"type": "ping"}}`); the agent
//! answers each with a stream of [`Event`]s carrying the same id, ending with exactly one
//! terminal event: [`EventKind::End`] or [`EventKind::Error`]. Byte strings (stdout, stdin,
//! entropy) are standard base64 strings. Unknown fields are ignored; unknown call types get an
//! `unknown_call` error and the connection goes on; unknown event types decode as
//! [`EventKind::Unknown`] so that an older host survives a newer agent.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Version of this protocol; the agent reports it in [`Pong::protocol`]. Bumped when a change is
/// not backwards compatible (a new call or event type or a new optional field is compatible).
pub const PROTOCOL_VERSION: u32 = 1;

/// The vsock port the agent listens on unless `ember.agent=PORT` says otherwise.
pub const DEFAULT_PORT: u32 = 1024;

/// Largest frame body either side accepts, in bytes.
pub const MAX_FRAME: u32 = 16 * 1024 * 1024;

/// Length of the frame header (the `u32` little-endian body length).
pub const HEADER_LEN: usize = 4;

/// Largest `stdout`/`stderr` chunk the agent sends in one event, in bytes (before base64).
pub const MAX_CHUNK: usize = 64 * 1024;

/// Fewest entropy bytes a `sync` call may carry.
pub const MIN_ENTROPY: usize = 32;

/// Most entropy bytes a `sync` call may carry.
pub const MAX_ENTROPY: usize = 256;

/// Request id of events that answer no particular request (a frame that could not be parsed
/// far enough to find its id). Requests must use ids from 1 up.
pub const CONNECTION_ID: u64 = 0;

/// The call types this version serves, as they appear in `call.type`.
pub const CALL_TYPES: [&str; 3] = ["ping", "sync", "exec"];

/// Longest error message the agent sends, in bytes (longer ones are cut).
pub const MAX_MESSAGE: usize = 1024;

/// A call from the host, with the id its events will carry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// Chosen by the host, unique among the calls in flight on the connection; not 0.
    pub id: u64,
    /// What to do.
    pub call: Call,
}

/// The calls. Tagged by `"type"` in snake case; variants added later (`run_code`, `files`) take
/// the same shape, so the envelope never changes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Call {
    /// Liveness check: answered with [`EventKind::Pong`], then `end`.
    Ping,
    /// Set the guest's wall clock and reseed its RNG (first call after a snapshot restore):
    /// answered with [`EventKind::Synced`], then `end`.
    Sync(SyncRequest),
    /// Run a program: `stdout`/`stderr` chunks, then [`EventKind::Exit`], then `end`.
    Exec(ExecRequest),
}

impl Call {
    /// The call's `type` name on the wire.
    pub fn type_name(&self) -> &'static str {
        match self {
            Call::Ping => "ping",
            Call::Sync(_) => "sync",
            Call::Exec(_) => "exec",
        }
    }
}

/// Arguments of [`Call::Sync`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncRequest {
    /// The host's wall clock, nanoseconds since the Unix epoch (below `i64::MAX`).
    pub wall_clock_ns: u64,
    /// Fresh random bytes from the host ([`MIN_ENTROPY`]..=[`MAX_ENTROPY`]), base64 on the wire.
    #[serde(with = "b64")]
    pub entropy: Vec<u8>,
}

/// Arguments of [`Call::Exec`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecRequest {
    /// Program and arguments. A program name without `/` is looked up in `PATH` (the request's
    /// own, else the default); an absolute path saves the lookup's failed `execve`s.
    pub argv: Vec<String>,
    /// Variables set on top of the agent's default environment (`PATH`, `HOME`, `TERM`, `LANG`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Working directory (default: the agent's, `/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Bytes fed to the program's stdin, which is then closed; without it stdin is `/dev/null`.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "b64_opt")]
    pub stdin: Option<Vec<u8>>,
    /// Time limit in milliseconds, after which the program's process group is killed
    /// (`SIGKILL`) and the call ends with status `timed_out`. None: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

impl ExecRequest {
    /// A request running `argv` with no stdin, no extra environment and no time limit.
    pub fn new<I, S>(argv: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            argv: argv.into_iter().map(Into::into).collect(),
            ..Self::default()
        }
    }
}

/// A message from the agent: one event of the call with this id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// The request's id, or [`CONNECTION_ID`] for a frame whose id could not be read.
    pub id: u64,
    /// What happened.
    pub event: EventKind,
}

/// The events. Tagged by `"type"` in snake case.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum EventKind {
    /// Answer to `ping`.
    Pong(Pong),
    /// Answer to `sync`.
    Synced(Synced),
    /// A chunk (at most [`MAX_CHUNK`] bytes) of the program's stdout.
    Stdout {
        /// The bytes, base64 on the wire.
        #[serde(with = "b64")]
        data: Vec<u8>,
    },
    /// A chunk (at most [`MAX_CHUNK`] bytes) of the program's stderr.
    Stderr {
        /// The bytes, base64 on the wire.
        #[serde(with = "b64")]
        data: Vec<u8>,
    },
    /// How the program ended.
    Exit(ExitStatus),
    /// Terminal: the call is over.
    End {
        /// How it ended.
        status: EndStatus,
    },
    /// Terminal: the call failed (or, with id 0, a frame could not be understood).
    Error(ErrorInfo),
    /// An event type this version does not know (sent by a newer agent); clients skip it.
    #[serde(other)]
    Unknown,
}

impl EventKind {
    /// Whether this event ends its call.
    pub fn is_terminal(&self) -> bool {
        matches!(self, EventKind::End { .. } | EventKind::Error(_))
    }
}

/// Payload of [`EventKind::Pong`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pong {
    /// Milliseconds since the guest booted (`CLOCK_BOOTTIME`; a restored clone continues the
    /// snapshot's count).
    pub uptime_ms: u64,
    /// The guest kernel's boot id, if it could be read (the same in every clone of a snapshot).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_id: Option<String>,
    /// The agent's [`PROTOCOL_VERSION`].
    #[serde(default)]
    pub protocol: u32,
    /// The agent's crate version.
    #[serde(default)]
    pub agent_version: String,
}

/// Payload of [`EventKind::Synced`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Synced {
    /// How far the guest's wall clock moved (host time minus the guest's time before), in ns.
    pub clock_step_ns: i64,
}

/// How a program ended: `{"code": N}` or `{"signal": N}` inside the `exit` event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawExit", into = "RawExit")]
pub enum ExitStatus {
    /// It exited with this status.
    Code(i32),
    /// A signal killed it.
    Signal(i32),
}

impl ExitStatus {
    /// Whether it exited with status 0.
    pub fn success(&self) -> bool {
        *self == ExitStatus::Code(0)
    }
}

impl std::fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExitStatus::Code(code) => write!(f, "exited with status {code}"),
            ExitStatus::Signal(signal) => write!(f, "killed by signal {signal}"),
        }
    }
}

#[derive(Serialize, Deserialize)]
struct RawExit {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    code: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    signal: Option<i32>,
}

impl TryFrom<RawExit> for ExitStatus {
    type Error = &'static str;

    fn try_from(raw: RawExit) -> Result<Self, Self::Error> {
        match (raw.code, raw.signal) {
            (Some(code), None) => Ok(ExitStatus::Code(code)),
            (None, Some(signal)) => Ok(ExitStatus::Signal(signal)),
            _ => Err("an exit event needs exactly one of `code` and `signal`"),
        }
    }
}

impl From<ExitStatus> for RawExit {
    fn from(status: ExitStatus) -> Self {
        match status {
            ExitStatus::Code(code) => RawExit {
                code: Some(code),
                signal: None,
            },
            ExitStatus::Signal(signal) => RawExit {
                code: None,
                signal: Some(signal),
            },
        }
    }
}

/// How a call ended (in [`EventKind::End`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EndStatus {
    /// The call ran to completion (for `exec`, whatever the program's exit status).
    Ok,
    /// The call's time limit ran out (for `exec`: the process group was killed).
    TimedOut,
    /// A status this version does not know.
    #[serde(other)]
    Unknown,
}

/// Payload of [`EventKind::Error`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Error)]
#[error("{code:?}: {message}")]
pub struct ErrorInfo {
    /// What kind of failure.
    pub code: ErrorCode,
    /// Human-readable detail (at most [`MAX_MESSAGE`] bytes).
    pub message: String,
}

impl ErrorInfo {
    /// An error with `message` cut to [`MAX_MESSAGE`] bytes.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        let mut message = message.into();
        if message.len() > MAX_MESSAGE {
            let mut cut = MAX_MESSAGE - 3;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            message.push_str("...");
        }
        Self { code, message }
    }
}

/// Kinds of [`ErrorInfo`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The frame body is not a JSON request object (sent with id 0).
    BadFrame,
    /// The frame header announced more than [`MAX_FRAME`] bytes; the agent closes the connection.
    FrameTooLarge,
    /// A known call with missing or invalid arguments.
    BadRequest,
    /// A call type this agent does not serve.
    UnknownCall,
    /// Setting the clock or reseeding the RNG failed.
    SyncFailed,
    /// The program could not be started.
    SpawnFailed,
    /// The agent hit an I/O error while serving the call.
    Io,
    /// A bug in the agent.
    Internal,
    /// A code this version does not know.
    #[serde(other)]
    Unknown,
}

/// Serde helpers: `Vec<u8>` as a standard base64 string.
pub mod b64 {
    use serde::{Deserialize, Deserializer, Serializer};

    /// Serializes bytes as a base64 string.
    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&crate::base64::encode(bytes))
    }

    /// Deserializes a base64 string (padding optional) into bytes.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        crate::base64::decode(text.as_bytes()).map_err(serde::de::Error::custom)
    }
}

/// Serde helpers: `Option<Vec<u8>>` as an optional base64 string.
pub mod b64_opt {
    use serde::{Deserialize, Deserializer, Serializer};

    /// Serializes optional bytes as a base64 string or null.
    pub fn serialize<S: Serializer>(bytes: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match bytes {
            Some(bytes) => super::b64::serialize(bytes, s),
            None => s.serialize_none(),
        }
    }

    /// Deserializes an optional base64 string.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
        match Option::<String>::deserialize(d)? {
            Some(text) => crate::base64::decode(text.as_bytes())
                .map(Some)
                .map_err(serde::de::Error::custom),
            None => Ok(None),
        }
    }
}

/// A frame that could not be read or written.
#[derive(Debug, Error)]
pub enum FrameError {
    /// The header announced (or a message encoded to) more bytes than the limit.
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// Announced or encoded body length.
        len: u64,
        /// The limit.
        max: u32,
    },
    /// The peer closed the connection in the middle of a frame.
    #[error("connection closed in the middle of a frame ({have} of {need} bytes received)")]
    Truncated {
        /// Bytes of the frame (header included) received.
        have: usize,
        /// Bytes the frame needs (header included; 4 while the header is incomplete).
        need: usize,
    },
    /// Serializing a message failed (a bug: every message type serializes).
    #[error("encoding a message failed: {0}")]
    Encode(#[source] serde_json::Error),
    /// Reading or writing the stream failed (including read timeouts).
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// Appends one frame (header and JSON body of `msg`) to `out`, refusing bodies over `max`.
pub fn encode_frame<T: Serialize>(msg: &T, out: &mut Vec<u8>, max: u32) -> Result<(), FrameError> {
    let start = out.len();
    out.extend_from_slice(&[0; HEADER_LEN]);
    if let Err(e) = serde_json::to_writer(&mut *out, msg) {
        out.truncate(start);
        return Err(FrameError::Encode(e));
    }
    let len = out.len() - start - HEADER_LEN;
    let header = match u32::try_from(len) {
        Ok(len32) if len32 <= max => len32.to_le_bytes(),
        _ => {
            out.truncate(start);
            return Err(FrameError::TooLarge {
                len: len as u64,
                max,
            });
        }
    };
    out[start..start + HEADER_LEN].copy_from_slice(&header);
    Ok(())
}

/// Writes one frame with a single `write_all` (one `write` syscall on a socket with room).
pub fn write_frame<W: Write + ?Sized, T: Serialize>(w: &mut W, msg: &T) -> Result<(), FrameError> {
    let mut buf = Vec::new();
    encode_frame(msg, &mut buf, MAX_FRAME)?;
    w.write_all(&buf)?;
    Ok(())
}

/// Bytes a [`FrameReader`] asks for per `read` (and keeps allocated between frames).
const READ_CHUNK: usize = 64 * 1024;

/// Reads frames from a byte stream with as few `read` calls as possible: one `read` fetches
/// whatever has arrived (often several frames), and frames are then cut from the buffer.
#[derive(Debug)]
pub struct FrameReader {
    buf: Vec<u8>,
    /// Start of the unconsumed bytes.
    start: usize,
    /// End of the valid bytes.
    end: usize,
    /// Bytes of the frame last returned, consumed on the next call.
    returned: usize,
    max: u32,
}

impl FrameReader {
    /// A reader accepting bodies of at most `max` bytes.
    pub fn new(max: u32) -> Self {
        Self {
            buf: Vec::new(),
            start: 0,
            end: 0,
            returned: 0,
            max,
        }
    }

    /// The largest body accepted.
    pub fn max(&self) -> u32 {
        self.max
    }

    /// Bytes received and not yet consumed.
    pub fn buffered(&self) -> &[u8] {
        &self.buf[self.start + self.returned..self.end]
    }

    /// Drops the first `n` buffered bytes (at most all of them).
    pub fn consume(&mut self, n: usize) {
        self.release();
        self.start = (self.start + n).min(self.end);
    }

    fn release(&mut self) {
        self.start += self.returned;
        self.returned = 0;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            // Give back what a big frame needed.
            if self.buf.len() > 2 * READ_CHUNK {
                self.buf.truncate(READ_CHUNK);
                self.buf.shrink_to_fit();
            }
        }
    }

    /// Makes room for at least `need` bytes counted from the start of the unconsumed data, and
    /// at least one free byte after them.
    fn reserve(&mut self, need: usize) {
        if self.buf.len() - self.start >= need && self.end < self.buf.len() {
            return;
        }
        self.buf.copy_within(self.start..self.end, 0);
        self.end -= self.start;
        self.start = 0;
        let want = need.max(READ_CHUNK);
        if self.buf.len() < want {
            self.buf.resize(want, 0);
        }
    }

    /// One `read` from `r` into the buffer; returns the number of bytes read (0 at EOF).
    /// `EINTR` is retried; other errors (timeouts included) are returned as they are.
    pub fn fill<R: Read + ?Sized>(&mut self, r: &mut R) -> io::Result<usize> {
        self.release();
        // Room for the whole frame at the front when its header is in and within the limit (so
        // that a big frame takes few reads); otherwise just room for more bytes.
        let frame = match self.needed() {
            Some(need) if need - HEADER_LEN <= self.max as usize => need,
            _ => 0,
        };
        self.reserve(frame.max(self.end - self.start + 1));
        loop {
            match r.read(&mut self.buf[self.end..]) {
                Ok(n) => {
                    self.end += n;
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Total bytes (header included) the frame at the front needs, once its header is there.
    /// `None` while the header is incomplete; values over the limit are returned as they are.
    fn needed(&self) -> Option<usize> {
        let data = &self.buf[self.start..self.end];
        let header: [u8; HEADER_LEN] = data.get(..HEADER_LEN)?.try_into().ok()?;
        Some(HEADER_LEN + u32::from_le_bytes(header) as usize)
    }

    /// The body of the complete frame at the front of the buffer, without reading.
    pub fn next_buffered(&mut self) -> Result<Option<&[u8]>, FrameError> {
        self.release();
        let Some(need) = self.needed() else {
            return Ok(None);
        };
        let len = need - HEADER_LEN;
        if len > self.max as usize {
            return Err(FrameError::TooLarge {
                len: len as u64,
                max: self.max,
            });
        }
        if self.end - self.start < need {
            return Ok(None);
        }
        self.returned = need;
        Ok(Some(&self.buf[self.start + HEADER_LEN..self.start + need]))
    }

    /// The next frame's body, reading from `r` as needed. `Ok(None)` at a clean end of stream
    /// (EOF between frames); EOF inside a frame is [`FrameError::Truncated`]. A header over the
    /// limit is [`FrameError::TooLarge`] before any of its body is read. The slice is valid
    /// until the next call.
    pub fn read_frame<R: Read + ?Sized>(&mut self, r: &mut R) -> Result<Option<&[u8]>, FrameError> {
        loop {
            // Checked in two steps so that the borrow of the buffer ends before `fill`.
            if self.next_buffered()?.is_some() {
                let body = self.start + HEADER_LEN..self.start + self.returned;
                return Ok(Some(&self.buf[body]));
            }
            if self.fill(r)? == 0 {
                let have = self.end - self.start;
                if have == 0 {
                    return Ok(None);
                }
                return Err(FrameError::Truncated {
                    have,
                    need: self.needed().unwrap_or(HEADER_LEN),
                });
            }
        }
    }
}

/// Decodes a request body on the agent's side. On failure, returns the id to answer with
/// ([`CONNECTION_ID`] if none could be read) and the error event to send: `bad_frame` for a
/// body that is not a JSON object with an `id`, `unknown_call` for a call type this version
/// does not serve, `bad_request` for a known call with bad arguments or for id 0.
pub fn decode_request(body: &[u8]) -> Result<Request, (u64, ErrorInfo)> {
    let err = match serde_json::from_slice::<Request>(body) {
        Ok(request) if request.id == CONNECTION_ID => {
            return Err((
                CONNECTION_ID,
                ErrorInfo::new(
                    ErrorCode::BadRequest,
                    "request id 0 is reserved; use ids from 1",
                ),
            ))
        }
        Ok(request) => return Ok(request),
        Err(e) => e,
    };
    // Find out as much as possible to make the error useful, and to answer on the right id.
    let value: serde_json::Value = match serde_json::from_slice(body) {
        Ok(value) => value,
        Err(e) => {
            return Err((
                CONNECTION_ID,
                ErrorInfo::new(ErrorCode::BadFrame, format!("frame body is not JSON: {e}")),
            ))
        }
    };
    let Some(object) = value.as_object() else {
        return Err((
            CONNECTION_ID,
            ErrorInfo::new(ErrorCode::BadFrame, "frame body is not a JSON object"),
        ));
    };
    let Some(id) = object.get("id").and_then(serde_json::Value::as_u64) else {
        return Err((
            CONNECTION_ID,
            ErrorInfo::new(
                ErrorCode::BadFrame,
                format!("request without a valid id: {err}"),
            ),
        ));
    };
    let call_type = object
        .get("call")
        .and_then(|call| call.get("type"))
        .and_then(serde_json::Value::as_str);
    match call_type {
        Some(name) if !CALL_TYPES.contains(&name) => Err((
            id,
            ErrorInfo::new(
                ErrorCode::UnknownCall,
                format!(
                    "unknown call type {name:?}; this agent (protocol {PROTOCOL_VERSION}) serves {}",
                    CALL_TYPES.join(", ")
                ),
            ),
        )),
        _ => Err((
            id,
            ErrorInfo::new(ErrorCode::BadRequest, format!("bad request: {err}")),
        )),
    }
}

/// Decodes an event body on the host's side.
pub fn decode_event(body: &[u8]) -> Result<Event, serde_json::Error> {
    serde_json::from_slice(body)
}

/// Validates a [`SyncRequest`]'s arguments (the agent's check, also usable by hosts).
pub fn check_sync(sync: &SyncRequest) -> Result<(), ErrorInfo> {
    if !(MIN_ENTROPY..=MAX_ENTROPY).contains(&sync.entropy.len()) {
        return Err(ErrorInfo::new(
            ErrorCode::BadRequest,
            format!(
                "sync: entropy must be {MIN_ENTROPY} to {MAX_ENTROPY} bytes, got {}",
                sync.entropy.len()
            ),
        ));
    }
    if sync.wall_clock_ns == 0 || sync.wall_clock_ns >= i64::MAX as u64 {
        return Err(ErrorInfo::new(
            ErrorCode::BadRequest,
            format!(
                "sync: wall_clock_ns {} is not a plausible time (1..2^63 ns since the epoch)",
                sync.wall_clock_ns
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn round_trip_request(request: &Request) -> serde_json::Value {
        let mut buf = Vec::new();
        encode_frame(request, &mut buf, MAX_FRAME).unwrap();
        let mut reader = FrameReader::new(MAX_FRAME);
        let body = reader.read_frame(&mut &buf[..]).unwrap().unwrap().to_vec();
        assert_eq!(&decode_request(&body).unwrap(), request);
        serde_json::from_slice(&body).unwrap()
    }

    fn round_trip_event(event: &Event) -> serde_json::Value {
        let mut buf = Vec::new();
        encode_frame(event, &mut buf, MAX_FRAME).unwrap();
        let len = u32::from_le_bytes(buf[..4].try_into().unwrap()) as usize;
        assert_eq!(len, buf.len() - 4);
        assert_eq!(&decode_event(&buf[4..]).unwrap(), event);
        serde_json::from_slice(&buf[4..]).unwrap()
    }

    #[test]
    fn requests_round_trip_with_the_documented_json() {
        let ping = Request {
            id: 1,
            call: Call::Ping,
        };
        assert_eq!(
            round_trip_request(&ping),
            json!({"id": 1, "call": {"type": "ping"}})
        );

        let sync = Request {
            id: 2,
            call: Call::Sync(SyncRequest {
                wall_clock_ns: 1_700_000_000_123_456_789,
                entropy: vec![0xff; 32],
            }),
        };
        assert_eq!(
            round_trip_request(&sync),
            json!({"id": 2, "call": {"type": "sync", "wall_clock_ns": 1_700_000_000_123_456_789u64,
                   "entropy": "//////////////////////////////////////////8="}})
        );

        let mut exec = ExecRequest::new(["/bin/sh", "-c", "cat"]);
        exec.env.insert("A".into(), "b c".into());
        exec.cwd = Some("/tmp".into());
        exec.stdin = Some(b"hi\n".to_vec());
        exec.timeout_ms = Some(5000);
        let exec = Request {
            id: u64::MAX,
            call: Call::Exec(exec),
        };
        assert_eq!(
            round_trip_request(&exec),
            json!({"id": u64::MAX, "call": {"type": "exec", "argv": ["/bin/sh", "-c", "cat"],
                   "env": {"A": "b c"}, "cwd": "/tmp", "stdin": "aGkK", "timeout_ms": 5000}})
        );
        // Optional fields may be left out.
        let minimal = Request {
            id: 3,
            call: Call::Exec(ExecRequest::new(["true"])),
        };
        assert_eq!(
            round_trip_request(&minimal),
            json!({"id": 3, "call": {"type": "exec", "argv": ["true"]}})
        );
    }

    #[test]
    fn call_type_names_match_the_wire() {
        let calls = [
            Call::Ping,
            Call::Sync(SyncRequest {
                wall_clock_ns: 1,
                entropy: vec![],
            }),
            Call::Exec(ExecRequest::default()),
        ];
        assert_eq!(calls.len(), CALL_TYPES.len());
        for (call, name) in calls.iter().zip(CALL_TYPES) {
            let value = serde_json::to_value(call).unwrap();
            assert_eq!(value["type"], name);
            assert_eq!(call.type_name(), name);
        }
    }

    #[test]
    fn events_round_trip_with_the_documented_json() {
        let cases = [
            (
                EventKind::Pong(Pong {
                    uptime_ms: 12,
                    boot_id: Some("b".into()),
                    protocol: 1,
                    agent_version: "0.1.0".into(),
                }),
                json!({"type": "pong", "uptime_ms": 12, "boot_id": "b", "protocol": 1,
                       "agent_version": "0.1.0"}),
            ),
            (
                EventKind::Synced(Synced { clock_step_ns: -5 }),
                json!({"type": "synced", "clock_step_ns": -5}),
            ),
            (
                EventKind::Stdout {
                    data: b"foo".to_vec(),
                },
                json!({"type": "stdout", "data": "Zm9v"}),
            ),
            (
                EventKind::Stderr { data: vec![] },
                json!({"type": "stderr", "data": ""}),
            ),
            (
                EventKind::Exit(ExitStatus::Code(3)),
                json!({"type": "exit", "code": 3}),
            ),
            (
                EventKind::Exit(ExitStatus::Signal(9)),
                json!({"type": "exit", "signal": 9}),
            ),
            (
                EventKind::End {
                    status: EndStatus::TimedOut,
                },
                json!({"type": "end", "status": "timed_out"}),
            ),
            (
                EventKind::Error(ErrorInfo::new(ErrorCode::UnknownCall, "nope")),
                json!({"type": "error", "code": "unknown_call", "message": "nope"}),
            ),
        ];
        for (kind, expected) in cases {
            let value = round_trip_event(&Event { id: 9, event: kind });
            assert_eq!(value, json!({"id": 9, "event": expected}));
        }
    }

    #[test]
    fn newer_agents_events_decode_as_unknown() {
        let event =
            decode_event(br#"{"id":1,"event":{"type":"display","mime":"image/png"}}"#).unwrap();
        assert_eq!(event.event, EventKind::Unknown);
        assert!(!event.event.is_terminal());
        let event =
            decode_event(br#"{"id":1,"event":{"type":"end","status":"cancelled"}}"#).unwrap();
        assert_eq!(
            event.event,
            EventKind::End {
                status: EndStatus::Unknown
            }
        );
        let event = decode_event(
            br#"{"id":1,"event":{"type":"error","code":"quota","message":"m","extra":1}}"#,
        )
        .unwrap();
        assert_eq!(
            event.event,
            EventKind::Error(ErrorInfo::new(ErrorCode::Unknown, "m"))
        );
        // A pong from an agent that predates the version fields still decodes.
        let event = decode_event(br#"{"id":1,"event":{"type":"pong","uptime_ms":5}}"#).unwrap();
        assert!(matches!(
            event.event,
            EventKind::Pong(Pong { uptime_ms: 5, .. })
        ));
    }

    #[test]
    fn bad_exit_events_are_refused() {
        for body in [
            &br#"{"id":1,"event":{"type":"exit"}}"#[..],
            br#"{"id":1,"event":{"type":"exit","code":1,"signal":2}}"#,
            br#"{"id":1,"event":{"type":"stdout","data":"not base64!"}}"#,
            br#"{"id":-1,"event":{"type":"end","status":"ok"}}"#,
        ] {
            assert!(
                decode_event(body).is_err(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn unknown_fields_are_ignored() {
        let request = decode_request(
            br#"{"id":4,"trace":"x","call":{"type":"exec","argv":["ls"],"future":true}}"#,
        )
        .unwrap();
        assert_eq!(request.call, Call::Exec(ExecRequest::new(["ls"])));
        let request = decode_request(br#"{"id":4,"call":{"type":"ping","verbose":true}}"#).unwrap();
        assert_eq!(request.call, Call::Ping);
    }

    #[test]
    fn request_errors_are_classified() {
        let (id, err) =
            decode_request(br#"{"id":7,"call":{"type":"run_code","code":"1+1"}}"#).unwrap_err();
        assert_eq!((id, err.code), (7, ErrorCode::UnknownCall));
        assert!(err.message.contains("\"run_code\""), "{}", err.message);
        assert!(err.message.contains("ping, sync, exec"), "{}", err.message);

        let (id, err) = decode_request(br#"{"id":8,"call":{"type":"exec"}}"#).unwrap_err();
        assert_eq!((id, err.code), (8, ErrorCode::BadRequest));
        assert!(err.message.contains("argv"), "{}", err.message);

        let (id, err) =
            decode_request(br#"{"id":8,"call":{"type":"sync","wall_clock_ns":1,"entropy":"%%"}}"#)
                .unwrap_err();
        assert_eq!((id, err.code), (8, ErrorCode::BadRequest));

        let (id, err) = decode_request(br#"{"id":9,"call":{}}"#).unwrap_err();
        assert_eq!((id, err.code), (9, ErrorCode::BadRequest));

        for body in [
            &b"not json"[..],
            b"",
            b"[1,2]",
            br#"{"call":{"type":"ping"}}"#,
        ] {
            let (id, err) = decode_request(body).unwrap_err();
            assert_eq!((id, err.code), (CONNECTION_ID, ErrorCode::BadFrame));
        }
        let (id, err) = decode_request(br#"{"id":0,"call":{"type":"ping"}}"#).unwrap_err();
        assert_eq!((id, err.code), (CONNECTION_ID, ErrorCode::BadRequest));
    }

    #[test]
    fn error_messages_are_bounded() {
        let err = ErrorInfo::new(ErrorCode::Io, "é".repeat(2000));
        assert!(err.message.len() <= MAX_MESSAGE);
        assert!(err.message.ends_with("..."));
        let (_, err) = decode_request(
            format!(r#"{{"id":1,"call":{{"type":"{}"}}}}"#, "x".repeat(100_000)).as_bytes(),
        )
        .unwrap_err();
        assert!(err.message.len() <= MAX_MESSAGE);
    }

    #[test]
    fn frame_reader_cuts_several_frames_from_one_read() {
        let mut stream = Vec::new();
        for id in 1..=3 {
            encode_frame(
                &Request {
                    id,
                    call: Call::Ping,
                },
                &mut stream,
                MAX_FRAME,
            )
            .unwrap();
        }
        let mut reader = FrameReader::new(MAX_FRAME);
        let mut reads = 0;
        let mut src = CountingReader {
            data: &stream,
            reads: &mut reads,
            max_per_read: usize::MAX,
        };
        for id in 1..=3 {
            let body = reader.read_frame(&mut src).unwrap().unwrap();
            assert_eq!(decode_request(body).unwrap().id, id);
        }
        assert!(reader.read_frame(&mut src).unwrap().is_none());
        // One read for all three frames, one more to see EOF.
        assert_eq!(reads, 2);
    }

    #[test]
    fn frame_reader_reassembles_byte_by_byte_and_big_frames() {
        let big = Request {
            id: 5,
            call: Call::Exec(ExecRequest {
                stdin: Some(vec![7; 300_000]),
                ..ExecRequest::new(["cat"])
            }),
        };
        let mut stream = Vec::new();
        encode_frame(
            &Request {
                id: 4,
                call: Call::Ping,
            },
            &mut stream,
            MAX_FRAME,
        )
        .unwrap();
        encode_frame(&big, &mut stream, MAX_FRAME).unwrap();
        encode_frame(
            &Request {
                id: 6,
                call: Call::Ping,
            },
            &mut stream,
            MAX_FRAME,
        )
        .unwrap();
        for max_per_read in [1, 7, 4096, usize::MAX] {
            let mut reads = 0;
            let mut src = CountingReader {
                data: &stream,
                reads: &mut reads,
                max_per_read,
            };
            let mut reader = FrameReader::new(MAX_FRAME);
            let ids: Vec<u64> = std::iter::from_fn(|| {
                reader
                    .read_frame(&mut src)
                    .unwrap()
                    .map(|body| decode_request(body).unwrap().id)
            })
            .collect();
            assert_eq!(ids, [4, 5, 6], "{max_per_read}");
            // After the big frame the buffer shrinks back.
            assert!(reader.buf.len() <= 2 * READ_CHUNK, "{}", reader.buf.len());
        }
    }

    #[test]
    fn oversized_frames_are_refused_before_their_body_is_read() {
        let mut header = (MAX_FRAME + 1).to_le_bytes().to_vec();
        header.extend_from_slice(b"{}");
        let mut reader = FrameReader::new(MAX_FRAME);
        match reader.read_frame(&mut &header[..]) {
            Err(FrameError::TooLarge { len, max }) => {
                assert_eq!((len, max), (u64::from(MAX_FRAME) + 1, MAX_FRAME))
            }
            other => panic!("{other:?}"),
        }
        // A smaller limit applies too (the client's own).
        let mut small = FrameReader::new(10);
        let mut stream = Vec::new();
        encode_frame(
            &Request {
                id: 1,
                call: Call::Ping,
            },
            &mut stream,
            MAX_FRAME,
        )
        .unwrap();
        assert!(matches!(
            small.read_frame(&mut &stream[..]),
            Err(FrameError::TooLarge { max: 10, .. })
        ));
        // The encoder refuses too.
        let mut out = b"keep".to_vec();
        let err = encode_frame(
            &Request {
                id: 1,
                call: Call::Ping,
            },
            &mut out,
            10,
        )
        .unwrap_err();
        assert!(matches!(err, FrameError::TooLarge { max: 10, .. }), "{err}");
        assert_eq!(out, b"keep");
        // The largest allowed body passes.
        let mut exact = (5u32).to_le_bytes().to_vec();
        exact.extend_from_slice(b"12345");
        assert_eq!(
            FrameReader::new(5).read_frame(&mut &exact[..]).unwrap(),
            Some(&b"12345"[..])
        );
    }

    #[test]
    fn truncated_frames_are_errors_and_clean_eof_is_not() {
        let mut stream = Vec::new();
        encode_frame(
            &Request {
                id: 1,
                call: Call::Ping,
            },
            &mut stream,
            MAX_FRAME,
        )
        .unwrap();
        for cut in [1, 3, 4, stream.len() - 1] {
            let mut reader = FrameReader::new(MAX_FRAME);
            match reader.read_frame(&mut &stream[..cut]) {
                Err(FrameError::Truncated { have, need }) => {
                    assert_eq!(have, cut);
                    assert_eq!(need, if cut < 4 { 4 } else { stream.len() });
                }
                other => panic!("cut {cut}: {other:?}"),
            }
        }
        let mut reader = FrameReader::new(MAX_FRAME);
        assert!(reader.read_frame(&mut &b""[..]).unwrap().is_none());
        let msg = FrameError::Truncated { have: 3, need: 4 }.to_string();
        assert!(msg.contains("3 of 4"), "{msg}");
    }

    #[test]
    fn buffered_bytes_can_be_consumed_before_frames() {
        let mut stream = b"OK 7\n".to_vec();
        encode_frame(
            &Request {
                id: 1,
                call: Call::Ping,
            },
            &mut stream,
            MAX_FRAME,
        )
        .unwrap();
        let mut reader = FrameReader::new(MAX_FRAME);
        let mut src = &stream[..];
        reader.fill(&mut src).unwrap();
        let nl = reader.buffered().iter().position(|&b| b == b'\n').unwrap();
        assert_eq!(&reader.buffered()[..nl], b"OK 7");
        reader.consume(nl + 1);
        let body = reader.read_frame(&mut src).unwrap().unwrap();
        assert_eq!(decode_request(body).unwrap().id, 1);
    }

    #[test]
    fn sync_arguments_are_checked() {
        let ok = SyncRequest {
            wall_clock_ns: 1_700_000_000_000_000_000,
            entropy: vec![1; 64],
        };
        check_sync(&ok).unwrap();
        for (clock, len) in [(1, 31), (1, 257), (0, 64), (u64::MAX, 64), (1 << 63, 64)] {
            let bad = SyncRequest {
                wall_clock_ns: clock,
                entropy: vec![1; len],
            };
            let err = check_sync(&bad).unwrap_err();
            assert_eq!(err.code, ErrorCode::BadRequest, "{clock} {len}");
        }
        check_sync(&SyncRequest {
            wall_clock_ns: 1,
            entropy: vec![0; MAX_ENTROPY],
        })
        .unwrap();
    }

    #[test]
    fn exit_status_display() {
        assert_eq!(ExitStatus::Code(0).to_string(), "exited with status 0");
        assert_eq!(ExitStatus::Signal(9).to_string(), "killed by signal 9");
        assert!(ExitStatus::Code(0).success());
        assert!(!ExitStatus::Signal(0).success());
    }

    struct CountingReader<'a> {
        data: &'a [u8],
        reads: &'a mut usize,
        max_per_read: usize,
    }

    impl Read for CountingReader<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            *self.reads += 1;
            let n = buf.len().min(self.data.len()).min(self.max_per_read);
            buf[..n].copy_from_slice(&self.data[..n]);
            self.data = &self.data[n..];
            Ok(n)
        }
    }
}
