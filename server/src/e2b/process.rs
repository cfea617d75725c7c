//! `process.Process`: programs in the sandbox, as envd runs them.
//!
//! A process is the runtime's `process_start` (a background program in its own session and
//! process group), so it outlives the request that started it and can be re-attached; the
//! runtime records its tag and config. Its output stream is the runtime's `process_attach`,
//! which first replays what the program wrote so far (the last 1 MiB of each stream), so
//! nothing written between `Start` and its attach is lost; a `Connect` to a running process
//! also gets that replay.
//!
//! - `Start`: `start{pid}`, then `data` (`stdout`/`stderr`, or `pty` for a terminal),
//!   `keepalive` every `Keepalive-Ping-Interval` seconds without output, then
//!   `end{exitCode, exited, status, error}` formatted as Go's `os.ProcessState` (envd's), and
//!   the end frame. `Connect-Timeout-Ms` bounds the process's life (the agent's `timeout_ms`
//!   kills its group, as envd's process context does), and the stream: when it passes the
//!   group gets `SIGKILL` and the stream ends with `deadline_exceeded`. A client that goes
//!   away leaves the process running.
//! - `Connect`: the same stream for a running process (by pid or tag); the deadline ends the
//!   stream only.
//! - `List`: the agent's running background programs, with the configs and tags `Start` was
//!   given.
//! - `SendInput`, `StreamInput`, `CloseStdin`, `SendSignal` (SIGTERM, SIGKILL, to the
//!   group), `Update` (terminal size).

use ember_runtime::call::{self, Io};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::Request;
use axum::response::Response;
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::connect::{self, pj, Code, ConnectError};
use super::{fail, rt_error, send, spawn_long, E2bState};
use crate::Backend;
use ember_runtime::call::{
    Cancel, CancelOnDrop, EndStatus, EventKind, ExecRequest, ExitStatus, ProcessInfo, PtySize,
};
use ember_runtime::{ProcessEnd, ProcessRecord, RuntimeError};

// ------------------------------------------------------------------------------------------
// Messages

/// `process.ProcessConfig`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct ProcessConfig {
    /// The program.
    #[serde(deserialize_with = "pj::or_default")]
    pub cmd: String,
    /// Its arguments.
    #[serde(deserialize_with = "pj::or_default")]
    pub args: Vec<String>,
    /// Environment on top of the sandbox's.
    #[serde(deserialize_with = "pj::or_default")]
    pub envs: BTreeMap<String, String>,
    /// Working directory (default: the user's home).
    #[serde(deserialize_with = "pj::or_default")]
    pub cwd: Option<String>,
}

impl ProcessConfig {
    fn to_json(&self) -> Value {
        let mut m = serde_json::Map::new();
        if !self.cmd.is_empty() {
            m.insert("cmd".into(), json!(self.cmd));
        }
        if !self.args.is_empty() {
            m.insert("args".into(), json!(self.args));
        }
        if !self.envs.is_empty() {
            m.insert("envs".into(), json!(self.envs));
        }
        if let Some(cwd) = &self.cwd {
            m.insert("cwd".into(), json!(cwd));
        }
        Value::Object(m)
    }
}

#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(default)]
struct SizeMsg {
    #[serde(deserialize_with = "pj::u32")]
    cols: u32,
    #[serde(deserialize_with = "pj::u32")]
    rows: u32,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct PtyMsg {
    #[serde(deserialize_with = "pj::or_default")]
    size: Option<SizeMsg>,
}

impl PtyMsg {
    fn size(&self) -> Result<PtySize, ConnectError> {
        let s = self.size.unwrap_or(SizeMsg { cols: 80, rows: 24 });
        let dim = |n: u32, what: &str| {
            u16::try_from(n)
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| ConnectError::invalid(format!("pty {what} {n} is out of range")))
        };
        Ok(PtySize {
            cols: dim(s.cols, "cols")?,
            rows: dim(s.rows, "rows")?,
        })
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StartRequest {
    #[serde(deserialize_with = "pj::or_default")]
    process: Option<ProcessConfig>,
    #[serde(deserialize_with = "pj::or_default")]
    pty: Option<PtyMsg>,
    #[serde(deserialize_with = "pj::or_default")]
    tag: Option<String>,
    #[serde(deserialize_with = "pj::or_default")]
    stdin: Option<bool>,
}

/// `process.ProcessSelector`: a pid or a tag.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct Selector {
    #[serde(deserialize_with = "pj::opt_u32")]
    pid: Option<u32>,
    #[serde(deserialize_with = "pj::or_default")]
    tag: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct SelectorRequest {
    #[serde(deserialize_with = "pj::or_default")]
    process: Option<Selector>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct InputMsg {
    #[serde(deserialize_with = "pj::opt_bytes")]
    stdin: Option<Vec<u8>>,
    #[serde(deserialize_with = "pj::opt_bytes")]
    pty: Option<Vec<u8>>,
}

impl InputMsg {
    fn bytes(self) -> Vec<u8> {
        self.stdin.or(self.pty).unwrap_or_default()
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct SendInputRequest {
    #[serde(deserialize_with = "pj::or_default")]
    process: Option<Selector>,
    #[serde(deserialize_with = "pj::or_default")]
    input: Option<InputMsg>,
}

const SIGNALS: &[(&str, i32)] = &[
    ("SIGNAL_UNSPECIFIED", 0),
    ("SIGNAL_SIGTERM", 15),
    ("SIGNAL_SIGKILL", 9),
];

fn signal<'de, D: serde::Deserializer<'de>>(d: D) -> Result<i32, D::Error> {
    pj::enum_value(d, SIGNALS)
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct SendSignalRequest {
    #[serde(deserialize_with = "pj::or_default")]
    process: Option<Selector>,
    #[serde(deserialize_with = "signal")]
    signal: i32,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct UpdateRequest {
    #[serde(deserialize_with = "pj::or_default")]
    process: Option<Selector>,
    #[serde(deserialize_with = "pj::or_default")]
    pty: Option<PtyMsg>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StreamStart {
    #[serde(deserialize_with = "pj::or_default")]
    process: Option<Selector>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StreamData {
    #[serde(deserialize_with = "pj::or_default")]
    input: Option<InputMsg>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StreamInputRequest {
    #[serde(deserialize_with = "pj::or_default")]
    start: Option<StreamStart>,
    #[serde(deserialize_with = "pj::or_default")]
    data: Option<StreamData>,
}

// ------------------------------------------------------------------------------------------
// Events

fn event(ev: Value) -> Bytes {
    connect::message_frame(&json!({ "event": ev }))
}

fn start_event(pid: u32) -> Bytes {
    event(json!({"start": {"pid": pid}}))
}

fn keepalive_event() -> Bytes {
    event(json!({"keepalive": {}}))
}

fn data_event(kind: &str, data: &[u8]) -> Bytes {
    event(json!({"data": {kind: pj::b64(data)}}))
}

/// A signal's name as Go's `syscall.Signal.String` gives it on Linux.
pub fn signal_name(sig: i32) -> String {
    let name = match sig {
        1 => "hangup",
        2 => "interrupt",
        3 => "quit",
        4 => "illegal instruction",
        5 => "trace/breakpoint trap",
        6 => "aborted",
        7 => "bus error",
        8 => "floating point exception",
        9 => "killed",
        10 => "user defined signal 1",
        11 => "segmentation fault",
        12 => "user defined signal 2",
        13 => "broken pipe",
        14 => "alarm clock",
        15 => "terminated",
        16 => "stack fault",
        17 => "child exited",
        18 => "continued",
        19 => "stopped (signal)",
        20 => "stopped",
        21 => "stopped (tty input)",
        22 => "stopped (tty output)",
        23 => "urgent I/O condition",
        24 => "CPU time limit exceeded",
        25 => "file size limit exceeded",
        26 => "virtual timer expired",
        27 => "profiling timer expired",
        28 => "window changed",
        29 => "I/O possible",
        30 => "power failure",
        31 => "bad system call",
        n => return format!("signal {n}"),
    };
    name.to_string()
}

/// The `end` event as envd makes it from Go's `ProcessState`: `exitCode` (-1 for a signal;
/// omitted when 0), `exited`, `status` (`exit status N`, `signal: killed`), and `error` (the
/// same text) when the exit was not a success.
pub fn end_event_json(exit: Option<ExitStatus>) -> Value {
    let (code, exited, status) = match exit {
        Some(ExitStatus::Code(n)) => (n, true, format!("exit status {n}")),
        Some(ExitStatus::Signal(s)) => (-1, false, format!("signal: {}", signal_name(s))),
        None => (-1, false, "unknown".to_string()),
    };
    let mut m = serde_json::Map::new();
    if code != 0 {
        m.insert("exitCode".into(), json!(code));
    }
    if exited {
        m.insert("exited".into(), json!(true));
    }
    m.insert("status".into(), json!(status));
    if exit.is_none() {
        m.insert(
            "error".into(),
            json!("the process ended without an exit status"),
        );
    } else if code != 0 {
        m.insert("error".into(), json!(status));
    }
    json!({ "end": Value::Object(m) })
}

// ------------------------------------------------------------------------------------------
// Dispatch

/// Serves `process.Process/<method>`.
pub async fn handle(st: E2bState, id: String, method: String, req: Request) -> Response {
    match method.as_str() {
        "Start" => start(st, id, req).await,
        "Connect" => connect_stream(st, id, req).await,
        "StreamInput" => stream_input(st, id, req).await,
        "List" | "SendInput" | "SendSignal" | "CloseStdin" | "Update" => {
            match unary(&st, &id, &method, req).await {
                Ok(v) => connect::unary_ok(&v),
                Err(e) => e.unary_response(),
            }
        }
        _ => super::no_method("process.Process", &method, &req),
    }
}

/// A unary call, bounded by `Connect-Timeout-Ms`.
async fn unary(st: &E2bState, id: &str, method: &str, req: Request) -> Result<Value, ConnectError> {
    let (parts, body) = req.into_parts();
    connect::check_content_type(&parts.headers, false)?;
    super::user_of(&parts.headers)?;
    let deadline = connect::timeout(&parts.headers)?;
    let work = async {
        match method {
            "List" => {
                let _: Value = connect::read_unary(body).await?;
                list(st, id).await
            }
            "SendInput" => {
                let m: SendInputRequest = connect::read_unary(body).await?;
                let pid = select(st, id, m.process.as_ref()).await?;
                let data = m.input.map(InputMsg::bytes).unwrap_or_default();
                let id = id.to_string();
                send(st, move |b| {
                    let mut input = std::io::Cursor::new(data);
                    b.call(call::StdinWrite { id, pid }, Io::input(&mut input))
                })
                .await?;
                Ok(json!({}))
            }
            "SendSignal" => {
                let m: SendSignalRequest = connect::read_unary(body).await?;
                let pid = select(st, id, m.process.as_ref()).await?;
                let sig = m.signal;
                if sig != 9 && sig != 15 {
                    return Err(ConnectError::invalid(format!(
                        "signal {sig} is not one of SIGNAL_SIGTERM, SIGNAL_SIGKILL"
                    )));
                }
                let (id, pid) = (id.to_string(), pid as i32);
                send(st, move |b| {
                    let signal = sig;
                    b.call(call::ProcessSignal { id, pid, signal }, Io::none())
                })
                .await?;
                Ok(json!({}))
            }
            "CloseStdin" => {
                let m: SelectorRequest = connect::read_unary(body).await?;
                let pid = select(st, id, m.process.as_ref()).await?;
                let id = id.to_string();
                send(st, move |b| {
                    b.call(call::StdinClose { id, pid }, Io::none())
                })
                .await?;
                Ok(json!({}))
            }
            "Update" => {
                let m: UpdateRequest = connect::read_unary(body).await?;
                let pid = select(st, id, m.process.as_ref()).await?;
                if let Some(pty) = m.pty {
                    let size = pty.size()?;
                    let id = id.to_string();
                    send(st, move |b| {
                        let (cols, rows) = (size.cols, size.rows);
                        b.call(
                            call::ProcessResize {
                                id,
                                pid,
                                cols,
                                rows,
                            },
                            Io::none(),
                        )
                    })
                    .await?;
                }
                Ok(json!({}))
            }
            _ => Err(ConnectError::new(Code::Unimplemented, method.to_string())),
        }
    };
    super::within(deadline, work).await
}

/// The pid a selector names.
async fn select(st: &E2bState, id: &str, sel: Option<&Selector>) -> Result<u32, ConnectError> {
    match sel {
        Some(Selector { pid: Some(pid), .. }) => Ok(*pid),
        Some(Selector { tag: Some(tag), .. }) => {
            let records = records(st, id, None).await?;
            newest_tagged(&records, tag)
                .ok_or_else(|| ConnectError::not_found(format!("process with tag {tag} not found")))
        }
        _ => Err(ConnectError::invalid(
            "the process selector names no pid or tag",
        )),
    }
}

/// The pid of the newest process tagged `tag` (records are oldest first).
fn newest_tagged(records: &[ProcessRecord], tag: &str) -> Option<u32> {
    records
        .iter()
        .rev()
        .find(|r| r.tag.as_deref() == Some(tag))
        .map(|r| r.pid)
}

/// The runtime's records of `id`'s processes (see `ProcessRecords`).
async fn records(
    st: &E2bState,
    id: &str,
    running: Option<Vec<u32>>,
) -> Result<Vec<ProcessRecord>, ConnectError> {
    let id = id.to_string();
    st.app
        .call(move |b| b.call(call::ProcessRecords { id, running }, Io::none()))
        .await
        .map_err(|e| ConnectError::internal(format!("the process registry: {}", e.message)))
}

/// Forgets process `pid` of `id` in the runtime's registry, in the background.
fn forget(st: &E2bState, id: &str, pid: u32) {
    let id = id.to_string();
    let job = st
        .app
        .spawn(move |b| b.call(call::ProcessForget { id, pid: Some(pid) }, Io::none()));
    tokio::spawn(async move {
        if let Ok(Err(e)) = job.await {
            tracing::debug!("forgetting a process record: {e}");
        }
    });
}

/// The programs the runtime says the agent started in `id`.
async fn process_list(st: &E2bState, id: &str) -> Result<Vec<ProcessInfo>, ConnectError> {
    let id = id.to_string();
    send(st, move |b| b.call(call::ProcessList { id }, Io::none())).await
}

async fn list(st: &E2bState, id: &str) -> Result<Value, ConnectError> {
    let procs = process_list(st, id).await?;
    let running: Vec<&ProcessInfo> = procs.iter().filter(|p| p.running && p.background).collect();
    let pids: Vec<u32> = running.iter().map(|p| p.pid as u32).collect();
    let records = records(st, id, Some(pids)).await?;
    let out: Vec<Value> = running
        .iter()
        .map(|p| {
            let pid = p.pid as u32;
            let known = records.iter().find(|r| r.pid == pid).and_then(|r| {
                let config = serde_json::from_value::<ProcessConfig>(r.config.clone()).ok()?;
                Some((config, r.tag.clone()))
            });
            let (config, tag) = match known {
                Some(k) => k,
                None => {
                    let mut argv = p.argv.clone().into_iter();
                    let cfg = ProcessConfig {
                        cmd: argv.next().unwrap_or_default(),
                        args: argv.collect(),
                        ..Default::default()
                    };
                    (cfg, None)
                }
            };
            let mut m = serde_json::Map::new();
            m.insert("config".into(), config.to_json());
            m.insert("pid".into(), json!(pid));
            if let Some(tag) = tag {
                m.insert("tag".into(), json!(tag));
            }
            Value::Object(m)
        })
        .collect();
    Ok(json!({ "processes": out }))
}

// ------------------------------------------------------------------------------------------
// Streams

async fn start(st: E2bState, id: String, req: Request) -> Response {
    match start_inner(&st, &id, req).await {
        Ok(r) => r,
        Err(e) => connect::stream_error(&e),
    }
}

async fn start_inner(st: &E2bState, id: &str, req: Request) -> Result<Response, ConnectError> {
    let (parts, body) = req.into_parts();
    connect::check_content_type(&parts.headers, true)?;
    let user = super::user_of(&parts.headers)?;
    let deadline = connect::timeout(&parts.headers)?;
    let keepalive = connect::keepalive(&parts.headers);
    let msg: StartRequest = connect::read_stream_request(body).await?;
    let config = msg.process.unwrap_or_default();
    if config.cmd.is_empty() {
        return Err(ConnectError::invalid("process.cmd is empty"));
    }
    let cwd = super::resolve(config.cwd.as_deref().unwrap_or(""), user)?;
    let pty = msg.pty.as_ref().map(PtyMsg::size).transpose()?;
    let mut argv = vec![config.cmd.clone()];
    argv.extend(config.args.iter().cloned());
    let exec = ExecRequest {
        argv,
        env: BTreeMap::new(),
        cwd: Some(cwd),
        stdin: None,
        // envd's process context: the deadline kills the process, whoever listens.
        timeout_ms: deadline.map(|d| d.as_millis().min(u64::MAX as u128) as u64),
        background: true,
        // envd keeps stdin a pipe unless told `stdin: false`; a terminal takes input
        // through its master anyway.
        stdin_stream: pty.is_none() && msg.stdin.unwrap_or(true),
        pty,
        user: user.exec_user(),
    };
    let exec = ExecRequest {
        env: config.envs.clone(),
        ..exec
    };
    let (sid, tag, cfg) = (id.to_string(), msg.tag, config.to_json());
    let started = send(st, move |b| {
        let start = call::ProcessStart {
            id: sid,
            req: exec,
            tag,
            config: cfg,
        };
        b.call(start, Io::none())
    })
    .await;
    let pid = match started {
        Ok(pid) => pid,
        Err(mut e) => {
            if e.code == Code::InvalidArgument {
                e.message = format!(
                    "error starting process '{}' in '{}': {}",
                    config.cmd,
                    config.cwd.as_deref().unwrap_or(user.home()),
                    e.message
                );
            }
            return Err(e);
        }
    };
    attach_stream(st, id, pid, pty.is_some(), deadline, keepalive, true)
}

async fn connect_stream(st: E2bState, id: String, req: Request) -> Response {
    match connect_inner(&st, &id, req).await {
        Ok(r) => r,
        Err(e) => connect::stream_error(&e),
    }
}

async fn connect_inner(st: &E2bState, id: &str, req: Request) -> Result<Response, ConnectError> {
    let (parts, body) = req.into_parts();
    connect::check_content_type(&parts.headers, true)?;
    super::user_of(&parts.headers)?;
    let deadline = connect::timeout(&parts.headers)?;
    let keepalive = connect::keepalive(&parts.headers);
    let msg: SelectorRequest = connect::read_stream_request(body).await?;
    let pid = select(st, id, msg.process.as_ref()).await?;
    // Check that it runs (so that an unknown pid fails before the `start` event).
    let procs = process_list(st, id).await?;
    let Some(p) = procs
        .iter()
        .find(|p| p.pid as u32 == pid && p.background && p.running)
    else {
        forget(st, id, pid);
        return Err(ConnectError::not_found(format!(
            "process with pid {pid} not found"
        )));
    };
    attach_stream(st, id, pid, p.pty, deadline, keepalive, false)
}

/// What the attach thread reports.
enum AttachMsg {
    Data(Bytes),
    End(Result<ProcessEnd, RuntimeError>),
}

/// The event stream of process `pid`: `start`, then its attach, keepalives, and the end.
fn attach_stream(
    st: &E2bState,
    id: &str,
    pid: u32,
    pty: bool,
    deadline: Option<Duration>,
    keepalive: Duration,
    kill_at_deadline: bool,
) -> Result<Response, ConnectError> {
    let abort = Cancel::new();
    let (ev_tx, ev_rx) = mpsc::channel::<AttachMsg>(16);
    let b = st.backend();
    let sid = id.to_string();
    let thread_abort = abort.clone();
    spawn_long(&st.rpc, "e2b-attach", move || {
        let r = attach(&*b, &sid, pid, pty, &thread_abort, &ev_tx);
        let _ = ev_tx.blocking_send(AttachMsg::End(r));
    })?;
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    let pump = Pump {
        st: st.clone(),
        id: id.to_string(),
        pid,
        tx,
        events: ev_rx,
        abort: abort.clone(),
        deadline: deadline.map(|d| tokio::time::Instant::now() + d),
        keepalive,
        kill_at_deadline,
    };
    tokio::spawn(pump.run());
    Ok(connect::stream_response(rx, CancelOnDrop(abort)))
}

/// Attaches to `pid` until it ends or the cancel fires; output goes to `events`.
fn attach(
    b: &dyn Backend,
    id: &str,
    pid: u32,
    pty: bool,
    abort: &Arc<Cancel>,
    events: &mpsc::Sender<AttachMsg>,
) -> Result<ProcessEnd, RuntimeError> {
    let (out_kind, err_kind) = if pty {
        ("pty", "pty")
    } else {
        ("stdout", "stderr")
    };
    let mut on_event = |ev: &EventKind| {
        let frame = match ev {
            // envd sends `start` once the stream is subscribed: here, once the attach is on
            // its way to the guest (a signal the client sends after reading `start` then
            // finds the attach there, and the attach sees the end).
            EventKind::Started { .. } => start_event(pid),
            EventKind::Stdout { data } => data_event(out_kind, data),
            EventKind::Stderr { data } => data_event(err_kind, data),
            _ => return true,
        };
        events.blocking_send(AttachMsg::Data(frame)).is_ok()
    };
    let attach = call::ProcessAttach {
        id: id.to_string(),
        pid,
    };
    b.call(attach, Io::events(&mut on_event).with_cancel(abort.clone()))
}

/// Moves a process's events to its response, with keepalives and the deadline.
struct Pump {
    st: E2bState,
    id: String,
    pid: u32,
    tx: mpsc::Sender<Bytes>,
    events: mpsc::Receiver<AttachMsg>,
    abort: Arc<Cancel>,
    deadline: Option<tokio::time::Instant>,
    keepalive: Duration,
    kill_at_deadline: bool,
}

impl Pump {
    async fn run(mut self) {
        let deadline = async {
            match self.deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(deadline);
        let mut ka =
            tokio::time::interval_at(tokio::time::Instant::now() + self.keepalive, self.keepalive);
        ka.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = self.tx.closed() => {
                    // The client went away; the process keeps running.
                    self.abort.fire();
                    return;
                }
                _ = &mut deadline => {
                    self.abort.fire();
                    if self.kill_at_deadline {
                        self.kill();
                    }
                    let e = ConnectError::new(
                        Code::DeadlineExceeded,
                        "the process ran longer than the request's timeout",
                    );
                    let _ = self.tx.send(connect::end_frame(Some(&e))).await;
                    return;
                }
                _ = ka.tick() => {
                    if self.tx.send(keepalive_event()).await.is_err() {
                        self.abort.fire();
                        return;
                    }
                }
                m = self.events.recv() => match m {
                    Some(AttachMsg::Data(frame)) => {
                        if self.tx.send(frame).await.is_err() {
                            self.abort.fire();
                            return;
                        }
                        ka.reset();
                    }
                    Some(AttachMsg::End(r)) => {
                        self.finish(r).await;
                        return;
                    }
                    None => {
                        let e = ConnectError::internal("the attach ended without a result");
                        let _ = self.tx.send(connect::end_frame(Some(&e))).await;
                        return;
                    }
                }
            }
        }
    }

    async fn finish(&self, r: Result<ProcessEnd, RuntimeError>) {
        // (The runtime forgets the record of a process it saw end.)
        let frames = match r {
            Ok(ProcessEnd {
                status: EndStatus::TimedOut,
                ..
            }) => {
                let e = ConnectError::new(
                    Code::DeadlineExceeded,
                    "the process ran longer than the request's timeout",
                );
                vec![connect::end_frame(Some(&e))]
            }
            Ok(ProcessEnd { exit, .. }) => {
                vec![event(end_event_json(exit)), connect::end_frame(None)]
            }
            Err(e) => {
                if self.abort.fired() {
                    return;
                }
                let e = match rt_error(e) {
                    e if e.code == Code::NotFound => {
                        ConnectError::not_found(format!("process with pid {} not found", self.pid))
                    }
                    e => e,
                };
                vec![connect::end_frame(Some(&e))]
            }
        };
        for f in frames {
            if self.tx.send(f).await.is_err() {
                return;
            }
        }
    }

    /// SIGKILL to the process group (the deadline passed).
    fn kill(&self) {
        let (id, pid) = (self.id.clone(), self.pid as i32);
        drop(self.st.app.spawn(move |b| {
            let kill = call::ProcessSignal { id, pid, signal: 9 };
            let r = b.call(kill, Io::none());
            if let Err(e) = &r {
                tracing::debug!("killing pid {pid} at its deadline: {e}");
            }
            Ok(())
        }));
    }
}

async fn stream_input(st: E2bState, id: String, req: Request) -> Response {
    match stream_input_inner(&st, &id, req).await {
        Ok(()) => connect::stream_single(&json!({})),
        Err(e) => fail(true, e),
    }
}

async fn stream_input_inner(st: &E2bState, id: &str, req: Request) -> Result<(), ConnectError> {
    let (parts, body) = req.into_parts();
    connect::check_content_type(&parts.headers, true)?;
    super::user_of(&parts.headers)?;
    let deadline = connect::timeout(&parts.headers)?;
    let work = async {
        let mut reader = connect::EnvelopeReader::new(body);
        let first: StreamInputRequest = reader
            .next_message()
            .await?
            .ok_or_else(|| ConnectError::invalid("the input stream holds no message"))?;
        let Some(start) = first.start else {
            return Err(ConnectError::invalid(
                "the first message of an input stream must be `start`",
            ));
        };
        let pid = select(st, id, start.process.as_ref()).await?;
        let (dtx, drx) = mpsc::channel::<Vec<u8>>(8);
        let sid = id.to_string();
        let job = st.app.spawn(move |b| {
            let mut input = ChannelReader {
                rx: drx,
                chunk: Vec::new(),
                at: 0,
            };
            b.call(call::StdinWrite { id: sid, pid }, Io::input(&mut input))
                .map(drop)
        });
        let mut read_err = None;
        loop {
            match reader.next_message::<StreamInputRequest>().await {
                Ok(Some(m)) => {
                    let Some(data) = m.data.and_then(|d| d.input).map(InputMsg::bytes) else {
                        continue; // keepalive (or a repeated start)
                    };
                    if data.is_empty() {
                        continue;
                    }
                    if dtx.send(data).await.is_err() {
                        break; // the writer failed: its error is the answer
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    read_err = Some(e);
                    break;
                }
            }
        }
        drop(dtx);
        let r = match job.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(rt_error(e)),
            Err(e) => Err(ConnectError::internal(format!("the call failed: {e}"))),
        };
        match (r, read_err) {
            (Err(e), _) => Err(e),
            (Ok(()), Some(e)) => Err(e),
            (Ok(()), None) => Ok(()),
        }
    };
    match deadline {
        Some(d) => tokio::time::timeout(d, work).await.unwrap_or_else(|_| {
            Err(ConnectError::new(
                Code::DeadlineExceeded,
                format!("the input stream took longer than its timeout of {d:?}"),
            ))
        }),
        None => work.await,
    }
}

/// The chunks of a channel as one byte stream (`StdinWrite`'s input: each chunk goes to the
/// program as it arrives).
struct ChannelReader {
    rx: mpsc::Receiver<Vec<u8>>,
    chunk: Vec<u8>,
    at: usize,
}

impl std::io::Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.at >= self.chunk.len() {
            match self.rx.blocking_recv() {
                Some(c) => {
                    self.chunk = c;
                    self.at = 0;
                }
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.chunk.len() - self.at);
        buf[..n].copy_from_slice(&self.chunk[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_request_of_the_sdk_parses() {
        let m: StartRequest = connect::decode(
            br#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo $FOO; echo err >&2"],"envs":{"BAR":"1"}},"stdin":false}"#,
        )
        .unwrap();
        let p = m.process.unwrap();
        assert_eq!(p.cmd, "/bin/bash");
        assert_eq!(p.args, ["-l", "-c", "echo $FOO; echo err >&2"]);
        assert_eq!(p.envs["BAR"], "1");
        assert_eq!(p.cwd, None);
        assert_eq!(m.stdin, Some(false));
        assert!(m.pty.is_none() && m.tag.is_none());
        let m: StartRequest = connect::decode(
            br#"{"process":{"cmd":"/bin/bash","args":["-i","-l"],"envs":{"TERM":"xterm-256color"},"cwd":"/tmp"},"pty":{"size":{"cols":80,"rows":"24"}},"tag":"t1","unknownField":1}"#,
        )
        .unwrap();
        let size = m.pty.unwrap().size().unwrap();
        assert_eq!((size.cols, size.rows), (80, 24));
        assert_eq!(m.tag.as_deref(), Some("t1"));
        assert_eq!(m.process.unwrap().cwd.as_deref(), Some("/tmp"));
        let bad: StartRequest =
            connect::decode(br#"{"pty":{"size":{"cols":0,"rows":24}}}"#).unwrap();
        assert!(bad.pty.unwrap().size().is_err());
    }

    #[test]
    fn selector_input_and_signal_requests_parse() {
        let m: SendInputRequest =
            connect::decode(br#"{"process":{"pid":12},"input":{"stdin":"aGkK"}}"#).unwrap();
        assert_eq!(m.process.unwrap().pid, Some(12));
        assert_eq!(m.input.unwrap().bytes(), b"hi\n");
        let m: SendInputRequest =
            connect::decode(br#"{"process":{"tag":"x"},"input":{"pty":"AQ=="}}"#).unwrap();
        assert_eq!(m.process.unwrap().tag.as_deref(), Some("x"));
        assert_eq!(m.input.unwrap().bytes(), [1]);
        let m: SendSignalRequest =
            connect::decode(br#"{"process":{"pid":"7"},"signal":"SIGNAL_SIGKILL"}"#).unwrap();
        assert_eq!((m.process.unwrap().pid, m.signal), (Some(7), 9));
        let m: SendSignalRequest = connect::decode(br#"{"signal":15}"#).unwrap();
        assert_eq!(m.signal, 15);
        let m: UpdateRequest =
            connect::decode(br#"{"process":{"pid":3},"pty":{"size":{"cols":100,"rows":30}}}"#)
                .unwrap();
        let s = m.pty.unwrap().size().unwrap();
        assert_eq!((s.cols, s.rows), (100, 30));
        let m: StreamInputRequest = connect::decode(br#"{"start":{"process":{"pid":5}}}"#).unwrap();
        assert_eq!(m.start.unwrap().process.unwrap().pid, Some(5));
        let m: StreamInputRequest =
            connect::decode(br#"{"data":{"input":{"stdin":"YQ=="}}}"#).unwrap();
        assert_eq!(m.data.unwrap().input.unwrap().bytes(), b"a");
        let m: StreamInputRequest = connect::decode(br#"{"keepalive":{}}"#).unwrap();
        assert!(m.start.is_none() && m.data.is_none());
    }

    #[test]
    fn end_events_read_like_envds() {
        assert_eq!(
            end_event_json(Some(ExitStatus::Code(0))),
            json!({"end": {"exited": true, "status": "exit status 0"}})
        );
        assert_eq!(
            end_event_json(Some(ExitStatus::Code(3))),
            json!({"end": {"exitCode": 3, "exited": true, "status": "exit status 3",
                           "error": "exit status 3"}})
        );
        assert_eq!(
            end_event_json(Some(ExitStatus::Signal(9))),
            json!({"end": {"exitCode": -1, "status": "signal: killed",
                           "error": "signal: killed"}})
        );
        assert_eq!(signal_name(15), "terminated");
        assert_eq!(signal_name(40), "signal 40");
    }

    #[test]
    fn frames_match_the_raw_response_the_sdk_accepts() {
        let f = start_event(12505);
        assert_eq!(&f[5..], br#"{"event":{"start":{"pid":12505}}}"#);
        let f = data_event("stdout", b"hi\n");
        assert_eq!(&f[5..], br#"{"event":{"data":{"stdout":"aGkK"}}}"#);
        let f = keepalive_event();
        assert_eq!(&f[5..], br#"{"event":{"keepalive":{}}}"#);
    }

    #[test]
    fn list_configs_leave_out_zero_values() {
        let c = ProcessConfig {
            cmd: "/bin/bash".into(),
            ..Default::default()
        };
        assert_eq!(c.to_json(), json!({"cmd": "/bin/bash"}));
    }
}
