//! The call surface: every operation on the runtime as one serializable [`Request`], with a
//! typed reply, handled in one place ([`Runtime::handle`]).
//!
//! Each call is a struct of its arguments (`Get { id }`, `RunCode { id, req }`, …) that names
//! its reply type through [`Call`], so a caller writes `runtime.call(Get { id }, Io::none())?`
//! and gets a `SandboxInfo` back. The structs are gathered into [`Request`] (what crosses a
//! process or host boundary: serde, tagged `{"call": "get", "args": {...}}`) and their replies
//! into [`Reply`]. The server's surfaces (native API, E2B adapter), the CLI and the fleet's
//! gateway translate what they receive into these requests and nothing else; Firecracker's
//! `VmmAction`/`VmmData` is the model.
//!
//! Streams are not serialized: a call that produces events (`RunCode`, `Exec`), takes bytes
//! (`WriteFile`), gives bytes (`ReadFile`) or reports progress (`BuildTemplate`) gets them
//! through [`Io`], beside the request. An event sink that returns `false` cancels the call
//! (the guest work is interrupted): that is how a client that goes away stops its code.
//!
//! [`Runtime::handle`] is the one place every call goes through: it times the call, counts
//! it in [`Runtime::call_counts`], and dispatches. Auditing, the state check and the implicit
//! resume of a paused sandbox happen below it, in the one helper every sandbox call uses
//! (`calls.rs`, `Runtime::audited`).
//!
//! Adding a call: a line in the `calls!` list below, an arm in [`Runtime::dispatch`], the
//! runtime method it calls, and the route that sends it.

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

/// The guest's vocabulary, as the call surface speaks it: what a program, a file, a context
/// or an event is. The types are the agent protocol's (the runtime passes them through
/// unchanged), named here so that the layers above the runtime — the server's surfaces, the
/// CLI, the fleet's gateway — depend on the call surface alone, never on the agent protocol.
pub use ember_agent::protocol::{
    canonical_language, default_context, ContextInfo, DirEntry, EndStatus, ErrorCode, EventKind,
    Exception, ExecRequest, ExecUser, ExitStatus, FileStat, FileType, FsOp, ProcessInfo, PtySize,
    ResultData, RunCodeRequest, LANGUAGES,
};

pub use crate::cancel::{Cancel, CancelOnDrop};

use crate::template::{BuildEvent, BuildOptions, Template};
use crate::{
    ArtifactInfo, AuditFilter, AuditRecord, CreateRequest, ExposedPort, ForkRequest, FsChange,
    ListFilter, LogKind, LogTail, Metrics, NetworkInfo, NetworkPolicy, OnTimeout, ProcessEnd,
    ProcessRecord, RunEnd, Runtime, RuntimeError, SandboxInfo, SnapshotInfo, SnapshotRequest,
    TemplateSummary, Transition, Usage,
};

/// One call: its arguments (the struct), its reply type and its name (as audited and timed).
pub trait Call: Into<Request> {
    /// What it answers.
    type Reply;
    /// Its name (`snake_case`, as in the serialized [`Request`]).
    const NAME: &'static str;
    /// Its reply out of a [`Reply`] (None: the handler answered another call's reply).
    fn reply(r: Reply) -> Option<Self::Reply>;
}

/// The streams of a call, beside its request.
#[derive(Default)]
pub struct Io<'a> {
    /// Events of `RunCode` and `Exec`, as the guest produces them; `false` stops the call.
    pub events: Option<&'a mut dyn FnMut(&EventKind) -> bool>,
    /// The bytes `WriteFile` writes.
    pub input: Option<&'a mut dyn Read>,
    /// Where `ReadFile` writes the file's bytes.
    pub output: Option<&'a mut dyn Write>,
    /// `BuildTemplate`'s progress.
    pub progress: Option<&'a mut dyn FnMut(BuildEvent)>,
    /// Stops a long call (`ProcessAttach`, `Watch`) from outside it: a stream that may stay
    /// silent for hours cannot rely on its event sink to notice that its caller went away.
    pub cancel: Option<Arc<Cancel>>,
}

impl Io<'_> {
    /// The same sinks, borrowed again: for a caller that may send a call a second time when
    /// the first attempt was refused before anything streamed (a router that followed a
    /// stale route). Not for a call with input: the first attempt consumes it.
    pub fn reborrow(&mut self) -> Io<'_> {
        Io {
            events: match &mut self.events {
                Some(e) => Some(&mut **e),
                None => None,
            },
            input: match &mut self.input {
                Some(r) => Some(&mut **r),
                None => None,
            },
            output: match &mut self.output {
                Some(w) => Some(&mut **w),
                None => None,
            },
            progress: match &mut self.progress {
                Some(p) => Some(&mut **p),
                None => None,
            },
            cancel: self.cancel.clone(),
        }
    }
}

impl std::fmt::Debug for Io<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Io")
            .field("events", &self.events.is_some())
            .field("input", &self.input.is_some())
            .field("output", &self.output.is_some())
            .field("progress", &self.progress.is_some())
            .field("cancel", &self.cancel.is_some())
            .finish()
    }
}

impl<'a> Io<'a> {
    /// No streams (every call but the four above).
    pub fn none() -> Self {
        Io::default()
    }
    /// An event sink.
    pub fn events(f: &'a mut dyn FnMut(&EventKind) -> bool) -> Self {
        Io {
            events: Some(f),
            ..Io::default()
        }
    }
    /// Bytes in.
    pub fn input(r: &'a mut dyn Read) -> Self {
        Io {
            input: Some(r),
            ..Io::default()
        }
    }
    /// Bytes out.
    pub fn output(w: &'a mut dyn Write) -> Self {
        Io {
            output: Some(w),
            ..Io::default()
        }
    }
    /// Build progress.
    pub fn progress(f: &'a mut dyn FnMut(BuildEvent)) -> Self {
        Io {
            progress: Some(f),
            ..Io::default()
        }
    }
    /// These streams, stoppable by `cancel`.
    pub fn with_cancel(self, cancel: Arc<Cancel>) -> Self {
        Io {
            cancel: Some(cancel),
            ..self
        }
    }
}

/// What handles calls: the [`Runtime`], and whatever stands in for it (the server's tests use
/// a fake; the fleet's gateway forwards to a node).
pub trait Handler: Send + Sync {
    /// Handles one request.
    fn handle(&self, req: Request, io: Io<'_>) -> Result<Reply, RuntimeError>;
}

/// [`Handler::handle`] with the call's own reply type (`Runtime::call` and the server's
/// `dyn Backend::call` are this).
pub fn call_dyn<C: Call, H: Handler + ?Sized>(
    h: &H,
    call: C,
    io: Io<'_>,
) -> Result<C::Reply, RuntimeError> {
    let r = h.handle(call.into(), io)?;
    C::reply(r).ok_or_else(|| {
        RuntimeError::Internal(format!("{}: the handler answered another call", C::NAME))
    })
}

macro_rules! calls {
    ($(
        $(#[$doc:meta])*
        $name:ident $snake:literal { $($(#[$fdoc:meta])* $field:ident : $ty:ty),* $(,)? } -> $reply:ty;
    )*) => {
        $(
            $(#[$doc])*
            #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
            pub struct $name { $($(#[$fdoc])* pub $field: $ty),* }

            impl Call for $name {
                type Reply = $reply;
                const NAME: &'static str = $snake;
                fn reply(r: Reply) -> Option<$reply> {
                    match r {
                        Reply::$name(v) => Some(v),
                        _ => None,
                    }
                }
            }

            impl From<$name> for Request {
                fn from(c: $name) -> Request {
                    Request::$name(c)
                }
            }
        )*

        /// Every call, as it crosses a process or host boundary.
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(tag = "call", content = "args", rename_all = "snake_case")]
        pub enum Request { $($name($name)),* }

        /// Every call's reply.
        #[derive(Debug, Clone, Serialize, Deserialize)]
        #[serde(tag = "call", content = "reply", rename_all = "snake_case")]
        pub enum Reply { $($name($reply)),* }

        impl Request {
            /// The call's name.
            pub fn name(&self) -> &'static str {
                match self { $(Request::$name(_) => $snake),* }
            }
            /// Every call's name, in declaration order.
            pub const NAMES: &'static [&'static str] = &[$($snake),*];
        }
    };
}

calls! {
    /// Built templates.
    ListTemplates "list_templates" {} -> Vec<TemplateSummary>;
    /// Builds a template (or finds it built); progress through [`Io::progress`].
    BuildTemplate "build_template" { name: String, rebuild: bool } -> TemplateSummary;
    /// Creates a sandbox.
    Create "create" { req: CreateRequest } -> SandboxInfo;
    /// Sandboxes that match a filter.
    List "list" { filter: ListFilter } -> Vec<SandboxInfo>;
    /// One sandbox.
    Get "get" { id: String } -> SandboxInfo;
    /// Kills a sandbox.
    Kill "kill" { id: String } -> SandboxInfo;
    /// Pauses a sandbox (snapshot to disk; its VMM exits).
    Pause "pause" { id: String } -> SandboxInfo;
    /// Resumes a paused sandbox; with `reboot`, from its disk alone (its memory ignored).
    Resume "resume" {
        id: String,
        #[serde(default)]
        reboot: bool,
    } -> SandboxInfo;
    /// Sets a sandbox's timeout (seconds from now) and what happens then.
    SetTimeout "set_timeout" { id: String, secs: u64, on_timeout: Option<OnTimeout> } -> SandboxInfo;
    /// Takes a named snapshot of a sandbox.
    TakeSnapshot "snapshot" { id: String, req: SnapshotRequest } -> SnapshotInfo;
    /// Named snapshots.
    ListSnapshots "snapshots" {} -> Vec<SnapshotInfo>;
    /// Deletes a named snapshot.
    DeleteSnapshot "delete_snapshot" { name: String } -> ();
    /// Creates a secret (its value is never returned by any call).
    SecretCreate "secret_create" {
        name: String,
        value: crate::secrets::SecretValue,
        #[serde(default)]
        description: Option<String>,
    } -> crate::secrets::SecretInfo;
    /// Every secret's name and metadata.
    SecretList "secret_list" {} -> Vec<crate::secrets::SecretInfo>;
    /// Replaces a secret's value.
    SecretRotate "secret_rotate" { name: String, value: crate::secrets::SecretValue } -> crate::secrets::SecretInfo;
    /// Deletes a secret.
    SecretDelete "secret_delete" { name: String } -> ();
    /// Creates a volume (docs/volumes.md).
    VolumeCreate "volume_create" {
        name: String,
        #[serde(default)]
        cap_bytes: Option<u64>,
    } -> crate::volumes::VolumeInfo;
    /// Every volume.
    VolumeList "volume_list" {} -> Vec<crate::volumes::VolumeInfo>;
    /// One volume.
    VolumeGet "volume_get" { name: String } -> crate::volumes::VolumeInfo;
    /// Deletes a volume (refused while mounted unless `force`).
    VolumeDelete "volume_delete" {
        name: String,
        #[serde(default)]
        force: bool,
    } -> ();
    /// A directory of a volume.
    VolumeListFiles "volume_list_files" { name: String, path: String } -> Vec<crate::volumes::VolumeEntry>;
    /// One path of a volume.
    VolumeStat "volume_stat" { name: String, path: String } -> crate::volumes::VolumeEntry;
    /// Reads a volume's file into [`Io::output`]; answers its length.
    VolumeReadFile "volume_read_file" { name: String, path: String } -> u64;
    /// Writes a volume's file from [`Io::input`] (atomically); answers the bytes written.
    VolumeWriteFile "volume_write_file" { name: String, path: String } -> u64;
    /// Makes a directory (and parents) in a volume.
    VolumeMkdir "volume_mkdir" { name: String, path: String } -> ();
    /// Removes a path of a volume.
    VolumeRemove "volume_remove" {
        name: String,
        path: String,
        #[serde(default)]
        recursive: bool,
    } -> ();
    /// Renames a path of a volume.
    VolumeRename "volume_rename" { name: String, from: String, to: String } -> ();
    /// Forks a sandbox into new ones.
    Fork "fork" { id: String, req: ForkRequest } -> Vec<SandboxInfo>;
    /// A sandbox's state history.
    History "history" { id: String } -> Vec<Transition>;
    /// The audit log.
    Audit "audit" { filter: AuditFilter } -> Vec<AuditRecord>;
    /// The runtime's counters.
    GetMetrics "metrics" {} -> Metrics;
    /// What a running sandbox uses on the host now.
    GetUsage "usage" { id: String } -> Usage;
    /// The last `max_bytes` of a sandbox's VMM log or serial console (host files; only
    /// while it has a VMM).
    GetLogTail "log_tail" { id: String, log: LogKind, max_bytes: u64 } -> LogTail;
    /// Creates a code context; with `context`, under that id (an existing one is an
    /// `exists` guest error).
    ContextCreate "context_create" {
        id: String,
        language: String,
        cwd: Option<String>,
        #[serde(default)]
        context: Option<String>,
    } -> ContextInfo;
    /// A sandbox's code contexts.
    ContextList "context_list" { id: String } -> Vec<ContextInfo>;
    /// Restarts a context (its state is lost).
    ContextRestart "context_restart" { id: String, context: String } -> ();
    /// Removes a context.
    ContextRemove "context_remove" { id: String, context: String } -> ();
    /// Interrupts the code running in a context.
    Interrupt "interrupt" { id: String, context: String } -> ();
    /// Sends a signal to a guest process.
    ProcessSignal "process_signal" { id: String, pid: i32, signal: i32 } -> ();
    /// Runs code in a context; events through [`Io::events`].
    RunCode "run_code" { id: String, req: RunCodeRequest } -> RunEnd;
    /// Runs a program; events through [`Io::events`].
    Exec "exec" { id: String, req: ExecRequest } -> EndStatus;
    /// Starts a background program (its own session; it outlives the call) with the
    /// template's environment, the sandbox's, then the request's, and records it with its
    /// tag and the caller's description of it; answers its pid.
    ProcessStart "process_start" {
        id: String,
        req: ExecRequest,
        tag: Option<String>,
        config: serde_json::Value,
    } -> u32;
    /// Streams a background program's output through [`Io::events`] — `Started` once the
    /// attach is on its way to the guest, then what it wrote so far (the last 1 MiB of each
    /// stream), then live — until it exits or [`Io::cancel`] fires.
    ProcessAttach "process_attach" { id: String, pid: u32 } -> ProcessEnd;
    /// The programs the agent started that run or have not been collected.
    ProcessList "process_list" { id: String } -> Vec<ProcessInfo>;
    /// Feeds a program's stdin (or terminal) with what [`Io::input`] gives, to its end;
    /// answers the bytes written.
    StdinWrite "stdin_write" { id: String, pid: u32 } -> u64;
    /// Closes a program's stdin.
    StdinClose "stdin_close" { id: String, pid: u32 } -> ();
    /// Resizes a program's terminal.
    ProcessResize "process_resize" { id: String, pid: u32, cols: u16, rows: u16 } -> ();
    /// Records a background process the caller started (its tag and description).
    ProcessRemember "process_remember" { id: String, process: ProcessRecord } -> ();
    /// The recorded processes of a sandbox, oldest first; with `running`, those not in it
    /// are forgotten first.
    ProcessRecords "process_records" { id: String, running: Option<Vec<u32>> } -> Vec<ProcessRecord>;
    /// Forgets one recorded process, or (no pid) all of a sandbox's.
    ProcessForget "process_forget" { id: String, pid: Option<u32> } -> ();
    /// Writes a guest file from [`Io::input`]; answers the bytes written. As `user`, the
    /// file (and the directories the write made under its home) is then theirs.
    WriteFile "write_file" {
        id: String,
        path: String,
        #[serde(default)]
        user: ExecUser,
    } -> u64;
    /// Reads a guest file into [`Io::output`]; answers the bytes read.
    ReadFile "read_file" { id: String, path: String } -> u64;
    /// Lists a guest directory.
    ListFiles "list_files" { id: String, path: String, depth: u32 } -> Vec<DirEntry>;
    /// Stats a guest path.
    Stat "stat" { id: String, path: String } -> FileStat;
    /// Makes a guest directory (and its parents); as `user`, with their rights, and theirs.
    Mkdir "mkdir" {
        id: String,
        path: String,
        #[serde(default)]
        user: ExecUser,
    } -> ();
    /// Removes a guest path.
    Remove "remove" { id: String, path: String, recursive: bool } -> ();
    /// Renames a guest path.
    Rename "rename" { id: String, from: String, to: String } -> ();
    /// Watches a guest directory: [`EventKind::FsEvent`]s through [`Io::events`] until the
    /// sink says stop or [`Io::cancel`] fires.
    Watch "watch" { id: String, path: String, recursive: bool } -> ();
    /// Creates a polling watcher on a guest directory; answers its id. The runtime keeps it
    /// (in the store: it outlives a server restart) until it is removed or its sandbox ends.
    WatcherCreate "watcher_create" { id: String, path: String, recursive: bool } -> String;
    /// The changes a polling watcher saw since the last poll, oldest first.
    WatcherEvents "watcher_events" { id: String, watcher: String } -> Vec<FsChange>;
    /// Removes a polling watcher.
    WatcherRemove "watcher_remove" { id: String, watcher: String } -> ();
    /// Copies the sandbox's outputs directory out as artifacts now.
    CollectArtifacts "collect_artifacts" { id: String } -> Vec<ArtifactInfo>;
    /// A sandbox's artifacts.
    Artifacts "artifacts" { id: String } -> Vec<ArtifactInfo>;
    /// Writes one artifact's bytes to `Io::output`; returns its length.
    ReadArtifact "read_artifact" { id: String, path: String } -> u64;
    /// A sandbox's network: policy, ports, counters.
    GetNetwork "network" { id: String } -> NetworkInfo;
    /// Changes a sandbox's network policy.
    SetNetwork "set_network" { id: String, policy: NetworkPolicy } -> NetworkInfo;
    /// Exposes a guest port.
    Expose "expose" { id: String, port: u16, public: bool } -> NetworkInfo;
    /// Closes an exposed port.
    Unexpose "unexpose" { id: String, port: u16 } -> NetworkInfo;
    /// The exposed port `port`, if it is.
    Exposed "exposed" { id: String, port: u16 } -> Option<ExposedPort>;
}

/// Names the calls addressed to one sandbox (their `id` field), for [`Request::sandbox`].
macro_rules! addressed {
    ($($name:ident),* $(,)?) => {
        impl Request {
            /// The sandbox the call is addressed to (`None`: a call about templates,
            /// snapshots, the audit log or the whole runtime). A fleet's gateway routes by it.
            pub fn sandbox(&self) -> Option<&str> {
                match self {
                    $(Request::$name(c) => Some(&c.id),)*
                    _ => None,
                }
            }
        }
    };
}

addressed!(
    Get,
    Kill,
    Pause,
    Resume,
    SetTimeout,
    TakeSnapshot,
    Fork,
    History,
    GetUsage,
    GetLogTail,
    ContextCreate,
    ContextList,
    ContextRestart,
    ContextRemove,
    Interrupt,
    ProcessSignal,
    RunCode,
    Exec,
    ProcessStart,
    ProcessAttach,
    ProcessList,
    StdinWrite,
    StdinClose,
    ProcessResize,
    ProcessRemember,
    ProcessRecords,
    ProcessForget,
    WriteFile,
    ReadFile,
    ListFiles,
    Stat,
    Mkdir,
    Remove,
    Rename,
    Watch,
    WatcherCreate,
    WatcherEvents,
    WatcherRemove,
    CollectArtifacts,
    Artifacts,
    ReadArtifact,
    GetNetwork,
    SetNetwork,
    Expose,
    Unexpose,
    Exposed,
);

fn missing(call: &str, what: &str) -> RuntimeError {
    RuntimeError::Internal(format!("{call}: the caller gave no {what}"))
}

impl Handler for Runtime {
    fn handle(&self, req: Request, io: Io<'_>) -> Result<Reply, RuntimeError> {
        let name = req.name();
        let t0 = Instant::now();
        let r = self.dispatch(req, io);
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        self.count_call(name, ms, r.is_ok());
        tracing::debug!(call = name, ms, ok = r.is_ok(), "call");
        r
    }
}

impl Runtime {
    /// Sends one call through [`Runtime::handle`] and takes its typed reply.
    pub fn call<C: Call>(&self, call: C, io: Io<'_>) -> Result<C::Reply, RuntimeError> {
        call_dyn(self, call, io)
    }

    /// The one dispatch of every [`Request`] to the method that does it.
    fn dispatch(&self, req: Request, io: Io<'_>) -> Result<Reply, RuntimeError> {
        let Io {
            events,
            input,
            output,
            progress,
            cancel,
        } = io;
        let mut no_events = |_: &EventKind| true;
        let events: &mut dyn FnMut(&EventKind) -> bool = match events {
            Some(f) => f,
            None => &mut no_events,
        };
        Ok(match req {
            Request::ListTemplates(ListTemplates {}) => Reply::ListTemplates(
                Template::list()?
                    .into_iter()
                    .map(|(name, t)| TemplateSummary::of(name, &t))
                    .collect(),
            ),
            Request::BuildTemplate(BuildTemplate { name, rebuild }) => {
                let opts = BuildOptions {
                    rebuild,
                    ..Default::default()
                };
                let mut quiet = |_: BuildEvent| {};
                let progress: &mut dyn FnMut(BuildEvent) = match progress {
                    Some(f) => f,
                    None => &mut quiet,
                };
                let t = Template::build(&name, &opts, progress)?;
                Reply::BuildTemplate(TemplateSummary::of(Some(name), &t))
            }
            Request::Create(Create { req }) => Reply::Create(self.create(&req)?),
            Request::List(List { filter }) => Reply::List(self.list(&filter)?),
            Request::Get(Get { id }) => Reply::Get(self.get(&id)?),
            Request::Kill(Kill { id }) => Reply::Kill(self.kill(&id)?),
            Request::Pause(Pause { id }) => Reply::Pause(self.pause(&id)?),
            Request::Resume(Resume { id, reboot }) => Reply::Resume(self.resume_with(&id, reboot)?),
            Request::SetTimeout(SetTimeout {
                id,
                secs,
                on_timeout,
            }) => Reply::SetTimeout(self.set_timeout(&id, secs, on_timeout)?),
            Request::TakeSnapshot(TakeSnapshot { id, req }) => {
                Reply::TakeSnapshot(self.snapshot(&id, &req)?)
            }
            Request::ListSnapshots(ListSnapshots {}) => Reply::ListSnapshots(self.snapshots()?),
            Request::DeleteSnapshot(DeleteSnapshot { name }) => {
                Reply::DeleteSnapshot(self.delete_snapshot(&name)?)
            }
            Request::SecretCreate(SecretCreate {
                name,
                value,
                description,
            }) => {
                Reply::SecretCreate(self.create_secret(&name, &value.0, description.as_deref())?)
            }
            Request::SecretList(SecretList {}) => Reply::SecretList(self.list_secrets()?),
            Request::SecretRotate(SecretRotate { name, value }) => {
                Reply::SecretRotate(self.rotate_secret(&name, &value.0)?)
            }
            Request::SecretDelete(SecretDelete { name }) => {
                Reply::SecretDelete(self.delete_secret(&name)?)
            }
            Request::VolumeCreate(VolumeCreate { name, cap_bytes }) => {
                Reply::VolumeCreate(self.create_volume(&name, cap_bytes)?)
            }
            Request::VolumeList(VolumeList {}) => Reply::VolumeList(self.list_volumes()?),
            Request::VolumeGet(VolumeGet { name }) => Reply::VolumeGet(self.volume(&name)?),
            Request::VolumeDelete(VolumeDelete { name, force }) => {
                Reply::VolumeDelete(self.delete_volume(&name, force)?)
            }
            Request::VolumeListFiles(VolumeListFiles { name, path }) => {
                Reply::VolumeListFiles(self.volume_list_files(&name, &path)?)
            }
            Request::VolumeStat(VolumeStat { name, path }) => {
                Reply::VolumeStat(self.volume_stat(&name, &path)?)
            }
            Request::VolumeReadFile(VolumeReadFile { name, path }) => {
                let out = output.ok_or_else(|| missing("volume_read_file", "output"))?;
                Reply::VolumeReadFile(self.volume_read_file(&name, &path, out)?)
            }
            Request::VolumeWriteFile(VolumeWriteFile { name, path }) => {
                let input = input.ok_or_else(|| missing("volume_write_file", "input"))?;
                Reply::VolumeWriteFile(self.volume_write_file(&name, &path, input)?)
            }
            Request::VolumeMkdir(VolumeMkdir { name, path }) => {
                Reply::VolumeMkdir(self.volume_mkdir(&name, &path)?)
            }
            Request::VolumeRemove(VolumeRemove {
                name,
                path,
                recursive,
            }) => Reply::VolumeRemove(self.volume_remove(&name, &path, recursive)?),
            Request::VolumeRename(VolumeRename { name, from, to }) => {
                Reply::VolumeRename(self.volume_rename(&name, &from, &to)?)
            }
            Request::Fork(Fork { id, req }) => Reply::Fork(self.fork(&id, &req)?),
            Request::History(History { id }) => Reply::History(self.history(&id)?),
            Request::Audit(Audit { filter }) => Reply::Audit(self.audit(&filter)?),
            Request::GetMetrics(GetMetrics {}) => Reply::GetMetrics(self.metrics()),
            Request::GetUsage(GetUsage { id }) => Reply::GetUsage(self.usage(&id)?),
            Request::GetLogTail(GetLogTail { id, log, max_bytes }) => {
                Reply::GetLogTail(self.log_tail(&id, log, max_bytes)?)
            }
            Request::ContextCreate(ContextCreate {
                id,
                language,
                cwd,
                context,
            }) => Reply::ContextCreate(self.context_create_as(
                &id,
                &language,
                cwd.as_deref(),
                context.as_deref(),
            )?),
            Request::ContextList(ContextList { id }) => Reply::ContextList(self.context_list(&id)?),
            Request::ContextRestart(ContextRestart { id, context }) => {
                Reply::ContextRestart(self.context_restart(&id, &context)?)
            }
            Request::ContextRemove(ContextRemove { id, context }) => {
                Reply::ContextRemove(self.context_remove(&id, &context)?)
            }
            Request::Interrupt(Interrupt { id, context }) => {
                Reply::Interrupt(self.interrupt(&id, &context)?)
            }
            Request::ProcessSignal(ProcessSignal { id, pid, signal }) => {
                Reply::ProcessSignal(self.process_signal(&id, pid, signal)?)
            }
            Request::RunCode(RunCode { id, req }) => {
                Reply::RunCode(self.run_code_cancellable(&id, &req, events, cancel)?)
            }
            Request::Exec(Exec { id, req }) => Reply::Exec(self.exec(&id, &req, events)?),
            Request::ProcessStart(ProcessStart {
                id,
                req,
                tag,
                config,
            }) => Reply::ProcessStart(self.process_start(&id, req, tag, config)?),
            Request::ProcessAttach(ProcessAttach { id, pid }) => {
                Reply::ProcessAttach(self.process_attach(&id, pid, events, cancel)?)
            }
            Request::ProcessList(ProcessList { id }) => Reply::ProcessList(self.process_list(&id)?),
            Request::StdinWrite(StdinWrite { id, pid }) => {
                let input = input.ok_or_else(|| missing("stdin_write", "bytes to write"))?;
                Reply::StdinWrite(self.stdin_write(&id, pid, input)?)
            }
            Request::StdinClose(StdinClose { id, pid }) => {
                Reply::StdinClose(self.stdin_close(&id, pid)?)
            }
            Request::ProcessResize(ProcessResize {
                id,
                pid,
                cols,
                rows,
            }) => Reply::ProcessResize(self.process_resize(&id, pid, cols, rows)?),
            Request::ProcessRemember(ProcessRemember { id, process }) => {
                Reply::ProcessRemember(self.remember_process(&id, process)?)
            }
            Request::ProcessRecords(ProcessRecords { id, running }) => {
                Reply::ProcessRecords(self.process_records(&id, running.as_deref())?)
            }
            Request::ProcessForget(ProcessForget { id, pid }) => {
                Reply::ProcessForget(self.forget_processes(&id, pid)?)
            }
            Request::WriteFile(WriteFile { id, path, user }) => {
                let input = input.ok_or_else(|| missing("write_file", "bytes to write"))?;
                Reply::WriteFile(self.write_file_as(&id, &path, input, user)?)
            }
            Request::ReadFile(ReadFile { id, path }) => {
                let output = output.ok_or_else(|| missing("read_file", "place for the bytes"))?;
                Reply::ReadFile(self.read_file(&id, &path, output)?)
            }
            Request::ListFiles(ListFiles { id, path, depth }) => {
                Reply::ListFiles(self.list_files(&id, &path, depth)?)
            }
            Request::Stat(Stat { id, path }) => Reply::Stat(self.stat(&id, &path)?),
            Request::Mkdir(Mkdir { id, path, user }) => {
                Reply::Mkdir(self.mkdir_as(&id, &path, user)?)
            }
            Request::Remove(Remove {
                id,
                path,
                recursive,
            }) => Reply::Remove(self.remove(&id, &path, recursive)?),
            Request::Rename(Rename { id, from, to }) => {
                Reply::Rename(self.rename(&id, &from, &to)?)
            }
            Request::Watch(Watch {
                id,
                path,
                recursive,
            }) => Reply::Watch(self.watch(&id, &path, recursive, events, cancel)?),
            Request::WatcherCreate(WatcherCreate {
                id,
                path,
                recursive,
            }) => Reply::WatcherCreate(self.watcher_create(&id, &path, recursive)?),
            Request::WatcherEvents(WatcherEvents { id, watcher }) => {
                Reply::WatcherEvents(self.watcher_events(&id, &watcher)?)
            }
            Request::WatcherRemove(WatcherRemove { id, watcher }) => {
                Reply::WatcherRemove(self.watcher_remove(&id, &watcher)?)
            }
            Request::CollectArtifacts(CollectArtifacts { id }) => {
                Reply::CollectArtifacts(self.collect_artifacts(&id)?)
            }
            Request::Artifacts(Artifacts { id }) => Reply::Artifacts(self.artifacts(&id)?),
            Request::ReadArtifact(ReadArtifact { id, path }) => {
                let output =
                    output.ok_or_else(|| missing("read_artifact", "place for the bytes"))?;
                let p = self.artifact_path(&id, &path)?;
                let mut f = std::fs::File::open(&p)
                    .map_err(RuntimeError::io("cannot open the artifact", &p))?;
                Reply::ReadArtifact(
                    std::io::copy(&mut f, output)
                        .map_err(RuntimeError::io("cannot send the artifact", &p))?,
                )
            }
            Request::GetNetwork(GetNetwork { id }) => Reply::GetNetwork(self.network(&id)?),
            Request::SetNetwork(SetNetwork { id, policy }) => {
                Reply::SetNetwork(self.set_network(&id, &policy)?)
            }
            Request::Expose(Expose { id, port, public }) => {
                Reply::Expose(self.expose(&id, port, public)?)
            }
            Request::Unexpose(Unexpose { id, port }) => Reply::Unexpose(self.unexpose(&id, port)?),
            Request::Exposed(Exposed { id, port }) => Reply::Exposed(self.exposed(&id, port)?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_through_json_with_their_name_as_tag() {
        let reqs: Vec<Request> = vec![
            Get { id: "sb1".into() }.into(),
            ListTemplates {}.into(),
            SetTimeout {
                id: "sb1".into(),
                secs: 60,
                on_timeout: Some(OnTimeout::Pause),
            }
            .into(),
            RunCode {
                id: "sb1".into(),
                req: RunCodeRequest {
                    code: "1 + 1".into(),
                    ..Default::default()
                },
            }
            .into(),
        ];
        for r in reqs {
            let text = serde_json::to_string(&r).unwrap();
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(v["call"], r.name(), "{text}");
            let back: Request = serde_json::from_str(&text).unwrap();
            assert_eq!(back, r);
        }
    }

    #[test]
    fn a_reply_of_another_call_is_refused_not_misread() {
        struct Wrong;
        impl Handler for Wrong {
            fn handle(&self, _: Request, _: Io<'_>) -> Result<Reply, RuntimeError> {
                Ok(Reply::ListSnapshots(vec![]))
            }
        }
        let e = call_dyn(&Wrong, Get { id: "x".into() }, Io::none()).unwrap_err();
        assert!(
            e.to_string()
                .contains("get: the handler answered another call"),
            "{e}"
        );
    }

    #[test]
    fn sandbox_calls_name_their_sandbox() {
        let get: Request = Get { id: "sb1".into() }.into();
        assert_eq!(get.sandbox(), Some("sb1"));
        let list: Request = ListSnapshots {}.into();
        assert_eq!(list.sandbox(), None);
        let w: Request = WatcherEvents {
            id: "sb2".into(),
            watcher: "w1".into(),
        }
        .into();
        assert_eq!(w.sandbox(), Some("sb2"));
    }

    #[test]
    fn names_are_unique() {
        let mut names = Request::NAMES.to_vec();
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n, "{names:?}");
    }
}
