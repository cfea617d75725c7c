//! Connect RPC services of envd (port 49983): `process.Process` and `filesystem.Filesystem`,
//! JSON codec, served in the host process over the runtime's call surface.
//!
//! - `super::connect`: the protocol (envelopes, end frames, errors and their statuses,
//!   headers, ProtoJSON helpers).
//! - `process`: `Start`, `Connect`, `List`, `SendInput`, `StreamInput`, `CloseStdin`,
//!   `SendSignal`, `Update`. Processes run as background `exec`s in the agent, so they
//!   outlive the request that started them; a stream is an agent `process_attach`.
//! - `filesystem`: `Stat`, `MakeDir`, `Move`, `ListDir`, `Remove`, `WatchDir` and the polling
//!   watchers (`CreateWatcher`, `GetWatcherEvents`, `RemoveWatcher`).
//!
//! The user of a call is `Authorization: Basic base64("<user>:")` (default `user`); `user`
//! and `root` exist. Relative paths resolve against the user's home.
//!
//! Long-lived calls (`process_attach`, `watch`) run on a thread of their own (not the blocking
//! pool), with a runtime `Cancel` that the response body fires when it is dropped (the client
//! went away, the stream ended); the runtime fires it itself before it pauses or kills the
//! sandbox. Everything here goes through the runtime's call surface.

#[path = "filesystem.rs"]
pub mod filesystem;
#[path = "process.rs"]
pub mod process;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::extract::Request;
use axum::http::{header, HeaderMap, Method};
use axum::response::Response;
use base64::Engine as _;

pub(crate) use super::connect;
use super::E2bState;
use connect::{Code, ConnectError};
use ember_runtime::call::{ErrorCode, ExecUser};
use ember_runtime::RuntimeError;

/// Most long-lived calls (attaches, watches) at once, server-wide: each holds a thread.
pub const MAX_LONG_CALLS: usize = 1024;

/// Per-server state of the RPC services: the count of long-lived calls. Everything about a
/// sandbox (processes' tags and configs, polling watchers) is the runtime's, so a server
/// restart keeps it.
#[derive(Debug, Default)]
pub struct RpcState {
    long_calls: Arc<AtomicUsize>,
}

/// `work`, cut off with `deadline_exceeded` after `deadline` (a unary call's
/// `Connect-Timeout-Ms`).
pub(crate) async fn within<T>(
    deadline: Option<std::time::Duration>,
    work: impl std::future::Future<Output = Result<T, ConnectError>>,
) -> Result<T, ConnectError> {
    match deadline {
        Some(d) => tokio::time::timeout(d, work).await.unwrap_or_else(|_| {
            Err(ConnectError::new(
                Code::DeadlineExceeded,
                format!("the call took longer than its timeout of {d:?}"),
            ))
        }),
        None => work.await,
    }
}

/// Serves one Connect RPC (`POST /process.Process/<M>` or `/filesystem.Filesystem/<M>`) for
/// sandbox `id`; the caller has routed and authenticated the request.
pub async fn handle(st: E2bState, id: String, req: Request) -> Response {
    let path = req.uri().path().trim_start_matches('/').to_string();
    let (service, method) = path.split_once('/').unwrap_or((path.as_str(), ""));
    let streaming_request = is_stream_request(req.headers());
    if req.method() != Method::POST {
        return fail(
            streaming_request,
            ConnectError::new(
                Code::Unimplemented,
                format!("{} {path}: Connect RPCs are POSTed", req.method()),
            ),
        );
    }
    match service {
        "process.Process" => process::handle(st, id, method.to_string(), req).await,
        "filesystem.Filesystem" => filesystem::handle(st, id, method.to_string(), req).await,
        _ => fail(
            streaming_request,
            ConnectError::new(Code::Unimplemented, format!("no service {service:?}")),
        ),
    }
}

/// Whether the request is enveloped (`application/connect+…`).
fn is_stream_request(h: &HeaderMap) -> bool {
    h.get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.trim()
                .to_ascii_lowercase()
                .starts_with("application/connect+")
        })
}

/// An error answered in the framing the request used.
pub(crate) fn fail(stream: bool, e: ConnectError) -> Response {
    if stream {
        connect::stream_error(&e)
    } else {
        e.unary_response()
    }
}

/// `unimplemented` for a method the service does not have.
pub(crate) fn no_method(service: &str, method: &str, req: &Request) -> Response {
    fail(
        is_stream_request(req.headers()),
        ConnectError::new(
            Code::Unimplemented,
            format!("{service}/{method} is not implemented"),
        ),
    )
}

/// The accounts a call can run as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum User {
    /// `root`, home `/root`.
    Root,
    /// `user` (uid 1000 in the templates), home `/home/user`; the default.
    User,
}

impl User {
    /// The account's name.
    pub fn name(self) -> &'static str {
        match self {
            User::Root => "root",
            User::User => "user",
        }
    }

    /// Its home directory.
    pub fn home(self) -> &'static str {
        match self {
            User::Root => "/root",
            User::User => "/home/user",
        }
    }

    /// The agent's account.
    pub fn exec_user(self) -> ExecUser {
        match self {
            User::Root => ExecUser::Root,
            User::User => ExecUser::User,
        }
    }
}

/// The user of a call: `Authorization: Basic base64("<user>:")`, default `user`. Other
/// names are `unauthenticated` (as envd answers an unknown account).
pub fn user_of(headers: &HeaderMap) -> Result<User, ConnectError> {
    let Some(v) = headers.get(header::AUTHORIZATION) else {
        return Ok(User::User);
    };
    let v = v.to_str().unwrap_or("").trim();
    let Some((scheme, cred)) = v.split_once(' ') else {
        return Ok(User::User);
    };
    if !scheme.eq_ignore_ascii_case("basic") {
        return Ok(User::User);
    }
    let raw = base64::engine::general_purpose::STANDARD
        .decode(cred.trim())
        .map_err(|_| {
            ConnectError::new(
                Code::Unauthenticated,
                "the Basic credentials are not base64",
            )
        })?;
    let text = String::from_utf8_lossy(&raw);
    let name = text.split_once(':').map_or(&*text, |(u, _)| u);
    match name {
        "" | "user" => Ok(User::User),
        "root" => Ok(User::Root),
        other => Err(ConnectError::new(
            Code::Unauthenticated,
            format!("invalid username: '{other}'"),
        )),
    }
}

/// A path as envd resolves it: empty is the home, `~` and `~/…` expand to it, a relative
/// path is taken from it; the result is normalised (`.`, `..`, repeated `/`).
pub fn resolve(path: &str, user: User) -> Result<String, ConnectError> {
    let home = user.home();
    let full = if path.is_empty() || path == "~" {
        home.to_string()
    } else if let Some(rest) = path.strip_prefix("~/") {
        format!("{home}/{rest}")
    } else if path.starts_with('~') {
        return Err(ConnectError::invalid(format!(
            "cannot expand user-specific home dir in '{path}'"
        )));
    } else if path.starts_with('/') {
        path.to_string()
    } else {
        format!("{home}/{path}")
    };
    if full.contains('\0') {
        return Err(ConnectError::invalid("a path contains a NUL byte"));
    }
    let mut parts: Vec<&str> = Vec::new();
    for c in full.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    Ok(format!("/{}", parts.join("/")))
}

/// The Connect error of a runtime error.
pub fn rt_error(e: RuntimeError) -> ConnectError {
    let message = e.to_string();
    let code = match &e {
        RuntimeError::NotFound(id) => {
            return ConnectError::new(Code::Unavailable, format!("The sandbox {id} was not found"))
        }
        RuntimeError::NoSuchWatcher(m) => return ConnectError::not_found(m.clone()),
        RuntimeError::Conflict { .. } => Code::Unavailable,
        RuntimeError::Sandbox(_) => Code::Unavailable,
        RuntimeError::Invalid(_) => Code::InvalidArgument,
        RuntimeError::Cancelled(_) => Code::Canceled,
        RuntimeError::Capacity(_) => Code::ResourceExhausted,
        RuntimeError::Timeout { .. } => Code::DeadlineExceeded,
        RuntimeError::Guest { code, message, .. } => {
            let code = match code {
                ErrorCode::NotFound | ErrorCode::NoSuchProcess | ErrorCode::NoSuchContext => {
                    Code::NotFound
                }
                ErrorCode::Exists => Code::AlreadyExists,
                ErrorCode::NotADirectory
                | ErrorCode::IsADirectory
                | ErrorCode::BadRequest
                | ErrorCode::SpawnFailed => Code::InvalidArgument,
                ErrorCode::PermissionDenied => Code::PermissionDenied,
                ErrorCode::Io | ErrorCode::Internal => Code::Internal,
                _ => Code::Unknown,
            };
            return ConnectError::new(code, message.clone());
        }
        _ => Code::Internal,
    };
    ConnectError::new(code, message)
}

/// Sends one call to the runtime on the blocking pool; its error becomes the Connect error
/// E2B's clients expect.
pub(crate) async fn send<T: Send + 'static>(
    st: &E2bState,
    f: impl FnOnce(&dyn crate::Backend) -> Result<T, RuntimeError> + Send + 'static,
) -> Result<T, ConnectError> {
    match st.app.spawn(f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(rt_error(e)),
        Err(e) => Err(ConnectError::internal(format!("the call failed: {e}"))),
    }
}

/// Runs a long-lived blocking call on a thread of its own (at most
/// [`MAX_LONG_CALLS`] at once).
pub(crate) fn spawn_long(
    st: &RpcState,
    name: &str,
    f: impl FnOnce() + Send + 'static,
) -> Result<(), ConnectError> {
    let count = st.long_calls.clone();
    if count.fetch_add(1, Ordering::SeqCst) >= MAX_LONG_CALLS {
        count.fetch_sub(1, Ordering::SeqCst);
        return Err(ConnectError::new(
            Code::ResourceExhausted,
            format!("too many open streams (at most {MAX_LONG_CALLS})"),
        ));
    }
    struct Release(Arc<AtomicUsize>);
    impl Drop for Release {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
    let release = Release(count);
    let span = tracing::Span::current();
    std::thread::Builder::new()
        .name(name.to_string())
        .stack_size(1 << 20)
        .spawn(move || {
            let _release = release;
            let _enter = span.enter();
            f()
        })
        .map(drop)
        .map_err(|e| ConnectError::internal(format!("cannot start a thread: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn basic(user: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        let v = base64::engine::general_purpose::STANDARD.encode(format!("{user}:"));
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(&format!("Basic {v}")).unwrap(),
        );
        h
    }

    #[test]
    fn users() {
        assert_eq!(user_of(&HeaderMap::new()).unwrap(), User::User);
        assert_eq!(user_of(&basic("root")).unwrap(), User::Root);
        assert_eq!(user_of(&basic("user")).unwrap(), User::User);
        let e = user_of(&basic("mallory")).unwrap_err();
        assert_eq!(e.code, Code::Unauthenticated);
        assert!(e.message.contains("mallory"));
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic !!"));
        assert_eq!(user_of(&h).unwrap_err().code, Code::Unauthenticated);
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer x"));
        assert_eq!(user_of(&h).unwrap(), User::User);
    }

    #[test]
    fn paths_resolve_like_envd() {
        let u = User::User;
        assert_eq!(resolve("", u).unwrap(), "/home/user");
        assert_eq!(resolve("a.txt", u).unwrap(), "/home/user/a.txt");
        assert_eq!(resolve("~/x/../y", u).unwrap(), "/home/user/y");
        assert_eq!(resolve("~", User::Root).unwrap(), "/root");
        assert_eq!(resolve("/tmp//a/./b/", u).unwrap(), "/tmp/a/b");
        assert_eq!(resolve("../../..", u).unwrap(), "/");
        assert!(resolve("~bob/x", u).is_err());
        assert!(resolve("/a\0b", u).is_err());
    }

    #[test]
    fn runtime_errors_map_to_connect_codes() {
        let guest = |code| RuntimeError::Guest {
            id: "s".into(),
            call: "file_stat",
            code,
            message: "m".into(),
        };
        assert_eq!(rt_error(guest(ErrorCode::NotFound)).code, Code::NotFound);
        assert_eq!(rt_error(guest(ErrorCode::Exists)).code, Code::AlreadyExists);
        assert_eq!(
            rt_error(guest(ErrorCode::PermissionDenied)).code,
            Code::PermissionDenied
        );
        assert_eq!(
            rt_error(guest(ErrorCode::NoSuchProcess)).code,
            Code::NotFound
        );
        assert_eq!(
            rt_error(guest(ErrorCode::BadRequest)).code,
            Code::InvalidArgument
        );
        assert_eq!(rt_error(guest(ErrorCode::Io)).code, Code::Internal);
        let e = rt_error(RuntimeError::NotFound("abc".into()));
        assert_eq!(e.code, Code::Unavailable);
        assert!(e.message.contains("was not found"));
    }
}
