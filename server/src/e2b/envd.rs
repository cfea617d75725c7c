//! envd's HTTP surface (port 49983, `docs/e2b.md` §3.1): `/health`, `/envs`, `/files`
//! (download and both upload forms); Connect RPC paths go to [`super::rpc`].
//!
//! Paths: absolute, or relative to the user's home (`/home/user`; `/root` for `root`). The
//! user is `username=` or `Authorization: Basic base64("<user>:")`, default `user` (envd
//! ≥ 0.4.0). The agent writes as root; a file written for `user` is then given to `user`
//! (with the directories under `/home/user` on its way) by one `chown` in the guest.
//!
//! Bodies stream in both directions: a download is written to the response as the guest
//! sends it, an upload (multipart part or octet-stream, gunzipped on the fly when
//! `Content-Encoding: gzip`) is read by the agent call as it arrives. Errors are
//! `{"code","message"}`: 404 no such file, 400 a directory or a bad request, 401 an unknown
//! user, 413 over the server's upload limit.

use ember_runtime::call::{self, Io};
use std::collections::BTreeMap;
use std::io::Read;

use axum::extract::{DefaultBodyLimit, Extension, Multipart, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::get;
use axum::{Json, Router};
use base64::Engine;
use bytes::Bytes;
use ember_runtime::call::{ErrorCode, ExecUser};
use futures_util::Stream;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tower::ServiceExt;

use super::target::{gone_or, Target};
use super::{rpc, E2bError, E2bQuery, E2bState};
use crate::error::ApiError;
use crate::stream::{self, pump_body, ChannelReader};
use ember_runtime::RuntimeError;

/// The default user of envd ≥ 0.4.0.
pub const DEFAULT_USER: &str = "user";

/// Serves one envd request (routed and authenticated by `route`) with `router` (the
/// surface's, built once).
pub async fn handle(st: E2bState, router: &Router, id: String, req: Request) -> Response {
    let path = req.uri().path();
    if path.starts_with("/process.Process/") || path.starts_with("/filesystem.Filesystem/") {
        return rpc::handle(st, id, req).await;
    }
    match router.clone().oneshot(req).await {
        Ok(resp) => resp,
        Err(never) => match never {},
    }
}

pub(super) fn routes() -> Router<E2bState> {
    let routes = Router::new()
        .route("/health", get(|| async { StatusCode::NO_CONTENT }))
        .route("/envs", get(envs))
        .route("/files", get(download).post(upload));
    super::with_fallbacks(routes, "envd")
        // Uploads have their own limit (the server's), enforced while streaming.
        .layer(DefaultBodyLimit::disable())
}

async fn envs(Extension(t): Extension<Target>) -> Json<BTreeMap<String, String>> {
    Json(t.info.env)
}

/// The user a request acts as, and its home.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// `user` or `root`.
    pub name: &'static str,
    /// Its home directory.
    pub home: &'static str,
}

/// The user of a request: `username=`, else Basic auth, else [`DEFAULT_USER`].
pub fn user_of(query: Option<&str>, headers: &HeaderMap) -> Result<User, E2bError> {
    let from_auth = || {
        let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
        let (scheme, b64) = v.trim().split_once(' ')?;
        if !scheme.eq_ignore_ascii_case("basic") {
            return None;
        }
        let raw = base64::engine::general_purpose::STANDARD
            .decode(b64.trim())
            .ok()?;
        let s = String::from_utf8(raw).ok()?;
        Some(s.split_once(':').map_or(s.clone(), |(u, _)| u.to_string()))
    };
    let name = query
        .filter(|u| !u.is_empty())
        .map(str::to_string)
        .or_else(from_auth)
        .unwrap_or_else(|| DEFAULT_USER.to_string());
    match name.as_str() {
        "user" => Ok(User {
            name: "user",
            home: "/home/user",
        }),
        "root" => Ok(User {
            name: "root",
            home: "/root",
        }),
        other => Err(E2bError::unauthorized(format!(
            "unknown user {other:?} (the sandbox has `user` and `root`)"
        ))),
    }
}

/// `path` made absolute against the user's home.
pub fn resolve(user: &User, path: &str) -> Result<String, E2bError> {
    let p = path.trim();
    if p.is_empty() {
        return Err(E2bError::invalid("path: empty"));
    }
    if p.starts_with('/') {
        return Ok(p.to_string());
    }
    let rel = p.strip_prefix("~/").unwrap_or(p);
    Ok(format!("{}/{}", user.home, rel.trim_start_matches("./")))
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct FileQuery {
    path: Option<String>,
    username: Option<String>,
}

/// The E2B status of a guest file error.
fn file_error(id: &str, path: &str, e: RuntimeError) -> E2bError {
    match &e {
        RuntimeError::Guest { code, message, .. } => {
            let status = match code {
                ErrorCode::NotFound => StatusCode::NOT_FOUND,
                ErrorCode::IsADirectory | ErrorCode::NotADirectory | ErrorCode::BadRequest => {
                    StatusCode::BAD_REQUEST
                }
                ErrorCode::PermissionDenied => StatusCode::FORBIDDEN,
                ErrorCode::Exists => StatusCode::CONFLICT,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            };
            E2bError::new(status, format!("{path}: {message}"))
        }
        _ => gone_or(id, e),
    }
}

async fn download(
    State(st): State<E2bState>,
    Extension(t): Extension<Target>,
    E2bQuery(q): E2bQuery<FileQuery>,
    headers: HeaderMap,
) -> Result<Response, E2bError> {
    let user = user_of(q.username.as_deref(), &headers)?;
    let path = resolve(&user, q.path.as_deref().unwrap_or(""))?;
    let b = st.backend();
    let id = t.id;
    Ok(stream::raw_with(
        move |w| {
            b.call(
                call::ReadFile {
                    id: id.to_string(),
                    path: path.to_string(),
                },
                Io::output(w),
            )
            .map_err(|e| {
                let e = file_error(&id, &path, e);
                ApiError::new(e.status, "e2b", e.message)
            })?;
            Ok(())
        },
        None,
        |e| axum::response::IntoResponse::into_response(E2bError::from(e)),
    )
    .await)
}

/// Why an upload's reader failed.
#[derive(Debug, Clone)]
enum ReadFail {
    /// More than the limit came through (after decompression).
    Over,
    /// The body could not be read or decoded.
    Bad(String),
}

/// A reader that fails once more than `left` bytes came through, and remembers why it
/// failed (the agent call reports only that its input broke).
struct Watched<R> {
    inner: R,
    left: u64,
    fail: std::sync::Arc<std::sync::Mutex<Option<ReadFail>>>,
}

impl<R: Read> Watched<R> {
    fn failed(&self, f: ReadFail, e: std::io::Error) -> std::io::Error {
        let mut slot = self.fail.lock().unwrap_or_else(|p| p.into_inner());
        slot.get_or_insert(f);
        e
    }
}

impl<R: Read> Read for Watched<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = match self.inner.read(buf) {
            Ok(n) => n,
            Err(e) => return Err(self.failed(ReadFail::Bad(e.to_string()), e)),
        };
        if n as u64 > self.left {
            let e = std::io::Error::other("the upload is over the limit");
            return Err(self.failed(ReadFail::Over, e));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// Streams `body` into the guest file `path` (gunzipped when `gzip`), at most `limit`
/// bytes (compressed and decompressed). The file is given to `user` afterwards when the
/// request's user is `user`.
async fn write_one<S, E>(
    st: &E2bState,
    id: &str,
    user: &User,
    path: String,
    body: S,
    gzip: bool,
) -> Result<Value, E2bError>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    let limit = st.backend().max_upload_bytes();
    let (tx, rx) = mpsc::channel::<std::io::Result<Bytes>>(8);
    let (id2, path2) = (id.to_string(), path.clone());
    // The runtime writes as root and then gives the file (and the directories the write
    // made under the home) to the user, as envd writes as the request's user.
    let as_user = if user.name == "user" {
        ExecUser::User
    } else {
        ExecUser::Root
    };
    let fail = std::sync::Arc::new(std::sync::Mutex::new(None));
    let fail2 = fail.clone();
    let job = st.app.spawn(move |b| {
        let raw = ChannelReader::new(rx);
        let reader: Box<dyn Read> = if gzip {
            Box::new(flate2::read::MultiGzDecoder::new(raw))
        } else {
            Box::new(raw)
        };
        let mut watched = Watched {
            inner: reader,
            left: limit,
            fail: fail2,
        };
        b.call(
            call::WriteFile {
                id: id2.to_string(),
                path: path2.to_string(),
                user: as_user,
            },
            Io::input(&mut watched),
        )
    });
    let over = pump_body(body, tx, limit).await;
    let r = match job.await {
        Ok(r) => r,
        Err(e) => {
            return Err(E2bError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the upload failed: {e}"),
            ))
        }
    };
    if over {
        return Err(too_large(limit));
    }
    if let Err(e) = r {
        let why = fail.lock().unwrap_or_else(|p| p.into_inner()).clone();
        return Err(match why {
            Some(ReadFail::Over) => too_large(limit),
            Some(ReadFail::Bad(m)) if gzip => {
                E2bError::invalid(format!("{path}: the gzip body cannot be decoded: {m}"))
            }
            Some(ReadFail::Bad(m)) => E2bError::invalid(format!("{path}: the body: {m}")),
            None => file_error(id, &path, e),
        });
    }
    let name = path.rsplit('/').next().unwrap_or("").to_string();
    Ok(json!({"path": path, "name": name, "type": "file"}))
}

fn too_large(limit: u64) -> E2bError {
    E2bError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("the upload is over the server's limit of {limit} bytes"),
    )
}

async fn upload(
    State(st): State<E2bState>,
    Extension(t): Extension<Target>,
    E2bQuery(q): E2bQuery<FileQuery>,
    req: Request,
) -> Result<Json<Vec<Value>>, E2bError> {
    let user = user_of(q.username.as_deref(), req.headers())?;
    let ctype = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let limit = st.backend().max_upload_bytes();
    if req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|n| n > limit.saturating_mul(2).max(limit + (1 << 20)))
    {
        return Err(too_large(limit));
    }
    if ctype.starts_with("multipart/form-data") {
        let mut mp = {
            use axum::extract::FromRequest;
            Multipart::from_request(req, &st)
                .await
                .map_err(|e| E2bError::invalid(format!("multipart body: {}", e.body_text())))?
        };
        let mut out = Vec::new();
        let mut first = true;
        loop {
            let field = match mp.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => return Err(E2bError::invalid(format!("multipart body: {e}"))),
            };
            let name = field.name().unwrap_or("").to_string();
            let filename = field.file_name().map(str::to_string);
            if name != "file" && filename.is_none() {
                continue;
            }
            let target = match (first, q.path.as_deref(), filename.as_deref()) {
                (true, Some(p), _) => p.to_string(),
                (_, _, Some(f)) => f.to_string(),
                _ => {
                    return Err(E2bError::invalid(
                        "a file part without a filename (the target path) and no ?path=",
                    ))
                }
            };
            first = false;
            let path = resolve(&user, &target)?;
            out.push(write_one(&st, &t.id, &user, path, field, false).await?);
        }
        if out.is_empty() {
            return Err(E2bError::invalid("the multipart body holds no `file` part"));
        }
        Ok(Json(out))
    } else {
        let target = q
            .path
            .as_deref()
            .ok_or_else(|| E2bError::invalid("path: missing (?path=)"))?;
        let path = resolve(&user, target)?;
        let gzip = match req
            .headers()
            .get(header::CONTENT_ENCODING)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.trim().to_ascii_lowercase())
        {
            None => false,
            Some(e) if e == "gzip" || e == "x-gzip" => true,
            Some(e) if e == "identity" || e.is_empty() => false,
            Some(e) => {
                return Err(E2bError::new(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    format!("Content-Encoding {e:?}: only gzip is supported"),
                ))
            }
        };
        let body = req.into_body().into_data_stream();
        let v = write_one(&st, &t.id, &user, path, body, gzip).await?;
        Ok(Json(vec![v]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn users_come_from_the_query_or_basic_auth() {
        let h = HeaderMap::new();
        assert_eq!(user_of(None, &h).unwrap().name, "user");
        assert_eq!(user_of(Some("root"), &h).unwrap().home, "/root");
        let mut h = HeaderMap::new();
        let b = base64::engine::general_purpose::STANDARD.encode("root:");
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(&format!("Basic {b}")).unwrap(),
        );
        assert_eq!(user_of(None, &h).unwrap().name, "root");
        assert_eq!(user_of(Some("user"), &h).unwrap().name, "user");
        assert_eq!(
            user_of(Some("mallory"), &h).unwrap_err().status,
            StatusCode::UNAUTHORIZED
        );
    }

    #[test]
    fn relative_paths_resolve_against_the_home() {
        let u = user_of(None, &HeaderMap::new()).unwrap();
        assert_eq!(resolve(&u, "a/b.txt").unwrap(), "/home/user/a/b.txt");
        assert_eq!(resolve(&u, "./a").unwrap(), "/home/user/a");
        assert_eq!(resolve(&u, "/tmp/x").unwrap(), "/tmp/x");
        assert!(resolve(&u, "").is_err());
        let r = user_of(Some("root"), &HeaderMap::new()).unwrap();
        assert_eq!(resolve(&r, "x").unwrap(), "/root/x");
    }
}
