//! The E2B-compatible surface of `ember serve`: the official E2B SDKs (Python `e2b`,
//! `e2b-code-interpreter`; npm `e2b`, `@e2b/code-interpreter`) work unchanged against it.
//! The wire protocol is summarised in `docs/e2b.md`; the SDK source is the contract.
//!
//! Everything is translated in the host process into the runtime's calls
//! (`ember_runtime::call`, sent through [`Backend`]) and nothing else: the adapter keeps no
//! state of its own (processes' tags, watchers and contexts are the runtime's), never reads
//! the store and never holds a sandbox handle; nothing of E2B's own server code runs in the
//! guest. Its three routers (control plane, envd, code interpreter) are built once with the
//! server's router ([`Surface`]) and answer every error in E2B's shape themselves
//! ([`E2bJson`], [`E2bPath`], [`E2bQuery`], [`with_fallbacks`]).
//!
//! - `control`: the REST control plane (`/v2/sandboxes`, `/sandboxes/…`, `/snapshots`),
//!   authenticated by `X-API-KEY` (ember's token), errors `{"code": int, "message": str}`.
//! - `route`: which requests are sandbox traffic (`E2b-Sandbox-Id`/`E2b-Sandbox-Port`
//!   headers, or `Host: <port>-<id>.<domain>`), and the per-sandbox `X-Access-Token`.
//! - `envd`: the envd HTTP surface on port 49983 (`/health`, `/files`, `/envs`).
//! - `connect` + `rpc`: Connect RPC (JSON codec) for `process.Process` and
//!   `filesystem.Filesystem` on port 49983.
//! - `interp`: the code-interpreter surface on port 49999 (`/execute`, `/contexts`).
//! - `tls`: the optional TLS listener and the local CA / `*.<domain>` certificate.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use serde::de::DeserializeOwned;

use super::error::{ApiError, ApiJson};
use super::{AppState, Backend};
use ember_runtime::{ErrorClass, RuntimeError};

pub mod connect;
pub mod control;
pub mod envd;
pub mod interp;
pub mod route;
pub mod rpc;
pub mod secrets;
pub mod target;
pub mod templates;
pub mod tls;
pub mod volumes;

/// envd's port: files, processes, filesystem RPC.
pub const ENVD_PORT: u16 = 49983;
/// The code interpreter's port: `/execute`, `/contexts`.
pub const INTERP_PORT: u16 = 49999;

/// The envd version advertised to the SDKs. The SDKs gate features on it
/// (`e2b/envd/versions.py`): 0.3.0 stdin flag, 0.4.0 default user, 0.5.2 CloseStdin,
/// 0.5.7 octet-stream and gzip uploads. Nothing above 0.5.7 is claimed (file metadata as
/// xattrs, watch `include_entry` are not implemented).
pub const ENVD_VERSION: &str = "0.5.7";

/// The E2B surface's settings.
#[derive(Debug, Clone)]
pub struct E2bOptions {
    /// The sandbox domain for `Host: <port>-<id>.<domain>` routing and the `domain` field of
    /// responses (None: answer `"domain": null`, header routing only).
    pub domain: Option<String>,
    /// E2B template names → ember template names (`code-interpreter-v1` → `code-interpreter`,
    /// every E2B code-interpreter language, and `base` → `default` unless configured
    /// otherwise). Names not in the map are ember
    /// template names.
    pub aliases: BTreeMap<String, String>,
    /// Honour `allow_internet_access: true` (which the SDKs send by default) with policy
    /// `egress`. Off: such sandboxes get ember's default, `none`, unless the request names
    /// `network.allowOut`/`denyOut` lists.
    pub allow_internet: bool,
}

impl Default for E2bOptions {
    fn default() -> Self {
        let mut aliases = BTreeMap::new();
        aliases.insert("code-interpreter-v1".into(), "code-interpreter".into());
        aliases.insert("base".into(), "default".into());
        E2bOptions {
            domain: None,
            aliases,
            allow_internet: false,
        }
    }
}

/// State shared by the E2B handlers. Cheap to clone.
#[derive(Clone)]
pub struct E2bState {
    /// The server's state (backend, token, blocking-call helpers).
    pub app: AppState,
    /// Settings.
    pub opts: Arc<E2bOptions>,
    /// The RPC services' state (the count of long calls' threads).
    pub rpc: Arc<rpc::RpcState>,
}

impl std::fmt::Debug for E2bState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("E2bState").finish_non_exhaustive()
    }
}

impl E2bState {
    /// The E2B surface's state over the server's.
    pub fn new(app: AppState) -> Self {
        let opts = app.inner.e2b.clone();
        let rpc = app.inner.rpc.clone();
        E2bState { app, opts, rpc }
    }

    /// The backend.
    pub fn backend(&self) -> Arc<dyn Backend> {
        self.app.backend()
    }

    /// The `envdAccessToken` of sandbox `id` (`X-Access-Token` on envd and `/execute`).
    pub fn envd_token(&self, id: &str) -> String {
        derive_token(&self.app.inner.token, "envd-access", id)
    }

    /// The `trafficAccessToken` of sandbox `id` (`E2B-Traffic-Access-Token` on every
    /// code-interpreter call, which the SDKs send when the API returned one).
    pub fn traffic_token(&self, id: &str) -> String {
        derive_token(&self.app.inner.token, "traffic-access", id)
    }

    /// Whether `key` is the server's token (constant-time).
    pub fn is_api_key(&self, key: &str) -> bool {
        super::same(key.as_bytes(), self.app.inner.token.as_bytes())
    }

    /// The `domain` field of responses.
    pub fn domain(&self) -> Option<String> {
        self.opts.domain.clone()
    }
}

pub use crate::tokens::{derive_token, hmac_sha256};

/// Marks a response the E2B surface produced (a response extension): the server's outer
/// layer then leaves its body alone and counts it under this label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct E2bRoute(pub &'static str);

/// An error of the E2B REST surfaces: `{"code": <status>, "message": "…"}`, the shape the
/// SDKs decode (`Error.from_dict` pops both keys).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct E2bError {
    /// The HTTP status (also the body's `code`).
    pub status: StatusCode,
    /// What failed.
    pub message: String,
    /// A machine-readable class for the client's logic, sent as `error_code` when set
    /// (E2B's API adds it to some errors: `sandbox_capacity_unavailable`).
    pub error_code: Option<&'static str>,
}

impl E2bError {
    /// An error with this status and message.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        E2bError {
            status,
            message: message.into(),
            error_code: None,
        }
    }

    /// 400.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// 404.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }

    /// 401.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, message)
    }

    /// 502 "The sandbox <id> was not found": what the SDKs read as "not running"
    /// (`exceptions.py SANDBOX_NOT_FOUND_MESSAGE`).
    pub fn sandbox_gone(id: &str) -> Self {
        Self::new(
            StatusCode::BAD_GATEWAY,
            format!("The sandbox {id} was not found"),
        )
    }

    /// 502 "… port is not open": the SDKs' `SandboxUnreachableException`
    /// (`exceptions.py SANDBOX_PORT_NOT_OPEN_MESSAGE`).
    pub fn port_closed(id: &str, port: u16) -> Self {
        Self::new(
            StatusCode::BAD_GATEWAY,
            format!(
                "The sandbox {id} port is not open: {port} (ember serves envd on {ENVD_PORT} \
                 and the code interpreter on {INTERP_PORT}; other ports once exposed with POST /v1/sandboxes/{id}/ports)"
            ),
        )
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        let mut b = serde_json::json!({"code": self.status.as_u16(), "message": self.message});
        if let Some(c) = self.error_code {
            b["error_code"] = c.into();
        }
        b
    }
}

impl std::fmt::Display for E2bError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.status.as_u16(), self.message)
    }
}

impl std::error::Error for E2bError {}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() && self.status != StatusCode::BAD_GATEWAY {
            tracing::error!(status = self.status.as_u16(), "{}", self.message);
        }
        let body = serde_json::to_vec(&self.body()).unwrap_or_default();
        let mut resp = (self.status, body).into_response();
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if self.status == StatusCode::BAD_GATEWAY {
            // A gone sandbox stays gone: the SDKs' transport retries 502s unless told not
            // to (`e2b/retry.py`).
            h.insert("should-retry", HeaderValue::from_static("false"));
        }
        resp
    }
}

impl From<ApiError> for E2bError {
    fn from(e: ApiError) -> Self {
        E2bError::new(e.status, e.message)
    }
}

impl From<RuntimeError> for E2bError {
    /// The runtime's classes as statuses; a sandbox that has ended is "not found", as E2B
    /// forgets killed sandboxes.
    fn from(e: RuntimeError) -> Self {
        if let RuntimeError::Conflict { id, state, .. } = &e {
            if matches!(*state, "stopped" | "failed") {
                return E2bError::not_found(format!("sandbox {id} not found ({state})"));
            }
        }
        let class = e.class();
        let status = match class {
            ErrorClass::Capacity => StatusCode::TOO_MANY_REQUESTS,
            c => super::error::status_of(c),
        };
        let mut err = E2bError::new(status, e.to_string());
        // Capacity (this host's caps) and unavailable (a fleet with no node to take it):
        // both "ask again later", the class E2B names `sandbox_capacity_unavailable`.
        if matches!(class, ErrorClass::Capacity | ErrorClass::Unavailable) {
            err.error_code = Some("sandbox_capacity_unavailable");
        }
        err
    }
}

/// A JSON request body for the E2B surfaces: an empty body is `{}`; malformed JSON and wrong
/// types are 400 in E2B's error shape. Unknown fields are ignored (the SDKs send fields
/// ember does not use).
#[derive(Debug, Clone)]
pub struct E2bJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for E2bJson<T> {
    type Rejection = E2bError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        ApiJson::<T>::from_request(req, state)
            .await
            .map(|j| E2bJson(j.0))
            .map_err(E2bError::from)
    }
}

/// `Path` with E2B's error shape when it cannot be read.
#[derive(Debug)]
pub struct E2bPath<T>(pub T);

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for E2bPath<T> {
    type Rejection = E2bError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|p| E2bPath(p.0))
            .map_err(|r| E2bError::new(r.status(), r.body_text()))
    }
}

/// `Query` with E2B's error shape when it cannot be read.
#[derive(Debug)]
pub struct E2bQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for E2bQuery<T> {
    type Rejection = E2bError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|q| E2bQuery(q.0))
            .map_err(|r| E2bError::new(r.status(), r.body_text()))
    }
}

/// The fallbacks of an E2B router (`what`: whose routes): an unknown path is `404`, a known
/// path with another method `405`, both in E2B's error shape.
pub fn with_fallbacks(router: Router<E2bState>, what: &'static str) -> Router<E2bState> {
    router
        .fallback(move |req: Request| async move {
            E2bError::not_found(format!(
                "no route {} {} in {what}",
                req.method(),
                req.uri().path()
            ))
        })
        .method_not_allowed_fallback(move |req: Request| async move {
            E2bError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                format!(
                    "{} is not allowed on {} in {what}",
                    req.method(),
                    req.uri().path()
                ),
            )
        })
}

/// The E2B surface as the server's router holds it: its state and its three routers, built
/// once with the server's.
#[derive(Clone)]
pub struct Surface {
    /// The surface's state.
    pub st: E2bState,
    /// The control plane (`/sandboxes`, `/v2/sandboxes`, `/snapshots`, `/templates`).
    pub control: Router,
    /// envd's HTTP routes (`/files`, `/envs`, `/health`; its Connect services are `rpc`).
    pub envd: Router,
    /// The code interpreter (`/execute`, `/contexts`).
    pub interp: Router,
}

impl Surface {
    /// The surface over the server's state.
    pub fn new(app: AppState) -> Self {
        let st = E2bState::new(app);
        Surface {
            control: control::routes().with_state(st.clone()),
            envd: envd::routes().with_state(st.clone()),
            interp: interp::routes().with_state(st.clone()),
            st,
        }
    }
}

impl std::fmt::Debug for Surface {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Surface").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use axum::body::Body;
    use axum::http::Request as HttpRequest;
    use axum::Router;
    use serde_json::{json, Value};
    use tower::ServiceExt;

    use super::*;
    use crate::tests::{Fake, KNOWN, TOKEN};

    const GONE: &str = "bbbbbbbbbbbbbbbb";

    fn app_with(fake: Arc<Fake>, domain: Option<&str>) -> Router {
        let opts = E2bOptions {
            domain: domain.map(str::to_string),
            ..E2bOptions::default()
        };
        crate::router(AppState::with_e2b(fake, TOKEN.into(), opts))
    }

    fn app() -> Router {
        app_with(Arc::new(Fake::default()), None)
    }

    fn envd_token(id: &str) -> String {
        derive_token(TOKEN, "envd-access", id)
    }

    fn control(method: &str, uri: &str, body: &str) -> HttpRequest<Body> {
        HttpRequest::builder()
            .method(method)
            .uri(uri)
            .header("x-api-key", TOKEN)
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .unwrap()
    }

    fn sandbox_req(
        id: &str,
        port: u16,
        method: &str,
        uri: &str,
        token: bool,
    ) -> axum::http::request::Builder {
        let mut b = HttpRequest::builder()
            .method(method)
            .uri(uri)
            .header("e2b-sandbox-id", id)
            .header("e2b-sandbox-port", port.to_string());
        if token {
            b = b.header("x-access-token", envd_token(id));
        }
        b
    }

    use crate::tests::send;

    async fn send_json(app: &Router, r: HttpRequest<Body>) -> (StatusCode, Value) {
        let (s, _, b) = send(app, r).await;
        (s, serde_json::from_slice(&b).unwrap_or(Value::Null))
    }

    /// `{"code": status, "message": str}` and nothing else.
    fn assert_e2b_error(status: StatusCode, v: &Value, want: StatusCode) {
        assert_eq!(status, want, "{v}");
        assert_eq!(v["code"], json!(want.as_u16()), "{v}");
        assert!(v["message"].is_string(), "{v}");
        let extra = v.as_object().unwrap().len() - 2;
        assert!(
            extra == 0 || (extra == 1 && v["error_code"].is_string()),
            "{v}"
        );
    }

    #[test]
    fn hmac_matches_rfc_4231() {
        // Test case 2 of RFC 4231.
        let mac = hmac_sha256(b"Jefe", b"what do ya want for nothing?");
        let hex: String = mac.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        // Keys longer than a block are hashed first (test case 6).
        let mac = hmac_sha256(
            &[0xaa; 131],
            b"Test Using Larger Than Block-Size Key - Hash Key First",
        );
        assert_eq!(mac[..4], [0x60, 0xe4, 0x31, 0x59]);
        let t = derive_token(TOKEN, "envd-access", KNOWN);
        assert_eq!(t.len(), 32);
        assert_ne!(t, derive_token(TOKEN, "envd-access", GONE));
        assert_ne!(t, derive_token(TOKEN, "traffic-access", KNOWN));
    }

    #[tokio::test]
    async fn the_control_plane_wants_the_api_key() {
        let app = app();
        let r = HttpRequest::builder()
            .method("POST")
            .uri("/v2/sandboxes")
            .body(Body::from("{}"))
            .unwrap();
        let (s, v) = send_json(&app, r).await;
        assert_e2b_error(s, &v, StatusCode::UNAUTHORIZED);
        let r = HttpRequest::builder()
            .uri("/sandboxes")
            .header("x-api-key", "nope")
            .body(Body::empty())
            .unwrap();
        let (s, v) = send_json(&app, r).await;
        assert_e2b_error(s, &v, StatusCode::UNAUTHORIZED);
    }

    #[tokio::test]
    async fn create_is_201_with_the_sandbox_shape_on_both_paths() {
        let app = app();
        for path in ["/v2/sandboxes", "/sandboxes"] {
            let body = r#"{"templateID":"code-interpreter-v1","timeout":60,"metadata":{"k":"v"},
                "envVars":{"A":"1"},"allow_internet_access":true,"secure":true}"#;
            let (s, v) = send_json(&app, control("POST", path, body)).await;
            assert_eq!(s, StatusCode::CREATED, "{v}");
            assert_eq!(v["sandboxID"], KNOWN);
            assert_eq!(v["clientID"], "ember");
            assert_eq!(v["envdVersion"], ENVD_VERSION);
            assert_eq!(v["alias"], "code-interpreter-v1");
            assert_eq!(v["templateID"], "default");
            assert_eq!(v["envdAccessToken"], envd_token(KNOWN));
            assert_eq!(v["domain"], Value::Null);
        }
        let (s, v) = send_json(&app, control("POST", "/v2/sandboxes", "[1")).await;
        assert_e2b_error(s, &v, StatusCode::BAD_REQUEST);
    }

    #[tokio::test]
    async fn lifecycle_statuses() {
        let app = app();
        let (s, _, b) = send(&app, control("DELETE", &format!("/sandboxes/{KNOWN}"), "")).await;
        assert_eq!(s, StatusCode::NO_CONTENT);
        assert!(b.is_empty());
        let (s, v) = send_json(&app, control("DELETE", &format!("/sandboxes/{GONE}"), "")).await;
        assert_e2b_error(s, &v, StatusCode::NOT_FOUND);
        let uri = format!("/sandboxes/{KNOWN}/timeout");
        let (s, _, _) = send(&app, control("POST", &uri, r#"{"timeout":30}"#)).await;
        assert_eq!(s, StatusCode::NO_CONTENT);
        let (s, v) = send_json(&app, control("POST", &uri, r#"{}"#)).await;
        assert_e2b_error(s, &v, StatusCode::BAD_REQUEST);
        let (s, v) = send_json(&app, control("GET", &format!("/sandboxes/{KNOWN}"), "")).await;
        assert_eq!(s, StatusCode::OK);
        for k in [
            "templateID",
            "sandboxID",
            "clientID",
            "startedAt",
            "endAt",
            "envdVersion",
            "cpuCount",
            "memoryMB",
            "diskSizeMB",
            "state",
            "envdAccessToken",
            "lifecycle",
        ] {
            assert!(v.get(k).is_some(), "{k} missing in {v}");
        }
        assert_eq!(v["state"], "running");
        let (s, v) = send_json(&app, control("GET", &format!("/sandboxes/{GONE}"), "")).await;
        assert_e2b_error(s, &v, StatusCode::NOT_FOUND);
        // Connect to a running sandbox: 200.
        let uri = format!("/v2/sandboxes/{KNOWN}/connect");
        let (s, v) = send_json(&app, control("POST", &uri, "{}")).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["sandboxID"], KNOWN);
        let uri = format!("/v2/sandboxes/{GONE}/connect");
        let (s, v) = send_json(&app, control("POST", &uri, "{}")).await;
        assert_e2b_error(s, &v, StatusCode::NOT_FOUND);
        // The fake's pause finds the sandbox ended: E2B's "not found".
        let uri = format!("/sandboxes/{KNOWN}/pause");
        let (s, v) = send_json(&app, control("POST", &uri, "{}")).await;
        assert_e2b_error(s, &v, StatusCode::NOT_FOUND);
        // Resume of a running one: 409.
        let uri = format!("/sandboxes/{KNOWN}/resume");
        let (s, v) = send_json(&app, control("POST", &uri, "{}")).await;
        assert_e2b_error(s, &v, StatusCode::CONFLICT);
        // Fork: 201, one result per sandbox.
        let uri = format!("/sandboxes/{KNOWN}/fork");
        let (s, v) = send_json(&app, control("POST", &uri, r#"{"count":1}"#)).await;
        assert_eq!(s, StatusCode::CREATED);
        assert_eq!(v[0]["sandbox"]["sandboxID"], KNOWN);
        // A filesystem-only snapshot reaches the runtime as one (the fake refuses it by name).
        let uri = format!("/sandboxes/{KNOWN}/snapshots");
        let (s, v) = send_json(&app, control("POST", &uri, r#"{"memory":false}"#)).await;
        assert_e2b_error(s, &v, StatusCode::BAD_REQUEST);
        assert!(
            v["message"]
                .as_str()
                .unwrap()
                .contains("fake: a filesystem-only snapshot"),
            "{v}"
        );
        // The fake's snapshot is at capacity: 429.
        let (s, v) = send_json(&app, control("POST", &uri, r#"{}"#)).await;
        assert_e2b_error(s, &v, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(v["error_code"], "sandbox_capacity_unavailable", "{v}");
        let (s, v) = send_json(&app, control("GET", "/snapshots", "")).await;
        assert_eq!((s, v), (StatusCode::OK, json!([])));
        let (s, v) = send_json(&app, control("DELETE", "/templates/nope", "")).await;
        assert_e2b_error(s, &v, StatusCode::NOT_FOUND);
        // Unknown routes and methods keep the shape.
        let (s, v) = send_json(&app, control("PUT", "/sandboxes", "")).await;
        assert_e2b_error(s, &v, StatusCode::METHOD_NOT_ALLOWED);
        let (s, v) = send_json(&app, control("GET", "/sandboxes/x/y/z", "")).await;
        assert_e2b_error(s, &v, StatusCode::NOT_FOUND);
    }

    #[tokio::test]
    async fn lists_filter_and_page() {
        let app = app();
        let (s, h, b) = send(
            &app,
            control("GET", "/v2/sandboxes?state=running,paused&limit=5", ""),
        )
        .await;
        assert_eq!(s, StatusCode::OK);
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v[0]["sandboxID"], KNOWN);
        assert_eq!(v[0]["state"], "running");
        assert!(h.get("x-next-token").is_none());
        let (s, v) = send_json(&app, control("GET", "/v2/sandboxes?state=paused", "")).await;
        assert_eq!((s, v), (StatusCode::OK, json!([])));
        let (s, v) = send_json(&app, control("GET", "/v2/sandboxes?state=bogus", "")).await;
        assert_e2b_error(s, &v, StatusCode::BAD_REQUEST);
        let (s, v) = send_json(&app, control("GET", "/sandboxes?limit=0", "")).await;
        assert_e2b_error(s, &v, StatusCode::BAD_REQUEST);

        // Pages over sorted keys, with a token while more remain.
        let items: Vec<u32> = (0..5).rev().collect();
        let key = |i: &u32| format!("{i:03}");
        let (p1, t1) = control::page(items.clone(), key, None, 2, true).unwrap();
        assert_eq!(p1, vec![4, 3]);
        let (p2, t2) = control::page(items.clone(), key, t1.as_deref(), 2, true).unwrap();
        assert_eq!(p2, vec![2, 1]);
        let (p3, t3) = control::page(items.clone(), key, t2.as_deref(), 2, true).unwrap();
        assert_eq!((p3, t3), (vec![0], None));
        assert!(control::page(items, key, Some("!!"), 2, true).is_err());
    }

    #[tokio::test]
    async fn the_list_header_carries_the_next_token() {
        let resp = control::page(
            (0..3).collect::<Vec<u32>>(),
            |i| i.to_string(),
            None,
            1,
            false,
        )
        .unwrap();
        assert_eq!(resp.0, vec![0]);
        assert!(resp.1.is_some());
    }

    #[test]
    fn metadata_queries_are_decoded_twice() {
        // What the Python SDK sends for {"a b": "c&d", "k": "v"} once the query layer
        // decoded it.
        let m = control::parse_metadata("a%2520b=c%2526d&k=v");
        assert_eq!(m.get("a b").map(String::as_str), Some("c&d"));
        assert_eq!(m.get("k").map(String::as_str), Some("v"));
    }

    #[tokio::test]
    async fn unknown_sandboxes_are_502_not_found_and_tokens_are_checked() {
        let app = app();
        let r = sandbox_req(GONE, ENVD_PORT, "GET", "/health", false)
            .body(Body::empty())
            .unwrap();
        let (s, h, b) = send(&app, r).await;
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_e2b_error(s, &v, StatusCode::BAD_GATEWAY);
        assert!(v["message"].as_str().unwrap().contains("was not found"));
        assert_eq!(h.get("should-retry").unwrap(), "false");
        // Health needs no token.
        let r = sandbox_req(KNOWN, ENVD_PORT, "GET", "/health", false)
            .body(Body::empty())
            .unwrap();
        assert_eq!(send(&app, r).await.0, StatusCode::NO_CONTENT);
        // Everything else does.
        let r = sandbox_req(KNOWN, ENVD_PORT, "GET", "/envs", false)
            .body(Body::empty())
            .unwrap();
        let (s, v) = send_json(&app, r).await;
        assert_e2b_error(s, &v, StatusCode::UNAUTHORIZED);
        let r = sandbox_req(KNOWN, ENVD_PORT, "GET", "/envs", true)
            .body(Body::empty())
            .unwrap();
        assert_eq!(send_json(&app, r).await, (StatusCode::OK, json!({})));
        // Another sandbox's token is wrong.
        let r = sandbox_req(KNOWN, ENVD_PORT, "GET", "/envs", false)
            .header("x-access-token", envd_token(GONE))
            .body(Body::empty())
            .unwrap();
        assert_eq!(send(&app, r).await.0, StatusCode::UNAUTHORIZED);
        // Other ports are not open.
        let r = sandbox_req(KNOWN, 8080, "GET", "/", false)
            .body(Body::empty())
            .unwrap();
        let (s, v) = send_json(&app, r).await;
        assert_e2b_error(s, &v, StatusCode::BAD_GATEWAY);
        assert!(v["message"].as_str().unwrap().contains("port is not open"));
        // The interpreter's calls may carry the traffic token instead.
        let r = sandbox_req(KNOWN, INTERP_PORT, "GET", "/contexts", false)
            .header(
                "e2b-traffic-access-token",
                derive_token(TOKEN, "traffic-access", KNOWN),
            )
            .body(Body::empty())
            .unwrap();
        assert_eq!(send_json(&app, r).await, (StatusCode::OK, json!([])));
    }

    #[tokio::test]
    async fn hosts_route_when_a_domain_is_set() {
        let app = app_with(Arc::new(Fake::default()), Some("e2b.test:3443"));
        let r = HttpRequest::builder()
            .uri("/health")
            .header("host", format!("49983-{KNOWN}.e2b.test:3443"))
            .body(Body::empty())
            .unwrap();
        assert_eq!(send(&app, r).await.0, StatusCode::NO_CONTENT);
        let r = HttpRequest::builder()
            .uri("/health")
            .header("host", "api.e2b.test:3443")
            .header("x-api-key", TOKEN)
            .body(Body::empty())
            .unwrap();
        let (s, v) = send_json(&app, r).await;
        assert_e2b_error(s, &v, StatusCode::NOT_FOUND);
        let (s, v) = send_json(&app, control("POST", "/v2/sandboxes", "{}")).await;
        assert_eq!(s, StatusCode::CREATED);
        assert_eq!(v["domain"], "e2b.test:3443");
    }

    #[tokio::test]
    async fn the_native_api_is_unaffected() {
        let app = app();
        let r = HttpRequest::builder()
            .uri("/v1/sandboxes")
            .header("authorization", format!("Bearer {TOKEN}"))
            .body(Body::empty())
            .unwrap();
        let (s, v) = send_json(&app, r).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(v[0]["id"], KNOWN);
        let r = HttpRequest::builder()
            .uri("/v1/sandboxes")
            .header("x-api-key", TOKEN)
            .body(Body::empty())
            .unwrap();
        let (s, v) = send_json(&app, r).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
        assert_eq!(v["error"]["code"], "unauthorized");
        let r = HttpRequest::builder()
            .uri("/healthz")
            .body(Body::empty())
            .unwrap();
        assert_eq!(send(&app, r).await.0, StatusCode::OK);
    }

    fn ndjson_lines(b: &[u8]) -> Vec<Value> {
        let text = std::str::from_utf8(b).unwrap();
        assert!(text.ends_with('\n'), "{text:?}");
        text.split_terminator('\n')
            .map(|l| {
                assert!(!l.trim().is_empty(), "a blank line in {text:?}");
                serde_json::from_str(l).unwrap()
            })
            .collect()
    }

    #[tokio::test]
    async fn execute_streams_e2b_lines() {
        let app = app();
        let exec = |body: &str| {
            sandbox_req(KNOWN, INTERP_PORT, "POST", "/execute", true)
                .header("content-type", "application/json")
                .body(Body::from(body.to_string()))
                .unwrap()
        };
        let (s, h, b) = send(
            &app,
            exec(r#"{"code":"print(1)","context_id":null,"language":null,"env_vars":{"A":"1"}}"#),
        )
        .await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(h.get("content-type").unwrap(), "application/x-ndjson");
        let lines = ndjson_lines(&b);
        assert_eq!(lines[0]["type"], "stdout");
        assert_eq!(lines[0]["text"], "hi\n");
        assert_eq!(
            lines[1],
            json!({"type": "number_of_executions", "execution_count": 1})
        );
        assert_eq!(lines.last().unwrap(), &json!({"type": "end_of_execution"}));
        // A failure after the first line: an error line, then the end.
        let (s, _, b) = send(&app, exec(r#"{"code":"fail"}"#)).await;
        assert_eq!(s, StatusCode::OK);
        let lines = ndjson_lines(&b);
        let n = lines.len();
        assert_eq!(lines[n - 2]["type"], "error");
        assert_eq!(lines[n - 2]["name"], "UnexpectedEndOfExecution");
        assert_eq!(lines[n - 1]["type"], "end_of_execution");
        // Both a context and a language; an unsupported language; no token.
        let (s, _, _) = send(
            &app,
            exec(r#"{"code":"1","context_id":"c","language":"python"}"#),
        )
        .await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
        let (s, _, b) = send(&app, exec(r#"{"code":"1","language":"cobol"}"#)).await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
        assert!(String::from_utf8_lossy(&b).contains("not supported"));
        let r = sandbox_req(KNOWN, INTERP_PORT, "POST", "/execute", false)
            .body(Body::from("{}"))
            .unwrap();
        assert_eq!(send(&app, r).await.0, StatusCode::UNAUTHORIZED);
    }

    #[tokio::test]
    async fn execute_cancels_the_run_when_the_client_leaves() {
        let fake = Arc::new(Fake::default());
        let app = app_with(fake.clone(), None);
        let r = sandbox_req(KNOWN, INTERP_PORT, "POST", "/execute", true)
            .body(Body::from(r#"{"code":"silent"}"#))
            .unwrap();
        let resp = app.oneshot(r).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        drop(resp);
        let cancelled = || fake.run_cancelled.load(std::sync::atomic::Ordering::SeqCst);
        for _ in 0..400 {
            if cancelled() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert!(cancelled(), "the run was not cancelled");
        // The run, not its context: an interrupt of the context could reach the next cell.
        assert!(!fake.interrupted.load(std::sync::atomic::Ordering::SeqCst));
    }

    #[tokio::test]
    async fn unknown_routes_and_methods_answer_in_e2bs_shape_on_every_surface() {
        let app = app();
        let (s, v) = send_json(&app, control("PUT", "/v2/sandboxes", "{}")).await;
        assert_e2b_error(s, &v, StatusCode::METHOD_NOT_ALLOWED);
        let (s, v) = send_json(&app, control("GET", "/sandboxes/x/nothing", "")).await;
        assert_e2b_error(s, &v, StatusCode::NOT_FOUND);
        for (port, path) in [(ENVD_PORT, "/files"), (INTERP_PORT, "/execute")] {
            let r = sandbox_req(KNOWN, port, "PATCH", path, true)
                .body(Body::empty())
                .unwrap();
            let (s, v) = send_json(&app, r).await;
            assert_e2b_error(s, &v, StatusCode::METHOD_NOT_ALLOWED);
            let r = sandbox_req(KNOWN, port, "GET", "/no/such/route", true)
                .body(Body::empty())
                .unwrap();
            let (s, v) = send_json(&app, r).await;
            assert_e2b_error(s, &v, StatusCode::NOT_FOUND);
        }
    }

    #[tokio::test]
    async fn files_download_and_upload() {
        let fake = Arc::new(Fake::default());
        let app = app_with(fake.clone(), None);
        let r = sandbox_req(KNOWN, ENVD_PORT, "GET", "/files?path=/data", true)
            .body(Body::empty())
            .unwrap();
        let (s, _, b) = send(&app, r).await;
        assert_eq!((s, b.len()), (StatusCode::OK, 300_000));
        let r = sandbox_req(KNOWN, ENVD_PORT, "GET", "/files?path=nope.txt", true)
            .body(Body::empty())
            .unwrap();
        let (s, v) = send_json(&app, r).await;
        assert_e2b_error(s, &v, StatusCode::NOT_FOUND);
        assert!(v["message"]
            .as_str()
            .unwrap()
            .contains("/home/user/nope.txt"));
        let r = sandbox_req(KNOWN, ENVD_PORT, "GET", "/files?path=x&username=eve", true)
            .body(Body::empty())
            .unwrap();
        assert_eq!(send(&app, r).await.0, StatusCode::UNAUTHORIZED);

        // octet-stream, plain and gzipped.
        let r = sandbox_req(KNOWN, ENVD_PORT, "POST", "/files?path=a/b.txt", true)
            .header("content-type", "application/octet-stream")
            .body(Body::from("hello"))
            .unwrap();
        let (s, v) = send_json(&app, r).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(
            v,
            json!([{"path": "/home/user/a/b.txt", "name": "b.txt", "type": "file"}])
        );
        assert_eq!(&*fake.written.lock().unwrap(), b"hello");
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(b"zipped").unwrap();
        let r = sandbox_req(KNOWN, ENVD_PORT, "POST", "/files?path=/tmp/z", true)
            .header("content-type", "application/octet-stream")
            .header("content-encoding", "gzip")
            .body(Body::from(gz.finish().unwrap()))
            .unwrap();
        let (s, v) = send_json(&app, r).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(&*fake.written.lock().unwrap(), b"zipped");
        let r = sandbox_req(KNOWN, ENVD_PORT, "POST", "/files?path=/tmp/z", true)
            .header("content-type", "application/octet-stream")
            .header("content-encoding", "gzip")
            .body(Body::from("not gzip"))
            .unwrap();
        let (s, v) = send_json(&app, r).await;
        assert_e2b_error(s, &v, StatusCode::BAD_REQUEST);
        // Over the fake's limit of 1000 bytes.
        let r = sandbox_req(KNOWN, ENVD_PORT, "POST", "/files?path=/tmp/big", true)
            .header("content-type", "application/octet-stream")
            .body(Body::from(vec![b'x'; 5000]))
            .unwrap();
        let (s, v) = send_json(&app, r).await;
        assert_e2b_error(s, &v, StatusCode::PAYLOAD_TOO_LARGE);

        // multipart, the path in the part's filename.
        let body = "--XyZ\r\nContent-Disposition: form-data; name=\"file\"; \
                    filename=\"/home/user/m.txt\"\r\nContent-Type: application/octet-stream\r\n\r\n\
                    multi\r\n--XyZ--\r\n";
        let r = sandbox_req(KNOWN, ENVD_PORT, "POST", "/files", true)
            .header("content-type", "multipart/form-data; boundary=XyZ")
            .body(Body::from(body))
            .unwrap();
        let (s, v) = send_json(&app, r).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v[0]["path"], "/home/user/m.txt");
        assert_eq!(&*fake.written.lock().unwrap(), b"multi");
    }
}

/// What the E2B adapter may reach: the runtime's call surface, never the store, the agent
/// protocol or a raw sandbox handle (the server crate does not even depend on the agent
/// crate: the call surface names the guest's vocabulary itself).
#[cfg(test)]
mod boundaries {
    const FILES: &[(&str, &str)] = &[
        ("connect.rs", include_str!("connect.rs")),
        ("control.rs", include_str!("control.rs")),
        ("envd.rs", include_str!("envd.rs")),
        ("filesystem.rs", include_str!("filesystem.rs")),
        ("interp.rs", include_str!("interp.rs")),
        ("mod.rs", include_str!("mod.rs")),
        ("process.rs", include_str!("process.rs")),
        ("route.rs", include_str!("route.rs")),
        ("rpc.rs", include_str!("rpc.rs")),
        ("secrets.rs", include_str!("secrets.rs")),
        ("templates.rs", include_str!("templates.rs")),
        ("volumes.rs", include_str!("volumes.rs")),
        ("target.rs", include_str!("target.rs")),
        ("tls.rs", include_str!("tls.rs")),
    ];

    fn code(text: &str) -> String {
        // This module names what it looks for; leave it out.
        let text = text.split("mod boundaries {").next().unwrap_or(text);
        text.lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn the_e2b_adapter_never_touches_the_store() {
        for (name, text) in FILES {
            let code = code(text);
            for bad in ["ember_runtime::store", "rusqlite", "crate::store"] {
                assert!(!code.contains(bad), "e2b/{name} uses {bad}");
            }
        }
    }

    #[test]
    fn the_server_does_not_depend_on_the_agent_protocol() {
        let manifest = include_str!("../../Cargo.toml");
        assert!(
            !manifest.contains("ember-agent"),
            "server/Cargo.toml: the server speaks the runtime's call surface, not the agent's"
        );
    }

    #[test]
    fn no_e2b_file_speaks_the_agent_protocol_or_holds_a_sandbox() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/e2b");
        let on_disk = std::fs::read_dir(&dir)
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "rs"))
            })
            .count();
        assert_eq!(
            on_disk,
            FILES.len(),
            "list every file of {} here",
            dir.display()
        );
        for (name, text) in FILES {
            let code = code(text);
            let raw = [
                "ember_agent",
                "ember_runtime::Sandbox",
                "SandboxError",
                "with_sandbox",
                "with_client",
            ]
            .iter()
            .find(|bad| code.contains(**bad));
            assert!(
                raw.is_none(),
                "e2b/{name} uses {}: send a call (ember_runtime::call) instead",
                raw.unwrap_or(&"")
            );
        }
    }
}
