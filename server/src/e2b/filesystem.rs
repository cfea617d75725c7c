//! `filesystem.Filesystem`: the guest's files, as envd presents them.
//!
//! Paths resolve against the user's home (see [`super::resolve`]). The runtime's file calls
//! run as root; where envd gives the caller's account ownership of what it creates
//! (`MakeDir`, the parents `Move` creates) the runtime's `mkdir` is asked to make them as the
//! caller, so they get its ownership and its permission checks.
//!
//! `EntryInfo.owner`/`group`: the agent reports no uid/gid, so they are inferred: `user`
//! under `/home/user`, `root` elsewhere.
//!
//! Watches: the runtime's `watch` (inotify in the guest) reports create, write, remove and
//! rename (no chmod); `WatchDir` streams them. `CreateWatcher`, `GetWatcherEvents` and
//! `RemoveWatcher` are the runtime's polling watchers, which it keeps in its store: a server
//! restart keeps them. A watch is in place once the agent has read the call; it sends no
//! acknowledgement, so events in the first few milliseconds after the answer may be missed.

use std::time::Duration;

use axum::extract::Request;
use axum::response::Response;
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

use super::connect::{self, pj, Code, ConnectError};
use super::{rt_error, spawn_long, E2bState, User};
use crate::Backend;
use ember_runtime::call::{
    self, Cancel, CancelOnDrop, ErrorCode, EventKind, FileStat, FileType, FsOp, Io,
};
use ember_runtime::RuntimeError;

/// How long `WatchDir` gives the agent to read the watch call before it answers.
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

/// Sends one call; its error becomes the Connect error.
async fn send<T: Send + 'static>(
    st: &E2bState,
    f: impl FnOnce(&dyn Backend) -> Result<T, RuntimeError> + Send + 'static,
) -> Result<T, ConnectError> {
    match st.app.spawn(f).await {
        Ok(r) => r.map_err(Failure::Runtime),
        Err(e) => Err(Failure::Join(e.to_string())),
    }
    .map_err(Failure::connect)
}

/// A call that failed: kept as the runtime's error where the caller looks at it (a missing
/// guest path is often an answer, not a failure).
enum Failure {
    Runtime(RuntimeError),
    Join(String),
}

impl Failure {
    fn connect(self) -> ConnectError {
        match self {
            Failure::Runtime(e) => rt_error(e),
            Failure::Join(e) => ConnectError::internal(format!("the call failed: {e}")),
        }
    }
}

/// Like [`send`], keeping the runtime's error for the caller to look at.
async fn try_send<T: Send + 'static>(
    st: &E2bState,
    f: impl FnOnce(&dyn Backend) -> Result<T, RuntimeError> + Send + 'static,
) -> Result<Result<T, RuntimeError>, ConnectError> {
    st.app
        .spawn(f)
        .await
        .map_err(|e| Failure::Join(e.to_string()).connect())
}

fn is_guest(e: &RuntimeError, want: ErrorCode) -> bool {
    matches!(e, RuntimeError::Guest { code, .. } if *code == want)
}

/// `Stat` of `path`, keeping a guest error for the caller.
async fn stat(
    st: &E2bState,
    id: &str,
    path: &str,
) -> Result<Result<FileStat, RuntimeError>, ConnectError> {
    let (id, path) = (id.to_string(), path.to_string());
    try_send(st, move |b| b.call(call::Stat { id, path }, Io::none())).await
}

/// `mkdir -p path` as `user` (so that the directories are theirs, with their rights).
async fn make_dirs(st: &E2bState, id: &str, path: &str, user: User) -> Result<(), ConnectError> {
    let (id, path) = (id.to_string(), path.to_string());
    let user = user.exec_user();
    send(st, move |b| {
        b.call(call::Mkdir { id, path, user }, Io::none())
    })
    .await
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
                let s = stat(st, id, &path).await?.map_err(rt_error)?;
                let entry = entry_json(&path, base_name(&path), s.kind, s.size, s.mode, s.mtime_ms);
                Ok(json!({ "entry": entry }))
            }
            "ListDir" => {
                let m: ListDirRequest = connect::read_unary(body).await?;
                let path = super::resolve(&m.path, user)?;
                let depth = m.depth.max(1);
                let s = stat(st, id, &path).await?.map_err(rt_error)?;
                if s.kind == FileType::File || s.kind == FileType::Other {
                    return Err(ConnectError::invalid(format!(
                        "path is not a directory: {path}"
                    )));
                }
                let (sid, p) = (id.to_string(), path.clone());
                let entries = send(st, move |b| {
                    b.call(
                        call::ListFiles {
                            id: sid,
                            path: p,
                            depth,
                        },
                        Io::none(),
                    )
                })
                .await?;
                let out: Vec<Value> = entries
                    .iter()
                    .filter(|e| e.kind != FileType::Other)
                    .map(|e| entry_json(&e.path, &e.name, e.kind, e.size, e.mode, e.mtime_ms))
                    .collect();
                Ok(json!({ "entries": out }))
            }
            "MakeDir" => {
                let m: PathRequest = connect::read_unary(body).await?;
                let path = super::resolve(&m.path, user)?;
                match stat(st, id, &path).await? {
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
                    Err(e) => return Err(rt_error(e)),
                }
                make_dirs(st, id, &path, user).await?;
                let entry = json!({
                    "name": base_name(&path), "type": "FILE_TYPE_DIRECTORY", "path": path,
                });
                Ok(json!({ "entry": entry }))
            }
            "Move" => {
                let m: MoveRequest = connect::read_unary(body).await?;
                let from = super::resolve(&m.source, user)?;
                let to = super::resolve(&m.destination, user)?;
                let rename = |st: &E2bState| {
                    let (id, from, to) = (id.to_string(), from.clone(), to.clone());
                    let st = st.clone();
                    async move {
                        try_send(&st, move |b| {
                            b.call(call::Rename { id, from, to }, Io::none())
                        })
                        .await
                    }
                };
                match rename(st).await? {
                    Ok(()) => {}
                    Err(e) if is_guest(&e, ErrorCode::NotFound) => {
                        // The source, or the destination's directory, is missing.
                        match stat(st, id, &from).await? {
                            Ok(_) => {}
                            Err(e) if is_guest(&e, ErrorCode::NotFound) => {
                                return Err(ConnectError::not_found(format!(
                                    "source file not found: {from}"
                                )))
                            }
                            Err(e) => return Err(rt_error(e)),
                        }
                        let parent = match to.rsplit_once('/') {
                            Some(("", _)) | None => "/".to_string(),
                            Some((p, _)) => p.to_string(),
                        };
                        make_dirs(st, id, &parent, user).await?;
                        rename(st).await?.map_err(rt_error)?;
                    }
                    Err(e) => return Err(rt_error(e)),
                }
                let s = stat(st, id, &to).await?.map_err(rt_error)?;
                let entry = entry_json(&to, base_name(&to), s.kind, s.size, s.mode, s.mtime_ms);
                Ok(json!({ "entry": entry }))
            }
            "Remove" => {
                let m: PathRequest = connect::read_unary(body).await?;
                let path = super::resolve(&m.path, user)?;
                let sid = id.to_string();
                let r = try_send(st, move |b| {
                    b.call(
                        call::Remove {
                            id: sid,
                            path,
                            recursive: true,
                        },
                        Io::none(),
                    )
                })
                .await?;
                match r {
                    // envd removes with os.RemoveAll: a missing path is fine.
                    Err(e) if !is_guest(&e, ErrorCode::NotFound) => Err(rt_error(e)),
                    _ => Ok(json!({})),
                }
            }
            "CreateWatcher" => {
                let m: WatchRequest = connect::read_unary(body).await?;
                let path = super::resolve(&m.path, user)?;
                check_watch_path(st, id, &path).await?;
                let (sid, recursive) = (id.to_string(), m.recursive);
                let watcher = send(st, move |b| {
                    b.call(
                        call::WatcherCreate {
                            id: sid,
                            path,
                            recursive,
                        },
                        Io::none(),
                    )
                })
                .await?;
                Ok(json!({ "watcherId": watcher }))
            }
            "GetWatcherEvents" => {
                let m: WatcherRequest = connect::read_unary(body).await?;
                let (sid, watcher) = (id.to_string(), m.watcher_id);
                let changes = send(st, move |b| {
                    b.call(call::WatcherEvents { id: sid, watcher }, Io::none())
                })
                .await?;
                let events: Vec<Value> = changes
                    .iter()
                    .filter_map(|c| change_json(&c.name, c.op))
                    .collect();
                Ok(json!({ "events": events }))
            }
            "RemoveWatcher" => {
                let m: WatcherRequest = connect::read_unary(body).await?;
                let (sid, watcher) = (id.to_string(), m.watcher_id);
                send(st, move |b| {
                    b.call(call::WatcherRemove { id: sid, watcher }, Io::none())
                })
                .await?;
                Ok(json!({}))
            }
            _ => Err(ConnectError::new(Code::Unimplemented, method.to_string())),
        }
    };
    super::within(deadline, work).await
}

/// Checks that `path` is a directory to watch (envd's errors, before a stream starts).
async fn check_watch_path(st: &E2bState, id: &str, path: &str) -> Result<(), ConnectError> {
    match stat(st, id, path).await? {
        Ok(s) if s.kind == FileType::Dir => Ok(()),
        Ok(_) => Err(ConnectError::invalid(format!(
            "path {path} not a directory"
        ))),
        Err(e) if is_guest(&e, ErrorCode::NotFound) => {
            Err(ConnectError::not_found(format!("path {path} not found")))
        }
        Err(e) => Err(rt_error(e)),
    }
}

/// A `FilesystemEvent` for a change to `name` (relative to the watched directory; `None`:
/// not reported).
fn change_json(name: &str, op: FsOp) -> Option<Value> {
    let kind = match op {
        FsOp::Create => "EVENT_TYPE_CREATE",
        FsOp::Write => "EVENT_TYPE_WRITE",
        FsOp::Remove => "EVENT_TYPE_REMOVE",
        FsOp::Rename => "EVENT_TYPE_RENAME",
        FsOp::Unknown => return None,
    };
    Some(json!({"name": name, "type": kind}))
}

/// A `FilesystemEvent` for a change to `path` under the watched `root`.
fn fs_event(root: &str, path: &str, op: FsOp) -> Option<Value> {
    change_json(ember_runtime::relative_name(root, path), op)
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
    let cancel = Cancel::new();
    let (ev_tx, mut ev_rx) = mpsc::channel::<Result<Value, RuntimeError>>(64);
    let (armed_tx, armed_rx) = oneshot::channel();
    let (b, sid, wpath, wcancel) = (st.backend(), id.to_string(), path.clone(), cancel.clone());
    let recursive = m.recursive;
    spawn_long(&st.rpc, "e2b-watch", move || {
        let tx = ev_tx.clone();
        let mut armed = Some(armed_tx);
        let mut on_event = |ev: &EventKind| match ev {
            EventKind::Started { .. } => {
                if let Some(a) = armed.take() {
                    let _ = a.send(());
                }
                true
            }
            EventKind::FsEvent { path: p, op } => match fs_event(&wpath, p, *op) {
                Some(v) => tx.blocking_send(Ok(v)).is_ok(),
                None => true,
            },
            _ => true,
        };
        let watch = call::Watch {
            id: sid,
            path: wpath.clone(),
            recursive,
        };
        let r = b.call(watch, Io::events(&mut on_event).with_cancel(wcancel));
        if let Err(e) = r {
            let _ = ev_tx.blocking_send(Err(e));
        }
    })?;
    // The watch is in place once the agent has read the call (it sends no
    // acknowledgement): the runtime says when the call left, this gives the agent a moment.
    let _ = armed_rx.await;
    tokio::time::sleep(WATCH_SETTLE).await;
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    let _ = tx.try_send(connect::message_frame(&json!({"start": {}})));
    let pump_cancel = cancel.clone();
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
                _ = tx.closed() => { pump_cancel.fire(); return; }
                _ = &mut deadline_fut => {
                    break Some(ConnectError::new(Code::DeadlineExceeded, "the watch ran longer than the request's timeout"));
                }
                _ = ka.tick() => {
                    if tx.send(connect::message_frame(&json!({"keepalive": {}}))).await.is_err() {
                        pump_cancel.fire();
                        return;
                    }
                }
                m = ev_rx.recv() => match m {
                    Some(Ok(v)) => {
                        if tx.send(connect::message_frame(&json!({"filesystem": v}))).await.is_err() {
                            pump_cancel.fire();
                            return;
                        }
                        ka.reset();
                    }
                    Some(Err(e)) => break Some(rt_error(e)),
                    None => break None,
                }
            }
        };
        pump_cancel.fire();
        let _ = tx.send(connect::end_frame(end.as_ref())).await;
    });
    Ok(connect::stream_response(rx, CancelOnDrop(cancel)))
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
        assert_eq!(base_name("/home/user/a.txt"), "a.txt");
        assert_eq!(base_name("/"), "/");
    }
}
