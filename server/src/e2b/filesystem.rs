//! `filesystem.Filesystem`: the guest's files, as envd presents them.
//!
//! Paths resolve against the user's home (see [`super::resolve`]). The agent's file calls run
//! as root; where envd gives the caller's account ownership of what it creates (`MakeDir`,
//! the parents `Move` creates) and the caller is `user`, the directories are made by
//! `mkdir -p` run as `user` through the agent's `exec`, so they get its ownership and its
//! permission checks.
//!
//! `EntryInfo.owner`/`group`: the agent reports no uid/gid, so they are inferred: `user`
//! under `/home/user`, `root` elsewhere.
//!
//! Watches: the agent's `file_watch` (inotify) reports create, write, remove and rename
//! (no chmod). `WatchDir` streams them; `CreateWatcher` keeps one running in the background
//! and buffers its events (at most [`super::MAX_WATCHER_EVENTS`]) for `GetWatcherEvents`.
//! A watch is in place once the agent has read the call; it sends no acknowledgement, so
//! events in the first few milliseconds after the answer may be missed.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::Request;
use axum::response::Response;
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

use super::connect::{self, pj, Code, ConnectError};
use super::{lock, rt_error, spawn_long, Abort, AbortOnDrop, E2bState, User};
use crate::backend::with_sandbox;
use crate::Backend;
use ember_agent::client::ClientError;
use ember_agent::protocol::{
    Call, ErrorCode, EventKind, ExecRequest, ExitStatus, FileType, FileWatchRequest, FsOp,
};
use ember_runtime::RuntimeError;

/// Longest a watch may last (the agent client needs a deadline).
const WATCH_LIMIT: Duration = Duration::from_secs(30 * 24 * 3600);
/// How long `CreateWatcher` and `WatchDir` give the agent to read the watch call before they
/// answer.
const WATCH_SETTLE: Duration = Duration::from_millis(50);

// ------------------------------------------------------------------------------------------
// Messages

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PathRequest {
    #[serde(deserialize_with = "pj::or_default")]
    path: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct MoveRequest {
    #[serde(deserialize_with = "pj::or_default")]
    source: String,
    #[serde(deserialize_with = "pj::or_default")]
    destination: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ListDirRequest {
    #[serde(deserialize_with = "pj::or_default")]
    path: String,
    #[serde(deserialize_with = "pj::u32")]
    depth: u32,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct WatchRequest {
    #[serde(deserialize_with = "pj::or_default")]
    path: String,
    #[serde(deserialize_with = "pj::or_default")]
    recursive: bool,
    #[serde(alias = "include_entry", deserialize_with = "pj::or_default")]
    include_entry: bool,
    #[serde(alias = "allow_network_mounts", deserialize_with = "pj::or_default")]
    allow_network_mounts: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct WatcherRequest {
    #[serde(alias = "watcher_id", deserialize_with = "pj::or_default")]
    watcher_id: String,
}

// ------------------------------------------------------------------------------------------
// EntryInfo

/// `FileType` of an agent file type (`None`: unspecified, left out).
fn file_type(kind: FileType) -> Option<&'static str> {
    match kind {
        FileType::File => Some("FILE_TYPE_FILE"),
        FileType::Dir => Some("FILE_TYPE_DIRECTORY"),
        FileType::Symlink => Some("FILE_TYPE_SYMLINK"),
        FileType::Other => None,
    }
}

/// `st_mode` as Go's `os.FileMode.String()` prints it (envd's `permissions`):
/// `-rw-r--r--`, `drwxr-xr-x`, `Lrwxrwxrwx`, `dtrwxrwxrwx`.
pub fn permissions(mode: u32) -> String {
    let fmt = mode & libc::S_IFMT;
    let mut s = String::new();
    // Go's order of type and special letters: "dalTLDpSugct?".
    if fmt == libc::S_IFDIR {
        s.push('d');
    }
    if fmt == libc::S_IFLNK {
        s.push('L');
    }
    if fmt == libc::S_IFBLK || fmt == libc::S_IFCHR {
        s.push('D');
    }
    if fmt == libc::S_IFIFO {
        s.push('p');
    }
    if fmt == libc::S_IFSOCK {
        s.push('S');
    }
    if mode & libc::S_ISUID != 0 {
        s.push('u');
    }
    if mode & libc::S_ISGID != 0 {
        s.push('g');
    }
    if fmt == libc::S_IFCHR {
        s.push('c');
    }
    if mode & libc::S_ISVTX != 0 {
        s.push('t');
    }
    if s.is_empty() {
        s.push('-');
    }
    for (i, c) in "rwxrwxrwx".chars().enumerate() {
        s.push(if mode & (1 << (8 - i)) != 0 { c } else { '-' });
    }
    s
}

/// The inferred owner of a path (the agent reports no uid/gid).
fn owner_of(path: &str) -> &'static str {
    if path == "/home/user" || path.starts_with("/home/user/") {
        "user"
    } else {
        "root"
    }
}

fn base_name(path: &str) -> &str {
    path.rsplit('/').find(|c| !c.is_empty()).unwrap_or("/")
}

/// `filesystem.EntryInfo` as ProtoJSON (zero values left out).
pub fn entry_json(
    path: &str,
    name: &str,
    kind: FileType,
    size: u64,
    mode: u32,
    mtime_ms: i64,
) -> Value {
    let mut m = serde_json::Map::new();
    if !name.is_empty() {
        m.insert("name".into(), json!(name));
    }
    if let Some(t) = file_type(kind) {
        m.insert("type".into(), json!(t));
    }
    m.insert("path".into(), json!(path));
    if size != 0 {
        m.insert(
            "size".into(),
            pj::i64_out(i64::try_from(size).unwrap_or(i64::MAX)),
        );
    }
    if mode & 0o777 != 0 {
        m.insert("mode".into(), json!(mode & 0o777));
    }
    m.insert("permissions".into(), json!(permissions(mode)));
    let owner = owner_of(path);
    m.insert("owner".into(), json!(owner));
    m.insert("group".into(), json!(owner));
    if mtime_ms > 0 {
        m.insert(
            "modifiedTime".into(),
            json!(ember_runtime::clock::rfc3339(mtime_ms)),
        );
    }
    Value::Object(m)
}

// ------------------------------------------------------------------------------------------
// Dispatch

/// Serves `filesystem.Filesystem/<method>`.
pub async fn handle(st: E2bState, id: String, method: String, req: Request) -> Response {
    match method.as_str() {
        "WatchDir" => match watch_dir(&st, &id, req).await {
            Ok(r) => r,
            Err(e) => connect::stream_error(&e),
        },
        "Stat" | "MakeDir" | "Move" | "ListDir" | "Remove" | "CreateWatcher"
        | "GetWatcherEvents" | "RemoveWatcher" => match unary(&st, &id, &method, req).await {
            Ok(v) => connect::unary_ok(&v),
            Err(e) => e.unary_response(),
        },
        _ => super::no_method("filesystem.Filesystem", &method, &req),
    }
}

/// [`super::agent`] with a closure that answers Connect errors of its own.
async fn agent<T: Send + 'static>(
    st: &E2bState,
    id: &str,
    call: &'static str,
    args: Value,
    f: impl FnOnce(&ember_runtime::Sandbox) -> Result<T, ConnectError> + Send + 'static,
) -> Result<T, ConnectError> {
    super::agent(st, id, call, args, move |sb| {
        f(sb).map_err(super::CallError::Connect)
    })
    .await
}

/// The Connect error of a guest call's error.
fn guest(e: ember_runtime::SandboxError) -> ConnectError {
    rt_error(RuntimeError::from(e))
}

fn is_guest(e: &ember_runtime::SandboxError, code: ErrorCode) -> bool {
    matches!(e, ember_runtime::SandboxError::Agent { source, .. } if source.is_remote(code))
}

async fn unary(st: &E2bState, id: &str, method: &str, req: Request) -> Result<Value, ConnectError> {
    let (parts, body) = req.into_parts();
    connect::check_content_type(&parts.headers, false)?;
    let user = super::user_of(&parts.headers)?;
    let deadline = connect::timeout(&parts.headers)?;
    let work = async {
        match method {
            "Stat" => {
                let m: PathRequest = connect::read_unary(body).await?;
                let path = super::resolve(&m.path, user)?;
                let args = json!({"path": path});
                agent(st, id, "e2b_stat", args, move |sb| {
                    let s = sb.stat(&path).map_err(guest)?;
                    let entry =
                        entry_json(&path, base_name(&path), s.kind, s.size, s.mode, s.mtime_ms);
                    Ok(json!({ "entry": entry }))
                })
                .await
            }
            "ListDir" => {
                let m: ListDirRequest = connect::read_unary(body).await?;
                let path = super::resolve(&m.path, user)?;
                let depth = m.depth.max(1);
                let args = json!({"path": path, "depth": depth});
                agent(st, id, "e2b_list_dir", args, move |sb| {
                    let s = sb.stat(&path).map_err(guest)?;
                    if s.kind == FileType::File || s.kind == FileType::Other {
                        return Err(ConnectError::invalid(format!(
                            "path is not a directory: {path}"
                        )));
                    }
                    let entries = sb.list(&path, depth).map_err(guest)?;
                    let out: Vec<Value> = entries
                        .iter()
                        .filter(|e| e.kind != FileType::Other)
                        .map(|e| entry_json(&e.path, &e.name, e.kind, e.size, e.mode, e.mtime_ms))
                        .collect();
                    Ok(json!({ "entries": out }))
                })
                .await
            }
            "MakeDir" => {
                let m: PathRequest = connect::read_unary(body).await?;
                let path = super::resolve(&m.path, user)?;
                let args = json!({"path": path, "user": user.name()});
                agent(st, id, "e2b_make_dir", args, move |sb| {
                    match sb.stat(&path) {
                        Ok(s) if s.kind == FileType::Dir => {
                            return Err(ConnectError::new(
                                Code::AlreadyExists,
                                format!("directory already exists: {path}"),
                            ))
                        }
                        Ok(_) => {
                            return Err(ConnectError::invalid(format!(
                                "path already exists but it is not a directory: {path}"
                            )))
                        }
                        Err(e) if is_guest(&e, ErrorCode::NotFound) => {}
                        Err(e) => return Err(guest(e)),
                    }
                    make_dirs(sb, &path, user)?;
                    let entry = json!({
                        "name": base_name(&path), "type": "FILE_TYPE_DIRECTORY", "path": path,
                    });
                    Ok(json!({ "entry": entry }))
                })
                .await
            }
            "Move" => {
                let m: MoveRequest = connect::read_unary(body).await?;
                let from = super::resolve(&m.source, user)?;
                let to = super::resolve(&m.destination, user)?;
                let args = json!({"from": from, "to": to});
                agent(st, id, "e2b_move", args, move |sb| {
                    match sb.rename(&from, &to) {
                        Ok(()) => {}
                        Err(e) if is_guest(&e, ErrorCode::NotFound) => {
                            // The source, or the destination's directory, is missing.
                            if let Err(e) = sb.stat(&from) {
                                return Err(if is_guest(&e, ErrorCode::NotFound) {
                                    ConnectError::not_found(format!(
                                        "source file not found: {from}"
                                    ))
                                } else {
                                    guest(e)
                                });
                            }
                            let parent = match to.rsplit_once('/') {
                                Some(("", _)) | None => "/".to_string(),
                                Some((p, _)) => p.to_string(),
                            };
                            make_dirs(sb, &parent, user)?;
                            sb.rename(&from, &to).map_err(guest)?;
                        }
                        Err(e) => return Err(guest(e)),
                    }
                    let s = sb.stat(&to).map_err(guest)?;
                    let entry = entry_json(&to, base_name(&to), s.kind, s.size, s.mode, s.mtime_ms);
                    Ok(json!({ "entry": entry }))
                })
                .await
            }
            "Remove" => {
                let m: PathRequest = connect::read_unary(body).await?;
                let path = super::resolve(&m.path, user)?;
                let args = json!({"path": path});
                agent(st, id, "e2b_remove", args, move |sb| {
                    match sb.remove(&path, true) {
                        // envd removes with os.RemoveAll: a missing path is fine.
                        Err(e) if !is_guest(&e, ErrorCode::NotFound) => Err(guest(e)),
                        _ => Ok(json!({})),
                    }
                })
                .await
            }
            "CreateWatcher" => {
                let m: WatchRequest = connect::read_unary(body).await?;
                create_watcher(st, id, m, user).await
            }
            "GetWatcherEvents" => {
                let m: WatcherRequest = connect::read_unary(body).await?;
                let w = st.rpc.watcher(id, &m.watcher_id)?;
                if let Some(e) = lock(&w.error).clone() {
                    return Err(e);
                }
                let events: Vec<Value> = lock(&w.events).drain(..).collect();
                Ok(json!({ "events": events }))
            }
            "RemoveWatcher" => {
                let m: WatcherRequest = connect::read_unary(body).await?;
                let w = st.rpc.watcher(id, &m.watcher_id)?;
                lock(&st.rpc.watchers).remove(&m.watcher_id);
                w.abort.fire();
                Ok(json!({}))
            }
            _ => Err(ConnectError::new(Code::Unimplemented, method.to_string())),
        }
    };
    super::within(deadline, work).await
}

/// `mkdir -p path`: by the agent for root; as `user` through `exec` for user (so that the
/// directories are theirs, and their permissions apply).
fn make_dirs(sb: &ember_runtime::Sandbox, path: &str, user: User) -> Result<(), ConnectError> {
    if user == User::Root {
        return sb.mkdir(path).map_err(guest);
    }
    let req = ExecRequest {
        argv: vec!["/bin/mkdir".into(), "-p".into(), "--".into(), path.into()],
        timeout_ms: Some(30_000),
        user: user.exec_user(),
        ..Default::default()
    };
    let mut stderr = Vec::new();
    let mut exit = None;
    sb.exec(&req, |ev| match ev {
        EventKind::Stderr { data } if stderr.len() < 4096 => stderr.extend_from_slice(data),
        EventKind::Exit(s) => exit = Some(*s),
        _ => {}
    })
    .map_err(guest)?;
    if exit == Some(ExitStatus::Code(0)) {
        return Ok(());
    }
    let text = String::from_utf8_lossy(&stderr).trim().to_string();
    let code = if text.contains("Permission denied") || text.contains("Read-only file system") {
        Code::PermissionDenied
    } else if text.contains("File exists") || text.contains("Not a directory") {
        Code::InvalidArgument
    } else {
        Code::Internal
    };
    Err(ConnectError::new(
        code,
        format!(
            "creating directory {path}: {}",
            if text.is_empty() {
                "mkdir failed"
            } else {
                &text
            }
        ),
    ))
}

/// Checks that `path` is a directory to watch.
async fn check_watch_path(st: &E2bState, id: &str, path: &str) -> Result<(), ConnectError> {
    let p = path.to_string();
    agent(
        st,
        id,
        "e2b_watch_check",
        json!({"path": path}),
        move |sb| match sb.stat(&p) {
            Ok(s) if s.kind == FileType::Dir => Ok(()),
            Ok(_) => Err(ConnectError::invalid(format!("path {p} not a directory"))),
            Err(e) if is_guest(&e, ErrorCode::NotFound) => {
                Err(ConnectError::not_found(format!("path {p} not found")))
            }
            Err(e) => Err(guest(e)),
        },
    )
    .await
}

/// Whether `name` is the agent's temporary file of an atomic write
/// (`.<name>.ember-<hex>`): its events are noise envd would not report (the final rename
/// shows as the target's `create`).
fn is_agent_temp(path: &str) -> bool {
    let name = base_name(path);
    name.starts_with('.')
        && name.rsplit_once(".ember-").is_some_and(|(head, hex)| {
            head.len() > 1 && !hex.is_empty() && hex.bytes().all(|c| c.is_ascii_hexdigit())
        })
}

/// A `FilesystemEvent` for an agent event under `root` (`None`: not reported).
fn fs_event(root: &str, path: &str, op: FsOp) -> Option<Value> {
    if is_agent_temp(path) {
        return None;
    }
    let kind = match op {
        FsOp::Create => "EVENT_TYPE_CREATE",
        FsOp::Write => "EVENT_TYPE_WRITE",
        FsOp::Remove => "EVENT_TYPE_REMOVE",
        FsOp::Rename => "EVENT_TYPE_RENAME",
        FsOp::Unknown => return None,
    };
    let name = if root == "/" {
        path.trim_start_matches('/')
    } else {
        path.strip_prefix(root)
            .and_then(|r| r.strip_prefix('/'))
            .unwrap_or(path)
    };
    Some(json!({"name": name, "type": kind}))
}

/// Watches `path` until the abort fires; each event goes to `on_event` (false: stop).
/// `armed` is told when the call is about to be sent.
fn watch(
    b: &dyn Backend,
    id: &str,
    path: &str,
    recursive: bool,
    abort: &Abort,
    armed: oneshot::Sender<()>,
    mut on_event: impl FnMut(Value) -> bool,
) -> Result<(), RuntimeError> {
    let args = json!({"path": path, "recursive": recursive});
    with_sandbox(b, id, "e2b_watch", args, |sb| {
        Ok(sb.with_client("file_watch", |c| {
            if !abort.arm(c.get_ref()) {
                return Err(ClientError::Closed);
            }
            let _ = armed.send(());
            let call = Call::FileWatch(FileWatchRequest {
                path: path.to_string(),
                recursive,
            });
            let r = c.call(&call, WATCH_LIMIT, |ev| {
                if let EventKind::FsEvent { path: p, op } = ev {
                    if let Some(v) = fs_event(path, &p, op) {
                        if !on_event(v) {
                            return Err(ClientError::Closed);
                        }
                    }
                }
                Ok(())
            });
            if abort.disarm() && r.is_ok() {
                return Err(ClientError::Closed);
            }
            r.map(drop)
        })?)
    })
}

async fn watch_dir(st: &E2bState, id: &str, req: Request) -> Result<Response, ConnectError> {
    let (parts, body) = req.into_parts();
    connect::check_content_type(&parts.headers, true)?;
    let user = super::user_of(&parts.headers)?;
    let deadline = connect::timeout(&parts.headers)?;
    let keepalive = connect::keepalive(&parts.headers);
    let m: WatchRequest = connect::read_stream_request(body).await?;
    let path = super::resolve(&m.path, user)?;
    check_watch_path(st, id, &path).await?;
    let abort = Arc::new(Abort::default());
    st.rpc.add_stream(id, &abort);
    let (ev_tx, mut ev_rx) = mpsc::channel::<Result<Value, RuntimeError>>(64);
    let (armed_tx, armed_rx) = oneshot::channel();
    let (b, sid, wpath, wabort) = (st.backend(), id.to_string(), path.clone(), abort.clone());
    let recursive = m.recursive;
    spawn_long(&st.rpc, "e2b-watch", move || {
        let tx = ev_tx.clone();
        let r = watch(&*b, &sid, &wpath, recursive, &wabort, armed_tx, |v| {
            tx.blocking_send(Ok(v)).is_ok()
        });
        if let Err(e) = r {
            let _ = ev_tx.blocking_send(Err(e));
        }
    })?;
    let _ = armed_rx.await;
    tokio::time::sleep(WATCH_SETTLE).await;
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    let _ = tx.try_send(connect::message_frame(&json!({"start": {}})));
    let pump_abort = abort.clone();
    tokio::spawn(async move {
        let deadline_fut = async {
            match deadline {
                Some(d) => tokio::time::sleep(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(deadline_fut);
        let mut ka = tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
        ka.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let end = loop {
            tokio::select! {
                _ = tx.closed() => { pump_abort.fire(); return; }
                _ = &mut deadline_fut => {
                    break Some(ConnectError::new(Code::DeadlineExceeded, "the watch ran longer than the request's timeout"));
                }
                _ = ka.tick() => {
                    if tx.send(connect::message_frame(&json!({"keepalive": {}}))).await.is_err() {
                        pump_abort.fire();
                        return;
                    }
                }
                m = ev_rx.recv() => match m {
                    Some(Ok(v)) => {
                        if tx.send(connect::message_frame(&json!({"filesystem": v}))).await.is_err() {
                            pump_abort.fire();
                            return;
                        }
                        ka.reset();
                    }
                    Some(Err(e)) => break Some(rt_error(e)),
                    None => break None,
                }
            }
        };
        pump_abort.fire();
        let _ = tx.send(connect::end_frame(end.as_ref())).await;
    });
    Ok(connect::stream_response(rx, AbortOnDrop(abort)))
}

/// A polling watcher.
#[derive(Debug)]
pub(crate) struct Watcher {
    pub(crate) sandbox: String,
    pub(crate) abort: Arc<Abort>,
    events: Mutex<VecDeque<Value>>,
    error: Mutex<Option<ConnectError>>,
}

impl super::RpcState {
    fn watcher(&self, sandbox: &str, id: &str) -> Result<Arc<Watcher>, ConnectError> {
        lock(&self.watchers)
            .get(id)
            .filter(|w| w.sandbox == sandbox)
            .cloned()
            .ok_or_else(|| ConnectError::not_found(format!("watcher with id {id} not found")))
    }
}

async fn create_watcher(
    st: &E2bState,
    id: &str,
    m: WatchRequest,
    user: User,
) -> Result<Value, ConnectError> {
    let path = super::resolve(&m.path, user)?;
    check_watch_path(st, id, &path).await?;
    let watcher_id = format!("w{}", ember_runtime::paths::random_id());
    let w = Arc::new(Watcher {
        sandbox: id.to_string(),
        abort: Arc::new(Abort::default()),
        events: Mutex::new(VecDeque::new()),
        error: Mutex::new(None),
    });
    {
        let mut all = lock(&st.rpc.watchers);
        // Watchers whose watch ended (the sandbox went away) make room first.
        let n = all.values().filter(|x| x.sandbox == id).count();
        if n >= super::MAX_WATCHERS_PER_SANDBOX {
            all.retain(|_, x| x.sandbox != id || lock(&x.error).is_none());
        }
        if all.values().filter(|x| x.sandbox == id).count() >= super::MAX_WATCHERS_PER_SANDBOX {
            return Err(ConnectError::new(
                Code::ResourceExhausted,
                format!(
                    "sandbox {id} has {} watchers already; remove some",
                    super::MAX_WATCHERS_PER_SANDBOX
                ),
            ));
        }
        all.insert(watcher_id.clone(), w.clone());
    }
    let (armed_tx, armed_rx) = oneshot::channel();
    let (b, sid, tw) = (st.backend(), id.to_string(), w.clone());
    let recursive = m.recursive;
    let started = spawn_long(&st.rpc, "e2b-watcher", move || {
        let r = watch(&*b, &sid, &path, recursive, &tw.abort, armed_tx, |v| {
            let mut q = lock(&tw.events);
            if q.len() >= super::MAX_WATCHER_EVENTS {
                q.pop_front();
            }
            q.push_back(v);
            true
        });
        if let Err(e) = r {
            if !tw.abort.fired() {
                *lock(&tw.error) = Some(rt_error(e));
            }
        } else if !tw.abort.fired() {
            *lock(&tw.error) = Some(ConnectError::internal("the watch ended"));
        }
    });
    if let Err(e) = started {
        lock(&st.rpc.watchers).remove(&watcher_id);
        return Err(e);
    }
    let _ = armed_rx.await;
    tokio::time::sleep(WATCH_SETTLE).await;
    if let Some(e) = lock(&w.error).clone() {
        lock(&st.rpc.watchers).remove(&watcher_id);
        return Err(e);
    }
    Ok(json!({ "watcherId": watcher_id }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permissions_print_like_go() {
        assert_eq!(permissions(libc::S_IFREG | 0o644), "-rw-r--r--");
        assert_eq!(permissions(libc::S_IFDIR | 0o755), "drwxr-xr-x");
        assert_eq!(permissions(libc::S_IFLNK | 0o777), "Lrwxrwxrwx");
        assert_eq!(
            permissions(libc::S_IFDIR | libc::S_ISVTX | 0o777),
            "dtrwxrwxrwx"
        );
        assert_eq!(permissions(libc::S_IFCHR | 0o666), "Dcrw-rw-rw-");
        assert_eq!(
            permissions(libc::S_IFREG | libc::S_ISUID | 0o755),
            "urwxr-xr-x"
        );
    }

    #[test]
    fn entries_match_the_sdks_example() {
        let e = entry_json(
            "/home/user/a.txt",
            "a.txt",
            FileType::File,
            10,
            libc::S_IFREG | 0o644,
            1_796_131_300_000,
        );
        assert_eq!(
            e,
            json!({"name": "a.txt", "type": "FILE_TYPE_FILE", "path": "/home/user/a.txt",
                   "size": "10", "mode": 420, "permissions": "-rw-r--r--", "owner": "user",
                   "group": "user", "modifiedTime": "2026-12-01T13:21:40.000Z"})
        );
        let e = entry_json("/tmp/x", "x", FileType::Dir, 0, libc::S_IFDIR | 0o700, 0);
        assert_eq!(e["owner"], "root");
        assert!(e.get("size").is_none() && e.get("modifiedTime").is_none());
        assert_eq!(e["type"], "FILE_TYPE_DIRECTORY");
    }

    #[test]
    fn requests_of_the_sdk_parse() {
        let m: ListDirRequest = connect::decode(br#"{"path":"/home/user","depth":1}"#).unwrap();
        assert_eq!((m.path.as_str(), m.depth), ("/home/user", 1));
        let m: PathRequest = connect::decode(br#"{"path":"x"}"#).unwrap();
        assert_eq!(m.path, "x");
        let m: MoveRequest = connect::decode(br#"{"source":"a","destination":"b"}"#).unwrap();
        assert_eq!((m.source.as_str(), m.destination.as_str()), ("a", "b"));
        let m: WatchRequest =
            connect::decode(br#"{"path":"d","recursive":true,"includeEntry":false}"#).unwrap();
        assert!(m.recursive && !m.include_entry && !m.allow_network_mounts);
        let m: WatchRequest = connect::decode(br#"{"path":"d","include_entry":true}"#).unwrap();
        assert!(m.include_entry);
        let m: WatcherRequest = connect::decode(br#"{"watcherId":"w1"}"#).unwrap();
        assert_eq!(m.watcher_id, "w1");
        let m: WatcherRequest = connect::decode(br#"{"watcher_id":"w2"}"#).unwrap();
        assert_eq!(m.watcher_id, "w2");
    }

    #[test]
    fn event_names_are_relative_to_the_watched_dir() {
        assert_eq!(
            fs_event("/home/user/d", "/home/user/d/a/b.txt", FsOp::Create),
            Some(json!({"name": "a/b.txt", "type": "EVENT_TYPE_CREATE"}))
        );
        assert_eq!(
            fs_event("/", "/x", FsOp::Remove),
            Some(json!({"name": "x", "type": "EVENT_TYPE_REMOVE"}))
        );
        assert_eq!(fs_event("/d", "/d/x", FsOp::Unknown), None);
        assert_eq!(
            fs_event("/d", "/d/.f.txt.ember-0c41f657", FsOp::Create),
            None
        );
        assert!(fs_event("/d", "/d/.ember-1", FsOp::Create).is_some());
        assert!(fs_event("/d", "/d/.x.ember-zz", FsOp::Create).is_some());
        assert_eq!(base_name("/home/user/a.txt"), "a.txt");
        assert_eq!(base_name("/"), "/");
    }
}
