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
use std::os::fd::RawFd;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Version of this protocol; the agent reports it in [`Pong::protocol`]. Bumped when a change is
/// not backwards compatible (a new call or event type or a new optional field is compatible).
pub const PROTOCOL_VERSION: u32 = 2;

/// The vsock port the agent listens on unless `ember.agent=PORT` says otherwise.
pub const DEFAULT_PORT: u32 = 1024;

/// Largest frame body either side accepts, in bytes.
pub const MAX_FRAME: u32 = 16 * 1024 * 1024;

/// Length of the frame header (the `u32` little-endian body length).
pub const HEADER_LEN: usize = 4;

/// Header bit marking a binary frame: its body is a `u64` LE call id and raw bytes, and its
/// length is the header's low 31 bits.
pub const BINARY_FLAG: u32 = 1 << 31;

/// Length of a binary frame's header plus its call id.
pub const BINARY_HEADER_LEN: usize = HEADER_LEN + 8;

/// Largest payload of one binary frame (`file_read` chunks, `file_write` chunks), in bytes.
pub const MAX_BINARY_CHUNK: usize = 1024 * 1024;

/// Largest `stdout`/`stderr` chunk the agent sends in one event, in bytes (before base64).
pub const MAX_CHUNK: usize = 64 * 1024;

/// Fewest entropy bytes a `sync` call may carry.
pub const MIN_ENTROPY: usize = 32;

/// Most entropy bytes a `sync` call may carry.
pub const MAX_ENTROPY: usize = 256;

/// A frame missing more than this many bytes is completed with one `recv(MSG_WAITALL)` by
/// [`FrameReader::read_any_socket`].
const WAITALL_MIN: usize = 16 * 1024;

/// Request id of events that answer no particular request (a frame that could not be parsed
/// far enough to find its id). Requests must use ids from 1 up.
pub const CONNECTION_ID: u64 = 0;

/// The call types this version serves, as they appear in `call.type`.
pub const CALL_TYPES: &[&str] = &[
    "ping",
    "sync",
    "exec",
    // files
    "file_read",
    "file_write",
    "file_list",
    "file_stat",
    "file_mkdir",
    "file_remove",
    "file_rename",
    "file_watch",
    // processes
    "stdin_write",
    "stdin_close",
    "process_list",
    "process_attach",
    "process_signal",
    "process_resize",
    // code contexts
    "context_create",
    "context_list",
    "context_restart",
    "context_remove",
    "run_code",
    "interrupt",
    "warmup",
];

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
    /// Run a program: [`EventKind::Started`], `stdout`/`stderr` chunks, then
    /// [`EventKind::Exit`], then `end` (background: `started` and `end` at once).
    Exec(ExecRequest),
    /// Read a file: [`EventKind::FileInfo`], binary frames, an empty binary frame, `end`.
    FileRead(FileReadRequest),
    /// Write a file from the binary frames that follow the request: [`EventKind::Written`],
    /// `end`.
    FileWrite(FileWriteRequest),
    /// List a directory: [`EventKind::Entries`] batches, `end`.
    FileList(FileListRequest),
    /// Stat a path: [`EventKind::Stat`], `end`.
    FileStat(PathRequest),
    /// `mkdir -p`: `end`.
    FileMkdir(PathRequest),
    /// Remove a file or (`recursive`) a tree: `end`.
    FileRemove(FileRemoveRequest),
    /// Rename: `end`.
    FileRename(FileRenameRequest),
    /// Watch a path: [`EventKind::FsEvent`]s until the host closes or sends a frame, `end`.
    FileWatch(FileWatchRequest),
    /// Write to the stdin of a process started with `stdin_stream` (or a pty): `end`.
    StdinWrite(StdinWriteRequest),
    /// Close a process's stdin: `end`.
    StdinClose(PidRequest),
    /// The processes the agent started: [`EventKind::Processes`], `end`.
    ProcessList,
    /// Buffered then live output of a process, [`EventKind::Exit`], `end`.
    ProcessAttach(PidRequest),
    /// Send a signal to a process's group: `end`.
    ProcessSignal(ProcessSignalRequest),
    /// Resize a process's pseudo-terminal: `end`.
    ProcessResize(ProcessResizeRequest),
    /// Create a code context: [`EventKind::Context`], `end`.
    ContextCreate(ContextCreateRequest),
    /// The code contexts: [`EventKind::Contexts`], `end`.
    ContextList,
    /// Replace a context's process with a fresh one: [`EventKind::Context`], `end`.
    ContextRestart(ContextRef),
    /// Remove a context (its process is killed): `end`.
    ContextRemove(ContextRef),
    /// Run code in a context: output, `result`, `display`, `exception` events, then `end` with
    /// `execution_count` and `duration_ms`.
    RunCode(RunCodeRequest),
    /// Interrupt the code running in a context: `end`.
    Interrupt(ContextRef),
    /// Start the python zygote, run warm-up code, create contexts and spares (template build
    /// time): the warm-up's output and `exception`, then `end`.
    Warmup(WarmupRequest),
}

impl Call {
    /// The call's `type` name on the wire.
    pub fn type_name(&self) -> &'static str {
        match self {
            Call::Ping => "ping",
            Call::Sync(_) => "sync",
            Call::Exec(_) => "exec",
            Call::FileRead(_) => "file_read",
            Call::FileWrite(_) => "file_write",
            Call::FileList(_) => "file_list",
            Call::FileStat(_) => "file_stat",
            Call::FileMkdir(_) => "file_mkdir",
            Call::FileRemove(_) => "file_remove",
            Call::FileRename(_) => "file_rename",
            Call::FileWatch(_) => "file_watch",
            Call::StdinWrite(_) => "stdin_write",
            Call::StdinClose(_) => "stdin_close",
            Call::ProcessList => "process_list",
            Call::ProcessAttach(_) => "process_attach",
            Call::ProcessSignal(_) => "process_signal",
            Call::ProcessResize(_) => "process_resize",
            Call::ContextCreate(_) => "context_create",
            Call::ContextList => "context_list",
            Call::ContextRestart(_) => "context_restart",
            Call::ContextRemove(_) => "context_remove",
            Call::RunCode(_) => "run_code",
            Call::Interrupt(_) => "interrupt",
            Call::Warmup(_) => "warmup",
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
    /// Return at once (`started`, `end`); the output is kept for `process_attach`.
    #[serde(default, skip_serializing_if = "is_false")]
    pub background: bool,
    /// Keep stdin a pipe for `stdin_write`/`stdin_close` (instead of `stdin` or `/dev/null`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub stdin_stream: bool,
    /// Run on a pseudo-terminal of this size (stdout carries its output; no stderr).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<PtySize>,
    /// The account to run as (default root).
    #[serde(default, skip_serializing_if = "ExecUser::is_root")]
    pub user: ExecUser,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// A terminal size, in character cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtySize {
    /// Columns.
    pub cols: u16,
    /// Rows.
    pub rows: u16,
}

/// Who an `exec` runs as.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecUser {
    /// uid 0, `HOME=/root`.
    #[default]
    Root,
    /// The unprivileged account `user` (uid 1000 in the templates), `HOME=/home/user`.
    User,
}

impl ExecUser {
    fn is_root(&self) -> bool {
        *self == ExecUser::Root
    }
}

/// Arguments of [`Call::FileRead`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileReadRequest {
    /// Guest path; relative paths are relative to `/workspace`.
    pub path: String,
    /// First byte to read (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
    /// Most bytes to read (default: to the end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub length: Option<u64>,
}

/// Arguments of [`Call::FileWrite`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileWriteRequest {
    /// Guest path; relative paths are relative to `/workspace`.
    pub path: String,
    /// Permission bits of a new file (default `0o644`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<u32>,
    /// Append to the file (written in place) instead of replacing it.
    #[serde(default, skip_serializing_if = "is_false")]
    pub append: bool,
    /// Create missing parent directories (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub create_dirs: Option<bool>,
}

/// Arguments of [`Call::FileList`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileListRequest {
    /// The directory.
    pub path: String,
    /// How deep to descend (default 1: the directory's own entries).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub depth: Option<u32>,
}

/// Arguments of calls that take only a path.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathRequest {
    /// Guest path; relative paths are relative to `/workspace`.
    pub path: String,
}

/// Arguments of [`Call::FileRemove`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRemoveRequest {
    /// What to remove.
    pub path: String,
    /// Remove a directory with everything in it.
    #[serde(default, skip_serializing_if = "is_false")]
    pub recursive: bool,
}

/// Arguments of [`Call::FileRename`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRenameRequest {
    /// The current path.
    pub from: String,
    /// The new path (replaced if it is a file).
    pub to: String,
}

/// Arguments of [`Call::FileWatch`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileWatchRequest {
    /// The directory (or file) to watch.
    pub path: String,
    /// Watch subdirectories too (including ones created later).
    #[serde(default, skip_serializing_if = "is_false")]
    pub recursive: bool,
}

/// Arguments of calls about one process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PidRequest {
    /// The process's pid in the guest (from `started`).
    pub pid: i32,
}

/// Arguments of [`Call::StdinWrite`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StdinWriteRequest {
    /// The process.
    pub pid: i32,
    /// Bytes for its stdin, base64 on the wire.
    #[serde(with = "b64")]
    pub data: Vec<u8>,
}

/// Arguments of [`Call::ProcessSignal`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessSignalRequest {
    /// The process (its group gets the signal).
    pub pid: i32,
    /// The signal number.
    pub signal: i32,
}

/// Arguments of [`Call::ProcessResize`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessResizeRequest {
    /// The process (started with `pty`).
    pub pid: i32,
    /// New width.
    pub cols: u16,
    /// New height.
    pub rows: u16,
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
    /// First event of every `exec`: the program's pid in the guest.
    Started {
        /// The pid (also its process group and session id).
        pid: i32,
    },
    /// First event of `file_read`: the file's metadata (binary frames follow).
    FileInfo(FileInfo),
    /// Answer to `file_write`: the file is in place.
    Written {
        /// The absolute guest path written.
        path: String,
        /// Bytes received (and written).
        bytes: u64,
    },
    /// A batch (at most [`MAX_ENTRIES_PER_EVENT`]) of `file_list` entries.
    Entries {
        /// The entries.
        entries: Vec<DirEntry>,
    },
    /// Answer to `file_stat` (nested: the event's own `type` tag would clash with the
    /// file's `type`).
    Stat {
        /// What the path is.
        stat: FileStat,
    },
    /// A change seen by `file_watch`.
    FsEvent {
        /// The absolute guest path that changed.
        path: String,
        /// What happened to it.
        op: FsOp,
    },
    /// Answer to `process_list`.
    Processes {
        /// The processes.
        processes: Vec<ProcessInfo>,
    },
    /// Answer to `context_create` and `context_restart`.
    Context(ContextInfo),
    /// Answer to `context_list`.
    Contexts {
        /// The contexts, by id.
        contexts: Vec<ContextInfo>,
    },
    /// The value of a cell's last expression.
    Result(ResultData),
    /// Something the code displayed (`display(...)`, a matplotlib figure).
    Display(DisplayData),
    /// The code raised (not terminal: `end` follows).
    Exception(Exception),
    /// The output cap of a `run_code` was reached; later output was dropped. Sent once.
    Truncated {
        /// The cap, in bytes.
        limit: u64,
    },
    /// The context's process had died and was replaced by a fresh one (first event of the
    /// `run_code` that found it dead).
    ContextRestarted {
        /// Why (how the old process ended).
        reason: String,
    },
    /// Terminal: the call is over.
    End {
        /// How it ended.
        status: EndStatus,
        /// `run_code`: the cell's number in its context.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        execution_count: Option<u64>,
        /// `run_code`: how long the code ran, in milliseconds.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        duration_ms: Option<u64>,
    },
    /// Terminal: the call failed (or, with id 0, a frame could not be understood).
    Error(ErrorInfo),
    /// An event type this version does not know (sent by a newer agent); clients skip it.
    #[serde(other)]
    Unknown,
}

impl EventKind {
    /// An `end` event with this status and no `run_code` fields.
    pub fn end(status: EndStatus) -> Self {
        EventKind::End {
            status,
            execution_count: None,
            duration_ms: None,
        }
    }

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

/// Most entries in one [`EventKind::Entries`] event.
pub const MAX_ENTRIES_PER_EVENT: usize = 1000;

/// Payload of [`EventKind::FileInfo`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileInfo {
    /// The file's size in bytes (the whole file, whatever range was asked for).
    pub size: u64,
    /// `st_mode` permission and type bits.
    pub mode: u32,
    /// Last modification, milliseconds since the Unix epoch.
    pub mtime_ms: i64,
}

/// What kind of file a path names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileType {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link (not followed).
    Symlink,
    /// Anything else (device, socket, fifo) or a type this version does not know.
    #[serde(other)]
    Other,
}

/// One entry of [`EventKind::Entries`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    /// Absolute guest path.
    pub path: String,
    /// The last path component.
    pub name: String,
    /// Its type (symbolic links are not followed).
    #[serde(rename = "type")]
    pub kind: FileType,
    /// Size in bytes.
    pub size: u64,
    /// `st_mode`.
    pub mode: u32,
    /// Last modification, milliseconds since the Unix epoch.
    pub mtime_ms: i64,
}

/// Payload of [`EventKind::Stat`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStat {
    /// Absolute guest path.
    pub path: String,
    /// Its type (a symbolic link is reported as such, not followed).
    #[serde(rename = "type")]
    pub kind: FileType,
    /// Size in bytes.
    pub size: u64,
    /// `st_mode`.
    pub mode: u32,
    /// Last modification, milliseconds since the Unix epoch.
    pub mtime_ms: i64,
}

/// What a [`EventKind::FsEvent`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FsOp {
    /// Created (file, directory, link) or moved in.
    Create,
    /// Written (reported when the writer closes the file or on each write).
    Write,
    /// Removed.
    Remove,
    /// Moved away (renamed).
    Rename,
    /// An operation this version does not know.
    #[serde(other)]
    Unknown,
}

/// One process of [`EventKind::Processes`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessInfo {
    /// Its pid in the guest.
    pub pid: i32,
    /// Its argv as requested.
    pub argv: Vec<String>,
    /// Started with `background`.
    pub background: bool,
    /// Runs on a pseudo-terminal.
    pub pty: bool,
    /// Still running.
    pub running: bool,
    /// How it ended, once it has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit: Option<ExitStatus>,
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
    /// `run_code`: the code raised an exception (an `exception` event came before).
    Error,
    /// `run_code`: the code was interrupted (`interrupt`, or the host hung up).
    Interrupted,
    /// `run_code`: the context's process died while the code ran.
    ContextDied,
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
    /// The path does not exist (`ENOENT`).
    NotFound,
    /// The path (or id) already exists (`EEXIST`).
    Exists,
    /// A component of the path is not a directory, or a directory was expected.
    NotADirectory,
    /// The path is a directory where a file was expected.
    IsADirectory,
    /// The agent may not do that to the path (`EACCES`, `EPERM`, `EROFS`).
    PermissionDenied,
    /// No process with that pid was started by the agent (or it was already collected).
    NoSuchProcess,
    /// A binary frame from the host carried more than [`MAX_BINARY_CHUNK`] bytes.
    OversizeChunk,
    /// No code context has that id.
    NoSuchContext,
    /// A code context's process could not be started.
    ContextFailed,
    /// The agent hit an I/O error while serving the call.
    Io,
    /// A bug in the agent.
    Internal,
    /// A code this version does not know.
    #[serde(other)]
    Unknown,
}

/// A MIME bundle: MIME type to value.
pub type MimeBundle = serde_json::Map<String, serde_json::Value>;

/// The languages of code contexts, as they appear in `language` fields (a template may have
/// only some of them: `context_create` of one it lacks is refused with the list it has).
pub const LANGUAGES: [&str; 6] = ["python", "bash", "javascript", "typescript", "r", "java"];

/// The language a `language` field names, aliases and case folded (`js`, `ts`, `R`,
/// `python3`, `sh`, `node`); None: not a context language.
pub fn canonical_language(name: &str) -> Option<&'static str> {
    let name = name.trim().to_ascii_lowercase();
    Some(match name.as_str() {
        "python" | "python3" => "python",
        "bash" | "sh" => "bash",
        "javascript" | "js" | "node" | "nodejs" => "javascript",
        "typescript" | "ts" => "typescript",
        "r" => "r",
        "java" => "java",
        _ => return None,
    })
}

/// The context a `run_code` without a context id runs in, per (canonical) language: `default`
/// for python, `default-bash`, `default-javascript`, ... for the others.
pub fn default_context(language: &str) -> &'static str {
    match canonical_language(language) {
        Some("bash") => "default-bash",
        Some("javascript") => "default-javascript",
        Some("typescript") => "default-typescript",
        Some("r") => "default-r",
        Some("java") => "default-java",
        _ => "default",
    }
}

/// Arguments of [`Call::ContextCreate`] (and one context of [`WarmupRequest::contexts`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContextCreateRequest {
    /// The context's language: `python` (default) or another of [`LANGUAGES`] (or an alias:
    /// [`canonical_language`]).
    #[serde(default = "python")]
    pub language: String,
    /// Working directory (default `/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Environment variables set in the context.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// The id (letters, digits, `.`, `_`, `-`; at most 64); default: chosen by the agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
}

/// Arguments of calls about one context.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContextRef {
    /// The context's id.
    pub context: String,
}

/// Arguments of [`Call::RunCode`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunCodeRequest {
    /// The context; default `default` (python) or `default-bash`, created on first use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<String>,
    /// The language, when no context is named: `python` (default) or `bash`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub language: Option<String>,
    /// The code.
    pub code: String,
    /// Time limit in milliseconds: then SIGINT, and a kill 2 s later. None: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Environment variables set for this call only.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Most stdout + stderr + display bytes sent (default [`DEFAULT_OUTPUT_CAP`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_cap: Option<u64>,
    /// A cell that leaves no trace in the context's history: a Python context runs it
    /// without storing it (its execution count does not advance). The runtime's warm pool
    /// runs one in a primed member's default context, so that the pages a first cell touches
    /// are mapped before a user's first cell; other languages ignore it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub silent: bool,
}

impl RunCodeRequest {
    /// A request running `code` in the default python context.
    pub fn new(code: impl Into<String>) -> Self {
        Self {
            code: code.into(),
            ..Self::default()
        }
    }
}

/// Default output cap of a `run_code` call, in bytes.
pub const DEFAULT_OUTPUT_CAP: u64 = 10 * 1024 * 1024;

/// Arguments of [`Call::Warmup`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WarmupRequest {
    /// Python run in the zygote after `import IPython` (imports, a first figure...).
    #[serde(default)]
    pub code: String,
    /// Contexts to create (each with its `id`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub contexts: Vec<ContextCreateRequest>,
    /// Spare contexts to keep ready, per language (`{"python": 1, "bash": 1}`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub spare: BTreeMap<String, u32>,
    /// Environment of the zygote (so of every python context forked from it) and of spares.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
}

fn python() -> String {
    "python".into()
}

/// Payload of [`EventKind::Context`] and one entry of [`EventKind::Contexts`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContextInfo {
    /// The id.
    pub id: String,
    /// The language (one of [`LANGUAGES`]).
    pub language: String,
    /// Its working directory when it started.
    pub cwd: String,
    /// Its process's pid in the guest (0 while it has none).
    pub pid: i32,
    /// `context_list`: whether code is running in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub busy: Option<bool>,
}

/// Payload of [`EventKind::Result`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResultData {
    /// MIME type to value (text as strings, `image/png` and `image/jpeg` as base64 strings,
    /// `application/json` as JSON).
    pub data: MimeBundle,
    /// The cell's number in its context.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub execution_count: Option<u64>,
}

/// Payload of [`EventKind::Display`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DisplayData {
    /// MIME type to value, as in [`ResultData::data`].
    pub data: MimeBundle,
    /// Per-MIME metadata, when there is any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<MimeBundle>,
}

/// Payload of [`EventKind::Exception`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Exception {
    /// The exception's type (`ZeroDivisionError`, `KeyboardInterrupt`, `ContextDied`...).
    pub name: String,
    /// Its message.
    pub value: String,
    /// The traceback, as text lines.
    #[serde(default)]
    pub traceback: Vec<String>,
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
    /// A binary frame too short to hold its call id (it was skipped).
    #[error("binary frame of {len} bytes is shorter than its 8-byte call id")]
    ShortBinary {
        /// Its body length.
        len: usize,
    },
    /// A binary frame where only JSON frames are expected (it was skipped).
    #[error("unexpected binary frame for call {id}")]
    UnexpectedBinary {
        /// The call id it carried.
        id: u64,
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

/// The header and call id of a binary frame carrying `len` bytes (`len` must be at most
/// [`MAX_BINARY_CHUNK`]; larger values are the caller's bug and are cut to the 31-bit field).
pub fn binary_header(id: u64, len: usize) -> [u8; BINARY_HEADER_LEN] {
    let body = u32::try_from(len.saturating_add(8)).unwrap_or(u32::MAX) & !BINARY_FLAG;
    let mut header = [0u8; BINARY_HEADER_LEN];
    header[..HEADER_LEN].copy_from_slice(&(BINARY_FLAG | body).to_le_bytes());
    header[HEADER_LEN..].copy_from_slice(&id.to_le_bytes());
    header
}

/// Appends one binary frame (call `id`, `data`) to `out`; refuses more than
/// [`MAX_BINARY_CHUNK`] bytes. An empty `data` is the end-of-stream frame.
pub fn encode_binary_frame(id: u64, data: &[u8], out: &mut Vec<u8>) -> Result<(), FrameError> {
    if data.len() > MAX_BINARY_CHUNK {
        return Err(FrameError::TooLarge {
            len: data.len() as u64,
            max: MAX_BINARY_CHUNK as u32,
        });
    }
    out.extend_from_slice(&binary_header(id, data.len()));
    out.extend_from_slice(data);
    Ok(())
}

/// One frame cut by a [`FrameReader`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frame<'a> {
    /// A JSON body (a request or an event).
    Json(&'a [u8]),
    /// Raw bytes of a call's data stream; empty `data` ends the stream.
    Binary {
        /// The call the bytes belong to.
        id: u64,
        /// The bytes.
        data: &'a [u8],
    },
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
    /// Largest binary payload accepted.
    max_binary: u32,
    /// Whether the frame last returned was binary (its buffer is kept for the next one).
    last_binary: bool,
    /// Most bytes one `recv(MSG_WAITALL)` waits for in [`FrameReader::read_any_socket`]
    /// (halved when the socket refuses: a vsock receive buffer smaller than the wait).
    waitall_max: usize,
}

impl FrameReader {
    /// A reader accepting JSON bodies and binary payloads of at most `max` bytes.
    pub fn new(max: u32) -> Self {
        Self {
            buf: Vec::new(),
            start: 0,
            end: 0,
            returned: 0,
            max,
            max_binary: max,
            last_binary: false,
            waitall_max: MAX_BINARY_CHUNK + 64,
        }
    }

    /// Changes the largest binary payload accepted (the client takes at most
    /// [`MAX_BINARY_CHUNK`]; the agent accepts more so that it can answer `oversize_chunk`).
    pub fn with_binary_limit(mut self, max_binary: u32) -> Self {
        self.max_binary = max_binary;
        self
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

    /// Puts the frame last returned back: the next call returns it again.
    pub fn unread(&mut self) {
        self.returned = 0;
    }

    fn release(&mut self) {
        self.start += self.returned;
        self.returned = 0;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            // Give back what a big frame needed; a buffer sized for binary chunks is kept while
            // they stream (one allocation per stream, not per chunk).
            let keep = if self.last_binary {
                (self.max_binary as usize).min(MAX_BINARY_CHUNK) + BINARY_HEADER_LEN + READ_CHUNK
            } else {
                2 * READ_CHUNK
            };
            if self.buf.len() > keep.max(2 * READ_CHUNK) {
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
        self.fill_from(r, None)
    }

    /// [`FrameReader::fill`], but when the front frame's header is in and more than a little of
    /// it is missing, waits for the rest of that frame in one `recv(MSG_WAITALL)` on `socket`
    /// (the descriptor `r` reads from) instead of one read per arriving packet: a vsock stream
    /// delivers 4 KiB packets, and a read per packet is a guest syscall each (milliseconds on
    /// kvm_pvm) for a 1 MiB binary frame.
    fn fill_from<R: Read + ?Sized>(
        &mut self,
        r: &mut R,
        socket: Option<RawFd>,
    ) -> io::Result<usize> {
        self.release();
        // Room for the whole frame at the front when its header is in and within the limit (so
        // that a big frame takes few reads); otherwise just room for more bytes.
        let frame = match self.header() {
            Some((binary, len)) if len <= self.limit(binary) => HEADER_LEN + len,
            _ => 0,
        };
        self.reserve(frame.max(self.end - self.start + 1));
        let missing = (self.start + frame).saturating_sub(self.end);
        if let (Some(fd), true) = (socket, missing > WAITALL_MIN && self.waitall_max > 0) {
            let want = missing.min(self.waitall_max);
            let room = &mut self.buf[self.end..self.end + want];
            loop {
                // SAFETY: `room` is a valid, writable buffer of `room.len()` bytes for the
                // duration of the call; `fd` is the open socket `r` reads from.
                let n = unsafe {
                    libc::recv(fd, room.as_mut_ptr().cast(), room.len(), libc::MSG_WAITALL)
                };
                if n >= 0 {
                    self.end += n as usize;
                    return Ok(n as usize);
                }
                let e = io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::ENOMEM) {
                    // vsock refuses to wait for as much as its receive buffer holds: ask for
                    // less from now on (down to plain reads).
                    self.waitall_max /= 2;
                    if self.waitall_max <= WAITALL_MIN {
                        self.waitall_max = 0;
                    }
                    return self.fill_from(r, socket);
                }
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
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

    /// The frame at the front: whether it is binary, and its body length. `None` while the
    /// header is incomplete.
    fn header(&self) -> Option<(bool, usize)> {
        let data = &self.buf[self.start..self.end];
        let header: [u8; HEADER_LEN] = data.get(..HEADER_LEN)?.try_into().ok()?;
        let word = u32::from_le_bytes(header);
        Some((word & BINARY_FLAG != 0, (word & !BINARY_FLAG) as usize))
    }

    /// Largest body length of a frame of this kind.
    fn limit(&self, binary: bool) -> usize {
        if binary {
            self.max_binary as usize + 8
        } else {
            self.max as usize
        }
    }

    /// Checks the frame at the front; if it is complete, marks it returned and says whether
    /// it is binary.
    fn front(&mut self) -> Result<Option<bool>, FrameError> {
        self.release();
        let Some((binary, len)) = self.header() else {
            return Ok(None);
        };
        if len > self.limit(binary) {
            return Err(FrameError::TooLarge {
                len: if binary { len as u64 - 8 } else { len as u64 },
                max: if binary { self.max_binary } else { self.max },
            });
        }
        if self.end - self.start < HEADER_LEN + len {
            return Ok(None);
        }
        self.returned = HEADER_LEN + len;
        self.last_binary = binary;
        if binary && len < 8 {
            return Err(FrameError::ShortBinary { len });
        }
        Ok(Some(binary))
    }

    /// The frame marked returned by [`FrameReader::front`].
    fn returned_frame(&self, binary: bool) -> Frame<'_> {
        let body = &self.buf[self.start + HEADER_LEN..self.start + self.returned];
        match body.split_first_chunk::<8>() {
            Some((id, data)) if binary => Frame::Binary {
                id: u64::from_le_bytes(*id),
                data,
            },
            _ => Frame::Json(body),
        }
    }

    /// The complete frame at the front of the buffer, without reading. A binary frame shorter
    /// than its id is [`FrameError::ShortBinary`] and is skipped (the stream stays usable).
    pub fn next_any(&mut self) -> Result<Option<Frame<'_>>, FrameError> {
        match self.front()? {
            Some(binary) => Ok(Some(self.returned_frame(binary))),
            None => Ok(None),
        }
    }

    /// The next frame, reading from `r` as needed. `Ok(None)` at a clean end of stream (EOF
    /// between frames); EOF inside a frame is [`FrameError::Truncated`]. A header over the
    /// limit is [`FrameError::TooLarge`] before any of its body is read. The frame borrows the
    /// buffer until the next call.
    pub fn read_any<R: Read + ?Sized>(
        &mut self,
        r: &mut R,
    ) -> Result<Option<Frame<'_>>, FrameError> {
        self.read_any_from(r, None)
    }

    /// [`FrameReader::read_any`] on a socket: the rest of a large frame is awaited in one
    /// `recv(MSG_WAITALL)` on `socket` (the descriptor `r` reads from).
    pub fn read_any_socket<R: Read + ?Sized>(
        &mut self,
        r: &mut R,
        socket: RawFd,
    ) -> Result<Option<Frame<'_>>, FrameError> {
        self.read_any_from(r, Some(socket))
    }

    fn read_any_from<R: Read + ?Sized>(
        &mut self,
        r: &mut R,
        socket: Option<RawFd>,
    ) -> Result<Option<Frame<'_>>, FrameError> {
        loop {
            // Checked in two steps so that the borrow of the buffer ends before `fill`.
            if let Some(binary) = self.front()? {
                return Ok(Some(self.returned_frame(binary)));
            }
            if self.fill_from(r, socket)? == 0 {
                let have = self.end - self.start;
                if have == 0 {
                    return Ok(None);
                }
                return Err(FrameError::Truncated {
                    have,
                    need: self
                        .header()
                        .map_or(HEADER_LEN, |(_, len)| HEADER_LEN + len),
                });
            }
        }
    }

    /// The body of the complete JSON frame at the front of the buffer, without reading; a
    /// binary frame there is [`FrameError::UnexpectedBinary`] (and is skipped).
    pub fn next_buffered(&mut self) -> Result<Option<&[u8]>, FrameError> {
        match self.next_any()? {
            None => Ok(None),
            Some(Frame::Json(body)) => Ok(Some(body)),
            Some(Frame::Binary { id, .. }) => Err(FrameError::UnexpectedBinary { id }),
        }
    }

    /// The next JSON frame's body, reading from `r` as needed (see [`FrameReader::read_any`]);
    /// for peers that send no binary frames: one is [`FrameError::UnexpectedBinary`].
    pub fn read_frame<R: Read + ?Sized>(&mut self, r: &mut R) -> Result<Option<&[u8]>, FrameError> {
        match self.read_any(r)? {
            None => Ok(None),
            Some(Frame::Json(body)) => Ok(Some(body)),
            Some(Frame::Binary { id, .. }) => Err(FrameError::UnexpectedBinary { id }),
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
            Call::FileRead(FileReadRequest::default()),
            Call::FileWrite(FileWriteRequest::default()),
            Call::FileList(FileListRequest::default()),
            Call::FileStat(PathRequest::default()),
            Call::FileMkdir(PathRequest::default()),
            Call::FileRemove(FileRemoveRequest::default()),
            Call::FileRename(FileRenameRequest::default()),
            Call::FileWatch(FileWatchRequest::default()),
            Call::StdinWrite(StdinWriteRequest::default()),
            Call::StdinClose(PidRequest::default()),
            Call::ProcessList,
            Call::ProcessAttach(PidRequest::default()),
            Call::ProcessSignal(ProcessSignalRequest::default()),
            Call::ProcessResize(ProcessResizeRequest::default()),
            Call::ContextCreate(ContextCreateRequest::default()),
            Call::ContextList,
            Call::ContextRestart(ContextRef::default()),
            Call::ContextRemove(ContextRef::default()),
            Call::RunCode(RunCodeRequest::default()),
            Call::Interrupt(ContextRef::default()),
            Call::Warmup(WarmupRequest::default()),
        ];
        for call in &calls {
            let value = serde_json::to_value(call).unwrap();
            assert_eq!(value["type"], call.type_name());
            assert!(
                CALL_TYPES.contains(&call.type_name()),
                "{}",
                call.type_name()
            );
            let back: Call = serde_json::from_value(value).unwrap();
            assert_eq!(&back, call);
        }
        let mut names = CALL_TYPES.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), CALL_TYPES.len(), "no duplicates");
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
                EventKind::end(EndStatus::TimedOut),
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
    fn code_context_messages_round_trip() {
        let mut run = RunCodeRequest::new("1 + 1");
        run.context = Some("c1".into());
        run.timeout_ms = Some(2000);
        run.env.insert("A".into(), "b".into());
        let request = Request {
            id: 3,
            call: Call::RunCode(run),
        };
        assert_eq!(
            round_trip_request(&request),
            json!({"id": 3, "call": {"type": "run_code", "context": "c1", "code": "1 + 1",
                   "timeout_ms": 2000, "env": {"A": "b"}}})
        );
        let create = decode_request(br#"{"id":1,"call":{"type":"context_create"}}"#).unwrap();
        match create.call {
            Call::ContextCreate(req) => assert_eq!(req.language, "python"),
            other => panic!("{other:?}"),
        }
        let warmup = decode_request(
            br#"{"id":1,"call":{"type":"warmup","code":"import x","spare":{"python":1},
                 "contexts":[{"id":"default","language":"bash"}]}}"#,
        )
        .unwrap();
        match warmup.call {
            Call::Warmup(req) => {
                assert_eq!(req.spare.get("python"), Some(&1));
                assert_eq!(req.contexts[0].language, "bash");
            }
            other => panic!("{other:?}"),
        }
        let mut data = MimeBundle::new();
        data.insert("text/plain".into(), json!("2"));
        data.insert("application/json".into(), json!({"a": [1]}));
        let cases = [
            (
                EventKind::Result(ResultData {
                    data: data.clone(),
                    execution_count: Some(4),
                }),
                json!({"type": "result", "data": {"text/plain": "2", "application/json": {"a": [1]}},
                       "execution_count": 4}),
            ),
            (
                EventKind::Display(DisplayData {
                    data,
                    metadata: None,
                }),
                json!({"type": "display", "data": {"text/plain": "2", "application/json": {"a": [1]}}}),
            ),
            (
                EventKind::Exception(Exception {
                    name: "E".into(),
                    value: "v".into(),
                    traceback: vec!["t".into()],
                }),
                json!({"type": "exception", "name": "E", "value": "v", "traceback": ["t"]}),
            ),
            (
                EventKind::Truncated { limit: 10 },
                json!({"type": "truncated", "limit": 10}),
            ),
            (
                EventKind::ContextRestarted { reason: "r".into() },
                json!({"type": "context_restarted", "reason": "r"}),
            ),
            (
                EventKind::End {
                    status: EndStatus::ContextDied,
                    execution_count: Some(2),
                    duration_ms: Some(15),
                },
                json!({"type": "end", "status": "context_died", "execution_count": 2,
                       "duration_ms": 15}),
            ),
            // v1 output is unchanged.
            (
                EventKind::end(EndStatus::Ok),
                json!({"type": "end", "status": "ok"}),
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
            decode_event(br#"{"id":1,"event":{"type":"hologram","mime":"image/png"}}"#).unwrap();
        assert_eq!(event.event, EventKind::Unknown);
        assert!(!event.event.is_terminal());
        let event =
            decode_event(br#"{"id":1,"event":{"type":"end","status":"cancelled"}}"#).unwrap();
        assert_eq!(event.event, EventKind::end(EndStatus::Unknown));
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
            decode_request(br#"{"id":7,"call":{"type":"teleport","code":"1+1"}}"#).unwrap_err();
        assert_eq!((id, err.code), (7, ErrorCode::UnknownCall));
        assert!(err.message.contains("\"teleport\""), "{}", err.message);
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
    fn binary_frames_interleave_with_json_frames() {
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
        encode_binary_frame(7, b"raw \x00\xff bytes", &mut stream).unwrap();
        encode_binary_frame(7, b"", &mut stream).unwrap();
        // Header: bit 31 set, length = 8 (id) + payload.
        assert_eq!(&binary_header(7, 3)[..4], &(BINARY_FLAG | 11).to_le_bytes());
        for max_per_read in [1, 5, usize::MAX] {
            let mut reads = 0;
            let mut src = CountingReader {
                data: &stream,
                reads: &mut reads,
                max_per_read,
            };
            let mut reader = FrameReader::new(MAX_FRAME);
            assert!(matches!(
                reader.read_any(&mut src).unwrap(),
                Some(Frame::Json(body)) if decode_request(body).unwrap().id == 1
            ));
            assert_eq!(
                reader.read_any(&mut src).unwrap(),
                Some(Frame::Binary {
                    id: 7,
                    data: &b"raw \x00\xff bytes"[..]
                })
            );
            assert_eq!(
                reader.read_any(&mut src).unwrap(),
                Some(Frame::Binary { id: 7, data: &[] })
            );
            assert_eq!(reader.read_any(&mut src).unwrap(), None);
        }
        // JSON-only readers refuse binary frames (and skip them).
        let mut reader = FrameReader::new(MAX_FRAME);
        let mut src = &stream[..];
        reader.read_frame(&mut src).unwrap().unwrap();
        assert!(matches!(
            reader.read_frame(&mut src),
            Err(FrameError::UnexpectedBinary { id: 7 })
        ));
        // A frame can be put back.
        let mut reader = FrameReader::new(MAX_FRAME);
        let mut src = &stream[..];
        reader.read_any(&mut src).unwrap();
        reader.unread();
        assert!(matches!(
            reader.read_any(&mut src),
            Ok(Some(Frame::Json(_)))
        ));
    }

    #[test]
    fn binary_frame_limits() {
        // The encoder refuses more than a chunk.
        let mut out = Vec::new();
        assert!(matches!(
            encode_binary_frame(1, &vec![0; MAX_BINARY_CHUNK + 1], &mut out),
            Err(FrameError::TooLarge { .. })
        ));
        assert!(out.is_empty());
        encode_binary_frame(1, &vec![0; MAX_BINARY_CHUNK], &mut out).unwrap();
        // A reader with a chunk limit refuses larger payloads before reading them.
        let mut big = binary_header(1, MAX_BINARY_CHUNK + 1).to_vec();
        big.extend_from_slice(&[0; 16]);
        let mut reader = FrameReader::new(MAX_FRAME).with_binary_limit(MAX_BINARY_CHUNK as u32);
        assert!(matches!(
            reader.read_any(&mut &big[..]),
            Err(FrameError::TooLarge { len, .. }) if len == MAX_BINARY_CHUNK as u64 + 1
        ));
        let mut reader = FrameReader::new(MAX_FRAME).with_binary_limit(MAX_BINARY_CHUNK as u32);
        assert!(matches!(
            reader.read_any(&mut &out[..]),
            Ok(Some(Frame::Binary { id: 1, data })) if data.len() == MAX_BINARY_CHUNK
        ));
        // A binary frame too short for its id is skipped with an error.
        let mut short = (BINARY_FLAG | 3).to_le_bytes().to_vec();
        short.extend_from_slice(b"abc");
        encode_binary_frame(2, b"x", &mut short).unwrap();
        let mut reader = FrameReader::new(MAX_FRAME);
        let mut src = &short[..];
        assert!(matches!(
            reader.read_any(&mut src),
            Err(FrameError::ShortBinary { len: 3 })
        ));
        assert_eq!(
            reader.read_any(&mut src).unwrap(),
            Some(Frame::Binary { id: 2, data: b"x" })
        );
    }

    #[test]
    fn file_and_process_events_round_trip() {
        let cases = [
            (
                EventKind::Started { pid: 42 },
                json!({"type": "started", "pid": 42}),
            ),
            (
                EventKind::FileInfo(FileInfo {
                    size: 5,
                    mode: 0o100644,
                    mtime_ms: 1,
                }),
                json!({"type": "file_info", "size": 5, "mode": 0o100644, "mtime_ms": 1}),
            ),
            (
                EventKind::Written {
                    path: "/a".into(),
                    bytes: 3,
                },
                json!({"type": "written", "path": "/a", "bytes": 3}),
            ),
            (
                EventKind::Entries {
                    entries: vec![DirEntry {
                        path: "/a/b".into(),
                        name: "b".into(),
                        kind: FileType::Dir,
                        size: 0,
                        mode: 0o40755,
                        mtime_ms: 2,
                    }],
                },
                json!({"type": "entries", "entries": [{"path": "/a/b", "name": "b",
                       "type": "dir", "size": 0, "mode": 0o40755, "mtime_ms": 2}]}),
            ),
            (
                EventKind::Stat {
                    stat: FileStat {
                        path: "/a".into(),
                        kind: FileType::Symlink,
                        size: 1,
                        mode: 0o120777,
                        mtime_ms: 3,
                    },
                },
                json!({"type": "stat", "stat": {"path": "/a", "type": "symlink", "size": 1,
                       "mode": 0o120777, "mtime_ms": 3}}),
            ),
            (
                EventKind::FsEvent {
                    path: "/w/x".into(),
                    op: FsOp::Create,
                },
                json!({"type": "fs_event", "path": "/w/x", "op": "create"}),
            ),
            (
                EventKind::Processes {
                    processes: vec![ProcessInfo {
                        pid: 9,
                        argv: vec!["sleep".into()],
                        background: true,
                        pty: false,
                        running: false,
                        exit: Some(ExitStatus::Code(0)),
                    }],
                },
                json!({"type": "processes", "processes": [{"pid": 9, "argv": ["sleep"],
                       "background": true, "pty": false, "running": false,
                       "exit": {"code": 0}}]}),
            ),
        ];
        for (kind, expected) in cases {
            let value = round_trip_event(&Event { id: 3, event: kind });
            assert_eq!(value, json!({"id": 3, "event": expected}));
        }
        let mut exec = ExecRequest::new(["sh"]);
        exec.background = true;
        exec.stdin_stream = true;
        exec.pty = Some(PtySize { cols: 80, rows: 24 });
        exec.user = ExecUser::User;
        assert_eq!(
            round_trip_request(&Request {
                id: 1,
                call: Call::Exec(exec)
            }),
            json!({"id": 1, "call": {"type": "exec", "argv": ["sh"], "background": true,
                   "stdin_stream": true, "pty": {"cols": 80, "rows": 24}, "user": "user"}})
        );
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
